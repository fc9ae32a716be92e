//! Lag of every stream into this node, in every stream state.
//!
//! A stream only learns the publisher's position while it runs (XLogData and
//! keepalives), so a paused stream, or one stopped by an error, would show no
//! lag at all — and lag alerts would never fire for exactly the streams that
//! need them. This module measures lag from outside the stream instead:
//! every second it reads each publisher's current WAL position over the
//! peer's `peer_dsn` (a plain SQL connection) and compares it with what this
//! node has applied from that publisher (the stream's processed position, or
//! `mm.apply_progress` when no stream ran since the agent started).
//!
//! * `lag_bytes` = publisher's current WAL position − processed position.
//! * `lag_seconds` = age of the oldest change not yet applied: exact when it
//!   is known (a paused stream peeks at its slot for the first pending
//!   transaction's commit timestamp; a stream stopped at a transaction knows
//!   that one's), otherwise the time since the publisher's WAL was first seen
//!   past the processed position (`LagTracker`, which underestimates by at
//!   most one probe interval), and 0 when nothing is pending.
//!
//! The publisher's WAL also holds what it does not send us (changes it
//! applied from other nodes, the agents' watermark messages), so a stream
//! that is idle but not running shows a few hundred bytes of lag; the
//! running stream's keepalives move its processed position past them.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use mm_proto::Lsn;
use mm_proto::api::{NodeState, StreamState};
use tokio::sync::watch;
use tokio_postgres::Client;
use tracing::debug;

use crate::raft::ClusterState;
use crate::status::StatusRegistry;
use crate::stream::names;

const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// A paused stream's slot is peeked this often (it decodes WAL).
const PEEK_EVERY: u32 = 5;
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a running stream gets to reach a publisher position before it
/// counts as lag: more than its feedback/keepalive period (300 ms).
const SETTLE: Duration = Duration::from_millis(800);
/// Samples kept per publisher (one per probe at most: hours of backlog).
const MAX_SAMPLES: usize = 100_000;

/// Sans-I/O: the publisher positions seen over time, and what they say about
/// a processed position.
#[derive(Debug, Default)]
pub struct LagTracker {
    /// (when first seen, publisher WAL position), positions increasing.
    samples: VecDeque<(Instant, Lsn)>,
}

impl LagTracker {
    /// Records the publisher's WAL position as seen at `at`.
    pub fn observe(&mut self, at: Instant, publisher: Lsn) {
        if self.samples.back().is_some_and(|(_, l)| *l >= publisher) {
            return;
        }
        self.samples.push_back((at, publisher));
        if self.samples.len() > MAX_SAMPLES {
            self.samples.pop_front();
        }
    }

    /// The publisher's newest known position.
    pub fn publisher(&self) -> Option<Lsn> {
        self.samples.back().map(|(_, l)| *l)
    }

    /// (bytes, seconds) behind for a node that has processed everything below
    /// `processed`; None before the first sample. Seconds: since the first
    /// sample past `processed`, i.e. since the oldest pending change was
    /// first seen.
    pub fn lag(&mut self, at: Instant, processed: Lsn) -> Option<(u64, f64)> {
        self.lag_settled(at, processed, Duration::ZERO)
    }

    /// As `lag`, against the publisher's position as it was `settle` ago: a
    /// running stream reaches the publisher's current position only at its
    /// next keepalive, so comparing with a position read this instant would
    /// show the last few hundred bytes (watermarks) of an idle stream as lag.
    pub fn lag_settled(
        &mut self,
        at: Instant,
        processed: Lsn,
        settle: Duration,
    ) -> Option<(u64, f64)> {
        // Samples at or below `processed` say nothing any more (processed
        // positions only grow), except the newest one.
        while self.samples.len() > 1 && self.samples.front().is_some_and(|(_, l)| *l <= processed) {
            self.samples.pop_front();
        }
        self.samples.back()?;
        let cutoff = at.checked_sub(settle).unwrap_or(at);
        let Some(&(_, newest)) = self.samples.iter().rev().find(|(t, _)| *t <= cutoff) else {
            return Some((0, 0.0));
        };
        let bytes = newest.0.saturating_sub(processed.0);
        if bytes == 0 {
            return Some((0, 0.0));
        }
        let since = self
            .samples
            .iter()
            .find(|(_, l)| *l > processed)
            .map_or(at, |(t, _)| *t);
        Some((bytes, at.saturating_duration_since(since).as_secs_f64()))
    }
}

