//! Integers in a JSON schema bounded as llama.cpp bounds them.
//!
//! llguidance lets an `integer` without `minimum`/`maximum` run to any length, so a small
//! model can write digits until `max_tokens` (a 37-digit "integer" was seen). llama.cpp's
//! schema-to-grammar writes the integral part as at most 16 digits; the same bound here is
//! `minimum`/`maximum` of ±(10¹⁶ − 1) added where a schema sets none, which llguidance turns
//! into a digit-count-limited pattern. Bounds a schema gives itself are kept as they are.

use serde_json::Value;

/// The largest magnitude of an integer the schema leaves unbounded: 16 digits.
pub const MAX_UNBOUNDED_INTEGER: i64 = 9_999_999_999_999_999;

/// Keywords whose values are data, not schemas: an `integer` spelled inside them is left alone.
const DATA_KEYWORDS: &[&str] = &["const", "enum", "default", "examples", "x-guidance"];

/// `schema` with every `integer` (alone or in a list of types) given the bounds it lacks.
pub fn bound_integers(schema: &Value) -> Value {
    let mut s = schema.clone();
    bound_in_place(&mut s, 0);
    s
}

/// Deeper than this the schema is left as it is (llguidance refuses such nesting anyway).
const MAX_DEPTH: usize = 128;

fn bound_in_place(v: &mut Value, depth: usize) {
    if depth > MAX_DEPTH {
        return;
    }
    match v {
        Value::Object(o) => {
            let integer = match o.get("type") {
                Some(Value::String(t)) => t == "integer",
                Some(Value::Array(ts)) => ts.iter().any(|t| t == "integer"),
                _ => false,
            };
            if integer {
                if !o.contains_key("maximum") && !o.contains_key("exclusiveMaximum") {
                    o.insert("maximum".into(), MAX_UNBOUNDED_INTEGER.into());
                }
                if !o.contains_key("minimum") && !o.contains_key("exclusiveMinimum") {
                    o.insert("minimum".into(), (-MAX_UNBOUNDED_INTEGER).into());
                }
            }
            for (k, child) in o.iter_mut() {
                if !DATA_KEYWORDS.contains(&k.as_str()) {
                    bound_in_place(child, depth + 1);
                }
            }
        }
        Value::Array(items) => {
            for child in items {
                bound_in_place(child, depth + 1);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unbounded_integers_get_sixteen_digits_and_bounded_ones_keep_theirs() {
        let s = bound_integers(&json!({
            "type": "object",
            "properties": {
                "n": {"type": "integer"},
                "m": {"type": ["integer", "null"], "minimum": 0},
                "k": {"type": "integer", "exclusiveMaximum": 5},
                "list": {"type": "array", "items": {"type": "integer"}},
                "type": {"type": "string"},
                "c": {"const": {"type": "integer"}}
            },
            "$defs": {"d": {"anyOf": [{"type": "integer"}]}}
        }));
        let p = &s["properties"];
        assert_eq!(p["n"]["maximum"], MAX_UNBOUNDED_INTEGER);
        assert_eq!(p["n"]["minimum"], -MAX_UNBOUNDED_INTEGER);
        assert_eq!(p["m"]["minimum"], 0);
        assert_eq!(p["m"]["maximum"], MAX_UNBOUNDED_INTEGER);
        assert!(p["k"].get("maximum").is_none());
        assert_eq!(p["list"]["items"]["maximum"], MAX_UNBOUNDED_INTEGER);
        assert!(p["type"].get("maximum").is_none());
        assert_eq!(p["c"]["const"], json!({"type": "integer"}));
        assert_eq!(
            s["$defs"]["d"]["anyOf"][0]["minimum"],
            -MAX_UNBOUNDED_INTEGER
        );
    }
}
