//! Which gradbus this is: the crate version and the git commit it was built from, recorded at build
//! time by `artifacts/build.rs`. `gradbus --version` prints [`describe`]; `launch.json`, `report.json`
//! and checkpoints carry [`Build`], so a run directory says which build wrote it.
//!
//! Invariant: a commit is never guessed. A tree that is not a git checkout of its own (a source
//! tarball, a copy inside another repository) has no commit, and [`describe`] says why.

use serde::{Deserialize, Serialize};

/// The crate version (the workspace's, shared by every gradbus crate).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

fn nonempty(s: &'static str) -> Option<&'static str> {
    (!s.is_empty()).then_some(s)
}

/// The build of gradbus that wrote an artifact.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Build {
    /// The crate version, e.g. `0.1.0`.
    pub version: String,
    /// The full git hash of the commit it was built from; null when the source tree was not a git
    /// checkout.
    #[serde(deserialize_with = "Option::deserialize")]
    pub commit: Option<String>,
}

/// This build.
pub fn build() -> Build {
    Build { version: VERSION.into(), commit: nonempty(env!("GRADBUS_GIT_COMMIT")).map(String::from) }
}

/// One line: `0.1.0 (commit 4d89fa528edf..., 2026-11-30)`, or the reason there is no commit.
pub fn describe() -> String {
    match (nonempty(env!("GRADBUS_GIT_COMMIT")), nonempty(env!("GRADBUS_GIT_DATE"))) {
        (Some(hash), Some(date)) => format!("{VERSION} (commit {hash}, {date})"),
        (Some(hash), None) => format!("{VERSION} (commit {hash})"),
        _ => format!("{VERSION} (commit unknown: {})", env!("GRADBUS_GIT_UNKNOWN")),
    }
}

#[cfg(test)]
#[path = "../build/git.rs"]
mod git;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_without_git_has_no_commit_and_says_why() {
        let dir = tempfile::tempdir().unwrap();
        let why = git::commit_of(dir.path()).err().expect("no commit in an empty directory");
        assert!(why.contains("without .git"), "{why}");
    }

    #[test]
    fn this_build_names_its_commit_or_why_not() {
        let d = describe();
        assert!(d.starts_with(VERSION), "{d}");
        match build().commit {
            Some(hash) => {
                assert!(hash.len() == 40 && hash.bytes().all(|b| b.is_ascii_hexdigit()), "{hash}");
                assert!(d.contains(&hash), "{d}");
            }
            None => assert!(d.contains("commit unknown: "), "{d}"),
        }
    }

    #[test]
    fn the_repository_is_its_own_checkout() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        if !root.join(".git").exists() {
            return; // a source tarball: the test above covers it
        }
        let c = git::commit_of(root).expect("the repository's commit");
        assert_eq!(c.hash.len(), 40);
        assert!(c.date.len() == 10 && c.date.as_bytes()[4] == b'-', "{}", c.date);
        assert!(c.watch.iter().any(|p| p.ends_with("HEAD")), "{:?}", c.watch);
    }

    #[test]
    fn a_tree_inside_another_repository_is_not_its_commit() {
        let dir = tempfile::tempdir().unwrap();
        let git_init = std::process::Command::new("git").arg("init").arg("-q").arg(dir.path()).status();
        if !git_init.is_ok_and(|s| s.success()) {
            return; // no git here: nothing can be misread either
        }
        let inner = dir.path().join("vendored");
        std::fs::create_dir_all(inner.join(".git")).unwrap();
        let why = git::commit_of(&inner).err().expect("the outer repository's commit is not the tree's");
        assert!(why.contains("inside another repository"), "{why}");
    }
}
