//! What mmctl prints: the aggregated cluster status (as JSON or as tables)
//! and a minimal aligned-table writer.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use mm_proto::Lsn;
use mm_proto::api::{ClusterConflictsResponse, LeaderInfo, NodeInfo};
use serde::{Deserialize, Serialize};

/// `mmctl status`: the cluster as seen by asking every node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The agent the node list came from.
    pub agent: String,
    pub leader: Option<LeaderInfo>,
    pub term: u64,
    pub nodes: Vec<NodeView>,
    /// Every ordered pair of distinct nodes.
    pub pairs: Vec<PairView>,
    pub paused: Vec<(String, String)>,
    /// Global sequences: what is left, each node's chunks.
    #[serde(default)]
    pub sequences: Vec<mm_proto::api::SequenceStatus>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    #[serde(flatten)]
    pub info: NodeInfo,
    pub is_leader: bool,
    pub reachable: bool,
    /// Why the node's status could not be read.
    pub error: Option<String>,
    /// Raft as this node sees it (None when unreachable).
    pub term: Option<u64>,
    pub last_applied_index: Option<u64>,
    /// Rows in the node's `mm.tombstones` (None when unreachable or not counted yet).
    pub tombstones: Option<u64>,
}

/// The stream of `from`'s changes into `to`, as reported by `to`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PairView {
    pub from: String,
    pub to: String,
    /// The stream's state (`streaming`, `paused`, ...), `no_stream` when `to`
    /// runs no stream from `from`, or `unreachable` when `to` did not answer.
    pub state: String,
    pub paused: bool,
    pub lag_bytes: Option<u64>,
    pub lag_seconds: Option<f64>,
    pub applied_txns: Option<u64>,
    pub applied_rows: Option<u64>,
    pub conflicts_total: Option<u64>,
    /// Conflicts by PostgreSQL 18 conflict type.
    pub conflicts: BTreeMap<String, u64>,
    /// Cross-origin changes applied without a conflict.
    pub routine: Option<u64>,
    pub received_lsn: Option<Lsn>,
    pub applied_lsn: Option<Lsn>,
    pub processed_lsn: Option<Lsn>,
    pub restarts: Option<u64>,
    /// Bytes of in-progress transactions received before their commit.
    pub streamed_bytes: Option<u64>,
    /// Transactions applied while they still arrived (before their COMMIT).
    #[serde(default)]
    pub early_txns: Option<u64>,
    /// Fast-path attempts rolled back for a conflict (`conflict_rollbacks`).
    #[serde(default)]
    pub conflict_rollbacks: Option<u64>,
    /// Conflicts settled inside a fast-path statement (`conflicts_in_place`).
    #[serde(default)]
    pub conflicts_in_place: Option<u64>,
    pub last_error: Option<String>,
    /// `transient` (retried until it passes) or `definite` (needs an operator).
    #[serde(default)]
    pub error_kind: Option<mm_proto::api::ErrorKind>,
    /// Commit LSN of the transaction the stream is stopped at (for `mmctl skip`).
    #[serde(default)]
    pub stuck_lsn: Option<Lsn>,
    /// The publisher's WAL position lag is measured against.
    #[serde(default)]
    pub publisher_lsn: Option<Lsn>,
}

/// Longest last error shown in the table; `--json` has the whole text.
const ERROR_WIDTH: usize = 60;

