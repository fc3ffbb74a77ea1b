//! `tessera lab pipeline`: whether a stage ring keeps its stages busy together.
//!
//! Three nodes on this machine's loopback serve one model as a ring of `stages` equal layer
//! ranges (and, for the prefill figure, one of them alone):
//!
//! - **Decode at several streams.** `n` greedy clients at once (for each `n` of `streams`),
//!   each decoding `tokens`. The aggregate rate is every token after each stream's first over
//!   the window from the earliest first token to the last token (the instants the clients read
//!   them); a stage's busy share is the decode compute its run reports summed over the streams
//!   (a batched step's time is shared among its sequences, so the sum is the stage's) over that
//!   window. A ring that pipelines keeps several stages busy at once, so the shares add up to
//!   more than one and the aggregate grows with the streams; one whose sequences travel as one
//!   batch keeps one stage busy at a time.
//! - **Prefill across stages.** The time to first token of a `prompt_tokens` prompt on the
//!   ring against one node holding every layer, alternating (the coordinator's figure).
//!
//! Every host is this machine, so the stages share its cores: on fewer cores than stages the
//! busy shares cannot all reach one. The machine's load average is reported beside the figures.

use std::path::Path;
use std::time::Instant;

use serde::Serialize;
use tessera_proto::RunReport;

use super::ring::{load_average, median, placements, split, EqualHosts};
use super::session::{Loopback, Mode, Session};
use crate::error::{LabError, Result};

/// What `tessera lab pipeline` measures.
#[derive(Debug, Clone)]
pub struct Options {
    pub model: std::path::PathBuf,
    /// Stages of the ring (one node each).
    pub stages: usize,
    /// Concurrent streams to measure at, e.g. 1, 4, 8.
    pub streams: Vec<usize>,
    /// Tokens each stream decodes.
    pub tokens: usize,
    /// Rounds over every figure (alternating); medians are reported.
    pub rounds: usize,
    /// Prompt length of the prefill figure (0: no prefill figure).
    pub prompt_tokens: usize,
    /// Prompt tokens per prefill step.
    pub prefill_chunk: usize,
    /// Compute threads per node.
    pub threads: usize,
}

/// The ring's decode at one number of concurrent streams (medians over rounds).
#[derive(Debug, Clone, Serialize)]
pub struct StreamsFigure {
    pub streams: usize,
    /// Tokens per second over every stream together.
    pub aggregate_tokens_per_s: f64,
    /// `aggregate_tokens_per_s` over the one-stream figure of the same run.
    pub against_one_stream: Option<f64>,
    /// Each stage's decode compute over the window, in ring order.
    pub busy_share: Vec<f64>,
    /// Sequences per decode step, averaged over the stages' steps.
    pub mean_batch: f64,
}

/// Time to first token of a long prompt, one node against the ring (medians over rounds).
#[derive(Debug, Clone, Serialize)]
pub struct PrefillFigure {
    pub prompt_tokens: usize,
    pub prefill_chunk: usize,
    pub single_ttft_ms: f64,
    pub ring_ttft_ms: f64,
    /// `ring_ttft_ms / single_ttft_ms`; the goal is at most [`PREFILL_GOAL`].
    pub ratio: f64,
}

/// The goal for [`PrefillFigure::ratio`].
pub const PREFILL_GOAL: f64 = 1.2;

/// Everything `tessera lab pipeline` measured.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineReport {
    pub model: String,
    /// The ring's layer ranges, in order.
    pub layers: Vec<String>,
    pub tokens: usize,
    pub rounds: usize,
    pub threads: usize,
    pub streams: Vec<StreamsFigure>,
    pub prefill: Option<PrefillFigure>,
    /// The machine's 1-minute load average before and after.
    pub load_before: Option<f64>,
    pub load_after: Option<f64>,
    pub cores: usize,
}

/// Tokens decoded by every stream together and the window they took: each stream's tokens
/// after its first, from the earliest first token to the last token. `None` without any.
pub fn decode_window(arrivals: &[Vec<Instant>]) -> Option<(usize, f64)> {
    let start = arrivals.iter().filter_map(|a| a.first()).min()?;
    let end = arrivals.iter().filter_map(|a| a.last()).max()?;
    let tokens: usize = arrivals.iter().map(|a| a.len().saturating_sub(1)).sum();
    let secs = end.duration_since(*start).as_secs_f64();
    (tokens > 0 && secs > 0.0).then_some((tokens, secs))
}

