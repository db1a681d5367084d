//! A shared medium on Redis (or Valkey): the chunks and manifests of a fleet of engines in one
//! key-value store, so that a conversation's next turn finds its KV on whichever engine it
//! lands (LMCache and SGLang's hierarchical cache keep KV in such stores too).
//!
//! Keys: `<prefix>:<fingerprint>:chunk:<address>` holds a chunk in the chunk format (header and
//! per-layer checksums, checked whole by the reader like a file), and
//! `<prefix>:<fingerprint>:conv:<hex name>` a conversation manifest, `<prefix>:name:<hex name>`
//! who keeps that name (for every model's engines to see). The prefix is the
//! deployment's, so fleets sharing one Redis never read each other's KV; the fingerprint keeps
//! models apart. A `SET` replaces a value whole, so readers see old bytes or new, never a mix.
//!
//! Every request has a deadline. A connection that failed is dropped, and after a refused
//! connection, a timeout or a lost connection no request is tried for a back-off that doubles
//! while the server keeps failing: a Redis that is down or stalled costs one deadline per
//! back-off, and each other request a quick refusal, not a wait.

use std::io::Cursor;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::error::StoreError;
use super::format::{self, Address, Fault};
use super::medium::{Listing, Medium, Owner, Refused, SharedMedium};

mod conn;

use conn::Conn;

use crate::setters::setters;

/// Where a fleet's shared tier lives, and how to reach it.
#[derive(Clone, PartialEq)]
#[non_exhaustive]
pub struct RedisConfig {
    /// `redis://[user][:password@]host[:port][/db]`, or `rediss://` for TLS (`valkey://` and
    /// `valkeys://` too). Never written to logs or errors with its password.
    pub url: String,
    /// Names this deployment's keys: fleets with different prefixes share a server without
    /// seeing each other's KV (with Redis ACLs, a user can be limited to `<prefix>:*`).
    pub key_prefix: String,
    /// How long an unused chunk or manifest stays (refreshed whenever it is read); `None` keeps
    /// keys until this engine deletes them or Redis evicts them under `maxmemory`.
    pub ttl: Option<Duration>,
    /// The deadline of each request (connecting, storing, fetching a chunk): past it the
    /// request fails and the KV is recomputed.
    pub timeout: Duration,
    /// A PEM file of the certificate authority that signed the server's certificate, for
    /// `rediss://` with a private CA (the system's roots otherwise).
    pub ca_file: Option<PathBuf>,
    /// `url` names nodes of a Redis Cluster (one or more, comma-separated; the client finds
    /// the others): keys spread over its shards by hash slot (chunks by their content address),
    /// and a conversation's manifest is found on whichever shard owns it. A shard that is down
    /// costs the recompute of the chunks it held.
    pub cluster: bool,
}

setters!(RedisConfig {
    into url: String,
    into key_prefix: String,
    some ttl: Duration,
    value timeout: Duration,
    some_into ca_file: PathBuf,
    value cluster: bool,
});

impl RedisConfig {
    /// The server at `url`, keys under `pensieve:`, kept a day after their last use, 500 ms per
    /// request.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            key_prefix: "pensieve".into(),
            ttl: Some(Duration::from_secs(24 * 3600)),
            timeout: Duration::from_millis(500),
            ca_file: None,
            cluster: false,
        }
    }

    /// The URL with its password, if any, replaced by `***`.
    pub fn redacted_url(&self) -> String {
        let Some((scheme, rest)) = self.url.split_once("://") else {
            return "***".into();
        };
        let authority_end = rest.find('/').unwrap_or(rest.len());
        match rest[..authority_end].rfind('@') {
            Some(at) => {
                let user = rest[..at].split(':').next().unwrap_or("");
                format!("{scheme}://{user}:***{}", &rest[at..])
            }
            None => self.url.clone(),
        }
    }
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &self.redacted_url())
            .field("key_prefix", &self.key_prefix)
            .field("ttl", &self.ttl)
            .field("timeout", &self.timeout)
            .field("ca_file", &self.ca_file)
            .field("cluster", &self.cluster)
            .finish()
    }
}

/// When the next connection may be tried.
#[derive(Debug)]
struct Backoff {
    not_before: Option<Instant>,
    delay: Duration,
}

const FIRST_DELAY: Duration = Duration::from_millis(50);
const LONGEST_DELAY: Duration = Duration::from_secs(2);

