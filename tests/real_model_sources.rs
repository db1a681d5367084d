//! Model sources other than the default GGUF: a local safetensors folder and a Hugging Face
//! hub repo read from a hub-cache folder the test builds (no hub is reachable here), plus the
//! typed errors of bad sources.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use common::{chat_prompt, greedy, max_abs_diff, PROMPTS};
use pensieve::model::{HubSource, LoadOptions, Model, ModelSource, WeightFormat};
use pensieve::Error;

const SMOL_CONFIG: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,
  "intermediate_size":1536,"num_attention_heads":9,"num_hidden_layers":30,"num_key_value_heads":3,
  "rms_norm_eps":1e-05,"rope_theta":100000.0,"max_position_embeddings":8192,
  "tie_word_embeddings":true,"vocab_size":49152,"eos_token_id":2,"bos_token_id":1}"#;

/// Writes tokenizer.json and tokenizer_config.json (template and special tokens) for `model`.
fn write_tokenizer_files(model: &Model, gguf: &gguf_file::Content, dir: &Path) {
    model
        .tokenizer()
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
    let template = gguf.metadata["tokenizer.chat_template"]
        .to_string()
        .unwrap();
    let cfg = serde_json::json!({
        "chat_template": template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"
    });
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
}

fn read_gguf() -> (std::fs::File, gguf_file::Content) {
    let mut f = std::fs::File::open(pensieve::model::default_model_path()).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    (f, c)
}

/// The real SmolLM2 weights in Hugging Face layout: GGUF names mapped back, and Q/K rows
/// un-permuted from llama.cpp's interleaved RoPE order to the half-split order.
fn hf_tensors_from_gguf() -> HashMap<String, Tensor> {
    let (mut f, c) = read_gguf();
    let dev = Device::Cpu;
    let mut out = HashMap::new();
    let mut get = |n: &str| c.tensor(&mut f, n, &dev).unwrap().dequantize(&dev).unwrap();
    let unpermute = |w: Tensor, heads: usize| {
        let (rows, cols) = w.dims2().unwrap();
        let d = rows / heads;
        w.reshape((heads, d / 2, 2, cols))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((rows, cols))
            .unwrap()
    };
    out.insert("model.embed_tokens.weight".into(), get("token_embd.weight"));
    out.insert("model.norm.weight".into(), get("output_norm.weight"));
    for i in 0..30 {
        let p = format!("model.layers.{i}");
        let b = format!("blk.{i}");
        out.insert(
            format!("{p}.input_layernorm.weight"),
            get(&format!("{b}.attn_norm.weight")),
        );
        out.insert(
            format!("{p}.post_attention_layernorm.weight"),
            get(&format!("{b}.ffn_norm.weight")),
        );
        out.insert(
            format!("{p}.self_attn.q_proj.weight"),
            unpermute(get(&format!("{b}.attn_q.weight")), 9),
        );
        out.insert(
            format!("{p}.self_attn.k_proj.weight"),
            unpermute(get(&format!("{b}.attn_k.weight")), 3),
        );
        for (hf, gg) in [
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
        ] {
            out.insert(format!("{p}.{hf}.weight"), get(&format!("{b}.{gg}.weight")));
        }
    }
    out
}

#[test]
fn real_model_safetensors_folder_equals_gguf() {
    let gguf_model = common::real_model(WeightFormat::F32);
    let dir = tempfile::tempdir().unwrap();
    candle_core::safetensors::save(
        &hf_tensors_from_gguf(),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(dir.path().join("config.json"), SMOL_CONFIG).unwrap();
    write_tokenizer_files(&gguf_model, &read_gguf().1, dir.path());
    // Sampling defaults and one more end of generation (<|endoftext|>), as checkpoints ship.
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": [2, 0], "temperature": 0.3, "top_p": 0.8}"#,
    )
    .unwrap();

    let source: ModelSource = dir.path().to_str().unwrap().parse().unwrap();
    assert_eq!(source, ModelSource::Safetensors(dir.path().to_path_buf()));
    let st_model = Model::load(&source, &LoadOptions::default().format(WeightFormat::F32)).unwrap();
    assert_eq!(st_model.eos_token_ids(), vec![2, 0]);
    let defaults = st_model.generation_defaults();
    assert_eq!(
        (defaults.temperature, defaults.top_p),
        (Some(0.3), Some(0.8))
    );
    assert_eq!(gguf_model.generation_defaults(), &Default::default());
    let prompt = chat_prompt(&st_model, PROMPTS[1]);
    assert_eq!(prompt, chat_prompt(&gguf_model, PROMPTS[1]));
    let (a, la) = greedy(&gguf_model, &prompt, 16, usize::MAX, |i| i as u32, 256);
    let (b, lb) = greedy(&st_model, &prompt, 16, usize::MAX, |i| i as u32, 256);
    assert_eq!(a, b);
    let d = la
        .iter()
        .zip(&lb)
        .map(|(x, y)| max_abs_diff(x, y))
        .fold(0.0, f32::max);
    assert!(d < 1e-3, "logits differ by {d}");
}

