//! A scaling curve: one scenario on its first 1, 2, … hosts (`tessera lab run --hosts 1,2,3,4`),
//! each point a whole `lab run` on the same caps, summed up as one table. Each point compares
//! the planner's choice and the best plan measured with the best single host measured *in
//! the same run* (for a model larger than any host: one host streaming its experts from its
//! own disk), so the machine's drift between runs does not enter the ratios. Pure.

use serde::Serialize;

use super::report::{Report, Row};

/// One point of the curve: the run on the first `hosts` hosts.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    pub hosts: usize,
    pub report: Report,
}

/// A measured plan of a point, by the objective's score.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Scored {
    pub description: String,
    pub predicted: f64,
    pub measured: f64,
}

/// A point as one line of the table.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Line {
    pub hosts: usize,
    /// The planner's choice (else what `--plan auto` runs instead), where it was measured.
    pub choice: Option<Scored>,
    /// The best plan measured.
    pub best: Option<Scored>,
    /// The best single-host plan measured in the same run.
    pub one_host: Option<Scored>,
    /// Every measured request's text was one process's.
    pub texts_identical: bool,
    /// llama.cpp's decode on the best single host under its caps, where it was measured.
    pub llama_cpp: Option<f64>,
}

fn scored(r: &Report, row: &Row) -> Option<Scored> {
    let (o, c) = (r.objective, r.concurrency);
    Some(Scored {
        description: row.description.clone(),
        predicted: row.predicted.score(o, c),
        measured: row.measured?.score(o, c),
    })
}

impl Line {
    pub fn of(p: &Point) -> Self {
        let r = &p.report;
        let best_of = |rows: &mut dyn Iterator<Item = &Row>| {
            rows.filter_map(|row| scored(r, row))
                .max_by(|a, b| a.measured.total_cmp(&b.measured))
        };
        let choice = r
            .rows
            .iter()
            .filter(|row| row.role == "choice" || row.role == "executable choice")
            .find_map(|row| scored(r, row));
        Self {
            hosts: p.hosts,
            choice,
            best: best_of(&mut r.rows.iter()),
            one_host: best_of(&mut r.rows.iter().filter(|row| row.strategy == "single")),
            texts_identical: r.text_mismatches().is_empty()
                && r.rows.iter().any(|row| row.text.is_some()),
            llama_cpp: r
                .baseline
                .as_ref()
                .and_then(|b| b.decode_tokens_per_s.clone().ok()),
        }
    }

    /// The best plan's measured decode over llama.cpp's on the best single host.
    pub fn best_over_llama_cpp(&self) -> Option<f64> {
        Some(self.best.as_ref()?.measured / self.llama_cpp?)
    }

    /// The choice's measured score over the best single host's, in the same run.
    pub fn choice_over_one_host(&self) -> Option<f64> {
        Some(self.choice.as_ref()?.measured / self.one_host.as_ref()?.measured)
    }

    /// The best plan's measured score over the best single host's, in the same run.
    pub fn best_over_one_host(&self) -> Option<f64> {
        Some(self.best.as_ref()?.measured / self.one_host.as_ref()?.measured)
    }
}

fn num(x: Option<f64>) -> String {
    x.filter(|v| v.is_finite())
        .map_or("-".into(), |v| format!("{v:.1}"))
}

fn ratio(x: Option<f64>) -> String {
    x.filter(|v| v.is_finite())
        .map_or("-".into(), |v| format!("{v:.2}×"))
}

