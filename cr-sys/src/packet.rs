//! AF_PACKET sockets of a process (kind "packet"): the interface and
//! protocol one is bound to, its memberships, rings and fanout (packet_diag,
//! asked in the socket's own network namespace), and the calls that make
//! such a socket again.

use crate::error::{Errno, NixResult, Result, SysError};
use crate::fdio::setsockopt_raw;
use crate::sock_diag::{self, attributes, u16_at, u32_at, QueryError};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// linux/socket.h, linux/if_packet.h.
pub const SOL_PACKET: i32 = 263;
const PACKET_ADD_MEMBERSHIP: i32 = 1;
/// SOL_PACKET options getsockopt reads and setsockopt sets again:
/// AUXDATA 8, ORIGDEV 9, VERSION 10, RESERVE 12, LOSS 14, VNET_HDR 15,
/// TIMESTAMP 17, TX_HAS_OFF 19, QDISC_BYPASS 20, IGNORE_OUTGOING 23.
/// VERSION comes first; VERSION, RESERVE, LOSS, VNET_HDR and TX_HAS_OFF
/// are taken only while the socket has no ring, so they are set before
/// its rings are made again ([`set_ring`]).
pub const OPTIONS: &[i32] = &[10, 8, 9, 12, 14, 15, 17, 19, 20, 23];
pub const PACKET_VERSION: i32 = 10;
/// Fanout types whose steering is a BPF program (PACKET_FANOUT_CBPF,
/// PACKET_FANOUT_EBPF).
pub const FANOUT_CBPF: u32 = 6;
pub const FANOUT_EBPF: u32 = 7;
const PACKET_RX_RING: i32 = 5;
const PACKET_TX_RING: i32 = 13;
const PACKET_FANOUT: i32 = 18;

// linux/packet_diag.h
const PACKET_SHOW_INFO: u32 = 0x1;
const PACKET_SHOW_MCLIST: u32 = 0x2;
const PACKET_SHOW_RING_CFG: u32 = 0x4;
const PACKET_SHOW_FANOUT: u32 = 0x8;
const PACKET_DIAG_MCLIST: u16 = 1;
const PACKET_DIAG_RX_RING: u16 = 2;
const PACKET_DIAG_TX_RING: u16 = 3;
const PACKET_DIAG_FANOUT: u16 = 4;
/// struct packet_diag_msg, struct packet_diag_mclist.
const DIAG_MSG_LEN: usize = 16;
const MCLIST_LEN: usize = 44;

/// The interface and protocol a packet socket is bound to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bound {
    /// Interface index (0: every interface) and its name in the socket's
    /// namespace.
    pub ifindex: i32,
    pub ifname: String,
    /// Ethertype, network byte order.
    pub protocol: u16,
}

/// One PACKET_ADD_MEMBERSHIP entry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    pub ifindex: i32,
    pub kind: u16,
    pub address: Vec<u8>,
    pub count: u32,
}

/// The geometry of a mapped ring: struct packet_diag_ring, the fields
/// of struct tpacket_req3 in its order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ring {
    pub block_size: u32,
    pub block_nr: u32,
    pub frame_size: u32,
    pub frame_nr: u32,
    pub retire_tmo: u32,
    pub sizeof_priv: u32,
    pub features: u32,
}

impl Ring {
    /// Bytes it takes mapped.
    pub fn len(&self) -> usize {
        self.block_size as usize * self.block_nr as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// struct tpacket_req3 (a V1/V2 socket reads the first four fields).
    fn req3(&self) -> [u8; 28] {
        let mut b = [0u8; 28];
        let f = [
            self.block_size,
            self.block_nr,
            self.frame_size,
            self.frame_nr,
            self.retire_tmo,
            self.sizeof_priv,
            self.features,
        ];
        for (c, v) in b.chunks_exact_mut(4).zip(f) {
            c.copy_from_slice(&v.to_ne_bytes());
        }
        b
    }

    /// Byte offset of frame `i` in the ring (frames fill each block from
    /// its start, as many as fit).
    fn frame_at(&self, i: u32) -> usize {
        let per_block = (self.block_size / self.frame_size.max(1)).max(1);
        (i / per_block) as usize * self.block_size as usize
            + (i % per_block) as usize * self.frame_size as usize
    }
}

/// What packet_diag tells of one socket.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diag {
    pub memberships: Vec<Membership>,
    pub rx_ring: Option<Ring>,
    pub tx_ring: Option<Ring>,
    /// PACKET_DIAG_FANOUT: as getsockopt(PACKET_FANOUT) reads it.
    pub fanout: Option<u32>,
}

