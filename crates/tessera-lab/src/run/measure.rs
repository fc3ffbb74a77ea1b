//! Measuring the plans of a scenario run: each plan's requests alone, interleaved across the
//! plans, then the workload's concurrency of requests at once, also in rounds through the plans
//! (the machine's drift falls on all alike); and the bytes the switch carried between the
//! nodes' hosts per decoded token.

use std::path::{Path, PathBuf};

use tessera_proto::RunReport;

use super::report::Figures;
use super::ring::median;
use super::session::{self, Session};
use super::{pipeline, Measured, REPEATS, SHORT};
use crate::error::{LabError, Result};
use crate::lab::Lab;
use crate::scenario::Scenario;

/// The node hosts' traffic among themselves so far, bytes (the coordinator's host excluded).
fn node_bytes(lab: &Lab) -> u64 {
    let mut total = 0;
    for a in 1..lab.len() {
        for b in 1..lab.len() {
            if a != b {
                total += lab.switch().stats(a, b).bytes_out;
            }
        }
    }
    total
}

/// Bytes between the nodes per token of a request that moved `run.0` bytes for `run.1` tokens,
/// beyond a short one's (`short`); NaN when it decoded no more than the short one.
fn wire_per_token(run: (u64, usize), short: (u64, usize)) -> f64 {
    let extra = run.1 as f64 - short.1 as f64;
    if extra > 0.0 {
        run.0.saturating_sub(short.0) as f64 / extra
    } else {
        f64::NAN
    }
}

/// A plan's requests so far.
struct Partial {
    runs: Vec<RunReport>,
    /// The text of each measured request (`runs`), in order.
    texts: Vec<String>,
    /// Bytes between the nodes per decoded token: the least over the measured requests.
    wire: f64,
    /// The short request's bytes between the nodes and tokens, taken off each measured one's
    /// (so what is counted is the decode's, not the prefill's).
    short: (u64, usize),
    /// The workload's speculating requests, each right after a plain one (`None`: the
    /// workload does not speculate); their failure is theirs, not the plan's.
    speculating: Option<std::result::Result<Speculating, String>>,
}

/// A plan's requests measured speculating, and what each read.
#[derive(Default)]
pub(super) struct Speculating {
    /// Drafts per ring turn.
    pub(super) k: usize,
    /// Drafted from the plain request's tokens (the workload's `predict`), not by prompt
    /// lookup.
    pub(super) predicted: bool,
    pub(super) runs: Vec<RunReport>,
    pub(super) texts: Vec<String>,
}

impl Partial {
    /// One more speculating request with `k` drafts a turn, if the workload asks for them and
    /// none has failed.
    fn speculate(
        &mut self,
        (k, predicted): (usize, bool),
        run: impl FnOnce() -> Result<(RunReport, String)>,
    ) {
        if k == 0 {
            return;
        }
        let Ok(s) = self.speculating.get_or_insert_with(|| {
            Ok(Speculating {
                k,
                predicted,
                ..Speculating::default()
            })
        }) else {
            return;
        };
        match run() {
            Ok((r, text)) => {
                s.runs.push(r);
                s.texts.push(text);
            }
            Err(e) => self.speculating = Some(Err(e.to_string())),
        }
    }
}

