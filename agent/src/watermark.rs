//! Watermarks: how a node learns what a peer had already seen when it made a
//! change, and when a tombstone can go.
//!
//! Every agent announces, in its own WAL, the newest commit timestamp it has
//! applied from each origin: a non-transactional logical message (prefix
//! `mm.watermark`), written by an ordinary session (no replication origin),
//! so `origin 'none'` lets it through to every peer. Decoding emits it at its
//! WAL position, between the publisher's commits, so on the receiving side
//! every change that follows it in the stream was committed after the
//! announced versions were applied on the publisher:
//!
//! - Classification (`mm.routine`, `apply::careful`): a change from P to a
//!   row version (origin X, ts t) with P's watermark for X past t could see
//!   that version: a routine cross-origin change, counted but neither
//!   resolved nor logged. Anything else is a true conflict.
//! - Tombstone purge: once every peer P has announced a watermark for the
//!   delete's origin past the delete (and we have applied P's stream up to
//!   that announcement), no change that could be older than the delete can
//!   still arrive from anyone; the tombstone is dropped.
//!
//! An announcement is written within ~10 ms of an apply (woken by it), so it
//! precedes in the WAL any local write made after the applied row became
//! visible — except one made within those milliseconds, which then counts as
//! a true conflict (the classification errs that way, never the other).
//!
//! Timestamps are compared with a safety margin for the purge (commit
//! timestamps of concurrent commits on one node may be out of commit order by
//! microseconds).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use crate::status::StatusRegistry;

pub const PREFIX: &str = "mm.watermark";
/// An announcement follows an apply within this (debounce): it must reach
/// the WAL before the local writes that build on what was applied, or those
/// look concurrent to the peers.
const EMIT_AFTER: Duration = Duration::from_millis(10);
/// ...but not more often than this: every announcement makes each receiver
/// wait for its pipeline to drain (see `Applier::set_watermarks`).
const EMIT_MIN_INTERVAL: Duration = Duration::from_millis(100);
/// Re-announced even when unchanged, so restarted streams learn it.
const REFRESH_EVERY: Duration = Duration::from_secs(2);
const PURGE_EVERY: Duration = Duration::from_secs(5);
const PURGE_MARGIN: chrono::Duration = ORDER_MARGIN;
/// How far one origin's commit timestamps may run out of its WAL order
/// (concurrent commits): every "applied everything from X up to t" test
/// asks for t plus this.
pub const ORDER_MARGIN: chrono::Duration = chrono::Duration::seconds(1);
/// A commit timestamp is taken just before the commit's WAL record is
/// written: a commit stamped this long before an announcement's `at` is in
/// the WAL before it.
pub const HEARTBEAT_MARGIN: chrono::Duration = chrono::Duration::seconds(1);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Announcement {
    pub node: String,
    pub applied: BTreeMap<String, DateTime<Utc>>,
    /// When the publisher wrote it, by its server's clock (the clock of its
    /// commit timestamps). Every commit of the publisher's own from more
    /// than `HEARTBEAT_MARGIN` before this precedes the message in its WAL,
    /// so once everything before the message is applied here, so are they:
    /// how idle origins, and rows that predate replication, count as seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<DateTime<Utc>>,
}

impl Announcement {
    pub fn decode(content: &[u8]) -> Result<Self, String> {
        serde_json::from_slice(content).map_err(|e| format!("malformed watermark: {e}"))
    }
}

/// Shared by the stream tasks (writers) and the emitter/purge task.
#[derive(Debug, Default)]
pub struct Watermarks {
    local: String,
    /// Newest commit timestamp applied here, per origin node.
    applied: Mutex<BTreeMap<String, DateTime<Utc>>>,
    /// Per peer, its latest announcement whose preceding transactions are
    /// all committed here.
    effective: Mutex<BTreeMap<String, BTreeMap<String, DateTime<Utc>>>>,
    /// Wakes the announcer when `applied` moves.
    moved: tokio::sync::Notify,
    /// Every node of the cluster as Raft last said, this one included;
    /// None until it has (`may_group`).
    members: Mutex<Option<Vec<String>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

impl Watermarks {
    pub fn new(local: &str) -> Self {
        Watermarks {
            local: local.to_owned(),
            ..Default::default()
        }
    }

    /// A transaction from `origin` committed here.
    pub fn applied(&self, origin: &str, ts: DateTime<Utc>) {
        let mut g = lock(&self.applied);
        match g.get_mut(origin) {
            Some(e) if *e >= ts => return,
            Some(e) => *e = ts,
            None => {
                g.insert(origin.to_owned(), ts);
            }
        }
        drop(g);
        self.moved.notify_one();
    }

