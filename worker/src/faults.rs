//! Planned faults, for the tests that prove every fault ends in a correct continuation or a clean,
//! explained abort. A plan comes from the config's `[[faults]]` or from `GRADBUS_FAULTS` (the same
//! TOML), and the step loop asks it at fixed points.
//!
//! Invariant: a plan with no entries costs one empty-vector check per hook; nothing is random.

use serde::Deserialize;

use gradbus_collectives::{Layout, StepId};
use gradbus_kernels::backend::Backend;

use crate::error::WorkerError;

/// What goes wrong.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FaultKind {
    /// Write NaN into this rank's local gradient.
    Nan,
    /// Write +Inf into this rank's local gradient.
    Inf,
    /// Multiply this rank's gradient of `param` by `factor` (in f64, saturated to +-f32::MAX, so
    /// every value stays finite): gradients that are finite on every rank but whose sum, or whose
    /// norm in f32, overflows.
    Scale,
    /// SIGKILL this rank.
    Kill,
    /// Sleep `seconds` (longer than the collective deadline to provoke a timeout).
    Stall,
    /// Exit with `code`.
    Exit,
    /// Flip bit `bit` of element `element` of `param` in the copy `target` names: silent data
    /// corruption, finite or not, as a bad GPU, a transfer or a memory cell makes it.
    Bitflip,
}

/// Which copy a bit flip damages.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum FlipTarget {
    /// This rank's local gradient, before the reduce.
    Grad,
    /// This rank's copy of the reduced gradient, after the reduce, before the optimizer.
    Reduced,
    /// This rank's parameter, right after its optimizer step.
    Weight,
}

/// Where in the update a process fault fires.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FaultPhase {
    /// Before the forward pass.
    #[default]
    Forward,
    /// After forward, before backward.
    Backward,
    /// Inside the first bucket's reduce: every rank has entered it, no sum is written yet.
    Reduce,
    /// After the first bucket's reduce, before the next.
    BetweenBuckets,
    /// While writing a checkpoint (after the temp file, before the rename). Only rank 0 writes
    /// checkpoints, so only a fault on rank 0 fires here; `step` is the checkpoint's step (the
    /// steps completed, as in `checkpoints/step-N`) and `minibatch` must be 0.
    Checkpoint,
}

/// One planned fault.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// What goes wrong.
    pub kind: FaultKind,
    /// On which rank.
    pub rank: usize,
    /// At which RL step.
    pub step: u64,
    /// At which update of the step (epoch * minibatches + minibatch).
    #[serde(default)]
    pub minibatch: u32,
    /// For kill/stall/exit: where.
    #[serde(default)]
    pub phase: FaultPhase,
    /// For nan/inf/scale/bitflip: the parameter (default: the last one, in bucket #0).
    #[serde(default)]
    pub param: Option<String>,
    /// For nan/inf/bitflip: element index in the parameter.
    #[serde(default)]
    pub element: usize,
    /// For nan/inf/scale/bitflip: only on the first execution of the update, as a silent hardware
    /// error would be; otherwise on every execution, as a data or software fault would be.
    #[serde(default)]
    pub transient: bool,
    /// For bitflip: the copy it damages.
    #[serde(default)]
    pub target: Option<FlipTarget>,
    /// For bitflip: the bit of the f32, 0 (the lowest mantissa bit) to 31 (the sign).
    #[serde(default)]
    pub bit: Option<u32>,
    /// For exit: the exit code.
    #[serde(default = "default_code")]
    pub code: i32,
    /// For stall: seconds.
    #[serde(default = "default_stall")]
    pub seconds: f64,
    /// For scale: the factor.
    #[serde(default = "default_factor")]
    pub factor: f64,
}

/// A bitflip fault's fields that can be wrong: the first as (field, value, why, example).
pub type FieldError = (&'static str, String, String, &'static str);

impl Fault {
    /// Whether this is a bitflip of `target`.
    fn flips(&self, target: FlipTarget) -> bool {
        self.kind == FaultKind::Bitflip && self.target == Some(target)
    }

