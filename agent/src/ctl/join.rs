//! `mmctl add-node --name N --url URL [--source S]`: the join runs on the
//! Raft leader; meanwhile the new node's copy is shown from its own agent
//! (`GET /v1/sync` at URL): one line on stderr per change, JSON lines with
//! `--json` (stdout keeps the single result document).

use std::time::Duration;

use mm_proto::api::{AddNodeRequest, NodeInfo, StatusResponse, SyncReport};

use super::client::{AgentClient, ClientError};
use super::commands::{CtlError, Output};

pub async fn add_node(
    c: &AgentClient,
    agent: &str,
    name: &str,
    url: &str,
    source: Option<&str>,
    json: bool,
) -> Result<Output, CtlError> {
    let req = AddNodeRequest {
        name: name.to_owned(),
        url: url.to_owned(),
        source: source.map(str::to_owned),
    };
    let watcher = tokio::spawn(watch(c.clone(), url.trim_end_matches('/').to_owned(), json));
    // No client timeout: the agent bounds each add-node step itself and
    // answers with the step that timed out.
    let res: Result<NodeInfo, ClientError> = c.post(agent, "/v1/nodes", &req, None).await;
    watcher.abort();
    let node = res.map_err(|e| CtlError::new(format!("add-node {name}"), e))?;
    Output::new(
        format!(
            "node {} (id {}) is {} at {}",
            node.name, node.id, node.state, node.api_url
        ),
        &node,
    )
}

/// One progress line for a copy report.
pub fn describe(r: &SyncReport) -> String {
    let mut line = format!("{}: {}", r.phase, r.detail);
    if r.tables_total > 0 {
        let rate = if r.elapsed_secs > 0.0 {
            r.rows as f64 / r.elapsed_secs
        } else {
            0.0
        };
        line.push_str(&format!(
            " [tables {}/{}, {} rows, {:.1} MB, {:.0} rows/s]",
            r.tables_done,
            r.tables_total,
            r.rows,
            r.bytes as f64 / 1e6,
            rate
        ));
    }
    if let Some(e) = &r.error
        && r.phase == "failed"
    {
        line.push_str(&format!(" (retrying: {e})"));
    }
    line
}

async fn watch(c: AgentClient, url: String, json: bool) {
    let mut last = String::new();
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Ok(r) = c.get::<SyncReport>(&url, "/v1/sync").await else {
            continue;
        };
        let mut line = describe(&r);
        // Once copied: how far behind each peer the new node still is.
        if r.phase == "done"
            && let Ok(s) = c.get::<StatusResponse>(&url, "/v1/status").await
            && !s.streams.is_empty()
        {
            let lags: Vec<String> = s
                .streams
                .iter()
                .map(|st| match st.lag_bytes {
                    Some(b) => format!("{} {b} B", st.from),
                    None => format!("{} ?", st.from),
                })
                .collect();
            line = format!("catching up: lag {}", lags.join(", "));
        }
        if line == last {
            continue;
        }
        if json {
            let event = serde_json::json!({ "event": "add-node", "progress": r, "line": line });
            eprintln!("{event}");
        } else {
            eprintln!("add-node: {line}");
        }
        last = line;
    }
}
