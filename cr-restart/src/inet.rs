//! IPv4 and IPv6 sockets rebuilt inside the restorer: TCP listeners (bound
//! and listening again), unconnected TCP sockets, UDP sockets (bound and
//! connected again), and established TCP connections, built in repair mode
//! without a handshake: sequence numbers, negotiated options, timestamp
//! clock, windows and both queues as the dump saw them.
//!
//! Addresses may be rewritten (`cr_restart --map-addr OLD=NEW`), on both
//! ends of a connection, so that processes that talked over TCP keep their
//! connection when they are restored on other hosts.
//!
//! Repair mode is left at the release ([`finish`]), after the image's
//! network lock is removed: the window probe sent then makes the peer
//! answer at once, and the bytes that had never been sent go out as normal
//! data.

use crate::error::{RestoreError, StepContext};
use cr_image::proto;
use cr_sys::inet::{self as sys, TcpQueue};
use cr_sys::SysError;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

/// `OLD=NEW` rewrites of IP addresses.
#[derive(Debug, Clone, Default)]
pub struct AddrMap(Vec<(IpAddr, IpAddr)>);

impl AddrMap {
    /// Parse `OLD=NEW` specifications.
    pub fn parse(specs: &[String]) -> Result<AddrMap, String> {
        let mut v = Vec::new();
        for s in specs {
            let (a, b) = s
                .split_once('=')
                .ok_or_else(|| format!("--map-addr {s}: expected OLD=NEW"))?;
            let parse = |x: &str| {
                x.trim()
                    .trim_matches(|c| c == '[' || c == ']')
                    .parse::<IpAddr>()
                    .map_err(|_| format!("--map-addr {s}: {x:?} is not an IP address"))
            };
            let (old, new) = (parse(a)?, parse(b)?);
            if old.is_ipv4() != new.is_ipv4() {
                return Err(format!(
                    "--map-addr {s}: both addresses must be IPv4, or both IPv6"
                ));
            }
            v.push((sys::canonical_ip(old), new));
        }
        Ok(AddrMap(v))
    }

    /// `a` with its IP rewritten (an IPv4-mapped IPv6 address stays mapped).
    pub fn map(&self, a: SocketAddr) -> SocketAddr {
        let ip = sys::canonical_ip(a.ip());
        let Some(&(_, new)) = self.0.iter().find(|(old, _)| *old == ip) else {
            return a;
        };
        match (a, new) {
            (SocketAddr::V6(v6), IpAddr::V4(n4)) => {
                SocketAddr::new(IpAddr::V6(n4.to_ipv6_mapped()), v6.port())
            }
            (_, n) => SocketAddr::new(n, a.port()),
        }
    }
}

/// What [`finish`] does for a connection at the release.
pub struct Pending {
    pub id: u64,
    local: SocketAddr,
    remote: SocketAddr,
    /// Bytes the program wrote that had never been sent.
    unsent: Vec<u8>,
    /// The program's SO_REUSEADDR (repair mode clobbers it).
    reuse: i32,
}

fn parse(addr: &str, map: &AddrMap, id: u64) -> Result<Option<SocketAddr>, RestoreError> {
    if addr.is_empty() {
        return Ok(None);
    }
    addr.parse::<SocketAddr>()
        .map(|a| Some(map.map(a)))
        .map_err(|_| {
            RestoreError::Unsupported(format!("socket:[{id}] has a damaged address {addr:?}"))
        })
}

/// Whether `o` is a listener (created before the other sockets, so that
/// sockets sharing its port never stand in its way).
pub fn is_listener(o: &proto::FileObject) -> bool {
    o.inet
        .as_ref()
        .is_some_and(|s| s.state == sys::TCP_LISTEN as u32)
}

