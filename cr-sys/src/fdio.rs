//! System calls on file descriptors the engines hold themselves: taking a
//! target's fd (pidfd_getfd), looking into pipes and sockets without
//! consuming their data, and creating the kernel objects a restore hands
//! over to the rebuilt processes (pipes, sockets, eventfd, timerfd,
//! signalfd, epoll, inotify, memfd) plus terminal ioctls.
//!
//! Every function returns owned fds, so nothing leaks on an error path.

use crate::error::{Errno, NixResult, Result, SysError};
use nix::errno::Errno as NixErrno;
use nix::fcntl::{fcntl, FcntlArg, OFlag, SealFlag, SpliceFFlags};
use nix::sys::socket::{self as sock, AddressFamily, MsgFlags, SockFlag, SockType};
use nix::unistd::Pid;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

pub(crate) fn fail(what: impl Into<String>) -> SysError {
    SysError::Syscall {
        what: what.into(),
        source: Errno::last(),
    }
}

pub(crate) fn cvt(r: i64, what: impl FnOnce() -> String) -> Result<i64> {
    if r < 0 {
        Err(fail(what()))
    } else {
        Ok(r)
    }
}

/// Wrap a new fd returned by the kernel.
pub(crate) fn own(r: i64, what: impl FnOnce() -> String) -> Result<OwnedFd> {
    let fd = cvt(r, what)?;
    // SAFETY: the kernel just returned this fd to us; nobody else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

// pidfd_open and pidfd_getfd are raw: nix has neither.

/// A pidfd for process `pid`.
pub fn pidfd_open(pid: i32) -> Result<OwnedFd> {
    pidfd_open_flags(pid, 0)
}

/// A pidfd for process `pid` with `flags` (PIDFD_NONBLOCK, PIDFD_THREAD).
pub fn pidfd_open_flags(pid: i32, flags: u32) -> Result<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, flags) };
    own(r, || format!("pidfd_open of process {pid}"))
}

/// A copy of fd `fd` of the process behind `pidfd`: the same open file
/// description (sharing offset and flags), close-on-exec in our table.
pub fn pidfd_getfd(pidfd: BorrowedFd<'_>, pid: i32, fd: i32) -> Result<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    own(r, || format!("pidfd_getfd of fd {fd} of process {pid}"))
}

/// The I/O signal owner (F_GETOWN_EX: its kind and PID) and signal
/// (F_GETSIG) of the open file description behind our fd `fd`: what the
/// process holding another fd of it would be told, but for the PID, which
/// is seen from our PID namespace (0, no owner, is the same in every one).
pub fn signal_owner(fd: BorrowedFd<'_>) -> Result<(i32, i32, i32)> {
    const F_GETSIG: i32 = 11;
    const F_GETOWN_EX: i32 = 16;
    let mut owner = [0i32; 2];
    // SAFETY: F_GETOWN_EX writes one struct f_owner_ex { int type; pid_t pid; }
    // into `owner`, which is exactly that size.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), F_GETOWN_EX, owner.as_mut_ptr()) };
    cvt(r as i64, || "fcntl(F_GETOWN_EX)".to_string())?;
    // SAFETY: F_GETSIG takes no argument.
    let sig = unsafe { libc::fcntl(fd.as_raw_fd(), F_GETSIG) };
    let sig = cvt(sig as i64, || "fcntl(F_GETSIG)".to_string())?;
    Ok((owner[0], owner[1], sig as i32))
}

/// Take fd `fd` of process `pid` (see [`pidfd_getfd`]).
pub fn steal_fd(pid: i32, fd: i32) -> Result<OwnedFd> {
    let pidfd = pidfd_open(pid)?;
    pidfd_getfd(std::os::fd::AsFd::as_fd(&pidfd), pid, fd)
}

/// The family (SO_DOMAIN: `AF_UNIX`, `AF_INET`, ...) of socket fd `fd` of
/// process `pid`, read on a copy of the fd: a few system calls, where
/// telling a unix socket by sock_diag or /proc/PID/net/unix means reading
/// every unix socket of the namespace.
pub fn socket_family(pid: i32, fd: i32) -> Result<i32> {
    getsockopt_int(&steal_fd(pid, fd)?, libc::SOL_SOCKET, libc::SO_DOMAIN)
}

/// Whether socket fd `fd` of process `pid` may be a unix socket: false
/// only when its family ([`socket_family`]) is known to be another, so a
/// caller can skip the listing of every unix socket of the namespace.
pub fn may_be_unix(pid: i32, fd: i32) -> bool {
    socket_family(pid, fd).map_or(true, |family| family == libc::AF_UNIX)
}

/// A close-on-exec duplicate of our own fd `fd` (fails if it is not open).
pub fn dup_own(fd: RawFd) -> Result<OwnedFd> {
    // Raw: `fd` is a number that may name no open file, so it cannot be
    // borrowed as the `AsFd` that nix's fcntl wants.
    // SAFETY: F_DUPFD_CLOEXEC takes an integer and returns a new fd.
    let r = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    own(r as i64, || format!("dup of our fd {fd}"))
}

/// The target of the symbolic link `fd` holds (an O_PATH | O_NOFOLLOW fd
/// of the link: readlinkat with an empty path).
pub fn link_target(fd: &OwnedFd) -> Result<Vec<u8>> {
    use std::os::unix::ffi::OsStringExt;
    nix::fcntl::readlinkat(fd, "")
        .map(|t| t.into_vec())
        .or_sys(|| format!("readlink of fd {}", fd.as_raw_fd()))
}

/// The inode number of the file `fd` holds (a socket's: its socket:[N]).
pub fn inode(fd: &OwnedFd) -> Result<u64> {
    nix::sys::stat::fstat(fd)
        .map(|st| st.st_ino)
        .or_sys(|| "fstat".into())
}

/// F_GETFL.
pub fn get_flags(fd: &OwnedFd) -> Result<i32> {
    fcntl(fd, FcntlArg::F_GETFL).or_sys(|| "fcntl(F_GETFL)".into())
}

