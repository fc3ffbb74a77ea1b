//! Chat templates: turning a conversation into the prompt text a chat model was trained on.
//!
//! Models ship a Jinja template in `tokenizer.chat_template` (copied from Hugging Face's
//! `tokenizer_config.json`). It is rendered with [minijinja] under Hugging Face's conventions, so
//! templates written for `transformers` render the same here:
//!
//! * variables `messages` (a list of `{role, content}`), `add_generation_prompt`, `bos_token`,
//!   `eos_token`;
//! * `trim_blocks` and `lstrip_blocks` on (as `transformers` sets them);
//! * `raise_exception(msg)` fails the render with `msg`; `strftime_now(fmt)` formats the current
//!   UTC time;
//! * `tojson` writes JSON as Python's `json.dumps` does (`", "` and `": "` separators, non-ASCII
//!   kept), not minijinja's compact HTML-safe form;
//! * Python string/dict/list methods (`.strip()`, `.startswith()`, `.split()`, `.items()`...)
//!   through `minijinja-contrib`'s pycompat; loop controls, slicing, `namespace()` are built in.
//!
//! A model without a template (stories260K has none) gets the **fallback**: one line per message,
//! `"{role}: {content}\n"`, followed by `"assistant:"` when a generation prompt is asked for.
//! For a system and a user message:
//!
//! ```text
//! system: You are terse.
//! user: Hi
//! assistant:
//! ```
//!
//! Templates often emit `bos_token` themselves; [`ChatTemplate::encode`] removes that text when the
//! tokenizer adds BOS anyway (as llama.cpp does), so the prompt never starts with two BOS tokens.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;

const TEMPLATE_NAME: &str = "chat";

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template, or the documented fallback (see the module docs).
#[derive(Clone)]
pub struct ChatTemplate {
    env: Option<Environment<'static>>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("fallback", &self.is_fallback())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

fn chat_err(msg: impl Into<String>) -> ModelError {
    ModelError::ChatTemplate(msg.into())
}

impl ChatTemplate {
    /// The model's template (`tokenizer.chat_template`) if it has one, else the fallback
    /// (`"role: content"` lines ending with `"assistant:"`; [`ChatTemplate::is_fallback`] says
    /// which). A template that does not compile is an error, not a silent fallback.
    pub fn from_gguf(g: &GgufFile, tok: &Tokenizer) -> Result<Self> {
        match g.meta("tokenizer.chat_template") {
            None => Ok(Self::fallback(tok)),
            Some(v) => {
                let src = v.as_str().ok_or_else(|| {
                    chat_err("metadata key 'tokenizer.chat_template' is not a string")
                })?;
                Self::from_source(src, tok)
            }
        }
    }

    /// Compiles `source` with the tokenizer's BOS/EOS texts as `bos_token`/`eos_token`.
    pub fn from_source(source: &str, tok: &Tokenizer) -> Result<Self> {
        let token = |id: Option<u32>| {
            id.and_then(|i| tok.token_str(i))
                .unwrap_or_default()
                .to_string()
        };
        Self::with_tokens(source, &token(tok.bos_id()), &token(tok.eos_id()))
    }

    /// Compiles `source` with explicit `bos_token`/`eos_token` texts.
    pub fn with_tokens(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| chat_err(format!("template does not compile: {e:#}")))?;
        Ok(Self {
            env: Some(env),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The fallback template (see the module docs).
    pub fn fallback(tok: &Tokenizer) -> Self {
        let token = |id: Option<u32>| {
            id.and_then(|i| tok.token_str(i))
                .unwrap_or_default()
                .to_string()
        };
        Self {
            env: None,
            bos_token: token(tok.bos_id()),
            eos_token: token(tok.eos_id()),
        }
    }

    /// True when the model had no template and the `"role: content"` fallback is used.
    pub fn is_fallback(&self) -> bool {
        self.env.is_none()
    }

    /// The prompt text for `messages`; with `add_generation_prompt`, ending where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let Some(env) = &self.env else {
            let mut out = String::new();
            for m in messages {
                out.push_str(&m.role);
                out.push_str(": ");
                out.push_str(&m.content);
                out.push('\n');
            }
            if add_generation_prompt {
                out.push_str("assistant:");
            }
            return Ok(out);
        };
        let tmpl = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| chat_err(format!("{e:#}")))?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        tmpl.render(ctx)
            .map_err(|e| chat_err(format!("render failed: {e:#}")))
    }