/// Create the socket of object `o`; established connections come back in
/// repair mode with a [`Pending`] for the release.
pub fn create(
    o: &proto::FileObject,
    map: &AddrMap,
) -> Result<(OwnedFd, Option<Pending>), RestoreError> {
    let s = o.inet.clone().unwrap_or_default();
    let id = o.id;
    let local = parse(&s.local, map, id)?;
    let remote = parse(&s.remote, map, id)?;
    let proto_name = if s.protocol as i32 == libc::IPPROTO_TCP {
        "TCP"
    } else {
        "UDP"
    };
    let what = || {
        format!(
            "cannot rebuild {proto_name} socket:[{id}] {}{}",
            local
                .map(|a| a.to_string())
                .unwrap_or_else(|| "(unbound)".into()),
            remote.map(|a| format!(" -> {a}")).unwrap_or_default()
        )
    };
    let sock = sys::socket(s.family as i32, s.sock_type as i32, s.protocol as i32).step(what)?;
    let reuse = saved_int(&s, libc::SOL_SOCKET, libc::SO_REUSEADDR).unwrap_or(0);
    if s.protocol as i32 == libc::IPPROTO_TCP && s.state == sys::TCP_ESTABLISHED as u32 {
        let c = s.tcp.clone().ok_or_else(|| {
            RestoreError::Unsupported(format!("socket:[{id}] is established but has no TCP state"))
        })?;
        let (Some(l), Some(r)) = (local, remote) else {
            return Err(RestoreError::Unsupported(format!(
                "established socket:[{id}] lacks an address"
            )));
        };
        let unsent = repair(&sock, &s, &c, l, r).step(what)?;
        debug!(id, local = %l, remote = %r, "TCP connection rebuilt in repair mode");
        return Ok((
            sock,
            Some(Pending {
                id,
                local: l,
                remote: r,
                unsent,
                reuse,
            }),
        ));
    }
    set_options(&sock, &s).step(what)?;
    if let Some(l) = local {
        // Let the old port's TIME-WAIT remnants not stand in the way.
        cr_sys::fdio::setsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1).step(what)?;
        sys::bind(&sock, &l).step(what)?;
        cr_sys::fdio::setsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_REUSEADDR, reuse)
            .step(what)?;
    }
    if s.state == sys::TCP_LISTEN as u32 {
        cr_sys::fdio::listen(&sock, s.backlog as i32).step(what)?;
    } else if let (Some(r), true) = (remote, s.protocol as i32 == libc::IPPROTO_UDP) {
        sys::connect(&sock, &r).step(what)?;
    }
    Ok((sock, None))
}

fn saved_int(s: &proto::InetSocket, level: i32, name: i32) -> Option<i32> {
    s.opts
        .iter()
        .find(|o| o.level == level && o.name == name)
        .and_then(|o| o.value.get(..4))
        .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")))
}

/// Every saved option but SO_REUSEADDR (the caller's) and the buffer
/// sizes (set with the FORCE variants: getsockopt shows twice what was set).
fn set_options(sock: &OwnedFd, s: &proto::InetSocket) -> Result<(), SysError> {
    for o in &s.opts {
        if o.level == libc::SOL_SOCKET {
            match o.name {
                libc::SO_REUSEADDR => continue,
                libc::SO_SNDBUF | libc::SO_RCVBUF => {
                    set_buffer(sock, o.name, saved_int_of(o) as usize)?;
                    continue;
                }
                _ => {}
            }
        }
        if let Err(e) = sys::setsockopt_bytes(sock, o.level, o.name, &o.value) {
            if o.level == libc::IPPROTO_TCP && o.name == libc::TCP_CONGESTION {
                warn!(error = %cr_sys::error::one_line(&e), "congestion control not available here; the default is used");
                continue;
            }
            return Err(e);
        }
    }
    Ok(())
}

fn saved_int_of(o: &proto::SockOpt) -> i32 {
    o.value
        .get(..4)
        .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")))
        .unwrap_or(0)
}

/// Make SO_SNDBUF / SO_RCVBUF read `size` (the kernel doubles what is set).
fn set_buffer(sock: &OwnedFd, name: i32, size: usize) -> Result<(), SysError> {
    let force = if name == libc::SO_SNDBUF {
        libc::SO_SNDBUFFORCE
    } else {
        libc::SO_RCVBUFFORCE
    };
    cr_sys::fdio::setsockopt_int(sock, libc::SOL_SOCKET, force, (size / 2) as i32)
}

