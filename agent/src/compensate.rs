//! The sending side of compensating deletes (see `conflict::classify` and
//! `mm.compensate` in sql/functions.sql): the apply path records, in the
//! transaction that gave a row up, the key to delete everywhere; this task
//! runs each one in an ordinary local session once that transaction has
//! committed, so the delete is published like any local one. A record is
//! removed in the same transaction that sends it: each is sent once, and
//! none is lost to a crash (it waits in `mm.compensations`).
//!
//! Invariant: each `mm.compensate` runs holding the apply gate exclusively
//! (`apply/gate.rs`), like a careful transaction, or waits for a later try.
//! It raises its key's tombstone without deleting a row (the row is usually
//! gone already), and nothing in PostgreSQL orders that against an apply
//! session reading and then raising the same tombstone: once the apply had
//! read the tombstone before the compensation committed and wrote its older
//! version after, the compensation was undone here only, and a later insert
//! of the key, older than the compensation, got in on this node alone (a
//! divergence,
//! `e2e_conflicts::compensating_delete_is_ordered_against_apply_of_the_same_key`).

use std::time::Duration;

use tokio_postgres::Client;
use tracing::warn;

use crate::apply::Gate;

const POLL: Duration = Duration::from_millis(200);
const MAX_POLL: Duration = Duration::from_secs(2);

/// How long a compensating delete waits for the gate: a fast-path
/// transaction blocked on a user's row lock holds it, and while the
/// compensation waits, every stream's next transaction queues behind it.
const GATE_WAIT: Duration = Duration::from_secs(1);

/// Sends every recorded compensating delete whose time has come; returns
/// how many are still waiting (their `not_before` is ahead of the clock,
/// their table is held by a user's transaction, or the apply gate is).
pub async fn drain(client: &Client, gate: &Gate) -> Result<u64, tokio_postgres::Error> {
    if !installed(client).await? {
        return Ok(0);
    }
    // Not due yet: waiting, without taking the gate (that drains every
    // stream's pipeline) only to hear "not yet". `mm.compensate` checks
    // the clock again itself.
    let rows = client
        .query(
            "SELECT id, pg_catalog.clock_timestamp() > not_before FROM mm.compensations ORDER BY id",
            &[],
        )
        .await?;
    let mut waiting = 0;
    let mut ids = Vec::with_capacity(rows.len());
    for row in &rows {
        if row.try_get::<_, bool>(1)? {
            ids.push(row.try_get::<_, i64>(0)?);
        } else {
            waiting += 1;
        }
    }
    for (i, &id) in ids.iter().enumerate() {
        let Ok(_alone) = tokio::time::timeout(GATE_WAIT, gate.exclusive()).await else {
            // The gate stays held for now: the rest wait for the next round
            // (one wait each would keep `/v1/wal-lsn` past its timeout).
            waiting += (ids.len() - i) as u64;
            break;
        };
        let done: bool = client
            .query_one("SELECT mm.compensate($1)", &[&id])
            .await?
            .try_get(0)?;
        if !done {
            waiting += 1;
        }
    }
    Ok(waiting)
}

/// How many compensating deletes this node ever recorded: `wait-sync`
/// compares it before and after a round to see whether new ones appeared.
pub async fn recorded(client: &Client) -> Result<u64, tokio_postgres::Error> {
    if !installed(client).await? {
        return Ok(0);
    }
    let n: i64 = client
        .query_one(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM mm.compensations_id_seq",
            &[],
        )
        .await?
        .try_get(0)?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Before the agent has set up schema mm (an API served before it), there
/// is nothing to send.
async fn installed(client: &Client) -> Result<bool, tokio_postgres::Error> {
    client
        .query_one(
            "SELECT pg_catalog.to_regclass('mm.compensations') IS NOT NULL",
            &[],
        )
        .await?
        .try_get(0)
}

pub async fn run(dsn: String, password: Option<String>, gate: Gate) {
    loop {
        let client = match crate::pg::connect(&dsn, password.as_deref()).await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "compensating deletes: cannot connect to the local PostgreSQL; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let mut poll = POLL;
        loop {
            match drain(&client, &gate).await {
                // Waiting ones: not due yet, or held up by a user's
                // transaction; each try holds every stream's apply up for
                // a moment (up to `lock_timeout`), so try less often while
                // they wait.
                Ok(0) => poll = POLL,
                Ok(_) => poll = (poll * 2).min(MAX_POLL),
                Err(e) => {
                    warn!(error = %e, "compensating deletes: sending failed; retrying");
                    break;
                }
            }
            tokio::time::sleep(poll).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
