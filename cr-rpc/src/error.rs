//! Errors of the shared cluster plumbing.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Config { path: PathBuf, what: String },
    #[error("bad address {addr}: {what}")]
    Address { addr: String, what: String },
    #[error("TLS is not configured: give ca, cert and key (or insecure = true to use plain TCP)")]
    NoTls,
    #[error("cannot connect to {addr}: {what}")]
    Connect { addr: String, what: String },
    #[error("certificate: {0}")]
    Cert(String),
}

/// The innermost cause of an error chain (transport errors nest deeply and
/// only the last one says what went wrong).
pub fn innermost(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}
