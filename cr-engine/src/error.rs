//! Errors of a checkpoint and of a restore, each naming the process and the
//! resource. Binaries print them on one line with `cr_sys::error::one_line`.

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
    #[error("process {pid} is traced by process {tracer} (a debugger or tracer: ptrace allows one tracer); detach it first")]
    Traced { pid: i32, tracer: i32 },
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
    /// An option names something unusable, or a file to save cannot be.
    #[error("{0}")]
    Invalid(String),
    #[error("this kernel lacks {0}")]
    KernelLacks(String),
    #[error("parent image {path}: {what}")]
    Parent {
        path: std::path::PathBuf,
        what: String,
    },
    #[error("fault injected at stage {0} (CR_FAULT_INJECT)")]
    Injected(String),
    #[error("interrupted by {0}; the processes run on as before")]
    Interrupted(&'static str),
    /// `--verify`: the tree differs from the image just written (or could
    /// not be captured again).
    #[error("process {pid}: the flags of mapping {start:#x}-{end:#x} changed during the checkpoint (madvise or mlock: {before} -> {after}); the image is removed and the processes run on; checkpoint again")]
    FlagsChanged {
        pid: i32,
        start: u64,
        end: u64,
        before: String,
        after: String,
    },
    #[error("--verify: {0}; the image is removed and the processes run on")]
    Verify(String),
    /// A program linked with libcr refused the checkpoint, or its callbacks
    /// or critical sections did not let it go in time.
    #[error("process {pid} (libcr): {reason}; the processes run on")]
    Coop { pid: i32, reason: String },
}

impl CheckpointError {
    /// Map a low-level error of an operation on `pid` to the clearest variant.
    pub fn from_sys(pid: i32, e: SysError) -> Self {
        match &e {
            SysError::Ptrace { source, tid, .. } if source.0 == libc::EPERM => {
                // Seizing a thread another tracer holds fails with EPERM too.
                let me = std::process::id() as i32;
                match cr_sys::proc::task_status(pid, *tid).map(|s| s.tracerpid) {
                    Ok(tracer) if tracer != 0 && tracer != me => {
                        CheckpointError::Traced { pid: *tid, tracer }
                    }
                    _ => CheckpointError::PermissionDenied {
                        pid,
                        source: *source,
                    },
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

    /// A resource of process `pid` this build refuses, in words.
    pub fn unsupported(pid: i32, what: impl Into<String>) -> Self {
        CheckpointError::Unsupported {
            pid,
            what: what.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    Image(#[from] cr_image::ImageError),
    #[error(transparent)]
    Clone(#[from] cr_sys::clone::CloneError),
    #[error(transparent)]
    Sys(#[from] SysError),
    #[error("{what}")]
    Step {
        what: String,
        #[source]
        source: SysError,
    },
    #[error("this CPU lacks features the image uses (XCR0 bits {missing:#x} missing)")]
    CpuFeatures { missing: u64 },
    #[error("thread {tid} of process {pid} is bound to CPUs {cpus}, but CPUs {missing} are not online on this machine (online: {online})")]
    Affinity {
        pid: u32,
        tid: u32,
        cpus: String,
        missing: String,
        online: String,
    },
    #[error("the vDSO of this kernel differs from the image's: {0}")]
    VdsoLayout(String),
    #[error("process {pid} of the image runs as uid {uid} or holds capabilities; only root or that user may restore it (you are uid {caller})")]
    NotYours { pid: u32, uid: u32, caller: u32 },
    #[error("image is not supported by this build: {0}")]
    Unsupported(String),
    #[error("{0} is a pre-dump (memory only, taken while the processes ran); restore the checkpoint made with --parent {0}")]
    PreDump(std::path::PathBuf),
    #[error("restored process {pid} could not be waited for")]
    Wait {
        pid: i32,
        #[source]
        source: Errno,
    },
    #[error("interrupted by {0}; nothing of the image runs")]
    Interrupted(&'static str),
    /// `--verify`: the restored tree differs from its image (or could not
    /// be captured again); nothing of it ran.
    #[error("--verify: {0}; nothing of the image runs")]
    Verify(String),
    /// An fd that led outside the tree, or an `--inherit-fd`, that cannot
    /// be bound.
    #[error("{0}")]
    Unbound(String),
    #[error("pid {pid} is already in use by {by}")]
    PidTaken { pid: i32, by: String },
    #[error("fault injected at stage {0} (CR_FAULT_INJECT)")]
    Injected(String),
    #[error("{path} ({used_by}) {change} since the checkpoint; restore anyway with --allow-changed-files, or checkpoint with --save-files")]
    ChangedFile {
        path: String,
        used_by: String,
        change: String,
    },
    #[error("System V {kind} {id} (key {key:#x}) cannot be restored: {why}; remove it ({ipcrm}) if nothing needs it, or restore elsewhere")]
    SysvTaken {
        kind: &'static str,
        id: i32,
        key: i32,
        why: String,
        ipcrm: String,
    },
    /// Post-copy (`--lazy-pages`): the pages of a process that already ran
    /// could not all be put in; it was killed (its image is untouched).
    #[error("post-copy of process {pid} failed after it started running: {why}; the process was killed, its image is intact: restore it again")]
    LazyPages { pid: i32, why: String },
    /// Post-copy between nodes: a block of a page store never came.
    #[error("block {block} of {} did not come from the node that holds the image: {why}", store.display())]
    RemotePages {
        store: std::path::PathBuf,
        block: u32,
        why: String,
    },
}

/// Attach a description of the step to a low-level error.
pub trait StepContext<T> {
    fn step(self, what: impl FnOnce() -> String) -> Result<T, RestoreError>;
}

impl<T> StepContext<T> for Result<T, SysError> {
    fn step(self, what: impl FnOnce() -> String) -> Result<T, RestoreError> {
        self.map_err(|source| RestoreError::Step {
            what: what(),
            source,
        })
    }
}
