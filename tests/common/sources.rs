//! Every source file of the crate, for the tests that read its code (`syn`) rather than run it.

use std::path::Path;

/// Every `.rs` file under `src/` (the binaries' folder aside), as (path under `src/`, text)
/// pairs in path order.
pub fn crate_sources() -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &src, &mut files);
    files
}

fn sources(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        let rel = p
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if p.is_dir() && rel != "bin" {
            sources(&p, root, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push((rel, std::fs::read_to_string(&p).unwrap()));
        }
    }
}

/// The module path of the file `file` (a path under `src/`): `crate::a::b` for `a/b.rs` and
/// `a/b/mod.rs`.
pub fn module_path(file: &str) -> Vec<String> {
    let file = file.trim_end_matches(".rs");
    let mut parts: Vec<String> = std::iter::once("crate".to_string())
        .chain(file.split('/').map(str::to_string))
        .collect();
    if matches!(parts.last().map(String::as_str), Some("lib" | "mod")) {
        parts.pop();
    }
    parts
}
