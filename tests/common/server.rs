//! The server (`pensieve-server`) as a child process, and the clients the server tests drive it with:
//! the official `openai` and `anthropic` Python packages (`tests/server_client.py`,
//! `tests/anthropic_client.py`) and raw HTTP.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

/// A server process, killed when dropped.
pub struct Server {
    pub child: Child,
    pub base: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The example binaries `cargo test` built next to this test's.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    dir.join("examples").join(name)
}

/// The server binary `cargo test` built.
pub fn server_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_pensieve-server"))
}

pub fn start(extra: &[&str]) -> Server {
    start_with_env(extra, &[])
}

/// [`start`] with these environment variables set for the server.
pub fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
    spawn(0, extra, env, Stdio::inherit())
}

/// [`start`] with the server's log (stderr) written to `log`.
pub fn start_logged(extra: &[&str], log: &std::path::Path) -> Server {
    spawn(
        0,
        extra,
        &[],
        Stdio::from(std::fs::File::create(log).unwrap()),
    )
}

/// [`start`] on `port` (a router's worker list names it, so a restart must keep it).
pub fn start_on(port: u16, extra: &[&str]) -> Server {
    spawn(port, extra, &[], Stdio::null())
}

fn spawn(port: u16, extra: &[&str], env: &[(&str, &str)], stderr: Stdio) -> Server {
    let mut child = Command::new(server_exe())
        .args(["--port", &port.to_string()])
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("the server binary is built by `cargo test`");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    Server { child, base }
}

/// Two servers sharing a Redis store under `prefix` (a fleet), with the Redis server they
/// share (stopped when dropped).
pub fn fleet(prefix: &str) -> (super::redis_server::Server, Server, Server) {
    let redis = super::redis_server::Server::start(None);
    let url = redis.url();
    let args = ["--redis", url.as_str(), "--redis-prefix", prefix];
    let (a, b) = (start(&args), start(&args));
    (redis, a, b)
}

pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("PENSIEVE_PYTHON") {
        return p.into();
    }
    venv_python("venv")
}

/// The Python of the virtual environment `name` that scripts/fetch-assets made in the cache.
pub fn venv_python(name: &str) -> PathBuf {
    fetched(&format!("{name}/bin/python"))
}

/// The file `path` of the cache scripts/fetch-assets fills, which must be there.
fn fetched(path: &str) -> PathBuf {
    let cache = std::env::var_os("PENSIEVE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/pensieve")
        });
    let p = cache.join(path);
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-assets --tests",
        p.display()
    );
    p
}

/// Runs the JavaScript client script `tests/js_client.cjs` with Node.js and the pinned npm SDKs
/// scripts/fetch-assets installed, and parses what it prints.
pub fn js_client(base: &str, args: &[&str]) -> Value {
    let mut node = Command::new(fetched("js-clients/node"));
    node.env("NODE_PATH", fetched("js-clients/node_modules"));
    run_client(node, "js_client.cjs", base, args)
}

/// Claude Code's binary, as scripts/fetch-assets installed it from npm.
pub fn claude_code() -> PathBuf {
    fetched("js-clients/node_modules/.bin/claude")
}

/// Runs the `openai`-client script and parses what it prints.
pub fn client(base: &str, args: &[&str]) -> Value {
    run_client(Command::new(python()), "server_client.py", base, args)
}

/// Runs the `anthropic`-client script and parses what it prints.
pub fn anthropic_client(base: &str, args: &[&str]) -> Value {
    run_client(Command::new(python()), "anthropic_client.py", base, args)
}

/// Runs the client script `tests/NAME` with `interpreter` and parses what it prints.
fn run_client(mut interpreter: Command, name: &str, base: &str, args: &[&str]) -> Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(name);
    let out = interpreter
        .arg(script)
        .arg(base)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "client failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// POSTs `body` (raw bytes); the status and the parsed JSON answer.
pub fn post(base: &str, path: &str, body: &str) -> (u16, Value) {
    request("POST", base, path, body)
}

/// Sends `body` with `method` (none for an empty body); the status and the parsed JSON
/// answer.
pub fn request(method: &str, base: &str, path: &str, body: &str) -> (u16, Value) {
    let r = ureq::request(method, &format!("{base}{path}")).set("content-type", "application/json");
    let r = match body.is_empty() {
        true => r.call(),
        false => r.send_string(body),
    };
    let resp = match r {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{e}"),
    };
    let status = resp.status();
    (
        status,
        serde_json::from_str(&resp.into_string().unwrap()).unwrap(),
    )
}

/// The manifest a folder store at `store` holds for the conversation `name`, if any: what a
/// restart would resume.
pub fn stored_manifest(store: &std::path::Path, name: &str) -> Option<Value> {
    // `<store>/<model fingerprint>/conversations/<hex name>.json`
    let models = std::fs::read_dir(store).ok()?.filter_map(|e| e.ok());
    let files = models
        .filter_map(|m| std::fs::read_dir(m.path().join("conversations")).ok())
        .flatten()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"));
    files
        .filter_map(|e| serde_json::from_slice::<Value>(&std::fs::read(e.path()).ok()?).ok())
        .find(|m| m["name"] == name)
}

/// The contents of a manifest's messages, in order.
pub fn stored_contents(manifest: &Value) -> Vec<String> {
    manifest["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// `/metrics`, read by a parser of the Prometheus text format.
pub fn scrape(base: &str) -> prometheus_parse::Scrape {
    let text = ureq::get(&format!("{base}/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap()
}

/// The value of the scalar metric `name`, summed over its label sets.
pub fn metric(base: &str, name: &str) -> f64 {
    use prometheus_parse::Value;
    let samples: Vec<f64> = scrape(base)
        .samples
        .into_iter()
        .filter(|s| s.metric == name)
        .filter_map(|s| match s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => Some(v),
            _ => None,
        })
        .collect();
    assert!(!samples.is_empty(), "no metric {name}");
    samples.iter().sum()
}

/// The cumulative buckets (upper bound, count) of the histogram `name`.
pub fn histogram(base: &str, name: &str) -> Vec<(f64, f64)> {
    let found = scrape(base)
        .samples
        .into_iter()
        .find_map(|s| match s.value {
            prometheus_parse::Value::Histogram(b) if s.metric == name => Some(b),
            _ => None,
        });
    let buckets = found.unwrap_or_else(|| panic!("no histogram {name}"));
    buckets.iter().map(|b| (b.less_than, b.count)).collect()
}

/// The assistant message of a chat answer whose reply `tool_choice` held to a call, checked to
/// have ended with its calls.
pub fn forced_call(base: &str, messages: Value, tools: &Value, choice: Value) -> Value {
    let body = serde_json::json!({"messages": messages, "tools": tools, "tool_choice": choice,
        "max_tokens": 160, "temperature": 0});
    let (status, answer) = post(base, "/v1/chat/completions", &body.to_string());
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["choices"][0]["finish_reason"], "tool_calls",
        "{answer}"
    );
    answer["choices"][0]["message"].clone()
}

/// A chat posted on a raw connection of its own (`connection: close`), for a test that reads
/// the answer's bytes as they arrive (a stream's pace).
pub fn raw_chat(base: &str, body: &Value) -> std::net::TcpStream {
    use std::io::Write;
    let body = body.to_string();
    let mut stream = std::net::TcpStream::connect(base.trim_start_matches("http://")).unwrap();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    stream
}
