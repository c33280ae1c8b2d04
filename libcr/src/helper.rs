//! libcr's side of a checkpoint: the listening socket and the thread that
//! serves it ("libcr"), the chains of callbacks, and the signal handler
//! that runs signal-context callbacks.
//!
//! A chain runs the callbacks of one context, last registered first: each
//! callback's `cr_checkpoint` runs the next one, and the innermost call
//! waits for the checkpoint itself; so the code after `cr_checkpoint` (the
//! continue/restart half) runs first registered first. A callback that
//! returns 0 without calling `cr_checkpoint` lets the chain go on; one that
//! returns anything else fails the checkpoint.
//!
//! Thread-context callbacks run in the libcr thread. Their innermost
//! `cr_checkpoint` interrupts (with [`cr_sys::coop::callback_signal`])
//! every thread that registered signal-context callbacks; each runs its
//! chain in the handler and reports through a pipe (8-byte messages, the
//! only thing a handler may safely do), then waits on a second pipe for the
//! outcome. Both pipes have both ends in the process, so a restore brings
//! them back with the waiting threads.

use crate::registry::{self, Context};
use crate::wire::{self, Done, Outcome, Prepare, Reply};
use crate::{cs, errors, info, request};
use nix::errno::Errno;
use std::cell::{Cell, RefCell};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;
use tracing::{debug, warn};

/// What the threads of the process share once `cr_init` ran.
struct Shared {
    listener: UnixListener,
    /// The socket's file, removed at exit.
    path: PathBuf,
    pid: i32,
    signal: i32,
    /// Signal threads → libcr thread.
    report_r: OwnedFd,
    report_w: OwnedFd,
    /// libcr thread → signal threads: one byte per waiting thread.
    outcome_r: OwnedFd,
    outcome_w: OwnedFd,
}

static SHARED: OnceLock<Result<Shared, String>> = OnceLock::new();

/// Why `cr_init` failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("libcr: {0}")]
pub struct InitError(pub String);

/// Make the process reachable by checkpointers (once; later calls return
/// the first result).
pub fn init() -> Result<(), InitError> {
    match SHARED.get_or_init(start) {
        Ok(_) => Ok(()),
        Err(e) => Err(InitError(e.clone())),
    }
}

pub fn initialised() -> bool {
    matches!(SHARED.get(), Some(Ok(_)))
}

fn start() -> Result<Shared, String> {
    let dir = std::env::var_os(wire::DIR_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(wire::DEFAULT_DIR));
    if !dir.is_dir() {
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create socket directory {}: {e}", dir.display()))?;
        // Shared by every user's programs, like /tmp.
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777));
    }
    let pid = std::process::id() as i32;
    // "pid:[INODE]"
    let pidns = std::fs::read_link("/proc/self/ns/pid")
        .ok()
        .and_then(|l| {
            let l = l.to_string_lossy().into_owned();
            l.trim_start_matches("pid:[")
                .trim_end_matches(']')
                .parse()
                .ok()
        })
        .unwrap_or(0);
    let path = wire::socket_path(&dir, pidns, pid);
    // A file left by an earlier process with this pid.
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)
        .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    let pipe = || {
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| format!("cannot create a pipe: {e}"))
    };
    let (report_r, report_w) = pipe()?;
    let (outcome_r, outcome_w) = pipe()?;
    let signal = cr_sys::coop::callback_signal();
    cr_sys::coop::install_rt_handler(signal, on_signal)
        .map_err(|e| format!("cannot install the callback signal handler: {e}"))?;
    // The thread blocks every signal from its first instruction (it
    // inherits the mask it is made with): a signal sent to the process
    // (kill, sigqueue, a timer) must go to one of the program's threads,
    // as it would without libcr, not run the program's handler here.
    let mut before = nix::sys::signal::SigSet::empty();
    nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&nix::sys::signal::SigSet::all()),
        Some(&mut before),
    )
    .map_err(|e| format!("cannot block signals for the libcr thread: {e}"))?;
    let spawned = std::thread::Builder::new()
        .name("libcr".into())
        .spawn(serve);
    let _ = nix::sys::signal::pthread_sigmask(
        nix::sys::signal::SigmaskHow::SIG_SETMASK,
        Some(&before),
        None,
    );
    spawned.map_err(|e| format!("cannot start the libcr thread: {e}"))?;
    if let Err(e) = cr_sys::coop::at_exit(remove_socket) {
        // The agent sweeps it once the process is gone.
        debug!(error = %e, "libcr: the socket file will stay after the exit");
    }
    debug!(path = %path.display(), "libcr listening");
    Ok(Shared {
        listener,
        path,
        pid,
        signal,
        report_r,
        report_w,
        outcome_r,
        outcome_w,
    })
}

