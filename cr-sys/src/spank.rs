//! Slurm's SPANK plugin interface (`<slurm/spank.h>` of Slurm 22.05), for
//! the `cr-spank` plugin (a `cdylib` that Slurm loads with dlopen).
//!
//! A plugin crate implements [`Plugin`] and invokes [`spank_plugin!`],
//! which exports what Slurm's plugin loader looks for (`plugin_name`,
//! `plugin_type`, `plugin_version`, `spank_plugin_version`) and the hooks
//! (`slurm_spank_init`, `slurm_spank_task_init`, ...), each calling the
//! trait through [`dispatch`].
//!
//! Slurm's side of the interface (`spank_get_item`, `spank_option_register`,
//! ...) lives in the program that loads the plugin (sbatch, srun, salloc,
//! slurmstepd, slurmd): it is looked up at run time with
//! `dlsym(RTLD_DEFAULT)` rather than linked, so that the workspace builds
//! and links without Slurm's libraries, and a missing function is an error
//! naming it instead of a failed dlopen.
//!
//! Kernel-level surprise of the interface: `spank_get_item` is variadic;
//! its item decides the types of the out-pointers (see spank.h's table).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Mutex;

/// The `plugin_version` Slurm's loader demands: its own
/// `SLURM_VERSION_NUMBER`, of which it compares the major and minor parts
/// (22.05 here).
pub const SLURM_VERSION_NUMBER: u32 = 0x16_05_08;

/// What went wrong in a SPANK call.
#[derive(Debug, thiserror::Error)]
pub enum SpankError {
    #[error("the Slurm program that loaded the plugin lacks {0} (not Slurm 22.05's SPANK?)")]
    Missing(&'static str),
    #[error("{call}: Slurm error {code}")]
    Call { call: String, code: c_int },
    #[error("{0} holds a NUL byte")]
    Nul(String),
}

/// The contexts a plugin is loaded in (`enum spank_context`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Context {
    Error,
    /// srun.
    Local,
    /// slurmstepd: the job's tasks.
    Remote,
    /// sbatch, salloc.
    Allocator,
    Slurmd,
    JobScript,
}

/// The hooks Slurm calls (see spank.h's diagram); every one returns 0 or
/// a negative value (an error fails the job or the command).
pub trait Plugin {
    /// The plugin's options, registered in every context by
    /// `slurm_spank_init` before [`Plugin::init`].
    const OPTIONS: &'static [OptionSpec];
    /// `slurm_spank_init` (every context).
    fn init(_sp: &Spank, _args: &[String]) -> Result<(), String> {
        Ok(())
    }
    /// `slurm_spank_init_post_opt`: options are parsed.
    fn init_post_opt(_sp: &Spank, _args: &[String]) -> Result<(), String> {
        Ok(())
    }
    /// `slurm_spank_task_init`: in a task, as the user, before its exec.
    fn task_init(_sp: &Spank, _args: &[String]) -> Result<(), String> {
        Ok(())
    }
}

/// Whether an option takes an argument (`has_arg`: 0, 1, 2 as in getopt).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HasArg {
    No = 0,
    Required = 1,
    Optional = 2,
}

/// A plugin option (`--NAME[=ARG]` of sbatch, srun and salloc).
#[derive(Debug)]
pub struct OptionSpec {
    pub name: &'static str,
    /// One word naming the argument.
    pub arginfo: &'static str,
    pub usage: &'static str,
    pub has_arg: HasArg,
}

/// `struct spank_option`.
#[repr(C)]
struct RawOption {
    name: *const c_char,
    arginfo: *const c_char,
    usage: *const c_char,
    has_arg: c_int,
    val: c_int,
    cb: Option<extern "C" fn(c_int, *const c_char, c_int) -> c_int>,
}

/// The C form of each registered option, by name: Slurm keeps the pointer
/// it was given, so every one lives as long as the plugin (leaked once).
struct Registered(Vec<(&'static str, &'static RawOption)>);

// SAFETY: the raw pointers in RawOption point to leaked CStrings that are
// never written after their creation; sharing them between threads is fine.
unsafe impl Send for Registered {}

static OPTIONS: Mutex<Registered> = Mutex::new(Registered(Vec::new()));

