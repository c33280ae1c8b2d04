//! libcr: programs taking part in their checkpoints.
//!
//! A program that calls [`init`] (C: `cr_init`) is reachable by the
//! checkpointer (`cr_checkpoint`, the node agent, a coordinated job
//! checkpoint): before its processes are frozen, its callbacks run
//! (close a connection to a server outside the job, flush a transport),
//! critical sections delay the freeze, and after the checkpoint, or after
//! a restart from it, the callbacks run on from their `checkpoint()` call
//! knowing which of the two happened. Programs that do not call it are
//! untouched: the checkpointer finds no socket and does nothing more.
//!
//! The same library is `libcr.so` for C (`include/libcr.h`, source
//! compatible with BLCR's libcr; see `capi`) and this crate for Rust:
//!
//! ```no_run
//! cr::init().unwrap();
//! cr::on_checkpoint(cr::Context::Thread, "reconnect", || {
//!     // close the connection
//!     match cr::checkpoint()? {
//!         cr::Resumed::Continued => { /* reopen it here */ }
//!         cr::Resumed::Restarted(info) => { /* reopen, maybe elsewhere: info.node_changed() */ }
//!     }
//!     Ok(())
//! })
//! .unwrap();
//! {
//!     let _cs = cr::critical_section(); // no checkpoint in here
//! }
//! ```
//!
//! Modules: [`wire`] (the protocol, `cr_proto::coop`, shared with the checkpointer),
//! `registry` (callbacks), `cs` (critical sections), `helper` (the libcr
//! thread and the signal handler), [`info`], `errors`, `capi`.

mod capi;
mod cs;
pub mod errors;
mod helper;
pub mod info;
mod registry;
mod request;
mod standalone;
pub use cr_proto::coop as wire;

pub use helper::InitError;
pub use info::{CheckpointInfo, RestartInfo};
pub use registry::Context;
pub use request::{Finished, RequestError, Scope};
use std::sync::Arc;
use std::time::Duration;

/// Errors of the Rust API.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Init(#[from] InitError),
    #[error("libcr: {0}")]
    Register(String),
    /// `checkpoint()` outside a callback.
    #[error("libcr: checkpoint() called outside a checkpoint callback")]
    NotInCallback,
    /// The checkpoint failed or was cancelled; the process runs on.
    #[error("libcr: checkpoint cancelled ({0})")]
    Cancelled(String),
    #[error(transparent)]
    Request(#[from] RequestError),
}

/// How the process came back from [`checkpoint`].
#[derive(Debug, Clone)]
pub enum Resumed {
    /// The checkpoint is taken and the process runs on.
    Continued,
    /// The process was restarted from the image.
    Restarted(Arc<RestartInfo>),
}

/// Make the process reachable by checkpointers: a socket and a thread.
/// Idempotent.
pub fn init() -> Result<(), Error> {
    Ok(helper::init()?)
}

/// The id of a registered callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallbackId(pub usize);

/// Run `f` before every checkpoint. It should call [`checkpoint`] once its
/// preparation is done and return `Ok(())`; an `Err` (returned as -1) or a
/// panic (-2) refuses the checkpoint, which then fails naming `name`; the
/// process runs on.
/// Signal-context callbacks run in a signal handler of the calling thread:
/// only async-signal-safe work there.
pub fn on_checkpoint<F>(context: Context, name: &str, f: F) -> Result<CallbackId, Error>
where
    F: Fn() -> Result<(), Error> + Send + Sync + 'static,
{
    init()?;
    let cb = registry::Callback {
        // A panic is a refusal like an error (it must not unwind into the
        // libcr thread or a signal handler).
        func: registry::Func::Rust(Box::new(move || {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&f)) {
                Ok(Ok(())) => 0,
                Ok(Err(_)) => -1,
                Err(_) => -2,
            }
        })),
        context,
        tid: nix::unistd::gettid().as_raw(),
        name: name.to_string(),
    };
    registry::register(cb)
        .map(CallbackId)
        .map_err(|e| Error::Register(e.to_string()))
}

/// In a callback: let the checkpoint happen (after the callbacks
/// registered earlier), and return once it is taken or once the process
/// is restarted from it.
pub fn checkpoint() -> Result<Resumed, Error> {
    resumed(helper::checkpoint(errors::CR_CHECKPOINT_READY))
}

/// In a callback: cancel the checkpoint (it fails; the process runs on).
pub fn refuse() -> Error {
    match resumed(helper::checkpoint(errors::CR_CHECKPOINT_TEMP_FAILURE)) {
        Err(e) => e,
        Ok(_) => Error::Cancelled("refused".into()),
    }
}

fn resumed(rc: i32) -> Result<Resumed, Error> {
    match rc {
        0 => Ok(Resumed::Continued),
        r if r > 0 => Ok(Resumed::Restarted(info::restart_info().unwrap_or_default())),
        r if -r == errors::CR_ENOTCB => Err(Error::NotInCallback),
        r => Err(Error::Cancelled(errors::text(-r))),
    }
}

/// A critical section: no checkpoint freezes the process while one is
/// open (up to the checkpointer's limit). Nested sections count each.
#[must_use = "the critical section ends when the guard is dropped"]
pub struct CriticalSection(());

impl Drop for CriticalSection {
    fn drop(&mut self) {
        cs::leave();
    }
}

/// Open a critical section, waiting while a checkpoint is in progress.
pub fn critical_section() -> CriticalSection {
    cs::enter();
    CriticalSection(())
}

/// Open a critical section unless a checkpoint is in progress.
pub fn try_critical_section() -> Option<CriticalSection> {
    cs::try_enter().then_some(CriticalSection(()))
}

/// The checkpoint in progress (or last taken).
pub fn checkpoint_info() -> Option<Arc<CheckpointInfo>> {
    info::checkpoint_info()
}

/// The last restart of this process.
pub fn restart_info() -> Option<Arc<RestartInfo>> {
    info::restart_info()
}

/// A checkpoint this program asked for ([`request_checkpoint`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request(u64);

/// Ask the node's agent for a checkpoint of this process's tree, or of
/// its whole cluster job. Returns once the agent accepted; the checkpoint
/// runs meanwhile (this program's callbacks included): see
/// [`Request::wait`]. Not from inside a critical section (the checkpoint
/// would wait for it).
pub fn request_checkpoint(scope: Scope) -> Result<Request, Error> {
    Ok(Request(request::request(scope)?))
}

impl Request {
    /// Wait up to `timeout` (None: no limit) for the checkpoint to end;
    /// None if it has not yet.
    pub fn wait(&self, timeout: Option<Duration>) -> Option<Finished> {
        request::poll(self.0, timeout).1
    }
}
