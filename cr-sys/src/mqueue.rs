//! POSIX message queues (mq_overview(7)) held by another process.
//!
//! A queue is a file of the mqueue file system of an IPC namespace; an
//! mqueue descriptor is an ordinary fd. A queue a process holds is opened
//! a second time through its `/proc/PID/fd/N` link (the same queue, even
//! when unlinked since), which gives its attributes and lets its messages
//! be taken out and put back in the same order (the kernel has no way to
//! read a message and leave it queued). Reading the file itself gives the
//! kernel's summary line, which says whether a process registered for
//! notification (mq_notify).
//!
//! To make a queue again, [`Queue::create`] runs mq_open in the caller's
//! IPC namespace (see [`crate::ns::in_ipc_ns`]).

use crate::error::{Errno, NixResult, Result, SysError};
use nix::mqueue::{self, MQ_OFlag, MqAttr, MqdT};
use nix::sys::stat::Mode;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};

/// statfs f_type of the mqueue file system.
pub const MQUEUE_MAGIC: i64 = 0x1980_0202;

/// One queued message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub priority: u32,
    pub data: Vec<u8>,
}

/// A queue's attributes (mq_getattr), and its notification (from the
/// kernel's summary line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attributes {
    pub maxmsg: i64,
    pub msgsize: i64,
    pub curmsgs: i64,
    /// The process registered with mq_notify (0: none).
    pub notify_pid: i32,
}

/// A descriptor of a queue of our own: closed on drop.
pub struct Queue {
    fd: OwnedFd,
    what: String,
}

impl Queue {
    /// Whether fd `fd` of `pid` is a message queue.
    pub fn is_queue(pid: i32, fd: i32) -> bool {
        crate::fdio::fs_magic_at(std::path::Path::new(&format!("/proc/{pid}/fd/{fd}")))
            .is_ok_and(|m| m == MQUEUE_MAGIC)
    }

    /// Open the queue fd `fd` of `pid` holds, for reading and writing,
    /// without blocking.
    pub fn of_fd(pid: i32, fd: i32) -> Result<Queue> {
        let queue = crate::fdio::open(
            &format!("/proc/{pid}/fd/{fd}"),
            libc::O_RDWR | libc::O_NONBLOCK,
        )?;
        Ok(Queue {
            fd: queue,
            what: format!("the message queue of fd {fd} of process {pid}"),
        })
    }

    /// Another description of the same queue with access mode `accmode`
    /// (non-blocking; the fd's own flags are set when it is handed over):
    /// what a process's fd is opened as at restore.
    pub fn reopen(&self, accmode: i32) -> Result<OwnedFd> {
        crate::fdio::reopen(&self.fd, accmode & libc::O_ACCMODE)
    }

    /// Make queue `name` ("/name") in this thread's IPC namespace, which
    /// must not exist yet, with its mode and sizes; or open it as it is
    /// when `exclusive` is false and it exists.
    pub fn create(
        name: &str,
        mode: u32,
        maxmsg: i64,
        msgsize: i64,
        exclusive: bool,
    ) -> Result<(Queue, bool)> {
        let what = format!("message queue {name}");
        let cname = CString::new(name).map_err(|_| SysError::Parse {
            path: name.into(),
            what: "a NUL in a message queue name".into(),
        })?;
        let base = MQ_OFlag::O_RDWR | MQ_OFlag::O_NONBLOCK | MQ_OFlag::O_CLOEXEC;
        if !exclusive {
            match mqueue::mq_open(cname.as_c_str(), base, Mode::empty(), None) {
                Ok(q) => return Ok((Self::own(q, what), false)),
                Err(nix::Error::ENOENT) => {}
                Err(e) => return Err(e).or_sys(|| format!("mq_open({name})")),
            }
        }
        let attr = MqAttr::new(0, maxmsg, msgsize, 0);
        let q = mqueue::mq_open(
            cname.as_c_str(),
            base | MQ_OFlag::O_CREAT | MQ_OFlag::O_EXCL,
            Mode::from_bits_truncate(mode & 0o777),
            Some(&attr),
        )
        .or_sys(|| {
            format!("mq_open({name}, O_CREAT|O_EXCL, {mode:#o}, {maxmsg} x {msgsize} bytes)")
        })?;
        let q = Self::own(q, what);
        // mq_open's mode went through our umask.
        nix::sys::stat::fchmod(&q.fd, Mode::from_bits_truncate(mode & 0o7777))
            .or_sys(|| format!("fchmod of {} to {mode:#o}", q.what))?;
        Ok((q, true))
    }

