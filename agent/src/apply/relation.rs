//! Mapping a publisher's RELATION message onto the local table.
//!
//! Columns are matched by name (column order may differ between nodes); the
//! target row is located by the LOCAL primary key / replica identity index,
//! whatever identity the publisher used, because that is what makes the lookup
//! an index scan here.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mm_proto::pgoutput::Relation;
use tokio_postgres::Client;

use super::pipeline::Stmt;

use super::ApplyFailure;
use super::sql::{self, Commit, Locator, TombstoneWrite};

/// Everything needed to apply changes to one relation, plus its prepared statements.
pub struct LocalRelation {
    pub remote: Relation,
    /// `"schema"."table"` for SQL.
    pub table_sql: String,
    /// `schema.table` for messages; shared (not re-allocated) by every row's
    /// pipeline entry.
    pub display: Arc<str>,
    /// For each remote column: the local column name it maps to.
    pub local_names: Vec<String>,
    /// Remote column indexes of the local key columns, in key order
    /// (empty when the table is REPLICA IDENTITY FULL without an index).
    pub key_remote: Vec<usize>,
    pub locator: Locator,
    /// Local table oid: tombstones are keyed by it.
    pub relid: u32,
    /// For each remote column: the local column's type (without typmod, so
    /// assignment still checks lengths), for casts of text parameters.
    /// Read as `format_type(oid, -1)`: with NULL, `character` and `bit`
    /// come out bare, which a cast reads as `character(1)` / `bit(1)` and
    /// silently cuts 'abcd' to 'a' (`bpchar` and `"bit"` do not).
    pub local_types: Vec<String>,
    /// Unique indexes usable for collision checks (plain columns, not
    /// partial), as remote column indexes; includes the key index.
    pub unique_indexes: Vec<Vec<usize>>,
    /// Its writes can be told apart by fingerprints (`schedule.rs`), so its
    /// transactions may run in parallel apply lanes: a plain table (not
    /// partitioned), no trigger that fires on apply (ENABLE ALWAYS or
    /// REPLICA), no rule, no exclusion constraint, every unique index over
    /// plain columns the publisher sends (`unique_indexes` has them all).
    /// Foreign keys are checked separately (`fks`).
    pub lanes_safe: bool,
    /// For each remote column: a `GENERATED ALWAYS AS IDENTITY` column here.
    /// Inserts write the publisher's value (`OVERRIDING SYSTEM VALUE`);
    /// updates leave it out of SET, since PostgreSQL refuses any explicit
    /// value there (and the publisher cannot have changed it by UPDATE either).
    pub always_identity: Vec<bool>,
    /// The foreign keys the table takes part in (orphan checks, `fk.rs`);
    /// None for most tables, which then pay nothing.
    pub fks: Option<Arc<super::fk::ForeignKeys>>,
    /// Prepared orphan checks, by (as child, constraint index).
    pub fk_stmts: HashMap<(bool, usize), Stmt>,
    /// Single-row INSERT: [inside a transaction, a whole transaction, a
    /// whole transaction in an apply lane] (`sql::Commit`).
    pub insert: [Option<Stmt>; 3],
    /// Multi-row INSERTs of `batch_sizes` rows (fixed per relation: its width).
    pub insert_batch: [Option<Stmt>; 3],
    /// Keyed by (columns left out of SET, columns left out of the row match).
    /// An "unchanged TOAST" value in the new tuple is left out of SET; in a
    /// REPLICA IDENTITY FULL old tuple it is left out of the match. Each
    /// pattern has its own statement.
    /// Also keyed by how the statement commits, and whether it resolves a
    /// conflict in place (`sql::fast_update_in_place`).
    pub update: HashMap<(Vec<bool>, Vec<bool>, Commit, bool), Stmt>,
    /// Keyed by the columns left out of the row match (FULL identity only)
    /// and how the tombstone is written.
    pub delete: HashMap<(Vec<bool>, Commit, TombstoneWrite), Stmt>,
    /// A group's merged statements (`merge.rs`), by class, rows and how a
    /// delete writes its tombstones.
    pub many: HashMap<(super::merge::Class, usize, TombstoneWrite), Stmt>,
    /// Until when deletes upsert their keys' tombstones: set when a plain
    /// tombstone INSERT met a key that had one (`Applier::recover`).
    pub upsert_tombstones_until: Option<Instant>,
}

