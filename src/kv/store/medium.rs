//! Where a store keeps its chunks and conversation manifests. The store's bookkeeping
//! (entries, references, budget), the chunk format and the background threads are the same
//! whatever keeps the bytes; a medium only stores, reads and lists them. [`Folder`] keeps them
//! in files (the store); a shared key-value service can keep them for a fleet of engines.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

use super::error::StoreError;
use super::format::{self, Address, Fault};

/// What a medium held when the store opened.
#[derive(Debug, Default)]
pub(crate) struct Listing {
    /// Chunks stored under a valid address (not yet checked).
    pub chunks: Vec<Address>,
    /// Leftovers removed while listing: interrupted writes, which are no fault...
    pub interrupted: usize,
    /// ...and entries that are not chunks of this store, which are.
    pub foreign: usize,
}

/// Why a manifest was not stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The medium failed (a full or read-only disk, a timeout): why.
    Failed(StoreError),
    /// Another writer stored the conversation since the state this write continues: the
    /// stored manifest's stamp.
    Conflict(String),
}

impl From<StoreError> for Refused {
    fn from(e: StoreError) -> Self {
        Self::Failed(e)
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::Failed(why) => write!(f, "{why}"),
            Refused::Conflict(stamp) if stamp.is_empty() => {
                f.write_str("the conversation was removed from the store meanwhile")
            }
            Refused::Conflict(stamp) => write!(
                f,
                "another writer stored this conversation meanwhile (stored state {stamp:?})"
            ),
        }
    }
}

/// The model (fingerprint) and a description of it that keep a conversation name: written
/// with each manifest where every model's engines can see it, so that an engine of another
/// model, weight format or KV precision finds the name taken instead of free.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Owner {
    /// The first 16 hex digits of the store's fingerprint.
    pub fingerprint: String,
    /// What a person reads: the model, its weight format, the KV precision.
    pub label: String,
}

impl Owner {
    pub(super) fn record(&self) -> Vec<u8> {
        format!("{}\n{}", self.fingerprint, self.label).into_bytes()
    }

    pub(super) fn parse(record: &[u8]) -> Self {
        let text = String::from_utf8_lossy(record);
        let (fingerprint, label) = text.split_once('\n').unwrap_or((&text, ""));
        Self {
            fingerprint: fingerprint.to_string(),
            label: label.to_string(),
        }
    }
}

/// Where a manifest's stamp is: the engine writes it first after the version, so a medium
/// checks it in the manifest's first bytes without parsing the rest.
const STAMP_WITHIN: usize = 256;

/// The stamp a manifest's bytes carry (empty if none): what a compare-and-set compares.
/// The stamp of a removed conversation's [`TOMBSTONE`]: no writer's (theirs are
/// `<hex>-<revision>`).
pub(crate) const REMOVED_STAMP: &str = "-removed";

/// What a removed conversation's manifest is replaced by, so that an engine still holding a
/// copy of it learns it was removed (its next resume drops the copy) and cannot write it back
/// (compare-and-set refuses), where a manifest simply missing is a store that lost it (a Redis
/// restarted empty), which a copy may give back. Readers take it for no manifest.
pub(crate) const TOMBSTONE: &[u8] = br#"{"version":1,"stamp":"-removed","removed":true}"#;

/// Whether stored manifest bytes are a [`TOMBSTONE`].
pub(crate) fn is_tombstone(bytes: &[u8]) -> bool {
    manifest_stamp(bytes) == REMOVED_STAMP
}

pub(crate) fn manifest_stamp(bytes: &[u8]) -> String {
    let head = &bytes[..bytes.len().min(STAMP_WITHIN)];
    let key = b"\"stamp\":\"";
    let Some(at) = head.windows(key.len()).position(|w| w == key) else {
        return String::new();
    };
    let rest = &head[at + key.len()..];
    let end = rest.iter().position(|&b| b == b'"').unwrap_or(rest.len());
    String::from_utf8_lossy(&rest[..end]).into_owned()
}