/// The figures of each plan in `plans` (plan files, all runnable in `session`): for each, a
/// warm-up, a short and a measured request alone (the measured one's traffic less the short
/// one's is the decode's); then [`REPEATS`]` - 1` more rounds of one measured request per plan;
/// then the workload's concurrency of requests at once, [`REPEATS`] times (the median of the
/// tokens over the window all were decoding, [`pipeline::overlap_window`]). Where the workload
/// speculates, each measured request alone is followed by the same request speculating, so
/// the two see the same drift. A plan's failure is its own.
pub(super) fn measure(
    session: &Session,
    lab: &Lab,
    scenario: &Scenario,
    plans: &[PathBuf],
    concurrency: usize,
    progress: &mut dyn FnMut(&str),
) -> Vec<std::result::Result<Measured, String>> {
    let prompt = &scenario.workload.prompt;
    let tokens = scenario.workload.tokens;
    let predict = scenario.workload.predict;
    let k = (scenario.workload.speculate, predict);
    // With `predict`, the plain request's own tokens are the prediction: the drafts always
    // agree (the target as its own draft).
    let speculating = |plan: &Path, answer: &[u32]| -> Result<(RunReport, String)> {
        let prediction = predict.then_some(answer);
        let r = session.timed_speculating(lab, plan, prompt, tokens, k.0, prediction)?;
        Ok((r.report, r.text))
    };
    // One request alone, with the text it read (compared with one process's by the caller).
    let one = |plan: &Path, n: usize| -> Result<session::TimedRun> {
        Ok(session
            .timed_clients(lab, plan, &[prompt.as_str()], n)?
            .remove(0))
    };
    let first = |plan: &Path| -> Result<Partial> {
        one(plan, SHORT)?;
        let b0 = node_bytes(lab);
        let short = one(plan, SHORT)?.report;
        let b1 = node_bytes(lab);
        let run = one(plan, tokens)?;
        let b2 = node_bytes(lab);
        let short = (b1 - b0, short.generated);
        let wire = wire_per_token((b2 - b1, run.report.generated), short);
        let mut part = Partial {
            runs: vec![run.report],
            texts: vec![run.text],
            wire,
            short,
            speculating: None,
        };
        part.speculate(k, || speculating(plan, &run.tokens));
        Ok(part)
    };
    let mut parts: Vec<std::result::Result<Partial, String>> = plans
        .iter()
        .map(|p| first(p).map_err(|e| e.to_string()))
        .collect();
    for _ in 1..REPEATS {
        for (plan, part) in plans.iter().zip(parts.iter_mut()) {
            if let Ok(p) = part {
                let b0 = node_bytes(lab);
                match one(plan, tokens) {
                    Ok(r) => {
                        // The least of the rounds: traffic between the nodes that is not the
                        // plan's (their link probes after a start) only ever adds.
                        let round =
                            wire_per_token((node_bytes(lab) - b0, r.report.generated), p.short);
                        p.wire = p.wire.min(round);
                        p.runs.push(r.report);
                        p.texts.push(r.text);
                        p.speculate(k, || speculating(plan, &r.tokens));
                    }
                    Err(e) => *part = Err(e.to_string()),
                }
            }
        }
    }
    // The workload's concurrency of requests at once, in rounds that go through every plan in
    // turn (as the single requests above do), so the machine's drift falls on all alike: the
    // median of REPEATS rounds, since one round on a shared machine varies by a third from the
    // next.
    let at_once = if concurrency > 1 {
        at_once_interleaved(session, lab, scenario, plans, &parts, concurrency, progress)
    } else {
        Vec::new()
    };
    parts
        .into_iter()
        .enumerate()
        .map(|(i, part)| {
            let Partial {
                mut runs,
                texts,
                wire,
                speculating,
                ..
            } = part?;
            let mut ttft: Vec<f64> = runs.iter().map(|r| r.time_to_first_token_ms).collect();
            ttft.sort_by(f64::total_cmp);
            runs.sort_by(|a, b| a.decode_tokens_per_s.total_cmp(&b.decode_tokens_per_s));
            let report = runs.swap_remove(runs.len() / 2);
            let decode = report.decode_tokens_per_s;
            let throughput = match at_once.get(i) {
                Some(r) => r.clone()?,
                None => decode,
            };
            Ok(Measured {
                figures: Figures {
                    decode_tokens_per_s: decode,
                    ttft_ms: ttft[ttft.len() / 2],
                    throughput_tokens_per_s: throughput,
                    wire_bytes_per_token: wire,
                },
                report,
                texts,
                speculating,
            })
        })
        .collect()
}

/// Aggregate tokens/s of `concurrency` requests at once on each plan whose single requests
/// succeeded: a warm-up each, then [`REPEATS`] rounds through the plans in turn; each plan's
/// median. A plan whose requests fail keeps the error.
fn at_once_interleaved(
    session: &Session,
    lab: &Lab,
    scenario: &Scenario,
    plans: &[PathBuf],
    parts: &[std::result::Result<Partial, String>],
    concurrency: usize,
    progress: &mut dyn FnMut(&str),
) -> Vec<std::result::Result<f64, String>> {
    let prompt = scenario.workload.prompt.as_str();
    let tokens = scenario.workload.tokens;
    let mut rates: Vec<std::result::Result<Vec<f64>, String>> = parts
        .iter()
        .zip(plans)
        .map(|(part, plan)| match part {
            Ok(_) => session
                .clients(lab, plan, prompt, SHORT, concurrency)
                .map(|_| Vec::with_capacity(REPEATS))
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.clone()),
        })
        .collect();
    for _ in 0..REPEATS {
        for (plan, r) in plans.iter().zip(rates.iter_mut()) {
            let Ok(v) = r else { continue };
            match round_at_once(session, lab, plan, prompt, tokens, concurrency) {
                Ok((rate, went)) => {
                    progress(&format!(
                        "{concurrency} at once: {rate:.1} tok/s, requests by first stage: {went}"
                    ));
                    v.push(rate);
                }
                Err(e) => *r = Err(e.to_string()),
            }
        }
    }
    rates.into_iter().map(|r| r.map(median)).collect()
}

/// One round of `concurrency` requests at once on `plan`: tokens over the time every request
/// was decoding (a sum of each request's own rate counts as concurrent what staggered starts
/// ran alone), and where the requests went (the first stage of each one's placement).
fn round_at_once(
    session: &Session,
    lab: &Lab,
    plan: &Path,
    prompt: &str,
    tokens: usize,
    concurrency: usize,
) -> Result<(f64, String)> {
    let prompts = vec![prompt; concurrency];
    let runs = session.timed_clients(lab, plan, &prompts, tokens)?;
    let mut went = std::collections::BTreeMap::<String, usize>::new();
    for r in &runs {
        let first = r.report.stages.first().map_or("?", |s| s.name.as_str());
        *went.entry(first.to_string()).or_default() += 1;
    }
    let arrivals: Vec<Vec<std::time::Instant>> = runs.into_iter().map(|r| r.arrivals).collect();
    let (n, secs) = pipeline::overlap_window(&arrivals).ok_or_else(|| {
        LabError::NothingMeasured(format!(
            "the {concurrency} requests never decoded at the same time (raise the workload's \
             tokens)"
        ))
    })?;
    let went = went
        .iter()
        .map(|(k, v)| format!("{k}:{v}"))
        .collect::<Vec<_>>()
        .join(" ");
    Ok((n as f64 / secs, went))
}
