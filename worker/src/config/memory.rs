//! The memory a job needs on one node, counted from the buffers the worker allocates, and the
//! check of that estimate against what the machine has (`MemAvailable`, /dev/shm).

use gradbus_collectives::layout::ALIGN_FLOATS;

use super::Config;
use crate::error::WorkerError;
use crate::model::GptConfig;

/// Elements of the model's flat parameter buffer (every slot padded to `ALIGN_FLOATS`, as
/// `Layout::new` lays them out), as f64 so that an absurd shape cannot overflow.
pub(super) fn param_floats(m: &GptConfig) -> f64 {
    let a = |n: f64| (n / ALIGN_FLOATS as f64).ceil() * ALIGN_FLOATS as f64;
    let (v, t, c) = (m.vocab as f64, m.max_seq as f64, m.channels as f64);
    let block = 6.0 * a(c) + a(3.0 * c * c) + a(3.0 * c) + a(c * c) + 2.0 * a(4.0 * c * c) + a(4.0 * c);
    2.0 * a(v * c) + a(t * c) + m.layers as f64 * block + 2.0 * a(c)
}

/// A job's memory on one node, in bytes (f64: an absurd model gives a large number, not an
/// overflow). Counted from the buffers the worker allocates (`train::Trainer::new`,
/// `model::Activations::new`, the shm segment's gradient slots); small tables are left out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryEstimate {
    /// Ranks on the node.
    pub local_ranks: usize,
    /// Parameter elements P.
    pub params: f64,
    /// One rank's weights x3 (trainer, rollout engine, frozen reference) and Adam moments x2.
    pub state: f64,
    /// One rank's activations, dlogits and loss caches.
    pub activations: f64,
    /// One rank's gradients when they are not in /dev/shm (a world of one).
    pub private_grads: f64,
    /// The node's /dev/shm segment: every local rank's gradients.
    pub segment: f64,
    /// Rank 0's buffer while it encodes a checkpoint (weights and moments), when checkpointing.
    pub checkpoint: f64,
}

impl MemoryEstimate {
    /// Bytes the node needs in all.
    pub fn total(&self) -> f64 {
        self.local_ranks as f64 * (self.state + self.activations + self.private_grads) + self.segment + self.checkpoint
    }

    fn describe(&self) -> String {
        let mut s = format!(
            "{} rank(s) x (weights x3 and Adam moments x2 {}, activations {}",
            self.local_ranks,
            bytes(self.state),
            bytes(self.activations)
        );
        if self.private_grads > 0.0 {
            s += &format!(", gradients {}", bytes(self.private_grads));
        }
        s += ")";
        if self.segment > 0.0 {
            s += &format!(" + gradients in /dev/shm {}", bytes(self.segment));
        }
        if self.checkpoint > 0.0 {
            s += &format!(" + checkpoint buffer {}", bytes(self.checkpoint));
        }
        s + &format!(", for {} parameters", count(self.params))
    }
}

/// What this machine has, where it can be read (None elsewhere: that check is then skipped).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Machine {
    /// Bytes of `MemAvailable` in /proc/meminfo.
    pub mem_available: Option<f64>,
    /// Free bytes of /dev/shm.
    pub shm_free: Option<f64>,
}

impl Machine {
    /// Read /proc/meminfo and statvfs(/dev/shm).
    pub fn probe() -> Machine {
        let mem_available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| {
            let line = t.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib * 1024.0)
        });
        // SAFETY: statvfs writes only into `st`, a plain C struct that may start zeroed; the path
        // is a NUL-terminated literal.
        let shm_free = unsafe {
            let mut st: libc::statvfs = std::mem::zeroed();
            (libc::statvfs(c"/dev/shm".as_ptr(), &mut st) == 0).then(|| st.f_bavail as f64 * st.f_frsize as f64)
        };
        Machine { mem_available, shm_free }
    }
}