/// How long a table's deletes upsert their tombstones after a plain
/// INSERT of one met a key that had one: that table's keys are being
/// deleted again within the purge window, and each such meeting rolls back
/// everything in flight. After it, plain INSERTs are tried again.
pub const UPSERT_TOMBSTONES_FOR: Duration = Duration::from_secs(60);

impl LocalRelation {
    /// How this table's deletes write their tombstones now.
    pub fn tombstone_write(&self) -> TombstoneWrite {
        match self.upsert_tombstones_until {
            Some(until) if Instant::now() < until => TombstoneWrite::Upsert,
            _ => TombstoneWrite::Insert,
        }
    }

    /// The key column names (`None` for REPLICA IDENTITY FULL without one).
    pub fn key_names(&self) -> Option<Vec<&str>> {
        match &self.locator {
            Locator::Key(k) => Some(k.iter().map(String::as_str).collect()),
            Locator::AllColumns(_) => None,
        }
    }

    /// Columns an update must not SET: unchanged TOAST (not sent) and
    /// `GENERATED ALWAYS` identity columns.
    pub fn set_mask(&self, tuple: &mm_proto::pgoutput::TupleData) -> Vec<bool> {
        tuple
            .columns
            .iter()
            .enumerate()
            .map(|(i, c)| {
                matches!(c, mm_proto::pgoutput::ColumnValue::UnchangedToast)
                    || self.always_identity.get(i).copied().unwrap_or(false)
            })
            .collect()
    }

    /// Local column names an update may SET (see `set_mask`).
    pub fn settable_names(&self) -> Vec<&str> {
        self.local_names
            .iter()
            .zip(&self.always_identity)
            .filter(|(_, a)| !**a)
            .map(|(n, _)| n.as_str())
            .collect()
    }

    /// Local types of the key columns, in key order.
    pub fn key_types(&self) -> Vec<&str> {
        self.key_remote
            .iter()
            .map(|&i| self.local_types[i].as_str())
            .collect()
    }