/// F_SETFL (only O_APPEND, O_ASYNC, O_DIRECT, O_NOATIME, O_NONBLOCK change).
pub fn set_flags(fd: &OwnedFd, flags: i32) -> Result<()> {
    fcntl(fd, FcntlArg::F_SETFL(OFlag::from_bits_retain(flags)))
        .map(drop)
        .or_sys(|| format!("fcntl(F_SETFL, {flags:#o})"))
}

/// Set FD_CLOEXEC on our fd (F_SETFD).
pub fn set_cloexec(fd: &OwnedFd) -> Result<()> {
    fcntl(fd, FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC))
        .map(drop)
        .or_sys(|| "fcntl(F_SETFD, FD_CLOEXEC)".into())
}

/// Capacity of a pipe (F_GETPIPE_SZ).
pub fn pipe_size(fd: &OwnedFd) -> Result<u32> {
    fcntl(fd, FcntlArg::F_GETPIPE_SZ)
        .map(|v| v as u32)
        .or_sys(|| "fcntl(F_GETPIPE_SZ)".into())
}

/// Set the capacity of a pipe (F_SETPIPE_SZ).
pub fn set_pipe_size(fd: &OwnedFd, size: u32) -> Result<()> {
    fcntl(fd, FcntlArg::F_SETPIPE_SZ(size as libc::c_int))
        .map(drop)
        .or_sys(|| format!("fcntl(F_SETPIPE_SZ, {size})"))
}

/// F_GET_SEALS of a memfd.
pub fn seals(fd: &OwnedFd) -> Result<u32> {
    fcntl(fd, FcntlArg::F_GET_SEALS)
        .map(|v| v as u32)
        .or_sys(|| "fcntl(F_GET_SEALS)".into())
}

/// F_ADD_SEALS.
pub fn add_seals(fd: &OwnedFd, seals: u32) -> Result<()> {
    let flags = SealFlag::from_bits_retain(seals as libc::c_int);
    fcntl(fd, FcntlArg::F_ADD_SEALS(flags))
        .map(drop)
        .or_sys(|| format!("fcntl(F_ADD_SEALS, {seals:#x})"))
}

/// An ioctl that writes one int (FIONREAD, TIOCGPTN, SIOCOUTQ...); nix has
/// no safe wrapper for these.
pub(crate) fn ioctl_get_int(
    fd: &OwnedFd,
    req: u64,
    what: impl FnOnce() -> String,
) -> Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    // SAFETY: every request passed here writes one int to the pointer.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, &mut v) };
    cvt(r as i64, what)?;
    Ok(v)
}

/// Bytes waiting to be read (FIONREAD).
pub fn bytes_queued(fd: &OwnedFd) -> Result<usize> {
    ioctl_get_int(fd, libc::FIONREAD, || "ioctl(FIONREAD)".into()).map(|n| n as usize)
}

/// pipe2 with `flags`: (read end, write end).
pub fn pipe(flags: i32) -> Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(OFlag::from_bits_retain(flags)).or_sys(|| "pipe2".into())
}

/// The bytes buffered in a pipe, without consuming them: tee(2) duplicates
/// the pipe's buffers into a pipe of our own, which we then drain.
/// `src` must be a readable description of the pipe.
pub fn peek_pipe(src: &OwnedFd) -> Result<Vec<u8>> {
    let queued = bytes_queued(src)?;
    if queued == 0 {
        return Ok(Vec::new());
    }
    let (r, w) = pipe(libc::O_CLOEXEC | libc::O_NONBLOCK)?;
    // tee always starts at the head of the source: our pipe must take every
    // buffer in one call, so it gets the source's capacity.
    set_pipe_size(&w, pipe_size(src)?.max(4096))?;
    let n = nix::fcntl::tee(src, &w, queued, SpliceFFlags::SPLICE_F_NONBLOCK)
        .or_sys(|| "tee from the pipe".into())?;
    drop(w);
    let mut out = vec![0u8; n];
    let mut done = 0;
    while done < n {
        let got =
            nix::unistd::read(&r, &mut out[done..]).or_sys(|| "read of the pipe copy".into())?;
        if got == 0 {
            break;
        }
        done += got;
    }
    out.truncate(done);
    if done != queued {
        return Err(SysError::Syscall {
            what: format!("tee copied {done} of the {queued} bytes in the pipe"),
            source: Errno(libc::EIO),
        });
    }
    Ok(out)
}

/// Write all of `data` to `fd` (which must not block: a pipe or socket with
/// room for it).
pub fn write_all(fd: &OwnedFd, data: &[u8]) -> Result<()> {
    let mut done = 0;
    while done < data.len() {
        done += nix::unistd::write(fd, &data[done..])
            .or_sys(|| format!("write of {} bytes", data.len() - done))?;
    }
    Ok(())
}

/// read(2) once into `buf` (the fd should be non-blocking).
pub fn read_nonblock(fd: &OwnedFd, buf: &mut [u8]) -> Result<usize> {
    nix::unistd::read(fd, buf).or_sys(|| "read".into())
}

/// send(2) one message (datagram sockets keep its boundary).
pub fn send(fd: &OwnedFd, data: &[u8]) -> Result<()> {
    let n = send_some(fd, data)?;
    if n != data.len() {
        return Err(SysError::Syscall {
            what: format!("send of {} bytes sent {n}", data.len()),
            source: Errno(if n == 0 { libc::EAGAIN } else { libc::EIO }),
        });
    }
    Ok(())
}

/// send(2) as much of `data` as the socket takes now (MSG_DONTWAIT); 0
/// when it takes nothing.
pub fn send_some(fd: &OwnedFd, data: &[u8]) -> Result<usize> {
    let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
    match sock::send(fd.as_raw_fd(), data, flags) {
        Err(NixErrno::EAGAIN) => Ok(0),
        r => r.or_sys(|| format!("send of {} bytes", data.len())),
    }
}

