//! The real worker over the MPI transports (feature `mpi`): the reference workload under `mpirun`
//! through the hierarchical path (2 fake nodes x 2 ranks), the flat MPI path and the shm bus must
//! train the same model within float rounding (their sums associate differently), each must repeat
//! itself bit for bit, and `gradbus run --launcher mpirun --hostfile` must reach the same result.
//! The worker itself aborts when replicas diverge, so exit 0 also means every rank agreed.
#![cfg(feature = "mpi")]

mod common;
#[path = "common/skip.rs"]
mod skip;

use std::path::Path;
use std::process::Command;

use common::{gradbus, metrics, root};

/// `mpirun -np 4 gradbus worker --run-dir DIR examples/tiny.toml --set steps=2` with `env` exported.
fn worker_under_mpirun(dir: &Path, env: &[(&str, &str)]) {
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "4"]).current_dir(root());
    let job = format!("tmpi{}-{}", std::process::id(), dir.file_name().unwrap().to_string_lossy());
    for (k, v) in env.iter().chain(&[("GRADBUS_JOB_ID", job.as_str())]) {
        c.env(k, v).args(["-x", k]);
    }
    c.args([env!("CARGO_BIN_EXE_gradbus"), "worker", "--run-dir"]).arg(dir).args([
        "examples/tiny.toml",
        "--set",
        "steps=2",
    ]);
    let out = c.output().expect("spawn mpirun (scripts/test.sh installs Open MPI)");
    assert!(
        out.status.success(),
        "{env:?} mpirun -np 4 gradbus worker: {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn num(v: &serde_json::Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {v}"))
}

/// Same updates, same verdicts, losses and norms within float rounding (not bitwise: the sums
/// associate differently).
fn assert_close(a: &[serde_json::Value], b: &[serde_json::Value], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: number of metrics lines");
    assert!(!a.is_empty());
    for (x, y) in a.iter().zip(b) {
        for k in ["step", "minibatch", "attempt", "verdict", "skipped", "nonfinite_ranks"] {
            assert_eq!(x[k], y[k], "{what}: {k}\n{x}\n{y}");
        }
        for k in ["loss", "grad_norm", "reward"] {
            let (p, q) = (num(x, k), num(y, k));
            assert!((p - q).abs() <= 1e-4 * p.abs().max(q.abs()).max(1.0), "{what}: {k} {p} vs {q}\n{x}\n{y}");
        }
    }
}

#[test]
fn hier_flat_and_shm_train_the_same_model_within_rounding_and_repeat_bitwise() {
    let d = tempfile::tempdir().unwrap();
    let run = |name: &str, env: &[(&str, &str)]| {
        let dir = d.path().join(name);
        worker_under_mpirun(&dir, env);
        metrics(&dir)
    };
    let hier = run("hier", &[("GRADBUS_FAKE_NODES", "2")]);
    let hier2 = run("hier2", &[("GRADBUS_FAKE_NODES", "2")]);
    let flat = run("flat", &[("GRADBUS_TRANSPORT", "mpi")]);
    let shm = run("shm", &[]);
    assert_eq!(hier, hier2, "the hierarchical path must repeat itself bit for bit");
    assert_close(&hier, &shm, "hier vs shm");
    assert_close(&flat, &shm, "flat mpi vs shm");
    assert_eq!(hier.len(), 2 * 16, "2 steps x 16 updates");
}

#[test]
fn gradbus_run_with_the_mpirun_launcher_and_a_localhost_hostfile() {
    let d = tempfile::tempdir().unwrap();
    let hosts = d.path().join("hosts");
    std::fs::write(&hosts, "# one machine\nlocalhost slots=4\n").unwrap();
    let e2e = d.path().join("e2e");
    let (h, r) = (hosts.to_str().unwrap(), e2e.to_str().unwrap());
    let args = ["run", "--launcher", "mpirun", "--hostfile", h, "--np", "4", "--run-dir", r, "examples/tiny.toml"];
    let args: Vec<&str> = args.into_iter().chain(["--set", "steps=2"]).collect();
    gradbus(&args, &[("GRADBUS_FAKE_NODES", "2")]).expect_code(0);
    // The same job started by hand: the same hierarchical path, so the same bits.
    let direct = d.path().join("direct");
    worker_under_mpirun(&direct, &[("GRADBUS_FAKE_NODES", "2")]);
    assert_eq!(metrics(&e2e), metrics(&direct));
}

