//! The layer rule of the crate, checked on its sources: every `crate::...` path a file names
//! (in `use` lines or inline, comments excluded) must point to its own module or to a lower
//! layer, the files must form no cycle, and there are at most 7 layers.
//!
//! ```text
//! 7 capi
//! 6 torch, dlpack, channel          (clients of the core)
//! 5 export, import
//! 4 backend, refcounter
//! 3 handle, loader, fds
//! 2 shm, fork, dtype, hostid        (primitives)
//! 1 error
//! ```
//!
//! Never: a backend that knows a transport; an exporter or import that names the channel; a
//! primitive that calls the registry. Inside the channel, the two transports (`channel/unix/`,
//! `channel/tcp/`) never name each other, and no channel file names a vendor backend
//! (`backend::acl`, `backend::cuda`): what they share is in `channel/` itself. A lower module that must call up defines a trait the
//! higher one implements (`export::LeaseServer`, `import::Lease`, `fork::ForkHook`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const LAYERS: &[(&str, u32)] = &[
    ("capi", 7),
    ("torch", 6),
    ("dlpack", 6),
    ("channel", 6),
    ("export", 5),
    ("import", 5),
    ("backend", 4),
    ("refcounter", 4),
    ("handle", 3),
    ("loader", 3),
    ("fds", 3),
    ("shm", 2),
    ("fork", 2),
    ("dtype", 2),
    ("hostid", 2),
    ("error", 1),
];

fn layer(module: &str) -> Option<u32> {
    LAYERS.iter().find(|(m, _)| *m == module).map(|&(_, l)| l)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file without comments (line comments, doc comments, block comments).
fn code(text: &str) -> String {
    let mut out = String::new();
    let mut in_block = 0usize;
    for line in text.lines() {
        let mut l = line;
        if in_block > 0 {
            match l.find("*/") {
                Some(i) => {
                    in_block -= 1;
                    l = &l[i + 2..];
                }
                None => continue,
            }
        }
        if let Some(i) = l.find("/*") {
            if !l[i..].contains("*/") {
                in_block += 1;
            }
            l = &l[..i];
        }
        let l = match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        };
        out.push_str(l);
        out.push('\n');
    }
    out
}

/// The `crate::a::b::...` paths named in `code`, as their segments.
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // e.g. `foo_crate::`
        }
        let mut segs = Vec::new();
        let mut r = rest;
        loop {
            let end = r.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(r.len());
            if end == 0 {
                break;
            }
            segs.push(r[..end].to_string());
            if r[end..].starts_with("::") {
                r = &r[end + 2..];
            } else {
                break;
            }
        }
        if !segs.is_empty() {
            out.push(segs);
        }
    }
    out
}

/// The file a `crate::` path points into: the deepest module file that exists.
fn file_of(src: &Path, segs: &[String]) -> Option<PathBuf> {
    let mut best = None;
    let mut dir = src.to_path_buf();
    for s in segs {
        let f = dir.join(format!("{s}.rs"));
        let m = dir.join(s).join("mod.rs");
        if f.is_file() {
            best = Some(f);
        } else if m.is_file() {
            best = Some(m);
        } else {
            break;
        }
        dir = dir.join(s);
    }
    best
}

fn top_module(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next().unwrap().as_os_str().to_string_lossy().to_string();
    first.trim_end_matches(".rs").to_string()
}