/// Stores, reads and lists chunks (as the chunk format's bytes) and manifests. Called from the
/// store and its worker threads.
pub(crate) trait Medium: Send + Sync + std::fmt::Debug {
    /// Stores chunk `address` as the concatenation of `parts`, atomically: a reader sees the
    /// old bytes or the new, never a mix, whatever happens meanwhile.
    fn put_chunk(&self, address: &Address, parts: &[&[u8]]) -> Result<(), StoreError>;

    /// A reader of chunk `address` from its first byte, and its length.
    fn open_chunk(&self, address: &Address) -> Result<(Box<dyn Read + Send>, u64), Fault>;

    /// The stored bytes of chunk `address`, whole.
    fn get_chunk(&self, address: &Address) -> Result<Vec<u8>, Fault>;

    /// Removes chunk `address` if it is stored.
    fn remove_chunk(&self, address: &Address);

    /// Stores the manifest of the conversation named `name`, atomically, if the one stored
    /// now carries the stamp `expect` (the state this one continues) or none is stored (a
    /// store that lost it is given it back), or if a [`TOMBSTONE`] is and `expect` is empty (a
    /// new conversation of a removed one's name); and registers the name as this store's
    /// [`Owner`]'s.
    ///
    /// # Errors
    /// [`Refused::Conflict`] if another stamp is stored, a tombstone included: a write that
    /// continues a conversation removed since does not bring it back; [`Refused::Failed`] if
    /// the medium cannot write.
    fn put_manifest(&self, name: &str, contents: &[u8], expect: &str) -> Result<(), Refused>;

    /// Replaces the manifest of `name` by a [`TOMBSTONE`] (kept as long as manifests are), and
    /// removes its registration if it is this store's.
    ///
    /// # Errors
    /// The medium could not remove it (it may still be there).
    fn remove_manifest(&self, name: &str) -> Result<(), StoreError>;

    /// Who registered `name` (see [`Owner`]), if anyone: this store while it keeps the
    /// conversation, or another model's.
    ///
    /// # Errors
    /// The medium cannot be read.
    fn registration(&self, name: &str) -> Result<Option<Owner>, StoreError>;

    /// The stored manifest of `name`, if there is one.
    ///
    /// # Errors
    /// The medium cannot be read.
    fn manifest(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError>;

    /// Every stored manifest, in a stable order (tombstones left out).
    fn manifests(&self) -> Vec<Vec<u8>>;

    /// The medium as other engines share it, if they write and delete entries too (a fleet's
    /// store): then the listing at start owns nothing, and chunks written by others are found
    /// by address. `None` for a medium only this store writes, which it indexed whole when it
    /// opened.
    fn shared(&self) -> Option<&dyn SharedMedium>;

    /// The chunks stored now, removing leftovers of interrupted writes and entries that are
    /// not chunks.
    ///
    /// # Errors
    /// The medium cannot be listed.
    fn list(&self) -> std::io::Result<Listing>;

    /// How messages name chunk `address` (a path, a key).
    fn describe(&self, address: &Address) -> String;

    /// Conversations this medium removed because they went unused past their time to live;
    /// 0 for one that leaves expiry to its server (Redis's TTL).
    fn expired(&self) -> u64 {
        0
    }
}

/// What a medium that other engines write too answers besides.
pub(crate) trait SharedMedium {
    /// Whether each chunk is stored now (`false` where it cannot tell).
    fn lookup(&self, addresses: &[Address]) -> Vec<bool>;