fn leak_cstr(s: &str) -> *const c_char {
    CString::new(s)
        .map(|c| c.into_raw() as *const c_char)
        .unwrap_or(std::ptr::null())
}

/// The C option of `spec`, made once.
fn raw_option(spec: &'static OptionSpec) -> &'static RawOption {
    let mut reg = OPTIONS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, r)) = reg.0.iter().find(|(n, _)| *n == spec.name) {
        return r;
    }
    let r: &'static RawOption = Box::leak(Box::new(RawOption {
        name: leak_cstr(spec.name),
        arginfo: if spec.has_arg == HasArg::No {
            std::ptr::null()
        } else {
            leak_cstr(spec.arginfo)
        },
        usage: leak_cstr(spec.usage),
        has_arg: spec.has_arg as c_int,
        val: reg.0.len() as c_int,
        cb: None,
    }));
    reg.0.push((spec.name, r));
    r
}

/// Looks up a function of Slurm's side by name.
fn sym(name: &'static CStr) -> Result<*mut c_void, SpankError> {
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only reads.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if p.is_null() {
        Err(SpankError::Missing(name.to_str().unwrap_or("?")))
    } else {
        Ok(p)
    }
}

// spank_item_t values used here (enum spank_item in spank.h).
const S_JOB_ID: c_int = 2;
const S_JOB_STEPID: c_int = 3;
const S_JOB_ARGV: c_int = 9;
const S_JOB_ENV: c_int = 10;
const S_SLURM_RESTART_COUNT: c_int = 29;

type GetItem = unsafe extern "C" fn(*mut c_void, c_int, ...) -> c_int;
type Register = unsafe extern "C" fn(*mut c_void, *const RawOption) -> c_int;
type GetOpt = unsafe extern "C" fn(*mut c_void, *const RawOption, *mut *mut c_char) -> c_int;
type ContextFn = unsafe extern "C" fn() -> c_int;
type LogFn = unsafe extern "C" fn(*const c_char, ...);

/// The handle Slurm passes to every hook (`spank_t`).
pub struct Spank {
    raw: *mut c_void,
}

/// A NULL-terminated `char **` as strings (lossy).
///
/// SAFETY: `v` is NULL or points to a NULL-terminated array of
/// NUL-terminated strings that outlive the call.
unsafe fn string_array(v: *const *const c_char, max: Option<usize>) -> Vec<String> {
    let mut out = Vec::new();
    if v.is_null() {
        return out;
    }
    let mut i = 0;
    loop {
        if max.is_some_and(|m| i >= m) {
            break;
        }
        // SAFETY: the caller's contract: v[i] is readable up to the NULL.
        let p = unsafe { *v.add(i) };
        if p.is_null() {
            break;
        }
        // SAFETY: p is a NUL-terminated string (caller's contract).
        out.push(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned());
        i += 1;
    }
    out
}

impl Spank {
    /// The context the plugin runs in.
    pub fn context() -> Context {
        let Ok(f) = sym(c"spank_context") else {
            return Context::Error;
        };
        // SAFETY: spank_context takes no argument and returns an enum value.
        let c = unsafe { std::mem::transmute::<*mut c_void, ContextFn>(f)() };
        match c {
            1 => Context::Local,
            2 => Context::Remote,
            3 => Context::Allocator,
            4 => Context::Slurmd,
            5 => Context::JobScript,
            _ => Context::Error,
        }
    }

    fn get_item(&self) -> Result<GetItem, SpankError> {
        let f = sym(c"spank_get_item")?;
        // SAFETY: spank_get_item has this (variadic) signature in spank.h.
        Ok(unsafe { std::mem::transmute::<*mut c_void, GetItem>(f) })
    }

    fn u32_item(&self, item: c_int, what: &str) -> Result<u32, SpankError> {
        let f = self.get_item()?;
        let mut v: u32 = 0;
        // SAFETY: these items take one `uint32_t *` (spank.h); self.raw is
        // the handle Slurm passed to the running hook.
        let rc = unsafe { f(self.raw, item, &mut v as *mut u32) };
        if rc != 0 {
            return Err(SpankError::Call {
                call: format!("spank_get_item({what})"),
                code: rc,
            });
        }
        Ok(v)
    }

