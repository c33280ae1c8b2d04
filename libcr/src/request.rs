//! Checkpoints the program asks for (`cr_request_checkpoint`,
//! [`crate::request_checkpoint`]): the node's agent is asked through its
//! `Local.RequestCheckpoint` and answers at once; the checkpoint then goes
//! as any other (the callbacks run in the libcr thread meanwhile), and its
//! end comes back on the libcr socket (`DONE`, see `cr_proto::coop`). A
//! process restored from that checkpoint gets `RESTART` instead: its
//! requests end as restarted.
//!
//! The connection to the agent is made inside a critical section, so that
//! the freeze waits until it is closed: nothing of it is in the image.

use crate::{cs, helper};
use cr_proto::coop::Done;
use cr_rpc::pb;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// How a requested checkpoint ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finished {
    /// Taken; the process runs on. What was done.
    Done(String),
    /// It failed; the process runs on. The error.
    Failed(String),
    /// This process was restarted from it.
    Restarted,
}

static NEXT: AtomicU64 = AtomicU64::new(1);
static TABLE: Mutex<Option<HashMap<u64, Option<Finished>>>> = Mutex::new(None);
static CHANGED: Condvar = Condvar::new();

fn table() -> std::sync::MutexGuard<'static, Option<HashMap<u64, Option<Finished>>>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Why a request was not made.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RequestError {
    #[error(transparent)]
    Init(#[from] helper::InitError),
    #[error("libcr: no cr-agent answers on this node (CR_AGENT_SOCKET or the default socket): a checkpoint cannot be requested")]
    NoAgent,
    #[error("libcr: the agent refused the checkpoint: {0}")]
    Refused(String),
}

/// What to checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// This process and its descendants (the job, for a process of a
    /// `cr_run` job).
    Tree,
    /// The whole cluster job this process is a member of, on every node.
    Job,
}

/// Ask the agent for a checkpoint; the request's number.
pub fn request(scope: Scope) -> Result<u64, RequestError> {
    helper::init()?;
    let id = NEXT.fetch_add(1, Ordering::SeqCst);
    table().get_or_insert_with(HashMap::new).insert(id, None);
    cs::enter();
    let asked = ask(id, scope);
    cs::leave();
    if asked.is_err() {
        table().get_or_insert_with(HashMap::new).remove(&id);
    }
    asked.map(|()| id)
}

fn ask(id: u64, scope: Scope) -> Result<(), RequestError> {
    let mut agent = cr_rpc::local::Agent::if_running().ok_or(RequestError::NoAgent)?;
    agent
        .request_checkpoint(pb::SelfCheckpointRequest {
            request: id,
            job: scope == Scope::Job,
            dir: std::env::var("CR_CHECKPOINT_DIR").unwrap_or_default(),
            after: pb::After::Continue as i32,
        })
        .map_err(RequestError::Refused)
}

/// Wait up to `timeout` (None: no limit) for request `id` to end; its end
/// (the request is then forgotten), or None if it has not ended yet (or
/// is unknown: `known` tells).
pub fn poll(id: u64, timeout: Option<Duration>) -> (bool, Option<Finished>) {
    let deadline = timeout.map(|t| Instant::now() + t);
    let mut t = table();
    loop {
        let Some(state) = t.get_or_insert_with(HashMap::new).get(&id).cloned() else {
            return (false, None);
        };
        if let Some(f) = state {
            t.get_or_insert_with(HashMap::new).remove(&id);
            return (true, Some(f));
        }
        let left = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return (true, None);
                }
                left
            }
            None => Duration::from_secs(3600),
        };
        t = CHANGED
            .wait_timeout(t, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// The agent's DONE.
pub(crate) fn done(d: Done) {
    let mut t = table();
    if let Some(slot) = t.get_or_insert_with(HashMap::new).get_mut(&d.request) {
        *slot = Some(if d.ok {
            Finished::Done(d.message)
        } else {
            Finished::Failed(d.message)
        });
    }
    CHANGED.notify_all();
}

/// This process was restarted: every request it was waiting for ends so.
pub(crate) fn restarted() {
    let mut t = table();
    for slot in t.get_or_insert_with(HashMap::new).values_mut() {
        if slot.is_none() {
            *slot = Some(Finished::Restarted);
        }
    }
    CHANGED.notify_all();
}
