//! The coordinator's view of the agents: [`AgentApi`], one method per RPC
//! of the Agent service, addressed by node name. [`GrpcAgents`] is the real
//! one (a lazily connected channel per node, mutual TLS with the agent's
//! node name as its TLS name); tests and cr-bench use in-process fakes.
//!
//! The round's calls (PREPARE, FREEZE, DUMP, ABORT, FINISH) go on one
//! `Commands` stream per agent ([`cr_rpc::commands`]), opened on the first
//! of them and again after it fails; an agent without it (Unimplemented)
//! gets unary calls until it registers again.
//!
//! Errors are one readable line (see [`cr_rpc::status_line`]), the same
//! on the stream as in a unary call.

use crate::catalog::Catalog;
use cr_rpc::commands;
use cr_rpc::pb;
use cr_rpc::pb::agent_client::AgentClient;
use cr_rpc::tls::Security;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::transport::Channel;

/// Keepalive of the channels to agents (see `cr_rpc::channel`).
pub const AGENT_KEEPALIVE: Duration = Duration::from_secs(1);

/// An agent's reply, or why there is none (one line).
pub type AgentResult<T> = Result<T, String>;

/// The Agent service of every node, by node name.
#[tonic::async_trait]
pub trait AgentApi: Send + Sync {
    async fn prepare(&self, node: &str, req: pb::PrepareRequest) -> AgentResult<pb::PrepareReply>;
    /// After a PREPARE with `callbacks_first`: freeze the members.
    async fn freeze(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::PrepareReply>;
    async fn dump(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::DumpReply>;
    async fn abort(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::Empty>;
    async fn finish(&self, node: &str, req: pb::FinishRequest) -> AgentResult<pb::FinishReply>;
    async fn restore(&self, node: &str, req: pb::RestoreRequest) -> AgentResult<pb::RestoreReply>;
    async fn release(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::ReleaseReply>;
    /// Every node released a restore with `job_barrier`: the restored
    /// members' restart callbacks run now.
    async fn job_back(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::Empty>;
    async fn remove(&self, node: &str, req: pb::RemoveRequest) -> AgentResult<pb::Empty>;
    async fn unlock(&self, node: &str, req: pb::RemoveRequest) -> AgentResult<pb::Empty>;
    /// Start a job member on `node` (cr_rsh); agents that cannot refuse.
    async fn launch(&self, node: &str, _req: pb::LaunchRequest) -> AgentResult<pb::LaunchReply> {
        Err(format!("the agent of {node} cannot start commands"))
    }
    /// Pre-dump a running member (pre-copy migration).
    async fn pre_dump(
        &self,
        node: &str,
        _req: pb::PreDumpRequest,
    ) -> AgentResult<pb::PreDumpReply> {
        Err(format!("node {node} cannot pre-dump"))
    }
    /// Copy images from another node's agent. (Fakes model shared
    /// storage: every image is already there, by the same path.)
    async fn fetch(&self, _node: &str, req: pb::FetchRequest) -> AgentResult<pb::FetchReply> {
        Ok(pb::FetchReply {
            dirs: req.dirs,
            ..Default::default()
        })
    }
    /// The agent of `node` (re)started: forget any connection to its
    /// predecessor (a channel would otherwise answer the next call with the
    /// error of its last failed connection).
    fn reset(&self, _node: &str) {}
}

/// The agents over gRPC. Their addresses come from the catalog (as they
/// registered); a channel is made on first use and again when the address
/// changes.
pub struct GrpcAgents {
    catalog: Arc<Catalog>,
    security: Security,
    connect_timeout: Duration,
    call_timeout: Duration,
    channels: Mutex<HashMap<String, Link>>,
}

/// How the round's calls reach an agent.
enum Via {
    /// Not tried yet, or the stream failed: open one.
    Unknown,
    Stream(Arc<commands::Client>),
    /// The agent has no Commands stream.
    Unary,
}

/// The channel to a node's agent (at its address) and its command stream.
struct Link {
    addr: String,
    channel: Channel,
    via: Arc<tokio::sync::Mutex<Via>>,
}

impl Link {
    fn new(addr: String, channel: Channel) -> Link {
        Link {
            addr,
            channel,
            via: Arc::new(tokio::sync::Mutex::new(Via::Unknown)),
        }
    }
}

impl GrpcAgents {
    /// `call_timeout` bounds every call (the protocol applies its own,
    /// usually shorter, deadlines as well).
    pub fn new(
        catalog: Arc<Catalog>,
        security: Security,
        connect_timeout: Duration,
        call_timeout: Duration,
    ) -> GrpcAgents {
        GrpcAgents {
            catalog,
            security,
            connect_timeout,
            call_timeout,
            channels: Mutex::new(HashMap::new()),
        }
    }

    fn client(&self, node: &str) -> AgentResult<AgentClient<Channel>> {
        self.link(node).map(|(ch, _)| AgentClient::new(ch))
    }

    /// The command stream to `node`'s agent (opened now if there is none,
    /// or the last one failed), or None: the agent has none (unary calls).
    async fn stream(&self, node: &str) -> AgentResult<Option<Arc<commands::Client>>> {
        let (ch, via) = self.link(node)?;
        let mut via = via.lock().await;
        match &*via {
            Via::Unary => return Ok(None),
            Via::Stream(c) if !c.is_closed() => return Ok(Some(c.clone())),
            Via::Stream(_) | Via::Unknown => {}
        }
        match commands::Client::open(ch).await {
            Ok(c) => {
                tracing::debug!(node, "agent command stream");
                let c = Arc::new(c);
                *via = Via::Stream(c.clone());
                Ok(Some(c))
            }
            Err(s) if s.code() == tonic::Code::Unimplemented => {
                tracing::info!(node, "the agent has no command stream: unary calls");
                *via = Via::Unary;
                Ok(None)
            }
            Err(s) => {
                *via = Via::Unknown;
                Err(cr_rpc::status_line(&s))
            }
        }
    }

    /// Calls waiting for their reply on `node`'s command stream (None:
    /// none open).
    pub fn in_flight(&self, node: &str) -> Option<usize> {
        let via = self
            .channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(node)?
            .via
            .clone();
        let via = via.try_lock().ok()?;
        match &*via {
            Via::Stream(c) if !c.is_closed() => Some(c.in_flight()),
            _ => None,
        }
    }

    fn link(&self, node: &str) -> AgentResult<(Channel, Arc<tokio::sync::Mutex<Via>>)> {
        // Reused as long as the node does not register again (which is
        // the only way its address changes: see `reset`); no look into
        // the catalog, whose lock every call would take.
        if let Some(l) = self
            .channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(node)
        {
            return Ok((l.channel.clone(), l.via.clone()));
        }
        let addr = self
            .catalog
            .read(|s| s.nodes.get(node).map(|n| n.agent_addr.clone()))
            .ok_or_else(|| format!("node {node} is not registered"))?;
        let mut chans = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = chans.get(node) {
            if l.addr == addr {
                return Ok((l.channel.clone(), l.via.clone()));
            }
        }
        // A short keepalive: an agent whose link is cut fails the call in
        // flight within seconds, so its peers are not held frozen waiting.
        let ch = cr_rpc::channel::lazy_with_keepalive(
            &addr,
            &self.security,
            node,
            self.connect_timeout,
            AGENT_KEEPALIVE,
        )
        .map_err(|e| e.to_string())?;
        tracing::debug!(node, addr = %addr, "agent channel");
        let l = Link::new(addr, ch);
        let out = (l.channel.clone(), l.via.clone());
        chans.insert(node.to_string(), l);
        Ok(out)
    }
}

macro_rules! call {
    ($self:ident, $node:ident, $method:ident, $req:ident) => {{
        let mut c = $self.client($node)?;
        match tokio::time::timeout($self.call_timeout, c.$method($req)).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(cr_rpc::status_line(&s)),
            Err(_) => Err(format!(
                "no reply within {} ms",
                $self.call_timeout.as_millis()
            )),
        }
    }};
}

/// A round's call: on the node's command stream, else unary; bounded by
/// `call_timeout` either way (a call given up leaves nothing pending).
macro_rules! round_call {
    ($self:ident, $node:ident, $variant:ident, $method:ident, $req:ident) => {{
        let call = async {
            match $self.stream($node).await? {
                Some(c) => match c.call(commands::Call::$variant($req)).await? {
                    commands::Reply::$variant(r) => Ok(r),
                    _ => Err(format!(
                        "the agent of {} answered {} with another call's reply",
                        $node,
                        stringify!($method)
                    )),
                },
                None => {
                    let mut c = $self.client($node)?;
                    c.$method($req)
                        .await
                        .map(|r| r.into_inner())
                        .map_err(|s| cr_rpc::status_line(&s))
                }
            }
        };
        match tokio::time::timeout($self.call_timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "no reply within {} ms",
                $self.call_timeout.as_millis()
            )),
        }
    }};
}

#[tonic::async_trait]
impl AgentApi for GrpcAgents {
    fn reset(&self, node: &str) {
        self.channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(node);
    }

    async fn prepare(&self, node: &str, req: pb::PrepareRequest) -> AgentResult<pb::PrepareReply> {
        round_call!(self, node, Prepare, prepare, req)
    }
    async fn freeze(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::PrepareReply> {
        round_call!(self, node, Freeze, freeze, req)
    }
    async fn dump(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::DumpReply> {
        round_call!(self, node, Dump, dump, req)
    }
    async fn abort(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::Empty> {
        round_call!(self, node, Abort, abort, req)
    }
    async fn finish(&self, node: &str, req: pb::FinishRequest) -> AgentResult<pb::FinishReply> {
        round_call!(self, node, Finish, finish, req)
    }
    async fn restore(&self, node: &str, req: pb::RestoreRequest) -> AgentResult<pb::RestoreReply> {
        call!(self, node, restore, req)
    }
    async fn release(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::ReleaseReply> {
        call!(self, node, release, req)
    }
    async fn job_back(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::Empty> {
        call!(self, node, job_back, req)
    }
    async fn remove(&self, node: &str, req: pb::RemoveRequest) -> AgentResult<pb::Empty> {
        call!(self, node, remove, req)
    }
    async fn unlock(&self, node: &str, req: pb::RemoveRequest) -> AgentResult<pb::Empty> {
        call!(self, node, unlock, req)
    }
    async fn launch(&self, node: &str, req: pb::LaunchRequest) -> AgentResult<pb::LaunchReply> {
        call!(self, node, launch, req)
    }
    async fn fetch(&self, node: &str, req: pb::FetchRequest) -> AgentResult<pb::FetchReply> {
        call!(self, node, fetch, req)
    }
    async fn pre_dump(&self, node: &str, req: pb::PreDumpRequest) -> AgentResult<pb::PreDumpReply> {
        call!(self, node, pre_dump, req)
    }
}
