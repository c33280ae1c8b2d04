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

/// A listener bound at a temporary name whose file was then made 0600 and
/// renamed into place (as the JVM's attach listener does with
/// `.java_pidN.tmp`): the restored listener is reached at the file's new
/// path, with its mode, keeps the name it was bound with, and no file is
/// left at the temporary name. Before the fix it was bound at the old name
/// and unlinked, and a client found the killed original's stale file
/// ("connection refused"); the file had the restorer's umask (jcmd refuses
/// a socket file readable by others).
#[test]
fn listener_whose_file_was_renamed_after_bind() {
    let rt = round_trip(
        "unix-moved",
        r#"
lis = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
lis.bind(os.path.join(DIR, "moved.tmp")); lis.listen(5)
os.chmod(os.path.join(DIR, "moved.tmp"), 0o600)
os.rename(os.path.join(DIR, "moved.tmp"), os.path.join(DIR, "moved"))
"#,
        r#"
expect(not os.path.exists(os.path.join(DIR, "moved.tmp")), "nothing at the temporary name")
expect(lis.getsockname() == os.path.join(DIR, "moved.tmp"), "its name %r" % lis.getsockname())
mode = os.stat(os.path.join(DIR, "moved")).st_mode & 0o7777
expect(mode == 0o600, "its file's mode %o" % mode)
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
c.connect(os.path.join(DIR, "moved"))
s, _ = lis.accept()
c.send(b"hi"); expect(s.recv(10) == b"hi", "the listener accepts at the new path")
"#,
    );
    for img in [&rt.before, &rt.after] {
        let moved: Vec<(bool, Vec<u8>)> = img
            .objects
            .iter()
            .filter_map(|o| match &o.kind {
                cr_image::model::ObjectKind::UnixSocket(u) => {
                    Some((u.name_unlinked, u.moved_to.clone()))
                }
                _ => None,
            })
            .collect();
        assert_eq!(moved.len(), 1, "one socket");
        assert!(!moved[0].0, "not taken for unlinked");
        assert!(
            moved[0].1.ends_with(b"/moved"),
            "moved to {:?}",
            String::from_utf8_lossy(&moved[0].1)
        );
    }
}