pub fn render_status(s: &ClusterStatus) -> String {
    let mut out = String::new();
    let mut nodes = Table::new(&["", "NAME", "ID", "STATE", "TOMBSTONES", "URL", "NOTE"]);
    for n in &s.nodes {
        let note = match (&n.error, n.reachable) {
            (Some(e), _) => format!("unreachable: {}", truncate(e, ERROR_WIDTH)),
            (None, false) => "unreachable".into(),
            (None, true) => String::new(),
        };
        nodes.row(vec![
            if n.is_leader {
                "*".into()
            } else {
                String::new()
            },
            n.info.name.clone(),
            n.info.id.to_string(),
            n.info.state.to_string(),
            n.tombstones
                .map(|v| v.to_string())
                .unwrap_or_else(|| "-".into()),
            n.info.api_url.clone(),
            note,
        ]);
    }
    let _ = writeln!(out, "Nodes (* = Raft leader)");
    out.push_str(&nodes.render());
    let leader = match &s.leader {
        Some(l) => format!(
            "{} (id {}, {})",
            l.name.as_deref().unwrap_or("?"),
            l.id,
            l.url
        ),
        None => "none (election in progress or no quorum)".into(),
    };
    let _ = writeln!(out, "\nRaft leader: {leader}, term {}", s.term);
    if !s.pairs.is_empty() {
        let mut pairs = Table::new(&[
            "FROM → TO",
            "STATE",
            "LAG BYTES",
            "LAG S",
            "APPLIED TXNS",
            "CONFLICTS",
            "ROUTINE",
            "LAST ERROR",
        ]);
        for p in &s.pairs {
            let opt = |v: Option<u64>| v.map(|x| x.to_string()).unwrap_or_else(|| "-".into());
            pairs.row(vec![
                format!("{} → {}", p.from, p.to),
                if p.paused && p.state != "paused" {
                    format!("{} (paused)", p.state)
                } else {
                    p.state.clone()
                },
                opt(p.lag_bytes),
                p.lag_seconds
                    .map(|v| format!("{v:.1}"))
                    .unwrap_or_else(|| "-".into()),
                opt(p.applied_txns),
                opt(p.conflicts_total),
                opt(p.routine),
                p.last_error
                    .as_deref()
                    .map(|e| truncate(e, ERROR_WIDTH))
                    .unwrap_or_else(|| "-".into()),
            ]);
        }
        let _ = writeln!(out, "\nStreams");
        out.push_str(&pairs.render());
        // The table cuts errors short; what `mmctl skip` needs is here whole.
        let failing: Vec<&PairView> = s.pairs.iter().filter(|p| p.state == "error").collect();
        if !failing.is_empty() {
            let _ = writeln!(out, "\nStreams in error");
            for p in failing {
                let kind = match p.error_kind {
                    Some(mm_proto::api::ErrorKind::Transient) => " (transient: retrying)",
                    Some(mm_proto::api::ErrorKind::Definite) => " (needs an operator)",
                    None => "",
                };
                let _ = writeln!(out, "{} → {}{kind}:", p.from, p.to);
                for line in wrap(p.last_error.as_deref().unwrap_or("(no message)"), 100) {
                    let _ = writeln!(out, "    {line}");
                }
                if let Some(lsn) = p.stuck_lsn {
                    let _ = writeln!(
                        out,
                        "    to skip that transaction: mmctl --agent <{}'s agent> skip --from {} --lsn {lsn}",
                        p.to, p.from
                    );
                }
            }
        }
    }
    let mut by_type = Table::new(&["FROM → TO", "CONFLICTS BY TYPE"]);
    let mut any = false;
    for p in s
        .pairs
        .iter()
        .filter(|p| p.conflicts.values().any(|n| *n > 0))
    {
        any = true;
        let types: Vec<String> = p
            .conflicts
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(t, n)| format!("{t} {n}"))
            .collect();
        by_type.row(vec![format!("{} → {}", p.from, p.to), types.join(", ")]);
    }
    if any {
        let _ = writeln!(out, "\nConflicts (mmctl conflicts lists them)");
        out.push_str(&by_type.render());
    }
    if !s.sequences.is_empty() {
        let mut seqs = Table::new(&["SEQUENCE", "LEFT", "MAX", "CHUNK", "NEWEST CHUNKS", "NOTE"]);
        for q in &s.sequences {
            let chunks: Vec<String> = q
                .ranges
                .iter()
                .map(|r| format!("{} {}..{}", r.node, r.start, r.end))
                .collect();
            let note = if q.exhausted {
                "EXHAUSTED: no chunk left to hand out"
            } else if q.running_out {
                "RUNNING OUT: fewer than 8 chunks left"
            } else {
                ""
            };
            seqs.row(vec![
                q.name.clone(),
                q.left.to_string(),
                q.max.to_string(),
                q.chunk.to_string(),
                chunks.join(", "),
                note.into(),
            ]);
        }
        let _ = writeln!(
            out,
            "\nGlobal sequences (mmctl sequence list has each node's use)"
        );
        out.push_str(&seqs.render());
    }
    out
}

