//! Round trip of kind "aio": a context with completed events, some reaped
//! and two not (wrapping round the ring's end); after the restore the program reaps the pending one, reads
//! again through the same context and destroys it. And the refusal of a
//! ring this build cannot read (its header overwritten by the program).

use crate::kinds::testkit::{round_trip, wait_for};
use cr_image::model::{Process, VmaKind};
use std::time::Duration;

/// The python3 helpers of both tests: the AIO system calls through ctypes.
const AIO_PY: &str = r#"
IOCB = struct.Struct("<QIIHhIQQqQII")     # struct iocb, 64 bytes
EVENT = struct.Struct("<QQqq")            # struct io_event, 32 bytes
def io_setup(n):
    ctx = ctypes.c_ulong(0)
    if libc.syscall(206, n, ctypes.byref(ctx)) != 0:
        raise OSError(ctypes.get_errno(), "io_setup")
    return ctx.value
def io_submit_read(ctx, fd, buf, n, off, tag):
    cb = ctypes.create_string_buffer(IOCB.pack(tag, 0, 0, 0, 0, fd, ctypes.addressof(buf), n, off, 0, 0, 0))
    ptr = ctypes.c_void_p(ctypes.addressof(cb))
    return libc.syscall(209, ctypes.c_ulong(ctx), 1, ctypes.byref(ptr))
def io_getevents(ctx, n):
    evs = ctypes.create_string_buffer(EVENT.size * n)
    ts = ctypes.create_string_buffer(struct.pack("<qq", 5, 0))
    got = libc.syscall(208, ctypes.c_ulong(ctx), n, n, evs, ts)
    return [EVENT.unpack_from(evs.raw, i * EVENT.size) for i in range(max(got, 0))]
def ring(ctx):
    return struct.unpack("<8I", ctypes.string_at(ctx, 32))
"#;

#[test]
fn aio_round_trip() {
    let setup = format!(
        "{AIO_PY}{}",
        r#"
path = os.path.join(DIR, "data")
with open(path, "wb") as f: f.write(bytes(range(256)) * 64)
fd = os.open(path, os.O_RDONLY)
ctx = io_setup(64)
bufs = [ctypes.create_string_buffer(4096) for _ in range(4)]
nr = ring(ctx)[1]
# Round the ring to its last slots, so that what stays in it wraps.
for i in range(nr - 2):
    assert io_submit_read(ctx, fd, bufs[3], 1, 0, 1) == 1
    assert len(io_getevents(ctx, 1)) == 1
for i in range(3):
    assert io_submit_read(ctx, fd, bufs[i], 4096, 4096 * i + i, 100 + i) == 1
# One reaped, two completed and left in the ring (its last slot and its first).
first = io_getevents(ctx, 1)
assert [e[0] for e in first] == [100], first
assert ring(ctx)[2:4] == (nr - 1, 1), ring(ctx)
"#
    );
    let check = r#"
expect(ring(ctx)[1:4] == (nr, nr - 1, 1), "size, head and tail: %r" % (ring(ctx),))
expect(("%x-" % ctx) in open("/proc/self/maps").read(), "the ring at the context's address")
ev = io_getevents(ctx, 2)
expect([(e[0], e[2]) for e in ev] == [(101, 4096), (102, 4096)], "the pending events: %r" % ev)
expect(bufs[2].raw == (bytes(range(256)) * 17)[2:4098], "the data read before")
expect(io_submit_read(ctx, fd, bufs[3], 100, 7, 200) == 1, "a new request: errno %d" % ctypes.get_errno())
ev = io_getevents(ctx, 1)
expect(len(ev) == 1 and ev[0][0] == 200 and ev[0][2] == 100, "the new event: %r" % ev)
expect(bufs[3].raw[:100] == bytes(range(7, 107)), "the data read after")
expect(libc.syscall(207, ctypes.c_ulong(ctx)) == 0, "io_destroy: errno %d" % ctypes.get_errno())
"#;
    let rt = round_trip("aio", &setup, check);
    let ring = |p: &Process| {
        let v = p
            .vmas
            .iter()
            .find(|v| v.kind == VmaKind::Aio)
            .expect("an AIO ring in the image");
        (v.start, v.end, v.aio.clone().expect("its state"))
    };
    let (a, b) = rt.roots();
    let (ra, rb) = (ring(a), ring(b));
    assert_eq!(ra, rb, "the AIO ring changed");
    let state = &ra.2;
    assert_eq!(
        (state.head, state.tail, state.pending()),
        (state.nr - 1, 1, 2)
    );
    assert_eq!(
        &state.events[..8],
        &101u64.to_le_bytes(),
        "the pending event"
    );
}

/// A ring whose header the program overwrote (its magic) is refused by
/// name before anything is saved, and the process runs on, untraced, its
/// context intact.
#[test]
fn aio_ring_unreadable_is_refused_and_the_process_runs_on() {
    let dir = std::env::temp_dir().join(format!("cr-engine-aio-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("errors");
    let program = format!(
        "import ctypes, os, signal, struct, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n{AIO_PY}{}",
        r#"
ctx = io_setup(64)
ctypes.memmove(ctx + 16, struct.pack("<I", 0), 4)   # the ring's magic
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
def answer(name, text):
    open(sys.argv[1] + "/" + name + ".tmp", "w").write(text)
    os.rename(sys.argv[1] + "/" + name + ".tmp", sys.argv[1] + "/" + name)
answer("ready", "ready")
signal.sigwait({signal.SIGUSR1})
ok = libc.syscall(207, ctypes.c_ulong(ctx)) == 0      # io_destroy
answer("verdict", "OK" if ok else "FAIL io_destroy")
"#
    );
    /// The program, killed if the test fails half-way.
    struct Program(std::process::Child);
    impl Drop for Program {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let child = Program(
        std::process::Command::new("python3")
            .args(["-c", &program])
            .arg(&dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).expect("errors file"))
            .spawn()
            .expect("python3"),
    );
    let pid = child.0.id() as i32;
    wait_for(
        "the program",
        pid,
        &dir.join("ready"),
        Duration::from_secs(30),
        &log,
    );
    let img = dir.join("img");
    let err = crate::kinds::testkit::checkpoint_kill(pid, &img)
        .expect_err("a process with an unreadable AIO ring was checkpointed");
    assert!(
        err.contains("AIO context") && err.contains("magic"),
        "{err}"
    );
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(
        status.contains("TracerPid:\t0\n"),
        "left traced after the refusal:\n{status}"
    );
    cr_sys::ptrace::kill(pid, libc::SIGUSR1).unwrap();
    let verdict = wait_for(
        "the verdict",
        pid,
        &dir.join("verdict"),
        Duration::from_secs(30),
        &log,
    );
    drop(child);
    assert_eq!(verdict, "OK", "the program after the refused checkpoint");
    let _ = std::fs::remove_dir_all(&dir);
}
