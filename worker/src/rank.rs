//! Rank discovery: who am I in this job? Each launcher that can have started this process has one
//! small function that reads its variables through a lookup closure (pure, so the tests use maps):
//! the launcher's `GRADBUS_*` contract, Open MPI's `OMPI_COMM_WORLD_*`, MPICH's `PMI_*`, Slurm's
//! `SLURM_*` of an `srun` step (checked against `PMIX_RANK`); none of them: a world of one.
//!
//! Precedence: the innermost launcher wins, in the order gradbus, Open MPI, MPICH, Slurm, because an
//! inner launcher's processes inherit the outer one's variables (`mpirun` inside an allocation,
//! `gradbus run` inside `srun`). Slurm counts only in the tasks of a job step (`SLURM_STEP_ID` set):
//! a batch script's own `SLURM_PROCID=0` describes the allocation, not a launch. Conflicts are errors
//! that name both sources: an outer launcher with the same world size but another rank (a double
//! launch such as `srun -n 4 gradbus run --np 4`: four jobs of four), `PMIX_RANK` against the Slurm or
//! Open MPI rank it was set beside, and Slurm's task count against its tasks per node. Outer
//! launchers of another size are what nesting looks like (Open MPI starts its daemons as a Slurm
//! step of one task per node) and are ignored.
//!
//! Invariant: every rank of one node derives the same job id and node id, because they name the
//! shared-memory segment the ranks must meet in; under Slurm the job id is `slurm<job>_<step>`, so
//! two steps of one allocation never share a segment.

use std::path::PathBuf;

use crate::env;
use crate::error::WorkerError;

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
    /// Where the numbers came from: `gradbus`, `openmpi`, `mpich`, `slurm` or `solo`.
    pub source: &'static str,
}

/// Reads one environment variable; `None` when it is unset or empty.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// What one launcher's variables say about this process.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Claim {
    source: &'static str,
    /// The variables the rank and world size came from, for messages.
    vars: (&'static str, &'static str),
    rank: usize,
    world: usize,
    local_rank: usize,
    local_size: usize,
    /// (node id, nodes) when the launcher says; else from `GRADBUS_NODE_ID` and world / local size.
    node: Option<(usize, usize)>,
    /// The launcher's own job identity, if it has one.
    job_id: Option<String>,
}

impl Claim {
    fn describe(&self) -> String {
        let (r, w) = self.vars;
        format!("{} says rank {} of {} ({r}, {w})", self.source, self.rank, self.world)
    }
}

fn num(get: Lookup, var: &'static str) -> Result<Option<usize>, WorkerError> {
    match get(var) {
        None => Ok(None),
        Some(value) => value.trim().parse().map(Some).map_err(|_| WorkerError::NotANumber { var, value }),
    }
}

fn need(get: Lookup, var: &'static str, set_by: &str) -> Result<usize, WorkerError> {
    num(get, var)?.ok_or_else(|| WorkerError::Missing { var, set_by: set_by.into() })
}

/// The launcher's own contract (`gradbus run`).
fn gradbus(get: Lookup) -> Result<Option<Claim>, WorkerError> {
    if num(get, env::RANK)?.is_none() {
        return Ok(None);
    }
    let by = format!("`gradbus run`, which sets {}", env::RANK);
    Ok(Some(Claim {
        source: "gradbus",
        vars: (env::RANK, env::WORLD_SIZE),
        rank: need(get, env::RANK, &by)?,
        world: need(get, env::WORLD_SIZE, &by)?,
        local_rank: need(get, env::LOCAL_RANK, &by)?,
        local_size: need(get, env::LOCAL_SIZE, &by)?,
        node: None,
        job_id: None,
    }))
}

/// Open MPI's `mpirun`.
fn openmpi(get: Lookup) -> Result<Option<Claim>, WorkerError> {
    if num(get, env::OMPI_RANK)?.is_none() {
        return Ok(None);
    }
    let by = "Open MPI's mpirun";
    Ok(Some(Claim {
        source: "openmpi",
        vars: (env::OMPI_RANK, env::OMPI_SIZE),
        rank: need(get, env::OMPI_RANK, by)?,
        world: need(get, env::OMPI_SIZE, by)?,
        local_rank: need(get, env::OMPI_LOCAL_RANK, by)?,
        local_size: need(get, env::OMPI_LOCAL_SIZE, by)?,
        node: None,
        job_id: get("PMIX_NAMESPACE").or_else(|| get("OMPI_MCA_orte_ess_jobid")),
    }))
}