/// Longest key shown in the conflicts table; `--json` has all of it.
const KEY_WIDTH: usize = 40;

/// `mmctl conflicts`: one line per conflict, newest first, then a warning
/// per node whose log could not be read.
pub fn render_conflicts(r: &ClusterConflictsResponse) -> String {
    let mut out = String::new();
    if r.conflicts.is_empty() {
        let _ = writeln!(
            out,
            "no conflicts recorded on {}",
            if r.nodes.is_empty() {
                "any node".to_owned()
            } else {
                r.nodes.join(", ")
            }
        );
    } else {
        let mut t = Table::new(&[
            "NODE",
            "AT",
            "RELATION",
            "TYPE",
            "KEY",
            "RESOLUTION",
            "LOCAL ORIGIN/TS",
            "REMOTE ORIGIN/TS",
            "LSN",
        ]);
        let dash = || "-".to_owned();
        let version = |origin: &Option<String>, ts: &Option<String>| match (origin, ts) {
            (None, None) => dash(),
            (o, t) => format!(
                "{} {}",
                o.as_deref().unwrap_or("?"),
                t.as_deref().map(human_ts).unwrap_or_else(dash)
            ),
        };
        for c in &r.conflicts {
            t.row(vec![
                c.node.clone(),
                human_ts(&c.at),
                if c.relation.is_empty() {
                    dash()
                } else {
                    c.relation.clone()
                },
                c.conflict_type.clone(),
                c.key
                    .as_ref()
                    .map(|k| truncate(&k.to_string(), KEY_WIDTH))
                    .unwrap_or_else(dash),
                c.resolution.clone(),
                version(&c.local_origin, &c.local_commit_ts),
                version(&c.remote_origin, &c.remote_commit_ts),
                c.remote_lsn.map(|l| l.to_string()).unwrap_or_else(dash),
            ]);
        }
        out.push_str(&t.render());
    }
    for e in &r.errors {
        let _ = writeln!(
            out,
            "warning: {}'s conflict log was not read ({}): {}",
            e.node,
            e.api_url,
            truncate(&e.error, 200)
        );
    }
    out
}

/// `2026-01-02T03:04:05.123456Z` as `2026-01-02 03:04:05.123456` (UTC).
/// RFC 3339 as "YYYY-MM-DD HH:MM:SS.ffffff+00": readable, and still saying
/// which time zone it is in.
fn human_ts(ts: &str) -> String {
    let t = ts.replacen('T', " ", 1);
    match t.strip_suffix('Z') {
        Some(base) => format!("{base}+00"),
        None => t,
    }
}

/// Words of `s` (made one line) in lines of at most `width` characters; a
/// longer word gets a line of its own.
fn wrap(s: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut cur = String::new();
    for w in s.split_whitespace() {
        if !cur.is_empty() && cur.chars().count() + 1 + w.chars().count() > width {
            lines.push(std::mem::take(&mut cur));
        }
        if !cur.is_empty() {
            cur.push(' ');
        }
        cur.push_str(w);
    }
    if !cur.is_empty() {
        lines.push(cur);
    }
    lines
}

