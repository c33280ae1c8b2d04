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

/// A transport failure's cause in plain words: no library prefix, no URL
/// ("peer closed connection without sending TLS close_notify: https://..."
/// is "the connection was lost").
pub fn plain(cause: &str) -> String {
    let w = cause.to_lowercase();
    let said = if w.contains("connection refused") {
        "connection refused"
    } else if w.contains("keep-alive") || w.contains("keepalive") {
        "no answer to keepalive pings (its host or link is down)"
    } else if w.contains("timed out") || w.contains("elapsed") || w.contains("timeout") {
        "no answer in time (its host or link is down)"
    } else if w.contains("close_notify")
        || w.contains("connection closed")
        || w.contains("broken pipe")
        || w.contains("connection reset")
        || w.contains("unexpected eof")
        || w.contains("stream closed")
    {
        "the connection was lost (the peer stopped or died)"
    } else if w.contains("no route") || w.contains("unreachable") {
        "no route to it"
    } else {
        let c = cause.split(": https://").next().unwrap_or(cause);
        let c = c.split(". For more information").next().unwrap_or(c);
        return c
            .trim()
            .trim_start_matches("transport error")
            .trim()
            .to_string();
    };
    said.to_string()
}
