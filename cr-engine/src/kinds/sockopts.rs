//! Socket options of every socket kind (inet, unix, netlink, packet): which are saved, read
//! as raw bytes when they differ from a fresh socket's of the same shape,
//! and set again at restore.

use cr_image::model::objects::SockOpt;
use cr_sys::inet as sys;
use cr_sys::{fdio, SysError};
use std::collections::HashMap;
use std::os::fd::OwnedFd;

/// (level, option, bytes to read): the options saved when they differ from
/// a fresh socket's. SO_SNDBUF/SO_RCVBUF are restored with the *FORCE
/// variants, which also lock them (no more autotuning), as CRIU does.
const OPTIONS: &[(i32, i32, usize)] = &[
    (libc::SOL_SOCKET, libc::SO_REUSEADDR, 4),
    (libc::SOL_SOCKET, libc::SO_REUSEPORT, 4),
    (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 4),
    (libc::SOL_SOCKET, libc::SO_LINGER, 8),
    (libc::SOL_SOCKET, libc::SO_PRIORITY, 4),
    (libc::SOL_SOCKET, libc::SO_RCVLOWAT, 4),
    (libc::SOL_SOCKET, libc::SO_RCVTIMEO, 16),
    (libc::SOL_SOCKET, libc::SO_SNDTIMEO, 16),
    (libc::SOL_SOCKET, libc::SO_MARK, 4),
    (libc::SOL_SOCKET, libc::SO_BROADCAST, 4),
    (libc::SOL_SOCKET, libc::SO_OOBINLINE, 4),
    (libc::SOL_SOCKET, libc::SO_BINDTODEVICE, 16),
    (libc::SOL_SOCKET, libc::SO_PASSSEC, 4),
    (libc::SOL_SOCKET, libc::SO_SNDBUF, 4),
    (libc::SOL_SOCKET, libc::SO_RCVBUF, 4),
    (libc::SOL_SOCKET, libc::SO_DONTROUTE, 4),
    // UDP over IPv4 without checksums.
    (libc::SOL_SOCKET, libc::SO_NO_CHECK, 4),
    (libc::SOL_SOCKET, libc::SO_PEEK_OFF, 4),
    (libc::SOL_SOCKET, libc::SO_BUSY_POLL, 4),
    (libc::SOL_SOCKET, libc::SO_MAX_PACING_RATE, 8),
    // What a received message's control data carries (timestamps, the
    // count of dropped packets, the error queue in select): programs that
    // ask for it parse it and break when it is missing.
    (libc::SOL_SOCKET, libc::SO_TIMESTAMP, 4),
    (libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, 4),
    (libc::SOL_SOCKET, libc::SO_TIMESTAMPING, 8),
    (libc::SOL_SOCKET, libc::SO_RXQ_OVFL, 4),
    (libc::SOL_SOCKET, libc::SO_SELECT_ERR_QUEUE, 4),
    (libc::SOL_SOCKET, libc::SO_ZEROCOPY, 4),
    (libc::IPPROTO_IP, libc::IP_TOS, 4),
    (libc::IPPROTO_IP, libc::IP_TTL, 4),
    (libc::IPPROTO_IP, libc::IP_FREEBIND, 4),
    (libc::IPPROTO_IP, libc::IP_TRANSPARENT, 4),
    (libc::IPPROTO_IP, libc::IP_MULTICAST_TTL, 4),
    (libc::IPPROTO_IP, libc::IP_MULTICAST_LOOP, 4),
    (libc::IPPROTO_IP, libc::IP_MULTICAST_IF, 4),
    (libc::IPPROTO_IP, libc::IP_MULTICAST_ALL, 4),
    (libc::IPPROTO_IP, libc::IP_PKTINFO, 4),
    (libc::IPPROTO_IP, libc::IP_RECVTTL, 4),
    (libc::IPPROTO_IP, libc::IP_RECVTOS, 4),
    (libc::IPPROTO_IP, libc::IP_RECVOPTS, 4),
    (libc::IPPROTO_IP, libc::IP_RETOPTS, 4),
    (libc::IPPROTO_IP, libc::IP_RECVERR, 4),
    (libc::IPPROTO_IP, libc::IP_RECVORIGDSTADDR, 4),
    (libc::IPPROTO_IP, libc::IP_RECVFRAGSIZE, 4),
    (libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, 4),
    (libc::IPPROTO_IP, libc::IP_BIND_ADDRESS_NO_PORT, 4),
    (libc::IPPROTO_IP, libc::IP_CHECKSUM, 4),
    (libc::IPPROTO_IP, libc::IP_PASSSEC, 4),
    (libc::IPPROTO_IP, libc::IP_OPTIONS, 40),
    (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 4),
    (libc::IPPROTO_IPV6, libc::IPV6_TCLASS, 4),
    (libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS, 4),
    (libc::IPPROTO_IPV6, libc::IPV6_MULTICAST_HOPS, 4),
    (libc::IPPROTO_IPV6, libc::IPV6_MULTICAST_LOOP, 4),
    (libc::IPPROTO_IPV6, libc::IPV6_MULTICAST_IF, 4),
    (libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, 4),
    (libc::IPPROTO_IPV6, libc::IPV6_RECVHOPLIMIT, 4),
    (libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS, 4),
    (libc::IPPROTO_IPV6, libc::IPV6_RECVERR, 4),
    (libc::IPPROTO_IPV6, libc::IPV6_RECVPATHMTU, 4),
    (libc::IPPROTO_IPV6, IPV6_RECVORIGDSTADDR, 4),
    (libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, 4),
    (libc::IPPROTO_IPV6, libc::IPV6_DONTFRAG, 4),
    (libc::IPPROTO_IPV6, IPV6_AUTOFLOWLABEL, 4),
    (libc::IPPROTO_IPV6, IPV6_FREEBIND, 4),
    (libc::IPPROTO_IPV6, IPV6_TRANSPARENT, 4),
    (libc::IPPROTO_UDP, UDP_CORK, 4),
    (libc::IPPROTO_UDP, UDP_SEGMENT, 4),
    (libc::IPPROTO_UDP, UDP_GRO, 4),
    // UDP-Lite: how much of each datagram its checksum covers.
    (libc::IPPROTO_UDPLITE, UDPLITE_SEND_CSCOV, 4),
    (libc::IPPROTO_UDPLITE, UDPLITE_RECV_CSCOV, 4),
    (libc::IPPROTO_TCP, libc::TCP_NODELAY, 4),
    (libc::IPPROTO_TCP, libc::TCP_CORK, 4),
    (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 4),
    (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 4),
    (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 4),
    (libc::IPPROTO_TCP, libc::TCP_SYNCNT, 4),
    (libc::IPPROTO_TCP, libc::TCP_LINGER2, 4),
    (libc::IPPROTO_TCP, libc::TCP_DEFER_ACCEPT, 4),
    (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, 4),
    (libc::IPPROTO_TCP, libc::TCP_NOTSENT_LOWAT, 4),
    (libc::IPPROTO_TCP, libc::TCP_CONGESTION, 16),
    (libc::IPPROTO_TCP, libc::TCP_FASTOPEN, 4),
    (libc::IPPROTO_TCP, libc::TCP_THIN_LINEAR_TIMEOUTS, 4),
    (libc::IPPROTO_TCP, libc::TCP_INQ, 4),
    (libc::IPPROTO_TCP, TCP_TX_DELAY, 4),
    (libc::IPPROTO_TCP, libc::TCP_SAVE_SYN, 4),
    // Raw IP sockets: the header is the program's own, ICMP type filters,
    // where IPv6 puts a checksum.
    (libc::IPPROTO_IP, libc::IP_HDRINCL, 4),
    (SOL_RAW, ICMP_FILTER, 4),
    (libc::IPPROTO_IPV6, IPV6_CHECKSUM, 4),
    (libc::IPPROTO_ICMPV6, ICMPV6_FILTER, 32),
];

