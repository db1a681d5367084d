//! The Jinja dialect of Hugging Face chat templates on minijinja: what transformers gives
//! templates beyond Jinja (`raise_exception`, `strftime_now`, its `tojson` with Python's
//! formatting and keyword arguments, the `{% generation %}` block that marks assistant text
//! for training), loop controls, and Python's string and list methods (minijinja-contrib's
//! `pycompat`). Real models' templates are checked against it in `tests/real_templates.rs`.
//!
//! One difference is kept on purpose for now: `tojson` without `separators` writes compact
//! JSON, as pensieve always has, where transformers writes `{"a": 1}`. With Python's spacing
//! the tools list changes, and on SmolLM2 with `chatml-tools` a forced call's turn was then
//! fed again on the next request instead of read from the cache (`tests/server_ops.rs`);
//! why is not yet understood.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};

/// An environment with the dialect's functions, filters and formatter.
pub(super) fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    // A value that is none writes nothing (not minijinja's `none`), as a template that
    // writes an absent thought or name expects.
    env.set_formatter(|out, state, value| match value.is_none() {
        true => Ok(()),
        false => minijinja::escape_formatter(out, state, value),
    });
    env
}

/// `source` without transformers' `{% generation %}` / `{% endgeneration %}` tags, which
/// mark the assistant's text for training masks and render their body as it is.
pub(super) fn without_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        let Some(end) = rest[at..].find("%}") else {
            break;
        };
        let tag = &rest[at + 2..at + end];
        let word = tag.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        out.push_str(&rest[..at]);
        if word != "generation" && word != "endgeneration" {
            out.push_str(&rest[at..at + end + 2]);
        }
        rest = &rest[at + end + 2..];
    }
    out.push_str(rest);
    out
}

/// transformers' `tojson` keyword arguments (`indent`, `separators`, `sort_keys`,
/// `ensure_ascii`, false unless asked) with Python's formatting under them, no HTML escaping,
/// and a call's arguments written back as the model wrote them. Without `separators` the JSON
/// is compact (minijinja's), where Python's `json.dumps` spaces it.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    // A call's arguments as the model wrote them, unless another form is asked for.
    let plain = indent.is_none() && separators.is_none() && !ascii.unwrap_or(false);
    if let (true, Some(a)) = (plain, value.downcast_object_ref::<super::view::Arguments>())
        && !sort.unwrap_or(false)
    {
        return Ok(Value::from_safe_string(a.text.clone()));
    }
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ))
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        // Compact, as minijinja's own `tojson` writes (Python's default puts a space after
        // each separator; see the module's note).
        None => (",".into(), ":".into()),
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let style = Style {
        indent,
        item,
        key,
        ascii: ascii.unwrap_or(false),
        sort: sort.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

struct Style {
    indent: Option<usize>,
    item: String,
    key: String,
    ascii: bool,
    sort: bool,
}

impl Style {
    fn write(&self, v: &serde_json::Value, depth: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, x) in items.iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.write(x, depth + 1, out);
                }
                self.close(depth, out);
                out.push(']');
            }
            J::Object(map) if !map.is_empty() => {
                let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
                if self.sort {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(x, depth + 1, out);
                }
                self.close(depth, out);
                out.push('}');
            }
            J::String(s) => self.string(s, out),
            other => out.push_str(&other.to_string()),
        }
    }

    /// Before item `i` of a container at `depth`.
    fn separate(&self, i: usize, depth: usize, out: &mut String) {
        if i > 0 {
            out.push_str(&self.item);
        }
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    }

    fn close(&self, depth: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// transformers' `strftime_now`: the current UTC time in a `strftime` format (`%Y`, `%m`,
/// `%d`, `%b`, `%B`, `%H`, `%M`, `%S`, `%y`, `%%`).
fn strftime_now(format: String) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(&format, secs)
}

fn strftime(format: &str, secs: u64) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let (year, month, day) = civil_date(secs / 86_400);
    let of_day = secs % 86_400;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let name = MONTHS[(month - 1) as usize];
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('B') => out.push_str(name),
            Some('b') => out.push_str(&name[..3]),
            Some('H') => out.push_str(&format!("{:02}", of_day / 3600)),
            Some('M') => out.push_str(&format!("{:02}", of_day / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", of_day % 60)),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: the directive %{} is not supported",
                        other.unwrap_or(' ')
                    ),
                ))
            }
        }
    }
    Ok(out)
}

/// The (year, month, day) of `days` since 1970-01-01 (the proleptic Gregorian calendar).
fn civil_date(days: u64) -> (i64, u32, u32) {
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: serde_json::Value) -> String {
        let mut env = environment();
        env.add_template_owned("t", without_generation_tags(source))
            .unwrap();
        env.get_template("t").unwrap().render(ctx).unwrap()
    }

    #[test]
    fn tojson_takes_python_s_keyword_arguments() {
        let ctx = serde_json::json!({"x": {"b": [1, 2.5, "é<&>"], "a": null, "c": {}}});
        assert_eq!(
            render("{{ x | tojson }}", ctx.clone()),
            r#"{"a":null,"b":[1,2.5,"é<&>"],"c":{}}"#
        );
        assert_eq!(
            render("{{ x | tojson(separators=[', ', ': ']) }}", ctx.clone()),
            r#"{"a": null, "b": [1, 2.5, "é<&>"], "c": {}}"#
        );
        assert_eq!(
            render(
                "{{ x.b | tojson(indent=2, ensure_ascii=True) }}",
                ctx.clone()
            ),
            "[\n  1,\n  2.5,\n  \"\\u00e9<&>\"\n]"
        );
        assert_eq!(
            render("{{ x.b | tojson(separators=[',', ':']) }}", ctx),
            r#"[1,2.5,"é<&>"]"#
        );
    }

    #[test]
    fn loop_controls_generation_tags_and_dates_render() {
        let source = "{% for i in [1, 2, 3] %}{% if i == 3 %}{% break %}{% endif %}\
            {%- generation %}{{ i }}{% endgeneration -%}{% endfor %}";
        assert_eq!(render(source, serde_json::json!({})), "12");
        assert_eq!(
            strftime("%Y-%m-%d %d %b %Y %H:%M:%S", 951_827_696).unwrap(),
            "2000-02-29 29 Feb 2000 12:34:56"
        );
        assert!(strftime("%Q", 0).is_err());
    }
}
