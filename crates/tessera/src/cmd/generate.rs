//! `tessera generate`: one prompt, one process, tokens streamed to stdout as they are produced.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use tessera_engine::{Generator, LoadSpec, Model};
use tessera_model::{ChatMessage, ChatTemplate, GgufFile, ModelConfig, StreamDecoder, Tokenizer};
use tessera_sampling::StopMatcher;

use super::progress::LoadProgress;

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// GGUF model file (default: the built-in stories260K).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// The prompt.
    #[arg(short, long)]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 128)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: super::sampling::SamplingArgs,
    /// Stop when this text is generated (may be repeated).
    #[arg(long)]
    stop: Vec<String>,
    /// Treat the prompt as a user message and apply the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Compute threads (default: all cores).
    #[arg(short, long)]
    threads: Option<usize>,
    /// KV cache element type: f16 (default), q8_0 or f32 (llama.cpp's non-flash numerics).
    #[arg(long, default_value = "f16")]
    kv_type: tessera_engine::KvType,
    /// Print timing figures to stderr at the end.
    #[arg(long)]
    stats: bool,
    #[command(flatten)]
    speculate: super::speculate::SpeculateArgs,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let params = args.sampling.params()?;
    let path = crate::default_model::resolve(args.model)?;
    let gguf = GgufFile::open(&path)?;
    let config = ModelConfig::from_gguf(&gguf)?;
    let tokenizer = Tokenizer::from_gguf(&gguf)?;
    let prompt = if args.chat {
        let template = ChatTemplate::from_gguf(&gguf, &tokenizer)?;
        template.encode(&tokenizer, &[ChatMessage::new("user", &args.prompt)], true)?
    } else {
        tokenizer.encode(&args.prompt, true)
    };
    if prompt.len() >= config.context_length {
        anyhow::bail!(
            "the prompt is {} tokens; {} allows at most {} (its context length) including the reply",
            prompt.len(),
            path.display(),
            config.context_length
        );
    }
    let threads = args.threads.unwrap_or_else(super::default_threads);
    let speculation = args.speculate.load(&gguf, threads, args.kv_type)?;
    let mut progress = LoadProgress::new(&gguf);
    let model = Model::load(
        &gguf,
        LoadSpec::full(&config),
        threads,
        &mut |done, total| progress.update(done, total),
    )
    .with_context(|| format!("loading {}", path.display()))?
    .with_kv_type(args.kv_type)
    .context("--kv-type")?;
    progress.finish();

    let mut eog: Vec<u32> = (0..tokenizer.vocab_size() as u32)
        .filter(|&t| tokenizer.is_end_of_generation(t))
        .collect();
    // A llama-family model that emits BOS has finished its document (stories260K ends each story
    // this way).
    eog.extend(tokenizer.bos_id());

    let capacity = (prompt.len() + args.max_tokens).min(config.context_length);
    let mut generator = Generator::new(&model, params, capacity);
    if let Some((source, k)) = super::speculate::drafter(&speculation, capacity, false) {
        generator = generator.with_speculation(source, k);
    }
    let mut decoder = StreamDecoder::new(&tokenizer);
    let mut stops = StopMatcher::new(args.stop);
    let mut out = std::io::stdout().lock();
    if !args.chat {
        write!(out, "{}", args.prompt)?;
        out.flush()?;
    }
    let mut io_error = None;
    let stats = generator.generate(&prompt, args.max_tokens, &eog, &mut |token| {
        let step = stops.push(&decoder.push(token));
        if let Err(e) = write!(out, "{}", step.emit).and_then(|_| out.flush()) {
            io_error = Some(e);
            return false;
        }
        !step.stopped
    })?;
    if let Some(e) = io_error {
        return Err(e.into());
    }
    let tail = stops.push(&decoder.finish());
    let held = if tail.stopped {
        String::new()
    } else {
        stops.finish()
    };
    write!(out, "{}{held}", tail.emit)?;
    writeln!(out)?;
    if args.stats {
        let s = &stats;
        eprintln!(
            "prompt {} tokens in {:.3} s ({:.1} tok/s); generated {} tokens in {:.3} s ({:.1} tok/s); stop: {:?}",
            s.prompt_tokens,
            s.prefill_time.as_secs_f64(),
            s.prompt_tokens as f64 / s.prefill_time.as_secs_f64().max(1e-9),
            s.generated_tokens,
            s.decode_time.as_secs_f64(),
            s.generated_tokens as f64 / s.decode_time.as_secs_f64().max(1e-9),
            s.stop
        );
        let sp = &s.speculation;
        if sp.drafted > 0 {
            eprintln!(
                "speculation: {} of {} drafts accepted ({:.1}%), {:.2} tokens per verification, drafting {:.3} s",
                sp.accepted,
                sp.drafted,
                100.0 * sp.acceptance_rate(),
                s.generated_tokens as f64 / sp.verifications.max(1) as f64,
                sp.draft_time.as_secs_f64()
            );
        }
    }
    Ok(())
}
