//! A process being rebuilt by a restore: a stub (our clone with the saved
//! PID) driven by injected system calls, with a scratch area of its own for
//! their memory arguments (see `restore`).

use cr_sys::mem;
use cr_sys::remote::Injector;

/// Scratch memory for syscall arguments inside the stub.
pub const SCRATCH: u64 = 64 * 1024;
/// The last bytes of the scratch area hold per-thread arguments (the largest:
/// supplementary groups).
pub const THREAD_ARGS: u64 = 12 * 1024;

pub struct Stub<'a> {
    pub inj: Injector<'a>,
    pub pid: i32,
    /// The scratch area (0 until mapped).
    pub scratch: u64,
    cursor: u64,
    /// The stub's fd number of a pidfd of the restorer (see [`Stub::grab`]).
    pub grab_pidfd: Option<u64>,
}

impl<'a> Stub<'a> {
    pub fn new(inj: Injector<'a>) -> Stub<'a> {
        Stub {
            pid: inj.pid(),
            inj,
            scratch: 0,
            cursor: 0,
            grab_pidfd: None,
        }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    pub fn call(
        &mut self,
        name: &'static str,
        nr: i64,
        args: [u64; 6],
    ) -> cr_sys::error::Result<u64> {
        self.inj.call(name, nr, args)
    }

    /// Copy bytes into the scratch area; returns their address in the stub.
    pub fn put(&mut self, data: &[u8]) -> cr_sys::error::Result<u64> {
        let len = (data.len() as u64).div_ceil(16) * 16;
        if self.scratch == 0 || len > SCRATCH - THREAD_ARGS {
            return Err(cr_sys::SysError::Syscall {
                what: format!(
                    "an argument of {} bytes does not fit the restorer's scratch memory",
                    data.len()
                ),
                source: cr_sys::Errno(libc::E2BIG),
            });
        }
        if self.cursor + len > SCRATCH - THREAD_ARGS {
            self.cursor = 0;
        }
        let addr = self.scratch + self.cursor;
        mem::write_vm(self.pid, addr, data)?;
        self.cursor += len;
        Ok(addr)
    }

    pub fn put_str(&mut self, s: &str) -> cr_sys::error::Result<u64> {
        self.put(&mem::cstring_bytes(s))
    }

    /// openat(AT_FDCWD, path, flags) inside the stub.
    pub fn open(&mut self, path: &str, flags: i32) -> cr_sys::error::Result<u64> {
        let p = self.put_str(path)?;
        self.call(
            "openat",
            libc::SYS_openat,
            [libc::AT_FDCWD as u64, p, flags as u64, 0, 0, 0],
        )
    }

    /// openat(dir, rel, flags) inside the stub, `dir` being a directory fd
    /// of the restorer's (taken for the call, as [`Stub::grab`] does): a
    /// path as the restorer sees it, whatever the stub's mount namespace.
    pub fn open_at_ours(&mut self, dir: i32, rel: &str, flags: i32) -> cr_sys::error::Result<u64> {
        let Some(pidfd) = self.grab_pidfd else {
            return Err(cr_sys::SysError::Syscall {
                what: "pidfd_getfd (the restorer's pidfd is gone)".into(),
                source: cr_sys::Errno(libc::EBADF),
            });
        };
        let d = self.call(
            "pidfd_getfd",
            libc::SYS_pidfd_getfd,
            [pidfd, dir as u64, 0, 0, 0, 0],
        )?;
        let p = self.put_str(rel);
        let r =
            p.and_then(|p| self.call("openat", libc::SYS_openat, [d, p, flags as u64, 0, 0, 0]));
        self.call("close", libc::SYS_close, [d, 0, 0, 0, 0, 0])?;
        r
    }

    /// Take the restorer's fd `ours` into the stub as fd `want` (the same
    /// open file description, through pidfd_getfd on the restorer's pidfd
    /// the stub inherited).
    pub fn grab(&mut self, ours: i32, want: i32, cloexec: bool) -> cr_sys::error::Result<()> {
        let Some(pidfd) = self.grab_pidfd else {
            return Err(cr_sys::SysError::Syscall {
                what: "pidfd_getfd (the restorer's pidfd is gone)".into(),
                source: cr_sys::Errno(libc::EBADF),
            });
        };
        let got = self.call(
            "pidfd_getfd",
            libc::SYS_pidfd_getfd,
            [pidfd, ours as u64, 0, 0, 0, 0],
        )?;
        self.place(got, want, cloexec)
    }

    /// Move the new fd `got` (close-on-exec, as pidfd_getfd makes it) to number `want`.
    pub fn place(&mut self, got: u64, want: i32, cloexec: bool) -> cr_sys::error::Result<()> {
        let flag = if cloexec { libc::O_CLOEXEC as u64 } else { 0 };
        if got == want as u64 {
            if !cloexec {
                self.call(
                    "fcntl(F_SETFD)",
                    libc::SYS_fcntl,
                    [got, libc::F_SETFD as u64, 0, 0, 0, 0],
                )?;
            }
            return Ok(());
        }
        self.call("dup3", libc::SYS_dup3, [got, want as u64, flag, 0, 0, 0])?;
        self.call("close", libc::SYS_close, [got, 0, 0, 0, 0, 0])?;
        Ok(())
    }

    /// The per-thread argument area at the end of the scratch memory.
    pub fn thread_args(&self) -> u64 {
        self.scratch + SCRATCH - THREAD_ARGS
    }
}
