//! The code's shape, as `docs/architecture.md` states it (issue 36, item 5),
//! held by a test so that it stays true:
//! - the modules of `vmm/src/vstate/` import one another one way (no
//!   cycle), the leaves being the errors, options and state below `Vm`;
//! - `Vm`'s fields are private to `vm.rs`;
//! - the shim reaches the daemon through `k7d-api`, never `k7d-vmm`, and
//!   makes no system call of its own (no `unsafe` in `shim/src`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// A file's text before its unit tests, with line comments removed.
fn code_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => &text[..],
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The sibling modules `code` names through `super::` (any depth) or
/// `crate::vstate::`.
fn imports(code: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for prefix in ["super::", "crate::vstate::"] {
        let mut rest = code;
        while let Some(i) = rest.find(prefix) {
            rest = &rest[i + prefix.len()..];
            let mut name = rest;
            while let Some(n) = name.strip_prefix("super::") {
                name = n;
            }
            let end = name
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(name.len());
            let m = &name[..end];
            if modules.contains(m) {
                out.insert(m.to_string());
            }
        }
    }
    out
}

/// A cycle of `graph`, if it has one.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut c = path[i..].to_vec();
            c.push(m.to_string());
            return Some(c);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for d in graph.get(m).into_iter().flatten() {
            if let Some(c) = visit(d, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
}

fn vstate_graph() -> BTreeMap<String, BTreeSet<String>> {
    let dir = repo().join("vmm/src/vstate");
    let files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs") && p.file_stem().is_some_and(|s| s != "mod"))
        .collect();
    let modules: BTreeSet<String> = files
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    files
        .iter()
        .map(|p| {
            let m = p.file_stem().unwrap().to_string_lossy().into_owned();
            let mut deps = imports(&code_of(p), &modules);
            deps.remove(&m);
            (m, deps)
        })
        .collect()
}

#[test]
fn vstate_modules_import_one_another_one_way() {
    let graph = vstate_graph();
    assert!(
        graph.len() > 15,
        "vmm/src/vstate has {} modules: {graph:?}",
        graph.len()
    );
    // The leaves below `Vm` import nothing that builds or drives one.
    for leaf in ["error", "options", "kvm", "control", "memory", "persist", "snapshot"] {
        let deps = &graph[leaf];
        for above in ["vm", "builder", "fork", "device_manager", "shell"] {
            assert!(!deps.contains(above), "{leaf}.rs imports {above}.rs: {deps:?}");
        }
    }
    assert!(
        !graph["device_manager"].contains("vm"),
        "device_manager.rs imports vm.rs"
    );
    if let Some(c) = cycle(&graph) {
        panic!("vmm/src/vstate imports in a circle: {}", c.join(" -> "));
    }
}

/// The check above finds a circle where there is one.
#[test]
fn the_cycle_check_finds_a_planted_cycle() {
    let mut graph = vstate_graph();
    graph.get_mut("error").unwrap().insert("vm".into());
    let c = cycle(&graph).expect("error -> vm -> error is a cycle");
    assert!(
        c.contains(&"vm".to_string()) && c.contains(&"error".to_string()),
        "{c:?}"
    );
    let modules: BTreeSet<String> = ["vm", "error"].iter().map(|s| s.to_string()).collect();
    assert_eq!(
        imports("use super::super::vm::Vm; use crate::vstate::error::VmError;", &modules),
        modules
    );
}

#[test]
fn vm_fields_are_private_to_vm_rs() {
    let code = code_of(&repo().join("vmm/src/vstate/vm.rs"));
    let start = code.find("pub struct Vm {").expect("vm.rs defines Vm");
    let body = &code[start..start + code[start..].find("\n}\n").expect("Vm's body ends")];
    let public: Vec<&str> = body
        .lines()
        .skip(1)
        .map(str::trim)
        .filter(|l| l.starts_with("pub"))
        .collect();
    assert!(public.is_empty(), "Vm has fields visible outside vm.rs: {public:?}");
    assert!(body.lines().count() > 10, "{body}");
}

#[test]
fn the_shim_is_a_client_of_k7d_api_and_makes_no_system_call_of_its_own() {
    let root = repo();
    let manifest = std::fs::read_to_string(root.join("shim/Cargo.toml")).unwrap();
    assert!(manifest.contains("k7d-api"), "the shim does not depend on k7d-api");
    assert!(!manifest.contains("k7d-vmm"), "the shim depends on k7d-vmm");
    let mut files = vec![root.join("shim/src")];
    let mut seen = 0;
    while let Some(p) = files.pop() {
        if p.is_dir() {
            files.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else if p.extension().is_some_and(|x| x == "rs") {
            seen += 1;
            let text = std::fs::read_to_string(&p).unwrap();
            for (n, l) in text.lines().enumerate() {
                let code = l.split("//").next().unwrap_or("");
                assert!(
                    !code.contains("unsafe"),
                    "{}:{}: the shim's system calls go through k7d-sys: {l}",
                    p.display(),
                    n + 1
                );
                assert!(
                    !code.contains("k7d_vmm"),
                    "{}:{}: the shim reaches the daemon through k7d_api: {l}",
                    p.display(),
                    n + 1
                );
            }
        }
    }
    assert!(seen > 10, "only {seen} files under shim/src");
}
