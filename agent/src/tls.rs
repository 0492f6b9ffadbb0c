//! TLS client settings shared by the agent's outbound HTTPS connections (the platform
//! connection of [`crate::platform`] and the Vault client of [`crate::secrets_vault`]).
//!
//! Guarantees: rustls with the ring provider offering TLS 1.3 cipher suites only (so nothing
//! older can be negotiated), and the CA the configuration names as the only trust anchor —
//! the system trust store is never consulted. Where a certificate revocation list file is
//! configured, every certificate of the server's chain below the CA must be named by one of
//! its CRLs as not revoked, and those CRLs must be current (their `nextUpdate` not passed):
//! a revoked certificate, a chain no CRL of the file covers, and a stale or unreadable file
//! all fail the connection. The file is read again when it changes (checked at each
//! connection and before a kept-alive connection is reused: one made under the old file is
//! closed, not reused, and none is used for longer than five minutes nor resumed — each
//! connection is a full handshake, so a list that went stale in place fails the next one).
//! Two lists of one issuer and scope in the file are refused (the checker would use only the
//! first).
//!
//! The HTTPS client (ureq) builds its TLS from its own settings, which take no revocation
//! list: [`ClientTls::connector`] is the TLS step of its connector chain instead.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};

use ureq::tls::{Certificate, PemItem};

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
/// belongs to the first certificate of `chain`, as rustls checks it
/// (`CertifiedKey::from_der`), in words an operator acts on.
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

/// Largest revocation list file read (a CA's CRL lists ~40 bytes per revoked certificate).
pub const MAX_CRL_FILE: u64 = 16 << 20;

/// A client's TLS trust: the CA roots, an optional client certificate, and an optional file
/// of certificate revocation lists (PEM `X509 CRL` blocks), read again when it changes.
pub struct ClientTls {
    roots: Arc<rustls::RootCertStore>,
    client: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    /// The configuration key and path of the revocation list file.
    crl: Option<(String, PathBuf)>,
    /// The rustls configuration in use, and the revocation list file it was built from.
    current: Mutex<(Option<FileStamp>, Arc<rustls::ClientConfig>)>,
}

/// What tells one version of a file from another: device, inode, size, and the change time
/// (any write or rename moves it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp(u64, u64, u64, i64, i64);

impl FileStamp {
    fn of(meta: &std::fs::Metadata) -> FileStamp {
        use std::os::unix::fs::MetadataExt;
        FileStamp(meta.dev(), meta.ino(), meta.size(), meta.ctime(), meta.ctime_nsec())
    }
}

