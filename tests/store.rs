//! The store tier on the real SmolLM2 weights: warm restart, damaged files, a full budget and a
//! failing disk. In every case each conversation's greedy outputs equal those of a `Stateless`
//! engine running the same turns (the default weight path is batch-invariant, so the rule is
//! strict), and the stats count what the tier detected.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use pensieve::engine::{
    Budgets, CacheMode, ConversationId, ConversationOptions, CostModel, CostProfile, Engine,
    EngineConfig, SamplingParams, StoreConfig, Turn, TurnStats,
};
use pensieve::model::{Model, WeightFormat};

const QUESTIONS: [&str; 6] = [
    "What is the capital of France?",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
    "What color is the sky on a clear day?",
    "What is two plus two?",
    "What do bees make?",
];

fn model() -> Arc<Model> {
    Arc::new(common::real_model(WeightFormat::default()))
}

/// An engine; with `disk`, a store tier of `store_bytes` there.
fn engine(model: &Arc<Model>, mode: CacheMode, store: Option<(&Path, usize)>) -> Engine {
    let budgets = Budgets::default().device_tokens(2048).host_bytes(1 << 30);
    engine_with(model, mode, store, budgets)
}

fn engine_with(
    model: &Arc<Model>,
    mode: CacheMode,
    store: Option<(&Path, usize)>,
    budgets: Budgets,
) -> Engine {
    Engine::with_model(model.clone(), config(mode, store, budgets)).unwrap()
}

fn config(mode: CacheMode, store: Option<(&Path, usize)>, budgets: Budgets) -> EngineConfig {
    EngineConfig::default()
        .mode(mode)
        .budgets(budgets)
        .step_token_budget(128)
        // A fixed curve: every chunk costs more to recompute than to read back.
        .cost_profile(CostProfile::Fixed(CostModel::new(1e-3, 1e-6)))
        .store(store.map(|(dir, budget_bytes)| StoreConfig::new(dir).budget_bytes(budget_bytes)))
        .check_invariants(true)
}

fn params() -> SamplingParams {
    SamplingParams::greedy().max_tokens(6).ignore_eos(true)
}

/// Runs turn `turn` of every conversation together; returns each one's generated tokens and
/// stats.
fn turn(e: &mut Engine, convs: &[ConversationId], turn: usize) -> Vec<(Vec<u32>, TurnStats)> {
    let ids: Vec<_> = convs
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let q = QUESTIONS[(i + turn) % QUESTIONS.len()];
            e.submit(c, Turn::user(q), params()).unwrap()
        })
        .collect();
    let mut out = vec![(Vec::new(), TurnStats::default()); convs.len()];
    while e.has_work() {
        for ev in e.step().unwrap() {
            let (request, done) = match ev {
                pensieve::engine::Event::Token { request, token, .. } => (request, Err(token)),
                pensieve::engine::Event::Finished {
                    request,
                    stats,
                    reason,
                    ..
                } => {
                    assert!(
                        !matches!(reason, pensieve::engine::FinishReason::Failed(_)),
                        "{reason:?}"
                    );
                    (request, Ok(stats))
                }
                other => panic!("unexpected event {other:?}"),
            };
            let k = ids.iter().position(|&r| r == request).unwrap();
            match done {
                Err(token) => out[k].0.push(token),
                Ok(stats) => out[k].1 = stats,
            }
        }
    }
    out
}

fn open(e: &mut Engine, names: &[String]) -> Vec<ConversationId> {
    names
        .iter()
        .map(|n| {
            e.open(ConversationOptions::default().name(n.clone()))
                .unwrap()
        })
        .collect()
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("conversation {i}")).collect()
}

/// Outputs of turns `0..turns` of `n` conversations on a stateless engine.
fn stateless(model: &Arc<Model>, n: usize, turns: usize) -> Vec<Vec<Vec<u32>>> {
    let mut e = engine(model, CacheMode::Stateless, None);
    let convs: Vec<_> = (0..n)
        .map(|_| e.open(ConversationOptions::default()).unwrap())
        .collect();
    (0..turns)
        .map(|t| turn(&mut e, &convs, t).into_iter().map(|o| o.0).collect())
        .collect()
}

