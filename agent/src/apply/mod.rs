//! The apply path: one local transaction per remote transaction, on a session
//! bound to the peer's replication origin.
//!
//! Invariant (exactly-once): the remote end LSN is written to
//! `mm.apply_progress` inside the same local transaction as the rows, so
//! progress and data commit or vanish together; a restart resumes from it.
//!
//! Why not the replication origin's own progress (DESIGN.md's first plan):
//! PostgreSQL also advances an origin when a transaction that ran
//! `pg_replication_origin_xact_setup` ABORTS (RecordTransactionAbort), and
//! only its built-in apply worker resets that state on errors. An external
//! applier whose session dies mid-transaction (agent killed, connection lost,
//! deferred constraint failing at COMMIT) would thereby skip the transaction
//! forever: we reproduced exactly that loss with `kill -9`. So the origin is
//! used for what is safe — tagging our commits (`origin 'none'` loop
//! suppression, `pg_xact_commit_timestamp_origin`) and carrying the remote
//! commit timestamp — with its LSN left invalid so it never moves.
//! Invariant (commit order): transactions are applied one after another in the
//! order the publisher committed them; only the statements WITHIN one
//! transaction are pipelined.

mod applier;
mod batch;
mod careful;
mod compensation;
mod deferred;
mod durable;
mod early;
mod fast;
mod fk;
mod gate;
mod group;
mod hot;
mod lanes;
mod merge;
mod param;
mod pipeline;
mod recover;
mod relation;
mod schedule;
mod session;
mod skip;
pub mod sql;
mod tuple;
mod txn;

pub use applier::{Applier, ApplyContext};
pub use gate::Gate;
pub use param::Param;
pub use pipeline::Done;
pub use txn::{ChangeSource, InMemory, Replayable, TxnBody, TxnMeta};

/// Why a change could not be applied. The stream adds peer and LSN.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}{message}{}", relation.as_ref().map(|r| format!("relation {r}: ")).unwrap_or_default(), sqlstate.as_ref().map(|c| format!(" (SQLSTATE {c})")).unwrap_or_default())]
pub struct ApplyFailure {
    pub relation: Option<String>,
    pub sqlstate: Option<String>,
    pub message: String,
    /// The remote transaction that failed, when known here: with pipelining
    /// it may be an earlier one than the transaction being queued.
    pub txn: Option<TxnMeta>,
    /// A fast-path statement met a conflict: not an error, the transaction
    /// is redone with the resolver (`Applier::recover`).
    pub conflict: bool,
    /// What PostgreSQL's error means to the apply path, decided once here
    /// from its SQLSTATE and constraint, not by comparing strings elsewhere.
    pub signal: Option<Signal>,
}

/// Errors of a fast-path row statement that mean "use the resolver".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// `mm.conflict()` (MM001) or the `mm.one_row` check: a version that
    /// needs the resolver, a tombstone or truncate in the way, a row missing.
    Conflict,
    /// 23505: the new row's key or unique value is taken.
    UniqueViolation,
    /// 23505 on `mm.tombstones`' key: a plain tombstone INSERT
    /// (`sql::TombstoneWrite::Insert`) met a key that has one. A conflict
    /// like the others (redone with the resolver, which upserts), and the
    /// table's deletes upsert for a while (`Applier::recover`). A user's
    /// constraint of the same name read as this costs nothing more than
    /// that: its table's deletes upsert a minute.
    TombstoneTaken,
}

/// `mm.tombstones`' unique index (0008_tombstone_hash.sql).
pub const TOMBSTONES_KEY: &str = "mm_tombstones_key";

impl ApplyFailure {
    pub fn new(relation: Option<&str>, message: impl Into<String>) -> Self {
        ApplyFailure {
            relation: relation.map(str::to_owned),
            sqlstate: None,
            message: message.into(),
            txn: None,
            conflict: false,
            signal: None,
        }
    }

    /// Sends the transaction to the careful path without trying it on the
    /// fast path (a change the fast path has no statement for).
    pub fn to_careful(relation: Option<&str>, why: &str) -> Self {
        ApplyFailure {
            conflict: true,
            signal: Some(Signal::Conflict),
            ..ApplyFailure::new(relation, why)
        }
    }

    pub fn from_pg(relation: Option<&str>, e: &tokio_postgres::Error) -> Self {
        match e.as_db_error() {
            Some(db) => Self::from_db(
                relation,
                db.code().code(),
                db.message(),
                db.detail(),
                db.constraint(),
            ),
            None => ApplyFailure::new(relation, format!("local PostgreSQL: {e}")),
        }
    }

    /// A server error on the pipelined apply session (`pipeline.rs`).
    pub fn from_server(relation: Option<&str>, e: &mm_proto::client::DbError) -> Self {
        Self::from_db(
            relation,
            &e.code,
            &e.message,
            e.detail.as_deref(),
            e.constraint.as_deref(),
        )
    }

    /// What a server error means to the apply path, whichever session
    /// reported it.
    fn from_db(
        relation: Option<&str>,
        code: &str,
        message: &str,
        detail: Option<&str>,
        constraint: Option<&str>,
    ) -> Self {
        match constraint {
            // The progress guard inlined in the statement (sql::progress_cte):
            // the transaction before this one did not commit.
            Some("mm_progress") => ApplyFailure {
                sqlstate: Some("MM003".to_owned()),
                ..ApplyFailure::new(
                    relation,
                    "mm: apply progress is not at the end of the previous transaction \
                     (it did not commit)",
                )
            },
            // The fast path's "changed no row" signal (schema.rs, mm.one_row).
            Some("mm_conflict") => ApplyFailure {
                sqlstate: Some("MM001".to_owned()),
                signal: Some(Signal::Conflict),
                ..ApplyFailure::new(relation, "mm: conflict, resolving (no row to change)")
            },
            _ => ApplyFailure {
                sqlstate: Some(code.to_owned()),
                signal: match code {
                    "MM001" => Some(Signal::Conflict),
                    "23505" if constraint == Some(TOMBSTONES_KEY) => Some(Signal::TombstoneTaken),
                    "23505" => Some(Signal::UniqueViolation),
                    _ => None,
                },
                ..ApplyFailure::new(
                    relation,
                    match detail {
                        Some(d) => format!("{message}: {d}"),
                        None => message.to_owned(),
                    },
                )
            },
        }
    }
}
