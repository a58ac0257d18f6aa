//! How a test that cannot run on this machine says so, in one place for every crate of the
//! workspace (the other crates' tests include this file by path).
//!
//! [`skip`] writes `SKIPPED: <why>` straight to the process's stderr, past the test harness's
//! capture, so the CI log shows it next to the test; appends the same line to the file named by
//! `GRADBUS_SKIP_LOG`, if set (scripts/test.sh prints the collected list at its end); and, when
//! `GRADBUS_REQUIRE` (a comma-separated list of capabilities) names the test's capability, panics
//! instead: scripts/test.sh sets it where its own probe shows the machine can run the test, so a
//! regression in a test's probe fails the run rather than hiding the test.
#![allow(dead_code)]

use std::io::Write;

/// Says why the calling test does not run here (see the module doc). Panics when `capability` is
/// required by `GRADBUS_REQUIRE`; otherwise the caller returns.
pub fn skip(capability: &str, why: &str) {
    let line = format!("SKIPPED: {why}\n");
    let require = std::env::var("GRADBUS_REQUIRE").ok();
    if required(capability, require.as_deref()) {
        panic!(
            "GRADBUS_REQUIRE={} names `{capability}`, so this must run here, yet: {line}",
            require.unwrap_or_default()
        );
    }
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os("GRADBUS_SKIP_LOG") {
        // One short O_APPEND write per line: lines of tests running in parallel do not interleave.
        let file = std::fs::OpenOptions::new().create(true).append(true).open(&path);
        if let Err(e) = file.and_then(|mut f| f.write_all(line.as_bytes())) {
            panic!("GRADBUS_SKIP_LOG={}: {e}", std::path::Path::new(&path).display());
        }
    }
}

/// Whether the comma-separated `require` list names `capability`.
fn required(capability: &str, require: Option<&str>) -> bool {
    require.is_some_and(|list| list.split(',').any(|c| c.trim() == capability))
}

/// Whether a small tmpfs can be mounted over `dir` in a private mount namespace (`unshare -rm`,
/// which needs no privilege where user namespaces are enabled): true when it can; else `test` says
/// why it does not run (capability "tmpfs", see [`skip`]) and the caller returns.
pub fn tmpfs_mounts(dir: &std::path::Path, test: &str) -> bool {
    let why = match std::process::Command::new("unshare").args(["-rm", "sh", "-c", &tmpfs_mount(dir)]).output() {
        Ok(o) if o.status.success() => return true,
        Ok(o) => format!("unshare -rm: {}: {}", o.status, String::from_utf8_lossy(&o.stderr).trim()),
        Err(e) => format!("unshare: {e}"),
    };
    // No way to make a small tmpfs here: say so loudly rather than pass silently.
    skip(
        "tmpfs",
        &format!("{test}: cannot mount a tmpfs in a private mount namespace ({why}); needs user namespaces or root"),
    );
    false
}

/// The shell command that mounts a 1 MiB tmpfs over `dir` (inside `unshare -rm`, as probed by
/// [`tmpfs_mounts`]).
pub fn tmpfs_mount(dir: &std::path::Path) -> String {
    format!("mount -t tmpfs -o size=1m tmpfs '{}'", dir.display())
}

/// The capabilities `GRADBUS_REQUIRE` names that start with `prefix`: for a test that must find each
/// of them among what it runs (every `simd-` level the CPU's flags show), where no skip would fire.
pub fn required_starting(prefix: &str) -> Vec<String> {
    starting(prefix, std::env::var("GRADBUS_REQUIRE").ok().as_deref())
}

fn starting(prefix: &str, require: Option<&str>) -> Vec<String> {
    let list = require.unwrap_or_default().split(',').map(str::trim);
    list.filter(|c| c.starts_with(prefix)).map(String::from).collect()
}

#[test]
fn require_lists_name_capabilities_exactly() {
    assert!(required("netns", Some("netns,tmpfs")));
    assert!(required("tmpfs", Some("netns, tmpfs")));
    assert!(!required("cuda", Some("netns,tmpfs")));
    assert!(!required("tmp", Some("tmpfs")));
    assert!(!required("netns", None));
    assert_eq!(starting("simd-", Some("tmpfs, simd-avx,simd-avx512")), ["simd-avx", "simd-avx512"]);
    assert!(starting("simd-", None).is_empty());
}
