//! Restore of kind "inet": IPv4 and IPv6 sockets rebuilt inside the
//! restorer: TCP listeners (bound
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
use crate::kinds::sockopts::{set_buffer, set_options};
use crate::options::AddrRewrite;
use crate::restore::Restorer;
use cr_image::model::objects::{InetSocket, TcpConnection};
use cr_image::model::{Checkpoint, ObjectKind};
use cr_sys::inet::{self as sys, TcpQueue};
use cr_sys::{proc, SysError};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

/// `OLD=NEW` rewrites of IP addresses, and `OLD:PORT=NEW` of one
/// endpoint (those win over the address's own).
#[derive(Debug, Clone, Default)]
pub struct AddrMap(Vec<(IpAddr, Option<u16>, IpAddr)>);

impl AddrMap {
    pub fn new(rewrites: &[AddrRewrite]) -> AddrMap {
        let mut v: Vec<_> = rewrites
            .iter()
            .map(|r| (sys::canonical_ip(r.old), r.port, r.new))
            .collect();
        v.sort_by_key(|(_, port, _)| port.is_none());
        AddrMap(v)
    }

    /// `a` with its IP rewritten (an IPv4-mapped IPv6 address stays mapped).
    pub fn map(&self, a: SocketAddr) -> SocketAddr {
        let ip = sys::canonical_ip(a.ip());
        let Some(&(_, _, new)) = self
            .0
            .iter()
            .find(|(old, port, _)| *old == ip && port.is_none_or(|p| p == a.port()))
        else {
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
    /// Its receive side was shut (shutdown(SHUT_RD) sends nothing).
    shut_rd: bool,
    /// The program's FIN never left: sent after the unsent bytes.
    fin: bool,
    /// CLOSING with that FIN: the peer's FIN, forged after it.
    peer_fin: Option<cr_sys::forged::Segment>,
    /// SYN-SENT: connected (the SYN sent again) at the release.
    connect: bool,
}

/// The restorer's TCP and UDP sockets by object, and the connections to
/// take out of repair mode at the release.
#[derive(Default)]
struct Held {
    sockets: HashMap<u64, OwnedFd>,
    pending: Vec<Pending>,
    /// The reset guard going in ahead of the release (see [`prepare`]):
    /// when it was in, or why not.
    guard: Option<std::thread::JoinHandle<(Instant, Result<(), String>)>>,
}

/// The connections the reset guard covers: (local, remote) of each
/// rebuilt connection but those being made (a peer that is not there
/// refuses those at once, as it would have refused the original).
fn guarded(pending: &[Pending]) -> Vec<(SocketAddr, SocketAddr)> {
    pending
        .iter()
        .filter(|p| !p.connect)
        .map(|p| (p.local, p.remote))
        .collect()
}

/// Create every TCP and UDP socket of the image, listeners first (so that
/// sockets sharing their ports never stand in their way).
pub fn prepare(r: &mut Restorer<'_>, ck: &Checkpoint) -> Result<(), RestoreError> {
    let map = AddrMap::new(&r.opts.map_addr);
    let inet = ck.objects.iter().filter_map(|o| match &o.kind {
        ObjectKind::InetSocket(s) => Some((o.id, s)),
        _ => None,
    });
    let (listeners, others): (Vec<_>, Vec<_>) =
        inet.partition(|(_, s)| s.state == sys::TCP_LISTEN as u32);
    let shared = shared_ports(listeners.iter().chain(&others).map(|(_, s)| *s));
    let tcp_close = r.opts.tcp_close;
    let guard_secs = r.opts.reset_guard;
    let held = r.stash.get::<Held>();
    let mut reuse_later = Vec::new();
    for (id, s) in listeners.into_iter().chain(others) {
        let port = port_key(s);
        let share = port.is_some_and(|k| shared.contains(&k));
        let (sock, pending) = create(id, s, &map, tcp_close, share)?;
        if share {
            reuse_later.push((
                id,
                s.int_opt(libc::SOL_SOCKET, libc::SO_REUSEPORT).unwrap_or(0),
            ));
        }
        held.sockets.insert(id, sock);
        held.pending.extend(pending);
    }
    // Once all are bound and listening: a program may have turned
    // SO_REUSEPORT off on one of them after it bound (the kernel checks
    // the option only at bind and listen).
    for (id, reuse) in reuse_later {
        if let Some(sock) = held.sockets.get(&id) {
            cr_sys::fdio::setsockopt_int(sock, libc::SOL_SOCKET, libc::SO_REUSEPORT, reuse)
                .step(|| format!("cannot set SO_REUSEPORT of socket:[{id}]"))?;
        }
    }
    // The reset guard (see [`finish`]) goes in now, on a thread of its
    // own, while the rest of the tree is rebuilt: its nft run (tens of ms)
    // is then out of the release, inside a migration's downtime. Nothing
    // changes for the connections: they stay in repair mode, behind the
    // image's network lock, until the release; a guard left by a restore
    // that fails only drops resets for a while (its elements expire).
    let conns = guarded(&held.pending);
    if guard_secs > 0 && !conns.is_empty() {
        held.guard = std::thread::Builder::new()
            .name("reset-guard".into())
            .spawn(move || {
                let res = cr_sys::netlock::guard_resets(&conns, guard_secs)
                    .map_err(|e| cr_sys::error::one_line(&e));
                (Instant::now(), res)
            })
            .ok();
    }
    Ok(())
}

/// The port a socket not connected over TCP holds alone or with others
/// (protocol, port), if bound.
fn port_key(s: &InetSocket) -> Option<(u32, u16)> {
    let connection = s.protocol as i32 == libc::IPPROTO_TCP && super::is_connection(s.state as u8);
    s.local
        .filter(|_| !connection)
        .map(|l| (s.protocol, l.port()))
}

/// Ports that several sockets of the image bind (with SO_REUSEPORT, at
/// the time they bound): each is bound with the option on, and given its
/// own value once all are (see [`prepare`]).
fn shared_ports<'a>(
    socks: impl Iterator<Item = &'a InetSocket>,
) -> std::collections::HashSet<(u32, u16)> {
    let mut seen = std::collections::HashSet::new();
    let mut shared = std::collections::HashSet::new();
    for k in socks.filter_map(port_key) {
        if !seen.insert(k) {
            shared.insert(k);
        }
    }
    shared
}

/// A description of socket `id`, for a process to take.
pub fn description(r: &mut Restorer<'_>, id: u64) -> Result<OwnedFd, RestoreError> {
    crate::kinds::sockets::hand_over(r.stash.get::<Held>().sockets.get(&id), id)
}

/// Whether `s` is a ping socket (an ICMP datagram socket).
fn is_ping(s: &InetSocket) -> bool {
    s.sock_type as i32 == libc::SOCK_DGRAM
        && matches!(s.protocol as i32, libc::IPPROTO_ICMP | libc::IPPROTO_ICMPV6)
}

/// A ping socket the restorer's own group may not make (outside
/// net.ipv4.ping_group_range, which binds root too): made as the first
/// group of the range, on a thread of its own.
fn ping_socket(s: &InetSocket) -> Result<OwnedFd, SysError> {
    let (lo, hi) = sys::ping_group_range()?;
    if lo > hi {
        return Err(SysError::Syscall {
            what: format!(
                "no group may make ping sockets in this network namespace (net.ipv4.ping_group_range is {lo} {hi})"
            ),
            source: cr_sys::Errno(libc::EACCES),
        });
    }
    debug!(
        gid = lo,
        "ping socket made as a group of net.ipv4.ping_group_range"
    );
    sys::socket_as_group(s.family as i32, s.sock_type as i32, s.protocol as i32, lo)
}

/// Create the socket of object `id`; established connections come back in
/// repair mode with a [`Pending`] for the release, or closed (`tcp_close`,
/// `cr_restart --tcp-close`).
fn create(
    id: u64,
    s: &InetSocket,
    map: &AddrMap,
    tcp_close: bool,
    shared_port: bool,
) -> Result<(OwnedFd, Option<Pending>), RestoreError> {
    let local = s.local.map(|a| map.map(a));
    let remote = s.remote.map(|a| map.map(a));
    let proto_name = super::proto_name(s.family as i32, s.sock_type as i32, s.protocol as i32);
    let what = || {
        format!(
            "cannot rebuild {proto_name} socket:[{id}] {}{}",
            local
                .map(|a| a.to_string())
                .unwrap_or_else(|| "(unbound)".into()),
            remote.map(|a| format!(" -> {a}")).unwrap_or_default()
        )
    };
    let sock = match sys::socket(s.family as i32, s.sock_type as i32, s.protocol as i32) {
        Err(e) if e.errno() == Some(libc::EACCES) && is_ping(s) => ping_socket(s).step(what)?,
        r => r.step(what)?,
    };
    let reuse = s.int_opt(libc::SOL_SOCKET, libc::SO_REUSEADDR).unwrap_or(0);
    let state = s.state as u8;
    if s.protocol as i32 == libc::IPPROTO_TCP && super::is_connection(state) && tcp_close {
        // A socket never connected, shut both ways: the kernel refuses the
        // call (ENOTCONN) but keeps the bits, so reads end at once, poll
        // reports a hang-up and writes fail with EPIPE, as on a connection
        // reset. Unbound: the old port stays free.
        set_options(&sock, &s.opts).step(what)?;
        shutdown(&sock, 3).step(what)?;
        debug!(id, local = ?local, remote = ?remote, "TCP connection restored closed (--tcp-close)");
        return Ok((sock, None));
    }
    if s.protocol as i32 == libc::IPPROTO_TCP && super::is_connection(state) {
        let c = s.tcp.as_ref().ok_or_else(|| {
            RestoreError::Unsupported(format!("socket:[{id}] is connected but has no TCP state"))
        })?;
        let (Some(l), Some(r)) = (local, remote) else {
            return Err(RestoreError::Unsupported(format!(
                "connected socket:[{id}] lacks an address"
            )));
        };
        let mut pending = Pending {
            id,
            local: l,
            remote: r,
            unsent: Vec::new(),
            reuse,
            shut_rd: s.shutdown & 1 != 0,
            fin: c.fin_unsent,
            peer_fin: None,
            connect: state == sys::TCP_SYN_SENT,
        };
        if pending.connect {
            before_connect(&sock, s, c, l).step(what)?;
            debug!(id, local = %l, remote = %r, "TCP socket to connect at the release");
        } else {
            pending.unsent = repair(&sock, s, c, l, r).step(what)?;
            pending.peer_fin = replay_fins(&sock, state, c, l, r).step(what)?;
            set_window(&sock, c, pending.peer_fin.is_some()).step(what)?;
            debug!(id, local = %l, remote = %r, state = sys::tcp_state_name(state), "TCP connection rebuilt in repair mode");
        }
        return Ok((sock, Some(pending)));
    }
    let ended_connection = s.protocol as i32 == libc::IPPROTO_TCP
        && s.state == sys::TCP_CLOSE as u32
        && s.shutdown == 3;
    if let (true, Some(l), Some(r)) = (ended_connection, local, remote) {
        ended(&sock, s, l, r).step(what)?;
        debug!(id, local = %l, remote = %r, "ended TCP connection restored closed, with its addresses");
        return Ok((sock, None));
    }
    set_options(&sock, &s.opts).step(what)?;
    if shared_port {
        cr_sys::fdio::setsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_REUSEPORT, 1).step(what)?;
    }
    if let Some(l) = local {
        // Let the old port's TIME-WAIT remnants not stand in the way.
        cr_sys::fdio::setsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1).step(what)?;
        bind_over_remnants(&sock, l)
            .or_else(|e| bind_freely(&sock, l, s, e))
            .step(what)?;
        cr_sys::fdio::setsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_REUSEADDR, reuse)
            .step(what)?;
    }
    if let (Some(l), false) = (local, s.received.is_empty()) {
        // Before connect(): a datagram queued before the program connected
        // may come from another sender, which a connected socket refuses.
        requeue(&sock, s, l, map).step(what)?;
    }
    if s.state == sys::TCP_LISTEN as u32 {
        cr_sys::fdio::listen(&sock, s.backlog as i32).step(what)?;
    } else if let (Some(r), true) = (remote, s.sock_type as i32 != libc::SOCK_STREAM) {
        sys::connect(&sock, &r).step(what)?;
    }
    let tcp_closed = s.protocol as i32 == libc::IPPROTO_TCP && s.state == sys::TCP_CLOSE as u32;
    if tcp_closed || matches!(s.protocol as i32, libc::IPPROTO_UDP | libc::IPPROTO_UDPLITE) {
        shutdown(&sock, s.shutdown).step(what)?;
    }
    Ok((sock, None))
}