    /// The slot of the parameter it names (default: the last one, in bucket #0).
    fn slot<'l>(&self, layout: &'l Layout) -> Option<&'l gradbus_collectives::Slot> {
        match &self.param {
            Some(name) => layout.slot(name),
            None => layout.slots.last(),
        }
    }

    /// Flip bit `bit` of element `element` of `x` (the parameter's values), saying so on stderr.
    fn flip(&self, x: &mut [f32], at: StepId, what: &str) {
        let (i, bit) = (self.element, self.bit.unwrap_or(0));
        let before = x[i];
        x[i] = f32::from_bits(before.to_bits() ^ (1 << bit));
        eprintln!(
            "fault plan: bit {bit} of {what} {}[{}] flipped at step {} update {} (attempt {}): {before:e} -> {:e}",
            self.param.as_deref().unwrap_or("(last)"),
            self.element,
            at.step,
            at.minibatch,
            at.attempt,
            x[i]
        );
    }

    /// The checks of a bitflip's own fields against the model: `target` and `bit` given (and only
    /// for a bitflip), `bit` in 0..=31, `element` inside the parameter. The config check and
    /// `GRADBUS_FAULTS` both use it, so that either names the key.
    pub fn check_flip(&self, model: &crate::model::GptConfig) -> Result<(), FieldError> {
        if self.kind != FaultKind::Bitflip {
            if self.target.is_some() {
                return Err((
                    "target",
                    format!("{:?}", self.target),
                    "only for kind = \"bitflip\"".into(),
                    "remove it",
                ));
            }
            if let Some(b) = self.bit {
                return Err(("bit", b.to_string(), "only for kind = \"bitflip\"".into(), "remove it"));
            }
            return Ok(());
        }
        if self.target.is_none() {
            let why = "must be given for a bitflip: \"grad\", \"reduced\" or \"weight\"";
            return Err(("target", "none".into(), why.into(), "\"grad\""));
        }
        match self.bit {
            None => return Err(("bit", "none".into(), "must be given for a bitflip: 0..=31".into(), "30")),
            Some(b) if b > 31 => {
                return Err(("bit", b.to_string(), "must be a bit of an f32: 0..=31 (31 is the sign)".into(), "30"))
            }
            Some(_) => {}
        }
        let name = self.param.as_deref().unwrap_or("head.weight");
        if let Some(n) = model.param_numel(name) {
            if self.element >= n {
                let why = format!("must be below {n}, the element count of {name}");
                return Err(("element", self.element.to_string(), why, "0"));
            }
        }
        Ok(())
    }
}

fn default_factor() -> f64 {
    1.0
}

fn default_code() -> i32 {
    1
}
fn default_stall() -> f64 {
    3600.0
}

/// The faults that concern this rank.
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    faults: Vec<Fault>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EnvPlan {
    faults: Vec<Fault>,
}

impl FaultPlan {
    /// The plan for `rank`: the config's faults plus those in `GRADBUS_FAULTS`.
    pub fn new(config: &[Fault], model: &crate::model::GptConfig, rank: usize) -> Result<FaultPlan, WorkerError> {
        FaultPlan::with_env(config, model, rank, std::env::var(crate::env::FAULTS).ok().as_deref())
    }

    /// As [`FaultPlan::new`], with `env` the value of `GRADBUS_FAULTS` (unset or blank: none). A
    /// bitflip of `GRADBUS_FAULTS` is checked against `model` as the config's faults are.
    fn with_env(
        config: &[Fault],
        model: &crate::model::GptConfig,
        rank: usize,
        env: Option<&str>,
    ) -> Result<FaultPlan, WorkerError> {
        let mut faults: Vec<Fault> = config.to_vec();
        if let Some(text) = env.filter(|t| !t.trim().is_empty()) {
            let p: EnvPlan = toml::from_str(text).map_err(|source| WorkerError::FaultsEnv { source })?;
            for (i, f) in p.faults.iter().enumerate() {
                if let Err((field, value, why, example)) = f.check_flip(model) {
                    return Err(WorkerError::ConfigRange {
                        key: format!("{} faults[{i}].{field}", crate::env::FAULTS),
                        value,
                        why,
                        hint: format!("e.g. {field} = {example} in that entry"),
                    });
                }
            }
            faults.extend(p.faults);
        }
        faults.retain(|f| f.rank == rank);
        Ok(FaultPlan { faults })
    }

    fn matching(&self, at: StepId) -> impl Iterator<Item = &Fault> {
        self.faults.iter().filter(move |f| f.step == at.step && f.minibatch == at.minibatch)
    }

