//! Who a client certificate names, and what it may call.
//!
//! Every certificate of the cluster CA names its holder by DNS name (a
//! node's name, the coordinator's TLS name, an administrator's name).
//! Administrators' certificates also carry the role extension
//! [`ROLE_OID`] with the value `admin` (`crctl pki issue --admin`). The
//! coordinator accepts Register and Heartbeat for node N only from a
//! certificate naming N and not an administrator's, and its administrative
//! calls only from an administrator's; an agent accepts the calls of its
//! Agent service only from a certificate naming the coordinator. With
//! `insecure` there is no certificate, and no identity at all.

use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

/// OID of the role extension: 1.3.6.1.4.1.99999.17.1 (a private arc of
/// this project; non-critical, so other TLS stacks ignore it). Its value
/// is a DER UTF8String: `admin`.
pub const ROLE_OID: &[u64] = &[1, 3, 6, 1, 4, 1, 99999, 17, 1];
/// The same, dotted.
pub const ROLE_OID_STR: &str = "1.3.6.1.4.1.99999.17.1";
/// The role value of an administrator's certificate.
pub const ROLE_ADMIN: &str = "admin";

/// What a peer's certificate says about it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Peer {
    /// Its DNS names (subject alternative names; the common name if none).
    pub names: Vec<String>,
    /// The role extension's value, if any.
    pub role: Option<String>,
}

impl Peer {
    pub fn is_admin(&self) -> bool {
        self.role.as_deref() == Some(ROLE_ADMIN)
    }

    pub fn names(&self, name: &str) -> bool {
        self.names.iter().any(|n| n.eq_ignore_ascii_case(name))
    }

    /// "the certificate of n1" / "the administrator certificate of alice".
    pub fn describe(&self) -> String {
        let who = if self.names.is_empty() {
            "(no name)".to_string()
        } else {
            self.names.join(", ")
        };
        if self.is_admin() {
            format!("the administrator certificate of {who}")
        } else {
            format!("the certificate of {who}")
        }
    }
}

/// The DER encoding of the role extension's value.
pub fn role_value(role: &str) -> Vec<u8> {
    let mut v = vec![0x0c, role.len() as u8];
    v.extend_from_slice(role.as_bytes());
    v
}

/// Read a certificate (DER).
pub fn parse(der: &[u8]) -> Result<Peer, String> {
    let (_, cert) =
        X509Certificate::from_der(der).map_err(|e| format!("unreadable certificate: {e}"))?;
    let mut peer = Peer::default();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            if let GeneralName::DNSName(d) = n {
                peer.names.push(d.to_string());
            }
        }
    }
    if peer.names.is_empty() {
        for cn in cert.subject().iter_common_name() {
            if let Ok(s) = cn.as_str() {
                peer.names.push(s.to_string());
            }
        }
    }
    for ext in cert.extensions() {
        if ext.oid.to_id_string() == ROLE_OID_STR {
            let v = ext.value;
            if v.len() >= 2 && v[0] == 0x0c && v[1] as usize == v.len() - 2 {
                peer.role = Some(String::from_utf8_lossy(&v[2..]).into_owned());
            } else {
                return Err("the certificate's role extension is malformed".into());
            }
        }
    }
    Ok(peer)
}

/// The client of a gRPC request: `None` without TLS (insecure mode), else
/// what its certificate says.
pub fn of_request<T>(req: &tonic::Request<T>) -> Result<Option<Peer>, tonic::Status> {
    let Some(certs) = req.peer_certs() else {
        return Ok(None);
    };
    let first = certs
        .first()
        .ok_or_else(|| tonic::Status::unauthenticated("no client certificate"))?;
    parse(first.as_ref())
        .map(Some)
        .map_err(tonic::Status::unauthenticated)
}