    /// Connections opened to the medium (more than one: it reconnected).
    fn connects(&self) -> u64;
}

/// Chunk files `<root>/chunks/<address>.kvc` and manifests
/// `<root>/conversations/<hex name>.json`, written atomically (see [`write_atomic`]), where
/// `<root>` is the store folder's sub-folder for one fingerprint; names registered in
/// `<store>/names/<hex name>`, for every fingerprint's engines to see.
#[derive(Debug)]
pub(crate) struct Folder {
    root: PathBuf,
    names: PathBuf,
    owner: Owner,
    /// How long a manifest stays after it was last written; `None` keeps it until removed.
    expire_after: Option<Duration>,
    /// When the manifests were last swept for expired ones.
    swept: Mutex<Instant>,
    expired: AtomicU64,
}

impl Folder {
    /// The folder for chunks of `owner`'s model under `dir` (created), whose manifests expire
    /// once unwritten for `expire_after`; those already expired are removed now, before any
    /// is resumed.
    ///
    /// # Errors
    /// The folders cannot be created.
    pub fn open(dir: &Path, owner: Owner, expire_after: Option<Duration>) -> std::io::Result<Self> {
        let root = dir.join(&owner.fingerprint);
        fs::create_dir_all(root.join("chunks"))?;
        fs::create_dir_all(root.join("conversations"))?;
        let names = dir.join("names");
        fs::create_dir_all(&names)?;
        let folder = Self {
            root,
            names,
            owner,
            expire_after,
            swept: Mutex::new(Instant::now()),
            expired: AtomicU64::new(0),
        };
        folder.expire();
        Ok(folder)
    }

    fn registration_path(&self, name: &str) -> PathBuf {
        self.names.join(format::name_key(name))
    }

    /// Sweeps for expired manifests if the last sweep was a 24th of their time to live ago (at
    /// most an hour): a folder that keeps being written keeps its conversations bounded to
    /// those used within about that time, without a listing per write.
    fn expire_if_due(&self) {
        let Some(ttl) = self.expire_after else {
            return;
        };
        let every = (ttl / 24).min(Duration::from_secs(3600));
        if self.swept.lock().elapsed() >= every {
            self.expire();
        }
    }

    /// Removes every manifest last written longer than `expire_after` ago, with this model's
    /// registration of its name. The chunks it named go with their last reference, as a closed
    /// conversation's do (at the next start for a folder no engine holds them in).
    fn expire(&self) {
        let Some(ttl) = self.expire_after else {
            return;
        };
        *self.swept.lock() = Instant::now();
        let Some(cutoff) = SystemTime::now().checked_sub(ttl) else {
            return;
        };
        let written = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
        let Ok(dir) = fs::read_dir(self.root.join("conversations")) else {
            return;
        };
        let keys: Vec<String> = dir
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .filter(|p| written(p).is_some_and(|t| t < cutoff))
            .filter_map(|p| Some(p.file_stem()?.to_str()?.to_string()))
            .collect();
        for key in keys {
            // An expiry that fails is tried again at the next.
            let _ = self.locked(|| {
                // Written again since it was listed: it stays.
                let manifest = self.manifest_path_of(&key);
                if written(&manifest).is_some_and(|t| t < cutoff) {
                    self.remove_keyed(&key)?;
                    self.expired.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<_, StoreError>(())
            });
        }
    }

    /// Removes the manifest of the name whose key is `key`, and its registration if it is
    /// this store's (the conversations' lock held).
    ///
    /// # Errors
    /// The manifest could not be removed, or its removal not synced.
    fn remove_keyed(&self, key: &str) -> Result<(), StoreError> {
        let manifest = self.manifest_path_of(key);
        match fs::remove_file(&manifest) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(StoreError::io(&manifest, e));
            }
            _ => {}
        }
        self.unregister(key);
        // The removal survives a power loss too, once the folder's entry is synced (a
        // conversation its user asked to end must not come back).
        match manifest.parent() {
            Some(dir) => File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| StoreError::io(dir, e)),
            None => Ok(()),
        }
    }

    /// Removes the registration of the name of `key` if it is this store's (one left behind
    /// only keeps the name this store's).
    fn unregister(&self, key: &str) {
        let registration = self.names.join(key);
        if fs::read(&registration).ok() == Some(self.owner.record()) {
            let _ = fs::remove_file(registration);
        }
    }

    /// Holds the conversations' lock (an advisory lock on a file of the folder) for `f`, so
    /// that engines sharing the folder compare and set manifests one at a time.
    fn locked<T, E: From<StoreError>>(&self, f: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
        let path = self.root.join("conversations").join(".lock");
        let describe = |e: std::io::Error| E::from(StoreError::io(&path, e));
        let lock = (File::options().create(true).truncate(false).write(true))
            .open(&path)
            .map_err(describe)?;
        lock.lock().map_err(describe)?;
        f()
    }

    fn chunk_path(&self, address: &Address) -> PathBuf {
        self.root
            .join("chunks")
            .join(format!("{}.kvc", address.hex()))
    }

    fn manifest_path(&self, name: &str) -> PathBuf {
        self.manifest_path_of(&format::name_key(name))
    }

    fn manifest_path_of(&self, key: &str) -> PathBuf {
        self.root.join("conversations").join(format!("{key}.json"))
    }
}

