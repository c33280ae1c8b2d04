//! Round trip of kind "seccomp": a process whose threads run under a filter
//! chain (one filter shared, one installed by a thread alone) keeps them:
//! the filtered calls still fail the way the filters say.

use crate::kinds::testkit::round_trip;
use cr_image::model::SeccompMode;

/// A filter: `uname` fails with errno `e`, everything else is allowed.
fn filter_uname(e: u32) -> String {
    format!(
        r#"
    prog = [
        (0x20, 0, 0, 0),                       # ld [0] (nr)
        (0x15, 0, 1, 63),                      # jeq #uname
        (0x06, 0, 0, 0x00050000 | {e}),        # ret ERRNO(e)
        (0x06, 0, 0, 0x7fff0000),              # ret ALLOW
    ]"#
    )
}

/// Python: `install(prog)` puts filter `prog` (a list of BPF
/// instructions) on the calling thread; `uname_errno()` is the errno
/// uname answers it.
const INSTALL_PY: &str = r#"
class sock_filter(ctypes.Structure): _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]
class sock_fprog(ctypes.Structure): _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(sock_filter))]
def install(prog):
    arr = (sock_filter * len(prog))(*[sock_filter(*i) for i in prog])
    fp = sock_fprog(len(prog), arr)
    assert libc.syscall(317, 1, 0, ctypes.byref(fp)) == 0, ctypes.get_errno()   # seccomp(SET_MODE_FILTER)
def uname_errno():
    libc.syscall(63, ctypes.create_string_buffer(400)); return ctypes.get_errno()
"#;

/// The seccomp state of each thread of `p`.
fn chains(p: &cr_image::model::Process) -> Vec<cr_image::model::ThreadSeccomp> {
    p.threads.iter().map(|t| t.seccomp.clone()).collect()
}

#[test]
fn seccomp_filters_round_trip() {
    let install = INSTALL_PY;
    let setup = format!(
        "{install}libc.prctl(38, 1, 0, 0, 0)   # no_new_privs\ndef first():{}\n    install(prog)\nfirst()\nimport threading\nseen = []\nagain = threading.Event()\ndef second():{}\n    install(prog)\n    seen.append(uname_errno())\n    again.wait()\n    seen.append(uname_errno())\n    while True: time.sleep(1)\nthreading.Thread(target=second, daemon=True).start()\nwhile not seen: time.sleep(0.01)\n",
        filter_uname(13), filter_uname(22)
    );
    let rt = round_trip(
        "seccomp",
        &setup,
        r#"
expect(uname_errno() == 13, "the main thread's filter (EACCES)")
again.set()
while len(seen) < 2: time.sleep(0.01)
expect(seen == [22, 22], "the thread's own filter is the newest (EINVAL): %r" % seen)
expect(open("/proc/self/status").read().count("Seccomp:\t2") == 1, "filter mode")
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(a.seccomp_filters, b.seccomp_filters);
    assert_eq!(chains(a), chains(b));
    assert_eq!(
        a.seccomp_filters.len(),
        2,
        "one filter shared, one the thread's own"
    );
    assert!(a
        .threads
        .iter()
        .all(|t| t.seccomp.mode == SeccompMode::Filter));
}

/// A thread whose filter makes `prctl` fail with an errno of its own (the
/// checkpoint asks each thread its tid address with `prctl`) is captured
/// and restored all the same (the filters are suspended while traced),
/// and its filter still answers the program the same way afterwards.
#[test]
fn filter_refusing_the_calls_a_checkpoint_injects() {
    let install = r#"
class sock_filter(ctypes.Structure): _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]
class sock_fprog(ctypes.Structure): _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(sock_filter))]
prog = [
    (0x20, 0, 0, 0),                       # ld [0] (nr)
    (0x15, 0, 1, 157),                     # jeq #prctl
    (0x06, 0, 0, 0x00050000 | 1234),       # ret ERRNO(1234)
    (0x06, 0, 0, 0x7fff0000),              # ret ALLOW
]
def install():
    arr = (sock_filter * len(prog))(*[sock_filter(*i) for i in prog])
    fp = sock_fprog(len(prog), arr)
    assert libc.syscall(317, 1, 0, ctypes.byref(fp)) == 0, ctypes.get_errno()   # seccomp(SET_MODE_FILTER)
def prctl_errno():
    r = libc.prctl(7, 0, 0, 0, 0)   # PR_GET_KEEPCAPS
    return ctypes.get_errno() if r < 0 else 0
libc.prctl(38, 1, 0, 0, 0)   # no_new_privs
import threading
seen = []
again = threading.Event()
def filtered():
    install()
    seen.append(prctl_errno())
    again.wait()
    seen.append(prctl_errno())
    while True: time.sleep(1)
