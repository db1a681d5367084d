//! The store tier's background threads: one writes files behind the engine (AttentionStore
//! §3.3), so that a step never waits for the file system to save KV; one reads chunks ahead of
//! the turns that will need them (§3.4), checking each whole before handing it over.
//!
//! Jobs run in the order they were queued, so a chunk's removal or a manifest naming new
//! chunks never overtakes the writes before it. Every write is atomic (the medium's promise).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use parking_lot::Mutex;

use super::error::StoreError;
use super::format::{
    check_layer, decode_chunk, decode_head, encode_header, Address, ChunkFormat, ChunkId, Fault,
};
use super::medium::{stored, Medium, Refused};
use crate::kv::{Arrived, ChunkBytes, ChunkUnavailable, LayerCells};

/// What the worker does.
pub(super) enum Job {
    /// Writes a chunk file: its header, then the chunk's bytes (waiting for a device copy
    /// still filling them).
    Chunk {
        bytes: Arc<ChunkBytes>,
        format: ChunkFormat,
        id: ChunkId,
        /// The store's number for this write.
        write: u64,
    },
    /// Writes a conversation manifest if the stored one carries the stamp `expect` (or none
    /// is stored), its bytes built when its turn comes, from which chunk writes succeeded.
    Manifest {
        name: String,
        expect: String,
        build: BuildManifest,
    },
    /// Removes a chunk if it is stored.
    RemoveChunk(Address),
    /// Removes a manifest if it is stored.
    RemoveManifest(String),
    /// Reads and checks a chunk file, putting its payload (or why it was refused) in `cell`.
    Read {
        format: ChunkFormat,
        address: Address,
        tokens: usize,
        cell: Arc<OnceLock<Arrived>>,
    },
    /// Reads a chunk file layer by layer, putting each layer's bytes in its cell once
    /// checked, so that a restore uses the first layers while later ones are still read.
    ReadLayers {
        format: ChunkFormat,
        address: Address,
        tokens: usize,
        layers: Arc<LayerCells>,
    },
    /// Asks a shared store which of `chunks` (address, KV-tokens) it holds, in one request.
    Lookup {
        /// The store's number for this lookup.
        lookup: u64,
        chunks: Vec<(Address, usize)>,
    },
    /// Answers once every job before it is done.
    Flush(Sender<()>),
}

/// Builds a manifest's bytes, given whether the chunk write of each number succeeded (so a
/// manifest lists only chunks that were written); an error fails the write.
pub(crate) type BuildManifest =
    Box<dyn FnOnce(&dyn Fn(u64) -> bool) -> Result<Vec<u8>, StoreError> + Send>;

/// A finished job the store must hear about.
pub(super) enum Done {
    /// A chunk write, numbered `write` by the store.
    Written {
        address: Address,
        write: u64,
        result: Result<(), StoreError>,
    },
    /// A read ahead whose file was refused.
    Refused { address: Address, fault: Fault },
    /// A lookup answered: the chunks the store holds (none if it could not say).
    Looked {
        lookup: u64,
        found: Vec<(Address, usize)>,
    },
}

/// Called on a worker's thread after each job it runs: how a host loop waiting on the store
/// learns, without polling, that a write is done. It must not block.
pub(crate) type Waker = Arc<dyn Fn() + Send + Sync>;

/// The thread and its queues. The store and its manifests' handle share the writer (so a
/// manifest follows the chunk writes it names): jobs are numbered under the queue's lock.
pub(super) struct Worker {
    jobs: Mutex<Option<Sender<Job>>>,
    done: Mutex<Receiver<Done>>,
    thread: Option<JoinHandle<()>>,
    /// Jobs queued, and jobs run (in queue order, so the first `ran` of them).
    queued: AtomicU64,
    ran: Arc<AtomicU64>,
    /// Manifest writes that failed, by job number (1-based, in queue order), with why; the
    /// latest [`FAILURES_KEPT`] only.
    failures: Arc<Mutex<BTreeMap<u64, Refused>>>,
    waker: Arc<Mutex<Option<Waker>>>,
}

impl std::fmt::Debug for Worker {
    // The waker is a closure: what a worker is, is its counts.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("queued", &self.queued)
            .field("ran", &self.ran)
            .finish_non_exhaustive()
    }
}