/// socket(2) of any family, type (with its SOCK_* flags) and protocol:
/// nix names only some protocols, and raw, netlink and packet sockets may
/// be of any.
pub fn socket(family: i32, ty: i32, protocol: i32) -> Result<OwnedFd> {
    // SAFETY: socket(2) takes no pointers; the fd it returns is ours alone.
    let fd = unsafe { libc::socket(family, ty, protocol) };
    if fd < 0 {
        return Err(SysError::Syscall {
            what: format!("socket({family}, {ty}, {protocol})"),
            source: Errno::last(),
        });
    }
    // SAFETY: fd was just returned by socket(2) and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Take one waiting message off a datagram socket and throw it away;
/// false when none waits.
pub fn recv_discard(fd: &OwnedFd) -> Result<bool> {
    let mut byte = [0u8; 1];
    let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC;
    match sock::recv(fd.as_raw_fd(), &mut byte, flags) {
        Err(NixErrno::EAGAIN) => Ok(false),
        r => r
            .map(|_| true)
            .or_sys(|| "recv of a message to drop".into()),
    }
}

/// getsockopt of any level and option into `buf`; returns the length the
/// kernel wrote. Raw: nix only has typed options, one per known name, and
/// the engines save and restore options by number.
pub(crate) fn getsockopt_raw(
    fd: &OwnedFd,
    level: i32,
    opt: i32,
    buf: &mut [u8],
) -> std::result::Result<usize, Errno> {
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `buf`.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(Errno::last());
    }
    Ok(len as usize)
}

/// setsockopt of any level and option from `val` (raw, see [`getsockopt_raw`]).
pub(crate) fn setsockopt_raw(
    fd: &OwnedFd,
    level: i32,
    opt: i32,
    val: &[u8],
) -> std::result::Result<(), Errno> {
    // SAFETY: the kernel reads `val.len()` bytes from `val`.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            val.as_ptr().cast(),
            val.len() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(Errno::last());
    }
    Ok(())
}

pub fn getsockopt_int(fd: &OwnedFd, level: i32, opt: i32) -> Result<i32> {
    let mut v = [0u8; 4];
    getsockopt_raw(fd, level, opt, &mut v).map_err(|source| SysError::Syscall {
        what: format!("getsockopt({level}, {opt})"),
        source,
    })?;
    Ok(i32::from_ne_bytes(v))
}

/// SO_PEERCRED of a unix socket: (pid, uid, gid) the kernel recorded for
/// its peer; None when it has none (never connected: pid 0).
pub fn peer_cred(fd: &OwnedFd) -> Result<Option<(i32, u32, u32)>> {
    // struct ucred: pid, uid, gid.
    let mut v = [0u8; 12];
    getsockopt_raw(fd, libc::SOL_SOCKET, libc::SO_PEERCRED, &mut v).map_err(|source| {
        SysError::Syscall {
            what: "getsockopt(SO_PEERCRED)".into(),
            source,
        }
    })?;
    let word = |i: usize| [v[i], v[i + 1], v[i + 2], v[i + 3]];
    let pid = i32::from_ne_bytes(word(0));
    Ok((pid > 0).then(|| {
        (
            pid,
            u32::from_ne_bytes(word(4)),
            u32::from_ne_bytes(word(8)),
        )
    }))
}

pub fn setsockopt_int(fd: &OwnedFd, level: i32, opt: i32, v: i32) -> Result<()> {
    setsockopt_raw(fd, level, opt, &v.to_ne_bytes()).map_err(|source| SysError::Syscall {
        what: format!("setsockopt({level}, {opt}, {v})"),
        source,
    })
}

/// One message of a socket's receive queue, as a peek saw it.
#[derive(Debug, Default)]
pub struct Peeked {
    pub data: Vec<u8>,
    /// The sender's unix name (empty if unnamed or a stream).
    pub from: Vec<u8>,
    /// Files in flight with it (SCM_RIGHTS): a peek installs a copy of each
    /// in our own table, the same open file descriptions.
    pub fds: Vec<OwnedFd>,
}

/// A socket's receive queue.
pub type Queue = Vec<Peeked>;

/// The receive queue of a socket, without consuming it: MSG_PEEK with
/// SO_PEEK_OFF walking forward, then SO_PEEK_OFF put back. Datagram and
/// seqpacket sockets give one entry per message; stream sockets one entry,
/// or one per run of bytes ending with files in flight (a read of a stream
/// stops after the bytes that carry files). `zero_ends`: a zero-length
/// read ends the queue (a seqpacket socket whose peer is gone reads 0 at
/// its end, like a stream, forever).
pub fn peek_queue(fd: &OwnedFd, stream: bool, zero_ends: bool) -> Result<Queue> {
    let old = getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_PEEK_OFF)?;
    setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_PEEK_OFF, 0)?;
    let out = peek_loop(fd, stream, zero_ends);
    let restored = setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_PEEK_OFF, old);
    let out = out?;
    restored?;
    Ok(out)
}

