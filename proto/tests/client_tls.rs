//! TLS with libpq's sslmode semantics, with certificates made by the openssl
//! CLI (skipped, with a message, without it).
//!
//! The embedded PostgreSQL 18 is built without TLS, so two setups:
//! - `through_tls_terminator`: a rustls terminator in front of PostgreSQL 18
//!   answers SSLRequest and forwards the decrypted bytes; it exercises every
//!   client-side mode, auth and streaming over TLS.
//! - `real_tls_server`: a PostgreSQL built with OpenSSL (the embedded one if
//!   it qualifies, else a system package), so the server itself confirms the
//!   session is encrypted and offers SCRAM-SHA-256-PLUS; skipped if none.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{Auth, Certs, PASSWORD, PgOptions, PgServer, ROLE, make_certs, ssl_capable_pg_bin};
use mm_proto::Lsn;
use mm_proto::client::{ClientError, ReplicationClient, ReplicationConfig, SnapshotAction};
use mm_proto::walsender::ServerMessage;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

fn config(port: u16, extra: &str) -> ReplicationConfig {
    ReplicationConfig::from_dsn(&format!("port={port} user={ROLE} dbname=postgres {extra}"))
        .unwrap()
        .with_password(PASSWORD)
}

fn assert_tls_error(err: ClientError, needle: &str) {
    match err {
        ClientError::Tls(msg) => assert!(msg.to_lowercase().contains(needle), "{msg}"),
        other => panic!("expected a TLS error containing {needle:?}, got {other:?}"),
    }
}

/// Listens on a free port; answers SSLRequest with 'S', terminates TLS with
/// the test server certificate and pipes the plaintext to PostgreSQL.
/// Counts completed handshakes so tests can tell TLS really happened.
async fn spawn_tls_terminator(pg_port: u16, certs: &Certs) -> (u16, Arc<AtomicUsize>) {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&certs.server_crt)
        .unwrap()
        .map(|c| c.unwrap())
        .collect();
    let key = PrivateKeyDer::from_pem_file(&certs.server_key).unwrap();
    let server_config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server_config));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let handshakes = Arc::new(AtomicUsize::new(0));
    let counter = handshakes.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut first = [0u8; 8];
                if sock.read_exact(&mut first).await.is_err() {
                    return;
                }
                let mut pg = TcpStream::connect(("127.0.0.1", pg_port)).await.unwrap();
                if first == SSL_REQUEST {
                    sock.write_all(b"S").await.unwrap();
                    // A failed handshake (client rejected our certificate) just ends this connection.
                    let Ok(mut tls) = acceptor.accept(sock).await else {
                        return;
                    };
                    counter.fetch_add(1, Ordering::SeqCst);
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut pg).await;
                } else {
                    pg.write_all(&first).await.unwrap();
                    let _ = tokio::io::copy_bidirectional(&mut sock, &mut pg).await;
                }
            });
        }
    });
    (port, handshakes)
}

/// The verification matrix; `port` serves the certificate for DNS name
/// `localhost` signed by `certs.ca`.
async fn check_verification_modes(port: u16, certs: &Certs) {
    let ca = certs.ca.display();
    // verify-full: chain and name (localhost) check out. hostaddr avoids ::1.
    let mut c = ReplicationClient::connect(&config(
        port,
        &format!("host=localhost hostaddr=127.0.0.1 sslmode=verify-full sslrootcert={ca}"),
    ))
    .await
    .unwrap();
    assert!(c.is_tls());
    c.identify_system().await.unwrap();

    // verify-full with a name the certificate does not carry: refused.
    let err = ReplicationClient::connect(&config(
        port,
        &format!("host=127.0.0.1 sslmode=verify-full sslrootcert={ca}"),
    ))
    .await
    .unwrap_err();
    assert_tls_error(err, "not valid for name");

    // verify-ca checks the chain only, so the same name is fine.
    let mut c = ReplicationClient::connect(&config(
        port,
        &format!("host=127.0.0.1 sslmode=verify-ca sslrootcert={ca}"),
    ))
    .await
    .unwrap();
    assert!(c.is_tls());
    c.identify_system().await.unwrap();

    // A CA that did not sign the server certificate: refused in every mode
    // that has a CA file (require + sslrootcert verifies the chain, like libpq).
    let other = certs.other_ca.display();
    for mode in ["verify-ca", "verify-full", "require"] {
        let err = ReplicationClient::connect(&config(
            port,
            &format!("host=localhost hostaddr=127.0.0.1 sslmode={mode} sslrootcert={other}"),
        ))
        .await
        .unwrap_err();
        assert_tls_error(err, "unknownissuer");
    }

    // SQL connections through tokio-postgres get the same rules.
    let (sql_config, tls) = config(
        port,
        &format!("host=localhost hostaddr=127.0.0.1 sslmode=verify-full sslrootcert={ca}"),
    )
    .to_sql_config()
    .unwrap();
    let (sql, conn) = sql_config.connect(tls).await.unwrap();
    tokio::spawn(conn);
    let one: i32 = sql.query_one("SELECT 1", &[]).await.unwrap().get(0);
    assert_eq!(one, 1);
    let (sql_config, tls) = config(
        port,
        &format!("host=localhost hostaddr=127.0.0.1 sslmode=verify-full sslrootcert={other}"),
    )
    .to_sql_config()
    .unwrap();
    let Err(err) = sql_config.connect(tls).await else {
        panic!("connected despite a certificate from another CA")
    };
    assert!(
        format!("{err:?}").to_lowercase().contains("unknownissuer"),
        "{err:?}"
    );

    // A CA file that does not exist: a TLS error naming it.
    let err = ReplicationClient::connect(&config(
        port,
        "host=127.0.0.1 sslmode=verify-ca sslrootcert=/nonexistent/ca.crt",
    ))
    .await
    .unwrap_err();
    assert_tls_error(err, "/nonexistent/ca.crt");
}

