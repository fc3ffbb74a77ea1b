//! The house's own rules, checked:
//! - README's exact crate graph ("How it is built") is the one the `Cargo.toml` files declare;
//! - the coordinator's and the node's files read bottom-up: no file-level import cycle.

#[path = "house/imports.rs"]
mod imports;

use std::collections::BTreeMap;
use std::path::Path;

type Graph = BTreeMap<String, Vec<String>>;

/// The workspace crates each crate's `[dependencies]` names (dev- and build-dependencies are
/// not part of the architecture).
fn declared(root: &Path) -> Graph {
    let mut graph = Graph::new();
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        let manifest = entry.unwrap().path().join("Cargo.toml");
        let Ok(text) = std::fs::read_to_string(&manifest) else {
            continue;
        };
        let mut name = None;
        let mut section = String::new();
        let mut deps = Vec::new();
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                section = line.to_string();
                continue;
            }
            if section == "[package]" {
                if let Some(v) = line.strip_prefix("name = ") {
                    name = Some(v.trim_matches('"').to_string());
                }
            }
            if section == "[dependencies]" && line.starts_with("tessera") {
                let dep = line.split(['.', ' ', '=']).next().unwrap();
                deps.push(dep.to_string());
            }
        }
        deps.sort();
        graph.insert(name.expect("a package name"), deps);
    }
    graph
}

/// The graph README states: the lines of the block after `<!-- crate-graph -->`, where a
/// line that starts with a space continues the one before.
fn stated(readme: &str) -> Graph {
    let block = readme
        .split("<!-- crate-graph -->")
        .nth(1)
        .expect("README has the crate-graph marker");
    let body = block.split("```").nth(1).expect("a fenced block after it");
    let mut graph = Graph::new();
    let mut current: Option<String> = None;
    for line in body.lines().skip(1) {
        let (uses, continued) = match line.split_once('→') {
            Some((name, uses)) => {
                current = Some(name.trim().to_string());
                (uses, false)
            }
            None => (line, true),
        };
        let Some(name) = &current else { continue };
        let entry = graph.entry(name.clone()).or_default();
        if !continued || !uses.trim().is_empty() {
            entry.extend(
                uses.split(',')
                    .map(str::trim)
                    .filter(|d| !d.is_empty())
                    .map(str::to_string),
            );
        }
    }
    for deps in graph.values_mut() {
        deps.sort();
    }
    graph
}

#[test]
fn readmes_crate_graph_is_the_one_the_manifests_declare() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let (stated, declared) = (stated(&readme), declared(&root));
    for (name, deps) in &declared {
        assert_eq!(
            stated.get(name),
            Some(deps),
            "README's crate graph says {name} uses {:?}; its Cargo.toml says {deps:?}",
            stated.get(name)
        );
    }
    let extra: Vec<_> = stated
        .keys()
        .filter(|k| !declared.contains_key(*k))
        .collect();
    assert!(
        extra.is_empty(),
        "README names crates that do not exist: {extra:?}"
    );
}

/// Writes a small crate's sources (`(path under src, text)`) into a temporary directory.
fn crate_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (path, text) in files {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    dir
}

fn cycle_names(src: &Path) -> Vec<Vec<String>> {
    imports::cycles(&imports::graph(src))
        .iter()
        .map(|c| c.iter().map(imports::name).collect())
        .collect()
}

#[test]
fn the_import_check_finds_cycles_through_paths_uses_and_reexports() {
    // a names b's item in code, b imports a's through the crate root's re-export.
    let planted = crate_with(&[
        ("lib.rs", "mod a; mod b; mod c; pub use a::Alpha;"),
        ("a.rs", "pub struct Alpha; fn f(_: crate::b::Beta) {}"),
        ("b.rs", "use crate::Alpha; pub struct Beta(Alpha);"),
        (
            "c.rs",
            "use super::a::Alpha; mod tests { use super::super::b::*; }",
        ),
    ]);
    assert_eq!(cycle_names(planted.path()), vec![vec!["a", "b"]]);
    // A parent that only re-exports its child, and a child using its parent's items, is a
    // facade, not a cycle; neither is a test module naming its own file's items.
    // A name the root imports from another crate is no edge to the root either.
    let facade = crate_with(&[
        (
            "lib.rs",
            "pub mod p; use std::collections; fn f(_: crate::p::P) {}",
        ),
        (
            "p/mod.rs",
            "mod q; pub use q::Q; pub struct P; fn g(_: crate::collections::HashSet<u8>) {}",
        ),
        (
            "p/q.rs",
            "pub struct Q(super::P); mod tests { use super::*; }",
        ),
    ]);
    assert!(cycle_names(facade.path()).is_empty());
}

#[test]
fn the_coordinator_and_the_node_have_no_file_level_import_cycle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for krate in ["tessera-coord", "tessera-node"] {
        let src = root.join("crates").join(krate).join("src");
        let graph = imports::graph(&src);
        let cycles = imports::cycles(&graph);
        let described: Vec<String> = cycles
            .iter()
            .map(|cycle| {
                let edges: Vec<String> = cycle
                    .iter()
                    .flat_map(|from| {
                        graph[from]
                            .iter()
                            .filter(|to| cycle.contains(to))
                            .map(move |to| {
                                format!("{} -> {}", imports::name(from), imports::name(to))
                            })
                    })
                    .collect();
                edges.join(", ")
            })
            .collect();
        assert!(
            cycles.is_empty(),
            "{krate} has file-level import cycles: {}",
            described.join("; ")
        );
    }
}
