//! A request made ready to run: its prompt rendered and tokenized (with tools and a final
//! assistant message to continue), its grammar built, and the heavy parts moved off the async
//! workers when the body is big.

use std::sync::Arc;

use axum::body::Bytes;
use serde_json::{json, Value};

use crate::grammar::{GrammarError, GrammarSpec};
use crate::openai::tools::{self, Tool, ToolChoice, ToolFormat};
use crate::openai::{ApiError, ParsedRequest, Prompt, ResponseFormat};
use crate::server::Gateway;
use tessera_api::ServedModel;
use tessera_grammar::Grammar;

/// A request ready to submit.
pub(crate) struct Prepared {
    pub prompt_tokens: Vec<u32>,
    pub grammar: Option<Grammar>,
    /// Read tool calls out of the text (tools given and `tool_choice` not `none`).
    pub tools: Option<(ToolFormat, Vec<Tool>)>,
    /// Completions with `echo`: the prompt text.
    pub echo: Option<String>,
    /// Chat's `prediction`, tokenized (empty: none).
    pub prediction: Vec<u32>,
}

/// The grammar a request's `tool_choice` or `response_format` asks for, and the parameter
/// that asked.
fn grammar_spec(req: &ParsedRequest, format: ToolFormat) -> Option<(GrammarSpec, &'static str)> {
    if let Some(g) = tools::tool_grammar(
        &req.tools,
        &req.tool_choice,
        req.parallel_tool_calls,
        format,
    ) {
        return Some((g, "tool_choice"));
    }
    match &req.response_format {
        ResponseFormat::Text => None,
        ResponseFormat::JsonObject => Some((
            GrammarSpec::JsonSchema(json!({"type": "object"})),
            "response_format",
        )),
        ResponseFormat::JsonSchema { schema, .. } => {
            Some((GrammarSpec::JsonSchema(schema.clone()), "response_format"))
        }
    }
}

/// Tokenizes, compiles the grammar and checks the request against the backend's features.
/// CPU work (templates, grammar compilation): call it off the async workers for big inputs.
pub(crate) fn prepare(gw: &Gateway, req: &ParsedRequest) -> Result<Prepared, ApiError> {
    crate::limits::check(req)?;
    // The one range check of every front end: the same value gets the same error everywhere.
    req.sampling(0, 0)
        .validate()
        .map_err(|e| ApiError::invalid(e.to_string(), Some(e.param.name())))?;
    let m = gw.backend.model();
    let features = gw.backend.features();
    let format = ToolFormat::of(&m.template);
    let spec = grammar_spec(req, format);
    if req.logprobs.is_some() && !features.logprobs {
        return Err(ApiError::invalid(
            "'logprobs' is not supported by this backend (it does not report \
             log-probabilities).",
            Some("logprobs"),
        ));
    }
    if let Some((_, param)) = &spec {
        if !features.grammar {
            return Err(ApiError::invalid(
                format!(
                    "'{param}' needs constrained decoding, which this backend does not \
                     support."
                ),
                Some(param),
            ));
        }
    }
    let vocab = m.tokenizer.vocab_size();
    if let Some((id, _)) = req.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
        return Err(ApiError::invalid(
            format!("Invalid 'logit_bias': token {id} is outside the vocabulary of {vocab}."),
            Some("logit_bias"),
        ));
    }
    let use_tools = !req.tools.is_empty() && req.tool_choice != ToolChoice::None;
    let prompt_tokens = tokenize(&m, req, use_tools)?;
    if prompt_tokens.is_empty() {
        return Err(ApiError::invalid("The prompt is empty.", Some("prompt")));
    }
    let grammar = match spec {
        None => None,
        Some((spec, param)) => {
            let compiler = m
                .grammar_compiler()
                .map_err(|e| ApiError::invalid(e.to_string(), Some(param)))?;
            Some(compiler.compile(&spec).map_err(|e| match e {
                GrammarError::Invalid(msg) => {
                    ApiError::invalid(format!("Invalid schema or grammar: {msg}"), Some(param))
                }
                e => ApiError::invalid(e.to_string(), Some(param)),
            })?)
        }
    };
    let prediction = match &req.prediction {
        None => Vec::new(),
        Some(_) if !features.prediction => {
            return Err(ApiError::invalid(
                "'prediction' is not supported by this backend (it does not draft).",
                Some("prediction"),
            ))
        }
        Some(text) => {
            use tessera_sampling::prediction::MAX_PREDICTION_TOKENS;
            let tokens = m.tokenizer.encode(text, false);
            if tokens.len() > MAX_PREDICTION_TOKENS {
                return Err(ApiError::invalid(
                    format!(
                        "Invalid 'prediction': {} tokens, at most {MAX_PREDICTION_TOKENS}.",
                        tokens.len()
                    ),
                    Some("prediction"),
                ));
            }
            tokens
        }
    };
    let echo = match (&req.prompt, req.echo) {
        (Prompt::Text(t), true) => Some(t.clone()),
        (Prompt::Tokens(t), true) => Some(m.tokenizer.decode(t)),
        _ => None,
    };
    Ok(Prepared {
        prompt_tokens,
        grammar,
        tools: use_tools.then(|| (format, req.tools.clone())),
        echo,
        prediction,
    })
}

