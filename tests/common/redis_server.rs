//! A `redis-server` (the Debian package) of a test's own: on a free local port, in its own
//! temporary folder, optionally with a password or TLS only; stopped when dropped.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pensieve::engine::{
    Budgets, CacheMode, ConversationOptions, CostModel, CostProfile, EngineConfig, RedisConfig,
    StoreConfig,
};

/// A `redis-server` of its own, stopped when dropped.
pub struct Server {
    child: Option<Child>,
    pub port: u16,
    password: Option<&'static str>,
    /// Serves TLS only, with the certificate in `<dir>/server.pem`.
    pub tls: bool,
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
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        if tls {
            let names = vec!["127.0.0.1".to_string(), "localhost".to_string()];
            let c = rcgen::generate_simple_self_signed(names).unwrap();
            std::fs::write(dir.path().join("server.pem"), c.cert.pem()).unwrap();
            std::fs::write(dir.path().join("server.key"), c.signing_key.serialize_pem()).unwrap();
        }
        let mut s = Self {
            child: None,
            port,
            password,
            tls,
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
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            // DEBUG SLEEP stands for a Redis too slow to answer.
            .args(["--enable-debug-command", "local"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(p) = self.password {
            cmd.args(["--requirepass", p]);
        }
        if self.tls {
            let key = self.dir.path().join("server.key");
            cmd.args(["--port", "0", "--tls-port", &self.port.to_string()])
                .args(["--tls-auth-clients", "no", "--tls-cert-file"])
                .arg(self.cert())
                .arg("--tls-key-file")
                .arg(key)
                .arg("--tls-ca-cert-file")
                .arg(self.cert());
        }
        let child = cmd.spawn().unwrap_or_else(|e| {
            panic!("redis-server is required (apt-get install redis-server): {e}")
        });
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
        .cost_profile(CostProfile::Fixed(CostModel {
            per_token_s: 1e-3,
            per_token_per_position_s: 1e-6,
        }))
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
