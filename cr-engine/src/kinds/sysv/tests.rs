//! Round trip of kind "sysv": a process with a shared memory segment
//! attached (one attach split in two mappings by mprotect), a segment
//! removed while attached, a semaphore set and a message queue keeps them
//! all, with their ids: the memory at the same addresses, the values, the
//! messages in order with their types, and `shmdt` still detaches both
//! pieces of the first attach.

use crate::kinds::testkit::round_trip;

const SETUP: &str = r#"
PAGE = 4096
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
IPC_CREAT, IPC_RMID, IPC_STAT, GETALL, GETPID, IPC_NOWAIT = 0o1000, 0, 2, 13, 11, 0o4000
def shmstat(i):
    b = ctypes.create_string_buffer(112)
    assert libc.shmctl(i, IPC_STAT, b) == 0, ctypes.get_errno()
    key, mode = struct.unpack_from("i", b, 0)[0], struct.unpack_from("H", b, 20)[0]
    return key, mode, struct.unpack_from("Q", b, 48)[0], struct.unpack_from("Q", b, 88)[0]
KEY = 0x7c000000 | (os.getpid() & 0xffffff)
a = libc.shmget(KEY, 3 * PAGE + 100, IPC_CREAT | 0o640)
assert a >= 0, ctypes.get_errno()
A = libc.shmat(a, None, 0)
for i in range(4):
    ctypes.memset(A + i * PAGE, 0x41 + i, 100)
assert libc.mprotect(ctypes.c_void_p(A + 3 * PAGE), PAGE, 1) == 0   # last page read-only
b = libc.shmget(0, PAGE, IPC_CREAT | 0o600)
B = libc.shmat(b, None, 0)
ctypes.memmove(B, b"removed but attached", 20)
assert libc.shmctl(b, IPC_RMID, None) == 0
s = libc.semget(KEY, 3, IPC_CREAT | 0o600)
vals = (ctypes.c_ushort * 3)(5, 0, 900)
assert libc.semctl(s, 0, 17, vals) == 0                              # SETALL
class sembuf(ctypes.Structure): _fields_ = [("num", ctypes.c_ushort), ("op", ctypes.c_short), ("flg", ctypes.c_short)]
assert libc.semop(s, ctypes.byref(sembuf(0, -2, 0)), 1) == 0         # 5 -> 3, our pid
q = libc.msgget(KEY, IPC_CREAT | 0o600)
class msg(ctypes.Structure): _fields_ = [("mtype", ctypes.c_long), ("text", ctypes.c_char * 64)]
SENT = [(7, b"first"), (2, b""), (7, b"x" * 60)]
for t, body in SENT:
    assert libc.msgsnd(q, ctypes.byref(msg(t, body)), len(body), 0) == 0
def maps():
    return open("/proc/self/maps").read()
"#;

const CHECK: &str = r#"
key, mode, size, nattch = shmstat(a)
expect((key, mode & 0o777, size, nattch) == (KEY, 0o640, 3 * PAGE + 100, 2), "segment a: %r" % ((key, mode, size, nattch),))
expect(all(ctypes.string_at(A + i * PAGE, 100) == bytes([0x41 + i]) * 100 for i in range(4)), "segment a's memory")
expect(ctypes.string_at(B, 20) == b"removed but attached", "segment b's memory")
expect(shmstat(b)[1] & 0o1000 != 0, "segment b is still removed (SHM_DEST)")
got = (ctypes.c_ushort * 3)()
libc.semctl(s, 0, GETALL, got)
expect(list(got) == [3, 0, 900], "semaphore values %r" % list(got))
expect(libc.semctl(s, 0, GETPID) == os.getpid(), "the last operation on semaphore 0 is ours")
rec = []
for _ in SENT:
    m = msg()
    n = libc.msgrcv(q, ctypes.byref(m), 64, 0, IPC_NOWAIT)
    rec.append((m.mtype, m.text[:n] if n >= 0 else None))
expect(rec == SENT, "messages %r" % rec)
expect(libc.shmdt(ctypes.c_void_p(A)) == 0, "shmdt of segment a")
expect(("%x-" % A) not in maps() and ("%x-" % (A + 3 * PAGE)) not in maps(), "shmdt detached both pieces")
for f, i in [(libc.shmctl, a), (libc.msgctl, q)]:
    f(i, IPC_RMID, None)
libc.semctl(s, 0, IPC_RMID)
libc.shmdt(ctypes.c_void_p(B))
"#;

#[test]
fn sysv_ipc_round_trip() {
    let rt = round_trip("sysv", SETUP, CHECK);
    let (a, b) = (
        rt.before.sysv.as_ref().expect("System V objects saved"),
        rt.after.sysv.as_ref().expect("and saved again"),
    );
    let ids = |s: &cr_image::model::SysvIpc| {
        (
            s.shm
                .iter()
                .map(|g| (g.id, g.perm.key, g.size, g.removed))
                .collect::<Vec<_>>(),
            s.sem
                .iter()
                .map(|m| (m.id, m.values.clone()))
                .collect::<Vec<_>>(),
            s.msg
                .iter()
                .map(|q| (q.id, q.messages.clone()))
                .collect::<Vec<_>>(),
        )
    };
    assert_eq!(ids(a), ids(b), "the same objects, ids and state");
    assert!(!a.own_namespace);
    assert_eq!(a.shm.len(), 2, "both segments");
    assert!(
        a.shm.iter().any(|g| g.removed),
        "one removed while attached"
    );
    let attaches = |p: &cr_image::model::Process| {
        p.vmas
            .iter()
            .filter(|v| v.kind == cr_image::model::VmaKind::SysvShm)
            .map(|v| (v.start, v.end, v.prot, v.inode))
            .collect::<Vec<_>>()
    };
    let (pa, pb) = rt.roots();
    assert_eq!(attaches(pa), attaches(pb), "the same attaches");
    assert_eq!(attaches(pa).len(), 3, "two pieces of one attach, and one");
}