fn not_found_is_missing(e: &std::io::Error) -> Fault {
    match e.kind() {
        std::io::ErrorKind::NotFound => Fault::Missing,
        kind => Fault::Io(kind),
    }
}

impl Medium for Folder {
    fn shared(&self) -> Option<&dyn SharedMedium> {
        None
    }

    fn put_chunk(&self, address: &Address, parts: &[&[u8]]) -> Result<(), StoreError> {
        write_atomic(&self.chunk_path(address), parts)
    }

    fn open_chunk(&self, address: &Address) -> Result<(Box<dyn Read + Send>, u64), Fault> {
        let f = File::open(self.chunk_path(address)).map_err(|e| not_found_is_missing(&e))?;
        let len = f.metadata().map_err(|e| Fault::Io(e.kind()))?.len();
        Ok((Box::new(f), len))
    }

    fn get_chunk(&self, address: &Address) -> Result<Vec<u8>, Fault> {
        fs::read(self.chunk_path(address)).map_err(|e| not_found_is_missing(&e))
    }

    fn remove_chunk(&self, address: &Address) {
        let _ = fs::remove_file(self.chunk_path(address));
    }

    fn put_manifest(&self, name: &str, contents: &[u8], expect: &str) -> Result<(), Refused> {
        let path = self.manifest_path(name);
        self.locked(|| {
            let mut head = Vec::with_capacity(STAMP_WITHIN);
            match File::open(&path) {
                Ok(f) => {
                    let read = f.take(STAMP_WITHIN as u64).read_to_end(&mut head);
                    read.map_err(|e| Refused::Failed(StoreError::io(&path, e)))?;
                    let stored = manifest_stamp(&head);
                    // A removed conversation's tombstone is no conversation to a new one, and
                    // refuses every write that continues a state it removed.
                    let new_over_removed = expect.is_empty() && stored == REMOVED_STAMP;
                    if stored != expect && !new_over_removed {
                        return Err(Refused::Conflict(stored));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Refused::Failed(StoreError::io(&path, e))),
            }
            let registration = self.registration_path(name);
            let record = self.owner.record();
            if fs::read(&registration).ok().as_deref() != Some(&record[..]) {
                write_atomic(&registration, &[&record]).map_err(Refused::Failed)?;
            }
            write_atomic(&path, &[contents]).map_err(Refused::Failed)
        })?;
        self.expire_if_due();
        Ok(())
    }

    fn remove_manifest(&self, name: &str) -> Result<(), StoreError> {
        let key = format::name_key(name);
        self.locked(|| {
            // The tombstone is written (synced) before the registration goes: a crash between
            // the two leaves the name this model's, never the conversation stored.
            write_atomic(&self.manifest_path_of(&key), &[TOMBSTONE])?;
            self.unregister(&key);
            Ok(())
        })
    }

    fn registration(&self, name: &str) -> Result<Option<Owner>, StoreError> {
        let path = self.registration_path(name);
        match fs::read(&path) {
            Ok(bytes) => Ok(Some(Owner::parse(&bytes))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io(path, e)),
        }
    }

    fn manifest(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let path = self.manifest_path(name);
        match fs::read(&path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io(path, e)),
        }
    }

