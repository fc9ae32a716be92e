//! `mmctl sequence add` / `mmctl sequence list`.

use futures_util::future::join_all;
use mm_proto::api::{
    SequenceAddRequest, SequenceLocalRequest, SequenceLocalResponse, SequencesResponse,
    StatusResponse,
};
use serde::Serialize;

use super::client::AgentClient;
use super::commands::{CtlError, Output};
use super::output::Table;

/// Default chunk: small types get small chunks (a 2-byte sequence has
/// 32,767 values for the whole cluster).
fn default_chunk(max: i64) -> i64 {
    if max <= i64::from(i16::MAX) {
        100
    } else {
        10_000
    }
}

async fn members(c: &AgentClient, agent: &str, what: &str) -> Result<StatusResponse, CtlError> {
    c.get(agent, "/v1/status")
        .await
        .map_err(|e| CtlError::new(what, e))
}

pub async fn add(
    c: &AgentClient,
    agent: &str,
    name: &str,
    chunk: Option<u64>,
) -> Result<Output, CtlError> {
    let what = format!("sequence add {name}");
    if crate::sequences::split_name(name).is_none() {
        return Err(CtlError::new(
            what,
            format!("{name:?} must be schema-qualified (schema.name)"),
        ));
    }
    if chunk == Some(0) {
        return Err(CtlError::new(what, "--chunk must be at least 1"));
    }
    let status = members(c, agent, &what).await?;
    // What every node's copy has handed out: allocation starts above all.
    let req = SequenceLocalRequest {
        name: name.to_owned(),
    };
    let answers = join_all(status.nodes.iter().map(|n| {
        let req = req.clone();
        async move {
            let r: Result<SequenceLocalResponse, _> =
                c.post(&n.api_url, "/v1/sequence-local", &req, None).await;
            (n.name.clone(), r)
        }
    }))
    .await;
    let mut used = None;
    let mut min_value = i64::MIN;
    let mut max = i64::MAX;
    for (node, r) in answers {
        let l = r.map_err(|e| CtlError::new(&what, format!("node {node}: {e}")))?;
        if l.increment != 1 {
            return Err(CtlError::new(
                &what,
                format!(
                    "node {node}: its increment is {}; global sequences need INCREMENT 1",
                    l.increment
                ),
            ));
        }
        used = used.max(l.used_max);
        min_value = min_value.max(l.min_value);
        max = max.min(l.max_value);
    }
    let start = used
        .map_or(min_value, |u| u.saturating_add(1))
        .max(min_value.max(1));
    let chunk = match chunk {
        Some(n) => i64::try_from(n).map_err(|_| CtlError::new(&what, "--chunk is too large"))?,
        None => default_chunk(max),
    };
    let add = SequenceAddRequest {
        name: name.to_owned(),
        chunk,
        start,
        max,
    };
    let _: serde_json::Value = c
        .post(agent, "/v1/sequences", &add, None)
        .await
        .map_err(|e| CtlError::new(&what, e))?;
    Output::new(
        format!(
            "sequence {name} is cluster-global: values {start}..{max} in chunks of {chunk}, each node drawing from its own"
        ),
        &add,
    )
}

#[derive(Serialize)]
struct ListJson {
    sequences: Vec<SequenceJson>,
}

#[derive(Serialize)]
struct SequenceJson {
    name: String,
    chunk: i64,
    next: i64,
    max: i64,
    exhausted: bool,
    ranges: Vec<mm_proto::api::SequenceRangeInfo>,
    nodes: Vec<NodeJson>,
}

#[derive(Serialize)]
struct NodeJson {
    node: String,
    /// The chunk its local sequence draws from (None: not switched yet, or
    /// the node could not be read).
    current: Option<mm_proto::api::SequenceRangeInfo>,
    last_value: Option<i64>,
    /// Chunks it was ever given.
    chunks: usize,
    /// Unused chunks it holds after the current one.
    reserve: usize,
    error: Option<String>,
}

pub async fn list(c: &AgentClient, agent: &str) -> Result<Output, CtlError> {
    let status = members(c, agent, "sequence list").await?;
    let answers = join_all(status.nodes.iter().map(|n| async move {
        let r: Result<SequencesResponse, _> = c.get(&n.api_url, "/v1/sequences").await;
        (n.name.clone(), r)
    }))
    .await;
    let own: SequencesResponse = c
        .get(agent, "/v1/sequences")
        .await
        .map_err(|e| CtlError::new("sequence list", e))?;
    let mut out = ListJson {
        sequences: Vec::new(),
    };
    for s in &own.sequences {
        let mut nodes = Vec::new();
        for (node, r) in &answers {
            let mine: Vec<_> = s.ranges.iter().filter(|r| &r.node == node).collect();
            let view = r
                .as_ref()
                .map(|v| v.sequences.iter().find(|x| x.name == s.name));
            let (current, last_value, error) = match view {
                Ok(Some(x)) => (x.current.clone(), x.last_value, None),
                Ok(None) => (
                    None,
                    None,
                    Some("does not know the sequence yet".to_owned()),
                ),
                Err(e) => (None, None, Some(e.to_string())),
            };
            let reserve = current
                .as_ref()
                .and_then(|cur| mine.iter().position(|r| r.start == cur.start))
                .map_or(0, |i| mine.len() - i - 1);
            nodes.push(NodeJson {
                node: node.clone(),
                current,
                last_value,
                chunks: mine.len(),
                reserve,
                error,
            });
        }
        out.sequences.push(SequenceJson {
            name: s.name.clone(),
            chunk: s.chunk,
            next: s.next,
            max: s.max,
            exhausted: s.exhausted,
            ranges: s.ranges.clone(),
            nodes,
        });
    }
    let mut human = String::new();
    if out.sequences.is_empty() {
        human.push_str("no global sequences (add one with `mmctl sequence add SCHEMA.SEQ`)");
    }
    for s in &out.sequences {
        let left = if s.exhausted {
            "exhausted".to_owned()
        } else {
            format!("next chunk from {}", s.next)
        };
        human.push_str(&format!(
            "{}  chunk {}  max {}  {left}\n",
            s.name, s.chunk, s.max
        ));
        let mut t = Table::new(&[
            "node",
            "current chunk",
            "last value",
            "used",
            "reserve",
            "chunks",
        ]);
        for n in &s.nodes {
            let (cur, used) = match &n.current {
                Some(r) => {
                    let size = (r.end - r.start + 1).max(1);
                    let done = n.last_value.map_or(0, |v| v - r.start + 1).clamp(0, size);
                    (
                        format!("{}..{}", r.start, r.end),
                        format!("{}%", done * 100 / size),
                    )
                }
                None => (n.error.clone().unwrap_or_else(|| "-".into()), "-".into()),
            };
            t.row(vec![
                n.node.clone(),
                cur,
                n.last_value.map_or("-".into(), |v| v.to_string()),
                used,
                n.reserve.to_string(),
                n.chunks.to_string(),
            ]);
        }
        human.push_str(&t.render());
    }
    Output::new(human.trim_end().to_owned(), &out)
}
