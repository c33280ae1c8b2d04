//! Round trip of kind "nsfds": fds of namespace files, of the namespaces
//! the program is in and of the checkpointer's; one of a namespace kept by
//! the fd alone is refused.

use crate::kinds::testkit::{refused, round_trip};
use cr_image::model::{FdKind, Process};

/// The namespace fds of `p`: (fd, kind, host).
fn ns_fds(p: &Process) -> Vec<(i32, String, bool)> {
    p.fds
        .iter()
        .filter_map(|f| match &f.kind {
            FdKind::NsFile { ns, host } => Some((f.fd, ns.clone(), *host)),
            _ => None,
        })
        .collect()
}

/// An fd of each namespace the program is in (as zdtm's proc-self keeps
/// /proc/self/ns/net): after the restore each names the namespace of its
/// kind the program is in, and setns(2) takes the network and UTS ones.
#[test]
fn own_namespace_fds_round_trip() {
    let rt = round_trip(
        "nsfds-own",
        r#"
KINDS = ["cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts"]
fds = {k: os.open("/proc/self/ns/" + k, os.O_RDONLY) for k in KINDS}
"#,
        r#"
for k, fd in fds.items():
    got, want = os.readlink("/proc/self/fd/%d" % fd), os.readlink("/proc/self/ns/" + k)
    expect(got == want, "fd %d of the %s namespace: %s, the program is in %s" % (fd, k, got, want))
for k, flag in (("net", 0x40000000), ("uts", 0x04000000)):
    expect(libc.setns(fds[k], flag) == 0, "setns(%s): errno %d" % (k, ctypes.get_errno()))
"#,
    );
    let (a, b) = rt.roots();
    let kinds: Vec<_> = ns_fds(a).into_iter().map(|(_, k, h)| (k, h)).collect();
    assert_eq!(kinds.len(), 8, "{:?}", a.fds);
    assert!(kinds.iter().all(|(_, host)| !host), "{kinds:?}");
    assert_eq!(ns_fds(a), ns_fds(b));
}

/// A program that moved to a UTS namespace of its own (unshare -u, its
/// own host name) keeping an fd of the one it left, the checkpointer's:
/// the restore gives it its own namespace with its name again, and the fd
/// is of the restorer's, whose host name setns(2) through it shows.
#[test]
fn fd_of_the_checkpointers_namespace_round_trip() {
    let rt = round_trip(
        "nsfds-host",
        r#"
host_name = socket.gethostname()
old = os.open("/proc/self/ns/uts", os.O_RDONLY)
assert libc.unshare(0x04000000) == 0, ctypes.get_errno()     # CLONE_NEWUTS
socket.sethostname("nsfds-inner")
"#,
        r#"
expect(socket.gethostname() == "nsfds-inner", "its own host name: %s" % socket.gethostname())
expect(os.readlink("/proc/self/fd/%d" % old) != os.readlink("/proc/self/ns/uts"), "the fd names its own namespace")
expect(libc.setns(old, 0x04000000) == 0, "setns: errno %d" % ctypes.get_errno())
expect(socket.gethostname() == host_name, "the host's name: %s, want %s" % (socket.gethostname(), host_name))
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(ns_fds(a).len(), 1, "{:?}", a.fds);
    assert!(ns_fds(a)[0].2, "of the checkpointer's: {:?}", ns_fds(a));
    assert_eq!(ns_fds(a), ns_fds(b));
}

/// An fd of a network namespace nobody is in (made with unshare -n, left
/// with setns): the fd alone keeps it, the restore cannot make it again.
#[test]
fn fd_of_a_namespace_nobody_is_in_is_refused() {
    refused(
        "nsfds-orphan",
        r#"
home = os.open("/proc/self/ns/net", os.O_RDONLY)
assert libc.unshare(0x40000000) == 0, ctypes.get_errno()     # CLONE_NEWNET
alone = os.open("/proc/self/ns/net", os.O_RDONLY)
assert libc.setns(home, 0x40000000) == 0, ctypes.get_errno()
"#,
        r#"
expect(os.readlink("/proc/self/fd/%d" % alone) != os.readlink("/proc/self/ns/net"), "the namespace of the fd")
"#,
        "which neither the process nor the checkpointer is in",
    );
}
