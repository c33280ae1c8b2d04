//! Round trip of kind "eventfds": an eventfd with its count, an epoll set
//! watching it, a signalfd, an armed timerfd, an inotify watch.

use crate::kinds::testkit::{round_trip, round_trip_opts};

#[test]
fn event_fds_round_trip() {
    let rt = round_trip(
        "eventfds",
        r#"
import select
ev = os.eventfd(5, os.EFD_NONBLOCK)
ep = select.epoll(); ep.register(ev, select.EPOLLIN)
mask = ctypes.c_uint64(1 << (signal.SIGUSR2 - 1))
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
sfd = libc.signalfd(-1, ctypes.byref(mask), 0)
class timespec(ctypes.Structure): _fields_ = [("s", ctypes.c_long), ("ns", ctypes.c_long)]
class itimerspec(ctypes.Structure): _fields_ = [("interval", timespec), ("value", timespec)]
tfd = libc.timerfd_create(1, 0)
libc.timerfd_settime(tfd, 0, ctypes.byref(itimerspec(timespec(0, 0), timespec(300, 0))), None)
ino = libc.inotify_init1(os.O_NONBLOCK)
# A directory of its own: an event in the test's (its "ready" file) would
# be queued, unread, at the checkpoint.
W = os.path.join(DIR, "watched"); os.mkdir(W)
wd = libc.inotify_add_watch(ino, W.encode(), 0x100)    # IN_CREATE
"#,
        r#"
expect(ep.poll(0) == [(ev, select.EPOLLIN)], "epoll sees the eventfd")
expect(os.eventfd_read(ev) == 5, "eventfd count")
cur = itimerspec(); libc.timerfd_gettime(tfd, ctypes.byref(cur))
expect(0 < cur.value.s <= 300, "timerfd time left %d" % cur.value.s)
os.kill(os.getpid(), signal.SIGUSR2)
expect(len(os.read(sfd, 128)) == 128, "signalfd")
open(os.path.join(W, "new"), "w").close()
expect(len(os.read(ino, 4096)) > 0, "inotify event")
"#,
    );
    let (a, b) = rt.roots();
    let names =
        |p: &cr_image::model::Process| p.fds.iter().map(|f| f.kind.name()).collect::<Vec<_>>();
    assert_eq!(names(a), names(b));
    for k in ["eventfd", "epoll", "signalfd", "timerfd", "inotify"] {
        assert!(names(a).contains(&k), "{k} missing from {:?}", names(a));
    }
}

/// EPOLLONESHOT items that fired and were not armed again stay disarmed
/// (one whose file is ready, one whose file is ready for nothing); an
/// armed one-shot item and an edge-triggered one work as before.
#[test]
fn fired_one_shot_epoll_items_round_trip() {
    round_trip(
        "epoll-oneshot",
        r#"
import select
r1, w1 = os.pipe(); r2, w2 = os.pipe(); r3, w3 = os.pipe(); r4, w4 = os.pipe()
ep = select.epoll()
ep.register(r1, select.EPOLLIN | select.EPOLLONESHOT)   # fires now: data below
ep.register(r2, select.EPOLLIN | select.EPOLLONESHOT)   # fires, then drained
ep.register(r3, select.EPOLLIN | select.EPOLLONESHOT)   # stays armed
ep.register(r4, select.EPOLLIN | select.EPOLLET)
os.write(w1, b"a"); os.write(w2, b"b")
fired = sorted(fd for fd, _ in ep.poll(0))
assert fired == sorted([r1, r2]), fired
os.read(r2, 1)
"#,
        r#"
expect(ep.poll(0) == [], "nothing to report yet: %r" % ep.poll(0))
os.write(w2, b"c"); os.write(w3, b"d"); os.write(w4, b"e")
got = sorted(fd for fd, _ in ep.poll(0))
expect(got == sorted([r3, r4]), "only the armed items report: %r" % got)
expect(ep.poll(0) == [], "each reported once")
ep.modify(r1, select.EPOLLIN | select.EPOLLONESHOT)
expect(ep.poll(0) == [(r1, select.EPOLLIN)], "armed again, the first reports its data")
"#,
    );
}

/// Edge-triggered items: one whose edge (data arrived) was not reported
/// yet reports it after the restore, once; one drained stays quiet and
/// reports the next edge. One whose edge was reported and whose data is
/// still unread may report once more (a repeated edge, which the kernel
/// gives anyway when more data arrives; never a lost one).
#[test]
fn edge_triggered_epoll_items_round_trip() {
    round_trip(
        "epoll-et",
        r#"
import select
r1, w1 = os.pipe(); r2, w2 = os.pipe(); r3, w3 = os.pipe()
ep = select.epoll()
for r in (r1, r2, r3):
    ep.register(r, select.EPOLLIN | select.EPOLLET)
os.write(w2, b"b"); os.write(w3, b"c")
fired = sorted(fd for fd, _ in ep.poll(0))
assert fired == sorted([r2, r3]), fired
os.read(r3, 1)
os.write(w1, b"a")          # an edge not reported yet
"#,
        r#"
got = sorted(fd for fd, _ in ep.poll(0))
expect(r1 in got, "the edge not reported yet is lost: %r" % got)
expect(r3 not in got, "the drained item reports: %r" % got)
expect(ep.poll(0) == [], "an edge reported twice: %r" % ep.poll(0))
expect(os.read(r1, 10) == b"a" and os.read(r2, 10) == b"b", "the data")
os.write(w3, b"d")
expect(ep.poll(0) == [(r3, select.EPOLLIN)], "the next edge")
"#,
    );
}

