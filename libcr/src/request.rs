//! Checkpoints the program asks for (`cr_request_checkpoint`,
//! [`crate::request_checkpoint`]): the node's agent is asked on its libcr
//! socket (`SELF`, see `cr_proto::coop`; no gRPC) and answers at once
//! (without an agent, a
//! checkpoint of one's tree is taken by the standalone cr_checkpoint, see
//! [`crate::standalone`]); the checkpoint then goes
//! as any other (the callbacks run in the libcr thread meanwhile), and its
//! end comes back on the libcr socket (`DONE`, see `cr_proto::coop`). A
//! process restored from that checkpoint gets `RESTART` instead: its
//! requests end as restarted.
//!
//! The connection to the agent is made inside a critical section, so that
//! the freeze waits until it is closed: nothing of it is in the image.

use crate::{cs, helper, standalone};
use cr_proto::coop::{self as wire, Done, SelfRequest};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
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
    #[error("libcr: no cr-agent answers on this node (CR_AGENT_SOCKET or the default socket): a checkpoint of the job cannot be requested")]
    NoAgent,
    #[error(transparent)]
    Fallback(#[from] standalone::FallbackError),
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
    let dir = std::env::var("CR_CHECKPOINT_DIR").unwrap_or_default();
    let socket = wire::agent_libcr_socket(&cr_proto::agent_socket());
    let Ok(mut agent) = UnixStream::connect(&socket) else {
        return match scope {
            Scope::Job => Err(RequestError::NoAgent),
            Scope::Tree => Ok(standalone::start(
                id,
                Some(&dir).filter(|d| !d.is_empty()).map(String::as_str),
            )?),
        };
    };
    let ask = SelfRequest {
        request: id,
        job: scope == Scope::Job,
        dir,
    };
    let refused =
        |e: std::io::Error| RequestError::Refused(format!("no answer from the agent: {e}"));
    // The agent answers once it accepted (a job's checkpoint: once the
    // coordinator did).
    agent
        .set_read_timeout(Some(ANSWER_TIMEOUT))
        .map_err(refused)?;
    agent.write_all(ask.line().as_bytes()).map_err(refused)?;
    let mut line = String::new();
    BufReader::new(&agent)
        .read_line(&mut line)
        .map_err(refused)?;
    match wire::parse_answer(&line) {
        Some(r) => r.map_err(RequestError::Refused),
        None => Err(RequestError::Refused(format!(
            "unexpected answer from the agent: {}",
            line.trim_end()
        ))),
    }
}

/// How long the agent may take to accept a request.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

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