#[test]
fn worker_whose_world_size_disagrees_with_mpi_exits_2_naming_both() {
    // Started without mpirun, MPI_Init makes a world of one; the environment claims two.
    let d = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gradbus"))
        .current_dir(root())
        .args(["worker", "--run-dir"])
        .arg(d.path())
        .args(["examples/tiny.toml", "--set", "steps=1"])
        .envs([
            ("GRADBUS_TRANSPORT", "mpi"),
            ("GRADBUS_RANK", "0"),
            ("GRADBUS_WORLD_SIZE", "2"),
            ("GRADBUS_LOCAL_RANK", "0"),
            ("GRADBUS_LOCAL_SIZE", "1"),
            ("GRADBUS_JOB_ID", "tmpi-size"),
            ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
            ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("says 2 ranks, but MPI_COMM_WORLD has 1"), "{err}");
}

/// `gradbus bench allreduce --transport mpi` runs the bus and MPI_Allreduce side by side under
/// mpirun; every element exact on both.
#[test]
fn bench_allreduce_compares_the_bus_with_mpi_allreduce() {
    let r = gradbus(
        &["bench", "allreduce", "--np", "2", "--sizes", "4KiB,1MiB", "--iters", "2", "--transport", "mpi", "--json"],
        &[],
    );
    r.expect_code(0);
    let rows: Vec<serde_json::Value> =
        r.stdout().lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 2, "{}", r.stdout());
    for row in rows {
        assert_eq!(row["wrong"], 0, "{row}");
        assert!(row["mpi_time_us"].as_f64().is_some_and(|t| t > 0.0), "{row}");
    }
}

/// Two "machines" on this one: two network namespaces on a bridge, each with its own `/dev/shm`
/// and `TMPDIR` (a private mount namespace), reached by Open MPI through an rsh agent that enters
/// them - so the job's two nodes talk MPI over TCP and share nothing but the file system. Needs
/// root (CAP_NET_ADMIN, CAP_SYS_ADMIN); elsewhere it is `None`, with the reason.
struct TwoNodes {
    tag: String,
    dir: tempfile::TempDir,
    hosts: [String; 2],
}

