//! One subscriber for the whole binary.
//!
//! The cluster's own events (the coordinator's, the node agent's, the transport's) are what a
//! person watching a node or a coordinator reads: plain lines, informational ones on stdout and
//! warnings and errors on stderr. `TESSERA_LOG_FORMAT=json` prints every such event as one JSON
//! object a line on stdout instead — its message, its level, and its structured fields
//! (`event`, `node`, `epoch`, …) — for scripts and tests that wait on what happened rather than
//! on wording. Everything else (the gateway's request logs) goes to stderr with timestamps.
//! `TESSERA_LOG` filters both (default `info`).

use std::fmt;

use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::field::Visit;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::prelude::*;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{filter, EnvFilter};

use crate::output::QueuedWriter;

/// Targets whose events are the cluster's story, printed plain (or as JSON).
fn cluster_event(meta: &Metadata<'_>) -> bool {
    let t = meta.target();
    [
        "tessera_coord",
        "tessera_node",
        "tessera_net",
        "tessera_lab",
    ]
    .iter()
    .any(|p| t.starts_with(p))
}

/// Installs the subscriber (once; later calls do nothing).
pub fn init() {
    let env = EnvFilter::try_from_env("TESSERA_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let json = json_format();
    let others = tracing_subscriber::fmt::layer()
        .with_writer(QueuedWriter::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(filter::filter_fn(|m| !cluster_event(m)));
    let registry = tracing_subscriber::registry().with(env).with(others);
    let _ = if json {
        let events = tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_writer(QueuedWriter::stdout)
            .with_filter(filter::filter_fn(cluster_event));
        registry.with(events).try_init()
    } else {
        let info = tracing_subscriber::fmt::layer()
            .event_format(Plain)
            .with_writer(QueuedWriter::stdout)
            .with_filter(filter::filter_fn(|m| {
                cluster_event(m) && *m.level() >= Level::INFO
            }));
        let warnings = tracing_subscriber::fmt::layer()
            .event_format(Plain)
            .with_writer(QueuedWriter::stderr)
            .with_filter(filter::filter_fn(|m| {
                cluster_event(m) && *m.level() < Level::INFO
            }));
        registry.with(info).with(warnings).try_init()
    };
}

/// An event's message alone, as a line (its fields are for the JSON form).
struct Plain;

impl<S, N> FormatEvent<S, N> for Plain
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        struct Message<'w, 'a>(&'w mut Writer<'a>, fmt::Result);
        impl Visit for Message<'_, '_> {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
                if field.name() == "message" {
                    self.1 = write!(self.0, "{value:?}");
                }
            }
        }
        let mut m = Message(&mut writer, Ok(()));
        event.record(&mut m);
        m.1?;
        writeln!(writer)
    }
}

/// Whether `TESSERA_LOG_FORMAT=json`: events as JSON lines, for scripts and tests.
pub fn json_format() -> bool {
    std::env::var("TESSERA_LOG_FORMAT").is_ok_and(|v| v == "json")
}

/// Prints a line a person or a script needs in order to go on — an address to connect to, a
/// token to join with: `line` as is, or, when `TESSERA_LOG_FORMAT=json`, one JSON object with
/// `event`, `fields` and `line` as its `message`, so scripts and tests read fields instead of
/// wording. Not an event of the log: `TESSERA_LOG` never filters it away.
pub fn announce(event: &str, fields: &[(&str, &str)], line: &str) {
    let json = json_format();
    // Through the same queue as the log, so lines keep their order and a stdout nobody reads
    // never blocks the caller (crate::output).
    if json {
        let mut o = serde_json::Map::new();
        o.insert("event".into(), event.into());
        for (k, v) in fields {
            o.insert((*k).into(), (*v).into());
        }
        o.insert("message".into(), line.into());
        say!("{}", serde_json::Value::Object(o));
    } else {
        say!("{line}");
    }
}
