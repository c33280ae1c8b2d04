//! Identity: credentials, groups, capabilities, no_new_privs and resource
//! limits survive checkpoint/kill/restore (checked by the workload itself);
//! a caller that is not root cannot restore an image that is not its own;
//! seccomp and POSIX timers are refused rather than lost.

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

fn refused(label: &str, program: &str, args: &[&str], keyword: &str) {
    let h = Harness::new(label);
    let mut wl = h.spawn_program(
        label,
        Path::new(program),
        &args.iter().map(OsStr::new).collect::<Vec<_>>(),
        &[],
    );
    wl.wait_ready();
    let img = h.image_dir("img");
    let out = h.checkpoint(&img, &["--kill"], wl.pid());
    out.assert_error(label, "cr_checkpoint: error: ", &[keyword]);
    assert_running_untraced(wl.pid(), "after a refused checkpoint");
    wl.go_and_expect_ok();
}

#[test]
fn seccomp_filter_is_refused() {
    let script = "import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
# PR_SET_NO_NEW_PRIVS, then SECCOMP_MODE_FILTER with an allow-all filter.
assert libc.prctl(38, 1, 0, 0, 0) == 0
prog = (ctypes.c_uint64 * 1)(0x7fff000000000006)  # BPF_RET|BPF_K, SECCOMP_RET_ALLOW
class Fprog(ctypes.Structure):
    _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_void_p)]
fp = Fprog(1, ctypes.addressof(prog))
assert libc.prctl(22, 2, ctypes.byref(fp), 0, 0) == 0, ctypes.get_errno()
print('READY', flush=True)
while not os.path.exists(os.path.join(sys.argv[1], 'go')):
    time.sleep(0.02)
print('OK', flush=True)
";
    refused(
        "seccomp",
        "/usr/bin/env",
        &["python3", "-c", script],
        "seccomp",
    );
}

#[test]
fn posix_timer_is_refused() {
    let script = "import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
tid = ctypes.c_int(0)
assert libc.timer_create(1, None, ctypes.byref(tid)) == 0, ctypes.get_errno()
print('READY', flush=True)
while not os.path.exists(os.path.join(sys.argv[1], 'go')):
    time.sleep(0.02)
print('OK', flush=True)
";
    refused(
        "posix-timer",
        "/usr/bin/env",
        &["python3", "-c", script],
        "posix timer",
    );
}
