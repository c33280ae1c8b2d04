//! Leases of the network locks a checkpoint session holds.
//!
//! A session's locks (nft tables dropping its members' packets) are made
//! with elements that expire after the lease (`lock_lease_ms`, the
//! kernel's own set timeouts), and this module's thread renews them every
//! quarter of it while the session holds them, until the session's freeze
//! bound. If the agent dies, is killed, or hangs, nothing renews them: the
//! lock lifts by itself within the lease, whatever else happens, and the
//! member's connections flow again (TCP retransmits what was dropped). The
//! emptied tables are removed by the agent's next start (the session's
//! record names them).
//!
//! A lease that lapsed while its session still needs it (a renewal found
//! an element gone) is reported by [`Lease::held`]: the session refuses to
//! dump or commit on a lock that lifted.

use cr_sys::netlock::{LockNs, LockSet};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::{debug, warn};

/// Locks by name with what each holds.
type Locks = Vec<(String, LockSet)>;

struct Entry {
    /// The locks' network namespace (where nft runs), pinned: it outlives
    /// the processes (see [`LockNs`]).
    ns: Arc<LockNs>,
    locks: Vec<(String, LockSet)>,
    /// Renewed until then, never after.
    until: Instant,
    last: Instant,
    lapsed: bool,
}

/// The leases in force.
pub struct Leases {
    lease: Duration,
    map: Mutex<HashMap<u64, Entry>>,
    next: AtomicU64,
    /// When the reset guard should be looked at (after a restore).
    guard_check: Mutex<Option<Instant>>,
}

/// One leased set of locks (one network namespace); renewal stops on drop.
pub struct Lease {
    leases: Arc<Leases>,
    id: u64,
}

impl Leases {
    pub fn new(lease: Duration) -> Arc<Leases> {
        Arc::new(Leases {
            lease,
            map: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            guard_check: Mutex::new(None),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Entry>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leases in force (for leak checks).
    pub fn count(&self) -> usize {
        self.lock().len()
    }

    /// Install `locks` in the namespace of `pid`, in one transaction, with a
    /// lease renewed until `until`.
    pub fn install(
        self: &Arc<Self>,
        pid: i32,
        locks: Vec<(String, LockSet)>,
        until: Instant,
    ) -> Result<Lease, cr_sys::SysError> {
        let ns = Arc::new(LockNs::of(pid)?);
        cr_sys::netlock::lock_many(&ns, &locks, Some(self.lease))?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(
            id,
            Entry {
                ns,
                locks,
                until,
                last: Instant::now(),
                lapsed: false,
            },
        );
        Ok(Lease {
            leases: self.clone(),
            id,
        })
    }

    /// Renew every lease due (a quarter of the lease old), each in one
    /// nft transaction, outside the map's lock.
    fn renew_due(&self) {
        let now = Instant::now();
        let due: Vec<(u64, Arc<LockNs>, Locks)> = self
            .lock()
            .iter()
            .filter(|(_, e)| !e.lapsed && e.until > now && now - e.last >= self.lease / 4)
            .map(|(id, e)| (*id, e.ns.clone(), e.locks.clone()))
            .collect();
        for (id, ns, locks) in due {
            let r = cr_sys::netlock::renew_many(&ns, &locks, self.lease);
            let mut m = self.lock();
            let Some(e) = m.get_mut(&id) else { continue };
            match r {
                Ok(()) => {
                    e.last = Instant::now();
                    debug!(locks = locks.len(), "network lock lease renewed");
                }
                Err(err) => {
                    e.lapsed = true;
                    warn!(error = %cr_sys::error::one_line(&err), "a network lock's lease lapsed");
                }
            }
        }
    }

    /// After a restore: look at the reset guard once its elements expired.
    pub fn check_guard_after(&self, d: Duration) {
        let at = Instant::now() + d;
        let mut g = self.guard_check.lock().unwrap_or_else(|p| p.into_inner());
        *g = Some(g.map_or(at, |old| old.max(at)));
    }

    fn guard_due(&self) {
        let mut g = self.guard_check.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_some_and(|at| Instant::now() >= at) {
            *g = None;
            drop(g);
            match cr_sys::netlock::remove_idle_guard() {
                Ok(true) => debug!("the idle reset guard table was removed"),
                Ok(false) => {}
                Err(e) => {
                    warn!(error = %cr_sys::error::one_line(&e), "cannot remove the reset guard table")
                }
            }
        }
    }

    /// The renewing thread.
    pub fn spawn(self: &Arc<Self>) {
        let me = self.clone();
        let period = (self.lease / 8).max(Duration::from_millis(50));
        let _ = std::thread::Builder::new()
            .name("leases".into())
            .spawn(move || loop {
                std::thread::sleep(period);
                me.renew_due();
                me.guard_due();
            });
    }
}

impl Lease {
    /// The lock is still in force (its lease never lapsed).
    pub fn held(&self) -> bool {
        let m = self.leases.lock();
        m.get(&self.id)
            .is_some_and(|e| !e.lapsed && e.last.elapsed() < self.leases.lease)
    }

    /// Stop renewing the locks named `names` (their member is gone: its
    /// elements expire within the lease).
    pub fn forget(&self, names: &[String]) {
        if let Some(e) = self.leases.lock().get_mut(&self.id) {
            e.locks.retain(|(n, _)| !names.contains(n));
        }
    }

    /// The lock now belongs to an image (the processes were killed or
    /// stopped after a commit): its elements no longer expire.
    pub fn make_permanent(self) {
        let Some(e) = self.leases.lock().remove(&self.id) else {
            return;
        };
        if let Err(err) = cr_sys::netlock::keep_many(&e.ns, &e.locks) {
            warn!(error = %cr_sys::error::one_line(&err), "cannot keep the network lock of a committed image");
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.leases.lock().remove(&self.id);
    }
}
