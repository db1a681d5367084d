//! Which request fields each endpoint takes, and what it does with each: OpenAI's published
//! request schema whole (the `*CreateParams` types of the official `openai` client), vLLM's
//! extra parameters where they have a meaning here, and pensieve's own extensions.
//!
//! Every field is one of three kinds ([`Kind`]): implemented; informational (accepted, and
//! changes nothing here, as `user` or `service_tier`); or taken at its default value only (a
//! request asking for what this server cannot do, audio output say, gets a 400 that names
//! the field and the value it takes). A name in none of these lists is a typo or another
//! server's extension: a 400 naming it, unless the server runs with `--ignore-unknown-fields`
//! (gateways that add fields of their own). docs/SERVER.md's field table is these lists, and
//! a test holds the two together.

use serde_json::Value;

use super::error::ApiError;

/// What the server does with a field.
#[derive(Clone, Copy, Debug)]
pub enum Kind {
    /// It acts on the field.
    Implemented,
    /// Accepted, without effect here.
    Informational,
    /// Accepted at the values `takes` allows; others are refused by value.
    DefaultOnly(fn(&Value) -> bool),
}

/// A request field of an endpoint.
#[derive(Clone, Copy, Debug)]
pub struct Field {
    pub name: &'static str,
    pub kind: Kind,
    /// What the server does with it (informational and default-only fields: why).
    pub note: &'static str,
}

const fn implemented(name: &'static str, note: &'static str) -> Field {
    Field {
        name,
        kind: Kind::Implemented,
        note,
    }
}

const fn informational(name: &'static str, note: &'static str) -> Field {
    Field {
        name,
        kind: Kind::Informational,
        note,
    }
}

const fn default_only(name: &'static str, takes: fn(&Value) -> bool, note: &'static str) -> Field {
    Field {
        name,
        kind: Kind::DefaultOnly(takes),
        note,
    }
}

fn null(v: &Value) -> bool {
    v.is_null()
}

fn null_or_false(v: &Value) -> bool {
    v.is_null() || *v == Value::Bool(false)
}

fn null_or_true(v: &Value) -> bool {
    v.is_null() || *v == Value::Bool(true)
}

fn text_only(v: &Value) -> bool {
    v.is_null() || v.as_array().is_some_and(|a| a.iter().all(|m| m == "text"))
}

fn at_most_one(v: &Value) -> bool {
    v.is_null() || v.as_u64().is_some_and(|n| n <= 1)
}

fn empty_or_null(v: &Value) -> bool {
    v.is_null() || v.as_array().is_some_and(Vec::is_empty) || v.as_str() == Some("")
}

/// vLLM's guided decoding, on every generation endpoint: at most one holds a reply.
const GUIDED: &[Field] = &[
    implemented("guided_json", "vLLM's: the reply follows this JSON schema"),
    implemented(
        "guided_regex",
        "vLLM's: the reply matches this regular expression",
    ),
    implemented("guided_choice", "vLLM's: the reply is one of these strings"),
    implemented(
        "guided_grammar",
        "vLLM's: a grammar in llguidance's Lark dialect",
    ),
];

