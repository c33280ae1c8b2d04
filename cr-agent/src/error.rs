//! Errors of a checkpoint, each naming the process and the resource.

use cr_sys::{Errno, SysError};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("no such process: {0}")]
    NoSuchProcess(i32),
    #[error("pid {0} is a kernel thread")]
    KernelThread(i32),
    #[error("pid {tid} is a thread of process {tgid}; checkpoint the process")]
    NotAProcess { tid: i32, tgid: i32 },
    #[error("pid {0} is a zombie")]
    Zombie(i32),
    #[error("cr_checkpoint cannot checkpoint itself")]
    SelfCheckpoint,
    #[error("permission denied to checkpoint process {pid} (it belongs to another user, or ptrace is restricted)")]
    PermissionDenied {
        pid: i32,
        #[source]
        source: Errno,
    },
    #[error("process {pid}: {what}: not supported yet")]
    Unsupported { pid: i32, what: String },
    #[error("process {pid}: its {conns} TCP connection(s) cannot be held still for the dump")]
    NetLock {
        pid: i32,
        conns: usize,
        #[source]
        source: SysError,
    },
    #[error("process {pid} exited during the checkpoint")]
    Exited { pid: i32 },
    #[error(transparent)]
    Sys(#[from] SysError),
    #[error(transparent)]
    Image(#[from] cr_image::ImageError),
    #[error("this kernel lacks {0}")]
    KernelLacks(String),
    #[error("parent image {path}: {what}")]
    Parent {
        path: std::path::PathBuf,
        what: String,
    },
    #[error("fault injected at stage {0} (CR_FAULT_INJECT)")]
    Injected(String),
}

impl CheckpointError {
    /// Map a low-level error of an operation on `pid` to the clearest variant.
    pub fn from_sys(pid: i32, e: SysError) -> Self {
        match &e {
            SysError::Ptrace { source, .. } if source.0 == libc::EPERM => {
                CheckpointError::PermissionDenied {
                    pid,
                    source: *source,
                }
            }
            SysError::Ptrace { source, .. } if source.0 == libc::ESRCH => {
                CheckpointError::NoSuchProcess(pid)
            }
            SysError::Exited { .. } => CheckpointError::Exited { pid },
            SysError::Io { source, .. }
                if source.kind() == std::io::ErrorKind::PermissionDenied =>
            {
                CheckpointError::PermissionDenied {
                    pid,
                    source: Errno(libc::EACCES),
                }
            }
            SysError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                CheckpointError::NoSuchProcess(pid)
            }
            _ => CheckpointError::Sys(e),
        }
    }
}
