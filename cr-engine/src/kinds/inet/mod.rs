//! Kind "inet": IPv4 and IPv6 sockets: TCP listening, unconnected and
//! established sockets, and UDP, raw and ping sockets, bound or connected
//! (the last three alike: address, connection, options).
//!
//! An established connection is read in repair mode (`TCP_REPAIR`, see
//! `cr_sys::inet`) on a copy of the process's fd: sequence numbers, the
//! send queue (what was written and not yet acknowledged, with the part
//! never sent), the receive queue (what arrived and was not read yet),
//! the negotiated options (MSS, window scales, SACK, timestamps), the
//! windows and the timestamp clock. Nothing is consumed. A dump that lets the
//! processes continue leaves repair mode at once; one that kills or stops
//! them keeps it until the end (a socket closed in repair mode sends no FIN
//! or RST), with the network lock (`cr_sys::netlock`) installed before any
//! connection is read so that nothing is acknowledged after the read.
//!
//! Socket options whose value differs from a fresh socket's are saved as
//! raw bytes and set again at restore. Datagrams queued on a UDP socket are
//! saved with their senders, peeked without being consumed
//! (`cr_sys::inet::peek_datagrams`), and sent again to the rebuilt socket
//! as if from those senders (`cr_sys::forged`); a raw or ping socket's are
//! not (they may be lost anyway). A TCP socket whose connection
//! ended (CLOSE: reset by the peer) with bytes not read yet is refused: a
//! closed socket cannot be given them again.
//!
//! Restore: see [`rebuild`].

mod rebuild;
#[cfg(test)]
mod tests;

pub use rebuild::{warn_other_netns, AddrMap};

use crate::error::RestoreError;
use crate::kinds::fds::{FdScan, OpenFd};
use crate::kinds::sockopts::{options, shape, Fresh, Shape};
use crate::kinds::{Described, FileKind, HeldState, Opened};
use crate::restore::{Rebuild, Restorer};
use cr_image::model::objects::{Datagram, InetSocket, TcpConnection};
use cr_image::model::{Checkpoint, Fd, FdKind, Object, ObjectKind, ObjectTag, Process};
use cr_sys::inet::{self as sys, TcpQueue};
use cr_sys::netlock::LockSet;
use cr_sys::proc::FDTarget;
use cr_sys::{fdio, SysError};
use std::net::SocketAddr;
use std::os::fd::OwnedFd;

pub struct Inet;

impl FileKind for Inet {
    fn name(&self) -> &'static str {
        "inet"
    }

    /// Any socket the unix kind did not take: TCP and UDP are described,
    /// netlink and packet sockets handed to their kinds, anything else is
    /// refused by name.
    fn describe(&self, cx: &mut FdScan<'_>, f: &OpenFd<'_>) -> Option<Described> {
        let FDTarget::Socket(ino) = *f.target else {
            return None;
        };
        Some(describe(cx, f, ino))
    }

    fn prepare(&self, r: &mut Restorer<'_>, ck: &Checkpoint) -> Result<(), RestoreError> {
        rebuild::prepare(r, ck)
    }

    fn open(
        &self,
        cx: &mut Rebuild<'_, '_, '_>,
        _p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>> {
        let FdKind::InetSocket { object } = f.kind else {
            return None;
        };
        Some(rebuild::description(cx.r, object).map(Opened::Ours))
    }

    fn release(&self, r: &mut Restorer<'_>) -> Result<(), RestoreError> {
        rebuild::finish(r)
    }
}

fn is_tcp(s: &Shape) -> bool {
    matches!(s.family, libc::AF_INET | libc::AF_INET6)
        && s.ty == libc::SOCK_STREAM
        && s.protocol == libc::IPPROTO_TCP
}

/// A raw IP socket (any protocol) or a ping socket (ICMP datagrams):
/// saved as UDP is, by address, connection and options. A ping socket's
/// port is its echo identifier (bound, or given at its first send or
/// connect), bound again at restore; the peer of a connected one comes
/// from /proc/PID/net (getpeername hides it, see
/// [`cr_sys::inet::datagram_peer`]).
fn is_raw_or_ping(s: &Shape) -> bool {
    matches!(s.family, libc::AF_INET | libc::AF_INET6)
        && (s.ty == libc::SOCK_RAW
            || (s.ty == libc::SOCK_DGRAM
                && matches!(s.protocol, libc::IPPROTO_ICMP | libc::IPPROTO_ICMPV6)))
}