    /// Fire the kill/stall/exit faults planned for this phase of this update.
    pub fn at_phase(&self, phase: FaultPhase, at: StepId) {
        for f in self.matching(at).filter(|f| f.phase == phase && at.attempt == 0) {
            match f.kind {
                FaultKind::Kill => {
                    eprintln!("fault plan: SIGKILL at step {} update {} ({:?})", at.step, at.minibatch, phase);
                    // SAFETY: kill(getpid(), SIGKILL) has no memory-safety preconditions.
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                FaultKind::Stall => {
                    eprintln!(
                        "fault plan: stall {}s at step {} update {} ({:?})",
                        f.seconds, at.step, at.minibatch, phase
                    );
                    std::thread::sleep(std::time::Duration::from_secs_f64(f.seconds));
                }
                FaultKind::Exit => {
                    eprintln!("fault plan: exit {} at step {} update {} ({:?})", f.code, at.step, at.minibatch, phase);
                    std::process::exit(f.code);
                }
                FaultKind::Nan | FaultKind::Inf | FaultKind::Scale | FaultKind::Bitflip => {}
            }
        }
    }

    /// The faults of this update that fire in this execution (a transient one only in the first).
    fn firing(&self, at: StepId) -> impl Iterator<Item = &Fault> {
        self.matching(at).filter(move |f| !(f.transient && at.attempt > 0))
    }

    /// Plant the nan/inf/scale faults and the `grad` bit flips of this update into parameter
    /// `param`'s final gradient `grad`.
    pub fn poison<B: Backend>(&self, be: &B, at: StepId, layout: &Layout, param: usize, mut grad: B::ViewMut<'_>) {
        let planted = |f: &&Fault| {
            matches!(f.kind, FaultKind::Nan | FaultKind::Inf | FaultKind::Scale) || f.flips(FlipTarget::Grad)
        };
        for f in self.firing(at).filter(planted) {
            if f.slot(layout).map(|s| s.param) != Some(param) {
                continue;
            }
            // Through the host (a test's fault, not a hot path): the same values on any backend.
            let mut g = be.to_host(B::reborrow(&grad)).into_owned();
            if f.kind == FaultKind::Scale {
                let max = f32::MAX as f64;
                for x in g.iter_mut() {
                    *x = (*x as f64 * f.factor).clamp(-max, max) as f32;
                }
            } else if f.kind == FaultKind::Bitflip {
                f.flip(&mut g, at, "grad");
            } else if !g.is_empty() {
                let i = f.element.min(g.len() - 1);
                g[i] = if f.kind == FaultKind::Nan { f32::NAN } else { f32::INFINITY };
            }
            be.write(B::reborrow_mut(&mut grad), &g);
        }
    }

    /// Flip the `target` bits of this update in `buf`, a whole flat buffer laid out by `layout`
    /// (this rank's reduced gradients after the reduce, or its weights after the optimizer step).
    pub fn flip_in<B: Backend>(
        &self,
        be: &B,
        at: StepId,
        layout: &Layout,
        target: FlipTarget,
        mut buf: B::ViewMut<'_>,
    ) {
        for f in self.firing(at).filter(|f| f.flips(target)) {
            let Some(slot) = f.slot(layout) else { continue };
            // Through the host, as `poison`: a test's fault, not a hot path.
            let mut whole = be.to_host(B::reborrow(&buf)).into_owned();
            f.flip(&mut whole[slot.offset..], at, if target == FlipTarget::Reduced { "reduced" } else { "weight" });
            be.write(B::reborrow_mut(&mut buf), &whole);
        }
    }

    /// Whether a bitflip of `target` is planned for this rank at all (the step loop skips the
    /// hook's host copy otherwise).
    pub fn has_flip(&self, target: FlipTarget) -> bool {
        self.faults.iter().any(|f| f.flips(target))
    }

    /// Whether a fault of this rank fires inside a reduce (the transport must call back into the plan).
    pub fn has_phase(&self, phase: FaultPhase) -> bool {
        self.faults.iter().any(|f| f.phase == phase)
    }

    /// Whether any fault is planned for this rank.
    pub fn is_empty(&self) -> bool {
        self.faults.is_empty()
    }

    /// The faults of this rank that fire during a checkpoint write of `step`.
    pub fn at_checkpoint(&self, step: u64) {
        self.at_phase(FaultPhase::Checkpoint, StepId { step, minibatch: 0, attempt: 0 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GptConfig;

    #[test]
    fn gradbus_faults_adds_to_the_config_and_keeps_this_ranks() {
        let config = [Fault { kind: FaultKind::Kill, rank: 1, ..exit_on(0) }, exit_on(2)];
        let env = "[[faults]]\nkind = \"nan\"\nrank = 1\nstep = 4\n";
        let plan = FaultPlan::with_env(&config, &GptConfig::default(), 1, Some(env)).unwrap();
        assert_eq!(
            plan.faults.iter().map(|f| (f.kind, f.step)).collect::<Vec<_>>(),
            [(FaultKind::Kill, 3), (FaultKind::Nan, 4)]
        );
        assert!(
            FaultPlan::with_env(&config, &GptConfig::default(), 0, Some(" \n")).unwrap().is_empty(),
            "blank: no faults"
        );
    }

    #[test]
    fn a_bad_gradbus_faults_is_a_config_error_naming_the_variable() {
        for bad in [
            "faults = 3",
            "[[faults]]\nkind = \"melt\"\nrank = 0\nstep = 1\n",
            "[[faults]]\nrank = 0\nstep = 1\nkind = \"nan\"\ncolour = 1\n",
        ] {
            let e = FaultPlan::with_env(&[], &GptConfig::default(), 0, Some(bad)).unwrap_err();
            assert!(matches!(e, WorkerError::FaultsEnv { .. }), "{bad}: {e:?}");
            assert!(e.to_string().starts_with("GRADBUS_FAULTS: "), "{bad}: {e}");
            assert_eq!(e.code(), crate::exit::Code::Usage);
        }
    }

    fn exit_on(rank: usize) -> Fault {
        Fault {
            kind: FaultKind::Exit,
            rank,
            step: 3,
            minibatch: 0,
            phase: FaultPhase::Forward,
            param: None,
            element: 0,
            transient: false,
            code: 1,
            seconds: 1.0,
            factor: 1.0,
            target: None,
            bit: None,
        }
    }

    #[test]
    fn a_bitflip_in_gradbus_faults_is_range_checked_naming_the_key() {
        let flip = |rest: &str| format!("[[faults]]\nkind = \"bitflip\"\nrank = 0\nstep = 1\n{rest}");
        let ok = flip("target = \"weight\"\nbit = 30\nparam = \"wte\"\nelement = 1023\n");
        assert!(FaultPlan::with_env(&[], &GptConfig::default(), 0, Some(&ok)).is_ok());
        for (rest, key) in [
            ("target = \"weight\"\nbit = 32\n", "faults[0].bit"),
            ("target = \"grad\"\n", "faults[0].bit"),
            ("bit = 3\n", "faults[0].target"),
            ("target = \"weight\"\nbit = 3\nparam = \"wte\"\nelement = 1024\n", "faults[0].element"),
        ] {
            let e = FaultPlan::with_env(&[], &GptConfig::default(), 0, Some(&flip(rest))).unwrap_err();
            assert!(e.to_string().contains(&format!("GRADBUS_FAULTS {key}")), "{rest}: {e}");
            assert_eq!(e.code(), crate::exit::Code::Usage);
        }
        let nan_with_bit = "[[faults]]\nkind = \"nan\"\nrank = 0\nstep = 1\nbit = 3\n";
        let e = FaultPlan::with_env(&[], &GptConfig::default(), 0, Some(nan_with_bit)).unwrap_err();
        assert!(e.to_string().contains("faults[0].bit"), "{e}");
        let bad_target = flip("target = \"moon\"\nbit = 3\n");
        let e = FaultPlan::with_env(&[], &GptConfig::default(), 0, Some(&bad_target)).unwrap_err();
        assert!(matches!(e, WorkerError::FaultsEnv { .. }), "{e}");
    }

    #[test]
    fn flips_land_where_and_when_the_plan_says() {
        use gradbus_collectives::ParamSpec;
        use gradbus_kernels::backend::Cpu;
        let layout = Layout::new(&[ParamSpec::new("a", 20), ParamSpec::new("b", 5)], 0);
        let env = "[[faults]]\nkind = \"bitflip\"\nrank = 0\nstep = 2\nminibatch = 1\ntarget = \"weight\"\n\
                   param = \"a\"\nelement = 3\nbit = 31\ntransient = true\n";
        let plan = FaultPlan::with_env(&[], &GptConfig::default(), 0, Some(env)).unwrap();
        assert!(plan.has_flip(FlipTarget::Weight) && !plan.has_flip(FlipTarget::Reduced));
        let at = StepId { step: 2, minibatch: 1, attempt: 0 };
        let mut w = vec![1.0f32; layout.len];
        plan.flip_in(&Cpu, StepId { minibatch: 0, ..at }, &layout, FlipTarget::Weight, &mut w);
        plan.flip_in(&Cpu, at, &layout, FlipTarget::Reduced, &mut w);
        assert!(w.iter().all(|&x| x == 1.0), "another update, another target: nothing");
        plan.flip_in(&Cpu, at, &layout, FlipTarget::Weight, &mut w);
        let a = layout.slot("a").unwrap().offset;
        assert_eq!(w[a + 3], -1.0, "the sign bit of a[3]");
        plan.flip_in(&Cpu, StepId { attempt: 1, ..at }, &layout, FlipTarget::Weight, &mut w);
        assert_eq!(w[a + 3], -1.0, "transient: not on the rerun");
    }
}
