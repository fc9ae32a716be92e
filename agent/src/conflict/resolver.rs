//! Resolvers: the built-ins of SPEC §6 as implementations of one trait, a
//! registry for custom Rust resolvers, and the per-table choice.
//!
//! Every resolver must be a pure function of the `Conflict` it is given: all
//! nodes see the same facts and must reach the same decision.

use std::collections::HashMap;
use std::sync::Arc;

use mm_cluster_config::ResolverSpec;

use super::{Conflict, Resolution};

pub trait Resolver: Send + Sync {
    fn resolve(&self, c: &Conflict) -> Resolution;

    /// True only for a resolver that decides exactly as `LastWriterWins`:
    /// the fast path then settles `update_origin_differs` on hot keys
    /// inside its own statement, with that rule written in SQL
    /// (`apply::sql::fast_update_in_place`), without calling `resolve`.
    fn is_last_writer_wins(&self) -> bool {
        false
    }
}

/// The later (commit timestamp, node name) wins. Deletes take part through
/// their tombstones, so update-vs-delete converges in both orders.
pub struct LastWriterWins;

impl Resolver for LastWriterWins {
    fn resolve(&self, c: &Conflict) -> Resolution {
        if c.remote_is_later() {
            Resolution::ApplyRemote
        } else {
            Resolution::KeepLocal
        }
    }

    fn is_last_writer_wins(&self) -> bool {
        true
    }
}

/// The earlier (commit timestamp, node name) wins; with no local version the
/// incoming change is all there is.
pub struct FirstWriterWins;

impl Resolver for FirstWriterWins {
    fn resolve(&self, c: &Conflict) -> Resolution {
        if c.local_origin.is_none() || !c.remote_is_later() {
            Resolution::ApplyRemote
        } else {
            Resolution::KeepLocal
        }
    }
}

/// Always the incoming change. Does not converge under concurrent writes on
/// several nodes (each keeps the other's); meant for tables with one writer.
pub struct ApplyRemote;

impl Resolver for ApplyRemote {
    fn resolve(&self, _: &Conflict) -> Resolution {
        Resolution::ApplyRemote
    }
}

/// Always the existing local state. Like `ApplyRemote`, for deliberate use.
pub struct KeepLocal;

impl Resolver for KeepLocal {
    fn resolve(&self, _: &Conflict) -> Resolution {
        Resolution::KeepLocal
    }
}

/// Stops the stream: an operator decides (`mmctl skip` or fixing the data).
pub struct ErrorResolver;

impl Resolver for ErrorResolver {
    fn resolve(&self, c: &Conflict) -> Resolution {
        Resolution::Error(format!(
            "{} on {} and the table's resolver is 'error'",
            c.kind, c.relation
        ))
    }
}

/// Named Rust resolvers: the built-ins plus any a binary embedding the agent
/// registers (`rust:NAME` in the config).
#[derive(Clone)]
pub struct ResolverRegistry {
    custom: HashMap<String, Arc<dyn Resolver>>,
}

impl Default for ResolverRegistry {
    fn default() -> Self {
        Self::builtin()
    }
}

impl ResolverRegistry {
    pub fn builtin() -> Self {
        ResolverRegistry {
            custom: HashMap::new(),
        }
    }

    pub fn register(&mut self, name: &str, r: Arc<dyn Resolver>) {
        self.custom.insert(name.to_owned(), r);
    }

    /// The resolver a config spec names; an unknown `rust:` name is an error
    /// naming it, so the agent refuses to start rather than guess.
    pub fn choose(&self, spec: &ResolverSpec) -> Result<ResolverChoice, String> {
        Ok(match spec {
            ResolverSpec::LastWriterWins => ResolverChoice::Rust(Arc::new(LastWriterWins)),
            ResolverSpec::FirstWriterWins => ResolverChoice::Rust(Arc::new(FirstWriterWins)),
            ResolverSpec::ApplyRemote => ResolverChoice::Rust(Arc::new(ApplyRemote)),
            ResolverSpec::KeepLocal => ResolverChoice::Rust(Arc::new(KeepLocal)),
            ResolverSpec::Error => ResolverChoice::Rust(Arc::new(ErrorResolver)),
            ResolverSpec::Sql { schema, function } => ResolverChoice::Sql {
                function: format!(
                    "{}.{}",
                    crate::apply::sql::quote_ident(schema),
                    crate::apply::sql::quote_ident(function)
                ),
            },
            ResolverSpec::Custom(name) => match self.custom.get(name) {
                Some(r) => ResolverChoice::Rust(Arc::clone(r)),
                None => {
                    return Err(format!(
                        "resolver rust:{name} is not registered in this mm-agent binary"
                    ));
                }
            },
        })
    }
}

/// What decides a table's conflicts.
#[derive(Clone)]
pub enum ResolverChoice {
    Rust(Arc<dyn Resolver>),
    /// A user function `(conflict jsonb) returns jsonb`, called inside the
    /// applying transaction; already quoted.
    Sql {
        function: String,
    },
}

/// The default resolver and the per-table overrides (`schema.table` keys).
#[derive(Clone)]
pub struct TableResolvers {
    pub default: ResolverChoice,
    pub tables: HashMap<String, ResolverChoice>,
}

impl Default for TableResolvers {
    fn default() -> Self {
        TableResolvers {
            default: ResolverChoice::Rust(Arc::new(LastWriterWins)),
            tables: HashMap::new(),
        }
    }
}

impl TableResolvers {
    pub fn from_config(
        registry: &ResolverRegistry,
        default: &str,
        tables: &std::collections::BTreeMap<String, String>,
    ) -> Result<Self, String> {
        let parse = |s: &str| -> Result<ResolverChoice, String> {
            let spec: ResolverSpec = s.parse()?;
            registry.choose(&spec)
        };
        let mut out = TableResolvers {
            default: parse(default).map_err(|e| format!("conflicts.resolver: {e}"))?,
            tables: HashMap::new(),
        };
        for (t, r) in tables {
            out.tables.insert(
                t.clone(),
                parse(r).map_err(|e| format!("conflicts.tables.\"{t}\": {e}"))?,
            );
        }
        Ok(out)
    }

    pub fn for_table(&self, relation: &str) -> &ResolverChoice {
        self.tables.get(relation).unwrap_or(&self.default)
    }
}
