//! `POST /v1/embeddings` (OpenAI) and what Ollama's `/api/embed` shares with it: reading the
//! inputs, tokenizing them within [`crate::limits`], and running them on the backend
//! ([`Backend::embed`](tessera_api::Backend::embed)).
//!
//! An embedding is the model's final hidden state (after the output norm, before the head)
//! pooled over the input's tokens as the model says (`{arch}.pooling_type`; mean for a causal
//! LM, which has no such key), then scaled to unit length ([`l2_normalize`]) as OpenAI's
//! embedding models answer. Text is tokenized as a completion prompt is (BOS where the model
//! wants one); OpenAI's token-array inputs are run as given.
//!
//! `encoding_format` is `float` (the default) or `base64` (the little-endian `f32` bytes, which
//! the official Python client asks for and decodes itself). `dimensions` is refused: a vector
//! cut short is only meaningful for a model trained for it. `user` is accepted and ignored, as
//! OpenAI documents it.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use base64::Engine as _;
use serde::Serialize;
use serde_json::Value;

use crate::limits::{check_embedding_inputs, check_embedding_tokens};
use crate::openai::{self, ApiError, Support};
use crate::respond::{off_thread_if_big, submit_error, Tracker};
use crate::server::{clip, Gateway, MAX_ECHO_BYTES};
use tessera_api::ClientId;
use tessera_api::{EmbeddingRequest, Embeddings, ServedModel, Usage};

/// `/v1/embeddings` parameters.
pub const EMBEDDING_PARAMS: &[(&str, Support)] = &[
    ("model", Support::Honoured),
    ("input", Support::Honoured),
    ("encoding_format", Support::Honoured),
    ("user", Support::Ignored),
    ("dimensions", Support::Refused),
];

/// What to embed, before tokenizing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EmbedInputs {
    Texts(Vec<String>),
    /// Token ids, run as given (OpenAI's array of integers, or of arrays of integers).
    Tokens(Vec<Vec<u32>>),
}

/// Reads `input` (named `param` in errors): a string, a list of strings, and, where
/// `tokens_allowed`, a list of token ids or a list of such lists. The count is held to the
/// limit before the items are read.
pub fn parse_inputs(
    v: Option<&Value>,
    param: &str,
    tokens_allowed: bool,
) -> Result<EmbedInputs, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some(param));
    let items = match v {
        None | Some(Value::Null) => {
            return Err(bad(format!("Missing required parameter: '{param}'.")))
        }
        Some(Value::String(s)) => return Ok(EmbedInputs::Texts(vec![s.clone()])),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(bad(format!(
                "Invalid '{param}': expected a string or an array."
            )))
        }
    };
    if items.is_empty() {
        return Err(bad(format!("Invalid '{param}': the array is empty.")));
    }
    check_embedding_inputs(items.len())?;
    if items.iter().all(Value::is_string) {
        let texts = items
            .iter()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect();
        return Ok(EmbedInputs::Texts(texts));
    }
    if !tokens_allowed {
        return Err(bad(format!("Invalid '{param}': expected strings.")));
    }
    let token = |x: &Value| -> Result<u32, ApiError> {
        x.as_u64()
            .and_then(|t| u32::try_from(t).ok())
            .ok_or_else(|| bad(format!("Invalid '{param}': {x} is not a token id.")))
    };
    if items.iter().all(Value::is_number) {
        let one = items.iter().map(token).collect::<Result<_, _>>()?;
        return Ok(EmbedInputs::Tokens(vec![one]));
    }
    let mut lists = Vec::with_capacity(items.len());
    for item in items {
        let Value::Array(ids) = item else {
            return Err(bad(format!(
                "Invalid '{param}': expected strings, token ids, or arrays of token ids, \
                 not a mix."
            )));
        };
        lists.push(ids.iter().map(token).collect::<Result<Vec<_>, _>>()?);
    }
    Ok(EmbedInputs::Tokens(lists))
}

