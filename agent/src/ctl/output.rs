//! What mmctl prints: the aggregated cluster status (as JSON or as tables)
//! and a minimal aligned-table writer.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use mm_proto::Lsn;
use mm_proto::api::{LeaderInfo, NodeInfo};
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
    pub conflicts: BTreeMap<String, u64>,
    pub received_lsn: Option<Lsn>,
    pub applied_lsn: Option<Lsn>,
    pub processed_lsn: Option<Lsn>,
    pub restarts: Option<u64>,
    /// Bytes of in-progress transactions received before their commit.
    pub streamed_bytes: Option<u64>,
    pub last_error: Option<String>,
}

/// Longest last error shown in the table; `--json` has the whole text.
const ERROR_WIDTH: usize = 60;

pub fn render_status(s: &ClusterStatus) -> String {
    let mut out = String::new();
    let mut nodes = Table::new(&["", "NAME", "ID", "STATE", "URL", "NOTE"]);
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
                p.last_error
                    .as_deref()
                    .map(|e| truncate(e, ERROR_WIDTH))
                    .unwrap_or_else(|| "-".into()),
            ]);
        }
        let _ = writeln!(out, "\nStreams");
        out.push_str(&pairs.render());
    }
    out
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
    fn truncate_counts_characters_and_flattens_lines() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("ab\ncd", 10), "ab cd");
        assert_eq!(truncate("ééééééé", 4), "ééé…");
    }
}
