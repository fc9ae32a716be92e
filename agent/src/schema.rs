//! The agent's own SQL objects on its node: schema `mm` (never replicated) and
//! the publication `mm` over the replicated schemas.

use tokio_postgres::Client;

use crate::apply::sql::quote_ident;

/// Numbered migrations, each applied once, in order, in its own transaction,
/// and recorded in `mm.schema_migrations`. Append only: a released file is
/// never edited.
pub const MIGRATIONS: &[(i32, &str)] = &[
    (1, include_str!("sql/0001_base.sql")),
    (2, include_str!("sql/0002_counters.sql")),
    (3, include_str!("sql/0003_truncates.sql")),
    (4, include_str!("sql/0004_compensations.sql")),
    (5, include_str!("sql/0005_sequence_ranges.sql")),
    (6, include_str!("sql/0006_sync.sql")),
    (7, include_str!("sql/0007_progress_guard.sql")),
    (8, include_str!("sql/0008_tombstone_hash.sql")),
    (9, include_str!("sql/0009_progress_fillfactor.sql")),
];

/// Functions and triggers: replaced at every start (not versioned data).
const FUNCTIONS: &str = include_str!("sql/functions.sql");

/// The schema version this agent needs (the newest migration).
pub const SCHEMA_VERSION: i32 = MIGRATIONS[MIGRATIONS.len() - 1].0;

/// Why the schema could not be brought up to date.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error(
        "schema mm is at version {found}, newer than this agent's {SCHEMA_VERSION}: run the newer agent (downgrades are not supported)"
    )]
    Newer { found: i32 },
    #[error("schema mm migration {version}: {source}")]
    Migration {
        version: i32,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("schema mm: {0}")]
    Pg(#[from] tokio_postgres::Error),
}

/// Creates or updates the schema, its tables and the publication. Idempotent:
/// runs at every start. Two agents starting at once on one database are
/// serialized by an advisory lock.
pub async fn ensure(client: &Client, schemas: &[String]) -> Result<(), SchemaError> {
    client
        .batch_execute(
            "CREATE SCHEMA IF NOT EXISTS mm;
             CREATE TABLE IF NOT EXISTS mm.schema_migrations (
               version int PRIMARY KEY,
               applied_at timestamptz NOT NULL DEFAULT now());
             SELECT pg_catalog.pg_advisory_lock(pg_catalog.hashtext('mm.schema_migrations'));",
        )
        .await?;
    let r = migrate(client).await;
    client
        .batch_execute(
            "SELECT pg_catalog.pg_advisory_unlock(pg_catalog.hashtext('mm.schema_migrations'))",
        )
        .await?;
    r?;
    client.batch_execute(FUNCTIONS).await?;
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
    // Partitioned tables publish as their root: one relation identity for
    // row lookup, tombstones, truncate versions and every conflict check,
    // whichever partition holds a row, and rows that move between
    // partitions arrive as updates (docs/ARCHITECTURE.md).
    let sql = if exists {
        format!(
            "ALTER PUBLICATION mm SET TABLES IN SCHEMA {list}; \
             ALTER PUBLICATION mm SET (publish_via_partition_root = true)"
        )
    } else {
        format!(
            "CREATE PUBLICATION mm FOR TABLES IN SCHEMA {list} WITH (publish_via_partition_root = true)"
        )
    };
    client.batch_execute(&sql).await?;
    // Tables that existed before the agent (or before this version): the
    // event trigger covers the ones created from now on.
    install_triggers(client).await
}

/// The agent's triggers on every replicated table (idempotent): also after
/// add-node created tables from the source's definitions. One table per
/// transaction, so a table's lock is held only while its own triggers are
/// made. A table whose triggers were made for another key and could not
/// be made again within a second (a long transaction holds it) keeps them
/// and is named in the log; a table dropped meanwhile is passed over.
pub async fn install_triggers(client: &Client) -> Result<(), SchemaError> {
    let tables = client
        .query(
            "SELECT c.oid, c.oid::pg_catalog.regclass::text FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_publication_namespace pn ON pn.pnnspid = c.relnamespace \
             JOIN pg_catalog.pg_publication p ON p.oid = pn.pnpubid AND p.pubname = 'mm' \
             WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition ORDER BY c.oid",
            &[],
        )
        .await?;
    for t in &tables {
        let (oid, name): (u32, String) = (t.try_get(0)?, t.try_get(1)?);
        let current = match client
            .query_one("SELECT mm.install_tombstone_trigger($1)", &[&oid])
            .await
        {
            Ok(row) => row.try_get::<_, bool>(0)?,
            Err(e) => {
                let gone = client
                    .query_opt("SELECT 1 FROM pg_catalog.pg_class WHERE oid = $1", &[&oid])
                    .await?
                    .is_none();
                if gone {
                    continue;
                }
                return Err(e.into());
            }
        };
        if !current {
            tracing::warn!(
                table = %name,
                "the table's tombstone triggers were made for another key and could not be made again \
                 within 1 s (a transaction holds the table): local deletes read the key from the \
                 catalog, and updates that change the new key leave no tombstone of the old one, \
                 until a start can make them again"
            );
        }
    }
    client
        .batch_execute(
            "SELECT mm.install_partition_trigger(c.oid) FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_publication_namespace pn ON pn.pnnspid = c.relnamespace \
             JOIN pg_catalog.pg_publication p ON p.oid = pn.pnpubid AND p.pubname = 'mm' \
             WHERE c.relkind IN ('r', 'p') AND c.relispartition",
        )
        .await?;
    Ok(())
}

async fn migrate(client: &Client) -> Result<(), SchemaError> {
    let found: i32 = client
        .query_one(
            "SELECT coalesce(max(version), 0) FROM mm.schema_migrations",
            &[],
        )
        .await?
        .try_get(0)?;
    if found > SCHEMA_VERSION {
        return Err(SchemaError::Newer { found });
    }
    for (version, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > found) {
        let m = |source| SchemaError::Migration {
            version: *version,
            source,
        };
        client.batch_execute("BEGIN").await.map_err(m)?;
        let r = async {
            client.batch_execute(sql).await?;
            client
                .execute(
                    "INSERT INTO mm.schema_migrations (version) VALUES ($1)",
                    &[version],
                )
                .await?;
            client.batch_execute("COMMIT").await
        }
        .await;
        if let Err(e) = r {
            let _ = client.batch_execute("ROLLBACK").await;
            return Err(m(e));
        }
        tracing::info!(version, "schema mm: migration applied");
    }
    Ok(())
}