threading.Thread(target=filtered, daemon=True).start()
while not seen: time.sleep(0.01)
"#;
    round_trip(
        "seccomp-prctl",
        install,
        r#"
expect(prctl_errno() == 0, "the main thread has no filter: errno %d" % prctl_errno())
again.set()
while len(seen) < 2: time.sleep(0.01)
expect(seen == [1234, 1234], "the thread's filter still refuses prctl: %r" % seen)
"#,
    );
}

/// Filters installed as root without no_new_privs (with CAP_SYS_ADMIN),
/// one by the main thread, one by another thread alone, then root
/// dropped (setuid to nobody: no capability left), as zdtm
/// seccomp_filter does: a thread cannot install them with its saved
/// credentials, so the restore installs them before those (the stubs'
/// filters suspended meanwhile). The restored program is nobody, without
/// capabilities nor no_new_privs, and each thread's filters answer as
/// before.
#[test]
fn filters_installed_as_root_before_setuid_round_trip() {
    let setup = format!(
        r#"{INSTALL_PY}
def status(key):
    return [l.split(":", 1)[1].strip() for l in open("/proc/thread-self/status") if l.startswith(key + ":")][0]
os.chmod(DIR, 0o777)                        # the verdict is written as nobody
def first():{}
    install(prog)
first()
import threading
seen = []
installed = threading.Event()
again = threading.Event()
def second():{}
    install(prog)
    installed.set()
    again.wait()
    seen.append((uname_errno(), status("Seccomp"), status("CapEff")))
    while True: time.sleep(1)
threading.Thread(target=second, daemon=True).start()
installed.wait()
os.setuid(65534)                            # every thread: root dropped
expect(status("NoNewPrivs") == "0" and status("CapEff") == "0000000000000000", "setup: the credentials")
"#,
        filter_uname(13),
        filter_uname(22)
    );
    let rt = round_trip(
        "seccomp-as-root",
        &setup,
        r#"
expect(os.getuid() == 65534 and os.geteuid() == 65534, "uid %d euid %d" % (os.getuid(), os.geteuid()))
expect(status("CapEff") == "0000000000000000", "capabilities %s" % status("CapEff"))
expect(status("NoNewPrivs") == "0", "no_new_privs set")
expect(status("Seccomp") == "2", "the main thread's mode %s" % status("Seccomp"))
expect(uname_errno() == 13, "the main thread's filter (EACCES): %d" % uname_errno())
again.set()
while not seen: time.sleep(0.01)
expect(seen == [(22, "2", "0000000000000000")], "the thread's own filter is the newest (EINVAL): %r" % seen)
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(a.identity.creds.cap_eff, 0);
    assert!(!a.identity.creds.no_new_privs);
    assert_eq!(a.seccomp_filters, b.seccomp_filters);
    assert_eq!(chains(a), chains(b));
    assert_eq!(a.seccomp_filters.len(), 2);
}

/// A child (not the root: its last steps may run on another tracer
/// thread) under a filter that kills the process at `pause`: restored,
/// it still answers its parent through a pipe, in filter mode. Before the
/// fix its stub was parked in `pause` after its filter went on, and the
/// filter killed it once let go (as strict mode did: zdtm seccomp_strict).
#[test]
fn child_under_a_filter_killing_pause_round_trip() {
    let setup = format!(
        "{INSTALL_PY}{}",
        r#"
r1, w1 = os.pipe(); r2, w2 = os.pipe()
child = os.fork()
if child == 0:
    libc.prctl(1, 9, 0, 0, 0)                        # PR_SET_PDEATHSIG: SIGKILL
    libc.prctl(38, 1, 0, 0, 0)                       # no_new_privs
    install([
        (0x20, 0, 0, 0),                             # ld [0] (nr)
        (0x15, 0, 1, 34),                            # jeq #pause
        (0x06, 0, 0, 0x80000000),                    # ret KILL_PROCESS
        (0x06, 0, 0, 0x7fff0000),                    # ret ALLOW
    ])
    while True:
        b = os.read(r1, 1)
        os.write(w2, b"k" if b == b"?" else b"x")
os.write(w1, b"?")
expect(os.read(r2, 1) == b"k", "setup: the child answers")
"#
    );
    let rt = round_trip(
        "seccomp-pause",
        &setup,
        r#"
import select
expect(os.waitpid(child, os.WNOHANG) == (0, 0), "the child died")
os.write(w1, b"?")
ready = select.select([r2], [], [], 10)[0]
expect(bool(ready) and os.read(r2, 1) == b"k", "the child under its filter does not answer")
expect("Seccomp:\t2" in open("/proc/%d/status" % child).read(), "the child's filter mode")
"#,
    );
    assert_eq!(rt.before.processes.len(), 2);
    let child = &rt.after.processes[1];
    assert!(child
        .threads
        .iter()
        .all(|t| t.seccomp.mode == SeccompMode::Filter));
}