    /// The Slurm job id (`S_JOB_ID`; remote context).
    pub fn job_id(&self) -> Result<u32, SpankError> {
        self.u32_item(S_JOB_ID, "S_JOB_ID")
    }

    /// The step id (`S_JOB_STEPID`): the batch step is `0xfffffffb`.
    pub fn step_id(&self) -> Result<u32, SpankError> {
        self.u32_item(S_JOB_STEPID, "S_JOB_STEPID")
    }

    /// How often the job was requeued (`S_SLURM_RESTART_COUNT`).
    pub fn restart_count(&self) -> Result<u32, SpankError> {
        self.u32_item(S_SLURM_RESTART_COUNT, "S_SLURM_RESTART_COUNT")
    }

    /// The task's command line (`S_JOB_ARGV`).
    pub fn argv(&self) -> Result<Vec<String>, SpankError> {
        let f = self.get_item()?;
        let mut argc: c_int = 0;
        let mut argv: *const *const c_char = std::ptr::null();
        // SAFETY: S_JOB_ARGV takes (int *, char ***) (spank.h).
        let rc = unsafe {
            f(
                self.raw,
                S_JOB_ARGV,
                &mut argc as *mut c_int,
                &mut argv as *mut *const *const c_char,
            )
        };
        if rc != 0 {
            return Err(SpankError::Call {
                call: "spank_get_item(S_JOB_ARGV)".into(),
                code: rc,
            });
        }
        // SAFETY: Slurm's argv array has argc strings, NULL-terminated.
        Ok(unsafe { string_array(argv, Some(argc.max(0) as usize)) })
    }

    /// The task's environment (`S_JOB_ENV`), as `NAME=VALUE` strings.
    pub fn env(&self) -> Result<Vec<String>, SpankError> {
        let f = self.get_item()?;
        let mut env: *const *const c_char = std::ptr::null();
        // SAFETY: S_JOB_ENV takes one `char ***` (spank.h).
        let rc = unsafe { f(self.raw, S_JOB_ENV, &mut env as *mut *const *const c_char) };
        if rc != 0 {
            return Err(SpankError::Call {
                call: "spank_get_item(S_JOB_ENV)".into(),
                code: rc,
            });
        }
        // SAFETY: the job's environment is a NULL-terminated string array.
        Ok(unsafe { string_array(env, None) })
    }

    /// Registers an option (only valid in `slurm_spank_init`).
    pub fn register(&self, spec: &'static OptionSpec) -> Result<(), SpankError> {
        let f = sym(c"spank_option_register")?;
        let opt = raw_option(spec);
        // SAFETY: the signature of spank.h; `opt` lives as long as the
        // plugin (leaked), as Slurm keeps the pointer.
        let rc = unsafe { std::mem::transmute::<*mut c_void, Register>(f)(self.raw, opt) };
        if rc != 0 {
            return Err(SpankError::Call {
                call: format!("spank_option_register(--{})", spec.name),
                code: rc,
            });
        }
        Ok(())
    }

    /// Whether option `spec` was given, and its argument: None if not
    /// given, `Some("")` if given without one.
    pub fn getopt(&self, spec: &'static OptionSpec) -> Result<Option<String>, SpankError> {
        let f = sym(c"spank_option_getopt")?;
        let opt = raw_option(spec);
        let mut arg: *mut c_char = std::ptr::null_mut();
        // SAFETY: the signature of spank.h; `arg` receives a string owned
        // by Slurm (or stays NULL).
        let rc = unsafe { std::mem::transmute::<*mut c_void, GetOpt>(f)(self.raw, opt, &mut arg) };
        if rc != 0 {
            // ESPANK_ERROR: the option was not used.
            return Ok(None);
        }
        if arg.is_null() {
            return Ok(Some(String::new()));
        }
        // SAFETY: a NUL-terminated string owned by Slurm.
        Ok(Some(
            unsafe { CStr::from_ptr(arg) }
                .to_string_lossy()
                .into_owned(),
        ))
    }
}

/// Writes one line through Slurm's log (`slurm_error`): the slurmd log in
/// the remote context, the terminal of sbatch/srun locally.
pub fn log_error(msg: &str) {
    let Ok(f) = sym(c"slurm_error") else {
        eprintln!("{msg}");
        return;
    };
    let msg = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    // SAFETY: slurm_error is printf-like; "%s" with one C string argument.
    unsafe { std::mem::transmute::<*mut c_void, LogFn>(f)(c"%s".as_ptr(), msg.as_ptr()) };
}

