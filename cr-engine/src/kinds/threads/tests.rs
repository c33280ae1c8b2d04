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
