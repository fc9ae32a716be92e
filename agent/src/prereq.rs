//! Node prerequisites (SPEC §2), checked at start. Every unmet prerequisite is
//! reported, one line each, so an operator fixes them all in one round.

use tokio_postgres::Client;

/// Minimum slots/senders for a two-node cluster: 2 x (nodes - 1) + 2.
pub fn required_slots(nodes: usize) -> i64 {
    2 * (nodes.max(2) as i64 - 1) + 2
}

/// Replication origins active at once on PostgreSQL 18
/// (`max_active_replication_origins`): one per apply lane of every stream
/// into this node, and one for add-node's copy.
pub fn required_origins(nodes: usize, lanes: usize) -> i64 {
    (nodes.max(2) as i64 - 1) * lanes.max(1) as i64 + 1
}

#[derive(Debug, thiserror::Error)]
#[error("node prerequisites not met:\n  - {}", problems.join("\n  - "))]
pub struct Unmet {
    pub problems: Vec<String>,
}

async fn setting(client: &Client, name: &str) -> Result<String, tokio_postgres::Error> {
    let row = client
        .query_one("SELECT pg_catalog.current_setting($1)", &[&name])
        .await?;
    Ok(row.get(0))
}

/// Checks server version, settings, privileges and replica identities.
pub async fn check(
    client: &Client,
    schemas: &[String],
    nodes: usize,
    lanes: usize,
) -> Result<(), anyhow::Error> {
    let mut problems = Vec::new();
    let version: i32 = setting(client, "server_version_num")
        .await?
        .parse()
        .unwrap_or(0);
    if version < 160000 {
        problems.push(format!(
            "PostgreSQL {} is too old: mm needs 16, 17 or 18 (origin 'none' and protocol 4)",
            setting(client, "server_version").await?
        ));
    }
    let wal_level = setting(client, "wal_level").await?;
    if wal_level != "logical" {
        problems.push(format!(
            "wal_level is '{wal_level}', must be 'logical' (restart needed)"
        ));
    }
    let tct = setting(client, "track_commit_timestamp").await?;
    if tct != "on" {
        problems.push(format!(
            "track_commit_timestamp is '{tct}', must be 'on' (conflict detection needs commit timestamps; restart needed)"
        ));
    }
    let need = required_slots(nodes);
    for name in ["max_replication_slots", "max_wal_senders"] {
        let v: i64 = setting(client, name).await?.parse().unwrap_or(0);
        if v < need {
            problems.push(format!(
                "{name} is {v}, must be at least {need} for {} nodes (2 x (nodes - 1) + 2)",
                nodes.max(2)
            ));
        }
    }
    if version >= 180000 {
        let need = required_origins(nodes, lanes);
        let v: i64 = setting(client, "max_active_replication_origins")
            .await?
            .parse()
            .unwrap_or(0);
        if v < need {
            problems.push(format!(
                "max_active_replication_origins is {v}, must be at least {need} for {} nodes with replication.apply_lanes = {} ((nodes - 1) x lanes + 1; restart needed)",
                nodes.max(2),
                lanes.max(1)
            ));
        }
    }
    let row = client
        .query_one(
            "SELECT r.rolsuper, r.rolreplication FROM pg_catalog.pg_roles r WHERE r.rolname = current_user",
            &[],
        )
        .await?;
    let (is_super, can_replicate): (bool, bool) = (row.get(0), row.get(1));
    if !is_super {
        if !can_replicate {
            problems.push("the agent's role lacks REPLICATION (ALTER ROLE ... REPLICATION)".into());
        }
        let checks = [
            (
                "SELECT pg_catalog.has_function_privilege('pg_catalog.pg_replication_origin_session_setup(text)', 'EXECUTE')",
                "EXECUTE on pg_replication_origin_* functions",
            ),
            (
                "SELECT pg_catalog.has_parameter_privilege('session_replication_role', 'SET')",
                "SET on parameter session_replication_role (GRANT SET ON PARAMETER session_replication_role TO ...)",
            ),
        ];
        for (sql, what) in checks {
            let ok: bool = client.query_one(sql, &[]).await?.get(0);
            if !ok {
                problems.push(format!("the agent's role lacks {what}"));
            }
        }
    }
    let missing_identity = client
        .query(
            "SELECT n.nspname::text || '.' || c.relname::text FROM pg_catalog.pg_class c \
             JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
             WHERE c.relkind IN ('r', 'p') AND n.nspname = ANY ($1) \
             AND NOT (c.relreplident = 'f' \
               OR (c.relreplident = 'i' AND EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisreplident)) \
               OR (c.relreplident = 'd' AND EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid AND i.indisprimary))) \
             ORDER BY 1",
            &[&schemas],
        )
        .await?;
    for row in missing_identity {
        let t: String = row.get(0);
        problems.push(format!(
            "table {t} has no primary key and no REPLICA IDENTITY FULL / USING INDEX: it cannot be replicated (add a primary key or ALTER TABLE {t} REPLICA IDENTITY FULL)"
        ));
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Unmet { problems }.into())
    }
}