/// A TCP connection that ended (in CLOSE, shut both ways: closed both
/// ways or reset) made again with its addresses, which the program may
/// still ask for (SO_PEERNAME, getsockname): in repair mode `sock` is
/// bound to `local` and connected to `remote` (no packet: it is
/// ESTABLISHED at once), then aborted through sock_diag (`tcp_abort`),
/// which leaves it in CLOSE, shut both ways, its addresses kept; its
/// pending ECONNABORTED is cleared, so reads end and writes get EPIPE as
/// before. The abort sends one reset from the old connection's addresses,
/// with a sequence number the peer does not expect (a peer still in
/// TIME-WAIT, and any RFC 5961 stack, ignores it).
fn ended(
    sock: &OwnedFd,
    s: &InetSocket,
    local: SocketAddr,
    remote: SocketAddr,
) -> Result<(), SysError> {
    sys::set_repair(sock, sys::REPAIR_ON)?;
    set_options(sock, &s.opts)?;
    let inode = cr_sys::fdio::inode(sock)?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    sys::set_repair_queue(sock, TcpQueue::Send)?;
    sys::set_queue_seq(sock, nanos ^ (inode as u32).rotate_left(16))?;
    sys::bind(sock, &local)?;
    sys::connect(sock, &remote)?;
    if cr_sys::inet_diag::abort(local, remote, inode)?.is_none() {
        return Err(SysError::Command {
            what: format!("closing the TCP socket {local} -> {remote} just made"),
            detail: "sock_diag does not find it".into(),
        });
    }
    // ECONNABORTED, pending since the abort.
    let _ = cr_sys::fdio::getsockopt_int(sock, libc::SOL_SOCKET, libc::SO_ERROR);
    sys::set_repair(sock, sys::REPAIR_OFF)
}

