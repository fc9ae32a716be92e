//! agent/mm-agent.example.toml is the documented example configuration that
//! the release tarball ships: it must load with the real loader, both as
//! shipped and with every optional key uncommented.

use std::path::{Path, PathBuf};

use mm_cluster_config::{AgentConfig, SyncCommit};

fn example_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../agent/mm-agent.example.toml")
}

fn example_text() -> String {
    std::fs::read_to_string(example_path()).expect("agent/mm-agent.example.toml is readable")
}

#[test]
fn example_config_loads_as_shipped() {
    let c = AgentConfig::load_with_env(&example_path(), std::iter::empty())
        .expect("the example config loads");
    assert_eq!(c.node.name, "n1");
    assert_eq!(c.node.data_dir, PathBuf::from("/var/lib/mm-agent"));
    assert_eq!(
        c.postgres.dsn,
        "host=/run/postgresql port=5432 user=mm dbname=app"
    );
    assert_eq!(c.postgres.password_file, None);
    assert_eq!(c.api.listen, "10.0.0.1:7601".parse().expect("addr"));
    assert_eq!(c.api.advertise, "http://10.0.0.1:7601");
    assert_eq!(c.api.token_file, PathBuf::from("/etc/mm/token"));
    assert_eq!(c.api.tls_cert, None);
    assert_eq!(c.replication.schemas, vec!["public".to_owned()]);
    assert_eq!(c.replication.synchronous_commit, SyncCommit::Off);
    assert_eq!(c.replication.group_transactions, 1);
    assert_eq!(c.conflicts.resolver, "last_writer_wins");
    assert!(c.conflicts.tables.is_empty());
}

/// Uncomments every `#key = value` line (prose comments start with `# `),
/// so a typo in an optional key is caught as an unknown key.
#[test]
fn example_config_loads_with_every_optional_key() {
    let text = example_text();
    let mut uncommented = 0;
    let full: String = text
        .lines()
        .map(|line| match line.strip_prefix('#') {
            Some(rest) if !rest.starts_with(' ') && !rest.is_empty() && rest.contains(" = ") => {
                uncommented += 1;
                rest.to_owned()
            }
            _ => line.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("\n")
        // TLS, once uncommented, requires an https advertise URL.
        .replace("advertise = \"http://", "advertise = \"https://");
    assert_eq!(uncommented, 10, "optional keys in the example:\n{full}");
    let c = AgentConfig::from_toml_str(&full).expect("the example with every key loads");
    assert_eq!(c.postgres.password_file, Some("/etc/mm/pgpass".into()));
    assert_eq!(c.api.tls_cert, Some("/etc/mm/tls/cert.pem".into()));
    assert_eq!(c.api.tls_key, Some("/etc/mm/tls/key.pem".into()));
    assert_eq!(c.api.tls_ca, Some("/etc/mm/tls/ca.pem".into()));
    assert_eq!(c.replication.schemas, vec!["public".to_owned()]);
    assert_eq!(c.replication.synchronous_commit, SyncCommit::Off);
    assert_eq!(c.replication.apply_lanes, 1);
    assert_eq!(c.replication.group_transactions, 100);
    assert_eq!(c.conflicts.resolver, "last_writer_wins");
    assert_eq!(
        c.conflicts.resolver_for("public", "accounts"),
        "sql:app.resolve_accounts"
    );
}