/// PACKET_RX_RING (or PACKET_TX_RING with `tx`) of geometry `r`: the
/// socket's PACKET_VERSION must already be set.
pub fn set_ring(fd: &OwnedFd, tx: bool, r: &Ring) -> Result<()> {
    let (opt, which) = if tx {
        (PACKET_TX_RING, "PACKET_TX_RING")
    } else {
        (PACKET_RX_RING, "PACKET_RX_RING")
    };
    setsockopt_raw(fd, SOL_PACKET, opt, &r.req3()).map_err(|source| SysError::Syscall {
        what: format!(
            "{which} of {} blocks of {} bytes, {} frames of {}",
            r.block_nr, r.block_size, r.frame_nr, r.frame_size
        ),
        source,
    })
}

/// Join fanout group `value` (id | type << 16 | flags << 24, as
/// getsockopt(PACKET_FANOUT) reads it).
pub fn set_fanout(fd: &OwnedFd, value: u32) -> Result<()> {
    setsockopt_raw(fd, SOL_PACKET, PACKET_FANOUT, &value.to_ne_bytes()).map_err(|source| {
        SysError::Syscall {
            what: format!(
                "PACKET_FANOUT group {} of type {}",
                value & 0xffff,
                (value >> 16) & 0xff
            ),
            source,
        }
    })
}

/// TP_STATUS_SEND_REQUEST | TP_STATUS_SENDING (linux/if_packet.h).
const TX_PENDING: u32 = 0x1 | 0x2;

/// How many frames of the transmit ring `tx` of socket `fd` (after its
/// receive ring `rx`, of version `version`: 0 TPACKET_V1, 1 V2, 2 V3) the
/// program handed to the kernel and it has not sent yet (status
/// SEND_REQUEST or SENDING). Read through a mapping of our own, read-only.
pub fn tx_pending(fd: &OwnedFd, rx: Option<&Ring>, tx: &Ring, version: u32) -> Result<u32> {
    let rx_len = rx.map_or(0, Ring::len);
    let len = rx_len + tx.len();
    // SAFETY: a new read-only shared mapping of the socket's rings, at an
    // address the kernel picks; unmapped below before returning.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if at == libc::MAP_FAILED {
        return Err(SysError::Syscall {
            what: format!("mmap of the {len} bytes of a packet socket's rings"),
            source: Errno::last(),
        });
    }
    // tp_status: at the start of struct tpacket_hdr (V1) and tpacket2_hdr
    // (V2), after five u32 in tpacket3_hdr (V3).
    let status_at = if version == 2 { 20 } else { 0 };
    let mut pending = 0;
    for i in 0..tx.frame_nr {
        let off = rx_len + tx.frame_at(i) + status_at;
        if off + 4 > len {
            break;
        }
        // SAFETY: `off + 4 <= len` lies in the mapping made above; the
        // kernel may write the word at any time, hence a volatile read.
        let status = unsafe { std::ptr::read_volatile(at.cast::<u8>().add(off).cast::<u32>()) };
        if status & TX_PENDING != 0 {
            pending += 1;
        }
    }
    // SAFETY: the mapping made above, no longer used.
    unsafe { libc::munmap(at, len) };
    Ok(pending)
}

/// socket(AF_PACKET, `ty` | SOCK_CLOEXEC, `protocol`).
pub fn socket(ty: i32, protocol: u16) -> Result<OwnedFd> {
    crate::fdio::socket(
        libc::AF_PACKET,
        ty | libc::SOCK_CLOEXEC,
        i32::from(protocol),
    )
}

/// Where the socket is bound (getsockname's sockaddr_ll), with the
/// interface's name as the socket's namespace knows it.
pub fn bound(fd: &OwnedFd) -> Result<Bound> {
    // SAFETY: an all-zero sockaddr_ll is a valid value.
    let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `sa`.
    let r = unsafe {
        libc::getsockname(
            fd.as_raw_fd(),
            (&mut sa as *mut libc::sockaddr_ll).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(SysError::Syscall {
            what: "getsockname of a packet socket".into(),
            source: Errno::last(),
        });
    }
    let ifname = if sa.sll_ifindex == 0 {
        String::new()
    } else {
        ifname(fd, sa.sll_ifindex)?
    };
    Ok(Bound {
        ifindex: sa.sll_ifindex,
        ifname,
        protocol: sa.sll_protocol,
    })
}

/// SOCK_PACKET, the obsolete type of packet socket: bound by interface
/// name (struct sockaddr_pkt), its protocol fixed when it is made.
/// (linux/net.h; libc marks its constant deprecated.)
pub const SOCK_PACKET: i32 = 10;

/// Where a SOCK_PACKET socket is bound: getsockname gives only the
/// interface's name (empty: every interface); the protocol is the one it
/// was made with (SO_PROTOCOL, network order).
pub fn bound_spkt(fd: &OwnedFd) -> Result<Bound> {
    // SAFETY: an all-zero sockaddr is a valid value.
    let mut sa: libc::sockaddr = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `sa`.
    let r = unsafe { libc::getsockname(fd.as_raw_fd(), &mut sa, &mut len) };
    if r < 0 {
        return Err(SysError::Syscall {
            what: "getsockname of a SOCK_PACKET socket".into(),
            source: Errno::last(),
        });
    }
    let name: Vec<u8> = sa
        .sa_data
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    let ifname = String::from_utf8_lossy(&name).into_owned();
    let protocol = crate::fdio::getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_PROTOCOL)? as u16;
    Ok(Bound {
        ifindex: 0,
        ifname,
        protocol,
    })
}