impl ClientTls {
    /// The trust of `roots`, presenting `client` (certificate chain and private key, PEM)
    /// when given, checking revocation against the file `crl` names (configuration key,
    /// path) when given — read here, so that a bad file is a configuration error.
    /// Errors name the configuration key of the file at fault: `ca` (key, path) for the
    /// roots, `client_key` for the client certificate's key.
    pub fn new(
        (ca_key, ca_path, roots): (&str, &Path, &[Certificate<'static>]),
        client: Option<(&str, &[Certificate<'static>], &[u8])>,
        crl: Option<(&str, &Path)>,
    ) -> Result<ClientTls, String> {
        use rustls::pki_types::pem::PemObject;
        let mut store = rustls::RootCertStore::empty();
        for (n, c) in roots.iter().enumerate() {
            store.add(CertificateDer::from(c.der().to_vec())).map_err(|e| {
                format!("{ca_key}: {}: certificate {} is not one a CA can be: {e}", ca_path.display(), n + 1)
            })?;
        }
        let client = match client {
            Some((key, chain, key_pem)) => Some((
                chain.iter().map(|c| CertificateDer::from(c.der().to_vec())).collect(),
                PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("{key}: no private key: {e}"))?,
            )),
            None => None,
        };
        let crl = crl.map(|(key, path)| (key.to_string(), path.to_path_buf()));
        let roots = Arc::new(store);
        let (stamp, crls) = match &crl {
            Some((key, path)) => read_crls(key, path).map(|(s, c)| (Some(s), c))?,
            None => (None, Vec::new()),
        };
        let config = build(&roots, &client, crls, crl.as_ref().map(|(k, p)| (k.as_str(), p.as_path())))?;
        Ok(ClientTls { roots, client, crl, current: Mutex::new((stamp, config)) })
    }

    /// The rustls configuration for a new connection, rebuilt first when the revocation
    /// list file changed; an error when it cannot be read or used (the connection fails).
    fn config(&self) -> Result<(Option<FileStamp>, Arc<rustls::ClientConfig>), String> {
        // A poisoned lock: a panic while swapping the configuration; the pair is whole.
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let Some((key, path)) = &self.crl else { return Ok(current.clone()) };
        // The trust rule again (a directory on the way may have changed hands, which the
        // file's stamp does not show).
        crate::config::check_trust_file(key, path)?;
        let now = std::fs::metadata(path).map(|m| FileStamp::of(&m)).ok();
        if now.is_some() && now == current.0 {
            return Ok(current.clone());
        }
        let (stamp, crls) = read_crls(key, path)?;
        let config = build(&self.roots, &self.client, crls, Some((key, path)))?;
        tracing::info!(key = %key, path = %path.display(), "certificate revocation lists read again");
        *current = (Some(stamp), config);
        Ok(current.clone())
    }

    /// Whether a connection made under `stamp` may be used again: the revocation list file
    /// is the one it was checked against.
    fn still_current(&self, stamp: &Option<FileStamp>) -> bool {
        match &self.crl {
            None => true,
            Some((_, path)) => std::fs::metadata(path).is_ok_and(|m| Some(FileStamp::of(&m)) == *stamp),
        }
    }

    /// A handshake's failure, in words an operator acts on where it is the revocation
    /// check's (rustls names them by its error variants).
    fn explain(&self, e: std::io::Error) -> ureq::Error {
        use rustls::CertificateError::{
            ExpiredRevocationList, ExpiredRevocationListContext, Revoked, UnknownRevocationStatus,
        };
        let Some((key, path)) = &self.crl else { return e.into() };
        let why = match e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
            Some(rustls::Error::InvalidCertificate(why)) => why,
            Some(rustls::Error::InvalidCertRevocationList(why)) => {
                return ureq::Error::Io(std::io::Error::other(format!(
                    "invalid peer certificate: a revocation list of {key} ({}) that covers the server's chain cannot be used \
                     ({why:?}): is it signed with the current key of the CA that issued the certificate?",
                    path.display()
                )))
            }
            _ => return e.into(),
        };
        let text = match why {
            Revoked => "the server's certificate, or one of its chain, is revoked by a revocation list of",
            UnknownRevocationStatus => {
                "the server's certificate chain is not covered (a certificate's issuer has no revocation list) by"
            }
            ExpiredRevocationList | ExpiredRevocationListContext { .. } => {
                "the revocation list is expired (past its next update; replace it with a current one) in"
            }
            _ => return e.into(),
        };
        ureq::Error::Io(std::io::Error::other(format!("invalid peer certificate: {text} {key} ({})", path.display())))
    }

    /// The connector chain of an HTTPS client using this trust: TCP (through an HTTP
    /// `CONNECT` proxy when the client's configuration names one), then TLS.
    pub fn connector(self) -> impl ureq::unversioned::transport::Connector {
        use ureq::unversioned::transport::{ConnectProxyConnector, Connector, TcpConnector};
        ().chain(ConnectProxyConnector::default())
            .chain(TcpConnector::default())
            .chain(TlsConnector { tls: Arc::new(self) })
    }
}

/// The CRLs of the PEM file at `path` (configuration `key`), with the file's stamp.
fn read_crls(key: &str, path: &Path) -> Result<(FileStamp, Vec<CertificateRevocationListDer<'static>>), String> {
    use rustls::pki_types::pem::PemObject;
    let at = || format!("{key}: {}", path.display());
    // Whoever could replace it could take a revocation back.
    crate::config::check_trust_file(key, path)?;
    let file = crate::bounded::open_regular(path).map_err(|e| format!("{}: {e}", at()))?;
    let stamp = FileStamp::of(&file.metadata().map_err(|e| format!("{}: {e}", at()))?);
    let pem = crate::bounded::read_capped(file, MAX_CRL_FILE).map_err(|e| format!("{}: {e}", at()))?;
    let crls = CertificateRevocationListDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: not a PEM file of certificate revocation lists: {e}", at()))?;
    if crls.is_empty() {
        return Err(format!("{}: no certificate revocation list (-----BEGIN X509 CRL-----) in it", at()));
    }
    // The checker takes the first list of a certificate's issuer (and scope) and ignores the
    // rest: an older list left before a newer one (appended, not replaced) would hide every
    // revocation since.
    let mut scopes = Vec::new();
    for (n, der) in crls.iter().enumerate() {
        let list = webpki::BorrowedCertRevocationList::from_der(der)
            .map(webpki::CertRevocationList::from)
            .map_err(|e| format!("{}: revocation list {} cannot be read: {e:?}", at(), n + 1))?;
        let scope = (list.issuer().to_vec(), list.issuing_distribution_point().map(<[u8]>::to_vec));
        if let Some(first) = scopes.iter().position(|s| *s == scope) {
            return Err(format!(
                "{}: revocation lists {} and {} are of the same issuer and scope: only the first would be used; \
                 keep only the current one (replace the file, do not append to it)",
                at(),
                first + 1,
                n + 1
            ));
        }
        scopes.push(scope);
    }
    Ok((stamp, crls))
}

/// A revocation list's `nextUpdate` within this many seconds is said to be near.
pub const CRL_NEAR_SECONDS: i64 = 24 * 3600;

/// What an operator should hear of the revocation lists in `path` (configuration `key`) at
/// `now` (seconds since the epoch): a list past its `nextUpdate` (every connection is refused
/// until the file is replaced) or within [`CRL_NEAR_SECONDS`] of it. An unreadable file is
/// an error, as it is at connection time.
pub fn crl_warnings(key: &str, path: &Path, now: i64) -> Result<Vec<String>, String> {
    let (_, crls) = read_crls(key, path)?;
    let count = crls.len();
    let mut warnings = Vec::new();
    for (n, der) in crls.iter().enumerate() {
        let which = if count == 1 {
            "its revocation list".to_string()
        } else {
            format!("revocation list {} of {count}", n + 1)
        };
        let at = format!("{key}: {}: {which}", path.display());
        let Some(next) = crl_next_update(der) else {
            warnings.push(format!("{at}: its nextUpdate cannot be read"));
            continue;
        };
        let when = crate::rfc3339::format(next);
        if next <= now {
            warnings.push(format!(
                "{at} was due to be replaced at {when} (its nextUpdate): every connection is refused until the file holds a current list"
            ));
        } else if next - now <= CRL_NEAR_SECONDS {
            warnings.push(format!(
                "{at} is due to be replaced at {when} (its nextUpdate, in {} min): after that every connection is refused until the file holds a current list",
                (next - now) / 60
            ));
        }
    }
    Ok(warnings)
}

/// The `nextUpdate` of a DER certificate revocation list (RFC 5280 §5.1), in seconds since
/// the epoch; `None` when it has none or the encoding is not what RFC 5280 describes.
/// (rustls-webpki checks it but does not expose it.)
fn crl_next_update(der: &[u8]) -> Option<i64> {
    /// One DER element at the start of `input`: its tag, contents and what follows.
    fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
        let (&tag, rest) = input.split_first()?;
        let (&first, rest) = rest.split_first()?;
        let (len, rest) = if first < 0x80 {
            (usize::from(first), rest)
        } else {
            let n = usize::from(first & 0x7f);
            if n == 0 || n > 4 || rest.len() < n {
                return None;
            }
            (rest[..n].iter().fold(0usize, |acc, b| (acc << 8) | usize::from(*b)), &rest[n..])
        };
        (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
    }
    const SEQUENCE: u8 = 0x30;
    const INTEGER: u8 = 0x02;
    const UTC_TIME: u8 = 0x17;
    const GENERALIZED_TIME: u8 = 0x18;
    let (SEQUENCE, list, _) = element(der)? else { return None };
    let (SEQUENCE, tbs, _) = element(list)? else { return None };
    // version (optional), signature algorithm, issuer, thisUpdate, nextUpdate (optional).
    let (mut tag, _, mut rest) = element(tbs)?;
    if tag == INTEGER {
        (tag, _, rest) = element(rest)?;
    }
    let (SEQUENCE, (SEQUENCE, _, rest)) = (tag, element(rest)?) else { return None };
    let (this_tag, _, rest) = element(rest)?;
    if !matches!(this_tag, UTC_TIME | GENERALIZED_TIME) {
        return None;
    }
    let (tag, time, _) = element(rest)?;
    let text = std::str::from_utf8(time).ok()?;
    let (year, rest) = match tag {
        // YYMMDDHHMMSSZ: 50–99 are 1950–1999 (RFC 5280 §4.1.2.5.1).
        UTC_TIME => {
            let yy: i64 = text.get(..2)?.parse().ok()?;
            (if yy >= 50 { 1900 + yy } else { 2000 + yy }, text.get(2..)?)
        }
        GENERALIZED_TIME => (text.get(..4)?.parse().ok()?, text.get(4..)?),
        _ => return None,
    };
    let b = rest.as_bytes();
    if b.len() != 11 || b[10] != b'Z' || !b[..10].iter().all(u8::is_ascii_digit) {
        return None;
    }
    let num = |i: usize| i64::from(b[i] - b'0') * 10 + i64::from(b[i + 1] - b'0');
    let (month, day, hour, minute, second) = (num(0), num(2), num(4), num(6), num(8));
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    Some(crate::rfc3339::days_from_civil(year, month, day) * 86_400 + hour * 3600 + minute * 60 + second)
}

/// TLS 1.3 only, `roots` as the only trust anchors, revocation checked against `crls` (when
/// `crl` names their file) for the whole chain, unknown status and stale lists refused.
fn build(
    roots: &Arc<rustls::RootCertStore>,
    client: &Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
    crls: Vec<CertificateRevocationListDer<'static>>,
    crl: Option<(&str, &Path)>,
) -> Result<Arc<rustls::ClientConfig>, String> {
    let provider = Arc::new(provider());
    let mut verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(roots.clone(), provider.clone());
    if crl.is_some() {
        // Unknown status (a chain certificate no list covers) is refused: rustls' default.
        verifier = verifier.with_crls(crls).enforce_revocation_expiration();
    }
    let verifier = verifier.build().map_err(|e| match crl {
        Some((key, path)) => format!("{key}: {}: {e}", path.display()),
        None => format!("the CA certificates: {e}"),
    })?;
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| format!("TLS 1.3: {e}"))?
        .with_webpki_verifier(verifier);
    let mut config = match client {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain.clone(), key.clone_key())
            .map_err(|e| format!("the client certificate and key do not go together: {e}"))?,
        None => builder.with_no_client_auth(),
    };
    if crl.is_some() {
        // A resumed session skips the certificate check, and so the lists: every
        // connection is a full handshake. (A configuration is built anew for each version
        // of the file, with an empty session cache.)
        config.resumption = rustls::client::Resumption::disabled();
    }
    Ok(Arc::new(config))
}