/// The /proc/PID/net table listing a raw or ping socket of shape `s`.
fn datagram_table(s: &Shape) -> &'static str {
    match (s.family == libc::AF_INET6, s.ty == libc::SOCK_RAW) {
        (false, true) => "raw",
        (true, true) => "raw6",
        (false, false) => "icmp",
        (true, false) => "icmp6",
    }
}

pub(crate) use cr_image::model::inet_proto_name as proto_name;

/// A UDP or UDP-Lite socket (saved and rebuilt alike; UDP-Lite adds its
/// checksum coverage options).
fn is_udp(s: &Shape) -> bool {
    matches!(s.family, libc::AF_INET | libc::AF_INET6)
        && s.ty == libc::SOCK_DGRAM
        && matches!(s.protocol, libc::IPPROTO_UDP | libc::IPPROTO_UDPLITE)
}

fn err(what: &str) -> impl Fn(SysError) -> String + '_ {
    move |e| {
        format!(
            "{what} that cannot be read: {}",
            cr_sys::error::one_line(&e)
        )
    }
}

/// The local address and the peer of socket `sock` (inode `ino`) of
/// process `pid`; a raw or ping socket's peer from /proc.
fn addresses(
    pid: i32,
    sock: &OwnedFd,
    sh: &Shape,
    ino: u64,
) -> Result<(Option<SocketAddr>, Option<SocketAddr>), SysError> {
    let local = sys::local_addr(sock)?;
    let mut remote = sys::peer_addr(sock)?;
    if remote.is_none() && is_raw_or_ping(sh) {
        remote = sys::datagram_peer(pid, datagram_table(sh), ino)?;
    }
    Ok((local, remote))
}

