//! Workload readers: ShareGPT's truncated JSON array and JSON-lines traces.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;

use pensieve::workload::{
    default_sharegpt_path, read_sharegpt, read_trace, ConversationSpec, TurnSpec,
};
use pensieve::Error;

fn file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

fn record(id: &str, pairs: usize) -> String {
    let msgs: Vec<String> = (0..pairs)
        .flat_map(|i| {
            [
                format!(r#"{{"from": "human", "value": "q{i} of {id}"}}"#),
                format!(r#"{{"from": "gpt", "value": "a{i} of {id}"}}"#),
            ]
        })
        .collect();
    format!(
        r#"{{"id": "{id}", "conversations": [{}]}}"#,
        msgs.join(", ")
    )
}

#[test]
fn sharegpt_keeps_everything_before_a_cut_mid_record() {
    let whole = format!(
        "[\n  {},\n  {},\n  {}\n]",
        record("a", 5),
        record("b", 2),
        record("c", 6)
    );
    let complete = read_sharegpt(file(&whole).path(), 5).unwrap();
    assert!(!complete.truncated);
    assert_eq!(complete.records, 3);
    let ids: Vec<&str> = complete
        .conversations
        .iter()
        .map(|c| c.id.as_str())
        .collect();
    assert_eq!(ids, ["a", "c"]);
    assert_eq!(
        complete.conversations[1].turns[5],
        ("q5 of c".to_string(), "a5 of c".to_string())
    );

    // Cut inside the third record's text: the first two records survive.
    let cut = &whole[..whole.find("q3 of c").unwrap() + 2];
    let truncated = read_sharegpt(file(cut).path(), 1).unwrap();
    assert!(truncated.truncated);
    assert_eq!(truncated.records, 2);
    assert_eq!(truncated.conversations.len(), 2);

    // Cut right after a separator.
    let cut = &whole[..whole.find(&record("c", 6)).unwrap()];
    let truncated = read_sharegpt(file(cut).path(), 1).unwrap();
    assert!(truncated.truncated);
    assert_eq!(truncated.records, 2);
}

#[test]
fn sharegpt_cuts_a_conversation_where_alternation_breaks() {
    let text = r#"[{"id": "x", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "again"}, {"from": "human", "value": "twice"},
        {"from": "gpt", "value": "late"}]},
      {"id": "y", "conversations": [{"from": "gpt", "value": "starts with the bot"},
        {"from": "human", "value": "q"}]},
      {"id": "z", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "a"}]}]"#;
    let found = read_sharegpt(file(text).path(), 1).unwrap();
    assert_eq!(found.records, 3);
    assert_eq!(found.conversations.len(), 1);
    assert_eq!(
        found.conversations[0].turns,
        [("hi".into(), "hello".into())]
    );
}

#[test]
fn sharegpt_rejects_what_is_not_a_dataset() {
    let not_array = read_sharegpt(file(r#"{"id": 1}"#).path(), 1);
    assert!(
        matches!(not_array, Err(Error::InvalidWorkload { .. })),
        "{not_array:?}"
    );
    let bad_record = read_sharegpt(file(r#"[{"id": "a", "conversations": 7}, {}]"#).path(), 1);
    assert!(
        matches!(bad_record, Err(Error::InvalidWorkload { .. })),
        "{bad_record:?}"
    );
    let missing = read_sharegpt(std::path::Path::new("/nonexistent/sharegpt.json"), 1);
    assert!(matches!(missing, Err(Error::Io { .. })), "{missing:?}");
}

#[test]
fn sharegpt_spec_caps_turns_and_output_lengths() {
    let found = read_sharegpt(file(&format!("[{}]", record("a", 6))).path(), 5).unwrap();
    let spec = found.conversations[0]
        .to_spec(4, 3, |reply| Ok(reply.len()))
        .unwrap();
    assert_eq!(spec.turns.len(), 4);
    // "a0 of a" has 7 bytes, capped at 3.
    assert!(spec.turns.iter().all(|t| t.output_tokens == 3));
    assert_eq!(spec.turns[2].user, "q2 of a");
}

#[test]
fn trace_reads_lines_with_and_without_arrivals() {
    let text = r#"{"id": "a", "arrival_s": 1.5, "turns": [{"user": "hi", "output_tokens": 4}]}

{"id": "b", "turns": [{"user": "x", "output_tokens": 1}, {"user": "y", "output_tokens": 2}]}
"#;
    let convs = read_trace(file(text).path()).unwrap();
    assert_eq!(
        convs,
        [
            ConversationSpec {
                id: "a".into(),
                arrival_s: Some(1.5),
                turns: vec![TurnSpec {
                    user: "hi".into(),
                    output_tokens: 4
                }],
            },
            ConversationSpec {
                id: "b".into(),
                arrival_s: None,
                turns: vec![
                    TurnSpec {
                        user: "x".into(),
                        output_tokens: 1
                    },
                    TurnSpec {
                        user: "y".into(),
                        output_tokens: 2
                    }
                ],
            },
        ]
    );
}

#[test]
fn trace_errors_name_the_line() {
    for (bad, why) in [
        (r#"{"id": "a", "turns": []}"#, "no turns"),
        (
            r#"{"id": "a", "turns": [{"user": "", "output_tokens": 1}]}"#,
            "empty user",
        ),
        (
            r#"{"id": "a", "turns": [{"user": "u", "output_tokens": 0}]}"#,
            "at least 1",
        ),
        (
            r#"{"id": "a", "arrival_s": -1, "turns": [{"user": "u", "output_tokens": 1}]}"#,
            "arrival_s",
        ),
        (r#"{"id": "a", "turns": [{"user": "u"}]}"#, "output_tokens"),
    ] {
        let text = format!(
            "{{\"id\": \"ok\", \"turns\": [{{\"user\": \"u\", \"output_tokens\": 1}}]}}\n{bad}\n"
        );
        match read_trace(file(&text).path()) {
            Err(Error::InvalidWorkload { what, reason }) => {
                assert!(what.ends_with(":2"), "{what}");
                assert!(reason.contains(why), "{reason} should mention {why}");
            }
            other => panic!("{bad}: {other:?}"),
        }
    }
}

/// The fetched dataset is cut short at the end; the reader keeps the ~17,000
/// records before the cut, and enough of them have 5+ turns for the replay benchmark.
#[test]
fn fetched_sharegpt_is_read_despite_its_cut() {
    let found = read_sharegpt(&default_sharegpt_path(), 5)
        .expect("the fetched dataset is required (run scripts/fetch-assets --tests)");
    assert!(found.truncated, "the published file ends mid-record");
    assert!(found.records > 10_000, "{} records", found.records);
    assert!(
        found.conversations.len() > 1_000,
        "{} conversations with 5+ turns",
        found.conversations.len()
    );
    assert!(found.conversations.iter().all(|c| c.turns.len() >= 5));
}

#[test]
fn a_written_trace_reads_back_the_same() {
    let convs = vec![
        ConversationSpec {
            id: "a".into(),
            arrival_s: Some(1.5),
            turns: vec![TurnSpec {
                user: "hi \"there\"\nline two".into(),
                output_tokens: 7,
            }],
        },
        ConversationSpec {
            id: "b".into(),
            arrival_s: None,
            turns: vec![
                TurnSpec {
                    user: "one".into(),
                    output_tokens: 1,
                },
                TurnSpec {
                    user: "two".into(),
                    output_tokens: 96,
                },
            ],
        },
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.jsonl");
    pensieve::workload::write_trace(&path, &convs).unwrap();
    assert_eq!(read_trace(&path).unwrap(), convs);
}
