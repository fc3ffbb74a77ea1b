//! What a scenario run found, as one table (or JSON): every plan the planner ranked, with its
//! prediction and, where the fabric could execute it, what the lab measured. Pure.

use serde::Serialize;
use tessera_plan::{Objective, Prediction};

/// The figures compared, predicted or measured.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Figures {
    /// Decode tokens/s of one request alone.
    pub decode_tokens_per_s: f64,
    /// Time to first token of the workload's prompt, ms.
    pub ttft_ms: f64,
    /// Aggregate decode tokens/s with the workload's concurrency of requests at once.
    pub throughput_tokens_per_s: f64,
    /// Bytes between the scenario's nodes per decoded token (the switch's count, framing
    /// included; predicted: the planner's hops).
    pub wire_bytes_per_token: f64,
}

impl Figures {
    pub fn predicted(p: &Prediction) -> Self {
        Self {
            decode_tokens_per_s: p.decode_tokens_per_s,
            ttft_ms: p.ttft_s * 1e3,
            throughput_tokens_per_s: p.throughput_tokens_per_s,
            wire_bytes_per_token: p.hops.iter().map(|h| h.wire_bytes_per_token).sum(),
        }
    }

    /// The objective's score at `concurrency` (as [`Prediction::score`]).
    pub fn score(&self, objective: Objective, concurrency: u32) -> f64 {
        let per_request = self.throughput_tokens_per_s / f64::from(concurrency.max(1));
        match objective {
            Objective::Latency => per_request,
            Objective::Throughput => self.throughput_tokens_per_s,
            Objective::Balanced => (per_request * self.throughput_tokens_per_s).sqrt(),
        }
    }
}

/// A plan's texts against one process's: greedy, so any difference is a fault.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TextCheck {
    /// Its measured requests whose text equalled one process's.
    pub identical: usize,
    pub checked: usize,
    /// The first text that differed.
    pub differing: Option<String>,
}

impl TextCheck {
    /// `texts` (a plan's requests) against `reference` (one process's).
    pub fn of(texts: &[String], reference: &str) -> Self {
        Self {
            identical: texts.iter().filter(|t| *t == reference).count(),
            checked: texts.len(),
            differing: texts.iter().find(|t| *t != reference).cloned(),
        }
    }

    pub fn all_identical(&self) -> bool {
        self.checked > 0 && self.identical == self.checked
    }
}

/// A plan's requests measured again speculating by prompt lookup, each right after a plain
/// one.
#[derive(Debug, Clone, Serialize)]
pub struct Speculation {
    /// Drafts per ring turn.
    pub k: usize,
    /// Drafted from the plain request's tokens sent as the prediction (the mechanism's
    /// ceiling), not by prompt lookup.
    pub predicted: bool,
    /// The speculating requests' median decode, tok/s.
    pub decode_tokens_per_s: f64,
    /// Over the plain requests' median decode.
    pub speedup: f64,
    /// Summed over the speculating requests' sampling stages: the steps that checked drafts,
    /// the drafts sent, and those the draws agreed with.
    pub verifications: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// Their texts against one process's.
    pub text: TextCheck,
    /// What the planner predicts for them, calibrated on the one-node plan's speculating
    /// requests (`None`: none was measured).
    pub predicted_tokens_per_s: Option<f64>,
}

impl Speculation {
    /// From the speculating requests' reports and texts, against the plain requests' median
    /// decode `plain` and one process's text `reference`.
    pub fn of(
        (k, predicted): (usize, bool),
        runs: &[tessera_proto::RunReport],
        texts: &[String],
        plain: f64,
        reference: &str,
    ) -> Self {
        let mut rates: Vec<f64> = runs.iter().map(|r| r.decode_tokens_per_s).collect();
        rates.sort_by(f64::total_cmp);
        let decode = rates.get(rates.len() / 2).copied().unwrap_or(f64::NAN);
        let sum = |f: fn(&tessera_proto::StageSeqStats) -> u64| -> u64 {
            runs.iter().flat_map(|r| &r.stage_stats).map(f).sum::<u64>()
        };
        Self {
            k,
            predicted,
            decode_tokens_per_s: decode,
            speedup: decode / plain,
            verifications: sum(|s| s.verifications),
            drafted: sum(|s| s.drafted),
            accepted: sum(|s| s.drafts_accepted),
            text: TextCheck::of(texts, reference),
            predicted_tokens_per_s: None,
        }
    }