/// Give the rebuilt UDP socket `sock` (bound to `local`) the datagrams
/// that waited in its receive queue, each forged as coming from its sender
/// (rewritten like every address), oldest first; then wait until they are
/// all queued (a looped-back packet is taken in by the network stack
/// shortly after it was sent, not by the send itself).
fn requeue(
    sock: &OwnedFd,
    s: &InetSocket,
    local: SocketAddr,
    map: &AddrMap,
) -> Result<(), SysError> {
    for d in &s.received {
        let from = map.map(d.from);
        // A socket bound to the wildcard address is reached through the
        // loopback address of the sender's family.
        let to_ip = match (sys::canonical_ip(local.ip()), sys::canonical_ip(from.ip())) {
            (ip, _) if !ip.is_unspecified() => ip,
            (_, IpAddr::V4(_)) => IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
            (_, IpAddr::V6(_)) => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        };
        cr_sys::forged::send_datagram(&cr_sys::forged::Datagram {
            from,
            to: SocketAddr::new(to_ip, local.port()),
            payload: &d.data,
            lite: s.protocol as i32 == libc::IPPROTO_UDPLITE,
        })?;
    }
    let mut queued = 0;
    let back = cr_sys::deadline::poll(Duration::from_secs(2), Duration::from_millis(1), || {
        queued = sys::peek_datagrams(sock)?.len();
        Ok::<_, SysError>((queued >= s.received.len()).then_some(()))
    })?;
    if back.is_none() {
        return Err(SysError::Syscall {
            what: format!(
                "{} of the {} datagrams queued at {local} came back (dropped by a filter or a full receive buffer?)",
                queued,
                s.received.len()
            ),
            source: cr_sys::Errno(libc::ETIMEDOUT),
        });
    }
    debug!(%local, datagrams = queued, "UDP receive queue given back");
    Ok(())
}