    /// Remove name `name` of this thread's IPC namespace (the queue lives
    /// on while open).
    pub fn unlink(name: &str) -> Result<()> {
        let cname = CString::new(name).map_err(|_| SysError::Parse {
            path: name.into(),
            what: "a NUL in a message queue name".into(),
        })?;
        mqueue::mq_unlink(cname.as_c_str()).or_sys(|| format!("mq_unlink({name})"))
    }

    fn own(q: MqdT, what: String) -> Queue {
        // SAFETY: mq_open just returned this descriptor, which nothing
        // else owns; on Linux an mqd_t is a file descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(q.into_raw_fd()) };
        Queue { fd, what }
    }

    fn mqd(&self) -> std::mem::ManuallyDrop<MqdT> {
        // SAFETY: borrowed for one call: the MqdT is never closed (it is
        // not dropped), `self.fd` stays the owner.
        std::mem::ManuallyDrop::new(unsafe { MqdT::from_raw_fd(self.fd.as_raw_fd()) })
    }

    /// Its attributes and who registered for notification.
    pub fn attributes(&self) -> Result<Attributes> {
        let a =
            mqueue::mq_getattr(&self.mqd()).or_sys(|| format!("mq_getattr of {}", self.what))?;
        // "QSIZE:%-10lu NOTIFY:%-5d SIGNO:%-5d NOTIFY_PID:%-6d"
        // At offset 0 whatever earlier reads did.
        let mut raw = [0u8; 128];
        let n = nix::sys::uio::pread(&self.fd, &mut raw, 0).unwrap_or(0);
        let notify_pid = String::from_utf8_lossy(&raw[..n])
            .split_whitespace()
            .find_map(|w| w.strip_prefix("NOTIFY_PID:"))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Ok(Attributes {
            maxmsg: a.maxmsg(),
            msgsize: a.msgsize(),
            curmsgs: a.curmsgs(),
            notify_pid,
        })
    }

    /// Take every message out, in the order they would be received
    /// (highest priority first, oldest first within a priority).
    pub fn drain(&self, msgsize: i64) -> Result<Vec<Message>> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; msgsize.max(1) as usize];
        loop {
            let mut priority = 0u32;
            match mqueue::mq_receive(&self.mqd(), &mut buf, &mut priority) {
                Ok(n) => out.push(Message {
                    priority,
                    data: buf[..n].to_vec(),
                }),
                Err(nix::Error::EAGAIN) => return Ok(out),
                Err(e) => {
                    return Err(SysError::Syscall {
                        what: format!("mq_receive from {}", self.what),
                        source: Errno(e as i32),
                    })
                }
            }
        }
    }

    /// Queue `messages`, in order, without blocking.
    pub fn send_all(&self, messages: &[Message]) -> Result<()> {
        for m in messages {
            mqueue::mq_send(&self.mqd(), &m.data, m.priority).or_sys(|| {
                format!(
                    "mq_send of {} bytes at priority {} to {}",
                    m.data.len(),
                    m.priority,
                    self.what
                )
            })?;
        }
        Ok(())
    }

    /// Set the queue's owner.
    pub fn chown(&self, uid: u32, gid: u32) -> Result<()> {
        nix::unistd::fchown(
            &self.fd,
            Some(nix::unistd::Uid::from_raw(uid)),
            Some(nix::unistd::Gid::from_raw(gid)),
        )
        .or_sys(|| format!("fchown of {} to {uid}:{gid}", self.what))
    }

    /// Owner and mode of the queue.
    pub fn stat(&self) -> Result<(u32, u32, u32)> {
        let st = nix::sys::stat::fstat(&self.fd).or_sys(|| format!("fstat of {}", self.what))?;
        Ok((st.st_uid, st.st_gid, st.st_mode & 0o7777))
    }
}