/// Bind a SOCK_PACKET socket to the interface named `ifname`.
pub fn bind_spkt(fd: &OwnedFd, ifname: &str) -> Result<()> {
    // SAFETY: an all-zero sockaddr is a valid value.
    let mut sa: libc::sockaddr = unsafe { std::mem::zeroed() };
    sa.sa_family = libc::AF_PACKET as u16;
    // The kernel reads at most 14 bytes of name and ends it itself.
    for (d, &b) in sa.sa_data.iter_mut().zip(ifname.as_bytes()) {
        *d = b as libc::c_char;
    }
    // SAFETY: the kernel reads size_of::<sockaddr>() bytes from `sa`.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            &sa,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(SysError::Syscall {
            what: format!("bind SOCK_PACKET socket to interface {ifname:?}"),
            source: Errno::last(),
        });
    }
    Ok(())
}

/// The name of interface `index` in the network namespace of socket `fd`
/// (SIOCGIFNAME on the socket itself).
pub fn ifname(fd: &OwnedFd, index: i32) -> Result<String> {
    // SAFETY: an all-zero ifreq is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    ifr.ifr_ifru.ifru_ifindex = index;
    // SAFETY: SIOCGIFNAME reads ifr_ifindex and writes ifr_name (16 bytes) of `ifr`.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFNAME, &mut ifr) };
    if r < 0 {
        return Err(SysError::Syscall {
            what: format!("the name of interface {index}"),
            source: Errno::last(),
        });
    }
    let bytes: Vec<u8> = ifr
        .ifr_name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// The index of interface `name` in our network namespace.
pub fn ifindex(name: &str) -> Result<i32> {
    nix::net::if_::if_nametoindex(name)
        .map(|i| i as i32)
        .or_sys(|| format!("the interface {name:?}"))
}

/// Bind to interface `ifindex` (0: all) for `protocol` (network order).
pub fn bind(fd: &OwnedFd, ifindex: i32, protocol: u16) -> Result<()> {
    // SAFETY: an all-zero sockaddr_ll is a valid value.
    let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sa.sll_family = libc::AF_PACKET as u16;
    sa.sll_protocol = protocol;
    sa.sll_ifindex = ifindex;
    // SAFETY: the kernel reads size_of::<sockaddr_ll>() bytes from `sa`.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(SysError::Syscall {
            what: format!("bind packet socket to interface {ifindex}"),
            source: Errno::last(),
        });
    }
    Ok(())
}

/// PACKET_ADD_MEMBERSHIP (struct packet_mreq: an 8-byte address at most).
pub fn add_membership(fd: &OwnedFd, ifindex: i32, kind: u16, address: &[u8]) -> Result<()> {
    let mut mreq = Vec::with_capacity(16);
    mreq.extend_from_slice(&ifindex.to_ne_bytes());
    mreq.extend_from_slice(&kind.to_ne_bytes());
    mreq.extend_from_slice(&(address.len().min(8) as u16).to_ne_bytes());
    let mut addr = [0u8; 8];
    let n = address.len().min(8);
    addr[..n].copy_from_slice(&address[..n]);
    mreq.extend_from_slice(&addr);
    setsockopt_raw(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mreq).map_err(|source| {
        SysError::Syscall {
            what: format!("PACKET_ADD_MEMBERSHIP type {kind} on interface {ifindex}"),
            source,
        }
    })
}

/// The network namespace socket `fd` lives in (SIOCGSKNS).
fn netns_of(fd: &OwnedFd) -> Result<OwnedFd> {
    const SIOCGSKNS: libc::c_ulong = 0x894C;
    // SAFETY: SIOCGSKNS takes no argument and returns a new fd.
    let ns = unsafe { libc::ioctl(fd.as_raw_fd(), SIOCGSKNS) };
    if ns < 0 {
        return Err(SysError::Syscall {
            what: "ioctl(SIOCGSKNS) of a packet socket".into(),
            source: Errno::last(),
        });
    }
    // SAFETY: the ioctl returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(ns) })
}

