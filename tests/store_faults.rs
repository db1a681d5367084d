//! Damage and faults of the folder store (issue 22), on the real SmolLM2 weights: a damaged
//! or missing manifest is a typed error, never an empty conversation; a conversation stored
//! under another model, weight format or KV precision is refused; a full disk (a small tmpfs)
//! or a read-only folder never loses an acknowledged turn, reports the failure, and never
//! leaves a manifest naming a chunk that was not written.
//!
//! The fault tests mount a tmpfs or a read-only bind mount, which needs root (CI runs as
//! root); elsewhere they print why they were skipped.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pensieve::engine::{
    ConversationId, ConversationOptions, Durability, Engine, EngineConfig, KvPrecision,
    SamplingParams, StoreConfig, Turn,
};
use pensieve::kv::StoreError;
use pensieve::model::{Model, WeightFormat};
use pensieve::Error;

const QUESTIONS: [&str; 3] = [
    "What is the capital of France?",
    "And of Italy?",
    "Which of the two is older?",
];

fn model(format: WeightFormat) -> Arc<Model> {
    Arc::new(common::real_model(format))
}

fn config(dir: &Path) -> EngineConfig {
    EngineConfig::default()
        // Every chunk worth saving, so that chunk writes happen (and fail on a full disk).
        .store(StoreConfig::new(dir).read_bytes_per_s(1e12))
        .check_invariants(true)
}

fn engine(model: &Arc<Model>, dir: &Path) -> Engine {
    Engine::with_model(model.clone(), config(dir)).unwrap()
}

fn named(name: &str) -> ConversationOptions {
    ConversationOptions::default().name(name)
}

fn turn(e: &mut Engine, conv: ConversationId, q: usize) {
    let params = SamplingParams::greedy().max_tokens(6);
    common::run_turn(e, conv, Turn::user(QUESTIONS[q]), params);
}

/// Waits for the outcome of the last manifest write of `conv`.
fn settled(e: &mut Engine, conv: ConversationId) -> Durability {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match e.durability(conv).unwrap() {
            Durability::Pending => {
                assert!(Instant::now() < deadline, "the write never finished");
                std::thread::sleep(Duration::from_millis(2));
            }
            d => return d,
        }
    }
}

/// The manifest file of the only conversation stored under `dir`.
fn manifest_file(dir: &Path) -> PathBuf {
    let found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| Some(e.ok()?.path().join("conversations")))
        .filter(|p| p.is_dir())
        .flat_map(|p| std::fs::read_dir(p).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    assert_eq!(found.len(), 1, "{found:?}");
    found[0].clone()
}

/// Alice's conversation after two turns, stored in `dir`; its tokens.
fn alice_stored(model: &Arc<Model>, dir: &Path) -> Vec<u32> {
    let mut e = engine(model, dir);
    let conv = e.open(named("alice")).unwrap();
    turn(&mut e, conv, 0);
    turn(&mut e, conv, 1);
    assert_eq!(settled(&mut e, conv), Durability::Durable);
    e.tokens(conv).unwrap().to_vec()
}

/// The engine still serves an unnamed conversation.
fn serves(e: &mut Engine) {
    let other = e.open(ConversationOptions::default()).unwrap();
    let r = common::run_turn(
        e,
        other,
        Turn::user(QUESTIONS[0]),
        SamplingParams::greedy().max_tokens(4),
    );
    assert!(!r.tokens.is_empty());
}

