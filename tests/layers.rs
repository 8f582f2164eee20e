//! The module layers docs/ARCHITECTURE.md draws, checked on the source text:
//! no module under `src/engine/` imports a module that imports it back
//! (directly or through others; a parent counts as importing the children it
//! declares), and the source protocol (`src/source/`) names neither of its
//! implementations. A refactor that brings a cycle back fails here, naming
//! the modules and the files whose paths close it.
//!
//! The reading is textual: every `crate::engine::…` and `super::…` path
//! outside comments and `#[cfg(test)]` code, brace groups expanded, resolved
//! to the longest module prefix that is a file. The last test feeds it a
//! made-up cycle, so the check is shown to find one.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use regex::Regex;

type Module = Vec<String>;

/// Every `.rs` file under `root`, keyed by its module path (`chunked/mod.rs`
/// is `["chunked"]`, `apply/heap.rs` is `["apply", "heap"]`).
fn modules_under(root: &Path) -> BTreeMap<Module, String> {
    fn walk(dir: &Path, root: &Path, out: &mut BTreeMap<Module, String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path: PathBuf = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, root, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(root).unwrap().with_extension("");
                let mut parts: Module = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
                if parts.last().is_some_and(|p| p == "mod") {
                    parts.pop();
                }
                out.insert(parts, std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// The source without comments and without its `#[cfg(test)]` tail.
fn code_of(source: &str) -> String {
    let cut = source.find("#[cfg(test)]").map_or(source, |i| &source[..i]);
    cut.lines().map(|l| l.find("//").map_or(l, |i| &l[..i])).collect::<Vec<_>>().join("\n")
}

/// Expands `a::{b, c::{d, e}}`-style use trees into flat paths.
fn expand(prefix: &[String], tree: &str, out: &mut Vec<Module>) {
    let tree = tree.trim();
    if let Some(inner) = tree.strip_prefix('{').and_then(|t| t.strip_suffix('}')) {
        let (mut depth, mut item) = (0, String::new());
        let mut items = Vec::new();
        for ch in inner.chars() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(std::mem::take(&mut item));
                    continue;
                }
                _ => {}
            }
            item.push(ch);
        }
        items.push(item);
        for it in items.iter().map(|i| i.trim()).filter(|i| !i.is_empty()) {
            match it.split_once("::") {
                Some((head, rest)) => {
                    let mut p = prefix.to_vec();
                    if head != "self" {
                        p.push(head.to_string());
                    }
                    expand(&p, rest, out);
                }
                None if it == "self" => out.push(prefix.to_vec()),
                None => out.push([prefix, &[it.split_whitespace().next().unwrap().to_string()]].concat()),
            }
        }
    } else {
        let mut p = prefix.to_vec();
        p.extend(tree.split("::").filter(|s| !s.is_empty()).map(str::to_string));
        out.push(p);
    }
}

/// The module graph: module -> the modules it names, with the files that name them.
fn import_graph(modules: &BTreeMap<Module, String>) -> BTreeMap<Module, BTreeSet<Module>> {
    let ident = r"(\{[^;]*?\}|[A-Za-z_][A-Za-z0-9_]*)";
    let absolute = Regex::new(&format!(r"crate::engine::((?:[a-z_][a-z0-9_]*::)*){ident}")).unwrap();
    let relative = Regex::new(&format!(r"\b((?:super::)+)((?:[a-z_][a-z0-9_]*::)*){ident}")).unwrap();
    let child = Regex::new(r"(?m)^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([a-z_][a-z0-9_]*)\s*;").unwrap();
    let resolve = |path: &[String]| -> Option<Module> { (1..=path.len()).rev().map(|n| path[..n].to_vec()).find(|m| modules.contains_key(m)) };
    let mut graph: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, source) in modules {
        let code = code_of(source);
        let mut named: Vec<Module> = Vec::new();
        for c in absolute.captures_iter(&code) {
            let prefix: Module = c[1].split("::").filter(|s| !s.is_empty()).map(str::to_string).collect();
            expand(&prefix, &c[2], &mut named);
        }
        for c in relative.captures_iter(&code) {
            let up = c[1].matches("super::").count();
            let mut prefix: Module = module[..module.len().saturating_sub(up)].to_vec();
            prefix.extend(c[2].split("::").filter(|s| !s.is_empty()).map(str::to_string));
            expand(&prefix, &c[3], &mut named);
        }
        // A parent depends on the children it declares (and re-exports).
        for c in child.captures_iter(&code) {
            named.push([module.as_slice(), &[c[1].to_string()]].concat());
        }
        let edges = graph.entry(module.clone()).or_default();
        for target in named.iter().filter_map(|p| resolve(p)) {
            if &target != module {
                edges.insert(target);
            }
        }
    }
    graph
}