/// Bind `sock` to `local`; when the port is taken by sockets no process
/// holds any more (connections of the killed original accepted on that
/// port, closing or in TIME-WAIT, whose owner did not set SO_REUSEADDR),
/// they are destroyed and the bind tried again.
fn bind_over_remnants(sock: &OwnedFd, local: SocketAddr) -> Result<(), SysError> {
    let Err(e) = sys::bind(sock, &local) else {
        return Ok(());
    };
    if e.errno() != Some(libc::EADDRINUSE) {
        return Err(e);
    }
    let states = cr_sys::inet_diag::destroy_orphans_on_port(local)?;
    if states.is_empty() {
        return Err(e);
    }
    let states: Vec<&str> = states.iter().map(|&s| sys::tcp_state_name(s)).collect();
    tracing::info!(%local, ?states, "destroyed lingering sockets of this port");
    sys::bind(sock, &local)
}

/// A bind to an address this host lacks (`e` is EADDRNOTAVAIL): the
/// program bound with IP_FREEBIND and may have cleared it since (the
/// kernel checks it only at bind). Bound again with the option on, then
/// given its saved value (IPv6 sockets share the flag with IPV6_FREEBIND).
fn bind_freely(
    sock: &OwnedFd,
    local: SocketAddr,
    s: &InetSocket,
    e: SysError,
) -> Result<(), SysError> {
    if e.errno() != Some(libc::EADDRNOTAVAIL) {
        return Err(e);
    }
    let saved = s.int_opt(libc::IPPROTO_IP, libc::IP_FREEBIND).unwrap_or(0);
    cr_sys::fdio::setsockopt_int(sock, libc::IPPROTO_IP, libc::IP_FREEBIND, 1)?;
    bind_over_remnants(sock, local)?;
    debug!(%local, "bound with IP_FREEBIND (the address is not on this host)");
    cr_sys::fdio::setsockopt_int(sock, libc::IPPROTO_IP, libc::IP_FREEBIND, saved)
}