/// Stores a manifest (`KEYS[1]`, `ARGV[2]`) and the name's registration (`KEYS[2]`, `ARGV[3]`)
/// if the stored manifest's stamp (within its first 256 bytes, where the engine writes it) is
/// `ARGV[1]` or none is stored, or a tombstone is (stamp `-removed`) and `ARGV[1]` is empty
/// (see `medium::TOMBSTONE`); `ARGV[4]`: time to live in seconds, 0 for none. Answers nil, or
/// the stored stamp that refused the write.
const PUT_MANIFEST: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur then
  local stamp = string.match(string.sub(cur, 1, 256), '"stamp":"([^"]*)"') or ''
  if stamp ~= ARGV[1] and not (ARGV[1] == '' and stamp == '-removed') then return stamp end
end
if ARGV[4] == '0' then
  redis.call('SET', KEYS[1], ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3])
else
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[4])
  redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
end
return false
"#;

/// Replaces a manifest (`KEYS[1]`) by the tombstone `ARGV[2]` for `ARGV[3]` seconds, and
/// removes the name's registration (`KEYS[2]`) if it is `ARGV[1]` (this model's).
const REMOVE_MANIFEST: &str = r#"
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return false
"#;

/// How long a tombstone is kept without a TTL of the store's own: longer than a copy of a
/// removed conversation is held by an engine that does not use it.
const TOMBSTONE_TTL_S: u64 = 7 * 24 * 3600;

/// Chunks and manifests in Redis, for every engine of a fleet.
pub(crate) struct Redis {
    client: conn::Client,
    /// `<prefix>:<fingerprint>:`.
    keys: String,
    /// `<prefix>:name:`.
    names: String,
    owner: Owner,
    ttl: Option<u64>,
    timeout: Duration,
    /// A Redis Cluster (its failures are one shard's).
    cluster: bool,
    idle: Mutex<Vec<Conn>>,
    backoff: Mutex<Backoff>,
    connects: AtomicU64,
}

impl std::fmt::Debug for Redis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Redis").field("keys", &self.keys).finish()
    }
}

