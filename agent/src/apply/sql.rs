//! SQL text for applying row changes. Pure functions, unit-tested.
//!
//! Identifiers come from the replication stream and are data: they are always
//! quoted here, never spliced raw. Values never appear in SQL text at all; they
//! are bound as parameters.

use std::fmt::Write;

/// Quotes an identifier the way PostgreSQL's `quote_ident` does when quoting is
/// needed, but always quotes (cheaper than deciding, and equally correct).
pub fn quote_ident(ident: &str) -> String {
    let mut out = String::with_capacity(ident.len() + 2);
    out.push('"');
    for c in ident.chars() {
        if c == '"' {
            out.push('"');
        }
        out.push(c);
    }
    out.push('"');
    out
}

pub fn qualified(schema: &str, table: &str) -> String {
    format!("{}.{}", quote_ident(schema), quote_ident(table))
}

/// How the target row of an UPDATE/DELETE is found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Locator {
    /// By the local primary key / replica identity index columns (`=`).
    Key(Vec<String>),
    /// REPLICA IDENTITY FULL without a usable index: every listed column matched
    /// with IS NOT DISTINCT FROM, one row only (duplicates are legal there).
    AllColumns(Vec<String>),
}

fn where_clause(table: &str, loc: &Locator, first_param: usize, out: &mut String) {
    match loc {
        Locator::Key(cols) => {
            out.push_str(" WHERE ");
            for (i, c) in cols.iter().enumerate() {
                if i > 0 {
                    out.push_str(" AND ");
                }
                let _ = write!(out, "{} = ${}", quote_ident(c), first_param + i);
            }
        }
        Locator::AllColumns(cols) => {
            let _ = write!(out, " WHERE ctid = (SELECT ctid FROM {table} WHERE ");
            for (i, c) in cols.iter().enumerate() {
                if i > 0 {
                    out.push_str(" AND ");
                }
                let _ = write!(
                    out,
                    "{} IS NOT DISTINCT FROM ${}",
                    quote_ident(c),
                    first_param + i
                );
            }
            if cols.is_empty() {
                out.push_str("true");
            }
            out.push_str(" LIMIT 1 FOR UPDATE)");
        }
    }
}

/// `INSERT INTO t (c1, c2) VALUES ($1, $2)`.
pub fn insert(table: &str, cols: &[&str]) -> String {
    let mut s = format!("INSERT INTO {table} (");
    for (i, c) in cols.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&quote_ident(c));
    }
    s.push_str(") VALUES (");
    for i in 0..cols.len() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "${}", i + 1);
    }
    s.push(')');
    s
}

/// `INSERT INTO t (c1, c2) VALUES ($1, $2), ($3, $4), ...` for `rows` rows.
pub fn insert_rows(table: &str, cols: &[&str], rows: usize) -> String {
    let mut s = insert(table, cols);
    let mut n = cols.len();
    for _ in 1..rows {
        s.push_str(", (");
        for i in 0..cols.len() {
            if i > 0 {
                s.push_str(", ");
            }
            n += 1;
            let _ = write!(s, "${n}");
        }
        s.push(')');
    }
    s
}

/// `UPDATE t SET c1 = $1 ... WHERE <locator>`; SET params come first.
pub fn update(table: &str, set_cols: &[&str], loc: &Locator) -> String {
    let mut s = format!("UPDATE {table} SET ");
    for (i, c) in set_cols.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{} = ${}", quote_ident(c), i + 1);
    }
    where_clause(table, loc, set_cols.len() + 1, &mut s);
    s
}

/// `DELETE FROM t WHERE <locator>`.
pub fn delete(table: &str, loc: &Locator) -> String {
    let mut s = format!("DELETE FROM {table}");
    where_clause(table, loc, 1, &mut s);
    s
}

/// `TRUNCATE t1, t2 [RESTART IDENTITY] [CASCADE]`.
pub fn truncate(tables: &[String], cascade: bool, restart_identity: bool) -> String {
    let mut s = format!("TRUNCATE {}", tables.join(", "));
    if restart_identity {
        s.push_str(" RESTART IDENTITY");
    }
    if cascade {
        s.push_str(" CASCADE");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_always_quoted_and_escaped() {
        assert_eq!(quote_ident("t"), "\"t\"");
        assert_eq!(quote_ident("we\"ird; DROP"), "\"we\"\"ird; DROP\"");
        assert_eq!(qualified("s", "T"), "\"s\".\"T\"");
    }

    #[test]
    fn insert_update_delete_text() {
        let t = qualified("public", "acc");
        assert_eq!(
            insert(&t, &["id", "v"]),
            "INSERT INTO \"public\".\"acc\" (\"id\", \"v\") VALUES ($1, $2)"
        );
        assert_eq!(
            insert_rows(&t, &["id", "v"], 3),
            "INSERT INTO \"public\".\"acc\" (\"id\", \"v\") VALUES ($1, $2), ($3, $4), ($5, $6)"
        );
        let key = Locator::Key(vec!["id".into()]);
        assert_eq!(
            update(&t, &["id", "v"], &key),
            "UPDATE \"public\".\"acc\" SET \"id\" = $1, \"v\" = $2 WHERE \"id\" = $3"
        );
        assert_eq!(
            delete(&t, &key),
            "DELETE FROM \"public\".\"acc\" WHERE \"id\" = $1"
        );
        let full = Locator::AllColumns(vec!["a".into(), "b".into()]);
        assert_eq!(
            delete(&t, &full),
            "DELETE FROM \"public\".\"acc\" WHERE ctid = (SELECT ctid FROM \"public\".\"acc\" WHERE \"a\" IS NOT DISTINCT FROM $1 AND \"b\" IS NOT DISTINCT FROM $2 LIMIT 1 FOR UPDATE)"
        );
        assert_eq!(
            truncate(std::slice::from_ref(&t), true, true),
            "TRUNCATE \"public\".\"acc\" RESTART IDENTITY CASCADE"
        );
    }
}