    /// Per origin: the newest commit timestamp applied here.
    pub fn applied_snapshot(&self) -> BTreeMap<String, DateTime<Utc>> {
        lock(&self.applied).clone()
    }

    pub fn set_effective(&self, peer: &str, a: BTreeMap<String, DateTime<Utc>>) {
        lock(&self.effective).insert(peer.to_owned(), a);
    }

    /// The cluster's nodes, from Raft's state (`cluster.rs`).
    pub fn set_members(&self, nodes: Vec<String>) {
        *lock(&self.members) = Some(nodes);
    }

    /// Whether transactions from `peer` committed up to `ts` may be applied
    /// here as one local transaction (`apply/group.rs`), whose commit then
    /// stamps every row it writes with `ts` instead of its own
    /// transaction's older timestamp. Only changes from a third node that
    /// reach this node later ever compare against that stamp (the
    /// publisher's own are ordered; this node's writes are not checked
    /// here). They judge the same by either stamp when, for every third
    /// node X:
    ///
    /// - everything X committed up to `ts` (plus the order margin) is
    ///   applied here, so what X sends later is stamped after `ts`, as it
    ///   is after the true one; and
    /// - X's latest announcement applied here says X had applied the
    ///   publisher's commits up to `ts` (plus the margin): what X sends
    ///   later counts as routine over either stamp, as `mm.routine`
    ///   compares them (the margin: `Guard::params`).
    ///
    /// Unknown membership, or a third node never heard from: no.
    pub fn may_group(&self, peer: &str, ts: DateTime<Utc>) -> bool {
        // One lock at a time: `purge_cutoffs` takes two, in another order.
        let Some(members) = lock(&self.members).clone() else {
            return false;
        };
        let need = ts + ORDER_MARGIN;
        let applied = self.applied_snapshot();
        let eff = lock(&self.effective).clone();
        members
            .iter()
            .filter(|x| **x != peer && **x != self.local)
            .all(|x| {
                applied.get(x).is_some_and(|a| *a > need)
                    && eff
                        .get(x)
                        .and_then(|m| m.get(peer))
                        .is_some_and(|w| *w > need)
            })
    }

    /// Whether `peer` is the only other node of the cluster (Raft's
    /// membership, nodes in every state: a joining one counts). Then a
    /// delete applied from it needs no tombstone (`sql::TombstoneWrite::
    /// Skip`): a remote delete's tombstone is read only by changes from a
    /// third node that had not seen the delete. The publisher's own later
    /// changes follow the delete in its commit order, and this node's
    /// writes are not judged here; for the same reason `purge_cutoffs`
    /// lets such tombstones go as soon as anything later from the
    /// publisher is applied. A node that joins later copies rows in which
    /// the delete is done, and writes after it. Unknown membership: no.
    pub fn sole_peer(&self, peer: &str) -> bool {
        lock(&self.members)
            .as_ref()
            .is_some_and(|m| m.iter().all(|x| x == peer || *x == self.local))
    }

    pub fn forget(&self, peer: &str) {
        lock(&self.effective).remove(peer);
    }

    fn announcement(&self) -> Announcement {
        Announcement {
            node: self.local.clone(),
            applied: lock(&self.applied).clone(),
            at: None,
        }
    }

    /// Per origin node: tombstones of deletes committed before this can go.
    /// `peers` are the nodes streaming into this one.
    pub fn purge_cutoffs(&self, peers: &[String]) -> BTreeMap<String, DateTime<Utc>> {
        let eff = lock(&self.effective);
        let applied = lock(&self.applied);
        let mut out = BTreeMap::new();
        let mut origins: Vec<&String> = peers.iter().collect();
        origins.push(&self.local);
        // Origins that no longer stream here (removed nodes) but whose
        // deletes left tombstones: the same rule, over the peers' words.
        for m in eff.values() {
            for x in m.keys() {
                if !origins.contains(&x) {
                    origins.push(x);
                }
            }
        }
        'origin: for x in origins {
            let mut cutoff: Option<DateTime<Utc>> = None;
            for p in peers.iter().filter(|p| *p != x) {
                let Some(w) = eff.get(p).and_then(|m| m.get(x)) else {
                    continue 'origin;
                };
                cutoff = Some(cutoff.map_or(*w, |c| c.min(*w)));
            }
            // No other peer can send anything older than a delete of x's
            // that x itself sent before its later changes.
            let cutoff = match cutoff {
                Some(c) => c,
                None => match applied.get(x) {
                    Some(a) => *a,
                    None => continue,
                },
            };
            out.insert(x.clone(), cutoff - PURGE_MARGIN);
        }
        out
    }
}

