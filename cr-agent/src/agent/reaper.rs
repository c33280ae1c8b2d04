//! Processes the agent restored are its children: their exit statuses are
//! collected here (and nothing else is waited for: a waitpid(-1) would
//! steal the ptrace stops the session threads wait for), so `Wait` can
//! report them and no zombie is left.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

#[derive(Default)]
pub struct Reaper {
    state: Mutex<State>,
    changed: Notify,
}

#[derive(Default)]
struct State {
    watched: HashSet<i32>,
    /// pid -> exit code (or 128 + signal).
    exited: HashMap<i32, i32>,
}

impl Reaper {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Start collecting the exit status of child `pid`.
    pub fn watch(&self, pid: i32) {
        let mut st = self.lock();
        st.exited.remove(&pid);
        st.watched.insert(pid);
    }

    pub fn is_watched(&self, pid: i32) -> bool {
        let st = self.lock();
        st.watched.contains(&pid) || st.exited.contains_key(&pid)
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
        let pids: Vec<i32> = self.lock().watched.iter().copied().collect();
        let mut done = Vec::new();
        for pid in pids {
            match cr_sys::ptrace::wait_raw(pid, libc::WNOHANG) {
                Ok((0, _)) => {}
                Ok((_, status)) => done.push((pid, cr_engine::restore::exit_code(status))),
                // Not our child (any more): nothing to collect.
                Err(_) => done.push((pid, -1)),
            }
        }
        if done.is_empty() {
            return;
        }
        let mut st = self.lock();
        for (pid, code) in done {
            tracing::info!(pid, code, "restored process exited");
            st.watched.remove(&pid);
            st.exited.insert(pid, code);
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
                if !st.watched.contains(&pid) {
                    return Err(format!("process {pid} was not restored by this agent"));
                }
            }
            notified.await;
        }
    }
}
