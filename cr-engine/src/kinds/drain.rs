//! Before the freeze of a dump whose processes end (`--kill`, `--stop`):
//! what the kernel queued for the program and no call can queue again
//! (connections on a TCP listener, see `netlock::AcceptDrain`; inotify and
//! fanotify events, see `eventfds::wait_for_reads`) is left to the running
//! program to take, for a short while, instead of refusing the dump at
//! once. What is still queued after the wait is refused by name by its
//! kind, as without it.

use std::fmt::Debug;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

/// How long a dump whose processes end waits, before the freeze, for them
/// to take what is queued for them.
pub const WAIT: Duration = Duration::from_secs(2);

/// How often the queues are looked at again meanwhile.
const EVERY: Duration = Duration::from_millis(2);

/// Look at what is still queued (`left`: empty once all is taken) every
/// few milliseconds until nothing is, or `limit` has passed; `queued` is
/// what was queued at first, `what` says what (for the log). Answers what
/// is still queued (empty: all taken).
pub fn wait<T: Debug>(
    what: &'static str,
    queued: &[T],
    limit: Duration,
    mut left: impl FnMut() -> Vec<T>,
) -> Vec<T> {
    let t0 = Instant::now();
    let mut now = Vec::new();
    let done = cr_sys::deadline::poll(limit, EVERY, || {
        now = left();
        Ok::<_, std::convert::Infallible>(now.is_empty().then_some(()))
    });
    let ms = t0.elapsed().as_millis() as u64;
    match done {
        Ok(Some(())) => debug!(
            ?queued,
            ms, "the program took its queued {what} before the freeze"
        ),
        _ => warn!(left = ?now, ms, "{what} still queued after the wait"),
    }
    now
}