/// Raw recvmsg: nix's reads the sender's address from uninitialized memory
/// when the sender is unnamed (the kernel then writes none and sets
/// msg_namelen to 0), and its UnixAddr::path_len panics on that length.
fn peek_loop(fd: &OwnedFd, stream: bool, zero_ends: bool) -> Result<Queue> {
    let mut msgs: Queue = Vec::new();
    // A stream's last entry ended with files: the next bytes start another.
    let mut closed = false;
    let mut buf = vec![0u8; 256 * 1024];
    // Room for SCM_MAX_FD (253) fds and credentials.
    let mut cbuf = [0u64; 160];
    loop {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: msghdr is plain data; zero is valid.
        let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
        let mut from = libc::sockaddr_un {
            sun_family: 0,
            sun_path: [0; 108],
        };
        mh.msg_name = (&mut from as *mut libc::sockaddr_un).cast();
        mh.msg_namelen = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
        mh.msg_iov = &mut iov;
        mh.msg_iovlen = 1;
        mh.msg_control = cbuf.as_mut_ptr().cast();
        mh.msg_controllen = std::mem::size_of_val(&cbuf);
        // SAFETY: every pointer in `mh` refers to our own live buffers.
        let n = unsafe {
            libc::recvmsg(
                fd.as_raw_fd(),
                &mut mh,
                libc::MSG_PEEK | libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
            )
        };
        if n < 0 {
            let e = Errno::last();
            if e.0 == libc::EAGAIN {
                break;
            }
            return Err(SysError::Syscall {
                what: "recvmsg(MSG_PEEK) of the socket queue".into(),
                source: e,
            });
        }
        let fds = passed_fds(&mh);
        if mh.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(SysError::Syscall {
                what: "recvmsg(MSG_PEEK): more files in flight than one message carries".into(),
                source: Errno(libc::EOVERFLOW),
            });
        }
        let n = n as usize;
        if stream {
            if n == 0 {
                break;
            }
            if msgs.is_empty() || closed {
                msgs.push(Peeked::default());
            }
            let last = msgs.last_mut().expect("just pushed");
            last.data.extend_from_slice(&buf[..n]);
            closed = !fds.is_empty();
            last.fds = fds;
        } else {
            if n == 0 && zero_ends {
                break;
            }
            if mh.msg_flags & libc::MSG_TRUNC != 0 {
                buf.resize(buf.len() * 4, 0);
                // Peek offset moved past the truncated message: start over.
                setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_PEEK_OFF, 0)?;
                msgs.clear();
                continue;
            }
            let off = std::mem::size_of::<libc::sa_family_t>();
            let len = (mh.msg_namelen as usize)
                .saturating_sub(off)
                .min(from.sun_path.len());
            let mut name: Vec<u8> = from.sun_path[..len].iter().map(|&c| c as u8).collect();
            // A path name ends with its NUL; an abstract one starts with 0.
            if name.first().is_some_and(|&c| c != 0) {
                if let Some(end) = name.iter().position(|&c| c == 0) {
                    name.truncate(end);
                }
            }
            msgs.push(Peeked {
                data: buf[..n].to_vec(),
                from: name,
                fds,
            });
            // The peek offset moves past empty datagrams too; a kernel that
            // did not would loop here forever.
            if msgs.len() > 4 << 20 {
                return Err(SysError::Syscall {
                    what: "peeking the socket queue (no end in sight)".into(),
                    source: Errno(libc::EOVERFLOW),
                });
            }
        }
    }
    Ok(msgs)
}

/// The fds a peeked message installed in our table.
fn passed_fds(mh: &libc::msghdr) -> Vec<OwnedFd> {
    let mut out = Vec::new();
    // SAFETY: the CMSG_* macros walk the control buffer the kernel filled,
    // bounded by msg_controllen; each fd of an SCM_RIGHTS message was just
    // installed in our table for us alone, so we own it.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(mh);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let n = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / std::mem::size_of::<RawFd>();
                for i in 0..n {
                    out.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(mh, c);
        }
    }
    out
}

/// sendmsg(2) of one message carrying files (SCM_RIGHTS), to the socket
/// named `to` or (None) to the peer, never waiting.
pub fn send_with_fds(
    fd: &OwnedFd,
    data: &[u8],
    fds: &[BorrowedFd<'_>],
    to: Option<&[u8]>,
) -> Result<()> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let what = || format!("sendmsg of {} bytes with {} files", data.len(), raw.len());
    let payload = std::mem::size_of_val(raw.as_slice());
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let addr = to.map(sockaddr_un).transpose()?;
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: msghdr is plain data; zero is valid.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    if let Some((sa, len)) = &addr {
        mh.msg_name = (sa as *const libc::sockaddr_un) as *mut libc::c_void;
        mh.msg_namelen = *len;
    }
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    if !raw.is_empty() {
        mh.msg_control = cbuf.as_mut_ptr().cast();
        mh.msg_controllen = space;
        // SAFETY: the control buffer is CMSG_SPACE(payload) bytes, room for
        // one header and the fds, which CMSG_DATA points past.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&mh);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(payload as u32) as usize;
            std::ptr::copy_nonoverlapping(
                raw.as_ptr(),
                libc::CMSG_DATA(c) as *mut RawFd,
                raw.len(),
            );
        }
    }
    // SAFETY: every pointer in `mh` refers to live buffers of ours.
    let n = unsafe { libc::sendmsg(fd.as_raw_fd(), &mh, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    let n = cvt(n as i64, what)? as usize;
    if n != data.len() {
        return Err(SysError::Syscall {
            what: what(),
            source: Errno(libc::EAGAIN),
        });
    }
    Ok(())
}

/// A sockaddr_un for `name` (raw: a leading 0 byte makes it abstract).
/// Not nix's `UnixAddr`, which refuses a path name of 108 bytes (filling
/// sun_path, no NUL): Linux takes one, and a dumped socket can have one.
fn sockaddr_un(name: &[u8]) -> Result<(libc::sockaddr_un, libc::socklen_t)> {
    let mut sa = libc::sockaddr_un {
        sun_family: libc::AF_UNIX as libc::sa_family_t,
        sun_path: [0; 108],
    };
    if name.len() > sa.sun_path.len() {
        return Err(SysError::Syscall {
            what: format!("unix socket name of {} bytes", name.len()),
            source: Errno(libc::ENAMETOOLONG),
        });
    }
    for (d, s) in sa.sun_path.iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + name.len();
    Ok((sa, len as libc::socklen_t))
}

/// A printable unix socket name.
pub fn show_name(name: &[u8]) -> String {
    match name.split_first() {
        Some((0, rest)) => format!("@{}", String::from_utf8_lossy(rest)),
        _ => String::from_utf8_lossy(name).into_owned(),
    }
}

/// A raw socket type (SOCK_STREAM..., possibly with SOCK_NONBLOCK) as nix
/// takes it, close-on-exec added; EINVAL for a type nix does not name
/// (the kernel refuses those too).
pub(crate) fn sock_type(ty: i32) -> nix::Result<(SockType, SockFlag)> {
    let flag_bits = libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    let flags = SockFlag::from_bits_retain(ty & flag_bits) | SockFlag::SOCK_CLOEXEC;
    Ok((SockType::try_from(ty & !flag_bits)?, flags))
}

pub fn unix_socket(sock_type: i32) -> Result<OwnedFd> {
    self::sock_type(sock_type)
        .and_then(|(ty, flags)| sock::socket(AddressFamily::Unix, ty, flags, None))
        .or_sys(|| format!("socket(AF_UNIX, {sock_type})"))
}

pub fn unix_socketpair(sock_type: i32) -> Result<(OwnedFd, OwnedFd)> {
    self::sock_type(sock_type)
        .and_then(|(ty, flags)| sock::socketpair(AddressFamily::Unix, ty, None, flags))
        .or_sys(|| format!("socketpair(AF_UNIX, {sock_type})"))
}

/// sendto(2) one datagram to the socket named `name`.
pub fn send_to(fd: &OwnedFd, data: &[u8], name: &[u8]) -> Result<()> {
    let (sa, len) = sockaddr_un(name)?;
    // SAFETY: sending from our own buffer to a valid sockaddr_un.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            data.as_ptr().cast(),
            data.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            (&sa as *const libc::sockaddr_un).cast(),
            len,
        )
    };
    cvt(n as i64, || {
        format!("sendto {} of {} bytes", show_name(name), data.len())
    })
    .map(drop)
}

