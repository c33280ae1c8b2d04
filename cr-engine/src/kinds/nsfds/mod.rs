//! Kind "nsfds": fds open on namespace files (/proc/PID/ns/KIND, whose
//! links read "KIND:[INODE]"), which a program keeps to setns(2) into the
//! namespace later, or to tell it from another.
//!
//! A namespace is not saved apart from the processes in it: the tree is
//! restored into its namespaces made again (its own network, UTS, IPC,
//! mount, PID, cgroup namespaces: kinds netns, uts, sysv, mounts, tree,
//! cgroups) or into the restorer's (a user or time namespace must be the
//! checkpointer's: `tree::refuse_foreign_namespaces`). So an fd of a
//! namespace the process is in comes back as an fd of the namespace of
//! that kind the restored process is in; one of the checkpointer's (a job
//! in a PID namespace of its own holding one of the host's) as one of the
//! restorer's. Any other (kept alive by the fd alone, or by processes
//! outside the tree) cannot be made again and is refused by name, as is
//! one of the checkpointer's network namespace the process is not in (the
//! restorer leaves its own for the tree's, see `netns::make`).

#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::{FdScan, OpenFd};
use crate::kinds::{Described, FileKind, Opened};
use crate::restore::Rebuild;
use cr_image::model::fds::NS_KINDS;
use cr_image::model::{Fd, FdKind, Process};
use cr_sys::{ns, proc::FDTarget};

pub struct NsFds;

impl FileKind for NsFds {
    fn name(&self) -> &'static str {
        "nsfds"
    }

    fn describe(&self, _cx: &mut FdScan<'_>, f: &OpenFd<'_>) -> Option<Described> {
        let kind = match f.target {
            FDTarget::Net(_) => "net",
            FDTarget::Other(k, _) => NS_KINDS.iter().copied().find(|n| n == k)?,
            _ => return None,
        };
        Some(describe(f.pid, kind, &f.link))
    }

    fn open(
        &self,
        cx: &mut Rebuild<'_, '_, '_>,
        _p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>> {
        let FdKind::NsFile { ns: kind, host } = &f.kind else {
            return None;
        };
        let made = if *host {
            ns::open_own(kind)
        } else {
            ns::open(cx.stub.pid(), kind)
        };
        let whose = if *host { "the restorer's" } else { "its own" };
        Some(
            made.step(|| format!("cannot open fd {} again, {whose} {kind} namespace", f.fd))
                .map(Opened::Ours),
        )
    }
}

/// fd of process `pid` open on the namespace `link` ("net:[4026531833]")
/// of kind `kind`: the process's own, or the checkpointer's.
fn describe(pid: i32, kind: &str, link: &str) -> Described {
    let unread = |e: cr_sys::SysError| {
        format!(
            "an fd of the namespace {link}, which cannot be told from the process's ({})",
            cr_sys::error::one_line(&e)
        )
    };
    let host = if ns::id(pid, kind).map_err(unread)? == link {
        false
    } else if ns::own_id(kind).map_err(unread)? == link {
        if kind == "net" {
            return Err(format!(
                "an fd of the network namespace {link}, the checkpointer's, which the process is not in (not supported: the restore makes the tree's own network namespace and leaves the restorer's)"
            ));
        }
        true
    } else {
        return Err(format!(
            "an fd of the namespace {link}, which neither the process nor the checkpointer is in (not supported: a namespace kept by an fd, or by processes outside the tree, cannot be made again)"
        ));
    };
    Ok(Some(FdKind::NsFile {
        ns: kind.to_string(),
        host,
    }))
}