/// Bytes in binary units, e.g. `894.1 GiB`; beyond EiB in scientific notation.
pub fn bytes(x: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = x;
    for u in units {
        if v < 1024.0 {
            return if u == "B" { format!("{v:.0} B") } else { format!("{v:.1} {u}") };
        }
        v /= 1024.0;
    }
    format!("{x:.1e} B")
}

/// A count, exact below a million, else like `2.4e11`.
fn count(x: f64) -> String {
    if x < 1e6 {
        format!("{x:.0}")
    } else {
        format!("{x:.1e}")
    }
}

impl Config {
    /// What a job of this config needs on one node that runs `local_ranks` of its ranks;
    /// `shared`: the gradients live in the node's /dev/shm segment (a world of more than one).
    pub fn memory(&self, local_ranks: usize, shared: bool) -> MemoryEstimate {
        let (m, rl) = (&self.model, &self.rl);
        let params = param_floats(m);
        let (b, t) = (rl.prompts_per_rank.saturating_mul(rl.group_size), rl.response_len.saturating_add(1));
        let bt = b as f64 * t as f64;
        // Activations, the loss's dlogits (B, T, V) and per-position caches.
        let activations = 4.0 * (crate::model::activations_numel(m, b, t) + bt * m.vocab as f64 + 16.0 * bt);
        // Weights (trainer, rollout engine, frozen reference) and Adam's two moments.
        let state = 4.0 * 5.0 * params;
        let grads = 4.0 * params;
        MemoryEstimate {
            local_ranks,
            params,
            state,
            activations,
            private_grads: if shared { 0.0 } else { grads },
            segment: if shared { local_ranks as f64 * (grads / 4096.0).ceil() * 4096.0 } else { 0.0 },
            checkpoint: if self.checkpoint.every > 0 { state } else { 0.0 },
        }
    }

    /// The model and batch keys the memory estimate depends on, with their values.
    fn shape_keys(&self) -> String {
        let (m, rl) = (&self.model, &self.rl);
        format!(
            "model.vocab = {}, model.max_seq = {}, model.channels = {}, model.heads = {}, model.layers = {}, \
             rl.prompts_per_rank = {}, rl.group_size = {}, rl.response_len = {}",
            m.vocab, m.max_seq, m.channels, m.heads, m.layers, rl.prompts_per_rank, rl.group_size, rl.response_len
        )
    }

    /// Refuse the config when [`Config::memory`] exceeds what `machine` has: memory available
    /// (`MemAvailable`) for the whole node, /dev/shm free space for the gradient segment.
    pub fn check_memory(&self, local_ranks: usize, shared: bool, machine: &Machine) -> Result<(), WorkerError> {
        let e = self.memory(local_ranks, shared);
        let hint = "make the model or the batch smaller (model.channels, model.layers, model.vocab, \
                    rl.prompts_per_rank, rl.group_size), or run fewer ranks on this node";
        if let Some(have) = machine.mem_available.filter(|&have| e.total() > have) {
            return Err(WorkerError::Memory {
                estimate: format!(
                    "the job needs about {} of memory on this node and the machine has {} available \
                     (MemAvailable): {}; {}",
                    bytes(e.total()),
                    bytes(have),
                    e.describe(),
                    self.shape_keys()
                ),
                hint: hint.into(),
            });
        }
        if let Some(free) = machine.shm_free.filter(|&free| e.segment > free) {
            return Err(WorkerError::Memory {
                estimate: format!(
                    "the gradients of {} local rank(s) need about {} in /dev/shm and it has {} free \
                     ({} parameters; {})",
                    local_ranks,
                    bytes(e.segment),
                    bytes(free),
                    count(e.params),
                    self.shape_keys()
                ),
                hint: format!("{hint}; or enlarge /dev/shm (`mount -o remount,size=8G /dev/shm`, docker --shm-size)"),
            });
        }
        Ok(())
    }
}