fn describe(cx: &mut FdScan<'_>, f: &OpenFd<'_>, ino: u64) -> Described {
    let (pid, fd) = (f.pid, f.fd);
    let Ok(sock) = fdio::steal_fd(pid, fd) else {
        return Ok(None); // closed meanwhile
    };
    let sh = shape(&sock);
    match sh.family {
        libc::AF_NETLINK => return super::netlink::describe(cx, f, ino, sock, &sh),
        libc::AF_PACKET => return super::packet::describe(cx, f, ino, sock, &sh),
        _ => {}
    }
    let (tcp, udp, raw) = (is_tcp(&sh), is_udp(&sh), is_raw_or_ping(&sh));
    if !tcp && !udp && !raw {
        return Err(other_family(&sh));
    }
    let what = format!("a {} socket", proto_name(sh.family, sh.ty, sh.protocol));
    let (local, remote) = addresses(pid, &sock, &sh, ino).map_err(err(&what))?;
    let mut s = InetSocket {
        family: sh.family as u32,
        sock_type: sh.ty as u32,
        protocol: sh.protocol as u32,
        local: local.filter(|a| a.port() != 0),
        remote,
        state: if remote.is_some() {
            sys::TCP_ESTABLISHED as u32
        } else {
            sys::TCP_CLOSE as u32
        },
        ..Default::default()
    };
    let mut info = sys::TcpInfo::default();
    if tcp {
        info = sys::tcp_info(&sock).map_err(err(&what))?;
        s.state = info.state as u32;
        match info.state {
            sys::TCP_ESTABLISHED => {}
            // A connection that ended (reset by the peer, or closed both
            // ways) may still hold bytes the program has not read: no
            // repair-mode call puts bytes back in a closed socket, and a
            // fresh one would lose them. SIOCINQ counts one byte less
            // when the socket is done (it takes off a FIN), so a reset
            // socket holding a single byte is not seen.
            sys::TCP_CLOSE => {
                // The end of a connection leaves both sides shut; a fresh
                // socket has neither (its reads fail with ENOTCONN).
                if sys::read_shut(&sock).map_err(err(&what))? {
                    s.shutdown = 3;
                }
                let unread = fdio::bytes_queued(&sock).unwrap_or(0);
                if unread > 0 {
                    return Err(format!(
                        "a TCP socket {} in state CLOSE with {unread} bytes received and not read (not supported: a closed socket cannot be given them again)",
                        show(&s.local)
                    ));
                }
            }
            sys::TCP_LISTEN => {
                s.backlog = info.sacked;
                if info.unacked > 0 && cx.tree.lock_network && !cx.tree.skip_in_flight {
                    return Err(format!(
                        "a TCP socket listening on {} with {} connection(s) not yet accepted (not supported: they cannot be put back in its queue, and the program did not accept them while the checkpoint waited; use --tcp-skip-in-flight to drop them)",
                        show(&s.local), info.unacked
                    ));
                }
            }
            st if is_connection(st) => {}
            st => {
                let peer = s.remote.map(|r| format!(" -> {r}")).unwrap_or_default();
                return Err(format!(
                    "a TCP socket {}{peer} in state {} (not supported: {})",
                    show(&s.local),
                    sys::tcp_state_name(st),
                    why_not(st)
                ));
            }
        }
    }
    let kind = FdKind::InetSocket { object: ino };
    let fresh = cx.tree.stash.get::<Fresh>();
    let lock_network = cx.tree.lock_network;
    let Some(objs) = cx.objects.as_deref_mut() else {
        return Ok(Some(kind));
    };
    if objs.contains(ObjectTag::InetSocket, ino) {
        return Ok(Some(kind));
    }
    s.opts = options(&sock, &sh, fresh);
    let connected = tcp && is_connection(info.state);
    if udp || connected {
        // A shut TCP connection is in another state but for its receive
        // side (which a FIN from the peer shuts too).
        // A connection's addresses name it: one exact lookup, not a dump
        // of every socket of the namespace (the dump when it is not found
        // so).
        let exact = match (tcp, s.local, s.remote) {
            (true, Some(l), Some(r)) => cr_sys::inet_diag::tcp_by_addresses(l, r, ino)
                .ok()
                .flatten(),
            _ => None,
        };
        let found = match exact {
            Some(f) => Ok(Some(f)),
            None => cr_sys::inet_diag::by_inode(sh.protocol, sh.family == libc::AF_INET, ino),
        }
        .unwrap_or_else(|e| {
                tracing::warn!(pid, fd, error = %cr_sys::error::one_line(&e), "cannot tell whether the socket was shut; taken for open");
                None
            });
        let bits = found.map_or(0, |f| f.shutdown);
        s.shutdown = u32::from(bits) & if udp { 3 } else { 1 };
        if info.state == sys::TCP_SYN_SENT {
            // getpeername answers ENOTCONN while the connection is made.
            s.remote = found.and_then(|f| f.remote);
            if s.remote.is_none() {
                return Err(format!(
                    "a TCP socket {} connecting to an address sock_diag does not tell",
                    show(&s.local)
                ));
            }
        }
    }
    if udp {
        corked(&sock, &s, cx.tree.lock_network && !cx.tree.skip_in_flight)?;
    }
    if (udp || raw) && fdio::bytes_queued(&sock).unwrap_or(0) > 0 {
        if udp {
            match sys::peek_datagrams(&sock) {
                Ok(v) => {
                    s.received = v
                        .into_iter()
                        .map(|(from, data)| Datagram { from, data })
                        .collect();
                }
                Err(e) => {
                    tracing::warn!(pid, fd, local = %show(&s.local), error = %cr_sys::error::one_line(&e), "datagrams queued on a UDP socket cannot be read; not saved");
                }
            }
        } else {
            tracing::warn!(pid, fd, local = %show(&s.local), socket = %what, "datagrams queued on a raw or ping socket are not saved");
        }
    }
    if connected {
        let reuse = fdio::getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_REUSEADDR).unwrap_or(0);
        sys::set_repair(&sock, sys::REPAIR_ON).map_err(|e| {
            format!(
                "a TCP connection {} -> {} that cannot enter repair mode: {}",
                show(&s.local),
                show(&s.remote),
                cr_sys::error::one_line(&e)
            )
        })?;
        let held = Repaired {
            paused: false,
            sock: Some(sock),
            reuse,
        };
        let conn = connection(held.fd(), &info);
        match conn {
            Ok(c) => s.tcp = Some(c),
            Err(e) => {
                return Err(format!(
                    "a TCP connection {} -> {} that cannot be read: {}",
                    show(&s.local),
                    show(&s.remote),
                    cr_sys::error::one_line(&e)
                ))
            }
        }
        if lock_network {
            // Closed in repair mode when the process dies: no FIN, no RST.
            objs.hold(Box::new(held));
        }
    }
    objs.insert(Object {
        id: ino,
        kind: ObjectKind::InetSocket(s),
    });
    Ok(Some(kind))
}

