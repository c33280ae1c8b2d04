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
