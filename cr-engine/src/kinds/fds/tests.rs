//! Round trip of kind "fds": numbers with gaps and a high one, close-on-exec
//! flags, an open file description shared by dup (one offset for both).

use crate::kinds::testkit::round_trip;

#[test]
fn fd_table_round_trip() {
    let rt = round_trip(
        "fds",
        r#"
p = os.path.join(DIR, "shared")
a = os.open(p, os.O_RDWR | os.O_CREAT)
os.write(a, b"0123456789")
b = os.dup(a)                 # one description, one offset
high = os.dup2(a, 900)
os.set_inheritable(a, True)
os.set_inheritable(high, False)
gap = os.open("/dev/null", os.O_RDONLY)
os.close(gap)
"#,
        r#"
os.lseek(a, 3, os.SEEK_SET)
expect(os.lseek(b, 0, os.SEEK_CUR) == 3 and os.lseek(high, 0, os.SEEK_CUR) == 3, "one offset")
expect(os.get_inheritable(a) and not os.get_inheritable(high), "close-on-exec flags")
expect(not os.path.exists("/proc/self/fd/%d" % gap), "the gap")
"#,
    );
    let (a, b) = rt.roots();
    let table = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .map(|f| (f.fd, f.flags, f.shared.map(|s| s.fd), f.kind.name()))
            .collect::<Vec<_>>()
    };
    assert_eq!(table(a), table(b));
    assert!(a.fds.iter().any(|f| f.fd == 900 && f.shared.is_some()));
}

/// I/O signal owners: a socket in O_ASYNC mode owned by the process with
/// a real-time signal (F_SETSIG), a pipe owned by its process group.
/// After the restore a write to the socket's peer still signals the
/// process with that signal.
#[test]
fn signal_owners_round_trip() {
    let rt = round_trip(
        "fd-owners",
        r#"
F_SETSIG, F_GETSIG = 10, 11
sig = signal.SIGRTMIN + 2
signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
a, b = socket.socketpair()
fcntl.fcntl(a.fileno(), fcntl.F_SETOWN, os.getpid())
fcntl.fcntl(a.fileno(), F_SETSIG, sig)
fcntl.fcntl(a.fileno(), fcntl.F_SETFL, fcntl.fcntl(a.fileno(), fcntl.F_GETFL) | os.O_ASYNC)
r, w = os.pipe()
fcntl.fcntl(r, fcntl.F_SETOWN, -os.getpgid(0))
"#,
        r#"
expect(fcntl.fcntl(a.fileno(), fcntl.F_GETOWN) == os.getpid(), "socket owner %d" % fcntl.fcntl(a.fileno(), fcntl.F_GETOWN))
expect(fcntl.fcntl(a.fileno(), F_GETSIG) == sig, "socket signal %d" % fcntl.fcntl(a.fileno(), F_GETSIG))
# (A group is a negative owner, which Python's fcntl takes for an error.)
expect(libc.fcntl(r, fcntl.F_GETOWN) == -os.getpgid(0), "pipe owner %d" % libc.fcntl(r, fcntl.F_GETOWN))
b.send(b"x")
got = signal.sigtimedwait({sig}, 10)
expect(got is not None and got.si_signo == sig, "the I/O signal %r" % (got,))
"#,
    );
    let (a, b) = rt.roots();
    let owners = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .map(|f| (f.fd, f.owner, f.signal))
            .collect::<Vec<_>>()
    };
    assert!(
        a.fds.iter().filter(|f| f.owner.is_some()).count() >= 2,
        "{:?}",
        owners(a)
    );
    assert_eq!(owners(a), owners(b));
}