#[tokio::test]
async fn through_tls_terminator() {
    let Some(certs) = make_certs() else { return };
    let server = PgServer::start(Auth::Scram);
    let (port, handshakes) = spawn_tls_terminator(server.port, &certs).await;

    // require without a CA: encryption only, any certificate accepted.
    let mut c = ReplicationClient::connect(&config(port, "host=127.0.0.1 sslmode=require"))
        .await
        .unwrap();
    assert!(c.is_tls());
    assert_eq!(handshakes.load(Ordering::SeqCst), 1);
    c.identify_system().await.unwrap();

    // prefer (the default) upgrades when TLS is offered.
    let c = ReplicationClient::connect(&config(port, "host=127.0.0.1"))
        .await
        .unwrap();
    assert!(c.is_tls());
    assert_eq!(handshakes.load(Ordering::SeqCst), 2);

    // disable never sends SSLRequest.
    let c = ReplicationClient::connect(&config(port, "host=127.0.0.1 sslmode=disable"))
        .await
        .unwrap();
    assert!(!c.is_tls());
    assert_eq!(handshakes.load(Ordering::SeqCst), 2);

    check_verification_modes(port, &certs).await;

    // Streaming over TLS: a committed row arrives as Begin/Relation/Insert/Commit.
    server.psql("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION mm FOR TABLE t");
    let mut c = ReplicationClient::connect(&config(port, "host=127.0.0.1 sslmode=require"))
        .await
        .unwrap();
    c.create_logical_slot("tls_slot", "pgoutput", SnapshotAction::NoExport, true)
        .await
        .unwrap();
    let mut stream = c
        .start_logical_replication(
            "tls_slot",
            Lsn::INVALID,
            &[("proto_version", "4"), ("publication_names", "\"mm\"")],
        )
        .await
        .unwrap();
    assert!(stream.is_tls());
    // Large enough to span many TLS records and reads.
    server.psql("INSERT INTO t VALUES (1, repeat('x', 200000))");
    let mut tags = Vec::new();
    while tags.last() != Some(&b'C') {
        let msg = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let ServerMessage::XLogData { data, .. } = msg {
            if data[0] == b'I' {
                assert!(data.len() > 200_000, "{}", data.len());
            }
            tags.push(data[0]);
        }
    }
    assert_eq!(tags, b"BRIC");
}

#[tokio::test]
async fn real_tls_server() {
    let Some(certs) = make_certs() else { return };
    let Some(bin) = ssl_capable_pg_bin() else {
        return;
    };
    let server = PgServer::start_with(PgOptions {
        auth: Auth::Scram,
        tls_files: certs.server_files(),
        hostssl_only: true,
        bin: Some(bin),
        ..PgOptions::default()
    });

    // SCRAM over real TLS: the server also offers SCRAM-SHA-256-PLUS; we
    // pick plain SCRAM-SHA-256 and the server accepts it.
    let mut c = ReplicationClient::connect(&config(server.port, "host=127.0.0.1 sslmode=require"))
        .await
        .unwrap();
    assert!(c.is_tls());
    let pid = c.backend_pid().unwrap();
    assert_eq!(
        server.psql(&format!("SELECT ssl FROM pg_stat_ssl WHERE pid = {pid}")),
        "t"
    );
    c.identify_system().await.unwrap();

    // tokio-postgres through the converted config: encrypted too.
    let (sql_config, tls) = config(server.port, "host=127.0.0.1 sslmode=require")
        .to_sql_config()
        .unwrap();
    let (sql, conn) = sql_config.connect(tls).await.unwrap();
    tokio::spawn(conn);
    let ssl: bool = sql
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ssl);

    // disable: the server's hostssl-only rule turns us away (28000).
    let err = ReplicationClient::connect(&config(server.port, "host=127.0.0.1 sslmode=disable"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("28000"), "{err:?}");

    check_verification_modes(server.port, &certs).await;
}

#[tokio::test]
async fn sslmodes_against_a_plain_server() {
    let server = PgServer::start(Auth::Scram);
    // prefer falls back to plain text.
    let c = ReplicationClient::connect(&config(server.port, "host=127.0.0.1 sslmode=prefer"))
        .await
        .unwrap();
    assert!(!c.is_tls());
    // require refuses to continue unencrypted.
    let err = ReplicationClient::connect(&config(server.port, "host=127.0.0.1 sslmode=require"))
        .await
        .unwrap_err();
    assert_tls_error(err, "does not support tls");
}