impl TwoNodes {
    fn up() -> Result<TwoNodes, String> {
        // Names and subnet unlikely to be anyone else's: pid and clock.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let salt = std::process::id() ^ nanos;
        let tag = format!("gb{:06}", salt % 1_000_000);
        let net = format!("10.213.{}", salt % 250 + 1);
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let nodes = TwoNodes { tag: tag.clone(), dir, hosts: [format!("{net}.2"), format!("{net}.3")] };
        let ip = |args: &str| -> Result<(), String> {
            let out = Command::new("ip").args(args.split(' ')).output().map_err(|e| format!("ip: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!("ip {args}: {}", String::from_utf8_lossy(&out.stderr).trim()))
            }
        };
        ip(&format!("link add {tag}br type bridge"))?;
        ip(&format!("addr add {net}.1/24 dev {tag}br"))?;
        ip(&format!("link set {tag}br up"))?;
        for (i, host) in nodes.hosts.iter().enumerate() {
            let ns = format!("{tag}n{i}");
            ip(&format!("netns add {ns}"))?;
            ip(&format!("link add {tag}v{i} type veth peer name eth0 netns {ns}"))?;
            ip(&format!("link set {tag}v{i} master {tag}br up"))?;
            ip(&format!("-n {ns} addr add {host}/24 dev eth0"))?;
            ip(&format!("-n {ns} link set eth0 up"))?;
            ip(&format!("-n {ns} link set lo up"))?;
        }
        let cases: String = nodes.hosts.iter().enumerate().map(|(i, h)| format!("  {h}) ns={tag}n{i} ;;\n")).collect();
        let agent = format!(
            "#!/bin/sh\nhost=$1; shift\ncase \"$host\" in\n{cases}  *) echo \"rsh: unknown host $host\" >&2; exit 1 ;;\nesac\n\
             mkdir -p \"{d}/$ns\"\n\
             exec ip netns exec \"$ns\" unshare --mount --propagation private /bin/sh -c \
             'mount -t tmpfs -o size=1g tmpfs /dev/shm && TMPDIR=\"$0\" exec /bin/sh -c \"$1\"' \"{d}/$ns\" \"$*\"\n",
            d = nodes.dir.path().display()
        );
        let path = nodes.agent();
        std::fs::write(&path, agent).map_err(|e| e.to_string())?;
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .map_err(|e| e.to_string())?;
        std::fs::write(nodes.hostfile(), format!("{} slots=2\n{} slots=2\n", nodes.hosts[0], nodes.hosts[1]))
            .map_err(|e| e.to_string())?;
        // The agent's whole path (namespace, private mount namespace, tmpfs) must work here.
        for host in &nodes.hosts {
            let out = Command::new(nodes.agent()).args([host.as_str(), "true"]).output().map_err(|e| e.to_string())?;
            if !out.status.success() {
                return Err(format!("rsh agent: {}", String::from_utf8_lossy(&out.stderr).trim()));
            }
        }
        Ok(nodes)
    }

    fn agent(&self) -> std::path::PathBuf {
        self.dir.path().join("rsh")
    }

    fn hostfile(&self) -> std::path::PathBuf {
        self.dir.path().join("hosts")
    }

    /// The Open MPI settings that send the launch through the agent and the traffic over the bridge.
    fn env(&self) -> Vec<(&'static str, String)> {
        let net = self.hosts[0].rsplit_once('.').unwrap().0.to_string() + ".0/24";
        vec![
            ("OMPI_MCA_plm_rsh_agent", self.agent().display().to_string()),
            ("OMPI_MCA_oob_tcp_if_include", net.clone()),
            ("OMPI_MCA_btl_tcp_if_include", net),
        ]
    }

    /// No process left in either namespace.
    fn processes_left(&self) -> Vec<String> {
        (0..2)
            .flat_map(|i| {
                let out = Command::new("ip").args(["netns", "pids", &format!("{}n{i}", self.tag)]).output();
                out.map(|o| String::from_utf8_lossy(&o.stdout).split_whitespace().map(String::from).collect::<Vec<_>>())
                    .unwrap_or_default()
            })
            .collect()
    }
}

impl Drop for TwoNodes {
    fn drop(&mut self) {
        // Deleting a namespace does not end its processes: kill what a failed case left there.
        for pid in self.processes_left() {
            let _ = Command::new("kill").args(["-9", &pid]).output();
        }
        for i in 0..2 {
            let _ = Command::new("ip").args(["netns", "del", &format!("{}n{i}", self.tag)]).output();
        }
        let _ = Command::new("ip").args(["link", "del", &format!("{}br", self.tag)]).output();
    }
}

#[test]
fn two_nodes_in_network_namespaces_train_over_tcp_like_two_fake_nodes_and_tear_down_together() {
    let nodes = match TwoNodes::up() {
        Ok(n) => n,
        Err(why) => {
            let why = format!("two_nodes_in_network_namespaces_train_over_tcp_like_two_fake_nodes_and_tear_down_together: cannot build two network namespaces here ({why}); needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2");
            skip::skip("netns", &why);
            return;
        }
    };
    let d = tempfile::tempdir().unwrap();
    let env = nodes.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let hosts = nodes.hostfile();
    let run = |name: &str, extra: &[&str], faults: &str| {
        let dir = d.path().join(name);
        let (h, r) = (hosts.to_str().unwrap(), dir.to_str().unwrap());
        let mut args = vec!["run", "--launcher", "mpirun", "--hostfile", h, "--np", "4", "--run-dir", r];
        args.extend(["examples/tiny.toml", "--set", "steps=2"]);
        args.extend(extra);
        let mut env = env.clone();
        env.push(("GRADBUS_FAULTS", faults));
        (gradbus(&args, &env), dir)
    };
    let (r, two) = run("two", &[], "");
    r.expect_code(0);
    let launch: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(two.join("launch.json")).unwrap()).unwrap();
    assert_eq!(launch["plan"]["nodes"].as_array().map(Vec::len), Some(2), "{launch}");
    // The same hierarchy on one machine (2 fake nodes x 2): shm inside a node, MPI between the
    // leaders - the same sums in the same order, so the same bits.
    let fake = d.path().join("fake");
    worker_under_mpirun(&fake, &[("GRADBUS_FAKE_NODES", "2")]);
    assert_eq!(metrics(&two), metrics(&fake));
    assert!(nodes.processes_left().is_empty());