    /// One line for the table.
    fn line(&self) -> String {
        let share = if self.drafted > 0 {
            format!(
                " ({:.0}%)",
                100.0 * self.accepted as f64 / self.drafted as f64
            )
        } else {
            String::new()
        };
        let per_check = if self.verifications > 0 {
            format!(
                ", {:.2} tokens a verifying turn",
                1.0 + self.accepted as f64 / self.verifications as f64
            )
        } else {
            String::new()
        };
        let predicted = match self.predicted_tokens_per_s {
            Some(p) => format!(
                "; predicted {} tok/s calibrated ({:+.0}%)",
                num(Some(p)),
                100.0 * (p / self.decode_tokens_per_s - 1.0)
            ),
            None => String::new(),
        };
        format!(
            "speculating ({}, k = {}): decode {} tok/s, {:.2}× without; {} of {} \
             drafts accepted{share}{per_check}{predicted}; text {}",
            if self.predicted {
                "the plain request's tokens as the prediction"
            } else {
                "prompt lookup"
            },
            self.k,
            num(Some(self.decode_tokens_per_s)),
            self.speedup,
            self.accepted,
            self.drafted,
            if self.text.all_identical() {
                "same".to_string()
            } else {
                format!(
                    "DIFFERS ({} of {} identical)",
                    self.text.identical, self.text.checked
                )
            }
        )
    }
}

/// One plan the planner ranked.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub strategy: String,
    pub description: String,
    /// See [`super::plans::Candidate::role`].
    pub role: String,
    pub predicted: Figures,
    /// `None` where the fabric cannot execute the plan ([`Row::note`] says why) or its run failed.
    pub measured: Option<Figures>,
    /// Why it was not measured.
    pub note: Option<String>,
    /// (predicted − measured) / measured, of the objective's score.
    pub error: Option<f64>,
    /// Among the measured plans, by the objective's score (1 = best).
    pub predicted_rank: Option<usize>,
    pub measured_rank: Option<usize>,
    /// The prediction after calibration on the reference run.
    pub calibrated: Option<Figures>,
    pub calibrated_error: Option<f64>,
    /// Its measured requests' texts against one process's (`None`: not measured).
    pub text: Option<TextCheck>,
    /// The same requests speculating, where the workload asks (or why they failed).
    pub speculation: Option<std::result::Result<Speculation, String>>,
    /// Each stage that streamed experts from its disk in the measured run's decode.
    pub streaming: Vec<StageStreaming>,
    /// Each home stage of an expert split: what its experts' owners did in that decode.
    pub owners: Vec<SplitOwners>,
}

/// What a stage's expert cache did over a measured request's decode: the figures that decide
/// a node streaming experts (and what the planner's hit-rate model is checked against).
#[derive(Debug, Clone, Serialize)]
pub struct StageStreaming {
    pub node: String,
    /// Expert lookups a decode token, and the share served from memory.
    pub lookups_per_token: f64,
    pub hit_rate: f64,
    /// Bytes read from disk a decode token (misses and prefetches), MiB.
    pub disk_mib_per_token: f64,
    /// Time the computation waited for reads a decode token, ms.
    pub read_wait_ms_per_token: f64,
}

impl StageStreaming {
    /// The streaming stages of `report`'s decode.
    pub fn of(report: &tessera_proto::RunReport) -> Vec<Self> {
        report
            .stage_stats
            .iter()
            .filter(|s| s.decode.expert_lookups > 0)
            .map(|s| {
                let d = &s.decode;
                let per_token = |x: f64| x / d.steps.max(1) as f64;
                Self {
                    node: stage_name(report, s.stage),
                    lookups_per_token: per_token(d.expert_lookups as f64),
                    hit_rate: 1.0 - d.expert_misses as f64 / d.expert_lookups as f64,
                    disk_mib_per_token: per_token(d.expert_disk_bytes as f64) / (1 << 20) as f64,
                    read_wait_ms_per_token: per_token(d.expert_read_wait_ns as f64) / 1e6,
                }
            })
            .collect()
    }

