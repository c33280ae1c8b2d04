//! Kind "netlink": AF_NETLINK sockets (route monitors, uevent listeners,
//! generic netlink clients...).
//!
//! Saved: type and protocol, the bound port id, the multicast groups
//! joined, the connect(2) destination, and the options that differ from a
//! fresh socket's (buffer sizes, the SOL_NETLINK flags, a BPF filter). All
//! of it is read from a copy of the process's fd, so it is the socket's own
//! network namespace that answers.
//!
//! Messages waiting on the socket cannot be read without consuming them
//! (netlink peeks only the first one), and a dump still being read (the
//! kernel makes its next part as the program reads) would end without its
//! DONE: a socket with unread messages is refused by name, and a later
//! checkpoint usually succeeds.
//!
//! Restore: each socket is made in the restorer (in the namespace the
//! restore runs in), bound to its old port id (the process's PID for an
//! autobound first socket, free again once the original is gone), put back
//! into its groups and connected, then handed to the processes holding it.

#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::{FdScan, OpenFd};
use crate::kinds::sockets::Remade;
use crate::kinds::sockopts::{options, set_options, Fresh, Shape};
use crate::kinds::Described;
use cr_image::model::objects::NetlinkSocket;
use cr_image::model::{FdKind, Object, ObjectKind, ObjectTag};
use cr_sys::netlink as sys;
use std::os::fd::OwnedFd;

pub struct Netlink;

impl Remade for Netlink {
    const NAME: &'static str = "netlink";

    fn make(o: &Object) -> Option<Result<OwnedFd, RestoreError>> {
        match &o.kind {
            ObjectKind::NetlinkSocket(s) => Some(create(o.id, s)),
            _ => None,
        }
    }

    fn object(k: &FdKind) -> Option<u64> {
        match *k {
            FdKind::NetlinkSocket { object } => Some(object),
            _ => None,
        }
    }
}

/// Netlink family and protocol names for messages.
fn protocol_name(p: u32) -> String {
    let name = match p as i32 {
        libc::NETLINK_ROUTE => "NETLINK_ROUTE",
        libc::NETLINK_SOCK_DIAG => "NETLINK_SOCK_DIAG",
        libc::NETLINK_NFLOG => "NETLINK_NFLOG",
        libc::NETLINK_XFRM => "NETLINK_XFRM",
        libc::NETLINK_SELINUX => "NETLINK_SELINUX",
        libc::NETLINK_AUDIT => "NETLINK_AUDIT",
        libc::NETLINK_NETFILTER => "NETLINK_NETFILTER",
        libc::NETLINK_KOBJECT_UEVENT => "NETLINK_KOBJECT_UEVENT",
        libc::NETLINK_GENERIC => "NETLINK_GENERIC",
        libc::NETLINK_CONNECTOR => "NETLINK_CONNECTOR",
        _ => return format!("netlink protocol {p}"),
    };
    name.into()
}

/// A netlink socket `sock` of `f` (inode `ino`, shape `sh`), called by the
/// inet kind.
pub(crate) fn describe(
    cx: &mut FdScan<'_>,
    f: &OpenFd<'_>,
    ino: u64,
    sock: OwnedFd,
    sh: &Shape,
) -> Described {
    let names = sys::names(&sock).map_err(|e| {
        format!(
            "a netlink socket ({}) that cannot be read: {}",
            protocol_name(sh.protocol as u32),
            cr_sys::error::one_line(&e)
        )
    })?;
    let what = || {
        format!(
            "a netlink socket ({}, port id {})",
            protocol_name(sh.protocol as u32),
            names.portid
        )
    };
    let unread = sys::unread_bytes(&sock).map_err(|e| {
        format!(
            "{} that cannot be read: {}",
            what(),
            cr_sys::error::one_line(&e)
        )
    })?;
    if unread > 0 {
        return Err(format!(
            "{} with {unread} bytes of messages not read yet (not supported: netlink cannot show them without taking them from the program; try again once it has read them)",
            what()
        ));
    }
    let kind = FdKind::NetlinkSocket { object: ino };
    let fresh = cx.tree.stash.get::<Fresh>();
    let Some(objs) = cx.objects.as_deref_mut() else {
        return Ok(Some(kind));
    };
    if objs.contains(ObjectTag::NetlinkSocket, ino) {
        return Ok(Some(kind));
    }
    let groups = sys::memberships(&sock).map_err(|e| {
        format!(
            "{} whose groups cannot be read: {}",
            what(),
            cr_sys::error::one_line(&e)
        )
    })?;
    tracing::debug!(
        pid = f.pid,
        fd = f.fd,
        portid = names.portid,
        ?groups,
        "netlink socket"
    );
    objs.insert(Object {
        id: ino,
        kind: ObjectKind::NetlinkSocket(NetlinkSocket {
            sock_type: sh.ty as u32,
            protocol: sh.protocol as u32,
            portid: names.portid,
            groups,
            dst_portid: names.dst_portid,
            dst_groups: names.dst_groups,
            opts: options(&sock, sh, fresh),
        }),
    });
    Ok(Some(kind))
}

/// Make socket `id` again: options first (buffer sizes before anything can
/// arrive), then its port, groups and destination.
fn create(id: u64, s: &NetlinkSocket) -> Result<OwnedFd, RestoreError> {
    let what = || {
        format!(
            "cannot rebuild netlink socket:[{id}] ({}, port id {})",
            protocol_name(s.protocol),
            s.portid
        )
    };
    let sock = sys::socket(s.sock_type as i32, s.protocol as i32).step(what)?;
    set_options(&sock, &s.opts).step(what)?;
    if s.portid != 0 {
        sys::bind(&sock, s.portid).step(what)?;
    }
    for &g in &s.groups {
        sys::join(&sock, g).step(what)?;
    }
    if s.dst_portid != 0 || s.dst_groups != 0 {
        sys::connect(&sock, s.dst_portid, s.dst_groups).step(what)?;
    }
    Ok(sock)
}
