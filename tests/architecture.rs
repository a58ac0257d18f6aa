//! `docs/architecture.md` against the code: its arrows between crates are the `[dependencies]` of
//! every crate's `Cargo.toml` (gradbus crates only), and no crate's modules import each other in a
//! circle (`use crate::...` outside the test modules).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The crate's manifest, by package name.
fn manifest(package: &str) -> PathBuf {
    let dir = match package {
        "gradbus" => "",
        "gradbus-python" => "python",
        other => other.strip_prefix("gradbus-").expect("a gradbus crate"),
    };
    root().join(dir).join("Cargo.toml")
}

/// The gradbus crates a manifest's `[dependencies]` names.
fn gradbus_deps(manifest: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(manifest).unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
    let doc: toml::Table = text.parse().unwrap_or_else(|e| panic!("{}: {e}", manifest.display()));
    let deps = doc.get("dependencies").and_then(|d| d.as_table()).cloned().unwrap_or_default();
    deps.keys().filter(|k| k.starts_with("gradbus-")).cloned().collect()
}

#[test]
fn the_documented_arrows_are_the_manifests_dependencies() {
    let doc = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    let block = doc.split("```text\n").nth(1).and_then(|b| b.split("```").next()).expect("the arrows block");
    let mut seen = 0;
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let (krate, deps) = line.split_once("->").unwrap_or_else(|| panic!("not an arrow line: {line:?}"));
        let documented: BTreeSet<String> = deps.split_whitespace().map(String::from).collect();
        let actual = gradbus_deps(&manifest(krate.trim()));
        assert_eq!(documented, actual, "docs/architecture.md's arrows of {} differ from its Cargo.toml", krate.trim());
        seen += 1;
    }
    assert_eq!(seen, 6, "one line per crate: kernels, collectives, artifacts, worker, gradbus, python");
}

/// `crate::module` imports of each top-level module of `src` (`lib` for the crate root, which also
/// stands for `crate::item` of an item the root defines or re-exports), test modules and comments
/// left out.
fn module_imports(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().map_or(true, |e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap();
            let first = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
            let module = first.trim_end_matches(".rs").to_string();
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap();
            let code = code.split("#[cfg(test)]\npub(crate) mod tests").next().unwrap();
            let deps = graph.entry(module.clone()).or_default();
            for line in code.lines().map(|l| l.split("//").next().unwrap()) {
                for part in line.split("crate::").skip(1) {
                    let name: String = part.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    if !name.is_empty() && name != module {
                        deps.insert(name);
                    }
                }
            }
        }
    }
    // `crate::name` where no module `name` exists names an item of the crate root.
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for (module, deps) in graph.iter_mut() {
        let items: Vec<String> = deps.iter().filter(|d| !modules.contains(*d)).cloned().collect();
        for item in items {
            deps.remove(&item);
            if module != "lib" {
                deps.insert("lib".into());
            }
        }
    }
    graph
}

/// A circle through `start`, if there is one.
fn circle(graph: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    let mut stack = vec![vec![start.to_string()]];
    let mut seen = BTreeSet::new();
    while let Some(path) = stack.pop() {
        for next in graph.get(path.last().unwrap()).into_iter().flatten() {
            if next == start {
                return Some([path.clone(), vec![next.clone()]].concat());
            }
            if seen.insert(next.clone()) {
                stack.push([path.clone(), vec![next.clone()]].concat());
            }
        }
    }
    None
}

#[test]
fn no_crate_imports_its_own_modules_in_a_circle() {
    for krate in ["kernels", "collectives", "artifacts", "worker", "launcher"] {
        let graph = module_imports(&root().join(krate).join("src"));
        assert!(graph.len() > 2, "{krate}: read {} modules", graph.len());
        for m in graph.keys() {
            if let Some(c) = circle(&graph, m) {
                panic!("{krate}: the modules import each other in a circle: {}", c.join(" -> "));
            }
        }
    }
}