    fn line(&self) -> String {
        format!(
            "{} streamed experts: {:.1} lookups a token, {:.0}% from memory, {:.2} MiB read \
             and {:.1} ms waiting for reads a token",
            self.node,
            self.lookups_per_token,
            self.hit_rate * 100.0,
            self.disk_mib_per_token,
            self.read_wait_ms_per_token
        )
    }
}

/// What the owners of a home stage's remote experts did over a measured request's decode, per
/// token, from the counters each owner returned with its replies: whether a slow split waits
/// on its owners' disks, their compute, or its links.
#[derive(Debug, Clone, Serialize)]
pub struct SplitOwners {
    /// The home stage's node.
    pub home: String,
    /// Requests to owners a decode token (one per contacted owner per MoE layer).
    pub round_trips_per_token: f64,
    /// The home's whole step a decode token (its compute and its waits), ms.
    pub step_ms_per_token: f64,
    /// The owners' expert lookups a token and the share served from memory (`None`: they hold
    /// their experts in memory).
    pub lookups_per_token: f64,
    pub hit_rate: Option<f64>,
    /// Bytes the owners read from disk a token, MiB, and the time their computations waited
    /// for reads, ms (summed over the owners).
    pub disk_mib_per_token: f64,
    pub read_wait_ms_per_token: f64,
    /// The slowest contacted owner's computation, summed over a token's MoE layers, ms.
    pub slowest_owner_ms_per_token: f64,
    /// What the home waited for replies after its own experts, ms a token.
    pub reply_wait_ms_per_token: f64,
}

impl SplitOwners {
    /// The home stages of `report`'s decode that asked owners for experts.
    pub fn of(report: &tessera_proto::RunReport) -> Vec<Self> {
        report
            .stage_stats
            .iter()
            .filter(|s| s.decode.expert_round_trips > 0)
            .map(|s| {
                let d = &s.decode;
                let o = &d.owners;
                let per_token = |x: u64| x as f64 / d.steps.max(1) as f64;
                Self {
                    home: stage_name(report, s.stage),
                    round_trips_per_token: per_token(d.expert_round_trips),
                    step_ms_per_token: per_token(d.compute_ns) / 1e6,
                    lookups_per_token: per_token(o.lookups),
                    hit_rate: (o.lookups > 0).then(|| 1.0 - o.misses as f64 / o.lookups as f64),
                    disk_mib_per_token: per_token(o.disk_bytes) / (1 << 20) as f64,
                    read_wait_ms_per_token: per_token(o.read_wait_ns) / 1e6,
                    slowest_owner_ms_per_token: per_token(o.slowest_serve_ns) / 1e6,
                    reply_wait_ms_per_token: per_token(o.reply_wait_ns) / 1e6,
                }
            })
            .collect()
    }

    fn line(&self) -> String {
        let streamed = match self.hit_rate {
            Some(h) => format!(
                "{:.1} streamed lookups a token, {:.0}% from memory, {:.2} MiB read and {:.1} ms \
                 waiting for reads a token",
                self.lookups_per_token,
                h * 100.0,
                self.disk_mib_per_token,
                self.read_wait_ms_per_token
            ),
            None => "every expert in memory".into(),
        };
        format!(
            "{}'s expert owners: {:.1} requests a token; {streamed}; the slowest owner computes \
             {:.1} ms a token, the home waits {:.1} ms for replies of its {:.1} ms step",
            self.home,
            self.round_trips_per_token,
            self.slowest_owner_ms_per_token,
            self.reply_wait_ms_per_token,
            self.step_ms_per_token
        )
    }
}