/// At exit: the socket file goes with the process (not with a forked
/// child that inherited the handler).
extern "C" fn remove_socket() {
    if let Some(Ok(s)) = SHARED.get() {
        if std::process::id() as i32 == s.pid {
            let _ = std::fs::remove_file(&s.path);
        }
    }
}

fn shared() -> &'static Shared {
    // The libcr thread and the handler exist only after a successful start.
    match SHARED.get() {
        Some(Ok(s)) => s,
        _ => unreachable!("libcr used before cr_init succeeded"),
    }
}

/// The libcr thread: one checkpoint request after the other.
fn serve() {
    // `start` is still filling SHARED when this thread starts.
    let s = loop {
        match SHARED.get() {
            Some(Ok(s)) => break s,
            Some(Err(_)) => return,
            None => std::thread::yield_now(),
        }
    };
    loop {
        let stream = match s.listener.accept() {
            Ok((c, _)) => c,
            Err(e) => {
                warn!(error = %e, "libcr: accept failed");
                continue;
            }
        };
        let line = read_line(&stream).unwrap_or_default();
        if let Some(p) = Prepare::parse(&line) {
            prepare(p, stream);
            continue;
        }
        // Closed before the requester is woken: once cr_poll_checkpoint
        // returns, the program holds no fd of ours it did not have.
        drop(stream);
        if let Some(d) = Done::parse(&line) {
            request::done(d);
        } else {
            // An outcome nobody waits for (the checkpoint was given up).
            debug!(line, "libcr: stray message ignored");
        }
    }
}

fn read_line(stream: &UnixStream) -> Option<String> {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).ok()?;
    (!line.is_empty()).then(|| line.trim_end_matches('\n').to_string())
}

thread_local! {
    /// The checkpointer's connection, in the libcr thread during a checkpoint.
    static SESSION: RefCell<Option<UnixStream>> = const { RefCell::new(None) };
    /// The callback this thread is running, if any.
    static LEVEL: Cell<Option<Level>> = const { Cell::new(None) };
}

#[derive(Clone, Copy)]
struct Level {
    context: Context,
    id: usize,
    /// What its `cr_checkpoint` returned, once called.
    result: Option<i32>,
}

fn say(r: &Reply) {
    SESSION.with_borrow_mut(|s| {
        if let Some(c) = s {
            if c.write_all(r.line().as_bytes()).is_err() {
                *s = None;
            }
        }
    });
}

/// One checkpoint request, in the libcr thread.
fn prepare(p: Prepare, stream: UnixStream) {
    info::set_checkpoint(&p.dest);
    let open = cs::begin_checkpoint(p.cs_wait);
    SESSION.set(Some(stream));
    if open > 0 && !p.cs_proceed {
        // Idle again before the checkpointer hears of the failure: a
        // program looking at cr_status() after it must not still see
        // this checkpoint pending (nor mistake the next one for it).
        cs::end_checkpoint();
        say(&Reply::Failed(format!(
            "{open} critical section(s) still open after {} ms",
            p.cs_wait.as_millis()
        )));
    } else {
        if open > 0 {
            warn!(open, "libcr: checkpoint proceeds inside critical sections");
        }
        let rc = chain(Context::Thread, None, 0);
        debug!(rc, "libcr: thread-context chain done");
    }
    SESSION.set(None);
    cs::end_checkpoint();
    // Requests end once the callbacks' continue or restart half has run.
    if RESTARTED.swap(false, std::sync::atomic::Ordering::SeqCst) {
        request::restarted();
    }
    for d in std::mem::take(&mut *LATER.lock().unwrap_or_else(|e| e.into_inner())) {
        request::done(d);
    }
}

/// Set by a RESTART, acted upon after the callbacks.
static RESTARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// DONE lines that came while the callbacks waited.
static LATER: std::sync::Mutex<Vec<Done>> = std::sync::Mutex::new(Vec::new());

