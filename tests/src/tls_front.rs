//! A TLS front for a plain TCP server: it terminates TLS (rustls) on a
//! loopback port of its own and relays each connection's bytes to the
//! server. The tests use it as a real Valkey's TLS port: the `valkey-server`
//! they run is built without TLS, and the front leaves every byte of the
//! protocol to the real server, so the client under test speaks TLS and then
//! the real Valkey protocol to the real server.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

/// The front's listener task; stops when dropped.
pub struct TlsFront {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl TlsFront {
    /// Serves TLS with `cert`/`key` on 127.0.0.1 and relays to `upstream`;
    /// with `client_ca`, only clients with a certificate from that CA get
    /// through the handshake (as `tls-auth-clients yes`).
    pub async fn start(
        upstream: SocketAddr,
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Self {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .expect("front certificate")
            .collect::<Result<_, _>>()
            .expect("front certificate PEM");
        let key = PrivateKeyDer::from_pem_file(key).expect("front key");
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("TLS versions");
        let config = match client_ca {
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in CertificateDer::pem_file_iter(ca).expect("client CA") {
                    roots.add(c.expect("client CA PEM")).expect("client CA");
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .expect("client verifier");
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        }
        .with_single_cert(chain, key)
        .expect("front server config");
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("front bind");
        let addr = listener.local_addr().expect("front addr");
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // A failed handshake (an untrusted client) just closes.
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let Ok(mut server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut server).await;
                });
            }
        });
        Self { addr, task }
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}
