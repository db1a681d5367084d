//! The disk tier's background threads: one writes files behind the engine (AttentionStore
//! §3.3), so that a step never waits for the file system to save KV; one reads chunks ahead of
//! the turns that will need them (§3.4), checking each whole before handing it over.
//!
//! Jobs run in the order they were queued, so a file's deletion or a manifest naming new
//! chunks never overtakes the writes before it. Every write is atomic: the bytes go to a
//! temporary file in the same folder, are flushed to the device (`fsync`), and the file is
//! renamed over its final name, then the folder is synced; a crash at any moment leaves the
//! final name either absent, or the old whole file, or the new whole file.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use super::format::{
    check_layer, decode_chunk, decode_head, encode_header, Address, ChunkFormat, ChunkId, Fault,
};
use crate::kv::{ChunkBytes, LayerCells};

/// What the worker does.
pub(super) enum Job {
    /// Writes a chunk file: its header, then the chunk's bytes (waiting for a device copy
    /// still filling them).
    Chunk {
        path: PathBuf,
        bytes: Arc<ChunkBytes>,
        format: ChunkFormat,
        id: ChunkId,
        /// The store's number for this write.
        write: u64,
    },
    /// Writes a small file whole (a conversation manifest).
    File { path: PathBuf, contents: Vec<u8> },
    /// Deletes a file if it exists.
    Remove(PathBuf),
    /// Reads and checks a chunk file, putting its payload (or why it was refused) in `cell`.
    Read {
        path: PathBuf,
        format: ChunkFormat,
        address: Address,
        tokens: usize,
        cell: Arc<OnceLock<Result<Vec<u8>, String>>>,
    },
    /// Reads a chunk file layer by layer, putting each layer's bytes in its cell once
    /// checked, so that a restore uses the first layers while later ones are still read.
    ReadLayers {
        path: PathBuf,
        format: ChunkFormat,
        address: Address,
        tokens: usize,
        layers: Arc<LayerCells>,
    },
    /// Answers once every job before it is done.
    Flush(Sender<()>),
}

/// A finished job the store must hear about.
pub(super) enum Done {
    /// A chunk write, numbered `write` by the store.
    Written {
        address: Address,
        write: u64,
        result: Result<(), String>,
    },
    /// A read ahead whose file was refused.
    Refused { address: Address, fault: Fault },
}

/// The thread and its queues.
#[derive(Debug)]
pub(super) struct Worker {
    jobs: Option<Sender<Job>>,
    done: Receiver<Done>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts the thread.
    ///
    /// # Errors
    /// The OS's refusal to start a thread.
    pub fn start() -> std::io::Result<Self> {
        let (jobs, queue) = channel::<Job>();
        let (report, done) = channel();
        let thread = std::thread::Builder::new()
            .name("pensieve-disk".into())
            .spawn(move || run(&queue, &report))?;
        Ok(Self {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        })
    }

    /// Queues a job; `false` if the thread is gone (it never exits while the worker lives,
    /// unless it panicked).
    pub fn send(&self, job: Job) -> bool {
        self.jobs.as_ref().is_some_and(|j| j.send(job).is_ok())
    }

    /// Chunk writes finished since the last call.
    pub fn finished(&self) -> Vec<Done> {
        self.done.try_iter().collect()
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
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(queue: &Receiver<Job>, report: &Sender<Done>) {
    for job in queue {
        match job {
            Job::Chunk {
                path,
                bytes,
                format,
                id,
                write,
            } => {
                let result = bytes
                    .bytes()
                    .and_then(|payload| {
                        let header = encode_header(&format, &id, payload);
                        write_atomic(&path, &[&header, payload])
                    })
                    .inspect_err(|_| {
                        let _ = fs::remove_file(temporary(&path));
                    });
                // The engine may be gone (dropped while jobs were queued): nobody to tell.
                let address = id.address;
                let _ = report.send(Done::Written {
                    address,
                    write,
                    result,
                });
            }
            Job::File { path, contents } => {
                let _ = write_atomic(&path, &[&contents]);
            }
            Job::Remove(path) => {
                let _ = fs::remove_file(&path);
            }
            Job::Read {
                path,
                format,
                address,
                tokens,
                cell,
            } => {
                let read = read_chunk(&path, &format, &address, tokens);
                if let Err(fault) = read {
                    let _ = report.send(Done::Refused { address, fault });
                }
                let _ = cell.set(read.map_err(|f| format!("{}: {f}", path.display())));
            }
            Job::ReadLayers {
                path,
                format,
                address,
                tokens,
                layers,
            } => {
                if let Err(fault) = read_layers(&path, &format, &address, tokens, &layers) {
                    // Layers already handed over were checked; the rest never will be.
                    let why = format!("{}: {fault}", path.display());
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
    }
}

/// Reads the file of the chunk at `address` (`tokens` KV-tokens) layer by layer into
/// `layers`, checking the header and layer table first and each layer before handing it over.
///
/// # Errors
/// The [`Fault`] that refuses the file (layers before it were handed over).
fn read_layers(
    path: &Path,
    format: &ChunkFormat,
    address: &Address,
    tokens: usize,
    layers: &LayerCells,
) -> Result<(), Fault> {
    let io = |e: std::io::Error| match e.kind() {
        std::io::ErrorKind::NotFound => Fault::Missing,
        std::io::ErrorKind::UnexpectedEof => Fault::Truncated,
        _ => Fault::Io,
    };
    let mut file = File::open(path).map_err(io)?;
    let mut head = vec![0u8; format.head_bytes()];
    file.read_exact(&mut head).map_err(io)?;
    let table = decode_head(format, &head, address, tokens)?;
    for (i, cell) in layers.iter().enumerate() {
        let mut bytes = vec![0u8; format.layer_bytes(tokens)];
        file.read_exact(&mut bytes).map_err(io)?;
        check_layer(table, i, &bytes)?;
        let _ = cell.set(Ok(bytes));
    }
    Ok(())
}

/// Reads the file of the chunk at `address` (`tokens` KV-tokens) and checks it whole; returns
/// its payload.
///
/// # Errors
/// The [`Fault`] that refuses it.
pub(super) fn read_chunk(
    path: &Path,
    format: &ChunkFormat,
    address: &Address,
    tokens: usize,
) -> Result<Vec<u8>, Fault> {
    let mut file = match fs::read(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(Fault::Missing),
        Err(_) => return Err(Fault::Io),
    };
    decode_chunk(format, &file, address, tokens)?;
    file.drain(..format.head_bytes());
    Ok(file)
}

/// The temporary name a file is written under before its rename.
pub(super) fn temporary(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}

/// Writes `parts` to `path` atomically (see the module header).
///
/// # Errors
/// What the file system said, as text.
pub(super) fn write_atomic(path: &Path, parts: &[&[u8]]) -> Result<(), String> {
    let tmp = temporary(path);
    let describe = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut f = File::create(&tmp).map_err(describe)?;
    for part in parts {
        f.write_all(part).map_err(describe)?;
    }
    f.sync_all().map_err(describe)?;
    drop(f);
    fs::rename(&tmp, path).map_err(describe)?;
    if let Some(dir) = path.parent() {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(describe)?;
    }
    Ok(())
}
