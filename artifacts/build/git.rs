//! Which git commit a source tree is, for the build script (`artifacts/build.rs`) and its unit test
//! (`artifacts/src/version.rs`). Only std: a build script has no dependencies.
//!
//! The tree is the repository root, the parent of `worker/`. It counts as a checkout only when git
//! says that root IS the top level of a work tree: a copy of the sources inside some other
//! repository (vendored, unpacked into a project) must not report that repository's commit.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The commit a tree was checked out at, and the files whose change means HEAD moved.
pub struct Commit {
    /// Full hash of HEAD.
    pub hash: String,
    /// Its committer date, `YYYY-MM-DD`.
    pub date: String,
    /// HEAD, its reflog, the branch's loose ref and packed-refs, where they exist.
    pub watch: Vec<PathBuf>,
}

fn git(dir: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .map_err(|e| format!("git could not be run ({e})"))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(err.lines().next().unwrap_or("git failed").trim().to_string());
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The commit of the source tree at `root`, or why there is none (a sentence).
pub fn commit_of(root: &Path) -> Result<Commit, String> {
    if !root.join(".git").exists() {
        return Err("built from a source tree without .git".into());
    }
    let top = git(root, &["rev-parse", "--show-toplevel"])?;
    let same = |a: &Path, b: &Path| a.canonicalize().ok().is_some_and(|a| b.canonicalize().ok() == Some(a));
    if !same(Path::new(&top), root) {
        return Err(format!("the source tree is inside another repository ({top})"));
    }
    let hash = git(root, &["rev-parse", "--verify", "HEAD"])?;
    let date = git(root, &["log", "-1", "--format=%cs", "HEAD"])?;
    let abs = |p: String| if Path::new(&p).is_absolute() { PathBuf::from(p) } else { root.join(p) };
    let git_dir = abs(git(root, &["rev-parse", "--git-dir"])?);
    let common = abs(git(root, &["rev-parse", "--git-common-dir"])?);
    let mut watch = vec![git_dir.join("HEAD"), git_dir.join("logs/HEAD"), common.join("packed-refs")];
    if let Ok(branch) = git(root, &["symbolic-ref", "-q", "HEAD"]) {
        watch.push(common.join(branch));
    }
    // A path that does not exist would make cargo rerun the script on every build.
    watch.retain(|p| p.exists());
    Ok(Commit { hash, date, watch })
}
