//! Round trip of kind "inet" (with the network lock of a --kill dump): a
//! TCP listener, an established connection with data in flight both ways
//! and options set (and its segment size), a bound UDP socket; shut
//! sockets; and one round trip per TCP state of a connection half closed
//! or being made (FIN-WAIT-1/2, CLOSE-WAIT, LAST-ACK, CLOSING, over IPv4
//! and IPv6: the peer segments forged at restore; SYN-SENT),
//! each in a network namespace of its own; and the refusal of a reset
//! connection with bytes not read.

use crate::kinds::testkit::{in_new_netns, round_trip};

#[test]
fn tcp_and_udp_round_trip() {
    let rt = round_trip(
        "inet",
        r#"
lis = socket.socket(); lis.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
lis.bind(("127.0.0.1", 0)); lis.listen(4)
c = socket.create_connection(lis.getsockname())
s, _ = lis.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
mss = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
c.send(b"c to s" * 1000); s.send(b"s to c")
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 0))
"#,
        r#"
got = b""
while len(got) < 6000:
    got += s.recv(10000)
expect(got == b"c to s" * 1000, "data from c")
expect(c.recv(100) == b"s to c", "data from s")
expect(c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1, "TCP_NODELAY")
# The segment size (the kernel takes an MSS clamp of at most 32767 to rebuild
# it; loopback's is 65483): not the 536 default's 524.
got = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
expect(got >= min(mss, 32767 - 12), f"segment size {got}, {mss} before")
c.send(b"again"); expect(s.recv(10) == b"again", "the connection goes on")
n = socket.create_connection(lis.getsockname()); a2, _ = lis.accept()
expect(a2 is not None, "the listener accepts")
u2 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u2.sendto(b"udp", u.getsockname())
expect(u.recv(10) == b"udp", "the UDP socket")
"#,
    );
    let conns = |c: &cr_image::model::Checkpoint| {
        let mut v: Vec<_> = c
            .objects
            .iter()
            .filter_map(|o| match &o.kind {
                cr_image::model::ObjectKind::InetSocket(s) => Some((
                    s.local,
                    s.remote,
                    s.state,
                    s.tcp.as_ref().map(|t| (t.snd_una, t.rcv_nxt)),
                )),
                _ => None,
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(conns(&rt.before).len(), 4);
    assert_eq!(conns(&rt.before), conns(&rt.after));
    assert!(
        rt.before.netlock.is_some(),
        "a --kill dump keeps its network lock"
    );
}

/// A classic BPF socket filter (and its lock), SO_BUF_LOCK and SO_NO_CHECK come back:
/// the filter still drops short datagrams and lets long ones through.
#[test]
fn socket_filter_and_buffer_lock_round_trip() {
    round_trip(
        "sockfilter",
        r#"
SO_ATTACH_FILTER, SO_LOCK_FILTER, SO_BUF_LOCK = 26, 44, 72
# A = length; accept (0xffff) if A >= 100, else drop.
prog = b"".join(struct.pack("HBBI", *i) for i in [
    (0x80, 0, 0, 0), (0x35, 0, 1, 100), (0x06, 0, 0, 0xffff), (0x06, 0, 0, 0)])
keep = ctypes.create_string_buffer(prog, len(prog))
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 0))
u.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HL", 4, ctypes.addressof(keep)))
u.setsockopt(socket.SOL_SOCKET, SO_LOCK_FILTER, 1)
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, SO_BUF_LOCK, 2)
tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
tx.setsockopt(socket.SOL_SOCKET, 11, 1)   # SO_NO_CHECK: sent without UDP checksums
def filtered():
    tx.sendto(b"s" * 10, u.getsockname())
    tx.sendto(b"L" * 200, u.getsockname())
    return u.recv(1000)
expect(filtered() == b"L" * 200, "the filter does not work before the checkpoint")
"#,
        r#"
expect(filtered() == b"L" * 200, "the short datagram was not dropped: no filter")
expect(u.getsockopt(socket.SOL_SOCKET, SO_LOCK_FILTER) == 1, "SO_LOCK_FILTER")
expect(t.getsockopt(socket.SOL_SOCKET, SO_BUF_LOCK) == 2, "SO_BUF_LOCK %d" % t.getsockopt(socket.SOL_SOCKET, SO_BUF_LOCK))
expect(tx.getsockopt(socket.SOL_SOCKET, 11) == 1, "SO_NO_CHECK")
"#,
    );
}

/// Options that make received messages carry control data (IP_PKTINFO,
/// SO_TIMESTAMP, IPV6_RECVPKTINFO, TCP_INQ), and others of UDP and IPv6,
/// come back: the program reads the control data it asked for.
#[test]
fn control_data_and_ipv6_options_round_trip() {
    round_trip(
        "cmsgopts",
        r#"
IP_PKTINFO, SO_TIMESTAMP, TCP_INQ, UDP_GRO, SO_PEEK_OFF = 8, 29, 36, 104, 42
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 0))
u.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
u.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMP, 1)
u.setsockopt(socket.IPPROTO_UDP, UDP_GRO, 1)
u6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM); u6.bind(("::1", 0))
u6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
u6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, 9)
u6.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, 0)
lis = socket.socket(socket.AF_INET6); lis.bind(("::1", 0)); lis.listen(1)
t = socket.socket(socket.AF_INET6); t.setsockopt(socket.IPPROTO_TCP, TCP_INQ, 1)
t.connect(lis.getsockname()); s, _ = lis.accept()
tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
tx6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
def levels(anc):
    return sorted((l, ty) for l, ty, _ in anc)
"#,
        r#"
tx.sendto(b"four", u.getsockname())
data, anc, _, _ = u.recvmsg(100, 1024)
expect(data == b"four", "IPv4 datagram")
expect(levels(anc) == [(socket.IPPROTO_IP, IP_PKTINFO), (socket.SOL_SOCKET, SO_TIMESTAMP)], f"IPv4 control data {levels(anc)}")
expect(u.getsockopt(socket.IPPROTO_UDP, UDP_GRO) == 1, "UDP_GRO")
tx6.sendto(b"six", u6.getsockname())
data, anc, _, _ = u6.recvmsg(100, 1024)
expect(data == b"six" and levels(anc) == [(socket.IPPROTO_IPV6, socket.IPV6_PKTINFO)], f"IPv6 control data {levels(anc)}")
expect(u6.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS) == 9, "IPV6_MULTICAST_HOPS")
expect(u6.getsockopt(socket.SOL_SOCKET, SO_PEEK_OFF) == 0, "SO_PEEK_OFF")
s.sendall(b"inq")
data, anc, _, _ = t.recvmsg(100, 1024)
expect(data == b"inq" and levels(anc) == [(socket.IPPROTO_TCP, TCP_INQ)], f"TCP_INQ control data {levels(anc)}")
"#,
    );
}

