//! File-level imports of a crate as a graph, so the house can require that its modules read
//! bottom-up: no cycle of files naming each other's items.
//!
//! A module is a file (`a.rs` or `a/mod.rs`); inline `mod x { … }` blocks belong to their
//! file. File A depends on file B when A's code names an item *defined* in B: through a
//! private `use`, or a `crate::`/`super::`/`self::` path anywhere in its code (test modules
//! included: tests are code the crate must be able to read too). Names are followed through
//! `use` declarations to the file that defines them; a `pub use` is a file's interface, not
//! its dependency, so it is no edge of its own; nor is a `mod` declaration.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use syn::visit::Visit;

/// A module's path from the crate root (`[]` is `lib.rs`).
pub type Module = Vec<String>;

/// Each module's file-level dependencies on other modules of the same crate.
pub type Graph = BTreeMap<Module, BTreeSet<Module>>;

/// One leaf of a `use` tree: its full path (the last segment is the imported name, or `*`).
struct UseLeaf {
    path: Vec<String>,
    public: bool,
}

/// What one file says: its `use` leaves and the other crate-relative paths its code names.
#[derive(Default)]
struct FileRefs {
    uses: Vec<UseLeaf>,
    paths: Vec<Vec<String>>,
}

/// Walks a file, noting paths relative to the file's module. Inline modules are folded into
/// their file: `super` inside `mod tests { … }` then names the file's own module, which is
/// what the depth counter undoes.
struct Collector {
    refs: FileRefs,
    inline_depth: usize,
}

impl Collector {
    /// Drops one `super` per inline module level, so the path is relative to the file.
    fn relative_to_file(&self, mut path: Vec<String>) -> Option<Vec<String>> {
        for _ in 0..self.inline_depth {
            match path.first().map(String::as_str) {
                Some("super") => {
                    path.remove(0);
                    if path.is_empty() {
                        return None;
                    }
                    path.insert(0, "self".to_string());
                }
                // `crate::` is absolute; `self::x` in an inline module names the inline
                // module's own items, which are in this file.
                Some("crate") => return Some(path),
                _ => return None,
            }
        }
        Some(path)
    }

    fn add_use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree, public: bool) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.add_use_tree(prefix, &p.tree, public);
                prefix.pop();
            }
            syn::UseTree::Name(n) => self.push_use(prefix, n.ident.to_string(), public),
            syn::UseTree::Rename(r) => self.push_use(prefix, r.ident.to_string(), public),
            syn::UseTree::Glob(_) => self.push_use(prefix, "*".to_string(), public),
            syn::UseTree::Group(g) => {
                for item in &g.items {
                    self.add_use_tree(prefix, item, public);
                }
            }
        }
    }

    fn push_use(&mut self, prefix: &[String], name: String, public: bool) {
        let mut path = prefix.to_vec();
        if name != "self" {
            path.push(name);
        }
        if let Some(path) = self.relative_to_file(path) {
            self.refs.uses.push(UseLeaf { path, public });
        }
    }
}

impl<'ast> Visit<'ast> for Collector {
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        let public = !matches!(item.vis, syn::Visibility::Inherited);
        self.add_use_tree(&mut Vec::new(), &item.tree, public);
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if item.content.is_some() {
            self.inline_depth += 1;
            syn::visit::visit_item_mod(self, item);
            self.inline_depth -= 1;
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        if segments.len() > 1 && matches!(segments[0].as_str(), "crate" | "super" | "self") {
            if let Some(p) = self.relative_to_file(segments) {
                self.refs.paths.push(p);
            }
        }
        syn::visit::visit_path(self, path);
    }
}

