//! The tokenizer rebuilt from the GGUF metadata gives llama.cpp's ids, and the model's own chat
//! template renders as SmolLM2 expects. Needs the real model.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use pensieve::model::{Message, WeightFormat};

#[test]
fn real_model_ids_match_llama_cpp() {
    let m = common::real_model(WeightFormat::F32);
    // Ids from llama.cpp (`pre = smollm`) for the same file.
    assert_eq!(m.encode("Hello").unwrap(), vec![19556]);
    assert_eq!(m.encode("<|im_start|>user").unwrap(), vec![1, 4093]);
    // Digits are split one by one; no space prefix is added.
    let ids = m.encode("12345").unwrap();
    assert_eq!(ids.len(), 5);
    let hello_world = m.encode("Hello world").unwrap();
    assert_eq!(hello_world[0], 19556);
    assert_eq!(hello_world.len(), 2);
    assert_eq!(m.decode(&hello_world).unwrap(), "Hello world");
}

#[test]
fn real_model_special_tokens_map_to_their_ids() {
    let m = common::real_model(WeightFormat::F32);
    for (text, id) in [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)] {
        assert_eq!(m.encode(text).unwrap(), vec![id], "{text}");
    }
    assert!(m.eos_token_ids().contains(&2));
}

#[test]
fn real_model_unicode_round_trips() {
    let m = common::real_model(WeightFormat::F32);
    for text in [
        "naïve café — 東京 🚀",
        "  leading spaces\n\ttabs",
        "emoji 👩‍👩‍👧 and ÄÖÜ ß",
        "2024-11-22 3.14159",
    ] {
        let ids = m.encode(text).unwrap();
        assert_eq!(m.decode(&ids).unwrap(), text);
    }
}

#[test]
fn real_model_chat_template_renders() {
    let m = common::real_model(WeightFormat::F32);
    let messages = [
        Message::new("system", "You are terse."),
        Message::new("user", "Hi!"),
        Message::new("assistant", "Hello."),
    ];
    let text = m.render_chat(&messages, true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n\
         <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>assistant\n"
    );
    // Without a system message the template inserts SmolLM's default one.
    let text = m.render_chat(&messages[1..2], false).unwrap();
    assert!(text.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
    assert!(text.ends_with("<|im_start|>user\nHi!<|im_end|>\n"));
}

#[test]
fn real_model_incremental_decoding_concatenates_to_the_text() {
    let m = common::real_model(WeightFormat::F32);
    let text = "Grüße aus 東京 🚀! 123";
    let ids = m.encode(text).unwrap();
    let mut dec = pensieve::model::IncrementalDecoder::new();
    let mut out = String::new();
    for id in ids {
        let delta = dec.push(m.tokenizer(), id).unwrap();
        assert!(!delta.contains('\u{FFFD}'));
        out.push_str(&delta);
    }
    assert_eq!(out, text);
}
