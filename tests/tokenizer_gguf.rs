//! Tokenizers rebuilt from GGUF metadata give llama.cpp's token ids: on llama.cpp's own
//! vocabulary-only files (Llama 3 BPE, Qwen2 BPE, Llama 2 SentencePiece) for 200 ShareGPT texts
//! and for the cases of llama.cpp's tokenizer tests (`.inp` / `.out` beside each file), on
//! Phi-3's for those cases, and on the Gemma 3 file. Unsupported vocabularies are refused by
//! key.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use candle_core::quantized::gguf_file;
use common::llamacpp;
use pensieve::model::tokenizer_from_gguf;
use pensieve::Error;
use tokenizers::Tokenizer;

fn load(path: &std::path::Path) -> (gguf_file::Content, Tokenizer) {
    let mut f = std::fs::File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut t = tokenizer_from_gguf(&content).unwrap();
    // As llama.cpp's `special=False`: the text of a control token stays text.
    t.set_encode_special_tokens(true);
    (content, t)
}

fn encode(t: &Tokenizer, text: &str) -> Vec<u32> {
    t.encode_fast(text, false).unwrap().get_ids().to_vec()
}

/// Our ids of every fixture text equal llama.cpp's; the first difference is shown.
fn check_texts(vocab: &str, t: &Tokenizer) {
    let (texts, want) = (llamacpp::texts(), llamacpp::token_ids(vocab));
    assert!(texts.len() >= 200 && texts.len() == want.len());
    let bad: Vec<usize> = (0..texts.len())
        .filter(|&i| encode(t, &texts[i]) != want[i])
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{vocab}: {} of {} texts differ; first {:?}:\n ours {:?}\n llama.cpp {:?}",
            bad.len(),
            texts.len(),
            texts[i],
            encode(t, &texts[i]),
            want[i]
        );
    }
    // Decoding gives the text back.
    for text in texts.iter().take(50) {
        assert_eq!(&t.decode(&encode(t, text), false).unwrap(), text, "{vocab}");
    }
}

/// llama.cpp's own test cases: texts separated by `__ggml_vocab_test__` lines, ids one line
/// per text.
fn check_llamacpp_cases(vocab: &str, t: &Tokenizer) {
    let path = llamacpp::vocab_gguf(vocab);
    let inp = std::fs::read_to_string(path.with_extension("gguf.inp")).unwrap();
    let out = std::fs::read_to_string(path.with_extension("gguf.out")).unwrap();
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let want: Vec<Vec<u32>> = out
        .lines()
        .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
        .collect();
    assert!(texts.len() >= want.len() && want.len() > 20, "{vocab}");
    for (text, want) in texts.iter().zip(&want) {
        assert_eq!(&encode(t, text), want, "{vocab}: {text:?}");
    }
}

#[test]
fn llama3_bpe_ids_match_llama_cpp() {
    let (_, t) = load(&llamacpp::vocab_gguf("llama-bpe"));
    check_texts("llama-bpe", &t);
    check_llamacpp_cases("llama-bpe", &t);
}

#[test]
fn qwen2_bpe_ids_match_llama_cpp() {
    let (_, t) = load(&llamacpp::vocab_gguf("qwen2"));
    check_texts("qwen2", &t);
    check_llamacpp_cases("qwen2", &t);
}

#[test]
fn llama2_sentencepiece_ids_match_llama_cpp() {
    let (_, t) = load(&llamacpp::vocab_gguf("llama-spm"));
    check_texts("llama-spm", &t);
    check_llamacpp_cases("llama-spm", &t);
}

/// Phi-3's vocabulary: Llama 2's SentencePiece with its chat's control tokens added.
#[test]
fn phi3_sentencepiece_ids_match_llama_cpps_own_cases() {
    let (_, t) = load(&llamacpp::vocab_gguf("phi-3"));
    check_llamacpp_cases("phi-3", &t);
}

#[test]
fn gemma3_sentencepiece_ids_match_llama_cpp() {
    let (_, t) = load(&llamacpp::gemma_path());
    check_texts("gemma3", &t);
    // Control tokens are whole when special tokens are parsed; user-defined ones always.
    let mut special = t.clone();
    special.set_encode_special_tokens(false);
    assert_eq!(
        encode(&special, "<start_of_turn>user\n"),
        vec![105, 2364, 107]
    );
    assert_eq!(encode(&t, "\n\n"), vec![108]);
}

#[test]
fn unsupported_vocabularies_are_refused_by_key() {
    let (mut content, _) = load(&llamacpp::vocab_gguf("qwen2"));
    let set = |c: &mut gguf_file::Content, k: &str, v: &str| {
        c.metadata
            .insert(k.into(), gguf_file::Value::String(v.into()));
    };
    set(&mut content, "tokenizer.ggml.pre", "jais");
    let e = tokenizer_from_gguf(&content).unwrap_err();
    assert!(matches!(&e, Error::InvalidModel { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("tokenizer.ggml.pre") && msg.contains("jais") && msg.contains("qwen2"),
        "{msg}"
    );
    set(&mut content, "tokenizer.ggml.model", "t5");
    let msg = tokenizer_from_gguf(&content).unwrap_err().to_string();
    assert!(
        msg.contains("tokenizer.ggml.model") && msg.contains("t5") && msg.contains("llama"),
        "{msg}"
    );
}
