//! Row versions written on purpose: rows committed under a chosen
//! replication origin with a chosen commit timestamp, as an apply session
//! writes them, for tests that compare the agent's SQL rules with its Rust
//! ones on real PostgreSQL.

use anyhow::Result;
use chrono::{DateTime, Utc};

use crate::PgNode;

/// A PostgreSQL node with the agent's SQL objects installed (schema `mm`,
/// replicating `public`) and a connection to it.
pub async fn node_with_schema(name: &str) -> Result<(PgNode, tokio_postgres::Client)> {
    let pg = PgNode::start(name)?;
    let c = pg.connect().await?;
    mm_agent::schema::ensure(&c, &["public".to_owned()]).await?;
    Ok((pg, c))
}

/// An RFC 3339 time (a test's own constant; the epoch if it does not parse).
pub fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .unwrap_or_default()
}

/// Runs `sql` in one transaction committed under replication origin
/// `origin` (created beforehand) with commit timestamp `at`.
pub async fn write_under_origin(pg: &PgNode, origin: &str, at: &str, sql: &str) -> Result<()> {
    let s = pg.connect().await?;
    s.batch_execute(&format!(
        "SELECT pg_replication_origin_session_setup('{origin}');
         BEGIN;
         SELECT pg_replication_origin_xact_setup('0/0', '{at}');
         {sql};
         COMMIT;"
    ))
    .await?;
    Ok(())
}

/// The commit timestamp of row `id` of table `t` (the tests' table).
pub async fn commit_ts_of_row(c: &tokio_postgres::Client, id: i32) -> Result<DateTime<Utc>> {
    Ok(c.query_one(
        "SELECT pg_xact_commit_timestamp(xmin) FROM t WHERE id = $1",
        &[&id],
    )
    .await?
    .get(0))
}

/// Every replication origin of the node: (local id, name without `mm_`).
pub async fn origins(c: &tokio_postgres::Client) -> Result<Vec<(u32, String)>> {
    Ok(c.query(
        "SELECT roident::int8, substr(roname, 4) FROM pg_replication_origin ORDER BY 1",
        &[],
    )
    .await?
    .iter()
    .map(|r| (r.get::<_, i64>(0) as u32, r.get(1)))
    .collect())
}
