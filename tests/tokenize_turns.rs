//! A chat turn's tokens equal the tokenization of its whole rendered text (what llama.cpp,
//! re-tokenizing the prompt, feeds its model), although the engine tokenizes markup and
//! message contents apart (so contents stay plain text). Vocabularies that prefix a space
//! marker to every piece of text (SentencePiece with `add_space_prefix`: Llama 2, Mistral v0.x)
//! break that on every boundary, so their turns are tokenized whole.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use candle_core::quantized::gguf_file;
use candle_core::Device;
use common::llamacpp;
use pensieve::engine::{ConversationOptions, Engine, EngineConfig, SamplingParams, Turn};
use pensieve::model::{
    tokenizer_from_gguf, Message, Model, ModelConfig, Transformer, WeightFormat,
};

/// Mistral v0.x's template, with `<s>` and `</s>` written out.
const MISTRAL: &str =
    "<s>{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]\
    {% else %}{{ m.content }}</s>{% endif %}{% endfor %}";

/// A model with random weights of a tiny shape over the vocabulary of `gguf`.
fn model_over(gguf: &std::path::Path) -> Model {
    let mut f = std::fs::File::open(gguf).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let tokenizer = tokenizer_from_gguf(&content).unwrap();
    let vocab = tokenizer.get_vocab_size(true);
    let config = ModelConfig::from_hf_json(&format!(
        r#"{{"architectures":["LlamaForCausalLM"],"vocab_size":{vocab},"hidden_size":32,
            "intermediate_size":64,"num_hidden_layers":1,"num_attention_heads":2,
            "num_key_value_heads":1,"max_position_embeddings":512}}"#
    ))
    .unwrap();
    let llama = Transformer::random(config, 1, WeightFormat::F32, &Device::Cpu).unwrap();
    Model::new(llama, tokenizer, None, vec![2])
}

/// The first turn's prompt tokens, as the engine fed them.
fn first_turn(model: &Arc<Model>, user: &str) -> Vec<u32> {
    let mut e = Engine::with_model(model.clone(), EngineConfig::default()).unwrap();
    let c = e.open(ConversationOptions::default()).unwrap();
    let params = SamplingParams::greedy().max_tokens(1).ignore_eos(true);
    e.submit(c, Turn::user(user), params).unwrap();
    while e.has_work() {
        e.step().unwrap();
    }
    let tokens = e.tokens(c).unwrap();
    tokens[..tokens.len() - 1].to_vec()
}

fn check(model: Model, name: &str) {
    let model = Arc::new(model);
    for user in [
        "Hello there",
        "What is 2 + 2?",
        "  spaced  out ",
        "Zürich, 東京 and 🚀",
    ] {
        let rendered = model
            .render_chat(&[Message::new("user", user)], true)
            .unwrap();
        let whole = model.encode(&rendered).unwrap();
        assert_eq!(first_turn(&model, user), whole, "{name}: {rendered:?}");
    }
}

#[test]
fn sentencepiece_with_space_prefix_turns_are_tokenized_whole() {
    let model = model_over(&llamacpp::vocab_gguf("llama-spm"))
        .with_template_source(MISTRAL)
        .unwrap();
    check(model, "llama-spm + Mistral template");
}

#[test]
fn byte_level_bpe_turns_equal_their_whole_text() {
    let model = model_over(&llamacpp::vocab_gguf("llama-bpe"))
        .with_builtin_template("llama3")
        .unwrap();
    check(model, "llama-bpe + llama3 template");
}

#[test]
fn gemma_turns_equal_their_whole_text() {
    let model = model_over(&llamacpp::gemma_path())
        .with_builtin_template("gemma")
        .unwrap();
    check(model, "gemma3 + gemma template");
}