/// The store's folder for the model's chunks and manifests.
fn root_of(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("conversations").is_dir())
        .unwrap()
}

/// The manifest file of conversation `name`, and its name's registration.
fn manifest_of(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let hex: String = name.bytes().map(|b| format!("{b:02x}")).collect();
    let manifest = root_of(dir)
        .join("conversations")
        .join(format!("{hex}.json"));
    (manifest, dir.join("names").join(hex))
}

/// The chunk files a conversation's manifest names, in chunk order.
fn files_of(dir: &Path, name: &str) -> Vec<PathBuf> {
    let root = root_of(dir);
    let manifest = manifest_of(dir, name).0;
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(manifest).unwrap()).unwrap();
    m["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c.as_str())
        .map(|c| root.join("chunks").join(format!("{c}.kvc")))
        .collect()
}

#[test]
fn a_restarted_engine_resumes_named_conversations_as_if_it_never_stopped() {
    let model = model();
    let dir = tempfile::tempdir().unwrap();
    let names = names(3);
    let reference = stateless(&model, names.len(), 3);
    {
        let mut a = engine(&model, CacheMode::Tiered, Some((dir.path(), 1 << 30)));
        let convs = open(&mut a, &names);
        for (t, want) in reference.iter().take(2).enumerate() {
            let got: Vec<_> = turn(&mut a, &convs, t).into_iter().map(|o| o.0).collect();
            assert_eq!(&got, want, "turn {t} before the restart");
        }
        let d = a.stats().store.unwrap();
        assert!(d.bytes_used > 0 && d.bytes_used <= d.budget_bytes, "{d:?}");
    }
    // A never-restarted engine's third turn, for the work it does.
    let mut warm = engine(&model, CacheMode::Tiered, None);
    let warm_convs: Vec<_> = (0..names.len())
        .map(|_| warm.open(ConversationOptions::default()).unwrap())
        .collect();
    let warm_out: Vec<_> = (0..3).map(|t| turn(&mut warm, &warm_convs, t)).collect();

    let mut b = engine(&model, CacheMode::Tiered, Some((dir.path(), 1 << 30)));
    let mut stored = b.named_conversations();
    stored.sort();
    assert_eq!(
        stored.iter().map(|s| s.0.clone()).collect::<Vec<_>>(),
        names
    );
    let convs: Vec<_> = names.iter().map(|n| b.find(n).unwrap()).collect();
    assert!(matches!(
        b.open(ConversationOptions::default().name(names[0].clone())),
        Err(pensieve::Error::ConversationExists(_))
    ));
    let third = turn(&mut b, &convs, 2);
    for (i, (out, stats)) in third.iter().enumerate() {
        assert_eq!(out, &reference[2][i], "conversation {i} after the restart");
        let never = &warm_out[2][i].1;
        assert_eq!(stats.prefilled_tokens, never.prefilled_tokens, "{stats:?}");
        assert_eq!(stats.recomputed_tokens, 0, "{stats:?}");
        assert_eq!(stats.reused_tokens, never.reused_tokens, "{stats:?}");
        assert_eq!(
            stats.reused_from_store_tokens, stats.reused_tokens,
            "{stats:?}"
        );
    }
    let d = b.stats().store.unwrap();
    assert_eq!(d.faults.total(), 0, "{d:?}");
    assert!(d.chunks_read > 0, "{d:?}");
}

#[test]
fn damaged_files_are_detected_and_recomputed_never_used() {
    damaged_files_are_refused(true);
}

/// The same with restores that wait for whole chunks (a GPU's copy stream), each read and
/// checked whole on the store's reader thread before its copy.
#[test]
fn damaged_files_read_whole_are_detected_and_recomputed_never_used() {
    damaged_files_are_refused(false);
}