/// Tokens decoded by every stream together while all of them were decoding, and that window:
/// from the last stream's first token to the first stream's last token, counting the tokens
/// that arrived after its start. An aggregate rate that a request running alone before the
/// others start (or after they end) does not inflate. `None` when the streams never overlap.
pub fn overlap_window(arrivals: &[Vec<Instant>]) -> Option<(usize, f64)> {
    let start = arrivals
        .iter()
        .map(|a| a.first())
        .collect::<Option<Vec<_>>>()?;
    let end = arrivals
        .iter()
        .map(|a| a.last())
        .collect::<Option<Vec<_>>>()?;
    let (start, end) = (**start.iter().max()?, **end.iter().min()?);
    let tokens = arrivals
        .iter()
        .flatten()
        .filter(|&&t| t > start && t <= end)
        .count();
    let secs = end.saturating_duration_since(start).as_secs_f64();
    (tokens > 0 && secs > 0.0).then_some((tokens, secs))
}

/// Per stage, in stage order (`stages` entries): decode compute (ns), sequence-steps (each
/// sequence counts every step it took part in) and the stage's own steps (millionths), summed
/// over the runs' reports.
pub fn decode_compute(reports: &[RunReport], stages: usize) -> Vec<(u64, u64, u64)> {
    let mut out = vec![(0u64, 0u64, 0u64); stages];
    for s in reports.iter().flat_map(|r| &r.stage_stats) {
        if let Some(o) = out.get_mut(s.stage) {
            o.0 += s.decode.compute_ns;
            o.1 += s.decode.steps;
            o.2 += s.decode_step_share_micro;
        }
    }
    out
}

/// Busy share of each stage over a window of `secs`, and the sequences per decode step
/// averaged over every stage's steps (`NaN` when the stages report no step shares).
pub fn shares(compute: &[(u64, u64, u64)], secs: f64) -> (Vec<f64>, f64) {
    let busy = compute
        .iter()
        .map(|&(ns, _, _)| ns as f64 / 1e9 / secs)
        .collect();
    let seq_steps: u64 = compute.iter().map(|c| c.1).sum();
    let steps = compute.iter().map(|c| c.2).sum::<u64>() as f64 / 1e6;
    let mean = if steps > 0.0 {
        seq_steps as f64 / steps
    } else {
        f64::NAN
    };
    (busy, mean)
}

