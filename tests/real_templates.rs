//! Real models' chat templates (llama.cpp's `models/templates`, from the llama-cpp-python
//! source package that `scripts/fetch-assets` fetches) render an agent's conversation through
//! pensieve's template engine (a system prompt, tools, a call with null content, its result,
//! the next question), and each is told the tool-call format its model writes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use pensieve::chat::{ChatTemplate, TemplateExtras, ToolFormat};
use pensieve::model::{default_cache_dir, Message, ToolCall};
use serde_json::json;

fn source(name: &str) -> String {
    let path = default_cache_dir().join("llamacpp-templates").join(name);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch-assets --tests)", path.display()))
}

/// The templates checked one by one: each model family's format (`None`: its template takes
/// no tools).
const FAMILIES: &[(&str, Option<ToolFormat>)] = &[
    ("Qwen-Qwen2.5-7B-Instruct.jinja", Some(ToolFormat::Hermes)),
    ("Qwen-Qwen3-0.6B.jinja", Some(ToolFormat::Hermes)),
    ("Qwen-QwQ-32B.jinja", Some(ToolFormat::Hermes)),
    ("Qwen3-Coder.jinja", Some(ToolFormat::Qwen3Coder)),
    (
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
        Some(ToolFormat::Hermes),
    ),
    ("ibm-granite-granite-4.0.jinja", Some(ToolFormat::Hermes)),
    (
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        Some(ToolFormat::Llama3Json),
    ),
    (
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        Some(ToolFormat::Llama3Json),
    ),
    (
        "meta-llama-Llama-3.3-70B-Instruct.jinja",
        Some(ToolFormat::Llama3Json),
    ),
    (
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        Some(ToolFormat::Mistral),
    ),
    (
        "Mistral-Small-3.2-24B-Instruct-2506.jinja",
        Some(ToolFormat::MistralArgs),
    ),
    (
        "unsloth-mistral-Devstral-Small-2507.jinja",
        Some(ToolFormat::MistralArgs),
    ),
    (
        "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
        Some(ToolFormat::MistralArgs),
    ),
    ("llama-cpp-deepseek-r1.jinja", Some(ToolFormat::DeepSeekV3)),
    ("deepseek-ai-DeepSeek-V3.1.jinja", None),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", None),
    ("microsoft-Phi-3.5-mini-instruct.jinja", None),
    ("openai-gpt-oss-120b.jinja", Some(ToolFormat::Harmony)),
];

/// Templates of models outside pensieve's architectures that use what the dialect lacks
/// (Cohere's own tool schema, Kimi's in-place `list.append`) or refuse a system message
/// (Gemma 2): their refusal must be a typed error.
const REFUSING: &[&str] = &[
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
    "fireworks-ai-llama-3-firefunction-v2.jinja",
    "Kimi-K2-Instruct.jinja",
    "Kimi-K2-Thinking.jinja",
    "google-gemma-2-2b-it.jinja",
];

/// An agent's turns: a question, a call, its result, the answer, the next question; the
/// call's id as the family writes ids.
fn conversation(format: Option<ToolFormat>) -> Vec<Message> {
    // The id a turn of this family gives its first call.
    let id = format
        .and_then(|f| {
            let reply = match f {
                ToolFormat::Mistral => r#"[TOOL_CALLS][{"name": "x", "arguments": {}}]"#,
                ToolFormat::MistralArgs => "[TOOL_CALLS]x[ARGS]{}",
                _ => return None,
            };
            Some(f.parse(reply, 1)?.1[0].id.clone())
        })
        .unwrap_or_else(|| "call_1".into());
    let call = ToolCall::new(id.clone(), "get_weather", r#"{"city": "Paris"}"#);
    vec![
        Message::new("system", "You are helpful."),
        Message::new("user", "Weather in Paris?"),
        Message::new("assistant", "").with_tool_calls(vec![call]),
        Message::new("tool", "sunny, 21 C").answering(id),
        Message::new("assistant", "It is sunny."),
        Message::new("user", "And tomorrow?"),
    ]
}

fn tools() -> Vec<serde_json::Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}),
    ]
}

#[test]
fn each_family_s_template_renders_an_agent_s_turns_and_is_told_its_call_format() {
    for &(name, format) in FAMILIES {
        let t = ChatTemplate::new(&source(name), "<s>", "</s>")
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(t.tool_format(), format, "{name}");
        let text = t
            .render_with_tools(&conversation(format), &tools(), true)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for part in ["Weather in Paris?", "It is sunny.", "And tomorrow?"] {
            assert!(text.contains(part), "{name}: no {part:?} in {text}");
        }
        if format.is_some() {
            assert!(text.contains("sunny, 21 C"), "{name}: {text}");
            // The tools are listed and the call written back (its arguments as the family
            // writes them: the value at least).
            assert!(text.matches("get_weather").count() >= 2, "{name}: {text}");
            assert!(text.matches("Paris").count() >= 2, "{name}: {text}");
        }
    }
}

#[test]
fn every_template_renders_or_refuses_with_a_typed_error() {
    let dir = default_cache_dir().join("llamacpp-templates");
    let mut rendered = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let made = ChatTemplate::new(&source(&name), "<s>", "</s>")
            .and_then(|t| t.render_with_tools(&conversation(t.tool_format()), &tools(), true));
        match made {
            Ok(_) => {
                assert!(!REFUSING.contains(&name.as_str()), "{name} renders now");
                rendered += 1;
            }
            Err(e) => {
                assert!(REFUSING.contains(&name.as_str()), "{name}: {e}");
                assert!(matches!(e, pensieve::Error::ChatTemplate(_)), "{name}: {e}");
            }
        }
    }
    assert!(rendered >= 60, "{rendered}");
}

#[test]
fn a_request_s_template_variables_reach_the_real_templates() {
    let user = [Message::new("user", "Hi")];
    let render = |name: &str, vars: serde_json::Value| {
        let t = ChatTemplate::new(&source(name), "<s>", "</s>").unwrap();
        let vars = vars.as_object().unwrap().clone();
        let extras = TemplateExtras {
            tools: &[],
            vars: Some(&vars),
        };
        t.render_with(&user, extras, true).unwrap()
    };
    // Qwen3's thinking switch, as vLLM's `chat_template_kwargs` passes it.
    let qwen3 = "Qwen-Qwen3-0.6B.jinja";
    let off = render(qwen3, json!({"enable_thinking": false}));
    assert!(off.ends_with("<think>\n\n</think>\n\n"), "{off}");
    assert!(!render(qwen3, json!({})).contains("<think>"));
    // gpt-oss's effort, as `reasoning_effort` and the Responses API's `reasoning.effort`.
    let oss = "openai-gpt-oss-120b.jinja";
    assert!(render(oss, json!({"reasoning_effort": "high"})).contains("Reasoning: high"));
    assert!(render(oss, json!({})).contains("Reasoning: medium"));
    // The standard variables win over a request's.
    let hijack = render(
        qwen3,
        json!({"messages": [], "add_generation_prompt": false}),
    );
    assert!(
        hijack.contains("Hi") && hijack.ends_with("<|im_start|>assistant\n"),
        "{hijack}"
    );
}
