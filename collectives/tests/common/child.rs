//! The child-process entry of a multi-process test file, in one place for the files that have one
//! (shm_bus.rs, mpi.rs, bench_allreduce.rs; included by path).
//!
//! A test of such a file (the parent) re-runs the file's own test binary as N processes, each running
//! only the entry: a `#[test]` marked `#[ignore]`, so that a plain test run lists it as ignored
//! instead of counting a function that checks nothing as a passing test. The parent selects it with
//! [`args`] and names its scenario in an environment variable; run without one (`--ignored` by hand)
//! the entry fails, saying it is not a test.
#![allow(dead_code)]

/// The test-binary arguments that run only the (ignored) entry `name`, output uncaptured.
pub fn args(name: &str) -> [&str; 5] {
    ["--ignored", "--exact", name, "--nocapture", "--test-threads=1"]
}

/// The value of `var`, which the parent sets for its children; panics without it.
pub fn scenario(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!("not a test: the child process that this file's tests start, with {var} set; run those tests instead")
    })
}
