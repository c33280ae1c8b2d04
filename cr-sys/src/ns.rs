//! Namespaces: the namespaces of another process (`/proc/PID/ns/*`),
//! running code in another process's IPC or UTS namespace (from a thread
//! of our own: `setns` of those changes only the calling thread), the host
//! names of a UTS namespace, and the mounts a `cr_run` job gets in its own
//! mount namespace: a fresh /proc for its PID namespace, a private tmpfs on
//! /dev/shm and a devpts instance of its own (its pseudo-terminals).

use crate::error::{io_err, NixResult, Result, SysError};
use std::os::fd::OwnedFd;

/// The namespace `kind` ("ipc", "mnt", "pid"...) of process `pid`, as its
/// link reads ("ipc:[4026531839]").
pub fn id(pid: i32, kind: &str) -> Result<String> {
    crate::proc::read_link(&format!("/proc/{pid}/ns/{kind}"))
}

/// Whether process `pid` is in another namespace `kind` than the calling
/// thread (a thread may have joined another network, IPC or UTS
/// namespace than its process's main thread).
pub fn differs(pid: i32, kind: &str) -> Result<bool> {
    Ok(id(pid, kind)? != own_id(kind)?)
}

/// The namespace `kind` of the calling thread, as its link reads.
pub fn own_id(kind: &str) -> Result<String> {
    crate::proc::read_link(&format!("/proc/thread-self/ns/{kind}"))
}

/// An fd of the calling thread's namespace `kind`.
pub fn open_own(kind: &str) -> Result<OwnedFd> {
    open_path(&format!("/proc/thread-self/ns/{kind}"))
}

/// An fd of the namespace `kind` of process `pid` (keeps it alive).
pub fn open(pid: i32, kind: &str) -> Result<OwnedFd> {
    open_path(&format!("/proc/{pid}/ns/{kind}"))
}

fn open_path(path: &str) -> Result<OwnedFd> {
    std::fs::File::open(path)
        .map(OwnedFd::from)
        .map_err(io_err(path))
}

/// Run `f` on a thread of its own in the IPC namespace `ns` (None: ours),
/// where `/proc/sysvipc`, the IPC sysctls and every System V call see
/// that namespace. Needs CAP_SYS_ADMIN for another namespace.
pub fn in_ipc_ns<R: Send, E: Send + From<SysError>>(
    ns: Option<&OwnedFd>,
    f: impl FnOnce() -> Result<R, E> + Send,
) -> Result<R, E> {
    in_thread_ns(ns, nix::sched::CloneFlags::CLONE_NEWIPC, "IPC", f)
}

/// Run `f` on a thread of its own in the network namespace `ns` (None:
/// ours), where sock_diag queries and interface names are that
/// namespace's.
pub fn in_net_ns<R: Send, E: Send + From<SysError>>(
    ns: Option<&OwnedFd>,
    f: impl FnOnce() -> Result<R, E> + Send,
) -> Result<R, E> {
    in_thread_ns(ns, nix::sched::CloneFlags::CLONE_NEWNET, "network", f)
}

/// The control groups of process `pid` as it sees them itself: paths
/// relative to the root of its own cgroup namespace (read from a thread
/// that joined it: the kernel shows /proc/PID/cgroup relative to the
/// reader's namespace). Same shape as [`crate::proc::cgroups`].
pub fn cgroups_seen_by(pid: i32) -> Result<Vec<(String, String)>> {
    let ns = open(pid, "cgroup")?;
    in_thread_ns(
        Some(&ns),
        nix::sched::CloneFlags::CLONE_NEWCGROUP,
        "cgroup",
        || crate::proc::cgroups(pid),
    )
}

/// Run `f` on a thread of its own that joined the namespace `ns` (None:
/// ours) of kind `flag` (one a thread may join alone: IPC, UTS, network, cgroup).
fn in_thread_ns<R: Send, E: Send + From<SysError>>(
    ns: Option<&OwnedFd>,
    flag: nix::sched::CloneFlags,
    what: &str,
    f: impl FnOnce() -> Result<R, E> + Send,
) -> Result<R, E> {
    std::thread::scope(|s| {
        s.spawn(|| {
            if let Some(fd) = ns {
                nix::sched::setns(fd, flag).or_sys(|| format!("setns({what} namespace)"))?;
            }
            f()
        })
        .join()
        .unwrap_or_else(|_| {
            Err(SysError::Command {
                what: format!("a thread working in an {what} namespace"),
                detail: "it panicked".into(),
            }
            .into())
        })
    })
}