#[test]
fn real_model_a_damaged_or_missing_manifest_is_a_typed_error_never_an_empty_conversation() {
    let model = model(WeightFormat::default());
    let dir = tempfile::tempdir().unwrap();
    let tokens = alice_stored(&model, dir.path());
    let file = manifest_file(dir.path());
    let good = std::fs::read(&file).unwrap();
    let mut value: serde_json::Value = serde_json::from_slice(&good).unwrap();
    value["computed"] = serde_json::json!(tokens.len() + 1);
    let too_much_kv = serde_json::to_vec(&value).unwrap();
    value["computed"] = serde_json::json!(0);
    value["tokens"][0] = serde_json::json!(u32::MAX);
    let foreign_token = serde_json::to_vec(&value).unwrap();
    let damages: [(&str, Option<Vec<u8>>, &str); 5] = [
        ("missing", None, "missing"),
        ("empty", Some(Vec::new()), "empty"),
        (
            "cut short",
            Some(good[..good.len() / 2].to_vec()),
            "cut short",
        ),
        ("KV past the tokens", Some(too_much_kv), "inconsistent"),
        (
            "a token past the vocabulary",
            Some(foreign_token),
            "vocabulary",
        ),
    ];
    for (what, bytes, cause_says) in damages {
        match &bytes {
            Some(b) => std::fs::write(&file, b).unwrap(),
            None => std::fs::remove_file(&file).unwrap(),
        }
        let mut e = engine(&model, dir.path());
        match e.resume("alice") {
            Err(Error::StoreDamaged { name, cause }) => {
                assert_eq!(name, "alice");
                assert!(cause.contains(cause_says), "{what}: {cause}");
            }
            other => panic!("{what}: {other:?}"),
        }
        serves(&mut e);
        drop(e);
        // Nothing of it was deleted or rewritten: it can be inspected or repaired.
        assert_eq!(std::fs::read(&file).ok(), bytes, "{what}");
        std::fs::write(&file, &good).unwrap();
    }
    // Repaired, it resumes as it was.
    let mut e = engine(&model, dir.path());
    let conv = e.resume("alice").unwrap();
    assert_eq!(e.tokens(conv).unwrap(), &tokens[..]);
}

#[test]
fn real_model_a_conversation_stored_under_another_model_format_or_precision_is_refused() {
    let model = model(WeightFormat::default());
    let dir = tempfile::tempdir().unwrap();
    alice_stored(&model, dir.path());
    let f32_weights = self::model(WeightFormat::F32);
    let others = [
        (
            "f32 weights",
            Engine::with_model(f32_weights, config(dir.path())),
        ),
        (
            "f32 KV",
            Engine::with_model(
                model.clone(),
                config(dir.path()).kv_precision(KvPrecision::F32),
            ),
        ),
    ];
    for (what, e) in others {
        let mut e = e.unwrap();
        for got in [
            e.resume("alice").map(|_| ()),
            e.open(named("alice")).map(|_| ()),
        ] {
            match got {
                Err(Error::StoredElsewhere { name, owner }) => {
                    assert_eq!(name, "alice");
                    assert!(owner.contains("F16") && owner.contains("Packed"), "{owner}");
                }
                other => panic!("{what}: {other:?}"),
            }
        }
        // Another name is free for it.
        let bob = e.open(named(&format!("bob ({what})"))).unwrap();
        turn(&mut e, bob, 0);
        assert_eq!(settled(&mut e, bob), Durability::Durable, "{what}");
    }
    // The model that stored alice still has her.
    let mut e = engine(&model, dir.path());
    assert!(e.resume("alice").is_ok());
}

/// A mount of its own, unmounted when dropped.
struct Mount(PathBuf, tempfile::TempDir);

impl Mount {
    /// Runs `mount` with `args` then the mount point; `None` (with the reason printed) where
    /// this process may not mount.
    fn new(args: &[&str]) -> Option<Self> {
        let point = tempfile::tempdir().unwrap();
        let out = Command::new("mount").args(args).arg(point.path()).output();
        match out {
            Ok(o) if o.status.success() => Some(Self(point.path().to_path_buf(), point)),
            Ok(o) => {
                let why = String::from_utf8_lossy(&o.stderr);
                eprintln!("skipped: mount {args:?} refused: {why}");
                None
            }
            Err(e) => {
                eprintln!("skipped: cannot run mount: {e}");
                None
            }
        }
    }

