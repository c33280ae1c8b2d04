//! The Agent service's `Commands` stream: the round's calls (PREPARE,
//! FREEZE, DUMP, ABORT, FINISH) as tagged messages on one bidirectional
//! stream per agent instead of one HTTP/2 stream per call.
//!
//! * [`serve`]: the agent's end: every command is handled concurrently by
//!   the function given (the unary handlers' logic), its reply tagged.
//! * [`Client`]: the coordinator's end: a call waits for the reply of its
//!   id; a call dropped (its timeout) leaves nothing behind; a stream that
//!   fails fails every call in flight and says so ([`Client::is_closed`]).

use crate::pb;
pub use pb::command::Call;
pub use pb::command_reply::Reply;
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, oneshot};
use tonic::{Status, Streaming};

/// Commands (and replies) queued per stream before a sender waits.
const QUEUE: usize = 64;

/// Why a call failed when the stream ended without an error.
const CLOSED: &str = "unreachable: the agent closed the command stream";

/// The stream of replies [`serve`] returns.
pub type ReplyStream = tokio_stream::wrappers::ReceiverStream<Result<pb::CommandReply, Status>>;

/// The status as a reply.
pub fn error_reply(s: &Status) -> Reply {
    Reply::Error(pb::CommandError {
        code: s.code() as i32,
        message: s.message().to_string(),
    })
}

/// The agent's end: reads `incoming` until it ends, handling each command
/// in a task of its own with `handle`; the replies go out in the order
/// they are ready.
pub fn serve<F, Fut>(mut incoming: Streaming<pb::Command>, handle: F) -> ReplyStream
where
    F: Fn(Call) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Reply, Status>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(QUEUE);
    tokio::spawn(async move {
        loop {
            let cmd = match incoming.message().await {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(s) => {
                    tracing::debug!(error = %crate::status_line(&s), "command stream ended");
                    break;
                }
            };
            let id = cmd.id;
            let tx = tx.clone();
            let reply = match cmd.call {
                Some(call) => {
                    let fut = handle(call);
                    tokio::spawn(async move {
                        let reply = fut.await.unwrap_or_else(|s| error_reply(&s));
                        let _ = tx
                            .send(Ok(pb::CommandReply {
                                id,
                                reply: Some(reply),
                            }))
                            .await;
                    });
                    continue;
                }
                None => error_reply(&Status::invalid_argument("a command without a call")),
            };
            let _ = tx
                .send(Ok(pb::CommandReply {
                    id,
                    reply: Some(reply),
                }))
                .await;
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

type Pending = Mutex<HashMap<u64, oneshot::Sender<Result<Reply, String>>>>;

/// The caller's end of one agent's command stream.
pub struct Client {
    tx: mpsc::Sender<pb::Command>,
    pending: Arc<Pending>,
    next: AtomicU64,
    closed: Arc<AtomicBool>,
}

/// Takes a call's id out of the pending map when the call ends, however
/// (its reply, an error, or dropped by a timeout).
struct Forget<'a>(&'a Pending, u64);

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.1);
    }
}

impl Client {
    /// Open the stream on `channel`: fails as the agent answers (e.g.
    /// Unimplemented: an agent without it) or as the connection does.
    pub async fn open(channel: tonic::transport::Channel) -> Result<Client, Status> {
        let (tx, rx) = mpsc::channel(QUEUE);
        let mut c = pb::agent_client::AgentClient::new(channel);
        let mut replies = c
            .commands(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        let pending: Arc<Pending> = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        let (p, cl) = (pending.clone(), closed.clone());
        tokio::spawn(async move {
            let end = loop {
                match replies.message().await {
                    Ok(Some(r)) => {
                        let waiter = p.lock().unwrap_or_else(|e| e.into_inner()).remove(&r.id);
                        if let Some(w) = waiter {
                            let res = match r.reply {
                                Some(Reply::Error(e)) => Err(crate::status_line(&Status::new(
                                    tonic::Code::from(e.code),
                                    e.message,
                                ))),
                                Some(rep) => Ok(rep),
                                None => Err("a reply without a result".to_string()),
                            };
                            let _ = w.send(res);
                        }
                    }
                    Ok(None) => break CLOSED.to_string(),
                    Err(s) => break crate::status_line(&s),
                }
            };
            cl.store(true, Ordering::SeqCst);
            let waiters: Vec<_> = p
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .drain()
                .collect();
            for (_, w) in waiters {
                let _ = w.send(Err(end.clone()));
            }
        });
        Ok(Client {
            tx,
            pending,
            next: AtomicU64::new(1),
            closed,
        })
    }

    /// The stream failed or ended: open another.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst) || self.tx.is_closed()
    }

    /// Send `call`, wait for its reply; an error is one line (as
    /// [`crate::status_line`] makes it of the unary call's status).
    pub async fn call(&self, call: Call) -> Result<Reply, String> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (wtx, wrx) = oneshot::channel();
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, wtx);
        let _forget = Forget(&self.pending, id);
        if self.is_closed()
            || self
                .tx
                .send(pb::Command {
                    id,
                    call: Some(call),
                })
                .await
                .is_err()
        {
            self.closed.store(true, Ordering::SeqCst);
            return Err(CLOSED.to_string());
        }
        wrx.await.unwrap_or_else(|_| Err(CLOSED.to_string()))
    }

    /// Calls waiting for their reply.
    pub fn in_flight(&self) -> usize {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}
