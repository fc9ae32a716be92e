//! Connecting and authenticating against a real PostgreSQL 18.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{Auth, PASSWORD, PgServer, ROLE};
use mm_proto::Lsn;
use mm_proto::client::{
    ClientError, ReplicationClient, ReplicationConfig, SQLSTATE_INVALID_PASSWORD,
};

/// Connects with `config`, runs IDENTIFY_SYSTEM and checks it against what
/// the server reports through SQL.
async fn connect_and_identify(server: &PgServer, config: &ReplicationConfig) -> ReplicationClient {
    let mut client = ReplicationClient::connect(config).await.unwrap();
    let id = client.identify_system().await.unwrap();
    let sysid = server.psql("SELECT system_identifier FROM pg_control_system()");
    assert_eq!(id.systemid, sysid);
    assert_eq!(id.timeline, 1);
    assert!(id.xlogpos > Lsn::INVALID);
    assert_eq!(id.dbname.as_deref(), Some("postgres"));
    assert_eq!(client.server_version_num().map(|v| v / 10_000), Some(18));

    // The server sees a walsender for our role, in the database we asked for.
    let pid = client.backend_pid().unwrap();
    let seen = server.psql(&format!(
        "SELECT usename || ',' || backend_type || ',' || datname FROM pg_stat_activity WHERE pid = {pid}"
    ));
    assert_eq!(seen, format!("{ROLE},walsender,postgres"));
    client
}

#[tokio::test]
async fn trust_needs_no_password() {
    let server = PgServer::start(Auth::Trust);
    let config = ReplicationConfig::from_dsn(&format!(
        "host=127.0.0.1 port={} user={ROLE} dbname=postgres sslmode=disable application_name=trusty",
        server.port
    ))
    .unwrap();
    let client = connect_and_identify(&server, &config).await;
    let pid = client.backend_pid().unwrap();
    assert_eq!(
        server.psql(&format!(
            "SELECT application_name FROM pg_stat_activity WHERE pid = {pid}"
        )),
        "trusty"
    );
    assert!(!client.is_tls());
    client.close().await;
}

#[tokio::test]
async fn md5_password() {
    let server = PgServer::start(Auth::Md5);
    assert_eq!(
        server.psql(&format!(
            "SELECT left(rolpassword, 3) FROM pg_authid WHERE rolname = '{ROLE}'"
        )),
        "md5"
    );
    connect_and_identify(&server, &server.replication_config()).await;
    assert_wrong_password_rejected(&server).await;
}

#[tokio::test]
async fn scram_password() {
    let server = PgServer::start(Auth::Scram);
    assert_eq!(
        server.psql(&format!(
            "SELECT left(rolpassword, 14) FROM pg_authid WHERE rolname = '{ROLE}'"
        )),
        "SCRAM-SHA-256$"
    );
    connect_and_identify(&server, &server.replication_config()).await;
    assert_wrong_password_rejected(&server).await;
}

#[tokio::test]
async fn cleartext_password() {
    let server = PgServer::start(Auth::Password);
    connect_and_identify(&server, &server.replication_config()).await;
    assert_wrong_password_rejected(&server).await;
}

async fn assert_wrong_password_rejected(server: &PgServer) {
    let wrong = server
        .replication_config()
        .with_password("not-the-password");
    let err = ReplicationClient::connect(&wrong).await.unwrap_err();
    assert_eq!(err.code(), Some(SQLSTATE_INVALID_PASSWORD), "{err:?}");
    match &err {
        ClientError::Server {
            severity, message, ..
        } => {
            assert_eq!(severity, "FATAL");
            assert_eq!(
                message,
                &format!("password authentication failed for user \"{ROLE}\"")
            );
        }
        other => panic!("expected a server error, got {other:?}"),
    }
    let shown = format!("{err} {err:?}");
    assert!(
        !shown.contains("not-the-password") && !shown.contains(PASSWORD),
        "{shown}"
    );

    // No password at all: we refuse before sending anything.
    let none = ReplicationConfig::from_dsn(&format!(
        "host=127.0.0.1 port={} user={ROLE} dbname=postgres sslmode=disable",
        server.port
    ))
    .unwrap();
    match ReplicationClient::connect(&none).await.unwrap_err() {
        ClientError::Auth(msg) => assert!(msg.contains("no password"), "{msg}"),
        other => panic!("expected an auth error, got {other:?}"),
    }
}

