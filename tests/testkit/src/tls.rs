//! A certificate authority made at run time, and certificates it signs, as PEM files.
//!
//! Tests that run TLS and mutual TLS get fresh keys every run: nothing secret is committed,
//! nothing expires in the repository.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};
use tempfile::TempDir;

/// A certificate and its key, on disk.
#[derive(Debug, Clone)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A CA that signs server and client certificates into a temporary folder.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: TempDir,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").field("dir", &self.dir.path()).finish_non_exhaustive()
    }
}

impl TestCa {
    /// A new CA; its certificate is written to `ca.pem`.
    pub fn new() -> Self {
        let dir = tempfile::Builder::new().prefix("shotfleet-pki-").tempdir().expect("temp dir");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, "shotfleet test CA");
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("CA key")).expect("CA certificate");
        std::fs::write(dir.path().join("ca.pem"), issuer.pem()).expect("write ca.pem");
        Self { issuer, dir }
    }

    /// The CA certificate (PEM), what clients and servers trust.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The folder holding every file this CA wrote.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A certificate for a server reachable as `127.0.0.1` and `localhost` (and usable as a
    /// client certificate too, as a cluster route needs).
    pub fn server(&self, name: &str) -> CertFiles {
        self.sign(name, &["127.0.0.1", "localhost"], &[ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth])
    }

    /// A client certificate with common name `name`.
    pub fn client(&self, name: &str) -> CertFiles {
        self.sign(name, &[], &[ExtendedKeyUsagePurpose::ClientAuth])
    }

    fn sign(&self, name: &str, hosts: &[&str], usages: &[ExtendedKeyUsagePurpose]) -> CertFiles {
        let hosts: Vec<String> = hosts.iter().map(|h| (*h).to_owned()).collect();
        let mut params = CertificateParams::new(hosts).expect("certificate params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages = usages.to_vec();
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        let files = CertFiles { cert: self.dir.path().join(format!("{name}.pem")), key: self.dir.path().join(format!("{name}-key.pem")) };
        std::fs::write(&files.cert, cert.pem()).expect("write certificate");
        std::fs::write(&files.key, key.serialize_pem()).expect("write key");
        files
    }
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}