/// A prompt of `words` words of plain prose.
fn prose(words: usize) -> String {
    const TEXT: &str = "The old lighthouse keeper climbed the stairs every evening to light the \
        lamp while the sea moved below and the gulls turned over the harbour and the boats came \
        home one by one with their nets full of silver fish for the market in the morning";
    TEXT.split_whitespace()
        .cycle()
        .take(words.max(1))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Measures the pipelining and prefill figures on loopback.
pub fn run(
    o: &Options,
    tessera: &Path,
    dir: &Path,
    mut progress: impl FnMut(&str),
) -> Result<PipelineReport> {
    let _copies = super::session::NodeModelCopies::removed_at_end(dir);
    let gguf = tessera_model::GgufFile::open(&o.model).map_err(|e| LabError::model(&o.model, e))?;
    let config = tessera_model::ModelConfig::from_gguf(&gguf)
        .map_err(|e| LabError::model(&o.model, format!("its configuration: {e}")))?;
    drop(gguf);
    if o.stages < 2 || config.n_layer < o.stages {
        return Err(LabError::Unrunnable(format!(
            "a ring of {} stages needs two stages or more and a model of as many layers (it has {})",
            o.stages, config.n_layer
        )));
    }
    // The prompt (counted here, a few tokens of numbering aside) and the answer.
    let context = (o.prompt_tokens + o.tokens + 64).max(512);
    if o.prompt_tokens > 0 && o.prompt_tokens + o.tokens > config.context_length {
        return Err(LabError::Unrunnable(format!(
            "a prompt of {} tokens does not fit the model's context of {}",
            o.prompt_tokens, config.context_length
        )));
    }
    let load_before = load_average();
    let s = EqualHosts {
        file: "pipeline.toml",
        model: &o.model,
        nodes: o.stages,
        rtt_ms: 0.0,
        context,
        tokens: o.tokens,
        threads: o.threads,
        cpu_quota: None,
    }
    .scenario()?;
    std::fs::create_dir_all(dir)
        .map_err(|e| LabError::io(format!("creating {}", dir.display()), e))?;
    let session = Session::start(&Loopback, tessera, &s, dir, &Mode::ByClient)?;
    progress(&format!("{} nodes up on loopback", o.stages));
    let ranges = split(config.n_layer, o.stages);
    let (single, ring) = placements(dir, config.n_layer, o.stages)?;
    let prompt = &s.workload.prompt;
    session.clients(&Loopback, &ring, prompt, 4, 1)?;

    // Decode at each number of streams, the order alternating between rounds.
    let mut per: Vec<Vec<(f64, Vec<f64>, f64)>> = vec![Vec::new(); o.streams.len()];
    for round in 0..o.rounds.max(1) {
        let mut order: Vec<usize> = (0..o.streams.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let n = o.streams[i];
            let runs =
                session.timed_clients(&Loopback, &ring, &vec![prompt.as_str(); n], o.tokens)?;
            let arrivals: Vec<Vec<Instant>> = runs.iter().map(|r| r.arrivals.clone()).collect();
            let reports: Vec<RunReport> = runs.into_iter().map(|r| r.report).collect();
            let Some((tokens, secs)) = decode_window(&arrivals) else {
                return Err(LabError::NothingMeasured(format!(
                    "{n} streams decoded nothing"
                )));
            };
            let (busy, batch) = shares(&decode_compute(&reports, o.stages), secs);
            progress(&format!(
                "round {}: {n} streams: {:.1} tok/s, busy {:?}, batch {batch:.2}",
                round + 1,
                tokens as f64 / secs,
                busy.iter()
                    .map(|b| format!("{:.0}%", b * 100.0))
                    .collect::<Vec<_>>()
            ));
            per[i].push((tokens as f64 / secs, busy, batch));
        }
    }
    let aggregate: Vec<f64> = per
        .iter()
        .map(|v| median(v.iter().map(|x| x.0).collect()))
        .collect();
    let one = o.streams.iter().position(|&n| n == 1).map(|i| aggregate[i]);
    let streams = o
        .streams
        .iter()
        .enumerate()
        .map(|(i, &n)| StreamsFigure {
            streams: n,
            aggregate_tokens_per_s: aggregate[i],
            against_one_stream: one.map(|one| aggregate[i] / one),
            busy_share: (0..o.stages)
                .map(|k| median(per[i].iter().map(|x| x.1[k]).collect()))
                .collect(),
            mean_batch: median(per[i].iter().map(|x| x.2).collect()),
        })
        .collect();

    let prefill = if o.prompt_tokens == 0 {
        None
    } else {
        Some(prefill(o, &session, &single, &ring, dir, &mut progress)?)
    };
    Ok(PipelineReport {
        model: o.model.display().to_string(),
        layers: ranges
            .iter()
            .map(|r| format!("{}..{}", r.start, r.end))
            .collect(),
        tokens: o.tokens,
        rounds: o.rounds.max(1),
        threads: o.threads,
        streams,
        prefill,
        load_before,
        load_after: load_average(),
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
    })
}

/// Time to first token of a `prompt_tokens` prompt, one node against the ring, alternating.
fn prefill(
    o: &Options,
    session: &Session,
    single: &Path,
    ring: &Path,
    session_dir: &Path,
    progress: &mut impl FnMut(&str),
) -> Result<PrefillFigure> {
    // Words for the prompt length asked, counted with the model's own tokenizer here (a
    // probe through the ring would prefill the whole prompt each time).
    let gguf = tessera_model::GgufFile::open(&o.model).map_err(|e| LabError::model(&o.model, e))?;
    let tokenizer = tessera_model::Tokenizer::from_gguf(&gguf)
        .map_err(|e| LabError::model(&o.model, format!("its tokenizer: {e}")))?;
    drop(gguf);
    let count = |words: usize| {
        tokenizer
            .encode(&format!("00. {}", prose(words)), true)
            .len()
    };
    let mut words = o.prompt_tokens.max(1);
    while words > 1 && count(words) > o.prompt_tokens {
        words = (words * o.prompt_tokens / count(words))
            .min(words - 1)
            .max(1);
    }
    while count(words + 1) <= o.prompt_tokens {
        words += 1;
    }
    let mut got = count(words);
    let text = prose(words);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for round in 0..o.rounds.max(1) {
        let first_single = round % 2 == 0;
        for on_ring in [!first_single, first_single] {
            let plan = if on_ring { ring } else { single };
            // A prompt of its own per request: a kept cache of an earlier one must not serve it.
            let text = format!("{round}{}. {text}", u8::from(on_ring));
            let r = session.one_with(&Loopback, plan, &text, 1, o.prefill_chunk)?;
            got = r.prompt_tokens;
            let name = format!(
                "prefill-{round}-{}.json",
                if on_ring { "ring" } else { "single" }
            );
            if let Ok(json) = serde_json::to_string(&r) {
                let _ = std::fs::write(session_dir.join(name), json);
            }
            if on_ring { &mut b } else { &mut a }.push(r.time_to_first_token_ms);
        }
        progress(&format!(
            "round {}: prefill of {got} tokens: one node {:.0} ms, ring {:.0} ms",
            round + 1,
            a.last().copied().unwrap_or(f64::NAN),
            b.last().copied().unwrap_or(f64::NAN)
        ));
    }
    let (single_ttft_ms, ring_ttft_ms) = (median(a), median(b));
    Ok(PrefillFigure {
        prompt_tokens: got,
        prefill_chunk: o.prefill_chunk,
        single_ttft_ms,
        ring_ttft_ms,
        ratio: ring_ttft_ms / single_ttft_ms,
    })
}

/// The figures as a table.
pub fn table(r: &PipelineReport) -> String {
    let mut s = format!(
        "{}-stage ring {} of {} on loopback, {} thread(s) a node, {} tokens a stream, medians of \
         {} rounds; {} cores, load average {} → {}\n",
        r.layers.len(),
        r.layers.join(" → "),
        r.model,
        r.threads,
        r.tokens,
        r.rounds,
        r.cores,
        r.load_before.map_or("?".into(), |l| format!("{l:.2}")),
        r.load_after.map_or("?".into(), |l| format!("{l:.2}")),
    );
    s.push_str(&format!(
        "{:>7} {:>12} {:>10} {:>10} {:>}\n",
        "streams", "aggr tok/s", "vs 1", "batch", "busy share per stage (sum)"
    ));
    for f in &r.streams {
        let sum: f64 = f.busy_share.iter().sum();
        s.push_str(&format!(
            "{:>7} {:>12.1} {:>10} {:>10.2} {} ({:.0}%)\n",
            f.streams,
            f.aggregate_tokens_per_s,
            f.against_one_stream
                .map_or("-".into(), |x| format!("{x:.2}x")),
            f.mean_batch,
            f.busy_share
                .iter()
                .map(|b| format!("{:.0}%", b * 100.0))
                .collect::<Vec<_>>()
                .join(" / "),
            sum * 100.0
        ));
    }
    if let Some(p) = &r.prefill {
        s.push_str(&format!(
            "prefill of {} tokens (chunks of {}): time to first token one node {:.0} ms, ring \
             {:.0} ms = {:.2}x (goal ≤ {PREFILL_GOAL}x)\n",
            p.prompt_tokens, p.prefill_chunk, p.single_ttft_ms, p.ring_ttft_ms, p.ratio
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::super::test_reports::{decode, report};
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_window_runs_from_the_earliest_first_token_to_the_last_token() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Two streams: one's tokens at 100..=400, the other's at 250..=500.
        let a = vec![at(100), at(200), at(300), at(400)];
        let b = vec![at(250), at(500)];
        let (tokens, secs) = decode_window(&[a, b]).unwrap();
        assert_eq!(tokens, 3 + 1);
        assert!((secs - 0.4).abs() < 1e-9);
        assert_eq!(decode_window(&[vec![at(1)]]), None);
    }

    #[test]
    fn the_overlap_counts_only_tokens_while_every_stream_decodes() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Overlap from 250 (b's first) to 400 (a's last): a's 300 and 400, b's none yet.
        let a = vec![at(100), at(200), at(300), at(400)];
        let b = vec![at(250), at(350), at(500)];
        let (tokens, secs) = overlap_window(&[a.clone(), b]).unwrap();
        assert_eq!(tokens, 3, "a's 300 and 400, b's 350");
        assert!((secs - 0.15).abs() < 1e-9);
        // One stream ends before the other starts: no overlap to measure.
        assert_eq!(overlap_window(&[a, vec![at(450), at(600)]]), None);
    }

    #[test]
    fn busy_shares_sum_each_stages_decode_compute_over_the_streams() {
        let report = |stage0: u64, stage1: u64| {
            let mut stats = vec![decode(0, stage0, 10), decode(1, stage1, 10)];
            for s in &mut stats {
                s.decode_step_share_micro = 5_000_000;
            }
            report(stats, 2)
        };
        let c = decode_compute(
            &[report(100_000_000, 50_000_000), report(100_000_000, 0)],
            2,
        );
        assert_eq!(c[0], (200_000_000, 20, 10_000_000));
        let (busy, batch) = shares(&c, 0.5);
        assert!((busy[0] - 0.4).abs() < 1e-9 && (busy[1] - 0.1).abs() < 1e-9);
        // Two sequences, every step carrying both: a batch of two.
        assert!((batch - 2.0).abs() < 1e-9);
    }
}