/// The node that ran `stage` in `report`.
fn stage_name(report: &tessera_proto::RunReport, stage: usize) -> String {
    report
        .stages
        .iter()
        .find(|p| p.stage == stage)
        .map_or_else(|| format!("stage {stage}"), |p| p.name.clone())
}

/// One link between two nodes: imposed by the lab, and as measured for the planner.
#[derive(Debug, Clone, Serialize)]
pub struct LinkReport {
    pub a: String,
    pub b: String,
    pub imposed_rtt_ms: f64,
    pub imposed_mbit_s: f64,
    pub measured_rtt_ms: f64,
    pub measured_mbit_s: f64,
    /// How the measured figures were obtained (between the nodes, or composed from the
    /// coordinator's links).
    pub method: String,
}

/// What a scenario run found.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub scenario: String,
    pub objective: Objective,
    pub concurrency: u32,
    pub tokens: usize,
    pub rows: Vec<Row>,
    /// Which figures were imposed by the lab and which measured.
    pub provenance: Vec<String>,
    /// Each link between two nodes: what the lab imposed and what the planner was given.
    pub links: Vec<LinkReport>,
    /// What the lab's machine computed alone and with one decoder per host at once, where its
    /// hosts share it (the planner divides the cores this says it has).
    pub machine: Option<super::machine::Parallelism>,
    /// The run calibration used, or why there was none.
    pub calibrated_on: String,
    /// What calibration changed, one line each.
    pub corrections: Vec<String>,
    /// Where the calibrated graph was saved.
    pub calibrated_graph: Option<String>,
    /// The text one process generated for the workload (greedy), every plan's reference.
    pub one_process_text: Option<String>,
    /// llama.cpp on the best single host under its caps, where `--llama-bench` asked.
    pub baseline: Option<super::baseline::Baseline>,
}

impl Report {
    /// Fills in ranks and errors from the rows' figures.
    pub fn rank(&mut self) {
        let (o, c) = (self.objective, self.concurrency);
        let measured: Vec<usize> = (0..self.rows.len())
            .filter(|&i| self.rows[i].measured.is_some())
            .collect();
        let ranks = |score: &dyn Fn(&Row) -> f64| -> Vec<usize> {
            measured
                .iter()
                .map(|&i| {
                    let x = score(&self.rows[i]);
                    1 + measured
                        .iter()
                        .filter(|&&j| score(&self.rows[j]) > x)
                        .count()
                })
                .collect()
        };
        let pr = ranks(&|r: &Row| r.predicted.score(o, c));
        let mr = ranks(&|r: &Row| r.measured.map_or(0.0, |m| m.score(o, c)));
        for (k, &i) in measured.iter().enumerate() {
            let row = &mut self.rows[i];
            let m = row.measured.expect("measured").score(o, c);
            row.predicted_rank = Some(pr[k]);
            row.measured_rank = Some(mr[k]);
            row.error = Some((row.predicted.score(o, c) - m) / m);
            row.calibrated_error = row.calibrated.map(|x| (x.score(o, c) - m) / m);
        }
    }

    /// The measured plans whose texts differed from one process's: a fault, for `lab run` to
    /// fail on.
    /// The best measured decode of the rows that pass `keep`.
    pub fn best_decode(&self, keep: impl Fn(&Row) -> bool) -> Option<&Row> {
        self.rows
            .iter()
            .filter(|r| keep(r) && r.measured.is_some())
            .max_by(|a, b| {
                let d = |r: &Row| r.measured.map_or(0.0, |m| m.decode_tokens_per_s);
                d(a).total_cmp(&d(b))
            })
    }

    pub fn text_mismatches(&self) -> Vec<&Row> {
        self.rows
            .iter()
            .filter(|r| {
                r.text.as_ref().is_some_and(|t| !t.all_identical())
                    || matches!(&r.speculation, Some(Ok(s)) if !s.text.all_identical())
            })
            .collect()
    }