pub fn bind_unix(fd: &OwnedFd, name: &[u8]) -> Result<()> {
    let (sa, len) = sockaddr_un(name)?;
    // SAFETY: `sa` is a valid sockaddr_un of `len` bytes.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_un).cast(),
            len,
        )
    };
    cvt(r as i64, || format!("bind to {}", show_name(name))).map(drop)
}

pub fn connect_unix(fd: &OwnedFd, name: &[u8]) -> Result<()> {
    let (sa, len) = sockaddr_un(name)?;
    // SAFETY: `sa` is a valid sockaddr_un of `len` bytes.
    let r = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_un).cast(),
            len,
        )
    };
    cvt(r as i64, || format!("connect to {}", show_name(name))).map(drop)
}

pub fn listen(fd: &OwnedFd, backlog: i32) -> Result<()> {
    // Raw: nix's Backlog refuses more than SOMAXCONN (4096), but a listener
    // dumped where net.core.somaxconn is higher can have a larger backlog.
    // SAFETY: plain syscall with integer arguments.
    let r = unsafe { libc::listen(fd.as_raw_fd(), backlog) };
    cvt(r as i64, || format!("listen({backlog})")).map(drop)
}

pub fn accept(fd: &OwnedFd) -> Result<OwnedFd> {
    sock::accept4(fd, SockFlag::SOCK_CLOEXEC).or_sys(|| "accept".into())
}

pub fn shutdown(fd: &OwnedFd, how: i32) -> Result<()> {
    let how_ = match how {
        libc::SHUT_RD => Ok(sock::Shutdown::Read),
        libc::SHUT_WR => Ok(sock::Shutdown::Write),
        libc::SHUT_RDWR => Ok(sock::Shutdown::Both),
        _ => Err(NixErrno::EINVAL),
    };
    how_.and_then(|h| sock::shutdown(fd.as_raw_fd(), h))
        .or_sys(|| format!("shutdown({how})"))
}

pub fn eventfd(count: u64, flags: i32) -> Result<OwnedFd> {
    if count > u32::MAX as u64 {
        // eventfd2 takes an unsigned int; larger counts are written after.
        let fd = eventfd(0, flags)?;
        write_all(&fd, &count.to_ne_bytes())?;
        return Ok(fd);
    }
    use nix::sys::eventfd::{EfdFlags, EventFd};
    let flags = EfdFlags::from_bits_retain(flags) | EfdFlags::EFD_CLOEXEC;
    EventFd::from_value_and_flags(count as u32, flags)
        .map(OwnedFd::from)
        .or_sys(|| format!("eventfd({count})"))
}

pub fn signalfd(mask: u64, flags: i32) -> Result<OwnedFd> {
    // Raw: nix's SigSet holds only the signals its Signal enum names, not
    // the realtime ones a saved mask can have.
    // SAFETY: the kernel reads 8 bytes of mask.
    let r = unsafe {
        libc::syscall(
            libc::SYS_signalfd4,
            -1,
            &mask as *const u64,
            8usize,
            flags | libc::SFD_CLOEXEC,
        )
    };
    own(r, || format!("signalfd({mask:#x})"))
}

pub fn timerfd(clockid: i32, flags: i32) -> Result<OwnedFd> {
    use nix::sys::timerfd::{ClockId, TimerFd, TimerFlags};
    // The clocks timerfd_create takes; the kernel refuses the others.
    let clock = match clockid {
        libc::CLOCK_REALTIME => Ok(ClockId::CLOCK_REALTIME),
        libc::CLOCK_MONOTONIC => Ok(ClockId::CLOCK_MONOTONIC),
        libc::CLOCK_BOOTTIME => Ok(ClockId::CLOCK_BOOTTIME),
        libc::CLOCK_REALTIME_ALARM => Ok(ClockId::CLOCK_REALTIME_ALARM),
        libc::CLOCK_BOOTTIME_ALARM => Ok(ClockId::CLOCK_BOOTTIME_ALARM),
        _ => Err(NixErrno::EINVAL),
    };
    let flags = TimerFlags::from_bits_retain(flags) | TimerFlags::TFD_CLOEXEC;
    clock
        .and_then(|c| TimerFd::new(c, flags))
        .map(OwnedFd::from)
        .or_sys(|| format!("timerfd_create(clock {clockid})"))
}

fn timespec(ns: u64) -> libc::timespec {
    libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    }
}

/// Arm a timerfd: first expiration `value_ns` from now (or at that absolute
/// time with TFD_TIMER_ABSTIME in `flags`), then every `interval_ns`.
pub fn timerfd_settime(fd: &OwnedFd, flags: i32, value_ns: u64, interval_ns: u64) -> Result<()> {
    let spec = libc::itimerspec {
        it_interval: timespec(interval_ns),
        it_value: timespec(value_ns),
    };
    // Raw: nix's TimerFd::set needs a TimerFd owning the fd, and ours is
    // borrowed.
    // SAFETY: the kernel reads one itimerspec; no old value is asked for.
    let r = unsafe { libc::timerfd_settime(fd.as_raw_fd(), flags, &spec, std::ptr::null_mut()) };
    cvt(r as i64, || "timerfd_settime".into()).map(drop)
}

/// Set the expiration count of a timerfd (TFD_IOC_SET_TICKS).
pub fn timerfd_set_ticks(fd: &OwnedFd, ticks: u64) -> Result<()> {
    const TFD_IOC_SET_TICKS: libc::c_ulong = 0x4008_5400;
    // Raw: nix has no wrapper for this ioctl.
    // SAFETY: the ioctl reads one u64.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), TFD_IOC_SET_TICKS, &ticks as *const u64) };
    cvt(r as i64, || "ioctl(TFD_IOC_SET_TICKS)".into()).map(drop)
}

