//! Round trip of kind "signals": a handler, a blocked signal pending with
//! its value, a thread's mask.

use crate::kinds::testkit::round_trip;

#[test]
fn signals_round_trip() {
    let rt = round_trip(
        "signals",
        r#"
hits = []
signal.signal(signal.SIGUSR2, lambda s, f: hits.append(s))
signal.signal(signal.SIGPIPE, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN})
class sigval(ctypes.Union):
    _fields_ = [("sival_int", ctypes.c_int), ("sival_ptr", ctypes.c_void_p)]
libc.sigqueue(os.getpid(), signal.SIGRTMIN, sigval(4242))
"#,
        r#"
expect(signal.SIGRTMIN in signal.sigpending(), "the pending real-time signal")
info = signal.sigtimedwait({signal.SIGRTMIN}, 0)
expect(info is not None and info.si_code == -1 and info.si_pid == os.getpid(), "its siginfo %r" % (info,))
expect(signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN, "an ignored signal")
os.kill(os.getpid(), signal.SIGUSR2)
time.sleep(0.05)
expect(hits == [signal.SIGUSR2], "the handler ran %r" % hits)
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(a.signals.actions.len(), b.signals.actions.len());
    assert_eq!(a.signals.shared_pending, b.signals.shared_pending);
    assert_eq!(a.threads[0].sigmask, b.threads[0].sigmask);
}

/// A signal `pthread_kill` sent to a thread other than the main one, still
/// pending (blocked there), comes back pending for that thread with its
/// siginfo (from tgkill: only the thread itself may queue it again).
#[test]
fn thread_directed_pending_signal_round_trip() {
    round_trip(
        "tkill",
        r#"
import threading
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP, signal.SIGUSR2})
ready = threading.Event(); go = threading.Event(); got = {}
def worker():
    ready.set(); go.wait()
    got["pending"] = signal.sigpending()
    info = signal.sigtimedwait({signal.SIGHUP}, 0)
    got["info"] = info and (info.si_signo, info.si_code, info.si_pid)
t = threading.Thread(target=worker); t.start(); ready.wait()
signal.pthread_kill(t.ident, signal.SIGHUP)
signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
"#,
        r#"
go.set(); t.join(10)
# tgkill's si_code: SI_TKILL (-6), SI_USER (0) on kernels since 6.9
expect(got.get("info") in [(signal.SIGHUP, c, os.getpid()) for c in (0, -6)], "the thread's pending signal %r" % (got,))
expect(signal.SIGHUP not in signal.sigpending(), "SIGHUP moved to the main thread")
info = signal.sigtimedwait({signal.SIGUSR2}, 0)
expect(info is not None and info.si_code in (0, -6), "the main thread's pending signal %r" % (info,))
"#,
    );
}
