//! A GGUF file the graph or tokenizer cannot run as written is refused with a typed error that
//! names the key or tensor, from the file's header alone: every file here is cut short where
//! the weights begin, so reading any weight would fail with an I/O error instead. Header keys
//! the graph does implement read as their `config.json` counterparts do.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use candle_core::quantized::{gguf_file, QTensor};
use candle_core::{Device, Tensor};
use pensieve::model::{LoadOptions, Model};
use pensieve::Error;

/// SmolLM2's metadata with `edit` applied, and its tensor names with `tensors` applied, each
/// holding one dummy value; written to a file cut short where the tensor data begins.
fn header_only(
    edit: impl Fn(&mut Vec<(String, gguf_file::Value)>),
    tensors: impl Fn(&mut Vec<String>),
) -> tempfile::NamedTempFile {
    let path = pensieve::model::default_model_path();
    let mut f = std::fs::File::open(&path).expect("run scripts/fetch-assets");
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut md: Vec<(String, gguf_file::Value)> = content.metadata.into_iter().collect();
    md.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut md);
    let mut names: Vec<String> = content.tensor_infos.into_keys().collect();
    names.sort();
    tensors(&mut names);
    let dummy = QTensor::quantize(
        &Tensor::zeros(32, candle_core::DType::F32, &Device::Cpu).unwrap(),
        candle_core::quantized::GgmlDType::F32,
    )
    .unwrap();
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = names.iter().map(|n| (n.as_str(), &dummy)).collect();
    let out = tempfile::NamedTempFile::new().unwrap();
    let mut w = std::fs::File::create(out.path()).unwrap();
    gguf_file::write(&mut w, &md_refs, &t_refs).unwrap();
    drop(w);
    let mut r = std::fs::File::open(out.path()).unwrap();
    let data_start = gguf_file::Content::read(&mut r).unwrap().tensor_data_offset;
    std::fs::OpenOptions::new()
        .write(true)
        .open(out.path())
        .unwrap()
        .set_len(data_start)
        .unwrap();
    out
}

fn set(md: &mut [(String, gguf_file::Value)], key: &str, value: &str) {
    let entry = md.iter_mut().find(|(k, _)| k == key).unwrap();
    entry.1 = gguf_file::Value::String(value.into());
}

fn refusal(file: &tempfile::NamedTempFile) -> String {
    let e = Model::from_gguf(file.path(), &LoadOptions::default()).unwrap_err();
    assert!(
        matches!(e, Error::InvalidModel { .. }),
        "not a typed refusal: {e}"
    );
    e.to_string()
}

#[test]
fn unknown_architecture_is_refused_by_key() {
    let f = header_only(|md| set(md, "general.architecture", "phi2"), |_| {});
    let msg = refusal(&f);
    assert!(
        msg.contains("general.architecture") && msg.contains("phi2") && msg.contains("gemma3"),
        "{msg}"
    );
    // A known architecture reads its settings under its own name.
    let f = header_only(|md| set(md, "general.architecture", "gpt-oss"), |_| {});
    let msg = refusal(&f);
    assert!(msg.contains("gpt-oss.") && msg.contains("missing"), "{msg}");
}

#[test]
fn a_mixture_without_its_expert_counts_is_refused_by_key() {
    // Mixtral's GGUF files say `llama` and count their experts.
    let f = header_only(
        |md| md.push(("llama.expert_count".into(), gguf_file::Value::U32(8))),
        |_| {},
    );
    let msg = refusal(&f);
    assert!(msg.contains("llama.expert_used_count"), "{msg}");
}

#[test]
fn unknown_pre_tokenizer_is_refused_by_key() {
    let f = header_only(|md| set(md, "tokenizer.ggml.pre", "jais"), |_| {});
    let msg = refusal(&f);
    assert!(
        msg.contains("tokenizer.ggml.pre") && msg.contains("jais"),
        "{msg}"
    );
}