fn damaged_files_are_refused(pipelined: bool) {
    let model = model();
    let dir = tempfile::tempdir().unwrap();
    let names = names(6);
    let reference = stateless(&model, names.len(), 3);
    {
        let mut a = engine(&model, CacheMode::Tiered, Some((dir.path(), 1 << 30)));
        let convs = open(&mut a, &names);
        for t in 0..2 {
            turn(&mut a, &convs, t);
        }
    }
    // A valid file of another KV layout (f32 values: another fingerprint), to plant.
    let other = tempfile::tempdir().unwrap();
    {
        let config = EngineConfig::default()
            .kv_precision(pensieve::engine::KvPrecision::F32)
            .cost_profile(CostProfile::Fixed(CostModel::new(1e-3, 1e-6)))
            .store(StoreConfig::new(other.path()));
        let mut f = Engine::with_model(model.clone(), config).unwrap();
        let c = open(&mut f, &names[..1])[0];
        turn(&mut f, &[c], 0);
    }
    let foreign = files_of(other.path(), &names[0]);
    let files: Vec<Vec<PathBuf>> = names.iter().map(|n| files_of(dir.path(), n)).collect();
    assert!(files.iter().all(|f| f.len() >= 2), "{files:?}");
    // 0: a flipped payload byte; 1: cut short; 2: deleted; 3: two files swapped; 4: a foreign
    // file under one of ours' names; 5: untouched.
    let mut bytes = std::fs::read(&files[0][1]).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x40;
    std::fs::write(&files[0][1], bytes).unwrap();
    let bytes = std::fs::read(&files[1][0]).unwrap();
    std::fs::write(&files[1][0], &bytes[..bytes.len() / 2]).unwrap();
    std::fs::remove_file(&files[2][1]).unwrap();
    let (x, y) = (
        std::fs::read(&files[3][0]).unwrap(),
        std::fs::read(&files[3][1]).unwrap(),
    );
    std::fs::write(&files[3][0], y).unwrap();
    std::fs::write(&files[3][1], x).unwrap();
    std::fs::copy(&foreign[0], &files[4][0]).unwrap();

    // No read-ahead: every file is read on demand. Pipelined, layer by layer into the running
    // pass, so the flipped byte (in the last layer) is found after the pass has used the first
    // layers: that conversation's row is discarded and redone. Otherwise whole, before the
    // copy: that conversation's swap-in fails and its row waits to recompute.
    let budgets = Budgets::default().device_tokens(2048).host_bytes(1 << 30);
    let config = config(CacheMode::Tiered, Some((dir.path(), 1 << 30)), budgets)
        .prefetch_window(0)
        .pipelined_restore(pipelined);
    // Each refusal is also a warning for the host's logs (here captured from this thread).
    let log = Log::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(log.clone())
        .with_ansi(false)
        .finish();
    let (b, third) = tracing::subscriber::with_default(subscriber, || {
        let mut b = Engine::with_model(model.clone(), config).unwrap();
        let convs: Vec<_> = names.iter().map(|n| b.find(n).unwrap()).collect();
        let third = turn(&mut b, &convs, 2);
        (b, third)
    });
    let warned = log.text();
    let refusals = warned
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("refused"))
        .count();
    assert!(refusals >= 5, "{warned}");
    for (i, (out, stats)) in third.iter().enumerate() {
        assert_eq!(out, &reference[2][i], "conversation {i}: {stats:?}");
        if i < 5 {
            assert!(stats.recomputed_tokens > 0, "conversation {i}: {stats:?}");
        } else {
            assert_eq!(stats.recomputed_tokens, 0, "{stats:?}");
        }
    }
    let f = b.stats().store.unwrap().faults;
    assert_eq!(
        (
            f.corrupt,
            f.truncated,
            f.missing,
            f.wrong_content,
            f.foreign
        ),
        (1, 1, 1, 2, 1),
        "{f:?}"
    );
    // The other files were refused by the start-up scan or at adoption; the corrupt one failed
    // its swap-in (pipelined, after the pass had started on it; its row was redone, equal
    // above).
    assert_eq!(b.stats().swap_in_failures, 1, "{:?}", b.stats());
}

