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

/// Stream and seqpacket sockets never connected (one bound, one not; the
/// kernel refuses to read their queue: EINVAL, ENOTCONN) are saved with an
/// empty queue, and connect once restored. Before the fix the checkpoint
/// was refused ("cannot be read").
#[test]
fn unconnected_stream_and_seqpacket_sockets() {
    round_trip(
        "unix-unconnected",
        r#"
lis = {}
for name, ty in (("stream", socket.SOCK_STREAM), ("seq", socket.SOCK_SEQPACKET)):
    l = socket.socket(socket.AF_UNIX, ty); l.bind(os.path.join(DIR, name)); l.listen(5)
    lis[ty] = l
plain = {ty: socket.socket(socket.AF_UNIX, ty) for ty in lis}
bound = {ty: socket.socket(socket.AF_UNIX, ty) for ty in lis}
for ty, b in bound.items(): b.bind(os.path.join(DIR, "bound-%d" % ty))
"#,
        r#"
for ty, l in lis.items():
    for c in (plain[ty], bound[ty]):
        c.connect(l.getsockname())
        s, _ = l.accept()
        c.send(b"hello"); expect(s.recv(10) == b"hello", "type %d connects after the restore" % ty)
        s.send(b"back"); expect(c.recv(10) == b"back", "type %d gets the answer" % ty)
    expect(bound[ty].getsockname() == os.path.join(DIR, "bound-%d" % ty), "the bound name of type %d" % ty)
"#,
    );
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

/// Files in flight (SCM_RIGHTS) in the queues of a stream pair and of a
/// datagram pair: a file at an offset and a memfd the sender closed (saved
/// as fds of their own kind), a file and a pipe end the sender kept (the
/// same open file descriptions again: a seek or a flag on one shows on the
/// other). The receiver gets every message at its place, with its files.
#[test]
fn files_in_flight_round_trip() {
    let rt = round_trip(
        "unix-in-flight",
        r#"
path = os.path.join(DIR, "file")
with open(path, "wb") as fh:
    fh.write(b"0123456789")
a, b = socket.socketpair()
f = os.open(path, os.O_RDONLY); os.lseek(f, 3, os.SEEK_SET)
socket.send_fds(a, [b"stream-one"], [f]); os.close(f)
a.send(b"plain")
g = os.open(path, os.O_RDWR)
socket.send_fds(a, [b"stream-two"], [g])
m = os.memfd_create("flying"); os.write(m, b"memfd-data")
r, w = os.pipe()
da, db = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
socket.send_fds(da, [b"dgram-one"], [m, w]); os.close(m)
da.send(b"dgram-two")
"#,
        r#"
msg, fds, _, _ = socket.recv_fds(b, 100, 4)
expect((msg, len(fds)) == (b"stream-one", 1), "first stream message %r with %d files" % (msg, len(fds)))
if fds:
    expect(os.lseek(fds[0], 0, os.SEEK_CUR) == 3, "the passed file's offset")
    expect(os.read(fds[0], 3) == b"345", "the passed file reads on")
msg, fds, _, _ = socket.recv_fds(b, 100, 4)
expect((msg, len(fds)) == (b"plainstream-two", 1), "second stream read %r with %d files" % (msg, len(fds)))
if fds:
    os.lseek(fds[0], 7, os.SEEK_SET)
    expect(os.lseek(g, 0, os.SEEK_CUR) == 7, "the kept file is the same description")
msg, fds, _, _ = socket.recv_fds(db, 100, 4)
expect((msg, len(fds)) == (b"dgram-one", 2), "datagram %r with %d files" % (msg, len(fds)))
if len(fds) == 2:
    os.lseek(fds[0], 0, os.SEEK_SET)
    expect(os.read(fds[0], 100) == b"memfd-data", "the memfd's content")
    fl = fcntl.fcntl(fds[1], fcntl.F_GETFL)
    fcntl.fcntl(fds[1], fcntl.F_SETFL, fl | os.O_NONBLOCK)
    expect(fcntl.fcntl(w, fcntl.F_GETFL) & os.O_NONBLOCK, "the kept pipe end is the same description")
    os.write(fds[1], b"via-pipe")
    expect(os.read(r, 100) == b"via-pipe", "the passed pipe end writes into the pipe")
expect(db.recv(100) == b"dgram-two", "the datagram after")
"#,
    );
    let flying = |c: &cr_image::model::Checkpoint| {
        let mut v: Vec<(u32, Vec<(String, bool)>)> = c
            .objects
            .iter()
            .filter_map(|o| match &o.kind {
                cr_image::model::ObjectKind::UnixSocket(u) => Some(u.in_flight.clone()),
                _ => None,
            })
            .flatten()
            .map(|m| {
                let fds = m
                    .fds
                    .iter()
                    .map(|f| (f.kind.name().to_string(), f.shared.is_some()))
                    .collect();
                (m.message, fds)
            })
            .collect();
        v.sort();
        v
    };
    let before = flying(&rt.before);
    assert_eq!(before.len(), 3, "three messages carry files: {before:?}");
    assert_eq!(before, flying(&rt.after), "the same files in flight after");
    let kinds: Vec<&(String, bool)> = before.iter().flat_map(|(_, f)| f).collect();
    assert!(kinds.contains(&&("memfd".to_string(), false)), "{kinds:?}");
    assert!(kinds.contains(&&("pipe".to_string(), true)), "{kinds:?}");
    assert!(kinds.contains(&&("regular".to_string(), true)), "{kinds:?}");
    assert!(
        kinds.contains(&&("regular".to_string(), false)),
        "{kinds:?}"
    );
}

/// Sockets in flight in their own queues (zdtm scm06): a datagram pair,
/// each end bound to an abstract name, each end's fd sent over each end,
/// so that both queues carry both sockets. The program holds both ends, so
/// the restore takes them from it and queues them again; each socket
/// received is the one sent (its name), read from in turn (as zdtm does).
#[test]
fn sockets_in_flight_in_their_own_queues_round_trip() {
    round_trip(
        "unix-flight-cycle",
        r#"
ska = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
for i, s in enumerate(ska):
    s.bind(b"\0cr-cycle-%d-%d" % (os.getpid(), i))
for i in range(2):
    for j in range(2):
        socket.send_fds(ska[i], [b"%d%d" % (i, j)], [ska[j].fileno()])
names = [s.getsockname() for s in ska]
"#,
        r#"
sk = ska[0]
for k in range(3):
    msg, fds, _, _ = socket.recv_fds(sk, 10, 2)
    expect(len(fds) == 1, "message %d %r carries %d files" % (k, msg, len(fds)))
    if len(fds) != 1:
        break
    sk = socket.socket(fileno=fds[0])
    expect(sk.getsockname() == names[k % 2], "message %d %r carried %r, not %r" % (k, msg, sk.getsockname(), names[k % 2]))
"#,
    );
}

/// Bound sockets whose names the program reused or removed, restored over
/// the killed original's stale socket files: two listeners bound at one
/// path (the first one's file renamed away and back, so the path is the
/// first one's), a datagram socket connected to itself, a datagram socket
/// whose file was replaced by a FIFO (a client still connected to it), and
/// one bound in a directory removed since (a client still connected to
/// it). Each socket keeps its name and its connections; the FIFO and the
/// path's file stay what they were, the removed directory stays removed,
/// and no temporary file is left. Before the fix every one of these
/// restores failed: "address already in use" (the second bind at one
/// path; a FIFO at the name) or "no such file or directory".
#[test]
fn sockets_at_reused_and_removed_names_round_trip() {
    round_trip(
        "unix-reused-names",
        r#"
import stat
p = os.path.join(DIR, "sock")
l1 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); l1.bind(p); l1.listen(1)
os.rename(p, p + ".tmp")
l2 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); l2.bind(p); l2.listen(1)
os.rename(p + ".tmp", p)
me = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
me.bind(os.path.join(DIR, "self")); me.connect(os.path.join(DIR, "self")); me.send(b"to myself")
g = os.path.join(DIR, "ghost")
gs = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); gs.bind(g)
gc = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); gc.connect(g); gc.send(b"queued")
os.unlink(g); os.mkfifo(g); fifo = os.open(g, os.O_RDWR)
d = os.path.join(DIR, "gone")
os.mkdir(d)
ds = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); ds.bind(os.path.join(d, "s"))
dc = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); dc.connect(os.path.join(d, "s"))
os.unlink(os.path.join(d, "s")); os.rmdir(d)
"#,
        r#"