/// The TLS step of [`ClientTls::connector`]'s chain.
struct TlsConnector {
    tls: Arc<ClientTls>,
}

impl std::fmt::Debug for TlsConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConnector").finish()
    }
}

impl<In: ureq::unversioned::transport::Transport> ureq::unversioned::transport::Connector<In> for TlsConnector {
    type Out = ureq::unversioned::transport::Either<In, TlsTransport>;

    fn connect(
        &self,
        details: &ureq::unversioned::transport::ConnectionDetails,
        chained: Option<In>,
    ) -> Result<Option<Self::Out>, ureq::Error> {
        use ureq::unversioned::transport::{Either, LazyBuffers, TransportAdapter};
        let Some(transport) = chained else { return Ok(None) };
        if !details.needs_tls() || transport.is_tls() {
            return Ok(Some(Either::A(transport)));
        }
        let (stamp, config) = self.tls.config().map_err(|e| ureq::Error::Io(std::io::Error::other(e)))?;
        let host = details.uri.host().ok_or(ureq::Error::Tls("no host to check the certificate against"))?;
        let name = rustls::pki_types::ServerName::try_from(host.trim_start_matches('[').trim_end_matches(']'))
            .map_err(|_| ureq::Error::Tls("not a host name or address to check the certificate against"))?
            .to_owned();
        let mut conn = rustls::ClientConnection::new(config, name).map_err(ureq::Error::Rustls)?;
        let mut sock = TransportAdapter::new(transport.boxed(), details.current_time.clone());
        // What is left of the connection's budget (the TCP connection and a proxy's CONNECT
        // took their part of it), as ureq's own TLS step measures it.
        sock.set_timeout(remaining(details.timeout, details.now, (details.current_time)()));
        conn.complete_io(&mut sock).map_err(|e| self.tls.explain(e))?;
        let buffers = LazyBuffers::new(details.config.input_buffer_size(), details.config.output_buffer_size());
        Ok(Some(Either::B(TlsTransport {
            buffers,
            stream: rustls::StreamOwned { conn, sock },
            stamp,
            made: std::time::Instant::now(),
            tls: self.tls.clone(),
        })))
    }
}

