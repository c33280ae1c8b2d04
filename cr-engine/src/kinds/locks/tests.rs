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
    assert!(parse("1: LEASE  ACTIVE    READ 5 fe:00:1 0 EOF").is_err());
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
