//! TLS for replication connections (rustls, ring provider), with libpq's
//! `sslmode` semantics:
//!
//! | sslmode | sslrootcert | what is checked |
//! | --- | --- | --- |
//! | prefer/allow/require | no | nothing: encryption only (libpq's `require`) |
//! | prefer/allow/require | yes | chain (libpq treats `require` + root cert as `verify-ca`) |
//! | verify-ca | yes | chain, not the host name |
//! | verify-full | yes | chain and host name |
//!
//! The provider is passed explicitly instead of relying on rustls' process
//! default, so nothing else in the process can change what we accept.

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::ClientError;
use super::config::{ReplicationConfig, SslMode, TlsVersion};

/// Builds the rustls client config for `config`'s sslmode and CA file.
pub(crate) fn client_config(
    config: &ReplicationConfig,
) -> Result<Arc<rustls::ClientConfig>, ClientError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let versions: &[&rustls::SupportedProtocolVersion] = match config.ssl_min_version {
        TlsVersion::Tls12 => rustls::DEFAULT_VERSIONS,
        TlsVersion::Tls13 => &[&rustls::version::TLS13],
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)
        .map_err(|e| ClientError::Tls(format!("building TLS config: {e}")))?;

    let verifier: Arc<dyn ServerCertVerifier> = match &config.ssl_root_cert {
        None => Arc::new(AcceptAnyCert(provider)),
        Some(path) => {
            let pem = std::fs::read(path).map_err(|e| {
                ClientError::Tls(format!("reading sslrootcert {}: {e}", path.display()))
            })?;
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| {
                    ClientError::Tls(format!("parsing sslrootcert {}: {e}", path.display()))
                })?;
                roots.add(cert).map_err(|e| {
                    ClientError::Tls(format!(
                        "sslrootcert {}: unusable CA certificate: {e}",
                        path.display()
                    ))
                })?;
            }
            if roots.is_empty() {
                return Err(ClientError::Tls(format!(
                    "sslrootcert {} holds no PEM certificate",
                    path.display()
                )));
            }
            let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| ClientError::Tls(format!("building certificate verifier: {e}")))?;
            if config.ssl_mode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(ChainOnly(webpki))
            }
        }
    };
    Ok(Arc::new(
        builder
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth(),
    ))
}

/// The name to verify the certificate against (and to send as SNI for DNS names).
pub(crate) fn server_name(host: &str) -> Result<ServerName<'static>, ClientError> {
    ServerName::try_from(host.to_owned())
        .map_err(|e| ClientError::Tls(format!("{host:?} is not a valid TLS server name: {e}")))
}

/// libpq's `require` without a CA: the session is encrypted but the peer is
/// not authenticated. Handshake signatures are still checked so the server
/// at least holds the key of the certificate it presents.
#[derive(Debug)]
struct AcceptAnyCert(Arc<CryptoProvider>);

impl ServerCertVerifier for AcceptAnyCert {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the full webpki check minus the host name. webpki checks the
/// chain before the name, so a name error implies the chain was accepted.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