#[tokio::test]
async fn unix_socket() {
    let server = PgServer::start(Auth::Scram);
    let client = connect_and_identify(&server, &server.replication_config_unix()).await;
    // The server sees a local (socket) client: no client address.
    let pid = client.backend_pid().unwrap();
    assert_eq!(
        server.psql(&format!(
            "SELECT coalesce(host(client_addr), 'local') FROM pg_stat_activity WHERE pid = {pid}"
        )),
        "local"
    );

    // The same through a connection string, socket directory as host.
    let dsn = format!(
        "host={} port={} user={ROLE} dbname=postgres",
        server.socket_dir.display(),
        server.port
    );
    let config = ReplicationConfig::from_dsn(&dsn)
        .unwrap()
        .with_password(PASSWORD);
    connect_and_identify(&server, &config).await;

    // The converted SQL config: sslmode=require does not apply to sockets
    // (as in libpq), and startup parameters travel as options.
    let config = ReplicationConfig::from_dsn(&format!("{dsn} sslmode=require"))
        .unwrap()
        .with_password(PASSWORD)
        .with_portable_text_settings();
    let (sql_config, tls) = config.to_sql_config().unwrap();
    let (sql, conn) = sql_config.connect(tls).await.unwrap();
    tokio::spawn(conn);
    let row = sql
        .query_one(
            "SELECT current_user::text, current_setting('search_path'), current_setting('TimeZone'), inet_client_addr() IS NULL",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), ROLE);
    assert_eq!(row.get::<_, String>(1), "");
    assert_eq!(row.get::<_, String>(2), "UTC");
    assert!(row.get::<_, bool>(3), "not a socket connection");
}

#[tokio::test]
async fn url_dsn_and_startup_params() {
    let server = PgServer::start(Auth::Scram);
    let dsn = format!(
        "postgresql://{ROLE}@127.0.0.1:{}/postgres?sslmode=disable&application_name=url%20app",
        server.port
    );
    let config = ReplicationConfig::from_dsn(&dsn)
        .unwrap()
        .with_password(PASSWORD)
        .with_portable_text_settings()
        .with_param("datestyle", "ISO, DMY");
    let mut client = ReplicationClient::connect(&config).await.unwrap();
    assert_eq!(client.parameter("DateStyle"), Some("ISO, DMY"));
    assert_eq!(client.parameter("TimeZone"), Some("UTC"));
    assert_eq!(client.parameter("client_encoding"), Some("UTF8"));
    assert_eq!(client.parameter("application_name"), Some("url app"));
    let rows = client
        .simple_query("SELECT current_setting('search_path'), current_setting('extra_float_digits'), current_setting('IntervalStyle')")
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(
        rows[0].values(),
        &[
            Some(String::new()),
            Some("3".into()),
            Some("postgres".into())
        ]
    );
}

#[tokio::test]
async fn simple_query_errors_keep_the_connection_usable() {
    let server = PgServer::start(Auth::Trust);
    let mut client = ReplicationClient::connect(&server.replication_config())
        .await
        .unwrap();

    let err = client.simple_query("SELECT 1/0").await.unwrap_err();
    assert_eq!(err.code(), Some("22012"), "{err:?}");
    assert!(!err.is_fatal());

    // Several statements: rows of all of them, NULL as None.
    let rows = client
        .simple_query("SELECT 1 AS a, NULL::text AS b; SELECT 'x''y' AS c")
        .await
        .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].columns(), &["a".to_owned(), "b".to_owned()]);
    assert_eq!(rows[0].get_by_name("a"), Some("1"));
    assert_eq!(rows[0].try_get("b").unwrap(), None);
    assert_eq!(rows[1].get(0), Some("x'y"));

    // Empty query and a statement without rows.
    assert!(client.simple_query("").await.unwrap().is_empty());
    assert!(
        client
            .simple_query("SET work_mem = '8MB'")
            .await
            .unwrap()
            .is_empty()
    );
    let rows = client.simple_query("SHOW work_mem").await.unwrap();
    assert_eq!(rows[0].get(0), Some("8MB"));

    // A replication command after all that still works.
    client.identify_system().await.unwrap();
}

#[tokio::test]
async fn connection_failures_are_io_errors() {
    // Nothing listens on a just-freed port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = ReplicationConfig::from_dsn(&format!(
        "host=127.0.0.1 port={port} user=x sslmode=disable"
    ))
    .unwrap();
    match ReplicationClient::connect(&config).await.unwrap_err() {
        ClientError::Io { source, context } => {
            assert_eq!(source.kind(), std::io::ErrorKind::ConnectionRefused);
            assert!(context.contains(&port.to_string()), "{context}");
        }
        other => panic!("{other:?}"),
    }

    // A listener that never answers: connect_timeout bounds the attempt.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let config = ReplicationConfig::from_dsn(&format!(
        "host=127.0.0.1 port={port} user=x connect_timeout=2"
    ))
    .unwrap();
    let started = std::time::Instant::now();
    match ReplicationClient::connect(&config).await.unwrap_err() {
        ClientError::Io { source, .. } => assert_eq!(source.kind(), std::io::ErrorKind::TimedOut),
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(10));

    // Multiple hosts: the dead one is skipped.
    let server = PgServer::start(Auth::Trust);
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = ReplicationConfig::from_dsn(&format!(
        "host=127.0.0.1,127.0.0.1 port={dead},{} user={ROLE} dbname=postgres sslmode=disable",
        server.port
    ))
    .unwrap();
    connect_and_identify(&server, &config).await;
}