impl Redis {
    /// The medium `config` names, for chunks of the model `fingerprint`; connects once to
    /// check the URL, the credentials and TLS. A server that refuses connections or does not
    /// answer in time is taken as down for now: the medium opens, its requests fail (costing
    /// recomputes) until the server is back, and then it reconnects.
    ///
    /// # Errors
    /// A malformed URL, an unreadable CA file, a failed TLS handshake, refused credentials,
    /// or any other error of the first connection (never naming the URL, which may hold a
    /// password).
    pub fn open(config: &RedisConfig, owner: Owner) -> Result<Self, StoreError> {
        let client = match (&config.ca_file, config.cluster) {
            (_, true) if config.url.starts_with("rediss") || config.ca_file.is_some() => {
                return Err(StoreError::Invalid(
                    "TLS to a Redis Cluster is not supported yet".into(),
                ));
            }
            (_, true) => {
                let nodes = config.url.split(',').map(|u| u.trim().to_string());
                conn::Client::cluster(nodes.collect(), config.timeout)
            }
            (Some(path), false) => {
                let root = std::fs::read(path).map_err(|e| StoreError::io(path, e))?;
                let certs = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root),
                };
                redis::Client::build_with_tls(config.url.as_str(), certs).map(conn::Client::Single)
            }
            (None, false) => redis::Client::open(config.url.as_str()).map(conn::Client::Single),
        }
        .map_err(|e| StoreError::redis(&e))?;
        let medium = Self {
            client,
            keys: format!("{}:{}:", config.key_prefix, owner.fingerprint),
            names: format!("{}:name:", config.key_prefix),
            owner,
            ttl: config.ttl.map(|t| t.as_secs().max(1)),
            timeout: config.timeout,
            cluster: config.cluster,
            idle: Mutex::new(Vec::new()),
            backoff: Mutex::new(Backoff {
                not_before: None,
                delay: FIRST_DELAY,
            }),
            connects: AtomicU64::new(0),
        };
        let first = (medium.connect())
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c).map(|_| c));
        match first {
            Ok(c) => {
                medium.connects.fetch_add(1, Ordering::Relaxed);
                medium.idle.lock().push(c);
            }
            Err(e) if e.is_connection_refusal() || e.is_timeout() => {
                tracing::warn!(error = %StoreError::redis(&e), url = %config.redacted_url(), "the shared store is not reachable yet; chunks are recomputed until it is");
            }
            Err(e) => return Err(StoreError::redis(&e)),
        }
        Ok(medium)
    }

    fn chunk_key(&self, address: &Address) -> String {
        format!("{}chunk:{}", self.keys, address.hex())
    }

    /// The manifest's and the registration's keys carry the name as a hash tag (`{...}`), so
    /// that a cluster keeps both on one shard (the script that writes them needs it).
    fn manifest_key(&self, name: &str) -> String {
        format!("{}conv:{{{}}}", self.keys, format::name_key(name))
    }

    fn registration_key(&self, name: &str) -> String {
        format!("{}{{{}}}", self.names, format::name_key(name))
    }

    /// A new connection, every request on it under the deadline.
    fn connect(&self) -> redis::RedisResult<Conn> {
        self.client.connect(self.timeout)
    }

    /// An idle connection, or a new one; none while the back-off lasts.
    fn connection(&self) -> Result<Conn, StoreError> {
        let mut backoff = self.backoff.lock();
        if backoff.not_before.is_some_and(|t| Instant::now() < t) {
            return Err(StoreError::BackingOff);
        }
        if let Some(c) = self.idle.lock().pop() {
            return Ok(c);
        }
        match self.connect() {
            Ok(c) => {
                self.connects.fetch_add(1, Ordering::Relaxed);
                Ok(c)
            }
            Err(e) => {
                Self::back_off(&mut backoff);
                let e = StoreError::redis(&e);
                tracing::warn!(error = %e, retry_in = ?backoff.delay, "the shared store is unreachable; chunks are recomputed until it is back");
                Err(e)
            }
        }
    }

    /// No request for a while, longer each time the server fails again.
    fn back_off(backoff: &mut Backoff) {
        backoff.not_before = Some(Instant::now() + backoff.delay);
        backoff.delay = (backoff.delay * 2).min(LONGEST_DELAY);
    }

    /// Runs `f` on a connection; the connection goes back to the idle ones unless the request
    /// failed (it may be broken, or carry a late reply). A request that timed out or lost its
    /// connection backs off the next ones, so a stalled server costs one deadline per
    /// back-off, not one per request.
    fn request<T>(
        &self,
        f: impl FnOnce(&mut Conn) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        let mut c = self.connection()?;
        match f(&mut c) {
            Ok(out) => {
                self.idle.lock().push(c);
                self.backoff.lock().delay = FIRST_DELAY;
                Ok(out)
            }
            Err(e) => {
                // A cluster's failures are a shard's: the others still serve (the client finds
                // the shard again when it is back), so the whole store does not back off.
                let broken = e.is_io_error() || e.is_timeout() || e.is_connection_dropped();
                let e = StoreError::redis(&e);
                if broken && !self.cluster {
                    Self::back_off(&mut self.backoff.lock());
                    tracing::warn!(error = %e, "a request to the shared store failed; backing off");
                }
                Err(e)
            }
        }
    }

    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(key).arg(value);
        if let Some(ttl) = self.ttl {
            cmd.arg("EX").arg(ttl);
        }
        self.request(|c| cmd.query::<()>(c))
    }

    /// The value at `key`, its time to live renewed.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let mut cmd = redis::cmd("GETEX");
        cmd.arg(key);
        if let Some(ttl) = self.ttl {
            cmd.arg("EX").arg(ttl);
        }
        self.request(|c| cmd.query::<Option<Vec<u8>>>(c))
    }

    fn delete(&self, key: &str) {
        let _ = self.request(|c| redis::cmd("DEL").arg(key).query::<()>(c));
    }

    /// Every key matching `pattern`.
    fn scan(&self, pattern: &str) -> Result<Vec<String>, StoreError> {
        self.request(|c| c.scan(pattern))
    }
}

impl Medium for Redis {
    fn put_chunk(&self, address: &Address, parts: &[&[u8]]) -> Result<(), StoreError> {
        self.set(&self.chunk_key(address), &parts.concat())
    }

    /// The whole value (one `GET`), then read from memory: the layered restore hands its layers
    /// over as they are checked, and overlaps across chunks. Reading each chunk in `GETRANGE`
    /// spans instead, to overlap within one too, measured worse (more round trips, less of
    /// the read hidden: 28-35% against 46-48%, `bench_restore --redis`).
    fn open_chunk(&self, address: &Address) -> Result<(Box<dyn std::io::Read + Send>, u64), Fault> {
        let bytes = self.get_chunk(address)?;
        let len = bytes.len() as u64;
        Ok((Box::new(Cursor::new(bytes)), len))
    }

    fn get_chunk(&self, address: &Address) -> Result<Vec<u8>, Fault> {
        match self.get(&self.chunk_key(address)) {
            Ok(Some(bytes)) => Ok(bytes),
            // Expired, evicted under `maxmemory`, or deleted by the engine that wrote it.
            Ok(None) => Err(Fault::Missing),
            Err(e) => Err(Fault::Io(e.io_kind())),
        }
    }

    fn remove_chunk(&self, address: &Address) {
        self.delete(&self.chunk_key(address));
    }