#[test]
fn a_full_budget_or_a_failing_store_refuses_saves_and_the_engine_keeps_serving() {
    let model = model();
    let names = names(6);
    let reference = stateless(&model, names.len(), 3);
    // Room for a few chunk files only (SmolLM2's 32-token chunk is ~0.7 MB in f16).
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(&model, CacheMode::Tiered, Some((dir.path(), 3 << 20)));
    let convs = open(&mut e, &names);
    for (t, want) in reference.iter().enumerate() {
        let got: Vec<_> = turn(&mut e, &convs, t).into_iter().map(|o| o.0).collect();
        assert_eq!(&got, want, "turn {t}");
    }
    let d = e.stats().store.unwrap();
    assert!(d.saves_refused > 0 || d.files_removed > 0, "{d:?}");
    assert!(d.bytes_used <= d.budget_bytes, "{d:?}");

    // The chunk folder turns into a file: every write fails from now on.
    let dir = tempfile::tempdir().unwrap();
    let mut e = engine(&model, CacheMode::Tiered, Some((dir.path(), 1 << 30)));
    let convs = open(&mut e, &names);
    // The store's folder of this model (beside it, the names' registrations).
    let root = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.join("chunks").is_dir())
        .unwrap();
    std::fs::remove_dir_all(root.join("chunks")).unwrap();
    std::fs::write(root.join("chunks"), b"not a folder").unwrap();
    for (t, want) in reference.iter().enumerate() {
        let got: Vec<_> = turn(&mut e, &convs, t).into_iter().map(|o| o.0).collect();
        assert_eq!(&got, want, "turn {t} on a failing store");
    }
    e.flush();
    let d = e.stats().store.unwrap();
    assert!(d.save_failures > 0, "{d:?}");
    assert_eq!(d.chunks_written, 0, "{d:?}");
}

/// An engine whose device and host tiers hold a few conversations' KV, and whose store in
/// `dir` holds everyone's.
fn pressured(model: &Arc<Model>, dir: &Path) -> Engine {
    let budgets = Budgets::default().device_tokens(512).host_bytes(3 << 20);
    engine_with(model, CacheMode::Tiered, Some((dir, 1 << 30)), budgets)
}

#[test]
fn under_pressure_kv_goes_through_the_store_tier_and_comes_back_ahead_of_its_turn() {
    let model = model();
    let n = 12;
    // Four turns: by the third, stored chunks are read back; by the fourth, some are read
    // ahead into host room (which chunks wait where depends on the step timings).
    let reference = stateless(&model, n, 4);
    let dir = tempfile::tempdir().unwrap();
    let mut e = pressured(&model, dir.path());
    let convs: Vec<_> = (0..n)
        .map(|_| e.open(ConversationOptions::default()).unwrap())
        .collect();
    let mut from_store = 0;
    for (t, want) in reference.iter().enumerate() {
        let out = turn(&mut e, &convs, t);
        from_store += out
            .iter()
            .map(|o| o.1.reused_from_store_tokens)
            .sum::<usize>();
        let got: Vec<_> = out.into_iter().map(|o| o.0).collect();
        assert_eq!(&got, want, "turn {t}");
    }
    let s = e.stats();
    let d = s.store.unwrap();
    assert!(s.chunks_to_store > 0, "{s:?}");
    assert!(d.chunks_prefetched > 0, "{d:?}");
    assert!(from_store > 0 || s.reused_host_tokens > 0, "{s:?}");
    assert_eq!(d.faults.total(), 0, "{d:?}");
}