    // A rank of the second node killed: the job ends on both nodes, with the rank's exit.
    let kill = "[[faults]]\nkind = \"kill\"\nrank = 3\nstep = 1\nminibatch = 0\nphase = \"forward\"\n";
    let (r, _) = run("kill", &[], kill);
    r.expect_code(4);
    assert!(nodes.processes_left().is_empty(), "left: {:?}", nodes.processes_left());
}

/// The agreement's summary path and its table path, each forced (`GRADBUS_AGREEMENT`), give bitwise
/// the same metrics over flat MPI and the hierarchical transport (2 fake nodes).
#[test]
fn summary_and_table_agreement_give_bitwise_identical_metrics_over_mpi_and_hier() {
    let d = tempfile::tempdir().unwrap();
    let run = |name: &str, env: &[(&str, &str)]| {
        let dir = d.path().join(name);
        worker_under_mpirun(&dir, env);
        metrics(&dir)
    };
    for (name, env) in [("flat", ("GRADBUS_TRANSPORT", "mpi")), ("hier", ("GRADBUS_FAKE_NODES", "2"))] {
        let summary = run(&format!("{name}-summary"), &[env, ("GRADBUS_AGREEMENT", "summary")]);
        let table = run(&format!("{name}-table"), &[env, ("GRADBUS_AGREEMENT", "table")]);
        assert_eq!(summary.len(), 2 * 16);
        assert_eq!(summary, table, "{name}: the paths' metrics differ");
    }
}

/// Issue 29's replica repair over MPI (`MPI_Bcast` from the donor): a flipped exponent bit in rank
/// 1's weights after an update is found at the next one and repaired from the majority, over flat
/// MPI and the hierarchical transport (2 fake nodes), and the run then goes on with the clean run's
/// bits: every other update's loss and weights' checksum are the clean run's.
#[test]
fn a_weight_flip_is_repaired_over_flat_mpi_and_hier_to_the_clean_bits() {
    let d = tempfile::tempdir().unwrap();
    let flip = "[[faults]]\nkind = \"bitflip\"\nrank = 1\nstep = 0\nminibatch = 7\ntarget = \"weight\"\n\
                param = \"head.weight\"\nelement = 3\nbit = 30\ntransient = false\n";
    let bits = |m: &[serde_json::Value]| -> Vec<String> {
        let kept = m.iter().filter(|l| l["verdict"] != "repair");
        kept.map(|l| format!("{} {} {} {}", l["step"], l["minibatch"], l["loss"], l["checksum"])).collect()
    };
    for (name, env) in [("flat", ("GRADBUS_TRANSPORT", "mpi")), ("hier", ("GRADBUS_FAKE_NODES", "2"))] {
        let (clean, flipped) = (d.path().join(format!("{name}-clean")), d.path().join(format!("{name}-flip")));
        worker_under_mpirun(&clean, &[env]);
        worker_under_mpirun(&flipped, &[env, ("GRADBUS_FAULTS", flip)]);
        let m = metrics(&flipped);
        let repairs: Vec<_> = m.iter().filter(|l| l["verdict"] == "repair").collect();
        assert_eq!(repairs.len(), 1, "{name}: {repairs:?}");
        assert!(repairs[0]["sdc"].as_str().unwrap_or("").contains("repaired from rank"), "{name}: {}", repairs[0]);
        assert_eq!(bits(&m), bits(&metrics(&clean)), "{name}: the run after the repair is the clean run");
    }
}
