//! GGUF files that hold matrices otherwise than one tensor each, beyond the logits checks
//! against candle (`tests/architectures.rs`): a mixture of experts' stacked experts and Phi-3's
//! fused projections load as the safetensors checkpoint of the same weights does, quantized
//! experts stream packed one by one, and a mixture's row does not depend on its batch.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use pensieve::attention::KvPool;
use pensieve::model::{ForwardBatch, GgufHeader, ModelConfig, Transformer, WeightFormat};

const PROMPT: usize = 24;
const EXPERTS: usize = 8;
const LAYERS: usize = 2;

/// A Qwen3 MoE of 8 experts, `per_token` per token, every width a multiple of 256 (the
/// K-quants' blocks).
fn config(per_token: usize) -> ModelConfig {
    ModelConfig::from_hf_json(&format!(
        r#"{{"architectures":["Qwen3MoeForCausalLM"],"vocab_size":300,"hidden_size":256,
            "intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":64,"rms_norm_eps":1e-6,"rope_theta":1000000.0,
            "max_position_embeddings":256,"tie_word_embeddings":false,"num_experts":8,
            "num_experts_per_tok":{per_token},"moe_intermediate_size":256,
            "norm_topk_prob":true}}"#
    ))
    .unwrap()
}

fn prompt() -> Vec<u32> {
    (0..PROMPT as u32).map(|i| (i * 37 + 11) % 300).collect()
}

/// The logits of every position of the prompt, and of `others` tokens of a second sequence
/// in the same pass.
fn logits(m: &Transformer, others: usize) -> Vec<f32> {
    let pool = KvPool::new(
        m.config().kv_shape(),
        2 * PROMPT,
        pensieve::engine::KvPrecision::F32,
        &Device::Cpu,
    )
    .unwrap();
    let mut batch = ForwardBatch::new();
    let idx: Vec<u32> = (0..PROMPT as u32).collect();
    batch
        .push_scored(&prompt(), &idx, &idx, &idx, PROMPT)
        .unwrap();
    if others > 0 {
        let tokens: Vec<u32> = prompt().iter().rev().take(others).copied().collect();
        let pos: Vec<u32> = (0..others as u32).collect();
        let slots: Vec<u32> = (PROMPT as u32..(PROMPT + others) as u32).collect();
        batch
            .push_scored(&tokens, &pos, &slots, &slots, others)
            .unwrap();
    }
    let all = m.forward(&batch, &pool).unwrap();
    let prompt_rows = all.narrow(0, 0, PROMPT).unwrap();
    prompt_rows.flatten_all().unwrap().to_vec1().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    (diff, scale)
}

/// The random checkpoint's tensors under llama.cpp's GGUF names, each layer's experts
/// stacked into one `[experts, rows, columns]` tensor per projection, as its converter
/// writes them; matrices in `dtype`, vectors in f32.
fn gguf_tensors(hf: &HashMap<String, Tensor>, dtype: GgmlDType) -> Vec<(String, QTensor)> {
    let q = |t: &Tensor, dtype| QTensor::quantize(t, dtype).unwrap();
    let mut out = vec![
        (
            "token_embd.weight".into(),
            q(&hf["model.embed_tokens.weight"], dtype),
        ),
        ("output.weight".into(), q(&hf["lm_head.weight"], dtype)),
        (
            "output_norm.weight".into(),
            q(&hf["model.norm.weight"], GgmlDType::F32),
        ),
    ];
    for l in 0..LAYERS {
        let hf_name = |s: &str| format!("model.layers.{l}.{s}");
        for (gguf, name, matrix) in [
            ("attn_norm", "input_layernorm.weight", false),
            ("ffn_norm", "post_attention_layernorm.weight", false),
            ("attn_q_norm", "self_attn.q_norm.weight", false),
            ("attn_k_norm", "self_attn.k_norm.weight", false),
            ("attn_q", "self_attn.q_proj.weight", true),
            ("attn_k", "self_attn.k_proj.weight", true),
            ("attn_v", "self_attn.v_proj.weight", true),
            ("attn_output", "self_attn.o_proj.weight", true),
            ("ffn_gate_inp", "mlp.gate.weight", false),
        ] {
            let t = &hf[&hf_name(name)];
            let dtype = if matrix { dtype } else { GgmlDType::F32 };
            out.push((format!("blk.{l}.{gguf}.weight"), q(t, dtype)));
        }
        for (gguf, proj) in [
            ("ffn_gate_exps", "gate_proj"),
            ("ffn_up_exps", "up_proj"),
            ("ffn_down_exps", "down_proj"),
        ] {
            let experts: Vec<&Tensor> = (0..EXPERTS)
                .map(|e| &hf[&hf_name(&format!("mlp.experts.{e}.{proj}.weight"))])
                .collect();
            let stacked = Tensor::stack(&experts, 0).unwrap();
            out.push((format!("blk.{l}.{gguf}.weight"), q(&stacked, dtype)));
        }
    }
    out
}

