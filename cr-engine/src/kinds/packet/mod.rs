//! Kind "packet": AF_PACKET sockets (raw frames of an interface, as DHCP
//! clients, LLDP or capture tools hold them).
//!
//! Saved: type, the protocol it receives and the interface it is bound to
//! (by name: indexes differ between hosts), its memberships (promiscuous,
//! all-multicast, multicast addresses, as packet_diag lists them) and the
//! options that differ from a fresh socket's (PACKET_VERSION, RESERVE,
//! LOSS, TIMESTAMP, AUXDATA, a BPF filter...). Frames waiting on it are not
//! saved: a packet socket may lose frames anyway, as UDP may lose
//! datagrams.
//!
//! Mapped rings (PACKET_RX_RING / PACKET_TX_RING, TPACKET_V1/V2/V3): their
//! geometry (packet_diag's PACKET_DIAG_RX_RING / TX_RING, a struct
//! tpacket_req3) is saved, not their frames. The restored socket gets rings
//! of the same geometry, empty (every frame's status TP_STATUS_KERNEL /
//! AVAILABLE, the kernel's ring index at frame 0), and the process's
//! mappings of them (kind "memory" classes a mapping of "socket:[N]" as a
//! packet ring and saves no page of it) are made again by mmap of the
//! restored socket, at the same address with the same protections, once
//! the fds are in ([`map_rings`]). Frames received and not yet handed back
//! by the program are lost, as queued ones are. A program that walks its
//! receive ring from where it was finds the next frames at frame 0 on: it
//! reads them once the kernel has filled the ring up to its position.
//! A transmit ring's index too starts again at 0: a program that queues
//! its next frame elsewhere waits for the kernel to reach it.
//!
//! Fanout groups (PACKET_FANOUT: group id, type and flags) are joined
//! again once the socket is bound; a group with sockets outside the tree
//! is joined if its type matches.
//!
//! Refused by name: a transmit ring holding frames the program queued and
//! the kernel has not sent (status SEND_REQUEST or SENDING: they would be
//! lost), and a fanout group steered by a BPF program (types CBPF and EBPF:
//! the program cannot be read back).
//!
//! SOCK_PACKET sockets (the obsolete type bound by interface name) are
//! saved and made again the same way, bound by name.
//!
//! Restore: made in the restorer with its original protocol, stopped
//! receiving at once (bound to protocol 0) while its options, rings and
//! memberships are set (PACKET_VERSION and RESERVE before the rings, which
//! the kernel requires) and anything that slipped in is drained, then bound
//! to its interface and protocol, then put in its fanout group.

