//! Every architecture's graph against candle-transformers' implementation of it, on random
//! weights: a safetensors checkpoint with its `config.json` is written by the test, loaded by
//! both, and the logits after a 24-token prompt compared (tight tolerance: both compute in f32).
//! Refusals are typed errors raised before any weight is read: another architecture, a tensor
//! the graph would not use, a missing tensor, settings the graph does not implement.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use pensieve::model::{ModelConfig, Transformer, WeightFormat};
use pensieve::Error;

#[path = "common/checkpoint.rs"]
mod checkpoint;

const PROMPT: usize = 24;
/// Largest difference allowed, relative to the largest logit.
const TOLERANCE: f32 = 1e-4;

const COMMON: &str = r#""vocab_size":300,"hidden_size":64,"intermediate_size":128,
    "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"rms_norm_eps":1e-6,
    "max_position_embeddings":256,"tie_word_embeddings":false"#;

fn config_json(arch: &str, extra: &str) -> String {
    format!(r#"{{"architectures":["{arch}"],{COMMON},{extra}}}"#)
}

fn write_checkpoint(dir: &Path, json: &str) -> ModelConfig {
    checkpoint::write(dir, json, 42)
}

fn prompt() -> Vec<u32> {
    (0..PROMPT as u32).map(|i| (i * 37 + 11) % 300).collect()
}

fn ours(dir: &Path, json: &str) -> Vec<f32> {
    checkpoint::last_logits(dir, json, &prompt())
}

fn vb(dir: &Path) -> VarBuilder<'static> {
    unsafe {
        VarBuilder::from_mmaped_safetensors(
            &[dir.join("model.safetensors")],
            DType::F32,
            &Device::Cpu,
        )
    }
    .unwrap()
}

fn input() -> Tensor {
    Tensor::new(prompt().as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap()
}

fn compare(name: &str, ours: &[f32], theirs: &Tensor) {
    let theirs = theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    checkpoint::assert_close(name, ours, &theirs, TOLERANCE);
}

#[test]
fn llama_with_llama3_rope_scaling_matches_candle() {
    use candle_transformers::models::llama;
    let dir = tempfile::tempdir().unwrap();
    let json = config_json(
        "LlamaForCausalLM",
        r#""rope_theta":500000.0,"rope_scaling":{"rope_type":"llama3","factor":8.0,
           "low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":64}"#,
    );
    write_checkpoint(dir.path(), &json);
    let cfg: llama::LlamaConfig = serde_json::from_str(&json).unwrap();
    let cfg = cfg.into_config(false);
    let model = llama::Llama::load(vb(dir.path()), &cfg).unwrap();
    let mut cache = llama::Cache::new(true, DType::F32, &cfg, &Device::Cpu).unwrap();
    let theirs = model.forward(&input(), 0, &mut cache).unwrap();
    compare(
        "llama (Transformer 3 scaling)",
        &ours(dir.path(), &json),
        &theirs,
    );
}

#[test]
fn mistral_matches_candle() {
    use candle_transformers::models::mistral;
    let dir = tempfile::tempdir().unwrap();
    let json = config_json(
        "MistralForCausalLM",
        r#""rope_theta":1000000.0,"head_dim":16,"sliding_window":null,"hidden_act":"silu""#,
    );
    write_checkpoint(dir.path(), &json);
    let cfg: mistral::Config = serde_json::from_str(&json).unwrap();
    let mut model = mistral::Model::new(&cfg, vb(dir.path())).unwrap();
    compare(
        "mistral",
        &ours(dir.path(), &json),
        &model.forward(&input(), 0).unwrap(),
    );
}

#[test]
fn qwen2_with_biases_matches_candle() {
    use candle_transformers::models::qwen2;
    let dir = tempfile::tempdir().unwrap();
    let json = config_json(
        "Qwen2ForCausalLM",
        r#""rope_theta":1000000.0,"sliding_window":256,"max_window_layers":2,
           "use_sliding_window":false,"hidden_act":"silu""#,
    );
    write_checkpoint(dir.path(), &json);
    let cfg: qwen2::Config = serde_json::from_str(&json).unwrap();
    let mut model = qwen2::ModelForCausalLM::new(&cfg, vb(dir.path())).unwrap();
    compare(
        "qwen2",
        &ours(dir.path(), &json),
        &model.forward(&input(), 0).unwrap(),
    );
}

