//! Sequence embeddings: a sequence's final hidden states (after the output norm, before the
//! head) pooled into one vector.
//!
//! How the rows are pooled is the model's: the GGUF's `{arch}.pooling_type` when it has one
//! (llama.cpp's numbering: 1 mean, 2 CLS — the first token, 3 last), and mean pooling when it
//! has none, as for every causal LM converted for generation. A [`Pooler`] takes a sequence's
//! rows in position order, in as many chunks as the caller likes, and gives the same vector
//! bit for bit however they were chunked: a server can spread a long input over several
//! forward passes, and share each pass with other sequences (the kernels are batch-invariant),
//! and still answer exactly what [`Model::sequence_embedding`] computes in one pass.
//!
//! Normalizing is the front end's choice: OpenAI's and Ollama's `/api/embed` answers are unit
//! vectors, Ollama's older `/api/embeddings` is not (`tessera_gateway::embeddings`).

use tessera_model::GgufFile;

use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::{Hidden, Model, SeqStep};
use crate::moe::LocalExperts;

/// How a sequence's rows become one vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The mean of every position's row.
    Mean,
    /// The first position's row (BERT's CLS token).
    First,
    /// The last position's row.
    Last,
}

/// A `pooling_type` this engine does not pool by.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("this model's pooling type is {name} ({key} = {value}): it does not pool its rows into one vector, so no sequence embedding is served")]
pub struct UnsupportedPooling {
    pub key: String,
    pub value: u64,
    pub name: &'static str,
}

impl Pooling {
    /// The model's pooling: `{arch}.pooling_type` when present, otherwise [`Pooling::Mean`]
    /// (a causal LM's file has no such key).
    pub fn from_gguf(g: &GgufFile) -> std::result::Result<Self, UnsupportedPooling> {
        let arch = g
            .meta("general.architecture")
            .and_then(|v| v.as_str())
            .unwrap_or_default();
        let key = format!("{arch}.pooling_type");
        let Some(value) = g.meta(&key).and_then(|v| v.as_u64()) else {
            return Ok(Self::Mean);
        };
        Self::from_type(value).map_err(|name| UnsupportedPooling { key, value, name })
    }

    /// llama.cpp's `enum llama_pooling_type` value; the name of a refused one.
    pub fn from_type(value: u64) -> std::result::Result<Self, &'static str> {
        match value {
            1 => Ok(Self::Mean),
            2 => Ok(Self::First),
            3 => Ok(Self::Last),
            0 => Err("none (one vector per token)"),
            4 => Err("rank (a reranker's score)"),
            _ => Err("unknown"),
        }
    }

    /// The name used in documents and logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::Mean => "mean",
            Self::First => "first (CLS)",
            Self::Last => "last",
        }
    }
}

/// One sequence's pooled vector, fed its final hidden rows in position order.
#[derive(Clone, Debug)]
pub struct Pooler {
    pooling: Pooling,
    /// Mean: the running sum (f64, summed in position order); First/Last: the row kept.
    acc: Vec<f64>,
    rows: usize,
}

impl Pooler {
    pub fn new(pooling: Pooling, n_embd: usize) -> Self {
        Self {
            pooling,
            acc: vec![0.0; n_embd],
            rows: 0,
        }
    }

    /// Rows seen so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Which of the next `n` positions' rows this pooling reads, as offsets into those `n`
    /// (the output norm need only be computed for them). `is_end`: these are the last.
    pub fn wanted(&self, n: usize, is_end: bool) -> std::ops::Range<usize> {
        match self.pooling {
            Pooling::Mean => 0..n,
            Pooling::First if self.rows == 0 => 0..n.min(1),
            Pooling::Last if is_end => n.saturating_sub(1)..n,
            Pooling::First | Pooling::Last => 0..0,
        }
    }

    /// Takes the rows [`Pooler::wanted`] named for the next `n` positions (`rows` holds
    /// exactly those), and counts the `n` positions as seen.
    pub fn push(&mut self, n: usize, is_end: bool, rows: &Hidden) {
        let want = self.wanted(n, is_end);
        debug_assert_eq!(rows.n_tokens, want.len());
        match self.pooling {
            Pooling::Mean => {
                for r in 0..rows.n_tokens {
                    for (a, &x) in self.acc.iter_mut().zip(rows.row(r)) {
                        *a += f64::from(x);
                    }
                }
            }
            Pooling::First | Pooling::Last => {
                if rows.n_tokens > 0 {
                    for (a, &x) in self.acc.iter_mut().zip(rows.row(0)) {
                        *a = f64::from(x);
                    }
                }
            }
        }
        self.rows += n;
    }

    /// The pooled vector (not normalized).
    pub fn finish(self) -> Vec<f32> {
        let div = match self.pooling {
            Pooling::Mean => self.rows.max(1) as f64,
            Pooling::First | Pooling::Last => 1.0,
        };
        self.acc.iter().map(|&a| (a / div) as f32).collect()
    }
}

/// Feeds `pooler` the final hidden rows it wants of `hidden` (the rows of positions
/// `pooler.rows()..pooler.rows() + hidden.n_tokens` of one sequence of `len` positions).
pub fn pool_rows(model: &Model, pooler: &mut Pooler, hidden: &Hidden, len: usize) -> Result<()> {
    let n = hidden.n_tokens;
    let is_end = pooler.rows() + n == len;
    let want = pooler.wanted(n, is_end);
    let normed = model.output_norm(&hidden.rows(want))?;
    pooler.push(n, is_end, &normed);
    Ok(())
}