/// Datagrams waiting in UDP receive queues come back, in order, each from
/// its sender: one whose sender's socket is closed, a large one, IPv4 and
/// IPv6 ones on a socket bound to the IPv6 wildcard, and one queued before
/// its socket connected elsewhere. Nothing more arrives.
#[test]
fn udp_receive_queues_round_trip() {
    round_trip(
        "udpqueue",
        r#"
SO_PEEK_OFF = 42
def udp(family, addr):
    s = socket.socket(family, socket.SOCK_DGRAM); s.bind((addr, 0)); return s
s1, s2, s3 = (udp(socket.AF_INET, "127.0.0.1") for _ in range(3))
a2, a3 = s2.getsockname(), s3.getsockname()
s2.sendto(b"from a closed socket", s1.getsockname()); s3.sendto(b"second", s1.getsockname())
s3.sendto(b"L" * 60000, s1.getsockname())
s2.close()
w = udp(socket.AF_INET6, "::"); v4 = udp(socket.AF_INET, "127.0.0.1"); v6 = udp(socket.AF_INET6, "::1")
v4.sendto(b"four", ("127.0.0.1", w.getsockname()[1])); v6.sendto(b"six", ("::1", w.getsockname()[1]))
c = udp(socket.AF_INET, "127.0.0.1"); s1.sendto(b"before connect", c.getsockname()); c.connect(a3)
def queued(s):
    # Datagrams in the queue, counted by peeking at a moving offset.
    s.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, 0); n = 0
    try:
        while True:
            s.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT); n += 1
    except BlockingIOError:
        pass
    s.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, -1)
    return n
# Loopback delivery may lag behind sendto: wait until all are queued.
t = time.time() + 10
while [queued(s) for s in (s1, w, c)] != [3, 2, 1] and time.time() < t:
    time.sleep(0.001)
expect([queued(s) for s in (s1, w, c)] == [3, 2, 1], "datagrams queued before the checkpoint")
for s in (s1, w, c): s.setblocking(False)
"#,
        r#"
expect(s1.recvfrom(100) == (b"from a closed socket", a2), "1st")
expect(s1.recvfrom(100) == (b"second", a3), "2nd")
expect(s1.recvfrom(65536) == (b"L" * 60000, a3), "the large one")
d, a = w.recvfrom(100)
expect((d, a[0], a[1]) == (b"four", "::ffff:127.0.0.1", v4.getsockname()[1]), "IPv4 on the IPv6 wildcard %r" % ((d, a),))
d, a = w.recvfrom(100)
expect((d, a[:2]) == (b"six", v6.getsockname()[:2]), "IPv6 %r" % ((d, a),))
expect(c.recv(100) == b"before connect", "queued before connect()")
for s in (s1, w, c):
    try:
        s.recv(100); expect(False, "one datagram too many")
    except BlockingIOError:
        pass
s3.sendto(b"after", c.getsockname())
c.setblocking(True); c.settimeout(5); expect(c.recv(100) == b"after", "the connected socket receives")
"#,
    );
}

/// UDP-Lite sockets (bound, connected, shut, with their checksum coverage
/// and a datagram queued, given back as UDP-Lite), a raw socket of a
/// protocol above 255 (the kernel takes up to IPPROTO_MAX, 262) and one of
/// protocol TCP (not a TCP socket: `--verify` tells them apart) come back.
#[test]
fn udplite_and_high_protocol_raw_round_trip() {
    round_trip(
        "udplite",
        r#"
UDPLITE, SEND_CSCOV, RECV_CSCOV = 136, 10, 11
def lite(addr=("127.0.0.1", 0)):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, UDPLITE); s.bind(addr); return s
a = lite(); b = lite(); b.connect(a.getsockname())
b.setsockopt(UDPLITE, SEND_CSCOV, 20); a.setsockopt(UDPLITE, RECV_CSCOV, 12)
b.send(b"queued lite")
c = lite(("0.0.0.0", 0)); c.connect(a.getsockname()); c.shutdown(socket.SHUT_WR)
r = socket.socket(socket.AF_INET, socket.SOCK_RAW, 256)
r6 = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_TCP)
t = time.time() + 10
while time.time() < t:
    try:
        a.recv(100, socket.MSG_PEEK | socket.MSG_DONTWAIT); break
    except BlockingIOError:
        time.sleep(0.001)
"#,
        r#"
a.settimeout(5)
expect(a.recvfrom(100) == (b"queued lite", b.getsockname()), "the queued UDP-Lite datagram")
expect(b.getsockopt(UDPLITE, SEND_CSCOV) == 20, "UDPLITE_SEND_CSCOV")
expect(a.getsockopt(UDPLITE, RECV_CSCOV) == 12, "UDPLITE_RECV_CSCOV")
expect(a.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL) == UDPLITE, "a UDP-Lite socket")
b.send(b"after"); expect(a.recv(100) == b"after", "the connected one sends")
try:
    c.send(b"x"); expect(False, "the shut socket sent")
except BrokenPipeError:
    pass
expect(r.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL) == 256, "raw protocol 256")
expect(r6.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_RAW, "raw socket of protocol TCP")
"#,
    );
}