    /// The planner's choice, else the executable one the coordinator would run: the first of
    /// them that was measured.
    fn measured_choice(&self) -> Option<&Row> {
        self.rows
            .iter()
            .find(|r| r.measured.is_some() && (r.role == "choice" || r.role == "executable choice"))
    }

    /// Whether the planner's choice (else the executable one the coordinator would run) measured
    /// best, or within `tolerance` of the best (by the objective's score); `None` when neither ran.
    pub fn choice_is_best(&self, tolerance: f64) -> Option<bool> {
        let (o, c) = (self.objective, self.concurrency);
        let score = |r: &Row| r.measured.map(|m| m.score(o, c));
        let chosen = score(self.measured_choice()?)?;
        let best = self.rows.iter().filter_map(score).fold(0.0, f64::max);
        Some(chosen >= best * (1.0 - tolerance))
    }

    /// The measured best plan, where it is not the choice but was predicted to score the same
    /// (within 0.5%): a tie the planner could not break, identical hosts on this machine, which
    /// the measurement's spread decided.
    pub fn best_tied_with_choice(&self) -> Option<&Row> {
        let (o, c) = (self.objective, self.concurrency);
        let choice = self.measured_choice()?;
        let best = self
            .rows
            .iter()
            .filter(|r| r.measured_rank == Some(1))
            .find(|r| !std::ptr::eq(*r, choice))?;
        let (a, b) = (choice.predicted.score(o, c), best.predicted.score(o, c));
        ((a - b).abs() <= 0.005 * a.abs().max(b.abs())).then_some(best)
    }
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".into(), |e| format!("{:+.0}%", e * 100.0))
}

fn num(x: Option<f64>) -> String {
    match x {
        Some(v) if v.is_finite() => format!("{v:.1}"),
        _ => "-".into(),
    }
}

