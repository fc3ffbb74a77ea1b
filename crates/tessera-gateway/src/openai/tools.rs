//! Tools (function calling): the definitions a request carries, how they reach the prompt, the
//! grammar that forces a call, and how calls are read back out of the generated text.
//!
//! Two wire formats, chosen from the model's chat template:
//!
//! * **Hermes** (Qwen2/Qwen3, Hermes, and the fallback template): each call is
//!   `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, several in a row when calls
//!   run in parallel.
//! * **Llama 3** (a template mentioning `<|python_tag|>`): one JSON object
//!   `{"name": …, "parameters": {…}}` as the whole reply.
//!
//! A template that renders `tools` itself gets them as its `tools` variable; otherwise a system
//! message lists them (Hermes style) and tool calls and results in the history are written as
//! text in the same format, so a model without tool training still sees the protocol.
//!
//! With `tool_choice` `required` or a named tool, [`tool_grammar`] builds a lark grammar whose
//! calls embed each tool's JSON schema, so even a random-weight model answers with a call that
//! parses and validates.

use serde_json::{json, Value};

use crate::grammar::GrammarSpec;
use tessera_model::ChatTemplate;

use super::ApiError;

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments (`{"type": "object"}` when the request gave none).
    pub parameters: Value,
}

impl Tool {
    /// The OpenAI definition, as chat templates expect it in `tools`.
    pub fn definition(&self) -> Value {
        let mut f = json!({"name": self.name, "parameters": self.parameters});
        if let Some(d) = &self.description {
            f["description"] = d.clone().into();
        }
        json!({"type": "function", "function": f})
    }
}

/// OpenAI's `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A call the model made.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI sends them as a string).
    pub arguments: String,
}

/// How tool calls are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3,
}

impl ToolFormat {
    /// The format the template was trained with (Hermes unless it is Llama 3's).
    pub fn of(template: &ChatTemplate) -> Self {
        if template.source_contains("<|python_tag|>") {
            Self::Llama3
        } else {
            Self::Hermes
        }
    }

    /// One call as the model would write it.
    pub fn write(self, call: &ToolCall) -> String {
        let args: Value = serde_json::from_str(&call.arguments).unwrap_or(Value::Null);
        match self {
            Self::Hermes => format!(
                "<tool_call>\n{}\n</tool_call>",
                json!({"name": call.name, "arguments": args})
            ),
            Self::Llama3 => json!({"name": call.name, "parameters": args}).to_string(),
        }
    }
}

/// Parses `tools` (only `type: function`).
pub fn parse_tools(v: &Value) -> Result<Vec<Tool>, ApiError> {
    let bad = |i: usize, what: &str| {
        ApiError::invalid(
            format!("Invalid 'tools[{i}]': {what}."),
            Some(&format!("tools[{i}]")),
        )
    };
    let Value::Array(items) = v else {
        return Err(ApiError::invalid(
            "Invalid type for 'tools': expected an array of tools.",
            Some("tools"),
        ));
    };
    crate::limits::check_tool_count(items.len())?;
    let mut tools = Vec::with_capacity(items.len());
    let mut names = std::collections::HashSet::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return Err(bad(
                    i,
                    &format!("tools of type '{other}' are not supported (only 'function')"),
                ))
            }
            None => return Err(bad(i, "missing 'type'")),
        }
        let f = t
            .get("function")
            .ok_or_else(|| bad(i, "missing 'function'"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| bad(i, "missing 'function.name'"))?;
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => return Err(bad(i, "'function.parameters' must be a JSON schema object")),
        };
        if !names.insert(name) {
            return Err(bad(i, &format!("the name '{name}' is used twice")));
        }
        tools.push(Tool {
            name: name.to_string(),
            description: f
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_string),
            parameters,
        });
    }
    Ok(tools)
}

/// Parses `tool_choice` against the tools given.
pub fn parse_tool_choice(v: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some("tool_choice"));
    let choice = match v {
        None | Some(Value::Null) if tools.is_empty() => ToolChoice::None,
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(format!(
                    "Invalid value for 'tool_choice': '{other}' (expected 'none', 'auto', \
                     'required' or a named function)."
                )))
            }
        },
        Some(o @ Value::Object(_)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| bad("Invalid 'tool_choice': expected {\"type\": \"function\", \"function\": {\"name\": …}}.".into()))?;
            ToolChoice::Named(name.to_string())
        }
        Some(_) => return Err(bad("Invalid type for 'tool_choice'.".into())),
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Auto if tools.is_empty() => Err(bad(
            "'tool_choice' is only allowed when 'tools' are specified.".into(),
        )),
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(bad(format!(
            "Invalid 'tool_choice': no tool named '{n}' in 'tools'."
        ))),
        _ => Ok(choice),
    }
}

