//! The reconciler: turns the Raft state machine into local reality — the
//! `mm.nodes` view for SQL readers, and one stream from every other member.
//!
//! It is level-triggered: on every state change it compares what runs with
//! what should run, so a missed notification or a restart converges the same.

use std::collections::HashMap;

use mm_proto::api::{NodeState, StreamState};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::raft::ClusterState;
use crate::stream::{LocalNode, Peer, StreamHandle, spawn_stream};

pub struct Reconciler {
    local: LocalNode,
    streams: HashMap<String, StreamHandle>,
    materialized_index: u64,
}

/// States in which a node publishes to and subscribes from the others.
fn streams_with(state: NodeState) -> bool {
    matches!(
        state,
        NodeState::Joining | NodeState::Syncing | NodeState::Active
    )
}

impl Reconciler {
    pub fn new(local: LocalNode) -> Self {
        Reconciler {
            local,
            streams: HashMap::new(),
            materialized_index: 0,
        }
    }

    /// Runs until the state channel closes (agent shutdown).
    pub async fn run(mut self, mut cluster: watch::Receiver<ClusterState>) {
        loop {
            let state = cluster.borrow_and_update().clone();
            self.reconcile(&state).await;
            if let Err(e) = self.materialize(&state).await {
                warn!(error = %e, "cannot materialize cluster state into mm.nodes; will retry");
                tokio::select! {
                    r = cluster.changed() => if r.is_err() { break },
                    _ = tokio::time::sleep(std::time::Duration::from_secs(2)) => {}
                }
                continue;
            }
            if cluster.changed().await.is_err() {
                break;
            }
        }
        for (_, h) in self.streams.drain() {
            h.stop().await;
        }
    }

    async fn reconcile(&mut self, state: &ClusterState) {
        let me = &self.local.name;
        let self_member = state
            .node_by_name(me)
            .is_some_and(|n| streams_with(n.state));
        let mut desired: HashMap<String, Peer> = HashMap::new();
        if self_member {
            for n in state.nodes.values() {
                if &n.name != me && streams_with(n.state) && !state.is_paused(&n.name, me) {
                    desired.insert(
                        n.name.clone(),
                        Peer {
                            name: n.name.clone(),
                            peer_dsn: n.peer_dsn.clone(),
                        },
                    );
                }
            }
        }
        let stale: Vec<String> = self
            .streams
            .iter()
            .filter(|(name, h)| desired.get(*name) != Some(&h.peer))
            .map(|(name, _)| name.clone())
            .collect();
        for name in stale {
            if let Some(h) = self.streams.remove(&name) {
                info!(from = %name, "stopping stream");
                h.stop().await;
            }
            let paused = state.is_paused(&name, me) && state.node_by_name(&name).is_some();
            if paused {
                self.local
                    .status
                    .update(&name, |s| s.state = StreamState::Paused);
            } else {
                self.local.status.remove(&name);
            }
        }
        for (name, peer) in desired {
            if !self.streams.contains_key(&name) {
                info!(from = %name, "starting stream");
                self.streams
                    .insert(name, spawn_stream(self.local.clone(), peer));
            }
        }
        // Paused pairs whose stream never ran here still show up as paused.
        if self_member {
            for (from, to) in &state.paused {
                if to == me && state.node_by_name(from).is_some() {
                    self.local
                        .status
                        .update(from, |s| s.state = StreamState::Paused);
                }
            }
        }
    }

    /// Writes the state into `mm.nodes` / `mm.paused_streams` /
    /// `mm.sequence_ranges`, guarded by the
    /// applied log index so an older state never overwrites a newer one.
    async fn materialize(&mut self, state: &ClusterState) -> Result<(), anyhow::Error> {
        if state.last_applied_index <= self.materialized_index && self.materialized_index > 0 {
            return Ok(());
        }
        let mut client =
            crate::pg::connect(&self.local.dsn, self.local.password.as_deref()).await?;
        let tx = client.transaction().await?;
        let stored: Option<i64> = tx
            .query_opt("SELECT applied_index FROM mm.raft_applied FOR UPDATE", &[])
            .await?
            .map(|r| r.get(0));
        let index = i64::try_from(state.last_applied_index).unwrap_or(i64::MAX);
        if stored.is_some_and(|s| s >= index && s > 0) {
            tx.commit().await?;
            self.materialized_index = state.last_applied_index;
            return Ok(());
        }
        tx.execute("DELETE FROM mm.nodes", &[]).await?;
        for n in state.nodes.values() {
            tx.execute(
                "INSERT INTO mm.nodes (id, name, api_url, peer_dsn, state) VALUES ($1::text::numeric, $2, $3, $4, $5)",
                &[&n.id.to_string(), &n.name, &n.api_url, &n.peer_dsn, &n.state.as_str()],
            )
            .await?;
        }
        tx.execute("DELETE FROM mm.paused_streams", &[]).await?;
        for (from, to) in &state.paused {
            tx.execute(
                "INSERT INTO mm.paused_streams (from_node, to_node) VALUES ($1, $2)",
                &[from, to],
            )
            .await?;
        }
        tx.execute("DELETE FROM mm.sequence_ranges", &[]).await?;
        for (name, g) in &state.sequences {
            for r in &g.ranges {
                tx.execute(
                    "INSERT INTO mm.sequence_ranges (sequence_name, node, range_start, range_end) VALUES ($1, $2, $3, $4)",
                    &[name, &r.node, &r.start, &r.end],
                )
                .await?;
            }
        }
        tx.execute(
            "INSERT INTO mm.raft_applied (singleton, applied_index) VALUES (true, $1) \
             ON CONFLICT (singleton) DO UPDATE SET applied_index = EXCLUDED.applied_index",
            &[&index],
        )
        .await?;
        tx.commit().await?;
        self.materialized_index = state.last_applied_index;
        check_capacity(&client, state).await;
        Ok(())
    }
}

/// SPEC §2: slots and senders must cover 2 x (nodes - 1) + 2. Checked at
/// start for two nodes and again whenever membership changes; too few is
/// logged loudly (a stream that cannot get a slot then reports its own error).
async fn check_capacity(client: &tokio_postgres::Client, state: &ClusterState) {
    let members = state
        .nodes
        .values()
        .filter(|n| n.state != NodeState::Parting)
        .count();
    let need = crate::prereq::required_slots(members);
    for name in ["max_replication_slots", "max_wal_senders"] {
        let have = match client
            .query_one("SELECT pg_catalog.current_setting($1)::int8", &[&name])
            .await
        {
            Ok(row) => row.get::<_, i64>(0),
            Err(_) => continue,
        };
        if have < need {
            warn!(
                setting = name,
                have,
                need,
                members,
                "{name} is {have}, below the {need} a {members}-node cluster needs (2 x (nodes - 1) + 2)"
            );
        }
    }
}
