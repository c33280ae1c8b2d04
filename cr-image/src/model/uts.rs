//! Section of kind "uts": the UTS namespace of a tree that has one of its
//! own (a `cr_run` job): its host name and NIS domain name, which the job
//! keeps wherever it is restored.

use super::{pb, Bad};
use serde::Serialize;

/// The longest name the kernel holds (`__NEW_UTS_LEN`).
const MAX_NAME: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct UtsNs {
    pub hostname: String,
    pub domainname: String,
}

/// A name `sethostname`/`setdomainname` takes.
fn check_name(what: &str, n: &str) -> Result<(), Bad> {
    if n.len() > MAX_NAME || n.contains('\0') {
        return Err(format!("bad {what} {n:?}"));
    }
    Ok(())
}

impl UtsNs {
    pub(crate) fn from_pb(u: pb::UtsNs) -> Result<UtsNs, Bad> {
        check_name("host name", &u.hostname)?;
        check_name("domain name", &u.domainname)?;
        Ok(UtsNs {
            hostname: u.hostname,
            domainname: u.domainname,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::UtsNs {
        pb::UtsNs {
            hostname: self.hostname.clone(),
            domainname: self.domainname.clone(),
        }
    }
}