/// The sampling and output fields `/v1/chat/completions` and `/v1/completions` share.
const SAMPLING: &[Field] = &[
    implemented(
        "model",
        "must name the served model (404 otherwise); may be omitted",
    ),
    implemented("max_tokens", "the reply's length limit"),
    implemented("temperature", "sampling temperature"),
    implemented("top_p", "nucleus sampling"),
    implemented(
        "seed",
        "seeds the request's sampler: the same seed, the same reply",
    ),
    implemented("stop", "stop strings (the reply ends before them)"),
    implemented("stream", "server-sent events"),
    implemented("stream_options", "`include_usage` adds a usage chunk"),
    implemented("n", "up to 16 choices, each on a fork of the conversation"),
    implemented("logit_bias", "token id to bias in [-100, 100]"),
    implemented("presence_penalty", "as OpenAI defines it"),
    implemented("frequency_penalty", "as OpenAI defines it"),
    informational("user", "OpenAI's end-user id for abuse monitoring"),
    // vLLM's extra sampling parameters.
    implemented("top_k", "vLLM's: the k most likely tokens (-1 or 0: all)"),
    implemented(
        "ignore_eos",
        "vLLM's: generation goes on past the end token",
    ),
    implemented("min_tokens", "vLLM's: no end before this many tokens"),
    implemented("repetition_penalty", "vLLM's"),
    implemented("min_p", "vLLM's"),
    implemented("stop_token_ids", "vLLM's: tokens that end the reply"),
    implemented(
        "return_tokens_as_token_ids",
        "vLLM's: log-probabilities name tokens `token_id:N`",
    ),
    informational(
        "guided_decoding_backend",
        "vLLM's: llguidance holds every constraint here",
    ),
    informational(
        "skip_special_tokens",
        "vLLM's: replies never carry the template's markup tokens here",
    ),
    informational("spaces_between_special_tokens", "vLLM's: as above"),
    informational(
        "priority",
        "vLLM's: turns are admitted first come, first served, and a step's prefill tokens go to the shortest remaining prefill first (aged: docs/ARCHITECTURE.md)",
    ),
    informational("request_id", "vLLM's: a request id for logs"),
    default_only(
        "include_stop_str_in_output",
        null_or_false,
        "vLLM's: the reply ends before a stop string (false only)",
    ),
    default_only(
        "use_beam_search",
        null_or_false,
        "vLLM's: no beam search (false only)",
    ),
    // SGLang's, which vLLM's and SGLang's routers write into every request they forward.
    default_only(
        "no_stop_trim",
        null_or_false,
        "SGLang's: the reply ends before a stop string (false only)",
    ),
    default_only(
        "return_hidden_states",
        null_or_false,
        "SGLang's: no hidden states are returned (false only)",
    ),
];

/// `/v1/chat/completions`, beside [`SAMPLING`].
const CHAT: &[Field] = &[
    implemented("messages", "the conversation; its history's KV is reused"),
    implemented(
        "max_completion_tokens",
        "the reply's length limit (over `max_tokens`)",
    ),
    implemented(
        "response_format",
        "`text`, `json_object`, `json_schema` (constrained)",
    ),
    implemented(
        "tools",
        "offered through the chat template; calls parsed from replies",
    ),
    implemented(
        "tool_choice",
        "`auto`, `none` (the tools stay in the prompt, as vLLM keeps them, so its KV is reused; the reply is text), `required` or a named function",
    ),
    implemented(
        "parallel_tool_calls",
        "false: only a reply's first call is answered",
    ),
    implemented("functions", "the legacy form of `tools`"),
    implemented("function_call", "the legacy form of `tool_choice`"),
    implemented("logprobs", "each reply token's log-probability"),
    implemented("top_logprobs", "and up to 20 alternatives"),
    // What vLLM's and SGLang's routers write into every chat request they forward.
    default_only(
        "separate_reasoning",
        null_or_true,
        "SGLang's: a thought is `reasoning_content` with `--reasoning-parser` (true only)",
    ),
    default_only(
        "stream_reasoning",
        null_or_true,
        "SGLang's: a thought streams as it is written (true only)",
    ),
    default_only(
        "include_reasoning",
        null_or_true,
        "vLLM's: a thought is returned (true only)",
    ),
    default_only(
        "continue_final_message",
        null_or_false,
        "vLLM's: a reply is a new assistant message (false only)",
    ),
    implemented(
        "reasoning_effort",
        "the chat template's `reasoning_effort` variable, as vLLM passes it (gpt-oss's)",
    ),
    implemented(
        "chat_template_kwargs",
        "vLLM's: variables of the chat template (Qwen3's `enable_thinking`, ...)",
    ),
    informational("metadata", "OpenAI's tags for stored completions"),
    informational("store", "OpenAI's storage of completions for its dashboard"),
    informational("service_tier", "one tier here"),
    informational(
        "safety_identifier",
        "OpenAI's end-user id for abuse monitoring",
    ),
    informational(
        "prompt_cache_key",
        "every conversation's KV is cached by content (and by name) already",
    ),
    informational("prompt_cache_retention", "as above"),
    informational("prompt_cache_options", "as above"),
    informational("verbosity", "a hint for OpenAI's models"),
    informational("moderation", "no moderation here"),
    implemented(
        "prediction",
        "Predicted Outputs: drafted by exact speculation, the same reply in fewer steps",
    ),
    default_only("modalities", text_only, "text output only: `[\"text\"]`"),
    default_only("audio", null, "no audio output"),
    default_only("web_search_options", null, "no web search"),
    default_only(
        "add_generation_prompt",
        null_or_true,
        "vLLM's: the reply is the assistant's next message (true only)",
    ),
    default_only(
        "continue_final_message",
        null_or_false,
        "vLLM's: a reply is a new message (false only)",
    ),
    default_only(
        "echo",
        null_or_false,
        "vLLM's: the prompt is not echoed (false only)",
    ),
    implemented(
        "conversation_id",
        "pensieve's: the conversation to continue by name (or `X-Conversation-Id`)",
    ),
    implemented(
        "pin",
        "pensieve's: keep the named conversation's KV in memory",
    ),
    implemented(
        "expect_resume_s",
        "pensieve's: the named conversation's next turn comes in this many seconds",
    ),
    implemented(
        "end_conversation",
        "pensieve's: free the named conversation after this turn",
    ),
];

