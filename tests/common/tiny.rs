//! A tiny random-weight Llama with a byte-level tokenizer and a ChatML template, built in code:
//! for tests of the engine's mechanism that need no real weights.

use candle_core::Device;
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
    let llama = Llama::random(config, seed, WeightFormat::F32, &Device::Cpu).unwrap();
    Model {
        llama,
        tokenizer: byte_tokenizer(),
        template: Some(ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap()),
        eos_token_ids: vec![2],
    }
}