/// pidfds of processes of the tree (its own, its child's, one
/// non-blocking, and one of its main thread: PIDFD_THREAD): each comes
/// back naming the same restored process (the thread's signals that
/// thread); the child (which dies with its parent: PR_SET_PDEATHSIG) is
/// ended through its pidfd.
#[test]
fn pidfds_of_the_tree_round_trip() {
    let rt = round_trip(
        "pidfds",
        r#"
r, w = os.pipe()
child = os.fork()
if child == 0:
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)         # PR_SET_PDEATHSIG
    os.write(w, b"x")
    while True:
        time.sleep(60)
os.read(r, 1)
me = os.pidfd_open(os.getpid())
kid = os.pidfd_open(child, os.O_NONBLOCK)
main = os.pidfd_open(os.getpid(), os.O_EXCL)      # PIDFD_THREAD
got = []
signal.signal(signal.SIGUSR2, lambda *a: got.append(threading.get_ident()))
import threading
def target(fd):
    for line in open("/proc/self/fdinfo/%d" % fd):
        if line.startswith("Pid:"):
            return int(line.split()[1])
"#,
        r#"
expect(target(me) == os.getpid(), "own pidfd names %r" % target(me))
expect(target(kid) == child, "child pidfd names %r, child is %d" % (target(kid), child))
expect(fcntl.fcntl(kid, fcntl.F_GETFL) & os.O_NONBLOCK, "PIDFD_NONBLOCK")
expect(fcntl.fcntl(me, fcntl.F_GETFD) & fcntl.FD_CLOEXEC, "close-on-exec")
expect(target(main) == os.getpid(), "main thread's pidfd names %r" % target(main))
expect(fcntl.fcntl(main, fcntl.F_GETFL) & os.O_EXCL, "PIDFD_THREAD")
signal.pidfd_send_signal(main, signal.SIGUSR2, None, 1)   # PIDFD_SIGNAL_THREAD
expect(got == [threading.main_thread().ident], "the main thread took the signal: %r" % got)
signal.pidfd_send_signal(kid, signal.SIGKILL)
expect(os.waitpid(child, 0)[0] == child, "child killed through its pidfd")
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(pidfds(a).len(), 3, "{:?}", a.fds);
    assert_eq!(pidfds(a), pidfds(b));
}

/// pidfds of threads that are not main threads (PIDFD_THREAD; zdtm
/// pidfd_of_thread's shape): one of a thread of the process, non-blocking,
/// with a copy (dup) sharing its description, both inherited by a child,
/// which opens one more of its parent's thread (a process rebuilt after
/// the thread's). Each names the same thread after the restore, and a
/// signal sent through it with PIDFD_SIGNAL_THREAD reaches that thread.
#[test]
fn pidfds_of_threads_round_trip() {
    let rt = round_trip(
        "pidfds-threads",
        r#"
import threading
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])   # in every thread
tids = []
ready = threading.Event()
def worker():
    tids.append(threading.get_native_id())
    ready.set()
    while True:
        time.sleep(60)
threading.Thread(target=worker, daemon=True).start()
ready.wait()
tfd = os.pidfd_open(tids[0], os.O_EXCL | os.O_NONBLOCK)   # PIDFD_THREAD
copy = os.dup(tfd)
r, w = os.pipe()
child = os.fork()
if child == 0:
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)         # PR_SET_PDEATHSIG
    parents = os.pidfd_open(tids[0], os.O_EXCL)
    os.write(w, b"x")
    while True:
        time.sleep(60)
os.read(r, 1)
def target(fd):
    for line in open("/proc/self/fdinfo/%d" % fd):
        if line.startswith("Pid:"):
            return int(line.split()[1])
def pending(tid):
    for line in open("/proc/self/task/%d/status" % tid):
        if line.startswith("SigPnd:"):
            return int(line.split()[1], 16)
"#,
        r#"
expect(target(tfd) == tids[0], "the thread's pidfd names %r, the thread is %d" % (target(tfd), tids[0]))
expect(target(copy) == tids[0], "its copy names %r" % target(copy))
fl = fcntl.fcntl(tfd, fcntl.F_GETFL)
expect(fl & os.O_EXCL and fl & os.O_NONBLOCK, "PIDFD_THREAD | PIDFD_NONBLOCK: %o" % fl)
expect(os.fstat(tfd).st_ino == os.fstat(copy).st_ino, "the same thread")
signal.pidfd_send_signal(tfd, signal.SIGUSR2, None, 1)   # PIDFD_SIGNAL_THREAD
bit = 1 << (signal.SIGUSR2 - 1)
expect(pending(tids[0]) & bit, "the signal is not pending for the thread: %x" % pending(tids[0]))
expect(not pending(os.getpid()) & bit, "the signal went to the main thread")
os.kill(child, signal.SIGKILL)
expect(os.waitpid(child, 0)[0] == child, "child ended")
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(pidfds(a).len(), 2, "{:?}", a.fds);
    assert_eq!(pidfds(a), pidfds(b));
    let child = &rt.before.processes[1];
    assert_eq!(pidfds(child).len(), 3, "{:?}", child.fds);
}