#[test]
fn qwen3_with_qk_norms_matches_candle() {
    use candle_transformers::models::qwen3;
    let dir = tempfile::tempdir().unwrap();
    let json = config_json(
        "Qwen3ForCausalLM",
        r#""rope_theta":1000000.0,"head_dim":24,"attention_bias":false,"sliding_window":null,
           "max_window_layers":2,"use_sliding_window":false,"hidden_act":"silu""#,
    );
    write_checkpoint(dir.path(), &json);
    let cfg: qwen3::Config = serde_json::from_str(&json).unwrap();
    let mut model = qwen3::ModelForCausalLM::new(&cfg, vb(dir.path())).unwrap();
    compare(
        "qwen3",
        &ours(dir.path(), &json),
        &model.forward(&input(), 0).unwrap(),
    );
}

#[test]
fn qwen3_moe_matches_candle() {
    use candle_transformers::models::qwen3_moe;
    let dir = tempfile::tempdir().unwrap();
    // Eight experts, two per token: with 24 tokens every expert gets rows and some none.
    let json = config_json(
        "Qwen3MoeForCausalLM",
        r#""rope_theta":1000000.0,"head_dim":24,"attention_bias":false,"sliding_window":null,
           "max_window_layers":2,"use_sliding_window":false,"hidden_act":"silu",
           "decoder_sparse_step":1,"moe_intermediate_size":48,"num_experts_per_tok":2,
           "num_experts":8,"norm_topk_prob":true"#,
    );
    let config = write_checkpoint(dir.path(), &json);
    assert_eq!(config.experts.map(|e| (e.count, e.per_token)), Some((8, 2)));
    let cfg: qwen3_moe::Config = serde_json::from_str(&json).unwrap();
    let mut model = qwen3_moe::ModelForCausalLM::new(&cfg, vb(dir.path())).unwrap();
    compare(
        "qwen3moe",
        &ours(dir.path(), &json),
        &model.forward(&input(), 0).unwrap(),
    );
}

#[test]
fn mixtral_matches_candle() {
    use candle_transformers::models::mixtral;
    let dir = tempfile::tempdir().unwrap();
    let json = config_json(
        "MixtralForCausalLM",
        r#""rope_theta":1000000.0,"sliding_window":4096,"hidden_act":"silu",
           "num_local_experts":4,"num_experts_per_tok":2,"use_flash_attn":false"#,
    );
    write_checkpoint(dir.path(), &json);
    let cfg: mixtral::Config = serde_json::from_str(&json).unwrap();
    let mut model = mixtral::Model::new(&cfg, vb(dir.path())).unwrap();
    compare(
        "mixtral",
        &ours(dir.path(), &json),
        &model.forward(&input(), 0).unwrap(),
    );
}

#[test]
fn phi3_with_fused_projections_matches_candle() {
    use candle_transformers::models::phi3;
    let dir = tempfile::tempdir().unwrap();
    let json = config_json(
        "Phi3ForCausalLM",
        r#""rope_theta":10000.0,"hidden_act":"silu","sliding_window":2047,
           "original_max_position_embeddings":256,"rope_scaling":null"#,
    );
    let config = write_checkpoint(dir.path(), &json);
    assert_eq!(config.layer_windows, vec![Some(2047); 2]);
    let cfg: phi3::Config = serde_json::from_str(&json).unwrap();
    let mut model = phi3::Model::new(&cfg, vb(dir.path())).unwrap();
    compare(
        "phi3",
        &ours(dir.path(), &json),
        &model.forward(&input(), 0).unwrap(),
    );
}