/// Now on clock `clockid`, in nanoseconds.
pub fn clock_now_ns(clockid: i32) -> Result<u64> {
    let ts = nix::time::clock_gettime(nix::time::ClockId::from_raw(clockid))
        .or_sys(|| format!("clock_gettime({clockid})"))?;
    Ok(ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64)
}

pub fn epoll_create() -> Result<OwnedFd> {
    use nix::sys::epoll::{Epoll, EpollCreateFlags};
    Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)
        .map(|e| e.0)
        .or_sys(|| "epoll_create1".into())
}

pub fn inotify_init(flags: i32) -> Result<OwnedFd> {
    use nix::sys::inotify::{InitFlags, Inotify};
    let flags = InitFlags::from_bits_retain(flags) | InitFlags::IN_CLOEXEC;
    Inotify::init(flags)
        .map(OwnedFd::from)
        .or_sys(|| "inotify_init1".into())
}

// inotify_add_watch and inotify_rm_watch stay raw: nix's Inotify owns its
// fd, and ours is borrowed.

pub fn inotify_add_watch(fd: &OwnedFd, path: &str, mask: u32) -> Result<i32> {
    let c = std::ffi::CString::new(path).map_err(|_| SysError::Syscall {
        what: format!("inotify watch on {path:?}"),
        source: Errno(libc::EINVAL),
    })?;
    // SAFETY: `c` is a valid NUL-terminated path.
    let r = unsafe { libc::inotify_add_watch(fd.as_raw_fd(), c.as_ptr(), mask) };
    cvt(r as i64, || format!("inotify_add_watch on {path}")).map(|v| v as i32)
}

pub fn inotify_rm_watch(fd: &OwnedFd, wd: i32) -> Result<()> {
    // SAFETY: plain syscall with integer arguments.
    let r = unsafe { libc::inotify_rm_watch(fd.as_raw_fd(), wd) };
    cvt(r as i64, || format!("inotify_rm_watch({wd})")).map(drop)
}

/// A fanotify group (fanotify_init with exactly `flags`: the group keeps
/// them, FAN_CLOEXEC included, and shows them in fdinfo), close-on-exec
/// in our table in any case.
pub fn fanotify_init(flags: u32, event_flags: u32) -> Result<OwnedFd> {
    // Raw: the workspace's nix is built without its fanotify module.
    // SAFETY: plain syscall with integer arguments.
    let r = unsafe { libc::fanotify_init(flags, event_flags) };
    let fd = own(r as i64, || {
        format!("fanotify_init({flags:#x}, {event_flags:#x})")
    })?;
    fcntl(&fd, FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC))
        .or_sys(|| "fcntl(F_SETFD, FD_CLOEXEC)".into())?;
    Ok(fd)
}

/// fanotify_mark of the fanotify group `fd` on `path`.
pub fn fanotify_mark(fd: &OwnedFd, flags: u32, mask: u64, path: &str) -> Result<()> {
    let what = || format!("fanotify_mark({flags:#x}, {mask:#x}) on {path}");
    let c = std::ffi::CString::new(path).map_err(|_| SysError::Syscall {
        what: what(),
        source: Errno(libc::EINVAL),
    })?;
    // SAFETY: `c` is a NUL-terminated string that outlives the call.
    let r = unsafe { libc::fanotify_mark(fd.as_raw_fd(), flags, mask, libc::AT_FDCWD, c.as_ptr()) };
    cvt(r as i64, what).map(drop)
}

/// An O_PATH fd of the file behind a file handle on the mount `mount_fd`
/// (an inotify watch's; a removed file too, while something keeps it).
pub fn open_handle(mount_fd: &OwnedFd, handle_type: i32, handle: &[u8]) -> Result<OwnedFd> {
    let mut raw = Vec::with_capacity(8 + handle.len());
    raw.extend_from_slice(&(handle.len() as u32).to_ne_bytes());
    raw.extend_from_slice(&handle_type.to_ne_bytes());
    raw.extend_from_slice(handle);
    // Raw: nix has no open_by_handle_at.
    // SAFETY: `raw` is a struct file_handle (bytes, type, then the handle).
    let r = unsafe {
        libc::syscall(
            libc::SYS_open_by_handle_at,
            mount_fd.as_raw_fd(),
            raw.as_ptr(),
            libc::O_PATH | libc::O_CLOEXEC,
        )
    };
    own(r, || "open_by_handle_at".into())
}

pub fn memfd_create(name: &str, flags: u32) -> Result<OwnedFd> {
    use nix::sys::memfd::MFdFlags;
    let flags = MFdFlags::from_bits_retain(flags) | MFdFlags::MFD_CLOEXEC;
    nix::sys::memfd::memfd_create(name.replace('\0', "").as_str(), flags)
        .or_sys(|| format!("memfd_create({name})"))
}

/// Free bytes `off..off + len` of `fd` (fallocate PUNCH_HOLE, the size
/// kept): for a memfd, its pages go back to the machine; they read as
/// zeros.
pub fn punch_hole(fd: BorrowedFd<'_>, off: u64, len: u64, what: &str) -> Result<()> {
    nix::fcntl::fallocate(
        fd,
        nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
        off as libc::off_t,
        len as libc::off_t,
    )
    .map(drop)
    .or_sys(|| format!("fallocate(PUNCH_HOLE, {what}, {len} bytes at {off})"))
}

/// Bytes of the `struct termios` buffer TCGETS and TCSETS use.
const TERMIOS_SIZE: usize = std::mem::size_of::<libc::termios>();

// The termios ioctls stay raw: images hold the kernel's struct termios as
// TCGETS wrote it, and nix's Termios goes through glibc's tcgetattr and
// tcsetattr, which rewrite the struct (c_ispeed, c_ospeed and the tail of
// c_cc), so a restore could set another line speed.

