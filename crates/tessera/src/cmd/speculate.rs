//! The speculative-decoding flags `tessera serve` and `tessera generate` share, checked into a
//! [`Speculation`] before any work: a draft model is opened and its vocabulary compared with
//! the target's here, so a mismatch is refused before the target loads.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use tessera_engine::speculate::{check_same_vocabulary, ModelDraft};
use tessera_engine::{KvType, Model};
use tessera_local::Speculation;
use tessera_model::{GgufFile, Tokenizer};
use tessera_sampling::speculate::{AdaptiveK, DraftSource, PromptLookup};

/// Where drafts come from.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpeculateMode {
    /// One token per forward pass.
    Off,
    /// Prompt lookup: draft by copying what followed the last few tokens earlier in the text.
    Lookup,
    /// A smaller model with the same vocabulary (`--draft-model`).
    Draft,
}

/// Most drafts per verification unless `--draft-max` says.
pub const DEFAULT_DRAFT_MAX: usize = 8;
/// Bounds `--draft-max`: a verification is one forward pass of `k + 1` rows.
pub const MAX_DRAFT_MAX: usize = 64;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct SpeculateArgs {
    /// Speculative decoding: `lookup` drafts from earlier in the text, `draft` with
    /// --draft-model; the drafts are verified several per forward pass and the text is the
    /// same as without. How many to draft adapts to the measured acceptance rate and costs,
    /// down to none. A distributed ring (`serve --nodes-expected`, `--split`, `--plan`) takes
    /// `lookup` only: the sampling stage drafts up to --draft-max (at most 16) with each token
    /// it sends back, and the ring checks them in one turn. [default: off, or draft when
    /// --draft-model is given]
    #[arg(long, value_enum)]
    pub speculate: Option<SpeculateMode>,
    /// GGUF draft model for `--speculate draft`; it must have the target's vocabulary.
    #[arg(long, value_name = "FILE")]
    pub draft_model: Option<PathBuf>,
    /// Most draft tokens per verification (1..=64). [default: 8]
    #[arg(long, value_name = "K")]
    pub draft_max: Option<usize>,
}

impl SpeculateArgs {
    /// Whether any speculation flag was given (modes that cannot speculate refuse them).
    pub fn given(&self) -> bool {
        self.speculate.is_some() || self.draft_model.is_some() || self.draft_max.is_some()
    }

    /// The mode and `k`, checked: no flag is accepted and then ignored.
    pub fn mode(&self) -> anyhow::Result<(SpeculateMode, usize)> {
        let mode = match (self.speculate, &self.draft_model) {
            (None, None) => SpeculateMode::Off,
            (None, Some(_)) | (Some(SpeculateMode::Draft), Some(_)) => SpeculateMode::Draft,
            (Some(SpeculateMode::Draft), None) => {
                bail!("--speculate draft needs --draft-model FILE")
            }
            (Some(m), Some(_)) => {
                bail!("--draft-model is only used with --speculate draft, not {m:?}")
            }
            (Some(m), None) => m,
        };
        let k = self.draft_max.unwrap_or(DEFAULT_DRAFT_MAX);
        if mode == SpeculateMode::Off && self.draft_max.is_some() {
            bail!("--draft-max needs --speculate lookup or draft");
        }
        if !(1..=MAX_DRAFT_MAX).contains(&k) {
            bail!("--draft-max must be between 1 and {MAX_DRAFT_MAX}");
        }
        Ok((mode, k))
    }

    /// Checks the flags and, for a draft model, its vocabulary against `target`'s, then loads
    /// it with `threads` threads.
    pub fn load(
        &self,
        target: &GgufFile,
        threads: usize,
        kv_type: KvType,
    ) -> anyhow::Result<Speculation> {
        let (mode, max_k) = self.mode()?;
        Ok(match mode {
            SpeculateMode::Off => Speculation::Off,
            SpeculateMode::Lookup => Speculation::Lookup { max_k },
            SpeculateMode::Draft => {
                let path = self.draft_model.as_deref().expect("checked by mode");
                let model = load_draft_model(path, target, threads, kv_type)?;
                Speculation::DraftModel {
                    model: Arc::new(model),
                    max_k,
                }
            }
        })
    }
}

/// Opens `path`, refuses it unless its vocabulary is `target`'s, and loads it.
pub fn load_draft_model(
    path: &Path,
    target: &GgufFile,
    threads: usize,
    kv_type: KvType,
) -> anyhow::Result<Model> {
    let g = GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
    let (t, d) = (Tokenizer::from_gguf(target)?, Tokenizer::from_gguf(&g)?);
    check_same_vocabulary(&t, &d).with_context(|| {
        format!(
            "--draft-model {} cannot draft for this model",
            path.display()
        )
    })?;
    let mut model =
        Model::load_full(&g, threads).with_context(|| format!("loading {}", path.display()))?;
    // The draft's heads may not allow the target's cache type: it keeps its default then.
    let _ = model.set_kv_type(kv_type);
    Ok(model)
}

/// A one-sequence drafter and its k controller, for [`tessera_engine::Generator`].
pub fn drafter(
    s: &Speculation,
    capacity: usize,
    fixed: bool,
) -> Option<(Box<dyn DraftSource>, AdaptiveK)> {
    let (source, max_k): (Box<dyn DraftSource>, usize) = match s {
        Speculation::Off => return None,
        Speculation::Lookup { max_k } => (Box::new(PromptLookup::default()), *max_k),
        Speculation::DraftModel { model, max_k } => {
            (Box::new(ModelDraft::new(model.clone(), capacity)), *max_k)
        }
    };
    let k = if fixed {
        AdaptiveK::fixed(max_k)
    } else {
        AdaptiveK::new(max_k)
    };
    Some((source, k))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(speculate: Option<SpeculateMode>, model: bool, k: Option<usize>) -> SpeculateArgs {
        SpeculateArgs {
            speculate,
            draft_model: model.then(|| PathBuf::from("d.gguf")),
            draft_max: k,
        }
    }

    #[test]
    fn no_flag_is_accepted_and_ignored() {
        use SpeculateMode::*;
        assert_eq!(args(None, false, None).mode().unwrap(), (Off, 8));
        assert_eq!(args(None, true, Some(3)).mode().unwrap(), (Draft, 3));
        assert_eq!(args(Some(Lookup), false, None).mode().unwrap(), (Lookup, 8));
        assert!(args(Some(Draft), false, None).mode().is_err());
        assert!(args(Some(Lookup), true, None).mode().is_err());
        assert!(args(Some(Off), true, None).mode().is_err());
        assert!(args(None, false, Some(4)).mode().is_err());
        assert!(args(Some(Lookup), false, Some(0)).mode().is_err());
        assert!(args(Some(Lookup), false, Some(65)).mode().is_err());
    }
}
