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
        line.push_str(&format!(
            " [tables {}/{}, {} rows, {:.1} MB, {:.0} rows/s]",
            r.tables_done,
            r.tables_total,
            r.rows,
            r.bytes as f64 / 1e6,
            rate(r)
        ));
        if r.rows_estimate > r.rows && rate(r) > 0.0 {
            let eta = (r.rows_estimate - r.rows) as f64 / rate(r);
            line.push_str(&format!(" ETA {eta:.0} s"));
        }
    }
    if let Some(e) = &r.error
        && r.phase == "failed"
    {
        line.push_str(&format!(" (retrying: {e})"));
    }
    line
}

/// How the copy is shown: a live bar on a terminal, plain lines when
/// stderr is a file or a pipe, JSON lines with `--json`.
enum Display {
    Bar(indicatif::ProgressBar),
    Lines,
    Json,
}

impl Display {
    fn new(json: bool) -> Display {
        if json {
            return Display::Json;
        }
        if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            return Display::Lines;
        }
        let bar = indicatif::ProgressBar::new(0);
        let style = indicatif::ProgressStyle::with_template(
            "{spinner} add-node [{elapsed_precise}] {bar:30} {pos}/{len} rows (ETA {eta}) {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
        bar.set_style(style);
        bar.enable_steady_tick(Duration::from_millis(200));
        Display::Bar(bar)
    }

    fn show(&self, r: &SyncReport, line: &str, changed: bool) {
        match self {
            Display::Bar(bar) => {
                // The estimate can be short of the truth: never past 100 %.
                bar.set_length(r.rows_estimate.max(r.rows));
                bar.set_position(r.rows);
                let msg = match r.phase.as_str() {
                    "copying" => format!(
                        "tables {}/{}, {:.1} MB, {:.0} rows/s",
                        r.tables_done,
                        r.tables_total,
                        r.bytes as f64 / 1e6,
                        rate(r)
                    ),
                    _ => line.to_owned(),
                };
                bar.set_message(msg);
            }
            _ if !changed => {}
            Display::Lines => eprintln!("add-node: {line}"),
            Display::Json => {
                let event = serde_json::json!({ "event": "add-node", "progress": r, "line": line });
                eprintln!("{event}");
            }
        }
    }
}

impl Drop for Display {
    fn drop(&mut self) {
        if let Display::Bar(bar) = self {
            bar.finish();
        }
    }
}

fn rate(r: &SyncReport) -> f64 {
    if r.elapsed_secs > 0.0 {
        r.rows as f64 / r.elapsed_secs
    } else {
        0.0
    }
}

async fn watch(c: AgentClient, url: String, json: bool) {
    let display = Display::new(json);
    // Plain and JSON lines: on every step, and every 10 s while the rows
    // flow (a long copy does not print twice a second for hours).
    let mut last = String::new();
    let mut printed = std::time::Instant::now();
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
        // Not started yet (or a bad request about to be refused): nothing
        // to show.
        if r.phase == "idle" {
            continue;
        }
        let key = format!("{} {} {} {}", r.phase, r.detail, r.tables_done, r.attempts);
        let key = if r.phase == "done" { line.clone() } else { key };
        let changed = key != last || printed.elapsed() >= Duration::from_secs(10);
        display.show(&r, &line, changed);
        if changed {
            printed = std::time::Instant::now();
        }
        last = key;
    }
}
