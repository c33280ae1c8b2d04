//! Kind "netlock": holding a tree's TCP connections still (an nft table
//! dropping their packets, see `cr_sys::netlock`) from before their state
//! is read until the processes are gone (the lock then belongs to the image
//! and the restore removes it) or run on (it goes at once). Listeners are
//! held (SYNs dropped) only while the dump runs, so no connection lands in
//! an accept queue after the queues were checked; before the freeze of a
//! dump whose processes end, they are held while the program accepts the
//! connections already queued ([`AcceptDrain`]).

#[cfg(test)]
mod tests;

use crate::error::CheckpointError;
use crate::kinds::inet;
use tracing::{debug, warn};

/// The network lock of a dump, removed again if the dump fails.
pub struct NetLock {
    name: String,
    pid: i32,
    /// Connections are locked (else only listeners are held).
    conns: bool,
    /// The listeners' table, removed when the dump ends, whatever happens.
    syn: Option<String>,
    armed: bool,
}

impl NetLock {
    /// Lock the TCP sockets of `pids` (None when they have none).
    pub fn take(
        root: i32,
        pids: &[i32],
        name: Option<&str>,
    ) -> Result<Option<NetLock>, CheckpointError> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        let name = name
            .map(str::to_string)
            .unwrap_or_else(|| format!("cr_lock_{root}_{stamp}"));
        let Some((mut lock, set)) = NetLock::plan(root, pids, &name) else {
            return Ok(None);
        };
        let fail = |e| CheckpointError::NetLock {
            pid: root,
            conns: set.conns.len(),
            source: e,
        };
        // Installed step by step: what is set up is removed if a step fails.
        lock.conns = false;
        let syn = lock.syn.take();
        if let Some(syn) = syn {
            cr_sys::netlock::hold_listeners(root, &syn, &set.listeners).map_err(fail)?;
            lock.syn = Some(syn);
        }
        if !set.conns.is_empty() {
            cr_sys::netlock::lock(root, &name, &set).map_err(fail)?;
            lock.conns = true;
        }
        debug!(
            name,
            conns = set.conns.len(),
            listeners = set.listeners.len(),
            "network locked"
        );
        Ok(Some(lock))
    }

    /// What the lock `name` of the TCP sockets of `pids` must hold (None:
    /// no TCP socket), and the lock as if it were installed (a caller
    /// installs several at once, see `cr_sys::netlock::lock_many`;
    /// removing an absent table is harmless).
    pub fn plan(
        root: i32,
        pids: &[i32],
        name: &str,
    ) -> Option<(NetLock, cr_sys::netlock::LockSet)> {
        let set = inet::lock_set(pids);
        if set.conns.is_empty() && set.listeners.is_empty() {
            return None;
        }
        let lock = NetLock {
            name: name.to_string(),
            pid: root,
            conns: !set.conns.is_empty(),
            syn: (!set.listeners.is_empty()).then(|| format!("{name}_syn")),
            armed: true,
        };
        Some((lock, set))
    }

    /// The tables a let-go would remove (the listeners' always; the
    /// connections' when the processes `continue`), handed to the caller
    /// to remove.
    pub fn take_tables(&mut self, continue_: bool) -> Vec<String> {
        let mut out: Vec<String> = self.syn.take().into_iter().collect();
        if continue_ && self.conns && self.armed {
            out.push(self.name.clone());
            self.armed = false;
        }
        out
    }

    /// The name the image records: the connections' lock, if any.
    pub fn image_name(&self) -> Option<String> {
        self.conns.then(|| self.name.clone())
    }

    /// The connections' lock stays for cr_restart.
    pub fn keep(mut self) {
        self.armed = false;
    }
}

impl Drop for NetLock {
    fn drop(&mut self) {
        let warn = |e: cr_sys::SysError| warn!(error = %cr_sys::error::one_line(&e), "removing the network lock failed");
        if let Some(syn) = &self.syn {
            cr_sys::netlock::unlock(Some(self.pid), syn).err().map(warn);
        }
        if self.armed && self.conns {
            cr_sys::netlock::unlock(Some(self.pid), &self.name)
                .err()
                .map(warn);
        }
    }
}

/// New connections to a tree's listeners held off (their SYNs dropped;
/// clients send them again a second later) while the tree, still running,
/// accepts those already queued: a connection in an accept queue cannot
/// be saved (no call puts one back in a queue), a connection accepted is
/// an ordinary one. Removed on drop, once the dump's own lock holds the
/// listeners.
pub struct AcceptDrain {
    pid: i32,
    name: String,
}

impl AcceptDrain {
    /// Before the freeze of the tree `pids` (root `root`) for a dump whose
    /// processes end: if its listeners have connections queued, hold new
    /// ones off and wait up to `limit` for the program to accept the queued
    /// ones (None: nothing was queued). Past `limit` the dump goes on and
    /// refuses the listener by name, as without the wait.
    pub fn run(
        root: i32,
        pids: &[i32],
        limit: std::time::Duration,
    ) -> Result<Option<AcceptDrain>, CheckpointError> {
        let queued = inet::accept_queues(pids);
        if queued.is_empty() {
            return Ok(None);
        }
        let listeners = inet::lock_set(pids).listeners;
        let name = format!("cr_accept_{root}_{}", std::process::id());
        cr_sys::netlock::hold_listeners(root, &name, &listeners).map_err(|e| {
            CheckpointError::NetLock {
                pid: root,
                conns: 0,
                source: e,
            }
        })?;
        let drain = AcceptDrain { pid: root, name };
        crate::kinds::drain::wait("connections on listeners", &queued, limit, || {
            inet::accept_queues(pids)
        });
        Ok(Some(drain))
    }
}

impl Drop for AcceptDrain {
    fn drop(&mut self) {
        if let Err(e) = cr_sys::netlock::unlock(Some(self.pid), &self.name) {
            warn!(error = %cr_sys::error::one_line(&e), "removing the listeners' hold failed");
        }
    }
}

/// At the release of a restore: the image's lock (same host, same network
/// namespace) goes now that every connection exists again.
pub fn remove(lock: Option<&str>) {
    let Some(name) = lock else { return };
    match cr_sys::netlock::unlock(None, name) {
        Ok(true) => debug!(lock = name, "network lock removed"),
        Ok(false) => {}
        Err(e) => {
            warn!(error = %cr_sys::error::one_line(&e), "the image's network lock could not be removed")
        }
    }
}