/// A UDP socket holding data written under UDP_CORK (or MSG_MORE) and not
/// sent yet: no interface shows those bytes. Refused when the tree is
/// about to be killed or stopped (`refuse`: the bytes would be lost); else
/// a warning (the program keeps them; an image restored later lacks them).
/// SIOCOUTQ also counts datagrams sent and not yet freed by the stack:
/// those leave within moments, corked ones stay.
fn corked(sock: &OwnedFd, s: &InetSocket, refuse: bool) -> Result<(), String> {
    let unsent = || sys::ioctl_int(sock, sys::SIOCOUTQ).unwrap_or(0);
    // Sent data leaves the queue within a moment; corked data stays.
    let sent = cr_sys::deadline::poll(
        std::time::Duration::from_millis(20),
        std::time::Duration::from_millis(1),
        || Ok::<_, ()>((unsent() == 0).then_some(())),
    );
    if sent.is_ok_and(|s| s.is_some()) {
        return Ok(());
    }
    let why = format!(
        "a UDP socket {} holding {} bytes corked (UDP_CORK or MSG_MORE) and not sent yet",
        show(&s.local),
        unsent()
    );
    if refuse {
        return Err(format!(
            "{why} (not supported: the kernel cannot show them; use --tcp-skip-in-flight to drop them)"
        ));
    }
    tracing::warn!("{why}: not saved (the program keeps them; a restore of this image lacks them)");
    Ok(())
}

/// A socket held in repair mode by the dump. Dropping it leaves repair mode
/// (without a window probe) and gives back the program's SO_REUSEADDR,
/// which repair mode clobbers — unless [`Repaired::keep`] was called
/// because the process is about to be killed.
pub struct Repaired {
    sock: Option<OwnedFd>,
    reuse: i32,
    /// Out of repair mode for the while (see `HeldState::pause`).
    paused: bool,
}

impl Repaired {
    /// Our copy (taken away only by `keep`, which consumes it).
    fn fd(&self) -> &OwnedFd {
        self.sock.as_ref().expect("held until kept or dropped")
    }
}

impl HeldState for Repaired {
    /// Close our copy, leaving the socket in repair mode (taken again if it
    /// was given back for the while: nothing moved, the lock holds its
    /// packets and the process is frozen).
    fn keep(mut self: Box<Self>) {
        if self.paused {
            if let Err(e) = sys::set_repair(self.fd(), sys::REPAIR_ON) {
                tracing::warn!(error = %cr_sys::error::one_line(&e), "taking TCP repair mode again failed");
            }
        }
        self.sock = None;
    }

    fn pause(&mut self) {
        if self.paused {
            return;
        }
        self.leave();
        self.paused = true;
    }
}

impl Repaired {
    /// Leave repair mode (no window probe), SO_REUSEADDR as the program had it.
    fn leave(&self) {
        if let Some(s) = &self.sock {
            if let Err(e) = sys::set_repair(s, sys::REPAIR_OFF_NO_WP) {
                tracing::warn!(error = %cr_sys::error::one_line(&e), "leaving TCP repair mode failed");
            }
            let _ = fdio::setsockopt_int(s, libc::SOL_SOCKET, libc::SO_REUSEADDR, self.reuse);
        }
    }
}

impl Drop for Repaired {
    fn drop(&mut self) {
        if self.paused {
            return;
        }
        if let Some(s) = self.sock.take() {
            if let Err(e) = sys::set_repair(&s, sys::REPAIR_OFF_NO_WP) {
                tracing::warn!(error = %cr_sys::error::one_line(&e), "leaving TCP repair mode failed");
            }
            let _ = fdio::setsockopt_int(&s, libc::SOL_SOCKET, libc::SO_REUSEADDR, self.reuse);
        }
    }
}