    fn manifests(&self) -> Vec<Vec<u8>> {
        let Ok(dir) = fs::read_dir(self.root.join("conversations")) else {
            return Vec::new();
        };
        let mut paths: Vec<PathBuf> = dir
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        paths.sort();
        (paths.into_iter())
            .filter_map(|p| fs::read(p).ok())
            .filter(|b| !is_tombstone(b))
            .collect()
    }

    fn list(&self) -> std::io::Result<Listing> {
        let mut out = Listing::default();
        for item in fs::read_dir(self.root.join("conversations"))? {
            let path = item?.path();
            if path.extension().is_some_and(|x| x == "tmp") {
                let _ = fs::remove_file(&path);
            }
        }
        for item in fs::read_dir(self.root.join("chunks"))? {
            let path = item?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            match name.strip_suffix(".kvc").and_then(Address::from_hex) {
                Some(a) => out.chunks.push(a),
                // Debris of an interrupted write, or a file that is not ours.
                None => {
                    let _ = fs::remove_file(&path);
                    match name.ends_with(".tmp") {
                        true => out.interrupted += 1,
                        false => out.foreign += 1,
                    }
                }
            }
        }
        Ok(out)
    }

    fn describe(&self, address: &Address) -> String {
        self.chunk_path(address).display().to_string()
    }

    fn expired(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }
}

/// The temporary name a file is written under before its rename.
pub(crate) fn temporary(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}

/// Which of `chunks` (address, KV-tokens) a shared `medium` holds, in one request; none for a
/// medium only its own store writes (its index says).
pub(super) fn stored(medium: &dyn Medium, chunks: &[(Address, usize)]) -> Vec<(Address, usize)> {
    let Some(shared) = medium.shared() else {
        return Vec::new();
    };
    let addresses: Vec<Address> = chunks.iter().map(|(a, _)| *a).collect();
    let there = shared.lookup(&addresses);
    (chunks.iter().zip(there))
        .filter_map(|(c, there)| there.then_some(*c))
        .collect()
}

/// Writes `parts` to `path` atomically: the bytes go to a temporary file in the same folder,
/// are flushed to the device (`fsync`), and the file is renamed over its final name, then the
/// folder is synced; a crash at any moment leaves the final name either absent, or the old
/// whole file, or the new whole file.
///
/// # Errors
/// What the file system said, with the path.
pub(crate) fn write_atomic(path: &Path, parts: &[&[u8]]) -> Result<(), StoreError> {
    // A failed write leaves nothing behind (on a full disk, a half-written file would hold
    // the space the next write needs).
    write_synced(path, parts).inspect_err(|_| {
        let _ = fs::remove_file(temporary(path));
    })
}

