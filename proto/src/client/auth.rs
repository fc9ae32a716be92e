//! The authentication exchange after StartupMessage: trust, cleartext, md5
//! and SCRAM-SHA-256 (without channel binding).
//!
//! A wrong password is reported by the server as an ErrorResponse (SQLSTATE
//! 28P01) and surfaces unchanged as `ClientError::Server`; `ClientError::Auth`
//! is for exchanges we cannot carry out at all.

use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256};
use postgres_protocol::message::frontend;

use super::ClientError;
use super::codec::{self, Body, Frame};
use super::connection::Connection;

const SCRAM_SHA_256: &str = "SCRAM-SHA-256";

/// Runs the exchange until AuthenticationOk.
pub(crate) async fn authenticate(
    conn: &mut Connection,
    user: &str,
    password: Option<&str>,
) -> Result<(), ClientError> {
    loop {
        let frame = read_auth_frame(conn).await?;
        let mut b = Body::new("Authentication", &frame.body);
        match b.i32()? {
            0 => return Ok(()),
            3 => {
                let pw = need_password(password, "cleartext password")?;
                send_password(conn, pw.as_bytes()).await?;
            }
            5 => {
                let salt = b.bytes(4)?;
                let salt = [salt[0], salt[1], salt[2], salt[3]];
                let pw = need_password(password, "md5")?;
                let hash = md5_hash(user.as_bytes(), pw.as_bytes(), salt);
                send_password(conn, hash.as_bytes()).await?;
            }
            10 => {
                let mut mechanisms = Vec::new();
                loop {
                    let m = b.cstr()?;
                    if m.is_empty() {
                        break;
                    }
                    mechanisms.push(m);
                }
                if !mechanisms.iter().any(|m| m == SCRAM_SHA_256) {
                    return Err(ClientError::Auth(format!(
                        "server offers only SASL mechanisms {mechanisms:?}; SCRAM-SHA-256 is required"
                    )));
                }
                let pw = need_password(password, SCRAM_SHA_256)?;
                scram(conn, pw).await?;
            }
            2 => return Err(unsupported("Kerberos V5")),
            6 => return Err(unsupported("SCM credentials")),
            7 | 8 => return Err(unsupported("GSSAPI")),
            9 => return Err(unsupported("SSPI")),
            other => {
                return Err(ClientError::protocol(format!(
                    "unknown authentication request code {other}"
                )));
            }
        }
    }
}

/// SCRAM-SHA-256 after AuthenticationSASL. We announce no channel binding
/// ("n,,"): honest, since we do not compute tls-server-end-point, and servers
/// accept it whether or not they offer SCRAM-SHA-256-PLUS.
async fn scram(conn: &mut Connection, password: &str) -> Result<(), ClientError> {
    let mut scram = ScramSha256::new(password.as_bytes(), ChannelBinding::unsupported());
    frontend::sasl_initial_response(SCRAM_SHA_256, scram.message(), conn.wbuf())
        .map_err(|e| ClientError::Auth(format!("encoding SASLInitialResponse: {e}")))?;
    conn.flush().await?;

    let frame = read_auth_frame(conn).await?;
    let mut b = Body::new("AuthenticationSASLContinue", &frame.body);
    if b.i32()? != 11 {
        return Err(ClientError::protocol("expected AuthenticationSASLContinue"));
    }
    scram
        .update(b.rest())
        .map_err(|e| ClientError::Auth(format!("SCRAM server-first-message: {e}")))?;
    frontend::sasl_response(scram.message(), conn.wbuf())
        .map_err(|e| ClientError::Auth(format!("encoding SASLResponse: {e}")))?;
    conn.flush().await?;

    let frame = read_auth_frame(conn).await?;
    let mut b = Body::new("AuthenticationSASLFinal", &frame.body);
    if b.i32()? != 12 {
        return Err(ClientError::protocol("expected AuthenticationSASLFinal"));
    }
    // Verifies the server's signature: proves the server knows the
    // password's verifier, i.e. it is not an impostor accepting anything.
    scram
        .finish(b.rest())
        .map_err(|e| ClientError::Auth(format!("SCRAM server signature rejected: {e}")))
}

/// Reads the next Authentication message, turning ErrorResponse (e.g. 28P01)
/// into `ClientError::Server` and skipping notices.
async fn read_auth_frame(conn: &mut Connection) -> Result<Frame, ClientError> {
    loop {
        let frame = conn.read_frame().await?;
        match frame.tag {
            b'R' => return Ok(frame),
            b'E' => return Err(codec::server_error(&frame.body)),
            b'N' | b'v' => continue,
            tag => return Err(codec::unexpected(tag, "during authentication")),
        }
    }
}

async fn send_password(conn: &mut Connection, pw: &[u8]) -> Result<(), ClientError> {
    frontend::password_message(pw, conn.wbuf())
        .map_err(|_| ClientError::Auth("password contains a NUL byte".into()))?;
    conn.flush().await
}

fn need_password<'a>(password: Option<&'a str>, method: &str) -> Result<&'a str, ClientError> {
    password.ok_or_else(|| {
        ClientError::Auth(format!(
            "server requested {method} authentication but no password is configured"
        ))
    })
}

fn unsupported(method: &str) -> ClientError {
    ClientError::Auth(format!(
        "server requested {method} authentication, which is not supported"
    ))
}
