//! Conflict rules: what counts as a conflict, who decides, and how the cluster
//! converges. The apply path (`apply::careful`) gathers the facts and carries
//! the decision out; this module holds the vocabulary and the resolvers.
//!
//! Detection (DESIGN.md "Conflicts"): for every incoming row change from peer
//! P, the local version of the row — or of its tombstone when it was deleted —
//! is `(origin, commit timestamp)` of its xmin. A change is applied without
//! asking anyone when that version came from P itself (P's stream is ordered),
//! from this same remote transaction, or is *routine*: P's watermark (see
//! `watermark`) proves P had applied that version before making the change,
//! and the change is later. Everything else is a true conflict: it is given to
//! the table's resolver, logged in `mm.conflict_log` in the same local
//! transaction as its resolution, and counted per type.
//!
//! Convergence: every node sees the same facts about a conflict — the two
//! versions' commit timestamps and origins are preserved by replication — and
//! the resolvers are pure functions of those facts, so every node keeps the
//! same winner. Deletes keep a tombstone (until every node has applied past
//! it) so an update older than the delete cannot resurrect the row and a newer
//! one can, whichever arrives first.

pub mod classify;
mod resolver;
pub mod routine;

pub use resolver::{
    ApplyRemote, ErrorResolver, FirstWriterWins, KeepLocal, LastWriterWins, Resolver,
    ResolverChoice, ResolverRegistry, TableResolvers,
};

use chrono::{DateTime, Utc};
use serde_json::Value;

/// PostgreSQL 18's conflict names, plus `update_deleted` (SPEC §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ConflictType {
    InsertExists,
    UpdateOriginDiffers,
    UpdateExists,
    UpdateDeleted,
    UpdateMissing,
    DeleteOriginDiffers,
    DeleteMissing,
    MultipleUniqueConflicts,
}

impl ConflictType {
    pub fn as_str(self) -> &'static str {
        match self {
            ConflictType::InsertExists => "insert_exists",
            ConflictType::UpdateOriginDiffers => "update_origin_differs",
            ConflictType::UpdateExists => "update_exists",
            ConflictType::UpdateDeleted => "update_deleted",
            ConflictType::UpdateMissing => "update_missing",
            ConflictType::DeleteOriginDiffers => "delete_origin_differs",
            ConflictType::DeleteMissing => "delete_missing",
            ConflictType::MultipleUniqueConflicts => "multiple_unique_conflicts",
        }
    }
}

impl std::fmt::Display for ConflictType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything a resolver may look at (SPEC §6). Rows are jsonb objects as
/// `to_jsonb(row)` renders them; columns the publisher did not send (key-only
/// old tuples, unchanged TOAST) are absent from `remote_old` / `remote_new`.
#[derive(Debug, Clone, PartialEq)]
pub struct Conflict {
    pub kind: ConflictType,
    /// `schema.table`.
    pub relation: String,
    /// The local row; `None` when it is missing or deleted.
    pub local: Option<Value>,
    pub remote_old: Option<Value>,
    pub remote_new: Option<Value>,
    /// Node that wrote the local version (row or tombstone); `None` when
    /// there is no local version at all.
    pub local_origin: Option<String>,
    /// `None` when unknown (no local version, or committed before commit
    /// timestamps were tracked).
    pub local_commit_ts: Option<DateTime<Utc>>,
    pub remote_origin: String,
    pub remote_commit_ts: DateTime<Utc>,
}

impl Conflict {
    /// The JSON document `sql:` resolvers receive.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "type": self.kind.as_str(),
            "relation": self.relation,
            "local": self.local,
            "remote_old": self.remote_old,
            "remote_new": self.remote_new,
            "local_origin": self.local_origin,
            "local_commit_ts": self.local_commit_ts,
            "remote_origin": self.remote_origin,
            "remote_commit_ts": self.remote_commit_ts,
        })
    }

    /// Does the incoming change win by (commit timestamp, node name)? A
    /// missing local version always loses; an unknown timestamp is older than
    /// any known one.
    pub fn remote_is_later(&self) -> bool {
        if self.local_origin.is_none() {
            return true;
        }
        let local = (self.local_commit_ts, self.local_origin.as_deref());
        let remote = (
            Some(self.remote_commit_ts),
            Some(self.remote_origin.as_str()),
        );
        remote > local
    }
}

/// A resolver's decision. The applier carries it out inside the local
/// transaction that applies the remote one.
#[derive(Debug, Clone, PartialEq)]
pub enum Resolution {
    /// The incoming change wins: apply it (an update of a missing row becomes
    /// an insert of the new row; an insert over an existing row replaces it).
    ApplyRemote,
    /// The local state wins: the incoming change is skipped.
    KeepLocal,
    /// Keep exactly this row (a jsonb object with every column).
    Row(Value),
    /// Keep no row: skip an insert, delete the local row.
    NoRow,
    /// Stop the stream at this transaction until `mmctl skip` or a data fix.
    Error(String),
}

/// How a resolution was carried out, as recorded in `mm.conflict_log`.
pub fn resolution_label(r: &Resolution, local_row_existed: bool) -> &'static str {
    match r {
        Resolution::ApplyRemote => "apply_remote",
        Resolution::KeepLocal => "keep_local",
        Resolution::Row(_) => "merged",
        Resolution::NoRow if local_row_existed => "deleted",
        Resolution::NoRow => "keep_local",
        Resolution::Error(_) => "error",
    }
}

#[cfg(test)]
mod tests;
