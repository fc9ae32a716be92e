//! Backlog catch-up: apply *capacity*, not the driver's speed.
//!
//! With the stream running, a subscriber that keeps pace with the load
//! generator measures the generator. Here the stream into node b is stopped
//! first (native: `ALTER SUBSCRIPTION .. DISABLE`, mm: `mmctl pause`), the
//! whole workload is committed on node a, and only then is the stream
//! started again: the time until b has everything is what the applier needs
//! for that backlog, decoding included. The same shapes run on both systems,
//! minutes apart, in one run.
//!
//! Resources are sampled from /proc meanwhile (every 50 ms): the agent process (mm), the
//! subscriber's apply backends (mm: the agent's sessions; native: the apply
//! worker and its parallel workers) and the publisher's walsender.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use super::resources::{Resources, Sampler, native_sub};
use super::{Kind, System};

/// The shapes of the backlog workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Single-row INSERT transactions.
    Insert1,
    /// Single-row UPDATE transactions over a preloaded table.
    Update1,
    /// Single-row DELETE transactions over a preloaded table.
    Delete1,
    /// Transactions of two statements on two tables (an UPDATE of a
    /// preloaded row, an INSERT into a history table), keys never shared:
    /// the small multi-statement transaction apply lanes can spread.
    UpdateInsert,
    /// INSERT transactions of 1000 rows each.
    Insert1000,
    /// One INSERT transaction (200k rows by default).
    OneTxn,
    /// One INSERT transaction bigger than `logical_decoding_work_mem`
    /// (1M rows by default): streamed before its commit.
    Streamed,
}

impl Shape {
    pub const ALL: [Shape; 7] = [
        Shape::Insert1,
        Shape::Update1,
        Shape::Delete1,
        Shape::UpdateInsert,
        Shape::Insert1000,
        Shape::OneTxn,
        Shape::Streamed,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Shape::Insert1 => "single-row INSERT txns",
            Shape::Update1 => "single-row UPDATE txns",
            Shape::Delete1 => "single-row DELETE txns",
            Shape::UpdateInsert => "UPDATE+INSERT txns",
            Shape::Insert1000 => "1000-row INSERT txns",
            Shape::OneTxn => "one INSERT txn",
            Shape::Streamed => "one streamed INSERT txn",
        }
    }

    pub fn key(self) -> &'static str {
        match self {
            Shape::Insert1 => "ins1",
            Shape::Update1 => "upd1",
            Shape::Delete1 => "del1",
            Shape::UpdateInsert => "updins",
            Shape::Insert1000 => "ins1000",
            Shape::OneTxn => "one",
            Shape::Streamed => "streamed",
        }
    }

    pub fn parse(s: &str) -> Option<Shape> {
        Shape::ALL.into_iter().find(|k| k.key() == s)
    }

    /// Its own table, so that shapes never see each other's rows.
    fn table(self) -> &'static str {
        match self {
            Shape::Insert1 => "bl_ins1",
            Shape::Update1 => "bl_upd1",
            Shape::Delete1 => "bl_del1",
            Shape::UpdateInsert => "bl_updins",
            Shape::Insert1000 => "bl_ins1000",
            Shape::OneTxn => "bl_one",
            Shape::Streamed => "bl_streamed",
        }
    }
}