/// How many failed manifest (and chunk) writes the worker remembers: enough for every turn
/// end a server holds back at once, and for every chunk a queued manifest may list, bounded
/// so a store that keeps failing costs no more memory.
const FAILURES_KEPT: usize = 4096;

impl Worker {
    /// Starts the thread, over `medium`.
    ///
    /// # Errors
    /// The OS's refusal to start a thread.
    pub fn start(medium: Arc<dyn Medium>) -> std::io::Result<Self> {
        let (jobs, queue) = channel::<Job>();
        let (report, done) = channel();
        let ran = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(BTreeMap::new()));
        let waker: Arc<Mutex<Option<Waker>>> = Arc::default();
        let (counter, failed, wake) = (Arc::clone(&ran), Arc::clone(&failures), Arc::clone(&waker));
        let thread = std::thread::Builder::new()
            .name("pensieve-store".into())
            .spawn(move || run(&*medium, &queue, &report, &counter, &failed, &wake))?;
        Ok(Self {
            jobs: Mutex::new(Some(jobs)),
            done: Mutex::new(done),
            thread: Some(thread),
            queued: AtomicU64::new(0),
            ran,
            failures,
            waker,
        })
    }

    /// Calls `waker` after each job from now on.
    pub fn set_waker(&self, waker: Waker) {
        *self.waker.lock() = Some(waker);
    }

    /// Queues a job; `false` if the thread is gone (it never exits while the worker lives,
    /// unless it panicked).
    pub fn send(&self, job: Job) -> bool {
        self.send_numbered(job).is_some()
    }

    /// Queues a job and returns its number (the count of jobs queued with it), for
    /// [`Worker::outcome`]; `None` if the thread is gone. Numbered under the queue's lock, so
    /// the numbers follow the queue's order whoever sends.
    pub fn send_numbered(&self, job: Job) -> Option<u64> {
        let jobs = self.jobs.lock();
        let sent = jobs.as_ref().is_some_and(|j| j.send(job).is_ok());
        sent.then(|| self.queued.fetch_add(1, Ordering::SeqCst) + 1)
    }

    /// What became of job `number`: `None` while it has not run; else whether it did what it
    /// was asked (a manifest written), or why not. A failure older than the last
    /// [`FAILURES_KEPT`] reads as done.
    pub fn outcome(&self, number: u64) -> Option<Result<(), Refused>> {
        if self.ran() < number {
            return None;
        }
        Some(match self.failures.lock().get(&number) {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        })
    }

    /// How many jobs were queued so far.
    pub fn queued(&self) -> u64 {
        self.queued.load(Ordering::SeqCst)
    }

    /// How many jobs have run (the first ones queued).
    pub fn ran(&self) -> u64 {
        self.ran.load(Ordering::SeqCst)
    }

    /// Chunk writes finished since the last call.
    pub fn finished(&self) -> Vec<Done> {
        self.done.lock().try_iter().collect()
    }

    /// Waits until every job queued so far has run.
    pub fn flush(&self) {
        let (tx, rx) = channel();
        if self.send(Job::Flush(tx)) {
            let _ = rx.recv();
        }
    }
}

