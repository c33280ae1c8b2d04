//! Processes the agent restored are its children: their exit statuses are
//! collected here, so `Wait` can report them and no zombie is left.
//!
//! One owner of each traced process at any time. A session that traces a
//! restored process (a checkpoint of it) waits for its ptrace stops and may
//! see it exit; a wait from here at the same time could take a stop the
//! session waits for (the session would then wait forever, the process
//! frozen). So a session [`Reaper::lend`]s the processes it traces: the
//! reaper lets them alone until the [`Loan`] is dropped. Exits are read
//! through pidfds (a reused PID is never mistaken for the process) with
//! WEXITED only, never waitpid(-1), so nothing else is ever taken.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// Exit statuses kept for `Wait` (the oldest are forgotten beyond this).
const EXITED_KEPT: usize = 1024;

#[derive(Default)]
pub struct Reaper {
    state: Mutex<State>,
    changed: Notify,
}

#[derive(Default)]
struct State {
    /// pid -> its pidfd.
    watched: HashMap<i32, OwnedFd>,
    /// pid -> sessions holding it (the reaper lets it alone).
    lent: HashMap<i32, usize>,
    /// pid -> exit code (or 128 + signal; -1: reaped by its tracer).
    exited: HashMap<i32, i32>,
    order: VecDeque<i32>,
}

/// Processes lent to a session; given back on drop.
pub struct Loan {
    reaper: Arc<Reaper>,
    pids: Vec<i32>,
}

impl Drop for Loan {
    fn drop(&mut self) {
        let mut st = self.reaper.lock();
        for pid in &self.pids {
            if let Some(n) = st.lent.get_mut(pid) {
                *n -= 1;
                if *n == 0 {
                    st.lent.remove(pid);
                }
            }
        }
    }
}

impl Reaper {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Start collecting the exit status of child `pid`.
    pub fn watch(&self, pid: i32) {
        let fd = match cr_sys::fdio::pidfd_open(pid) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::warn!(pid, error = %cr_sys::error::one_line(&e), "cannot watch a restored process");
                return;
            }
        };
        let mut st = self.lock();
        st.exited.remove(&pid);
        st.watched.insert(pid, fd);
    }

    pub fn is_watched(&self, pid: i32) -> bool {
        let st = self.lock();
        st.watched.contains_key(&pid) || st.exited.contains_key(&pid)
    }

    /// Number of processes watched (for tests and leak checks).
    pub fn watched(&self) -> usize {
        self.lock().watched.len()
    }

    /// Let `pids` alone until the loan is dropped: a session traces them.
    /// No wait of the reaper on them runs once this returns.
    pub fn lend(self: &Arc<Self>, pids: &[i32]) -> Loan {
        let mut st = self.lock();
        let mut lent = Vec::new();
        for &pid in pids {
            if st.watched.contains_key(&pid) {
                *st.lent.entry(pid).or_default() += 1;
                lent.push(pid);
            }
        }
        Loan {
            reaper: self.clone(),
            pids: lent,
        }
    }

    /// Poll the watched children every `period` (a thread of its own).
    pub fn spawn(self: &Arc<Self>, period: Duration) {
        let me = self.clone();
        let _ = std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || loop {
                std::thread::sleep(period);
                me.poll();
            });
    }

    fn poll(&self) {
        // Under the lock: a lend() waits for this round to end.
        let mut st = self.lock();
        let mut done = Vec::new();
        for (&pid, fd) in &st.watched {
            if st.lent.contains_key(&pid) {
                continue;
            }
            match cr_sys::ptrace::reap_exited(fd.as_fd()) {
                Ok(None) => {}
                Ok(Some(code)) => done.push((pid, code)),
                // Reaped by a tracer of ours while it was lent.
                Err(_) => done.push((pid, -1)),
            }
        }
        if done.is_empty() {
            return;
        }
        for (pid, code) in done {
            tracing::info!(pid, code, "restored process exited");
            st.watched.remove(&pid);
            st.exited.insert(pid, code);
            st.order.push_back(pid);
        }
        while st.order.len() > EXITED_KEPT {
            if let Some(old) = st.order.pop_front() {
                st.exited.remove(&old);
            }
        }
        drop(st);
        self.changed.notify_waiters();
    }

    /// Wait until `pid` has exited; its exit code.
    pub async fn wait(&self, pid: i32) -> Result<i32, String> {
        loop {
            let notified = self.changed.notified();
            {
                let st = self.lock();
                if let Some(&c) = st.exited.get(&pid) {
                    return Ok(c);
                }
                if !st.watched.contains_key(&pid) {
                    return Err(format!("process {pid} was not restored by this agent"));
                }
            }
            notified.await;
        }
    }
}