/// `timeout` less the time since `started`.
fn remaining(
    timeout: ureq::unversioned::transport::NextTimeout,
    started: ureq::unversioned::transport::time::Instant,
    now: ureq::unversioned::transport::time::Instant,
) -> ureq::unversioned::transport::NextTimeout {
    use ureq::unversioned::transport::time::{Duration, Instant};
    let mut left = timeout;
    if let (Duration::Exact(limit), Instant::Exact(started), Instant::Exact(now)) = (timeout.after, started, now) {
        left.after = Duration::Exact(limit.saturating_sub(now.saturating_duration_since(started)));
    }
    left
}

/// How long a connection checked against revocation lists is used: a list that passes its
/// next update while the file stays as it is fails the next connection, so a kept-alive
/// one must end too.
const CHECKED_CONNECTION_LIFETIME: std::time::Duration = std::time::Duration::from_secs(300);

/// A TLS connection made by [`TlsConnector`].
pub struct TlsTransport {
    buffers: ureq::unversioned::transport::LazyBuffers,
    stream: rustls::StreamOwned<rustls::ClientConnection, ureq::unversioned::transport::TransportAdapter>,
    /// The revocation list file the server's chain was checked against.
    stamp: Option<FileStamp>,
    made: std::time::Instant,
    tls: Arc<ClientTls>,
}