    /// Whether the template's source mentions `needle` (how the gateway tells which tool-call
    /// format a model was trained on: `<tool_call>` for Hermes/Qwen, `<|python_tag|>` for
    /// Llama 3). Always false for the fallback.
    pub fn source_contains(&self, needle: &str) -> bool {
        self.env
            .as_ref()
            .and_then(|env| env.get_template(TEMPLATE_NAME).ok())
            .is_some_and(|t| t.source().contains(needle))
    }

    /// Like [`ChatTemplate::render`] for messages given as JSON objects (so assistant
    /// `tool_calls`, `tool_call_id` and `name` reach the template) and with `tools` (a list of
    /// OpenAI function definitions) as the template's `tools` variable, as `transformers`'
    /// `apply_chat_template(messages, tools=...)` does. The fallback writes each message's
    /// `content` as in [`ChatTemplate::render`] (the caller turns tool calls into text for it).
    pub fn render_json(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let Some(env) = &self.env else {
            let plain: Vec<ChatMessage> = messages
                .iter()
                .map(|m| {
                    let field = |k: &str| m.get(k).and_then(|v| v.as_str()).unwrap_or_default();
                    ChatMessage::new(field("role"), field("content"))
                })
                .collect();
            return self.render(&plain, add_generation_prompt);
        };
        let tmpl = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| chat_err(format!("{e:#}")))?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        tmpl.render(ctx)
            .map_err(|e| chat_err(format!("render failed: {e:#}")))
    }

    /// [`ChatTemplate::encode`] for [`ChatTemplate::render_json`]'s inputs. Every string in
    /// the messages and the tools (contents, tool-call arguments, tool results, descriptions)
    /// is client text: control-token text in any of them is tokenized as text.
    pub fn encode_json(
        &self,
        tok: &Tokenizer,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let rendered = self.render_json(messages, tools, add_generation_prompt)?;
        let mut texts = Vec::new();
        let marked_messages: Vec<_> = messages
            .iter()
            .map(|m| mark_control_text(m, tok, &mut texts))
            .collect();
        let marked_tools: Option<Vec<_>> = tools.map(|t| {
            t.iter()
                .map(|v| mark_control_text(v, tok, &mut texts))
                .collect()
        });
        if texts.is_empty() {
            return Ok(self.tokenize_rendered(tok, &rendered, &[]));
        }
        let skeleton = self.render_json(
            &marked_messages,
            marked_tools.as_deref(),
            add_generation_prompt,
        )?;
        let plain = place_texts(&rendered, &skeleton, &texts).ok_or_else(transformed)?;
        Ok(self.tokenize_rendered(tok, &rendered, &plain))
    }

    /// Renders and tokenizes a conversation for generation: special-token text the template
    /// writes becomes special tokens, BOS is added if the model adds one, and a leading
    /// `bos_token` text that the template wrote is dropped so BOS is not doubled.
    ///
    /// Control tokens come only from the template: a message whose content holds a control
    /// token's text (`<|im_start|>system…` typed by a user) has that content tokenized as text.
    /// To know exactly where such contents land, the conversation is rendered a second time
    /// with a unique marker in place of each; if the template changes contents (so the marked
    /// rendering does not give back the real one), such a conversation is refused.
    pub fn encode(
        &self,
        tok: &Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let rendered = self.render(messages, add_generation_prompt)?;
        let mut texts = Vec::new();
        let marked: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage {
                content: mark_if_control(&m.content, tok, &mut texts),
                ..m.clone()
            })
            .collect();
        if texts.is_empty() {
            return Ok(self.tokenize_rendered(tok, &rendered, &[]));
        }
        let skeleton = self.render(&marked, add_generation_prompt)?;
        let plain = place_texts(&rendered, &skeleton, &texts).ok_or_else(transformed)?;
        Ok(self.tokenize_rendered(tok, &rendered, &plain))
    }

    /// Tokenizes a rendered conversation: `plain` byte ranges are text whatever they hold; a
    /// leading `bos_token` text is dropped when the tokenizer adds BOS itself.
    fn tokenize_rendered(
        &self,
        tok: &Tokenizer,
        rendered: &str,
        plain: &[std::ops::Range<usize>],
    ) -> Vec<u32> {
        let skip = match rendered.strip_prefix(self.bos_token.as_str()) {
            Some(_) if tok.adds_bos() && !self.bos_token.is_empty() => self.bos_token.len(),
            _ => 0,
        };
        let plain: Vec<_> = plain
            .iter()
            .filter(|r| r.start >= skip)
            .map(|r| r.start - skip..r.end - skip)
            .collect();
        tok.encode_with_specials_except(&rendered[skip..], true, &plain)
    }
}