/// Shortens to `max` characters (not bytes), marking the cut; one line.
pub fn truncate(s: &str, max: usize) -> String {
    let s = super::client::one_line(s);
    if s.chars().count() <= max {
        return s;
    }
    let mut t: String = s.chars().take(max.saturating_sub(1)).collect();
    t.push('…');
    t
}

/// Left-aligned columns separated by two spaces; trailing blanks trimmed.
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn render(&self) -> String {
        let cols = self.header.len();
        let mut width = vec![0usize; cols];
        for r in std::iter::once(&self.header).chain(&self.rows) {
            for (i, c) in r.iter().enumerate().take(cols) {
                width[i] = width[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        for r in std::iter::once(&self.header).chain(&self.rows) {
            let mut line = String::from("  ");
            for (i, c) in r.iter().enumerate().take(cols) {
                line.push_str(c);
                if i + 1 < cols {
                    let pad = width[i] - c.chars().count() + 2;
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_columns_by_characters() {
        let mut t = Table::new(&["A", "BB"]);
        t.row(vec!["n1 → n2".into(), "x".into()]);
        t.row(vec!["n10".into(), "".into()]);
        let out = t.render();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "  A        BB");
        assert_eq!(lines[1], "  n1 → n2  x");
        assert_eq!(lines[2], "  n10");
    }

    #[test]
    fn conflicts_table_and_warnings() {
        use mm_proto::api::{ConflictRecord, NodeError};
        let row = ConflictRecord {
            node: "n2".into(),
            id: 4,
            at: "2026-01-02T03:04:05.123456Z".into(),
            relation: "public.accounts".into(),
            conflict_type: "update_origin_differs".into(),
            key: Some(serde_json::json!({"id": 7})),
            local_origin: Some("n2".into()),
            local_commit_ts: Some("2026-01-02T03:04:04.000001Z".into()),
            remote_origin: Some("n1".into()),
            remote_commit_ts: Some("2026-01-02T03:04:04.5Z".into()),
            remote_lsn: Some(Lsn(0x1_0000_00A0)),
            resolution: "apply_remote".into(),
            local_tuple: None,
            remote_tuple: None,
        };
        let skipped = ConflictRecord {
            relation: String::new(),
            conflict_type: "skipped_transaction".into(),
            key: None,
            local_origin: None,
            local_commit_ts: None,
            resolution: "skipped".into(),
            ..row.clone()
        };
        let r = ClusterConflictsResponse {
            limit: 20,
            nodes: vec!["n1".into(), "n2".into()],
            conflicts: vec![row, skipped],
            errors: vec![NodeError {
                node: "n3".into(),
                api_url: "http://127.0.0.1:3".into(),
                error: "cannot reach it: connection refused".into(),
            }],
        };
        let text = render_conflicts(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[0].contains("NODE") && lines[0].contains("REMOTE ORIGIN/TS"));
        for want in [
            "n2",
            "2026-01-02 03:04:05.123456",
            "public.accounts",
            "update_origin_differs",
            r#"{"id":7}"#,
            "apply_remote",
            "n2 2026-01-02 03:04:04.000001",
            "n1 2026-01-02 03:04:04.5",
            "1/A0",
        ] {
            assert!(lines[1].contains(want), "{want} missing: {}", lines[1]);
        }
        assert!(lines[2].contains("skipped_transaction") && lines[2].contains("skipped"));
        assert!(lines[3].starts_with("warning: n3's conflict log was not read"));
        assert!(lines[3].contains("connection refused"));

        let empty = ClusterConflictsResponse {
            limit: 20,
            nodes: vec!["n1".into()],
            conflicts: vec![],
            errors: vec![],
        };
        assert_eq!(render_conflicts(&empty), "no conflicts recorded on n1\n");
    }

    #[test]
    fn truncate_counts_characters_and_flattens_lines() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("ab\ncd", 10), "ab cd");
        assert_eq!(truncate("ééééééé", 4), "ééé…");
    }
}