/// An epoll watching a pidfd (PIDFD_THREAD) of a thread of the process
/// that is not its main thread, opened only once the threads exist: after
/// the restore the epoll reports nothing while the thread runs, and the
/// pidfd readable once it has exited.
#[test]
fn epoll_of_a_thread_pidfd_round_trip() {
    let rt = round_trip(
        "epoll-thread-pidfd",
        r#"
import select, threading
tids = []
ready = threading.Event()
r, w = os.pipe()
def worker():
    tids.append(threading.get_native_id())
    ready.set()
    os.read(r, 1)
threading.Thread(target=worker, daemon=True).start()
ready.wait()
tfd = os.pidfd_open(tids[0], os.O_EXCL)   # PIDFD_THREAD
ep = select.epoll()
ep.register(tfd, select.EPOLLIN)
expect(ep.poll(0) == [], "setup: the epoll reports the running thread")
"#,
        r#"
expect(ep.poll(0) == [], "the epoll reports the thread before it exits: %r" % ep.poll(0))
os.write(w, b"x")
got = ep.poll(10)
# EPOLLIN once it exited, EPOLLHUP once reaped (at once: not a main thread).
expect(len(got) == 1 and got[0][0] == tfd and got[0][1] & select.EPOLLIN,
       "once the thread exited, the epoll reports %r" % got)
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(pidfds(a).len(), 1, "{:?}", a.fds);
    assert_eq!(pidfds(a), pidfds(b));
}

/// A process holding a pidfd (PIDFD_THREAD) of a thread of its child that
/// is not the child's main thread (the child is rebuilt after it), with a
/// copy, an epoll watching it, and another child that inherited it: after
/// the restore the pidfd (and the other child's) names that thread, a
/// signal sent through it (PIDFD_SIGNAL_THREAD) is pending for that
/// thread and not the child's main thread, the epoll reports nothing
/// until the thread exits, then the pidfd readable.
#[test]
fn pidfd_of_a_childs_thread_round_trip() {
    let rt = round_trip(
        "pidfd-child-thread",
        r#"
import select
r, w = os.pipe()
go_r, go_w = os.pipe()
child = os.fork()
if child == 0:
    import threading
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)         # PR_SET_PDEATHSIG
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])   # in every thread
    def worker():
        os.write(w, struct.pack("i", threading.get_native_id()))
        os.read(go_r, 1)
    threading.Thread(target=worker, daemon=True).start()
    while True:
        time.sleep(60)
tid, = struct.unpack("i", os.read(r, 4))
tfd = os.pidfd_open(tid, os.O_EXCL | os.O_NONBLOCK)   # PIDFD_THREAD
copy = os.dup(tfd)
ep = select.epoll()
ep.register(tfd, select.EPOLLIN)
other = os.fork()        # rebuilt after the child: inherits the pidfd
if other == 0:
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    while True:
        time.sleep(60)
def target(fd, pid="self"):
    for line in open("/proc/%s/fdinfo/%d" % (pid, fd)):
        if line.startswith("Pid:"):
            return int(line.split()[1])
def pending(t):
    for line in open("/proc/%d/task/%d/status" % (child, t)):
        if line.startswith("SigPnd:"):
            return int(line.split()[1], 16)
"#,
        r#"
expect(target(tfd) == tid, "the pidfd names %r, the child's thread is %d" % (target(tfd), tid))
expect(target(copy) == tid, "its copy names %r" % target(copy))
expect(target(tfd, other) == tid, "the other child's names %r" % target(tfd, other))
expect(os.fstat(tfd).st_ino == os.fstat(copy).st_ino, "the copy names another thread")
fl = fcntl.fcntl(tfd, fcntl.F_GETFL)
expect(fl & os.O_EXCL and fl & os.O_NONBLOCK, "PIDFD_THREAD | PIDFD_NONBLOCK: %o" % fl)
signal.pidfd_send_signal(tfd, signal.SIGUSR2, None, 1)   # PIDFD_SIGNAL_THREAD
bit = 1 << (signal.SIGUSR2 - 1)
expect(pending(tid) & bit, "the signal is not pending for the thread: %x" % pending(tid))
expect(not pending(child) & bit, "the signal went to the child's main thread")
expect(ep.poll(0) == [], "the epoll reports the thread before it exits: %r" % ep.poll(0))
os.write(go_w, b"x")
got = ep.poll(10)
# EPOLLIN once it exited, EPOLLHUP once reaped (at once: not a main thread).
expect(len(got) == 1 and got[0][0] == tfd and got[0][1] & select.EPOLLIN,
       "once the thread exited, the epoll reports %r" % got)
