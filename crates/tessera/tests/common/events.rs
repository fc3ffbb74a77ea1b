//! The cluster's structured events: a `tessera coordinator` or `tessera node` started with
//! `TESSERA_LOG_FORMAT=json` prints each event as one JSON object a line (`event`, `node`,
//! `epoch`, … beside its `message`), so tests wait on what happened, never on wording.

use serde_json::Value;

/// The environment that makes a process print its events as JSON lines.
pub const JSON_LOGS: (&str, &str) = ("TESSERA_LOG_FORMAT", "json");

/// The event on `line` if it is one whose fields have the given values (strings compared as
/// they are, numbers and booleans as written in JSON).
pub fn event_in(line: &str, fields: &[(&str, &str)]) -> Option<Value> {
    if !line.starts_with('{') {
        return None;
    }
    let v: Value = serde_json::from_str(line).ok()?;
    let all = fields.iter().all(|(k, want)| match &v[*k] {
        Value::String(s) => s == want,
        Value::Number(n) => n.to_string() == *want,
        Value::Bool(b) => b.to_string() == *want,
        _ => false,
    });
    all.then_some(v)
}

/// `fields` for messages: `event=joined node=a`.
pub fn describe(fields: &[(&str, &str)]) -> String {
    fields
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}