    /// Looks the relation up in the local catalog. Errors name the relation and
    /// what is missing; the caller adds peer and LSN.
    pub async fn resolve(client: &Client, remote: Relation) -> Result<Self, ApplyFailure> {
        let display = format!("{}.{}", remote.namespace, remote.name);
        let fail = |message: String| ApplyFailure::new(Some(&display), message);
        let rows = client
            .query(
                "SELECT c.oid, c.relreplident::text FROM pg_catalog.pg_class c \
                 JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
                 WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')",
                &[&remote.namespace, &remote.name],
            )
            .await
            .map_err(|e| ApplyFailure::from_pg(Some(&display), &e))?;
        let Some(row) = rows.first() else {
            return Err(fail(format!(
                "table {display} does not exist on this node (create it with the same columns as on the publisher)"
            )));
        };
        let oid: u32 = row.get(0);
        let replident: String = row.get(1);
        let cols = client
            .query(
                "SELECT attname::text, pg_catalog.format_type(atttypid, -1), attidentity = 'a' \
                 FROM pg_catalog.pg_attribute \
                 WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped AND attgenerated = ''",
                &[&oid],
            )
            .await
            .map_err(|e| ApplyFailure::from_pg(Some(&display), &e))?;
        let local_cols: Vec<(String, String, bool)> = cols
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let mut local_names = Vec::with_capacity(remote.columns.len());
        let mut local_types = Vec::with_capacity(remote.columns.len());
        let mut always_identity = Vec::with_capacity(remote.columns.len());
        for rc in &remote.columns {
            let Some((_, ty, always)) = local_cols.iter().find(|(c, _, _)| c == &rc.name) else {
                return Err(fail(format!(
                    "table {display} on this node is missing replicated column \"{}\"",
                    rc.name
                )));
            };
            local_names.push(rc.name.clone());
            local_types.push(ty.clone());
            always_identity.push(*always);
        }
        let uniq = client
            .query(
                "SELECT array_agg(a.attname::text ORDER BY array_position(i.indkey::int2[], a.attnum)) \
                 FROM pg_catalog.pg_index i \
                 JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey) \
                 WHERE i.indrelid = $1 AND i.indisunique AND i.indisvalid AND i.indpred IS NULL \
                   AND i.indexprs IS NULL \
                 GROUP BY i.indexrelid ORDER BY i.indexrelid",
                &[&oid],
            )
            .await
            .map_err(|e| ApplyFailure::from_pg(Some(&display), &e))?;
        let opaque = client
            .query_one(
                "SELECT c.relkind <> 'r' OR c.relhasrules \
                   OR EXISTS (SELECT 1 FROM pg_catalog.pg_trigger t \
                              WHERE t.tgrelid = c.oid AND t.tgenabled IN ('A', 'R')) \
                   OR EXISTS (SELECT 1 FROM pg_catalog.pg_index i WHERE i.indrelid = c.oid \
                              AND i.indisunique AND (i.indpred IS NOT NULL OR i.indexprs IS NOT NULL)) \
                   OR EXISTS (SELECT 1 FROM pg_catalog.pg_constraint x \
                              WHERE x.conrelid = c.oid AND x.contype = 'x') \
                 FROM pg_catalog.pg_class c WHERE c.oid = $1",
                &[&oid],
            )
            .await
            .map_err(|e| ApplyFailure::from_pg(Some(&display), &e))?
            .try_get::<_, bool>(0)
            .map_err(|e| ApplyFailure::from_pg(Some(&display), &e))?;
        let mut unique_indexes = Vec::new();
        for r in &uniq {
            let names: Vec<String> = r.get(0);
            let idx: Option<Vec<usize>> = names
                .iter()
                .map(|n| remote.columns.iter().position(|c| &c.name == n))
                .collect();
            // An index over a column the publisher does not send cannot be
            // checked from the incoming row.
            if let Some(idx) = idx {
                unique_indexes.push(idx);
            }
        }
        // Prefer the replica identity index, then the primary key: the same
        // choice PostgreSQL's own apply worker makes.
        // The same function the tombstone trigger uses, so both sides agree
        // on which columns form the key.
        let key_rows = client
            .query(
                "SELECT k FROM unnest(mm.key_columns($1)) WITH ORDINALITY AS u(k, i) ORDER BY i",
                &[&oid],
            )
            .await
            .map_err(|e| ApplyFailure::from_pg(Some(&display), &e))?;
        let key_names: Vec<String> = key_rows.iter().map(|r| r.get(0)).collect();
        let (locator, key_remote) = if !key_names.is_empty() {
            let mut idx = Vec::with_capacity(key_names.len());
            for k in &key_names {
                match remote.columns.iter().position(|c| &c.name == k) {
                    Some(i) => idx.push(i),
                    None => {
                        return Err(fail(format!(
                            "key column \"{k}\" of {display} is not replicated by the publisher"
                        )));
                    }
                }
            }
            (Locator::Key(key_names), idx)
        } else if replident == "f" {
            (Locator::AllColumns(local_names.clone()), Vec::new())
        } else {
            return Err(fail(format!(
                "table {display} has no primary key, replica identity index or REPLICA IDENTITY FULL on this node"
            )));
        };
        Ok(LocalRelation {
            table_sql: sql::qualified(&remote.namespace, &remote.name),
            display: Arc::from(display.as_str()),
            local_names,
            key_remote,
            locator,
            relid: oid,
            local_types,
            lanes_safe: !opaque && unique_indexes.len() == uniq.len(),
            unique_indexes,
            always_identity,
            fks: super::fk::ForeignKeys::load(client, oid)
                .await
                .map_err(|e| ApplyFailure::new(Some(&display), e.message))?,
            fk_stmts: HashMap::new(),
            remote,
            insert: [None, None, None],
            insert_batch: [None, None, None],
            update: HashMap::new(),
            delete: HashMap::new(),
            many: HashMap::new(),
            upsert_tombstones_until: None,
        })
    }
}
