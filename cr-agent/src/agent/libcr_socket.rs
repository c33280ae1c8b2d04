//! The agent's socket for libcr, `<socket>.libcr` (`cr_proto::coop`):
//! programs linked with libcr ask for checkpoints of themselves here in
//! one line (`SELF`), without gRPC, so that libcr links no RPC stack. The
//! caller is known by the socket's credentials, as on the gRPC socket, and
//! is served as `Local.RequestCheckpoint` would serve it.
//!
//! Also the sweep of `$CR_COOP_DIR` (default /run/cr/coop): the socket
//! files of programs that ended without removing theirs (killed) go, at
//! start and every [`SWEEP_PERIOD`].

use super::authz::Caller;
use super::local::LocalService;
use super::Shared;
use cr_proto::coop::{self as wire, SelfRequest};
use cr_rpc::pb;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tracing::{debug, info, warn};

/// How long a caller has to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the libcr socket directory is swept.
pub const SWEEP_PERIOD: Duration = Duration::from_secs(60);

/// Serve `listener` until `stop` resolves.
pub async fn serve(
    shared: Arc<Shared>,
    listener: UnixListener,
    stop: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(stop);
    loop {
        let conn = tokio::select! {
            _ = &mut stop => return,
            c = listener.accept() => c,
        };
        match conn {
            Ok((c, _)) => {
                let shared = shared.clone();
                tokio::spawn(async move { one(shared, c).await });
            }
            Err(e) => warn!(error = %e, "libcr socket: accept failed"),
        }
    }
}

async fn one(shared: Arc<Shared>, c: UnixStream) {
    let who = match c.peer_cred() {
        Ok(cred) => Caller {
            uid: cred.uid(),
            gid: cred.gid(),
            pid: cred.pid().unwrap_or(0),
        },
        Err(e) => {
            debug!(error = %e, "libcr socket: no credentials");
            return;
        }
    };
    let (r, mut w) = c.into_split();
    let mut line = String::new();
    let read = tokio::time::timeout(READ_TIMEOUT, BufReader::new(r).read_line(&mut line)).await;
    if !matches!(read, Ok(Ok(n)) if n > 0) {
        debug!(pid = who.pid, "libcr socket: no request");
        return;
    }
    let answer = match SelfRequest::parse(&line) {
        Some(q) => LocalService { shared }
            .request_self(
                who,
                pb::SelfCheckpointRequest {
                    request: q.request,
                    job: q.job,
                    dir: q.dir,
                    after: pb::After::Continue as i32,
                },
            )
            .map_err(|s| s.message().to_string()),
        None => Err(format!("not a request: {}", line.trim_end())),
    };
    let _ = w.write_all(wire::answer_line(&answer).as_bytes()).await;
}

/// The libcr socket directory of the programs this agent serves.
fn coop_dir() -> PathBuf {
    std::env::var_os(wire::DIR_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(wire::DEFAULT_DIR))
}

/// Remove the libcr socket files in `dir` nobody listens on any more.
pub fn sweep(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let path = e.path();
        if !wire::is_socket_path(&path.to_string_lossy()) {
            continue;
        }
        // A live libcr takes the empty connection as a stray message.
        let refused = matches!(
            std::os::unix::net::UnixStream::connect(&path),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
        );
        if refused && std::fs::remove_file(&path).is_ok() {
            removed += 1;
        }
    }
    if removed > 0 {
        info!(dir = %dir.display(), removed, "removed the libcr sockets of ended programs");
    }
    removed
}

/// Sweep the libcr socket directory now and every [`SWEEP_PERIOD`].
pub async fn sweep_periodically() {
    let dir = coop_dir();
    loop {
        let d = dir.clone();
        let _ = tokio::task::spawn_blocking(move || sweep(&d)).await;
        tokio::time::sleep(SWEEP_PERIOD).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the files nobody listens on go; other files stay.
    #[test]
    fn sweep_removes_the_sockets_of_ended_programs() {
        let dir = std::env::temp_dir().join(format!("cr-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let live = wire::socket_path(&dir, 1, 10);
        let dead = wire::socket_path(&dir, 1, 11);
        let other = dir.join("other.sock");
        let _l = std::os::unix::net::UnixListener::bind(&live).unwrap();
        drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
        drop(std::os::unix::net::UnixListener::bind(&other).unwrap());
        assert_eq!(sweep(&dir), 1);
        assert!(live.exists() && !dead.exists() && other.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