/// A tiny random-weight Llama in a hub-cache folder laid out as hf-hub writes it; `sharded`,
/// its weights in two files under an index, as large repositories ship them.
fn tiny_hub_cache(root: &Path, repo_dir: &str, commit: &str, sharded: bool) {
    let snap = root.join(repo_dir).join("snapshots").join(commit);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(root.join(repo_dir).join("refs")).unwrap();
    std::fs::write(root.join(repo_dir).join("refs/main"), commit).unwrap();
    let real = common::real_model(WeightFormat::F32);
    write_tokenizer_files(&real, &read_gguf().1, &snap);
    let config = SMOL_CONFIG
        .replace("\"hidden_size\":576", "\"hidden_size\":32")
        .replace("\"intermediate_size\":1536", "\"intermediate_size\":64")
        .replace("\"num_attention_heads\":9", "\"num_attention_heads\":4")
        .replace("\"num_hidden_layers\":30", "\"num_hidden_layers\":2")
        .replace("\"num_key_value_heads\":3", "\"num_key_value_heads\":2");
    std::fs::write(snap.join("config.json"), config).unwrap();
    std::fs::write(
        snap.join("generation_config.json"),
        r#"{"temperature": 0.7}"#,
    )
    .unwrap();
    let dev = Device::Cpu;
    let mut t = HashMap::new();
    let mut rand = |name: String, shape: &[usize]| {
        t.insert(
            name,
            Tensor::randn(0f32, 0.2, shape, &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap(),
        );
    };
    rand("model.embed_tokens.weight".into(), &[49152, 32]);
    rand("model.norm.weight".into(), &[32]);
    for i in 0..2 {
        let p = format!("model.layers.{i}");
        for (n, s) in [
            ("input_layernorm", vec![32]),
            ("post_attention_layernorm", vec![32]),
            ("self_attn.q_proj", vec![32, 32]),
            ("self_attn.k_proj", vec![16, 32]),
            ("self_attn.v_proj", vec![16, 32]),
            ("self_attn.o_proj", vec![32, 32]),
            ("mlp.gate_proj", vec![64, 32]),
            ("mlp.up_proj", vec![64, 32]),
            ("mlp.down_proj", vec![32, 64]),
        ] {
            rand(format!("{p}.{n}.weight"), &s);
        }
    }
    if !sharded {
        candle_core::safetensors::save(&t, snap.join("model.safetensors")).unwrap();
        return;
    }
    let mut weight_map = serde_json::Map::new();
    let (first, second): (HashMap<_, _>, HashMap<_, _>) = t
        .into_iter()
        .partition(|(name, _)| name.contains("layers.0"));
    for (i, part) in [first, second].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        for name in part.keys() {
            weight_map.insert(name.clone(), file.clone().into());
        }
        candle_core::safetensors::save(part, snap.join(&file)).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(snap.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

/// An address where nothing listens: a hub there fails every request at once.
fn dead_endpoint() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}")
}

#[test]
fn real_model_hub_repo_loads_from_a_populated_cache_without_network() {
    let cache = tempfile::tempdir().unwrap();
    tiny_hub_cache(
        cache.path(),
        "models--pensieve-test--tiny-llama",
        "0123abcd",
        false,
    );
    let mut source: ModelSource = "pensieve-test/tiny-llama".parse().unwrap();
    let ModelSource::Hub(hub) = &mut source else {
        panic!("parsed as {source:?}")
    };
    assert_eq!(
        (hub.repo.as_str(), hub.revision.as_str(), hub.offline),
        ("pensieve-test/tiny-llama", "main", false)
    );
    // Online mode still reads a complete cache first and never asks the network.
    hub.cache_dir = Some(cache.path().to_path_buf());
    let model = Model::load(&source, &LoadOptions::default()).unwrap();
    assert_eq!(model.transformer().config().num_layers, 2);
    assert_eq!(model.generation_defaults().temperature, Some(0.7));
    let prompt = chat_prompt(&model, "hi");
    let (ids, logits) = greedy(&model, &prompt, 4, usize::MAX, |i| i as u32, 64);
    assert_eq!(ids.len(), 4);
    assert!(logits.iter().flatten().all(|x| x.is_finite()));
}

#[test]
fn real_model_a_sharded_hub_repo_loads_from_its_cache_without_asking_the_hub() {
    let cache = tempfile::tempdir().unwrap();
    tiny_hub_cache(
        cache.path(),
        "models--pensieve-test--sharded",
        "4567ef",
        true,
    );
    // Online, against a hub that fails every request: the cache alone must serve the load.
    let source = ModelSource::Hub(HubSource {
        cache_dir: Some(cache.path().to_path_buf()),
        endpoint: Some(dead_endpoint()),
        ..HubSource::new("pensieve-test/sharded")
    });
    let model = Model::load(&source, &LoadOptions::default()).unwrap();
    assert_eq!(model.transformer().config().num_layers, 2);
    let (ids, _) = greedy(
        &model,
        &chat_prompt(&model, "hi"),
        2,
        usize::MAX,
        |i| i as u32,
        64,
    );
    assert_eq!(ids.len(), 2);
}

#[test]
fn the_hub_is_asked_at_its_endpoint_with_the_token() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let heard = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            std::io::Read::read_exact(&mut stream, &mut byte).unwrap();
            head.push(byte[0]);
        }
        let answer = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
        std::io::Write::write_all(&mut stream, answer).unwrap();
        String::from_utf8(head).unwrap()
    });
    let cache = tempfile::tempdir().unwrap();
    let source = ModelSource::Hub(HubSource {
        cache_dir: Some(cache.path().to_path_buf()),
        endpoint: Some(endpoint),
        token: Some("hf_pensieve_test".into()),
        ..HubSource::new("gated/model")
    });
    assert!(matches!(
        Model::load(&source, &LoadOptions::default()),
        Err(Error::Hub { .. })
    ));
    let head = heard.join().unwrap().to_ascii_lowercase();
    assert!(head.starts_with("get /api/models/gated/model"), "{head}");
    assert!(
        head.contains("authorization: bearer hf_pensieve_test"),
        "{head}"
    );
}

