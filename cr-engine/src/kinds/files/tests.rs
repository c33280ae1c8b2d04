//! Round trip of kind "files": a file at an offset, an append-only file, a
//! directory, /dev/null, a sealed memfd with its content, a deleted file
//! with its content, and a mapping of a deleted file.

use crate::kinds::testkit::round_trip;

#[test]
fn files_round_trip() {
    let rt = round_trip(
        "files",
        r#"
import mmap
plain = open(os.path.join(DIR, "plain"), "w+b"); plain.write(b"a" * 100); plain.seek(42)
app = os.open(os.path.join(DIR, "log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
d = os.open(DIR, os.O_RDONLY | os.O_DIRECTORY)
null = os.open("/dev/null", os.O_RDWR)
m = os.memfd_create("cr-memfd", os.MFD_ALLOW_SEALING)
os.write(m, b"memfd content" * 1000)
fcntl.fcntl(m, 1033, 8)       # F_ADD_SEALS F_SEAL_WRITE
gone = open(os.path.join(DIR, "gone"), "w+b"); gone.write(b"deleted " * 5000); gone.seek(10)
os.unlink(os.path.join(DIR, "gone"))
g2 = open(os.path.join(DIR, "gone2"), "w+b"); g2.write(b"z" * 8192); g2.flush()
gmap = mmap.mmap(g2.fileno(), 8192)
os.unlink(os.path.join(DIR, "gone2")); g2.close()
"#,
        r#"
expect(plain.tell() == 42, "offset")
expect(fcntl.fcntl(app, fcntl.F_GETFL) & os.O_APPEND, "O_APPEND")
expect(os.path.samefile("/proc/self/fd/%d" % d, DIR), "directory")
expect(os.readlink("/proc/self/fd/%d" % null) == "/dev/null", "/dev/null")
os.lseek(m, 0, 0)
expect(os.read(m, 13000) == b"memfd content" * 1000, "memfd content")
expect(fcntl.fcntl(m, 1034) & 8, "memfd seal")     # F_GET_SEALS
expect(gone.tell() == 10, "deleted file offset")
gone.seek(0)
expect(gone.read() == b"deleted " * 5000, "deleted file content")
expect(gmap[:8192] == b"z" * 8192, "mapping of a deleted file")
"#,
    );
    let (a, b) = rt.roots();
    let kinds = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .map(|f| (f.fd, f.pos, f.kind.name()))
            .collect::<Vec<_>>()
    };
    assert_eq!(kinds(a), kinds(b));
    let contents = |c: &cr_image::model::Checkpoint| {
        c.objects
            .iter()
            .filter_map(|o| match &o.kind {
                cr_image::model::ObjectKind::Memfd(f)
                | cr_image::model::ObjectKind::DeletedFile(f) => Some((f.size, f.seals, f.mode)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(contents(&rt.before).len(), 3);
    assert_eq!(contents(&rt.before), contents(&rt.after));
}

/// O_PATH fds of a directory, a regular file and a FIFO: each comes back
/// as an O_PATH fd of the same file (a FIFO's without blocking in open).
#[test]
fn path_only_fds_round_trip() {
    let rt = round_trip(
        "o-path",
        r#"
O_PATH = 0o10000000
os.mkdir(os.path.join(DIR, "d"))
open(os.path.join(DIR, "d", "f"), "w").write("hello")
os.mkfifo(os.path.join(DIR, "fifo"))
pd = os.open(os.path.join(DIR, "d"), O_PATH | os.O_DIRECTORY)
pf = os.open(os.path.join(DIR, "d", "f"), O_PATH)
pp = os.open(os.path.join(DIR, "fifo"), O_PATH)
ids = [(os.fstat(x).st_dev, os.fstat(x).st_ino) for x in (pd, pf, pp)]
"#,
        r#"
for x in (pd, pf, pp):
    expect(fcntl.fcntl(x, fcntl.F_GETFL) & O_PATH, "fd %d lost O_PATH" % x)
expect([(os.fstat(x).st_dev, os.fstat(x).st_ino) for x in (pd, pf, pp)] == ids, "the same files")
expect(os.read(os.open("f", os.O_RDONLY, dir_fd=pd), 10) == b"hello", "open relative to the O_PATH directory")
expect(os.readlink("/proc/self/fd/%d" % pp) == os.path.join(DIR, "fifo"), "the FIFO's path")
"#,
    );
    let (a, b) = rt.roots();
    let kinds = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .map(|f| (f.fd, f.flags, f.kind.name()))
            .collect::<Vec<_>>()
    };
    assert_eq!(kinds(a), kinds(b));
    assert!(
        kinds(a).iter().any(|k| k.2 == "path_only"),
        "{:?}",
        kinds(a)
    );
}

/// Ghosts: a directory (in a directory removed too) held open, a working
/// directory, and a FIFO with bytes in it, each removed while in use. The
/// restored program holds them removed at the same paths, the FIFO with
/// its bytes, and nothing is left on disk.
#[test]
fn removed_directories_and_fifo_round_trip() {
    round_trip(
        "files-ghosts",
        r#"
gd = os.path.join(DIR, "gone", "deeper"); os.makedirs(gd)
dfd = os.open(gd, os.O_RDONLY | os.O_DIRECTORY)
cwdd = os.path.join(DIR, "cwd-gone"); os.mkdir(cwdd); os.chdir(cwdd)
fifo = os.path.join(DIR, "ghost-fifo"); os.mkfifo(fifo)
fr = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK); fw = os.open(fifo, os.O_WRONLY)
os.write(fw, b"buffered")
os.unlink(fifo); os.rmdir(gd); os.rmdir(os.path.join(DIR, "gone")); os.rmdir(cwdd)
"#,
        r#"
link = lambda fd: os.readlink("/proc/self/fd/%d" % fd)
expect(os.readlink("/proc/self/cwd") == cwdd + " (deleted)", "cwd %r" % os.readlink("/proc/self/cwd"))
expect(link(dfd) == gd + " (deleted)", "the open directory %r" % link(dfd))
expect(os.fstat(dfd).st_nlink == 0, "the open directory is removed")
expect(not os.path.exists(os.path.join(DIR, "gone")), "its parent left behind")
expect(not os.path.exists(cwdd), "the working directory left behind")
expect(os.read(fr, 100) == b"buffered", "the FIFO's bytes")
os.write(fw, b"more")
expect(os.read(fr, 100) == b"more", "the FIFO carries on")
expect(link(fr) == fifo + " (deleted)", "the FIFO %r" % link(fr))
expect(not os.path.exists(fifo), "the FIFO left behind")
"#,
    );
}

/// Memfds' modes: one made with MFD_NOEXEC_SEAL (0666 and F_SEAL_EXEC:
/// never executable), one whose mode the program changed.
#[test]
fn memfd_modes_round_trip() {
    round_trip(
        "files-memfd-mode",
        r#"
noexec = os.memfd_create("cr-noexec", 8)       # MFD_NOEXEC_SEAL
os.write(noexec, b"x")
chmodded = os.memfd_create("cr-chmod", 0)
os.fchmod(chmodded, 0o640)
"#,
        r#"
mode = os.fstat(noexec).st_mode & 0o7777
expect(mode == 0o666, "the no-exec memfd's mode %o" % mode)
expect(fcntl.fcntl(noexec, 1034) & 0x20, "F_SEAL_EXEC")      # F_GET_SEALS
mode = os.fstat(chmodded).st_mode & 0o7777
expect(mode == 0o640, "the memfd's mode %o" % mode)
"#,
    );
}

/// The times of files whose content the image holds (a deleted file, a
/// memfd) are theirs again, not the restore's (nor the checkpoint's: it
/// reads them without touching their access time).
#[test]
fn content_times_round_trip() {
    round_trip(
        "files-times",
        r#"
times = (1_500_000_000_111_000_000, 1_400_000_000_222_000_000)
gone = os.path.join(DIR, "old-file")
d = os.open(gone, os.O_RDWR | os.O_CREAT, 0o644); os.write(d, b"old content")
os.utime(d, ns=times); os.unlink(gone)
m = os.memfd_create("cr-times", 0); os.write(m, b"memfd"); os.utime(m, ns=times)
"#,
        r#"
for fd, what in ((d, "the deleted file"), (m, "the memfd")):
    st = os.fstat(fd)
    got = (st.st_atime_ns, st.st_mtime_ns)
    expect(got == times, "%s's times %r" % (what, got))
"#,
    );
}
