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

/// The directory /proc/PID of a child that has exited and was reaped,
/// kept as the working directory and as an open fd (zdtm unhashed_proc):
/// the restored program has both again, gone (getcwd says ENOENT, the
/// fd lists nothing), with the same path, and the PID is free again.
#[test]
fn dead_proc_pid_dir_round_trip() {
    round_trip(
        "files-dead-proc-dir",
        r#"
kid = os.fork()
if kid == 0:
    while True:
        signal.pause()
piddir = "/proc/%d" % kid
os.chdir(piddir)
pfd = os.open(piddir, os.O_RDONLY | os.O_DIRECTORY)
os.kill(kid, signal.SIGKILL)
os.waitpid(kid, 0)
def cwd_errno():
    try:
        os.getcwd()
        return 0
    except OSError as e:
        return e.errno
def listing(fd):
    try:
        return sorted(os.listdir(fd))
    except OSError as e:
        return e.errno
before = listing(pfd)
expect(cwd_errno() == errno.ENOENT, "setup: getcwd in the dead process's directory")
expect(before in ([], errno.ENOENT), "setup: the dead process's directory lists %r" % (before,))
"#,
        r#"
expect(cwd_errno() == errno.ENOENT, "getcwd: errno %d" % cwd_errno())
expect(os.readlink("/proc/self/cwd") == piddir + " (deleted)", "cwd %r" % os.readlink("/proc/self/cwd"))
expect(os.readlink("/proc/self/fd/%d" % pfd) == piddir + " (deleted)", "the fd %r" % os.readlink("/proc/self/fd/%d" % pfd))
expect(listing(pfd) == before, "listing it: %r, was %r" % (listing(pfd), before))
expect(not os.path.exists(piddir), "process %d lives" % kid)
"#,
    );
}