/// TCP states of a connection whose state is saved: established, being
/// made (SYN-SENT), or closed on one side or both (the FIN-WAITs,
/// CLOSE-WAIT, LAST-ACK, CLOSING).
pub fn is_connection(state: u8) -> bool {
    cr_image::model::objects::TCP_CONNECTED.contains(&u32::from(state))
}

/// Why a TCP socket in `state` cannot be saved, in a few words.
fn why_not(state: u8) -> &'static str {
    match state {
        sys::TCP_TIME_WAIT => {
            "no process holds a socket in TIME-WAIT: the kernel moves a held socket to CLOSE when both sides closed"
        }
        3 => "a connection accepted with TCP Fast Open whose handshake has not completed",
        _ => "a state the kernel does not let a process hold",
    }
}

/// The program's FIN follows write_seq (it shut its sending side).
pub fn sent_fin(state: u8) -> bool {
    matches!(
        state,
        sys::TCP_FIN_WAIT1 | sys::TCP_FIN_WAIT2 | sys::TCP_CLOSING | sys::TCP_LAST_ACK
    )
}

/// The peer's FIN follows rcv_nxt (the peer shut its sending side).
pub fn got_fin(state: u8) -> bool {
    matches!(
        state,
        sys::TCP_CLOSE_WAIT | sys::TCP_CLOSING | sys::TCP_LAST_ACK
    )
}

/// The state of a connection; `sock` is in repair mode. Sequence numbers
/// and queues count data only: the kernel counts a FIN in write_seq, in
/// SIOCOUTQ while it is not acknowledged, in SIOCOUTQNSD while it is not
/// sent, and the peer's in rcv_nxt (SIOCINQ leaves it out).
fn connection(sock: &OwnedFd, info: &sys::TcpInfo) -> Result<TcpConnection, SysError> {
    let mut c = TcpConnection::default();
    // Send side: the program is frozen, so write_seq is fixed; the queue
    // only loses acknowledged bytes at its head. Whatever the peek returns
    // ends at write_seq.
    sys::set_repair_queue(sock, TcpQueue::Send)?;
    let write_seq = sys::queue_seq(sock)?;
    if info.state == sys::TCP_SYN_SENT {
        // The SYN takes one sequence number; nothing else is there yet.
        c.write_seq = write_seq;
        c.snd_una = write_seq.wrapping_sub(1);
        c.snd_nxt = write_seq;
        return Ok(c);
    }
    let ours = sent_fin(info.state);
    let fin_acked = info.state == sys::TCP_FIN_WAIT2;
    c.write_seq = write_seq.wrapping_sub(u32::from(ours));
    let outq = sys::ioctl_int(sock, sys::SIOCOUTQ)?.max(0) as usize;
    let outq = outq.saturating_sub(usize::from(ours && !fin_acked));
    c.send_queue = sys::peek(sock, outq)?;
    let unsent = sys::ioctl_int(sock, sys::SIOCOUTQNSD)?.max(0) as usize;
    // The FIN is the last thing queued: if anything is unsent, it is.
    c.fin_unsent = ours && unsent > 0;
    let unsent = unsent.saturating_sub(usize::from(c.fin_unsent));
    c.unsent = unsent.min(c.send_queue.len()) as u32;
    c.snd_una = c.write_seq.wrapping_sub(c.send_queue.len() as u32);
    c.snd_nxt = c.write_seq.wrapping_sub(c.unsent);
    // Receive side: bytes may still arrive (no lock when the processes
    // continue); read rcv_nxt and the queue length until they agree.
    sys::set_repair_queue(sock, TcpQueue::Recv)?;
    let mut tries = 0;
    loop {
        let rcv1 = sys::queue_seq(sock)?;
        let inq = sys::ioctl_int(sock, sys::SIOCINQ)?.max(0) as usize;
        let data = sys::peek(sock, inq)?;
        let rcv2 = sys::queue_seq(sock)?;
        let inq2 = sys::ioctl_int(sock, sys::SIOCINQ)?.max(0) as usize;
        // A FIN that arrived meanwhile changed the state read before.
        let same_state = sys::tcp_info(sock)?.state == info.state;
        if !same_state {
            return Err(SysError::Syscall {
                what: "reading the connection (its state changed meanwhile)".into(),
                source: cr_sys::Errno(libc::EAGAIN),
            });
        }
        if rcv1 == rcv2 && inq == inq2 && data.len() == inq {
            c.rcv_nxt = rcv1.wrapping_sub(u32::from(got_fin(info.state)));
            c.recv_queue = data;
            break;
        }
        tries += 1;
        if tries == 1000 {
            return Err(SysError::Syscall {
                what: "reading the receive queue (data kept arriving)".into(),
                source: cr_sys::Errno(libc::EAGAIN),
            });
        }
    }
    c.mss = fdio::getsockopt_int(sock, libc::IPPROTO_TCP, libc::TCP_MAXSEG)? as u32;
    c.options = info.options as u32;
    c.snd_wscale = info.snd_wscale as u32;
    c.rcv_wscale = info.rcv_wscale as u32;
    if info.options & sys::TCPI_OPT_TIMESTAMPS != 0 {
        c.timestamp = sys::timestamp(sock)?;
    }
    let w = sys::repair_window(sock)?;
    c.snd_wl1 = w.snd_wl1;
    c.snd_wnd = w.snd_wnd;
    c.max_window = w.max_window;
    c.rcv_wnd = w.rcv_wnd;
    c.rcv_wup = w.rcv_wup;
    Ok(c)
}