/// Run the callbacks of `context` registered before `below` (thread
/// `tid`'s for signal context), then wait for the checkpoint; what the
/// innermost `cr_checkpoint` returns.
fn chain(context: Context, below: Option<usize>, tid: i32) -> i32 {
    let Some(id) = registry::next_below(below, context, tid) else {
        return match context {
            Context::Thread => checkpoint_thread(),
            Context::Signal => checkpoint_signal(),
        };
    };
    let Some(cb) = registry::get(id) else {
        return chain(context, Some(id), tid);
    };
    match context {
        Context::Thread => say(&Reply::Started {
            id,
            context: context.name().into(),
            name: cb.name.clone(),
        }),
        Context::Signal => report(Msg::Started, 0, id),
    }
    let outer = LEVEL.replace(Some(Level {
        context,
        id,
        result: None,
    }));
    let rc = cb.call();
    let me = LEVEL.replace(outer).expect("set above");
    match me.result {
        Some(r) => r,
        None if rc == 0 => chain(context, Some(id), tid),
        None => {
            fail(context, id, 0, rc);
            -errors::CR_ETEMPFAIL
        }
    }
}

/// `cr_checkpoint(flags)` in a callback: the rest of the chain, then the
/// checkpoint. 0: continued, 1: restarted, < 0: -error.
pub fn checkpoint(flags: i32) -> i32 {
    let Some(mut me) = LEVEL.get() else {
        return -errors::CR_ENOTCB;
    };
    if me.result.is_some() {
        return -libc::EINVAL;
    }
    match me.context {
        Context::Thread => say(&Reply::Reached { id: me.id }),
        Context::Signal => report(Msg::Reached, 0, me.id),
    }
    let kind = flags & errors::CR_CHECKPOINT_ABORT_MASK;
    let r = if kind != 0 {
        fail(me.context, me.id, kind, 0);
        let code = flags >> 16;
        match (code, kind) {
            (0, errors::CR_CHECKPOINT_PERM_FAILURE) => -errors::CR_EPERMFAIL,
            (0, _) => -errors::CR_ETEMPFAIL,
            (c, _) => -c,
        }
    } else {
        chain(me.context, Some(me.id), cr_gettid())
    };
    me.result = Some(r);
    LEVEL.set(Some(me));
    r
}

fn cr_gettid() -> i32 {
    nix::unistd::gettid().as_raw()
}

/// Callback `id` refused the checkpoint: with `flags` (TEMP/PERM/OMIT), or
/// by returning `rc`.
fn fail(context: Context, id: usize, flags: i32, rc: i32) {
    match context {
        Context::Thread => say(&Reply::Failed(refusal(id, context, 0, flags, rc))),
        Context::Signal => report(Msg::Failed, flags as u8, id | ((rc as u16 as usize) << 16)),
    }
}

fn refusal(id: usize, context: Context, tid: i32, flags: i32, rc: i32) -> String {
    let name = registry::get(id).map_or("?", |c| c.name.as_str());
    let thread = if tid != 0 {
        format!(", thread {tid}")
    } else {
        String::new()
    };
    let why = match flags {
        0 => format!("returned {rc} without calling cr_checkpoint"),
        errors::CR_CHECKPOINT_PERM_FAILURE => "called cr_checkpoint(CR_CHECKPOINT_PERM_FAILURE)".into(),
        errors::CR_CHECKPOINT_OMIT => "called cr_checkpoint(CR_CHECKPOINT_OMIT): a process cannot be left out of its tree's image".into(),
        _ => "called cr_checkpoint(CR_CHECKPOINT_TEMP_FAILURE)".into(),
    };
    format!(
        "callback #{id} {name} ({} context{thread}) {why}",
        context.name()
    )
}

/// Messages of signal-context chains to the libcr thread.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Msg {
    Started = b'S',
    Reached = b'C',
    /// Chain done, the thread waits for the outcome.
    Waiting = b'W',
    /// Refused; the thread does not wait.
    Failed = b'F',
}

/// Send one message (async-signal-safe: one write of 16 bytes, atomic on a
/// pipe).
fn report(kind: Msg, flags: u8, arg: usize) {
    let s = shared();
    let mut m = [0u8; 16];
    m[0] = kind as u8;
    m[1] = flags;
    m[4..8].copy_from_slice(&cr_gettid().to_le_bytes());
    m[8..16].copy_from_slice(&(arg as u64).to_le_bytes());
    let _ = nix::unistd::write(&s.report_w, &m);
}

fn read_exact(fd: &OwnedFd, buf: &mut [u8]) -> bool {
    let mut done = 0;
    while done < buf.len() {
        match nix::unistd::read(fd, &mut buf[done..]) {
            Ok(0) => return false,
            Ok(n) => done += n,
            Err(Errno::EINTR) => {}
            Err(_) => return false,
        }
    }
    true
}

