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
    if i % 2:
        libc.prctl(15, b"worker-%d" % i, 0, 0, 0)  # PR_SET_NAME: odd ones renamed
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
main = open("/proc/self/comm").read().strip()
for i, t in enumerate(tids):
    name = open("/proc/self/task/%d/comm" % t).read().strip()
    expect(name == ("worker-%d" % i if i % 2 else main), "thread %d is named %r" % (i, name))
"#,
    );
    let (a, b) = rt.roots();
    let ids = |p: &cr_image::model::Process| {
        p.threads
            .iter()
            .map(|t| (t.tid, t.rseq.is_some(), t.xstate.len(), t.comm.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(ids(a), ids(b));
    assert_eq!(a.threads.len(), 5);
    assert_eq!(a.threads[2].comm, "worker-1");
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

/// CPU affinity per thread (what taskset, Open MPI's rank binding or
/// pthread_setaffinity_np set): the main thread bound to the last CPU, a
/// worker to the first, a second worker left unbound. Needs two CPUs.
#[test]
fn cpu_affinity_round_trip() {
    let rt = round_trip(
        "affinity",
        r#"
import threading
cpus = sorted(os.sched_getaffinity(0))
expect(len(cpus) >= 2, "this test needs two CPUs, has %r" % cpus)
os.sched_setaffinity(0, {cpus[-1]})
asked = threading.Event()
bound = threading.Semaphore(0)
answers = {}
def work(name, mask):
    if mask:
        os.sched_setaffinity(0, mask)
    answers[name] = os.sched_getaffinity(0)
    bound.release()
    asked.wait()
    answers[name + " after"] = os.sched_getaffinity(0)
ts = [threading.Thread(target=work, args=("bound", {cpus[0]}), daemon=True),
      threading.Thread(target=work, args=("unbound", set(cpus)), daemon=True)]
for t in ts: t.start()
for t in ts: expect(bound.acquire(timeout=10), "a worker did not bind itself")
"#,
        r#"
expect(os.sched_getaffinity(0) == {cpus[-1]}, "main thread on %r" % os.sched_getaffinity(0))
asked.set()
for t in ts: t.join(10)
expect(answers.get("bound after") == {cpus[0]}, "bound worker on %r" % answers.get("bound after"))
expect(answers.get("unbound after") == set(cpus), "unbound worker on %r" % answers.get("unbound after"))
"#,
    );
    let (a, b) = rt.roots();
    let masks = |p: &cr_image::model::Process| {
        p.threads
            .iter()
            .map(|t| t.affinity.clone())
            .collect::<Vec<_>>()
    };
    let online = cr_sys::sched::online_cpus().unwrap();
    let (first, last) = (online[0], online[online.len() - 1]);
    assert_eq!(masks(a), vec![vec![last], vec![first], vec![]]);
    assert_eq!(masks(a), masks(b));
}

/// An image bound to a CPU this machine does not have online is refused
/// by name, before anything is made.
#[test]
fn affinity_to_an_absent_cpu_is_refused() {
    use cr_image::model::{Process, Thread};
    let thread = |tid: u32, affinity: Vec<u32>| Thread {
        tid,
        ns_tid: tid,
        regs: Default::default(),
        xstate: Vec::new(),
        rseq: None,
        clear_child_tid: 0,
        pdeathsig: 0,
        robust_list: 0,
        robust_list_len: 0,
        affinity,
        sigmask: 0,
        pending: Vec::new(),
        sigaltstack: Default::default(),
        seccomp: Default::default(),
        comm: String::new(),
        timer_slack_ns: 0,
        ioprio: None,
        sched: None,
        cgroups: Vec::new(),
    };
    let procs = [Process {
        pid: 40,
        threads: vec![thread(40, vec![]), thread(41, vec![1, 6, 7])],
        ..Default::default()
    }];
    assert!(super::check_affinity(&procs, &[0, 1, 2, 3, 4, 5, 6, 7]).is_ok());
    let err = super::check_affinity(&procs, &[0, 1, 2, 3]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "thread 41 of process 40 is bound to CPUs 1,6-7, but CPUs 6-7 are not online on this machine (online: 0-3)"
    );
}

/// Timer slack and I/O priority per thread: a worker made before the main
/// thread changed its own keeps the defaults (I/O priority never set), one
/// sets values of its own, one made after keeps what it inherited.
#[test]
fn timer_slack_and_io_priority_per_thread_round_trip() {
    let rt = round_trip(
        "thread-slack-ioprio",
        r#"
import threading
def mine():
    return (libc.prctl(30, 0, 0, 0, 0), libc.syscall(252, 1, 0))  # PR_GET_TIMERSLACK, ioprio_get(self)
asked = threading.Event()
made = threading.Semaphore(0)
answers = {}
def work(name, own):
    if own:
        libc.prctl(29, 123457, 0, 0, 0)            # PR_SET_TIMERSLACK
        libc.syscall(251, 1, 0, 3 << 13)           # ioprio_set(self, idle)
    answers[name] = mine()
    made.release()
    asked.wait()
    answers[name + " after"] = mine()
def start(name, own):
    t = threading.Thread(target=work, args=(name, own), daemon=True)
    t.start()
    expect(made.acquire(timeout=10), "worker %s did not start" % name)
    return t
ts = [start("early", False)]
libc.prctl(29, 61000, 0, 0, 0)
libc.syscall(251, 1, 0, 2 << 13 | 6)              # best-effort 6
ts += [start("own", True), start("late", False)]
main = mine()
expect(answers["early"][1] == 0 and answers["own"] == (123457, 3 << 13), "set up: %r" % answers)
expect(answers["late"] == main == (61000, 2 << 13 | 6), "inherited: %r, main %r" % (answers, main))
"#,
        r#"
expect(mine() == main, "main thread %r, was %r" % (mine(), main))
asked.set()
for t in ts: t.join(10)
for name in ("early", "own", "late"):
    expect(answers.get(name + " after") == answers[name],
           "worker %s: %r, was %r" % (name, answers.get(name + " after"), answers[name]))
"#,
    );
    let (a, b) = rt.roots();
    let own = |p: &cr_image::model::Process| {
        p.threads
            .iter()
            .map(|t| (t.timer_slack_ns, t.ioprio))
            .collect::<Vec<_>>()
    };
    assert_eq!(own(a), own(b));
    assert_eq!(own(a)[1].1, Some(0), "the early worker's I/O priority");
    assert_eq!(
        own(a)[2..],
        [(123457, Some(3 << 13)), (61000, Some(2 << 13 | 6))]
    );
}

/// Scheduling per thread: the main thread SCHED_OTHER nice 0, a worker
/// SCHED_BATCH nice 5, one SCHED_IDLE, one SCHED_OTHER nice 3, one
/// SCHED_FIFO priority 10 with SCHED_RESET_ON_FORK that set nice -4
/// before (kept for when it leaves its policy). Each thread's values are
/// read from inside, by the main thread (by TID) and by the thread
/// itself, after the kill-restore and the checkpoint that continues (both
/// with --verify, which compares them thread by thread).
#[test]
fn scheduling_per_thread_round_trip() {
    let rt = round_trip(
        "thread-sched",
        r#"
import threading
def of(tid):
    return (os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority, os.getpriority(os.PRIO_PROCESS, tid))
asked = threading.Event()
made = threading.Semaphore(0)
tids, answers = {}, {}
def work(name, setup):
    tids[name] = threading.get_native_id()
    setup()
    answers[name] = of(0)
    made.release()
    asked.wait()
    answers[name + " after"] = of(0)
def start(name, setup):
    t = threading.Thread(target=work, args=(name, setup), daemon=True)
    t.start()
    expect(made.acquire(timeout=10), "worker %s did not start" % name)
    return t
def batch():
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0)); os.setpriority(os.PRIO_PROCESS, 0, 5)
def idle():
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
def nice3():
    os.setpriority(os.PRIO_PROCESS, 0, 3)
def fifo():
    os.setpriority(os.PRIO_PROCESS, 0, -4)
    os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(10))
want = {
    "batch": (os.SCHED_BATCH, 0, 5),
    "idle": (os.SCHED_IDLE, 0, 0),
    "nice3": (os.SCHED_OTHER, 0, 3),
    "fifo": (os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, 10, -4),
}
ts = [start(n, f) for n, f in (("batch", batch), ("idle", idle), ("nice3", nice3), ("fifo", fifo))]
main = of(0)
expect(main == (os.SCHED_OTHER, 0, 0), "main thread set up: %r" % (main,))
for n in want:
    expect(answers[n] == want[n], "worker %s set up: %r" % (n, answers[n]))
"#,
        r#"
expect(of(0) == main, "main thread %r, was %r" % (of(0), main))
for n in want:
    expect(of(tids[n]) == want[n], "worker %s seen by TID: %r, was %r" % (n, of(tids[n]), want[n]))
asked.set()
for t in ts: t.join(20)
for n in want:
    expect(answers.get(n + " after") == want[n], "worker %s itself: %r, was %r" % (n, answers.get(n + " after"), want[n]))
"#,
    );
    let (a, b) = rt.roots();
    let sched = |p: &cr_image::model::Process| {
        p.threads
            .iter()
            .map(|t| t.sched.map(|s| (s.policy, s.priority, s.nice)))
            .collect::<Vec<_>>()
    };
    assert_eq!(sched(a), sched(b));
    assert_eq!(
        sched(a),
        [
            Some((0, 0, 0)),
            Some((3, 0, 5)),
            Some((5, 0, 0)),
            Some((0, 0, 3)),
            Some((1 | 0x4000_0000, 10, -4)),
        ]
    );
}