const SOL_RAW: i32 = 255;
// Missing from the libc crate (linux/in6.h, linux/tcp.h, linux/udp.h).
const IPV6_AUTOFLOWLABEL: i32 = 70;
const IPV6_RECVORIGDSTADDR: i32 = 74;
const IPV6_TRANSPARENT: i32 = 75;
const IPV6_FREEBIND: i32 = 78;
const TCP_TX_DELAY: i32 = 37;
const UDP_CORK: i32 = 1;
const UDP_SEGMENT: i32 = 103;
const UDP_GRO: i32 = 104;
const UDPLITE_SEND_CSCOV: i32 = 10;
const UDPLITE_RECV_CSCOV: i32 = 11;
const ICMP_FILTER: i32 = 1;
const IPV6_CHECKSUM: i32 = 7;
const ICMPV6_FILTER: i32 = 1;

/// The options of `level`: the table above, the netlink flags and the
/// packet options.
fn table() -> impl Iterator<Item = (i32, i32, usize)> {
    OPTIONS
        .iter()
        .copied()
        .chain(
            cr_sys::netlink::FLAG_OPTIONS
                .iter()
                .map(|&n| (cr_sys::netlink::SOL_NETLINK, n, 4)),
        )
        .chain(
            cr_sys::packet::OPTIONS
                .iter()
                .map(|&n| (cr_sys::packet::SOL_PACKET, n, 4)),
        )
}

