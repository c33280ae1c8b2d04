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