#[test]
fn a_tensor_the_graph_would_not_use_is_refused() {
    let f = header_only(|_| {}, |names| names.push("blk.0.attn_q.bias".into()));
    let msg = refusal(&f);
    assert!(
        msg.contains("blk.0.attn_q.bias") && msg.contains("would not use"),
        "{msg}"
    );
}

#[test]
fn a_missing_tensor_is_refused() {
    let f = header_only(|_| {}, |names| names.retain(|n| n != "blk.1.ffn_up.weight"));
    let msg = refusal(&f);
    assert!(
        msg.contains("blk.1.ffn_up.weight") && msg.contains("missing"),
        "{msg}"
    );
}

/// A vocabulary that cannot be rebuilt from the metadata is read from a `tokenizer.json` beside
/// the file, or from the one `LoadOptions::tokenizer` names.
#[test]
fn a_tokenizer_json_beside_the_file_or_named_stands_in() {
    let original = pensieve::model::default_model_path();
    let mut f = std::fs::File::open(&original).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let reference = Model::from_gguf(&original, &LoadOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut md: Vec<(String, gguf_file::Value)> = content.metadata.clone().into_iter().collect();
    set(&mut md, "tokenizer.ggml.pre", "jais");
    let tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|n| (n.clone(), content.tensor(&mut f, n, &Device::Cpu).unwrap()))
        .collect();
    let path = dir.path().join("model.gguf");
    let mut w = std::fs::File::create(&path).unwrap();
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    gguf_file::write(&mut w, &md_refs, &t_refs).unwrap();
    drop(w);
    assert!(Model::from_gguf(&path, &LoadOptions::default()).is_err());
    let named = dir.path().join("elsewhere.json");
    reference.tokenizer().save(&named, false).unwrap();
    let text = "Hello world, 12345 <|im_start|>";
    let with_named =
        Model::from_gguf(&path, &LoadOptions::default().tokenizer(named.clone())).unwrap();
    assert_eq!(
        with_named.encode(text).unwrap(),
        reference.encode(text).unwrap()
    );
    std::fs::rename(&named, dir.path().join("tokenizer.json")).unwrap();
    let beside = Model::from_gguf(&path, &LoadOptions::default()).unwrap();
    assert_eq!(
        beside.encode(text).unwrap(),
        reference.encode(text).unwrap()
    );
}

/// A GGUF's YaRN keys scale RoPE as the same settings in `config.json` do.
#[test]
fn yarn_keys_scale_rope_as_config_json_does() {
    use gguf_file::Value::{String as S, F32, U32};
    let file = header_only(
        |md| {
            md.push(("llama.rope.scaling.type".into(), S("yarn".into())));
            md.push(("llama.rope.scaling.factor".into(), F32(4.0)));
            md.push((
                "llama.rope.scaling.original_context_length".into(),
                U32(2048),
            ));
        },
        |_| {},
    );
    let mut r = std::fs::File::open(file.path()).unwrap();
    let content = gguf_file::Content::read(&mut r).unwrap();
    let gguf = pensieve::model::ModelConfig::from_gguf(&content).unwrap();
    let json = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,
        "intermediate_size":1536,"num_attention_heads":9,"num_hidden_layers":30,
        "num_key_value_heads":3,"rms_norm_eps":1e-05,"rope_theta":100000,
        "max_position_embeddings":8192,"tie_word_embeddings":true,"vocab_size":49152,
        "rope_scaling":{"rope_type":"yarn","factor":4.0,"original_max_position_embeddings":2048}}"#;
    let hf = pensieve::model::ModelConfig::from_hf_json(json).unwrap();
    // llama.cpp's GGUFs pair dimensions interleaved (their converter permuted Q and K).
    assert_eq!(
        (gguf.rope.freq_factors, gguf.rope.attention_factor),
        (hf.rope.freq_factors.clone(), hf.rope.attention_factor)
    );
    assert!(hf.rope.attention_factor.is_some_and(|f| f > 1.0));
}
