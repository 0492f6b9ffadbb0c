//! TLS client settings shared by the agent's outbound HTTPS connections (the platform
//! connection of [`crate::platform`] and the Vault client of [`crate::secrets_vault`]).
//!
//! Guarantees: rustls with the ring provider offering TLS 1.3 cipher suites only (so nothing
//! older can be negotiated), and the CA the configuration names as the only trust anchor —
//! the system trust store is never consulted.

use std::path::Path;
use std::sync::Arc;

use ureq::tls::{Certificate, ClientCert, PemItem, RootCerts, TlsConfig, TlsProvider};

/// The certificates in a PEM text (other items, and unparsable ones, are skipped).
pub fn pem_certificates(pem: &[u8]) -> Vec<Certificate<'static>> {
    ureq::tls::parse_pem(pem)
        .filter_map(|i| match i {
            Ok(PemItem::Certificate(c)) => Some(c),
            _ => None,
        })
        .collect()
}

/// Largest certificate file read (a CA bundle or a client chain; the whole Mozilla bundle is
/// ~220 KB).
pub const MAX_CERT_FILE: u64 = 4 << 20;

/// The CA certificates of the PEM file at `path` (a regular file of at most
/// [`MAX_CERT_FILE`] bytes); errors name the configuration `key`.
pub fn read_ca(path: &Path, key: &str) -> Result<Vec<Certificate<'static>>, String> {
    // Whoever could replace it could stand in for the server.
    crate::config::check_trust_file(key, path)?;
    let pem =
        crate::bounded::read_regular(path, MAX_CERT_FILE).map_err(|e| format!("{key}: {}: {e}", path.display()))?;
    let roots = pem_certificates(&pem);
    if roots.is_empty() {
        return Err(format!("{key}: {}: no certificate in it", path.display()));
    }
    Ok(roots)
}

/// The ring provider with its TLS 1.3 cipher suites only.
fn provider() -> rustls::crypto::CryptoProvider {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.retain(|s| matches!(s, rustls::SupportedCipherSuite::Tls13(_)));
    provider
}

/// Whether the first private key in `key_pem` is one the TLS provider can sign with and
/// belongs to the first certificate of `chain`, as the HTTPS client checks it (rustls'
/// `CertifiedKey::from_der`). Checked when the configuration is read: the client builds its
/// TLS context only at its first connection, and there a mismatch is a panic, not an error.
pub fn check_client_key(chain: &[Certificate<'static>], key_pem: &[u8]) -> Result<(), String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("no private key: {e}"))?;
    let chain = chain.iter().map(|c| CertificateDer::from(c.der().to_vec())).collect();
    rustls::sign::CertifiedKey::from_der(chain, key, &provider()).map(|_| ()).map_err(|e| match e {
        rustls::Error::InconsistentKeys(_) => "is not the key of the certificate's public key".to_string(),
        e => format!("unusable: {e}"),
    })
}

/// TLS 1.3 only, `roots` as the only trust anchors, with an optional client certificate.
pub fn client_config(roots: &[Certificate<'static>], client: Option<ClientCert>) -> TlsConfig {
    TlsConfig::builder()
        .provider(TlsProvider::Rustls)
        .unversioned_rustls_crypto_provider(Arc::new(provider()))
        .root_certs(RootCerts::new_with_certs(roots))
        .client_cert(client)
        .build()
}