/// `--verify` (before the tree runs): each TCP socket of a restored live
/// process `pid` is in the state its image had, as far as the restore
/// makes it before the release (a FIN that never left is sent then, and a
/// connection being made connects then); a tree that was dumped and runs
/// on has its TCP states not compared (its connections go on moving).
/// Each datagram socket has its ports and connection ([`verify_datagram`]).
pub fn verify(c: &mut crate::verify::Compare<'_>, ck: &Checkpoint, image: &Process, pid: i32) {
    for f in &image.fds {
        let FdKind::InetSocket { object } = f.kind else {
            continue;
        };
        let Some(ObjectKind::InetSocket(s)) = ck
            .objects
            .iter()
            .find(|o| o.id == object && matches!(o.kind, ObjectKind::InetSocket(_)))
            .map(|o| &o.kind)
        else {
            continue;
        };
        let Ok(sock) = fdio::steal_fd(pid, f.fd) else {
            continue; // the fd itself is compared by kind "fds"
        };
        // A raw socket may carry protocol 6 too.
        if s.protocol as i32 != libc::IPPROTO_TCP || s.sock_type as i32 != libc::SOCK_STREAM {
            verify_datagram(c, s, f.fd, pid, &sock);
            continue;
        }
        if !c.restored {
            continue;
        }
        let now = sys::tcp_info(&sock).map(|i| i.state).unwrap_or(0);
        let want = match before_release(s) {
            st if c.tcp_closed && is_connection(st) => sys::TCP_CLOSE,
            st => st,
        };
        c.same(
            &format!("fd {} (TCP {})", f.fd, show(&s.local)),
            "state",
            sys::tcp_state_name(want),
            sys::tcp_state_name(now),
        );
    }
}

/// A UDP, raw or ping socket `s` at fd `fd` of the live process `pid`:
/// its port (a ping socket's echo identifier) and its peer's, and whether
/// it is connected. (Not the addresses themselves: `--map-addr` may
/// rewrite them.)
fn verify_datagram(
    c: &mut crate::verify::Compare<'_>,
    s: &InetSocket,
    fd: i32,
    pid: i32,
    sock: &OwnedFd,
) {
    use std::os::unix::fs::MetadataExt;
    let sh = shape(sock);
    let what = format!(
        "fd {fd} ({} {})",
        proto_name(sh.family, sh.ty, sh.protocol),
        show(&s.local)
    );
    let ino = std::fs::metadata(format!("/proc/{pid}/fd/{fd}")).map_or(0, |m| m.ino());
    let (local, remote) = match addresses(pid, sock, &sh, ino) {
        Ok(a) => a,
        Err(e) => {
            c.differ(
                &what,
                format!("addresses unreadable: {}", cr_sys::error::one_line(&e)),
            );
            return;
        }
    };
    let port = |a: Option<SocketAddr>| a.map_or(0, |a| a.port());
    c.same(&what, "port", &port(s.local), &port(local));
    c.same(
        &what,
        "peer port (connected)",
        &s.remote.map(|a| a.port()),
        &remote.map(|a| a.port()),
    );
}

