//! The reconciler: turns the Raft state machine into local reality — the
//! `mm.nodes` view for SQL readers, and one stream from every other member.
//!
//! It is level-triggered: on every state change it compares what runs with
//! what should run, so a missed notification or a restart converges the same.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use mm_proto::api::{NodeState, StreamState};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::raft::ClusterState;
use crate::stream::{LocalNode, Peer, StreamHandle, spawn_stream};

pub struct Reconciler {
    local: LocalNode,
    streams: HashMap<String, StreamHandle>,
    materialized_index: u64,
    /// Removed from the cluster while away (`part::fenced`): no streams.
    fenced: bool,
    last_fence_check: Option<Instant>,
    /// Slots/origins of removed nodes still to drop (`part::cleanup`).
    cleanup_left: bool,
}

/// How often a node that believes it is a member asks whether it was removed.
const FENCE_CHECK_EVERY: Duration = Duration::from_secs(5);

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
            fenced: false,
            last_fence_check: None,
            cleanup_left: true,
        }
    }

    /// Runs until the state channel closes (agent shutdown).
    pub async fn run(mut self, mut cluster: watch::Receiver<ClusterState>) {
        let http = crate::ctl::client::AgentClient::new(self.local.token.to_string()).ok();
        loop {
            let state = cluster.borrow_and_update().clone();
            if let Some(http) = &http {
                self.check_fence(http, &state).await;
            }
            self.reconcile(&state).await;
            let materialized = self.materialize(&state).await;
            if let Err(e) = &materialized {
                warn!(error = %e, "cannot materialize cluster state into mm.nodes; will retry");
            }
            self.clean_up(&state).await;
            // Level-triggered: also every few seconds (fence checks, and
            // slots a removed node may have created again).
            let wait = if materialized.is_err() {
                Duration::from_secs(2)
            } else {
                FENCE_CHECK_EVERY
            };
            tokio::select! {
                r = cluster.changed() => if r.is_err() { break },
                _ = tokio::time::sleep(wait) => {}
            }
        }
        for (_, h) in self.streams.drain() {
            h.stop().await;
        }
    }

    /// Asks the peers whether this node was removed while away (at start,
    /// then every `FENCE_CHECK_EVERY`); once fenced, stays fenced.
    async fn check_fence(&mut self, http: &crate::ctl::client::AgentClient, state: &ClusterState) {
        if self.fenced
            || self
                .last_fence_check
                .is_some_and(|t| t.elapsed() < FENCE_CHECK_EVERY)
        {
            return;
        }
        self.last_fence_check = Some(Instant::now());
        if crate::part::fenced(http, state, &self.local.name).await {
            self.fenced = true;
            self.cleanup_left = true;
            for (_, h) in self.streams.drain() {
                h.stop().await;
            }
        }
    }

    /// Drops the slots and origins of removed nodes (`part::cleanup`).
    async fn clean_up(&mut self, state: &ClusterState) {
        let needed = self.cleanup_left
            || self.fenced
            || !state.removed_names.is_empty()
            || state.nodes.values().any(|n| n.state == NodeState::Parting);
        if !needed {
            return;
        }
        let client = match crate::pg::connect(&self.local.dsn, self.local.password.as_deref()).await
        {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "cannot clean up after removed nodes; will retry");
                return;
            }
        };
        match crate::part::cleanup(&client, state, &self.local.name, self.fenced).await {
            Ok(left) => self.cleanup_left = left > 0,
            Err(e) => warn!(error = %e, "cleaning up after removed nodes failed; will retry"),
        }
    }

    async fn reconcile(&mut self, state: &ClusterState) {
        let me = &self.local.name;
        // Whom a grouped apply must wait for (`Watermarks::may_group`):
        // every node, whatever its state, as long as it is in the cluster.
        self.local
            .watermarks
            .set_members(state.nodes.values().map(|n| n.name.clone()).collect());
        let self_member = !self.fenced
            && state
                .node_by_name(me)
                .is_some_and(|n| streams_with(n.state));
        // A node copying its data (`syncing`) takes no stream in until the
        // copy is done and the join moves it on (`sync`): what it copies
        // is exactly what those streams then skip.
        let receiving = self_member
            && state
                .node_by_name(me)
                .is_some_and(|n| n.state != NodeState::Syncing);
        let mut desired: HashMap<String, Peer> = HashMap::new();
        if receiving {
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
