//! The layer rule of `docs/ARCHITECTURE.md`: the KV bookkeeping (`src/kv`) and the scheduler
//! move ids only. They use no candle type and know nothing of the model, the attention op or
//! the engine, so they unit-test without a model and the tiers below host can grow there.

#![allow(clippy::panic)]

use std::path::{Path, PathBuf};

/// Paths (crate-relative) that must stay free of tensors and models.
const ID_LAYER: [&str; 3] = ["src/kv", "src/scheduler.rs", "src/scheduler"];

/// What those files must not name.
const FORBIDDEN: [&str; 6] = [
    "candle_core",
    "candle_nn",
    "candle_transformers",
    "crate::model",
    "crate::attention",
    "crate::engine",
];

fn rust_files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        entries.sort();
        for p in entries {
            rust_files(&p, out);
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        out.push(path.to_path_buf());
    }
}

#[test]
fn kv_and_scheduler_use_no_tensor_or_model_type() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for p in ID_LAYER {
        rust_files(&root.join(p), &mut files);
    }
    assert!(
        files.len() >= 6,
        "expected the kv and scheduler files, found {files:?}"
    );
    let mut offences = Vec::new();
    for file in &files {
        let text =
            std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for word in FORBIDDEN.iter().filter(|w| code.contains(*w)) {
                offences.push(format!("{}:{}: {word}", file.display(), n + 1));
            }
        }
    }
    assert!(
        offences.is_empty(),
        "layer rule broken:\n{}",
        offences.join("\n")
    );
}