/// `/v1/completions`, beside [`SAMPLING`].
const COMPLETION: &[Field] = &[
    implemented("prompt", "text or token ids, one prompt"),
    implemented(
        "logprobs",
        "log-probabilities and up to 20 alternatives per token",
    ),
    implemented(
        "add_special_tokens",
        "vLLM's: the vocabulary's begin token (true)",
    ),
    implemented(
        "response_format",
        "vLLM's: `json_object`, `json_schema` (constrained), as on chat",
    ),
    implemented(
        "max_completion_tokens",
        "as `max_tokens` (chat's name for it)",
    ),
    default_only("best_of", at_most_one, "one candidate per choice (1 only)"),
    default_only(
        "echo",
        null_or_false,
        "the prompt is not echoed (false only)",
    ),
    default_only("suffix", empty_or_null, "no insertion after a suffix"),
];

/// `/v1/responses`.
pub const RESPONSES: &[Field] = &[
    implemented(
        "model",
        "must name the served model (404 otherwise); may be omitted",
    ),
    implemented(
        "input",
        "text or items: messages, calls, their outputs, reasoning, compaction items (made by \
         this server: the summary, as an assistant message); a last `compaction_trigger` makes \
         the response a compaction of the context",
    ),
    implemented("instructions", "the system message"),
    implemented(
        "previous_response_id",
        "continues a stored response (its KV reused)",
    ),
    implemented("store", "false: the response is not kept"),
    implemented("stream", "the Responses API's events"),
    implemented("max_output_tokens", "the reply's length limit"),
    implemented("temperature", "sampling temperature"),
    implemented("top_p", "nucleus sampling"),
    implemented("metadata", "echoed in the response"),
    implemented("tools", "function tools, as on the chat endpoint"),
    implemented(
        "tool_choice",
        "`auto`, `none` (the tools stay in the prompt, as vLLM keeps them, so its KV is reused; the reply is text), `required` or a named function",
    ),
    implemented(
        "parallel_tool_calls",
        "false: only a reply's first call is answered",
    ),
    implemented(
        "text",
        "`format`: free text, `json_object` or `json_schema`",
    ),
    implemented(
        "include",
        "`message.output_text.logprobs` reports the answer's log-probabilities; values of \
         hosted tools, images and encrypted thoughts add nothing here; unknown values are \
         refused by name",
    ),
    implemented(
        "reasoning",
        "`effort` as the chat template's `reasoning_effort` variable; `summary`: no summaries",
    ),
    implemented(
        "chat_template_kwargs",
        "vLLM's: variables of the chat template, as on chat",
    ),
    informational("user", "OpenAI's end-user id for abuse monitoring"),
    informational("safety_identifier", "as above"),
    informational("service_tier", "one tier here"),
    informational(
        "prompt_cache_key",
        "every conversation's KV is cached by content (and by name) already",
    ),
    informational("prompt_cache_retention", "as above"),
    informational("prompt_cache_options", "as above"),
    informational("moderation", "no moderation here"),
    informational(
        "stream_options",
        "`include_obfuscation`: no obfuscation here",
    ),
    informational("access_programs", "OpenAI's account programs"),
    informational("background_options", "as `background`"),
    implemented(
        "background",
        "answered at once, polled with GET, cancelled with POST .../cancel (not with stream)",
    ),
    implemented(
        "top_logprobs",
        "up to 20 alternatives of each answer token, with `include` of \
         `message.output_text.logprobs`",
    ),
    implemented(
        "truncation",
        "`auto`: the oldest turns are dropped to fit (`--overflow drop-oldest`); `disabled`: a 400",
    ),
    informational(
        "max_tool_calls",
        "it bounds calls of OpenAI's built-in tools, and there are none here",
    ),
    implemented(
        "conversation",
        "a conversation of `/v1/conversations` to continue; the reply joins its items",
    ),
    default_only("prompt", null, "OpenAI's stored prompt templates"),
    implemented(
        "context_management",
        "`compaction` entries: past `compact_threshold` prompt tokens (default three quarters \
         of the context), the history before the new input is summarized first and the \
         response's output begins with the compaction item",
    ),
    default_only("image", null, "no image generation"),
];

