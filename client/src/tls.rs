//! TLS for every connection the client makes, when the connection string asks for it.
//!
//! `sslmode=require` negotiates TLS with rustls; anything else (`prefer`, the default, and
//! `disable`) connects in plain text, as the client always did. Unlike libpq's `require`, the
//! server's certificate is always verified, against the system's roots plus the CA file in
//! [`ClientOptions::ssl_root_cert`](crate::ClientOptions) (by default `PGSSLROOTCERT`, as libpq
//! reads it): an encrypted connection to a server nobody vouched for is not what a user who
//! asked for TLS wants.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use tokio_postgres::config::SslMode;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{Error, Result};

/// How connections are made.
#[derive(Clone)]
pub(crate) enum Tls {
    Off,
    On(MakeRustlsConnect),
}

impl Tls {
    /// TLS as `config` asks for it, trusting the system's roots and `root_cert` (PEM).
    pub fn for_config(config: &tokio_postgres::Config, root_cert: Option<&Path>) -> Result<Tls> {
        if config.get_ssl_mode() != SslMode::Require {
            return Ok(Tls::Off);
        }
        let mut roots = rustls::RootCertStore::empty();
        // Unreadable system certificates are skipped; a server they would have verified fails
        // its handshake with a clear error instead.
        let native = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(native.certs);
        if let Some(path) = root_cert {
            let pem =
                std::fs::read(path).map_err(|e| Error::Config(format!("ssl_root_cert {}: {e}", path.display())))?;
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.map_err(|e| Error::Config(format!("ssl_root_cert {}: {e}", path.display())))?;
                roots.add(cert).map_err(|e| Error::Config(format!("ssl_root_cert {}: {e}", path.display())))?;
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Config(format!("TLS: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Tls::On(MakeRustlsConnect::new(tls)))
    }
}