#[test]
fn bad_sources_are_typed_errors() {
    let cache = tempfile::tempdir().unwrap();
    let offline = ModelSource::Hub(HubSource {
        cache_dir: Some(cache.path().into()),
        offline: true,
        ..HubSource::new("nobody/nothing")
    });
    assert!(matches!(
        Model::load(&offline, &LoadOptions::default()),
        Err(Error::Io { .. })
    ));
    let missing = ModelSource::Gguf(cache.path().join("absent.gguf"));
    assert!(matches!(
        Model::load(&missing, &LoadOptions::default()),
        Err(Error::Io { .. })
    ));
    let corrupt = cache.path().join("corrupt.gguf");
    std::fs::write(&corrupt, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    assert!(matches!(
        Model::load(&ModelSource::Gguf(corrupt), &LoadOptions::default()),
        Err(Error::InvalidModel { .. })
    ));
    // A truncated copy of the real file: metadata parses, tensor data is cut short.
    let truncated = cache.path().join("truncated.gguf");
    let bytes = std::fs::read(pensieve::model::default_model_path()).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        Model::load(&ModelSource::Gguf(truncated), &LoadOptions::default()),
        Err(Error::InvalidModel { .. })
    ));
    assert!("not a model".parse::<ModelSource>().is_err());
    assert_eq!(
        "org/name@v2:m.gguf".parse::<ModelSource>().unwrap(),
        ModelSource::Hub(HubSource {
            revision: "v2".into(),
            gguf_file: Some("m.gguf".into()),
            ..HubSource::new("org/name")
        })
    );
}