/// How many tokens the request's prompt is (tools included), without generating.
pub(crate) fn prompt_tokens(gw: &Gateway, req: &ParsedRequest) -> Result<usize, ApiError> {
    crate::limits::check(req)?;
    // The one range check of every front end: the same value gets the same error everywhere.
    req.sampling(0, 0)
        .validate()
        .map_err(|e| ApiError::invalid(e.to_string(), Some(e.param.name())))?;
    let m = gw.backend.model();
    let use_tools = !req.tools.is_empty() && req.tool_choice != ToolChoice::None;
    tokenize(&m, req, use_tools).map(|t| t.len())
}

fn tokenize(m: &ServedModel, req: &ParsedRequest, use_tools: bool) -> Result<Vec<u32>, ApiError> {
    let tools: &[Tool] = if use_tools { &req.tools } else { &[] };
    match &req.prompt {
        Prompt::Chat(messages) if req.continue_final_message => {
            continue_final_message(m, messages, tools)
        }
        Prompt::Chat(messages) => {
            let (messages, defs) = tools::prepare_messages(messages.clone(), tools, &m.template);
            m.template
                .encode_json(&m.tokenizer, &messages, defs.as_deref(), true)
                .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))
        }
        Prompt::Text(t) => Ok(m.tokenizer.encode(t, true)),
        Prompt::Tokens(t) => {
            let v = m.tokenizer.vocab_size();
            match t.iter().find(|&&id| id as usize >= v) {
                Some(bad) => Err(ApiError::invalid(
                    format!("Token id {bad} is outside the vocabulary of {v}."),
                    Some("prompt"),
                )),
                None => Ok(t.clone()),
            }
        }
    }
}

/// The conversation up to its last message, an assistant turn begun by the client, rendered
/// for generation with that turn's text after the assistant's opening: the model continues
/// the reply instead of starting a new one (the template would close the turn).
fn continue_final_message(
    m: &ServedModel,
    messages: &[Value],
    tools: &[Tool],
) -> Result<Vec<u32>, ApiError> {
    let (last, earlier) = match messages.split_last() {
        Some((l, e))
            if l["role"] == "assistant" && l.get("tool_calls").is_none_or(Value::is_null) =>
        {
            (l, e)
        }
        _ => {
            return Err(ApiError::invalid(
                "To continue the final message it must be an assistant message without tool \
                 calls.",
                Some("messages"),
            ))
        }
    };
    let (earlier, defs) = tools::prepare_messages(earlier.to_vec(), tools, &m.template);
    let mut tokens = m
        .template
        .encode_json(&m.tokenizer, &earlier, defs.as_deref(), true)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    // The begun reply is client text: tokenized as text, without a BOS.
    let begun = last["content"].as_str().unwrap_or_default();
    tokens.extend(m.tokenizer.encode(begun, false));
    Ok(tokens)
}

/// A body parsed by `parse` (a front end's parser), on a blocking thread when it is larger
/// than [`crate::limits::RequestLimits::inline_bytes`]: parsing is linear, but a few MiB of
/// JSON still take milliseconds the async workers owe to every other connection.
pub(crate) async fn parse_off_thread(
    body: &Bytes,
    parse: fn(&[u8]) -> Result<ParsedRequest, ApiError>,
) -> Result<ParsedRequest, ApiError> {
    let b = body.clone();
    off_thread_if_big(body.len(), move || parse(&b)).await
}

/// `work` for a body of `body_len` bytes: inline when small, otherwise on a blocking thread
/// (anything that grows with the input: parsing, templates, tokenizing, grammars).
pub(crate) async fn off_thread_if_big<T: Send + 'static>(
    body_len: usize,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    if body_len <= crate::limits::LIMITS.inline_bytes {
        return work();
    }
    tokio::task::spawn_blocking(work).await.unwrap_or_else(|e| {
        Err(ApiError::internal(format!(
            "the request's work failed: {e}"
        )))
    })
}

/// [`prepare`], on a blocking thread when it may take a while (big bodies, grammars).
pub(crate) async fn prepare_off_thread(
    gw: &Arc<Gateway>,
    req: &ParsedRequest,
    body_len: usize,
) -> Result<Prepared, ApiError> {
    let heavy = body_len > crate::limits::LIMITS.inline_bytes
        || req.response_format != ResponseFormat::Text
        || matches!(req.tool_choice, ToolChoice::Required | ToolChoice::Named(_));
    if !heavy {
        return prepare(gw, req);
    }
    let (g, r) = (gw.clone(), req.clone());
    tokio::task::spawn_blocking(move || prepare(&g, &r))
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("preparing failed: {e}"))))
}