/// Build an established connection in repair mode; returns the bytes
/// never sent, queued normally at the release.
fn repair(
    sock: &OwnedFd,
    s: &InetSocket,
    c: &TcpConnection,
    local: SocketAddr,
    remote: SocketAddr,
) -> Result<Vec<u8>, SysError> {
    sys::set_repair(sock, sys::REPAIR_ON)?;
    set_options(sock, &s.opts)?;
    let sent = c.send_queue.len() - (c.unsent as usize).min(c.send_queue.len());
    sys::set_repair_queue(sock, TcpQueue::Send)?;
    sys::set_queue_seq(sock, c.snd_una)?;
    sys::set_repair_queue(sock, TcpQueue::Recv)?;
    sys::set_queue_seq(sock, c.rcv_nxt.wrapping_sub(c.recv_queue.len() as u32))?;
    // The segment size a connection sends is worked out at the connect from
    // its MSS clamp, which is still the 536 default then (the repair options
    // set it only after the connect, and nothing works it out again: the
    // handshake would): rebuilt connections sent 524-byte segments, 3 to
    // 100 times more than before. The saved clamp as TCP_MAXSEG during the
    // connect makes the connect use it (the kernel takes at most 32767).
    let clamp = c.mss.min(sys::TCP_MAXSEG_MAX);
    if clamp >= sys::TCP_MAXSEG_MIN {
        cr_sys::fdio::setsockopt_int(sock, libc::IPPROTO_TCP, libc::TCP_MAXSEG, clamp as i32)?;
    }
    sys::bind(sock, &local)?;
    if let Err(e) = sys::connect(sock, &remote) {
        // The killed original's socket (or an earlier restore's) may still
        // linger with these addresses; no process holds it: it goes.
        if e.errno() != Some(libc::EADDRNOTAVAIL) {
            return Err(e);
        }
        let Some(state) = cr_sys::inet_diag::destroy_orphan(local, remote)? else {
            return Err(e);
        };
        tracing::info!(%local, %remote, state = sys::tcp_state_name(state), "destroyed a lingering socket of this connection");
        sys::connect(sock, &remote)?;
    }
    // The program had set no TCP_MAXSEG of its own (none is saved).
    cr_sys::fdio::setsockopt_int(sock, libc::IPPROTO_TCP, libc::TCP_MAXSEG, 0)?;
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
    for name in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        if let Some(v) = s.int_opt(libc::SOL_SOCKET, name) {
            set_buffer(sock, name, v.max(0) as usize)?;
        }
    }
    Ok(c.send_queue[sent..].to_vec())
}