/// The report as a table.
pub fn table(r: &Report) -> String {
    let score = match r.objective {
        Objective::Latency if r.concurrency == 1 => "decode tok/s".to_string(),
        Objective::Latency => format!("tok/s per request at {} at once", r.concurrency),
        Objective::Throughput => format!("aggregate tok/s at {} at once", r.concurrency),
        Objective::Balanced => format!("balanced score at {} at once", r.concurrency),
    };
    let mut s = format!(
        "scenario {} — objective {} ({score}), {} tokens a request\n",
        r.scenario,
        format!("{:?}", r.objective).to_lowercase(),
        r.tokens
    );
    s.push_str(&format!(
        "{:<9} {:<34} {:>9} {:>9} {:>6} {:>4} {:>4} {:>9} {:>6} {:>6} | {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}\n",
        "strategy", "plan", "predicted", "measured", "error", "p.rk", "m.rk", "calibr.", "error",
        "text", "decode p", "decode m", "ttft p", "ttft m", "wire B p", "wire B m",
    ));
    let (o, c) = (r.objective, r.concurrency);
    for row in &r.rows {
        let m = row.measured;
        s.push_str(&format!(
            "{:<9} {:<34} {:>9} {:>9} {:>6} {:>4} {:>4} {:>9} {:>6} {:>6} | {:>8} {:>8} {:>8} {:>8} {:>8.0} {:>8}{}\n",
            row.strategy,
            row.description,
            num(Some(row.predicted.score(o, c))),
            num(m.map(|m| m.score(o, c))),
            pct(row.error),
            row.predicted_rank.map_or("-".into(), |x| x.to_string()),
            row.measured_rank.map_or("-".into(), |x| x.to_string()),
            num(row.calibrated.map(|x| x.score(o, c))),
            pct(row.calibrated_error),
            row.text.as_ref().map_or("-".into(), |t| if t.all_identical() {
                "same".to_string()
            } else {
                format!("{}/{}", t.identical, t.checked)
            }),
            num(Some(row.predicted.decode_tokens_per_s)),
            num(m.map(|m| m.decode_tokens_per_s)),
            num(Some(row.predicted.ttft_ms)),
            num(m.map(|m| m.ttft_ms)),
            row.predicted.wire_bytes_per_token.abs(),
            m.map_or("-".into(), |m| format!("{:.0}", m.wire_bytes_per_token)),
            match row.role.as_str() {
                "choice" => "  <- planner's choice",
                "executable choice" => "  <- what --plan auto runs instead",
                "forced" => "  (forced)",
                "rejected" => "  (ranked out by the planner)",
                _ => "",
            }
        ));
        if let Some(n) = &row.note {
            s.push_str(&format!("{:<9} not measured: {n}\n", ""));
        }
        match &row.speculation {
            Some(Ok(sp)) => s.push_str(&format!("{:<9} {}\n", "", sp.line())),
            Some(Err(e)) => s.push_str(&format!("{:<9} speculating failed: {e}\n", "")),
            None => {}
        }
        for st in &row.streaming {
            s.push_str(&format!("{:<9} {}\n", "", st.line()));
        }
        for o in &row.owners {
            s.push_str(&format!("{:<9} {}\n", "", o.line()));
        }
        if let Some(d) = row.text.as_ref().and_then(|t| t.differing.as_ref()) {
            s.push_str(&format!(
                "{:<9} TEXT DIFFERS from one process's ({} of {} identical): {d:?}\n",
                "",
                row.text.as_ref().map_or(0, |t| t.identical),
                row.text.as_ref().map_or(0, |t| t.checked),
            ));
        }
    }
    match &r.one_process_text {
        Some(t) => s.push_str(&format!(
            "text: every measured request (greedy) against one process's {} chars ({}); a \
             difference fails the run\n",
            t.chars().count(),
            if r.text_mismatches().is_empty() {
                "all identical"
            } else {
                "SOME DIFFER"
            }
        )),
        None => s.push_str("text: not compared (one process did not run)\n"),
    }
    match r.choice_is_best(0.05) {
        Some(true) => s.push_str("the planner's choice measured best (or within 5% of it)\n"),
        Some(false) => {
            s.push_str("the planner's choice did NOT measure best (nor within 5%)");
            if let Some(best) = r.best_tied_with_choice() {
                s.push_str(&format!(
                    "; the best, {}, was predicted the same as the choice: a tie the planner \
                     cannot break (hosts it sees as identical), decided by the measurement",
                    best.description
                ));
            }
            s.push('\n');
        }
        None => s.push_str("the planner's choice did not run\n"),
    }
    if let Some(b) = &r.baseline {
        s.push_str(&baseline_lines(r, b));
    }
    s.push_str(&format!("calibrated on {}\n", r.calibrated_on));
    for c in &r.corrections {
        s.push_str(&format!("  {c}\n"));
    }
    if let Some(g) = &r.calibrated_graph {
        s.push_str(&format!(
            "calibrated graph saved to {g} (tessera plan --nodes, tessera lab run)\n"
        ));
    }
    for p in &r.provenance {
        s.push_str(&format!("{p}\n"));
    }
    s
}