#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::{FdScan, OpenFd};
use crate::kinds::sockets::Remade;
use crate::kinds::sockopts::{options, set_options, Fresh, Shape};
use crate::kinds::Described;
use crate::restore::Rebuild;
use cr_image::model::objects::{PacketMembership, PacketRing, PacketSocket};
use cr_image::model::{FdKind, Object, ObjectKind, ObjectTag, Process, Vma, VmaKind};
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

    fn after_fds(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
        map_rings(cx, p)
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
    if let Some(tx) = &diag.tx_ring {
        let version = cr_sys::fdio::getsockopt_int(&sock, sys::SOL_PACKET, sys::PACKET_VERSION)
            .and_then(|v| sys::tx_pending(&sock, diag.rx_ring.as_ref(), tx, v as u32))
            .map_err(|e| format!("{what} whose transmit ring cannot be read: {}", line(e)))?;
        if version > 0 {
            return Err(format!(
                "{what} with {version} frame(s) queued in its transmit ring and not sent yet (not supported: they would be lost; checkpoint once the program has sent them)"
            ));
        }
    }
    if let Some(f) = diag.fanout {
        let ty = (f >> 16) & 0xff;
        if ty == sys::FANOUT_CBPF || ty == sys::FANOUT_EBPF {
            return Err(format!(
                "{what} in fanout group {} steered by a BPF program (not supported: the program cannot be read back)",
                f & 0xffff
            ));
        }
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
            rx_ring: diag.rx_ring.as_ref().map(ring_of),
            tx_ring: diag.tx_ring.as_ref().map(ring_of),
            fanout: diag.fanout.unwrap_or(0),
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
    // After PACKET_VERSION and RESERVE (in the options).
    if let Some(r) = &s.rx_ring {
        sys::set_ring(&sock, false, &sys_ring(r)).step(what)?;
    }
    if let Some(r) = &s.tx_ring {
        sys::set_ring(&sock, true, &sys_ring(r)).step(what)?;
    }
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
    // A group is joined by a bound socket.
    if s.fanout != 0 {
        sys::set_fanout(&sock, s.fanout).step(what)?;
    }
    Ok(sock)
}

fn ring_of(r: &sys::Ring) -> PacketRing {
    PacketRing {
        block_size: r.block_size,
        block_nr: r.block_nr,
        frame_size: r.frame_size,
        frame_nr: r.frame_nr,
        retire_tmo: r.retire_tmo,
        sizeof_priv: r.sizeof_priv,
        features: r.features,
    }
}

fn sys_ring(r: &PacketRing) -> sys::Ring {
    sys::Ring {
        block_size: r.block_size,
        block_nr: r.block_nr,
        frame_size: r.frame_size,
        frame_nr: r.frame_nr,
        retire_tmo: r.retire_tmo,
        sizeof_priv: r.sizeof_priv,
        features: r.features,
    }
}

/// Map again the packet rings `p` mapped (VMAs of kind PacketRing), from
/// the restored sockets its fds hold: each mmap of a socket covers all its
/// rings from offset 0, so the whole is mapped where the first mapping of
/// it began (its address less its offset), the pieces the process had
/// unmapped are unmapped again, and each piece gets its protections.
fn map_rings(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    let rings: Vec<&Vma> = p
        .vmas
        .iter()
        .filter(|v| v.kind == VmaKind::PacketRing)
        .collect();
    if rings.is_empty() {
        return Ok(());
    }
    let owner = crate::kinds::fds::table_owner(cx.r.ck, p);
    // (socket, base) -> its mappings, in address order.
    let mut groups: Vec<((u64, u64), Vec<&Vma>)> = Vec::new();
    for v in rings {
        let key = (v.inode, v.start - v.pgoff);
        match groups.iter_mut().find(|g| g.0 == key) {
            Some(g) => g.1.push(v),
            None => groups.push((key, vec![v])),
        }
    }
    for ((ino, base), pieces) in groups {
        let what = || {
            format!(
                "cannot map the rings of packet socket:[{ino}] at {base:#x} in process {}",
                p.pid
            )
        };
        let fd = owner
            .fds
            .iter()
            .find(|f| matches!(f.kind, FdKind::PacketSocket { object } if object == ino))
            .ok_or_else(|| {
                RestoreError::Unsupported(format!(
                    "{}: no fd of the process holds the socket",
                    what()
                ))
            })?
            .fd;
        let len = match cx
            .r
            .ck
            .object(ObjectTag::PacketSocket, ino)
            .map(|o| &o.kind)
        {
            Some(ObjectKind::PacketSocket(s)) => s.rings_len(),
            _ => 0,
        };
        if len == 0 {
            return Err(RestoreError::Unsupported(format!(
                "{}: the image holds no ring of it",
                what()
            )));
        }
        let first = pieces[0];
        let flags = if first.shared {
            libc::MAP_SHARED
        } else {
            libc::MAP_PRIVATE
        } | libc::MAP_FIXED_NOREPLACE;
        cx.stub.later(
            "mmap",
            libc::SYS_mmap,
            [base, len, first.prot as u64, flags as u64, fd as u64, 0],
            what(),
        )?;
        let end = base + len;
        let mut at = base;
        for v in &pieces {
            if v.start > at {
                cx.stub.later(
                    "munmap",
                    libc::SYS_munmap,
                    [at, v.start - at, 0, 0, 0, 0],
                    what(),
                )?;
            }
            at = at.max(v.end);
            if v.prot != first.prot {
                cx.stub.later(
                    "mprotect",
                    libc::SYS_mprotect,
                    [v.start, v.end - v.start, v.prot as u64, 0, 0, 0],
                    what(),
                )?;
            }
        }
        if at < end {
            cx.stub.later(
                "munmap",
                libc::SYS_munmap,
                [at, end - at, 0, 0, 0, 0],
                what(),
            )?;
        }
    }
    cx.stub.flush()?;
    Ok(())
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