#[test]
fn gemma3_matches_candle() {
    use candle_transformers::models::gemma3;
    let dir = tempfile::tempdir().unwrap();
    // candle scales scores by head_dim^-1/2 whatever query_pre_attn_scalar says, lets a window
    // see one key more than Gemma does, and its KV cache takes one KV head only: the scalar is
    // the head size here (as in every Gemma 3 but the 27B), one KV head (as Gemma 3 270M), and
    // the prompt fits the window (the real-weight tests against llama.cpp cover windows).
    let json = config_json(
        "Gemma3ForCausalLM",
        r#""head_dim":32,"query_pre_attn_scalar":32,"rope_theta":1000000.0,
           "rope_local_base_freq":10000.0,"sliding_window":32,"sliding_window_pattern":2,
           "hidden_activation":"gelu_pytorch_tanh","attention_bias":false,
           "final_logit_softcapping":null,"attn_logit_softcapping":null"#,
    )
    .replace(
        r#""tie_word_embeddings":false"#,
        r#""tie_word_embeddings":true"#,
    )
    .replace(r#""num_key_value_heads":2"#, r#""num_key_value_heads":1"#);
    let config = write_checkpoint(dir.path(), &json);
    assert_eq!(config.layer_windows, vec![Some(32), None]);
    let cfg: gemma3::Config = serde_json::from_str(&json).unwrap();
    let mut model = gemma3::Model::new(false, &cfg, vb(dir.path())).unwrap();
    compare(
        "gemma3",
        &ours(dir.path(), &json),
        &model.forward(&input(), 0).unwrap(),
    );
}

fn refused(dir: &Path, json: &str) -> String {
    let config = ModelConfig::from_hf_json(json).unwrap();
    let e = Transformer::from_safetensors(
        config,
        &[dir.join("model.safetensors")],
        WeightFormat::F32,
        &Device::Cpu,
    )
    .unwrap_err();
    assert!(matches!(e, Error::InvalidModel { .. }), "{e}");
    e.to_string()
}

#[test]
fn checkpoints_that_do_not_fit_the_graph_are_refused_before_loading() {
    let dir = tempfile::tempdir().unwrap();
    // Qwen2 weights (with biases) under a Llama config: the biases would be ignored.
    let qwen = config_json("Qwen2ForCausalLM", r#""rope_theta":10000.0"#);
    write_checkpoint(dir.path(), &qwen);
    let llama = config_json("LlamaForCausalLM", r#""rope_theta":10000.0"#);
    let msg = refused(dir.path(), &llama);
    assert!(
        msg.contains("self_attn.q_proj.bias") && msg.contains("would not use"),
        "{msg}"
    );
    // Llama weights under a Qwen3 config: the Q/K norms are missing.
    write_checkpoint(dir.path(), &llama);
    let qwen3 = config_json("Qwen3ForCausalLM", r#""rope_theta":10000.0"#);
    let msg = refused(dir.path(), &qwen3);
    assert!(
        msg.contains("self_attn.k_norm.weight") && msg.contains("missing"),
        "{msg}"
    );
    // A corrupt header is an error too, not a panic.
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"\x10\0\0\0\0\0\0\0{not json",
    )
    .unwrap();
    refused(dir.path(), &llama);
}

#[test]
fn configs_the_graph_does_not_implement_are_refused_by_field() {
    for (json, field) in [
        (
            config_json("PhiForCausalLM", r#""rope_theta":10000.0"#),
            "architectures",
        ),
        (
            config_json("LlamaForCausalLM", r#""hidden_act":"gelu""#),
            "hidden_act",
        ),
        (
            config_json("LlamaForCausalLM", r#""mlp_bias":true"#),
            "mlp_bias",
        ),
        (
            config_json("Qwen2ForCausalLM", r#""use_sliding_window":true"#),
            "use_sliding_window",
        ),
        (
            config_json("Gemma3ForCausalLM", r#""final_logit_softcapping":30.0"#),
            "final_logit_softcapping",
        ),
        (
            config_json(
                "LlamaForCausalLM",
                r#""rope_scaling":{"rope_type":"yarn","factor":4.0,"extra":1}"#,
            ),
            "rope_scaling",
        ),
        (
            config_json(
                "Qwen3MoeForCausalLM",
                r#""num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":48,
                   "decoder_sparse_step":2"#,
            ),
            "decoder_sparse_step",
        ),
        (
            config_json(
                "Qwen3MoeForCausalLM",
                r#""num_experts":8,"num_experts_per_tok":2,"moe_intermediate_size":48,
                   "mlp_only_layers":[0]"#,
            ),
            "mlp_only_layers",
        ),
        (
            config_json("Qwen3MoeForCausalLM", r#""num_experts":8"#),
            "num_experts_per_tok",
        ),
        (
            config_json("MixtralForCausalLM", r#""num_experts_per_tok":9"#),
            "experts per token",
        ),
        (
            config_json("LlamaForCausalLM", r#""partial_rotary_factor":0.75"#),
            "partial_rotary_factor",
        ),
        (
            config_json(
                "Phi3ForCausalLM",
                r#""rope_scaling":{"type":"longrope","short_factor":[1.0],"long_factor":[1.0]}"#,
            ),
            "frequency factors of Some(1)",
        ),
        (
            config_json(
                "Phi3ForCausalLM",
                r#""rope_scaling":{"type":"dynamic","factor":2.0}"#,
            ),
            "rope_scaling",
        ),
        (
            config_json(
                "GptOssForCausalLM",
                r#""num_local_experts":4,"num_experts_per_tok":2,"swiglu_limit":5.0"#,
            ),
            "swiglu_limit",
        ),
        (
            config_json(
                "GptOssForCausalLM",
                r#""num_local_experts":4,"num_experts_per_tok":2,
                "quantization_config":{"quant_method":"bitsandbytes"}"#,
            ),
            "quantization_config",
        ),
        (format!(r#"{{{COMMON}}}"#), "architecture"),
    ] {
        let e = ModelConfig::from_hf_json(&json).unwrap_err();
        assert!(matches!(e, Error::InvalidModel { .. }), "{e}");
        assert!(e.to_string().contains(field), "{field}: {e}");
    }
}