/// The windows as saved (TCP_REPAIR_WINDOW), once the FINs are back: the
/// saved rcv_wup may count the peer's FIN, and the kernel takes none past
/// rcv_nxt. When the peer's FIN comes only at the release (CLOSING with our
/// FIN not sent yet: `peer_fin_later`), the connection's rcv_nxt is still
/// before it, and so go rcv_wup and snd_wl1 until then.
fn set_window(sock: &OwnedFd, c: &TcpConnection, peer_fin_later: bool) -> Result<(), SysError> {
    if c.max_window == 0 {
        return Ok(());
    }
    let before_fin = |seq: u32| {
        // seq after rcv_nxt, in sequence-number order.
        let after = (seq.wrapping_sub(c.rcv_nxt) as i32) > 0;
        if peer_fin_later && after {
            c.rcv_nxt
        } else {
            seq
        }
    };
    sys::set_repair_window(
        sock,
        &sys::RepairWindow {
            snd_wl1: before_fin(c.snd_wl1),
            snd_wnd: c.snd_wnd,
            max_window: c.max_window,
            rcv_wnd: c.rcv_wnd,
            rcv_wup: before_fin(c.rcv_wup),
        },
    )
}

/// A connection rebuilt as established (repair mode, send queue selected)
/// is brought to its saved `state`: the program's FIN is queued again with
/// shutdown(SHUT_WR), which in repair mode counts it as sent without
/// sending it; what the peer sent (its FIN, its ACK of ours) is forged
/// through a raw socket (`cr_sys::forged`), in the order it came. A
/// FIN that never left waits for the release (`Pending::fin`), and so
/// does a peer's FIN that came after it (CLOSING): returned, to be forged
/// then.
fn replay_fins(
    sock: &OwnedFd,
    state: u8,
    c: &TcpConnection,
    local: SocketAddr,
    remote: SocketAddr,
) -> Result<Option<cr_sys::forged::Segment>, SysError> {
    use cr_sys::forged::{self as seg, Segment};
    let ours = super::sent_fin(state) && !c.fin_unsent;
    let theirs = super::got_fin(state);
    if !ours && !theirs {
        return Ok(None);
    }
    let window = if c.options as u8 & sys::TCPI_OPT_WSCALE != 0 {
        c.snd_wnd >> c.snd_wscale
    } else {
        c.snd_wnd
    };
    let from_peer = |flags, ack| Segment {
        from: remote,
        to: local,
        seq: c.rcv_nxt,
        ack,
        flags,
        window: window.min(u32::from(u16::MAX)) as u16,
    };
    // LAST-ACK: the peer closed first; the others: the program did.
    let ours_first = state != sys::TCP_LAST_ACK;
    let peer_fin = from_peer(seg::FIN | seg::ACK, c.snd_una);
    if state == sys::TCP_CLOSING && c.fin_unsent {
        return Ok(Some(peer_fin));
    }
    if ours && ours_first {
        our_fin(sock, sys::TCP_FIN_WAIT1)?;
    }
    if theirs {
        // It acknowledges what the peer had of ours: the data sent, not
        // our FIN (CLOSING: both FINs crossed).
        let now = if ours && ours_first {
            sys::TCP_CLOSING
        } else {
            sys::TCP_CLOSE_WAIT
        };
        seg::send(&peer_fin)?;
        wait_state(sock, now)?;
    }
    if ours && !ours_first {
        our_fin(sock, sys::TCP_LAST_ACK)?;
    }
    if state == sys::TCP_FIN_WAIT2 {
        // The peer acknowledged our FIN.
        seg::send(&from_peer(seg::ACK, c.write_seq.wrapping_add(1)))?;
        wait_state(sock, sys::TCP_FIN_WAIT2)?;
    }
    Ok(None)
}

/// shutdown(SHUT_WR) in repair mode with the send queue selected: the FIN
/// counts as sent (nothing leaves); the state becomes `then`.
fn our_fin(sock: &OwnedFd, then: u8) -> Result<(), SysError> {
    sys::set_repair_queue(sock, TcpQueue::Send)?;
    cr_sys::fdio::shutdown(sock, libc::SHUT_WR)?;
    wait_state(sock, then)
}