/// The inputs as tokens, each checked (not empty, within the vocabulary, within the context
/// or cut to it when `truncate`), all together within the token limit; tokenizing stops at the
/// first input past it.
pub fn tokenize(
    m: &ServedModel,
    inputs: EmbedInputs,
    truncate: bool,
    param: &str,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let bad = |m: String| ApiError::invalid(m, Some(param));
    let mut out = Vec::new();
    let mut total = 0usize;
    let mut push = |i: usize, mut t: Vec<u32>| -> Result<(), ApiError> {
        if t.is_empty() {
            return Err(bad(format!(
                "Invalid '{param}': input {i} is empty (nothing to embed)."
            )));
        }
        if t.len() > m.context_length {
            if !truncate {
                return Err(bad(format!(
                    "Invalid '{param}': input {i} has {} tokens; this model's maximum context \
                     length is {} tokens.",
                    t.len(),
                    m.context_length
                ))
                .with_code("context_length_exceeded"));
            }
            t.truncate(m.context_length);
        }
        total += t.len();
        check_embedding_tokens(total)?;
        out.push(t);
        Ok(())
    };
    match inputs {
        EmbedInputs::Texts(texts) => {
            for (i, s) in texts.iter().enumerate() {
                if s.is_empty() {
                    return Err(bad(format!("Invalid '{param}': input {i} is empty.")));
                }
                push(i, m.tokenizer.encode(s, true))?;
            }
        }
        EmbedInputs::Tokens(lists) => {
            let vocab = m.tokenizer.vocab_size();
            for (i, t) in lists.into_iter().enumerate() {
                if let Some(id) = t.iter().find(|&&id| id as usize >= vocab) {
                    return Err(bad(format!(
                        "Invalid '{param}': token id {id} is outside the vocabulary of {vocab}."
                    )));
                }
                push(i, t)?;
            }
        }
    }
    Ok(out)
}

/// Runs tokenized inputs on the backend, holding one place of the client's fair share
/// while they run. The vectors are not normalized.
pub async fn compute(
    gw: &Arc<Gateway>,
    client: &ClientId,
    id: u64,
    inputs: Vec<Vec<u32>>,
) -> Result<Embeddings, ApiError> {
    let _permit = match &gw.admission {
        Some(a) => Some(
            a.admit(client)
                .map_err(|e| submit_error(tessera_api::SubmitError::OverShare(e), "input"))?,
        ),
        None => None,
    };
    let handle = gw
        .backend
        .embed(EmbeddingRequest { id, inputs })
        .map_err(|e| submit_error(e, "input"))?;
    handle.result().await.map_err(ApiError::internal)
}

/// `v` scaled to unit Euclidean length (its sum of squares taken in f64); a zero vector stays
/// zero.
pub fn l2_normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 {
        for x in v.iter_mut() {
            *x = (f64::from(*x) / norm) as f32;
        }
    }
}

/// `encoding_format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Encoding {
    Float,
    Base64,
}

/// A `/v1/embeddings` body, read and tokenized.
struct Parsed {
    inputs: Vec<Vec<u32>>,
    encoding: Encoding,
}

fn parse(gw: &Gateway, body: &[u8]) -> Result<Parsed, ApiError> {
    let v = openai::parse_value(body)?;
    openai::check_params(&v, EMBEDDING_PARAMS)?;
    let model = openai::field::<String>(&v, "model")?
        .ok_or_else(|| ApiError::invalid("you must provide a model parameter", Some("model")))?;
    let m = gw.backend.model();
    if model != m.id {
        return Err(ApiError::model_not_found(&clip(&model, MAX_ECHO_BYTES)));
    }
    let encoding = match openai::field::<String>(&v, "encoding_format")?.as_deref() {
        None | Some("float") => Encoding::Float,
        Some("base64") => Encoding::Base64,
        Some(other) => {
            return Err(ApiError::invalid(
                format!(
                    "Invalid 'encoding_format': '{}' is not one of 'float' or 'base64'.",
                    clip(other, MAX_ECHO_BYTES)
                ),
                Some("encoding_format"),
            ))
        }
    };
    let inputs = parse_inputs(v.get("input"), "input", true)?;
    let inputs = tokenize(&m, inputs, false, "input")?;
    Ok(Parsed { inputs, encoding })
}

/// One vector of the answer, as its encoding writes it.
#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct Item {
    object: &'static str,
    index: usize,
    embedding: Vector,
}

#[derive(Serialize)]
struct EmbeddingsUsage {
    prompt_tokens: usize,
    total_tokens: usize,
}