/// Move the calling thread (and the processes it starts from now on) into
/// a new network namespace of its own, with nothing but a loopback device
/// (down: see `ip link set lo up`).
pub fn unshare_net() -> Result<()> {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
        .or_sys(|| "unshare(network namespace)".into())
}

/// Bring the loopback device of the calling thread's network namespace up
/// (a new namespace has it down; `ip link set lo up`).
pub fn loopback_up() -> Result<()> {
    use std::os::fd::AsRawFd;
    let sock = nix::sys::socket::socket(
        nix::sys::socket::AddressFamily::Inet,
        nix::sys::socket::SockType::Datagram,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        None,
    )
    .or_sys(|| "socket for SIOCSIFFLAGS".into())?;
    // SAFETY: ifreq is plain old data; all zeros is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the name and writes the flags of `req`,
    // which lives for the call.
    let got = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) };
    if got < 0 {
        return Err(nix::errno::Errno::last()).or_sys(|| "SIOCGIFFLAGS of lo".into());
    }
    // SAFETY: the kernel filled the flags member of the union just above.
    unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: as above; SIOCSIFFLAGS only reads `req`.
    let set = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) };
    if set < 0 {
        return Err(nix::errno::Errno::last()).or_sys(|| "SIOCSIFFLAGS of lo (up)".into());
    }
    Ok(())
}

/// The network devices of process `pid`'s network namespace, each with
/// whether it is up, by name.
pub fn net_devices(pid: i32) -> Result<Vec<(String, bool)>> {
    let ns = open(pid, "net")?;
    in_net_ns(Some(&ns), || {
        let mut out: Vec<(String, bool)> = Vec::new();
        for a in nix::ifaddrs::getifaddrs().or_sys(|| "getifaddrs".into())? {
            if !out.iter().any(|(n, _)| *n == a.interface_name) {
                let up = a.flags.contains(nix::net::if_::InterfaceFlags::IFF_UP);
                out.push((a.interface_name.clone(), up));
            }
        }
        out.sort();
        Ok::<_, SysError>(out)
    })
}

/// The host name and NIS domain name of the UTS namespace of process `pid`
/// (read by a thread of ours that joins it: /proc/sys/kernel/hostname shows
/// the reader's namespace, whoever's /proc it is).
pub fn uts_names(pid: i32) -> Result<(String, String)> {
    let fd = open(pid, "uts")?;
    in_thread_ns(
        Some(&fd),
        nix::sched::CloneFlags::CLONE_NEWUTS,
        "UTS",
        || {
            let read = |name: &str| {
                crate::proc::read_string(&format!("/proc/sys/kernel/{name}"))
                    .map(|v| v.trim_end_matches('\n').to_string())
            };
            Ok((read("hostname")?, read("domainname")?))
        },
    )
}

/// One mount of a job's own mount namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub source: &'static str,
    pub target: &'static str,
    pub fstype: &'static str,
    pub flags: u64,
    /// Mount options (the tmpfs root's mode).
    pub data: String,
}

/// Where a job's private tmpfs goes.
pub const DEV_SHM: &str = "/dev/shm";

/// Where a job's own devpts instance goes, and the multiplexer bound over
/// /dev/ptmx (so that openpt(3) allocates from the job's instance).
pub const DEV_PTS: &str = "/dev/pts";
pub const DEV_PTMX: &str = "/dev/ptmx";

/// The options of a job's devpts: a new instance (its own pty numbers,
/// from 0), its ptmx usable by all, slaves as the system's (group tty).
const DEVPTS_OPTIONS: &str = "newinstance,ptmxmode=0666,mode=0620,gid=5";