impl Drop for Worker {
    /// Finishes the queued writes, so a clean shutdown saves everything it promised.
    fn drop(&mut self) {
        self.jobs.lock().take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(
    medium: &dyn Medium,
    queue: &Receiver<Job>,
    report: &Sender<Done>,
    ran: &AtomicU64,
    failures: &Mutex<BTreeMap<u64, Refused>>,
    waker: &Mutex<Option<Waker>>,
) {
    let mut failed_chunks = BTreeSet::new();
    for job in queue {
        // Recorded before the job counts as run, so a reader that sees it run sees its fate.
        if let Err(why) = run_one(medium, job, report, &mut failed_chunks) {
            let number = ran.load(Ordering::SeqCst) + 1;
            let mut f = failures.lock();
            f.insert(number, why);
            while f.len() > FAILURES_KEPT {
                f.pop_first();
            }
        }
        ran.fetch_add(1, Ordering::SeqCst);
        // Called outside the lock: a waker may take its time (it must not block for long).
        let wake = waker.lock().clone();
        if let Some(wake) = wake {
            wake();
        }
    }
}

/// Runs `job`; the error of a manifest write (the one a caller may wait on), else `Ok`.
/// `failed_chunks`: the numbers of the chunk writes that failed (the latest ones).
fn run_one(
    medium: &dyn Medium,
    job: Job,
    report: &Sender<Done>,
    failed_chunks: &mut BTreeSet<u64>,
) -> Result<(), Refused> {
    match job {
        Job::Lookup { lookup, chunks } => {
            let found = stored(medium, &chunks);
            let _ = report.send(Done::Looked { lookup, found });
        }
        Job::Chunk {
            bytes,
            format,
            id,
            write,
        } => {
            let result = write_chunk(medium, &bytes, &format, &id);
            if result.is_err() {
                failed_chunks.insert(write);
                while failed_chunks.len() > FAILURES_KEPT {
                    failed_chunks.pop_first();
                }
            }
            // The engine may be gone (dropped while jobs were queued): nobody to tell.
            let address = id.address;
            let _ = report.send(Done::Written {
                address,
                write,
                result,
            });
        }
        Job::Manifest {
            name,
            expect,
            build,
        } => {
            let contents =
                build(&|write| !failed_chunks.contains(&write)).map_err(Refused::Failed)?;
            return medium.put_manifest(&name, &contents, &expect);
        }
        Job::RemoveChunk(address) => medium.remove_chunk(&address),
        Job::RemoveManifest(name) => return medium.remove_manifest(&name).map_err(Refused::Failed),
        Job::Read {
            format,
            address,
            tokens,
            cell,
        } => {
            let read = read_chunk(medium, &format, &address, tokens);
            if let Err(fault) = read {
                let _ = report.send(Done::Refused { address, fault });
            }
            let _ = cell.set(read.map_err(|fault| ChunkUnavailable::Refused {
                at: medium.describe(&address),
                fault,
            }));
        }
        Job::ReadLayers {
            format,
            address,
            tokens,
            layers,
        } => {
            if let Err(fault) = read_layers(medium, &format, &address, tokens, &layers) {
                // Layers already handed over were checked; the rest never will be.
                let why = ChunkUnavailable::Refused {
                    at: medium.describe(&address),
                    fault,
                };
                layers.iter().for_each(|cell| {
                    let _ = cell.set(Err(why.clone()));
                });
                let _ = report.send(Done::Refused { address, fault });
            }
        }
        Job::Flush(tx) => {
            let _ = tx.send(());
        }
    }
    Ok(())
}

/// Writes a chunk file: its header, then its bytes (waiting for a device copy still filling
/// them).
fn write_chunk(
    medium: &dyn Medium,
    bytes: &ChunkBytes,
    format: &ChunkFormat,
    id: &ChunkId,
) -> Result<(), StoreError> {
    let payload = bytes.bytes().map_err(StoreError::Unavailable)?;
    let header = encode_header(format, id, payload);
    medium.put_chunk(&id.address, &[&header, payload])
}

/// Reads the chunk at `address` (`tokens` KV-tokens) layer by layer into `layers`, checking
/// the header and layer table first and each layer before handing it over.
///
/// # Errors
/// The [`Fault`] that refuses the chunk (layers before it were handed over).
fn read_layers(
    medium: &dyn Medium,
    format: &ChunkFormat,
    address: &Address,
    tokens: usize,
    layers: &LayerCells,
) -> Result<(), Fault> {
    let io = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => Fault::Truncated,
        kind => Fault::Io(kind),
    };
    let (mut reader, _) = medium.open_chunk(address)?;
    let mut head = vec![0u8; format.head_bytes()];
    reader.read_exact(&mut head).map_err(io)?;
    let table = decode_head(format, &head, address, tokens)?;
    for (i, cell) in layers.iter().enumerate() {
        let mut bytes = vec![0u8; format.layer_bytes(tokens)];
        reader.read_exact(&mut bytes).map_err(io)?;
        check_layer(table, i, &bytes)?;
        let _ = cell.set(Ok(bytes));
    }
    Ok(())
}

/// Reads the chunk at `address` (`tokens` KV-tokens) and checks it whole; returns its payload.
///
/// # Errors
/// The [`Fault`] that refuses it.
fn read_chunk(
    medium: &dyn Medium,
    format: &ChunkFormat,
    address: &Address,
    tokens: usize,
) -> Result<Vec<u8>, Fault> {
    let mut stored = medium.get_chunk(address)?;
    decode_chunk(format, &stored, address, tokens)?;
    stored.drain(..format.head_bytes());
    Ok(stored)
}
