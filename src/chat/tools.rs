//! Tool calling: the formats of the templates' families, told by a template's source; the
//! calls are read back from a reply in its format by `super::tool_stream`.

/// How a chat template's family writes tool calls in a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ToolFormat {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one element per call
    /// (Hermes; Qwen 2.5 and 3; pensieve's `chatml-tools`).
    Hermes,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral).
    Mistral,
    /// `[TOOL_CALLS]NAME[ARGS]{...}`, the opener before each call (Mistral's templates from
    /// tokenizer v11: Mistral Small 3.2, Devstral, Magistral).
    MistralArgs,
    /// A reply that is one JSON object `{"name": ..., "parameters": {...}}`, possibly after
    /// `<|python_tag|>` (Llama 3.1 to 3.3).
    Llama3Json,
    /// `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`,
    /// each value on lines of its own and typed by the tool's schema (Qwen3-Coder).
    Qwen3Coder,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the
    /// arguments' object fenced as ` ```json `, then `<｜tool▁call▁end｜>`, per call
    /// (DeepSeek V3 and R1).
    DeepSeekV3,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`
    /// per call (DeepSeek V3.1).
    DeepSeekV31,
    /// A harmony message to `functions.NAME` whose content is the arguments' object:
    /// `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`, or with
    /// the recipient before the channel (gpt-oss).
    Harmony,
}

impl ToolFormat {
    /// The format of a template that renders tools, from its source; `None` when it takes
    /// no tools.
    pub fn detect(source: &str) -> Option<Self> {
        if !source.contains("tools") {
            return None;
        }
        if source.contains("<|channel|>") && source.contains("to=") {
            Some(Self::Harmony)
        } else if source.contains("<｜tool▁call▁begin｜>") {
            match source.contains("```json") {
                true => Some(Self::DeepSeekV3),
                false => Some(Self::DeepSeekV31),
            }
        } else if source.contains("<function=") && source.contains("<parameter=") {
            Some(Self::Qwen3Coder)
        } else if source.contains("<tool_call>") {
            Some(Self::Hermes)
        } else if source.contains("[TOOL_CALLS]") && source.contains("[ARGS]") {
            Some(Self::MistralArgs)
        } else if source.contains("[TOOL_CALLS]") {
            Some(Self::Mistral)
        } else if source.contains("<|start_header_id|>") && source.contains("parameters") {
            Some(Self::Llama3Json)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tool_stream::ToolDelta;
    use super::*;
    use crate::message::ToolCall;

    #[test]
    fn each_family_s_calls_are_read_with_their_arguments() {
        let reply = "Let me check.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": \
                     {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \
                     \"arguments\": {}}\n</tool_call>";
        let (text, calls) = ToolFormat::Hermes.parse(reply, 1).unwrap();
        assert_eq!(text, "Let me check.");
        assert_eq!(calls.len(), 2);
        // The arguments as the model wrote them.
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("weather", r#"{"city": "Paris"}"#)
        );
        assert_ne!(calls[0].id, calls[1].id);
        // Ids are the turn's: another seed, other ids.
        assert_ne!(
            ToolFormat::Hermes.parse(reply, 2).unwrap().1[0].id,
            calls[0].id
        );
        let mistral = r#"[TOOL_CALLS][{"name": "time", "arguments": {"zone": "UTC"}}, {"name": "date", "arguments": "{\"zone\": \"UTC\"}"}]"#;
        let (text, calls) = ToolFormat::Mistral.parse(mistral, 1).unwrap();
        assert_eq!((text.as_str(), calls[0].name.as_str()), ("", "time"));
        // Arguments given as a JSON string are its contents.
        assert_eq!(calls[1].arguments, r#"{"zone": "UTC"}"#);
        let named = r#"On it.[TOOL_CALLS]time[ARGS]{"zone": "UTC"}[TOOL_CALLS]date[ARGS]{}"#;
        let (text, calls) = ToolFormat::MistralArgs.parse(named, 1).unwrap();
        assert_eq!(text, "On it.");
        assert_eq!(
            calls
                .iter()
                .map(|c| (c.name.as_str(), c.arguments.as_str()))
                .collect::<Vec<_>>(),
            [("time", r#"{"zone": "UTC"}"#), ("date", "{}")]
        );
        assert!(ToolFormat::MistralArgs
            .parse("[TOOL_CALLS]time[ARGS]{\"zone\": ", 1)
            .is_none());
        let deepseek = "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>time\n```json\n{\"zone\": \"UTC\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>date\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (text, calls) = ToolFormat::DeepSeekV3.parse(deepseek, 1).unwrap();
        assert_eq!(text, "Checking.");
        let pairs = |calls: &[ToolCall]| -> Vec<(String, String)> {
            (calls.iter())
                .map(|c| (c.name.clone(), c.arguments.clone()))
                .collect()
        };
        let expected = [("time", r#"{"zone": "UTC"}"#), ("date", "{}")]
            .map(|(n, a)| (n.to_string(), a.to_string()));
        assert_eq!(pairs(&calls), expected);
        let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>time<｜tool▁sep｜>{\"zone\": \"UTC\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>date<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (text, calls) = ToolFormat::DeepSeekV31.parse(v31, 1).unwrap();
        assert_eq!((text.as_str(), pairs(&calls)), ("", expected.to_vec()));
        assert!(ToolFormat::DeepSeekV3
            .parse(
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>time\n```json\n{}",
                1
            )
            .is_none());
        let harmony = "<|channel|>analysis<|message|>Need time.<|end|><|start|>assistant<|channel|>commentary to=functions.time <|constrain|>json<|message|>{\"zone\": \"UTC\"}";
        let (text, calls) = ToolFormat::Harmony.parse(harmony, 1).unwrap();
        assert_eq!(
            text,
            "<|channel|>analysis<|message|>Need time.<|end|><|start|>assistant<|channel|>commentary"
        );
        assert_eq!(pairs(&calls), [expected[0].clone()]);
        // The recipient in the role, as the template renders calls.
        let (_, calls) = ToolFormat::Harmony
            .parse(
                " to=functions.date<|channel|>commentary json<|message|>{}",
                1,
            )
            .unwrap();
        assert_eq!(pairs(&calls), [expected[1].clone()]);
        let llama = r#"<|python_tag|>{"name": "time", "parameters": {"zone": "UTC"}}"#;
        let (_, calls) = ToolFormat::Llama3Json.parse(llama, 1).unwrap();
        assert_eq!(calls[0].arguments, r#"{"zone": "UTC"}"#);
        // Text without calls, or calls that are not JSON, are a plain reply.
        assert!(ToolFormat::Hermes
            .parse("The weather is fine.", 1)
            .is_none());
        assert!(ToolFormat::Hermes
            .parse("<tool_call>{not json}</tool_call>", 1)
            .is_none());
        assert!(ToolFormat::Llama3Json.parse("Paris is sunny.", 1).is_none());
        assert!(ToolFormat::Llama3Json
            .parse(r#"{"name": "time", "parameters": {}} and more"#, 1)
            .is_none());
        // A call cut off by the length is no call.
        assert!(ToolFormat::Hermes
            .parse("<tool_call>{\"name\": \"time\", \"arguments\": {\"zo", 1)
            .is_none());
    }

    #[test]
    fn a_streamed_reply_gives_the_same_text_and_calls_in_any_pieces() {
        let replies = [
            (ToolFormat::Hermes, "Checking <the> weather.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Par\\\"is}\", \"days\": [1, {\"a\": 2}]}}\n</tool_call>\nignored<tool_call>{\"arguments\": {\"x\": 1}, \"name\": \"late\"}</tool_call>"),
            (ToolFormat::Mistral, r#"[TOOL_CALLS] [{"name": "a", "arguments": {"k": "v"}}, {"name": "b", "arguments": "{}"}]"#),
            (ToolFormat::Llama3Json, r#"<|python_tag|>{"name": "time", "parameters": {"zone": "UTC"}}"#),
            (ToolFormat::Hermes, "No calls at all, just < and <tool text.  "),
            (ToolFormat::MistralArgs, r#"Sure.[TOOL_CALLS]weather[ARGS]{"city": "Pa}ris", "days": [1, {"a": 2}]}[TOOL_CALLS]time[ARGS]{}"#),
            (ToolFormat::DeepSeekV3, "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n{\"city\": \"Pa}ris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
            (ToolFormat::Harmony, "<|channel|>analysis<|message|>Weather, then time.<|end|><|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{\"city\": \"Pa}ris\"}<|start|>assistant to=functions.time<|channel|>commentary json<|message|>{}"),
            (ToolFormat::DeepSeekV31, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>weather<｜tool▁sep｜>{\"days\": [1, {\"a\": 2}]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
            (ToolFormat::Qwen3Coder, "Let me look.\n<tool_call>\n<function=read>\n<parameter=path>\nsrc/a<b>.rs\n</parameter>\n<parameter=lines>\n[1, 2]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=list>\n</function>\n</tool_call>"),
        ];
        for (format, reply) in replies {
            let whole = format.parse(reply, 9);
            let chars: Vec<char> = reply.chars().collect();
            for size in [1, 2, 3, 5, 8, 13, 1000] {
                let mut s = format.stream(9);
                let mut deltas = Vec::new();
                for piece in chars.chunks(size) {
                    deltas.extend(s.push(&piece.iter().collect::<String>()));
                }
                deltas.extend(s.finish());
                let mut text = String::new();
                let mut calls: Vec<ToolCall> = Vec::new();
                for d in deltas {
                    match d {
                        ToolDelta::Text(t) => text.push_str(&t),
                        ToolDelta::Call { index, id, name } => {
                            assert_eq!(index, calls.len());
                            calls.push(ToolCall::new(id, name, ""));
                        }
                        ToolDelta::Arguments { index, fragment } => {
                            calls[index].arguments.push_str(&fragment)
                        }
                    }
                }
                assert_eq!(s.result(), whole, "{format:?} in pieces of {size}");
                match &whole {
                    Some((t, c)) => {
                        assert_eq!((&text, &calls), (t, c), "{format:?} in pieces of {size}")
                    }
                    None => assert_eq!(text, reply, "{format:?} in pieces of {size}"),
                }
            }
        }
    }

    #[test]
    fn formats_are_told_by_the_template_source() {
        assert_eq!(
            ToolFormat::detect("{% if tools %}<tools>{% endif %}<tool_call>"),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(ToolFormat::detect("<tool_call> without the list"), None);
        assert_eq!(
            ToolFormat::detect("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]x[ARGS]"),
            Some(ToolFormat::MistralArgs)
        );
        assert_eq!(
            ToolFormat::detect("{% if tools %}<tool_call>\n<function=x>\n<parameter=y>{% endif %}"),
            Some(ToolFormat::Qwen3Coder)
        );
        assert_eq!(
            ToolFormat::detect("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"),
            Some(ToolFormat::Mistral)
        );
        let deepseek = "{% if tools %}{{ tools }}{% endif %}<｜tool▁call▁begin｜>";
        assert_eq!(
            ToolFormat::detect(&format!("{deepseek}function<｜tool▁sep｜>\n```json\n")),
            Some(ToolFormat::DeepSeekV3)
        );
        assert_eq!(ToolFormat::detect(deepseek), Some(ToolFormat::DeepSeekV31));
        assert_eq!(
            ToolFormat::detect("{% if tools %}<|start|>assistant to=functions.{{ n }}<|channel|>"),
            Some(ToolFormat::Harmony)
        );
    }
}
