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
    /// A 400 naming the parameter unless it is `null`.
    Refused,
}

use Support::{Honoured, Ignored, Refused};

/// `/v1/chat/completions` parameters. `top_k`, `min_p`, `repetition_penalty` and
/// `repeat_last_n` are extensions (llama-server's names).
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
    ("user", Ignored),
    ("safety_identifier", Ignored),
    ("prompt_cache_key", Ignored),
    ("metadata", Ignored),
    ("service_tier", Ignored),
    ("audio", Refused),
    ("functions", Refused),
    ("function_call", Refused),
    ("prediction", Refused),
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
    ("user", Ignored),
    ("suffix", Refused),
];

/// Refuses parameters the table does not list, or lists as refused.
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
            Some(Refused) if !val.is_null() => {
                return Err(ApiError::invalid(
                    format!("'{k}' is not supported by this server."),
                    Some(k),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}