impl Model {
    /// The reference: `tokens` run as one sequence in one forward pass from position 0 on a
    /// fresh cache, its final hidden states pooled by `pooling` (not normalized).
    pub fn sequence_embedding(&self, tokens: &[u32], pooling: Pooling) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(EngineError::BadInput("no tokens to embed".into()));
        }
        let limit = self.config().context_length;
        if tokens.len() > limit {
            return Err(EngineError::ContextOverflow {
                needed: tokens.len(),
                limit,
            });
        }
        let mut kv: KvCache = self.new_kv(tokens.len());
        let mut hidden = self.embed(tokens)?;
        self.run_layers(
            0..self.config().n_layer,
            &mut hidden,
            &[SeqStep {
                n_tokens: tokens.len(),
                start_pos: 0,
            }],
            &mut [&mut kv],
            &mut LocalExperts(self),
        )?;
        let mut pooler = Pooler::new(pooling, self.config().n_embd);
        pool_rows(self, &mut pooler, &hidden, tokens.len())?;
        Ok(pooler.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(data: &[&[f32]]) -> Hidden {
        Hidden {
            n_tokens: data.len(),
            n_embd: data.first().map_or(0, |r| r.len()),
            data: data.concat(),
        }
    }

    /// Feeds `all` (the rows of one sequence) to a pooler in chunks of `chunk` positions.
    fn pooled(pooling: Pooling, all: &[&[f32]], chunk: usize) -> Vec<f32> {
        let mut p = Pooler::new(pooling, all[0].len());
        for c in all.chunks(chunk) {
            let is_end = p.rows() + c.len() == all.len();
            let want = p.wanted(c.len(), is_end);
            p.push(c.len(), is_end, &rows(&c[want]));
        }
        p.finish()
    }

    #[test]
    fn mean_first_and_last_pool_the_rows_they_name() {
        let all: [&[f32]; 3] = [&[1.0, -2.0], &[3.0, 0.0], &[5.0, 8.0]];
        assert_eq!(pooled(Pooling::Mean, &all, 3), vec![3.0, 2.0]);
        assert_eq!(pooled(Pooling::First, &all, 3), vec![1.0, -2.0]);
        assert_eq!(pooled(Pooling::Last, &all, 3), vec![5.0, 8.0]);
    }

    #[test]
    fn chunking_changes_no_bit_of_the_pooled_vector() {
        let all: Vec<Vec<f32>> = (0..7)
            .map(|i| (0..4).map(|j| ((i * 7 + j) as f32).sin() * 1e3).collect())
            .collect();
        let all: Vec<&[f32]> = all.iter().map(Vec::as_slice).collect();
        for pooling in [Pooling::Mean, Pooling::First, Pooling::Last] {
            let whole = pooled(pooling, &all, 7);
            for chunk in 1..7 {
                assert_eq!(
                    pooled(pooling, &all, chunk),
                    whole,
                    "{pooling:?} by {chunk}"
                );
            }
        }
    }

    /// A header of string and u32 metadata, no tensors.
    fn header(kvs: &[(&str, Result<&str, u32>)]) -> GgufFile {
        fn put_str(out: &mut Vec<u8>, s: &str) {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        }
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        out.extend((kvs.len() as u64).to_le_bytes());
        for (k, v) in kvs {
            put_str(&mut out, k);
            match v {
                Ok(s) => {
                    out.extend(8u32.to_le_bytes());
                    put_str(&mut out, s);
                }
                Err(n) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(n.to_le_bytes());
                }
            }
        }
        GgufFile::parse(&out).unwrap()
    }

    #[test]
    fn the_pooling_key_is_read_under_the_architecture_and_mean_is_the_default() {
        let arch = ("general.architecture", Ok("qwen3"));
        assert_eq!(Pooling::from_gguf(&header(&[arch])), Ok(Pooling::Mean));
        let last = header(&[arch, ("qwen3.pooling_type", Err(3))]);
        assert_eq!(Pooling::from_gguf(&last), Ok(Pooling::Last));
        let cls = header(&[arch, ("qwen3.pooling_type", Err(2))]);
        assert_eq!(Pooling::from_gguf(&cls), Ok(Pooling::First));
        // Another architecture's key is not this model's.
        let other = header(&[arch, ("bert.pooling_type", Err(3))]);
        assert_eq!(Pooling::from_gguf(&other), Ok(Pooling::Mean));
        let rank = header(&[arch, ("qwen3.pooling_type", Err(4))]);
        let e = Pooling::from_gguf(&rank).unwrap_err();
        assert!(e.to_string().contains("qwen3.pooling_type = 4"), "{e}");
    }

    #[test]
    fn pooling_types_follow_llama_cpp_and_refuse_what_is_not_one_vector() {
        assert_eq!(Pooling::from_type(1), Ok(Pooling::Mean));
        assert_eq!(Pooling::from_type(2), Ok(Pooling::First));
        assert_eq!(Pooling::from_type(3), Ok(Pooling::Last));
        assert!(Pooling::from_type(0).is_err());
        assert!(Pooling::from_type(4).is_err());
        assert!(Pooling::from_type(99).is_err());
    }
}
