//! Ctrl-C, SIGTERM and SIGHUP during a checkpoint or a restore. A tool
//! holds a [`Watch`] while the engine works: the signal only raises a flag
//! (signal-hook), which the engine checks between steps ([`check`]); a
//! checkpoint then fails with `Interrupted`, which detaches every thread and
//! leaves the processes running exactly as before, and a restore kills what
//! it built. Without a watch (the agent daemon handles its own signals) the
//! flag is never raised.

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::SigId;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// The number of the signal received (0: none).
fn received() -> &'static Arc<AtomicUsize> {
    static FLAG: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    FLAG.get_or_init(|| Arc::new(AtomicUsize::new(0)))
}

/// Signals caught while held; their default actions come back on drop.
pub struct Watch(Vec<SigId>);

impl Watch {
    pub fn new() -> Watch {
        let ids = [SIGINT, SIGTERM, SIGHUP]
            .into_iter()
            .filter_map(|sig| {
                signal_hook::flag::register_usize(sig, received().clone(), sig as usize).ok()
            })
            .collect();
        Watch(ids)
    }
}

impl Default for Watch {
    fn default() -> Self {
        Watch::new()
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        for id in self.0.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// The name of the signal that interrupted the work, if one came.
pub fn check() -> Result<(), &'static str> {
    match received().load(Ordering::Relaxed) as i32 {
        0 => Ok(()),
        SIGINT => Err("SIGINT"),
        SIGTERM => Err("SIGTERM"),
        SIGHUP => Err("SIGHUP"),
        _ => Err("a signal"),
    }
}

/// The signal that came, raised again with its default action (so the
/// tool ends the way the signal asked, after the engine cleaned up).
pub fn exit_code() -> Option<i32> {
    match received().load(Ordering::Relaxed) as i32 {
        0 => None,
        sig => Some(128 + sig),
    }
}