import stat
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); c.connect(p)
a, _ = l1.accept(); c.send(b"x"); expect(a.recv(1) == b"x", "the path reaches the first listener")
expect(l2.getsockname() == p, "the second listener's name %r" % l2.getsockname())
expect(me.recv(100) == b"to myself", "the queue of the socket connected to itself")
me.send(b"again"); expect(me.recv(100) == b"again", "still connected to itself")
expect(gs.recv(100) == b"queued", "the queue of the socket under the FIFO")
gc.send(b"more"); expect(gs.recv(100) == b"more", "its client still reaches it")
expect(stat.S_ISFIFO(os.lstat(g).st_mode), "the FIFO is still at its name")
os.write(fifo, b"f"); expect(os.read(fifo, 1) == b"f", "the FIFO works")
expect(not os.path.exists(d), "the removed directory stays removed")
dc.send(b"d"); expect(ds.recv(10) == b"d", "the socket of the removed directory is reached")
expect(ds.getsockname() == os.path.join(d, "s"), "its name %r" % ds.getsockname())
left = sorted(n for n in os.listdir(DIR) if ".cr" in n)
expect(left == [], "files left: %r" % left)
"#,
    );
}

/// Datagrams queued on a bound socket by senders closed since (one bound
/// at an abstract name, one at a path, removed with it): recvfrom names
/// each sender after the restore, and no file is left at the path. Before
/// the fix they came unnamed (zdtm socket_snd_addr).
#[test]
fn datagrams_of_closed_senders_keep_their_sender_round_trip() {
    round_trip(
        "unix-closed-senders",
        r#"
srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
srv.bind(os.path.join(DIR, "srv"))
abstract = b"\0cr-closed-sender-%d" % os.getpid()
for name in (abstract, os.path.join(DIR, "sender")):
    c = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    c.bind(name)
    c.sendto(b"from %r" % name, os.path.join(DIR, "srv"))
    c.close()
os.unlink(os.path.join(DIR, "sender"))
"#,
        r#"
d1, f1 = srv.recvfrom(100); d2, f2 = srv.recvfrom(100)
expect(d1 == b"from %r" % abstract and f1 == abstract, "the first from %r: %r" % (f1, d1))
p = os.path.join(DIR, "sender")
expect(d2 == b"from %r" % p and f2 == p, "the second from %r: %r" % (f2, d2))
expect(not os.path.lexists(p), "no file left at the sender's path")
"#,
    );
}

