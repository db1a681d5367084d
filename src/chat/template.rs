//! Chat prompts rendered by the model's own Jinja template (`tokenizer.chat_template` in GGUF,
//! `chat_template` in `tokenizer_config.json`), with minijinja and its Python-compatibility
//! methods (`.strip()`, `.startswith()`, ... that real templates call).

use minijinja::{context, Environment};

mod jinja;
mod view;
use serde_json::Value;

use super::tools::ToolFormat;
use crate::message::Message;
use crate::Result;

/// What a template renders beside the messages: the tools it lists, and the variables a
/// request sets beside the standard ones (vLLM's `chat_template_kwargs`: Qwen3's
/// `enable_thinking`, gpt-oss's `reasoning_effort`, ...).
#[derive(Clone, Copy, Debug, Default)]
pub struct TemplateExtras<'a> {
    /// OpenAI's `tools` entries.
    pub tools: &'a [Value],
    /// Variables by name; the standard ones (`messages`, `tools`, ...) win over these.
    pub vars: Option<&'a serde_json::Map<String, Value>>,
}

/// A compiled chat template plus the special-token strings templates refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    tool_format: Option<ToolFormat>,
    thinks: bool,
    harmony: bool,
    /// Whether the template writes a call's arguments by concatenation (DeepSeek's), so takes
    /// them as text rather than as an object.
    arguments_as_text: bool,
}

const TEMPLATE_NAME: &str = "chat";

/// ChatML (`<|im_start|>role ... <|im_end|>`): Qwen, SmolLM and many fine-tunes.
const CHATML: &str = include_str!("templates/chatml.jinja");

/// Gemma's turns (`<start_of_turn>user ... <end_of_turn>`, the assistant named `model`, a
/// system message put before the first user message), as Gemma's instruction-tuned models
/// ship it, contents untrimmed so they are tokenized as plain text.
const GEMMA: &str = include_str!("templates/gemma.jinja");

/// Llama 3's headers (`<|start_header_id|>role<|end_header_id|>`, turns ended by
/// `<|eot_id|>`).
const LLAMA3: &str = include_str!("templates/llama3.jinja");

/// ChatML with tools in the Hermes manner (as Qwen 2.5 writes them): the tools listed in the
/// system message, calls as `<tool_call>` elements, results as `<tool_response>` elements of
/// a user turn. For ChatML models whose own template takes no tools.
const CHATML_TOOLS: &str = include_str!("templates/chatml-tools.jinja");

