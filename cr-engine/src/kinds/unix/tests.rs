//! Round trip of kind "unix": a stream pair with data queued both ways, a
//! bound datagram socket holding datagrams from a named sender, a listener.

use crate::kinds::testkit::round_trip;

#[test]
fn unix_sockets_round_trip() {
    let rt = round_trip(
        "unix",
        r#"
a, b = socket.socketpair()
a.send(b"to b"); b.send(b"to a" * 50)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
srv.bind(os.path.join(DIR, "dgram"))
cli = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
cli.bind(os.path.join(DIR, "sender"))
cli.sendto(b"one", os.path.join(DIR, "dgram")); cli.sendto(b"two", os.path.join(DIR, "dgram"))
lis = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
lis.bind(os.path.join(DIR, "listen")); lis.listen(5)
"#,
        r#"
expect(b.recv(100) == b"to b", "queue of b")
expect(a.recv(1000) == b"to a" * 50, "queue of a")
d1, f1 = srv.recvfrom(100); d2, f2 = srv.recvfrom(100)
expect((d1, d2) == (b"one", b"two"), "datagrams keep their boundaries")
expect(f1 == os.path.join(DIR, "sender"), "the sender's name %r" % f1)
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
c.connect(os.path.join(DIR, "listen"))
s, _ = lis.accept()
c.send(b"hi"); expect(s.recv(10) == b"hi", "the listener accepts")
"#,
    );
    let socks = |c: &cr_image::model::Checkpoint| {
        let mut v: Vec<_> = c
            .objects
            .iter()
            .filter_map(|o| match &o.kind {
                cr_image::model::ObjectKind::UnixSocket(u) => {
                    Some((u.sock_type, u.state, u.name.clone(), u.queue.clone()))
                }
                _ => None,
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(socks(&rt.before), socks(&rt.after));
}