/// Whether options of `level` exist for sockets of shape `sh`.
fn level_applies(level: i32, sh: &Shape) -> bool {
    let ip = matches!(sh.family, libc::AF_INET | libc::AF_INET6);
    let raw = ip && sh.ty == libc::SOCK_RAW;
    match level {
        libc::SOL_SOCKET => true,
        libc::IPPROTO_IP => ip,
        libc::IPPROTO_IPV6 => sh.family == libc::AF_INET6,
        libc::IPPROTO_TCP => ip && sh.protocol == libc::IPPROTO_TCP,
        // UDP-Lite sockets take UDP's options too.
        libc::IPPROTO_UDP => ip && matches!(sh.protocol, libc::IPPROTO_UDP | libc::IPPROTO_UDPLITE),
        libc::IPPROTO_UDPLITE => ip && sh.protocol == libc::IPPROTO_UDPLITE,
        SOL_RAW => raw && sh.family == libc::AF_INET && sh.protocol == libc::IPPROTO_ICMP,
        libc::IPPROTO_ICMPV6 => raw && sh.protocol == libc::IPPROTO_ICMPV6,
        cr_sys::netlink::SOL_NETLINK => sh.family == libc::AF_NETLINK,
        cr_sys::packet::SOL_PACKET => sh.family == libc::AF_PACKET,
        _ => false,
    }
}

/// What kind of socket an fd is.
pub struct Shape {
    pub family: i32,
    pub ty: i32,
    pub protocol: i32,
}

pub fn shape(sock: &OwnedFd) -> Shape {
    let get = |opt| fdio::getsockopt_int(sock, libc::SOL_SOCKET, opt).unwrap_or(-1);
    Shape {
        family: get(libc::SO_DOMAIN),
        ty: get(libc::SO_TYPE),
        protocol: get(libc::SO_PROTOCOL),
    }
}

/// Fresh sockets by (family, type, protocol), whose option values are the
/// defaults saved options are compared with. Kept in a capture's stash.
#[derive(Default)]
pub struct Fresh(HashMap<(i32, i32, i32), Option<OwnedFd>>);

/// The options of `sock` that differ from a fresh socket's. A unix
/// socket's buffer sizes are left out (its own fields hold them).
pub fn options(sock: &OwnedFd, sh: &Shape, fresh: &mut Fresh) -> Vec<SockOpt> {
    let key = (sh.family, sh.ty, sh.protocol);
    let fresh = fresh
        .0
        .entry(key)
        .or_insert_with(|| fresh_socket(sh).ok())
        .as_ref();
    let ip = matches!(sh.family, libc::AF_INET | libc::AF_INET6);
    let mut out = Vec::new();
    for (level, name, max) in table() {
        let multicast = (level == libc::IPPROTO_IP
            && matches!(
                name,
                libc::IP_MULTICAST_TTL
                    | libc::IP_MULTICAST_LOOP
                    | libc::IP_MULTICAST_IF
                    | libc::IP_MULTICAST_ALL
            ))
            || (level == libc::IPPROTO_IPV6
                && matches!(
                    name,
                    libc::IPV6_MULTICAST_HOPS | libc::IPV6_MULTICAST_LOOP | libc::IPV6_MULTICAST_IF
                ));
        // Timestamping with OPT_ID is refused on a TCP socket that is not
        // connected yet, which a repaired one is when its options are set.
        let timestamping = level == libc::SOL_SOCKET
            && name == libc::SO_TIMESTAMPING
            && sh.protocol == libc::IPPROTO_TCP;
        // Only TCP and UDP sockets may set it.
        let zerocopy = level == libc::SOL_SOCKET
            && name == libc::SO_ZEROCOPY
            && !(ip && matches!(sh.protocol, libc::IPPROTO_TCP | libc::IPPROTO_UDP));
        let buffer = level == libc::SOL_SOCKET && matches!(name, libc::SO_SNDBUF | libc::SO_RCVBUF);
        // IPV6_CHECKSUM is a raw socket's option (an ICMPv6 one refuses it).
        let checksum = level == libc::IPPROTO_IPV6 && name == IPV6_CHECKSUM;
        if !level_applies(level, sh)
            || (buffer && sh.family == libc::AF_UNIX)
            || (multicast && sh.protocol != libc::IPPROTO_UDP)
            || timestamping
            || zerocopy
            || (checksum && (sh.ty != libc::SOCK_RAW || sh.protocol == libc::IPPROTO_ICMPV6))
            || (level == libc::IPPROTO_IP && name == libc::IP_HDRINCL && sh.ty != libc::SOCK_RAW)
        {
            continue;
        }
        let Ok(v) = sys::getsockopt_bytes(sock, level, name, max) else {
            continue;
        };
        let default = fresh.and_then(|f| sys::getsockopt_bytes(f, level, name, max).ok());
        if default.as_deref() == Some(&v[..]) {
            continue;
        }
        if name == libc::SO_BINDTODEVICE && level == libc::SOL_SOCKET && v.iter().all(|&b| b == 0) {
            continue;
        }
        out.push(SockOpt {
            level,
            name,
            value: v,
        });
    }
    // A classic BPF filter, then whether it is locked (set in this order).
    if let Ok(program) = sys::socket_filter(sock) {
        if !program.is_empty() {
            out.push(SockOpt {
                level: libc::SOL_SOCKET,
                name: sys::SO_ATTACH_FILTER,
                value: program,
            });
        }
    }
    // Buffer locks (IP sockets, whose buffer sizes are saved here): also
    // when 0 if a size is restored, since the FORCE variants lock it.
    let sized = out.iter().any(|o| {
        o.level == libc::SOL_SOCKET && matches!(o.name, libc::SO_SNDBUF | libc::SO_RCVBUF)
    });
    for (name, keep_zero) in [(sys::SO_LOCK_FILTER, false), (sys::SO_BUF_LOCK, sized)] {
        if name == sys::SO_BUF_LOCK && !ip {
            continue;
        }
        if let Ok(v) = fdio::getsockopt_int(sock, libc::SOL_SOCKET, name) {
            if v != 0 || keep_zero {
                out.push(SockOpt {
                    level: libc::SOL_SOCKET,
                    name,
                    value: v.to_le_bytes().to_vec(),
                });
            }
        }
    }
    out
}

