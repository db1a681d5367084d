//! The agent frameworks people build with, against `pensieve-server` on the real model, as
//! their users' programs call it: `tests/frameworks/flows.py` runs each library's documented
//! flows (openai-agents, langchain-openai, pydantic-ai, instructor, smolagents, llama-index and
//! the `openai` client itself), and `tests/frameworks/schema.py` sends every request parameter
//! the installed `openai` client has. Both run in the two pinned environments
//! scripts/fetch-assets makes, one per major version of the `openai` client, since no one
//! version serves every library. `tests/frameworks/anthropic_flows.py` runs the frameworks'
//! Anthropic models (LangChain, pydantic-ai, LiteLLM) on the Messages API, in a third.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;

use common::server::{start, venv_python};
use serde_json::Value;

/// The environments, and the libraries each must run.
const ENVIRONMENTS: [(&str, &[&str]); 2] = [
    (
        "frameworks-openai3",
        &[
            "openai",
            "openai-agents",
            "langchain-openai",
            "pydantic-ai",
            "smolagents",
        ],
    ),
    (
        "frameworks-openai2",
        &[
            "openai",
            "openai-agents",
            "instructor",
            "langchain-openai",
            "pydantic-ai",
            "smolagents",
            "llama-index",
        ],
    ),
];

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/frameworks")
        .join(name)
}

/// Runs `name` in the environment `venv` against `base`: its exit status and its stdout.
fn run(venv: &str, name: &str, base: &str) -> (bool, String) {
    let out = Command::new(venv_python(venv))
        .arg(script(name))
        .arg(base)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn real_model_every_framework_flow_completes_with_only_successful_answers() {
    // SmolLM2's own template takes no tools: ChatML with Hermes-style tools does.
    let server = start(&["--chat-template", "chatml-tools"]);
    for (venv, libraries) in ENVIRONMENTS {
        let (ok, out) = run(venv, "flows.py", &server.base);
        let flows: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let failed: Vec<&Value> = flows
            .iter()
            .filter(|f| f["ok"] != true && f["skipped"] != true)
            .collect();
        assert!(ok && failed.is_empty(), "{venv}: {failed:#?}");
        let ran: BTreeSet<&str> = flows
            .iter()
            .filter(|f| f["ok"] == true)
            .filter_map(|f| f["lib"].as_str())
            .collect();
        let expected: BTreeSet<&str> = libraries.iter().copied().collect();
        assert_eq!(ran, expected, "{venv}: the libraries whose flows ran");
        assert!(flows.len() > 50, "{venv}: {} flows", flows.len());
    }
}

#[test]
fn real_model_the_frameworks_anthropic_models_complete_every_flow() {
    let server = start(&["--chat-template", "chatml-tools"]);
    let (ok, out) = run("frameworks-anthropic", "anthropic_flows.py", &server.base);
    let flows: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let failed: Vec<&Value> = flows.iter().filter(|f| f["ok"] != true).collect();
    assert!(ok && failed.is_empty(), "{failed:#?}");
    let ran: BTreeSet<&str> = flows.iter().filter_map(|f| f["lib"].as_str()).collect();
    let expected = BTreeSet::from(["langchain-anthropic", "pydantic-ai-anthropic", "litellm"]);
    assert_eq!(ran, expected, "the libraries whose flows ran");
    assert!(flows.len() >= 10, "{} flows", flows.len());
}

#[test]
fn real_model_every_parameter_of_both_client_majors_is_taken() {
    let server = start(&[]);
    let mut clients = BTreeSet::new();
    for (venv, _) in ENVIRONMENTS {
        let (ok, out) = run(venv, "schema.py", &server.base);
        let report: Value = serde_json::from_str(out.trim()).unwrap();
        assert!(ok, "{venv}: {report:#}");
        assert_eq!(report["failures"], serde_json::json!([]), "{venv}");
        assert!(report["checked"].as_u64().unwrap() > 80, "{report}");
        let version = report["client"].as_str().unwrap().to_string();
        clients.insert(version.split('.').next().unwrap_or_default().to_string());
    }
    assert_eq!(clients, BTreeSet::from(["2".into(), "3".into()]));
}