/// An epoll in flight (sent over a datagram pair, then closed), watching a
/// pipe and the receiving socket: received after the restore, it reports
/// both with their data. Before the fix the checkpoint was refused (zdtm
/// scm05).
#[test]
fn epoll_in_flight_round_trip() {
    round_trip(
        "unix-epoll-in-flight",
        r#"
import select, array
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
r, w = os.pipe()
ep = select.epoll()
ep.register(r, select.EPOLLIN)
ep.register(b, select.EPOLLIN)
a.sendmsg([b"e"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [ep.fileno()]))])
ep.close()
"#,
        r#"
import select, array
msg, anc, _, _ = b.recvmsg(10, socket.CMSG_SPACE(4))
expect(msg == b"e", "the message %r" % msg)
fds = array.array("i"); fds.frombytes(anc[0][2])
ep = select.epoll.fromfd(fds[0])
expect(ep.poll(0) == [], "no event before a write")
os.write(w, b"x"); a.send(b"y")
got = sorted(ep.poll(1))
expect(got == sorted([(r, select.EPOLLIN), (b.fileno(), select.EPOLLIN)]), "the events %r" % got)
expect(os.read(r, 1) == b"x", "the pipe")
"#,
    );
}

/// Connections queued on listeners and not yet accepted, whose clients had
/// sent data (the data waits on the listener's side, where only accept()
/// reads it), or had closed (with and without data), stream and seqpacket:
/// after the restore, accept() returns them in their order, each with what
/// its client had sent, then the end of a closed client. Before the fix
/// the checkpoint was refused ("already sent data") and a listener whose
/// client had closed came back with an empty queue (accept() blocked; zdtm
/// sk-unix-listen02..04).
#[test]
fn queued_connections_with_data_round_trip() {
    let before = crate::kinds::testkit::round_trip_killed(
        "unix-queued-data",
        r#"
lis, kept = {}, {}
for name, ty in (("stream", socket.SOCK_STREAM), ("seq", socket.SOCK_SEQPACKET)):
    l = socket.socket(socket.AF_UNIX, ty); l.bind(os.path.join(DIR, name)); l.listen(8)
    lis[ty] = l
    a = socket.socket(socket.AF_UNIX, ty); a.connect(l.getsockname()); a.send(b"first"); a.send(b"more")
    b = socket.socket(socket.AF_UNIX, ty); b.connect(l.getsockname()); b.send(b"gone"); b.close()
    c = socket.socket(socket.AF_UNIX, ty); c.connect(l.getsockname()); c.close()
    d = socket.socket(socket.AF_UNIX, ty); d.connect(l.getsockname())
    kept[ty] = (a, d)
"#,
        r#"
def drain(s, ty):
    got = []
    while True:
        m = s.recv(100)
        if not m: return got
        got.append(m)
for ty, l in lis.items():
    a, d = kept[ty]
    l.setblocking(False)
    acc = []
    while True:
        try: acc.append(l.accept()[0])
        except BlockingIOError: break
    expect(len(acc) == 4, "type %d: 4 connections queued, got %d" % (ty, len(acc)))
    sa, sb, sc, sd = acc
    if ty == socket.SOCK_STREAM:
        got = b""
        while len(got) < 9: got += sa.recv(100)
        expect(got == b"firstmore", "type %d: what the first client sent: %r" % (ty, got))
    else:
        got = [sa.recv(100), sa.recv(100)]
        expect(got == [b"first", b"more"], "type %d: the first client's messages: %r" % (ty, got))
    got = drain(sb, ty)
    expect(b"".join(got) == b"gone", "type %d: a closed client's data, then its end: %r" % (ty, got))
    expect(drain(sc, ty) == [], "type %d: a closed client without data ends at once" % ty)
    a.send(b"later"); expect(sa.recv(100) == b"later", "type %d: the first client still talks" % ty)
    sa.send(b"back"); expect(a.recv(100) == b"back", "type %d: and hears back" % ty)
    sd.send(b"to d"); expect(d.recv(100) == b"to d", "type %d: the last client is connected" % ty)
"#,
    );
    let pending = |c: &cr_image::model::Checkpoint| {
        c.objects
            .iter()
            .filter_map(|o| match &o.kind {
                cr_image::model::ObjectKind::UnixSocket(u) if u.state == 10 => Some(
                    u.pending
                        .iter()
                        .map(|p| p.data.concat())
                        .collect::<Vec<_>>(),
                ),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let want: Vec<Vec<u8>> = vec![b"firstmore".to_vec(), b"gone".to_vec(), vec![], vec![]];
    assert_eq!(pending(&before), vec![want.clone(), want]);
}

/// SO_PEERCRED of socket pairs: one made by the program (its own PID,
/// root), one made by a child as another user and group that then exited
/// (the pair names a process gone, as zdtm sock_peercred). Both pairs
/// name the same peer after the restore.
#[test]
fn socketpair_peer_credentials_round_trip() {
    let rt = round_trip(
        "unix-peercred",
        r#"
import array
def cred(s):
    return struct.unpack("iII", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
mine_a, mine_b = socket.socketpair()
carrier_a, carrier_b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
child = os.fork()
if child == 0:
    os.setgid(4242); os.setuid(4343)
    x, y = socket.socketpair()
    carrier_b.sendmsg([b"p"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [x.fileno(), y.fileno()]))])
    os._exit(0)
msg, anc, _, _ = carrier_a.recvmsg(1, socket.CMSG_LEN(8))
fds = array.array("i"); fds.frombytes(anc[0][2][:8])
theirs_a = socket.socket(fileno=fds[0]); theirs_b = socket.socket(fileno=fds[1])
os.waitpid(child, 0)
mine = (os.getpid(), 0, 0)
theirs = (child, 4343, 4242)
expect(cred(mine_a) == mine and cred(mine_b) == mine, "setup: my pair %r" % (cred(mine_a),))
expect(cred(theirs_a) == theirs and cred(theirs_b) == theirs, "setup: the child's pair %r" % (cred(theirs_a),))
"#,
        r#"
for s, want in ((mine_a, mine), (mine_b, mine), (theirs_a, theirs), (theirs_b, theirs)):
    expect(cred(s) == want, "SO_PEERCRED %r, was %r" % (cred(s), want))
mine_a.send(b"x"); expect(mine_b.recv(1) == b"x", "my pair carries data")
theirs_a.send(b"y"); expect(theirs_b.recv(1) == b"y", "the child's pair carries data")
"#,
    );
    let creds = |c: &cr_image::model::Checkpoint| {
        let mut v: Vec<_> = c
            .objects
            .iter()
            .filter_map(|o| match &o.kind {
                cr_image::model::ObjectKind::UnixSocket(u) => u.peer_cred.map(|p| (p.uid, p.gid)),
                _ => None,
            })
            .collect();
        v.sort();
        v
    };
    assert!(
        creds(&rt.before).contains(&(4343, 4242)),
        "{:?}",
        creds(&rt.before)
    );
    assert_eq!(creds(&rt.before), creds(&rt.after));
}
