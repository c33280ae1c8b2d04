//! gRPC channels: to a daemon over TCP (TLS as configured), or to the
//! node's agent over its Unix socket; and the daemons' side of them
//! ([`incoming`]).

use crate::tls::Security;
use crate::RpcError;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Uri};

/// HTTP/2 keepalive of the channels: a ping every this long, the
/// connection dropped when one is not answered within twice that.
pub const KEEPALIVE: Duration = Duration::from_secs(10);

/// The connections a daemon accepts on `listener`, with Nagle's algorithm
/// off (TCP_NODELAY, as the channels have): a reply's HTTP/2 frames are
/// written in several small writes, and with Nagle on the last waits for
/// the peer's delayed ACK, 40 ms on Linux. (tonic's
/// `Server::tcp_nodelay` only applies to the listeners it binds itself.)
pub fn incoming(listener: tokio::net::TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

fn endpoint(
    addr: &str,
    sec: &Security,
    domain: &str,
    timeout: Duration,
    keepalive: Duration,
    while_idle: bool,
) -> Result<Endpoint, RpcError> {
    let bad = |what: String| RpcError::Address {
        addr: addr.to_string(),
        what,
    };
    let uri = format!("{}://{addr}", sec.scheme());
    let mut ep = Endpoint::from_shared(uri)
        .map_err(|e| bad(e.to_string()))?
        .connect_timeout(timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(keepalive)
        .keep_alive_timeout(keepalive * 2)
        .keep_alive_while_idle(while_idle);
    if let Some(tls) = sec.client(domain) {
        ep = ep.tls_config(tls).map_err(|e| bad(e.to_string()))?;
    }
    Ok(ep)
}

/// A connected channel to `addr` (host:port) whose certificate names `domain`.
pub async fn connect(
    addr: &str,
    sec: &Security,
    domain: &str,
    timeout: Duration,
) -> Result<Channel, RpcError> {
    endpoint(addr, sec, domain, timeout, KEEPALIVE, true)?
        .connect()
        .await
        .map_err(|e| RpcError::Connect {
            addr: addr.to_string(),
            what: crate::error::innermost(&e),
        })
}

/// A channel that connects on first use (and again after a failure).
pub fn lazy(
    addr: &str,
    sec: &Security,
    domain: &str,
    timeout: Duration,
) -> Result<Channel, RpcError> {
    Ok(endpoint(addr, sec, domain, timeout, KEEPALIVE, true)?.connect_lazy())
}

/// [`lazy`] with its own keepalive period: a call in flight on a
/// connection whose peer stopped answering (a cut link) fails within
/// three periods instead of hanging until its own timeout. Only while
/// calls are in flight: a coordinator holds one such channel per node, and
/// pinging thousands of idle ones every second is most of its work.
pub fn lazy_with_keepalive(
    addr: &str,
    sec: &Security,
    domain: &str,
    timeout: Duration,
    keepalive: Duration,
) -> Result<Channel, RpcError> {
    Ok(endpoint(addr, sec, domain, timeout, keepalive, false)?.connect_lazy())
}

/// HTTP/2 flow-control windows of a channel that carries bulk data (image
/// copies between agents): the default 64 KiB stream window would cap a
/// copy at 64 KiB per round trip.
const BULK_STREAM_WINDOW: u32 = 16 << 20;
const BULK_CONNECTION_WINDOW: u32 = 32 << 20;

/// [`lazy_with_keepalive`] with large flow-control windows, for bulk data.
pub fn lazy_bulk(
    addr: &str,
    sec: &Security,
    domain: &str,
    timeout: Duration,
    keepalive: Duration,
) -> Result<Channel, RpcError> {
    Ok(endpoint(addr, sec, domain, timeout, keepalive, true)?
        .initial_stream_window_size(BULK_STREAM_WINDOW)
        .initial_connection_window_size(BULK_CONNECTION_WINDOW)
        .connect_lazy())
}

/// The agent's Unix socket for local clients: `CR_AGENT_SOCKET` or the default.
pub fn agent_socket() -> PathBuf {
    cr_proto::agent_socket()
}

/// A channel over the agent's Unix socket.
pub async fn local(socket: &Path) -> Result<Channel, RpcError> {
    let path = socket.to_path_buf();
    // The URI is required by the API and ignored by the connector.
    Endpoint::from_static("http://agent.local")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(&path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
        .map_err(|e| RpcError::Connect {
            addr: socket.display().to_string(),
            what: crate::error::innermost(&e),
        })
}
