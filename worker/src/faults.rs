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
    /// For nan/inf/scale: the parameter (default: the last one, in bucket #0).
    #[serde(default)]
    pub param: Option<String>,
    /// For nan/inf: element index in the parameter.
    #[serde(default)]
    pub element: usize,
    /// For nan/inf: only on the first execution of the update, as a silent hardware error would be.
    #[serde(default)]
    pub transient: bool,
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
    pub fn new(config: &[Fault], rank: usize) -> Result<FaultPlan, WorkerError> {
        FaultPlan::with_env(config, rank, std::env::var(crate::env::FAULTS).ok().as_deref())
    }

    /// As [`FaultPlan::new`], with `env` the value of `GRADBUS_FAULTS` (unset or blank: none).
    fn with_env(config: &[Fault], rank: usize, env: Option<&str>) -> Result<FaultPlan, WorkerError> {
        let mut faults: Vec<Fault> = config.to_vec();
        if let Some(text) = env.filter(|t| !t.trim().is_empty()) {
            let p: EnvPlan = toml::from_str(text).map_err(|source| WorkerError::FaultsEnv { source })?;
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
                FaultKind::Nan | FaultKind::Inf | FaultKind::Scale => {}
            }
        }
    }

    /// Plant the nan/inf/scale faults of this update into parameter `param`'s final gradient `grad`.
    pub fn poison<B: Backend>(&self, be: &B, at: StepId, layout: &Layout, param: usize, mut grad: B::ViewMut<'_>) {
        for f in self.matching(at).filter(|f| matches!(f.kind, FaultKind::Nan | FaultKind::Inf | FaultKind::Scale)) {
            if f.transient && at.attempt > 0 {
                continue;
            }
            let slot = match &f.param {
                Some(name) => layout.slot(name),
                None => layout.slots.last(),
            };
            if slot.map(|s| s.param) != Some(param) {
                continue;
            }
            // Through the host (a test's fault, not a hot path): the same values on any backend.
            let mut g = be.to_host(B::reborrow(&grad)).into_owned();
            if f.kind == FaultKind::Scale {
                let max = f32::MAX as f64;
                for x in g.iter_mut() {
                    *x = (*x as f64 * f.factor).clamp(-max, max) as f32;
                }
            } else if !g.is_empty() {
                let i = f.element.min(g.len() - 1);
                g[i] = if f.kind == FaultKind::Nan { f32::NAN } else { f32::INFINITY };
            }
            be.write(B::reborrow_mut(&mut grad), &g);
        }
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

    #[test]
    fn gradbus_faults_adds_to_the_config_and_keeps_this_ranks() {
        let config = [Fault { kind: FaultKind::Kill, rank: 1, ..exit_on(0) }, exit_on(2)];
        let env = "[[faults]]\nkind = \"nan\"\nrank = 1\nstep = 4\n";
        let plan = FaultPlan::with_env(&config, 1, Some(env)).unwrap();
        assert_eq!(
            plan.faults.iter().map(|f| (f.kind, f.step)).collect::<Vec<_>>(),
            [(FaultKind::Kill, 3), (FaultKind::Nan, 4)]
        );
        assert!(FaultPlan::with_env(&config, 0, Some(" \n")).unwrap().is_empty(), "blank: no faults");
    }

    #[test]
    fn a_bad_gradbus_faults_is_a_config_error_naming_the_variable() {
        for bad in [
            "faults = 3",
            "[[faults]]\nkind = \"melt\"\nrank = 0\nstep = 1\n",
            "[[faults]]\nrank = 0\nstep = 1\nkind = \"nan\"\ncolour = 1\n",
        ] {
            let e = FaultPlan::with_env(&[], 0, Some(bad)).unwrap_err();
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
        }
    }
}
