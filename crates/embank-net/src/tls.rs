//! TLS for `embank serve` and the client, with rustls (the `ring` provider).
//!
//! The server presents a certificate chain and key from PEM files and, with a
//! client CA file, requires a client certificate signed by it (mutual TLS). The
//! client verifies the server against a CA file, optionally presenting its own
//! certificate. Handshakes are done explicitly when a connection opens, so a
//! wrong CA, a missing client certificate or a plaintext peer is a clear error
//! there, not a confusing one on the first request. Session tickets are off: a
//! pooled client connection is checked for stray bytes before reuse.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use embank_core::{Error, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection, StreamOwned};

/// Files of a server's TLS set-up (`[tls]` in the config).
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerTlsFiles {
    /// The server's certificate chain, PEM (leaf first).
    pub cert_file: PathBuf,
    /// The server's private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// With it, clients must present a certificate signed by one of these CAs (mTLS).
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
}

/// Files of a client's TLS set-up.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClientTlsFiles {
    /// CA certificates (PEM) the server's certificate must chain to.
    pub ca_file: PathBuf,
    /// The client's certificate and key, for servers that require one (mTLS).
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// Name to check the server's certificate against; default: the host of each address.
    pub server_name: Option<String>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::config(format!("TLS: {what}: {e}"))
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect())
        .map_err(|e| tls_error(&format!("cannot read certificates from {}", path.display()), e))?;
    if certs.is_empty() {
        return Err(tls_error(&format!("no certificate in {}", path.display()), "expected PEM CERTIFICATE blocks"));
    }
    Ok(certs)
}

fn key(path: &Path) -> Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| tls_error(&format!("cannot read a private key from {}", path.display()), e))
}

fn roots(path: &Path) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for c in certs(path)? {
        roots.add(c).map_err(|e| tls_error(&format!("bad CA certificate in {}", path.display()), e))?;
    }
    Ok(roots)
}

/// A server's TLS configuration, loaded once.
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<ServerConfig>,
    pub mutual: bool,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").field("mutual", &self.mutual).finish()
    }
}

impl ServerTls {
    pub fn load(files: &ServerTlsFiles) -> Result<ServerTls> {
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("protocol versions", e))?;
        let builder = match &files.client_ca_file {
            Some(ca) => {
                let verifier =
                    rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
                        .build()
                        .map_err(|e| tls_error("client certificate verifier", e))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(certs(&files.cert_file)?, key(&files.key_file)?)
            .map_err(|e| tls_error("server certificate and key do not fit together", e))?;
        config.send_tls13_tickets = 0;
        Ok(ServerTls { config: Arc::new(config), mutual: files.client_ca_file.is_some() })
    }

    /// Wraps an accepted socket; the handshake runs on the first reads and writes.
    pub fn accept(&self, tcp: TcpStream) -> Result<Stream> {
        let conn = ServerConnection::new(Arc::clone(&self.config)).map_err(|e| tls_error("new session", e))?;
        Ok(Stream::Server(Box::new(StreamOwned::new(conn, tcp))))
    }
}

/// A client's TLS configuration, loaded once.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<ClientConfig>,
    server_name: Option<String>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").field("server_name", &self.server_name).finish()
    }
}

impl ClientTls {
    pub fn load(files: &ClientTlsFiles) -> Result<ClientTls> {
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error("protocol versions", e))?
            .with_root_certificates(roots(&files.ca_file)?);
        let config = match (&files.cert_file, &files.key_file) {
            (Some(c), Some(k)) => builder
                .with_client_auth_cert(certs(c)?, key(k)?)
                .map_err(|e| tls_error("client certificate and key do not fit together", e))?,
            (None, None) => builder.with_no_client_auth(),
            _ => return Err(Error::config("TLS: give both a client certificate and its key, or neither")),
        };
        Ok(ClientTls { config: Arc::new(config), server_name: files.server_name.clone() })
    }

    /// Runs the handshake over a connected socket to `addr` (`host:port`).
    pub fn connect(&self, tcp: TcpStream, addr: &str) -> io::Result<Stream> {
        let host = self.server_name.clone().unwrap_or_else(|| host_of(addr).to_string());
        let name = ServerName::try_from(host.clone())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("bad TLS server name {host:?}: {e}")))?;
        let conn = ClientConnection::new(Arc::clone(&self.config), name).map_err(io::Error::other)?;
        let mut s = StreamOwned::new(conn, tcp);
        while s.conn.is_handshaking() {
            s.conn.complete_io(&mut s.sock)?;
        }
        Ok(Stream::Client(Box::new(s)))
    }
}

/// The host part of `host:port` or `[v6]:port`.
fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}

/// A connection, plain or TLS.
pub enum Stream {
    Plain(TcpStream),
    Server(Box<StreamOwned<ServerConnection, TcpStream>>),
    Client(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl Stream {
    /// The socket underneath (timeouts, shutdown, peeking).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Server(s) => &s.sock,
            Stream::Client(s) => &s.sock,
        }
    }

    pub fn is_tls(&self) -> bool {
        !matches!(self, Stream::Plain(_))
    }

    /// Whether decrypted bytes are already waiting in the TLS session.
    pub fn buffered(&mut self) -> bool {
        match self {
            Stream::Plain(_) => false,
            Stream::Server(s) => s.conn.process_new_packets().is_ok_and(|st| st.plaintext_bytes_to_read() > 0),
            Stream::Client(s) => s.conn.process_new_packets().is_ok_and(|st| st.plaintext_bytes_to_read() > 0),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Server(s) => s.read(buf),
            Stream::Client(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Server(s) => s.write(buf),
            Stream::Client(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write_vectored(bufs),
            // One TLS record per slice would be wasteful for many small rows; rustls
            // buffers plaintext, so feed it every slice and flush once.
            Stream::Server(s) => write_slices(s.as_mut(), bufs),
            Stream::Client(s) => write_slices(s.as_mut(), bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Server(s) => s.flush(),
            Stream::Client(s) => s.flush(),
        }
    }
}

/// Writes slices into a TLS session's plaintext buffer, then sends what it encrypted.
fn write_slices<C, D>(s: &mut StreamOwned<C, TcpStream>, bufs: &[IoSlice<'_>]) -> io::Result<usize>
where
    C: std::ops::DerefMut + std::ops::Deref<Target = rustls::ConnectionCommon<D>>,
    D: rustls::SideData,
{
    let mut n = 0;
    for b in bufs {
        let w = s.conn.writer().write(b)?;
        n += w;
        if w < b.len() {
            break; // the session's buffer is full: send, and let the caller go on from n
        }
    }
    while s.conn.wants_write() {
        s.conn.write_tls(&mut s.sock)?;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::host_of;

    #[test]
    fn hosts_of_addresses() {
        assert_eq!(host_of("127.0.0.1:7070"), "127.0.0.1");
        assert_eq!(host_of("shard0.example:7070"), "shard0.example");
        assert_eq!(host_of("[::1]:7070"), "::1");
    }
}
