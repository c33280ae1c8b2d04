//! The C ABI of `libcr.so`, declared in `include/libcr.h` (where every
//! function is documented). Functions return what BLCR's did: ids >= 0,
//! else -1 with errno set; `cr_checkpoint` returns 0 / > 0 / -error.

use crate::registry::{self, CFn, Callback, Context, Func};
use crate::request::{self, Finished, RequestError, Scope};
use crate::{cs, errors, helper, info};
use libc::{c_char, c_int, c_uint, c_ulong, c_void, pid_t};
use nix::errno::Errno;
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::Mutex;

pub const CR_THREAD_CONTEXT: c_int = 0x4000000;
pub const CR_SIGNAL_CONTEXT: c_int = 0x2000000;

pub const CR_SCOPE_PROC: c_int = 0;
pub const CR_SCOPE_TREE: c_int = 3;
/// Ours: the whole cluster job.
pub const CR_SCOPE_JOB: c_int = 4;

pub const CR_STATE_IDLE: c_int = 0;
pub const CR_STATE_ACTIVE: c_int = 2;

fn err(code: i32) -> c_int {
    Errno::set_raw(code);
    -1
}

#[no_mangle]
pub extern "C" fn cr_init() -> c_int {
    match helper::init() {
        Ok(()) => 0,
        Err(e) => {
            tracing::warn!(error = %e, "cr_init failed");
            err(libc::EIO)
        }
    }
}

fn callback(func: Option<CFn>, arg: *mut c_void, flags: c_int) -> Result<Callback, c_int> {
    let Some(f) = func else {
        return Err(libc::EINVAL);
    };
    let context = match flags & (CR_THREAD_CONTEXT | CR_SIGNAL_CONTEXT) {
        CR_THREAD_CONTEXT => Context::Thread,
        CR_SIGNAL_CONTEXT => Context::Signal,
        _ => return Err(libc::EINVAL),
    };
    let addr = f as usize;
    Ok(Callback {
        func: Func::C {
            f,
            arg: arg as usize,
        },
        context,
        tid: nix::unistd::gettid().as_raw(),
        name: cr_sys::coop::symbol_name(addr).unwrap_or_else(|| format!("{addr:#x}")),
    })
}

#[no_mangle]
pub extern "C" fn cr_register_callback(func: Option<CFn>, arg: *mut c_void, flags: c_int) -> c_int {
    if !helper::initialised() && cr_init() != 0 {
        return -1;
    }
    match callback(func, arg, flags) {
        Ok(cb) => match registry::register(cb) {
            Ok(id) => id as c_int,
            Err(_) => err(libc::ENOSPC),
        },
        Err(e) => err(e),
    }
}

#[no_mangle]
pub extern "C" fn cr_replace_callback(
    id: c_int,
    func: Option<CFn>,
    arg: *mut c_void,
    flags: c_int,
) -> c_int {
    let Ok(id) = usize::try_from(id) else {
        return err(libc::EINVAL);
    };
    match callback(func, arg, flags) {
        Ok(cb) => match registry::replace(id, cb) {
            Ok(()) => 0,
            Err(registry::RegisterError::Full) => err(libc::ENOSPC),
            Err(_) => err(libc::EINVAL),
        },
        Err(e) => err(e),
    }
}

#[no_mangle]
pub extern "C" fn cr_checkpoint(flags: c_int) -> c_int {
    let r = helper::checkpoint(flags);
    if r < 0 {
        Errno::set_raw(-r);
    }
    r
}

#[no_mangle]
pub extern "C" fn cr_enter_cs(_id: c_int) -> c_int {
    cs::enter();
    0
}

#[no_mangle]
pub extern "C" fn cr_tryenter_cs(_id: c_int) -> c_int {
    if cs::try_enter() {
        0
    } else {
        err(libc::EAGAIN)
    }
}

#[no_mangle]
pub extern "C" fn cr_leave_cs(_id: c_int) -> c_int {
    if cs::leave() {
        0
    } else {
        err(libc::EINVAL)
    }
}

#[no_mangle]
pub extern "C" fn cr_status() -> c_int {
    if cs::pending() {
        CR_STATE_ACTIVE
    } else {
        CR_STATE_IDLE
    }
}

/// `struct cr_checkpoint_info`.
#[repr(C)]
pub struct CrCheckpointInfo {
    pub signal: c_int,
    pub dest: *const c_char,
    pub requester: pid_t,
    pub target: pid_t,
    pub scope: c_int,
}

/// `struct cr_restart_info` (BLCR's two fields, then ours).
#[repr(C)]
pub struct CrRestartInfo {
    pub requester: pid_t,
    pub src: *const c_char,
    pub hostname_before: *const c_char,
    pub hostname_now: *const c_char,
    pub node_changed: c_int,
    pub addresses_changed: c_int,
    pub addresses_before: *const c_char,
    pub addresses_now: *const c_char,
}