for c in (child, other):
    os.kill(c, signal.SIGKILL)
    expect(os.waitpid(c, 0)[0] == c, "child ended")
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(pidfds(a).len(), 2, "{:?}", a.fds);
    let other = &rt.before.processes[2];
    assert!(
        other
            .fds
            .iter()
            .any(|f| f.shared.is_some_and(|s| s.pid == a.pid)),
        "{:?}",
        other.fds
    );
    assert_eq!(pidfds(a), pidfds(b));
    let tid = rt.before.processes[1].threads[1].tid;
    assert!(pidfds(a).iter().all(|&(_, pid)| pid == tid), "{:?}", a.fds);
}

/// The pidfds of `p`: (fd, the image's PID they name).
fn pidfds(p: &cr_image::model::Process) -> Vec<(i32, u32)> {
    p.fds
        .iter()
        .filter_map(|f| match f.kind {
            cr_image::model::FdKind::Pidfd { pid, .. } => Some((f.fd, pid)),
            _ => None,
        })
        .collect()
}

/// pidfds of processes that have exited and been reaped (two of one
/// process, one blocking and one non-blocking, and one of another): after
/// the restore each still names a dead process ("Pid: -1"),
/// pidfd_send_signal answers ESRCH, poll reports them readable, the
/// non-blocking one keeps PIDFD_NONBLOCK, and (pidfs) the two of one
/// process share their inode, which the other's differs from.
#[test]
fn pidfds_of_dead_processes_round_trip() {
    let rt = round_trip(
        "pidfds-dead",
        r#"
import select
def dead(*flags):
    child = os.fork()
    if child == 0:
        os._exit(0)
    fds = [os.pidfd_open(child, f) for f in flags]
    os.waitpid(child, 0)
    return fds
blocking, nonblocking = dead(0, os.O_NONBLOCK)
other, = dead(0)
ino = lambda fd: os.fstat(fd).st_ino
expect(ino(blocking) == ino(nonblocking) != ino(other), "setup: the inodes")
def target(fd):
    for line in open("/proc/self/fdinfo/%d" % fd):
        if line.startswith("Pid:"):
            return int(line.split()[1])
"#,
        r#"
expect(ino(blocking) == ino(nonblocking), "the pidfds of one process: two inodes")
expect(ino(blocking) != ino(other), "the pidfds of two processes: one inode")
for fd in (blocking, nonblocking, other):
    expect(target(fd) == -1, "pidfd %d names %r" % (fd, target(fd)))
    try:
        signal.pidfd_send_signal(fd, 0)
        expect(False, "pidfd %d: a signal sent to a dead process" % fd)
    except ProcessLookupError:
        pass
    p = select.poll()
    p.register(fd, select.POLLIN)
    expect(p.poll(0) != [], "pidfd %d not readable" % fd)
expect(fcntl.fcntl(nonblocking, fcntl.F_GETFL) & os.O_NONBLOCK, "PIDFD_NONBLOCK")
expect(not fcntl.fcntl(blocking, fcntl.F_GETFL) & os.O_NONBLOCK, "the blocking one")
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(pidfds(a).len(), 3, "{:?}", a.fds);
    assert!(pidfds(a).iter().all(|&(_, pid)| pid == 0));
    assert_eq!(pidfds(a), pidfds(b));
}

/// An epoll watching a pipe through an fd closed since (the pipe still
/// open at another number, a dup): the item keeps its key and its data and
/// reports the pipe's events.
#[test]
fn epoll_watching_a_closed_fd_round_trip() {
    let rt = round_trip(
        "eventfds-epoll-closed",
        r#"
import select
ep = select.epoll()
r, w = os.pipe()
kept = os.dup(r)
ep.register(r, select.EPOLLIN)
old = r
os.close(r)
"#,
        r#"
import select
expect(ep.poll(0) == [], "no event before a write")
os.write(w, b"x")
got = ep.poll(1)
expect(got == [(old, select.EPOLLIN)], "the events %r" % got)
expect(os.read(kept, 1) == b"x", "the pipe")
"#,
    );
    let items = |c: &cr_image::model::Checkpoint| -> Vec<(i32, Option<i32>)> {
        epoll_items(c).iter().map(|i| (i.tfd, i.open_as)).collect()
    };
    let before = items(&rt.before);
    assert_eq!(before.len(), 1);
    assert!(
        before[0].1.is_some(),
        "watched through another fd: {before:?}"
    );
    assert_eq!(before, items(&rt.after));
}

/// The inotify helper of the programs: the events queued in inotify fd
/// `fd` (non-blocking), as (wd, mask, name).
const INOTIFY_PY: &str = r#"
def inotify_events(fd):
    out = []
    while True:
        try:
            b = os.read(fd, 4096)
        except BlockingIOError:
            return out
        i = 0
        while i < len(b):
            wd, mask, _, n = struct.unpack_from("iIII", b, i)
            out.append((wd, mask, b[i + 16:i + 16 + n].rstrip(b"\0").decode()))
            i += 16 + n
"#;

/// inotify watching a file removed while the program keeps it open: the
/// watch comes back on the file made again, at its number (after a watch
/// of the directory, one removed and one more, so the numbers have gaps);
/// writing the removed file through the program's fd is reported on it.
#[test]
fn inotify_on_a_removed_file_round_trip() {
    let rt = round_trip(
        "inotify-deleted",
        &format!(
            "{INOTIFY_PY}{}",
            r#"
IN_MODIFY, IN_ATTRIB, IN_CREATE = 0x2, 0x4, 0x100
ino = libc.inotify_init1(os.O_NONBLOCK)
def watch(path, mask):
    return libc.inotify_add_watch(ino, path.encode(), mask)
# A directory of its own: an event in the test's (its "ready" file) would
# be queued, unread, at the checkpoint.
W = os.path.join(DIR, "watched-dir"); os.mkdir(W)
wdir = watch(W, IN_CREATE)
p = os.path.join(DIR, "watched")
f = open(p, "w+b"); f.write(b"before"); f.flush()
gone = watch(os.path.join(DIR, "program.py"), IN_MODIFY)
libc.inotify_rm_watch(ino, gone)
wfile = watch(p, IN_MODIFY | IN_ATTRIB)
os.unlink(p)
def events():
    return [(wd, mask) for wd, mask, _ in inotify_events(ino)]
events()   # the unlink's IN_ATTRIB, the removed watch's IN_IGNORED
"#
        ),
        r#"
f.write(b" after"); f.flush()
f.seek(0); expect(f.read() == b"before after", "the removed file's content")
open(os.path.join(W, "new"), "w").close()
got = events()
expect((wfile, IN_MODIFY) in got, "no IN_MODIFY on watch %d of the removed file: %r" % (wfile, got))
expect((wdir, IN_CREATE) in got, "no IN_CREATE on watch %d of the directory: %r" % (wdir, got))
expect(os.readlink("/proc/self/fd/%d" % f.fileno()) == p + " (deleted)", "the fd of the removed file")
"#,
    );
    let watches = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .filter_map(|f| match &f.kind {
                cr_image::model::FdKind::Inotify { watches } => {
                    let mut v: Vec<_> = watches
                        .iter()
                        .map(|w| (w.wd, w.mask, w.deleted_file.is_some()))
                        .collect();
                    v.sort();
                    Some(v)
                }
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let (a, b) = rt.roots();
    assert_eq!(watches(a), vec![vec![(1, 0x100, false), (3, 0x6, true)]]);
    assert_eq!(watches(a), watches(b));
}

/// inotify watching a symbolic link itself (IN_DONT_FOLLOW, which the
/// kernel does not keep in the watch's mask) to a directory: the watch
/// comes back on the link, not on the directory it points to.
#[test]
fn inotify_on_a_symlink_itself_round_trip() {
    let rt = round_trip(
        "inotify-symlink",
        &format!(
            "{INOTIFY_PY}{}",
            r#"
IN_ATTRIB, IN_CREATE, IN_DONT_FOLLOW = 0x4, 0x100, 0x02000000
ino = libc.inotify_init1(os.O_NONBLOCK)
T = os.path.join(DIR, "target-dir"); os.mkdir(T)
L = os.path.join(DIR, "link"); os.symlink(T, L)
wl = libc.inotify_add_watch(ino, L.encode(), IN_ATTRIB | IN_CREATE | IN_DONT_FOLLOW)
expect(wl > 0, "watch of the link")
def watched_inodes():
    return [int(w.split("ino:")[1].split()[0], 16)
            for w in open("/proc/self/fdinfo/%d" % ino) if w.startswith("inotify ")]
expect(watched_inodes() == [os.lstat(L).st_ino], "the link's inode watched")
"#
        ),
        r#"
expect(watched_inodes() == [os.lstat(L).st_ino],
       "watched %r, the link is %d, its directory %d" % (watched_inodes(), os.lstat(L).st_ino, os.stat(T).st_ino))
open(os.path.join(T, "new"), "w").close()
os.utime(L, (1, 1), follow_symlinks=False)
got = [(wd, mask) for wd, mask, _ in inotify_events(ino)]
expect(got == [(wl, IN_ATTRIB)], "events %r, want only the link's IN_ATTRIB on watch %d" % (got, wl))
"#,
    );
    let masks = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .filter_map(|f| match &f.kind {
                cr_image::model::FdKind::Inotify { watches } => {
                    Some(watches.iter().map(|w| w.mask).collect::<Vec<_>>())
                }
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let (a, b) = rt.roots();
    assert_eq!(masks(a), vec![vec![0x104 | libc::IN_DONT_FOLLOW]]);
    assert_eq!(masks(a), masks(b));
}

/// inotify with more watches than one hex digit numbers (fdinfo shows the
/// watch numbers in hex: "a" is 10, "10" is 16): 20 directories watched,
/// each comes back at its number and reports its own events.
#[test]
fn inotify_many_watches_round_trip() {
    let rt = round_trip(
        "inotify-many",
        &format!(
            "{INOTIFY_PY}{}",
            r#"
IN_CREATE = 0x100
ino = libc.inotify_init1(os.O_NONBLOCK)
dirs = {}
for i in range(20):
    d = os.path.join(DIR, "d.%02d" % i); os.mkdir(d)
    wd = libc.inotify_add_watch(ino, d.encode(), IN_CREATE)
    assert wd > 0
    dirs[wd] = d
def events():
    return inotify_events(ino)
"#
        ),
        r#"
for wd, d in dirs.items():
    open(os.path.join(d, "f%d" % wd), "w").close()
got = sorted(events())
want = sorted((wd, IN_CREATE, "f%d" % wd) for wd in dirs)
expect(got == want, "events %r, want %r" % (got, want))
n = sum(1 for l in open("/proc/self/fdinfo/%d" % ino) if l.startswith("inotify "))
expect(n == 20, "%d watches" % n)
"#,
    );
    let wds = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .filter_map(|f| match &f.kind {
                cr_image::model::FdKind::Inotify { watches } => {
                    let mut v: Vec<_> = watches.iter().map(|w| w.wd).collect();
                    v.sort();
                    Some(v)
                }
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let (a, b) = rt.roots();
    assert_eq!(wds(a), vec![(1..=20).collect::<Vec<_>>()]);
    assert_eq!(wds(a), wds(b));
}

/// The fanotify helpers of the programs: the calls through ctypes, and
/// the events of a group (struct fanotify_event_metadata, then its info
/// records) as (mask, fd, record bytes).
const FANOTIFY_PY: &str = r#"
libc.fanotify_init.argtypes = [ctypes.c_uint, ctypes.c_uint]
libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
FAN_ACCESS, FAN_CLOSE_WRITE, FAN_CREATE, FAN_EVENT_ON_CHILD, FAN_ONDIR = 0x1, 0x8, 0x100, 0x08000000, 0x40000000
FAN_NONBLOCK, FAN_REPORT_DFID_NAME = 0x2, 0xc00
FAN_MARK_ADD, FAN_MARK_MOUNT, FAN_MARK_IGNORED_MASK, FAN_MARK_IGNORED_SURV_MODIFY, FAN_MARK_FILESYSTEM = 0x1, 0x10, 0x20, 0x40, 0x100
def fan_init(flags):
    fd = libc.fanotify_init(flags, os.O_RDONLY)
    if fd < 0: raise OSError(ctypes.get_errno(), "fanotify_init")
    return fd
def fan_mark(fd, flags, mask, path):
    if libc.fanotify_mark(fd, flags, mask, -100, path.encode()) != 0:
        raise OSError(ctypes.get_errno(), "fanotify_mark " + path)
def fan_events(fd):
    out = []
    try:
        buf = os.read(fd, 65536)
    except BlockingIOError:
        return out
    off = 0
    while off < len(buf):
        n, vers, _, mlen, mask, efd, pid = struct.unpack_from("=IBBHQii", buf, off)
        out.append((mask, efd, buf[off + mlen:off + n]))
        off += n
    return out
def fan_lines(fd):
    return sorted(l for l in open("/proc/self/fdinfo/%d" % fd).read().splitlines() if l.startswith("fanotify"))
"#;

/// Two fanotify groups: one reporting directory handles and names with a
/// mark on a directory (FAN_CREATE); one plain, with a mark on the same
/// directory for its children's FAN_CLOSE_WRITE, an ignore mask on one of
/// them, and ignore-only marks on the mount and the filesystem. After the
/// restore the groups list the same marks, the first sees a file created
/// in the directory (by name), the second the child written and closed
/// (with an fd of it) and not the ignored one.
#[test]
fn fanotify_round_trip() {
    let rt = round_trip(
        "fanotify",
        &format!(
            "{FANOTIFY_PY}{}",
            r#"
W = os.path.join(DIR, "watched"); os.mkdir(W)
for name in ("child", "quiet"):
    open(os.path.join(W, name), "w").close()
named = fan_init(FAN_REPORT_DFID_NAME | FAN_NONBLOCK)
fan_mark(named, FAN_MARK_ADD, FAN_CREATE | FAN_ONDIR, W)
plain = fan_init(FAN_NONBLOCK)
fan_mark(plain, FAN_MARK_ADD, FAN_CLOSE_WRITE | FAN_EVENT_ON_CHILD, W)
fan_mark(plain, FAN_MARK_ADD | FAN_MARK_IGNORED_MASK | FAN_MARK_IGNORED_SURV_MODIFY, FAN_CLOSE_WRITE, os.path.join(W, "quiet"))
# Ignoring FAN_ACCESS (which the group does not ask for), surviving
# changes (any write on the mount would clear them).
fan_mark(plain, FAN_MARK_ADD | FAN_MARK_MOUNT | FAN_MARK_IGNORED_MASK | FAN_MARK_IGNORED_SURV_MODIFY, FAN_ACCESS, W)
fan_mark(plain, FAN_MARK_ADD | FAN_MARK_FILESYSTEM | FAN_MARK_IGNORED_MASK | FAN_MARK_IGNORED_SURV_MODIFY, FAN_ACCESS, W)
before = (fan_lines(named), fan_lines(plain))
"#
        ),
        r#"
after = (fan_lines(named), fan_lines(plain))
expect(after == before, "the groups' fdinfo %r, was %r" % (after, before))
expect(fan_events(named) == [] and fan_events(plain) == [], "no events before the program's own")
open(os.path.join(W, "new"), "w").close()
ev = fan_events(named)
expect(len(ev) == 1 and ev[0][0] & FAN_CREATE and b"new\0" in ev[0][2], "the create event %r" % ev)
for name in ("quiet", "child"):
    with open(os.path.join(W, name), "w") as f: f.write("x")
ev = fan_events(plain)
paths = [os.readlink("/proc/self/fd/%d" % e[1]) for e in ev if e[1] >= 0]
for e in ev:
    if e[1] >= 0: os.close(e[1])
want = [os.path.join(W, "new"), os.path.join(W, "child")]
expect([e[0] for e in ev] == [FAN_CLOSE_WRITE] * 2 and paths == want, "the close-write events %r on %r" % (ev, paths))
"#,
    );
    let (a, b) = rt.roots();
    let marks = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .filter_map(|f| match &f.kind {
                cr_image::model::FdKind::Fanotify { marks, .. } => Some(marks.len()),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(marks(a), vec![1, 4]);
    assert_eq!(marks(a), marks(b));
}

/// A fanotify group (notification class: permission marks are refused)
/// with an event never read: dropped at a dump whose processes end, like
/// inotify's (the kernel cannot queue it again, and a group marking a
/// whole mount also gets the checkpoint's own opens: refusing would fail
/// every such dump). The restored group reports what happens next.
#[test]
fn fanotify_events_never_read_are_dropped() {
    crate::kinds::testkit::round_trip(
        "fanotify-queued",
        &format!(
            "{FANOTIFY_PY}{}",
            r#"
W = os.path.join(DIR, "watched"); os.mkdir(W)
g = fan_init(FAN_REPORT_DFID_NAME | FAN_NONBLOCK)
fan_mark(g, FAN_MARK_ADD, FAN_CREATE, W)
open(os.path.join(W, "early"), "w").close()
"#
        ),
        r#"
ev = fan_events(g)
expect(ev == [], "events queued before the checkpoint came back: %r" % ev)
open(os.path.join(W, "late"), "w").close()
ev = fan_events(g)
expect(len(ev) == 1 and b"late\0" in ev[0][2], "the event after the restore %r" % ev)
"#,
    );
}

/// A fanotify group asking for permission events is refused by name
/// before anything is frozen, and the program runs on: its marked file
/// opens once the program answers (FAN_ALLOW).
#[test]
fn fanotify_permission_events_are_refused() {
    crate::kinds::testkit::refused(
        "fanotify-perm",
        &format!(
            "{FANOTIFY_PY}{}",
            r#"
W = os.path.join(DIR, "guarded"); os.mkdir(W)
open(os.path.join(W, "f"), "w").close()
g = fan_init(0x4)      # FAN_CLASS_CONTENT, blocking reads
fan_mark(g, FAN_MARK_ADD, 0x10000 | FAN_EVENT_ON_CHILD, W)      # FAN_OPEN_PERM
"#
        ),
        r#"
pid = os.fork()
if pid == 0:
    os.open(os.path.join(W, "f"), os.O_RDONLY); os._exit(0)
ev = fan_events(g)
expect(len(ev) == 1 and ev[0][0] & 0x10000, "the permission event %r" % ev)
os.write(g, struct.pack("=iI", ev[0][1], 1))     # FAN_ALLOW
os.close(ev[0][1])
expect(os.waitpid(pid, 0)[1] == 0, "the open allowed")
"#,
        "a fanotify mark asking for permission events",
    );
}

/// The inotify helpers of the programs: an instance (blocking reads)
/// watching a directory of its own for IN_CREATE, three files created in
/// it (three events of 32 bytes queued), and its events as (wd, name).
const INOTIFY_QUEUED_PY: &str = r#"
import select
IN_CREATE = 0x100
W = os.path.join(DIR, "watched"); os.mkdir(W)
ino = libc.inotify_init1(0)
wd = libc.inotify_add_watch(ino, W.encode(), IN_CREATE)
def queued():
    return struct.unpack("i", fcntl.ioctl(ino, 0x541B, b"\0" * 4))[0]      # FIONREAD
def parse(b):
    out, i = [], 0
    while i < len(b):
        w, mask, _, n = struct.unpack_from("iIII", b, i)
        out.append((w, b[i + 16:i + 16 + n].rstrip(b"\0").decode()))
        i += 16 + n
    return out
def events(timeout):
    out = []
    while select.select([ino], [], [], timeout)[0]:
        out += parse(os.read(ino, 4096))
        timeout = 0
    return out
names = ["e0", "e1", "e2"]
for n in names:
    open(os.path.join(W, n), "w").close()
assert queued() == 96, queued()
"#;

/// An inotify instance with three events queued when the checkpoint
/// (--kill) starts, which the program reads at its own pace (one every
/// 0.25 s, on a thread of its own): the dump waits for it to read them
/// before the freeze; after the restore the program has had each event
/// exactly once, none is queued again, and its watch reports a new file.
#[test]
fn inotify_events_read_while_the_checkpoint_waits_round_trip() {
    let rt = round_trip(
        "inotify-drain",
        &format!(
            "{INOTIFY_QUEUED_PY}{}",
            r#"
import threading
got = []
def reader():
    for _ in names:
        time.sleep(0.25)    # the program's pace
        got.extend(parse(os.read(ino, 32)))     # one event at a time
t = threading.Thread(target=reader); t.start()
"#
        ),
        r#"
t.join(10)
expect(not t.is_alive(), "the reader still waits for events")
expect(got == [(wd, n) for n in names], "the events read: %r" % got)
expect(queued() == 0, "%d bytes queued again" % queued())
open(os.path.join(W, "after"), "w").close()
ev = events(5)
expect(ev == [(wd, "after")], "the watch after the restore: %r" % ev)
"#,
    );
    let (a, b) = rt.roots();
    let inotify =
        |p: &cr_image::model::Process| p.fds.iter().filter(|f| f.kind.name() == "inotify").count();
    assert_eq!((inotify(a), inotify(b)), (1, 1));
}

/// The check of a program whose queued events were dropped: nothing is
/// queued after the restore, and its watch reports what happens next.
const DROPPED_CHECK: &str = r#"
expect(queued() == 0, "%d bytes of dropped events queued" % queued())
open(os.path.join(W, "after"), "w").close()
ev = events(5)
expect(ev == [(wd, "after")], "the watch after the restore: %r" % ev)
"#;

/// An inotify instance whose program never reads its queued events: after
/// the wait the dump drops them (with a warning) and goes on; the restored
/// program has nothing queued and its watch reports what happens next.
#[test]
fn inotify_events_never_read_are_dropped_after_the_wait() {
    round_trip("inotify-queued", INOTIFY_QUEUED_PY, DROPPED_CHECK);
}

/// --skip-queued-events: the queued events are dropped (the program is
/// told so by their absence), the checkpoint goes on, and the restored
/// program's watch reports what happens next.
#[test]
fn inotify_events_skipped_round_trip() {
    let rt = round_trip_opts(
        "inotify-skip",
        INOTIFY_QUEUED_PY,
        DROPPED_CHECK,
        |o| o.skip_queued_events = true,
        |_| {},
    );
    let (a, _) = rt.roots();
    assert!(
        a.fds.iter().any(|f| f.kind.name() == "inotify"),
        "the inotify instance is in the image"
    );
}

/// A checkpoint that continues the program leaves it its inotify instance,
/// queue and all: not refused, and the program then reads every event.
#[test]
fn inotify_events_queued_at_a_checkpoint_that_continues() {
    crate::kinds::testkit::continued(
        "inotify-continue",
        INOTIFY_QUEUED_PY,
        r#"
ev = events(0)
expect(ev == [(wd, n) for n in names], "the queued events %r" % ev)
"#,
    );
}

/// Epoll items whose key is a number the program reused: pipes added under
/// the same fd number one after the other (closed between, each still open
/// elsewhere), and under a number another pipe holds now. Each item keeps
/// its key and data and reports its own pipe; the fd at the reused number
/// is still its own file. Before the fix the restore added the first
/// pipe several times ("file exists"), and a number taken by another file
/// was refused at checkpoint.
#[test]
fn epoll_items_under_reused_numbers_round_trip() {
    let rt = round_trip(
        "eventfds-epoll-reused",
        r#"
import select
ep = select.epoll()
pipes = [os.pipe() for _ in range(4)]
for i, (r, w) in enumerate(pipes):
    os.dup2(r, 900)
    ep.register(900, select.EPOLLIN)
    libc.epoll_ctl(ep.fileno(), 3, 900, ctypes.byref(ctypes.create_string_buffer(struct.pack("=IQ", 1, 100 + i), 12)))
    if i < 3:
        os.close(900)
"#,
        r#"
import select
expect(ep.poll(0) == [], "no event before a write")
for i, (r, w) in enumerate(pipes):
    os.write(w, b"x")
    raw = ctypes.create_string_buffer(12 * 8)
    n = libc.epoll_wait(ep.fileno(), raw, 8, 1000)
    got = [struct.unpack_from("=IQ", raw, 12 * k) for k in range(max(n, 0))]
    expect(got == [(1, 100 + i)], "pipe %d reported as %r" % (i, got))
    expect(os.read(r, 1) == b"x", "pipe %d" % i)
expect(os.fstat(900).st_ino == os.fstat(pipes[3][0]).st_ino, "fd 900 is the last pipe")
"#,
    );
    let items = |c: &cr_image::model::Checkpoint| -> Vec<(i32, u64, Option<i32>)> {
        let mut v: Vec<_> = epoll_items(c)
            .iter()
            .map(|i| (i.tfd, i.data, i.open_as))
            .collect();
        v.sort();
        v
    };
    let before = items(&rt.before);
    assert_eq!(before.len(), 4, "{before:?}");
    assert!(before.iter().all(|i| i.0 == 900), "{before:?}");
    let elsewhere = before.iter().filter(|i| i.2.is_some()).count();
    assert_eq!(elsewhere, 3, "three watched through another fd: {before:?}");
    let datas: Vec<u64> = before.iter().map(|i| i.1).collect();
    assert_eq!(datas, vec![100, 101, 102, 103]);
    assert_eq!(items(&rt.after).len(), 4);
}

/// The items of every epoll of the root process of `c`.
fn epoll_items(c: &cr_image::model::Checkpoint) -> Vec<cr_image::model::fds::EpollItem> {
    c.processes[0]
        .fds
        .iter()
        .filter_map(|f| match &f.kind {
            cr_image::model::FdKind::Epoll { items } => Some(items.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}