/// The system text that describes the tools to a template that does not render them itself.
pub fn tools_system_text(tools: &[Tool]) -> String {
    let mut s = String::from(
        "You may call one or more functions to assist with the user query. The functions are \
         listed within <tools></tools>:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.definition().to_string());
    }
    s.push_str(
        "\n</tools>\nFor each function call, return a JSON object with the function name and \
         arguments within <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": \
         <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// The tools in few tokens, for the fallback template (a model with no chat training, whose
/// context may be short): each as `name(argument, …)` and the call syntax.
pub fn compact_tools_text(tools: &[Tool]) -> String {
    let sigs: Vec<String> = tools
        .iter()
        .map(|t| {
            let args: Vec<&str> = t.parameters["properties"]
                .as_object()
                .map(|p| p.keys().map(String::as_str).collect())
                .unwrap_or_default();
            format!("{}({})", t.name, args.join(", "))
        })
        .collect();
    format!(
        "tools: {}; call as <tool_call>{{\"name\": …, \"arguments\": {{…}}}}</tool_call>",
        sigs.join(", ")
    )
}

/// The JSON schema of one call to `tool` in `format`.
fn call_schema(parameters: Value, name: &str, format: ToolFormat) -> Value {
    let args = match format {
        ToolFormat::Hermes => "arguments",
        ToolFormat::Llama3 => "parameters",
    };
    json!({
        "type": "object",
        "properties": {"name": {"const": name}, args: parameters},
        "required": ["name", args],
        "additionalProperties": false,
    })
}

/// The schema `%json` embeds: one call, or any of several, laid out compactly.
///
/// A tool's parameters are nested inside the call object, but their local references
/// (`#/$defs/…`, `#/definitions/…`, as Pydantic writes them) point at the parameters' own
/// root; so their definitions move up to the root of the call schema, where those references
/// look. Tools that define the same name keep the first tool's definition.
fn calls_schema(allowed: &[&Tool], format: ToolFormat) -> Value {
    let mut hoisted: [(&str, serde_json::Map<String, Value>); 2] = [
        ("$defs", serde_json::Map::new()),
        ("definitions", serde_json::Map::new()),
    ];
    let mut calls: Vec<Value> = allowed
        .iter()
        .map(|t| {
            let mut parameters = t.parameters.clone();
            if let Value::Object(p) = &mut parameters {
                for (key, defs) in hoisted.iter_mut() {
                    if let Some(Value::Object(d)) = p.remove(*key) {
                        for (name, def) in d {
                            defs.entry(name).or_insert(def);
                        }
                    }
                }
            }
            call_schema(parameters, &t.name, format)
        })
        .collect();
    let mut schema = if calls.len() == 1 {
        calls.remove(0)
    } else {
        json!({ "anyOf": calls })
    };
    for (key, defs) in hoisted {
        if !defs.is_empty() {
            schema[key] = Value::Object(defs);
        }
    }
    crate::grammar::compact(&schema)
}

/// The grammar that forces a call (`required`: to any of `tools`; `Named`: to that one), one
/// call or several when `parallel`. `None` for `auto` and `none`.
pub fn tool_grammar(
    tools: &[Tool],
    choice: &ToolChoice,
    parallel: bool,
    format: ToolFormat,
) -> Option<GrammarSpec> {
    let allowed: Vec<&Tool> = match choice {
        ToolChoice::None | ToolChoice::Auto => return None,
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Named(n) => tools.iter().filter(|t| &t.name == n).collect(),
    };
    let schema = calls_schema(&allowed, format);
    let lark = match format {
        ToolFormat::Hermes => {
            // At most one call per allowed tool (a named tool: one), so a model that never
            // stops calling still ends: `call ("\n" call ("\n" call)?)?`.
            let calls = if parallel {
                allowed.len().clamp(1, 4)
            } else {
                1
            };
            let mut rule = String::from("call");
            for _ in 1..calls {
                rule = format!("call (\"\\n\" {rule})?");
            }
            format!(
                "start: {rule}\ncall: \"<tool_call>\\n\" body \"\\n</tool_call>\"\nbody: %json {schema}\n"
            )
        }
        ToolFormat::Llama3 => format!("start: %json {schema}\n"),
    };
    Some(GrammarSpec::Lark(lark))
}

/// What the parser lets out as text arrives.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolEvent {
    /// Ordinary reply text.
    Content(String),
    /// A complete call.
    Call(ToolCall),
}

/// Reads calls out of streamed text: text before the first call streams as content; a call is
/// let out when it closes; a possible call opening is held back until it is clear.
#[derive(Debug)]
pub struct ToolCallParser {
    format: ToolFormat,
    names: Vec<String>,
    buf: String,
    /// Seen a call opening (Hermes) or a reply that starts as JSON (Llama 3): all further text
    /// is held for parsing.
    in_calls: bool,
    /// Any non-whitespace content let out.
    said_something: bool,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

impl ToolCallParser {
    pub fn new(format: ToolFormat, tools: &[Tool]) -> Self {
        Self {
            format,
            names: tools.iter().map(|t| t.name.clone()).collect(),
            buf: String::new(),
            in_calls: false,
            said_something: false,
        }
    }

    /// Feeds generated text.
    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        match self.format {
            ToolFormat::Hermes => self.drain_hermes(&mut out),
            ToolFormat::Llama3 => {
                if !self.in_calls && !self.said_something {
                    let t = self.buf.trim_start();
                    if t.starts_with('{') {
                        self.in_calls = true;
                    } else if !t.is_empty() {
                        self.said_something = true;
                    }
                }
                if !self.in_calls && self.said_something {
                    out.push(ToolEvent::Content(std::mem::take(&mut self.buf)));
                }
            }
        }
        out.retain(|e| !matches!(e, ToolEvent::Content(c) if c.is_empty()));
        out
    }

    fn drain_hermes(&mut self, out: &mut Vec<ToolEvent>) {
        loop {
            if let Some(at) = self.buf.find(OPEN) {
                let before: String = self.buf.drain(..at).collect();
                self.content(before, out);
                self.in_calls = true;
                let Some(end) = self.buf.find(CLOSE) else {
                    return;
                };
                let block: String = self.buf.drain(..end + CLOSE.len()).collect();
                let inner = &block[OPEN.len()..block.len() - CLOSE.len()];
                match self.parse_call(inner) {
                    Some(call) => out.push(ToolEvent::Call(call)),
                    None => self.content(block, out),
                }
                continue;
            }
            // No opening in the buffer: let out all but a tail that may begin one.
            let hold = (1..OPEN.len())
                .rev()
                .find(|&k| self.buf.ends_with(&OPEN[..k]))
                .unwrap_or(0);
            let cut = self.buf.len() - hold;
            let text: String = self.buf.drain(..cut).collect();
            self.content(text, out);
            return;
        }
    }

    fn content(&mut self, text: String, out: &mut Vec<ToolEvent>) {
        // Whitespace between calls is not content.
        if self.in_calls && text.trim().is_empty() {
            return;
        }
        if !text.trim().is_empty() {
            self.said_something = true;
        }
        out.push(ToolEvent::Content(text));
    }

    /// One call's JSON (`{"name", "arguments"|"parameters"}`), if it names a known tool.
    fn parse_call(&self, text: &str) -> Option<ToolCall> {
        let v: Value = serde_json::from_str(text.trim()).ok()?;
        let name = v.get("name")?.as_str()?;
        if !self.names.iter().any(|n| n == name) {
            return None;
        }
        let args = v
            .get("arguments")
            .or_else(|| v.get("parameters"))
            .cloned()
            .unwrap_or_else(|| json!({}));
        let arguments = match args {
            Value::String(s) => s,
            other => other.to_string(),
        };
        Some(ToolCall {
            name: name.to_string(),
            arguments,
        })
    }

    /// End of the reply: whatever is held, as calls if it parses. A call cut short (by
    /// `max_tokens`) is still a call, its arguments as far as they got, when its tool's name
    /// is complete, and is dropped otherwise: call syntax is never let out as content.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let rest = std::mem::take(&mut self.buf);
        let mut out = Vec::new();
        if rest.is_empty() {
            return out;
        }
        if self.format == ToolFormat::Llama3 && self.in_calls {
            // One object, or several separated by `;` or newlines; the last may be cut.
            let parts: Vec<&str> = rest
                .split([';', '\n'])
                .filter(|p| !p.trim().is_empty())
                .collect();
            for (i, p) in parts.iter().enumerate() {
                match self.parse_call(p) {
                    Some(c) => out.push(ToolEvent::Call(c)),
                    None if i + 1 == parts.len() => {
                        out.extend(self.cut_call(p).map(ToolEvent::Call))
                    }
                    // Not a call after all: the reply is text.
                    None => return vec![ToolEvent::Content(rest)],
                }
            }
            return out;
        }
        if self.format == ToolFormat::Hermes {
            if let Some(inner) = rest.trim_start().strip_prefix(OPEN) {
                out.extend(self.cut_call(inner).map(ToolEvent::Call));
                return out;
            }
            // A held tail that can only be the start of a call opening.
            if rest.len() >= 2 && OPEN.starts_with(rest.as_str()) {
                return out;
            }
        }
        out.push(ToolEvent::Content(rest));
        out
    }

    /// A call whose text ends early (`{"name": "f", "arguments": {"city": "Pa`): the call with
    /// its arguments as far as they got (not valid JSON), if the name is complete and known.
    fn cut_call(&self, text: &str) -> Option<ToolCall> {
        let after_key = &text[text.find("\"name\"")? + "\"name\"".len()..];
        let value = after_key.trim_start().strip_prefix(':')?.trim_start();
        let value = value.strip_prefix('"')?;
        let name = &value[..value.find('"')?];
        if !self.names.iter().any(|n| n == name) {
            return None;
        }
        let rest = ["\"arguments\"", "\"parameters\""]
            .iter()
            .find_map(|k| text.find(k).map(|at| &text[at + k.len()..]))
            .and_then(|a| a.trim_start().strip_prefix(':'))
            .map_or("", str::trim);
        // Arguments that are whole (the cut fell after them) are kept as they are, without
        // what followed; otherwise the text as far as it got.
        let arguments = match serde_json::Deserializer::from_str(rest)
            .into_iter::<Value>()
            .next()
        {
            Some(Ok(whole)) => whole.to_string(),
            _ => rest.to_string(),
        };
        Some(ToolCall {
            name: name.to_string(),
            arguments,
        })
    }
}

