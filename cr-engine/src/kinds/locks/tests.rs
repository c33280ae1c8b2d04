use super::*;

#[test]
fn lines() {
    let l = parse("1: POSIX  ADVISORY  WRITE 5122 fe:00:10010639 5 14")
        .unwrap()
        .unwrap();
    assert_eq!((l.kind, l.start, l.len), (LockKind::Posix, 5, 10));
    let l = parse("1: FLOCK  ADVISORY  WRITE 5122 fe:00:10010639 0 EOF")
        .unwrap()
        .unwrap();
    assert_eq!((l.kind, l.len, l.write), (LockKind::Flock, 0, true));
    assert!(parse("1: -> POSIX  ADVISORY  WRITE 77 fe:00:1 0 EOF")
        .unwrap()
        .is_none());
    let l = parse("1: LEASE  ACTIVE    WRITE 5 fe:00:1 0 EOF")
        .unwrap()
        .unwrap();
    assert_eq!((l.kind, l.write), (LockKind::Lease, true));
    let e = parse("1: LEASE  BREAKING  UNLCK 5 fe:00:1 0 EOF").unwrap_err();
    assert!(e.contains("being broken"), "{e}");
}

/// Round trip: a read lease on a file opened read-only and a write lease on
/// a file opened read-write are held again: another process opening the
/// files in a way that breaks them is told to wait (EWOULDBLOCK with
/// O_NONBLOCK), and F_GETLEASE gives each lease's type.
#[test]
fn leases_round_trip() {
    let rt = crate::kinds::testkit::round_trip(
        "leases",
        r#"
F_SETLEASE, F_GETLEASE = 1024, 1025
# A lease break signals its holder (SIGIO unless F_SETSIG said otherwise).
signal.signal(signal.SIGIO, signal.SIG_IGN)
rp, wp = os.path.join(DIR, "read-leased"), os.path.join(DIR, "write-leased")
for p in (rp, wp):
    with open(p, "w") as f:
        f.write("content")
r = os.open(rp, os.O_RDONLY); fcntl.fcntl(r, F_SETLEASE, fcntl.F_RDLCK)
w = os.open(wp, os.O_RDWR); fcntl.fcntl(w, F_SETLEASE, fcntl.F_WRLCK)
"#,
        r#"
expect(fcntl.fcntl(r, F_GETLEASE) == fcntl.F_RDLCK, "read lease: %d" % fcntl.fcntl(r, F_GETLEASE))
expect(fcntl.fcntl(w, F_GETLEASE) == fcntl.F_WRLCK, "write lease: %d" % fcntl.fcntl(w, F_GETLEASE))
kid = os.fork()
if kid == 0:
    bad = 0
    for p, mode, bit in ((rp, os.O_WRONLY, 1), (wp, os.O_RDONLY, 2)):
        try:
            os.close(os.open(p, mode | os.O_NONBLOCK)); bad |= bit
        except BlockingIOError:
            pass
    os._exit(bad)
_, st = os.waitpid(kid, 0)
expect(os.WEXITSTATUS(st) == 0, "another process opened a leased file (%d)" % os.WEXITSTATUS(st))
"#,
    );
    let (a, b) = rt.roots();
    let leases = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .flat_map(|f| f.locks.iter().map(move |l| (f.fd, *l)))
            .filter(|(_, l)| l.kind == LockKind::Lease)
            .collect::<Vec<_>>()
    };
    assert_eq!(leases(a).len(), 2);
    assert_eq!(leases(a), leases(b));
}

/// Round trip: a flock and a POSIX range lock are held again after the
/// restore (another process cannot take them).
#[test]
fn locks_round_trip() {
    let rt = crate::kinds::testkit::round_trip(
        "locks",
        r#"
f = open(os.path.join(DIR, "locked"), "w+")
fcntl.flock(f, fcntl.LOCK_EX)
g = open(os.path.join(DIR, "ranged"), "w+"); g.write("x" * 100); g.flush()
fcntl.lockf(g, fcntl.LOCK_EX, 10, 20)
"#,
        r#"
kid = os.fork()
if kid == 0:
    bad = 0
    try:
        fcntl.flock(open(os.path.join(DIR, "locked")), fcntl.LOCK_EX | fcntl.LOCK_NB); bad |= 1
    except OSError: pass
    try:
        fcntl.lockf(open(os.path.join(DIR, "ranged"), "r+"), fcntl.LOCK_EX | fcntl.LOCK_NB, 5, 25); bad |= 2
    except OSError: pass
    os._exit(bad)
_, st = os.waitpid(kid, 0)
expect(os.WEXITSTATUS(st) == 0, "another process took a lock we hold (%d)" % os.WEXITSTATUS(st))
"#,
    );
    let (a, b) = rt.roots();
    let locks = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .flat_map(|f| f.locks.iter().map(move |l| (f.fd, *l)))
            .collect::<Vec<_>>()
    };
    assert_eq!(locks(a).len(), 2);
    assert_eq!(locks(a), locks(b));
}