/// MPICH's Hydra (`PMI_*`; the local numbers are optional there).
fn mpich(get: Lookup) -> Result<Option<Claim>, WorkerError> {
    let Some(rank) = num(get, env::PMI_RANK)? else { return Ok(None) };
    let world = need(get, env::PMI_SIZE, "MPICH's mpiexec")?;
    Ok(Some(Claim {
        source: "mpich",
        vars: (env::PMI_RANK, env::PMI_SIZE),
        rank,
        world,
        local_rank: num(get, env::MPICH_LOCAL_RANK)?.unwrap_or(rank),
        local_size: num(get, env::MPICH_LOCAL_SIZE)?.unwrap_or(world),
        node: None,
        job_id: None,
    }))
}

/// Slurm's `srun`: only in the tasks of a job step (`SLURM_STEP_ID` set), not in a batch script.
fn slurm(get: Lookup) -> Result<Option<Claim>, WorkerError> {
    if get(env::SLURM_STEP_ID).is_none() || get(env::SLURM_PROCID).is_none() {
        return Ok(None);
    }
    let by = "srun";
    let rank = need(get, env::SLURM_PROCID, by)?;
    let (world_var, world) = match num(get, env::SLURM_STEP_NUM_TASKS)? {
        Some(n) => (env::SLURM_STEP_NUM_TASKS, n),
        None => (env::SLURM_NTASKS, need(get, env::SLURM_NTASKS, by)?),
    };
    let node_id = need(get, env::SLURM_NODEID, by)?;
    let (per_var, per_node) = slurm_tasks_per_node(get)?;
    let nodes = match num(get, env::SLURM_STEP_NUM_NODES)?.or(num(get, env::SLURM_NNODES)?) {
        Some(n) => n,
        None => per_node.len().max(node_id + 1),
    };
    // A single number (`--ntasks-per-node`) holds for every node.
    let per_node = if per_node.len() == 1 { vec![per_node[0]; nodes] } else { per_node };
    if per_node.len() != nodes || per_node.iter().sum::<usize>() != world {
        return Err(WorkerError::SlurmTasks { world_var, world, nodes, per_var, per_node });
    }
    let local_size = *per_node.get(node_id).ok_or(WorkerError::SlurmNodeId { node_id, nodes })?;
    let job =
        get(env::SLURM_JOB_ID).ok_or_else(|| WorkerError::Missing { var: env::SLURM_JOB_ID, set_by: by.into() })?;
    let step = get(env::SLURM_STEP_ID).unwrap_or_default();
    Ok(Some(Claim {
        source: "slurm",
        vars: (env::SLURM_PROCID, world_var),
        rank,
        world,
        local_rank: need(get, env::SLURM_LOCALID, by)?,
        local_size,
        node: Some((node_id, nodes)),
        job_id: Some(format!("slurm{job}_{step}")),
    }))
}

/// The tasks on each node of the step: `SLURM_STEP_TASKS_PER_NODE`, else `SLURM_TASKS_PER_NODE`, else
/// `SLURM_NTASKS_PER_NODE`; returns the variable it used.
fn slurm_tasks_per_node(get: Lookup) -> Result<(&'static str, Vec<usize>), WorkerError> {
    for var in [env::SLURM_STEP_TASKS_PER_NODE, env::SLURM_TASKS_PER_NODE, env::SLURM_NTASKS_PER_NODE] {
        if let Some(value) = get(var) {
            return tasks_per_node(var, &value).map(|t| (var, t));
        }
    }
    Err(WorkerError::NoTasksPerNode)
}