/// packet_diag's view of socket `fd` (inode `ino`), asked in its own
/// network namespace. None: the kernel does not list it.
pub fn diag(fd: &OwnedFd, ino: u64) -> Result<Option<Diag>> {
    let ns = netns_of(fd)?;
    let what = || format!("packet_diag of socket:[{ino}]");
    crate::ns::in_net_ns(Some(&ns), || {
        let seq = sock_diag::next_seq();
        let mut req = Vec::with_capacity(16);
        req.push(libc::AF_PACKET as u8);
        req.push(0);
        req.extend_from_slice(&0u16.to_ne_bytes());
        req.extend_from_slice(&0u32.to_ne_bytes());
        let show =
            PACKET_SHOW_INFO | PACKET_SHOW_MCLIST | PACKET_SHOW_RING_CFG | PACKET_SHOW_FANOUT;
        req.extend_from_slice(&show.to_ne_bytes());
        req.extend_from_slice(&[0xff; 8]);
        let msg = sock_diag::message(
            sock_diag::SOCK_DIAG_BY_FAMILY,
            sock_diag::NLM_F_REQUEST | sock_diag::NLM_F_DUMP,
            seq,
            &req,
        );
        let mut found = None;
        sock_diag::exchange(&msg, seq, &mut |_, payload| {
            if u32_at(payload, 4).map(u64::from) == Some(ino) {
                found = Some(parse(payload)?);
            }
            Ok(())
        })
        .map_err(|e| e.into_sys_error(what()))?;
        Ok(found)
    })
}

/// struct packet_diag_ring: seven u32.
fn ring(data: &[u8]) -> std::result::Result<Ring, QueryError> {
    let f = |i: usize| {
        u32_at(data, i * 4).ok_or_else(|| {
            QueryError::Malformed(format!("packet_diag_ring of {} bytes", data.len()))
        })
    };
    Ok(Ring {
        block_size: f(0)?,
        block_nr: f(1)?,
        frame_size: f(2)?,
        frame_nr: f(3)?,
        retire_tmo: f(4)?,
        sizeof_priv: f(5)?,
        features: f(6)?,
    })
}

fn parse(payload: &[u8]) -> std::result::Result<Diag, QueryError> {
    let attrs = attributes(payload.get(DIAG_MSG_LEN..).unwrap_or_default())
        .map_err(|len| QueryError::Malformed(format!("attribute of length {len}")))?;
    let mut d = Diag::default();
    for (ty, data) in attrs {
        match ty {
            PACKET_DIAG_MCLIST => {
                for m in data.chunks_exact(MCLIST_LEN) {
                    let alen = usize::from(u16_at(m, 10).unwrap_or(0)).min(32);
                    d.memberships.push(Membership {
                        ifindex: u32_at(m, 0).unwrap_or(0) as i32,
                        count: u32_at(m, 4).unwrap_or(0),
                        kind: u16_at(m, 8).unwrap_or(0),
                        address: m[12..12 + alen].to_vec(),
                    });
                }
            }
            PACKET_DIAG_RX_RING => d.rx_ring = Some(ring(data)?),
            PACKET_DIAG_TX_RING => d.tx_ring = Some(ring(data)?),
            PACKET_DIAG_FANOUT => {
                d.fanout = Some(u32_at(data, 0).ok_or_else(|| {
                    QueryError::Malformed("PACKET_DIAG_FANOUT shorter than 4 bytes".into())
                })?)
            }
            _ => {}
        }
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bound_socket_is_seen_with_its_membership() {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        let s = socket(libc::SOCK_DGRAM, proto).unwrap();
        let lo = ifindex("lo").unwrap();
        bind(&s, lo, proto).unwrap();
        add_membership(&s, lo, 2, &[]).unwrap(); // PACKET_MR_ALLMULTI
        let b = bound(&s).unwrap();
        assert_eq!(
            (b.ifindex, b.ifname.as_str(), b.protocol),
            (lo, "lo", proto)
        );
        let ino = crate::fdio::inode(&s).unwrap();
        let d = diag(&s, ino)
            .unwrap()
            .expect("packet_diag lists the socket");
        assert_eq!(d.memberships.len(), 1);
        assert_eq!(
            (
                d.memberships[0].ifindex,
                d.memberships[0].kind,
                d.memberships[0].count
            ),
            (lo, 2, 1)
        );
        assert!(d.rx_ring.is_none() && d.tx_ring.is_none() && d.fanout.is_none());
    }
}