/// A GGUF file of `metadata` and `tensors`.
fn write_gguf(
    metadata: &[(String, gguf_file::Value)],
    tensors: &[(String, QTensor)],
) -> tempfile::NamedTempFile {
    let md: Vec<(&str, &gguf_file::Value)> =
        metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let file = tempfile::NamedTempFile::new().unwrap();
    gguf_file::write(&mut std::fs::File::create(file.path()).unwrap(), &md, &ts).unwrap();
    file
}

/// A GGUF file of the checkpoint `hf` (of `config(per_token)`) with matrices in `dtype`.
fn gguf_file(
    hf: &HashMap<String, Tensor>,
    per_token: u32,
    dtype: GgmlDType,
) -> tempfile::NamedTempFile {
    use gguf_file::Value::{F32, U32};
    let md = metadata(
        "qwen3moe",
        &[
            ("attention.key_length", U32(64)),
            ("attention.value_length", U32(64)),
            ("attention.layer_norm_rms_epsilon", F32(1e-6)),
            ("rope.freq_base", F32(1e6)),
            ("expert_count", U32(EXPERTS as u32)),
            ("expert_used_count", U32(per_token)),
            ("expert_feed_forward_length", U32(256)),
        ],
    );
    write_gguf(&md, &gguf_tensors(hf, dtype))
}

/// The metadata of a GGUF file of architecture `arch` of the tests' shape (vocabulary 300,
/// width 256, inner width 512, 4 heads over 2 KV heads, 256 positions), and `more` keys.
fn metadata(arch: &str, more: &[(&str, gguf_file::Value)]) -> Vec<(String, gguf_file::Value)> {
    use gguf_file::Value::{String as S, U32};
    let mut md = vec![("general.architecture".to_string(), S(arch.into()))];
    for (key, value) in [
        ("vocab_size", U32(300)),
        ("embedding_length", U32(256)),
        ("feed_forward_length", U32(512)),
        ("block_count", U32(LAYERS as u32)),
        ("attention.head_count", U32(4)),
        ("attention.head_count_kv", U32(2)),
        ("context_length", U32(256)),
    ]
    .into_iter()
    .chain(more.iter().cloned())
    {
        md.push((format!("{arch}.{key}"), value));
    }
    md
}

fn load_gguf(file: &tempfile::NamedTempFile, format: WeightFormat) -> Transformer {
    let mut r = std::fs::File::open(file.path()).unwrap();
    let header = GgufHeader::read(&mut r).unwrap();
    Transformer::from_gguf(&header, &mut r, format, &Device::Cpu).unwrap()
}

#[test]
fn stacked_gguf_experts_load_as_the_safetensors_checkpoint_of_the_same_weights() {
    let config = config(2);
    let hf = Transformer::random_tensors(&config, 9, &Device::Cpu).unwrap();
    let file = gguf_file(&hf, 2, GgmlDType::F32);
    let gguf = load_gguf(&file, WeightFormat::F32);
    assert_eq!(gguf.config().experts, config.experts);
    assert_same_logits(&gguf, config, hf);
}

/// `gguf` (f32 tensors) computes what the safetensors checkpoint `hf` of `config` does.
fn assert_same_logits(gguf: &Transformer, config: ModelConfig, hf: HashMap<String, Tensor>) {
    let reference =
        Transformer::from_hf_tensors(config, hf, WeightFormat::F32, &Device::Cpu).unwrap();
    let (diff, scale) = max_diff(&logits(gguf, 0), &logits(&reference, 0));
    assert!(
        scale > 0.1 && diff <= 1e-5 * scale,
        "{diff} (scale {scale})"
    );
}

