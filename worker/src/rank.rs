//! Rank discovery: who am I in this job? From the launcher's `GRADBUS_*` contract, else from the MPI
//! launcher's environment (Open MPI, then MPICH/PMI), else a world of one.
//!
//! Invariant: every rank of one node derives the same job id and node id, because they name the
//! shared-memory segment the ranks must meet in.

use std::path::PathBuf;

use crate::env;

/// This worker's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankInfo {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Rank among the ranks that share this node's segment.
    pub local_rank: usize,
    /// Ranks that share this node's segment.
    pub local_size: usize,
    /// Node index (distinct per segment on one host).
    pub node_id: usize,
    /// Number of nodes.
    pub nodes: usize,
    /// Job id.
    pub job_id: String,
    /// Where the numbers came from: `gradbus`, `openmpi`, `mpich` or `solo`.
    pub source: &'static str,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn num(name: &str) -> Result<Option<usize>, String> {
    match var(name) {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| format!("environment variable {name}={v:?} is not a non-negative integer")),
    }
}

fn need(name: &str) -> Result<usize, String> {
    num(name)?
        .ok_or_else(|| format!("environment variable {name} is missing (the launcher sets it with {})", env::RANK))
}

impl RankInfo {
    /// Discover from the environment.
    pub fn discover() -> Result<RankInfo, String> {
        let (source, rank, world, local_rank, local_size) = if num(env::RANK)?.is_some() {
            ("gradbus", need(env::RANK)?, need(env::WORLD_SIZE)?, need(env::LOCAL_RANK)?, need(env::LOCAL_SIZE)?)
        } else if num(env::OMPI_RANK)?.is_some() {
            (
                "openmpi",
                need(env::OMPI_RANK)?,
                need(env::OMPI_SIZE)?,
                need(env::OMPI_LOCAL_RANK)?,
                need(env::OMPI_LOCAL_SIZE)?,
            )
        } else if num(env::PMI_RANK)?.is_some() {
            let world = need(env::PMI_SIZE)?;
            let local_rank = num(env::MPICH_LOCAL_RANK)?.unwrap_or(need(env::PMI_RANK)?);
            let local_size = num(env::MPICH_LOCAL_SIZE)?.unwrap_or(world);
            ("mpich", need(env::PMI_RANK)?, world, local_rank, local_size)
        } else {
            ("solo", 0, 1, 0, 1)
        };
        if world == 0 || rank >= world || local_size == 0 || local_rank >= local_size || local_size > world {
            return Err(format!(
                "inconsistent rank environment ({source}): rank {rank} of {world}, local rank {local_rank} of {local_size}"
            ));
        }
        let mut node_id = num(env::NODE_ID)?.unwrap_or(0);
        let mut nodes = world / local_size;
        let (mut local_rank, mut local_size) = (local_rank, local_size);
        if let Some(k) = num(env::FAKE_NODES)? {
            if k == 0 || local_size % k != 0 {
                return Err(format!("{}={k} must divide the local size {local_size}", env::FAKE_NODES));
            }
            let per = local_size / k;
            node_id = node_id * k + local_rank / per;
            nodes *= k;
            local_rank %= per;
            local_size = per;
        }
        let job_id = var(env::JOB_ID)
            .or_else(|| var("PMIX_NAMESPACE"))
            .or_else(|| var("OMPI_MCA_orte_ess_jobid"))
            .unwrap_or_else(|| format!("p{}", if source == "solo" { std::process::id() } else { parent_pid() }));
        let job_id = job_id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        Ok(RankInfo { rank, world, local_rank, local_size, node_id, nodes, job_id, source })
    }

    /// The run directory: `--run-dir`, else `GRADBUS_RUN_DIR`, else `runs/<job id>`.
    pub fn run_dir(&self, arg: Option<PathBuf>) -> PathBuf {
        arg.or_else(|| var(env::RUN_DIR).map(PathBuf::from)).unwrap_or_else(|| PathBuf::from("runs").join(&self.job_id))
    }
}

fn parent_pid() -> u32 {
    // SAFETY: getppid has no preconditions and cannot fail.
    unsafe { libc::getppid() as u32 }
}
