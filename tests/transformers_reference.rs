//! The architectures against Hugging Face `transformers`, on seeded random weights of small
//! configs: `scripts/reference/transformers_logits.py` ran `transformers` on the checkpoint
//! the `random_checkpoint` example writes from each fixture's config and seed, and kept the
//! logits after the fixture's prompt (`tests/fixtures/transformers`). This test writes the
//! same checkpoint from the seed, loads it, and compares (both compute in f32), under the
//! config as written and as transformers 5 saves it (`saved_config`: `rope_parameters`,
//! renamed fields), which must load to the same logits.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use serde_json::Value;

#[path = "common/checkpoint.rs"]
mod checkpoint;

/// Largest difference allowed, relative to the largest logit.
const TOLERANCE: f32 = 1e-4;

fn check(name: &str) {
    let path = format!(
        "{}/tests/fixtures/transformers/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let json = fixture["config"].to_string();
    let seed = fixture["seed"].as_u64().unwrap();
    let prompt: Vec<u32> = serde_json::from_value(fixture["prompt"].clone()).unwrap();
    let theirs: Vec<f32> = serde_json::from_value(fixture["logits"].clone()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    checkpoint::write(dir.path(), &json, seed);
    let ours = checkpoint::last_logits(dir.path(), &json, &prompt);
    let reference = &fixture["reference"];
    checkpoint::assert_close(&format!("{name} vs {reference}"), &ours, &theirs, TOLERANCE);
    let saved = fixture["saved_config"].to_string();
    let ours = checkpoint::last_logits(dir.path(), &saved, &prompt);
    let name = format!("{name} saved by {}, vs {reference}", fixture["saved_by"]);
    checkpoint::assert_close(&name, &ours, &theirs, TOLERANCE);
}

#[test]
fn phi3_with_partial_rotary_and_longrope_matches_transformers() {
    check("phi3_longrope_partial");
}

#[test]
fn yarn_scaling_matches_transformers() {
    check("qwen3_yarn");
    check("llama_yarn_mscale");
}

#[test]
fn qwen3_moe_matches_transformers() {
    check("qwen3_moe");
    check("qwen3_moe_unnormalized");
}

#[test]
fn gpt_oss_matches_transformers() {
    check("gpt_oss");
}

#[test]
fn mixtral_matches_transformers() {
    check("mixtral");
}
