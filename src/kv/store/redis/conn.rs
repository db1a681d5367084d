//! One connection to the shared store: to a single Redis, or to a Redis Cluster (the `redis`
//! crate's cluster client, which routes each key to the shard that owns its hash slot and
//! follows the cluster when slots move). Keys written together (a conversation's manifest and
//! its name's registration) carry the same hash tag, so one shard holds both.

use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, ConnectionLike, RedisResult, Value};

/// A client of either kind.
#[derive(Clone)]
pub(super) enum Client {
    Single(redis::Client),
    Cluster(ClusterClient),
}

/// A connection of either kind; commands run on either alike.
pub(super) enum Conn {
    Single(redis::Connection),
    Cluster(Box<ClusterConnection>),
}

impl Client {
    /// A new connection, every request on it under `timeout`.
    pub fn connect(&self, timeout: Duration) -> RedisResult<Conn> {
        match self {
            Client::Single(c) => {
                let c = c.get_connection_with_timeout(timeout)?;
                c.set_read_timeout(Some(timeout))?;
                c.set_write_timeout(Some(timeout))?;
                Ok(Conn::Single(c))
            }
            Client::Cluster(c) => {
                let c = c.get_connection()?;
                c.set_read_timeout(Some(timeout))?;
                c.set_write_timeout(Some(timeout))?;
                Ok(Conn::Cluster(Box::new(c)))
            }
        }
    }

    /// The cluster client of the nodes at `urls` (one is enough: it finds the others).
    pub fn cluster(urls: Vec<String>, timeout: Duration) -> RedisResult<Self> {
        // One retry (a slot that moved): a shard that is down fails its request within about
        // one deadline, as a single Redis does, instead of the client's sixteen waits.
        let client = ClusterClient::builder(urls)
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(1)
            .build()?;
        Ok(Client::Cluster(client))
    }
}

impl Conn {
    /// Whether each of `keys` exists, in one round trip per shard.
    pub fn exist(&mut self, keys: &[String]) -> RedisResult<Vec<bool>> {
        match self {
            Conn::Single(c) => {
                let mut pipe = redis::pipe();
                keys.iter().for_each(|k| _ = pipe.cmd("EXISTS").arg(k));
                pipe.query(c)
            }
            Conn::Cluster(c) => {
                let mut pipe = redis::cluster::cluster_pipe();
                keys.iter().for_each(|k| _ = pipe.cmd("EXISTS").arg(k));
                pipe.query(c.as_mut())
            }
        }
    }

    /// Every key matching `pattern`, on every shard.
    pub fn scan(&mut self, pattern: &str) -> RedisResult<Vec<String>> {
        match self {
            Conn::Single(c) => scan_node(pattern, &mut |cmd| cmd.query(c)),
            Conn::Cluster(c) => {
                let mut keys = Vec::new();
                for (host, port) in primaries(c)? {
                    let at =
                        RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port });
                    let mut on_node = |cmd: &Cmd| {
                        let v = c.route_command(cmd, at.clone())?;
                        Ok(redis::from_redis_value(v)?)
                    };
                    keys.extend(scan_node(pattern, &mut on_node)?);
                }
                Ok(keys)
            }
        }
    }
}

/// One page of a `SCAN`: the next cursor (0 at the end) and the keys.
type Page = (u64, Vec<String>);

/// `SCAN`s one node to the end.
fn scan_node(
    pattern: &str,
    query: &mut dyn FnMut(&Cmd) -> RedisResult<Page>,
) -> RedisResult<Vec<String>> {
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000);
        let (next, batch) = query(&cmd)?;
        keys.extend(batch);
        if next == 0 {
            return Ok(keys);
        }
        cursor = next;
    }
}

/// The cluster's primaries (host, port), from `CLUSTER NODES`.
fn primaries(c: &mut ClusterConnection) -> RedisResult<Vec<(String, u16)>> {
    let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(c)?;
    Ok(nodes
        .lines()
        .filter(|l| {
            let flags = l.split(' ').nth(2).unwrap_or("");
            flags.split(',').any(|f| f == "master") && !flags.contains("fail")
        })
        .filter_map(|l| {
            let addr = l.split(' ').nth(1)?.split('@').next()?;
            let (host, port) = addr.rsplit_once(':')?;
            Some((host.to_string(), port.parse().ok()?))
        })
        .collect())
}

impl ConnectionLike for Conn {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn req_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        match self {
            Conn::Single(c) => c.req_command(cmd),
            Conn::Cluster(c) => c.req_command(cmd),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }

    fn check_connection(&mut self) -> bool {
        match self {
            Conn::Single(c) => c.check_connection(),
            Conn::Cluster(c) => c.check_connection(),
        }
    }

    fn is_open(&self) -> bool {
        match self {
            Conn::Single(c) => c.is_open(),
            Conn::Cluster(c) => c.is_open(),
        }
    }
}
