//! Row images: TupleData and the old-row variants of UPDATE/DELETE.

use bytes::Bytes;

use super::message::Relation;

/// One row image: a value per column of the table's RELATION message, in order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TupleData {
    pub columns: Vec<ColumnValue>,
}

impl TupleData {
    pub fn new(columns: Vec<ColumnValue>) -> Self {
        TupleData { columns }
    }
}

/// One column of a row image.
///
/// `UnchangedToast` is deliberately its own variant: it means "the publisher
/// did not send the value because it did not change", and writing it as NULL
/// would silently destroy data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ColumnValue {
    /// 'n': SQL NULL (but see [`KeyTuple`]: in a 'K' tuple it means "not sent").
    Null,
    /// 'u': an unchanged out-of-line (TOASTed) value, not sent.
    UnchangedToast,
    /// 't': the type's text output.
    Text(Bytes),
    /// 'b': the type's binary send format (`binary 'true'`).
    Binary(Bytes),
}

impl ColumnValue {
    /// The wire marker byte.
    pub fn marker(&self) -> u8 {
        match self {
            ColumnValue::Null => b'n',
            ColumnValue::UnchangedToast => b'u',
            ColumnValue::Text(_) => b't',
            ColumnValue::Binary(_) => b'b',
        }
    }

    /// The value bytes for 't' and 'b'.
    pub fn bytes(&self) -> Option<&Bytes> {
        match self {
            ColumnValue::Text(b) | ColumnValue::Binary(b) => Some(b),
            ColumnValue::Null | ColumnValue::UnchangedToast => None,
        }
    }
}

/// The old row carried by UPDATE (optional) and DELETE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OldTuple {
    /// 'K': only the replica identity columns.
    Key(KeyTuple),
    /// 'O': the whole old row (REPLICA IDENTITY FULL); every column is real,
    /// 'n' is a real NULL and 'u' an unchanged TOAST value.
    Full(TupleData),
}

/// A 'K' old tuple: the values of the replica identity columns.
///
/// On the wire it is a full-width TupleData in which PostgreSQL sends every
/// non-key column as 'n'. Such a column was *not sent*; it is not NULL, and
/// treating it as NULL (e.g. `WHERE col IS NULL`) would match the wrong row or
/// none. The raw TupleData is therefore private: values are only reachable
/// through the table's [`Relation`], which says which columns are keys, and
/// come out as [`KeyValue::NotSent`] for the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyTuple {
    /// Invariant: exactly what was (or will be) on the wire; no interpretation.
    wire: TupleData,
}

/// A column of a [`KeyTuple`] seen through its [`Relation`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyValue<'a> {
    /// A replica identity column and its value.
    Key(&'a ColumnValue),
    /// Not part of the replica identity: the publisher sent nothing for it.
    NotSent,
}

/// A [`KeyTuple`] was read with a [`Relation`] of a different width, i.e. not
/// the RELATION it was sent under (wrong OID, or a stale definition).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "key tuple has {tuple_columns} columns but relation {relation_oid} ({relation_columns} columns) was used to read it"
)]
pub struct KeyTupleMismatch {
    pub relation_oid: u32,
    pub relation_columns: usize,
    pub tuple_columns: usize,
}

impl KeyTuple {
    /// Wraps a TupleData exactly as it appears on the wire (non-key columns as 'n').
    pub fn from_wire(wire: TupleData) -> Self {
        KeyTuple { wire }
    }

    /// Builds the 'K' image PostgreSQL would send for `row`: key columns'
    /// values, 'n' for the rest. For producing test traffic.
    pub fn from_row(rel: &Relation, row: &TupleData) -> Result<Self, KeyTupleMismatch> {
        check_width(rel, row.columns.len())?;
        let columns = rel
            .columns
            .iter()
            .zip(&row.columns)
            .map(|(c, v)| {
                if c.is_key {
                    v.clone()
                } else {
                    ColumnValue::Null
                }
            })
            .collect();
        Ok(KeyTuple {
            wire: TupleData { columns },
        })
    }

    /// The wire image. Only for encoding; its non-key 'n' columns are not NULLs.
    pub(crate) fn wire(&self) -> &TupleData {
        &self.wire
    }

    /// Number of columns sent (keys and not-sent placeholders).
    pub fn width(&self) -> usize {
        self.wire.columns.len()
    }

    /// Every column, in order, as key value or [`KeyValue::NotSent`].
    pub fn values<'a>(
        &'a self,
        rel: &'a Relation,
    ) -> Result<impl ExactSizeIterator<Item = KeyValue<'a>> + 'a, KeyTupleMismatch> {
        check_width(rel, self.wire.columns.len())?;
        Ok(rel.columns.iter().zip(&self.wire.columns).map(|(c, v)| {
            if c.is_key {
                KeyValue::Key(v)
            } else {
                KeyValue::NotSent
            }
        }))
    }

    /// Only the key columns: (column index in the relation, value).
    pub fn key_columns<'a>(
        &'a self,
        rel: &'a Relation,
    ) -> Result<impl Iterator<Item = (usize, &'a ColumnValue)> + 'a, KeyTupleMismatch> {
        check_width(rel, self.wire.columns.len())?;
        Ok(rel
            .columns
            .iter()
            .zip(&self.wire.columns)
            .enumerate()
            .filter(|(_, (c, _))| c.is_key)
            .map(|(i, (_, v))| (i, v)))
    }

    /// Column `index` through `rel`; `None` if out of range.
    pub fn get<'a>(
        &'a self,
        rel: &'a Relation,
        index: usize,
    ) -> Result<Option<KeyValue<'a>>, KeyTupleMismatch> {
        check_width(rel, self.wire.columns.len())?;
        Ok(rel
            .columns
            .get(index)
            .zip(self.wire.columns.get(index))
            .map(|(c, v)| {
                if c.is_key {
                    KeyValue::Key(v)
                } else {
                    KeyValue::NotSent
                }
            }))
    }
}

fn check_width(rel: &Relation, tuple_columns: usize) -> Result<(), KeyTupleMismatch> {
    if rel.columns.len() == tuple_columns {
        Ok(())
    } else {
        Err(KeyTupleMismatch {
            relation_oid: rel.oid,
            relation_columns: rel.columns.len(),
            tuple_columns,
        })
    }
}
