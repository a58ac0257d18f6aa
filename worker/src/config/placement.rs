//! The checks of a config that need to know where the job runs: the world size (a planned fault's
//! rank must exist) and the device (`device = "cuda"` needs the feature, the driver and a GPU).

use super::{Config, Device};
use crate::error::WorkerError;

impl Config {
    /// The checks that need the world size: a planned fault's rank must exist.
    pub fn check_world(&self, world: usize) -> Result<(), WorkerError> {
        for (i, f) in self.faults.iter().enumerate() {
            if f.rank >= world {
                return Err(WorkerError::ConfigRange {
                    key: format!("faults[{i}].rank"),
                    value: f.rank.to_string(),
                    why: format!("must be below the world size {world} (the fault would never fire)"),
                    hint: "e.g. rank = 0".into(),
                });
            }
        }
        Ok(())
    }

    /// The check of `device` for a node of `local_ranks` ranks: `device = "cuda"` needs a build
    /// with the `cuda` feature and, on the machine that runs the ranks (`here`: this one), the CUDA
    /// driver (libcuda.so) and a GPU; a launcher whose ranks run elsewhere checks only the build.
    /// More local ranks than GPUs is allowed: the warning to print is returned.
    pub fn check_device(&self, local_ranks: usize, here: bool) -> Result<Option<String>, WorkerError> {
        if self.device == Device::Cpu {
            return Ok(None);
        }
        let probe = gradbus_kernels::cuda::probe();
        if !here && !matches!(probe, Err(gradbus_kernels::Error::NotCompiledWithCuda)) {
            return Ok(None);
        }
        cuda_check(probe, local_ranks)
    }
}

/// [`Config::check_device`] for `device = "cuda"` given the driver probe's answer (the number of
/// GPUs it sees).
pub(super) fn cuda_check(
    probe: Result<usize, gradbus_kernels::Error>,
    local_ranks: usize,
) -> Result<Option<String>, WorkerError> {
    use gradbus_kernels::Error as E;
    let err = |why: String, hint: &str| WorkerError::Device { why, hint: hint.into() };
    match probe {
        Err(E::NotCompiledWithCuda) => Err(err(
            "this gradbus was built without the cuda feature".into(),
            "build it with `cargo build --release --features cuda` (or `cargo install --path . --features cuda`), or set device = \"cpu\"",
        )),
        Err(E::NoCudaDriver(why)) => Err(err(
            format!("no CUDA driver: {why}"),
            "install the NVIDIA driver (it provides libcuda.so) and run on a machine with a GPU, or set device = \"cpu\"",
        )),
        Err(e) => Err(err(e.to_string(), "check `nvidia-smi`, or set device = \"cpu\"")),
        Ok(0) => Err(err(
            "the CUDA driver sees no GPU".into(),
            "check `nvidia-smi` and CUDA_VISIBLE_DEVICES, or set device = \"cpu\"",
        )),
        Ok(gpus) if gpus < local_ranks => Ok(Some(format!(
            "device = \"cuda\": {local_ranks} local ranks share {gpus} GPU(s) (rank r takes GPU r mod {gpus})"
        ))),
        Ok(_) => Ok(None),
    }
}
