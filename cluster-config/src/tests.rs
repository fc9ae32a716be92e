//! One test (at least) per validation rule of SPEC §3, plus loading, env
//! overrides and secrets.

use super::*;

const BASE: &str = r#"
[node]
name = "n1"
data_dir = "/var/lib/mm-agent"

[postgres]
dsn = "host=/run/postgresql port=5432 user=mm dbname=app"
peer_dsn = "host=10.0.0.1 port=5432 user=mm dbname=app"

[api]
listen = "127.0.0.1:7601"
advertise = "http://127.0.0.1:7601"
token_file = "/etc/mm/token"
"#;

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// BASE with the line starting with `prefix` replaced by `line`.
fn with_line(prefix: &str, line: &str) -> String {
    let mut found = false;
    let out: Vec<String> = BASE
        .lines()
        .map(|l| {
            if l.starts_with(prefix) {
                found = true;
                line.to_owned()
            } else {
                l.to_owned()
            }
        })
        .collect();
    assert!(found, "no line starting with {prefix}");
    out.join("\n")
}

fn err_of(toml: &str) -> ConfigError {
    match AgentConfig::from_toml_str(toml) {
        Ok(c) => panic!("expected an error, got {c:?}"),
        Err(e) => e,
    }
}

/// Asserts an `Invalid` error for `key` naming `value`, and that the message
/// shows both.
fn assert_invalid(err: &ConfigError, key: &str, value: &str) {
    match err {
        ConfigError::Invalid {
            key: k, value: v, ..
        } => {
            assert_eq!(k, key, "{err}");
            assert_eq!(v, value, "{err}");
        }
        other => panic!("expected Invalid for {key}, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(key) && msg.contains(value), "{msg}");
}

#[test]
fn base_config_loads_with_defaults() {
    let c = AgentConfig::from_toml_str(BASE).unwrap();
    assert_eq!(c.node.name, "n1");
    assert_eq!(c.node.data_dir, PathBuf::from("/var/lib/mm-agent"));
    assert_eq!(c.postgres.password_file, None);
    assert_eq!(c.api.listen, "127.0.0.1:7601".parse().unwrap());
    assert_eq!(c.api.token_file, PathBuf::from("/etc/mm/token"));
    assert_eq!(c.replication.schemas, vec!["public".to_owned()]);
    assert_eq!(c.replication.synchronous_commit, SyncCommit::Off);
    assert_eq!(c.conflicts.resolver, "last_writer_wins");
    assert!(c.conflicts.tables.is_empty());
}

#[test]
fn full_config_loads() {
    let toml = format!(
        r#"{BASE}
password_file = "/etc/mm/pgpass"
tls_cert = "/etc/mm/cert.pem"
tls_key = "/etc/mm/key.pem"
tls_ca = "/etc/mm/ca.pem"

[replication]
schemas = ["public", "App_2"]
synchronous_commit = "remote_apply"

[conflicts]
resolver = "first_writer_wins"
[conflicts.tables]
"public.accounts" = "sql:app.resolve_accounts"
"App_2.t" = "keep_local"
"#
    );
    // password_file landed in [api] above; move it to [postgres].
    let toml = toml
        .replace("password_file = \"/etc/mm/pgpass\"\n", "")
        .replace(
            "[postgres]\n",
            "[postgres]\npassword_file = \"/etc/mm/pgpass\"\n",
        )
        .replace("http://127.0.0.1:7601", "https://n1.example:7601/");
    let c = AgentConfig::from_toml_str(&toml).unwrap();
    assert_eq!(c.postgres.password_file, Some("/etc/mm/pgpass".into()));
    assert_eq!(c.api.tls_cert, Some("/etc/mm/cert.pem".into()));
    assert_eq!(c.api.tls_key, Some("/etc/mm/key.pem".into()));
    assert_eq!(c.api.tls_ca, Some("/etc/mm/ca.pem".into()));
    assert_eq!(
        c.api.advertise, "https://n1.example:7601",
        "trailing / dropped"
    );
    assert_eq!(c.replication.schemas, vec!["public", "App_2"]);
    assert_eq!(c.replication.synchronous_commit, SyncCommit::RemoteApply);
    assert_eq!(c.conflicts.resolver, "first_writer_wins");
    assert_eq!(
        c.conflicts.resolver_for("public", "accounts"),
        "sql:app.resolve_accounts"
    );
    assert_eq!(c.conflicts.resolver_for("App_2", "t"), "keep_local");
    assert_eq!(
        c.conflicts.resolver_for("public", "other"),
        "first_writer_wins"
    );
}

#[test]
fn node_name_rules() {
    for good in ["a", "n-1_x", &"z".repeat(32)] {
        let c =
            AgentConfig::from_toml_str(&with_line("name", &format!("name = \"{good}\""))).unwrap();
        assert_eq!(c.node.name, good);
    }
    for bad in ["", "N1", "n.1", "n 1", "nó", &"z".repeat(33)] {
        let e = err_of(&with_line("name", &format!("name = \"{bad}\"")));
        assert_invalid(&e, "node.name", bad);
    }
}

#[test]
fn missing_required_keys_are_named() {
    for (prefix, key) in [
        ("name", "node.name"),
        ("data_dir", "node.data_dir"),
        ("dsn", "postgres.dsn"),
        ("peer_dsn", "postgres.peer_dsn"),
        ("token_file", "api.token_file"),
    ] {
        let e = err_of(&with_line(prefix, ""));
        assert!(
            matches!(&e, ConfigError::Missing { key: k } if k == key),
            "{e:?}"
        );
        assert!(e.to_string().contains(key), "{e}");
    }
    let e = err_of(&BASE.replace("[node]", "[nodes]"));
    // [nodes] is unknown and reported first or [node] is missing: both name it.
    assert!(e.to_string().contains("node"), "{e}");
}

#[test]
fn empty_paths_are_refused() {
    let e = err_of(&with_line("data_dir", "data_dir = \"\""));
    assert_invalid(&e, "node.data_dir", "");
    let e = err_of(&with_line("token_file", "token_file = \" \""));
    assert_invalid(&e, "api.token_file", " ");
}

#[test]
fn dsn_must_parse() {
    for (prefix, key) in [("dsn", "postgres.dsn"), ("peer_dsn", "postgres.peer_dsn")] {
        let e = err_of(&with_line(prefix, &format!("{prefix} = \"\"")));
        assert_invalid(&e, key, "");
        let e = err_of(&with_line(
            prefix,
            &format!("{prefix} = \"host=x bogus_option=1\""),
        ));
        assert_invalid(&e, key, "host=x bogus_option=1");
        let e = err_of(&with_line(
            prefix,
            &format!("{prefix} = \"host=x port=notaport\""),
        ));
        assert_invalid(&e, key, "host=x port=notaport");
    }
    // The URL form is accepted too.
    let c = AgentConfig::from_toml_str(&with_line(
        "peer_dsn",
        "peer_dsn = \"postgresql://mm@10.0.0.1:5432/app?sslmode=require\"",
    ))
    .unwrap();
    assert_eq!(
        c.postgres.peer_dsn,
        "postgresql://mm@10.0.0.1:5432/app?sslmode=require"
    );
}

#[test]
fn inline_passwords_are_refused_without_echoing_them() {
    let secret = "Sup3rS3cret";
    for (prefix, key) in [("dsn", "postgres.dsn"), ("peer_dsn", "postgres.peer_dsn")] {
        for dsn in [
            format!("host=x user=mm password={secret} dbname=app"),
            format!("host=x user=mm password='{secret}'"),
            format!("postgresql://mm:{secret}@10.0.0.1/app"),
            // Unparseable and with a password: still never echoed.
            format!("host=x password={secret} bogus_option=1"),
            format!("postgres://mm:{secret}@host:notaport/app"),
        ] {
            let e = err_of(&with_line(prefix, &format!("{prefix} = \"{dsn}\"")));
            assert!(
                matches!(&e, ConfigError::InlinePassword { key: k, .. } if k == key),
                "{dsn}: {e:?}"
            );
            let msg = e.to_string();
            assert!(msg.contains("password_file") && msg.contains(key), "{msg}");
            assert!(
                !msg.contains(secret) && !format!("{e:?}").contains(secret),
                "{msg}"
            );
        }
    }
}

#[test]
fn listen_must_be_a_socket_address() {
    for bad in ["localhost:7601", "127.0.0.1", "127.0.0.1:99999", ""] {
        let e = err_of(&with_line("listen", &format!("listen = \"{bad}\"")));
        assert_invalid(&e, "api.listen", bad);
    }
    let c = AgentConfig::from_toml_str(&with_line("listen", "listen = \"[::1]:7700\"")).unwrap();
    assert_eq!(c.api.listen, "[::1]:7700".parse().unwrap());
}

#[test]
fn listen_and_advertise_defaults() {
    let toml = with_line("listen", "").replace("advertise = \"http://127.0.0.1:7601\"", "");
    let c = AgentConfig::from_toml_str(&toml).unwrap();
    assert_eq!(c.api.listen, DEFAULT_LISTEN.parse().unwrap());
    assert_eq!(c.api.advertise, "http://127.0.0.1:7601");

    // A wildcard listen address says nothing about how peers reach us.
    let toml = with_line("listen", "listen = \"0.0.0.0:7601\"")
        .replace("advertise = \"http://127.0.0.1:7601\"", "");
    let e = err_of(&toml);
    assert!(
        matches!(&e, ConfigError::Missing { key } if key == "api.advertise"),
        "{e:?}"
    );
}

#[test]
fn advertise_must_be_an_http_url() {
    for bad in [
        "127.0.0.1:7601",
        "ftp://host:1",
        "http://",
        "http:///path",
        "http://host:port",
        "http://host:70000",
        "http://ho st:1",
        "http://user@host:1",
        "http://[::1",
    ] {
        let e = err_of(&with_line("advertise", &format!("advertise = \"{bad}\"")));
        assert_invalid(&e, "api.advertise", bad);
    }
    for good in [
        "http://n1",
        "https://n1.example.com:443/mm",
        "http://[::1]:7601",
    ] {
        let c =
            AgentConfig::from_toml_str(&with_line("advertise", &format!("advertise = \"{good}\"")))
                .unwrap();
        assert_eq!(c.api.advertise, good);
    }
}

#[test]
fn tls_cert_and_key_go_together_and_imply_https() {
    let e = err_of(&format!("{BASE}tls_cert = \"/c.pem\"\n"));
    assert!(
        matches!(&e, ConfigError::Missing { key } if key == "api.tls_key"),
        "{e:?}"
    );
    let e = err_of(&format!("{BASE}tls_key = \"/k.pem\"\n"));
    assert!(
        matches!(&e, ConfigError::Missing { key } if key == "api.tls_cert"),
        "{e:?}"
    );

    let both = format!("{BASE}tls_cert = \"/c.pem\"\ntls_key = \"/k.pem\"\n");
    let e = err_of(&both);
    assert_invalid(&e, "api.advertise", "http://127.0.0.1:7601");
    let c = AgentConfig::from_toml_str(&both.replace("http://", "https://")).unwrap();
    assert_eq!(c.api.tls_cert, Some("/c.pem".into()));
    // Derived advertise follows TLS.
    let c = AgentConfig::from_toml_str(&both.replace("advertise = \"http://127.0.0.1:7601\"", ""))
        .unwrap();
    assert_eq!(c.api.advertise, "https://127.0.0.1:7601");
}

#[test]
fn schemas_rules() {
    let e = err_of(&format!("{BASE}\n[replication]\nschemas = []\n"));
    assert_invalid(&e, "replication.schemas", "[]");
    for bad in [
        "mm",
        "1abc",
        "a-b",
        "",
        "pg_catalog",
        "information_schema",
        &"s".repeat(64),
    ] {
        let e = err_of(&format!(
            "{BASE}\n[replication]\nschemas = [\"public\", \"{bad}\"]\n"
        ));
        assert_invalid(&e, "replication.schemas", bad);
    }
    let e = err_of(&format!(
        "{BASE}\n[replication]\nschemas = [\"app\", \"app\"]\n"
    ));
    assert_invalid(&e, "replication.schemas", "app");
    let e = err_of(&format!("{BASE}\n[replication]\nschemas = \"public\"\n"));
    assert!(
        matches!(&e, ConfigError::WrongType { key, .. } if key == "replication.schemas"),
        "{e:?}"
    );
}

#[test]
fn group_transactions_values() {
    let c = AgentConfig::from_toml_str(BASE).unwrap();
    assert_eq!(c.replication.group_transactions, 1);
    let c = AgentConfig::from_toml_str(&format!(
        "{BASE}\n[replication]\ngroup_transactions = 100\n"
    ))
    .unwrap();
    assert_eq!(c.replication.group_transactions, 100);
    let c = AgentConfig::from_toml_str_with_env(
        BASE,
        env(&[("MM_REPLICATION__GROUP_TRANSACTIONS", "1000")]),
    )
    .unwrap();
    assert_eq!(c.replication.group_transactions, 1000);
    for bad in ["0", "1001", "-5", "\"many\""] {
        let e = err_of(&format!(
            "{BASE}\n[replication]\ngroup_transactions = {bad}\n"
        ));
        assert_invalid(&e, "replication.group_transactions", bad.trim_matches('"'));
    }
}

#[test]
fn apply_lanes_values() {
    assert_eq!(
        AgentConfig::from_toml_str(BASE)
            .unwrap()
            .replication
            .apply_lanes,
        1
    );
    let c =
        AgentConfig::from_toml_str(&format!("{BASE}\n[replication]\napply_lanes = 4\n")).unwrap();
    assert_eq!(c.replication.apply_lanes, 4);
    let c = AgentConfig::from_toml_str_with_env(BASE, env(&[("MM_REPLICATION__APPLY_LANES", "8")]))
        .unwrap();
    assert_eq!(c.replication.apply_lanes, 8);
    for bad in ["0", "65", "-1", "\"four\""] {
        let e = err_of(&format!("{BASE}\n[replication]\napply_lanes = {bad}\n"));
        assert_invalid(&e, "replication.apply_lanes", bad.trim_matches('"'));
    }
    let e = AgentConfig::from_toml_str_with_env(BASE, env(&[("MM_REPLICATION__APPLY_LANES", "x")]))
        .unwrap_err();
    assert_invalid(&e, "replication.apply_lanes", "x");
}

#[test]
fn synchronous_commit_values() {
    for (s, v) in [
        ("off", SyncCommit::Off),
        ("local", SyncCommit::Local),
        ("on", SyncCommit::On),
        ("remote_write", SyncCommit::RemoteWrite),
        ("remote_apply", SyncCommit::RemoteApply),
    ] {
        let c = AgentConfig::from_toml_str(&format!(
            "{BASE}\n[replication]\nsynchronous_commit = \"{s}\"\n"
        ))
        .unwrap();
        assert_eq!(c.replication.synchronous_commit, v);
        assert_eq!(v.as_str(), s);
        assert_eq!(v.to_string(), s);
    }
    let e = err_of(&format!(
        "{BASE}\n[replication]\nsynchronous_commit = \"yes\"\n"
    ));
    assert_invalid(&e, "replication.synchronous_commit", "yes");
}

#[test]
fn resolver_rules() {
    for good in [
        "last_writer_wins",
        "first_writer_wins",
        "apply_remote",
        "keep_local",
        "error",
        "sql:app.resolve_accounts",
    ] {
        let c =
            AgentConfig::from_toml_str(&format!("{BASE}\n[conflicts]\nresolver = \"{good}\"\n"))
                .unwrap();
        assert_eq!(c.conflicts.resolver, good);
        let spec: ResolverSpec = good.parse().unwrap();
        assert_eq!(spec.to_string(), good, "Display round-trips");
    }
    assert_eq!(
        "sql:app.f".parse::<ResolverSpec>().unwrap(),
        ResolverSpec::Sql {
            schema: "app".into(),
            function: "f".into()
        }
    );
    for bad in [
        "lww",
        "LAST_WRITER_WINS",
        "sql:",
        "sql:nodot",
        "sql:a.b c",
        "sql:a.b.c",
        "sql:.f",
    ] {
        let e = err_of(&format!("{BASE}\n[conflicts]\nresolver = \"{bad}\"\n"));
        assert_invalid(&e, "conflicts.resolver", bad);
    }
}

#[test]
fn conflict_table_keys_are_schema_dot_table() {
    let e = err_of(&format!(
        "{BASE}\n[conflicts.tables]\naccounts = \"keep_local\"\n"
    ));
    assert_invalid(&e, "conflicts.tables.\"accounts\"", "accounts");
    let e = err_of(&format!(
        "{BASE}\n[conflicts.tables]\n\"public.a-b\" = \"keep_local\"\n"
    ));
    assert_invalid(&e, "conflicts.tables.\"public.a-b\"", "public.a-b");
    let e = err_of(&format!(
        "{BASE}\n[conflicts.tables]\n\"other.t\" = \"keep_local\"\n"
    ));
    assert_invalid(&e, "conflicts.tables.\"other.t\"", "other.t");
    let e = err_of(&format!(
        "{BASE}\n[conflicts.tables]\n\"public.t\" = \"nope\"\n"
    ));
    assert_invalid(&e, "conflicts.tables.\"public.t\"", "nope");
}

#[test]
fn unknown_keys_are_errors_naming_the_key() {
    let cases = [
        (format!("typo = 1\n{BASE}"), "typo"),
        (format!("{BASE}\n[nodes]\nname = \"x\"\n"), "nodes"),
        (
            BASE.replace("[node]\n", "[node]\nnmae = \"x\"\n"),
            "node.nmae",
        ),
        (
            BASE.replace("[postgres]\n", "[postgres]\npassword = \"x\"\n"),
            "postgres.password",
        ),
        (format!("{BASE}tls_crt = \"/c\"\n"), "api.tls_crt"),
        (
            format!("{BASE}\n[replication]\nschema = [\"a\"]\n"),
            "replication.schema",
        ),
        (
            format!("{BASE}\n[conflicts]\nresolvers = \"error\"\n"),
            "conflicts.resolvers",
        ),
    ];
    for (toml, key) in cases {
        let e = err_of(&toml);
        assert!(
            matches!(&e, ConfigError::UnknownKey { key: k, origin: Origin::File } if k == key),
            "{key}: {e:?}"
        );
        assert!(e.to_string().contains(&format!("`{key}`")), "{e}");
    }
}

#[test]
fn wrong_types_name_the_key() {
    let e = err_of(&with_line("name", "name = [1]"));
    assert!(
        matches!(&e, ConfigError::WrongType { key, .. } if key == "node.name"),
        "{e:?}"
    );
    assert!(e.to_string().contains("node.name"), "{e}");
}

#[test]
fn env_overrides_win_over_the_file() {
    let c = AgentConfig::from_toml_str_with_env(
        BASE,
        env(&[
            ("MM_POSTGRES__DSN", "host=/tmp port=6000 user=mm dbname=app"),
            ("MM_API__LISTEN", "127.0.0.1:7777"),
            ("MM_NODE__NAME", "n9"),
            ("MM_REPLICATION__SCHEMAS", "public, app,"),
            ("MM_REPLICATION__SYNCHRONOUS_COMMIT", "on"),
            ("MM_CONFLICTS__RESOLVER", "keep_local"),
            ("MM_POSTGRES__PASSWORD_FILE", "/run/secrets/pg"),
            // Not overrides (no `__`): other tools' variables must not matter.
            ("MM_PG_BIN", "/opt/pg/bin"),
            ("MM_KEEP_TEST_DIRS", "1"),
            ("PATH", "/usr/bin"),
        ]),
    )
    .unwrap();
    assert_eq!(c.postgres.dsn, "host=/tmp port=6000 user=mm dbname=app");
    assert_eq!(c.api.listen, "127.0.0.1:7777".parse().unwrap());
    assert_eq!(c.node.name, "n9");
    assert_eq!(c.replication.schemas, vec!["public", "app"]);
    assert_eq!(c.replication.synchronous_commit, SyncCommit::On);
    assert_eq!(c.conflicts.resolver, "keep_local");
    assert_eq!(c.postgres.password_file, Some("/run/secrets/pg".into()));
    // Untouched keys keep the file's values.
    assert_eq!(
        c.postgres.peer_dsn,
        "host=10.0.0.1 port=5432 user=mm dbname=app"
    );
}

#[test]
fn env_can_supply_required_keys() {
    let toml = with_line("token_file", "");
    let c =
        AgentConfig::from_toml_str_with_env(&toml, env(&[("MM_API__TOKEN_FILE", "/t")])).unwrap();
    assert_eq!(c.api.token_file, PathBuf::from("/t"));
}

#[test]
fn env_errors_name_the_variable() {
    let e = AgentConfig::from_toml_str_with_env(BASE, env(&[("MM_NODE__NAEM", "x")])).unwrap_err();
    assert!(
        matches!(&e, ConfigError::UnknownKey { key, origin: Origin::Env(v) } if key == "node.naem" && v == "MM_NODE__NAEM"),
        "{e:?}"
    );
    assert!(e.to_string().contains("MM_NODE__NAEM"), "{e}");

    let e =
        AgentConfig::from_toml_str_with_env(BASE, env(&[("MM_NODE__NAME", "Bad!")])).unwrap_err();
    assert_invalid(&e, "node.name", "Bad!");
    assert!(e.to_string().contains("MM_NODE__NAME"), "{e}");

    let e = AgentConfig::from_toml_str_with_env(BASE, env(&[("MM_REPLICATION__SCHEMAS", " ")]))
        .unwrap_err();
    assert_invalid(&e, "replication.schemas", "[]");

    for var in ["MM_A__B__C", "MM___X", "MM_NODE__", "MM_NO.DE__NAME"] {
        let e = AgentConfig::from_toml_str_with_env(BASE, env(&[(var, "x")])).unwrap_err();
        assert!(
            matches!(&e, ConfigError::Env { var: v, .. } if v == var),
            "{var}: {e:?}"
        );
    }

    let secret = "hunter2hunter2";
    let e = AgentConfig::from_toml_str_with_env(
        BASE,
        env(&[(
            "MM_POSTGRES__PEER_DSN",
            &format!("host=x password={secret}"),
        )]),
    )
    .unwrap_err();
    assert!(matches!(e, ConfigError::InlinePassword { .. }), "{e:?}");
    assert!(e.to_string().contains("MM_POSTGRES__PEER_DSN"), "{e}");
    assert!(!e.to_string().contains(secret), "{e}");
}

#[test]
fn load_reads_a_file_and_env() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.toml");
    std::fs::write(&path, BASE).unwrap();
    let c = AgentConfig::load_with_env(&path, env(&[("MM_NODE__NAME", "from-env")])).unwrap();
    assert_eq!(c.node.name, "from-env");
    assert_eq!(c.api.token_file, PathBuf::from("/etc/mm/token"));

    // load() uses the process environment; nothing in it may break a valid file
    // (the test runner sets no MM_<SECTION>__<KEY> variables).
    assert_eq!(AgentConfig::load(&path).unwrap().node.name, "n1");

    let missing = dir.path().join("nope.toml");
    let e = AgentConfig::load_with_env(&missing, env(&[])).unwrap_err();
    assert!(matches!(e, ConfigError::Load { .. }), "{e:?}");
    assert!(e.to_string().contains("nope.toml"), "{e}");

    std::fs::write(&path, "[node\nname=").unwrap();
    let e = AgentConfig::load_with_env(&path, env(&[])).unwrap_err();
    assert!(matches!(e, ConfigError::Load { .. }), "{e:?}");
}

#[test]
fn secrets_are_trimmed_and_never_shown() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    let pgpass = dir.path().join("pgpass");
    std::fs::write(&token, "  tok-123\n").unwrap();
    std::fs::write(&pgpass, "pw\n").unwrap();
    assert_eq!(read_secret(&token).unwrap(), "tok-123");

    let toml = BASE
        .replace("/etc/mm/token", &token.display().to_string())
        .replace(
            "[postgres]\n",
            &format!("[postgres]\npassword_file = \"{}\"\n", pgpass.display()),
        );
    let c = AgentConfig::from_toml_str(&toml).unwrap();
    assert_eq!(c.token().unwrap(), "tok-123");
    assert_eq!(c.password().unwrap().as_deref(), Some("pw"));
    let no_pw =
        AgentConfig::from_toml_str(&BASE.replace("/etc/mm/token", &token.display().to_string()))
            .unwrap();
    assert_eq!(no_pw.password().unwrap(), None);
    // The config itself never holds the secret.
    assert!(!format!("{c:?}").contains("tok-123"));

    let missing = dir.path().join("missing-token");
    let e = read_secret(&missing).unwrap_err();
    assert!(e.to_string().contains("missing-token"), "{e}");

    let empty = dir.path().join("empty");
    std::fs::write(&empty, " \n\t").unwrap();
    let e = read_secret(&empty).unwrap_err();
    assert!(e.to_string().contains("empty"), "{e}");

    let binary = dir.path().join("binary");
    std::fs::write(&binary, b"s3cr\xffet").unwrap();
    let e = read_secret(&binary).unwrap_err();
    assert!(
        e.to_string().contains("binary") && !e.to_string().contains("s3cr"),
        "{e}"
    );
}

#[test]
fn sync_commit_parse_round_trips() {
    for v in [
        SyncCommit::Off,
        SyncCommit::Local,
        SyncCommit::On,
        SyncCommit::RemoteWrite,
        SyncCommit::RemoteApply,
    ] {
        assert_eq!(v.as_str().parse::<SyncCommit>().unwrap(), v);
    }
    assert!("ON".parse::<SyncCommit>().is_err());
}
