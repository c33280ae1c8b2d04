//! What libcr (the application-cooperation library, crate `cr-libcr`)
//! needs from the kernel and the C runtime: its signal handler for
//! signal-context callbacks, signals to one thread, and the symbol name of
//! a callback for error messages.

use crate::error::{Errno, Result, SysError};
use std::ffi::CStr;

/// The real-time signal libcr uses to run signal-context callbacks:
/// SIGRTMAX - 2 (glibc keeps the first real-time signals for itself).
pub fn callback_signal() -> i32 {
    libc::SIGRTMAX() - 2
}

/// Install `handler` for real-time signal `sig` (SA_RESTART, so that the
/// interrupted thread's system calls go on; the signal stays blocked
/// while the handler runs).
pub fn install_rt_handler(sig: i32, handler: extern "C" fn(i32)) -> Result<()> {
    // Real-time signals have no `Signal` variant in nix: raw sigaction.
    // SAFETY: an all-zero sigaction is valid (empty mask, no flags).
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = handler as usize;
    sa.sa_flags = libc::SA_RESTART;
    // SAFETY: `sa` is initialised; the handler is an `extern "C"` function
    // of libcr's code, which stays loaded as long as the program runs.
    let r = unsafe { libc::sigaction(sig, &sa, std::ptr::null_mut()) };
    if r != 0 {
        return Err(SysError::Syscall {
            what: format!("sigaction of signal {sig}"),
            source: Errno::last(),
        });
    }
    Ok(())
}

/// Close every fd from 3 up (close_range(2)): for the cr_checkpoint a
/// libcr program starts on itself (no agent), which must hold none of the
/// program's files (its sockets and pipes would have a holder outside the
/// tree being checkpointed).
pub fn close_inherited_fds() -> Result<()> {
    // SAFETY: close_range takes integers; called at the start of a program
    // that owns no fd above 2 yet (Rust's own are opened later).
    let r = unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    if r != 0 {
        return Err(SysError::Syscall {
            what: "close_range of the inherited fds".into(),
            source: Errno::last(),
        });
    }
    Ok(())
}

/// Run `f` when the process exits normally (atexit(3)): libcr removes its
/// socket file then.
pub fn at_exit(f: extern "C" fn()) -> Result<()> {
    // SAFETY: `f` is an `extern "C"` function of libcr's code, which stays
    // loaded as long as the program runs; atexit only records it.
    let r = unsafe { libc::atexit(f) };
    if r != 0 {
        return Err(SysError::Syscall {
            what: "atexit".into(),
            source: Errno::last(),
        });
    }
    Ok(())
}

/// Send signal `sig` to thread `tid` of process `pid` (tgkill(2)).
pub fn tgkill(pid: i32, tid: i32, sig: i32) -> Result<()> {
    // SAFETY: tgkill takes three integers and touches no memory of ours.
    let r = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, sig) };
    if r != 0 {
        return Err(SysError::Syscall {
            what: format!("tgkill of thread {tid} of process {pid}"),
            source: Errno::last(),
        });
    }
    Ok(())
}

/// The name of the function at code address `addr` in this process: from
/// the dynamic symbol tables, else from the full symbol table of the file
/// it belongs to (static functions of a program that is not stripped),
/// else the file and the offset.
pub fn symbol_name(addr: usize) -> Option<String> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the loader's tables and fills `info`.
    let r = unsafe { libc::dladdr(addr as *const libc::c_void, &mut info) };
    if r == 0 {
        return None;
    }
    let text = |p: *const libc::c_char| {
        // SAFETY: dladdr's strings are NUL-terminated and live as long as
        // the object they describe is loaded.
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    if let Some(s) = text(info.dli_sname) {
        if info.dli_saddr as usize == addr {
            return Some(s);
        }
    }
    let base = info.dli_fbase as usize;
    let file = text(info.dli_fname).unwrap_or_default();
    // The main program's name is the one it was started with: through
    // /proc/self/exe when that path does not lead to it any more.
    [file.as_str(), "/proc/self/exe"]
        .iter()
        .filter(|f| !f.is_empty())
        .find_map(|f| crate::elf::function_at(f, base as u64, addr as u64))
        .or_else(|| Some(format!("{file}+{:#x}", addr - base)))
}
