//! Kind "packet": AF_PACKET sockets (raw frames of an interface, as DHCP
//! clients, LLDP or capture tools hold them).
//!
//! Saved: type, the protocol it receives and the interface it is bound to
//! (by name: indexes differ between hosts), its memberships (promiscuous,
//! all-multicast, multicast addresses, as packet_diag lists them) and the
//! options that differ from a fresh socket's (PACKET_VERSION, AUXDATA,
//! a BPF filter...). Frames waiting on it are not saved: a packet socket may
//! lose frames anyway, as UDP may lose datagrams.
//!
//! Refused by name: mapped rings (PACKET_RX_RING / PACKET_TX_RING, whose
//! frames live in memory the kernel shares with the program) and fanout
//! groups (shared with sockets outside the tree).
//!
//! SOCK_PACKET sockets (the obsolete type bound by interface name) are
//! saved and made again the same way, bound by name.
//!
//! Restore: made in the restorer with its original protocol, stopped
//! receiving at once (bound to protocol 0) while its options and
//! memberships are set and anything that slipped in is drained, then bound
//! to its interface and protocol.

#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::{FdScan, OpenFd};
use crate::kinds::sockets::Remade;
use crate::kinds::sockopts::{options, set_options, Fresh, Shape};
use crate::kinds::Described;
use cr_image::model::objects::{PacketMembership, PacketSocket};
use cr_image::model::{FdKind, Object, ObjectKind, ObjectTag};
use cr_sys::packet as sys;
use std::os::fd::OwnedFd;

pub struct Packet;

impl Remade for Packet {
    const NAME: &'static str = "packet";

    fn make(o: &Object) -> Option<Result<OwnedFd, RestoreError>> {
        match &o.kind {
            ObjectKind::PacketSocket(s) => Some(create(o.id, s)),
            _ => None,
        }
    }

    fn object(k: &FdKind) -> Option<u64> {
        match *k {
            FdKind::PacketSocket { object } => Some(object),
            _ => None,
        }
    }
}

fn on(ifname: &str) -> String {
    if ifname.is_empty() {
        "every interface".into()
    } else {
        ifname.into()
    }
}

/// A packet socket `sock` of `f` (inode `ino`, shape `sh`), called by the
/// inet kind.
pub(crate) fn describe(
    cx: &mut FdScan<'_>,
    f: &OpenFd<'_>,
    ino: u64,
    sock: OwnedFd,
    sh: &Shape,
) -> Described {
    let line = |e: cr_sys::SysError| cr_sys::error::one_line(&e);
    let bound = if sh.ty == sys::SOCK_PACKET {
        sys::bound_spkt(&sock)
    } else {
        sys::bound(&sock)
    }
    .map_err(|e| format!("a packet socket that cannot be read: {}", line(e)))?;
    let what = format!(
        "a packet socket (protocol {:#06x} on {})",
        u16::from_be(bound.protocol),
        on(&bound.ifname)
    );
    let diag = sys::diag(&sock, ino)
        .map_err(|e| format!("{what} that packet_diag cannot describe: {}", line(e)))?
        .ok_or_else(|| format!("{what} that packet_diag does not list"))?;
    if diag.rx_ring || diag.tx_ring {
        return Err(format!(
            "{what} with a mapped {} ring (not supported: its frames live in memory shared with the kernel)",
            if diag.rx_ring { "receive" } else { "transmit" }
        ));
    }
    if diag.fanout {
        return Err(format!(
            "{what} in a fanout group (not supported: the group is shared with sockets outside the tree)"
        ));
    }
    let kind = FdKind::PacketSocket { object: ino };
    let fresh = cx.tree.stash.get::<Fresh>();
    let Some(objs) = cx.objects.as_deref_mut() else {
        return Ok(Some(kind));
    };
    if objs.contains(ObjectTag::PacketSocket, ino) {
        return Ok(Some(kind));
    }
    let memberships = diag
        .memberships
        .iter()
        .map(|m| {
            Ok(PacketMembership {
                ifname: sys::ifname(&sock, m.ifindex)
                    .map_err(|e| format!("{what} with a membership on {}", line(e)))?,
                kind: u32::from(m.kind),
                address: m.address.clone(),
                count: m.count,
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    tracing::debug!(pid = f.pid, fd = f.fd, ifname = %bound.ifname, memberships = memberships.len(), "packet socket");
    objs.insert(Object {
        id: ino,
        kind: ObjectKind::PacketSocket(PacketSocket {
            sock_type: sh.ty as u32,
            protocol: u32::from(bound.protocol),
            ifname: bound.ifname,
            opts: options(&sock, sh, fresh),
            memberships,
        }),
    });
    Ok(Some(kind))
}

/// Make socket `id` again, receiving nothing until it is set up.
fn create(id: u64, s: &PacketSocket) -> Result<OwnedFd, RestoreError> {
    let protocol = s.protocol as u16;
    let what = || {
        format!(
            "cannot rebuild packet socket:[{id}] (protocol {:#06x} on {})",
            u16::from_be(protocol),
            on(&s.ifname)
        )
    };
    if s.sock_type as i32 == sys::SOCK_PACKET {
        return create_spkt(s, protocol).step(what);
    }
    let sock = sys::socket(s.sock_type as i32, protocol).step(what)?;
    // Protocol 0: no more frames from here on.
    sys::bind(&sock, 0, 0).step(what)?;
    set_options(&sock, &s.opts).step(what)?;
    for m in &s.memberships {
        let index = sys::ifindex(&m.ifname).step(what)?;
        for _ in 0..m.count.max(1) {
            sys::add_membership(&sock, index, m.kind as u16, &m.address).step(what)?;
        }
    }
    // Frames taken before the bind to protocol 0 are not the program's.
    while cr_sys::fdio::recv_discard(&sock).step(what)? {}
    let index = if s.ifname.is_empty() {
        0
    } else {
        sys::ifindex(&s.ifname).step(what)?
    };
    sys::bind(&sock, index, protocol).step(what)?;
    Ok(sock)
}

/// A SOCK_PACKET socket: its protocol is fixed when it is made (a bind
/// names only the interface), so it receives from the start; what came
/// before the bind is drained (as much as was queued then: frames keep
/// coming on a busy interface).
fn create_spkt(s: &PacketSocket, protocol: u16) -> Result<OwnedFd, cr_sys::SysError> {
    let sock = sys::socket(sys::SOCK_PACKET, protocol)?;
    set_options(&sock, &s.opts)?;
    if !s.ifname.is_empty() {
        sys::bind_spkt(&sock, &s.ifname)?;
    }
    let queued = cr_sys::fdio::getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_RCVBUF)?;
    for _ in 0..queued.max(0) / 64 {
        if !cr_sys::fdio::recv_discard(&sock)? {
            break;
        }
    }
    Ok(sock)
}