/// `/v1/responses/compact`.
pub const COMPACT: &[Field] = &[
    implemented(
        "model",
        "must name the served model (404 otherwise); may be omitted",
    ),
    implemented("input", "as on `/v1/responses`: the context to compact"),
    implemented("instructions", "the system message of the context"),
    implemented(
        "previous_response_id",
        "a stored response whose conversation comes before `input`",
    ),
    informational("prompt_cache_key", "the cache is found by content"),
    informational("prompt_cache_retention", "as above"),
    informational("prompt_cache_options", "as above"),
    informational("service_tier", "one tier here"),
    informational("image", "no images here"),
];

/// vLLM's `/tokenize`.
pub const TOKENIZE: &[Field] = &[
    implemented("model", "must name the served model"),
    implemented("prompt", "text to tokenize"),
    implemented("messages", "chat messages, rendered by the template"),
    implemented(
        "add_generation_prompt",
        "end with the assistant's turn opening",
    ),
    implemented(
        "add_special_tokens",
        "the vocabulary's begin (and end) tokens",
    ),
];

/// vLLM's `/detokenize`.
pub const DETOKENIZE: &[Field] = &[
    implemented("model", "must name the served model"),
    implemented("tokens", "token ids"),
];

/// Anthropic's Messages API (`/v1/messages`): the create request's fields whole (the
/// `MessageCreateParams` of the official `anthropic` client, and the sampling fields older
/// clients send).
pub const MESSAGES: &[Field] = &[
    implemented("model", "must name the served model (404 otherwise)"),
    implemented(
        "messages",
        "text, tool_use, tool_result (`is_error`: the result begins `Error: `) and thinking \
         blocks; images and documents refused; a last assistant message (a prefill) refused",
    ),
    implemented(
        "max_tokens",
        "the reply's length limit (required); 0 computes and keeps the prompt, no reply",
    ),
    implemented("system", "text or text blocks"),
    implemented(
        "stop_sequences",
        "stop strings; `stop_sequence` names the one that ended the reply",
    ),
    implemented("stream", "Anthropic's server-sent events"),
    implemented("temperature", "sampling temperature, in [0, 1]"),
    implemented("top_p", "nucleus sampling"),
    implemented("top_k", "the k most likely tokens only"),
    implemented(
        "tools",
        "client tools (name, description, input_schema), listed by the chat template; server \
         tools refused by type",
    ),
    implemented(
        "tool_choice",
        "`auto`, `any`, `tool` by name, `none` (the tools stay listed); \
         `disable_parallel_tool_use`",
    ),
    implemented(
        "thinking",
        "`enabled` or `disabled`: the template's `enable_thinking`; `adaptive`: the \
         template's default; `budget_tokens` is not enforced",
    ),
    implemented(
        "output_config",
        "`format` (`json_schema`): the reply follows the schema; `effort`: the template's \
         `reasoning_effort`",
    ),
    implemented(
        "cache_control",
        "a breakpoint at the last message; as on blocks, its `ttl` (5m, 1h) is how long the \
         conversation is expected back, and `usage` counts the cache up to the last breakpoint",
    ),
    informational("metadata", "`user_id`: Anthropic's end-user id"),
    informational("service_tier", "one tier here"),
    informational("speed", "one speed here"),
    informational("inference_geo", "one place here"),
    informational("diagnostics", "the cache's misses are not explained here"),
    informational("user_profile_id", "Anthropic's attribution of requests"),
    informational("workspace_id", "Anthropic's workspaces"),
    default_only("container", null, "no code execution containers"),
    implemented(
        "context_management",
        "`clear_thinking` edits drop earlier turns' thoughts (`keep`); clearing tool results \
         is refused",
    ),
    default_only("mcp_servers", empty_or_null, "no MCP connector"),
];

