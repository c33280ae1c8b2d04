//! Round trip of kind "eventfds": an eventfd with its count, an epoll set
//! watching it, a signalfd, an armed timerfd, an inotify watch.

use crate::kinds::testkit::round_trip;

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
wd = libc.inotify_add_watch(ino, DIR.encode(), 0x100)    # IN_CREATE
"#,
        r#"
expect(ep.poll(0) == [(ev, select.EPOLLIN)], "epoll sees the eventfd")
expect(os.eventfd_read(ev) == 5, "eventfd count")
cur = itimerspec(); libc.timerfd_gettime(tfd, ctypes.byref(cur))
expect(0 < cur.value.s <= 300, "timerfd time left %d" % cur.value.s)
os.kill(os.getpid(), signal.SIGUSR2)
expect(len(os.read(sfd, 128)) == 128, "signalfd")
open(os.path.join(DIR, "new"), "w").close()
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

/// pidfds of processes of the tree (its own, its child's, one
/// non-blocking): each comes back naming the same restored process; the
/// child (which dies with its parent: PR_SET_PDEATHSIG) is ended through
/// its pidfd.
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
signal.pidfd_send_signal(kid, signal.SIGKILL)
expect(os.waitpid(child, 0)[0] == child, "child killed through its pidfd")
"#,
    );
    let (a, b) = rt.roots();
    let pidfds = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .filter_map(|f| match f.kind {
                cr_image::model::FdKind::Pidfd { pid } => Some((f.fd, pid)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(pidfds(a).len(), 2, "{:?}", a.fds);
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
        c.processes[0]
            .fds
            .iter()
            .filter_map(|f| match &f.kind {
                cr_image::model::FdKind::Epoll { items } => Some(items.clone()),
                _ => None,
            })
            .flatten()
            .map(|i| (i.tfd, i.open_as))
            .collect()
    };
    let before = items(&rt.before);
    assert_eq!(before.len(), 1);
    assert!(
        before[0].1.is_some(),
        "watched through another fd: {before:?}"
    );
    assert_eq!(before, items(&rt.after));
}

/// inotify watching a file removed while the program keeps it open: the
/// watch comes back on the file made again, at its number (after a watch
/// of the directory, one removed and one more, so the numbers have gaps);
/// writing the removed file through the program's fd is reported on it.
#[test]
fn inotify_on_a_removed_file_round_trip() {
    let rt = round_trip(
        "inotify-deleted",
        r#"
IN_MODIFY, IN_ATTRIB, IN_CREATE = 0x2, 0x4, 0x100
ino = libc.inotify_init1(os.O_NONBLOCK)
def watch(path, mask):
    return libc.inotify_add_watch(ino, path.encode(), mask)
wdir = watch(DIR, IN_CREATE)
p = os.path.join(DIR, "watched")
f = open(p, "w+b"); f.write(b"before"); f.flush()
gone = watch(os.path.join(DIR, "program.py"), IN_MODIFY)
libc.inotify_rm_watch(ino, gone)
wfile = watch(p, IN_MODIFY | IN_ATTRIB)
os.unlink(p)
def events():
    out = []
    while True:
        try:
            b = os.read(ino, 4096)
        except BlockingIOError:
            return out
        i = 0
        while i < len(b):
            wd, mask, _, n = struct.unpack_from("iIII", b, i)
            out.append((wd, mask))
            i += 16 + n
events()   # the unlink's IN_ATTRIB, the removed watch's IN_IGNORED
"#,
        r#"
f.write(b" after"); f.flush()
f.seek(0); expect(f.read() == b"before after", "the removed file's content")
open(os.path.join(DIR, "new"), "w").close()
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