/// `cr_restart --tcp-close`: an established connection (both ends in the
/// tree, data in flight) and one whose peer is outside come back closed
/// (end-of-file, POLLHUP, EPIPE, state CLOSE); the listener still accepts.
#[test]
fn tcp_close_restores_connections_closed() {
    let rt = crate::kinds::testkit::round_trip_restoring(
        "tcpclose",
        r#"
import select
lis = socket.socket(); lis.bind(("127.0.0.1", 0)); lis.listen(4)
c = socket.create_connection(lis.getsockname()); s, _ = lis.accept()
c.send(b"in flight")
def closed(sock, who):
    expect(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == 7, who + " is not CLOSE")
    expect(sock.recv(10, socket.MSG_DONTWAIT) == b"", who + " does not read end-of-file")
    p = select.poll(); p.register(sock, select.POLLIN)
    expect(dict(p.poll(0)).get(sock.fileno(), 0) & select.POLLHUP, who + " has no POLLHUP")
    try:
        sock.send(b"x", socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL); expect(False, who + " sent")
    except BrokenPipeError:
        pass
"#,
        r#"
closed(c, "the client end"); closed(s, "the server end")
n = socket.create_connection(lis.getsockname()); a, _ = lis.accept()
n.send(b"new"); expect(a.recv(10) == b"new", "a new connection to the listener")
"#,
        |_| {},
        |_| {},
        |o| o.tcp_close = true,
    );
    let states = |c: &cr_image::model::Checkpoint| {
        let mut v: Vec<u32> = crate::kinds::testkit::objects_of(c, |k| match k {
            cr_image::model::ObjectKind::InetSocket(s) => Some(&s.state),
            _ => None,
        });
        v.sort();
        v
    };
    assert_eq!(
        states(&rt.before),
        vec![1, 1, 10],
        "two established, one listener"
    );
    assert_eq!(
        states(&rt.after),
        vec![7, 7, 10],
        "two closed, one listener"
    );
}

/// Two listeners sharing a port with SO_REUSEPORT, one of which turned the
/// option off after it bound, come back on that port with their own
/// values, and both accept.
#[test]
fn listeners_sharing_a_port_round_trip() {
    round_trip(
        "reuseport",
        r#"
def listener(port):
    l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    l.bind(("127.0.0.1", port)); l.listen(8); return l
l1 = listener(0); port = l1.getsockname()[1]; l2 = listener(port)
l1.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 0)
"#,
        r#"
expect(l1.getsockname()[1] == port and l2.getsockname()[1] == port, "the shared port")
expect(l1.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0, "SO_REUSEPORT turned off")
expect(l2.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1, "SO_REUSEPORT on")
# Connections spread over both listeners (by a hash of the source port),
# each accepted before the next is made.
l1.setblocking(False); l2.setblocking(False)
got, conns = set(), []
for _ in range(64):
    conns.append(socket.create_connection(("127.0.0.1", port)))
    for l in (l1, l2):
        try:
            l.accept(); got.add(l.fileno())
        except BlockingIOError:
            pass
    if len(got) == 2:
        break
expect(got == {l1.fileno(), l2.fileno()}, "both listeners accept")
"#,
    );
}

/// Bytes written under UDP_CORK and not sent yet cannot be read from the
/// kernel: a checkpoint that kills is refused, and the program still sends
/// them as one datagram when it uncorks.
#[test]
fn corked_udp_socket_is_refused() {
    let err = crate::kinds::testkit::refused(
        "udpcork",
        r#"
rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); rx.bind(("127.0.0.1", 0))
tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); tx.bind(("127.0.0.1", 0))
tx.setsockopt(socket.IPPROTO_UDP, 1, 1)  # UDP_CORK
tx.sendto(b"part 1, ", rx.getsockname()); tx.sendto(b"part 2", rx.getsockname())
"#,
        r#"
tx.setsockopt(socket.IPPROTO_UDP, 1, 0)
rx.settimeout(5)
expect(rx.recvfrom(100) == (b"part 1, part 2", tx.getsockname()), "the corked datagram")
"#,
        "corked",
    );
    assert!(err.contains("not sent yet"), "{err}");
}

/// `OLD:PORT=NEW` rewrites one endpoint and wins over `OLD=NEW`; an
/// IPv4-mapped address stays mapped.
#[test]
fn endpoint_rewrites_win_over_address_rewrites() {
    use super::AddrMap;
    use std::net::SocketAddr;
    let rw = |s: &str| s.parse::<crate::options::AddrRewrite>().unwrap();
    let m = AddrMap::new(&[rw("10.0.0.1=10.0.0.9"), rw("10.0.0.1:7300=10.0.0.3")]);
    let a = |s: &str| s.parse::<SocketAddr>().unwrap();
    assert_eq!(m.map(a("10.0.0.1:7300")), a("10.0.0.3:7300"));
    assert_eq!(m.map(a("10.0.0.1:80")), a("10.0.0.9:80"));
    assert_eq!(
        m.map(a("[::ffff:10.0.0.1]:7300")),
        a("[::ffff:10.0.0.3]:7300")
    );
    assert_eq!(m.map(a("10.0.0.2:7300")), a("10.0.0.2:7300"));
    assert_eq!(
        rw("10.0.0.1:7300=10.0.0.3").to_string(),
        "10.0.0.1:7300=10.0.0.3"
    );
    assert!("10.0.0.1:x=10.0.0.3"
        .parse::<crate::options::AddrRewrite>()
        .is_err());
}

