//! A tiny random-weight Llama with a byte-level tokenizer and a ChatML template, built in code:
//! for tests of the engine's mechanism that need no real weights.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use pensieve::model::{ChatTemplate, Llama, LlamaConfig, Model, WeightFormat};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn byte_tokenizer() -> Tokenizer {
    let mut vocab: tokenizers::models::bpe::Vocab = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, s)| (s.to_string(), i as u32))
        .collect();
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort();
    for c in alphabet {
        let n = vocab.len() as u32;
        vocab.insert(c.to_string(), n);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, vec![])
        .build()
        .unwrap();
    let mut t = Tokenizer::new(bpe);
    t.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    t.with_decoder(Some(ByteLevelDecoder::default()));
    t.add_special_tokens(
        &SPECIALS
            .iter()
            .map(|s| AddedToken::from(*s, true))
            .collect::<Vec<_>>(),
    );
    t
}

/// 2 layers, width 32, 4 query heads over 2 kv heads, 259-token byte vocabulary.
pub fn tiny_model(seed: u64) -> Model {
    let config = LlamaConfig::from_hf_json(
        r#"{"vocab_size":259,"hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"rms_norm_eps":1e-5,
            "rope_theta":10000.0,"max_position_embeddings":2048,"tie_word_embeddings":true}"#,
    )
    .unwrap();
    let dev = Device::Cpu;
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut rand = |shape: &[usize]| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.8
            })
            .collect();
        Tensor::from_vec(v, shape, &dev).unwrap()
    };
    let mut t: HashMap<String, Tensor> = HashMap::new();
    t.insert("model.embed_tokens.weight".into(), rand(&[259, 32]));
    t.insert(
        "model.norm.weight".into(),
        Tensor::ones(32, DType::F32, &dev).unwrap(),
    );
    for i in 0..2 {
        let p = format!("model.layers.{i}");
        for (n, s) in [
            ("self_attn.q_proj", [32, 32]),
            ("self_attn.k_proj", [16, 32]),
            ("self_attn.v_proj", [16, 32]),
            ("self_attn.o_proj", [32, 32]),
            ("mlp.gate_proj", [64, 32]),
            ("mlp.up_proj", [64, 32]),
            ("mlp.down_proj", [32, 64]),
        ] {
            t.insert(format!("{p}.{n}.weight"), rand(&s));
        }
        t.insert(
            format!("{p}.input_layernorm.weight"),
            Tensor::ones(32, DType::F32, &dev).unwrap(),
        );
        t.insert(
            format!("{p}.post_attention_layernorm.weight"),
            Tensor::ones(32, DType::F32, &dev).unwrap(),
        );
    }
    let llama = Llama::from_hf_tensors(config, t, WeightFormat::F32, &dev).unwrap();
    Model {
        llama,
        tokenizer: byte_tokenizer(),
        template: Some(ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap()),
        eos_token_ids: vec![2],
    }
}
