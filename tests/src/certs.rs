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

/// A mesh CA and the certificates it signs (`mesh.tls`), as PEM files in a
/// temporary directory that lives as long as this value.
pub struct MeshPki {
    ca_path: PathBuf,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    dir: tempfile::TempDir,
}

impl MeshPki {
    pub fn new() -> Self {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "kvmesh test mesh CA");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).expect("CA certificate");
        let dir = tempfile::tempdir().expect("temp dir");
        let ca_path = dir.path().join("ca.pem");
        std::fs::write(&ca_path, cert.pem()).expect("write CA");
        Self {
            ca_path,
            issuer: rcgen::Issuer::new(params, key),
            dir,
        }
    }

    /// A certificate for `san` (server and client use) signed by this CA,
    /// written as `<stem>.pem` and `<stem>-key.pem`, with this CA as the
    /// trust anchor.
    pub fn files(&self, stem: &str, san: &str) -> kvmesh_proxy::config::mesh::MeshTlsFiles {
        use rcgen::{CertificateParams, ExtendedKeyUsagePurpose, KeyPair};
        let key = KeyPair::generate().expect("leaf key");
        let mut params = CertificateParams::new(vec![san.to_owned()]).expect("leaf params");
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("leaf certificate");
        let cert_path = self.dir.path().join(format!("{stem}.pem"));
        let key_path = self.dir.path().join(format!("{stem}-key.pem"));
        std::fs::write(&cert_path, cert.pem()).expect("write cert");
        std::fs::write(&key_path, key.serialize_pem()).expect("write key");
        kvmesh_proxy::config::mesh::MeshTlsFiles {
            ca: self.ca_path.clone(),
            cert: cert_path,
            key: key_path,
            server_name: san.to_owned(),
        }
    }
}

impl Default for MeshPki {
    fn default() -> Self {
        Self::new()
    }
}