/// The plugin's arguments from plugstack.conf.
///
/// SAFETY: Slurm passes `ac` strings in `av`.
unsafe fn plugin_args(ac: c_int, av: *const *const c_char) -> Vec<String> {
    // SAFETY: the caller's contract.
    unsafe { string_array(av, Some(ac.max(0) as usize)) }
}

/// Which hook [`dispatch`] runs.
#[derive(Clone, Copy, Debug)]
pub enum Hook {
    Init,
    InitPostOpt,
    TaskInit,
}

/// Runs hook `hook` of plugin `P` with the arguments Slurm passed to the
/// exported C function: 0 on success, -1 (logged) on error. Only the
/// functions [`spank_plugin!`] exports call it.
#[doc(hidden)]
// The pointers are the ones Slurm passes to the exported hooks, which are
// the only callers (the macro's expansion), so the function stays safe to
// name there without an unsafe block in the plugin crate.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn dispatch<P: Plugin>(
    hook: Hook,
    raw: *mut c_void,
    ac: c_int,
    av: *const *const c_char,
) -> c_int {
    // SAFETY: called only by the hooks spank_plugin! exports, with the
    // argument vector Slurm passed to them.
    let args = unsafe { plugin_args(ac, av) };
    let sp = Spank { raw };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match hook {
        Hook::Init => {
            for spec in P::OPTIONS {
                sp.register(spec).map_err(|e| e.to_string())?;
            }
            P::init(&sp, &args)
        }
        Hook::InitPostOpt => P::init_post_opt(&sp, &args),
        Hook::TaskInit => P::task_init(&sp, &args),
    }));
    match r {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            log_error(&e);
            -1
        }
        Err(_) => {
            log_error(&format!("SPANK hook {hook:?} panicked"));
            -1
        }
    }
}

/// Exports the symbols of a SPANK plugin named `$name` (a string literal)
/// implemented by type `$plugin` ([`Plugin`]).
#[macro_export]
macro_rules! spank_plugin {
    ($name:literal, $plugin:ty) => {
        #[allow(non_upper_case_globals)]
        #[no_mangle]
        pub static plugin_name: [u8; $name.len() + 1] = {
            let mut b = [0u8; $name.len() + 1];
            let s = $name.as_bytes();
            let mut i = 0;
            while i < s.len() {
                b[i] = s[i];
                i += 1;
            }
            b
        };
        #[allow(non_upper_case_globals)]
        #[no_mangle]
        pub static plugin_type: [u8; 6] = *b"spank\0";
        #[allow(non_upper_case_globals)]
        #[no_mangle]
        pub static plugin_version: u32 = $crate::spank::SLURM_VERSION_NUMBER;
        #[allow(non_upper_case_globals)]
        #[no_mangle]
        pub static spank_plugin_version: u32 = 1;

        #[no_mangle]
        pub extern "C" fn slurm_spank_init(
            sp: *mut ::std::ffi::c_void,
            ac: ::std::ffi::c_int,
            av: *const *const ::std::ffi::c_char,
        ) -> ::std::ffi::c_int {
            $crate::spank::dispatch::<$plugin>($crate::spank::Hook::Init, sp, ac, av)
        }

        #[no_mangle]
        pub extern "C" fn slurm_spank_init_post_opt(
            sp: *mut ::std::ffi::c_void,
            ac: ::std::ffi::c_int,
            av: *const *const ::std::ffi::c_char,
        ) -> ::std::ffi::c_int {
            $crate::spank::dispatch::<$plugin>($crate::spank::Hook::InitPostOpt, sp, ac, av)
        }

        #[no_mangle]
        pub extern "C" fn slurm_spank_task_init(
            sp: *mut ::std::ffi::c_void,
            ac: ::std::ffi::c_int,
            av: *const *const ::std::ffi::c_char,
        ) -> ::std::ffi::c_int {
            $crate::spank::dispatch::<$plugin>($crate::spank::Hook::TaskInit, sp, ac, av)
        }
    };
}
