//! Identity: credentials, groups, capabilities, no_new_privs and resource
//! limits survive checkpoint/kill/restore (checked by the workload itself);
//! a caller that is not root cannot restore an image that is not its own;
//! seccomp filters and POSIX timers survive too.

use cr_tests::*;
use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

fn setpriv_workload(h: &Harness, label: &str, setpriv_args: &[&str]) -> Workload {
    let wl = workload_path("wl_ident");
    let mut pre: Vec<&OsStr> = setpriv_args.iter().map(OsStr::new).collect();
    pre.push(wl.as_os_str());
    h.spawn_program(label, Path::new("/usr/bin/setpriv"), &pre, &[])
}

fn roundtrip(label: &str, setpriv_args: &[&str]) {
    let h = Harness::new(label);
    let mut wl = setpriv_workload(&h, label, setpriv_args);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let mut r = h.restore_bg(&img, pid);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, label);
}

#[test]
fn unprivileged_user_with_groups_and_no_new_privs() {
    roundtrip(
        "ident-nobody",
        &[
            "--reuid=65534",
            "--regid=65534",
            "--groups=100,200",
            "--no-new-privs",
        ],
    );
}

#[test]
fn root_with_reduced_bounding_set_and_ambient_capability() {
    roundtrip(
        "ident-caps",
        &[
            "--bounding-set=-all,+net_bind_service,+setpcap",
            "--inh-caps=+net_bind_service",
            "--ambient-caps=+net_bind_service",
        ],
    );
}

#[test]
fn non_root_caller_cannot_restore_a_root_image() {
    let h = Harness::new("ident-notyours");
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    let pid = wl.pid();
    let open = h.dir.join("open");
    std::fs::create_dir(&open).expect("mkdir open");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let img = open.join("img");
    checkpoint_kill(&h, &mut wl, &img);
    for e in std::fs::read_dir(&img).expect("image dir").flatten() {
        std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(0o644)).expect("chmod");
    }
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let exe = open.join("cr_restart");
    std::fs::copy(tool_path("cr_restart"), &exe).expect("copy cr_restart");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let run = RunOpts {
        as_user: Some((65534, 65534)),
        exe: Some(exe),
        ..Default::default()
    };
    let out = h.run_tool("cr_restart", &[img.as_os_str()], &run);
    out.assert_error(
        "restore of a root image as nobody",
        "cr_restart: error: ",
        &["only root or that user"],
    );
    assert!(
        !is_alive(pid),
        "a process was restored for a caller who does not own the image"
    );
}

fn survives(label: &str, script: &str) {
    let h = Harness::new(label);
    let mut wl = h.spawn_program(
        label,
        Path::new("/usr/bin/env"),
        &["python3", "-c", script].map(OsStr::new),
        &[],
    );
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let mut r = h.restore_bg(&img, pid);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, label);
}

#[test]
fn seccomp_filter_survives() {
    // The filter denies getppid with EPERM (errno 1) and allows the rest;
    // after restore the process checks its mode and that the filter still
    // acts.
    let script = "import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0
# ld [nr]; jeq getppid(110) ? 0 : 1; ret ERRNO|1; ret ALLOW
ins = [(0x20, 0, 0, 0), (0x15, 0, 1, 110), (0x06, 0, 0, 0x00050001), (0x06, 0, 0, 0x7fff0000)]
prog = (ctypes.c_uint64 * len(ins))(*[c | (jt << 16) | (jf << 24) | (k << 32) for c, jt, jf, k in ins])
class Fprog(ctypes.Structure):
    _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_void_p)]
fp = Fprog(len(ins), ctypes.addressof(prog))
assert libc.prctl(22, 2, ctypes.byref(fp), 0, 0) == 0, ctypes.get_errno()
def check(when):
    mode = [l for l in open('/proc/self/status') if l.startswith('Seccomp:')][0].split()[1]
    if mode != '2':
        print('FAIL', when, 'seccomp mode', mode, flush=True); sys.exit(1)
    r = libc.syscall(110)
    if r != -1 or ctypes.get_errno() != 1:
        print('FAIL', when, 'getppid not filtered', r, ctypes.get_errno(), flush=True); sys.exit(1)
check('before')
print('READY', flush=True)
while not os.path.exists(os.path.join(sys.argv[1], 'go')):
    time.sleep(0.02)