#[test]
fn quantized_experts_stream_packed_and_match_their_dequantized_weights() {
    // Every expert on every token: a router's choice between near-equal experts flips with
    // the rounding of the activations, which would hide an expert's wrong bytes in noise.
    let config = config(EXPERTS);
    let hf = Transformer::random_tensors(&config, 9, &Device::Cpu).unwrap();
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K] {
        let file = gguf_file(&hf, EXPERTS as u32, dtype);
        let packed = load_gguf(&file, WeightFormat::Packed);
        let dequantized = load_gguf(&file, WeightFormat::F32);
        // Held in their own codes: about the file's bytes, not f32's.
        let bytes = std::fs::metadata(file.path()).unwrap().len() as f64;
        assert!((packed.weight_bytes() as f64) < 1.2 * bytes, "{dtype:?}");
        // The packed kernel quantizes activations to 8 bits: close, not equal.
        let (diff, scale) = max_diff(&logits(&packed, 0), &logits(&dequantized, 0));
        assert!(
            scale > 0.1 && diff <= 0.03 * scale,
            "{dtype:?}: {diff} (scale {scale})"
        );
    }
}

/// Routing is per token and each expert's rows run as one batch through the packed kernel:
/// a sequence's logits are the same bits alone and beside another sequence whose tokens route
/// to the same experts.
#[test]
fn a_mixture_of_experts_row_does_not_depend_on_its_batch() {
    let m = Transformer::random(config(2), 5, WeightFormat::Packed, &Device::Cpu).unwrap();
    let alone = logits(&m, 0);
    assert_eq!(alone, logits(&m, 17));
    assert_eq!(alone, logits(&m, PROMPT));
}

/// Phi-3's fused projections (`attn_qkv`, and `ffn_up` holding gate and up) are split by rows
/// at load, from their own bytes, as the safetensors checkpoint's `qkv_proj` and
/// `gate_up_proj` are; its partial rotary (`rope.dimension_count` under the head size) and
/// LongRoPE factors (`rope_factors_short`/`_long`, past `original_context_length`) read as
/// `partial_rotary_factor` and `rope_scaling` do.
#[test]
fn fused_gguf_projections_load_as_the_safetensors_checkpoint_of_the_same_weights() {
    use gguf_file::Value::{F32, U32};
    let factors = |step: f32| -> Vec<f32> { (0..24).map(|i| 1.0 + step * i as f32).collect() };
    let (short, long) = (factors(0.05), factors(0.4));
    let config = ModelConfig::from_hf_json(&format!(
        r#"{{"architectures":["Phi3ForCausalLM"],"vocab_size":300,"hidden_size":256,
            "intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"rms_norm_eps":1e-5,"rope_theta":10000.0,
            "max_position_embeddings":256,"sliding_window":2047,"tie_word_embeddings":false,
            "partial_rotary_factor":0.75,"original_max_position_embeddings":8,
            "rope_scaling":{{"type":"longrope","short_factor":{short:?},"long_factor":{long:?}}}}}"#
    ))
    .unwrap();
    let hf = Transformer::random_tensors(&config, 4, &Device::Cpu).unwrap();
    let f32 = |name: &str| QTensor::quantize(&hf[name], GgmlDType::F32).unwrap();
    let mut tensors = vec![
        (
            "token_embd.weight".to_string(),
            f32("model.embed_tokens.weight"),
        ),
        ("output.weight".to_string(), f32("lm_head.weight")),
        ("output_norm.weight".to_string(), f32("model.norm.weight")),
    ];
    for l in 0..LAYERS {
        for (gguf, name) in [
            ("attn_norm", "input_layernorm"),
            ("attn_qkv", "self_attn.qkv_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_norm", "post_attention_layernorm"),
            ("ffn_up", "mlp.gate_up_proj"),
            ("ffn_down", "mlp.down_proj"),
        ] {
            let t = f32(&format!("model.layers.{l}.{name}.weight"));
            tensors.push((format!("blk.{l}.{gguf}.weight"), t));
        }
    }
    for (name, f) in [("rope_factors_short", &short), ("rope_factors_long", &long)] {
        let t = Tensor::new(f.as_slice(), &Device::Cpu).unwrap();
        let t = QTensor::quantize(&t, GgmlDType::F32).unwrap();
        tensors.push((format!("{name}.weight"), t));
    }
    let metadata = metadata(
        "phi3",
        &[
            ("attention.layer_norm_rms_epsilon", F32(1e-5)),
            ("attention.sliding_window", U32(2047)),
            ("rope.freq_base", F32(1e4)),
            ("rope.dimension_count", U32(48)),
            ("rope.scaling.original_context_length", U32(8)),
        ],
    );
    let file = write_gguf(&metadata, &tensors);
    let gguf = load_gguf(&file, WeightFormat::F32);
    assert_eq!(gguf.config().layer_windows, config.layer_windows);
    assert_eq!(gguf.config().rope, config.rope);
    assert_eq!(config.rope.freq_factors.as_ref(), Some(&long));
    assert_same_logits(&gguf, config, hf);
}
