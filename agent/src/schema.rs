//! The agent's own SQL objects on its node: schema `mm` (never replicated) and
//! the publication `mm` over the replicated schemas.

use tokio_postgres::Client;

use crate::apply::sql::quote_ident;

/// Creates or updates the schema, its tables and the publication. Idempotent:
/// runs at every start.
pub async fn ensure(client: &Client, schemas: &[String]) -> Result<(), tokio_postgres::Error> {
    client
        .batch_execute(
            "CREATE SCHEMA IF NOT EXISTS mm;
             CREATE TABLE IF NOT EXISTS mm.nodes (
               id numeric(20) PRIMARY KEY,
               name text NOT NULL UNIQUE,
               api_url text NOT NULL,
               peer_dsn text NOT NULL,
               state text NOT NULL);
             CREATE TABLE IF NOT EXISTS mm.raft_applied (
               singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
               applied_index bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS mm.apply_progress (
               origin text PRIMARY KEY,
               remote_lsn pg_lsn NOT NULL,
               remote_commit_ts timestamptz);
             -- Records an applied transaction's progress, only on top of the
             -- previous one's (so a transaction pipelined behind a failed one
             -- fails too), and gives the commit the remote commit timestamp
             -- through the session's replication origin. The origin's own LSN
             -- stays invalid: PostgreSQL would advance it even on abort.
             CREATE OR REPLACE FUNCTION mm.advance_progress(
                 p_origin text, p_prev pg_lsn, p_new pg_lsn, p_ts timestamptz)
             RETURNS void LANGUAGE plpgsql AS $fn$
             BEGIN
               PERFORM pg_catalog.pg_replication_origin_xact_setup('0/0', p_ts);
               UPDATE mm.apply_progress SET remote_lsn = p_new, remote_commit_ts = p_ts
                WHERE origin = p_origin AND remote_lsn = p_prev;
               IF NOT FOUND THEN
                 RAISE EXCEPTION 'mm: apply progress of % is not at % (the transaction before this one did not commit)', p_origin, p_prev;
               END IF;
             END
             $fn$;
             CREATE TABLE IF NOT EXISTS mm.paused_streams (
               from_node text NOT NULL,
               to_node text NOT NULL,
               PRIMARY KEY (from_node, to_node));
             CREATE TABLE IF NOT EXISTS mm.conflict_log (
               id bigserial PRIMARY KEY,
               at timestamptz NOT NULL DEFAULT now(),
               relation text NOT NULL,
               conflict_type text NOT NULL,
               key jsonb,
               local_origin text,
               local_commit_ts timestamptz,
               remote_origin text,
               remote_commit_ts timestamptz,
               remote_lsn pg_lsn,
               resolution text NOT NULL,
               local_tuple jsonb,
               remote_tuple jsonb);",
        )
        .await?;
    let list = schemas
        .iter()
        .map(|s| quote_ident(s))
        .collect::<Vec<_>>()
        .join(", ");
    let exists = client
        .query_opt(
            "SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = 'mm'",
            &[],
        )
        .await?
        .is_some();
    let sql = if exists {
        format!("ALTER PUBLICATION mm SET TABLES IN SCHEMA {list}")
    } else {
        format!("CREATE PUBLICATION mm FOR TABLES IN SCHEMA {list}")
    };
    client.batch_execute(&sql).await?;
    Ok(())
}
