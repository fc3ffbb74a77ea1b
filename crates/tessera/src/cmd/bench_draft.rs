//! `tessera bench --draft`: speculative decoding against plain decoding in the same run
//! (`tessera_engine::speculate::bench`), on a prompt made for the draft source being measured.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use tessera_engine::speculate::bench::{bench_speculation, SpeculationBench};
use tessera_engine::speculate::ModelDraft;
use tessera_engine::{KvType, Model};
use tessera_model::{GgufFile, Tokenizer};
use tessera_sampling::speculate::{AdaptiveK, DraftSource, PromptLookup};
use tessera_sampling::SamplingParams;

/// Which prompt the draft benchmark decodes from.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftTask {
    /// A paragraph given twice and begun a third time: continuing it copies the input.
    Copy,
    /// A story opening to continue: little to copy.
    Story,
}

/// The paragraph of the copy task (written for this benchmark).
const PARAGRAPH: &str = "Once upon a time, there was a little girl named Lily. She loved to play \
    in the park with her red ball. One day, the ball rolled under a big tree, and a small dog \
    came to help her find it. Lily was very happy, and she shared her cookies with the dog.";

impl DraftTask {
    fn prompt(self) -> String {
        match self {
            Self::Copy => {
                let start: String = PARAGRAPH.split(". ").next().unwrap_or(PARAGRAPH).into();
                format!("{PARAGRAPH}\n\n{PARAGRAPH}\n\n{start}")
            }
            Self::Story => "Once upon a time, there was a little girl named Lily.".into(),
        }
    }
}

/// The flags of a draft benchmark.
pub struct Options {
    pub draft: String,
    pub max_k: Option<usize>,
    pub fixed: bool,
    pub task: DraftTask,
    pub n_gen: usize,
    pub repetitions: usize,
    pub threads: usize,
    pub kv_type: KvType,
    pub json: bool,
}

/// Measures speculation on `path` as `o` says and prints the report.
pub fn run(path: &Path, o: &Options) -> anyhow::Result<()> {
    let max_k = o.max_k.unwrap_or(super::speculate::DEFAULT_DRAFT_MAX);
    if !(1..=super::speculate::MAX_DRAFT_MAX).contains(&max_k) {
        bail!(
            "--draft-max must be between 1 and {}",
            super::speculate::MAX_DRAFT_MAX
        );
    }
    if o.n_gen == 0 {
        bail!("--draft needs tokens to generate (-n)");
    }
    let gguf = GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&gguf)?;
    let model = Arc::new(
        Model::load_full(&gguf, o.threads)
            .with_context(|| format!("loading {}", path.display()))?
            .with_kv_type(o.kv_type)
            .context("--kv-type")?,
    );
    let prompt = tokenizer.encode(&o.task.prompt(), true);
    let eog: Vec<u32> = (0..tokenizer.vocab_size() as u32)
        .filter(|&t| tokenizer.is_end_of_generation(t))
        .collect();
    let capacity = (prompt.len() + o.n_gen + 1).min(model.config().context_length);
    if prompt.len() + 1 >= capacity {
        bail!(
            "the {:?} prompt does not fit {}'s context",
            o.task,
            path.display()
        );
    }
    let (draft_model, fixed, name) = match o.draft.as_str() {
        "lookup" => (None, o.fixed, "lookup".to_string()),
        // Every draft agrees: adapting k would only turn a costly draft off.
        "self" => (Some(model.clone()), true, "self".to_string()),
        file => {
            let m =
                super::speculate::load_draft_model(Path::new(file), &gguf, o.threads, o.kv_type)?;
            (Some(Arc::new(m)), o.fixed, file.to_string())
        }
    };
    let mut drafter = || -> (Box<dyn DraftSource>, AdaptiveK) {
        let source: Box<dyn DraftSource> = match &draft_model {
            None => Box::new(PromptLookup::default()),
            Some(m) => Box::new(ModelDraft::new(m.clone(), capacity)),
        };
        let k = if fixed {
            AdaptiveK::fixed(max_k)
        } else {
            AdaptiveK::new(max_k)
        };
        (source, k)
    };
    let mut b = SpeculationBench {
        prompt: &prompt,
        n_gen: o.n_gen,
        eog: &eog,
        params: SamplingParams::greedy(),
        repetitions: o.repetitions,
        drafter: &mut drafter,
        draft_name: name,
    };
    let report = bench_speculation(&model, &mut b)?;
    if o.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("{} ({:?} task)\n{report}\n", path.display(), o.task);
    }
    if !report.same_tokens {
        bail!("speculative decoding changed the tokens: a bug, please report it");
    }
    Ok(())
}