/// Expands Slurm's compressed tasks-per-node list `value` of variable `var`: `2(x3),1` -> `[2, 2, 2, 1]`.
pub fn tasks_per_node(var: &'static str, value: &str) -> Result<Vec<usize>, WorkerError> {
    let bad = |part: &str| WorkerError::TaskList { var, value: value.into(), part: part.into() };
    let mut out = Vec::new();
    for part in value.split(',').map(str::trim) {
        let (n, times) = match part.split_once("(x") {
            Some((n, rest)) => (n, rest.strip_suffix(')').ok_or_else(|| bad(part))?),
            None => (part, "1"),
        };
        let n: usize = n.parse().map_err(|_| bad(part))?;
        let times: usize = times.parse().map_err(|_| bad(part))?;
        if n == 0 || times == 0 || out.len() + times > 1 << 20 {
            return Err(bad(part));
        }
        out.extend(std::iter::repeat(n).take(times));
    }
    Ok(out)
}

/// `PMIX_RANK`, a check on the launcher it was set beside (PMIx gives no world size in the
/// environment, so it never makes a claim of its own).
fn pmix_rank(get: Lookup) -> Result<Option<usize>, WorkerError> {
    num(get, env::PMIX_RANK)
}

impl RankInfo {
    /// Discover from the process environment.
    pub fn discover() -> Result<RankInfo, WorkerError> {
        let get = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        Self::discover_from(&get, (std::process::id(), parent_pid()))
    }

    /// Discover from `get`; `pids` = (this process, its parent) name the job when no launcher does.
    pub fn discover_from(get: Lookup, pids: (u32, u32)) -> Result<RankInfo, WorkerError> {
        let claims: Vec<Claim> =
            [gradbus(get)?, openmpi(get)?, mpich(get)?, slurm(get)?].into_iter().flatten().collect();
        let pmix = pmix_rank(get)?;
        let solo = Claim {
            source: "solo",
            vars: ("", ""),
            rank: 0,
            world: 1,
            local_rank: 0,
            local_size: 1,
            node: None,
            job_id: None,
        };
        if claims.is_empty() {
            if let Some(pmix) = pmix {
                return Err(WorkerError::PmixAlone { pmix });
            }
        }
        let win = claims.first().unwrap_or(&solo).clone();
        for outer in claims.iter().skip(1) {
            if outer.world == win.world && outer.rank != win.rank {
                return Err(WorkerError::DoubleLaunch { inner: win.describe(), outer: outer.describe() });
            }
        }
        if let Some(pmix) = pmix.filter(|&p| matches!(win.source, "slurm" | "openmpi") && p != win.rank) {
            return Err(WorkerError::PmixConflict { claim: win.describe(), pmix });
        }
        let Claim { source, rank, world, local_rank, local_size, .. } = win;
        if world == 0 || rank >= world || local_size == 0 || local_rank >= local_size || local_size > world {
            return Err(WorkerError::Inconsistent { launcher: source, rank, world, local_rank, local_size });
        }
        let (mut node_id, mut nodes) = match win.node {
            Some(n) => n,
            None => (num(get, env::NODE_ID)?.unwrap_or(0), world / local_size),
        };
        let (mut local_rank, mut local_size) = (local_rank, local_size);
        if let Some(k) = num(get, env::FAKE_NODES)? {
            if k == 0 || local_size % k != 0 {
                return Err(WorkerError::FakeNodes { fake_nodes: k, local_size });
            }
            let per = local_size / k;
            node_id = node_id * k + local_rank / per;
            nodes *= k;
            local_rank %= per;
            local_size = per;
        }
        let job_id = get(env::JOB_ID)
            .or(win.job_id)
            .unwrap_or_else(|| format!("p{}", if source == "solo" { pids.0 } else { pids.1 }));
        let job_id = job_id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        Ok(RankInfo { rank, world, local_rank, local_size, node_id, nodes, job_id, source })
    }

    /// The run directory: `--run-dir`, else `GRADBUS_RUN_DIR`, else `runs/<job id>`.
    pub fn run_dir(&self, arg: Option<PathBuf>) -> PathBuf {
        arg.or_else(|| std::env::var(env::RUN_DIR).ok().filter(|v| !v.is_empty()).map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("runs").join(&self.job_id))
    }
}

