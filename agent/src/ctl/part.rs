//! `mmctl remove-node --name N`.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use mm_proto::api::{NodeInfo, RemoveNodeRequest, SlotsResponse, StatusResponse};
use serde::Serialize;

use super::client::AgentClient;
use super::commands::{CtlError, Output};
use crate::stream::names::slot_name;

/// How long the remaining nodes get to drop the removed node's slots.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Serialize)]
struct Removed {
    removed: NodeInfo,
    remaining: Vec<String>,
    /// Nodes that could not be asked whether its slots are gone.
    unreachable: Vec<String>,
}

pub async fn remove_node(c: &AgentClient, agent: &str, name: &str) -> Result<Output, CtlError> {
    let what = format!("remove-node {name}");
    let removed: NodeInfo = c
        .post(
            agent,
            "/v1/nodes/remove",
            &RemoveNodeRequest {
                name: name.to_owned(),
            },
            Some(Duration::from_secs(90)),
        )
        .await
        .map_err(|e| CtlError::new(&what, e))?;
    // The remaining nodes, as the cluster now sees them (retried: when the
    // leader removed itself, an election follows).
    let deadline = Instant::now() + CLEANUP_TIMEOUT;
    let status: StatusResponse = loop {
        match c.get::<StatusResponse>(agent, "/v1/status").await {
            Ok(s) if !s.nodes.iter().any(|n| n.id == removed.id) => break s,
            Ok(_) | Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Ok(_) => {
                return Err(CtlError::new(
                    &what,
                    format!(
                        "{agent} still lists {name} after {}s",
                        CLEANUP_TIMEOUT.as_secs()
                    ),
                ));
            }
            Err(e) => return Err(CtlError::new(&what, e)),
        }
    };
    let remaining: Vec<NodeInfo> = status.nodes.clone();
    // Every remaining node drops its slot for the removed node (their
    // reconcilers); wait until none is left.
    let mut unreachable = Vec::new();
    loop {
        let answers = join_all(remaining.iter().map(|n| async move {
            (
                n.name.clone(),
                c.get::<SlotsResponse>(&n.api_url, "/v1/slots").await,
            )
        }))
        .await;
        let mut left = Vec::new();
        unreachable.clear();
        for (node, r) in answers {
            match r {
                Ok(s) => {
                    let slot = slot_name(&node, name);
                    if s.slots.contains(&slot) {
                        left.push(format!("slot {slot} on {node}"));
                    }
                }
                Err(_) => unreachable.push(node),
            }
        }
        if left.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            return Err(CtlError::new(
                &what,
                format!(
                    "{name} left the cluster, but after {}s these remain: {}",
                    CLEANUP_TIMEOUT.as_secs(),
                    left.join(", ")
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let names: Vec<String> = remaining.iter().map(|n| n.name.clone()).collect();
    let mut human = format!(
        "removed {name}: streams to and from it stopped, its slots dropped on {}",
        names.join(", ")
    );
    if !unreachable.is_empty() {
        human.push_str(&format!(
            " (not confirmed on unreachable {}: they drop them when back)",
            unreachable.join(", ")
        ));
    }
    Output::new(
        human,
        &Removed {
            removed,
            remaining: names,
            unreachable,
        },
    )
}
