//! Round trip of kind "timers": an interval timer keeps its period and the
//! time it had left.

use crate::kinds::testkit::round_trip;

#[test]
fn interval_timer_round_trip() {
    let rt = round_trip(
        "timers",
        r#"
signal.signal(signal.SIGALRM, lambda s, f: None)
signal.setitimer(signal.ITIMER_REAL, 300, 7)
"#,
        r#"
left, interval = signal.getitimer(signal.ITIMER_REAL)
expect(0 < left <= 300 and interval == 7, "timer %r %r" % (left, interval))
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(a.timers.itimers.len(), 1);
    assert_eq!(
        a.timers.itimers[0].interval_us,
        b.timers.itimers[0].interval_us
    );
    assert!(b.timers.itimers[0].value_us <= a.timers.itimers[0].value_us);
}

/// Round trip of POSIX timers: two of them on two clocks, one periodic
/// with a signal and a value, one signalling a thread, one disarmed; their
/// ids, time left and notifications come back.
#[test]
fn posix_timers_round_trip() {
    let rt = round_trip(
        "posix-timers",
        r#"
import threading
class timespec(ctypes.Structure): _fields_ = [("s", ctypes.c_long), ("ns", ctypes.c_long)]
class itimerspec(ctypes.Structure): _fields_ = [("interval", timespec), ("value", timespec)]
class sigevent(ctypes.Structure):
    _fields_ = [("value", ctypes.c_uint64), ("signo", ctypes.c_int), ("notify", ctypes.c_int), ("tid", ctypes.c_int), ("pad", ctypes.c_int * 11)]
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN, signal.SIGRTMIN + 1})
def make(clock, ev, value, interval):
    tid = ctypes.c_int(-1)
    assert libc.timer_create(clock, ctypes.byref(ev), ctypes.byref(tid)) == 0
    libc.timer_settime(tid, 0, ctypes.byref(itimerspec(timespec(interval, 0), timespec(value, 0))), None)
    return tid.value
t1 = make(1, sigevent(77, signal.SIGRTMIN, 0, 0), 200, 50)          # MONOTONIC, SIGEV_SIGNAL
ready_ev = threading.Event()
tid_box = []
def waiter():
    tid_box.append(threading.get_native_id()); ready_ev.set()
    while True: time.sleep(1)
threading.Thread(target=waiter, daemon=True).start(); ready_ev.wait()
t2 = make(0, sigevent(0, signal.SIGRTMIN + 1, 4, tid_box[0]), 300, 0)  # REALTIME, SIGEV_THREAD_ID
t3 = make(7, sigevent(0, 0, 1, 0), 0, 0)                              # BOOTTIME, SIGEV_NONE, disarmed
"#,
        r#"
cur = itimerspec()
expect(libc.timer_gettime(t1, ctypes.byref(cur)) == 0 and 0 < cur.value.s <= 200 and cur.interval.s == 50, "timer 1 %d/%d" % (cur.value.s, cur.interval.s))
expect(libc.timer_gettime(t2, ctypes.byref(cur)) == 0 and 0 < cur.value.s <= 300, "timer 2")
expect(libc.timer_gettime(t3, ctypes.byref(cur)) == 0 and cur.value.s == 0, "timer 3 disarmed")
libc.timer_settime(t1, 0, ctypes.byref(itimerspec(timespec(0, 0), timespec(0, 1000000))), None)
info = signal.sigtimedwait({signal.SIGRTMIN}, 5)
expect(info is not None and info.si_code == -2, "timer 1 fires its signal %r" % (info,))   # SI_TIMER
timers = open("/proc/self/timers").read()
expect("ID: %d" % t2 in timers and "signal/tid.%d" % tid_box[0] in timers, "timer 2 signals its thread: " + timers)
"#,
    );
    let (a, b) = rt.roots();
    let shape = |p: &cr_image::model::Process| {
        p.timers
            .posix
            .iter()
            .map(|t| (t.id, t.clockid, t.notify, t.signo, t.sigval, t.interval_ns))
            .collect::<Vec<_>>()
    };
    assert_eq!(a.timers.posix.len(), 3);
    assert_eq!(shape(a), shape(b));
}