/// Build an established connection in repair mode; returns the bytes
/// never sent, queued normally at the release.
fn repair(
    sock: &OwnedFd,
    s: &proto::InetSocket,
    c: &proto::TcpConnection,
    local: SocketAddr,
    remote: SocketAddr,
) -> Result<Vec<u8>, SysError> {
    sys::set_repair(sock, sys::REPAIR_ON)?;
    set_options(sock, s)?;
    let sent = c.send_queue.len() - (c.unsent as usize).min(c.send_queue.len());
    sys::set_repair_queue(sock, TcpQueue::Send)?;
    sys::set_queue_seq(sock, c.snd_una)?;
    sys::set_repair_queue(sock, TcpQueue::Recv)?;
    sys::set_queue_seq(sock, c.rcv_nxt.wrapping_sub(c.recv_queue.len() as u32))?;
    sys::bind(sock, &local)?;
    sys::connect(sock, &remote)?;
    let mut opts = vec![(sys::TCPOPT_MSS, c.mss)];
    if c.options as u8 & sys::TCPI_OPT_WSCALE != 0 {
        opts.push((sys::TCPOPT_WINDOW, c.snd_wscale | (c.rcv_wscale << 16)));
    }
    if c.options as u8 & sys::TCPI_OPT_SACK != 0 {
        opts.push((sys::TCPOPT_SACK_PERM, 0));
    }
    if c.options as u8 & sys::TCPI_OPT_TIMESTAMPS != 0 {
        opts.push((sys::TCPOPT_TIMESTAMP, 0));
    }
    sys::set_repair_options(sock, &opts)?;
    if c.options as u8 & sys::TCPI_OPT_TIMESTAMPS != 0 {
        sys::set_timestamp(sock, c.timestamp)?;
    }
    // Queues: what was sent and not acknowledged, then what was received
    // and not read. Buffers grow as needed for them (set back below).
    sys::set_repair_queue(sock, TcpQueue::Send)?;
    fill(sock, &c.send_queue[..sent], libc::SO_SNDBUF)?;
    sys::set_repair_queue(sock, TcpQueue::Recv)?;
    fill(sock, &c.recv_queue, libc::SO_RCVBUF)?;
    sys::set_repair_queue(sock, TcpQueue::Send)?;
    if c.max_window != 0 {
        sys::set_repair_window(
            sock,
            &sys::RepairWindow {
                snd_wl1: c.snd_wl1,
                snd_wnd: c.snd_wnd,
                max_window: c.max_window,
                rcv_wnd: c.rcv_wnd,
                rcv_wup: c.rcv_wup,
            },
        )?;
    }
    for name in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        if let Some(v) = saved_int(s, libc::SOL_SOCKET, name) {
            set_buffer(sock, name, v as usize)?;
        }
    }
    Ok(c.send_queue[sent..].to_vec())
}

/// Queue `data` on the selected repair queue, growing buffer `buf` when the
/// socket takes no more.
fn fill(sock: &OwnedFd, mut data: &[u8], buf: i32) -> Result<(), SysError> {
    let mut size = cr_sys::fdio::getsockopt_int(sock, libc::SOL_SOCKET, buf)? as usize;
    while !data.is_empty() {
        let n = cr_sys::fdio::send_some(sock, data).or_else(|e| match e {
            // The receive queue answers ENOMEM when the buffer is full.
            SysError::Syscall { source, .. } if source.0 == libc::ENOMEM => Ok(0),
            e => Err(e),
        })?;
        if n == 0 {
            size = size.max(64 << 10) * 2;
            set_buffer(sock, buf, size)?;
            continue;
        }
        data = &data[n..];
    }
    Ok(())
}

/// At the release: guard the rebuilt connections against resets from
/// peers not restored yet (`cr_sys::netlock::guard_resets`, for
/// `guard_secs`), leave repair mode on each (the window probe makes the
/// peer answer at once), give back SO_REUSEADDR, and send the bytes that
/// had never been sent.
pub fn finish(
    sockets: &std::collections::HashMap<u64, OwnedFd>,
    pending: Vec<Pending>,
    guard_secs: u32,
) -> Result<(), RestoreError> {
    if guard_secs > 0 && !pending.is_empty() {
        let conns: Vec<_> = pending.iter().map(|p| (p.local, p.remote)).collect();
        if let Err(e) = cr_sys::netlock::guard_resets(&conns, guard_secs) {
            warn!(error = %cr_sys::error::one_line(&e), "no reset guard: a peer restored after this process may reset its connection");
        }
    }
    let mut unsent = Vec::new();
    for p in pending {
        let Some(sock) = sockets.get(&p.id) else {
            continue;
        };
        let what = || format!("cannot leave repair mode on socket:[{}]", p.id);
        sys::set_repair(sock, sys::REPAIR_OFF).step(what)?;
        cr_sys::fdio::setsockopt_int(sock, libc::SOL_SOCKET, libc::SO_REUSEADDR, p.reuse)
            .step(what)?;
        if !p.unsent.is_empty() {
            unsent.push((sock, p.id, p.unsent));
        }
    }
    // The unsent bytes fit in the send buffer they came from; a slow peer
    // may take a moment to open its window.
    let deadline = Instant::now() + Duration::from_secs(30);
    for (sock, id, data) in unsent {
        let mut rest = &data[..];
        while !rest.is_empty() {
            let n = cr_sys::fdio::send_some(sock, rest)
                .step(|| format!("cannot queue the unsent bytes of socket:[{id}]"))?;
            rest = &rest[n..];
            if n == 0 {
                if Instant::now() > deadline {
                    return Err(RestoreError::Unsupported(format!(
                        "socket:[{id}]: {} unsent bytes could not be queued again (the peer does not read)",
                        rest.len()
                    )));
                }
                sys::wait_writable(sock, 100).step(|| format!("waiting to write socket:[{id}]"))?;
            }
        }
    }
    Ok(())
}
