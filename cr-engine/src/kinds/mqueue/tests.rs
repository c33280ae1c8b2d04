use crate::kinds::testkit::round_trip_with;
use cr_image::model::ObjectKind;

/// A named queue with messages of three priorities, a second description
/// of it (write-only, non-blocking), and an unlinked queue with a message:
/// after the restore every message comes out once, in order, with its
/// priority; the attributes, flags, mode and owner are back. The named
/// queue is removed between checkpoint and restore, as on another node:
/// it is made again from the image.
#[test]
fn posix_message_queues_round_trip() {
    let rt = round_trip_with(
        "mqueue",
        r#"
rt = ctypes.CDLL("librt.so.1", use_errno=True)
class Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("cur", ctypes.c_long), ("pad", ctypes.c_long * 4)]
NAME = ("/cr-test-mq-%d" % os.getpid()).encode()
open(os.path.join(DIR, "name"), "wb").write(NAME)
os.umask(0)  # the restorer's own umask must not apply
a = Attr(0, 6, 100, 0)
q = rt.mq_open(NAME, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o662, ctypes.byref(a))
assert q >= 0, os.strerror(ctypes.get_errno())
os.fchown(q, 4321, 5432)
for m, p in [(b"low-1", 1), (b"high", 9), (b"low-2", 1), (b"", 0), (b"x" * 100, 5)]:
    assert rt.mq_send(q, m, len(m), p) == 0, os.strerror(ctypes.get_errno())
w = rt.mq_open(NAME, os.O_WRONLY | os.O_NONBLOCK)
UNL = ("/cr-test-mq-unl-%d" % os.getpid()).encode()
u = rt.mq_open(UNL, os.O_RDWR | os.O_CREAT, 0o600, ctypes.byref(Attr(0, 2, 16, 0)))
rt.mq_send(u, b"ghost", 5, 3)
rt.mq_unlink(UNL)
"#,
        r#"
buf = ctypes.create_string_buffer(100)
prio = ctypes.c_uint()
got = []
at = Attr()
rt.mq_getattr(q, ctypes.byref(at))
expect((at.maxmsg, at.msgsize, at.cur, at.flags) == (6, 100, 5, 0), "attributes %r" % ((at.maxmsg, at.msgsize, at.cur, at.flags),))
rt.mq_getattr(w, ctypes.byref(at))
expect(at.flags == os.O_NONBLOCK, "second description flags %#x" % at.flags)
expect(fcntl.fcntl(w, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY, "second description is write-only")
st = os.fstat(q)
expect((st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o662, 4321, 5432), "mode and owner %o %d:%d" % (st.st_mode & 0o777, st.st_uid, st.st_gid))
for _ in range(5):
    n = rt.mq_receive(q, buf, 100, ctypes.byref(prio))
    got.append((buf.raw[:n], prio.value))
expect(got == [(b"high", 9), (b"x" * 100, 5), (b"low-1", 1), (b"low-2", 1), (b"", 0)], "messages %r" % got)
expect(rt.mq_send(w, b"after", 5, 2) == 0, "send through the second description")
n = rt.mq_receive(q, buf, 100, ctypes.byref(prio))
expect(buf.raw[:n] == b"after", "message sent after the restore")
n = rt.mq_receive(u, buf, 16, ctypes.byref(prio))
expect((buf.raw[:max(n, 0)], prio.value) == (b"ghost", 3), "unlinked queue's message")
expect(os.fstat(u).st_nlink == 0, "unlinked queue still unlinked")
rt.mq_unlink(NAME)
"#,
        |dir| {
            // As on a node that never had it.
            let name = std::fs::read_to_string(dir.join("name")).expect("the queue's name");
            cr_sys::mqueue::Queue::unlink(&name).expect("mq_unlink of the named queue");
        },
    );
    let queues = |ck: &cr_image::model::Checkpoint| {
        let mut q: Vec<_> = ck
            .objects
            .iter()
            .filter_map(|o| match &o.kind {
                ObjectKind::Mqueue(m) => Some((m.unlinked, m.maxmsg, m.messages.len())),
                _ => None,
            })
            .collect();
        q.sort();
        q
    };
    assert_eq!(queues(&rt.before), vec![(false, 6, 5), (true, 2, 1)]);
    assert_eq!(queues(&rt.after), queues(&rt.before));
}
