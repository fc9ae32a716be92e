//! The routine test: may a change to this row version be applied without
//! asking the resolver? One rule with two implementations, because it runs
//! in two places: `mm.routine` in `sql/functions.sql` decides it inside every
//! fast-path UPDATE and DELETE (pipelined, no round trip), this function on
//! the careful path. `tests/tests/routine_rule.rs` runs both on the same
//! vectors against real PostgreSQL, so they cannot drift apart.

use chrono::{DateTime, Utc};

/// A local row version: `pg_xact_commit_timestamp_origin(xmin)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionFacts {
    /// Replication origin id of the writer (0: a local write).
    pub roident: Option<u32>,
    /// Commit timestamp; None when unknown (frozen, older than
    /// `track_commit_timestamp`) or not committed yet.
    pub ts: Option<DateTime<Utc>>,
    /// Written by the local transaction applying this very change.
    pub this_txn: bool,
}

/// True when no resolver is needed: the version has no known commit, was
/// written by this transaction or by the publisher itself (its stream is
/// ordered), or the publisher's watermark for the version's origin has
/// reached the version's timestamp and the change is later (the publisher
/// had applied that version before making the change).
pub fn no_resolver_needed(
    v: &VersionFacts,
    peer_roidents: &[u32],
    watermark: impl Fn(u32) -> Option<DateTime<Utc>>,
    remote_ts: DateTime<Utc>,
) -> bool {
    if v.this_txn || v.roident.is_some_and(|r| peer_roidents.contains(&r)) {
        return true;
    }
    let Some(ts) = v.ts else {
        return true;
    };
    watermark(v.roident.unwrap_or(0)).is_some_and(|w| ts <= w && ts < remote_ts)
}