/// Files and a directory inside /proc/PID of a child that has exited and
/// was reaped, kept open (zdtm remap_dead_pid): /proc names them without
/// " (deleted)". The restored program has each fd again, at the same path
/// and reading as before (mountinfo still reads; status fails with ESRCH),
/// and the PID is free again.
#[test]
fn files_of_a_dead_proc_pid_dir_round_trip() {
    round_trip(
        "files-dead-proc-files",
        r#"
kid = os.fork()
if kid == 0:
    while True:
        signal.pause()
piddir = "/proc/%d" % kid
fds = {}
for n, fl in (("mountinfo", os.O_RDONLY), ("status", os.O_RDONLY), ("task", os.O_RDONLY | os.O_DIRECTORY)):
    fds[n] = os.open(piddir + "/" + n, fl)
os.kill(kid, signal.SIGKILL)
os.waitpid(kid, 0)
def reads(fd):
    try:
        return len(os.pread(fd, 64, 0)) > 0
    except OSError as e:
        return e.errno
before = {n: reads(fd) for n, fd in fds.items() if n != "task"}
fdflags = {n: fcntl.fcntl(fd, fcntl.F_GETFD) for n, fd in fds.items()}
expect(before == {"mountinfo": True, "status": errno.ESRCH}, "setup: reads %r" % (before,))
"#,
        r#"
for n, fd in fds.items():
    link = os.readlink("/proc/self/fd/%d" % fd)
    expect(link in (piddir + "/" + n, piddir + "/" + n + " (deleted)"), "fd %d is %r" % (fd, link))
    expect(fcntl.fcntl(fd, fcntl.F_GETFD) == fdflags[n], "fd %d flags" % fd)
after = {n: reads(fd) for n, fd in fds.items() if n != "task"}
expect(after == before, "reads %r, was %r" % (after, before))
expect(not os.path.exists(piddir), "process %d lives" % kid)
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

/// Device nodes outside /dev: two removed while open (a /dev/null and a
/// /dev/zero of the program's own, owned by other users, one in a
/// directory removed too, one open twice through a dup) and one still
/// linked. The restored program holds removed nodes of the same paths,
/// device numbers, modes and owners, that
/// still work as those devices, and nothing is left on disk.
#[test]
fn removed_device_nodes_round_trip() {
    round_trip(
        "files-ghost-dev",
        r#"
import stat
nul = os.path.join(DIR, "null-node")
os.mknod(nul, stat.S_IFCHR | 0o600, os.makedev(1, 3)); os.chmod(nul, 0o620)
sub = os.path.join(DIR, "sub"); os.mkdir(sub)
zero = os.path.join(sub, "zero-node")
os.mknod(zero, stat.S_IFCHR | 0o640, os.makedev(1, 5)); os.chmod(zero, 0o640)
kept = os.path.join(DIR, "kept-null")
os.mknod(kept, stat.S_IFCHR | 0o666, os.makedev(1, 3))
os.chown(nul, 1234, 2345); os.chown(zero, 4321, 5432); os.chmod(zero, 0o640)
fn = os.open(nul, os.O_WRONLY)
fz = os.open(zero, os.O_RDONLY | os.O_NONBLOCK); fz2 = os.dup(fz)
fk = os.open(kept, os.O_RDWR)
os.unlink(nul); os.unlink(zero); os.rmdir(sub)
"#,
        r#"
link = lambda fd: os.readlink("/proc/self/fd/%d" % fd)
for fd, path, dev, mode, owner in ((fn, nul, (1, 3), 0o620, (1234, 2345)), (fz, zero, (1, 5), 0o640, (4321, 5432))):
    st = os.fstat(fd)
    expect((st.st_uid, st.st_gid) == owner, "fd %d owner %d:%d" % (fd, st.st_uid, st.st_gid))
    expect(link(fd) == path + " (deleted)", "fd %d is %r" % (fd, link(fd)))
    expect(stat.S_ISCHR(st.st_mode), "fd %d a character device" % fd)
    expect((os.major(st.st_rdev), os.minor(st.st_rdev)) == dev, "fd %d device %x" % (fd, st.st_rdev))
    expect(st.st_mode & 0o7777 == mode, "fd %d mode %o" % (fd, st.st_mode & 0o7777))
    expect(st.st_nlink == 0, "fd %d removed" % fd)
    expect(not os.path.exists(path), "%s left behind" % path)
expect(not os.path.exists(sub), "the removed directory left behind")
expect(fcntl.fcntl(fn, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY, "write-only")
expect(os.write(fn, b"x" * 100) == 100, "writes to the null ghost")
expect(fcntl.fcntl(fz, fcntl.F_GETFL) & os.O_NONBLOCK, "O_NONBLOCK")
expect(os.read(fz, 64) == bytes(64), "zeros from the zero ghost")
fcntl.fcntl(fz2, fcntl.F_SETFL, 0)
expect(not fcntl.fcntl(fz, fcntl.F_GETFL) & os.O_NONBLOCK, "the dup shares its description")
expect(link(fk) == kept, "the linked node %r" % link(fk))
expect(os.fstat(fk).st_ino == os.stat(kept).st_ino, "the linked node is the same file")
expect(os.write(fk, b"y") == 1 and os.read(fk, 10) == b"", "the linked node is a /dev/null")
"#,
    );
}

/// A loop device (detached when the test ends, passed or not).
struct Loop(String);

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .args(["-d", &self.0])
            .status();
    }
}

/// Block devices: a loop device open by its /dev path, and a node of the
/// same device made by the program and removed while open. Each comes
/// back at its offset, reading the disk's bytes; the removed one a
/// removed block node of the same path, device number, mode and owner.
#[test]
fn block_devices_round_trip() {
    use std::os::unix::fs::MetadataExt;
    let dir = std::env::temp_dir().join(format!("cr-engine-block-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("test directory");
    let backing = dir.join("disk");
    let bytes: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&backing, &bytes).expect("the loop device's file");
    let out = std::process::Command::new("losetup")
        .args(["-f", "--show"])
        .arg(&backing)
        .output()
        .expect("losetup (util-linux)");
    assert!(out.status.success(), "losetup: {out:?}");
    let dev = Loop(String::from_utf8_lossy(&out.stdout).trim().to_string());
    let rdev = std::fs::metadata(&dev.0).expect("the loop device").rdev();
    let setup = format!(
        r#"
import stat
LOOP = "{loop}"; RDEV = {rdev}
node = os.path.join(DIR, "blk")
os.mknod(node, stat.S_IFBLK | 0o600, RDEV); os.chown(node, 1234, 2345); os.chmod(node, 0o604)
gb = os.open(node, os.O_RDONLY); os.lseek(gb, 5000, 0)
lb = os.open(LOOP, os.O_RDONLY); os.lseek(lb, 7000, 0)
os.unlink(node)
"#,
        loop = dev.0
    );
    let rt = round_trip(
        "files-block",
        &setup,
        r#"
want = lambda off, n: bytes((i % 251) for i in range(off, off + n))
link = lambda fd: os.readlink("/proc/self/fd/%d" % fd)
st = os.fstat(gb)
expect(link(gb) == node + " (deleted)", "the removed node %r" % link(gb))
expect(stat.S_ISBLK(st.st_mode) and st.st_rdev == RDEV, "the removed node's device")
expect(st.st_mode & 0o7777 == 0o604, "the removed node's mode %o" % (st.st_mode & 0o7777))
expect((st.st_uid, st.st_gid) == (1234, 2345), "the removed node's owner %d:%d" % (st.st_uid, st.st_gid))
expect(not os.path.exists(node), "the removed node left behind")
expect(os.lseek(gb, 0, 1) == 5000, "the removed node's offset")
expect(os.read(gb, 16) == want(5000, 16), "the disk's bytes through the removed node")
expect(link(lb) == LOOP, "the loop device %r" % link(lb))
expect(os.lseek(lb, 0, 1) == 7000, "the loop device's offset")
expect(os.read(lb, 16) == want(7000, 16), "the disk's bytes")
"#,
    );
    let blocks = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .filter(|f| f.kind.name() == "block_device")
            .count()
    };
    let (a, b) = rt.roots();
    assert_eq!((blocks(a), blocks(b)), (2, 2));
    drop(dev);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A program that runs a memfd it wrote (a script, as runc and others run
/// a memfd copy of themselves): after the restore it still can. Before the
/// fix its fd was opened again read-write through /proc, which counts as
/// a writer, and execveat failed with ETXTBSY.
#[test]
fn executable_memfd_round_trip() {
    round_trip(
        "memfd-exec",
        r##"
script = os.memfd_create("cr-script", 0)
os.write(script, b"#!/bin/sh\nexit 7\n")
def run():
    child = os.fork()
    if child == 0:
        try: os.execve(script, ["script"], {})
        except OSError as e: os._exit(100 + e.errno % 100)
    return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
expect(run() == 7, "the memfd runs before the checkpoint")
"##,
        r#"
got = run()
expect(got == 7, "the memfd runs after the restore: exit %d (126 = ETXTBSY)" % got)
expect(os.lseek(script, 0, os.SEEK_CUR) == 17, "its offset")
"#,
    );
}

/// A file removed while open, whose owner, group and mode the program had
/// changed: the file made again has them. Before the fix it had the
/// restorer's owner ("u(g)id changed", zdtm unlink_fstat00).
#[test]
fn removed_file_owner_and_mode_round_trip() {
    round_trip(
        "files-deleted-owner",
        r#"
p = os.path.join(DIR, "gone")
fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
os.write(fd, b"data")
os.fchown(fd, 4321, 8765)
os.fchmod(fd, 0o2751)
os.unlink(p)
"#,
        r#"
st = os.fstat(fd)
expect((st.st_uid, st.st_gid) == (4321, 8765), "owner %d:%d" % (st.st_uid, st.st_gid))
expect(st.st_mode & 0o7777 == 0o2751, "mode %o" % (st.st_mode & 0o7777))
expect(st.st_nlink == 0, "still removed")
expect(os.pread(fd, 10, 0) == b"data", "its content")
"#,
    );
}

/// An O_PATH fd of a symbolic link removed since (and two dups of it): it
/// comes back as an O_PATH fd of a removed symbolic link with the same
/// target and owner, at the same path, and nothing is left on disk.
/// Before the fix the checkpoint was refused (zdtm symlink01).
#[test]
fn removed_symlink_path_fd_round_trip() {
    let rt = round_trip(
        "files-removed-symlink",
        r#"
import stat
O_PATH = 0o10000000
link = os.path.join(DIR, "link")
os.symlink("/some/where/else", link)
os.lchown(link, 1234, 5678)
fd = os.open(link, O_PATH | os.O_NOFOLLOW)
fd2 = os.dup(fd)
os.unlink(link)
"#,
        r#"
import stat
st = os.fstat(fd)
expect(stat.S_ISLNK(st.st_mode), "a symbolic link, mode %o" % st.st_mode)
expect(st.st_nlink == 0, "removed")
expect((st.st_uid, st.st_gid) == (1234, 5678), "owner %d:%d" % (st.st_uid, st.st_gid))
expect(os.readlink("", dir_fd=fd) == "/some/where/else", "its target")
expect(os.readlink("", dir_fd=fd2) == "/some/where/else", "its dup's target")
expect(os.readlink("/proc/self/fd/%d" % fd) == link + " (deleted)", "its path")
expect(not os.path.lexists(link), "nothing left at its path")
"#,
    );
    let (a, b) = rt.roots();
    let kinds = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .map(|f| (f.fd, f.kind.clone()))
            .filter(|(_, k)| k.name() == "removed_symlink")
            .collect::<Vec<_>>()
    };
    assert_eq!(kinds(a).len(), 2, "{:?}", a.fds);
    assert_eq!(kinds(a), kinds(b));
}

/// A file removed with the directories it was in (a program's scratch
/// directory, as DMTCP's shared-memory2 test makes), held open and mapped
/// shared: the restored program has the same contents, writes through
/// the mapping reach the fd, /proc shows the old path "(deleted)" for
/// both, and the directories made for the while are gone again.
#[test]
fn file_of_removed_directories_round_trip() {
    round_trip(
        "files-removed-dirs",
        r#"
import mmap
top = os.path.join(DIR, "scratch")
d = os.path.join(top, "inner"); os.makedirs(d)
name = os.path.join(d, "data")
fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o600)
os.write(fd, b"a" * 8192)
m = mmap.mmap(fd, 8192, mmap.MAP_SHARED)
m[0:5] = b"hello"
os.unlink(name); os.rmdir(d); os.rmdir(top)
def mapped_as():
    for line in open("/proc/self/maps"):
        if "/scratch/inner/data" in line:
            return line.split(None, 5)[5].strip()
"#,
        r#"
expect(m[0:5] == b"hello", "the mapping's contents")
m[5:10] = b"world"
expect(os.pread(fd, 10, 0) == b"helloworld", "the mapping and the fd are one file")
expect(os.readlink("/proc/self/fd/%d" % fd) == name + " (deleted)", "the fd %r" % os.readlink("/proc/self/fd/%d" % fd))
expect(mapped_as() == name + " (deleted)", "the mapping %r" % mapped_as())
expect(not os.path.exists(top), "the directories left behind")
"#,
    );
}

/// Deleted files opened with O_NOFOLLOW, as shm_open opens them (Open
/// MPI's /dev/shm segment, unlinked once mapped): the flag, which only
/// open(2) sets, is kept for a read-write and a read-only description.
/// Before the fix the restore's --verify refused the fd ("flags is ...").
#[test]
fn deleted_file_nofollow_flag_round_trip() {
    round_trip(
        "files-deleted-nofollow",
        r#"
import fcntl
p = os.path.join(DIR, "segment")
rw = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
os.write(rw, b"shared " * 100)
ro = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
plain = os.open(p, os.O_RDONLY)
os.unlink(p)
"#,
        r#"
import fcntl
for fd, nf in ((rw, True), (ro, True), (plain, False)):
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    expect(bool(fl & os.O_NOFOLLOW) == nf, "fd %d flags %o" % (fd, fl))
    expect(os.readlink("/proc/self/fd/%d" % fd) == p + " (deleted)", "fd %d path" % fd)
expect(fcntl.fcntl(rw, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR, "read-write")
expect(fcntl.fcntl(ro, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY, "read-only")
os.pwrite(rw, b"SHARED", 0)
expect(os.pread(ro, 13, 0) == b"SHARED shared", "one file for all fds")
expect(os.fstat(rw).st_nlink == 0, "still deleted")
"#,
    );
}

/// A deleted file open several times with O_SYNC, O_DSYNC, O_APPEND and
/// O_NONBLOCK (BLCR's filedescriptors fd_flags_unlinked): each fd keeps
/// its own description with its flags, O_SYNC and O_DSYNC too, which only
/// open(2) sets. Before the fix the restore's --verify refused the O_SYNC
/// fd ("flags is ...").
#[test]
fn deleted_file_sync_flags_round_trip() {
    round_trip(
        "files-deleted-sync",
        r#"
import fcntl
p = os.path.join(DIR, "data")
plain = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
os.write(plain, b"x" * 8192)
fds = {fl: os.open(p, os.O_RDWR | fl) for fl in (os.O_SYNC, os.O_DSYNC, os.O_APPEND, os.O_NONBLOCK)}
os.lseek(fds[os.O_DSYNC], 100, os.SEEK_SET)
os.unlink(p)
"#,
        r#"
import fcntl
for fl, fd in fds.items():
    got = fcntl.fcntl(fd, fcntl.F_GETFL)
    expect(got & (os.O_SYNC | os.O_DSYNC | os.O_APPEND | os.O_NONBLOCK) == fl, "fd %d flags %o, wants %o" % (fd, got, fl))
expect(fcntl.fcntl(plain, fcntl.F_GETFL) & (os.O_SYNC | os.O_DSYNC) == 0, "the plain fd is not synchronous")
expect(os.lseek(fds[os.O_DSYNC], 0, os.SEEK_CUR) == 100, "the O_DSYNC fd's offset")
expect(os.lseek(fds[os.O_SYNC], 0, os.SEEK_CUR) == 0, "the O_SYNC fd's offset")
os.write(fds[os.O_APPEND], b"tail")
expect(os.fstat(plain).st_size == 8196, "appended at the end")
expect(os.pread(plain, 4, 8192) == b"tail", "one file for all fds")
"#,
    );
}

/// A file open by a name removed while it kept another (linked under it
/// before; zdtm unlink_regular00's shape: the removed name's directory is
/// gone too), plus an O_PATH fd of it. It comes back as the same file as
/// its other name (what the program writes shows there), at its offset,
/// shown as before ("NAME (deleted)"), the directory made for a while
/// gone again; a shared mapping of it too.
#[test]
fn file_removed_under_one_of_its_names_round_trip() {
    let rt = round_trip(
        "files-relink",
        r#"
sub = os.path.join(DIR, "sub")
os.mkdir(sub)
name = os.path.join(sub, "data")
f = open(name, "w+b"); f.write(b"relinked " * 100); f.flush(); f.seek(7)
po = os.open(name, 0o10000000)   # O_PATH
import mmap
m = mmap.mmap(f.fileno(), 900)
other = os.path.join(DIR, "other")
os.link(name, other)
os.unlink(name); os.rmdir(sub)
shown = os.readlink("/proc/self/fd/%d" % f.fileno())
"#,
        r#"
expect(shown == name + " (deleted)", "shown before %r" % shown)
now = os.readlink("/proc/self/fd/%d" % f.fileno())
expect(now == shown, "shown after %r" % now)
expect(f.tell() == 7, "offset %d" % f.tell())
st = os.fstat(f.fileno())
expect((st.st_dev, st.st_ino) == (os.stat(other).st_dev, os.stat(other).st_ino), "not the file of its other name")
ps = os.stat("/proc/self/fd/%d" % po)
expect(ps.st_ino == st.st_ino, "the O_PATH fd leads elsewhere")
f.write(b"X"); f.flush()
expect(open(other, "rb").read()[:9] == b"relinkeX ", "a write does not show under its other name")
expect(not os.path.exists(sub), "the directory made for a while is left")
m[0:1] = b"M"
expect(open(other, "rb").read()[:2] == b"Me", "the mapping is not of the file of its other name")
maps = [l.split(None, 5)[-1].strip() for l in open("/proc/self/maps") if "data" in l]
expect(maps == [name + " (deleted)"], "the mapping is shown as %r" % maps)
"#,
    );
    let links = |c: &cr_image::model::Checkpoint| {
        c.processes[0]
            .fds
            .iter()
            .filter_map(|f| match &f.kind {
                cr_image::model::FdKind::Regular {
                    relink: Some(l), ..
                } => Some(l.clone()),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let before = links(&rt.before);
    // The fd, the O_PATH fd and Python's copy of the fd for the mapping.
    assert_eq!(
        before.len(),
        3,
        "fds linked: {:?}",
        rt.before.processes[0].fds
    );
    assert!(before.iter().all(|l| *l == before[0]), "one link per file");
    let mapped = rt.before.processes[0]
        .vmas
        .iter()
        .filter_map(|v| v.relink.clone())
        .collect::<Vec<_>>();
    assert_eq!(mapped, vec![before[0].clone()], "the mapping linked");
    assert!(before[0].contains("/.cr-relink."), "{before:?}");
    // The restored program's checkpoint linked it again, under the same name.
    assert_eq!(links(&rt.after), before);
}

/// The link the checkpoint made for such a file is gone at the restore
/// (the image was restored already): refused by name, nothing left.
#[test]
fn file_removed_under_one_of_its_names_without_its_link_is_named() {
    crate::kinds::testkit::restore_refused_with(
        "files-relink-gone",
        r#"
name = os.path.join(DIR, "data")
f = open(name, "w+b"); f.write(b"x" * 10)
os.link(name, os.path.join(DIR, "other"))
os.unlink(name)
"#,
        "the link the checkpoint made to",
        |dir| {
            let links: Vec<_> = std::fs::read_dir(dir)
                .unwrap()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(".cr-relink."))
                .collect();
            assert_eq!(links.len(), 1, "the checkpoint's link");
            std::fs::remove_file(links[0].path()).unwrap();
        },
        |_| {},
    );
}