/// The mounts that make a job's mount namespace its own, in order: its
/// mounts stop propagating to the host (and back), then a fresh /proc
/// (which must be mounted by a process of the job's PID namespace to show
/// it), then a tmpfs on /dev/shm with root mode `shm_mode`, if wanted, then
/// a devpts instance of its own on /dev/pts with its ptmx bound over
/// /dev/ptmx, if `devpts`: the pseudo-terminals the job opens (Open MPI's
/// daemons give every rank one) are numbered in the job alone, so that a
/// restore anywhere gets the same numbers again.
pub fn job_mounts(proc: bool, shm_mode: Option<u32>, devpts: bool) -> Vec<Mount> {
    let mut v = vec![Mount {
        source: "none",
        target: "/",
        fstype: "",
        flags: libc::MS_REC | libc::MS_PRIVATE,
        data: String::new(),
    }];
    if proc {
        v.push(Mount {
            source: "proc",
            target: "/proc",
            fstype: "proc",
            flags: libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            data: String::new(),
        });
    }
    if let Some(mode) = shm_mode {
        v.push(Mount {
            source: "tmpfs",
            target: DEV_SHM,
            fstype: "tmpfs",
            flags: libc::MS_NOSUID | libc::MS_NODEV,
            data: format!("mode={:o}", mode & 0o7777),
        });
    }
    if devpts {
        v.push(Mount {
            source: "devpts",
            target: DEV_PTS,
            fstype: "devpts",
            flags: libc::MS_NOSUID | libc::MS_NOEXEC,
            data: DEVPTS_OPTIONS.into(),
        });
        v.push(Mount {
            source: "/dev/pts/ptmx",
            target: DEV_PTMX,
            fstype: "",
            flags: libc::MS_BIND,
            data: String::new(),
        });
    }
    v
}

/// Mount `m` in the caller's mount namespace.
pub fn mount(m: &Mount) -> Result<()> {
    use nix::mount::MsFlags;
    let fstype = (!m.fstype.is_empty()).then_some(m.fstype);
    let data = (!m.data.is_empty()).then_some(m.data.as_str());
    nix::mount::mount(
        Some(m.source),
        m.target,
        fstype,
        MsFlags::from_bits_retain(m.flags),
        data,
    )
    .or_sys(|| format!("mounting {} on {}", m.source, m.target))
}

/// Put the caller in mount, IPC and UTS namespaces of its own (cr_run,
/// before it starts the job) and make the mounts a job gets there, but for
/// /proc ([`mount_proc_in_child`]): its mounts stop propagating, a private
/// tmpfs covers /dev/shm and a devpts instance of its own /dev/pts (where
/// the host has them). The UTS namespace starts with the node's host name,
/// which the job keeps wherever it is restored.
pub fn unshare_job_namespaces() -> Result<()> {
    use nix::sched::CloneFlags;
    nix::sched::unshare(
        CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWIPC | CloneFlags::CLONE_NEWUTS,
    )
    .or_sys(|| "unshare(mount, IPC and UTS namespaces)".into())?;
    let shm = std::path::Path::new(DEV_SHM).is_dir().then_some(0o1777);
    let devpts = std::path::Path::new(DEV_PTS).is_dir() && std::path::Path::new(DEV_PTMX).exists();
    for m in job_mounts(false, shm, devpts) {
        mount(&m)?;
    }
    Ok(())
}

/// Make the child of `cmd` (PID 1 of a new PID namespace) mount a fresh
/// /proc before it runs the command, in a mount namespace of its own (a
/// copy of ours), so that ours keeps the /proc of our PID namespace.
pub fn mount_proc_in_child(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let m = job_mounts(true, None, false)
        .pop()
        .expect("the /proc mount");
    let c = |s: &str| std::ffi::CString::new(s).expect("no NUL in a mount argument");
    let (source, target, fstype) = (c(m.source), c(m.target), c(m.fstype));
    let flags = m.flags as libc::c_ulong;
    // SAFETY: the hook runs in the child between fork and exec and only
    // makes raw unshare and mount system calls with C strings made before
    // the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::unshare(libc::CLONE_NEWNS) != 0
                || libc::mount(
                    source.as_ptr(),
                    target.as_ptr(),
                    fstype.as_ptr(),
                    flags,
                    std::ptr::null(),
                ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
