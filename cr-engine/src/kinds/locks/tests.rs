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
    let l = parse("1: LEASE  BREAKING  UNLCK 5 fe:00:1 0 EOF")
        .unwrap()
        .unwrap();
    assert_eq!(
        (l.kind, l.breaking),
        (LockKind::Lease, Some(LeaseBreak::ToUnlock))
    );
    let l = parse("1: LEASE  BREAKING  READ 5 fe:00:1 0 EOF")
        .unwrap()
        .unwrap();
    assert_eq!((l.write, l.breaking), (true, Some(LeaseBreak::ToRead)));
    let e = parse("1: DELEG  ACTIVE  READ 5 fe:00:1 0 EOF").unwrap_err();
    assert!(e.contains("delegation"), "{e}");
}

/// The openers /proc/locks shows blocked on a lease of a file: under its
/// entry, or under another lease's of the same file; not another file's.
#[test]
fn waiters_of_a_file() {
    let all = "\
1: FLOCK  ADVISORY  WRITE 1623 fe:00:5865967 0 EOF
2: LEASE  BREAKING  UNLCK 3372 fe:00:10027186 0 EOF
2: -> LEASE  BREAKER   WRITE 3416 <none>:0 0 EOF
3: LEASE  BREAKING  UNLCK 3373 fe:00:10027186 0 EOF
3: -> LEASE  BREAKER   WRITE 3417 <none>:0 0 EOF
4: LEASE  BREAKING  UNLCK 3372 fe:00:77 0 EOF
4: -> LEASE  BREAKER   WRITE 3418 <none>:0 0 EOF
";
    assert_eq!(lease_waiters(all, "fe:00:10027186"), vec![3416, 3417]);
    assert_eq!(lease_waiters(all, "fe:00:77"), vec![3418]);
    assert!(lease_waiters(all, "fe:00:5865967").is_empty());
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

/// Round trip of leases being broken (as CRIU's zdtm file_lease02 has
/// them): each was broken by an open that did not wait (O_NONBLOCK), and
/// its holder got SIGIO then. After the restore F_GETLEASE gives the type
/// each is broken to, no second SIGIO came, each is still held as it was
/// taken (a write lease on a read-only description refuses a reader, a
/// read lease does not), and giving them up lets the openers in.
#[test]
fn breaking_leases_round_trip() {
    let rt = crate::kinds::testkit::round_trip(
        "breaking-leases",
        r#"
F_SETLEASE, F_GETLEASE = 1024, 1025
got = []
signal.signal(signal.SIGIO, lambda signo, frame: got.append(signo))
def leased(name, mode, lease, breaker):
    p = os.path.join(DIR, name)
    with open(p, "w") as f:
        f.write("content")
    fd = os.open(p, mode)
    fcntl.fcntl(fd, F_SETLEASE, lease)
    try:
        os.close(os.open(p, breaker | os.O_NONBLOCK))
        problems.append(name + ": the conflicting open was granted")
    except BlockingIOError:
        pass
    return p, fd
rp, r = leased("read", os.O_RDONLY, fcntl.F_RDLCK, os.O_WRONLY)
wp, w = leased("write", os.O_WRONLY, fcntl.F_WRLCK, os.O_RDONLY)
up, u = leased("write-unlock", os.O_RDWR, fcntl.F_WRLCK, os.O_WRONLY)
op, o = leased("write-on-read-only", os.O_RDONLY, fcntl.F_WRLCK, os.O_WRONLY)
# The handler runs between bytecodes, a little after the signal came.
deadline = time.monotonic() + 60
while len(got) < 4 and time.monotonic() < deadline:
    time.sleep(0.01)
expect(len(got) == 4, "SIGIO at the breaks: %d" % len(got))
signals = len(got)
"#,
        r#"
want = ((r, fcntl.F_UNLCK), (w, fcntl.F_RDLCK), (u, fcntl.F_UNLCK), (o, fcntl.F_UNLCK))
for fd, t in want:
    expect(fcntl.fcntl(fd, F_GETLEASE) == t, "fd %d: F_GETLEASE %d, not %d" % (fd, fcntl.fcntl(fd, F_GETLEASE), t))
    expect(fcntl.fcntl(fd, fcntl.F_GETOWN) == os.getpid(), "fd %d: owner %d" % (fd, fcntl.fcntl(fd, fcntl.F_GETOWN)))
def opens(tries):
    # In a child: which opens (O_NONBLOCK) are granted, one bit each.
    kid = os.fork()
    if kid == 0:
        bits = 0
        for i, (p, mode) in enumerate(tries):
            try:
                os.close(os.open(p, mode | os.O_NONBLOCK)); bits |= 1 << i
            except BlockingIOError:
                pass
        os._exit(bits)
    return os.WEXITSTATUS(os.waitpid(kid, 0)[1])
# Held as taken (these opens start no new break).
got_opens = opens(((rp, os.O_RDONLY), (rp, os.O_WRONLY), (wp, os.O_RDONLY), (up, os.O_RDONLY), (op, os.O_RDONLY)))
expect(got_opens == 0b00001, "opens granted while broken: %s, not 0b00001" % bin(got_opens))
# Given up, the opens are granted (the write lease's holder cannot
# downgrade it itself: it has the file open for writing).
for fd in (r, w, u, o):
    fcntl.fcntl(fd, F_SETLEASE, fcntl.F_UNLCK)
got_opens = opens(((rp, os.O_WRONLY), (wp, os.O_RDONLY), (up, os.O_WRONLY), (op, os.O_RDWR)))
expect(got_opens == 0b1111, "opens granted once given up: %s, not 0b1111" % bin(got_opens))
# A SIGIO of the restore's breaks would have come when the program ran
# again, its handler run at the next bytecode: long before this.
expect(len(got) == signals, "SIGIO after the restore: %d" % (len(got) - signals))
"#,
    );
    let (a, b) = rt.roots();
    let leases = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .flat_map(|f| f.locks.iter().map(move |l| (f.fd, l.write, l.breaking)))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        leases(a).iter().map(|l| (l.1, l.2)).collect::<Vec<_>>(),
        vec![
            (false, Some(LeaseBreak::ToUnlock)),
            (true, Some(LeaseBreak::ToRead)),
            (true, Some(LeaseBreak::ToUnlock)),
            (true, Some(LeaseBreak::ToUnlock)),
        ]
    );
    assert_eq!(leases(a), leases(b));
}
