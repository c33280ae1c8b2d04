//! Round trip of kind "threads": several threads, each with its own TID,
//! thread-local state and a counter it keeps advancing after the restore.

use crate::kinds::testkit::round_trip;

#[test]
fn threads_round_trip() {
    let rt = round_trip(
        "threads",
        r#"
import threading
local = threading.local()
counts = [0] * 4
tids = [0] * 4
go = threading.Event()
def work(i):
    local.me = i * 1000
    tids[i] = threading.get_native_id()
    while True:
        counts[i] += 1
        if local.me != i * 1000:
            problems.append("thread %d lost its thread-local value" % i)
        time.sleep(0.001)
ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(4)]
for t in ts: t.start()
while not all(tids): time.sleep(0.01)
"#,
        r#"
before = list(counts)
time.sleep(0.2)
expect(all(c > b for c, b in zip(counts, before)), "threads stopped: %r -> %r" % (before, counts))
expect(sorted(int(t) for t in os.listdir("/proc/self/task")) == sorted([os.getpid()] + tids), "tids")
"#,
    );
    let (a, b) = rt.roots();
    let ids = |p: &cr_image::model::Process| {
        p.threads
            .iter()
            .map(|t| (t.tid, t.rseq.is_some(), t.xstate.len()))
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(a), ids(b));
    assert_eq!(a.threads.len(), 5);
}

/// Each thread's robust futex list (glibc registers one per thread, in its
/// TLS) is registered again at the same address: without it a thread that
/// dies holding a robust mutex would leave it locked for good.
#[test]
fn robust_futex_lists_round_trip() {
    round_trip(
        "robust",
        r#"
import ctypes, threading
libc = ctypes.CDLL(None, use_errno=True)
SYS_get_robust_list = 274
def robust():
    head = ctypes.c_void_p()
    size = ctypes.c_size_t()
    r = libc.syscall(SYS_get_robust_list, 0, ctypes.byref(head), ctypes.byref(size))
    return (r, head.value or 0, size.value)
asked = threading.Event()
answered = threading.Event()
seen = {}
started = threading.Event()
def work():
    seen["worker"] = robust()
    started.set()
    while True:
        asked.wait()
        asked.clear()
        seen["worker after"] = robust()
        answered.set()
t = threading.Thread(target=work, daemon=True)
t.start()
expect(started.wait(10), "the worker thread did not start")
main_before = robust()
expect(main_before[0] == 0 and main_before[1] != 0, "no robust list registered by glibc: %r" % (main_before,))
"#,
        r#"
asked.set()
expect(answered.wait(10), "the worker thread does not answer")
expect(robust() == main_before, "main thread's robust list %r, was %r" % (robust(), main_before))
expect(seen["worker after"] == seen["worker"], "worker's robust list %r, was %r" % (seen["worker after"], seen["worker"]))
expect(seen["worker"][1] != main_before[1], "the threads share one list head")
"#,
    );
}
