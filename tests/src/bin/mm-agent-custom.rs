//! mm-agent with one extra, custom Rust resolver: the way a user embeds the
//! daemon (`mm_agent::daemon::run_with`) to register resolvers of their own.
//! `e2e_conflicts::custom_rust_resolver_max_value` runs a cluster of these.
//!
//! `rust:max_value` keeps the version whose `v` column is larger (a number or
//! numeric text); ties, and anything it cannot compare, go to the incoming
//! change. A pure function of the conflict's facts, so every node agrees.

use std::process::ExitCode;
use std::sync::Arc;

use mm_agent::conflict::{Conflict, Resolution, Resolver, ResolverRegistry};
use serde_json::Value;

/// Keeps the row with the larger `v`.
struct MaxValue;

fn v_of(row: Option<&Value>) -> Option<f64> {
    match row?.get("v")? {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

impl Resolver for MaxValue {
    fn resolve(&self, c: &Conflict) -> Resolution {
        match (v_of(c.local.as_ref()), v_of(c.remote_new.as_ref())) {
            (Some(local), Some(remote)) if local > remote => Resolution::KeepLocal,
            _ => Resolution::ApplyRemote,
        }
    }
}

fn main() -> ExitCode {
    let mut registry = ResolverRegistry::builtin();
    registry.register("max_value", Arc::new(MaxValue));
    mm_agent::daemon::main(
        "mm-agent-custom",
        "mm-agent with the custom resolver rust:max_value",
        registry,
    )
}
