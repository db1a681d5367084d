//! A tiny random-weight Llama with a byte-level tokenizer and a ChatML template, built in
//! code: for tests of the engine's mechanism, and of applications embedding it, that need no
//! real weights.

use candle_core::Device;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use super::{Model, ModelConfig, Transformer, WeightFormat};
use crate::{Error, Result};

const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

fn byte_tokenizer() -> Result<Tokenizer> {
    let mut vocab: Vocab = SPECIALS
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
        .map_err(Error::Tokenizer)?;
    let mut t = Tokenizer::new(bpe);
    t.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    t.with_decoder(Some(ByteLevelDecoder::default()));
    t.add_special_tokens(
        &SPECIALS
            .iter()
            .map(|s| AddedToken::from(*s, true))
            .collect::<Vec<_>>(),
    );
    Ok(t)
}

impl Model {
    /// A tiny model with seeded random weights: 2 layers, width 32, 4 query heads over 2 KV
    /// heads, a 259-token byte vocabulary (`<|im_end|>` ends a reply), ChatML, a 2048-token
    /// window. Its replies are noise, but deterministic.
    ///
    /// # Errors
    /// Only if candle or the tokenizer cannot build it.
    pub fn tiny(seed: u64) -> Result<Self> {
        Self::tiny_of(
            r#""architectures":["LlamaForCausalLM"],"intermediate_size":64"#,
            seed,
        )
    }

    /// [`Model::tiny`] with a mixture of experts for its MLPs (the Qwen3 MoE graph: 4 experts
    /// of width 16, 2 per token), for tests of what routing per token must not change.
    ///
    /// # Errors
    /// Only if candle or the tokenizer cannot build it.
    pub fn tiny_experts(seed: u64) -> Result<Self> {
        Self::tiny_of(
            r#""architectures":["Qwen3MoeForCausalLM"],"intermediate_size":64,"head_dim":8,
               "num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":16,
               "norm_topk_prob":true"#,
            seed,
        )
    }

    /// [`Model::tiny`] of gpt-oss's graph: attention sinks and biases, a 16-token sliding
    /// window on every other layer, YaRN, and a mixture of 4 biased experts of width 16 with
    /// the clamped SwiGLU, 2 per token.
    ///
    /// # Errors
    /// Only if candle or the tokenizer cannot build it.
    pub fn tiny_gpt_oss(seed: u64) -> Result<Self> {
        Self::tiny_of(
            r#""architectures":["GptOssForCausalLM"],"intermediate_size":16,"head_dim":8,
               "num_local_experts":4,"num_experts_per_tok":2,"attention_bias":true,
               "sliding_window":16,"layer_types":["sliding_attention","full_attention"],
               "rope_scaling":{"rope_type":"yarn","factor":4.0,
               "original_max_position_embeddings":512}"#,
            seed,
        )
    }

    fn tiny_of(architecture: &str, seed: u64) -> Result<Self> {
        let config = ModelConfig::from_hf_json(&format!(
            r#"{{{architecture},"vocab_size":259,"hidden_size":32,"num_hidden_layers":2,
                "num_attention_heads":4,"num_key_value_heads":2,"rms_norm_eps":1e-5,
                "rope_theta":10000.0,"max_position_embeddings":2048,"tie_word_embeddings":true}}"#
        ))?;
        let llama = Transformer::random(config, seed, WeightFormat::F32, &Device::Cpu)?;
        Model::new(llama, byte_tokenizer()?, None, vec![2]).with_builtin_template("chatml")
    }
}