/// llama.cpp's decode on the best single host, and the best plan's and the best single host's
/// over it.
fn baseline_lines(r: &Report, b: &super::baseline::Baseline) -> String {
    let rate = match &b.decode_tokens_per_s {
        Ok(x) => *x,
        Err(why) => return format!("llama.cpp on {}: not measured: {why}\n", b.host),
    };
    let mut s = format!(
        "llama.cpp on {} under its caps (mmap, no repack): {rate:.2} tok/s decode ({})\n",
        b.host, b.command
    );
    let best = |row: Option<&Row>| row.and_then(|x| Some((x.description.clone(), x.measured?)));
    for (what, row) in [
        ("best plan", best(r.best_decode(|_| true))),
        (
            "best single host",
            best(r.best_decode(|x| x.strategy == "single")),
        ),
    ] {
        if let Some((d, m)) = row {
            s.push_str(&format!(
                "  {what} ({d}): {:.1} tok/s = {:.1}× llama.cpp\n",
                m.decode_tokens_per_s,
                m.decode_tokens_per_s / rate
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A home stage's owners, per decode token from its decode's sums: a stage that asked no
    /// owner has no row, and owners holding every expert in memory say so.
    #[test]
    fn a_split_homes_owners_are_reported_per_decode_token() {
        use super::super::test_reports::{decode, on_nodes, report};
        let mut home = decode(0, 40_000_000, 4);
        home.decode.expert_round_trips = 48;
        home.decode.owners = tessera_proto::OwnerExpertStats {
            lookups: 200,
            misses: 50,
            disk_bytes: 8 << 20,
            read_wait_ns: 12_000_000,
            slowest_serve_ns: 20_000_000,
            reply_wait_ns: 16_000_000,
        };
        let r = on_nodes(report(vec![home, decode(1, 4_000_000, 4)], 2), &["a", "b"]);
        let [o] = SplitOwners::of(&r).try_into().expect("one home");
        assert_eq!(o.home, "a");
        assert_eq!(o.round_trips_per_token, 12.0);
        assert_eq!(o.step_ms_per_token, 10.0);
        assert_eq!(o.lookups_per_token, 50.0);
        assert_eq!(o.hit_rate, Some(0.75));
        assert_eq!(o.disk_mib_per_token, 2.0);
        assert_eq!(o.read_wait_ms_per_token, 3.0);
        assert_eq!(o.slowest_owner_ms_per_token, 5.0);
        assert_eq!(o.reply_wait_ms_per_token, 4.0);
        assert!(o.line().contains("75% from memory"), "{}", o.line());

        let mut in_memory = decode(0, 40_000_000, 4);
        in_memory.decode.expert_round_trips = 48;
        let r = on_nodes(report(vec![in_memory], 1), &["a"]);
        let [o] = SplitOwners::of(&r).try_into().expect("one home");
        assert_eq!(o.hit_rate, None);
        assert!(o.line().contains("every expert in memory"), "{}", o.line());
    }

    fn figures(decode: f64, throughput: f64) -> Figures {
        Figures {
            decode_tokens_per_s: decode,
            ttft_ms: 10.0,
            throughput_tokens_per_s: throughput,
            wire_bytes_per_token: 0.0,
        }
    }

    fn row(role: &str, predicted: Figures, measured: Option<Figures>) -> Row {
        Row {
            strategy: "stage".into(),
            description: String::new(),
            role: role.into(),
            predicted,
            measured,
            note: measured.is_none().then(|| "cannot run".into()),
            error: None,
            predicted_rank: None,
            measured_rank: None,
            calibrated: Some(predicted),
            calibrated_error: None,
            text: None,
            speculation: None,
            streaming: Vec::new(),
            owners: Vec::new(),
        }
    }

    fn report(objective: Objective, concurrency: u32, rows: Vec<Row>) -> Report {
        let mut r = Report {
            machine: None,
            scenario: "s".into(),
            objective,
            concurrency,
            tokens: 8,
            rows,
            provenance: vec![],
            links: vec![],
            calibrated_on: String::new(),
            corrections: vec![],
            calibrated_graph: None,
            one_process_text: None,
            baseline: None,
        };
        r.rank();
        r
    }

    #[test]
    fn a_speculating_text_that_differs_is_a_mismatch_and_the_table_gives_the_speedup() {
        let same = vec!["a b c".to_string()];
        let speculation = |texts: &[String]| Speculation {
            k: 4,
            predicted: false,
            decode_tokens_per_s: 30.0,
            speedup: 1.5,
            verifications: 10,
            drafted: 40,
            accepted: 10,
            text: TextCheck::of(texts, "a b c"),
            predicted_tokens_per_s: Some(33.0),
        };
        let mut good = row("choice", figures(1.0, 1.0), Some(figures(20.0, 20.0)));
        good.text = Some(TextCheck::of(&same, "a b c"));
        good.speculation = Some(Ok(speculation(&same)));
        let mut r = report(Objective::Latency, 1, vec![good.clone()]);
        assert!(r.text_mismatches().is_empty());
        let t = table(&r);
        assert!(
            t.contains("k = 4): decode 30.0 tok/s, 1.50× without; 10 of 40 drafts accepted (25%), 2.00 tokens a verifying turn; predicted 33.0 tok/s calibrated (+10%); text same"),
            "{t}"
        );
        let mut bad = good;
        bad.speculation = Some(Ok(speculation(&["a b d".to_string()])));
        r.rows = vec![bad];
        assert_eq!(r.text_mismatches().len(), 1);
        assert!(table(&r).contains("text DIFFERS (0 of 1 identical)"));
    }

    #[test]
    fn a_plan_whose_text_differs_from_one_process_is_a_mismatch_the_table_shows() {
        let same = vec!["a b c".to_string(), "a b c".to_string()];
        let odd = vec!["a b c".to_string(), "a b d".to_string()];
        assert!(TextCheck::of(&same, "a b c").all_identical());
        let check = TextCheck::of(&odd, "a b c");
        assert_eq!((check.identical, check.checked), (1, 2));
        assert_eq!(check.differing.as_deref(), Some("a b d"));
        // Nothing checked is not "identical".
        assert!(!TextCheck::of(&[], "a b c").all_identical());

        let mut good = row("choice", figures(1.0, 1.0), Some(figures(1.0, 1.0)));
        good.text = Some(TextCheck::of(&same, "a b c"));
        let mut bad = row("runner-up", figures(1.0, 1.0), Some(figures(1.0, 1.0)));
        bad.text = Some(check);
        let mut r = report(Objective::Latency, 1, vec![good, bad]);
        r.one_process_text = Some("a b c".into());
        assert_eq!(r.text_mismatches().len(), 1);
        assert_eq!(r.text_mismatches()[0].role, "runner-up");
        let t = table(&r);
        assert!(t.contains("TEXT DIFFERS"), "{t}");
        assert!(t.contains("SOME DIFFER"), "{t}");
        assert!(t.contains(" same "), "{t}");
        assert!(t.contains(" 1/2 "), "{t}");
    }

    #[test]
    fn ranks_and_errors_count_only_measured_plans_by_the_objective() {
        let r = report(
            Objective::Throughput,
            4,
            vec![
                row("choice", figures(100.0, 400.0), Some(figures(50.0, 100.0))),
                row(
                    "runner-up",
                    figures(200.0, 200.0),
                    Some(figures(100.0, 200.0)),
                ),
                row("runner-up", figures(900.0, 900.0), None),
            ],
        );
        assert_eq!(r.rows[0].predicted_rank, Some(1));
        assert_eq!(r.rows[0].measured_rank, Some(2));
        assert_eq!(r.rows[1].measured_rank, Some(1));
        assert_eq!(r.rows[0].error, Some(3.0));
        assert_eq!(r.rows[2].predicted_rank, None);
        assert_eq!(r.choice_is_best(0.05), Some(false));
        assert!(
            r.best_tied_with_choice().is_none(),
            "predicted 400 against 200"
        );
        assert!(table(&r).contains("not measured: cannot run"));
    }

    #[test]
    fn a_best_plan_predicted_the_same_as_the_choice_is_called_a_tie() {
        let r = report(
            Objective::Latency,
            1,
            vec![
                row("choice", figures(100.0, 400.0), Some(figures(50.0, 300.0))),
                row(
                    "runner-up",
                    figures(100.0, 400.0),
                    Some(figures(50.0, 360.0)),
                ),
            ],
        );
        assert_eq!(r.choice_is_best(0.05), Some(false));
        assert_eq!(
            r.best_tied_with_choice().map(|b| b.role.as_str()),
            Some("runner-up")
        );
        assert!(table(&r).contains("a tie the planner cannot break"));
    }

    #[test]
    fn latency_at_concurrency_is_the_speed_each_request_sees() {
        let f = figures(100.0, 240.0);
        assert_eq!(f.score(Objective::Latency, 4), 60.0);
        assert_eq!(f.score(Objective::Latency, 1), 240.0);
        let r = report(
            Objective::Latency,
            1,
            vec![row("choice", f, Some(figures(100.0, 228.0)))],
        );
        assert_eq!(r.choice_is_best(0.05), Some(true));
    }
}
