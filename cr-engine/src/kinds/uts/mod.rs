//! Kind "uts": the UTS namespace of a tree that has one of its own (a
//! `cr_run` job, see `cr_sys::ns::unshare_job_namespaces`): its host name
//! and NIS domain name. A job started on node n1 and restored on n2 goes
//! on seeing n1 (MPI runtimes and applications keep host names in their
//! state: a rank that found another name would take itself for a stranger).
//!
//! Restore: the root's stub is created in a new UTS namespace (see
//! `kinds::tree::restore`), where injected `sethostname` and
//! `setdomainname` calls give it the saved names.

use crate::error::{CheckpointError, RestoreError, StepContext};
use cr_image::model::{Checkpoint, Process, UtsNs};
use cr_sys::ptrace::Tracee;
use cr_sys::{mem, ns};
use tracing::debug;

/// The names of the frozen tree's UTS namespace, when it has one of its own.
pub fn capture(images: &[Process]) -> Result<Option<UtsNs>, CheckpointError> {
    let Some(root) = images.first().map(|p| p.pid as i32) else {
        return Ok(None);
    };
    let sys = |e| CheckpointError::from_sys(root, e);
    if !ns::differs(root, "uts").map_err(sys)? {
        return Ok(None);
    }
    crate::kinds::tree::same_namespace(images, "uts", "a UTS")?;
    let (hostname, domainname) = ns::uts_names(root).map_err(sys)?;
    debug!(root, %hostname, %domainname, "UTS namespace saved");
    Ok(Some(UtsNs {
        hostname,
        domainname,
    }))
}

/// Give the new UTS namespace of the root stub `root` (before it forks the
/// others) the image's names.
pub fn prepare(ck: &Checkpoint, root: &mut Tracee) -> Result<(), RestoreError> {
    let Some(u) = &ck.uts else {
        return Ok(());
    };
    let pid = root.tid();
    crate::kinds::tree::restore::inject_with_page(root, |inj, page| {
        for (name, nr, value) in [
            ("sethostname", libc::SYS_sethostname, &u.hostname),
            ("setdomainname", libc::SYS_setdomainname, &u.domainname),
        ] {
            mem::write_vm(pid, page, value.as_bytes())?;
            inj.call(name, nr, [page, value.len() as u64, 0, 0, 0, 0])
                .step(|| format!("cannot give the restored job its {name} {value:?}"))?;
        }
        Ok(())
    })?;
    debug!(root = pid, hostname = %u.hostname, "UTS namespace made");
    Ok(())
}
