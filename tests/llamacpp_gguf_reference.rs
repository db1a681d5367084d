//! GGUF files in the types only the packed formats hold, against llama.cpp:
//! `scripts/reference/llamacpp_gguf_logits.py` ran llama.cpp on the small gpt-oss file (experts
//! in MXFP4) the `random_gguf` example writes from a seed, and kept the logits after a prompt
//! (`tests/fixtures/llamacpp/gpt-oss-mxfp4.json`). This test writes the same file from the seed,
//! loads it, and compares.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::Device;
use pensieve::model::{GgufHeader, Transformer, WeightFormat};
use pensieve::Error;
use serde_json::Value;

#[allow(dead_code)]
#[path = "common/checkpoint.rs"]
mod checkpoint;
#[path = "common/gguf_writer.rs"]
mod gguf_writer;

/// Largest difference allowed, relative to the largest logit: llama.cpp rounds the experts'
/// activations to 8 bits with f16 scales, pensieve with f32 scales.
const TOLERANCE: f32 = 1e-2;

fn fixture() -> Value {
    let path = format!(
        "{}/tests/fixtures/llamacpp/gpt-oss-mxfp4.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn write(seed: u64) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    let (meta, tensors) = gguf_writer::tiny_gpt_oss(seed);
    gguf_writer::write(file.path(), &meta, &tensors).unwrap();
    file
}

fn load(file: &tempfile::NamedTempFile, format: WeightFormat) -> pensieve::Result<Transformer> {
    let mut r = std::fs::File::open(file.path()).unwrap();
    let header = GgufHeader::read(&mut r)?;
    Transformer::from_gguf(&header, &mut r, format, &Device::Cpu)
}

#[test]
fn gpt_oss_with_mxfp4_experts_matches_llamacpp() {
    let fixture = fixture();
    let file = write(fixture["seed"].as_u64().unwrap());
    let prompt: Vec<u32> = serde_json::from_value(fixture["prompt"].clone()).unwrap();
    let theirs: Vec<f32> = serde_json::from_value(fixture["logits"].clone()).unwrap();
    let m = load(&file, WeightFormat::Packed).unwrap();
    let ours = checkpoint::logits(&m, &prompt);
    let name = format!("gpt-oss MXFP4 GGUF vs {}", fixture["reference"]);
    checkpoint::assert_close(&name, &ours, &theirs, TOLERANCE);
}

#[test]
fn mxfp4_outside_the_packed_format_is_refused_by_tensor() {
    let file = write(1);
    let Err(e) = load(&file, WeightFormat::F32) else {
        panic!("MXFP4 experts loaded as f32");
    };
    let text = e.to_string();
    assert!(
        matches!(e, Error::InvalidModel { .. })
            && text.contains("ffn_gate_exps")
            && text.contains("Mxfp4"),
        "{text}"
    );
}