/// Anthropic's `/v1/messages/count_tokens`.
pub const COUNT_TOKENS: &[Field] = &[
    implemented("model", "must name the served model (404 otherwise)"),
    implemented("messages", "as on `/v1/messages`"),
    implemented("system", "as on `/v1/messages`"),
    implemented(
        "tools",
        "as on `/v1/messages`: listed by the template, so counted",
    ),
    implemented("tool_choice", "checked as on `/v1/messages`"),
    implemented("thinking", "as on `/v1/messages`"),
    implemented("output_config", "as on `/v1/messages`"),
    informational(
        "cache_control",
        "a count is the same with or without breakpoints",
    ),
    informational("speed", "one speed here"),
    informational("user_profile_id", "Anthropic's attribution of requests"),
    informational("workspace_id", "Anthropic's workspaces"),
    implemented("context_management", "as on `/v1/messages`"),
    default_only("mcp_servers", empty_or_null, "no MCP connector"),
];

/// An endpoint's fields, in the order docs/SERVER.md lists them.
#[derive(Clone, Copy, Debug)]
pub struct Endpoint {
    pub path: &'static str,
    /// Whose API it is (vLLM's for its own endpoints): named when a field is unknown.
    pub api: &'static str,
    pub lists: &'static [&'static [Field]],
}

/// Every endpoint that takes a JSON body, with its fields.
pub const ENDPOINTS: &[Endpoint] = &[
    Endpoint {
        path: "/v1/chat/completions",
        api: "OpenAI",
        lists: &[CHAT, SAMPLING, GUIDED],
    },
    Endpoint {
        path: "/v1/completions",
        api: "OpenAI",
        lists: &[COMPLETION, SAMPLING, GUIDED],
    },
    Endpoint {
        path: "/v1/responses",
        api: "OpenAI",
        lists: &[RESPONSES, GUIDED],
    },
    Endpoint {
        path: "/tokenize",
        api: "vLLM",
        lists: &[TOKENIZE],
    },
    Endpoint {
        path: "/detokenize",
        api: "vLLM",
        lists: &[DETOKENIZE],
    },
    Endpoint {
        path: "/v1/messages",
        api: "Anthropic",
        lists: &[MESSAGES],
    },
    Endpoint {
        path: "/v1/messages/count_tokens",
        api: "Anthropic",
        lists: &[COUNT_TOKENS],
    },
    Endpoint {
        path: "/v1/responses/compact",
        api: "OpenAI",
        lists: &[COMPACT],
    },
];

