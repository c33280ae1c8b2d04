//! Round trip of kind "pipes": a pipe and a FIFO holding buffered bytes,
//! with the pipe's capacity.

use crate::kinds::testkit::round_trip;

#[test]
fn pipes_round_trip() {
    let rt = round_trip(
        "pipes",
        r#"
r, w = os.pipe()
fcntl.fcntl(w, 1031, 1 << 20)     # F_SETPIPE_SZ
os.write(w, b"in the pipe" * 100)
fifo = os.path.join(DIR, "fifo")
os.mkfifo(fifo)
fr = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
fw = os.open(fifo, os.O_WRONLY)
os.write(fw, b"in the fifo")
"#,
        r#"
expect(os.read(r, 2000) == b"in the pipe" * 100, "pipe data")
expect(fcntl.fcntl(w, 1032) == 1 << 20, "pipe capacity")       # F_GETPIPE_SZ
expect(os.read(fr, 100) == b"in the fifo", "fifo data")
os.write(w, b"more")
expect(os.read(r, 10) == b"more", "the pipe still works")
"#,
    );
    let buffered = |c: &cr_image::model::Checkpoint| {
        let mut v: Vec<_> = c
            .objects
            .iter()
            .filter_map(|o| match &o.kind {
                cr_image::model::ObjectKind::Pipe(p) => Some((p.data.clone(), p.capacity)),
                cr_image::model::ObjectKind::Fifo(f) => Some((f.data.clone(), f.capacity)),
                _ => None,
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(buffered(&rt.before), buffered(&rt.after));
}

/// A FIFO removed while open comes back with its permission bits and
/// owner (not the restorer's 0600 and root).
#[test]
fn removed_fifo_keeps_its_mode_and_owner() {
    let rt = round_trip(
        "pipes-ghost-fifo-owner",
        r#"
fifo = os.path.join(DIR, "owned-fifo"); os.mkfifo(fifo)
os.chown(fifo, 1234, 5678); os.chmod(fifo, 0o2640)
fr = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK); fw = os.open(fifo, os.O_WRONLY)
os.write(fw, b"owned")
os.unlink(fifo)
"#,
        r#"
st = os.fstat(fr)
expect(st.st_mode & 0o7777 == 0o2640, "mode %o" % (st.st_mode & 0o7777))
expect((st.st_uid, st.st_gid) == (1234, 5678), "owner %d:%d" % (st.st_uid, st.st_gid))
expect(os.read(fr, 100) == b"owned", "the FIFO's bytes")
expect(os.readlink("/proc/self/fd/%d" % fr) == fifo + " (deleted)", "still removed")
"#,
    );
    let owners = |c: &cr_image::model::Checkpoint| {
        crate::kinds::testkit::objects_of(c, |k| match k {
            cr_image::model::ObjectKind::Fifo(f) => Some(f),
            _ => None,
        })
        .into_iter()
        .map(|f| (f.mode, f.uid, f.gid))
        .collect::<Vec<_>>()
    };
    assert_eq!(owners(&rt.before), vec![(0o2640, 1234, 5678)]);
    assert_eq!(owners(&rt.before), owners(&rt.after));
}

/// A FIFO removed after the checkpoint, before the restore (BLCR's
/// named_fifo_*_unlink): it is made again at its path with its mode and
/// owner, holds the bytes it had, and the program can remove it again.
/// Before the fix the restore failed ("cannot open the FIFO").
#[test]
fn fifo_removed_after_the_checkpoint_is_made_again() {
    crate::kinds::testkit::round_trip_with(
        "pipes-fifo-removed-after",
        r#"
fifo = os.path.join(DIR, "later-gone"); os.mkfifo(fifo)
os.chown(fifo, 1234, 5678); os.chmod(fifo, 0o640)
fr = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK); fw = os.open(fifo, os.O_WRONLY)
os.write(fw, b"kept")
"#,
        r#"
st = os.stat(fifo)
expect(st.st_mode & 0o7777 == 0o640, "mode %o" % (st.st_mode & 0o7777))
expect((st.st_uid, st.st_gid) == (1234, 5678), "owner %d:%d" % (st.st_uid, st.st_gid))
expect(os.path.samestat(os.fstat(fr), st), "the fd is the FIFO at its path")
expect(os.read(fr, 100) == b"kept", "the FIFO's bytes")
os.write(fw, b"more")
expect(os.read(fr, 100) == b"more", "the FIFO still works")
os.unlink(fifo)
"#,
        |dir| std::fs::remove_file(dir.join("later-gone")).expect("remove the FIFO"),
    );
}