/// The module a file under `src` is.
fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Module = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts == ["lib"] || parts == ["main"] {
        parts.clear();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Resolves names to the files that define them, following re-exports.
struct Resolver {
    modules: BTreeSet<Module>,
    reexports: BTreeMap<Module, BTreeMap<String, Vec<String>>>,
}

impl Resolver {
    /// The absolute form of `path` written in module `from`, or `None` for another crate.
    fn absolute(&self, from: &Module, path: &[String]) -> Option<(Module, Vec<String>)> {
        let mut base = from.clone();
        let mut rest = path;
        match path.first()?.as_str() {
            "crate" => {
                base.clear();
                rest = &path[1..];
            }
            "self" => rest = &path[1..],
            "super" => {
                while rest.first().is_some_and(|s| s == "super") {
                    base.pop();
                    rest = &rest[1..];
                }
            }
            // A bare path names a child module of `from`, or something outside the crate.
            first => {
                let mut child = from.clone();
                child.push(first.to_string());
                if !self.modules.contains(&child) {
                    return None;
                }
            }
        }
        Some((base, rest.to_vec()))
    }

    /// The file defining what `path` (written in `from`) names.
    fn defining_module(&self, from: &Module, path: &[String], depth: usize) -> Option<Module> {
        let (mut module, rest) = self.absolute(from, path)?;
        for segment in &rest {
            let mut child = module.clone();
            child.push(segment.clone());
            if self.modules.contains(&child) {
                module = child;
                continue;
            }
            if let Some(target) = self.reexports.get(&module).and_then(|r| r.get(segment)) {
                // A name imported from another crate is no edge (`None`); a chain of
                // re-exports longer than any real one stops where it is.
                if depth < 16 {
                    return self.defining_module(&module, target, depth + 1);
                }
            }
            break;
        }
        Some(module)
    }
}

/// The file-level dependency graph of the crate whose sources are under `src`.
pub fn graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut refs = BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let ast = syn::parse_file(&text)
            .unwrap_or_else(|e| panic!("{} does not parse: {e}", file.display()));
        let mut collector = Collector {
            refs: FileRefs::default(),
            inline_depth: 0,
        };
        collector.visit_file(&ast);
        refs.insert(module_of(src, file), collector.refs);
    }
    let mut resolver = Resolver {
        modules: refs.keys().cloned().collect(),
        reexports: BTreeMap::new(),
    };
    for (module, file) in &refs {
        // Any `use` makes a name visible in its module and, through `super::`, below it.
        for leaf in &file.uses {
            if let Some(name) = leaf.path.last().filter(|n| *n != "*") {
                resolver
                    .reexports
                    .entry(module.clone())
                    .or_default()
                    .insert(name.clone(), leaf.path.clone());
            }
        }
    }
    let mut graph = Graph::new();
    for (module, file) in &refs {
        let private_uses = file.uses.iter().filter(|l| !l.public).map(|l| &l.path);
        let edges = graph.entry(module.clone()).or_default();
        for path in private_uses.chain(&file.paths) {
            // A glob imports from the module it names.
            let path: Vec<String> = path.iter().filter(|s| *s != "*").cloned().collect();
            if let Some(target) = resolver.defining_module(module, &path, 0) {
                if &target != module {
                    edges.insert(target);
                }
            }
        }
    }
    graph
}

/// The strongly connected components of more than one module (Tarjan's algorithm).
pub fn cycles(graph: &Graph) -> Vec<Vec<Module>> {
    struct Tarjan<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g Module, usize>,
        low: BTreeMap<&'g Module, usize>,
        stack: Vec<&'g Module>,
        on_stack: BTreeSet<&'g Module>,
        found: Vec<Vec<Module>>,
    }
    impl<'g> Tarjan<'g> {
        fn visit(&mut self, v: &'g Module) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on_stack.remove(w);
                    component.push(w.clone());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut tarjan = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !tarjan.index.contains_key(v) {
            tarjan.visit(v);
        }
    }
    tarjan.found
}

/// A module's name as a person reads it.
pub fn name(module: &Module) -> String {
    if module.is_empty() {
        "lib".to_string()
    } else {
        module.join("::")
    }
}
