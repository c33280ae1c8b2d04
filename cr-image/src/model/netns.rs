//! Section of kind "netns": the network namespace of a tree that has one
//! of its own (`unshare -n`), by its devices. A namespace with the
//! loopback device alone is made again by `cr_restart`; others are
//! restored into the restorer's namespace (or `--netns`).

use super::{pb, Bad};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct NetNs {
    /// By name.
    pub devices: Vec<NetDevice>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct NetDevice {
    pub name: String,
    pub up: bool,
}

/// The longest device name (IFNAMSIZ less its NUL).
const MAX_NAME: usize = 15;

impl NetNs {
    /// Only the loopback device: a namespace a restore can make again.
    pub fn loopback_only(&self) -> bool {
        self.devices.len() == 1 && self.devices[0].name == "lo"
    }

    /// Whether the loopback device was up.
    pub fn loopback_up(&self) -> bool {
        self.devices.iter().any(|d| d.name == "lo" && d.up)
    }

    pub(crate) fn from_pb(n: pb::NetNs) -> Result<NetNs, Bad> {
        let mut devices = Vec::with_capacity(n.devices.len());
        for d in n.devices {
            if d.name.is_empty() || d.name.len() > MAX_NAME || d.name.contains(['/', '\0', ' ']) {
                return Err(format!("bad network device name {:?}", d.name));
            }
            if devices.iter().any(|o: &NetDevice| o.name == d.name) {
                return Err(format!("network device {:?} twice", d.name));
            }
            devices.push(NetDevice {
                name: d.name,
                up: d.up,
            });
        }
        Ok(NetNs { devices })
    }

    pub(crate) fn to_pb(&self) -> pb::NetNs {
        pb::NetNs {
            devices: self
                .devices
                .iter()
                .map(|d| pb::NetDevice {
                    name: d.name.clone(),
                    up: d.up,
                })
                .collect(),
        }
    }
}