/// The state the restore gives socket `s` before the release.
fn before_release(s: &InetSocket) -> u8 {
    let state = s.state as u8;
    let fin_unsent = s.tcp.as_ref().is_some_and(|c| c.fin_unsent);
    match state {
        sys::TCP_SYN_SENT => sys::TCP_CLOSE,
        sys::TCP_FIN_WAIT1 | sys::TCP_CLOSING if fin_unsent => sys::TCP_ESTABLISHED,
        sys::TCP_LAST_ACK if fin_unsent => sys::TCP_CLOSE_WAIT,
        st => st,
    }
}

/// An address as users read it ("(unbound)" when none).
fn show(a: &Option<std::net::SocketAddr>) -> String {
    a.map_or_else(|| "(unbound)".into(), |a| a.to_string())
}

/// "TCP 127.0.0.1:5000 -> 127.0.0.1:40000 ESTABLISHED", for `--check`.
pub fn label(pid: i32, fd: i32) -> String {
    let Ok(sock) = fdio::steal_fd(pid, fd) else {
        return "socket".into();
    };
    let sh = shape(&sock);
    let v = if sh.family == libc::AF_INET6 {
        "v6"
    } else {
        "v4"
    };
    let local = sys::local_addr(&sock)
        .ok()
        .flatten()
        .filter(|a| a.port() != 0)
        .map(|a| a.to_string())
        .unwrap_or_else(|| "unbound".into());
    let mut remote = sys::peer_addr(&sock)
        .ok()
        .flatten()
        .map(|a| format!(" -> {a}"))
        .unwrap_or_default();
    if is_tcp(&sh) {
        let info = sys::tcp_info(&sock).unwrap_or_default();
        if info.state == sys::TCP_SYN_SENT {
            remote = connecting_to(&sock)
                .map(|a| format!(" -> {a}"))
                .unwrap_or_default();
        }
        let mut s = format!("TCP{v} {local}{remote} {}", sys::tcp_state_name(info.state));
        if info.state == sys::TCP_LISTEN && info.unacked > 0 {
            s += &format!(", {} connection(s) not accepted yet", info.unacked);
        }
        s
    } else {
        format!("UDP{v} {local}{remote}")
    }
}

/// The address a TCP socket in SYN-SENT connects to (getpeername does not
/// tell it yet: sock_diag does).
fn connecting_to(sock: &OwnedFd) -> Option<std::net::SocketAddr> {
    let ino = fdio::inode(sock).ok()?;
    let v4 = shape(sock).family == libc::AF_INET;
    cr_sys::inet_diag::by_inode(libc::IPPROTO_TCP, v4, ino)
        .ok()
        .flatten()
        .and_then(|f| f.remote)
}

/// Each TCP socket the processes `pids` hold: a copy of its fd, its local
/// address and its TCP info (sockets that went away meanwhile are left out).
fn tcp_sockets(pids: &[i32]) -> Vec<(OwnedFd, std::net::SocketAddr, sys::TcpInfo)> {
    let mut out = Vec::new();
    for &pid in pids {
        for (fd, target) in cr_sys::proc::fds(pid).unwrap_or_default() {
            if !matches!(target, FDTarget::Socket(_)) {
                continue;
            }
            let Ok(sock) = fdio::steal_fd(pid, fd) else {
                continue;
            };
            if !is_tcp(&shape(&sock)) {
                continue;
            }
            let (Ok(Some(local)), Ok(info)) = (sys::local_addr(&sock), sys::tcp_info(&sock)) else {
                continue;
            };
            out.push((sock, local, info));
        }
    }
    out
}