/// Shut sockets: a connected UDP socket shut for writing (a send fails
/// with EPIPE), an unbound-peer UDP socket shut for reading (poll reports
/// the hang-up; the kernel sets the bits though the call says ENOTCONN),
/// and an established TCP connection shut for reading (reads end at once)
/// that still sends.
#[test]
fn shut_sockets_round_trip() {
    let rt = round_trip(
        "inet-shut",
        r#"
import select
u1 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u1.bind(("127.0.0.1", 0))
u2 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u2.bind(("127.0.0.1", 0))
u2.connect(u1.getsockname()); u2.shutdown(socket.SHUT_WR)
u3 = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u3.bind(("127.0.0.1", 0))
try:
    u3.shutdown(socket.SHUT_RD)
except OSError:
    pass
lis = socket.socket(); lis.bind(("127.0.0.1", 0)); lis.listen(1)
c = socket.create_connection(lis.getsockname()); s, _ = lis.accept()
c.shutdown(socket.SHUT_RD)
def rdhup(sock):
    p = select.poll(); p.register(sock, select.POLLIN | select.POLLRDHUP)
    return dict(p.poll(0)).get(sock.fileno(), 0) & select.POLLRDHUP
"#,
        r#"
try:
    u2.send(b"x")
    expect(False, "the UDP socket shut for writing sent")
except BrokenPipeError:
    pass
expect(rdhup(u3), "the UDP socket shut for reading")
expect(not rdhup(u1), "the UDP socket left open")
c.settimeout(5)
expect(c.recv(10) == b"", "the TCP connection shut for reading")
c.send(b"still"); s.settimeout(5)
expect(s.recv(10) == b"still", "it still sends")
"#,
    );
    let shut = |c: &cr_image::model::Checkpoint| {
        let mut v: Vec<u32> = c
            .objects
            .iter()
            .filter_map(|o| match &o.kind {
                cr_image::model::ObjectKind::InetSocket(s) => Some(s.shutdown),
                _ => None,
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(shut(&rt.before), vec![0, 0, 0, 1, 1, 2]);
    assert_eq!(shut(&rt.before), shut(&rt.after));
}

/// Python helpers of the TCP state tests (connections over 127.0.0.1, or
/// ::1 where a test sets FAMILY and LOOPBACK): a connection's state, waiting
/// for one, reading to the end, and nft rules of the test's own network
/// namespace that drop one direction of a connection (so that a FIN or
/// its ACK stays in flight).
const TCP_STATES: &str = r#"
import select, subprocess, termios
ESTABLISHED, SYN_SENT, FIN_WAIT1, FIN_WAIT2, CLOSE, CLOSE_WAIT, LAST_ACK, CLOSING = 1, 2, 4, 5, 7, 8, 9, 11
NAMES = {1: "ESTABLISHED", 2: "SYN-SENT", 4: "FIN-WAIT-1", 5: "FIN-WAIT-2", 6: "TIME-WAIT", 7: "CLOSE", 8: "CLOSE-WAIT", 9: "LAST-ACK", 11: "CLOSING"}
def state(s):
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
def wait_state(s, want, secs=30):
    t = time.time() + secs
    while state(s) != want and time.time() < t:
        time.sleep(0.01)
    return state(s) == want
def is_(s, want, who):
    expect(state(s) == want, "%s is %s, not %s" % (who, NAMES.get(state(s)), NAMES[want]))
def ends(s, want, who):
    expect(wait_state(s, want), "%s stays %s, not %s" % (who, NAMES.get(state(s)), NAMES[want]))
def ioctl_int(s, req):
    return struct.unpack("i", fcntl.ioctl(s.fileno(), req, b"\0" * 4))[0]
def settled(*socks, secs=10):
    t = time.time() + secs
    while any(ioctl_int(s, termios.TIOCOUTQ) for s in socks) and time.time() < t:
        time.sleep(0.01)
def read_to_eof(s, secs=60):
    s.settimeout(secs)
    got = b""
    while True:
        d = s.recv(65536)
        if not d:
            return got
        got += d
def nft(script):
    subprocess.run(["nft", "-f", "-"], input=script.encode(), check=True)
# Dropped on the way in: the sender's TCP counts what it sent as sent.
def drop(rule):
    nft("add table inet t\nadd chain inet t in { type filter hook input priority 0; }\nadd rule inet t in " + rule + " drop\n")
def undrop():
    nft("delete table inet t\n")
FAMILY, LOOPBACK = socket.AF_INET, "127.0.0.1"
def pair():
    lis = socket.socket(FAMILY); lis.bind((LOOPBACK, 0)); lis.listen(1)
    a = socket.create_connection(lis.getsockname()[:2]); b, _ = lis.accept()
    lis.close()
    return a, b
def port(s):
    return s.getsockname()[1]
def exchanged():
    """A pair, each end with the other's data acknowledged (not read)."""
    a, b = pair()
    b.sendall(b"b1 " * 100); a.sendall(b"a1 " * 100)
    settled(a, b)
    return a, b
def to_the_end(a, want_a, b, want_b):
    """Packets flow again: each end reads what it wants then the end, and
    both connections close."""
    undrop()
    for s, want, who in ((a, want_a, "a"), (b, want_b, "b")):
        got = read_to_eof(s)
        expect(got == want, "%s read %d bytes of %d before the end" % (who, len(got), len(want)))
    ends(a, CLOSE, "a"); ends(b, CLOSE, "b")
"#;

/// The TCP states of the image's sockets, sorted.
fn tcp_states(c: &cr_image::model::Checkpoint) -> Vec<u32> {
    let mut v: Vec<u32> = c
        .objects
        .iter()
        .filter_map(|o| match &o.kind {
            cr_image::model::ObjectKind::InetSocket(s) if s.protocol == 6 => Some(s.state),
            _ => None,
        })
        .collect();
    v.sort();
    v
}

/// A round trip of `setup`/`check` (with [`TCP_STATES`]) in a network
/// namespace of its own; the image holds sockets in `states` before and
/// after.
fn tcp_states_round_trip(name: &str, setup: &str, check: &str, states: &[u32]) {
    tcp_states_round_trip_in(Family::V4, name, setup, check, states)
}

/// The address family of the connections [`TCP_STATES`]'s `pair()` makes.
#[derive(Clone, Copy)]
enum Family {
    V4,
    /// Over ::1: the peer's segments forged at restore are IPv6 ones.
    V6,
}

/// The round trip `body(family, name)` as two tests: over IPv4 (`v4`) and
/// over IPv6 (`v6`, its name with "-v6").
macro_rules! both_families {
    ($v4:ident, $v6:ident, $body:ident, $name:literal) => {
        #[test]
        fn $v4() {
            $body(Family::V4, $name);
        }

        #[test]
        fn $v6() {
            $body(Family::V6, concat!($name, "-v6"));
        }
    };
}

/// [`tcp_states_round_trip`] with connections of `family`.
fn tcp_states_round_trip_in(family: Family, name: &str, setup: &str, check: &str, states: &[u32]) {
    let family = match family {
        Family::V4 => "",
        Family::V6 => "FAMILY, LOOPBACK = socket.AF_INET6, \"::1\"\n",
    };
    let setup = format!("{TCP_STATES}{family}{setup}");
    let rt = in_new_netns(|| round_trip(name, &setup, check));
    assert_eq!(tcp_states(&rt.before), states, "{name}: the first image");
    assert_eq!(
        tcp_states(&rt.after),
        states,
        "{name}: the image of the restored program"
    );
}

both_families!(
    tcp_fin_wait2_and_close_wait_round_trip,
    tcp_fin_wait2_and_close_wait_round_trip_ipv6,
    tcp_fin_wait2_and_close_wait,
    "tcp-fin-wait2"
);

/// FIN-WAIT-2 and CLOSE-WAIT: `a` shut its sending side and the peer `b`
/// acknowledged the FIN; both have data not read yet. After the restore `b`
/// reads its data then the end of the stream, and can still write to `a`;
/// `a` reads all `b` wrote and cannot write; when `b` shuts too, `a` sees
/// the end.
fn tcp_fin_wait2_and_close_wait(family: Family, name: &str) {
    tcp_states_round_trip_in(
        family,
        name,
        r#"
a, b = pair()
b.sendall(b"to a " * 100)
a.sendall(b"to b " * 500)
a.shutdown(socket.SHUT_WR)
expect(wait_state(a, FIN_WAIT2) and wait_state(b, CLOSE_WAIT), "not set up: %s %s" % (state(a), state(b)))
"#,
        r#"
is_(a, FIN_WAIT2, "a"); is_(b, CLOSE_WAIT, "b")
got = read_to_eof(b)
expect(got == b"to b " * 500, "b read %d bytes before the end" % len(got))
expect(b.recv(10) == b"", "b: the end again")
b.sendall(b"after")
a.settimeout(30)
want = b"to a " * 100 + b"after"
got = b""
while len(got) < len(want):
    d = a.recv(65536)
    if not d:
        break
    got += d
expect(got == want, "a read %d bytes of %d" % (len(got), len(want)))
try:
    a.send(b"x")
    expect(False, "a wrote after its shutdown")
except BrokenPipeError:
    pass
b.shutdown(socket.SHUT_WR)
expect(a.recv(10) == b"", "a sees the end")
ends(b, CLOSE, "b")
"#,
        &[5, 8],
    );
}

both_families!(
    tcp_fin_wait1_and_last_ack_round_trip,
    tcp_fin_wait1_and_last_ack_round_trip_ipv6,
    tcp_fin_wait1_and_last_ack,
    "tcp-last-ack"
);

/// FIN-WAIT-1 and LAST-ACK: nothing `b` sends reaches `a`: `a` shut its
/// side (its FIN reached `b`, the ACK did not come back), `b` wrote more and
/// shut its side too. Once packets flow again, each reads all the other
/// wrote and the end, and both connections close.
fn tcp_fin_wait1_and_last_ack(family: Family, name: &str) {
    tcp_states_round_trip_in(
        family,
        name,
        r#"
a, b = exchanged()
drop("tcp sport %d tcp dport %d" % (port(b), port(a)))
a.shutdown(socket.SHUT_WR)
expect(wait_state(b, CLOSE_WAIT), "b did not get the FIN")
b.sendall(b"b2 " * 50)
b.shutdown(socket.SHUT_WR)
expect(wait_state(b, LAST_ACK) and state(a) == FIN_WAIT1, "not set up: %s %s" % (state(a), state(b)))
"#,
        r#"
is_(a, FIN_WAIT1, "a"); is_(b, LAST_ACK, "b")
to_the_end(a, b"b1 " * 100 + b"b2 " * 50, b, b"a1 " * 100)
"#,
        &[4, 9],
    );
}

both_families!(
    tcp_closing_round_trip,
    tcp_closing_round_trip_ipv6,
    tcp_closing,
    "tcp-closing"
);

/// CLOSING (and FIN-WAIT-1): nothing `a` sends reaches `b`; both shut
/// their sides, so the FINs crossed: `a` got `b`'s FIN before any ACK of
/// its own. Once packets flow again, both read the other's data and the
/// end, and both connections close.
fn tcp_closing(family: Family, name: &str) {
    tcp_states_round_trip_in(
        family,
        name,
        r#"
a, b = exchanged()
drop("tcp sport %d tcp dport %d" % (port(a), port(b)))
a.shutdown(socket.SHUT_WR)
b.shutdown(socket.SHUT_WR)
expect(wait_state(a, CLOSING) and state(b) == FIN_WAIT1, "not set up: %s %s" % (state(a), state(b)))
"#,
        r#"
is_(a, CLOSING, "a"); is_(b, FIN_WAIT1, "b")
to_the_end(a, b"b1 " * 100, b, b"a1 " * 100)
"#,
        &[4, 11],
    );
}

/// FIN-WAIT-1 with the FIN never sent: `b` does not read, so `a`'s data
/// waits unsent behind a closed window, and the FIN `a` queued waits
/// behind it. After the restore `b` reads every byte and then the end;
/// `a` gets to FIN-WAIT-2 and still reads what `b` writes.
#[test]
fn tcp_fin_behind_unsent_data_round_trip() {
    tcp_states_round_trip(
        "tcp-fin-unsent",
        r#"
SIOCOUTQNSD = 0x894B
lis = socket.socket(); lis.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
lis.bind(("127.0.0.1", 0)); lis.listen(1)
a = socket.socket(); a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
a.connect(lis.getsockname()); b, _ = lis.accept(); lis.close()
a.setblocking(False)
data = bytes(i % 251 for i in range(1 << 20))
sent = 0
deadline = time.time() + 20
while time.time() < deadline:
    try:
        sent += a.send(data[sent:sent + 4096])
    except BlockingIOError:
        if ioctl_int(a, SIOCOUTQNSD) > 0:
            break
        time.sleep(0.01)
a.setblocking(True)
a.shutdown(socket.SHUT_WR)
expect(state(a) == FIN_WAIT1 and ioctl_int(a, SIOCOUTQNSD) > 0, "not set up: %s, %d unsent" % (state(a), ioctl_int(a, SIOCOUTQNSD)))
"#,
        r#"
is_(a, FIN_WAIT1, "a"); is_(b, ESTABLISHED, "b")
got = read_to_eof(b)
expect(got == data[:sent], "b read %d bytes of %d before the end" % (len(got), sent))
ends(a, FIN_WAIT2, "a")
b.sendall(b"late")
a.settimeout(30)
expect(a.recv(10) == b"late", "a reads after its shutdown")
b.shutdown(socket.SHUT_WR)
expect(a.recv(10) == b"", "a sees the end")
"#,
        &[1, 4],
    );
}

/// The part of the setups below that fills `a`'s send buffer (its size
/// left to autotuning) while `b` reads nothing, until bytes wait unsent
/// behind the closed window and no more fit.
const FILL_UNREAD: &str = r#"
SIOCOUTQNSD = 0x894B
a, b = pair()
a.setblocking(False)
data = bytes(i % 251 for i in range(64 << 20))
sent = 0
full_since = None
deadline = time.time() + 30
while time.time() < deadline:
    try:
        sent += a.send(data[sent:sent + 65536])
        full_since = None
    except BlockingIOError:
        # Full for a while: the window stays closed and the buffer stops growing.
        full_since = full_since or time.time()
        if ioctl_int(a, SIOCOUTQNSD) > 0 and time.time() - full_since > 0.5:
            break
        time.sleep(0.01)
a.setblocking(True)
unsent = ioctl_int(a, SIOCOUTQNSD)
expect(unsent > 0, "nothing unsent")
"#;

/// FIN-WAIT-1 with megabytes unsent: `b` does not read and `a`'s send
/// buffer, grown by autotuning, is full of bytes never sent, its FIN
/// behind them. A rebuilt socket packs those bytes in other segments, so
/// they may not fit its buffer of the same size: after the restore they
/// are all queued (and the FIN), and `b` reads every byte then the end.
#[test]
fn tcp_fin_behind_a_full_autotuned_buffer_round_trip() {
    let setup = format!(
        "{FILL_UNREAD}{}",
        r#"
a.shutdown(socket.SHUT_WR)
expect(state(a) == FIN_WAIT1, "not set up: %s" % NAMES.get(state(a)))
"#
    );
    tcp_states_round_trip(
        "tcp-fin-full-buffer",
        &setup,
        r#"
is_(a, FIN_WAIT1, "a")
got = read_to_eof(b)
expect(got == data[:sent], "b read %d bytes of %d before the end" % (len(got), sent))
ends(a, FIN_WAIT2, "a")
"#,
        &[1, 4],
    );
}

/// CLOSING with the program's FIN never sent: `a`'s FIN waits behind
/// bytes `b` does not read, and `b` shut its side, so `a` got `b`'s FIN
/// (CLOSING) and `b` is in FIN-WAIT-2. The peer's FIN comes back only
/// after `a`'s bytes are queued again at the release (so do the windows
/// it counted in). Then `b` reads every byte and the end, `a` the end,
/// and both close.
#[test]
fn tcp_closing_with_fin_unsent_round_trip() {
    let setup = format!(
        "{FILL_UNREAD}{}",
        r#"
a.shutdown(socket.SHUT_WR)
b.shutdown(socket.SHUT_WR)
expect(wait_state(a, CLOSING) and wait_state(b, FIN_WAIT2), "not set up: %s %s" % (NAMES.get(state(a)), NAMES.get(state(b))))
"#
    );
    tcp_states_round_trip(
        "tcp-closing-fin-unsent",
        &setup,
        r#"
is_(a, CLOSING, "a"); is_(b, FIN_WAIT2, "b")
got = read_to_eof(b)
expect(got == data[:sent], "b read %d bytes of %d before the end" % (len(got), sent))
expect(read_to_eof(a) == b"", "a reads the end")
ends(a, CLOSE, "a"); ends(b, CLOSE, "b")
"#,
        &[5, 11],
    );
}

/// Sockets bound to addresses this host lacks, with IP_FREEBIND on at
/// their bind and off since (UDP over IPv6, a TCP listener over IPv4):
/// bound there again, the option still off.
#[test]
fn freebind_cleared_after_bind_round_trip() {
    let rt = in_new_netns(|| {
        round_trip(
            "inet-freebind",
            r#"
IP_FREEBIND = 15
u = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
u.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
u.bind(("2001:db8::ff00:42:8329", 56789))
u.setsockopt(socket.SOL_IP, IP_FREEBIND, 0)
t = socket.socket()
t.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
t.bind(("192.0.2.7", 8080)); t.listen(1)
t.setsockopt(socket.SOL_IP, IP_FREEBIND, 0)
"#,
            r#"
expect(u.getsockname()[:2] == ("2001:db8::ff00:42:8329", 56789), "u bound to %r" % (u.getsockname(),))
expect(t.getsockname() == ("192.0.2.7", 8080), "t bound to %r" % (t.getsockname(),))
for s, who in ((u, "u"), (t, "t")):
    expect(s.getsockopt(socket.SOL_IP, IP_FREEBIND) == 0, who + ": IP_FREEBIND on")
expect(t.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1, "t listens")
"#,
        )
    });
    assert_eq!(rt.before.objects.len(), rt.after.objects.len());
}

/// SYN-SENT: non-blocking connects whose SYNs are dropped: to a listener,
/// to a port where a listener comes only after the restore, and to a port
/// where none ever comes. Once packets flow again the first two complete
/// (and carry data), the third is refused.
#[test]
fn tcp_syn_sent_round_trip() {
    tcp_states_round_trip(
        "tcp-syn-sent",
        r#"
lis = socket.socket(); lis.bind(("127.0.0.1", 0)); lis.listen(4)
def free_port():
    t = socket.socket(); t.bind(("127.0.0.1", 0)); p = port(t); t.close()
    return p
later, never = free_port(), free_port()
drop("tcp dport { %d, %d, %d }" % (port(lis), later, never))
conns = []
for p in (port(lis), later, never):
    c = socket.socket(); c.setblocking(False)
    expect(c.connect_ex(("127.0.0.1", p)) == errno.EINPROGRESS, "connect did not start")
    conns.append(c)
c1, c2, c3 = conns
expect(all(state(c) == SYN_SENT for c in conns), "not set up: %s" % [state(c) for c in conns])
def outcome(c):
    p = select.poll(); p.register(c, select.POLLOUT)
    p.poll(60000)
    return c.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
"#,
        r#"
for i, c in enumerate(conns):
    is_(c, SYN_SENT, "c%d" % (i + 1))
lis2 = socket.socket(); lis2.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
lis2.bind(("127.0.0.1", later)); lis2.listen(1)
undrop()
for c, l in ((c1, lis), (c2, lis2)):
    err = outcome(c)
    expect(err == 0, "connect to %d: %s" % (port(l), os.strerror(err)))
    if err == 0:
        s, _ = l.accept()
        c.setblocking(True); c.sendall(b"hello"); s.settimeout(10)
        expect(s.recv(10) == b"hello", "data over the connection to %d" % port(l))
err = outcome(c3)
expect(err == errno.ECONNREFUSED, "connect to a closed port: %s" % os.strerror(err))
"#,
        &[2, 2, 2, 10],
    );
}

/// Run `f` in a network namespace of its own whose
/// net.ipv4.ping_group_range is `range`.
fn with_ping_groups<T: Send>(range: &str, f: impl FnOnce() -> T + Send) -> T {
    in_new_netns(|| {
        std::fs::write("/proc/sys/net/ipv4/ping_group_range", range)
            .expect("set ping_group_range in the test's network namespace");
        f()
    })
}

/// A ping socket of a program whose group is in net.ipv4.ping_group_range
/// while the restorer's (root's group 0) is not: the kernel refuses root
/// too, so the restore makes it as a group of the range. After the restore
/// the program pings through it and gets its echo reply.
#[test]
fn ping_socket_restored_outside_the_restorers_group_range() {
    let rt = with_ping_groups("4242 4242", || {
        round_trip(
            "inet-ping",
            r#"
os.setgroups([]); os.setgid(4242)
ping = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
def echo(seq):
    ping.sendto(struct.pack("!BBHHH", 8, 0, 0, 0, seq) + b"cr-ping", ("127.0.0.1", 0))
    ping.settimeout(5)
    reply = ping.recv(64)
    return reply[0], struct.unpack("!H", reply[6:8])[0], reply[8:]
assert echo(1) == (0, 1, b"cr-ping"), "a ping before the checkpoint"
"#,
            r#"
expect(os.getgid() == 4242, "the group: %d" % os.getgid())
expect(ping.getsockopt(socket.SOL_SOCKET, socket.SO_PROTOCOL) == socket.IPPROTO_ICMP, "the protocol")
expect(ping.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_DGRAM, "the type")
expect(echo(2) == (0, 2, b"cr-ping"), "the echo reply after the restore")
"#,
        )
    });
    let pings = |c: &cr_image::model::Checkpoint| {
        crate::kinds::testkit::objects_of(c, |k| match k {
            cr_image::model::ObjectKind::InetSocket(s) => Some(s),
            _ => None,
        })
        .into_iter()
        .filter(|s| s.sock_type == 2 && s.protocol == 1)
        .count()
    };
    assert_eq!((pings(&rt.before), pings(&rt.after)), (1, 1));
}

/// Ping sockets keep their echo identifier (the kernel's "port" of an ICMP
/// datagram socket: it rewrites the id of every echo request sent and
/// hands a reply only to the socket of its id): one given its id by the
/// kernel at its first send, one bound to an id of its own, an ICMPv6 one,
/// and connected ones of both families (given their id by the connect;
/// getpeername hides their peer). After the restore each has its id again
/// and gets replies with it; the connected ones, and a connected raw ICMP
/// socket, send without an address.
#[test]
fn ping_sockets_keep_their_echo_id() {
    let rt = with_ping_groups("0 0", || {
        round_trip(
            "inet-ping-id",
            r#"
def ping(family, bind=None):
    s = socket.socket(family, socket.SOCK_DGRAM,
                      socket.IPPROTO_ICMP if family == socket.AF_INET else socket.IPPROTO_ICMPV6)
    if bind is not None:
        s.bind(("0.0.0.0" if family == socket.AF_INET else "::", bind))
    return s
def echo(s, seq):
    v4 = s.family == socket.AF_INET
    request = struct.pack("!BBHHH", 8 if v4 else 128, 0, 0, 0xbeef, seq) + b"cr-ping"
    if s in connected:
        s.send(request)
    else:
        s.sendto(request, ("127.0.0.1" if v4 else "::1", 0))
    s.settimeout(5)
    reply = s.recv(64)
    kind, ident, got = struct.unpack("!BxxxHH", reply[:8])
    expect(kind == (0 if v4 else 129) and got == seq and reply[8:] == b"cr-ping", "echo reply %r" % reply)
    return ident
pings = {"auto": ping(socket.AF_INET), "bound": ping(socket.AF_INET, 4321), "v6": ping(socket.AF_INET6),
         "connected": ping(socket.AF_INET), "connected v6": ping(socket.AF_INET6)}
pings["connected"].connect(("127.0.0.1", 0)); pings["connected v6"].connect(("::1", 0))
connected = [pings["connected"], pings["connected v6"]]
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
raw.connect(("127.0.0.1", 0))
ids = {name: echo(s, 1) for name, s in pings.items()}
assert ids["bound"] == 4321, "the bound id %d" % ids["bound"]
for name, s in pings.items():
    assert s.getsockname()[1] == ids[name], "%s: id %d, bound to %r" % (name, ids[name], s.getsockname())
"#,
            r#"
for name, s in pings.items():
    expect(s.getsockname()[1] == ids[name], "%s: bound to %r, had id %d" % (name, s.getsockname(), ids[name]))
    got = echo(s, 2)
    expect(got == ids[name], "%s: reply with id %d, had %d" % (name, got, ids[name]))
try:
    raw.send(struct.pack("!BBHHH", 8, 0, 0, 0xbeef, 3) + b"cr-raw")
except OSError as e:
    expect(False, "the connected raw socket: %r" % e)
"#,
        )
    });
    let ids = |c: &cr_image::model::Checkpoint| {
        let mut v: Vec<_> = crate::kinds::testkit::objects_of(c, |k| match k {
            cr_image::model::ObjectKind::InetSocket(s) => Some(s),
            _ => None,
        })
        .into_iter()
        .map(|s| {
            let port = |a: Option<std::net::SocketAddr>| a.map(|a| a.port());
            (s.sock_type, s.protocol, port(s.local), port(s.remote))
        })
        .collect();
        v.sort();
        v
    };
    let (a, b) = (ids(&rt.before), ids(&rt.after));
    assert_eq!(a, b);
    assert_eq!(a.len(), 6, "{a:?}");
    assert!(a.contains(&(2, 1, Some(4321), None)), "{a:?}");
    assert_eq!(
        a.iter().filter(|s| s.3 == Some(0)).count(),
        3,
        "connected: {a:?}"
    );
}

/// A TCP connection reset by its peer (SO_LINGER 0) before the program
/// read what the peer sent: in state CLOSE with bytes in its receive
/// queue, which no repair-mode call can put back in a closed socket.
/// Refused by name, and the program runs on: it reads the bytes, then the
/// reset, then the end.
#[test]
fn tcp_reset_with_unread_data_is_refused() {
    let err = in_new_netns(|| {
        crate::kinds::testkit::refused(
            "tcp-reset-unread",
            &format!(
                "{TCP_STATES}{}",
                r#"
lis = socket.socket(); lis.bind(("127.0.0.1", 0)); lis.listen(1)
c = socket.create_connection(lis.getsockname())
s, _ = lis.accept(); lis.close()
s.send(b"unread bytes")
s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)); s.close()
ends(c, CLOSE, "c")
expect(ioctl_int(c, termios.FIONREAD) > 0, "c has the bytes")
"#
            ),
            r#"
c.settimeout(5)
expect(c.recv(100) == b"unread bytes", "the bytes")
try:
    c.recv(100); expect(False, "no reset after the bytes")
except ConnectionResetError:
    pass
expect(c.recv(100) == b"", "the end after the reset")
"#,
            "in state CLOSE with",
        )
    });
    assert!(err.contains("received and not read"), "{err}");
}

/// A server that accepts slowly (one connection every 0.3 s, its own
/// pace), with three connections queued and their first bytes sent when
/// the checkpoint (--kill) starts: the dump holds new connections off and
/// waits for the program to accept the queued ones, then freezes; after
/// the restore the server has all three, each with its bytes, and they
/// carry data both ways.
#[test]
fn tcp_connections_queued_on_a_listener_are_accepted_before_the_freeze() {
    let rt = in_new_netns(|| {
        round_trip(
            "tcp-accept-drain",
            r#"
import threading
lis = socket.socket(); lis.bind(("127.0.0.1", 0)); lis.listen(8)
clients = [socket.create_connection(lis.getsockname()) for i in range(3)]
for i, c in enumerate(clients):
    c.send(b"hello %d" % i)
served = []
def server():
    for i in range(3):
        time.sleep(0.3)    # the server's pace: one connection at a time
        s, _ = lis.accept()
        served.append((s, s.recv(100)))
t = threading.Thread(target=server); t.start()
"#,
            r#"
t.join(10)
expect(not t.is_alive(), "the server still waits for connections")
expect(sorted(d for _, d in served) == [b"hello 0", b"hello 1", b"hello 2"], "what the server got: %r" % [d for _, d in served])
for (s, d), i in zip(served, range(3)):
    s.send(b"reply " + d)
for c in clients:
    c.settimeout(5)
    got = c.recv(100)
    expect(got.startswith(b"reply hello"), "reply %r" % got)
n = socket.create_connection(lis.getsockname()); a, _ = lis.accept()
n.send(b"new"); expect(a.recv(10) == b"new", "a new connection after the restore")
"#,
        )
    });
    let listeners: Vec<_> = rt
        .before
        .objects
        .iter()
        .filter_map(|o| match &o.kind {
            cr_image::model::ObjectKind::InetSocket(s) if s.state == 10 => Some(s.local),
            _ => None,
        })
        .collect();
    assert_eq!(listeners.len(), 1, "one listener in the image");
}

/// A listener whose program never accepts its queued connection: after
/// the wait, the dump refuses it by name, and the program runs on and
/// accepts the connection with its bytes.
#[test]
fn tcp_connection_never_accepted_is_refused_after_the_wait() {
    let err = in_new_netns(|| {
        crate::kinds::testkit::refused(
            "tcp-never-accepted",
            r#"
lis = socket.socket(); lis.bind(("127.0.0.1", 0)); lis.listen(8)
c = socket.create_connection(lis.getsockname()); c.send(b"early")
"#,
            r#"
s, _ = lis.accept()
expect(s.recv(10) == b"early", "the queued connection's bytes")
s.send(b"late"); c.settimeout(5); expect(c.recv(10) == b"late", "the reply")
"#,
            "not yet accepted",
        )
    });
    assert!(
        err.contains("did not accept them while the checkpoint waited"),
        "{err}"
    );
}

both_families!(
    tcp_ended_connection_round_trip,
    tcp_ended_connection_round_trip_ipv6,
    tcp_ended_connection,
    "tcp-ended"
);

/// Sockets in state CLOSE: both ends of a connection closed both ways
/// (each shut its side, both FINs acknowledged), and a socket never
/// connected. After the restore the ended ones read the end of the stream
/// (not ENOTCONN) and cannot write; the fresh one still says ENOTCONN.
fn tcp_ended_connection(family: Family, name: &str) {
    tcp_states_round_trip_in(
        family,
        name,
        r#"
a, b = pair()
a.shutdown(socket.SHUT_WR)
expect(wait_state(b, CLOSE_WAIT), "b is %s" % NAMES.get(state(b)))
b.shutdown(socket.SHUT_WR)
expect(wait_state(a, CLOSE) and wait_state(b, CLOSE), "not ended: %s %s" % (NAMES.get(state(a)), NAMES.get(state(b))))
fresh = socket.socket(FAMILY, socket.SOCK_STREAM)
SO_PEERNAME = 28
NAMELEN = 16 if FAMILY == socket.AF_INET else 28
names = {s: (s.getsockname(), s.getsockopt(socket.SOL_SOCKET, SO_PEERNAME, NAMELEN)) for s in (a, b)}
expect(names[a][1] != names[b][1], "setup: the peers' names")
"#,
        r#"
for s, who in ((a, "a"), (b, "b")):
    is_(s, CLOSE, who)
    # An ended connection keeps both addresses (SO_PEERNAME tells the peer's).
    now = (s.getsockname(), s.getsockopt(socket.SOL_SOCKET, SO_PEERNAME, NAMELEN))
    expect(now == names[s], "%s: addresses %r, were %r" % (who, now, names[s]))
    expect(s.recv(10) == b"", "%s: the end of the stream" % who)
    try:
        s.send(b"x")
        expect(False, "%s wrote after the end" % who)
    except BrokenPipeError:
        pass
is_(fresh, CLOSE, "fresh")
try:
    fresh.recv(1)
    expect(False, "the fresh socket read")
except OSError as e:
    expect(e.errno == errno.ENOTCONN, "the fresh socket: %s" % e)
"#,
        &[7, 7, 7],
    );
}
