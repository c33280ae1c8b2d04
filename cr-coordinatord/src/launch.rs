//! Remote starts (`cr_rsh`): a member of job J on node A asks, through
//! A's agent, for a command to be started as a new member of J on the
//! node named by HOST (a node name, or one of a node's addresses). The
//! coordinator checks that A hosts a live member of J, finds HOST's node
//! and forwards the request to its agent, which starts `cr_run --job J --
//! COMMAND`.

use crate::coordinator::Coordinator;
use crate::error::Error;
use cr_rpc::pb;

impl Coordinator {
    /// The node (its name) that `host` names: a node's name, one of the
    /// addresses it registered, or the host of its agent's address.
    pub fn resolve_host(&self, host: &str) -> Result<String, Error> {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        self.catalog.read(|s| {
            if s.nodes.contains_key(host) {
                return Ok(host.to_string());
            }
            s.nodes
                .values()
                .find(|n| {
                    n.addresses.iter().any(|a| a == host)
                        || n.agent_addr
                            .parse::<std::net::SocketAddr>()
                            .is_ok_and(|a| a.ip().to_string() == host)
                })
                .map(|n| n.name.clone())
                .ok_or_else(|| Error::UnknownNode {
                    node: host.to_string(),
                    known: s.nodes.keys().cloned().collect::<Vec<_>>().join(", "),
                })
        })
    }

    /// Starts `req.command` as a member of `req.job` on `req.host`'s node,
    /// for a member of that job on `from` (the asking agent's node).
    pub async fn launch(
        &self,
        from: &str,
        mut req: pb::LaunchRequest,
    ) -> Result<pb::LaunchReply, Error> {
        if req.command.is_empty() {
            return Err(Error::Invalid {
                what: "no command to launch".into(),
            });
        }
        // The asking agent reports its new member (the caller's `cr_run`)
        // on its own stream, which may reach us after the caller's first
        // `cr_rsh`: mpiexec starts its remote proxies at once.
        let asks = self
            .job_when(&req.job, crate::users::JOIN_WAIT, |j| {
                j.members.iter().any(|m| m.alive && m.node == from)
            })
            .await
            .map(|j| j.members.iter().any(|m| m.alive && m.node == from));
        match asks {
            None => return Err(Error::UnknownJob { job: req.job }),
            Some(false) => {
                return Err(Error::Invalid {
                    what: format!("node {from} hosts no live member of job {}", req.job),
                })
            }
            Some(true) => {}
        }
        let node = self.resolve_host(&req.host)?;
        if !self.liveness().is_up(&node) {
            return Err(Error::NodeDown {
                job: req.job,
                node,
                why: "no heartbeat".into(),
            });
        }
        req.from_node = from.to_string();
        tracing::info!(job = req.job, from, node, command = ?req.command, "launch");
        let job = req.job.clone();
        self.agents
            .launch(&node, req)
            .await
            .map_err(|reason| Error::LaunchFailed { job, node, reason })
    }
}