/// The chat endpoint's fields.
pub const CHAT_ENDPOINT: Endpoint = ENDPOINTS[0];
/// The completion endpoint's fields.
pub const COMPLETION_ENDPOINT: Endpoint = ENDPOINTS[1];
/// The Responses API's fields.
pub const RESPONSES_ENDPOINT: Endpoint = ENDPOINTS[2];
/// `/tokenize`'s fields.
pub const TOKENIZE_ENDPOINT: Endpoint = ENDPOINTS[3];
/// `/detokenize`'s fields.
pub const DETOKENIZE_ENDPOINT: Endpoint = ENDPOINTS[4];
/// Anthropic's Messages API's fields.
pub const MESSAGES_ENDPOINT: Endpoint = ENDPOINTS[5];
/// Anthropic's token count's fields.
pub const COUNT_TOKENS_ENDPOINT: Endpoint = ENDPOINTS[6];
/// The Responses API's compaction's fields.
pub const COMPACT_ENDPOINT: Endpoint = ENDPOINTS[7];

impl Endpoint {
    /// The field of this name, first list first (an endpoint's own entry before a shared
    /// one).
    pub fn field(&self, name: &str) -> Option<&'static Field> {
        self.lists
            .iter()
            .flat_map(|l| l.iter())
            .find(|f| f.name == name)
    }

    /// Checks a request object's fields: each known (else a 400 naming it, unless
    /// `ignore_unknown`), each default-only one at a value it takes (else a 400 naming it and
    /// why).
    ///
    /// # Errors
    /// The 400 for the first field at fault.
    pub fn check(
        &self,
        object: &serde_json::Map<String, Value>,
        ignore_unknown: bool,
    ) -> Result<(), ApiError> {
        for (k, v) in object {
            match self.field(k).map(|f| (f.kind, f.note)) {
                None if ignore_unknown => {}
                None => {
                    return Err(ApiError::bad(format!(
                        "unsupported field {k:?}: neither {}'s API nor this server has it \
                         on {} (start the server with --ignore-unknown-fields to ignore such \
                         fields)",
                        self.api, self.path
                    ))
                    .with_param(k.clone()))
                }
                Some((Kind::DefaultOnly(takes), note)) if !takes(v) => {
                    return Err(ApiError::bad(format!("unsupported value of {k:?}: {note}"))
                        .with_param(k.clone()))
                }
                Some(_) if k == "metadata" && self.api == "OpenAI" => super::metadata::check(v)?,
                Some(_) => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The field table of docs/SERVER.md, as these lists make it.
    fn table() -> String {
        let mut out = String::new();
        for e in ENDPOINTS {
            out.push_str(&format!(
                "\n`{}`:\n\n| field | | what it does here |\n|---|---|---|\n",
                e.path
            ));
            let mut seen = std::collections::HashSet::new();
            for f in e.lists.iter().flat_map(|l| l.iter()) {
                if !seen.insert(f.name) {
                    continue;
                }
                let kind = match f.kind {
                    Kind::Implemented => "implemented",
                    Kind::Informational => "informational",
                    Kind::DefaultOnly(_) => "default only",
                };
                out.push_str(&format!("| `{}` | {kind} | {} |\n", f.name, f.note));
            }
        }
        out
    }

    #[test]
    fn the_docs_field_table_is_these_lists() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/SERVER.md");
        let docs = std::fs::read_to_string(path).unwrap();
        let table = table();
        assert!(
            docs.contains(&table),
            "docs/SERVER.md's field table differs from src/server/fields.rs; it should read:\n{table}"
        );
    }

    #[test]
    fn unknown_and_unsupported_values_are_refused_by_name() {
        let object = |v: Value| v.as_object().unwrap().clone();
        let chat = CHAT_ENDPOINT;
        let e = chat.check(&object(serde_json::json!({"temprature": 1})), false);
        assert!(e.unwrap_err().message.contains("\"temprature\""));
        assert!(chat
            .check(&object(serde_json::json!({"temprature": 1})), true)
            .is_ok());
        let ok = serde_json::json!({"modalities": ["text"], "audio": null, "store": true,
            "metadata": {"a": "b"}, "service_tier": "auto", "reasoning_effort": "low"});
        assert!(chat.check(&object(ok), false).is_ok());
        let e = chat.check(
            &object(serde_json::json!({"modalities": ["text", "audio"]})),
            false,
        );
        assert!(e.unwrap_err().message.contains("modalities"));
    }
}
