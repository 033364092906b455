//! TLS on the TCP doors (rustls, ring's primitives): the daemon's certificate and key from PEM
//! files, optionally client certificates checked against a CA, ALPN per door, and the files
//! read again on SIGHUP so that a renewed certificate takes effect without a restart.
//!
//! A TLS handshake is part of a connection's first request head: it must be over within
//! [`DoorLimits::header_timeout`](crate::DoorLimits::header_timeout) of the accept, with the
//! HTTP request head after it, or the connection is closed (protection `tls-handshake`). Until
//! then the connection costs rustls's own buffers, which are bounded (one TLS record, 16 KiB,
//! plus rustls's default limit on buffered plaintext).
//!
//! Unix sockets never use TLS: who may connect there is who may write the socket file.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use anyhow::{Context, Result, bail};
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

/// Whether a TLS client must present a certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientCerts {
    /// No client certificates are asked for (the default): the bearer token authenticates.
    None,
    /// A client may present a certificate; one it presents must chain to a CA of the file
    /// (PEM). Clients without one are served (their token still decides).
    Optional(PathBuf),
    /// Every client must present a certificate that chains to a CA of the file (PEM); the
    /// handshake of any other client fails, before a byte of HTTP is read.
    Required(PathBuf),
}

/// The files of the doors' TLS (`tpubox serve --tls-cert --tls-key [--tls-client-ca
/// [--tls-client-auth optional|required]]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The daemon's certificate chain, PEM, leaf first.
    pub cert: PathBuf,
    /// Its private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// Client certificates.
    pub client_certs: ClientCerts,
}

/// ALPN protocol ids (RFC 7301; IANA's registry): HTTP/2 over TLS and HTTP/1.1.
const ALPN_H2: &[u8] = b"h2";
const ALPN_HTTP1: &[u8] = b"http/1.1";

/// The doors' TLS: the configuration in force, made again by [`Tls::reload`].
#[derive(Debug)]
pub struct Tls {
    files: TlsFiles,
    /// (HTTP/2 only: the gRPC doors; HTTP/2 and HTTP/1.1).
    configs: RwLock<(Arc<ServerConfig>, Arc<ServerConfig>)>,
}

impl Tls {
    /// Reads `files` and makes the doors' TLS configuration.
    ///
    /// Errors: a file that cannot be read, holds no certificate or key, a key that does not
    /// match the certificate, a client CA file without a usable certificate.
    pub fn load(files: TlsFiles) -> Result<Arc<Tls>> {
        let configs = configs(&files)?;
        Ok(Arc::new(Tls {
            files,
            configs: RwLock::new(configs),
        }))
    }

    /// Reads the files again (a renewed certificate, a new client CA); connections opened
    /// from now on use them. On an error the configuration in force stays.
    ///
    /// Errors: as [`Tls::load`].
    pub fn reload(&self) -> Result<()> {
        let c = configs(&self.files)?;
        *self.configs.write().unwrap_or_else(|p| p.into_inner()) = c;
        Ok(())
    }

    /// The files it was loaded from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// An acceptor for a door that speaks HTTP/2 only (`http2_only`, ALPN `h2`) or both
    /// (ALPN `h2`, `http/1.1`; a client that offers no ALPN gets HTTP/1.1 or HTTP/2 with
    /// prior knowledge, as on a plain-text door).
    pub fn acceptor(&self, http2_only: bool) -> tokio_rustls::TlsAcceptor {
        let c = self.configs.read().unwrap_or_else(|p| p.into_inner());
        let config = if http2_only { &c.0 } else { &c.1 };
        tokio_rustls::TlsAcceptor::from(Arc::clone(config))
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>> {
    let bytes =
        std::fs::read(path).with_context(|| format!("reading {what} {}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{what} {}: not PEM certificates", path.display()))?;
    if certs.is_empty() {
        bail!(
            "{what} {}: no certificate in it (expected PEM `-----BEGIN CERTIFICATE-----` blocks)",
            path.display()
        );
    }
    Ok(certs)
}

fn configs(files: &TlsFiles) -> Result<(Arc<ServerConfig>, Arc<ServerConfig>)> {
    let chain = read_certs(&files.cert, "the TLS certificate (--tls-cert)")?;
    let key_bytes = std::fs::read(&files.key)
        .with_context(|| format!("reading the TLS key (--tls-key) {}", files.key.display()))?;
    let key = PrivateKeyDer::from_pem_slice(&key_bytes).map_err(|e| {
        anyhow::anyhow!(
            "the TLS key (--tls-key) {}: no private key in it ({e}); expected a PEM PKCS#8, PKCS#1 or SEC1 key",
            files.key.display()
        )
    })?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("rustls refused its own default protocol versions")?;
    let builder = match &files.client_certs {
        ClientCerts::None => builder.with_no_client_auth(),
        ClientCerts::Optional(ca) | ClientCerts::Required(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in read_certs(ca, "the client CA file (--tls-client-ca)")? {
                roots.add(c).with_context(|| {
                    format!(
                        "the client CA file {}: a certificate rustls cannot use",
                        ca.display()
                    )
                })?;
            }
            let v = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
            let v = if matches!(files.client_certs, ClientCerts::Optional(_)) {
                v.allow_unauthenticated()
            } else {
                v
            };
            builder.with_client_cert_verifier(
                v.build()
                    .with_context(|| format!("the client CA file {}", ca.display()))?,
            )
        }
    };
    let config = builder.with_single_cert(chain, key).with_context(|| {
        format!(
            "the TLS key {} does not go with the certificate {}",
            files.key.display(),
            files.cert.display()
        )
    })?;
    let mut h2 = config.clone();
    h2.alpn_protocols = vec![ALPN_H2.to_vec()];
    let mut both = config;
    both.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_HTTP1.to_vec()];
    Ok((Arc::new(h2), Arc::new(both)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(dir: &Path, cert: &str, key: &str) -> TlsFiles {
        let (c, k) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&c, cert).unwrap();
        std::fs::write(&k, key).unwrap();
        TlsFiles {
            cert: c,
            key: k,
            client_certs: ClientCerts::None,
        }
    }

    fn err(f: TlsFiles) -> String {
        format!("{:#}", Tls::load(f).unwrap_err())
    }

    #[test]
    fn bad_files_are_named_with_their_flag() {
        let dir = std::env::temp_dir().join(format!("tpubox-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = TlsFiles {
            cert: dir.join("absent.pem"),
            key: dir.join("absent.key"),
            client_certs: ClientCerts::None,
        };
        let e = err(missing);
        assert!(e.contains("--tls-cert") && e.contains("absent.pem"), "{e}");
        let e = err(files(&dir, "not a certificate\n", ""));
        assert!(e.contains("no certificate in it"), "{e}");
        let e = err(files(
            &dir,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
            "nothing\n",
        ));
        assert!(
            e.contains("--tls-key") && e.contains("no private key"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