/// Raw struct termios of a terminal (TCGETS).
pub fn tcgets(fd: &OwnedFd) -> Result<Vec<u8>> {
    let mut t = [0u8; TERMIOS_SIZE];
    // SAFETY: TCGETS writes one struct termios, no larger than `t` (the
    // kernel copies bytes: alignment does not matter).
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TCGETS, t.as_mut_ptr()) };
    cvt(r as i64, || "ioctl(TCGETS)".into())?;
    Ok(t.to_vec())
}

/// Apply raw struct termios bytes from [`tcgets`] (TCSETS).
pub fn tcsets(fd: BorrowedFd<'_>, raw: &[u8]) -> Result<()> {
    let mut t = [0u8; TERMIOS_SIZE];
    let n = raw.len().min(TERMIOS_SIZE);
    t[..n].copy_from_slice(&raw[..n]);
    // SAFETY: TCSETS reads one struct termios, no larger than `t`.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TCSETS, t.as_ptr()) };
    cvt(r as i64, || "ioctl(TCSETS)".into()).map(drop)
}

/// Raw struct winsize (TIOCGWINSZ).
pub fn get_winsize(fd: &OwnedFd) -> Result<Vec<u8>> {
    let mut w = [0u16; 4];
    // SAFETY: TIOCGWINSZ writes one struct winsize (four u16).
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCGWINSZ, w.as_mut_ptr()) };
    cvt(r as i64, || "ioctl(TIOCGWINSZ)".into())?;
    Ok(w.iter().flat_map(|v| v.to_ne_bytes()).collect())
}

/// Make process group `pgrp` the foreground group of terminal `fd`.
pub fn set_foreground(fd: BorrowedFd<'_>, pgrp: i32) -> Result<()> {
    nix::unistd::tcsetpgrp(fd, Pid::from_raw(pgrp)).or_sys(|| format!("ioctl(TIOCSPGRP, {pgrp})"))
}

/// Whether `fd` is a terminal.
pub fn is_tty(fd: BorrowedFd<'_>) -> bool {
    nix::unistd::isatty(fd).unwrap_or(false)
}

/// Open a new description of the pipe, FIFO, memfd or file behind `fd`
/// through /proc/self/fd (a FIFO open never blocks here: O_NONBLOCK).
pub fn reopen(fd: &OwnedFd, accmode: i32) -> Result<OwnedFd> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    open(&path, accmode | libc::O_NONBLOCK)
}

/// A new hard link `to` of the file that `from` names, following a last
/// symbolic link of `from`: through /proc/PID/fd/N, the very file a
/// process holds (linkat(2) with AT_SYMLINK_FOLLOW; the file must still
/// have a name, the kernel refuses ENOENT for one whose last link is gone).
pub fn link_following(from: &str, to: &str) -> Result<()> {
    nix::unistd::linkat(
        nix::fcntl::AT_FDCWD,
        from,
        nix::fcntl::AT_FDCWD,
        to,
        nix::fcntl::AtFlags::AT_SYMLINK_FOLLOW,
    )
    .or_sys(|| format!("link of {from} as {to}"))
}

/// open(2) with raw flags (close-on-exec added).
pub fn open(path: &str, flags: i32) -> Result<OwnedFd> {
    if path.contains('\0') {
        return Err(SysError::Syscall {
            what: format!("open of {path:?}"),
            source: Errno(libc::EINVAL),
        });
    }
    let flags = OFlag::from_bits_retain(flags) | OFlag::O_CLOEXEC;
    let mode = nix::sys::stat::Mode::from_bits_retain(0o600);
    nix::fcntl::open(path, flags, mode).or_sys(|| format!("open of {path}"))
}

// The winsize and pty ioctls are raw: nix has no wrappers for them (its
// ioctl macros only generate unsafe functions).

const TIOCGPTN: u64 = 0x8004_5430;
const TIOCSPTLCK: libc::c_ulong = 0x4004_5431;
const TIOCGPTPEER: libc::c_ulong = 0x5441;

/// Index of the pty pair whose master is `fd` (TIOCGPTN).
pub fn pty_index(fd: &OwnedFd) -> Result<u32> {
    // An unsigned int: the same four bytes.
    ioctl_get_int(fd, TIOCGPTN, || "ioctl(TIOCGPTN)".into()).map(|n| n as u32)
}

/// Whether the pty whose master is `fd` is still locked (TIOCGPTLCK).
pub fn pty_locked(fd: &OwnedFd) -> Result<bool> {
    const TIOCGPTLCK: u64 = 0x8004_5439;
    ioctl_get_int(fd, TIOCGPTLCK, || "ioctl(TIOCGPTLCK)".into()).map(|v| v != 0)
}

/// Lock or unlock the slave side of a pty (TIOCSPTLCK).
pub fn set_pty_locked(fd: &OwnedFd, locked: bool) -> Result<()> {
    let v: libc::c_int = locked as libc::c_int;
    // SAFETY: TIOCSPTLCK reads one int.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), TIOCSPTLCK, &v) };
    cvt(r as i64, || "ioctl(TIOCSPTLCK)".into()).map(drop)
}

/// A new description of the slave of the pty whose master is `master`
/// (TIOCGPTPEER: no path lookup, never becomes a controlling terminal).
pub fn pty_peer(master: &OwnedFd, accmode: i32) -> Result<OwnedFd> {
    // Not O_CLOEXEC: unlike open(2), which strips it, TIOCGPTPEER keeps
    // the flags it is given in the file's f_flags, so the description
    // would show O_CLOEXEC in fdinfo for good, in every process it is
    // handed to (a restored shell's fd 0 then differs from its image).
    // SAFETY: TIOCGPTPEER takes open flags as an integer and returns an fd.
    let r = unsafe { libc::ioctl(master.as_raw_fd(), TIOCGPTPEER, accmode | libc::O_NOCTTY) };
    let fd = own(r as i64, || "ioctl(TIOCGPTPEER)".into())?;
    set_cloexec(&fd)?;
    Ok(fd)
}

/// Open a new pty pair with index `want` through the multiplexer `ptmx`
/// (/dev/ptmx, or the ptmx of another devpts instance): devpts hands out
/// the lowest free index, so the pairs below it are opened and held until
/// we get there.
pub fn open_pty_index(ptmx: &str, want: u32) -> Result<OwnedFd> {
    let mut below = Vec::new();
    loop {
        let m = open(ptmx, libc::O_RDWR | libc::O_NOCTTY)?;
        let idx = pty_index(&m)?;
        if idx == want {
            set_pty_locked(&m, false)?;
            return Ok(m);
        }
        if idx > want || below.len() > 4096 {
            return Err(SysError::Syscall {
                what: format!("opening pseudo-terminal {want} (/dev/pts/{want} is in use)"),
                source: Errno(libc::EBUSY),
            });
        }
        below.push(m);
    }
}

