//! Errors of the low-level layer; each names the operation and the resource.

use std::fmt;

/// An errno value with its symbolic description.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    /// The calling thread's current errno.
    pub fn last() -> Self {
        Errno(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let e = std::io::Error::from_raw_os_error(self.0);
        // io::Error's Display appends " (os error N)"; keep the description only.
        let s = e.to_string();
        let s = s.split(" (os error").next().unwrap_or(&s).to_lowercase();
        write!(f, "{s}")
    }
}

impl std::error::Error for Errno {}

impl From<nix::errno::Errno> for Errno {
    fn from(e: nix::errno::Errno) -> Self {
        Errno(e as i32)
    }
}

/// The result of a nix call as ours: its error becomes a
/// [`SysError::Syscall`] naming the operation (`what` is only formatted on
/// failure).
pub(crate) trait NixResult<T> {
    fn or_sys(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> NixResult<T> for nix::Result<T> {
    fn or_sys(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| SysError::Syscall {
            what: what(),
            source: e.into(),
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SysError {
    #[error("ptrace {op} on thread {tid} failed")]
    Ptrace {
        op: &'static str,
        tid: i32,
        #[source]
        source: Errno,
    },
    #[error("waiting for thread {tid} failed")]
    Wait {
        tid: i32,
        #[source]
        source: Errno,
    },
    #[error("thread {tid} did not stop within {secs} s (it may be in an uninterruptible sleep)")]
    StopTimeout { tid: i32, secs: u64 },
    #[error("thread {tid} exited while being traced (status {status:#x})")]
    Exited { tid: i32, status: i32 },
    #[error("thread {tid} stopped unexpectedly (status {status:#x}) during {during}")]
    UnexpectedStop {
        tid: i32,
        status: i32,
        during: &'static str,
    },
    #[error("remote {name} in process {pid} failed")]
    Remote {
        name: &'static str,
        pid: i32,
        #[source]
        source: Errno,
    },
    #[error("{op} of {len} bytes at {addr:#x} in process {pid} failed")]
    Memory {
        op: &'static str,
        pid: i32,
        addr: u64,
        len: usize,
        #[source]
        source: Errno,
    },
    #[error("short {op} at {addr:#x} in process {pid}: {done} of {len} bytes")]
    ShortMemory {
        op: &'static str,
        pid: i32,
        addr: u64,
        done: usize,
        len: usize,
    },
    #[error("cannot read {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot parse {path}: {what}")]
    Parse { path: String, what: String },
    #[error("{what} failed")]
    Syscall {
        what: String,
        #[source]
        source: Errno,
    },
    #[error("bpf({op}) on {map} failed")]
    Bpf {
        op: &'static str,
        map: String,
        #[source]
        source: Errno,
    },
    #[error("{what}: {detail}")]
    Command { what: String, detail: String },
    #[error("no syscall instruction found in the executable mappings of process {pid}")]
    NoSyscallInsn { pid: i32 },
}

pub type Result<T, E = SysError> = std::result::Result<T, E>;

impl SysError {
    /// The errno of a failed system call, if that is what this is.
    pub fn errno(&self) -> Option<i32> {
        match self {
            SysError::Ptrace { source, .. }
            | SysError::Wait { source, .. }
            | SysError::Remote { source, .. }
            | SysError::Memory { source, .. }
            | SysError::Syscall { source, .. }
            | SysError::Bpf { source, .. } => Some(source.0),
            SysError::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

pub(crate) fn io_err(path: impl Into<String>) -> impl FnOnce(std::io::Error) -> SysError {
    let path = path.into();
    move |source| SysError::Io { path, source }
}

/// An error and its chain of sources on one line ("a: b: c"), skipping a
/// source whose text the message already ends with.
pub fn one_line(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let t = s.to_string();
        if !msg.ends_with(&t) {
            msg.push_str(": ");
            msg.push_str(&t);
        }
        src = s.source();
    }
    msg
}
