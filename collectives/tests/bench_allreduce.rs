//! The all-reduce benchmark run the way `gradbus bench allreduce` runs it: N real processes, each
//! calling `bench::rank_main` (self-exec: this test binary re-run to run only `bench_child`, an
//! ignored test: common/child.rs).
//!
//! `bench_smoke` (a test) checks that every reduced element is right on small sizes.
//! `bench_allreduce_numbers` (ignored: a benchmark prints numbers) measures the real sizes:
//!
//! ```sh
//! GRADBUS_BENCH_NP=2 GRADBUS_BENCH_SIZES=1MiB,16MiB,64MiB,256MiB \
//!   cargo test -p gradbus-collectives --release --test bench_allreduce -- \
//!   --ignored --exact bench_allreduce_numbers --nocapture
//! ```

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gradbus_collectives::bench::{format_table, json_lines, parse_sizes, rank_main, BenchArgs};
use gradbus_collectives::shm::remove_job_segments;

#[path = "common/child.rs"]
mod child;

const CHILD_ENV: &str = "GRADBUS_BENCH_CHILD";

/// The child's entry: rank `GRADBUS_BENCH_CHILD` of the benchmark; rank 0 writes the results.
#[test]
#[ignore = "not a test: the child process that this file's tests start"]
fn bench_child() {
    let rank = child::scenario(CHILD_ENV);
    let get = |k: &str| std::env::var(k).unwrap();
    let mut args = BenchArgs::new(
        rank.parse().unwrap(),
        get("GB_NP").parse().unwrap(),
        get("GB_JOB"),
        parse_sizes(&get("GB_SIZES")).unwrap(),
    );
    args.iters = get("GB_ITERS").parse().unwrap();
    args.timeout = Duration::from_secs(60);
    let code = match rank_main(args) {
        Ok(Some(rows)) => {
            let out = format!("{}\n{}", format_table(&rows), json_lines(&rows));
            std::fs::write(Path::new(&get("GB_DIR")).join("rows.txt"), out).unwrap();
            0
        }
        Ok(None) => 0,
        Err(e) => {
            eprintln!("rank {rank}: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// Run the benchmark on `np` processes; returns rank 0's table and JSON lines.
fn run(np: usize, sizes: &str, iters: usize) -> String {
    let dir = tempfile::tempdir().unwrap();
    let job = format!("bench{}-{np}-{iters}", std::process::id());
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..np)
        .map(|r| {
            Command::new(&exe)
                .args(child::args("bench_child"))
                .env(CHILD_ENV, r.to_string())
                .env("GB_NP", np.to_string())
                .env("GB_JOB", &job)
                .env("GB_SIZES", sizes)
                .env("GB_ITERS", iters.to_string())
                .env("GB_DIR", dir.path())
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let limit = Instant::now() + Duration::from_secs(300);
    let mut codes = vec![None; np];
    while codes.iter().any(Option::is_none) {
        for (r, c) in children.iter_mut().enumerate() {
            if codes[r].is_none() {
                codes[r] = c.try_wait().unwrap().map(|s| s.code());
            }
        }
        if Instant::now() > limit {
            children.iter_mut().for_each(|c| {
                let _ = c.kill();
                let _ = c.wait();
            });
            panic!("benchmark did not finish");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(remove_job_segments(Path::new("/dev/shm"), &job).unwrap(), 0, "the creator removed the segment");
    assert!(codes.iter().all(|&c| c == Some(Some(0))), "exit codes {codes:?}");
    std::fs::read_to_string(dir.path().join("rows.txt")).unwrap()
}

#[test]
fn bench_smoke() {
    for np in [2, 3] {
        let out = run(np, "4KiB,65540", 2);
        let rows: Vec<serde_json::Value> =
            out.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(rows.len(), 2, "{out}");
        assert_eq!(rows[1]["count"], 65540 / 4);
        for r in &rows {
            assert_eq!(r["wrong"], 0, "{out}");
            assert_eq!(r["np"], np);
        }
    }
}

#[test]
#[ignore = "benchmark: prints numbers"]
fn bench_allreduce_numbers() {
    let np = std::env::var("GRADBUS_BENCH_NP").map_or(2, |s| s.parse().unwrap());
    let sizes = std::env::var("GRADBUS_BENCH_SIZES").unwrap_or_else(|_| "1MiB,16MiB,64MiB".into());
    let iters = std::env::var("GRADBUS_BENCH_ITERS").map_or(20, |s| s.parse().unwrap());
    println!("{}", run(np, &sizes, iters));
}