/// A C string that lives as long as the program (the info structs are
/// few: one per checkpoint or restart).
fn leak(s: &str) -> *const c_char {
    CString::new(s.replace('\0', ""))
        .unwrap_or_default()
        .into_raw()
}

#[no_mangle]
pub extern "C" fn cr_get_checkpoint_info() -> *const CrCheckpointInfo {
    let Some(i) = info::checkpoint_info() else {
        err(errors::CR_ENOTCB);
        return std::ptr::null();
    };
    Box::leak(Box::new(CrCheckpointInfo {
        signal: 0,
        dest: leak(&i.dest),
        requester: 0,
        target: std::process::id() as pid_t,
        scope: 0,
    }))
}

#[no_mangle]
pub extern "C" fn cr_get_restart_info() -> *const CrRestartInfo {
    let Some(i) = info::restart_info() else {
        err(errors::CR_ENOTCB);
        return std::ptr::null();
    };
    Box::leak(Box::new(CrRestartInfo {
        requester: 0,
        src: leak(&i.src),
        hostname_before: leak(&i.hostname_before),
        hostname_now: leak(&i.hostname_now),
        node_changed: c_int::from(i.node_changed()),
        addresses_changed: c_int::from(i.addresses_changed()),
        addresses_before: leak(&i.addresses_before.join(" ")),
        addresses_now: leak(&i.addresses_now.join(" ")),
    }))
}

static TEXTS: Mutex<Option<HashMap<c_int, usize>>> = Mutex::new(None);

#[no_mangle]
pub extern "C" fn cr_strerror(code: c_int) -> *const c_char {
    let code = code.abs();
    let mut t = TEXTS.lock().unwrap_or_else(|e| e.into_inner());
    let p = *t
        .get_or_insert_with(HashMap::new)
        .entry(code)
        .or_insert_with(|| leak(&errors::text(code)) as usize);
    p as *const c_char
}

/// `cr_checkpoint_args_t`.
#[repr(C)]
pub struct CrCheckpointArgs {
    pub cr_version: c_int,
    pub cr_scope: c_int,
    pub cr_target: pid_t,
    pub cr_fd: c_int,
    pub cr_signal: c_int,
    pub cr_timeout: c_uint,
    pub cr_flags: c_uint,
}

#[no_mangle]
pub extern "C" fn cri_init_checkpoint_args_t(
    version: c_int,
    args: Option<&mut CrCheckpointArgs>,
) -> c_int {
    let Some(a) = args else {
        return err(libc::EINVAL);
    };
    *a = CrCheckpointArgs {
        cr_version: version,
        cr_scope: 0,
        cr_target: 0,
        cr_fd: -1,
        cr_signal: 0,
        cr_timeout: 0,
        cr_flags: 0,
    };
    0
}

#[no_mangle]
pub extern "C" fn cr_request_checkpoint(
    args: Option<&CrCheckpointArgs>,
    handle: Option<&mut c_ulong>,
) -> c_int {
    let (Some(a), Some(h)) = (args, handle) else {
        return err(libc::EINVAL);
    };
    if a.cr_target != 0 && a.cr_target != std::process::id() as pid_t {
        // Only oneself: another process is cr_checkpoint's business.
        return err(libc::EINVAL);
    }
    let scope = match a.cr_scope {
        CR_SCOPE_PROC | CR_SCOPE_TREE => Scope::Tree,
        CR_SCOPE_JOB => Scope::Job,
        _ => return err(errors::CR_ENOSUPPORT),
    };
    match request::request(scope) {
        Ok(id) => {
            *h = id as c_ulong;
            0
        }
        Err(e) => {
            tracing::warn!(error = %e, "cr_request_checkpoint");
            err(match e {
                RequestError::Init(_) => libc::EIO,
                RequestError::NoAgent => errors::CR_ENOSUPPORT,
                RequestError::Fallback(_) => errors::CR_ENOSUPPORT,
                RequestError::Refused(_) => libc::EPERM,
            })
        }
    }
}

#[no_mangle]
pub extern "C" fn cr_poll_checkpoint(
    handle: Option<&mut c_ulong>,
    timeout: Option<&mut libc::timeval>,
) -> c_int {
    let Some(h) = handle else {
        return err(libc::EINVAL);
    };
    let limit = timeout.map(|tv| {
        std::time::Duration::from_secs(tv.tv_sec.max(0) as u64)
            + std::time::Duration::from_micros(tv.tv_usec.max(0) as u64)
    });
    match request::poll(*h, limit) {
        (false, _) => err(libc::EINVAL),
        (true, None) => 0,
        (true, Some(Finished::Done(_))) => 1,
        (true, Some(Finished::Failed(m))) => {
            tracing::warn!(error = m, "requested checkpoint failed");
            err(errors::CR_ETEMPFAIL)
        }
        (true, Some(Finished::Restarted)) => err(errors::CR_ERESTARTED),
    }
}