/// The backlog tables, created with the rest of the bench schema.
pub const SCHEMA: &str = "
CREATE TABLE bl_ins1 (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE bl_upd1 (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE bl_del1 (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE bl_updins (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE bl_updins_h (id bigint PRIMARY KEY, aid bigint NOT NULL, v text NOT NULL);
CREATE TABLE bl_ins1000 (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE bl_one (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
CREATE TABLE bl_streamed (id bigint PRIMARY KEY, n bigint NOT NULL, v text NOT NULL);
";

/// One backlog measurement.
#[derive(Debug, Clone, Copy)]
pub struct Backlog {
    pub shape: Shape,
    pub rows: u64,
    pub txns: u64,
    /// Committing the backlog on the publisher (not part of the result).
    pub load: Duration,
    /// From the restart of the stream until the subscriber had everything.
    pub catch_up: Duration,
    pub res: Resources,
}

impl Backlog {
    pub fn rows_per_sec(&self) -> f64 {
        self.rows as f64 / self.catch_up.as_secs_f64().max(1e-9)
    }
}

/// Rows of each shape. Single-row shapes use `rows` transactions.
#[derive(Debug, Clone, Copy)]
pub struct BacklogConfig {
    pub rows: u64,
    pub batch_rows: u64,
    pub one_txn_rows: u64,
    pub streamed_rows: u64,
}

/// Runs one shape on one system: preload (replicated, settled), stop the
/// stream a → b, commit the backlog on a, start the stream, time b.
pub async fn run(sys: &System, shape: Shape, cfg: &BacklogConfig) -> Result<Backlog> {
    let table = shape.table();
    let rows = match shape {
        Shape::Insert1 | Shape::Update1 | Shape::Delete1 => cfg.rows,
        // Two row changes per transaction.
        Shape::UpdateInsert => 2 * cfg.rows,
        Shape::Insert1000 => cfg.batch_rows,
        Shape::OneTxn => cfg.one_txn_rows,
        Shape::Streamed => cfg.streamed_rows,
    };
    // Empty again for a repeated run (`--backlog-repeat`); the TRUNCATE
    // replicates, and is settled before anything is measured.
    let tables = match shape {
        Shape::UpdateInsert => format!("{table}, {table}_h"),
        _ => table.to_owned(),
    };
    sys.a().execute(&format!("TRUNCATE {tables}")).await?;
    sys.settle().await?;
    if matches!(shape, Shape::Update1 | Shape::Delete1 | Shape::UpdateInsert) {
        sys.a()
            .execute(&format!(
                "INSERT INTO {table} (id, n, v) SELECT g, 0, md5(g::text) FROM generate_series(1, {}) g",
                cfg.rows
            ))
            .await?;
        sys.settle().await?;
    }
    sys.advance_slots().await?;
    stop_stream(sys).await?;
    let a = sys.a().connect().await?;
    a.batch_execute("SET synchronous_commit = off").await?;
    let t = Instant::now();
    let txns = match shape {
        Shape::Insert1 | Shape::Update1 | Shape::Delete1 | Shape::UpdateInsert => {
            let sql = match shape {
                Shape::Insert1 => format!(
                    "INSERT INTO {table} (id, n, v) VALUES ($1::bigint, $1::bigint, md5($1::bigint::text))"
                ),
                Shape::Update1 => format!("UPDATE {table} SET n = n + 1 WHERE id = $1::bigint"),
                // One statement, two row changes: decoded as an UPDATE and
                // an INSERT of one transaction.
                Shape::UpdateInsert => format!(
                    "WITH u AS (UPDATE {table} SET n = n + 1 WHERE id = $1::bigint RETURNING id) \
                     INSERT INTO {table}_h (id, aid, v) SELECT id, id, md5(id::text) FROM u"
                ),
                _ => format!("DELETE FROM {table} WHERE id = $1::bigint"),
            };
            // Committed before the stream starts: the driver's speed is
            // not part of the result.
            let conns = super::open_clients(sys.a(), 4, false, &sql).await?;
            super::drive(conns, cfg.rows).await?;
            cfg.rows
        }
        Shape::Insert1000 => {
            let mut lo = 1u64;
            let mut n = 0;
            while lo <= rows {
                let hi = (lo + 999).min(rows);
                a.batch_execute(&format!(
                    "INSERT INTO {table} (id, n, v) SELECT g, g, md5(g::text) FROM generate_series({lo}, {hi}) g"
                ))
                .await?;
                lo = hi + 1;
                n += 1;
            }
            n
        }
        Shape::OneTxn | Shape::Streamed => {
            a.batch_execute(&format!(
                "INSERT INTO {table} (id, n, v) SELECT g, g, md5(g::text) FROM generate_series(1, {rows}) g"
            ))
            .await?;
            1
        }
    };
    let load = t.elapsed();
    sys.checkpoint().await?;
    let (check, want) = match shape {
        Shape::Update1 => (
            format!("SELECT sum(n)::bigint FROM {table}"),
            rows.to_string(),
        ),
        Shape::Delete1 => (format!("SELECT count(*) FROM {table}"), "0".to_owned()),
        Shape::UpdateInsert => (
            format!(
                "SELECT (SELECT sum(n) FROM {table})::text || '/' || (SELECT count(*) FROM {table}_h)::text"
            ),
            format!("{0}/{0}", cfg.rows),
        ),
        _ => (format!("SELECT count(*) FROM {table}"), rows.to_string()),
    };
    let sampler = Sampler::start(sys).await?;
    let start = Instant::now();
    start_stream(sys).await?;
    let catch_up = sys.delivered(start, &check, &want).await?;
    let res = sampler.stop().await?;
    Ok(Backlog {
        shape,
        rows,
        txns,
        load,
        catch_up,
        res,
    })
}

/// Stops a → b and waits until nothing applies any more.
async fn stop_stream(sys: &System) -> Result<()> {
    match sys.kind {
        Kind::Native => {
            let sub = native_sub(sys);
            sys.b()
                .execute(&format!("ALTER SUBSCRIPTION {sub} DISABLE"))
                .await?;
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let n = sys
                    .b()
                    .query_one_string(&format!(
                        "SELECT count(*) FROM pg_stat_subscription WHERE subname = '{sub}' AND pid IS NOT NULL"
                    ))
                    .await?;
                if n.as_deref() == Some("0") {
                    return Ok(());
                }
                if Instant::now() > deadline {
                    bail!("native: {sub}'s apply worker did not stop");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Kind::Mm => {
            let (from, to) = (sys.a().name().to_owned(), sys.b().name().to_owned());
            sys.mmctl(&["pause", "--from", &from, "--to", &to]).await?;
            Ok(())
        }
    }
}

async fn start_stream(sys: &System) -> Result<()> {
    match sys.kind {
        Kind::Native => {
            let sub = native_sub(sys);
            sys.b()
                .execute(&format!("ALTER SUBSCRIPTION {sub} ENABLE"))
                .await
        }
        Kind::Mm => {
            let (from, to) = (sys.a().name().to_owned(), sys.b().name().to_owned());
            sys.mmctl(&["resume", "--from", &from, "--to", &to])
                .await
                .map(|_| ())
        }
    }
}
