//! Keys known to be hot: rows that single-change transactions of this
//! stream just met in conflict.
//!
//! Under hot keys nearly every transaction conflicts. On the fast path each
//! one would be sent, fail in its conflict check, be rolled back and then
//! be applied again on the careful path: a statement and a round trip
//! spent on an attempt that is known to fail. A transaction whose only
//! change touches a key in this set goes to the careful path directly
//! ("check, then apply"). Only the route changes: a key that is no longer
//! contended is applied there as a routine change, with the same outcome
//! the fast path would have had.
//!
//! An update of such a key that `resolvable_in_place` allows goes neither
//! way: it stays on the fast path, pipelined, as a statement that resolves
//! its own conflict (`sql::fast_update_in_place`), so dense conflicts cost
//! about one statement each instead of a rolled-back attempt or a careful
//! transaction's round trips.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};

use mm_proto::pgoutput::{ColumnValue, Message, Update};

use super::Param;
use super::relation::LocalRelation;
use super::sql::Locator;
use super::tuple::locate;

/// Keys remembered; the set starts over when full (it only steers routing).
const CAPACITY: usize = 4096;

#[derive(Default)]
pub(super) struct HotKeys(HashSet<u64>);

impl HotKeys {
    pub fn insert(&mut self, key: u64) {
        if self.0.len() >= CAPACITY {
            self.0.clear();
        }
        self.0.insert(key);
    }

    pub fn contains(&self, key: u64) -> bool {
        self.0.contains(&key)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The relation a row change (insert, update, delete) is for.
pub(super) fn relation_of(change: &Message) -> Option<u32> {
    match change {
        Message::Insert(i) => Some(i.relation_oid),
        Message::Update(u) => Some(u.relation_oid),
        Message::Delete(d) => Some(d.relation_oid),
        _ => None,
    }
}

/// A fingerprint of the row a change targets: its relation and the values
/// that locate it, as the publisher sent them. `None` when the change has
/// no key of its own (REPLICA IDENTITY FULL without an index).
pub(super) fn key_of(rel: &LocalRelation, change: &Message) -> Option<u64> {
    let (oid, located) = match change {
        Message::Insert(i) => (i.relation_oid, locate(rel, None, Some(&i.new))),
        Message::Update(u) => (u.relation_oid, locate(rel, u.old.as_ref(), Some(&u.new))),
        Message::Delete(d) => (d.relation_oid, locate(rel, Some(&d.old), None)),
        _ => return None,
    };
    let (mask, params) = located.ok()?;
    if !mask.is_empty() {
        return None;
    }
    Some(fingerprint(oid, &params))
}

/// Whether the conflict an update of a hot key may meet can be settled in
/// its own statement (`sql::fast_update_in_place`, for a last-writer-wins
/// table): its commit timestamp is known (not a streamed transaction
/// applied before its commit: the decision needs it), it keeps its key
/// (no old tuple: a key change is a delete and an insert, `careful_move`),
/// the row is found by a key, and every column is sent and settable (the
/// statement logs the whole incoming row, and an unchanged-TOAST value must
/// be completed from the publisher first, which only the careful path does).
/// Everything else about the change is checked by the statement itself.
pub(super) fn resolvable_in_place(rel: &LocalRelation, upd: &Update, commit_known: bool) -> bool {
    commit_known
        && upd.old.is_none()
        && matches!(rel.locator, Locator::Key(_))
        && upd.new.columns.len() == rel.local_names.len()
        && upd
            .new
            .columns
            .iter()
            .all(|c| matches!(c, ColumnValue::Text(_) | ColumnValue::Null))
        && !rel.always_identity.contains(&true)
}

/// Equal for equal (relation, key values); each value is hashed with its
/// kind and length, so values never run into each other.
pub(super) fn fingerprint(oid: u32, key: &[Param]) -> u64 {
    let mut h = DefaultHasher::new();
    oid.hash(&mut h);
    for p in key {
        match p {
            Param::Null => 0u8.hash(&mut h),
            Param::Text(b) => (1u8, b.as_ref()).hash(&mut h),
            Param::Binary(b) => (2u8, b.as_ref()).hash(&mut h),
        }
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn text(s: &'static str) -> Param {
        Param::Text(Bytes::from_static(s.as_bytes()))
    }

    #[test]
    fn a_key_is_known_by_its_relation_and_every_value() {
        let k = fingerprint(42, &[text("1"), text("x")]);
        assert_eq!(k, fingerprint(42, &[text("1"), text("x")]));
        assert_ne!(k, fingerprint(43, &[text("1"), text("x")]));
        assert_ne!(k, fingerprint(42, &[text("1"), text("y")]));
        // Boundaries and kinds count: no two keys run into each other.
        assert_ne!(
            fingerprint(42, &[text("ab"), text("c")]),
            fingerprint(42, &[text("a"), text("bc")])
        );
        assert_ne!(
            fingerprint(42, &[Param::Null]),
            fingerprint(42, &[text("")])
        );
        assert_ne!(
            fingerprint(42, &[text("1")]),
            fingerprint(42, &[Param::Binary(Bytes::from_static(b"1"))])
        );
    }

    #[test]
    fn the_set_forgets_everything_when_full_and_keeps_going() {
        let mut hot = HotKeys::default();
        for k in 0..CAPACITY as u64 {
            hot.insert(k);
        }
        assert!(hot.contains(0) && hot.contains(CAPACITY as u64 - 1));
        hot.insert(u64::MAX);
        assert!(hot.contains(u64::MAX));
        assert!(!hot.contains(0), "a full set starts over");
    }
}
