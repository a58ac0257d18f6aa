//! Records the git commit the crate is built from (`GRADBUS_GIT_COMMIT`, `GRADBUS_GIT_DATE`), or
//! why there is none (`GRADBUS_GIT_UNKNOWN`), for `gradbus_artifacts::version`. The script reruns
//! when HEAD moves (a commit, a checkout), not on every edit: uncommitted changes are not marked.

#[path = "build/git.rs"]
mod git;

fn main() {
    let manifest = std::path::PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let root = manifest.parent().unwrap_or(&manifest);
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build/git.rs");
    match git::commit_of(root) {
        Ok(c) => {
            println!("cargo:rustc-env=GRADBUS_GIT_COMMIT={}", c.hash);
            println!("cargo:rustc-env=GRADBUS_GIT_DATE={}", c.date);
            println!("cargo:rustc-env=GRADBUS_GIT_UNKNOWN=");
            for p in c.watch {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        }
        Err(why) => {
            println!("cargo:rustc-env=GRADBUS_GIT_COMMIT=");
            println!("cargo:rustc-env=GRADBUS_GIT_DATE=");
            println!("cargo:rustc-env=GRADBUS_GIT_UNKNOWN={why}");
        }
    }
}
