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