check('after')
print('OK', flush=True)
";
    survives("seccomp", script);
}

#[test]
fn seccomp_filter_shared_by_threads_takes_a_tsync_filter_after_restore() {
    // A filter (getppid -> EPERM) goes on before a second thread is made,
    // so both threads share it. After restore the main thread installs a
    // second filter (getpgrp -> ENOENT) with SECCOMP_FILTER_FLAG_TSYNC: the
    // kernel accepts that only if the threads still share the first one,
    // and then the other thread must see both filters act.
    let script = "import ctypes, os, sys, time, threading
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0
class Fprog(ctypes.Structure):
    _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_void_p)]
keep = []
def fprog(nr, errno):
    # ld [nr]; jeq nr ? 0 : 1; ret ERRNO|errno; ret ALLOW
    ins = [(0x20, 0, 0, 0), (0x15, 0, 1, nr), (0x06, 0, 0, 0x00050000 | errno), (0x06, 0, 0, 0x7fff0000)]
    prog = (ctypes.c_uint64 * len(ins))(*[c | (jt << 16) | (jf << 24) | (k << 32) for c, jt, jf, k in ins])
    fp = Fprog(len(ins), ctypes.addressof(prog))
    keep.append((prog, fp))
    return ctypes.byref(fp)
assert libc.syscall(317, 1, 0, fprog(110, 1)) == 0, ctypes.get_errno()
go = threading.Event()
seen = {}
def denied(nr):
    r = libc.syscall(nr)
    return ctypes.get_errno() if r == -1 else 0
def other():
    go.wait()
    seen['getppid'] = denied(110)
    seen['getpgrp'] = denied(111)
t = threading.Thread(target=other)
t.start()
print('READY', flush=True)
while not os.path.exists(os.path.join(sys.argv[1], 'go')):
    time.sleep(0.02)
r = libc.syscall(317, 1, 1, fprog(111, 2))
if r != 0:
    print('FAIL TSYNC seccomp returned', r, ctypes.get_errno(), flush=True); sys.exit(1)
go.set()
t.join()
if seen != {'getppid': 1, 'getpgrp': 2}:
    print('FAIL other thread sees', seen, flush=True); sys.exit(1)
print('OK', flush=True)
";
    survives("seccomp-tsync", script);
}

#[test]
fn posix_timer_survives() {
    // An armed interval timer keeps its id and delivers its signal after
    // restore.
    let script = "import ctypes, os, sys, time, signal
libc = ctypes.CDLL(None, use_errno=True)
hits = [0]
signal.signal(signal.SIGUSR2, lambda s, f: hits.__setitem__(0, hits[0] + 1))
class Sigev(ctypes.Structure):
    _fields_ = [('value', ctypes.c_void_p), ('signo', ctypes.c_int), ('notify', ctypes.c_int), ('pad', ctypes.c_byte * 48)]
class Its(ctypes.Structure):
    _fields_ = [('isec', ctypes.c_long), ('insec', ctypes.c_long), ('vsec', ctypes.c_long), ('vnsec', ctypes.c_long)]
ev = Sigev(None, signal.SIGUSR2, 0)
tid = ctypes.c_int(0)
assert libc.timer_create(1, ctypes.byref(ev), ctypes.byref(tid)) == 0, ctypes.get_errno()
its = Its(0, 20000000, 0, 20000000)
assert libc.timer_settime(tid, 0, ctypes.byref(its), None) == 0
print('READY', flush=True)
while not os.path.exists(os.path.join(sys.argv[1], 'go')):
    time.sleep(0.02)
seen = hits[0]
deadline = time.time() + 10
while hits[0] < seen + 5 and time.time() < deadline:
    time.sleep(0.02)
cur = Its()
if libc.timer_gettime(tid, ctypes.byref(cur)) != 0:
    print('FAIL timer id lost', ctypes.get_errno(), flush=True); sys.exit(1)
if cur.insec != 20000000:
    print('FAIL interval', cur.isec, cur.insec, flush=True); sys.exit(1)
if hits[0] < seen + 5:
    print('FAIL timer stopped firing', hits[0], seen, flush=True); sys.exit(1)
# Disarm: Python puts SIGUSR2 back to its default action while exiting.
libc.timer_delete(tid)
print('OK', flush=True)
";
    survives("posix-timer", script);
}