    /// A read-only view of `dir`.
    fn read_only(dir: &Path) -> Option<Self> {
        let m = Self::new(&["--bind", dir.to_str()?])?;
        let status = Command::new("mount")
            .args(["-o", "remount,bind,ro"])
            .arg(&m.0)
            .status();
        match status {
            Ok(s) if s.success() => Some(m),
            _ => {
                eprintln!("skipped: the kernel refused a read-only bind mount");
                None
            }
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = &self.1;
    }
}

/// Resumes alice from `dir` in a new engine: her tokens must be `tokens` (the last state
/// acknowledged), every chunk file her manifest lists must be there, and her next turn runs.
fn resumes_as_acknowledged(model: &Arc<Model>, dir: &Path, tokens: &[u32]) {
    let mut e = engine(model, dir);
    let conv = e.resume("alice").unwrap();
    assert_eq!(e.tokens(conv).unwrap(), tokens);
    turn(&mut e, conv, 2);
    let faults = e.stats().store.unwrap().faults;
    assert_eq!(
        faults.missing, 0,
        "the manifest listed a chunk never written"
    );
}

#[test]
fn real_model_a_full_store_never_loses_an_acknowledged_turn_and_says_so() {
    let model = model(WeightFormat::default());
    let Some(store) = Mount::new(&["-t", "tmpfs", "-o", "size=64k", "tmpfs"]) else {
        return;
    };
    let mut e = engine(&model, &store.0);
    let conv = e.open(named("alice")).unwrap();
    // A chunk file (over 200 KB) does not fit: its write fails, the manifest does not.
    turn(&mut e, conv, 0);
    assert_eq!(settled(&mut e, conv), Durability::Durable);
    let acknowledged = e.tokens(conv).unwrap().to_vec();
    // Nothing left for the next manifest either.
    let filler = store.0.join("filler");
    let _ = std::fs::write(&filler, vec![0u8; 1 << 20]);
    turn(&mut e, conv, 1);
    match settled(&mut e, conv) {
        Durability::Failed(why) => assert!(
            matches!(&why, StoreError::Io { source, .. } if source.kind() == ErrorKind::StorageFull),
            "{why}"
        ),
        other => panic!("{other:?}"),
    }
    serves(&mut e);
    assert!(
        e.stats().store.unwrap().save_failures > 0,
        "no chunk write failed"
    );
    drop(e);
    std::fs::remove_file(&filler).unwrap();
    resumes_as_acknowledged(&model, &store.0, &acknowledged);
}

#[test]
fn real_model_a_read_only_store_never_loses_an_acknowledged_turn_and_says_so() {
    let model = model(WeightFormat::default());
    let dir = tempfile::tempdir().unwrap();
    let acknowledged = alice_stored(&model, dir.path());
    let Some(view) = Mount::read_only(dir.path()) else {
        return;
    };
    let mut e = engine(&model, &view.0);
    let conv = e.resume("alice").unwrap();
    turn(&mut e, conv, 2);
    match settled(&mut e, conv) {
        Durability::Failed(why) => assert!(
            matches!(&why, StoreError::Io { source, .. } if source.kind() == ErrorKind::ReadOnlyFilesystem),
            "{why}"
        ),
        other => panic!("{other:?}"),
    }
    serves(&mut e);
    drop(e);
    drop(view);
    resumes_as_acknowledged(&model, dir.path(), &acknowledged);
}

#[test]
fn real_model_the_chat_example_refuses_a_conversation_stored_under_another_model_or_kv() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.txt");
    std::fs::write(&script, "What is the capital of France?\n").unwrap();
    let store = dir.path().join("store");
    let chat = |extra: &[&str]| {
        Command::new(common::server::example("chat"))
            .args([
                "--script",
                script.to_str().unwrap(),
                "--json",
                "--no-compare",
            ])
            .args(["--max-tokens", "4", "--conversation", "alice"])
            .args(["--store", store.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap()
    };
    let first = chat(&[]);
    assert!(first.status.success(), "{first:?}");
    for other in [&["--kv", "f32"][..], &["--format", "f32"][..]] {
        let out = chat(other);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{other:?} started another alice");
        assert!(
            err.contains("stored under another model or format"),
            "{other:?}: {err}"
        );
    }
    // The model it was stored under continues it.
    let again = chat(&[]);
    assert!(again.status.success(), "{again:?}");
}
