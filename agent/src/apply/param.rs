//! Row values bound as statement parameters in PostgreSQL's text format.
//!
//! pgoutput (without `binary`) sends every value as its type's text output.
//! Binding that text with the text format lets the server's own input function
//! parse it for whatever the local column type is (enums, domains, arrays
//! included), so we never interpret values ourselves and never splice them
//! into SQL.
//!
//! The exception: values the agent makes itself for its own checks (origin
//! ids, commit timestamps, watermark arrays) go in binary. They are bound to
//! every replicated UPDATE and DELETE, and parsing their text (timestamps,
//! arrays of timestamps) on the single apply backend costs more than the
//! change itself (measured with pgbench).

use bytes::{Bytes, BytesMut};
use postgres_protocol::types;
use tokio_postgres::types::{Format, IsNull, ToSql, Type, to_sql_checked};

#[derive(Debug, Clone)]
pub enum Param {
    Null,
    Text(Bytes),
    /// Already in the binary format of the type the statement casts it to.
    Binary(Bytes),
}

impl ToSql for Param {
    fn to_sql(
        &self,
        _ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Param::Null => Ok(IsNull::Yes),
            Param::Text(b) | Param::Binary(b) => {
                out.extend_from_slice(b);
                Ok(IsNull::No)
            }
        }
    }

    fn accepts(_ty: &Type) -> bool {
        true
    }

    fn encode_format(&self, _ty: &Type) -> Format {
        match self {
            Param::Binary(_) => Format::Binary,
            Param::Null | Param::Text(_) => Format::Text,
        }
    }

    to_sql_checked!();
}

impl Param {
    /// As a Bind message carries it: (binary format, bytes or NULL).
    pub fn wire(&self) -> (bool, Option<&[u8]>) {
        match self {
            Param::Null => (false, None),
            Param::Text(b) => (false, Some(b)),
            Param::Binary(b) => (true, Some(b)),
        }
    }

    pub fn text(s: impl Into<String>) -> Param {
        Param::Text(Bytes::from(s.into()))
    }

    /// For a parameter the statement casts to `oid`.
    pub fn oid(v: u32) -> Param {
        let mut b = BytesMut::with_capacity(4);
        types::oid_to_sql(v, &mut b);
        Param::Binary(b.freeze())
    }

    /// For a parameter the statement casts to `int4`.
    pub fn int4(v: i32) -> Param {
        let mut b = BytesMut::with_capacity(4);
        types::int4_to_sql(v, &mut b);
        Param::Binary(b.freeze())
    }

    /// For a parameter the statement casts to `timestamptz`: microseconds
    /// since 2000-01-01 UTC, as pgoutput sends them.
    pub fn timestamptz(micros: i64) -> Param {
        let mut b = BytesMut::with_capacity(8);
        types::timestamp_to_sql(micros, &mut b);
        Param::Binary(b.freeze())
    }

    /// For `oid[]` (one dimension, no NULLs).
    pub fn oid_array(v: &[u32]) -> Param {
        Self::array(Type::OID.oid(), v, |x, b| types::oid_to_sql(*x, b))
    }

    /// For `timestamptz[]` of microseconds since 2000 (one dimension, no NULLs).
    pub fn timestamptz_array(v: &[i64]) -> Param {
        Self::array(Type::TIMESTAMPTZ.oid(), v, |x, b| {
            types::timestamp_to_sql(*x, b)
        })
    }

    /// For `text[]` (one dimension, no NULLs).
    pub fn text_array(v: &[String]) -> Param {
        Self::array(Type::TEXT.oid(), v, |x, b| types::text_to_sql(x, b))
    }

    /// For `text[]` whose elements may be NULL (one column's values over
    /// a batch of transactions, `batch.rs`): each element is the value's
    /// text, which is also `text`'s binary format.
    pub fn nullable_text_array(v: &[Option<Bytes>]) -> Param {
        Self::array_of(Type::TEXT.oid(), v, |x, b| match x {
            Some(t) => {
                b.extend_from_slice(t);
                postgres_protocol::IsNull::No
            }
            None => postgres_protocol::IsNull::Yes,
        })
    }

    /// For `pg_lsn[]` (binary: each LSN as a 64-bit integer).
    pub fn lsn_array(v: &[u64]) -> Param {
        Self::array(Type::PG_LSN.oid(), v, |x, b| {
            b.extend_from_slice(&x.to_be_bytes())
        })
    }

    fn array<T>(element_type: u32, v: &[T], put: impl Fn(&T, &mut BytesMut)) -> Param {
        Self::array_of(element_type, v, |x, b| {
            put(x, b);
            postgres_protocol::IsNull::No
        })
    }

    /// A one-dimensional array in the binary format, `put` writing each
    /// element (or saying it is NULL).
    fn array_of<T>(
        element_type: u32,
        v: &[T],
        put: impl Fn(&T, &mut BytesMut) -> postgres_protocol::IsNull,
    ) -> Param {
        let mut b = BytesMut::new();
        let dims = (!v.is_empty()).then(|| types::ArrayDimension {
            len: i32::try_from(v.len()).unwrap_or(i32::MAX),
            lower_bound: 1,
        });
        // Infallible: every element is written or NULL.
        let _ = types::array_to_sql(dims, element_type, v.iter(), |x, b| Ok(put(x, b)), &mut b);
        Param::Binary(b.freeze())
    }
}