/// An idle engine says when its next read-ahead is due (`poll_timeout`), and a step at that
/// moment reads a conversation's disk-only KV back before its turn: a host loop that sleeps
/// until then needs no polling.
#[test]
fn an_idle_engine_says_when_a_read_ahead_is_due() {
    use std::time::{Duration, Instant};
    let model = model();
    let dir = tempfile::tempdir().unwrap();
    let mut e = pressured(&model, dir.path());
    let convs: Vec<_> = (0..12)
        .map(|_| e.open(ConversationOptions::default()).unwrap())
        .collect();
    for t in 0..2 {
        turn(&mut e, &convs, t);
    }
    // The first conversation's KV is on disk only by now; the others are done with, which
    // leaves the host tier room to read it into. Nothing is timed.
    for &c in &convs[1..] {
        e.release(c).unwrap();
    }
    // A read-ahead reads files: a chunk whose write is still queued (a busy machine) is read
    // from memory and counts as no read. So the writes finish first, and a step takes their
    // reports.
    let mark = e.store_mark().unwrap();
    while !e.store_reached(mark) {
        std::thread::sleep(Duration::from_millis(5));
    }
    e.step().unwrap();
    assert_eq!(e.poll_timeout(), None);
    let prefetched = |e: &Engine| e.stats().store.unwrap().chunks_prefetched;
    let before = prefetched(&e);
    let lead = e.config().prefetch_lead;
    let ahead = Duration::from_millis(300);
    // Bounded by instants read on both sides of the call, not by how fast it ran.
    let asked = Instant::now();
    e.expect_resume(convs[0], lead + ahead).unwrap();
    let due = e.poll_timeout().expect("a read-ahead is timed");
    let answered = Instant::now();
    assert!(
        due >= asked + ahead && due <= answered + ahead,
        "{due:?} not {ahead:?} after {asked:?}..{answered:?}"
    );
    assert_eq!(prefetched(&e), before, "not before it is due");
    std::thread::sleep(due.saturating_duration_since(Instant::now()));
    e.step().unwrap();
    assert!(prefetched(&e) > before, "read ahead when due");
    assert_eq!(e.poll_timeout(), None, "nothing more is timed");
}

/// The store's threads wake a host loop when they finish a job, so a host that waits for a
/// write (`store_reached`) sleeps on its own channel instead of polling.
#[test]
fn the_store_wakes_the_host_when_its_writes_finish() {
    use std::time::Duration;
    let model = model();
    let dir = tempfile::tempdir().unwrap();
    let mut e = pressured(&model, dir.path());
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    e.set_store_waker(Arc::new(move || {
        let _ = tx.lock().unwrap().send(());
    }));
    let conv = e.open(ConversationOptions::default()).unwrap();
    turn(&mut e, &[conv], 0);
    let mark = e.store_mark().unwrap();
    // Woken (never more than a few seconds away on a local disk) until the mark is reached;
    // each write that reached it woke the host once.
    let mut wakes = 0;
    while !e.store_reached(mark) {
        rx.recv_timeout(Duration::from_secs(30))
            .expect("the store wakes the host when a write finishes");
        wakes += 1;
    }
    wakes += rx.try_iter().count();
    assert!(wakes > 0, "no wake for the turn's writes");
}