impl std::fmt::Debug for TlsTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsTransport").finish()
    }
}

impl ureq::unversioned::transport::Transport for TlsTransport {
    fn buffers(&mut self) -> &mut dyn ureq::unversioned::transport::Buffers {
        &mut self.buffers
    }

    fn transmit_output(
        &mut self,
        amount: usize,
        timeout: ureq::unversioned::transport::NextTimeout,
    ) -> Result<(), ureq::Error> {
        use std::io::Write;
        use ureq::unversioned::transport::Buffers;
        self.stream.get_mut().set_timeout(timeout);
        let output = &self.buffers.output()[..amount];
        self.stream.write_all(output)?;
        Ok(())
    }

    fn await_input(&mut self, timeout: ureq::unversioned::transport::NextTimeout) -> Result<bool, ureq::Error> {
        use std::io::Read;
        use ureq::unversioned::transport::Buffers;
        self.stream.get_mut().set_timeout(timeout);
        let input = self.buffers.input_append_buf();
        let amount = self.stream.read(input)?;
        self.buffers.input_appended(amount);
        Ok(amount > 0)
    }

    fn is_open(&mut self) -> bool {
        // Checked before a kept-alive connection is reused: not one checked against a
        // revocation list file that has changed since, nor one checked longer ago than
        // `CHECKED_CONNECTION_LIFETIME`.
        let checked_recently = self.stamp.is_none() || self.made.elapsed() < CHECKED_CONNECTION_LIFETIME;
        checked_recently && self.tls.still_current(&self.stamp) && self.stream.get_mut().get_mut().is_open()
    }