#[test]
fn no_module_names_a_higher_layer_and_there_are_no_cycles_and_at_most_7_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut upward = Vec::new();
    let mut unknown = BTreeSet::new();
    let mut file_edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    let mut module_edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        if f.ends_with("lib.rs") {
            continue;
        }
        let from = top_module(&src, f);
        let Some(from_layer) = layer(&from) else {
            unknown.insert(from.clone());
            continue;
        };
        let text = std::fs::read_to_string(f).unwrap();
        for segs in crate_paths(&code(&text)) {
            let to = &segs[0];
            let Some(to_layer) = layer(to) else {
                continue; // a re-export at the crate root (Error, Result, Status)
            };
            if to != &from {
                if to_layer >= from_layer {
                    upward.push(format!(
                        "{} (layer {from_layer}) names crate::{} (layer {to_layer})",
                        f.strip_prefix(&src).unwrap().display(),
                        segs.join("::")
                    ));
                }
                module_edges.entry(from.clone()).or_default().insert(to.clone());
            }
            if let Some(target) = file_of(&src, &segs) {
                if &target != f {
                    file_edges.entry(f.clone()).or_default().insert(target);
                }
            }
        }
    }
    assert!(unknown.is_empty(), "modules with no layer in tests/layers.rs: {unknown:?}");
    assert!(upward.is_empty(), "imports against the layer rule:\n{}", upward.join("\n"));

    // No cycle among files: depth-first search with colours.
    fn visit(
        n: &PathBuf,
        edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        state: &mut BTreeMap<PathBuf, u8>,
        stack: &mut Vec<PathBuf>,
    ) -> Option<Vec<PathBuf>> {
        match state.get(n) {
            Some(2) => return None,
            Some(1) => {
                let i = stack.iter().position(|x| x == n).unwrap();
                return Some(stack[i..].to_vec());
            }
            _ => {}
        }
        state.insert(n.clone(), 1);
        stack.push(n.clone());
        for m in edges.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, edges, state, stack) {
                return Some(c);
            }
        }
        stack.pop();
        state.insert(n.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for f in file_edges.keys() {
        if let Some(cycle) = visit(f, &file_edges, &mut state, &mut Vec::new()) {
            let names: Vec<_> = cycle.iter().map(|p| p.strip_prefix(&src).unwrap().display().to_string()).collect();
            panic!("a cycle of crate:: imports among files: {}", names.join(" -> "));
        }
    }

    // Floors: the longest chain of module dependencies.
    fn depth(m: &str, edges: &BTreeMap<String, BTreeSet<String>>, memo: &mut BTreeMap<String, usize>) -> usize {
        if let Some(&d) = memo.get(m) {
            return d;
        }
        let d = 1 + edges.get(m).into_iter().flatten().map(|n| depth(n, edges, memo)).max().unwrap_or(0);
        memo.insert(m.to_string(), d);
        d
    }
    let mut memo = BTreeMap::new();
    let floors = module_edges.keys().map(|m| depth(m, &module_edges, &mut memo)).max().unwrap_or(1);
    println!("{} files, {floors} floors; module graph: {module_edges:?}", files.len());
    assert!(floors <= 7, "{floors} floors (at most 7)");
}

/// The paths a file names, crate-relative or `super::`-relative, as text (`a::b::c`).
fn named_paths(code: &str) -> Vec<String> {
    let mut out: Vec<String> = crate_paths(code).into_iter().map(|s| s.join("::")).collect();
    // `super::` and bare module paths (`tcp::x`, `unix::y`) as well: whatever the file writes.
    for word in code.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')) {
        let external = ["std::", "core::", "alloc::", "rustix::", "libc::", "::"].iter().any(|x| word.starts_with(x));
        if word.contains("::") && !external {
            out.push(word.trim_start_matches("crate::").to_string());
        }
    }
    out
}

/// Which of `names` (module names) `file`'s code names as a path segment.
fn names_any(file: &Path, names: &[&str]) -> Vec<String> {
    let text = code(&std::fs::read_to_string(file).unwrap());
    let mut hits = Vec::new();
    for p in named_paths(&text) {
        let segs: Vec<&str> = p.split("::").collect();
        for w in segs.windows(2) {
            if names.iter().any(|n| w.join("::") == *n) || names.iter().any(|n| w[0] == *n && !n.contains("::")) {
                hits.push(p.clone());
            }
        }
        if segs.len() == 1 && names.contains(&segs[0]) {
            hits.push(p.clone());
        }
    }
    hits.sort();
    hits.dedup();
    hits
}