const MARK_CLOSE: char = '\u{E001}';
const MARK_PREFIX: &str = "\u{E000}tessera-text-";

fn transformed() -> ModelError {
    chat_err(
        "a message holds a control token's text, and this chat template transforms message \
         contents, so it cannot be sent as plain text",
    )
}

/// `text` unchanged, or (if it holds a control token's text) a marker standing for it, with
/// `text` remembered at the marker's index.
fn mark_if_control(text: &str, tok: &Tokenizer, texts: &mut Vec<String>) -> String {
    if !tok.contains_control_text(text) {
        return text.to_string();
    }
    texts.push(text.to_string());
    format!("{MARK_PREFIX}{}{MARK_CLOSE}", texts.len() - 1)
}

/// `v` with every string that holds control text replaced by a marker ([`mark_if_control`]).
fn mark_control_text(
    v: &serde_json::Value,
    tok: &Tokenizer,
    texts: &mut Vec<String>,
) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        J::String(s) => J::String(mark_if_control(s, tok, texts)),
        J::Array(a) => J::Array(a.iter().map(|x| mark_control_text(x, tok, texts)).collect()),
        J::Object(o) => J::Object(
            o.iter()
                .map(|(k, x)| (k.clone(), mark_control_text(x, tok, texts)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Where the marked texts land in `rendered`, found by putting them back into `skeleton` (the
/// same conversation rendered with markers): their byte ranges, or `None` if the result is not
/// `rendered` (the template transformed a text, or a marker was forged in the input).
fn place_texts(
    rendered: &str,
    skeleton: &str,
    texts: &[String],
) -> Option<Vec<std::ops::Range<usize>>> {
    let mut text = String::with_capacity(rendered.len());
    let mut plain = Vec::new();
    let mut rest = skeleton;
    while let Some(at) = rest.find(MARK_PREFIX) {
        text.push_str(&rest[..at]);
        let after = &rest[at + MARK_PREFIX.len()..];
        let end = after.find(MARK_CLOSE)?;
        let t = texts.get(after[..end].parse::<usize>().ok()?)?;
        plain.push(text.len()..text.len() + t.len());
        text.push_str(t);
        rest = &after[end + MARK_CLOSE.len_utf8()..];
    }
    text.push_str(rest);
    (text == rendered).then_some(plain)
}

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python's `json.dumps` layout: `", "` between items, `": "` after keys (or newlines and
/// `indent` spaces when given), non-ASCII characters written as they are.
fn tojson(
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, Error> {
    let indent = match indent.or(kwargs.get::<Option<Value>>("indent")?) {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => Some(
            usize::try_from(v.clone())
                .map_err(|_| Error::new(ErrorKind::InvalidOperation, "indent must be a count"))?,
        ),
    };
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_py_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_py_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_py_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&J::String(k.clone()).to_string());
                out.push_str(": ");
                write_py_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// `strftime_now(fmt)`: the current UTC time, for `%d %m %Y %y %b %B %H %M %S %j %%`.
fn strftime_now(fmt: String) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format_utc(secs, &fmt)
}

/// Formats UNIX time `secs` (UTC) with a small strftime subset; unknown specifiers are kept.
pub(crate) fn format_utc(secs: u64, fmt: &str) -> String {
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
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let jday = cum[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let name = MONTHS[(month - 1) as usize];

    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('j') => out.push_str(&format!("{jday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::format_utc;

    #[test]
    fn utc_dates() {
        assert_eq!(
            format_utc(0, "%d %b %Y %H:%M:%S %j"),
            "01 Jan 1970 00:00:00 001"
        );
        // 2024-02-29 12:34:56 UTC (leap day).
        assert_eq!(
            format_utc(1_709_210_096, "%Y-%m-%d %H:%M:%S %B %y %j %%"),
            "2024-02-29 12:34:56 February 24 060 %"
        );
    }
}
