//! Chat templates: the Jinja programs that Hugging Face models ship to turn a conversation
//! into the exact text the model was trained on.
//!
//! Rendering follows transformers' `apply_chat_template`: `trim_blocks` and `lstrip_blocks`
//! on, the variables `messages`, `add_generation_prompt`, `bos_token` and `eos_token`, the
//! `raise_exception(msg)` and `strftime_now(fmt)` functions, a `tojson` filter that writes what
//! Python's `json.dumps(..., ensure_ascii=False)` writes, and Python's string methods
//! (`.strip()`, `.startswith()`, `.split()`, ...) that templates call.

use super::DataError;
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, syntax::SyntaxConfig};
use std::collections::BTreeMap;
use std::fmt::Write;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Renders `messages` with the chat `template` as transformers would. A template that does not
/// parse, or fails while rendering (including its own `raise_exception`), is an error that
/// gives the template's line.
pub fn render_chat(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, DataError> {
    let env = environment().map_err(template_error)?;
    let tmpl = env.template_from_str(template).map_err(template_error)?;
    let messages: Vec<Value> = messages
        .iter()
        .map(|m| {
            let mut map = BTreeMap::new();
            map.insert("role".to_string(), Value::from(m.role.as_str()));
            map.insert("content".to_string(), Value::from(m.content.as_str()));
            Value::from(map)
        })
        .collect();
    let mut ctx = BTreeMap::new();
    ctx.insert("messages".to_string(), Value::from(messages));
    ctx.insert(
        "add_generation_prompt".to_string(),
        Value::from(add_generation_prompt),
    );
    ctx.insert("bos_token".to_string(), Value::from(bos_token));
    ctx.insert("eos_token".to_string(), Value::from(eos_token));
    tmpl.render(Value::from(ctx)).map_err(template_error)
}

fn environment() -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    Ok(env)
}

fn template_error(e: Error) -> DataError {
    let mut reason = e.kind().to_string();
    if let Some(detail) = e.detail() {
        let _ = write!(reason, ": {detail}");
    }
    DataError::ChatTemplate {
        line: e.line(),
        reason,
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
fn tojson(value: &Value, indent: Option<usize>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<usize>>("indent")?,
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    // transformers' filter accepts these; neither changes kiln's output (non-ASCII is kept,
    // and separators follow the indent as in Python).
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, sort_keys, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    v: &Value,
    indent: Option<usize>,
    sort_keys: bool,
    level: usize,
) -> Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64().filter(|_| v.is_integer()) {
                let _ = write!(out, "{i}");
            } else {
                let f = f64::try_from(v.clone())?;
                if f.is_finite() {
                    let _ = write!(out, "{f:?}");
                } else {
                    out.push_str(if f.is_nan() {
                        "NaN"
                    } else if f > 0.0 {
                        "Infinity"
                    } else {
                        "-Infinity"
                    });
                }
            }
        }
        ValueKind::String => write_json_string(out, v.as_str().unwrap_or_default()),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write_json_string(out, &k.to_string());
                out.push_str(": ");
                write_json(out, &v.get_item(k)?, indent, sort_keys, level + 1)?;
            }
            newline(out, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                write_json(out, item, indent, sort_keys, level + 1)?;
            }
            newline(out, level);
            out.push(']');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson cannot write a value of kind {}", v.kind()),
            ));
        }
    }
    Ok(())
}

fn write_json_string(out: &mut String, s: &str) {
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
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The current UTC time formatted like Python's `strftime` (the directives chat templates
/// use for "Today's date": %Y %m %d %H %M %S %B %b %A %a %j %y %%).
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(&format, secs).map(Value::from)
}

fn strftime(format: &str, unix_secs: i64) -> Result<String, Error> {
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
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday.
    let weekday = (days + 4).rem_euclid(7) as usize;
    let year_day = days - days_from_civil(year, 1, 1) + 1;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('H') => write!(out, "{:02}", secs / 3600),
            Some('M') => write!(out, "{:02}", secs / 60 % 60),
            Some('S') => write!(out, "{:02}", secs % 60),
            Some('j') => write!(out, "{year_day:03}"),
            Some('B') => write!(out, "{}", MONTHS[month as usize - 1]),
            Some('b') => write!(out, "{}", &MONTHS[month as usize - 1][..3]),
            Some('A') => write!(out, "{}", DAYS[weekday]),
            Some('a') => write!(out, "{}", &DAYS[weekday][..3]),
            Some('%') => write!(out, "%"),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now does not know the directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ));
            }
        };
    }
    Ok(out)
}

/// Year, month and day of the day `days` after 1970-01-01 (proleptic Gregorian calendar).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-Instruct's template, as in its tokenizer_config.json and GGUF metadata.
    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn the_smollm2_template_renders_chatml_as_transformers_does() {
        let msgs = [ChatMessage::new("user", "What is the capital of France?")];
        let text =
            render_chat(SMOLLM2_TEMPLATE, &msgs, true, "<|im_start|>", "<|im_end|>").unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        );
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello."),
        ];
        let text = render_chat(SMOLLM2_TEMPLATE, &msgs, false, "", "").unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello.<|im_end|>\n"
        );
    }

    #[test]
    fn blocks_are_trimmed_and_python_methods_and_tojson_work() {
        // trim_blocks drops the newline after a tag; lstrip_blocks the indentation before one.
        let t = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content.strip().upper() }}]{{ m.content|tojson }}\n  {% endif %}\n{% endfor %}\n{{ bos_token }}";
        let msgs = [
            ChatMessage::new("user", " a\"b\nc é<tag> "),
            ChatMessage::new("system", "x"),
        ];
        let text = render_chat(t, &msgs, false, "<s>", "</s>").unwrap();
        assert_eq!(text, "[A\"B\nC É<TAG>]\" a\\\"b\\nc é<tag> \"\n<s>");
        let t = "{{ {'b': [1, 2.5, none, true], 'a': 'x'}|tojson(sort_keys=true) }}|{{ [1]|tojson(indent=2) }}";
        assert_eq!(
            render_chat(t, &[], false, "", "").unwrap(),
            "{\"a\": \"x\", \"b\": [1, 2.5, null, true]}|[\n  1\n]"
        );
    }

    #[test]
    fn template_errors_name_the_line() {
        let broken = "{% for m in messages %}\n{{ m.content }}\n{% endfo %}";
        let e = render_chat(broken, &[], false, "", "")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 3"), "{e}");
        let raising = "line one\n{% if messages|length == 0 %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}";
        let e = render_chat(raising, &[], false, "", "")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 2") && e.contains("Conversation roles must alternate"),
            "{e}"
        );
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(
            strftime("%d %B %Y, %a %b %j %H:%M:%S %y %%", t).unwrap(),
            "26 July 2024, Fri Jul 208 13:05:09 24 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0).unwrap(), "1970-01-01");
        assert!(strftime("%Q", 0).is_err());
    }
}
