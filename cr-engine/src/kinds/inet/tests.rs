//! Round trip of kind "inet" (with the network lock of a --kill dump): a
//! TCP listener, an established connection with data in flight both ways
//! and options set (and its segment size), a bound UDP socket.

use crate::kinds::testkit::round_trip;

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

/// A classic BPF socket filter (and its lock) and SO_BUF_LOCK come back:
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
"#,
    );
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
