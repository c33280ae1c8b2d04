//! A cluster CA and the certificates it signs (`crctl pki`), for operators
//! without a PKI of their own. ECDSA P-256 keys; certificates name the
//! peer by DNS name (its node or daemon name) and optionally by IP, and an
//! administrator's carries the role extension (see [`crate::identity`]).

use crate::RpcError;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use std::net::IpAddr;
use std::path::{Path, PathBuf};

/// Subject of the CA certificate; certificates it signs name it as issuer.
const CA_NAME: &str = "cr cluster CA";

fn cert_err(e: rcgen::Error) -> RpcError {
    RpcError::Cert(e.to_string())
}

fn write(path: &Path, text: &str, private: bool) -> Result<(), RpcError> {
    use std::os::unix::fs::OpenOptionsExt;
    let werr = |e| RpcError::Write {
        path: path.to_path_buf(),
        source: e,
    };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if private { 0o600 } else { 0o644 })
        .open(path)
        .map_err(werr)?;
    std::io::Write::write_all(&mut f, text.as_bytes()).map_err(werr)
}

fn ca_params() -> Result<CertificateParams, RpcError> {
    let mut p = CertificateParams::new(Vec::<String>::new()).map_err(cert_err)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, CA_NAME);
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(p)
}

/// Create `dir/ca.crt` and `dir/ca.key` (refused if the CA exists).
pub fn init_ca(dir: &Path) -> Result<PathBuf, RpcError> {
    std::fs::create_dir_all(dir).map_err(|e| RpcError::Write {
        path: dir.to_path_buf(),
        source: e,
    })?;
    let crt = dir.join("ca.crt");
    if crt.exists() {
        return Err(RpcError::Cert(format!(
            "{} exists already; remove it to make a new CA",
            crt.display()
        )));
    }
    let key = KeyPair::generate().map_err(cert_err)?;
    let cert = ca_params()?.self_signed(&key).map_err(cert_err)?;
    write(&dir.join("ca.key"), &key.serialize_pem(), true)?;
    write(&crt, &cert.pem(), false)?;
    Ok(crt)
}

/// Sign a certificate for `name` (also its DNS name) and `ips` with the CA
/// in `dir`: writes `dir/NAME.crt` and `dir/NAME.key`, usable by servers
/// and clients alike (a node, the coordinator).
pub fn issue(dir: &Path, name: &str, ips: &[IpAddr]) -> Result<(PathBuf, PathBuf), RpcError> {
    issue_with_role(dir, name, ips, None)
}

/// [`issue`] with a role (see [`crate::identity`]): `Some("admin")` makes
/// an administrator's certificate (`crctl pki issue --admin`).
pub fn issue_with_role(
    dir: &Path,
    name: &str,
    ips: &[IpAddr],
    role: Option<&str>,
) -> Result<(PathBuf, PathBuf), RpcError> {
    let ca_key_path = dir.join("ca.key");
    let ca_key_pem = std::fs::read_to_string(&ca_key_path).map_err(|e| RpcError::Read {
        path: ca_key_path.clone(),
        source: e,
    })?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).map_err(cert_err)?;
    let issuer = Issuer::new(ca_params()?, ca_key);
    let mut p = CertificateParams::new(vec![name.to_string()]).map_err(cert_err)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    p.distinguished_name = dn;
    p.subject_alt_names
        .extend(ips.iter().map(|ip| SanType::IpAddress(*ip)));
    p.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    if let Some(r) = role {
        p.custom_extensions
            .push(rcgen::CustomExtension::from_oid_content(
                crate::identity::ROLE_OID,
                crate::identity::role_value(r),
            ));
    }
    let key = KeyPair::generate().map_err(cert_err)?;
    let cert = p.signed_by(&key, &issuer).map_err(cert_err)?;
    let (crt_path, key_path) = (
        dir.join(format!("{name}.crt")),
        dir.join(format!("{name}.key")),
    );
    write(&key_path, &key.serialize_pem(), true)?;
    write(&crt_path, &cert.pem(), false)?;
    Ok((crt_path, key_path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn der(path: &Path) -> Vec<u8> {
        let pem = std::fs::read_to_string(path).unwrap();
        let b64: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        rustls_b64(&b64)
    }

    /// A tiny base64 decoder (the test needs no crate for it).
    fn rustls_b64(s: &str) -> Vec<u8> {
        let val = |c: u8| match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            _ => 63,
        };
        let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').map(val).collect();
        let mut out = Vec::new();
        for ch in bytes.chunks(4) {
            let mut n = 0u32;
            for (i, &b) in ch.iter().enumerate() {
                n |= u32::from(b) << (18 - 6 * i);
            }
            for i in 0..ch.len().saturating_sub(1) {
                out.push((n >> (16 - 8 * i)) as u8);
            }
        }
        out
    }

    #[test]
    fn certificates_name_their_holder_and_role() {
        let dir = std::env::temp_dir().join(format!("cr-pki-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        init_ca(&dir).unwrap();
        let (n1, _) = issue(&dir, "n1", &["10.0.0.1".parse().unwrap()]).unwrap();
        let (adm, _) = issue_with_role(&dir, "alice", &[], Some("admin")).unwrap();
        let p = crate::identity::parse(&der(&n1)).unwrap();
        assert_eq!(p.names, ["n1"]);
        assert!(!p.is_admin());
        let a = crate::identity::parse(&der(&adm)).unwrap();
        assert_eq!(a.names, ["alice"]);
        assert!(a.is_admin(), "{a:?}");
        assert!(a.describe().contains("administrator"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