fn write_synced(path: &Path, parts: &[&[u8]]) -> Result<(), StoreError> {
    let tmp = temporary(path);
    let describe = |e: std::io::Error| StoreError::io(path, e);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(fingerprint: &str) -> Owner {
        Owner {
            fingerprint: fingerprint.repeat(16),
            label: format!("model {fingerprint}"),
        }
    }

    #[test]
    fn manifests_are_compared_and_set_by_stamp_and_names_registered_for_every_model() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (
            Folder::open(dir.path(), owner("a"), None).unwrap(),
            Folder::open(dir.path(), owner("b"), None).unwrap(),
        );
        let v1 = br#"{"version":1,"stamp":"e1-1","name":"alice"}"#;
        let v2 = br#"{"version":1,"stamp":"e1-2","name":"alice"}"#;
        let fork = br#"{"version":1,"stamp":"e2-2","name":"alice"}"#;
        assert_eq!(manifest_stamp(v2), "e1-2");
        assert_eq!(manifest_stamp(b"{}"), "");
        a.put_manifest("alice", v1, "").unwrap();
        // A second creation, and a write continuing a state that is not the stored one.
        assert_eq!(
            a.put_manifest("alice", v1, ""),
            Err(Refused::Conflict("e1-1".into()))
        );
        a.put_manifest("alice", v2, "e1-1").unwrap();
        assert_eq!(
            a.put_manifest("alice", fork, "e1-1"),
            Err(Refused::Conflict("e1-2".into()))
        );
        assert_eq!(a.manifest("alice"), Ok(Some(v2.to_vec())));
        // A store that lost a manifest is given it back by a write that continues it.
        let lost = tempfile::tempdir().unwrap();
        let c = Folder::open(lost.path(), owner("a"), None).unwrap();
        c.put_manifest("alice", v2, "e1-1").unwrap();
        // A removed one is not: its tombstone refuses what continues it, and takes a new one.
        c.remove_manifest("alice").unwrap();
        assert_eq!(c.manifest("alice"), Ok(Some(TOMBSTONE.to_vec())));
        assert_eq!(
            c.put_manifest("alice", fork, "e1-2"),
            Err(Refused::Conflict(REMOVED_STAMP.into()))
        );
        c.put_manifest("alice", v1, "").unwrap();
        // The other model's store sees the name taken, by whom; removal frees it.
        assert_eq!(b.manifest("alice"), Ok(None));
        assert_eq!(b.registration("alice"), Ok(Some(owner("a"))));
        b.remove_manifest("alice").unwrap();
        assert_eq!(a.registration("alice"), Ok(Some(owner("a"))));
        a.remove_manifest("alice").unwrap();
        assert_eq!(
            (a.manifest("alice"), b.registration("alice")),
            (Ok(Some(TOMBSTONE.to_vec())), Ok(None))
        );
    }

    #[test]
    fn a_folder_stores_reads_lists_and_removes() {
        let dir = tempfile::tempdir().unwrap();
        let m = Folder::open(dir.path(), owner("a"), None).unwrap();
        let a = Address::chain(&Address::default(), &[1, 2, 3]);
        assert_eq!(m.get_chunk(&a), Err(Fault::Missing));
        m.put_chunk(&a, &[b"head", b"payload"]).unwrap();
        assert_eq!(m.get_chunk(&a).unwrap(), b"headpayload");
        let (mut r, len) = m.open_chunk(&a).unwrap();
        let mut head = [0u8; 4];
        r.read_exact(&mut head).unwrap();
        assert_eq!((&head, len), (b"head", 11));
        assert_eq!(m.manifest("alice"), Ok(None));
        m.put_manifest("alice", b"{}", "").unwrap();
        assert_eq!(m.manifests(), vec![b"{}".to_vec()]);
        assert_eq!(m.manifest("alice"), Ok(Some(b"{}".to_vec())));
        assert!(m.shared().is_none());
        // An interrupted write and a stray file are cleared by the listing.
        let chunks = m.chunk_path(&a).parent().unwrap().to_path_buf();
        fs::write(chunks.join("x.kvc.tmp"), b"half").unwrap();
        fs::write(chunks.join("notes.txt"), b"?").unwrap();
        let l = m.list().unwrap();
        assert_eq!((l.chunks, l.interrupted, l.foreign), (vec![a], 1, 1));
        assert_eq!(fs::read_dir(&chunks).unwrap().count(), 1);
        m.remove_chunk(&a);
        m.remove_manifest("alice").unwrap();
        assert!(m.list().unwrap().chunks.is_empty() && m.manifests().is_empty());
    }
}
