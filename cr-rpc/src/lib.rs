//! What the cluster daemons (`cr-agent`, `cr-coordinatord`) and their
//! clients (`crctl`, `cr_run`, `cr_checkpoint`, `cr_restart`) share.
//!
//! * [`tls`]: the cluster's mutual TLS (every peer holds a certificate of
//!   the cluster CA), or plain TCP when explicitly asked for.
//! * [`channel`]: gRPC channels to a TCP address or to the agent's Unix socket;
//!   [`local`]: the blocking client of the agent the command-line tools use;
//!   [`opts`]: the engines' options to and from the Local service's messages.
//! * [`config`]: TOML configuration files; [`logging`]: the daemons' log.
//! * [`shutdown`]: SIGTERM / SIGINT as a future; [`fault`]: the test hooks.
//! * [`pki`]: a cluster CA and certificates signed by it (`crctl pki`);
//!   [`identity`]: who a client certificate names, and what it may call.
#![forbid(unsafe_code)]

pub mod channel;
pub mod commands;
pub mod config;
pub mod error;
pub mod fault;
pub mod identity;
pub mod local;
pub mod logging;
pub mod opts;
pub mod pki;
pub mod shutdown;
pub mod tls;

pub use cr_proto::cluster as pb;
pub use error::RpcError;

/// Default port of cr-coordinatord.
pub const COORDINATOR_PORT: u16 = 7170;
/// Default port of a cr-agent's Agent service.
pub const AGENT_PORT: u16 = 7171;
pub use cr_proto::{AGENT_SOCKET, AGENT_SOCKET_ENV};
/// TLS name of the coordinator's certificate unless configured otherwise.
pub const COORDINATOR_NAME: &str = "cr-coordinatord";

/// One readable line from a gRPC status: its message, or its code when the
/// message is empty; a failure of the transport (no answer, a connection
/// lost) is said in plain words (`unreachable: ...`), never as the
/// transport library's message.
pub fn status_line(s: &tonic::Status) -> String {
    let msg = s.message().trim();
    let transport = matches!(
        s.code(),
        tonic::Code::Unavailable
            | tonic::Code::Unknown
            | tonic::Code::Cancelled
            | tonic::Code::Internal
            | tonic::Code::DeadlineExceeded
    ) && (std::error::Error::source(s).is_some()
        || [
            "transport",
            "h2 protocol",
            "http2",
            "connection",
            "timed out",
        ]
        .iter()
        .any(|w| msg.contains(w)));
    if transport || s.code() == tonic::Code::Unavailable {
        format!(
            "unreachable: {}",
            error::plain(&format!("{msg} {}", error::innermost(s)))
        )
    } else if msg.is_empty() {
        format!("{:?}", s.code())
    } else {
        msg.to_string()
    }
}