/// The CUDA device ordinal of a rank, one GPU per local rank: `local_rank` indexes the devices that
/// `CUDA_VISIBLE_DEVICES` (`visible`) lists, which CUDA renumbers from 0. One listed device means the
/// launcher bound this task to its own GPU (Slurm's `--gpus-per-task=1` or `--gpu-bind=single:1`):
/// ordinal 0. Unset: every device is visible, ordinal = local rank (the driver checks that it
/// exists). An empty list, Slurm's `NoDevFiles`, or fewer devices than local ranks is an error.
pub fn gpu_ordinal(local_rank: usize, visible: Option<&str>) -> Result<usize, WorkerError> {
    let Some(list) = visible else { return Ok(local_rank) };
    let devices: Vec<&str> = list.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
    match devices.len() {
        0 => Err(WorkerError::NoGpu { list: list.into() }),
        _ if devices == ["NoDevFiles"] => Err(WorkerError::NoDevFiles),
        1 => Ok(0),
        n if local_rank < n => Ok(local_rank),
        n => Err(WorkerError::TooFewGpus { local_rank, list: list.into(), devices: n }),
    }
}

fn parent_pid() -> u32 {
    // SAFETY: getppid has no preconditions and cannot fail.
    unsafe { libc::getppid() as u32 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same error, variant and fields (the one error type holds I/O errors: no `PartialEq`).
    #[track_caller]
    fn assert_same(got: &WorkerError, want: WorkerError) {
        assert_eq!(format!("{got:?}"), format!("{want:?}"));
    }
    use std::collections::BTreeMap;

    fn discover(vars: &[(&str, &str)]) -> Result<RankInfo, WorkerError> {
        let map: BTreeMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        RankInfo::discover_from(&|k: &str| map.get(k).cloned(), (100, 99))
    }

    /// The variables `srun -n 4` set for task 2 on a one-node cluster (as read there).
    const SRUN_TASK_2: &[(&str, &str)] = &[
        ("SLURM_JOB_ID", "17"),
        ("SLURM_STEP_ID", "0"),
        ("SLURM_PROCID", "2"),
        ("SLURM_LOCALID", "2"),
        ("SLURM_NODEID", "0"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_STEP_NUM_TASKS", "4"),
        ("SLURM_NNODES", "1"),
        ("SLURM_STEP_NUM_NODES", "1"),
        ("SLURM_TASKS_PER_NODE", "4"),
        ("SLURM_STEP_TASKS_PER_NODE", "4"),
    ];

    /// A batch script's own variables: an allocation of 8 tasks, not a launch.
    const BATCH: &[(&str, &str)] = &[
        ("SLURM_JOB_ID", "17"),
        ("SLURM_PROCID", "0"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NODEID", "0"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_TASKS_PER_NODE", "8"),
    ];

    fn with(
        base: &[(&'static str, &'static str)],
        extra: &[(&'static str, &'static str)],
    ) -> Vec<(&'static str, &'static str)> {
        let mut v: Vec<_> = base.iter().filter(|(k, _)| !extra.iter().any(|(e, _)| e == k)).copied().collect();
        v.extend_from_slice(extra);
        v
    }

    #[test]
    fn nothing_set_is_a_world_of_one() {
        let i = discover(&[]).unwrap();
        assert_eq!((i.source, i.rank, i.world, i.nodes, i.job_id.as_str()), ("solo", 0, 1, 1, "p100"));
    }

    #[test]
    fn an_srun_task_finds_itself_and_names_the_job_step() {
        let i = discover(SRUN_TASK_2).unwrap();
        assert_eq!(
            i,
            RankInfo {
                rank: 2,
                world: 4,
                local_rank: 2,
                local_size: 4,
                node_id: 0,
                nodes: 1,
                job_id: "slurm17_0".into(),
                source: "slurm"
            }
        );
        let other_step = discover(&with(SRUN_TASK_2, &[("SLURM_STEP_ID", "1")])).unwrap();
        assert_ne!(other_step.job_id, i.job_id, "two steps of one job must not share a segment");
        let exported = discover(&with(SRUN_TASK_2, &[("GRADBUS_JOB_ID", "j9")])).unwrap();
        assert_eq!(exported.job_id, "j9", "gradbus run --launcher srun exports its job id");
    }

    #[test]
    fn srun_over_uneven_nodes_takes_the_local_size_of_its_node() {
        // 7 tasks over 4 nodes as `2(x3),1`: the last node holds rank 6 alone.
        let vars = [
            ("SLURM_JOB_ID", "5"),
            ("SLURM_STEP_ID", "2"),
            ("SLURM_PROCID", "6"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "3"),
            ("SLURM_STEP_NUM_TASKS", "7"),
            ("SLURM_STEP_NUM_NODES", "4"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x3),1"),
        ];
        let i = discover(&vars).unwrap();
        assert_eq!((i.rank, i.world, i.local_rank, i.local_size, i.node_id, i.nodes), (6, 7, 0, 1, 3, 4));
        let i =
            discover(&with(&vars, &[("SLURM_PROCID", "3"), ("SLURM_LOCALID", "1"), ("SLURM_NODEID", "1")])).unwrap();
        assert_eq!((i.local_rank, i.local_size, i.node_id), (1, 2, 1));
    }

    #[test]
    fn ntasks_per_node_alone_holds_for_every_node() {
        let vars = [
            ("SLURM_JOB_ID", "5"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "5"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_NTASKS", "6"),
            ("SLURM_NNODES", "3"),
            ("SLURM_NTASKS_PER_NODE", "2"),
        ];
        let i = discover(&vars).unwrap();
        assert_eq!((i.local_size, i.node_id, i.nodes), (2, 2, 3));
    }

    #[test]
    fn tasks_per_node_expands_slurms_compressed_form() {
        assert_eq!(tasks_per_node("T", "2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(tasks_per_node("T", "4").unwrap(), [4]);
        assert_eq!(tasks_per_node("T", "1,3(x2)").unwrap(), [1, 3, 3]);
        for bad in ["", "x", "2(x3", "2(3)", "0", "2(x0)", "-1", "2(x99999999)"] {
            let e = tasks_per_node("SLURM_TASKS_PER_NODE", bad).unwrap_err();
            assert!(matches!(&e, WorkerError::TaskList { value, .. } if value == bad), "{bad}: {e:?}");
            assert!(e.to_string().contains("2(x3),1"), "{bad}: {e}");
        }
        let e = discover(&with(SRUN_TASK_2, &[("SLURM_STEP_TASKS_PER_NODE", "4(x")])).unwrap_err();
        assert_eq!(
            e.to_string(),
            "environment variable SLURM_STEP_TASKS_PER_NODE=\"4(x\": `4(x` is not N or N(xK) \
             (hint: Slurm writes e.g. `2(x3),1`)"
        );
    }

    #[test]
    fn a_batch_script_is_an_allocation_not_a_launch() {
        let i = discover(BATCH).unwrap();
        assert_eq!(i.source, "solo");
        // `gradbus run --np 4` (or mpirun -np 4) inside `sbatch -n 8`: the inner launcher decides.
        let i = discover(&with(
            BATCH,
            &[
                ("GRADBUS_RANK", "3"),
                ("GRADBUS_WORLD_SIZE", "4"),
                ("GRADBUS_LOCAL_RANK", "3"),
                ("GRADBUS_LOCAL_SIZE", "4"),
            ],
        ))
        .unwrap();
        assert_eq!((i.source, i.rank, i.world), ("gradbus", 3, 4));
    }

    #[test]
    fn the_innermost_launcher_wins_over_an_outer_step_of_another_size() {
        // Open MPI started its daemons as a Slurm step of one task per node (2 nodes); its ranks
        // inherit that step's variables and carry their own.
        let orted = [
            ("SLURM_JOB_ID", "8"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_STEP_NUM_NODES", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
        ];
        let ompi = with(
            &orted,
            &[
                ("OMPI_COMM_WORLD_RANK", "5"),
                ("OMPI_COMM_WORLD_SIZE", "8"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
                ("PMIX_RANK", "5"),
            ],
        );
        let i = discover(&ompi).unwrap();
        assert_eq!((i.source, i.rank, i.world, i.local_rank, i.local_size), ("openmpi", 5, 8, 1, 4));
        // `srun -n 1 gradbus run --np 4`: one launcher, four workers.
        let one = [
            ("SLURM_JOB_ID", "8"),
            ("SLURM_STEP_ID", "3"),
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_STEP_NUM_TASKS", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "1"),
            ("PMIX_RANK", "0"),
        ];
        let g = with(
            &one,
            &[
                ("GRADBUS_RANK", "2"),
                ("GRADBUS_WORLD_SIZE", "4"),
                ("GRADBUS_LOCAL_RANK", "2"),
                ("GRADBUS_LOCAL_SIZE", "4"),
                ("GRADBUS_JOB_ID", "j1"),
            ],
        );
        let i = discover(&g).unwrap();
        assert_eq!((i.source, i.rank, i.world, i.job_id.as_str()), ("gradbus", 2, 4, "j1"));
    }

    #[test]
    fn a_double_launch_is_an_error_naming_both_sources() {
        // `srun -n 4 gradbus run --np 4`: task 1's launcher started worker 3.
        let g = with(
            SRUN_TASK_2,
            &[
                ("SLURM_PROCID", "1"),
                ("SLURM_LOCALID", "1"),
                ("GRADBUS_RANK", "3"),
                ("GRADBUS_WORLD_SIZE", "4"),
                ("GRADBUS_LOCAL_RANK", "3"),
                ("GRADBUS_LOCAL_SIZE", "4"),
            ],
        );
        let e = discover(&g).unwrap_err();
        assert_same(
            &e,
            WorkerError::DoubleLaunch {
                inner: "gradbus says rank 3 of 4 (GRADBUS_RANK, GRADBUS_WORLD_SIZE)".into(),
                outer: "slurm says rank 1 of 4 (SLURM_PROCID, SLURM_STEP_NUM_TASKS)".into(),
            },
        );
        assert!(e.to_string().contains("hint:"), "{e}");
        // mpirun -np 4 inside `srun -n 4` likewise.
        let o = with(
            SRUN_TASK_2,
            &[
                ("OMPI_COMM_WORLD_RANK", "0"),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ],
        );
        let e = discover(&o).unwrap_err().to_string();
        assert!(e.contains("openmpi says rank 0 of 4") && e.contains("slurm says rank 2 of 4"), "{e}");
        // The same rank from both is no conflict.
        let same = with(
            SRUN_TASK_2,
            &[
                ("OMPI_COMM_WORLD_RANK", "2"),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ],
        );
        assert_eq!(discover(&same).unwrap().source, "openmpi");
    }

    #[test]
    fn pmix_must_agree_with_the_launcher_it_was_set_beside() {
        assert_eq!(discover(&with(SRUN_TASK_2, &[("PMIX_RANK", "2")])).unwrap().rank, 2);
        let e = discover(&with(SRUN_TASK_2, &[("PMIX_RANK", "1")])).unwrap_err();
        assert!(matches!(e, WorkerError::PmixConflict { pmix: 1, .. }), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("slurm says rank 2 of 4") && e.contains("PMIX_RANK=1"), "{e}");
        let e = discover(&[("PMIX_RANK", "1")]).unwrap_err();
        assert_same(&e, WorkerError::PmixAlone { pmix: 1 });
        let e = e.to_string();
        assert!(e.contains("PMIX_RANK=1") && e.contains("world size"), "{e}");
    }

    #[test]
    fn inconsistent_slurm_variables_are_errors_naming_them() {
        let e = discover(&with(SRUN_TASK_2, &[("SLURM_STEP_NUM_TASKS", "5")])).unwrap_err();
        assert!(matches!(e, WorkerError::SlurmTasks { world: 5, nodes: 1, .. }), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("SLURM_STEP_NUM_TASKS=5") && e.contains("SLURM_STEP_TASKS_PER_NODE"), "{e}");
        let e = discover(&with(SRUN_TASK_2, &[("SLURM_PROCID", "two")])).unwrap_err();
        assert_same(&e, WorkerError::NotANumber { var: "SLURM_PROCID", value: "two".into() });
        assert_eq!(e.to_string(), "environment variable SLURM_PROCID=\"two\" is not a non-negative integer");
        let no_local: Vec<_> = SRUN_TASK_2.iter().filter(|(k, _)| *k != "SLURM_LOCALID").copied().collect();
        let e = discover(&no_local).unwrap_err();
        assert_eq!(e.to_string(), "environment variable SLURM_LOCALID is missing (srun sets it)");
        let e = discover(&with(SRUN_TASK_2, &[("SLURM_LOCALID", "4")])).unwrap_err();
        assert!(matches!(e, WorkerError::Inconsistent { launcher: "slurm", local_rank: 4, .. }), "{e:?}");
        assert!(e.to_string().contains("local rank 4 of 4"), "{e}");
        let e = discover(&with(SRUN_TASK_2, &[("SLURM_NODEID", "1")])).unwrap_err();
        assert_same(&e, WorkerError::SlurmNodeId { node_id: 1, nodes: 1 });
        assert!(e.to_string().contains("SLURM_NODEID=1"), "{e}");
        let no_job: Vec<_> = SRUN_TASK_2.iter().filter(|(k, _)| *k != "SLURM_JOB_ID").copied().collect();
        let e = discover(&no_job).unwrap_err();
        assert_eq!(e.to_string(), "environment variable SLURM_JOB_ID is missing (srun sets it)");
        let no_per_node: Vec<_> = SRUN_TASK_2.iter().filter(|(k, _)| !k.ends_with("TASKS_PER_NODE")).copied().collect();
        assert_same(&discover(&no_per_node).unwrap_err(), WorkerError::NoTasksPerNode);
    }

    #[test]
    fn the_launcher_contract_and_mpi_as_before() {
        let g = [
            ("GRADBUS_RANK", "1"),
            ("GRADBUS_WORLD_SIZE", "4"),
            ("GRADBUS_LOCAL_RANK", "1"),
            ("GRADBUS_LOCAL_SIZE", "2"),
            ("GRADBUS_NODE_ID", "0"),
            ("GRADBUS_JOB_ID", "j-1.x"),
        ];
        let i = discover(&g).unwrap();
        assert_eq!((i.rank, i.world, i.local_size, i.nodes, i.job_id.as_str()), (1, 4, 2, 2, "j-1_x"));
        let i = discover(&with(&g, &[("GRADBUS_FAKE_NODES", "2")])).unwrap();
        assert_eq!((i.local_rank, i.local_size, i.node_id, i.nodes), (0, 1, 1, 4));
        let e = discover(&g[..1]).unwrap_err();
        assert!(matches!(e, WorkerError::Missing { var: "GRADBUS_WORLD_SIZE", .. }), "{e:?}");
        assert!(e.to_string().contains("GRADBUS_WORLD_SIZE is missing"), "{e}");
        let e = discover(&with(&g, &[("GRADBUS_FAKE_NODES", "3")])).unwrap_err();
        assert_eq!(e.to_string(), "GRADBUS_FAKE_NODES=3 must divide the local size 2");
        let m = discover(&[("PMI_RANK", "2"), ("PMI_SIZE", "3")]).unwrap();
        assert_eq!((m.source, m.rank, m.local_rank, m.local_size, m.job_id.as_str()), ("mpich", 2, 2, 3, "p99"));
    }

    #[test]
    fn one_gpu_per_local_rank_follows_cuda_visible_devices() {
        assert_eq!(gpu_ordinal(3, None).ok(), Some(3), "all devices visible: the local rank");
        assert_eq!(gpu_ordinal(2, Some("4,5,6,7")).ok(), Some(2), "Slurm's per-job list, renumbered from 0");
        assert_eq!(gpu_ordinal(3, Some("GPU-a1,GPU-b2,GPU-c3,GPU-d4")).ok(), Some(3));
        assert_eq!(gpu_ordinal(3, Some("6")).ok(), Some(0), "--gpus-per-task=1: this task's own GPU");
        let e = gpu_ordinal(4, Some("0,1,2,3")).unwrap_err();
        assert_same(&e, WorkerError::TooFewGpus { local_rank: 4, list: "0,1,2,3".into(), devices: 4 });
        let e = e.to_string();
        assert!(e.contains("local rank 4") && e.contains("CUDA_VISIBLE_DEVICES=\"0,1,2,3\""), "{e}");
        assert!(gpu_ordinal(0, Some("")).unwrap_err().to_string().contains("hides every GPU"));
        assert_same(&gpu_ordinal(0, Some("NoDevFiles")).unwrap_err(), WorkerError::NoDevFiles);
        assert!(WorkerError::NoDevFiles.to_string().starts_with("CUDA_VISIBLE_DEVICES=NoDevFiles: "));
    }
}
