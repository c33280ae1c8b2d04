//! Critical sections: regions a checkpoint waits for. A count of open
//! sections (nested ones counted each) and a flag "checkpoint pending";
//! while it is set a thread outside any section cannot open one (a thread
//! already inside can nest, or it would wait for itself).

use std::cell::Cell;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

struct State {
    open: u32,
    pending: bool,
}

static STATE: Mutex<State> = Mutex::new(State {
    open: 0,
    pending: false,
});
static CHANGED: Condvar = Condvar::new();

thread_local! {
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Enter a critical section, waiting while a checkpoint is pending (unless
/// this thread is already inside one).
pub fn enter() {
    let mut s = state();
    if DEPTH.get() == 0 {
        while s.pending {
            s = CHANGED.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
    s.open += 1;
    DEPTH.set(DEPTH.get() + 1);
}

/// Enter a critical section unless a checkpoint is pending; whether it did.
pub fn try_enter() -> bool {
    let mut s = state();
    if DEPTH.get() == 0 && s.pending {
        return false;
    }
    s.open += 1;
    DEPTH.set(DEPTH.get() + 1);
    true
}

/// Leave the innermost critical section of this thread; false if it is in
/// none.
pub fn leave() -> bool {
    if DEPTH.get() == 0 {
        return false;
    }
    DEPTH.set(DEPTH.get() - 1);
    let mut s = state();
    s.open = s.open.saturating_sub(1);
    CHANGED.notify_all();
    true
}

/// Whether a checkpoint is pending (between its request and its outcome).
pub fn pending() -> bool {
    state().pending
}

/// Mark a checkpoint pending and wait up to `limit` for every critical
/// section to close; the number still open.
pub fn begin_checkpoint(limit: Duration) -> u32 {
    let deadline = Instant::now() + limit;
    let mut s = state();
    s.pending = true;
    while s.open > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        s = CHANGED
            .wait_timeout(s, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    s.open
}

/// The checkpoint is over (done, failed or restarted): sections may open.
pub fn end_checkpoint() {
    state().pending = false;
    CHANGED.notify_all();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_sections_hold_a_checkpoint_and_only_outsiders_wait() {
        enter();
        enter();
        assert_eq!(begin_checkpoint(Duration::from_millis(20)), 2);
        // Inside a section a thread nests on; outside it is refused.
        assert!(try_enter());
        assert!(leave());
        let outsider = std::thread::spawn(try_enter).join().unwrap();
        assert!(
            !outsider,
            "a new section opened while a checkpoint is pending"
        );
        assert!(leave());
        assert_eq!(begin_checkpoint(Duration::from_millis(20)), 1);
        assert!(leave());
        assert!(!leave(), "left a section that was not entered");
        assert_eq!(begin_checkpoint(Duration::ZERO), 0);
        assert!(pending());
        end_checkpoint();
        assert!(!pending());
        assert!(std::thread::spawn(|| {
            let ok = try_enter();
            leave();
            ok
        })
        .join()
        .unwrap());
    }
}