/// Chat templates for models that ship none (base models), by name: the Jinja source, the
/// special tokens its markup needs, and the token that ends a turn.
pub const BUILTIN_TEMPLATES: [(&str, &str, &[&str]); 4] = [
    ("chatml", CHATML, &["<|im_start|>", "<|im_end|>"]),
    (
        "chatml-tools",
        CHATML_TOOLS,
        &["<|im_start|>", "<|im_end|>"],
    ),
    ("gemma", GEMMA, &["<start_of_turn>", "<end_of_turn>"]),
    (
        "llama3",
        LLAMA3,
        &["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    ),
];

impl ChatTemplate {
    /// Compiles `source`.
    ///
    /// # Errors
    /// [`crate::Error::ChatTemplate`] if the template does not parse.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = jinja::environment();
        env.add_template_owned(TEMPLATE_NAME, jinja::without_generation_tags(source))?;
        Ok(Self {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            tool_format: ToolFormat::detect(source),
            thinks: super::reasoning::template_thinks(source),
            harmony: source.contains("<|channel|>"),
            arguments_as_text: concatenates_arguments(source),
        })
    }

    /// Whether the template is a thinking model's (it names `</think>`): a reply's thought
    /// (up to `</think>`) is kept apart from its answer in the transcript
    /// ([`Message::reasoning_content`]), as the template expects.
    pub fn thinks(&self) -> bool {
        self.thinks
    }

    /// Whether the template is OpenAI's harmony format (gpt-oss: it names `<|channel|>`): a
    /// reply is messages on channels, the `analysis` one its thought
    /// ([`crate::chat::ReasoningParser::GptOss`]).
    pub fn harmony(&self) -> bool {
        self.harmony
    }

    /// How replies write tool calls, for a template that takes tools (`None`: it takes none).
    pub fn tool_format(&self) -> Option<ToolFormat> {
        self.tool_format
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    ///
    /// # Errors
    /// [`crate::Error::ChatTemplate`] if rendering fails (including the template's own
    /// `raise_exception`, e.g. for roles it does not accept).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with the tools the assistant may call (OpenAI's `tools`
    /// entries), which the template lists where its family puts them.
    ///
    /// # Errors
    /// As [`ChatTemplate::render`].
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let extras = TemplateExtras { tools, vars: None };
        self.render_with(messages, extras, add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with the tools and variables of `extras`.
    ///
    /// # Errors
    /// As [`ChatTemplate::render`].
    pub fn render_with(
        &self,
        messages: &[Message],
        extras: TemplateExtras<'_>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.env.get_template(TEMPLATE_NAME)?;
        let as_text = self.arguments_as_text;
        let messages: Vec<minijinja::Value> =
            messages.iter().map(|m| view::message(m, as_text)).collect();
        let tools = extras.tools;
        let vars = minijinja::Value::from_serialize(extras.vars.cloned().unwrap_or_default());
        Ok(template.render(context! {
            messages => messages,
            tools => (!tools.is_empty()).then_some(tools),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
            ..vars
        })?)
    }
}

impl ChatTemplate {
    /// The text that continues a conversation the model has already seen as `seen_text` (the
    /// rendered prompt plus the generated replies, exactly as fed) so that it reads as the
    /// template renders `messages` followed by a generation prompt. Only this text needs
    /// tokenizing for a new turn: the history's tokens are kept, never re-tokenized.
    ///
    /// When the template rewrites history (some trim replies), the continuation starts after
    /// the longest common prefix; the cached tokens stay as the model produced them.
    ///
    /// # Errors
    /// [`crate::Error::ChatTemplate`] if rendering fails.
    pub fn continuation(&self, messages: &[Message], seen_text: &str) -> Result<String> {
        let full = self.render(messages, true)?;
        Ok(full[common_prefix(&full, seen_text)..].to_string())
    }

    /// Where each message's content lies in `render(messages, add_generation_prompt)`, in
    /// order: found by rendering with every content replaced by a marker that no text holds,
    /// so markup that happens to read like a message is never taken for it. `None` when the
    /// template changes contents (trims them, say) or a content holds the markers.
    ///
    /// # Errors
    /// [`crate::Error::ChatTemplate`] if rendering fails.
    pub fn content_spans(
        &self,
        messages: &[Message],
        extras: TemplateExtras<'_>,
        add_generation_prompt: bool,
    ) -> Result<Option<(String, Vec<std::ops::Range<usize>>)>> {
        const OPEN: char = '\u{F0000}';
        const CLOSE: char = '\u{F0001}';
        if messages.iter().any(|m| m.content.contains([OPEN, CLOSE])) {
            return Ok(None);
        }
        // An empty content stays empty (a template may render its message otherwise, as
        // chatml-tools renders a call without text before it); its span is empty, where
        // the content before it ends.
        let marked: Vec<Message> = (0..messages.len())
            .map(|i| Message {
                content: match messages[i].content.is_empty() {
                    true => String::new(),
                    false => format!("{OPEN}{i}{CLOSE}"),
                },
                ..messages[i].clone()
            })
            .collect();
        let rendered = self.render_with(&marked, extras, add_generation_prompt)?;
        let mut text = String::with_capacity(rendered.len());
        let mut spans: Vec<std::ops::Range<usize>> = Vec::new();
        let mut rest = rendered.as_str();
        while let Some(open) = rest.find(OPEN) {
            text.push_str(&rest[..open]);
            let after = &rest[open + OPEN.len_utf8()..];
            let Some(close) = after.find(CLOSE) else {
                return Ok(None);
            };
            let Some((i, m)) = after[..close]
                .parse::<usize>()
                .ok()
                .and_then(|i| Some((i, messages.get(i)?)))
            else {
                return Ok(None);
            };
            while spans.len() < i {
                let end = spans.last().map_or(0, |r| r.end);
                spans.push(end..end);
            }
            spans.push(text.len()..text.len() + m.content.len());
            text.push_str(&m.content);
            rest = &after[close + CLOSE.len_utf8()..];
        }
        text.push_str(rest);
        while spans.len() < messages.len() {
            let end = spans.last().map_or(0, |r| r.end);
            spans.push(end..end);
        }
        let plain = self.render_with(messages, extras, add_generation_prompt)?;
        Ok((text == plain).then_some((text, spans)))
    }
}

/// Whether `source` adds a call's arguments to a string with `+` (as
/// `'...' + tool['function']['arguments']` does), which only text can be.
fn concatenates_arguments(source: &str) -> bool {
    let compact: String = source.chars().filter(|c| !c.is_whitespace()).collect();
    compact.match_indices("arguments").any(|(at, word)| {
        let after = compact[at + word.len()..].trim_start_matches(['\'', '"', ']']);
        let before = compact[..at].trim_end_matches(['\'', '"', '[', '.']);
        let before =
            before.trim_end_matches(|c: char| c.is_alphanumeric() || "_.[]'\"".contains(c));
        after.starts_with('+') || before.ends_with('+')
    })
}

/// The length of the longest common beginning of `full` and `seen` (a char boundary of both).
pub fn common_prefix(full: &str, seen: &str) -> usize {
    full.char_indices()
        .zip(seen.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| full.len().min(seen.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::ToolCall;

    #[test]
    fn builtins_render_turns_and_keep_contents_findable() {
        let msgs = [
            Message::new("system", "Be brief."),
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello."),
            Message::new("user", "Bye"),
        ];
        let render = |name: &str| {
            let (_, src, _) = BUILTIN_TEMPLATES.iter().find(|t| t.0 == name).unwrap();
            let t = ChatTemplate::new(src, "<bos>", "<eos>").unwrap();
            assert!(
                t.content_spans(&msgs, TemplateExtras::default(), true)
                    .unwrap()
                    .is_some(),
                "{name}"
            );
            t.render(&msgs, true).unwrap()
        };
        assert_eq!(
            render("gemma"),
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n\
             Hello.<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        assert!(render("llama3")
            .starts_with("<bos><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"));
        assert!(render("chatml").ends_with("<|im_start|>assistant\n"));
    }

    #[test]
    fn chatml_tools_lists_tools_and_renders_calls_and_results() {
        let t = ChatTemplate::new(CHATML_TOOLS, "", "<|im_end|>").unwrap();
        assert_eq!(t.tool_format(), Some(ToolFormat::Hermes));
        let tools = [serde_json::json!({"type": "function",
            "function": {"name": "weather", "parameters": {"type": "object"}}})];
        let call = ToolCall {
            id: "call_1".into(),
            name: "weather".into(),
            arguments: r#"{"city": "Paris"}"#.into(),
        };
        let msgs = [
            Message::new("system", "Be brief."),
            Message::new("user", "Weather in Paris?"),
            Message {
                tool_calls: vec![call],
                ..Message::new("assistant", "")
            },
            Message {
                tool_call_id: Some("call_1".into()),
                ..Message::new("tool", "sunny")
            },
        ];
        let text = t.render_with_tools(&msgs, &tools, true).unwrap();
        assert!(
            text.starts_with("<|im_start|>system\nBe brief.\n\n# Tools"),
            "{text}"
        );
        assert!(text.contains(r#""name":"weather""#), "{text}");
        // A call without text before it renders as the model writes it after the generation
        // prompt (no blank line), so the next turn continues the KV of the call as generated.
        assert!(
            text.contains(
                "<|im_start|>assistant\n<tool_call>\n{\"name\": \"weather\", \"arguments\": \
             {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n\
             sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            ),
            "{text}"
        );
        // Contents stay findable, so what users and tools wrote is tokenized as plain text.
        let extras = TemplateExtras {
            tools: &tools,
            vars: None,
        };
        let (spanned, spans) = t.content_spans(&msgs, extras, true).unwrap().unwrap();
        assert_eq!(spanned, text);
        assert_eq!(&text[spans[3].clone()], "sunny");
        // Without tools, the plain ChatML turns.
        assert!(t
            .render(&msgs[..2], true)
            .unwrap()
            .starts_with("<|im_start|>system\nBe brief.<|im_end|>"));
    }

    #[test]
    fn arguments_are_text_for_templates_that_concatenate_them() {
        let call = ToolCall::new("c1", "time", r#"{"zone": "UTC"}"#);
        let msgs = [
            Message::new("user", "Time?"),
            Message::new("assistant", "").with_tool_calls(vec![call]),
        ];
        let probe = "{% for m in messages %}[{{ m.content is string }}]\
            {% for c in m.tool_calls %}{{ c.function.arguments is string }}{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(probe, "", "").unwrap();
        assert_eq!(t.render(&msgs, false).unwrap(), "[True][True]False");
        let concatenating = format!("{probe}{{{{ '```json' + tool['function']['arguments'] }}}}");
        let t = ChatTemplate::new(&concatenating, "", "").unwrap();
        assert!(t.render(&msgs, false).is_err() || t.arguments_as_text);
        assert!(t.arguments_as_text);
        for (source, text) in [
            ("{{ call.arguments | tojson }}", false),
            ("{{ '\\n' + tool_call['arguments'] + '\\n' }}", true),
            ("{{ x.arguments+'`' }}", true),
            (
                "{% for k, v in call.arguments | items %}{% endfor %}",
                false,
            ),
        ] {
            assert_eq!(concatenates_arguments(source), text, "{source}");
        }
    }

    #[test]
    fn continuation_is_only_the_new_turn() {
        let t = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let mut msgs = vec![Message::new("user", "Hi")];
        let first = t.render(&msgs, true).unwrap();
        // The model generated "Hello!" and its end-of-turn token.
        let seen = format!("{first}Hello!<|im_end|>");
        msgs.push(Message::new("assistant", "Hello!"));
        msgs.push(Message::new("user", "How are you?"));
        let next = t.continuation(&msgs, &seen).unwrap();
        assert_eq!(
            next,
            "\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn template_errors_are_typed() {
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
        assert!(matches!(
            t.render(&[], true),
            Err(crate::Error::ChatTemplate(_))
        ));
        // Python string methods used by real templates work.
        let t = ChatTemplate::new("{{ messages[0].content.strip() }}", "", "").unwrap();
        assert_eq!(
            t.render(&[Message::new("user", "  x  ")], false).unwrap(),
            "x"
        );
    }
}
