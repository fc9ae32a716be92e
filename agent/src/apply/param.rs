//! Row values bound as statement parameters in PostgreSQL's text format.
//!
//! pgoutput (without `binary`) sends every value as its type's text output.
//! Binding that text with the text format lets the server's own input function
//! parse it for whatever the local column type is (enums, domains, arrays
//! included), so we never interpret values ourselves and never splice them
//! into SQL.

use bytes::{Bytes, BytesMut};
use tokio_postgres::types::{Format, IsNull, ToSql, Type, to_sql_checked};

#[derive(Debug, Clone)]
pub enum Param {
    Null,
    Text(Bytes),
}

impl ToSql for Param {
    fn to_sql(
        &self,
        _ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Param::Null => Ok(IsNull::Yes),
            Param::Text(b) => {
                out.extend_from_slice(b);
                Ok(IsNull::No)
            }
        }
    }

    fn accepts(_ty: &Type) -> bool {
        true
    }

    fn encode_format(&self, _ty: &Type) -> Format {
        Format::Text
    }

    to_sql_checked!();
}

impl Param {
    pub fn text(s: impl Into<String>) -> Param {
        Param::Text(Bytes::from(s.into()))
    }
}
