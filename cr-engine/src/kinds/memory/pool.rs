//! The one worker pool of page copies, in both directions (dump reads
//! process memory into the page store, restore writes it back): a rayon
//! pool of one thread per CPU, shared by every checkpoint and restore of
//! the process (the agent runs many).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

fn pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .clamp(1, 64);
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("cr-pages-{i}"))
            .build()
            .unwrap_or_else(|_| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(1)
                    .build()
                    .expect("a one-thread pool")
            })
    })
}

/// Bytes of mapped pages all workers together hold at once, where they
/// work through a mapping (the snapshot memfd of a dump, the page store
/// of a restore): what bounds the tools' resident set at any image size.
const WINDOWS_BYTES: usize = 16 << 20;

/// Below this many bytes, a snapshot of a frozen process's pages is copied
/// by the calling thread alone: a few hundred pages take less than handing
/// them to the pool (see [`run`]).
pub const ONE_WORKER_BYTES: u64 = 4 << 20;

/// Bytes one of `workers` workers maps at a time: a share of
/// [`WINDOWS_BYTES`], between 1 MiB (one run of pages) and 4 MiB (past
/// that, fewer unmaps gain nothing).
pub fn window_bytes(workers: usize) -> usize {
    (WINDOWS_BYTES / workers.max(1)).clamp(1 << 20, 4 << 20)
}

/// Consecutive items (of `lens` bytes each) in groups of at most `most`
/// items and `budget` bytes together (an item alone may exceed it): the
/// pieces one worker takes at a time, through one window.
pub fn groups(
    lens: impl IntoIterator<Item = usize>,
    most: usize,
    budget: usize,
) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut first, mut bytes, mut n) = (0, 0, 0);
    for (i, len) in lens.into_iter().enumerate() {
        if i > first && (i - first == most || bytes + len > budget) {
            out.push(first..i);
            (first, bytes) = (i, 0);
        }
        bytes += len;
        n = i + 1;
    }
    if first < n {
        out.push(first..n);
    }
    out
}

/// Raised when a worker fails: the others stop taking work.
#[derive(Default)]
pub struct Stop(AtomicBool);

impl Stop {
    pub fn stopped(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Run `work` as `n` tasks of the pool, each taking pieces of a shared
/// list until it is empty (or another failed); the first error is returned.
/// One task runs on the calling thread: no hand-over to the pool and back
/// (two wake-ups, each waiting for a core on a loaded machine).
pub fn run<E: Send>(n: usize, work: impl Fn(&Stop) -> Result<(), E> + Sync) -> Result<(), E> {
    let stop = Stop::default();
    if n <= 1 {
        return work(&stop);
    }
    let first: Mutex<Option<E>> = Mutex::new(None);
    pool().scope(|s| {
        for _ in 0..n.clamp(1, 64) {
            s.spawn(|_| {
                if let Err(e) = work(&stop) {
                    stop.0.store(true, Ordering::Relaxed);
                    first
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get_or_insert(e);
                }
            });
        }
    });
    match first.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::groups;

    #[test]
    fn groups_keep_to_the_count_and_the_budget() {
        assert_eq!(groups([], 4, 10), Vec::<std::ops::Range<usize>>::new());
        // A budget of 10: 4+4 fits, a third does not; an item of 30 alone.
        assert_eq!(
            groups([4, 4, 4, 30, 1], 9, 10),
            vec![0..2, 2..3, 3..4, 4..5]
        );
        // At most 2 items; items of no bytes count only as items.
        assert_eq!(groups([0, 0, 0, 0, 0], 2, 10), vec![0..2, 2..4, 4..5]);
    }
}
