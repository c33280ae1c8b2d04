//! Creating a process with a chosen PID: clone3 with `set_tid`.

use crate::error::{Errno, Result};

#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// Why a stub could not be created.
#[derive(Debug, thiserror::Error)]
pub enum CloneError {
    #[error("pid {0} is already in use")]
    PidInUse(i32),
    #[error("pid {pid} is still the {what} of process {holder} (outside the image): the kernel keeps the number while a group or session has it")]
    GroupId {
        pid: i32,
        holder: i32,
        what: &'static str,
    },
    #[error("creating a process with pid {pid} is not permitted (needs CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN)")]
    NotPermitted {
        pid: i32,
        #[source]
        source: Errno,
    },
    #[error("clone3 with set_tid={pid} failed")]
    Other {
        pid: i32,
        #[source]
        source: Errno,
    },
}

/// Fork a child of the calling process with PID `pid` (in the caller's PID
/// namespace), in new namespaces of the kinds `ns` (CLONE_NEWNS,
/// CLONE_NEWIPC; 0: ours). The child only asks to be killed with its parent
/// and then waits in pause(); the caller is expected to seize it and
/// rebuild it.
pub fn spawn_stub(pid: i32, ns: u64) -> Result<i32, CloneError> {
    spawn(Some(pid), ns)
}

/// Like [`spawn_stub`], but the child is PID 1 of a new PID namespace;
/// returns its PID in ours.
pub fn spawn_stub_in_new_pidns(ns: u64) -> Result<i32, CloneError> {
    spawn(Some(1), libc::CLONE_NEWPID as u64 | ns)
}

/// Fork a child that waits in pause(), with PID `pid` (None: any).
fn spawn(pid: Option<i32>, flags: u64) -> Result<i32, CloneError> {
    // A process just reaped is gone from /proc a moment before its number
    // is free again (the kernel releases the numbers after it unhashes the
    // task; with thousands of mappings to tear down, tens of milliseconds
    // later): clone3 says EEXIST for a number nobody holds. Retried while
    // /proc shows no holder, for a bounded time.
    let deadline = std::time::Instant::now() + RELEASE_WAIT;
    loop {
        match spawn_once(pid, flags) {
            Err(CloneError::PidInUse(n))
                if n > 1 && !pid_exists(n) && std::time::Instant::now() < deadline =>
            {
                if let Some((holder, what)) = crate::proc::group_or_session_of(n) {
                    return Err(CloneError::GroupId {
                        pid: n,
                        holder,
                        what,
                    });
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            r => return r,
        }
    }
}

/// How long [`spawn`] waits for a number being released.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

fn spawn_once(pid: Option<i32>, flags: u64) -> Result<i32, CloneError> {
    let tids = [pid.unwrap_or(0)];
    let args = CloneArgs {
        flags,
        exit_signal: libc::SIGCHLD as u64,
        set_tid: if pid.is_some() {
            tids.as_ptr() as u64
        } else {
            0
        },
        set_tid_size: pid.is_some() as u64,
        ..Default::default()
    };
    let pid = pid.unwrap_or(0);
    // Raw: nix has no clone3 (set_tid).
    // SAFETY: clone3 without CLONE_VM is a fork: the child gets a copy of our
    // address space. The child only calls prctl and pause (system calls
    // without locks or allocation, async-signal-safe) and never returns
    // from this function.
    let r = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if r == 0 {
        // Child.
        let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
        loop {
            nix::unistd::pause();
        }
    }
    if r < 0 {
        let e = Errno::last();
        return Err(match e.0 {
            libc::EEXIST => CloneError::PidInUse(pid),
            libc::EPERM => CloneError::NotPermitted { pid, source: e },
            _ => CloneError::Other { pid, source: e },
        });
    }
    Ok(r as i32)
}

/// Whether a PID currently names a process or thread (any state, zombies included).
pub fn pid_exists(pid: i32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Move the caller's future children into a new PID namespace (the first
/// child becomes its PID 1). Used by cr_run.
pub fn unshare_pidns() -> Result<(), Errno> {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWPID).map_err(Errno::from)
}

/// Make the child of `cmd` receive `sig` when its parent dies.
pub fn kill_with_parent(cmd: &mut std::process::Command, sig: i32) {
    use std::os::unix::process::CommandExt;
    // Raw prctl: nix's set_pdeathsig takes a Signal, which cannot name a
    // realtime `sig`; pre_exec is unsafe anyway.
    // SAFETY: the hook runs in the child between fork and exec and only
    // makes a raw prctl syscall (async-signal-safe).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// A child of ours that waits until it is ended ([`Doomed::end`], or the
/// drop): the pidfds opened of it meanwhile are, once it is ended and
/// reaped, pidfds of a process that has exited (pidfd_send_signal answers
/// ESRCH, poll reports them readable), all of the same process.
#[derive(Debug)]
pub struct Doomed {
    pid: i32,
}

impl Doomed {
    /// Fork the child (it dies with us too: PR_SET_PDEATHSIG).
    pub fn spawn() -> Result<Doomed, CloneError> {
        Ok(Doomed {
            pid: spawn(None, 0)?,
        })
    }

    /// Fork the child with PID `pid` (clone3 `set_tid`; the number must
    /// be free): its /proc/PID directory, opened meanwhile, is that of a
    /// process that has exited once it is ended.
    pub fn spawn_as(pid: i32) -> Result<Doomed, CloneError> {
        Ok(Doomed {
            pid: spawn(Some(pid), 0)?,
        })
    }

    /// A new pidfd of the child, with `flags` (PIDFD_NONBLOCK, PIDFD_THREAD).
    pub fn pidfd(&self, flags: u32) -> Result<std::os::fd::OwnedFd> {
        crate::fdio::pidfd_open_flags(self.pid, flags)
    }

    /// Kill the child and reap it.
    pub fn end(self) {}
}

impl Drop for Doomed {
    fn drop(&mut self) {
        let _ = crate::ptrace::kill(self.pid, libc::SIGKILL);
        let _ = crate::ptrace::wait_timed(self.pid, 0, crate::ptrace::KILL_REAP_TIMEOUT);
    }
}
