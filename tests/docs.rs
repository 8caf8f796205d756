//! The documentation's links resolve: every `[text](target)` in README.md, STATUS.md,
//! CHANGELOG.md, ARCHITECTURE.md and docs/*.md names a file or folder of the repository, and
//! every `#anchor` names a heading of the page it points to (GitHub's heading ids).
//! File names a user types from them name this version.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The pages whose links are checked.
fn pages(root: &Path) -> Vec<PathBuf> {
    let mut pages: Vec<PathBuf> =
        ["README.md", "STATUS.md", "CHANGELOG.md", "ARCHITECTURE.md"].iter().map(|p| root.join(p)).collect();
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// The text of a page outside fenced code blocks and inline code spans (replaced by spaces),
/// where a link is a link.
fn prose(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            out.push('\n');
            continue;
        }
        if fenced {
            out.push('\n');
            continue;
        }
        let mut in_code = false;
        for c in line.chars() {
            if c == '`' {
                in_code = !in_code;
                out.push(' ');
            } else {
                out.push(if in_code { ' ' } else { c });
            }
        }
        out.push('\n');
    }
    out
}

/// Every `[text](target)` target of a page (inline links; images too).
fn links(text: &str) -> Vec<String> {
    let text = prose(text);
    let bytes = text.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while let Some(at) = text[i..].find("](") {
        let start = i + at + 2;
        // The link text must open with '[' on the same line, before the "](".
        let before = &text[..i + at];
        let line_start = before.rfind('\n').map_or(0, |n| n + 1);
        if before[line_start..].contains('[') {
            if let Some(len) = text[start..].find([')', ' ', '\n']) {
                if bytes[start + len] == b')' {
                    found.push(text[start..start + len].to_string());
                }
            }
        }
        i = start;
    }
    found
}

/// GitHub's id for a heading: lowercase; letters, digits, '-' and '_' kept; spaces to '-';
/// everything else dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The ids of a page's headings, a repeated one numbered as GitHub numbers it (`x`, `x-1`, ...).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let heading = line.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base = slug(heading);
        let mut id = base.clone();
        let mut n = 0;
        while ids.contains(&id) {
            n += 1;
            id = format!("{base}-{n}");
        }
        ids.insert(id);
    }
    ids
}

/// What is wrong with the links of the page at `page` (empty when nothing is).
fn broken_links(root: &Path, page: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(page).unwrap();
    let name = page.strip_prefix(root).unwrap_or(page).display().to_string();
    let mut broken = Vec::new();
    for target in links(&text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (file, anchor) = match target.split_once('#') {
            Some((f, a)) => (f, Some(a)),
            None => (target.as_str(), None),
        };
        let path = if file.is_empty() { page.to_path_buf() } else { page.parent().unwrap().join(file) };
        if !path.exists() {
            broken.push(format!("{name}: {target} (no such file)"));
            continue;
        }
        if let Some(anchor) = anchor {
            if !path.extension().is_some_and(|e| e == "md") {
                broken.push(format!("{name}: {target} (an anchor into a file that is not markdown)"));
            } else if !anchors(&std::fs::read_to_string(&path).unwrap()).contains(anchor) {
                broken.push(format!("{name}: {target} (no such heading)"));
            }
        }
    }
    broken
}

#[test]
fn every_link_in_the_docs_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut broken = Vec::new();
    let mut count = 0;
    for page in pages(root) {
        count += links(&std::fs::read_to_string(&page).unwrap()).len();
        broken.extend(broken_links(root, &page));
    }
    assert!(count > 50, "only {count} links found: is the parser broken?");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_readme_keeps_the_quick_start_commands() {
    // CI (.ci/run) runs the README's two quick-start commands literally.
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let at = text.find("## Quick start").expect("README has a Quick start section");
    let section = &text[at..];
    let demo = section.find("\nbash scripts/demo.sh\n").expect("bash scripts/demo.sh");
    let test = section.find("\nbash scripts/test.sh\n").expect("bash scripts/test.sh");
    assert!(demo < test, "the demo comes first");
}

#[test]
fn the_checker_finds_what_is_broken_and_only_that() {
    assert_eq!(slug("Pools across machines: `tcp://` channels"), "pools-across-machines-tcp-channels");
    assert_eq!(slug("Mixed Python/C++ deployments: the wheel"), "mixed-pythonc-deployments-the-wheel");
    assert_eq!(slug("Share once, lease many: `register`, `recv_batch`"), "share-once-lease-many-register-recv_batch");
    assert_eq!(slug("1.3"), "13");
    let ids = anchors("# A\n## B c\n```\n# not a heading\n```\n## B c\n#no\n");
    assert_eq!(ids, ["a", "b-c", "b-c-1"].iter().map(|s| s.to_string()).collect());
    assert_eq!(
        links("[a](x.md) `[b](code.md)` ![i](p.png)\n```\n[c](fenced.md)\n```\n[d](y.md#z) [e](has space)"),
        vec!["x.md", "p.png", "y.md#z"]
    );

    let dir = std::env::temp_dir().join(format!("devshare-docs-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("docs")).unwrap();
    std::fs::write(dir.join("docs/b.md"), "# B\n\n## Here it is\n").unwrap();
    let page = dir.join("docs/a.md");
    std::fs::write(
        &page,
        "# A\n[ok](b.md#here-it-is) [self](#a) [up](../docs)\n\
         [gone](c.md) [bad anchor](b.md#not-here) [own](#nope)\n",
    )
    .unwrap();
    let broken = broken_links(&dir, &page);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        broken,
        vec![
            "docs/a.md: c.md (no such file)",
            "docs/a.md: b.md#not-here (no such heading)",
            "docs/a.md: #nope (no such heading)",
        ]
    );
}

/// The file names a user types from the docs (`libdevshare.so.X.Y.Z`, `devshare-X.Y.Z...` wheels
/// and archives) name this version, or none (`<version>`): 1.9.0's stayed in the docs until
/// 1.18.3.
#[test]
fn file_names_in_the_user_docs_name_this_version() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let version = env!("CARGO_PKG_VERSION");
    let mut stale = Vec::new();
    let mut user_pages: Vec<PathBuf> = pages(root).into_iter().filter(|p| !p.ends_with("CHANGELOG.md")).collect();
    user_pages.push(root.join("python/README.md"));
    for page in user_pages {
        let text = std::fs::read_to_string(&page).unwrap();
        for prefix in ["libdevshare.so.", "devshare-"] {
            for (at, _) in text.match_indices(prefix) {
                let rest = &text[at + prefix.len()..];
                let named: String = rest.chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
                let named = named.trim_end_matches('.');
                // A full X.Y.Z only (the soname `libdevshare.so.1` names no release).
                if named.split('.').count() == 3 && named != version {
                    stale.push(format!("{}: {prefix}{named}", page.strip_prefix(root).unwrap().display()));
                }
            }
        }
    }
    assert!(stale.is_empty(), "file names of another version than {version}:\n{}", stale.join("\n"));
}
