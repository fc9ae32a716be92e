//! remove-node: parting a node, whether it is up or down.
//!
//! On the leader, in this order, each step a Raft write so an interrupted
//! removal is finished by running it again:
//! 1. the node becomes `parting`: every node stops its stream from it, and
//!    the node itself (if up) stops streaming from everyone;
//! 2. it is removed from the state: its name joins `removed_names`, so every
//!    remaining node drops its slot for it and its apply progress (`cleanup`, run by
//!    each node's reconciler on every state change and every few seconds:
//!    also a slot a removed agent that missed its removal creates again),
//!    its stream status goes, so its watermark no longer holds back
//!    tombstone purging; a node that is up applies this entry and drops
//!    the slots it published;
//! 3. it leaves the Raft membership (a leader removing itself steps down).
//!
//! Fencing: an agent that was down (or cut off) while it was removed still
//! believes it is a member. Its reconciler asks a peer (`fenced`): a peer
//! that has applied more of the log and no longer lists this node's id
//! means it was removed; it then neither streams nor applies, and drops
//! the slots it published, until its data_dir is wiped (a fresh id).

use std::time::Duration;

use mm_proto::api::{NodeInfo, NodeState, StatusResponse};
use tokio_postgres::Client;
use tracing::{info, warn};

use crate::raft::{ClusterRequest, ClusterResponse, ClusterState, RaftNode, WriteError};
use crate::stream::names::{origin_name, slot_name};

#[derive(Debug, thiserror::Error)]
pub enum PartError {
    #[error("unknown node {0}")]
    Unknown(String),
    #[error("{what}: {source}")]
    Raft {
        what: String,
        #[source]
        source: WriteError,
    },
    #[error("{0}")]
    Rejected(String),
}

async fn write(raft: &RaftNode, what: &str, req: ClusterRequest) -> Result<(), PartError> {
    match raft.write(req).await {
        Ok(ClusterResponse::Ok) => Ok(()),
        Ok(ClusterResponse::Error(e)) => Err(PartError::Rejected(e)),
        Err(source) => Err(PartError::Raft {
            what: what.into(),
            source,
        }),
    }
}

/// Runs on the leader (the API forwards there).
pub async fn remove_node(raft: &RaftNode, name: &str) -> Result<NodeInfo, PartError> {
    let info = raft
        .cluster()
        .borrow()
        .node_by_name(name)
        .cloned()
        .ok_or_else(|| PartError::Unknown(name.to_owned()))?;
    info!(node = %name, id = info.id, "removing node: parting");
    write(
        raft,
        "marking the node parting",
        ClusterRequest::SetNodeState {
            name: name.to_owned(),
            state: NodeState::Parting,
        },
    )
    .await?;
    write(
        raft,
        "removing the node from the cluster state",
        ClusterRequest::RemoveNode {
            name: name.to_owned(),
        },
    )
    .await?;
    // Give a node that is up a moment to apply its removal (it then drops
    // its own slots) before it is cut off from the log.
    raft.wait_replicated(info.id, Duration::from_secs(3)).await;
    raft.remove_member(info.id)
        .await
        .map_err(|source| PartError::Raft {
            what: "removing the node from the Raft membership".into(),
            source,
        })?;
    info!(node = %name, id = info.id, "node removed");
    Ok(info)
}

/// Slots on this node's PostgreSQL that must go: those it publishes to
/// removed or parting nodes, or all it publishes when it was removed itself.
fn doomed_slots(state: &ClusterState, me: &str, fenced: bool) -> Vec<String> {
    let mut names: Vec<&String> = state.removed_names.iter().collect();
    let gone_myself = fenced || state.removed_names.contains(me);
    if gone_myself {
        names.extend(state.nodes.values().map(|n| &n.name));
    } else {
        names.extend(
            state
                .nodes
                .values()
                .filter(|n| n.state == NodeState::Parting)
                .map(|n| &n.name),
        );
    }
    names
        .into_iter()
        .filter(|n| n.as_str() != me)
        .map(|n| slot_name(me, n))
        .collect()
}