/// Turns a request's messages into what the template renders. A template that handles tools
/// gets the messages as they are (arguments parsed into objects, as `transformers` expects)
/// and `tools`; any other gets the tools in a system message and calls/results as text.
pub fn prepare_messages(
    messages: Vec<Value>,
    tools: &[Tool],
    template: &ChatTemplate,
) -> (Vec<Value>, Option<Vec<Value>>) {
    let native = template.source_contains("tools");
    let format = ToolFormat::of(template);
    let tools_system_text = |tools: &[Tool]| {
        if template.is_fallback() {
            compact_tools_text(tools)
        } else {
            tools_system_text(tools)
        }
    };
    let mut out = Vec::with_capacity(messages.len() + 1);
    if !native && !tools.is_empty() {
        let text = tools_system_text(tools);
        match messages.first() {
            Some(m) if m["role"] == "system" => {}
            _ => out.push(json!({"role": "system", "content": text})),
        }
    }
    for (i, mut m) in messages.into_iter().enumerate() {
        if !native {
            if i == 0 && m["role"] == "system" && !tools.is_empty() {
                let c = m["content"].as_str().unwrap_or_default().to_string();
                m["content"] = format!("{c}\n\n{}", tools_system_text(tools)).into();
            }
            if let Some(calls) = m.get("tool_calls").and_then(Value::as_array).cloned() {
                let mut text = m["content"].as_str().unwrap_or_default().to_string();
                for c in calls {
                    let call = ToolCall {
                        name: c["function"]["name"].as_str().unwrap_or_default().into(),
                        arguments: c["function"]["arguments"]
                            .as_str()
                            .unwrap_or("{}")
                            .to_string(),
                    };
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format.write(&call));
                }
                m = json!({"role": "assistant", "content": text});
            } else if m["role"] == "tool" {
                let c = m["content"].as_str().unwrap_or_default();
                m = json!({"role": "tool", "content": format!("<tool_response>\n{c}\n</tool_response>")});
            }
        } else if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
            for c in calls {
                if let Some(a) = c["function"].get("arguments").and_then(Value::as_str) {
                    if let Ok(parsed) = serde_json::from_str::<Value>(a) {
                        c["function"]["arguments"] = parsed;
                    }
                }
            }
        }
        out.push(m);
    }
    let defs = (native && !tools.is_empty()).then(|| tools.iter().map(Tool::definition).collect());
    (out, defs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        parse_tools(&json!([
            {"type": "function", "function": {"name": "get_weather",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "add"}}
        ]))
        .unwrap()
    }

    #[test]
    fn a_call_cut_short_is_a_call_or_nothing_never_content() {
        let cut = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa";
        let mut p = ToolCallParser::new(ToolFormat::Hermes, &tools());
        let mut events = p.push(cut);
        events.extend(p.finish());
        assert_eq!(
            events,
            vec![ToolEvent::Call(ToolCall {
                name: "get_weather".into(),
                arguments: "{\"city\": \"Pa".into()
            })]
        );
        for cut in [
            "<tool_call>\n{\"name\": \"get_wea",
            "<tool_c",
            "<tool_call>{\"name\": \"nope\"",
        ] {
            let mut p = ToolCallParser::new(ToolFormat::Hermes, &tools());
            let mut events = p.push(cut);
            events.extend(p.finish());
            assert!(events.is_empty(), "{cut}: {events:?}");
        }
        let mut p = ToolCallParser::new(ToolFormat::Llama3, &tools());
        let mut events = p.push(concat!(
            "{\"name\": \"add\", \"parameters\": {}};",
            "{\"name\": \"get_weather\", \"parameters\": {\"ci"
        ));
        events.extend(p.finish());
        let names: Vec<_> = events
            .iter()
            .map(|e| match e {
                ToolEvent::Call(c) => c.name.as_str(),
                ToolEvent::Content(_) => "content",
            })
            .collect();
        assert_eq!(names, ["add", "get_weather"]);
    }

    #[test]
    fn hermes_calls_are_parsed_across_chunk_boundaries() {
        let mut p = ToolCallParser::new(ToolFormat::Hermes, &tools());
        let text = "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>";
        let mut events = Vec::new();
        for ch in text.chars() {
            events.extend(p.push(&ch.to_string()));
        }
        events.extend(p.finish());
        let content: String = events
            .iter()
            .filter_map(|e| match e {
                ToolEvent::Content(c) => Some(c.as_str()),
                ToolEvent::Call(_) => None,
            })
            .collect();
        assert_eq!(content, "Let me check.");
        let calls: Vec<&ToolCall> = events
            .iter()
            .filter_map(|e| match e {
                ToolEvent::Call(c) => Some(c),
                ToolEvent::Content(_) => None,
            })
            .collect();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
        assert_eq!(calls[1].name, "add");
    }

    #[test]
    fn text_that_only_looks_like_a_call_is_content() {
        let mut p = ToolCallParser::new(ToolFormat::Hermes, &tools());
        let mut ev = p.push("a <tool_c");
        assert_eq!(ev, vec![ToolEvent::Content("a ".into())]);
        ev = p.push("at> b");
        assert_eq!(ev, vec![ToolEvent::Content("<tool_cat> b".into())]);
        let mut p = ToolCallParser::new(ToolFormat::Hermes, &tools());
        p.push("<tool_call>{\"name\": \"nope\"}</tool_call>");
        let mut p2 = ToolCallParser::new(ToolFormat::Hermes, &tools());
        let ev = p2.push("<tool_call>{\"name\": \"nope\"}</tool_call>");
        assert!(matches!(&ev[..], [ToolEvent::Content(_)]), "{ev:?}");
        assert_eq!(p.finish(), vec![]);
    }

    #[test]
    fn llama3_reply_that_is_json_is_a_call() {
        let mut p = ToolCallParser::new(ToolFormat::Llama3, &tools());
        assert!(p.push("{\"name\": \"add\", ").is_empty());
        assert!(p.push("\"parameters\": {\"a\": 1}}").is_empty());
        assert_eq!(
            p.finish(),
            vec![ToolEvent::Call(ToolCall {
                name: "add".into(),
                arguments: r#"{"a":1}"#.into()
            })]
        );
        let mut p = ToolCallParser::new(ToolFormat::Llama3, &tools());
        assert_eq!(p.push("Hi"), vec![ToolEvent::Content("Hi".into())]);
    }

    #[test]
    fn tool_choice_must_name_a_given_tool() {
        let t = tools();
        assert_eq!(parse_tool_choice(None, &t).unwrap(), ToolChoice::Auto);
        assert_eq!(parse_tool_choice(None, &[]).unwrap(), ToolChoice::None);
        let e = parse_tool_choice(
            Some(&json!({"type": "function", "function": {"name": "x"}})),
            &t,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let e = parse_tool_choice(Some(&json!("required")), &[]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        let e = parse_tools(&json!([{"type": "code_interpreter"}])).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0]"));
    }
}
