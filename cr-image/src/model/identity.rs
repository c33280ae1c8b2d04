//! Section of kind "identity": credentials, capabilities and resource
//! limits.

use super::{need, pb, Bad};
use serde::Serialize;

/// RLIMIT_NLIMITS on Linux.
pub const RLIMITS: usize = 16;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Identity {
    pub creds: Creds,
    /// Every RLIMIT_*, in resource order.
    pub rlimits: Vec<RLimit>,
    /// The audit login uid (u32::MAX: unset); None: the kernel keeps none.
    pub loginuid: Option<u32>,
}

/// Credentials of a process (all its threads share them).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Creds {
    /// Real, effective, saved, filesystem.
    pub uids: [u32; 4],
    pub gids: [u32; 4],
    pub groups: Vec<u32>,
    #[serde(serialize_with = "super::ser::hex")]
    pub cap_inh: u64,
    #[serde(serialize_with = "super::ser::hex")]
    pub cap_prm: u64,
    #[serde(serialize_with = "super::ser::hex")]
    pub cap_eff: u64,
    #[serde(serialize_with = "super::ser::hex")]
    pub cap_bnd: u64,
    #[serde(serialize_with = "super::ser::hex")]
    pub cap_amb: u64,
    pub no_new_privs: bool,
    pub keep_caps: bool,
    /// PR_GET_DUMPABLE: 0, 1 or 2.
    pub dumpable: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RLimit {
    pub soft: u64,
    pub hard: u64,
}

/// Supplementary groups a process may have (NGROUPS_MAX).
pub const MAX_GROUPS: usize = 65536;

impl Identity {
    pub(crate) fn from_pb(i: pb::Identity) -> Result<Identity, Bad> {
        let c = need(i.creds, "the credentials")?;
        let four = |v: Vec<u32>, what: &str| -> Result<[u32; 4], Bad> {
            v.try_into()
                .map_err(|v: Vec<u32>| format!("{} {what} instead of 4", v.len()))
        };
        if c.groups.len() > MAX_GROUPS {
            return Err(format!("{} supplementary groups", c.groups.len()));
        }
        if c.dumpable > 2 {
            return Err(format!("dumpable mode {}", c.dumpable));
        }
        if i.rlimits.len() > RLIMITS {
            return Err(format!("{} resource limits", i.rlimits.len()));
        }
        Ok(Identity {
            creds: Creds {
                uids: four(c.uids, "user ids")?,
                gids: four(c.gids, "group ids")?,
                groups: c.groups,
                cap_inh: c.cap_inh,
                cap_prm: c.cap_prm,
                cap_eff: c.cap_eff,
                cap_bnd: c.cap_bnd,
                cap_amb: c.cap_amb,
                no_new_privs: c.no_new_privs,
                keep_caps: c.keep_caps,
                dumpable: c.dumpable,
            },
            rlimits: i
                .rlimits
                .into_iter()
                .map(|l| RLimit {
                    soft: l.soft,
                    hard: l.hard,
                })
                .collect(),
            loginuid: i.loginuid,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::Identity {
        let c = &self.creds;
        pb::Identity {
            creds: Some(pb::Creds {
                uids: c.uids.to_vec(),
                gids: c.gids.to_vec(),
                groups: c.groups.clone(),
                cap_inh: c.cap_inh,
                cap_prm: c.cap_prm,
                cap_eff: c.cap_eff,
                cap_bnd: c.cap_bnd,
                cap_amb: c.cap_amb,
                no_new_privs: c.no_new_privs,
                keep_caps: c.keep_caps,
                dumpable: c.dumpable,
            }),
            rlimits: self
                .rlimits
                .iter()
                .map(|l| pb::RLimit {
                    soft: l.soft,
                    hard: l.hard,
                })
                .collect(),
            loginuid: self.loginuid,
        }
    }
}

impl Creds {
    /// Any capability in a set that gives power (permitted, effective,
    /// inheritable, ambient).
    pub fn has_caps(&self) -> bool {
        self.cap_prm | self.cap_eff | self.cap_inh | self.cap_amb != 0
    }
}