/// Announces this node's watermarks and purges tombstones, until dropped.
pub async fn run(
    dsn: String,
    password: Option<String>,
    wm: Arc<Watermarks>,
    status: Arc<StatusRegistry>,
) {
    loop {
        if let Err(e) = run_once(&dsn, password.as_deref(), &wm, &status).await {
            warn!(error = %e, "watermark/tombstone task: restarting in 2 s");
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

async fn run_once(
    dsn: &str,
    password: Option<&str>,
    wm: &Watermarks,
    status: &StatusRegistry,
) -> anyhow::Result<()> {
    let client = crate::pg::connect(dsn, password).await?;
    let emit = client
        .prepare(
            "SELECT pg_catalog.pg_logical_emit_message(false, 'mm.watermark', \
             pg_catalog.jsonb_set($1::text::jsonb, '{at}', pg_catalog.to_jsonb(pg_catalog.clock_timestamp()))::text)::text",
        )
        .await?;
    let mut last: Option<Announcement> = None;
    let mut last_emit = tokio::time::Instant::now();
    let mut last_purge = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = wm.moved.notified() => {
                let wait = EMIT_MIN_INTERVAL.saturating_sub(last_emit.elapsed()).max(EMIT_AFTER);
                tokio::time::sleep(wait).await;
            }
            _ = tokio::time::sleep(REFRESH_EVERY) => {}
        }
        let a = wm.announcement();
        let changed = last.as_ref() != Some(&a);
        // Sent even when unchanged (and empty): its `at` is the heartbeat
        // that lets the peers count this node's idle stretches as applied.
        if changed || last_emit.elapsed() >= REFRESH_EVERY {
            let text = serde_json::to_string(&a)?;
            client.query_one(&emit, &[&text]).await?;
            last = Some(a);
            last_emit = tokio::time::Instant::now();
        }
        if last_purge.elapsed() >= PURGE_EVERY {
            last_purge = tokio::time::Instant::now();
            let peers: Vec<String> = status.snapshot().into_iter().map(|s| s.from).collect();
            purge(&client, wm, &peers, status).await?;
        }
    }
}

async fn purge(
    client: &tokio_postgres::Client,
    wm: &Watermarks,
    peers: &[String],
    status: &StatusRegistry,
) -> anyhow::Result<()> {
    let cutoffs = wm.purge_cutoffs(peers);
    let origins = client
        .query(
            "SELECT roident, roname FROM pg_catalog.pg_replication_origin",
            &[],
        )
        .await?;
    let mut ids: Vec<u32> = Vec::new();
    let mut ts: Vec<DateTime<Utc>> = Vec::new();
    for (node, cut) in &cutoffs {
        // Every origin of the node: each apply lane of its stream has one.
        let of_node: Vec<u32> = if *node == wm.local {
            vec![0]
        } else {
            origins
                .iter()
                .filter(|r| {
                    crate::stream::names::node_of_origin(&r.get::<_, String>(1))
                        == Some(node.as_str())
                })
                .map(|r| r.get::<_, u32>(0))
                .collect()
        };
        for id in of_node {
            ids.push(id);
            ts.push(*cut);
        }
    }
    if !ids.is_empty() {
        let n = client
            .execute(
                "DELETE FROM mm.tombstones tb WHERE (SELECT o.\"timestamp\" < c.cutoff \
                 FROM pg_catalog.pg_xact_commit_timestamp_origin(tb.xmin) o \
                 JOIN unnest($1::oid[], $2::timestamptz[]) AS c(id, cutoff) ON c.id = o.roident)",
                &[&ids, &ts],
            )
            .await?;
        if n > 0 {
            debug!(purged = n, "tombstones every node has applied past");
        }
    }
    let count: i64 = client
        .query_one("SELECT count(*) FROM mm.tombstones", &[])
        .await?
        .get(0);
    status.set_tombstones(count.max(0) as u64);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn t(s: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + s, 0)
            .single()
            .expect("valid")
    }

    #[test]
    fn purge_waits_for_every_other_peer() {
        let wm = Watermarks::new("a");
        let peers = vec!["b".to_owned(), "c".to_owned()];
        // Nobody announced anything: nothing may go.
        assert!(wm.purge_cutoffs(&peers).is_empty());
        wm.set_effective(
            "b",
            [("a".to_owned(), t(10)), ("c".to_owned(), t(20))].into(),
        );
        // c has not announced: a's and b's deletes stay; c's deletes need
        // only b's word (c's own later changes follow its delete).
        let cut = wm.purge_cutoffs(&peers);
        assert_eq!(cut.get("c"), Some(&(t(20) - PURGE_MARGIN)));
        assert!(!cut.contains_key("a"));
        wm.set_effective("c", [("a".to_owned(), t(5)), ("b".to_owned(), t(7))].into());
        let cut = wm.purge_cutoffs(&peers);
        assert_eq!(cut.get("a"), Some(&(t(5) - PURGE_MARGIN)));
        assert_eq!(cut.get("b"), Some(&(t(7) - PURGE_MARGIN)));
    }

    #[test]
    fn a_removed_nodes_tombstones_go_once_every_peer_is_past_them() {
        let wm = Watermarks::new("a");
        // d was removed: it streams here no more, b and c still do.
        let peers = vec!["b".to_owned(), "c".to_owned()];
        wm.set_effective("b", [("d".to_owned(), t(30))].into());
        assert!(
            !wm.purge_cutoffs(&peers).contains_key("d"),
            "c has not said how far it applied d"
        );
        wm.set_effective("c", [("d".to_owned(), t(25))].into());
        assert_eq!(
            wm.purge_cutoffs(&peers).get("d"),
            Some(&(t(25) - PURGE_MARGIN))
        );
    }

    #[test]
    fn two_nodes_purge_up_to_what_was_applied() {
        let wm = Watermarks::new("a");
        let peers = vec!["b".to_owned()];
        wm.applied("b", t(3));
        let cut = wm.purge_cutoffs(&peers);
        assert_eq!(cut.get("b"), Some(&(t(3) - PURGE_MARGIN)));
        assert!(!cut.contains_key("a"));
    }

    #[test]
    fn grouping_waits_for_membership_and_every_third_node() {
        let wm = Watermarks::new("a");
        // Membership unknown: never.
        assert!(!wm.may_group("b", t(10)));
        // Two nodes: nothing else can reach a row the group wrote.
        wm.set_members(vec!["a".to_owned(), "b".to_owned()]);
        assert!(wm.may_group("b", t(10)));
        // A third node, never heard from: no.
        wm.set_members(vec!["a".to_owned(), "b".to_owned(), "c".to_owned()]);
        assert!(!wm.may_group("b", t(10)));
        // c's commits are applied here past the group, but c has not said
        // it saw b's: its later changes could be judged differently.
        wm.applied("c", t(20));
        assert!(!wm.may_group("b", t(10)));
        wm.set_effective("c", [("b".to_owned(), t(20))].into());
        assert!(wm.may_group("b", t(10)));
        // Within the order margin of either: no.
        let inside = t(20) - ORDER_MARGIN;
        assert!(!wm.may_group("b", inside));
        // c saw b's commits, but c's own are not applied here that far.
        wm.set_effective("c", [("b".to_owned(), t(40))].into());
        assert!(!wm.may_group("b", t(30)));
        assert!(wm.may_group("b", t(18)));
    }

    #[test]
    fn remote_deletes_skip_tombstones_only_from_the_sole_peer() {
        let wm = Watermarks::new("a");
        // Membership unknown: tombstones.
        assert!(!wm.sole_peer("b"));
        wm.set_members(vec!["a".to_owned(), "b".to_owned()]);
        assert!(wm.sole_peer("b"));
        // A third node in any state (joining, parting), however far it
        // has applied: tombstones.
        wm.set_members(vec!["a".to_owned(), "b".to_owned(), "c".to_owned()]);
        wm.applied("c", t(20));
        wm.set_effective("c", [("b".to_owned(), t(20))].into());
        assert!(!wm.sole_peer("b"));
        assert!(!wm.sole_peer("c"));
    }

    #[test]
    fn announcements_round_trip_and_reject_garbage() {
        let a = Announcement {
            node: "n1".into(),
            applied: [("n2".to_owned(), t(1))].into(),
            at: None,
        };
        let bytes = serde_json::to_vec(&a).expect("serializable");
        assert_eq!(Announcement::decode(&bytes), Ok(a));
        // As PostgreSQL's to_jsonb(clock_timestamp()) writes it.
        let sent = br#"{"node": "n1", "applied": {}, "at": "2026-12-01T14:29:03.541664+00:00"}"#;
        let got = Announcement::decode(sent).expect("decodes");
        assert_eq!(
            got.at.map(|t| t.timestamp_micros()),
            Some(1_796_135_343_541_664)
        );
        assert!(Announcement::decode(b"\xff{").is_err());
    }
}