/// Wait (a moment: a looped-back segment is usually processed before
/// sendto returns) until the connection is in `state`.
fn wait_state(sock: &OwnedFd, state: u8) -> Result<(), SysError> {
    let mut now = 0;
    let reached = cr_sys::deadline::poll(Duration::from_secs(5), Duration::from_millis(2), || {
        now = sys::tcp_info(sock)?.state;
        Ok::<_, SysError>((now == state).then_some(()))
    })?;
    if reached.is_none() {
        return Err(SysError::Syscall {
            what: format!(
                "bringing the connection to {} (it stays in {})",
                sys::tcp_state_name(state),
                sys::tcp_state_name(now)
            ),
            source: cr_sys::Errno(libc::ETIMEDOUT),
        });
    }
    Ok(())
}

/// A socket in SYN-SENT: bound, its first sequence number set (the SYN
/// sent again at the release carries the same one, so that a peer that
/// answered the first SYN knows this one), left out of repair mode.
fn before_connect(
    sock: &OwnedFd,
    s: &InetSocket,
    c: &TcpConnection,
    local: SocketAddr,
) -> Result<(), SysError> {
    sys::set_repair(sock, sys::REPAIR_ON)?;
    set_options(sock, &s.opts)?;
    sys::set_repair_queue(sock, TcpQueue::Send)?;
    sys::set_queue_seq(sock, c.write_seq.wrapping_sub(1))?;
    bind_over_remnants(sock, local)?;
    sys::set_repair(sock, sys::REPAIR_OFF_NO_WP)
}

