//! `/metrics` in the Prometheus text exposition format.
//!
//! Hand-rolled: a dozen gauges and counters per stream don't justify a metrics
//! framework, and rendering from the status registry keeps one source of truth
//! for `mmctl status` and scrapers.

use std::fmt::Write;

use mm_proto::api::{StreamState, StreamStatus};

use crate::status::StatusRegistry;

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn state_code(s: StreamState) -> u8 {
    match s {
        StreamState::Streaming => 1,
        StreamState::Starting => 2,
        StreamState::Paused => 3,
        StreamState::Error => 4,
        StreamState::Stopped => 0,
    }
}

/// Renders every stream's counters. Label order is fixed so output is diffable.
pub fn render(registry: &StatusRegistry) -> String {
    let streams = registry.snapshot();
    let mut out = String::new();
    type Getter = fn(&StreamStatus) -> Option<f64>;
    let families: [(&str, &str, &str, Getter); 12] = [
        (
            "mm_stream_state",
            "gauge",
            "0 stopped, 1 streaming, 2 starting, 3 paused, 4 error",
            |s| Some(f64::from(state_code(s.state))),
        ),
        (
            "mm_stream_lag_bytes",
            "gauge",
            "publisher WAL bytes not yet applied",
            |s| s.lag_bytes.map(|v| v as f64),
        ),
        (
            "mm_stream_lag_seconds",
            "gauge",
            "age of the newest applied remote commit while behind",
            |s| s.lag_seconds,
        ),
        (
            "mm_stream_applied_transactions_total",
            "counter",
            "remote transactions applied",
            |s| Some(s.applied_txns as f64),
        ),
        (
            "mm_stream_applied_rows_total",
            "counter",
            "remote row changes applied",
            |s| Some(s.applied_rows as f64),
        ),
        (
            "mm_routine_changes_total",
            "counter",
            "cross-origin changes applied without conflict (the publisher had seen the local version)",
            |s| Some(s.routine as f64),
        ),
        (
            "mm_stream_restarts_total",
            "counter",
            "stream restarts after errors",
            |s| Some(s.restarts as f64),
        ),
        (
            "mm_stream_streamed_bytes_total",
            "counter",
            "bytes of in-progress transactions received before commit",
            |s| Some(s.streamed_bytes as f64),
        ),
        (
            "mm_stream_early_transactions_total",
            "counter",
            "transactions applied while they still arrived (before their COMMIT)",
            |s| Some(s.early_txns as f64),
        ),
        (
            "mm_stream_conflict_rollbacks_total",
            "counter",
            "fast-path attempts rolled back for a conflict before the careful path applied them",
            |s| Some(s.conflict_rollbacks as f64),
        ),
        (
            "mm_stream_conflicts_in_place_total",
            "counter",
            "conflicts on hot keys settled inside a fast-path statement (no rollback, no careful path)",
            |s| Some(s.conflicts_in_place as f64),
        ),
        (
            "mm_stream_processed_lsn",
            "gauge",
            "publisher WAL position fully applied",
            |s| s.processed_lsn.map(|l| l.0 as f64),
        ),
    ];
    for (name, kind, help, get) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for s in &streams {
            if let Some(v) = get(s) {
                let _ = writeln!(
                    out,
                    "{name}{{from=\"{}\",to=\"{}\"}} {v}",
                    esc(&s.from),
                    esc(&s.to)
                );
            }
        }
    }
    let _ = writeln!(
        out,
        "# HELP mm_conflicts_total conflicts detected, by PostgreSQL 18 conflict type\n# TYPE mm_conflicts_total counter"
    );
    for s in &streams {
        for (ty, n) in &s.conflicts {
            let _ = writeln!(
                out,
                "mm_conflicts_total{{from=\"{}\",to=\"{}\",type=\"{}\"}} {n}",
                esc(&s.from),
                esc(&s.to),
                esc(ty)
            );
        }
    }
    if let Some(n) = registry.tombstones() {
        let _ = writeln!(
            out,
            "# HELP mm_tombstones rows in mm.tombstones (deleted rows' last versions)\n# TYPE mm_tombstones gauge\nmm_tombstones{{node=\"{}\"}} {n}",
            esc(registry.local_node())
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_labels_and_counters() {
        let r = StatusRegistry::new("n2");
        r.update("n1", |s| {
            s.applied_txns = 7;
            s.state = StreamState::Streaming;
            s.conflicts.insert("update_missing".into(), 2);
            s.routine = 11;
        });
        let text = render(&r);
        assert!(!text.contains("mm_tombstones"), "not counted yet: {text}");
        assert!(text.contains("mm_routine_changes_total{from=\"n1\",to=\"n2\"} 11"));
        r.set_tombstones(5);
        let text = render(&r);
        assert!(text.contains("# TYPE mm_tombstones gauge\nmm_tombstones{node=\"n2\"} 5"));
        assert!(text.contains("mm_stream_applied_transactions_total{from=\"n1\",to=\"n2\"} 7"));
        assert!(text.contains("mm_stream_state{from=\"n1\",to=\"n2\"} 1"));
        assert!(
            text.contains("mm_conflicts_total{from=\"n1\",to=\"n2\",type=\"update_missing\"} 2")
        );
    }
}