/// The commit timestamp of the first transaction waiting in the publisher's
/// slot for us (decoded without consuming anything), None when none is.
/// Only for a slot no stream uses: an active slot cannot be peeked.
pub async fn first_pending_commit(
    peer: &Client,
    slot: &str,
    upto: Lsn,
) -> Result<Option<DateTime<Utc>>, tokio_postgres::Error> {
    // Binary pgoutput: a 'B' (begin) message is final LSN (8 bytes), commit
    // timestamp (8, microseconds since 2000-01-01) and xid (4).
    let rows = peer
        .query(
            "SELECT data FROM pg_catalog.pg_logical_slot_peek_binary_changes($1, $2::text::pg_lsn, 1, \
             'proto_version', '1', 'publication_names', '\"mm\"', 'origin', 'none')",
            &[&slot, &upto.to_string()],
        )
        .await?;
    for r in rows {
        let data: Vec<u8> = r.try_get(0)?;
        if data.first() == Some(&b'B') && data.len() >= 17 {
            let mut ts = [0u8; 8];
            ts.copy_from_slice(&data[9..17]);
            let micros = i64::from_be_bytes(ts);
            return Ok(pg_epoch_micros(micros));
        }
    }
    Ok(None)
}

fn pg_epoch_micros(micros: i64) -> Option<DateTime<Utc>> {
    // 2000-01-01T00:00:00Z in Unix seconds.
    const PG_EPOCH: i64 = 946_684_800;
    DateTime::<Utc>::from_timestamp(PG_EPOCH, 0)?
        .checked_add_signed(chrono::Duration::microseconds(micros))
}

struct PeerProbe {
    dsn: String,
    client: Option<Client>,
    tracker: LagTracker,
    ticks: u32,
    /// Commit timestamp of the first pending transaction, from the last peek.
    pending_since: Option<DateTime<Utc>>,
}

/// What the probe needs of the local node.
pub struct Probe {
    pub local_node: String,
    pub local_dsn: String,
    pub password: Option<String>,
    pub status: Arc<StatusRegistry>,
}

impl Probe {
    /// Runs until the cluster state channel closes.
    pub async fn run(self, cluster: watch::Receiver<ClusterState>) {
        let mut peers: HashMap<String, PeerProbe> = HashMap::new();
        let mut local: Option<Client> = None;
        let mut tick = tokio::time::interval(PROBE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if cluster.has_changed().is_err() {
                break;
            }
            let state = cluster.borrow().clone();
            let wanted: BTreeMap<String, String> = state
                .nodes
                .values()
                .filter(|n| {
                    n.name != self.local_node
                        && matches!(
                            n.state,
                            NodeState::Joining | NodeState::Syncing | NodeState::Active
                        )
                })
                .map(|n| (n.name.clone(), n.peer_dsn.clone()))
                .collect();
            peers.retain(|name, p| wanted.get(name) == Some(&p.dsn));
            for (name, dsn) in &wanted {
                peers.entry(name.clone()).or_insert_with(|| PeerProbe {
                    dsn: dsn.clone(),
                    client: None,
                    tracker: LagTracker::default(),
                    ticks: 0,
                    pending_since: None,
                });
            }
            let applied = self.applied_progress(&mut local).await;
            for (name, p) in peers.iter_mut() {
                let paused = state.is_paused(name, &self.local_node);
                let progress = applied.get(&names::origin_name(name)).copied();
                self.probe_peer(name, p, paused, progress).await;
            }
        }
    }

    /// `mm.apply_progress` per origin name (what survives restarts).
    async fn applied_progress(&self, local: &mut Option<Client>) -> BTreeMap<String, Lsn> {
        let mut out = BTreeMap::new();
        if local.is_none() {
            *local = crate::pg::connect(&self.local_dsn, self.password.as_deref())
                .await
                .ok();
        }
        let Some(c) = local.as_ref() else {
            return out;
        };
        match c
            .query(
                "SELECT origin, remote_lsn::text FROM mm.apply_progress",
                &[],
            )
            .await
        {
            Ok(rows) => {
                for r in rows {
                    let (Ok(origin), Ok(lsn)) =
                        (r.try_get::<_, String>(0), r.try_get::<_, String>(1))
                    else {
                        continue;
                    };
                    if let Ok(lsn) = lsn.parse() {
                        out.insert(origin, lsn);
                    }
                }
            }
            Err(e) => {
                debug!(error = %e, "lag probe: cannot read mm.apply_progress");
                *local = None;
            }
        }
        out
    }

