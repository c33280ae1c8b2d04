//! The node side of the system: the agent daemon ([`agent`]) and the
//! tools `cr_checkpoint` and `cr_run`. The checkpoint and restore engines
//! themselves are the `cr-engine` crate; `cr_rpc::opts` converts their
//! options to and from the messages of the agent's Local service.
#![forbid(unsafe_code)]

pub mod agent;
pub mod pmi;
pub mod relay;
