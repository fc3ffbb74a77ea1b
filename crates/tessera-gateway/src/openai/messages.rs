//! A chat request's messages (roles, content as text or text parts, tool calls and results)
//! and its `response_format`, checked and normalised for the chat template.

use serde_json::{json, Value};

use super::{ApiError, ResponseFormat};

/// A message's `content` as text: a string, or text parts (other part types are refused).
fn content_text(c: &Value, param: &str) -> Result<String, ApiError> {
    match c {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut t = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        t.push_str(p.get("text").and_then(Value::as_str).unwrap_or_default())
                    }
                    other => {
                        return Err(ApiError::invalid(
                            format!(
                                "Content parts of type '{}' are not supported.",
                                other.unwrap_or("?")
                            ),
                            Some(param),
                        ))
                    }
                }
            }
            Ok(t)
        }
        _ => Err(ApiError::invalid(
            format!("Invalid type for '{param}': expected a string or an array of parts."),
            Some(param),
        )),
    }
}

/// One chat message, normalised for the template.
pub(super) fn chat_message(i: usize, m: &Value) -> Result<Value, ApiError> {
    let p = |k: &str| format!("messages[{i}].{k}");
    let Value::Object(o) = m else {
        return Err(ApiError::invalid(
            format!("Invalid type for 'messages[{i}]': expected an object."),
            Some(&format!("messages[{i}]")),
        ));
    };
    let role = o.get("role").and_then(Value::as_str).unwrap_or_default();
    if !matches!(role, "system" | "developer" | "user" | "assistant" | "tool") {
        return Err(ApiError::invalid(
            format!("Invalid value for 'messages[{i}].role': '{role}'."),
            Some(&p("role")),
        ));
    }
    let mut out = serde_json::Map::new();
    // Templates know "system"; OpenAI's "developer" is the same turn for them.
    let role = if role == "developer" { "system" } else { role };
    out.insert("role".into(), role.into());
    out.insert(
        "content".into(),
        content_text(o.get("content").unwrap_or(&Value::Null), &p("content"))?.into(),
    );
    for (k, v) in o {
        match k.as_str() {
            "role" | "content" => {}
            "name" | "tool_call_id" if v.is_string() => {
                out.insert(k.clone(), v.clone());
            }
            "tool_calls" if role == "assistant" => {
                let calls = v.as_array().ok_or_else(|| {
                    ApiError::invalid(format!("Invalid type for '{}'.", p(k)), Some(&p(k)))
                })?;
                for (j, c) in calls.iter().enumerate() {
                    if c["function"]["name"].as_str().is_none() {
                        let f = format!("messages[{i}].tool_calls[{j}].function.name");
                        return Err(ApiError::invalid(format!("Missing '{f}'."), Some(&f)));
                    }
                }
                out.insert(k.clone(), v.clone());
            }
            // Echoes of an earlier response: carry nothing the model needs.
            "refusal" | "annotations" | "reasoning_content" => {}
            _ if v.is_null() => {}
            _ => {
                return Err(ApiError::invalid(
                    format!("'{}' is not supported by this server.", p(k)),
                    Some(&p(k)),
                ))
            }
        }
    }
    if role == "tool" && !out.contains_key("tool_call_id") {
        return Err(ApiError::invalid(
            format!("Missing required parameter: '{}'.", p("tool_call_id")),
            Some(&p("tool_call_id")),
        ));
    }
    Ok(Value::Object(out))
}

pub(super) fn response_format(v: &Value) -> Result<ResponseFormat, ApiError> {
    let bad = |m: &str| ApiError::invalid(m.to_string(), Some("response_format"));
    let Some(rf) = v.get("response_format").filter(|x| !x.is_null()) else {
        return Ok(ResponseFormat::Text);
    };
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(ResponseFormat::Text),
        Some("json_object") => Ok(ResponseFormat::JsonObject),
        Some("json_schema") => {
            let js = rf
                .get("json_schema")
                .ok_or_else(|| bad("Missing required parameter: 'response_format.json_schema'."))?;
            let name = js.get("name").and_then(Value::as_str).ok_or_else(|| {
                bad("Missing required parameter: 'response_format.json_schema.name'.")
            })?;
            let schema = match js.get("schema") {
                None | Some(Value::Null) => json!({}),
                Some(s @ Value::Object(_)) => s.clone(),
                Some(_) => {
                    return Err(bad(
                        "Invalid 'response_format.json_schema.schema': expected an object.",
                    ))
                }
            };
            Ok(ResponseFormat::JsonSchema {
                name: name.to_string(),
                schema,
            })
        }
        _ => Err(bad(
            "Invalid 'response_format.type': expected 'text', 'json_object' or 'json_schema'.",
        )),
    }
}

/// Chat's `prediction`: `{"type": "content", "content": TEXT}`, the content a string or an array
/// of text parts (joined), as OpenAI's predicted outputs take it.
pub(super) fn prediction(v: &Value) -> Result<Option<String>, ApiError> {
    let bad = |m: &str| ApiError::invalid(m.to_string(), Some("prediction"));
    let Some(p) = v.get("prediction").filter(|x| !x.is_null()) else {
        return Ok(None);
    };
    if p.get("type").and_then(Value::as_str) != Some("content") {
        return Err(bad("Invalid 'prediction.type': expected 'content'."));
    }
    match p.get("content") {
        Some(Value::String(t)) => Ok(Some(t.clone())),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text")) {
                    (Some("text"), Some(Value::String(t))) => text.push_str(t),
                    _ => {
                        return Err(bad("Invalid 'prediction.content': expected text parts \
                             ({\"type\": \"text\", \"text\": ...})."))
                    }
                }
            }
            Ok(Some(text))
        }
        _ => Err(bad(
            "Invalid 'prediction.content': expected a string or an array of text parts.",
        )),
    }
}