/// Drops what belongs to removed nodes on this node: their slots (a
/// walsender still using one is terminated first; the slot goes on the
/// next round) and apply progress (origins stay: see below). Idempotent; returns how
/// much is left to do (0: clean).
pub async fn cleanup(
    client: &Client,
    state: &ClusterState,
    me: &str,
    fenced: bool,
) -> Result<usize, tokio_postgres::Error> {
    let mut left = 0;
    for slot in doomed_slots(state, me, fenced) {
        let Some(row) = client
            .query_opt(
                "SELECT active_pid FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await?
        else {
            continue;
        };
        let pid: Option<i32> = row.try_get(0)?;
        match pid {
            Some(pid) => {
                client
                    .execute("SELECT pg_catalog.pg_terminate_backend($1)", &[&pid])
                    .await?;
                left += 1;
            }
            None => match client
                .execute("SELECT pg_catalog.pg_drop_replication_slot($1)", &[&slot])
                .await
            {
                Ok(_) => info!(%slot, "dropped the slot of a removed node"),
                Err(e) => {
                    warn!(%slot, error = %e, "cannot drop the slot of a removed node yet");
                    left += 1;
                }
            },
        }
    }
    // A removed node forgets every peer; the others forget the removed
    // ones: their apply progress goes (a node joining later under the same
    // name has another WAL). Their replication ORIGINS stay: rows and
    // tombstones they wrote carry the origin's id in their commit
    // timestamps, and PostgreSQL hands a dropped id to the next origin
    // created, which would make those versions look like the new node's.
    let gone_myself = fenced || state.removed_names.contains(me);
    let forget: Vec<&String> = if gone_myself {
        state
            .removed_names
            .iter()
            .chain(state.nodes.values().map(|n| &n.name))
            .collect()
    } else {
        state.removed_names.iter().collect()
    };
    for name in forget.into_iter().filter(|n| n.as_str() != me) {
        client
            .execute(
                "DELETE FROM mm.apply_progress WHERE origin = $1",
                &[&origin_name(name)],
            )
            .await?;
    }
    Ok(left)
}

/// Has this node been removed while it was away? Asks the peers it knows:
/// one that has applied more of the Raft log and does not list this node's
/// id says so. Unreachable peers say nothing (a partition is not a removal).
pub async fn fenced(
    http: &crate::ctl::client::AgentClient,
    state: &ClusterState,
    me: &str,
) -> bool {
    let Some(my_id) = state.node_by_name(me).map(|n| n.id) else {
        return false;
    };
    for peer in state.nodes.values().filter(|n| n.name != me) {
        let Ok(st) = http
            .get::<StatusResponse>(&peer.api_url, "/v1/status")
            .await
        else {
            continue;
        };
        let listed = st.nodes.iter().any(|n| n.id == my_id);
        if st.last_applied_index > state.last_applied_index && !listed {
            warn!(node = %me, told_by = %peer.name, "this node was removed from the cluster: it no longer streams or applies (wipe its data_dir to join again)");
            return true;
        }
        if st.last_applied_index >= state.last_applied_index {
            // As far as we are, and we are a member there: settled.
            return false;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: u64, name: &str, state: NodeState) -> NodeInfo {
        NodeInfo {
            id,
            name: name.into(),
            api_url: String::new(),
            peer_dsn: String::new(),
            state,
        }
    }

    #[test]
    fn slots_for_removed_and_parting_nodes_go_and_a_removed_node_drops_all_its_own() {
        let mut s = ClusterState::default();
        s.nodes.insert(1, node(1, "a", NodeState::Active));
        s.nodes.insert(2, node(2, "b", NodeState::Parting));
        s.nodes.insert(3, node(3, "c", NodeState::Active));
        s.removed_names.insert("d".into());
        let mut got = doomed_slots(&s, "a", false);
        got.sort();
        assert_eq!(got, vec![slot_name("a", "b"), slot_name("a", "d")]);
        let mut all = doomed_slots(&s, "a", true);
        all.sort();
        assert_eq!(
            all,
            vec![
                slot_name("a", "b"),
                slot_name("a", "c"),
                slot_name("a", "d")
            ]
        );
    }
}