/// The strongly connected components of more than one module (Tarjan).
fn cycles(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct T<'a> {
        g: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<Module, usize>,
        low: BTreeMap<Module, usize>,
        stack: Vec<Module>,
        on: BTreeSet<Module>,
        out: Vec<Vec<Module>>,
    }
    impl T<'_> {
        fn visit(&mut self, v: &Module) {
            let i = self.index.len();
            self.index.insert(v.clone(), i);
            self.low.insert(v.clone(), i);
            self.stack.push(v.clone());
            self.on.insert(v.clone());
            for w in self.g.get(v).into_iter().flatten() {
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let l = self.low[v].min(self.low[w]);
                    self.low.insert(v.clone(), l);
                } else if self.on.contains(w) {
                    let l = self.low[v].min(self.index[w]);
                    self.low.insert(v.clone(), l);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on.remove(&w);
                    let done = &w == v;
                    comp.push(w);
                    if done {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.out.push(comp);
                }
            }
        }
    }
    let mut t = T { g: graph, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on: BTreeSet::new(), out: Vec::new() };
    for v in graph.keys() {
        if !t.index.contains_key(v) {
            t.visit(v);
        }
    }
    t.out
}

fn describe(graph: &BTreeMap<Module, BTreeSet<Module>>, comp: &[Module]) -> String {
    let name = |m: &Module| m.join("/");
    let mut lines = Vec::new();
    for a in comp {
        for b in graph[a].iter().filter(|b| comp.contains(b)) {
            lines.push(format!("  {} -> {}", name(a), name(b)));
        }
    }
    lines.join("\n")
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn no_engine_module_imports_a_module_that_imports_it_back() {
    let modules = modules_under(&src().join("engine"));
    assert!(modules.len() > 20, "read {} engine modules: the walk found too few to mean anything", modules.len());
    let graph = import_graph(&modules);
    // The layers the docs name, as edges the reading must find (so a reading
    // that finds nothing cannot pass): transitions above state, state above rules.
    for (a, b) in [("stream", "state"), ("state", "rules"), ("chunked", "rules"), ("machine", "chunked"), ("apply", "apply/decide")] {
        let (a, b): (Module, Module) = (a.split('/').map(str::to_string).collect(), b.split('/').map(str::to_string).collect());
        assert!(graph[&a].contains(&b), "{} should import {}: the reading of the source missed it", a.join("/"), b.join("/"));
    }
    let found = cycles(&graph);
    let text: Vec<String> = found.iter().map(|c| describe(&graph, c)).collect();
    assert!(found.is_empty(), "modules under src/engine/ that import each other back:\n{}", text.join("\n\n"));
}

#[test]
fn the_source_protocol_names_neither_implementation() {
    let modules = modules_under(&src().join("source"));
    assert!(!modules.is_empty());
    let named = Regex::new(r"crate::(sim|mssql)\b").unwrap();
    for (module, source) in &modules {
        let code = code_of(source);
        let hits: Vec<&str> = named.find_iter(&code).map(|m| m.as_str()).collect();
        assert!(hits.is_empty(), "src/source/{} names {:?}: the URL factory (src/connect.rs) is the one place that does", module.join("/"), hits);
    }
}

#[test]
fn the_check_finds_a_cycle_it_is_shown() {
    let mut modules = BTreeMap::new();
    modules.insert(vec!["a".to_string()], "use super::b::thing;\n".to_string());
    modules.insert(vec!["b".to_string()], "pub fn thing() { crate::engine::c::{self, X}; }\n".to_string());
    modules.insert(vec!["c".to_string()], "use crate::engine::{a::{self}, d};\n// use crate::engine::e; (a comment names nothing)\n".to_string());
    modules.insert(vec!["d".to_string()], "mod inner;\n".to_string());
    modules.insert(vec!["d".to_string(), "inner".to_string()], "use super::Thing;\n".to_string());
    modules.insert(vec!["e".to_string()], "use crate::engine::a;\n".to_string());
    let graph = import_graph(&modules);
    let found = cycles(&graph);
    let as_text: Vec<Vec<String>> = found.iter().map(|c| c.iter().map(|m| m.join("/")).collect()).collect();
    assert_eq!(as_text, vec![vec!["a".to_string(), "b".into(), "c".into()], vec!["d".to_string(), "d/inner".into()]]);
}