/// connect(2) without waiting (the program's socket may block): the SYN
/// leaves, the connection completes or fails as the program's would have.
fn connect_now(sock: &OwnedFd, remote: SocketAddr) -> Result<(), SysError> {
    let flags = cr_sys::fdio::get_flags(sock)?;
    cr_sys::fdio::set_flags(sock, flags | libc::O_NONBLOCK)?;
    let r = match sys::connect(sock, &remote) {
        Err(e) if e.errno() == Some(libc::EINPROGRESS) => Ok(()),
        r => r,
    };
    cr_sys::fdio::set_flags(sock, flags)?;
    r
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
pub fn finish(r: &mut Restorer<'_>) -> Result<(), RestoreError> {
    let guard_secs = r.opts.reset_guard;
    let held = r.stash.get::<Held>();
    let pending = std::mem::take(&mut held.pending);
    let sockets = &held.sockets;
    let conns = guarded(&pending);
    // The guard made ahead (see [`prepare`]) does if at least half of its
    // time is left; else (a long wait for the release, or nft failed) it
    // goes in again now.
    let ahead = held.guard.take().and_then(|h| h.join().ok());
    if let Some((_, Err(e))) = &ahead {
        debug!(error = %e, "no reset guard ahead of the release: made now");
    }
    let fresh = matches!(&ahead, Some((at, Ok(())))
        if at.elapsed() < Duration::from_secs(u64::from(guard_secs)) / 2);
    if guard_secs > 0 && !conns.is_empty() && !fresh {
        if let Err(e) = cr_sys::netlock::guard_resets(&conns, guard_secs) {
            warn!(error = %cr_sys::error::one_line(&e), "no reset guard: a peer restored after this process may reset its connection");
        }
    }
    let mut unsent = Vec::new();
    for p in pending {
        let Some(sock) = sockets.get(&p.id) else {
            continue;
        };
        if p.connect {
            let what = || format!("cannot connect socket:[{}] again", p.id);
            cr_sys::fdio::setsockopt_int(sock, libc::SOL_SOCKET, libc::SO_REUSEADDR, p.reuse)
                .step(what)?;
            connect_now(sock, p.remote).step(what)?;
            continue;
        }
        let what = || format!("cannot leave repair mode on socket:[{}]", p.id);
        sys::set_repair(sock, sys::REPAIR_OFF).step(what)?;
        cr_sys::fdio::setsockopt_int(sock, libc::SOL_SOCKET, libc::SO_REUSEADDR, p.reuse)
            .step(what)?;
        if p.shut_rd {
            shutdown(sock, 1).step(|| format!("cannot shut socket:[{}] for reading", p.id))?;
        }
        if !p.unsent.is_empty() || p.fin {
            unsent.push((sock, p.id, p.unsent, p.fin, p.peer_fin));
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    for (sock, id, data, fin, peer_fin) in unsent {
        queue_unsent(sock, id, &data, deadline)?;
        // The program's FIN waited behind those bytes.
        if fin {
            cr_sys::fdio::shutdown(sock, libc::SHUT_WR)
                .step(|| format!("cannot shut socket:[{id}] for writing"))?;
        }
        if let Some(seg) = peer_fin {
            let what = || format!("cannot give socket:[{id}] its peer's FIN");
            cr_sys::forged::send(&seg).step(what)?;
            wait_state(sock, sys::TCP_CLOSING).step(what)?;
        }
    }
    Ok(())
}

/// Queue the bytes of socket `id` that had never been sent. They fitted in
/// the send buffer they came from, but a rebuilt socket packs them in other
/// segments (a buffer counts their overhead too): when a peer that does not
/// read leaves no room, the buffer grows for them (up to their size twice
/// over), then gets its size and its locks back (a buffer holding more than
/// its size is simply not writable until it drains, as the original was).
/// Past that growth, a slow peer may take until `deadline` to open its
/// window.
fn queue_unsent(
    sock: &OwnedFd,
    id: u64,
    data: &[u8],
    deadline: Instant,
) -> Result<(), RestoreError> {
    let what = || format!("cannot queue the unsent bytes of socket:[{id}]");
    let get = |name| cr_sys::fdio::getsockopt_int(sock, libc::SOL_SOCKET, name);
    let size = get(libc::SO_SNDBUF).step(what)?.max(0) as usize;
    // (Linux before 5.14 has no SO_BUF_LOCK: the grown size stays locked.)
    let locks = get(sys::SO_BUF_LOCK).ok();
    let most = size + 2 * data.len();
    let mut grown = size;
    let mut rest = data;
    while !rest.is_empty() {
        let n = cr_sys::fdio::send_some(sock, rest).step(what)?;
        rest = &rest[n..];
        if n > 0 {
            continue;
        }
        if grown < most {
            grown = (grown.max(64 << 10) * 2).min(most);
            set_buffer(sock, libc::SO_SNDBUF, grown).step(what)?;
            continue;
        }
        if Instant::now() > deadline {
            return Err(RestoreError::Unsupported(format!(
                "socket:[{id}]: {} unsent bytes could not be queued again (the peer does not read)",
                rest.len()
            )));
        }
        sys::wait_writable(sock, 100).step(|| format!("waiting to write socket:[{id}]"))?;
    }
    if grown != size {
        debug!(id, size, grown, "send buffer grown for the unsent bytes");
        set_buffer(sock, libc::SO_SNDBUF, size).step(what)?;
        if let Some(l) = locks {
            cr_sys::fdio::setsockopt_int(sock, libc::SOL_SOCKET, sys::SO_BUF_LOCK, l).step(what)?;
        }
    }
    Ok(())
}

/// shutdown(2) of the sides in `bits` (1 receive, 2 send). An unconnected
/// UDP socket is shut all the same, though the call says ENOTCONN (the
/// kernel sets the bits before it answers so, for poll's sake).
fn shutdown(sock: &OwnedFd, bits: u32) -> Result<(), SysError> {
    let how = match bits & 3 {
        0 => return Ok(()),
        1 => libc::SHUT_RD,
        2 => libc::SHUT_WR,
        _ => libc::SHUT_RDWR,
    };
    match cr_sys::fdio::shutdown(sock, how) {
        Err(e) if e.errno() == Some(libc::ENOTCONN) => Ok(()),
        r => r,
    }
}

/// Sockets restored on the same boot into another network namespace than
/// the one they lived in are usually a mistake (`--netns` was forgotten).
pub fn warn_other_netns(ck: &Checkpoint) {
    let has_inet = ck
        .objects
        .iter()
        .any(|o| matches!(o.kind, ObjectKind::InetSocket(_)));
    let boot = proc::sys_value("/proc/sys/kernel/random/boot_id");
    let here = proc::read_link("/proc/self/ns/net").unwrap_or_default();
    let m = &ck.meta;
    // (A namespace of its own made again by cr_restart is another one.)
    let made = crate::kinds::netns::restorable(ck).is_some()
        && cr_sys::ns::net_devices(std::process::id() as i32)
            .is_ok_and(|d| d.len() == 1 && d[0].0 == "lo");
    if has_inet && !made && !m.netns.is_empty() && m.boot_id == boot && m.netns != here {
        warn!(
            image = m.netns,
            here, "the image's sockets lived in another network namespace of this host; they are restored into this one (see cr_restart --netns)"
        );
    }
}
