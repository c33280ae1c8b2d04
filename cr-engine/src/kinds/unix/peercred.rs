//! SO_PEERCRED of socket pairs. The kernel records, for each end of a
//! socketpair, the PID, effective user and group of the process that made
//! it; a pair the restorer made would name cr_restart (a process soon
//! gone, and root). A pair whose ends carry the same credentials is made
//! instead by a helper process with that PID (free here before the tree's
//! stubs exist; the process may also be long gone, as the kernel keeps the
//! number a socket names), user and group, which the restorer takes the
//! two fds from before it kills it. A PID taken by another process here,
//! or a tree in a PID namespace of its own (whose numbers mean nothing
//! here yet), keeps the restorer's credentials (logged at debug).

use crate::error::{RestoreError, StepContext};
use crate::kinds::tree::restore::{inject_with_page, StubGuard};
use cr_image::model::objects::PeerCred;
use cr_sys::ptrace::{OnDrop, Tracee};
use std::os::fd::OwnedFd;
use tracing::debug;

/// A socketpair of type `ty` whose ends name `c` as their peer, or None
/// when it cannot be made so here (see the module's docs).
pub fn pair(ty: i32, c: &PeerCred) -> Result<Option<(OwnedFd, OwnedFd)>, RestoreError> {
    if c.pid <= 0 || cr_sys::clone::pid_exists(c.pid) {
        debug!(
            pid = c.pid,
            "socket pair: its maker's PID is taken here, made by the restorer"
        );
        return Ok(None);
    }
    let pid = match cr_sys::clone::spawn_stub(c.pid, 0) {
        Ok(p) => p,
        Err(e) => {
            debug!(pid = c.pid, error = %e, "socket pair: no helper with its maker's PID");
            return Ok(None);
        }
    };
    let mut guard = StubGuard(pid);
    let what = || {
        format!(
            "cannot make a socket pair as process {} ({}:{})",
            c.pid, c.uid, c.gid
        )
    };
    let options = (libc::PTRACE_O_TRACESYSGOOD | libc::PTRACE_O_EXITKILL) as u64;
    let mut t = Tracee::seize(pid, options, OnDrop::Kill).step(what)?;
    guard.0 = 0;
    let fds = inject_with_page(&mut t, |inj, page| {
        let (g, u) = (u64::from(c.gid), u64::from(c.uid));
        inj.call("setresgid", libc::SYS_setresgid, [g, g, g, 0, 0, 0])
            .step(what)?;
        inj.call("setresuid", libc::SYS_setresuid, [u, u, u, 0, 0, 0])
            .step(what)?;
        inj.call(
            "socketpair",
            libc::SYS_socketpair,
            [libc::AF_UNIX as u64, ty as u64, 0, page, 0, 0],
        )
        .step(what)?;
        let mut v = [0u8; 8];
        cr_sys::mem::read_vm(pid, page, &mut v).step(what)?;
        let a = i32::from_ne_bytes([v[0], v[1], v[2], v[3]]);
        let b = i32::from_ne_bytes([v[4], v[5], v[6], v[7]]);
        let x = cr_sys::fdio::steal_fd(pid, a).step(what)?;
        let y = cr_sys::fdio::steal_fd(pid, b).step(what)?;
        Ok((x, y))
    })?;
    drop(t);
    Ok(Some(fds))
}
