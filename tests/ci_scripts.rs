//! The CI scripts' own refusals: what a new user (or a CI machine) meets before any test runs.

mod common;
#[path = "common/skip.rs"]
mod skip;

use std::process::Command;

/// python/test.sh on a disk too small for its venv (torch and the CUDA runtime libraries: 7.5 GB at
/// the install's peak) stops before installing anything, naming the folder, what it needs and what
/// is free, instead of pip's "[Errno 28] No space left on device" half-way through the install.
/// The disk is a 1 MiB tmpfs as `target/`, in a private mount namespace (`unshare -rm`), holding
/// what an interrupted install left.
#[test]
fn python_test_sh_refuses_a_disk_too_small_for_its_venv_naming_the_space() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("python")).unwrap();
    std::fs::create_dir(dir.path().join("target")).unwrap();
    let script = dir.path().join("python/test.sh");
    std::fs::copy(common::root().join("python/test.sh"), &script).unwrap();
    let target = dir.path().join("target");
    if !skip::tmpfs_mounts(&target, "python_test_sh_refuses_a_disk_too_small_for_its_venv_naming_the_space") {
        return;
    }
    let mount = skip::tmpfs_mount(&target);
    // In the namespace: 600 KiB of an install cut short (a venv without `.complete`, which the
    // script removes before it counts: the refusal says the whole 1 MiB is free), then the script,
    // then what it left on the small disk (`ls -A`, on stdout).
    let t = target.display();
    let half = format!("mkdir '{t}/pyvenv' && head -c 614400 /dev/zero > '{t}/pyvenv/half'");
    let run = format!("{mount} && {half} && {{ \"$0\"; rc=$?; ls -A '{t}'; exit $rc; }}");
    let out = Command::new("unshare").args(["-rm", "sh", "-c", &run]).arg(&script).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let left = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "stdout: {left}\nstderr: {err}");
    let want = format!("needs 8 GiB free on {} ", target.display());
    assert!(err.contains("python/test.sh: making the test venv target/pyvenv") && err.contains(&want), "{err}");
    assert!(err.contains("; 1 MiB are free there (hint: free disk space"), "{err}");
    // Nothing was installed, nor even made, on the small disk.
    assert_eq!(left.trim(), "", "left on target/: {left}");
}
