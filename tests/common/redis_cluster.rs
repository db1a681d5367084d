//! A Redis Cluster of a test's own: three primaries (`--cluster-enabled yes`, the server
//! `redis_server::server_binary` finds) on free local ports, each in its own folder, each given
//! a third of the slots and introduced to the others (what `redis-cli --cluster create` does,
//! without needing redis-cli); stopped when dropped.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use super::redis_server::{server_binary, spawn_server};

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
        let port = super::redis_server::free_port();
        if port < 55000 && std::net::TcpListener::bind(("127.0.0.1", port + 10000)).is_ok() {
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
                let child = spawn_server(
                    Command::new(server_binary())
                        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                        .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                        // A shard that is down leaves the others serving their slots.
                        .args(["--cluster-require-full-coverage", "no"])
                        .args(["--save", "", "--appendonly", "no"])
                        .arg("--dir")
                        .arg(dir.path()),
                );
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
        // A third of the 16,384 slots to each node, then the first meets the others.
        const SLOTS: usize = 16_384;
        let n = c.nodes.len();
        for (i, node) in c.nodes.iter().enumerate() {
            let (first, last) = (i * SLOTS / n, (i + 1) * SLOTS / n - 1);
            let _: String = redis::cmd("CLUSTER")
                .arg("ADDSLOTSRANGE")
                .arg(first)
                .arg(last)
                .query(&mut c.node_at(node.port))
                .unwrap();
        }
        for node in &c.nodes[1..] {
            let _: String = redis::cmd("CLUSTER")
                .arg("MEET")
                .arg("127.0.0.1")
                .arg(node.port)
                .query(&mut c.node_at(c.nodes[0].port))
                .unwrap();
        }
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
        self.node_at(self.nodes[i].port)
    }

    fn node_at(&self, port: u16) -> redis::Connection {
        self.raw(port).unwrap()
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