/// Log lines written by a `tracing` subscriber, kept in memory.
#[derive(Clone, Default)]
struct Log(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Log {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Log {
    type Writer = Log;

    fn make_writer(&'a self) -> Log {
        self.clone()
    }
}

/// Makes the file at `path` read as last written `ago`.
fn age(path: &Path, ago: Duration) {
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.set_modified(SystemTime::now() - ago).unwrap();
}

#[test]
fn conversations_unused_past_their_time_to_live_leave_the_folder_with_their_files() {
    let model = model();
    let dir = tempfile::tempdir().unwrap();
    let names = names(3);
    // Swept at open, and while writing once a 24th of it (a second) has passed.
    let ttl = Duration::from_secs(24);
    let config = || {
        let budgets = Budgets::default().device_tokens(2048).host_bytes(1 << 30);
        let store = StoreConfig::new(dir.path()).expire_after(Some(ttl));
        config(CacheMode::Tiered, None, budgets).store(Some(store))
    };
    let mut a = Engine::with_model(model.clone(), config()).unwrap();
    let convs = open(&mut a, &names);
    turn(&mut a, &convs, 0);
    a.flush();
    drop(a);
    let others: Vec<PathBuf> = names[1..]
        .iter()
        .flat_map(|n| files_of(dir.path(), n))
        .collect();
    let only_first: Vec<PathBuf> = (files_of(dir.path(), &names[0]).into_iter())
        .filter(|f| !others.contains(f))
        .collect();
    assert!(!only_first.is_empty());
    let (manifest, registration) = manifest_of(dir.path(), &names[0]);
    assert!(registration.exists());
    age(&manifest, Duration::from_secs(3600));

    // At open: the expired conversation is not resumed, and none of its files stay.
    let mut b = Engine::with_model(model.clone(), config()).unwrap();
    // Files no conversation needs are deleted behind.
    b.flush();
    let mut resumed: Vec<String> = b.named_conversations().into_iter().map(|n| n.0).collect();
    resumed.sort();
    assert_eq!(resumed, names[1..]);
    assert!(!manifest.exists() && !registration.exists());
    for f in &only_first {
        assert!(!f.exists(), "{f:?}");
    }
    assert!(others.iter().all(|f| f.exists()));
    assert_eq!(b.stats().store.unwrap().conversations_expired, 1);

    // While an engine writes: a turn's manifest write sweeps once the interval passed.
    let (manifest, _) = manifest_of(dir.path(), &names[1]);
    age(&manifest, Duration::from_secs(3600));
    std::thread::sleep(Duration::from_millis(1100));
    let last = b.find(&names[2]).unwrap();
    turn(&mut b, &[last], 1);
    b.flush();
    assert!(!manifest.exists());
    assert!(manifest_of(dir.path(), &names[2]).0.exists());
    assert_eq!(b.stats().store.unwrap().conversations_expired, 2);
}

/// A host without the service reads what a resume or a named open needs on a thread of its
/// own, and the engine applies it: the conversation continues as it would have.
#[test]
fn a_host_reads_the_store_off_its_step_thread_and_the_engine_applies_what_it_read() {
    let model = model();
    let dir = tempfile::tempdir().unwrap();
    let reference = stateless(&model, 1, 2);
    let mut e = engine(&model, CacheMode::Tiered, Some((dir.path(), 1 << 30)));
    let c = open(&mut e, &["alice".to_string()])[0];
    assert_eq!(turn(&mut e, &[c], 0)[0].0, reference[0][0]);
    e.flush();
    let tokens = e.tokens(c).unwrap().to_vec();
    e.detach(c).unwrap();
    let reader = e.resume_reader().unwrap();
    let [alice, carol] = std::thread::spawn(move || ["alice", "carol"].map(|n| reader.fetch(n)))
        .join()
        .unwrap();
    let refused = |r| match r {
        Err(pensieve::Error::InvalidRequest { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    assert_eq!(refused(e.resume_with("alice", carol)), "fetched");
    let c = e.resume_with("alice", alice).unwrap();
    assert_eq!(e.tokens(c).unwrap(), tokens);
    // (Its chunk files went with the detached copy, their last reference: recomputed.)
    assert_eq!(turn(&mut e, &[c], 1)[0].0, reference[1][0]);

    let reader = e.resume_reader().unwrap();
    let [bob, erin] = std::thread::spawn(move || ["bob", "erin"].map(|n| reader.registration(n)))
        .join()
        .unwrap();
    let named = |n: &str| ConversationOptions::default().name(n.to_string());
    let dave = e.open_registered(named("dave"), erin);
    assert_eq!(refused(dave), "registration");
    let b = e.open_registered(named("bob"), bob).unwrap();
    assert_eq!(e.find("bob"), Some(b));
    assert_eq!(e.find("dave"), None);
}
