//! The cluster's transport security. Every daemon and client holds a
//! certificate signed by the cluster CA and its key; servers demand a
//! client certificate of that CA (mutual TLS) and clients check the
//! server's. Plain TCP is used only when `insecure` is set explicitly.

use crate::RpcError;
use serde::Deserialize;
use std::path::{Path, PathBuf};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// Where the PEM files are, as given in a config file or by flags.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// The cluster CA's certificate.
    pub ca: Option<PathBuf>,
    /// This peer's certificate, signed by the CA.
    pub cert: Option<PathBuf>,
    /// This peer's private key.
    pub key: Option<PathBuf>,
    /// Plain TCP, no authentication at all (tests, trusted networks).
    #[serde(default)]
    pub insecure: bool,
}

impl TlsFiles {
    /// Values given on the command line win over the config file's.
    pub fn merge(
        mut self,
        ca: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        insecure: bool,
    ) -> TlsFiles {
        self.ca = ca.or(self.ca);
        self.cert = cert.or(self.cert);
        self.key = key.or(self.key);
        self.insecure |= insecure;
        self
    }
}

/// Loaded credentials, ready for servers and channels.
#[derive(Clone)]
pub enum Security {
    Tls { ca: Certificate, identity: Identity },
    Insecure,
}

fn read(path: &Path) -> Result<Vec<u8>, RpcError> {
    std::fs::read(path).map_err(|e| RpcError::Read {
        path: path.to_path_buf(),
        source: e,
    })
}

impl Security {
    /// Read the PEM files. TLS unless `insecure`; then all three files are needed.
    pub fn load(files: &TlsFiles) -> Result<Security, RpcError> {
        if files.insecure {
            return Ok(Security::Insecure);
        }
        let (Some(ca), Some(cert), Some(key)) = (&files.ca, &files.cert, &files.key) else {
            return Err(RpcError::NoTls);
        };
        let ca_pem = read(ca)?;
        if !String::from_utf8_lossy(&ca_pem).contains("BEGIN CERTIFICATE") {
            return Err(RpcError::Config {
                path: ca.clone(),
                what: "not a PEM certificate".into(),
            });
        }
        Ok(Security::Tls {
            ca: Certificate::from_pem(ca_pem),
            identity: Identity::from_pem(read(cert)?, read(key)?),
        })
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, Security::Tls { .. })
    }

    /// For a server: our identity, and client certificates of the CA required.
    pub fn server(&self) -> Option<ServerTlsConfig> {
        match self {
            Security::Tls { ca, identity } => Some(
                ServerTlsConfig::new()
                    .identity(identity.clone())
                    .client_ca_root(ca.clone()),
            ),
            Security::Insecure => None,
        }
    }

    /// For a client of a server whose certificate names `domain`.
    pub fn client(&self, domain: &str) -> Option<ClientTlsConfig> {
        match self {
            Security::Tls { ca, identity } => Some(
                ClientTlsConfig::new()
                    .ca_certificate(ca.clone())
                    .identity(identity.clone())
                    .domain_name(domain),
            ),
            Security::Insecure => None,
        }
    }

    /// URI scheme of a channel.
    pub fn scheme(&self) -> &'static str {
        if self.is_tls() {
            "https"
        } else {
            "http"
        }
    }
}