    /// One script, so the comparison and both writes are atomic against every other client.
    fn put_manifest(&self, name: &str, contents: &[u8], expect: &str) -> Result<(), Refused> {
        let key = self.manifest_key(name);
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(PUT_MANIFEST).arg(2).arg(&key);
        cmd.arg(self.registration_key(name))
            .arg(expect)
            .arg(contents);
        cmd.arg(self.owner.record()).arg(self.ttl.unwrap_or(0));
        match self.request(|c| cmd.query::<Option<String>>(c)) {
            Ok(None) => Ok(()),
            Ok(Some(stored)) => Err(Refused::Conflict(stored)),
            Err(e) => Err(Refused::Failed(e)),
        }
    }

    fn remove_manifest(&self, name: &str) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(REMOVE_MANIFEST).arg(2).arg(self.manifest_key(name));
        cmd.arg(self.registration_key(name))
            .arg(self.owner.record())
            .arg(super::medium::TOMBSTONE)
            .arg(self.ttl.unwrap_or(TOMBSTONE_TTL_S));
        self.request(|c| cmd.query::<()>(c))
    }

    fn registration(&self, name: &str) -> Result<Option<Owner>, StoreError> {
        let key = self.registration_key(name);
        let record = self.request(|c| redis::cmd("GET").arg(&key).query::<Option<Vec<u8>>>(c))?;
        Ok(record.map(|r| Owner::parse(&r)))
    }

    fn manifest(&self, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.get(&self.manifest_key(name))
    }

    fn manifests(&self) -> Vec<Vec<u8>> {
        let Ok(mut keys) = self.scan(&format!("{}conv:*", self.keys)) else {
            return Vec::new();
        };
        keys.sort();
        keys.iter()
            .filter_map(|k| self.get(k).ok().flatten())
            .filter(|b| !super::medium::is_tombstone(b))
            .collect()
    }

    /// Nothing: every key may be another engine's, so none is this store's to index or clear
    /// at start; chunks are found by address when a turn needs them.
    fn list(&self) -> std::io::Result<Listing> {
        Ok(Listing::default())
    }

    fn shared(&self) -> Option<&dyn SharedMedium> {
        Some(self)
    }

    fn describe(&self, address: &Address) -> String {
        self.chunk_key(address)
    }
}

impl SharedMedium for Redis {
    fn lookup(&self, addresses: &[Address]) -> Vec<bool> {
        let keys: Vec<String> = addresses.iter().map(|a| self.chunk_key(a)).collect();

        match self.request(|c| c.exist(&keys)) {
            Ok(found) if found.len() == keys.len() => found,
            // A cluster with a shard down fails the whole pipeline: each key is asked alone,
            // each on a connection of its own (the failed one may hold replies never read),
            // and those of the shards still up are found.
            _ if self.cluster => (keys.iter())
                .map(|k| (self.request(|c| redis::cmd("EXISTS").arg(k).query(c))).unwrap_or(false))
                .collect(),
            _ => vec![false; keys.len()],
        }
    }

    fn connects(&self) -> u64 {
        self.connects.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner() -> Owner {
        Owner {
            fingerprint: "0".repeat(16),
            label: "a test model".into(),
        }
    }

    #[test]
    fn passwords_never_reach_debug_output() {
        let c = RedisConfig::new("rediss://fleet:s3cret@cache.internal:6380/2");
        assert_eq!(c.redacted_url(), "rediss://fleet:***@cache.internal:6380/2");
        assert!(!format!("{c:?}").contains("s3cret"));
        let c = RedisConfig::new("redis://:s3cret@localhost");
        assert_eq!(c.redacted_url(), "redis://:***@localhost");
        let c = RedisConfig::new("redis://localhost:6379");
        assert_eq!(c.redacted_url(), "redis://localhost:6379");
    }

    #[test]
    fn a_server_down_at_start_fails_each_request_quickly_with_no_secret() {
        // A port nobody listens on (bound, then released).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        let mut c = RedisConfig::new(format!("redis://:hunter2@127.0.0.1:{port}"));
        c.timeout = Duration::from_millis(200);
        let m = Redis::open(&c, owner()).unwrap();
        let a = Address::chain(&Address::default(), &[1]);
        assert!(matches!(m.get_chunk(&a), Err(Fault::Io(_))));
        let e = m.put_chunk(&a, &[b"x"]).unwrap_err();
        assert!(!format!("{e} {e:?}").contains("hunter2"), "{e}");
        let shared = m.shared().unwrap();
        assert_eq!((shared.lookup(&[a]), shared.connects()), (vec![false], 0));
        // A malformed URL is refused at once.
        assert!(Redis::open(&RedisConfig::new("http://nowhere"), owner()).is_err());
    }
}
