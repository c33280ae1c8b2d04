//! The registered callbacks. The table is append-only and read without
//! locks, because signal-context callbacks are looked up inside a signal
//! handler: each slot is set once, and a callback id points at its current
//! slot (`cr_replace_callback` fills a new slot and moves the id).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// Most callbacks (registrations plus replacements) of one process.
pub const MAX_SLOTS: usize = 1024;

/// Where a callback runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Context {
    /// In libcr's own thread, one callback after the other.
    Thread,
    /// In a signal handler of the thread that registered it, while that
    /// thread is interrupted (only async-signal-safe calls there).
    Signal,
}

impl Context {
    pub fn name(self) -> &'static str {
        match self {
            Context::Thread => "thread",
            Context::Signal => "signal",
        }
    }
}

/// A C callback: `int (*)(void *)`.
pub type CFn = extern "C" fn(*mut libc::c_void) -> libc::c_int;

/// What runs.
pub enum Func {
    /// A C function and its argument (an address: never dereferenced here).
    C { f: CFn, arg: usize },
    /// A Rust closure; its result is the callback's return value.
    Rust(Box<dyn Fn() -> i32 + Send + Sync>),
}

pub struct Callback {
    pub func: Func,
    pub context: Context,
    /// The registering thread: where a signal-context callback runs.
    pub tid: i32,
    /// For messages: the C function's symbol, or the name given in Rust.
    pub name: String,
}

impl Callback {
    pub fn call(&self) -> i32 {
        match &self.func {
            Func::C { f, arg } => f(*arg as *mut libc::c_void),
            Func::Rust(f) => f(),
        }
    }
}

static SLOTS: [OnceLock<Callback>; MAX_SLOTS] = [const { OnceLock::new() }; MAX_SLOTS];
/// Callback id → slot + 1 (0: no such id).
static IDS: [AtomicUsize; MAX_SLOTS] = [const { AtomicUsize::new(0) }; MAX_SLOTS];
static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);
static NEXT_ID: AtomicUsize = AtomicUsize::new(0);
static WRITERS: Mutex<()> = Mutex::new(());

/// Why a registration failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegisterError {
    #[error("more than {MAX_SLOTS} callbacks registered or replaced")]
    Full,
    #[error("no callback with id {0}")]
    NoSuchId(usize),
}

fn store(cb: Callback) -> Result<usize, RegisterError> {
    let slot = NEXT_SLOT.fetch_add(1, Ordering::SeqCst);
    if slot >= MAX_SLOTS {
        return Err(RegisterError::Full);
    }
    if SLOTS[slot].set(cb).is_err() {
        unreachable!("slot {slot} is handed out once");
    }
    Ok(slot)
}

/// Register `cb`; its id.
pub fn register(cb: Callback) -> Result<usize, RegisterError> {
    let _w = WRITERS.lock().unwrap_or_else(|e| e.into_inner());
    let id = NEXT_ID.load(Ordering::SeqCst);
    if id >= MAX_SLOTS {
        return Err(RegisterError::Full);
    }
    let slot = store(cb)?;
    IDS[id].store(slot + 1, Ordering::SeqCst);
    NEXT_ID.store(id + 1, Ordering::SeqCst);
    Ok(id)
}

/// Put `cb` in the place of callback `id` (same position in the order).
pub fn replace(id: usize, cb: Callback) -> Result<(), RegisterError> {
    let _w = WRITERS.lock().unwrap_or_else(|e| e.into_inner());
    if id >= MAX_SLOTS || IDS[id].load(Ordering::SeqCst) == 0 {
        return Err(RegisterError::NoSuchId(id));
    }
    let slot = store(cb)?;
    IDS[id].store(slot + 1, Ordering::SeqCst);
    Ok(())
}

/// Callback `id`, if registered (lock-free: usable in a signal handler).
pub fn get(id: usize) -> Option<&'static Callback> {
    let slot = IDS.get(id)?.load(Ordering::SeqCst);
    if slot == 0 {
        return None;
    }
    SLOTS[slot - 1].get()
}

/// The id of the next callback to run after `below` (exclusive; `None`:
/// start from the last registered), for `context` and, for signal
/// context, thread `tid`. Callbacks run last registered first.
pub fn next_below(below: Option<usize>, context: Context, tid: i32) -> Option<usize> {
    let top = below.unwrap_or_else(|| NEXT_ID.load(Ordering::SeqCst));
    (0..top).rev().find(|&id| {
        get(id).is_some_and(|cb| {
            cb.context == context && (context == Context::Thread || cb.tid == tid)
        })
    })
}

/// The threads with signal-context callbacks.
pub fn signal_threads() -> Vec<i32> {
    let mut tids: Vec<i32> = (0..NEXT_ID.load(Ordering::SeqCst))
        .filter_map(get)
        .filter(|cb| cb.context == Context::Signal)
        .map(|cb| cb.tid)
        .collect();
    tids.sort_unstable();
    tids.dedup();
    tids
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rust(context: Context, tid: i32, rc: i32) -> Callback {
        Callback {
            func: Func::Rust(Box::new(move || rc)),
            context,
            tid,
            name: format!("cb{rc}"),
        }
    }

    #[test]
    fn order_is_last_registered_first_and_replace_keeps_the_place() {
        let a = register(rust(Context::Thread, 1, 10)).unwrap();
        let s = register(rust(Context::Signal, 7, 20)).unwrap();
        let b = register(rust(Context::Thread, 1, 30)).unwrap();
        assert_eq!(next_below(None, Context::Thread, 0), Some(b));
        assert_eq!(next_below(Some(b), Context::Thread, 0), Some(a));
        assert_eq!(next_below(Some(a), Context::Thread, 0), None);
        assert_eq!(next_below(None, Context::Signal, 7), Some(s));
        assert_eq!(next_below(None, Context::Signal, 8), None);
        assert_eq!(signal_threads(), vec![7]);
        replace(a, rust(Context::Thread, 1, 40)).unwrap();
        assert_eq!(get(a).map(Callback::call), Some(40));
        assert_eq!(next_below(Some(b), Context::Thread, 0), Some(a));
        assert_eq!(
            replace(MAX_SLOTS + 1, rust(Context::Thread, 1, 0)),
            Err(RegisterError::NoSuchId(MAX_SLOTS + 1))
        );
    }
}
