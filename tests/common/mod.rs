//! Helpers for the integration tests: run the real binaries in a unique temp directory and show
//! the command, stdout and stderr whenever an expectation fails.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root (examples live there).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A finished command with everything needed to explain a failure.
pub struct Run {
    pub cmd: String,
    pub out: Output,
}

impl Run {
    pub fn code(&self) -> Option<i32> {
        self.out.status.code()
    }
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.out.stdout).into_owned()
    }
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.out.stderr).into_owned()
    }
    /// Panic with the whole story unless the exit code is `want`.
    pub fn expect_code(&self, want: i32) -> &Run {
        if self.code() != Some(want) {
            panic!(
                "{}\nexpected exit {want}, got {:?}\n--- stdout\n{}\n--- stderr\n{}",
                self.cmd,
                self.out.status,
                self.stdout(),
                self.stderr()
            );
        }
        self
    }
}

/// Run `gradbus ARGS` with extra environment.
pub fn gradbus(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gradbus"));
    c.args(args).current_dir(root()).env_remove("GRADBUS_FAULTS");
    for (k, v) in env {
        c.env(k, v);
    }
    let cmd = format!(
        "{} gradbus {}",
        env.iter().map(|(k, v)| format!("{k}='{v}'")).collect::<Vec<_>>().join(" "),
        args.join(" ")
    );
    Run { cmd, out: c.output().expect("spawn gradbus") }
}

/// `RUN_DIR/metrics.jsonl` as JSON values without the wall-clock `time_*` fields and the line
/// checksum (which covers them).
pub fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).expect("json line");
            v.as_object_mut().unwrap().retain(|k, _| !k.starts_with("time_") && k != "crc32c");
            v
        })
        .collect()
}

/// No shared-memory segment of any gradbus job is left (tests use unique job ids; this checks all).
pub fn segments_left(job_hint: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("gradbus-") && n.contains(job_hint))
                .collect()
        })
        .unwrap_or_default()
}

/// The fast seed-case config (after `examples/tiny.toml`): a stale rollout engine (never synced) and
/// lr 1e-2 drive the ROLL-style loss's k3 log-ratio past exp overflow around step 110 on 2 ranks.
pub const FAST_SEED_CASE: &[&str] = &[
    "--set",
    "steps=200",
    "--set",
    "rollout_sync_interval=1000",
    "--set",
    "optim.lr=1e-2",
    "--set",
    "rl.epochs=2",
    "--set",
    "rl.minibatches=2",
];

/// Waits for `child` until `deadline`; past it, kills it and returns `None` (bounded polling, never a
/// hang: a test that waits for a launcher fails with its output instead of stalling CI).
pub fn wait_until(child: &mut std::process::Child, deadline: std::time::Instant) -> Option<std::process::ExitStatus> {
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return Some(s);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// One pipe of a child process, read to its end by a thread while the test goes on.
pub struct Captured {
    buf: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Captured {
    /// What the pipe has delivered so far.
    pub fn so_far(&self) -> String {
        String::from_utf8_lossy(&self.buf.lock().unwrap()).into_owned()
    }

    /// Everything, once the writer has closed the pipe (call after the child exited).
    pub fn finish(&mut self) -> String {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.so_far()
    }
}

/// Take the child's piped stdout and stderr (in that order) and read each on its own thread.
pub fn capture(child: &mut std::process::Child) -> [Captured; 2] {
    use std::io::Read;
    let pipes: [Box<dyn Read + Send>; 2] =
        [Box::new(child.stdout.take().expect("piped stdout")), Box::new(child.stderr.take().expect("piped stderr"))];
    pipes.map(|mut pipe| {
        let buf = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let b = buf.clone();
        let thread = std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                b.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        Captured { buf, thread: Some(thread) }
    })
}

/// Whether `pid` is gone (no /proc entry, or a zombie nobody reaped yet).
pub fn is_dead(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => {
            let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
            matches!(state, Some('Z' | 'X'))
        }
    }
}