#[test]
fn the_two_transports_never_name_each_other_and_no_channel_file_names_a_vendor() {
    let channel = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/channel");
    let mut wrong = Vec::new();
    for (dir, other) in [("unix", "tcp"), ("tcp", "unix")] {
        let mut files = Vec::new();
        rust_files(&channel.join(dir), &mut files);
        assert!(!files.is_empty(), "no files in channel/{dir}");
        for f in files {
            for hit in names_any(&f, &[other]) {
                wrong.push(format!("{} names {hit}", f.display()));
            }
        }
    }
    let mut files = Vec::new();
    rust_files(&channel, &mut files);
    for f in files {
        for hit in names_any(&f, &["backend::acl", "backend::cuda"]) {
            wrong.push(format!("{} names a vendor: {hit}", f.display()));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_checker_finds_what_it_must() {
    // Comments do not count; paths do, inline or in `use` lines.
    let c = code("use crate::a::b; // crate::c::d\n/// [`crate::e`]\nlet x = crate::f::g(1); /* crate::h */");
    let paths = crate_paths(&c);
    assert_eq!(paths, vec![vec!["a".to_string(), "b".to_string()], vec!["f".to_string(), "g".to_string()]]);
    assert_eq!(layer("capi"), Some(7));
    assert!(layer("channel") > layer("export") && layer("export") > layer("backend"));
    assert!(layer("backend") > layer("handle") && layer("handle") > layer("shm"));
    // The transport rule sees every way of naming the other transport or a vendor.
    let dir = std::env::temp_dir().join(format!("devshare-layers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("x.rs");
    for (text, names, hit) in [
        ("use crate::channel::tcp::ucx;", &["tcp"][..], true),
        ("use super::super::tcp::{RemotePool};", &["tcp"][..], true),
        ("let a = tcp::is_remote(x);", &["tcp"][..], true),
        ("// tcp::is_remote in a comment", &["tcp"][..], false),
        ("let t = crate::backend::acl::bare_tgid();", &["backend::acl", "backend::cuda"][..], true),
        ("let t = crate::backend::pid_for_peers();", &["backend::acl", "backend::cuda"][..], false),
        ("let stcp = 1;", &["tcp"][..], false),
        ("use std::os::unix::fs::symlink;", &["unix"][..], false),
    ] {
        std::fs::write(&f, text).unwrap();
        assert_eq!(!names_any(&f, names).is_empty(), hit, "{text}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_files_the_readme_and_architecture_md_name_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut missing = Vec::new();
    // README and ARCHITECTURE.md, the status and history pages, and every page of docs/.
    let mut docs: Vec<String> = ["README.md", "ARCHITECTURE.md", "STATUS.md", "CHANGELOG.md"].map(String::from).into();
    let mut pages: Vec<String> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| format!("docs/{}", e.unwrap().file_name().to_string_lossy()))
        .filter(|p| p.ends_with(".md"))
        .collect();
    pages.sort();
    docs.extend(pages);
    for doc in docs.iter().map(String::as_str) {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        for word in text.split(|c: char| c.is_whitespace() || "`()|,;[]".contains(c)) {
            let w = word.trim_end_matches(['.', ':']);
            let path = if w.starts_with("src/") || w.starts_with("tests/") {
                root.join(w)
            } else if doc == "ARCHITECTURE.md"
                && (w.ends_with(".rs") || (w.ends_with('/') && w.len() > 1))
                && w.chars().all(|c| c.is_ascii_lowercase() || c == '_' || c == '/' || c == '.')
            {
                // ARCHITECTURE.md names files relative to src/ (or tests/...).
                root.join("src").join(w)
            } else {
                continue;
            };
            if !path.exists() {
                missing.push(format!("{doc}: {w}"));
            }
        }
    }
    assert!(missing.is_empty(), "named but missing: {missing:?}");
}

/// The README's Layout block (between "## Layout" and the end of its code block).
fn readme_layout() -> String {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let at = text.find("## Layout").expect("README has a Layout section");
    let rest = &text[at..];
    let open = rest.find("```").expect("Layout has a code block") + 3;
    let close = rest[open..].find("```").expect("Layout's code block ends") + open;
    rest[open..close].to_string()
}

#[test]
fn the_readme_layout_names_every_source_module_and_every_channel_file() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let layout = readme_layout();
    let words: BTreeSet<&str> =
        layout.split(|c: char| c.is_whitespace() || "(),;:".contains(c)).filter(|w| !w.is_empty()).collect();
    let mut missing = Vec::new();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        let named = if p.is_dir() { format!("src/{name}/") } else { format!("src/{name}") };
        if !words.contains(named.as_str()) {
            missing.push(named);
        }
    }
    let mut files = Vec::new();
    rust_files(&src.join("channel"), &mut files);
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        if !words.contains(name.as_str()) {
            missing.push(format!("{}", f.strip_prefix(&src).unwrap().display()));
        }
        // Every folder on the way is named too (`unix/`, `producer/`).
        let mut dir = f.parent().unwrap();
        while dir != src.join("channel") {
            let d = format!("{}/", dir.file_name().unwrap().to_string_lossy());
            if !words.contains(d.as_str()) {
                missing.push(d);
            }
            dir = dir.parent().unwrap();
        }
    }
    missing.sort();
    missing.dedup();
    assert!(missing.is_empty(), "README's Layout does not name: {missing:?}");
}
