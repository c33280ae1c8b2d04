//! AF_NETLINK sockets of a process (kind "netlink"): what one is bound and
//! connected to, the multicast groups it joined, whether messages wait on
//! it, and the calls that make such a socket again.
//!
//! Everything is read from a copy of the process's fd, so it answers for
//! the socket's own network namespace (a sock_diag query would answer for
//! ours).

use crate::error::{NixResult, Result};
use crate::fdio::{getsockopt_raw, setsockopt_raw};
use nix::sys::socket::{self as sock, NetlinkAddr};
use std::os::fd::{AsRawFd, OwnedFd};

/// linux/netlink.h: SOL_NETLINK options.
pub const SOL_NETLINK: i32 = 270;
pub const NETLINK_ADD_MEMBERSHIP: i32 = 1;
pub const NETLINK_LIST_MEMBERSHIPS: i32 = 9;
/// The SOL_NETLINK flags getsockopt can read and setsockopt set again
/// (PKTINFO, BROADCAST_ERROR, NO_ENOBUFS, CAP_ACK, EXT_ACK, GET_STRICT_CHK).
pub const FLAG_OPTIONS: &[i32] = &[3, 4, 5, 10, 11, 12];

/// Where a netlink socket is bound and connected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Names {
    /// Bound port id (0: not bound yet).
    pub portid: u32,
    pub dst_portid: u32,
    /// Group mask of the connect(2) destination.
    pub dst_groups: u32,
}

/// socket(AF_NETLINK, `ty` | SOCK_CLOEXEC, `protocol`) for any protocol
/// (nix names only some).
pub fn socket(ty: i32, protocol: i32) -> Result<OwnedFd> {
    crate::fdio::socket(libc::AF_NETLINK, ty | libc::SOCK_CLOEXEC, protocol)
}

/// Its port id and destination.
pub fn names(fd: &OwnedFd) -> Result<Names> {
    let own: NetlinkAddr =
        sock::getsockname(fd.as_raw_fd()).or_sys(|| "getsockname of a netlink socket".into())?;
    // An unconnected netlink socket answers getpeername with port 0, group 0.
    let peer: NetlinkAddr =
        sock::getpeername(fd.as_raw_fd()).or_sys(|| "getpeername of a netlink socket".into())?;
    Ok(Names {
        portid: own.pid(),
        dst_portid: peer.pid(),
        dst_groups: peer.groups(),
    })
}

/// The multicast groups it joined, numbered from 1 (bit N-1 of the
/// kernel's bitmap is group N).
pub fn memberships(fd: &OwnedFd) -> Result<Vec<u32>> {
    // The kernel tells the size it needs when the buffer is too small.
    let mut buf = vec![0u8; 128];
    loop {
        let len = getsockopt_raw(fd, SOL_NETLINK, NETLINK_LIST_MEMBERSHIPS, &mut buf).map_err(
            |source| crate::error::SysError::Syscall {
                what: "getsockopt(NETLINK_LIST_MEMBERSHIPS)".into(),
                source,
            },
        )?;
        if len <= buf.len() {
            return Ok(bits(&buf[..len]));
        }
        buf.resize(len, 0);
    }
}

/// Group numbers of a bitmap of u32 words.
fn bits(map: &[u8]) -> Vec<u32> {
    let mut out = Vec::new();
    for (w, word) in map.chunks_exact(4).enumerate() {
        let v = u32::from_ne_bytes([word[0], word[1], word[2], word[3]]);
        for b in 0..32 {
            if v & (1 << b) != 0 {
                out.push(w as u32 * 32 + b + 1);
            }
        }
    }
    out
}

/// Bytes of messages waiting to be read (SO_MEMINFO's receive memory:
/// netlink has no FIONREAD).
pub fn unread_bytes(fd: &OwnedFd) -> Result<u32> {
    // SK_MEMINFO_VARS (9) u32s; the first is SK_MEMINFO_RMEM_ALLOC.
    let mut buf = [0u8; 36];
    getsockopt_raw(fd, libc::SOL_SOCKET, libc::SO_MEMINFO, &mut buf).map_err(|source| {
        crate::error::SysError::Syscall {
            what: "getsockopt(SO_MEMINFO)".into(),
            source,
        }
    })?;
    Ok(u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]))
}

/// Bind to port id `portid` (joining no group: see [`join`]).
pub fn bind(fd: &OwnedFd, portid: u32) -> Result<()> {
    sock::bind(fd.as_raw_fd(), &NetlinkAddr::new(portid, 0))
        .or_sys(|| format!("bind netlink socket to port id {portid}"))
}

/// Join multicast group `group` (numbered from 1).
pub fn join(fd: &OwnedFd, group: u32) -> Result<()> {
    setsockopt_raw(
        fd,
        SOL_NETLINK,
        NETLINK_ADD_MEMBERSHIP,
        &group.to_ne_bytes(),
    )
    .map_err(|source| crate::error::SysError::Syscall {
        what: format!("join netlink multicast group {group}"),
        source,
    })
}

/// Connect to port id `portid` / group mask `groups`.
pub fn connect(fd: &OwnedFd, portid: u32, groups: u32) -> Result<()> {
    sock::connect(fd.as_raw_fd(), &NetlinkAddr::new(portid, groups))
        .or_sys(|| format!("connect netlink socket to port id {portid}, groups {groups:#x}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_bitmap_is_numbered_from_one() {
        let mut map = Vec::new();
        map.extend_from_slice(&0b101u32.to_ne_bytes());
        map.extend_from_slice(&(1u32 << 31).to_ne_bytes());
        assert_eq!(bits(&map), vec![1, 3, 64]);
    }

    #[test]
    fn a_socket_made_again_has_its_port_groups_and_destination() {
        let a = socket(libc::SOCK_RAW, libc::NETLINK_ROUTE).unwrap();
        // A port id nobody holds: ours plus a large offset.
        let port = std::process::id() + 0x4000_0000;
        bind(&a, port).unwrap();
        join(&a, 1).unwrap(); // RTNLGRP_LINK
        join(&a, 33).unwrap();
        assert_eq!(memberships(&a).unwrap(), vec![1, 33]);
        assert_eq!(names(&a).unwrap().portid, port);
        assert_eq!(unread_bytes(&a).unwrap(), 0);
        connect(&a, 0, 0).unwrap();
        let n = names(&a).unwrap();
        assert_eq!((n.dst_portid, n.dst_groups), (0, 0));
    }
}
