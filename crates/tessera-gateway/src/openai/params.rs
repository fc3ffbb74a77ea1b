//! Which request parameters the server honours, ignores or refuses, per endpoint, and the check
//! that refuses the rest with a 400 naming them.

use serde_json::Value;

use super::ApiError;

/// How the server treats a request parameter. Every parameter of OpenAI's reference request
/// schemas is in [`CHAT_PARAMS`] or [`COMPLETION_PARAMS`]; anything else is refused with a 400
/// naming it, as OpenAI does ("Unrecognized request argument supplied").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Support {
    /// Acted on (within the values the parser accepts; others are a 400 naming it).
    Honoured,
    /// Accepted and ignored, as OpenAI documents for `user` (bookkeeping only).
    Ignored,
    /// A 400 naming the parameter unless its value asks for nothing: `null`, or the value
    /// [`asks_for_nothing`] names (`functions: []`, `verbosity: "medium"`...).
    Refused,
}

use Support::{Honoured, Ignored, Refused};

/// `/v1/chat/completions` parameters. `top_k`, `min_p`, `repetition_penalty` and
/// `repeat_last_n` are extensions, as are llama.cpp's spellings [`LLAMA_CPP_ALIASES`].
pub const CHAT_PARAMS: &[(&str, Support)] = &[
    ("model", Honoured),
    ("messages", Honoured),
    ("stream", Honoured),
    ("stream_options", Honoured),
    ("max_tokens", Honoured),
    ("max_completion_tokens", Honoured),
    ("temperature", Honoured),
    ("top_p", Honoured),
    ("seed", Honoured),
    ("stop", Honoured),
    ("n", Honoured),
    ("logprobs", Honoured),
    ("top_logprobs", Honoured),
    ("logit_bias", Honoured),
    ("presence_penalty", Honoured),
    ("frequency_penalty", Honoured),
    ("response_format", Honoured),
    ("tools", Honoured),
    ("tool_choice", Honoured),
    ("parallel_tool_calls", Honoured),
    // Only ["text"].
    ("modalities", Honoured),
    // Only false: nothing is stored.
    ("store", Honoured),
    ("top_k", Honoured),
    ("min_p", Honoured),
    ("repetition_penalty", Honoured),
    ("repeat_last_n", Honoured),
    ("repeat_penalty", Honoured),
    ("n_predict", Honoured),
    ("cache_prompt", Ignored),
    // vLLM's: the last (assistant) message is continued, not closed.
    ("continue_final_message", Honoured),
    // Predicted outputs: drafts to check, never a change of the text.
    ("prediction", Honoured),
    ("user", Ignored),
    ("safety_identifier", Ignored),
    ("prompt_cache_key", Ignored),
    ("metadata", Ignored),
    ("service_tier", Ignored),
    ("audio", Refused),
    ("functions", Refused),
    ("function_call", Refused),
    ("reasoning_effort", Refused),
    ("verbosity", Refused),
    ("web_search_options", Refused),
    ("prompt_cache_retention", Refused),
];

/// `/v1/completions` parameters (extensions as for chat).
pub const COMPLETION_PARAMS: &[(&str, Support)] = &[
    ("model", Honoured),
    ("prompt", Honoured),
    ("stream", Honoured),
    ("stream_options", Honoured),
    ("max_tokens", Honoured),
    ("temperature", Honoured),
    ("top_p", Honoured),
    ("seed", Honoured),
    ("stop", Honoured),
    ("n", Honoured),
    ("logprobs", Honoured),
    ("echo", Honoured),
    // Only equal to n (each choice is its own sample; nothing is ranked).
    ("best_of", Honoured),
    ("logit_bias", Honoured),
    ("presence_penalty", Honoured),
    ("frequency_penalty", Honoured),
    ("top_k", Honoured),
    ("min_p", Honoured),
    ("repetition_penalty", Honoured),
    ("repeat_last_n", Honoured),
    ("repeat_penalty", Honoured),
    ("n_predict", Honoured),
    ("cache_prompt", Ignored),
    ("user", Ignored),
    ("suffix", Refused),
];

/// llama.cpp's (llama-server's) names for parameters honoured under OpenAI's or our own name:
/// `(llama.cpp's, ours)`. When both are given, ours wins. `cache_prompt` is accepted and
/// ignored: prompt caching changes no output.
pub const LLAMA_CPP_ALIASES: &[(&str, &str)] = &[
    ("repeat_penalty", "repetition_penalty"),
    ("n_predict", "max_tokens"),
];

/// Whether `value` of the refused parameter `name` asks for nothing this server would have
/// to do: the empty list or object, or the documented default. Clients and agent SDKs send
/// these on every request (the OpenAI Agents SDK sends `include: []` to Responses), so
/// refusing them would refuse requests whose answer would be the same.
pub fn asks_for_nothing(name: &str, value: &Value) -> bool {
    let empty = match value {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(Value::is_null),
        _ => false,
    };
    empty
        || match (name, value) {
            ("verbosity", Value::String(s)) => s == "medium",
            ("reasoning_effort", Value::String(s)) => s == "none",
            // With no `functions` (else refused by their own name) there is nothing to call.
            ("function_call", Value::String(s)) => s == "none" || s == "auto",
            ("reasoning", Value::Object(o)) => o
                .iter()
                .all(|(k, v)| v.is_null() || (k == "effort" && v == "none")),
            ("top_logprobs", Value::Number(n)) => n.as_u64() == Some(0),
            ("prompt_cache_retention", Value::String(s)) => s == "in_memory",
            _ => false,
        }
}

/// Refuses parameters the table does not list, or lists as refused (unless their value
/// [`asks_for_nothing`]).
pub(crate) fn check_params(v: &Value, table: &[(&str, Support)]) -> Result<(), ApiError> {
    let Value::Object(map) = v else {
        return Ok(());
    };
    for (k, val) in map {
        match table.iter().find(|(n, _)| n == k).map(|(_, s)| *s) {
            None => {
                return Err(ApiError::invalid(
                    format!("Unrecognized request argument supplied: {k}"),
                    Some(k),
                ))
            }
            Some(Refused) if !asks_for_nothing(k, val) => {
                return Err(ApiError::invalid(
                    format!(
                        "'{k}' is not supported by this server (only a value that asks for \
                         nothing is accepted: null, [] or {{}}, or the default)."
                    ),
                    Some(k),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn refused_parameters_are_accepted_when_they_ask_for_nothing() {
        let table = &[
            ("functions", Refused),
            ("include", Refused),
            ("reasoning", Refused),
            ("verbosity", Refused),
            ("reasoning_effort", Refused),
        ];
        for body in [
            json!({"functions": []}),
            json!({"include": []}),
            json!({"reasoning": {}}),
            json!({"reasoning": {"effort": null, "summary": null}}),
            json!({"verbosity": "medium"}),
            json!({"reasoning_effort": "none"}),
        ] {
            assert!(check_params(&body, table).is_ok(), "{body}");
        }
        for (body, name) in [
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (
                json!({"include": ["reasoning.encrypted_content"]}),
                "include",
            ),
            (json!({"reasoning": {"effort": "high"}}), "reasoning"),
            (json!({"verbosity": "low"}), "verbosity"),
        ] {
            let e = check_params(&body, table).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(name));
        }
    }
}