/// Foreground process group of the terminal (TIOCGPGRP; works on a pty
/// master without being its session).
pub fn foreground(fd: &OwnedFd) -> Result<i32> {
    nix::unistd::tcgetpgrp(fd)
        .map(Pid::as_raw)
        .or_sys(|| "ioctl(TIOCGPGRP)".into())
}

/// Apply raw struct winsize bytes (TIOCSWINSZ).
pub fn set_winsize(fd: &OwnedFd, raw: &[u8]) -> Result<()> {
    let mut w = [0u16; 4];
    for (i, c) in raw.chunks_exact(2).take(4).enumerate() {
        w[i] = u16::from_ne_bytes([c[0], c[1]]);
    }
    // SAFETY: TIOCSWINSZ reads one struct winsize (four u16).
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSWINSZ, w.as_ptr()) };
    cvt(r as i64, || "ioctl(TIOCSWINSZ)".into()).map(drop)
}

/// The file system type (statfs f_type: its magic number) of `file`.
pub fn fs_magic(file: &std::fs::File) -> Result<i64> {
    nix::sys::statfs::fstatfs(file)
        .map(|s| s.filesystem_type().0)
        .or_sys(|| "fstatfs".into())
}

/// The file system type (statfs f_type) of the file at `path`.
pub fn fs_magic_at(path: &std::path::Path) -> Result<i64> {
    nix::sys::statfs::statfs(path)
        .map(|s| s.filesystem_type().0)
        .or_sys(|| format!("statfs({})", path.display()))
}

/// The statfs magic of hugetlbfs.
pub const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// The page size of the file at `path` when it is on hugetlbfs (its
/// statfs block size: the size of its huge pages), None on any other file
/// system. For a mapping, `path` is its /proc/PID/map_files link.
pub fn huge_page_size_at(path: &std::path::Path) -> Result<Option<u64>> {
    let s = nix::sys::statfs::statfs(path).or_sys(|| format!("statfs({})", path.display()))?;
    Ok(huge_page_size_of(&s))
}

/// [`huge_page_size_at`] of an open file.
pub fn huge_page_size(file: &std::fs::File) -> Result<Option<u64>> {
    let s = nix::sys::statfs::fstatfs(file).or_sys(|| "fstatfs".into())?;
    Ok(huge_page_size_of(&s))
}

fn huge_page_size_of(s: &nix::sys::statfs::Statfs) -> Option<u64> {
    (s.filesystem_type().0 == HUGETLBFS_MAGIC).then_some(s.block_size() as u64)
}

/// Set the access and modification times of `path` (a link itself, not
/// what it points to) to `ns` nanoseconds since the epoch.
pub fn set_times_nofollow(path: &std::path::Path, ns: i64) -> Result<()> {
    let ts =
        nix::sys::time::TimeSpec::new(ns.div_euclid(1_000_000_000), ns.rem_euclid(1_000_000_000));
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &ts,
        &ts,
        nix::sys::stat::UtimensatFlags::NoFollowSymlink,
    )
    .or_sys(|| format!("utimensat({})", path.display()))
}

/// mkfifo(3): a FIFO at `path` with permission bits `mode` (less the umask).
pub fn mkfifo(path: &str, mode: u32) -> Result<()> {
    let c = std::ffi::CString::new(path).map_err(|_| SysError::Syscall {
        what: format!("mkfifo of {path:?}"),
        source: Errno(libc::EINVAL),
    })?;
    // SAFETY: `c` is a NUL-terminated string that outlives the call.
    let r = unsafe { libc::mkfifo(c.as_ptr(), mode as libc::mode_t) };
    cvt(r as i64, || format!("mkfifo {path}")).map(drop)
}

/// Make the device node `path`: `mode` holds its type (S_IFCHR or
/// S_IFBLK) and permission bits (the umask is undone: the bits are set
/// again with chmod), `rdev` its device number.
pub fn mknod(path: &str, mode: u32, rdev: u64) -> Result<()> {
    use nix::sys::stat::{Mode, SFlag};
    let kind = SFlag::from_bits_truncate(mode & libc::S_IFMT);
    let perm = Mode::from_bits_truncate(mode & 0o7777);
    nix::sys::stat::mknod(path, kind, perm, rdev).or_sys(|| format!("mknod {path}"))?;
    chmod(path, mode)
}

/// Set the permission bits of `mode` (& 07777) on `path` (chmod).
pub fn chmod(path: &str, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o7777)).map_err(|e| {
        SysError::Syscall {
            what: format!("chmod {path}"),
            source: Errno(e.raw_os_error().unwrap_or(libc::EIO)),
        }
    })
}

/// fchown `fd` to `uid`:`gid`, then fchmod it to `mode` (after: chown may
/// clear set-user-ID and set-group-ID).
pub fn set_owner_and_mode(fd: &OwnedFd, uid: u32, gid: u32, mode: u32) -> Result<()> {
    nix::unistd::fchown(
        fd,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
    )
    .or_sys(|| format!("fchown {uid}:{gid}"))?;
    nix::sys::stat::fchmod(fd, nix::sys::stat::Mode::from_bits_retain(mode & 0o7777))
        .or_sys(|| format!("fchmod {:o}", mode & 0o7777))
}

/// Set the access and modification times of the file open as `fd`, in
/// nanoseconds since the epoch (futimens).
pub fn set_file_times(fd: &OwnedFd, atime_ns: i64, mtime_ns: i64) -> Result<()> {
    let ts = |ns: i64| {
        nix::sys::time::TimeSpec::new(ns.div_euclid(1_000_000_000), ns.rem_euclid(1_000_000_000))
    };
    nix::sys::stat::futimens(fd.as_fd(), &ts(atime_ns), &ts(mtime_ns)).or_sys(|| "futimens".into())
}