    fn is_tls(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A DER revocation list of a fresh CA with its `nextUpdate` at midnight of `y-m-d`.
    fn crl_until(y: i32, m: u8, d: u8) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.key_usages = vec![rcgen::KeyUsagePurpose::CrlSign, rcgen::KeyUsagePurpose::KeyCertSign];
        let issuer = rcgen::Issuer::new(ca, key);
        let params = rcgen::CertificateRevocationListParams {
            this_update: rcgen::date_time_ymd(2020, 1, 1),
            next_update: rcgen::date_time_ymd(y, m, d),
            crl_number: 1u64.into(),
            issuing_distribution_point: None,
            revoked_certs: Vec::new(),
            key_identifier_method: rcgen::KeyIdMethod::Sha256,
        };
        params.signed_by(&issuer).unwrap().der().to_vec()
    }

    #[test]
    fn a_revocation_lists_next_update_is_read_in_both_time_encodings() {
        let at = |y: i64, m: i64, d: i64| crate::rfc3339::days_from_civil(y, m, d) * 86_400;
        // UTCTime up to 2049, GeneralizedTime from 2050 (RFC 5280 §5.1.2.5).
        for (y, m, d) in [(2026, 12, 8), (2049, 12, 31), (2050, 1, 1), (2099, 6, 30)] {
            let der = crl_until(y, m, d);
            assert_eq!(crl_next_update(&der), Some(at(y.into(), m.into(), d.into())), "{y}-{m}-{d}");
            // Every shorter prefix is refused, never read past its end.
            for cut in 0..der.len() {
                let _ = crl_next_update(&der[..cut]);
            }
        }
        assert_eq!(crl_next_update(b""), None);
        assert_eq!(crl_next_update(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]), None);
        assert_eq!(crl_next_update(&[0x02, 0x01, 0x00]), None, "not a SEQUENCE");
    }

    #[test]
    fn the_handshake_gets_what_is_left_of_the_connections_budget() {
        use ureq::unversioned::transport::time::{Duration, Instant};
        use ureq::unversioned::transport::NextTimeout;
        let budget = NextTimeout { after: Duration::from_secs(10), ..NextTimeout::default() };
        let now = std::time::Instant::now();
        let started = Instant::Exact(now - std::time::Duration::from_secs(3));
        let left = remaining(budget, started, Instant::Exact(now));
        assert_eq!(left.after, Duration::from_secs(7));
        assert_eq!(left.reason, budget.reason);
        let spent = Instant::Exact(now - std::time::Duration::from_secs(30));
        assert_eq!(remaining(budget, spent, Instant::Exact(now)).after, Duration::from_secs(0));
        let endless = NextTimeout { after: Duration::NotHappening, ..NextTimeout::default() };
        assert_eq!(remaining(endless, started, Instant::Exact(now)).after, Duration::NotHappening);
    }
}
