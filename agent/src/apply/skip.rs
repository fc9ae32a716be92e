//! `mmctl skip`: a transaction an operator asked to skip is not applied;
//! its progress is, with an audit row, in one local transaction.

use mm_proto::pgoutput::{ColumnValue, KeyTuple, Message, OldTuple, TupleData};

use super::applier::Applier;
use super::fast::control_op;
use super::pipeline::{OpKind, Pipeline};
use super::relation::LocalRelation;
use super::txn::{ChangeSource, TxnMeta};
use super::{ApplyFailure, Param};

impl Applier {
    /// `mmctl skip`: the transaction's changes are not applied; its progress
    /// is, with an audit row in the conflict log naming the relations and
    /// the rows skipped (keys as sent, the first `SKIP_AUDIT_ROWS`), and the
    /// request is consumed in the same local transaction. RELATION messages
    /// inside it are still taken: the publisher sends each relation once per
    /// session, and later transactions refer to it.
    pub(super) async fn queue_skip(
        &mut self,
        pipe: &mut Pipeline,
        meta: &TxnMeta,
        src: &mut dyn ChangeSource,
    ) -> Result<(), ApplyFailure> {
        let txn = *meta;
        let control = |kind| control_op(kind, txn);
        let mut relations: Vec<String> = Vec::new();
        let mut rows: Vec<serde_json::Value> = Vec::new();
        let mut changes = 0u64;
        while let Some(msg) = src.next_message()? {
            let (oid, op, key) = match &msg {
                Message::Relation(_) => {
                    pipe.settle(0).await?;
                    if let Message::Relation(r) = msg {
                        self.load_relation(r).await?;
                    }
                    continue;
                }
                Message::Insert(i) => (i.relation_oid, "insert", Some(&i.new)),
                Message::Update(u) => (
                    u.relation_oid,
                    "update",
                    match &u.old {
                        Some(OldTuple::Full(t)) => Some(t),
                        _ => Some(&u.new),
                    },
                ),
                Message::Delete(d) => (
                    d.relation_oid,
                    "delete",
                    match &d.old {
                        OldTuple::Full(t) => Some(t),
                        OldTuple::Key(_) => None,
                    },
                ),
                Message::Truncate(t) => {
                    for oid in &t.relation_oids {
                        if let Ok(rel) = self.rel(*oid) {
                            note_relation(&mut relations, &rel.display);
                            push_capped(
                                &mut rows,
                                serde_json::json!({"relation": &*rel.display, "op": "truncate"}),
                            );
                        }
                    }
                    changes += 1;
                    continue;
                }
                _ => continue,
            };
            changes += 1;
            let Ok(rel) = self.rel(oid) else { continue };
            note_relation(&mut relations, &rel.display);
            let key = match (&msg, key) {
                (Message::Delete(d), None) => match &d.old {
                    OldTuple::Key(k) => key_json_of_key(rel, k),
                    OldTuple::Full(_) => serde_json::Value::Null,
                },
                (_, Some(t)) => key_json_of_tuple(rel, t),
                _ => serde_json::Value::Null,
            };
            push_capped(
                &mut rows,
                serde_json::json!({"relation": &*rel.display, "op": op, "key": key}),
            );
        }
        let summary = serde_json::json!({"changes": changes, "rows": rows});
        let audit = pipe.prepare(
            &self.stmt_names,
            "mm.conflict_log",
            "WITH r AS (DELETE FROM mm.skip_requests WHERE from_node = $1 AND commit_lsn = $2::pg_lsn) \
             INSERT INTO mm.conflict_log (relation, conflict_type, remote_origin, remote_commit_ts, remote_lsn, resolution, remote_tuple) \
             VALUES ($4, 'skipped_transaction', $1, $3::timestamptz, $2::pg_lsn, 'skipped', $5::jsonb)",
        )
        .await?;
        pipe.push(
            &audit,
            vec![
                Param::text(self.ctx.peer.clone()),
                Param::text(meta.commit_lsn.to_string()),
                Param::text(meta.commit_ts.to_string()),
                Param::text(relations.join(", ")),
                Param::text(summary.to_string()),
            ],
            control(OpKind::Control),
        )
        .await?;
        tracing::warn!(commit_lsn = %meta.commit_lsn, xid = meta.xid, relations = %relations.join(", "), changes, "skipping the transaction as requested by mmctl skip");
        self.skips.remove(&meta.commit_lsn);
        self.finish_queue(pipe, meta).await
    }
}

/// Rows of a skipped transaction listed in its audit row.
const SKIP_AUDIT_ROWS: usize = 100;

fn note_relation(relations: &mut Vec<String>, display: &str) {
    if !relations.iter().any(|r| r == display) {
        relations.push(display.to_owned());
    }
}

fn push_capped(rows: &mut Vec<serde_json::Value>, v: serde_json::Value) {
    if rows.len() < SKIP_AUDIT_ROWS {
        rows.push(v);
    }
}

fn text_json(v: &ColumnValue) -> serde_json::Value {
    match v {
        ColumnValue::Text(b) => serde_json::Value::String(String::from_utf8_lossy(b).into_owned()),
        _ => serde_json::Value::Null,
    }
}

/// The key columns of a full tuple, as sent (text), for audit rows.
fn key_json_of_tuple(rel: &LocalRelation, t: &TupleData) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    let idx: Vec<usize> = if rel.key_remote.is_empty() {
        (0..t.columns.len()).collect()
    } else {
        rel.key_remote.clone()
    };
    for i in idx {
        if let (Some(name), Some(v)) = (rel.local_names.get(i), t.columns.get(i)) {
            m.insert(name.clone(), text_json(v));
        }
    }
    serde_json::Value::Object(m)
}

fn key_json_of_key(rel: &LocalRelation, k: &KeyTuple) -> serde_json::Value {
    let vals = super::fk::old_values(rel, &OldTuple::Key(k.clone()));
    let mut m = serde_json::Map::new();
    for (v, name) in vals.iter().zip(&rel.local_names) {
        if let Some(c) = v {
            m.insert(name.clone(), text_json(c));
        }
    }
    serde_json::Value::Object(m)
}
