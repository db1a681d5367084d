//! A Redis Cluster of a test's own: three primaries (`redis-server --cluster-enabled yes`) on
//! free local ports, each in its own folder, joined by `redis-cli --cluster create`; stopped
//! when dropped.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Cluster {
    nodes: Vec<Node>,
}

struct Node {
    port: u16,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    // A cluster node also listens on port + 10000 (the cluster bus): keep both free.
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        if port < 55000 && TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
            return port;
        }
    }
}

impl Cluster {
    pub fn start() -> Self {
        let nodes: Vec<Node> = (0..3)
            .map(|_| {
                let port = free_port();
                let dir = tempfile::tempdir().unwrap();
                let child = Command::new("redis-server")
                    .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                    .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                    // A shard that is down leaves the others serving their slots.
                    .args(["--cluster-require-full-coverage", "no"])
                    .args(["--save", "", "--appendonly", "no"])
                    .arg("--dir")
                    .arg(dir.path())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap_or_else(|e| panic!("redis-server is required: {e}"));
                Node {
                    port,
                    child: Some(child),
                    _dir: dir,
                }
            })
            .collect();
        let c = Self { nodes };
        for n in &c.nodes {
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.raw(n.port).is_err() {
                assert!(Instant::now() < deadline, "a cluster node did not start");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let addrs: Vec<String> = c
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap_or_else(|e| panic!("redis-cli is required: {e}"));
        assert!(created.success(), "redis-cli --cluster create failed");
        // Until every node sees every slot covered.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !c.nodes.iter().all(|n| c.state_ok(n.port)) {
            assert!(Instant::now() < deadline, "the cluster did not come up");
            std::thread::sleep(Duration::from_millis(100));
        }
        c
    }

    fn state_ok(&self, port: u16) -> bool {
        let Ok(mut c) = self.raw(port) else {
            return false;
        };
        let info: String = redis::cmd("CLUSTER")
            .arg("INFO")
            .query(&mut c)
            .unwrap_or_default();
        info.contains("cluster_state:ok")
    }

    /// The URLs of every node, comma-separated (a client needs one up to find the others).
    pub fn url(&self) -> String {
        let urls: Vec<String> = (self.nodes.iter())
            .map(|n| format!("redis://127.0.0.1:{}/", n.port))
            .collect();
        urls.join(",")
    }

    /// A plain connection to node `i`.
    pub fn node(&self, i: usize) -> redis::Connection {
        self.raw(self.nodes[i].port).unwrap()
    }

    fn raw(&self, port: u16) -> redis::RedisResult<redis::Connection> {
        let mut c = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?.get_connection()?;
        redis::cmd("PING").query::<String>(&mut c)?;
        Ok(c)
    }

    /// Keys node `i` holds.
    pub fn keys(&self, i: usize) -> Vec<String> {
        redis::cmd("KEYS")
            .arg("*")
            .query(&mut self.node(i))
            .unwrap()
    }

    /// Stops node `i` (its shard is down).
    pub fn stop(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.stop(i);
        }
    }
}
