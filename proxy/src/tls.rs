//! TLS with rustls and the ring provider, from PEM files:
//!
//! - the client port ([`acceptor`]): the configured certificate, ALPN h2 and
//!   HTTP/1.1, no client certificates;
//! - the mesh ([`MeshTls::load`]): mutual TLS between sidecars. Every sidecar
//!   presents its certificate both on its mesh port and when it subscribes to
//!   a peer, and accepts a peer whose certificate chains to the mesh CA. The
//!   peer's server certificate is checked against one fixed name
//!   (`mesh.tls.server_name`) rather than its pod IP, which changes with every
//!   restart and is rarely in a certificate's SANs.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::config::mesh::MeshTlsFiles;
use crate::config::Tls;

/// Why the TLS material could not be used; `field` is the config key at fault.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{field} {path}: {reason}")]
    File {
        field: &'static str,
        path: String,
        reason: String,
    },
    #[error("{field}: {reason}")]
    Config { field: &'static str, reason: String },
}

impl TlsError {
    /// The config key at fault (`listeners.tls.cert`, `mesh.tls.ca`, ...).
    pub fn field(&self) -> &'static str {
        match self {
            Self::File { field, .. } | Self::Config { field, .. } => field,
        }
    }
}

/// The client port's acceptor (`listeners.tls`).
pub fn acceptor(tls: &Tls) -> Result<TlsAcceptor, TlsError> {
    let certs = load_certs(&tls.cert, "listeners.tls.cert")?;
    let key = load_key(&tls.key, "listeners.tls.key")?;
    let unusable = |e: rustls::Error| TlsError::Config {
        field: "listeners.tls",
        reason: format!("certificate and key do not form a usable server config: {e}"),
    };
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(unusable)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(unusable)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Mutual TLS for the mesh's state streams (see the module docs).
#[derive(Clone)]
pub struct MeshTls {
    /// For the mesh port: requires a client certificate from the mesh CA.
    pub acceptor: TlsAcceptor,
    /// For subscribing: presents this sidecar's certificate.
    pub connector: TlsConnector,
    /// The name a peer's certificate is verified against.
    pub server_name: ServerName<'static>,
}

impl std::fmt::Debug for MeshTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MeshTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl MeshTls {
    pub fn load(files: &MeshTlsFiles) -> Result<Self, TlsError> {
        let mut roots = RootCertStore::empty();
        for ca in load_certs(&files.ca, "mesh.tls.ca")? {
            roots.add(ca).map_err(|e| TlsError::File {
                field: "mesh.tls.ca",
                path: files.ca.display().to_string(),
                reason: format!("not a usable CA certificate: {e}"),
            })?;
        }
        let roots = Arc::new(roots);
        let certs = load_certs(&files.cert, "mesh.tls.cert")?;
        let key = load_key(&files.key, "mesh.tls.key")?;
        let unusable = |e: rustls::Error| TlsError::Config {
            field: "mesh.tls",
            reason: format!("certificate, key and CA do not form a usable config: {e}"),
        };
        let server_name =
            ServerName::try_from(files.server_name.clone()).map_err(|e| TlsError::Config {
                field: "mesh.tls.server_name",
                reason: format!("{:?} is not a DNS name: {e}", files.server_name),
            })?;
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| TlsError::Config {
                field: "mesh.tls.ca",
                reason: format!("cannot verify peers with it: {e}"),
            })?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(unusable)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(unusable)?;
        server.alpn_protocols = vec![b"h2".to_vec()];
        let mut client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(unusable)?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
            .map_err(unusable)?;
        client.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            connector: TlsConnector::from(Arc::new(client)),
            server_name,
        })
    }

    /// The client side of the handshake with a peer's mesh port over `tcp`:
    /// this sidecar's certificate, the peer's checked against `server_name`.
    pub async fn connect(
        &self,
        tcp: tokio::net::TcpStream,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        self.connector.connect(self.server_name.clone(), tcp).await
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load_certs(path: &Path, field: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let err = |reason: String| TlsError::File {
        field,
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

fn load_key(path: &Path, field: &'static str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::File {
        field,
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}
