//! GGUF files in the types only the packed formats hold, against llama.cpp:
//! `scripts/reference/llamacpp_gguf_logits.py` ran llama.cpp on the small gpt-oss file (experts
//! in MXFP4) the `random_gguf` example writes from a seed, and kept the logits after a prompt
//! (`tests/fixtures/llamacpp/gpt-oss-mxfp4.json`). This test writes the same file from the seed,
//! loads it, and compares. The same weights as an MXFP4 safetensors checkpoint (OpenAI's
//! layout: `_blocks` and `_scales`, gate and up rows interleaved) load to the same logits.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use pensieve::model::{GgufHeader, ModelConfig, Transformer, WeightFormat};
use pensieve::Error;
use serde_json::{json, Value};

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

/// The small gpt-oss's Hugging Face config (as the GGUF's metadata says it).
fn hf_config() -> String {
    json!({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 300,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": false,
        "rope_theta": 10000.0, "num_local_experts": 4, "num_experts_per_tok": 2,
        "attention_bias": true, "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 7.0,
        // llama.cpp rounds YaRN's ramp out; the GGUF is read so.
        "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": true, "original_max_position_embeddings": 32},
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert":
            ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
             "lm_head"]}})
    .to_string()
}

/// GGUF MXFP4 rows (`[rows][blocks]` of an exponent and 16 bytes holding values `j` and
/// `j + 16`) as Hugging Face's blocks (16 bytes holding values `2j` and `2j + 1`) and scales.
fn hf_blocks(gguf: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let (mut blocks, mut scales) = (Vec::new(), Vec::new());
    for b in gguf.chunks(17) {
        scales.push(b[0]);
        let value = |i: usize| (b[1 + i % 16] >> (4 * (i / 16))) & 0x0F;
        blocks.extend((0..16).map(|j| value(2 * j) | value(2 * j + 1) << 4));
    }
    (blocks, scales)
}

/// The GGUF's tensors under Hugging Face's names and layouts, experts in MXFP4.
fn hf_tensors(seed: u64) -> HashMap<String, Tensor> {
    let (_, tensors) = gguf_writer::tiny_gpt_oss(seed);
    let get = |name: &str| {
        let t = tensors.iter().find(|t| t.name == name).unwrap();
        match &t.data {
            gguf_writer::Data::F32(v) => (v.clone(), Vec::new(), t.dims.clone()),
            gguf_writer::Data::Mxfp4(b) => (Vec::new(), b.clone(), t.dims.clone()),
        }
    };
    let cpu = &Device::Cpu;
    let mut out = HashMap::new();
    let put = |out: &mut HashMap<String, Tensor>, name: String, gguf: &str| {
        let (v, _, dims) = get(gguf);
        let shape: Vec<usize> = dims.iter().rev().copied().collect();
        out.insert(name, Tensor::from_vec(v, shape, cpu).unwrap());
    };
    put(
        &mut out,
        "model.embed_tokens.weight".into(),
        "token_embd.weight",
    );
    put(&mut out, "model.norm.weight".into(), "output_norm.weight");
    put(&mut out, "lm_head.weight".into(), "output.weight");
    for l in 0..2 {
        let hf = |s: &str| format!("model.layers.{l}.{s}");
        let gg = |s: &str| format!("blk.{l}.{s}");
        for (h, g) in [
            ("input_layernorm.weight", "attn_norm.weight"),
            ("self_attn.q_proj.weight", "attn_q.weight"),
            ("self_attn.q_proj.bias", "attn_q.bias"),
            ("self_attn.k_proj.weight", "attn_k.weight"),
            ("self_attn.k_proj.bias", "attn_k.bias"),
            ("self_attn.v_proj.weight", "attn_v.weight"),
            ("self_attn.v_proj.bias", "attn_v.bias"),
            ("self_attn.o_proj.weight", "attn_output.weight"),
            ("self_attn.o_proj.bias", "attn_output.bias"),
            ("self_attn.sinks", "attn_sinks.weight"),
            (
                "post_attention_layernorm.weight",
                "post_attention_norm.weight",
            ),
            ("mlp.router.weight", "ffn_gate_inp.weight"),
            ("mlp.router.bias", "ffn_gate_inp.bias"),
            ("mlp.experts.down_proj_bias", "ffn_down_exps.bias"),
        ] {
            put(&mut out, hf(h), &gg(g));
        }
        // Gate and up interleaved by output row, for the weights and the biases.
        let (gate, up) = (
            get(&gg("ffn_gate_exps.weight")),
            get(&gg("ffn_up_exps.weight")),
        );
        let (k, ff, experts) = (gate.2[0], gate.2[1], gate.2[2]);
        let row = k / 32 * 17;
        let mut fused = Vec::new();
        for r in 0..experts * ff {
            fused.extend_from_slice(&gate.1[r * row..][..row]);
            fused.extend_from_slice(&up.1[r * row..][..row]);
        }
        let mxfp4 = |out: &mut HashMap<String, Tensor>, name: &str, gguf: &[u8], rows, k| {
            let (blocks, scales) = hf_blocks(gguf);
            let name = hf(&format!("mlp.experts.{name}"));
            let blocks = Tensor::from_vec(blocks, (experts, rows, k / 32, 16), cpu).unwrap();
            let scales = Tensor::from_vec(scales, (experts, rows, k / 32), cpu).unwrap();
            out.insert(format!("{name}_blocks"), blocks);
            out.insert(format!("{name}_scales"), scales);
        };
        mxfp4(&mut out, "gate_up_proj", &fused, 2 * ff, k);
        let down = get(&gg("ffn_down_exps.weight"));
        mxfp4(&mut out, "down_proj", &down.1, down.2[1], down.2[0]);
        let (gb, ub) = (
            get(&gg("ffn_gate_exps.bias")).0,
            get(&gg("ffn_up_exps.bias")).0,
        );
        let bias: Vec<f32> = gb.iter().zip(&ub).flat_map(|(g, u)| [*g, *u]).collect();
        let bias = Tensor::from_vec(bias, (experts, 2 * ff), cpu).unwrap();
        out.insert(hf("mlp.experts.gate_up_proj_bias"), bias);
    }
    out
}

#[test]
fn an_mxfp4_safetensors_checkpoint_loads_as_its_gguf() {
    let (seed, prompt) = (3, [5u32, 17, 123, 44, 299, 0, 8, 61, 200, 150]);
    let file = write(seed);
    let gguf = checkpoint::logits(&load(&file, WeightFormat::Packed).unwrap(), &prompt);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    candle_core::safetensors::save(&hf_tensors(seed), &path).unwrap();
    let config = ModelConfig::from_hf_json(&hf_config()).unwrap();
    let m =
        Transformer::from_safetensors(config, &[path], WeightFormat::Packed, &Device::Cpu).unwrap();
    let hf = checkpoint::logits(&m, &prompt);
    checkpoint::assert_close("MXFP4 safetensors vs the same GGUF", &hf, &gguf, 1e-6);
}