/// The curve as one table (the objective's score: decode tok/s for latency at 1 request).
pub fn table(points: &[Point]) -> String {
    let mut s = String::from(
        "scaling: each line a lab run on the first N hosts, same caps; ratios against the best \
         single host measured in the same run, and against llama.cpp's decode (mmap) on that \
         host under its caps where --llama-bench measured it\n",
    );
    s.push_str(&format!(
        "{:>5}  {:<44} {:>6} {:>6}  {:<44} {:>6}  {:<32} {:>6}  {:>8} {:>8} {:>7} {:>9}  {}\n",
        "hosts",
        "planner's choice",
        "pred.",
        "meas.",
        "best measured",
        "meas.",
        "best single host",
        "meas.",
        "choice/1",
        "best/1",
        "llama",
        "best/llama",
        "texts"
    ));
    for p in points {
        let l = Line::of(p);
        let d = |x: &Option<Scored>| x.as_ref().map_or("-".into(), |x| x.description.clone());
        s.push_str(&format!(
            "{:>5}  {:<44} {:>6} {:>6}  {:<44} {:>6}  {:<32} {:>6}  {:>8} {:>8} {:>7} {:>9}  {}\n",
            l.hosts,
            d(&l.choice),
            num(l.choice.as_ref().map(|x| x.predicted)),
            num(l.choice.as_ref().map(|x| x.measured)),
            d(&l.best),
            num(l.best.as_ref().map(|x| x.measured)),
            d(&l.one_host),
            num(l.one_host.as_ref().map(|x| x.measured)),
            ratio(l.choice_over_one_host()),
            ratio(l.best_over_one_host()),
            l.llama_cpp
                .filter(|v| v.is_finite())
                .map_or("-".into(), |v| format!("{v:.2}")),
            ratio(l.best_over_llama_cpp()),
            if l.texts_identical {
                "one process's"
            } else {
                "DIFFER (or none measured)"
            },
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::report::{Figures, TextCheck};
    use tessera_plan::Objective;

    fn figures(decode: f64) -> Figures {
        Figures {
            decode_tokens_per_s: decode,
            ttft_ms: 10.0,
            throughput_tokens_per_s: decode,
            wire_bytes_per_token: 0.0,
        }
    }

    fn row(strategy: &str, role: &str, predicted: f64, measured: Option<f64>) -> Row {
        Row {
            strategy: strategy.into(),
            description: format!("{strategy} {role}"),
            role: role.into(),
            predicted: figures(predicted),
            measured: measured.map(figures),
            note: None,
            error: None,
            predicted_rank: None,
            measured_rank: None,
            calibrated: None,
            calibrated_error: None,
            text: measured.map(|_| TextCheck::of(&["t".into()], "t")),
            speculation: None,
            streaming: Vec::new(),
            owners: Vec::new(),
        }
    }

    fn point(hosts: usize, rows: Vec<Row>) -> Point {
        Point {
            hosts,
            report: Report {
                scenario: "s".into(),
                objective: Objective::Latency,
                concurrency: 1,
                tokens: 8,
                rows,
                provenance: vec![],
                links: vec![],
                machine: None,
                calibrated_on: String::new(),
                corrections: vec![],
                calibrated_graph: None,
                one_process_text: Some("t".into()),
                baseline: None,
            },
        }
    }

    #[test]
    fn each_point_is_set_against_the_best_single_host_of_its_own_run() {
        let one = point(1, vec![row("single", "choice", 1.0, Some(4.0))]);
        let four = point(
            4,
            vec![
                row("expert", "choice", 5.0, Some(6.0)),
                row("stage", "rejected", 3.0, Some(15.0)),
                row("single", "rejected", 1.0, Some(5.0)),
                row("single", "runner-up", 0.9, Some(3.0)),
                row("bank", "rejected", 9.0, None),
            ],
        );
        let l1 = Line::of(&one);
        assert_eq!(l1.best_over_one_host(), Some(1.0));
        let l4 = Line::of(&four);
        assert_eq!(l4.choice.as_ref().unwrap().description, "expert choice");
        assert_eq!(l4.best.as_ref().unwrap().measured, 15.0);
        // The best single host of the run, not the first listed nor the 1-host run's.
        assert_eq!(l4.one_host.as_ref().unwrap().measured, 5.0);
        assert_eq!(l4.best_over_one_host(), Some(3.0));
        assert_eq!(l4.choice_over_one_host(), Some(1.2));
        assert!(l4.texts_identical);
        assert_eq!(l4.best_over_llama_cpp(), None, "not measured");
        let t = table(&[one, four.clone()]);
        assert!(t.contains("3.00×") && t.contains("1.20×"), "{t}");
        // With llama.cpp measured on the best single host, the best plan is set against it.
        let mut four = four;
        four.report.baseline = Some(crate::run::baseline::Baseline {
            host: "b".into(),
            command: "llama-bench".into(),
            decode_tokens_per_s: Ok(0.5),
        });
        assert_eq!(Line::of(&four).best_over_llama_cpp(), Some(30.0));
        assert!(table(&[four.clone()]).contains("30.00×"));
        let lines = crate::run::table(&four.report);
        assert!(
            lines.contains("best plan (stage rejected): 15.0 tok/s = 30.0× llama.cpp"),
            "{lines}"
        );
        assert!(lines.contains("best single host (single rejected): 5.0 tok/s = 10.0× llama.cpp"));
    }

    #[test]
    fn a_point_whose_texts_differ_says_so() {
        let mut p = point(2, vec![row("stage", "choice", 1.0, Some(2.0))]);
        p.report.rows[0].text = Some(TextCheck::of(&["u".into()], "t"));
        assert!(!Line::of(&p).texts_identical);
        assert!(table(&[p]).contains("DIFFER"));
        // Nothing measured: no text was compared, which is not "identical" either.
        let none = point(2, vec![row("stage", "choice", 1.0, None)]);
        assert!(!Line::of(&none).texts_identical);
        assert!(Line::of(&none).best_over_one_host().is_none());
    }
}
