//! TLS on the client port: rustls with the ring provider, certificate and key
//! from PEM files, ALPN offering h2 and HTTP/1.1.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use crate::config::Tls;

/// Why the TLS material could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("listeners.tls.cert {path}: {reason}")]
    Cert { path: String, reason: String },
    #[error("listeners.tls.key {path}: {reason}")]
    Key { path: String, reason: String },
    #[error("listeners.tls: certificate and key do not form a usable server config: {0}")]
    Config(String),
}

pub fn acceptor(tls: &Tls) -> Result<TlsAcceptor, TlsError> {
    let certs = load_certs(&tls.cert)?;
    let key = PrivateKeyDer::from_pem_file(&tls.key).map_err(|e| TlsError::Key {
        path: tls.key.display().to_string(),
        reason: e.to_string(),
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let err = |reason: String| TlsError::Cert {
        path: path.display().to_string(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(e.to_string()))?;
    if certs.is_empty() {
        return Err(err("no certificate in the file".to_owned()));
    }
    Ok(certs)
}