/// A socket of shape `sh` as made new. A packet socket's is made for no
/// protocol, so that it receives nothing while it exists.
fn fresh_socket(sh: &Shape) -> Result<OwnedFd, SysError> {
    match sh.family {
        libc::AF_NETLINK => cr_sys::netlink::socket(sh.ty, sh.protocol),
        libc::AF_PACKET => cr_sys::packet::socket(sh.ty, 0),
        _ => sys::socket(sh.family, sh.ty, sh.protocol),
    }
}

/// Set saved options again, but SO_REUSEADDR (the caller sets it when it
/// is safe) and the buffer sizes (set with the FORCE variants: getsockopt
/// shows twice what was set). A congestion control this kernel lacks is
/// left at the default with a warning.
pub fn set_options(sock: &OwnedFd, opts: &[SockOpt]) -> Result<(), SysError> {
    for o in opts {
        if o.level == libc::SOL_SOCKET {
            match o.name {
                libc::SO_REUSEADDR => continue,
                libc::SO_SNDBUF | libc::SO_RCVBUF => {
                    set_buffer(sock, o.name, o.int().unwrap_or(0).max(0) as usize)?;
                    continue;
                }
                sys::SO_ATTACH_FILTER => {
                    sys::attach_socket_filter(sock, &o.value)?;
                    continue;
                }
                _ => {}
            }
        }
        if let Err(e) = sys::setsockopt_bytes(sock, o.level, o.name, &o.value) {
            // Saved as 0 (off) because no fresh socket of the shape could be
            // made to compare with (a ping socket outside the restorer's
            // group range), on a socket that cannot set it at all: off it is.
            let unsettable = matches!(
                e.errno(),
                Some(libc::EOPNOTSUPP | libc::ENOPROTOOPT | libc::EINVAL)
            );
            if unsettable && o.value.iter().all(|&b| b == 0) {
                continue;
            }
            if o.level == libc::IPPROTO_TCP && o.name == libc::TCP_CONGESTION {
                tracing::warn!(error = %cr_sys::error::one_line(&e), "congestion control not available here; the default is used");
                continue;
            }
            return Err(e);
        }
    }
    Ok(())
}

/// Make SO_SNDBUF / SO_RCVBUF read `size` (the kernel doubles what is set).
pub fn set_buffer(sock: &OwnedFd, name: i32, size: usize) -> Result<(), SysError> {
    let force = if name == libc::SO_SNDBUF {
        libc::SO_SNDBUFFORCE
    } else {
        libc::SO_RCVBUFFORCE
    };
    fdio::setsockopt_int(sock, libc::SOL_SOCKET, force, (size / 2) as i32)
}