/// The addresses the network lock must hold for the TCP sockets of `pids`.
pub fn lock_set(pids: &[i32]) -> LockSet {
    let mut set = LockSet::default();
    for (sock, local, info) in tcp_sockets(pids) {
        match info.state {
            sys::TCP_LISTEN => set.listeners.push(local),
            // Its SYNs (and the answer) wait for the restore.
            sys::TCP_SYN_SENT => {
                if let Some(remote) = connecting_to(&sock) {
                    set.conns.push((local, remote));
                }
            }
            _ => {
                if let Ok(Some(remote)) = sys::peer_addr(&sock) {
                    set.conns.push((local, remote));
                }
            }
        }
    }
    set.conns.sort();
    set.conns.dedup();
    set.listeners.sort();
    set.listeners.dedup();
    set
}

/// The TCP listeners of `pids` with connections waiting to be accepted:
/// (address, how many).
pub fn accept_queues(pids: &[i32]) -> Vec<(std::net::SocketAddr, u32)> {
    let mut out: Vec<_> = tcp_sockets(pids)
        .into_iter()
        .filter(|(_, _, i)| i.state == sys::TCP_LISTEN && i.unacked > 0)
        .map(|(_, local, i)| (local, i.unacked))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Name the family (and protocol) of a socket that is not supported.
fn other_family(sh: &Shape) -> String {
    let what = match sh.family {
        libc::AF_INET | libc::AF_INET6 => {
            let v = if sh.family == libc::AF_INET {
                "IPv4"
            } else {
                "IPv6"
            };
            format!("an {v} socket (type {}, protocol {})", sh.ty, sh.protocol)
        }
        libc::AF_UNIX => "a unix socket sock_diag does not know".into(),
        -1 => return "a socket that cannot be inspected (not supported)".into(),
        d => format!("a socket of family {d}"),
    };
    format!("{what} (not supported)")
}

/// The bookmarks of every established TCP connection of `pids` (each
/// socket once): sequence numbers only, read in repair mode, nothing
/// consumed. Sockets that vanish or cannot be read are left out.
pub fn bookmarks(pids: &[i32]) -> Vec<cr_image::bookmarks::Bookmark> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for &pid in pids {
        for (fd, target) in cr_sys::proc::fds(pid).unwrap_or_default() {
            let FDTarget::Socket(ino) = target else {
                continue;
            };
            if !seen.insert(ino) {
                continue;
            }
            let Ok(sock) = fdio::steal_fd(pid, fd) else {
                continue;
            };
            if !is_tcp(&shape(&sock)) {
                continue;
            }
            if sys::tcp_info(&sock).map(|i| i.state).ok() != Some(sys::TCP_ESTABLISHED) {
                continue;
            }
            let (Ok(Some(local)), Ok(Some(remote))) =
                (sys::local_addr(&sock), sys::peer_addr(&sock))
            else {
                continue;
            };
            match sequence_numbers(sock) {
                Ok((snd_una, snd_nxt, write_seq, rcv_nxt)) => {
                    out.push(cr_image::bookmarks::Bookmark {
                        local: local.to_string(),
                        remote: remote.to_string(),
                        snd_una,
                        snd_nxt,
                        rcv_nxt,
                        write_seq,
                    })
                }
                Err(e) => {
                    tracing::warn!(pid, fd, error = %cr_sys::error::one_line(&e), "cannot read a TCP connection's sequence numbers")
                }
            }
        }
    }
    out
}

/// (snd_una, snd_nxt, write_seq, rcv_nxt) of an established socket.
fn sequence_numbers(sock: OwnedFd) -> Result<(u32, u32, u32, u32), SysError> {
    let reuse = fdio::getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_REUSEADDR).unwrap_or(0);
    sys::set_repair(&sock, sys::REPAIR_ON)?;
    // Leaves repair mode however the reads end.
    let held = Repaired {
        sock: Some(sock),
        reuse,
        paused: false,
    };
    let s = held.fd();
    sys::set_repair_queue(s, TcpQueue::Send)?;
    let write_seq = sys::queue_seq(s)?;
    let outq = sys::ioctl_int(s, sys::SIOCOUTQ)?.max(0) as u32;
    let unsent = (sys::ioctl_int(s, sys::SIOCOUTQNSD)?.max(0) as u32).min(outq);
    sys::set_repair_queue(s, TcpQueue::Recv)?;
    let rcv_nxt = sys::queue_seq(s)?;
    Ok((
        write_seq.wrapping_sub(outq),
        write_seq.wrapping_sub(unsent),
        write_seq,
        rcv_nxt,
    ))
}