/// The handler of the callback signal: this thread's signal-context chain.
extern "C" fn on_signal(_sig: i32) {
    let errno = Errno::last_raw();
    if LEVEL.get().is_none() {
        chain(Context::Signal, None, cr_gettid());
    }
    Errno::set_raw(errno);
}

/// The innermost `cr_checkpoint` of a signal-context chain.
fn checkpoint_signal() -> i32 {
    report(Msg::Waiting, 0, 0);
    let mut b = [0u8; 1];
    if !read_exact(&shared().outcome_r, &mut b) {
        return -libc::EIO;
    }
    outcome_code(b[0])
}

fn outcome_code(b: u8) -> i32 {
    match b {
        b'C' => 0,
        b'R' => 1,
        _ => -errors::CR_ETEMPFAIL,
    }
}

/// The innermost `cr_checkpoint` of the thread-context chain: the signal
/// phase, then the checkpoint itself.
fn checkpoint_thread() -> i32 {
    let s = shared();
    let mut expected = 0;
    for tid in registry::signal_threads() {
        match cr_sys::coop::tgkill(s.pid, tid, s.signal) {
            Ok(()) => expected += 1,
            Err(e) => debug!(tid, error = %e, "libcr: thread with signal callbacks is gone"),
        }
    }
    let mut waiting = 0;
    let mut refused = None;
    while expected > 0 {
        let mut m = [0u8; 16];
        if !read_exact(&s.report_r, &mut m) {
            break;
        }
        let tid = i32::from_le_bytes(m[4..8].try_into().expect("4 bytes"));
        let arg = u64::from_le_bytes(m[8..16].try_into().expect("8 bytes")) as usize;
        match m[0] {
            b'S' => say(&Reply::Started {
                id: arg,
                context: format!("signal context, thread {tid},"),
                name: registry::get(arg).map_or("?".into(), |c| c.name.clone()),
            }),
            b'C' => say(&Reply::Reached { id: arg }),
            b'W' => {
                waiting += 1;
                expected -= 1;
            }
            _ => {
                let (id, rc) = (arg & 0xffff, (arg >> 16) as u16 as i16 as i32);
                refused.get_or_insert_with(|| refusal(id, Context::Signal, tid, m[1] as i32, rc));
                expected -= 1;
            }
        }
    }
    let outcome = match refused {
        Some(why) => {
            say(&Reply::Failed(why));
            Outcome::Abort
        }
        None => wait_outcome(),
    };
    let byte = match &outcome {
        Outcome::Continue => b'C',
        Outcome::Restart { .. } => b'R',
        Outcome::Abort => b'A',
    };
    for _ in 0..waiting {
        let _ = nix::unistd::write(&s.outcome_w, &[byte]);
    }
    match outcome {
        Outcome::Continue => 0,
        Outcome::Restart { .. } => 1,
        Outcome::Abort => -errors::CR_ETEMPFAIL,
    }
}

/// Tell the checkpointer READY, get its FREEZE, and wait on the listener
/// for the outcome.
fn wait_outcome() -> Outcome {
    say(&Reply::Ready);
    let Some(stream) = SESSION.take() else {
        return Outcome::Abort;
    };
    let _ = stream.set_read_timeout(None);
    let mut line = String::new();
    let _ = BufReader::new(&stream).read_line(&mut line);
    let Some(node) = wire::parse_freeze(&line) else {
        return Outcome::Abort;
    };
    info::remember_node(&node);
    // Closed before the freeze: nothing of the checkpointer in the image.
    drop(stream);
    let s = shared();
    loop {
        let Ok((c, _)) = s.listener.accept() else {
            continue;
        };
        let line = read_line(&c).unwrap_or_default();
        if let Some(d) = Done::parse(&line) {
            // Reported once the callbacks have run on (see `prepare`).
            LATER.lock().unwrap_or_else(|e| e.into_inner()).push(d);
            continue;
        }
        if let Some(o) = Outcome::parse(&line) {
            if let Outcome::Restart { node, dir } = &o {
                info::set_restarted(node, dir);
                RESTARTED.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            debug!(?o, "libcr: checkpoint outcome");
            return o;
        }
        if Prepare::parse(&line).is_some() {
            let mut c = c;
            let _ = c.write_all(
                Reply::Failed("an earlier checkpoint of this process is not finished".into())
                    .line()
                    .as_bytes(),
            );
        }
    }
}