#[derive(Serialize)]
struct Answer {
    object: &'static str,
    data: Vec<Item>,
    model: String,
    usage: EmbeddingsUsage,
}

/// The little-endian bytes of `v`, in standard base64.
fn base64_f32(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// `POST /v1/embeddings`.
pub(crate) async fn create(
    State(gw): State<Arc<Gateway>>,
    Extension(client): Extension<ClientId>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (seq, suffix) = gw.new_id();
    let mut t = Tracker::new(
        gw.clone(),
        format!("embd-{suffix}"),
        "/v1/embeddings",
        client,
    );
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            return t.reject(ApiError::body_rejected(&e));
        }
    };
    let (g, b) = (gw.clone(), body.clone());
    let parsed = match off_thread_if_big(body.len(), move || parse(&g, &b)).await {
        Ok(p) => p,
        Err(e) => return t.reject(e),
    };
    let out = match compute(&gw, &t.client, seq, parsed.inputs).await {
        Ok(e) => e,
        Err(e) => return t.reject(e),
    };
    let usage = Usage {
        prompt_tokens: out.prompt_tokens,
        ..Usage::default()
    };
    let n = out.vectors.len();
    let data = out
        .vectors
        .into_iter()
        .enumerate()
        .map(|(index, mut v)| {
            l2_normalize(&mut v);
            let embedding = match parsed.encoding {
                Encoding::Float => Vector::Float(v),
                Encoding::Base64 => Vector::Base64(base64_f32(&v)),
            };
            Item {
                object: "embedding",
                index,
                embedding,
            }
        })
        .collect();
    let answer = Answer {
        object: "list",
        data,
        model: gw.backend.model().id.clone(),
        usage: EmbeddingsUsage {
            prompt_tokens: out.prompt_tokens,
            total_tokens: out.prompt_tokens,
        },
    };
    t.record(200, usage, None, format!("{n} embeddings"));
    json_response(&answer)
}

/// `value` as a JSON response: serialized by serde directly, so each `f32` is written in the
/// shortest form that reads back as the same `f32`.
pub(crate) fn json_response<T: Serialize>(value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(bytes) => (
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            bytes,
        )
            .into_response(),
        Err(e) => ApiError::internal(format!("writing the answer failed: {e}")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn inputs_take_every_shape_openai_documents() {
        let p = |v: Value| parse_inputs(Some(&v), "input", true);
        assert_eq!(p(json!("hi")), Ok(EmbedInputs::Texts(vec!["hi".into()])));
        assert_eq!(
            p(json!(["a", "b"])),
            Ok(EmbedInputs::Texts(vec!["a".into(), "b".into()]))
        );
        assert_eq!(p(json!([1, 2])), Ok(EmbedInputs::Tokens(vec![vec![1, 2]])));
        assert_eq!(
            p(json!([[1], [2, 3]])),
            Ok(EmbedInputs::Tokens(vec![vec![1], vec![2, 3]]))
        );
        for bad in [
            json!([]),
            json!(3),
            json!(["a", 1]),
            json!([-1]),
            json!([[1], 2]),
        ] {
            let e = p(bad.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("input"), "{bad}");
        }
        assert!(parse_inputs(None, "input", true).is_err());
        assert!(parse_inputs(Some(&json!([1])), "input", false).is_err());
    }

    #[test]
    fn too_many_inputs_are_refused_before_they_are_read() {
        let many = Value::Array(vec![
            json!(0);
            crate::limits::LIMITS.max_embedding_inputs + 1
        ]);
        let e = parse_inputs(Some(&many), "input", true).unwrap_err();
        assert!(e.message.contains("inputs"), "{}", e.message);
    }

    #[test]
    fn base64_is_the_little_endian_f32_bytes() {
        // 1.0f32 = 0x3f800000: bytes 00 00 80 3f.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[]), "");
    }

    #[test]
    fn normalized_vectors_have_unit_length_and_zero_stays_zero() {
        let mut v = vec![3.0f32, 4.0];
        l2_normalize(&mut v);
        assert_eq!(v, vec![0.6, 0.8]);
        let mut z = vec![0.0f32; 3];
        l2_normalize(&mut z);
        assert_eq!(z, vec![0.0; 3]);
    }
}
