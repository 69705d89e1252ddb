//! A self-signed test certificate for `localhost` and `127.0.0.1` (rcgen),
//! written as PEM files the sidecar's config can point at.

use std::path::PathBuf;

use rustls::pki_types::CertificateDer;

/// PEM files in a temporary directory that lives as long as this value.
pub struct TestCert {
    pub cert_path: PathBuf,
    pub key_path: PathBuf,
    /// The certificate, for a client's root store.
    pub der: CertificateDer<'static>,
    _dir: tempfile::TempDir,
}

impl TestCert {
    pub fn new() -> Self {
        let ck = rcgen::generate_simple_self_signed(vec![
            "localhost".to_owned(),
            "127.0.0.1".to_owned(),
        ])
        .expect("rcgen generates a certificate");
        let dir = tempfile::tempdir().expect("temp dir");
        let cert_path = dir.path().join("tls.crt");
        let key_path = dir.path().join("tls.key");
        std::fs::write(&cert_path, ck.cert.pem()).expect("write cert");
        std::fs::write(&key_path, ck.signing_key.serialize_pem()).expect("write key");
        Self {
            cert_path,
            key_path,
            der: ck.cert.der().clone(),
            _dir: dir,
        }
    }
}

impl Default for TestCert {
    fn default() -> Self {
        Self::new()
    }
}
