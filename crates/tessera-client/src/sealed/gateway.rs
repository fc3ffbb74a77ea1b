//! The gateway as a sealing client: plain OpenAI clients talk to a gateway they trust, and the
//! gateway seals each request to workers behind a coordinator it does not trust
//! (`tessera serve --sealed-via TOKEN@HOST:PORT`). The answer comes back whole (a sealed job is
//! answered once), so a stream gets all its tokens at the end. Under
//! [`ClientPolicy::verified_only`] an unverified answer is not released (the request fails);
//! otherwise every answer is marked: `"verified": true|false` on its final object (and on a
//! stream's last event) and an `x-tessera-verified` header on a whole response.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use tessera_api::{
    Backend, BackendCounters, Check, ClusterStatus, EmbeddingHandle, EmbeddingRequest, Event,
    FinishReason, GenerationRequest, RequestHandle, ServedModel, SubmitError, Usage,
};
use tessera_proto::{FinishReason as SeqFinish, SealedRequest};

use super::client::{ClientPolicy, SealedClient};

/// Settings of a sealed backend.
#[derive(Clone, Debug)]
pub struct SealedBackendConfig {
    /// Seal each request to at most this many workers (the first holds it; the others take
    /// over or check the answer).
    pub workers: usize,
    /// How long each envelope stays valid, ms.
    pub ttl_ms: u64,
    /// Whom to seal to, and whether unverified answers are released.
    pub policy: ClientPolicy,
}

/// A [`Backend`] that runs every request as a sealed job.
pub struct SealedBackend {
    model: Arc<ServedModel>,
    client: Arc<SealedClient>,
    config: SealedBackendConfig,
    eog: Arc<Vec<u32>>,
    /// Rotates the first candidate, so requests spread over the workers.
    next: AtomicUsize,
    /// Jobs in flight, prompt and generated tokens so far (for the dashboard and /metrics).
    active: Arc<AtomicUsize>,
    prompt_tokens: Arc<AtomicU64>,
    generated_tokens: Arc<AtomicU64>,
}

impl SealedBackend {
    pub fn new(model: ServedModel, client: SealedClient, config: SealedBackendConfig) -> Self {
        let eog = (0..model.tokenizer.vocab_size() as u32)
            .filter(|&t| model.is_end_of_generation(t))
            .collect();
        Self {
            model: Arc::new(model),
            client: Arc::new(client),
            config,
            eog: Arc::new(eog),
            next: AtomicUsize::new(0),
            active: Arc::default(),
            prompt_tokens: Arc::default(),
            generated_tokens: Arc::default(),
        }
    }
}

impl Backend for SealedBackend {
    fn model(&self) -> Arc<ServedModel> {
        self.model.clone()
    }

    /// A sealed job carries tokens out, not final hidden states.
    fn embed(&self, _req: EmbeddingRequest) -> Result<EmbeddingHandle, SubmitError> {
        Err(SubmitError::Unsupported(
            tessera_api::NO_CLUSTER_EMBEDDINGS.into(),
        ))
    }

    fn submit(&self, req: GenerationRequest) -> Result<RequestHandle, SubmitError> {
        req.check(self.model.context_length)?;
        let (handle, tx) = RequestHandle::channel(req.id);
        let request = SealedRequest {
            prompt_tokens: req.prompt_tokens,
            max_new_tokens: req.max_tokens,
            sampling: req.params,
            eog: self.eog.to_vec(),
        };
        let (client, config) = (self.client.clone(), self.config.clone());
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        let active = self.active.clone();
        let (prompt_total, generated_total) =
            (self.prompt_tokens.clone(), self.generated_tokens.clone());
        active.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(async move {
            let outcome = async {
                let (mut candidates, _) = client.trusted_holders(&config.policy.trust).await?;
                let n = candidates.len();
                candidates.rotate_left(first % n);
                candidates.truncate(config.workers.max(1));
                client
                    .run(
                        &request,
                        &candidates,
                        config.ttl_ms,
                        &config.policy,
                        |_, _| {},
                    )
                    .await
            }
            .await;
            match outcome {
                Ok(o) => {
                    let completion_tokens = o.answer.tokens.len();
                    let check = if o.verified {
                        Check::Verified
                    } else {
                        Check::Unverified
                    };
                    let _ = tx.send(Event::Checked(check));
                    for t in o.answer.tokens {
                        let _ = tx.send(Event::Token(t));
                    }
                    let reason = match o.answer.finish_reason {
                        SeqFinish::EndOfGeneration => FinishReason::Stop,
                        _ => FinishReason::Length,
                    };
                    prompt_total.fetch_add(request.prompt_tokens.len() as u64, Ordering::Relaxed);
                    generated_total.fetch_add(completion_tokens as u64, Ordering::Relaxed);
                    let _ = tx.send(Event::Finished {
                        reason,
                        usage: Usage {
                            prompt_tokens: request.prompt_tokens.len(),
                            completion_tokens,
                            cached_tokens: 0,
                        },
                    });
                }
                Err(e) => {
                    let _ = tx.send(Event::Failed {
                        message: e.to_string(),
                    });
                }
            }
            active.fetch_sub(1, Ordering::Relaxed);
        });
        Ok(handle)
    }

    fn status(&self) -> ClusterStatus {
        ClusterStatus {
            model: self.model.id.clone(),
            not_serving: None,
            counters: BackendCounters {
                active_sequences: self.active.load(Ordering::Relaxed),
                prompt_tokens_total: self.prompt_tokens.load(Ordering::Relaxed),
                generated_tokens_total: self.generated_tokens.load(Ordering::Relaxed),
                ..Default::default()
            },
            ..Default::default()
        }
    }
}