    async fn probe_peer(&self, name: &str, p: &mut PeerProbe, paused: bool, applied: Option<Lsn>) {
        if p.client.is_none() {
            p.client = tokio::time::timeout(
                PROBE_TIMEOUT,
                crate::pg::connect(&p.dsn, self.password.as_deref()),
            )
            .await
            .ok()
            .and_then(Result::ok);
        }
        let status = self.status.get(name);
        let processed = status
            .as_ref()
            .and_then(|s| s.processed_lsn)
            .into_iter()
            .chain(applied)
            .max();
        let now = Instant::now();
        if let Some(c) = p.client.as_ref() {
            let r = tokio::time::timeout(
                PROBE_TIMEOUT,
                c.query_one("SELECT pg_catalog.pg_current_wal_lsn()::text", &[]),
            )
            .await;
            match r {
                Ok(Ok(row)) => {
                    if let Some(l) = row
                        .try_get::<_, String>(0)
                        .ok()
                        .and_then(|s| s.parse::<Lsn>().ok())
                    {
                        p.tracker.observe(now, l);
                    }
                }
                _ => p.client = None,
            }
        }
        // What the running stream saw of the publisher counts too.
        if let Some(r) = status.as_ref().and_then(|s| s.received_lsn) {
            p.tracker.observe(now, r);
        }
        let state = status.as_ref().map(|s| s.state);
        let idle_stream = paused || matches!(state, Some(StreamState::Paused));
        p.ticks = p.ticks.wrapping_add(1);
        if !idle_stream {
            p.pending_since = None;
        } else if p.ticks % PEEK_EVERY == 1
            && let (Some(c), Some(upto)) = (p.client.as_ref(), p.tracker.publisher())
        {
            let slot = names::slot_name(name, &self.local_node);
            match tokio::time::timeout(PROBE_TIMEOUT * 3, first_pending_commit(c, &slot, upto))
                .await
            {
                Ok(Ok(ts)) => p.pending_since = ts,
                Ok(Err(e)) => debug!(peer = name, error = %e, "lag probe: cannot peek slot"),
                Err(_) => debug!(peer = name, "lag probe: slot peek timed out"),
            }
        }
        let Some(processed) = processed else {
            return;
        };
        // A running stream: against the position of a moment ago (see
        // `lag_settled`); stopped ones cannot catch up meanwhile.
        let settle = if idle_stream || matches!(state, Some(StreamState::Error)) {
            Duration::ZERO
        } else {
            SETTLE
        };
        let Some((bytes, mut seconds)) = p.tracker.lag_settled(now, processed, settle) else {
            return;
        };
        if idle_stream {
            // Exact when the slot told us; nothing pending there: nothing
            // of ours waits (only WAL the stream would skip).
            seconds = p.pending_since.map_or(0.0, age);
        } else if bytes > 0
            && let Some(ts) = status.as_ref().and_then(|s| s.stuck_commit_ts)
        {
            seconds = seconds.max(age(ts));
        }
        self.status.update(name, |s| {
            s.lag_bytes = Some(bytes);
            s.lag_seconds = Some(seconds);
            s.publisher_lsn = p.tracker.publisher();
        });
    }
}

fn age(t: DateTime<Utc>) -> f64 {
    (Utc::now() - t).num_milliseconds().max(0) as f64 / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_counts_from_the_first_sample_past_the_processed_position() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut t = LagTracker::default();
        assert_eq!(t.lag(at(0), Lsn(100)), None, "no sample yet");
        t.observe(at(0), Lsn(100));
        assert_eq!(t.lag(at(0), Lsn(100)), Some((0, 0.0)));
        // Writes start at t=1 and continue; nothing is applied (paused).
        t.observe(at(1), Lsn(500));
        t.observe(at(2), Lsn(900));
        t.observe(at(2), Lsn(800)); // an older reading changes nothing
        assert_eq!(t.lag(at(5), Lsn(100)), Some((800, 4.0)));
        // Half applied: the oldest pending change was first seen at t=2.
        assert_eq!(t.lag(at(6), Lsn(500)), Some((400, 4.0)));
        // All applied: no lag, whatever the time.
        assert_eq!(t.lag(at(60), Lsn(900)), Some((0, 0.0)));
        // A processed position past the last sample (keepalives) is no lag.
        assert_eq!(t.lag(at(61), Lsn(950)), Some((0, 0.0)));
    }

    #[test]
    fn a_running_stream_gets_a_moment_to_reach_the_publisher() {
        let t0 = Instant::now();
        let ms = |m: u64| t0 + Duration::from_millis(m);
        let mut t = LagTracker::default();
        t.observe(ms(0), Lsn(100));
        t.observe(ms(1000), Lsn(200));
        // At 1.1 s the stream has processed 100: the 200 read 0.1 s ago is
        // not lag yet, only what was there 0.8 s before.
        let settle = Duration::from_millis(800);
        assert_eq!(t.lag_settled(ms(1100), Lsn(100), settle), Some((0, 0.0)));
        // Still at 100 at 2 s: now it is.
        let (b, s) = t
            .lag_settled(ms(2000), Lsn(100), settle)
            .unwrap_or_default();
        assert_eq!(b, 100);
        assert!((s - 1.0).abs() < 1e-9, "{s}");
    }

    #[test]
    fn pg_timestamps_decode() {
        assert_eq!(
            pg_epoch_micros(0).map(|t| t.to_rfc3339()),
            Some("2000-01-01T00:00:00+00:00".into())
        );
        assert_eq!(
            pg_epoch_micros(86_400_000_001).map(|t| t.timestamp_micros()),
            Some(946_684_800_000_000 + 86_400_000_001)
        );
    }
}
