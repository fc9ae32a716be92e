//! Compensating deletes from peers: the `mm.delete` logical messages
//! `mm.compensate` (sql/functions.sql) sends after a peer gave a row up on a
//! unique value held by a row at another key (`conflict::classify`). Each
//! is applied as a delete of that key through the careful path's rules, so
//! it meets tombstones, truncates and newer versions like any delete: it is
//! newer than every version the collision involved, so on every node it
//! wins over them, and loses only to a change made after it.
//!
//! The message describes its table as pgoutput would (oid, names, columns)
//! because a peer may not have received that table's RELATION in this
//! session: no row change of it may have preceded the message.

use std::collections::BTreeMap;

use bytes::Bytes;
use mm_proto::pgoutput::{ColumnValue, LogicalMessage, Relation, RelationColumn, ReplicaIdentity};
use serde::Deserialize;

use super::careful::Outcome;
use super::sql::Locator;
use super::txn::TxnMeta;
use super::{Applier, ApplyFailure, Param};
use crate::conflict::classify::Op;

pub(super) const PREFIX: &str = "mm.delete";

pub(super) fn is_compensation(m: &LogicalMessage) -> bool {
    m.transactional && m.prefix == PREFIX
}

#[derive(Debug, Deserialize)]
struct Compensation {
    relation: RelationDesc,
    /// Key column → its value's text output.
    key: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
struct RelationDesc {
    oid: u32,
    schema: String,
    table: String,
    replident: String,
    columns: Vec<ColumnDesc>,
}

#[derive(Debug, Deserialize)]
struct ColumnDesc {
    name: String,
    #[serde(rename = "type")]
    type_oid: u32,
    typmod: i32,
    key: bool,
}

impl RelationDesc {
    fn to_relation(&self) -> Result<Relation, String> {
        let replica_identity = self
            .replident
            .bytes()
            .next()
            .and_then(ReplicaIdentity::from_byte)
            .ok_or_else(|| format!("unknown replica identity {:?}", self.replident))?;
        Ok(Relation {
            xid: None,
            oid: self.oid,
            namespace: self.schema.clone(),
            name: self.table.clone(),
            replica_identity,
            columns: self
                .columns
                .iter()
                .map(|c| RelationColumn {
                    is_key: c.key,
                    name: c.name.clone(),
                    type_oid: c.type_oid,
                    type_modifier: c.typmod,
                })
                .collect(),
        })
    }
}

impl Applier {
    /// Applies one compensating delete inside the careful transaction.
    pub(super) async fn careful_compensation(
        &mut self,
        meta: &TxnMeta,
        m: &LogicalMessage,
        out: &mut Outcome,
    ) -> Result<(), ApplyFailure> {
        let bad = |why: String| {
            ApplyFailure::new(
                None,
                format!(
                    "malformed compensating delete (mm.delete message) at {}: {why}",
                    meta.commit_lsn
                ),
            )
        };
        let msg: Compensation =
            serde_json::from_slice(&m.content).map_err(|e| bad(e.to_string()))?;
        let oid = msg.relation.oid;
        if self.rel(oid).is_err() {
            let r = msg.relation.to_relation().map_err(bad)?;
            self.load_relation(r).await?;
        }
        let rel = self.rel(oid)?;
        let Locator::Key(names) = &rel.locator else {
            return Err(ApplyFailure::new(
                Some(&*rel.display),
                "a compensating delete arrived for a table without a key on this node",
            ));
        };
        let mut params = Vec::with_capacity(names.len());
        // The key as a row image of the table (for the conflict log).
        let mut image = vec![ColumnValue::Null; rel.local_names.len()];
        for (n, &i) in names.iter().zip(&rel.key_remote) {
            let Some(v) = msg.key.get(n) else {
                return Err(bad(format!("key column {n} of {} missing", rel.display)));
            };
            params.push(Param::text(v.clone()));
            if let Some(slot) = image.get_mut(i) {
                *slot = ColumnValue::Text(Bytes::from(v.clone()));
            }
        }
        let keys = rel.key_remote.clone();
        let old = self.tuple_json(rel, &image, |i| keys.contains(&i)).await?;
        let rel = self.rel(oid)?;
        let target = self.fetch_target(rel, &rel.locator, &params).await?;
        self.careful_remove(meta, oid, Op::Delete, target, params, old, None, true, out)
            .await
            .map(|_| ())
    }
}
