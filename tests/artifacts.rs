//! Damaged artifacts of real runs are refused, never loaded: a corrupt newest checkpoint is named
//! in a warning and the run resumes from the older intact one, bitwise like an uninterrupted run;
//! when none verifies the run stops with exit 2 naming each file; a damaged dump or report.json
//! is refused by `gradbus replay` and `gradbus report` with the file named.

mod common;

use std::path::Path;

use common::{gradbus, metrics};

const TINY: &str = "examples/tiny.toml";

fn run(dir: &Path, resume: bool, extra: &[&str]) -> common::Run {
    let d = dir.to_str().unwrap();
    let mut args = vec!["run", "--np", "2", if resume { "--resume" } else { "--run-dir" }, d, TINY];
    args.extend_from_slice(&["--set", "rl.epochs=2", "--set", "rl.minibatches=2", "--set", "checkpoint.every=2"]);
    args.extend_from_slice(extra);
    gradbus(&args, &[])
}

/// Flip one byte in the middle of a file.
fn flip(path: &Path) {
    let mut b = std::fs::read(path).unwrap();
    let i = b.len() / 2;
    b[i] ^= 0x10;
    std::fs::write(path, b).unwrap();
}

#[test]
fn a_corrupt_newest_checkpoint_is_named_and_the_older_one_resumes_bitwise() {
    let tmp = tempfile::tempdir().unwrap();
    let (full, part) = (tmp.path().join("full"), tmp.path().join("part"));
    run(&full, false, &["--set", "steps=6"]).expect_code(0);
    run(&part, false, &["--set", "steps=4"]).expect_code(0);
    let newest = part.join("checkpoints/step-000004/state.bin");
    flip(&newest);

    let r = run(&part, true, &["--set", "steps=6"]);
    r.expect_code(0);
    let err = r.stderr();
    let warning = err.lines().find(|l| l.contains("warning: --resume skips a checkpoint")).unwrap_or_else(|| {
        panic!("no warning about the corrupt checkpoint\n{err}");
    });
    assert!(warning.contains(&format!("{}: checksum mismatch", newest.display())), "{warning}");
    assert!(warning.contains("expected ") && warning.contains(", found "), "{warning}");
    assert!(err.contains("step-000002 at step 2"), "did not resume from step-000002\n{err}");
    // The resumed run is the uninterrupted one, bit for bit (the checksum of the final weights too).
    assert_eq!(metrics(&part), metrics(&full));
    assert_eq!(metrics(&part).last().unwrap()["checksum"], metrics(&full).last().unwrap()["checksum"]);

    // Now damage every checkpoint: nothing is loaded, exit 2, each file named with its reason.
    let ckpts = ["step-000002", "step-000004", "step-000006"];
    for c in ckpts {
        flip(&part.join("checkpoints").join(c).join("state.bin"));
    }
    let r = run(&part, true, &["--set", "steps=8"]);
    r.expect_code(2);
    let out = r.stdout() + &r.stderr();
    assert!(out.contains("no complete checkpoint under"), "{out}");
    for c in ckpts {
        assert!(out.contains(&format!("{c}/state.bin: checksum mismatch")), "{c} not named\n{out}");
    }
    assert!(!out.contains("panicked"), "{out}");
}

#[test]
fn a_damaged_dump_or_report_is_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let d = dir.to_str().unwrap();
    let faults = "[[faults]]\nkind = \"nan\"\nrank = 1\nstep = 0\nminibatch = 1\n";
    let args = ["run", "--np", "2", "--run-dir", d, TINY, "--set", "steps=2"];
    gradbus(&args, &[("GRADBUS_FAULTS", faults)]).expect_code(3);
    gradbus(&["replay", d], &[]).expect_code(0);
    gradbus(&["report", d], &[]).expect_code(0);

    let dump = dir.join("dumps/rank-1.bin");
    flip(&dump);
    let r = gradbus(&["replay", dump.to_str().unwrap()], &[]);
    r.expect_code(2);
    assert!(r.stderr().contains(&format!("{}: checksum mismatch", dump.display())), "{}", r.stderr());

    let report = dir.join("report.json");
    flip(&report);
    let r = gradbus(&["report", d], &[]);
    r.expect_code(2);
    assert!(r.stderr().contains(&format!("{}: checksum mismatch", report.display())), "{}", r.stderr());
}
