//! Programs that take part in their checkpoints through libcr (crate
//! `cr-libcr`; the protocol is `cr_proto::coop`). Before a tree is frozen, every
//! process of it that called `cr_init` (it listens on its libcr socket) is
//! asked to run its checkpoint callbacks and to close its critical
//! sections; the freeze waits until all are ready, within a deadline that
//! names the callback still running. After the dump each is told that the
//! checkpoint is done (or failed), and after a restore that it was
//! restarted. Processes without libcr cost a look at their fds.

use crate::error::CheckpointError;
use crate::kinds::tree;
use cr_proto::coop::{self as wire, Done, Outcome, Prepare, Reply};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tracing::{debug, info};

/// How long callbacks may run, by default.
pub const CALLBACK_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an open critical section may delay a checkpoint, by default.
pub const CS_WAIT: Duration = Duration::from_secs(10);

/// What the checkpoint options say about cooperating programs.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub callback_timeout: Duration,
    pub cs_wait: Duration,
    pub cs_proceed: bool,
}

/// Finds the libcr sockets of processes: the listening Unix sockets a
/// process holds (`/proc/PID/fd`) whose name is a libcr one
/// ([`wire::is_socket_path`]), named in `/proc/PID/net/unix` (read once
/// per network namespace), reached through the process's own root
/// (`/proc/PID/root`). A process without libcr costs a look at its fds.
#[derive(Default)]
pub struct Finder {
    /// Network namespace inode → listening libcr sockets (inode → path).
    by_netns: HashMap<u64, HashMap<u64, String>>,
}

/// `__SO_ACCEPTCON` in the flags of /proc/net/unix: a listening socket.
const SO_ACCEPTCON: u32 = 0x10000;

fn listening_libcr_sockets(pid: i32) -> HashMap<u64, String> {
    let text = cr_sys::proc::read_string(&format!("/proc/{pid}/net/unix")).unwrap_or_default();
    text.lines()
        .skip(1)
        .filter_map(|l| {
            // Num RefCount Protocol Flags Type St Inode [Path]
            let f: Vec<&str> = l.split_whitespace().collect();
            let flags = u32::from_str_radix(f.get(3)?, 16).ok()?;
            let path = *f.get(7)?;
            (flags & SO_ACCEPTCON != 0 && wire::is_socket_path(path))
                .then(|| Some((f.get(6)?.parse().ok()?, path.to_string())))
                .flatten()
        })
        .collect()
}

impl Finder {
    /// The libcr socket of process `pid`, if it listens on one.
    pub fn socket_of(&mut self, pid: i32) -> Option<PathBuf> {
        // Its unix sockets only: /proc/PID/net/unix lists every unix
        // socket of the namespace, and the members of a node, in one
        // namespace, each read it (their launchers and the agent hold
        // ~4 unix sockets per member: O(members²) before the freeze) when
        // all they hold is TCP sockets.
        let inodes: Vec<u64> = cr_sys::proc::fds(pid)
            .ok()?
            .into_iter()
            .filter_map(|(fd, t)| match t {
                cr_sys::proc::FDTarget::Socket(ino) if cr_sys::fdio::may_be_unix(pid, fd) => {
                    Some(ino)
                }
                _ => None,
            })
            .collect();
        if inodes.is_empty() {
            return None;
        }
        let netns = std::fs::metadata(format!("/proc/{pid}/ns/net")).ok()?.ino();
        let socks = self
            .by_netns
            .entry(netns)
            .or_insert_with(|| listening_libcr_sockets(pid));
        // A child forked by a libcr program holds its parent's socket too
        // (no exec closed it), but nothing of it answers there: only the
        // socket its own cr_init made (named after its PID) counts.
        let ns_pid = cr_sys::proc::status(pid)
            .ok()
            .and_then(|s| cr_sys::proc::ns_last(&s.nspid))
            .map_or(pid, |p| p as i32);
        let own = inodes
            .iter()
            .filter_map(|i| socks.get(i))
            .find(|path| wire::socket_pid(path) == Some(ns_pid))?;
        let own = Path::new(own);
        let through_root =
            Path::new(&format!("/proc/{pid}/root")).join(own.strip_prefix("/").unwrap_or(own));
        // sun_path holds 107 bytes.
        Some(if through_root.as_os_str().len() < 108 {
            through_root
        } else {
            own.to_path_buf()
        })
    }
}

/// The processes of a tree that are ready for the freeze (their callbacks
/// wait in `cr_checkpoint`). Dropped without [`Coop::finish`], it tells
/// them the checkpoint failed.
pub struct Coop {
    ready: Vec<(i32, PathBuf)>,
}

struct Session {
    pid: i32,
    path: PathBuf,
    reader: BufReader<UnixStream>,
}

fn coop_error(pid: i32, reason: String) -> CheckpointError {
    CheckpointError::Coop { pid, reason }
}

/// Ask every process of `pids` that uses libcr to get ready for a
/// checkpoint into `dest`; returns once all are, or fails naming the
/// process and callback that refused or did not finish in time (the
/// processes then run on: their callbacks see the checkpoint cancelled).
pub fn prepare(pids: &[i32], dest: &Path, limits: Limits) -> Result<Coop, CheckpointError> {
    let t0 = Instant::now();
    let deadline = t0 + limits.cs_wait + limits.callback_timeout;
    let ask = Prepare {
        cs_wait: limits.cs_wait,
        cs_proceed: limits.cs_proceed,
        dest: dest.display().to_string(),
    }
    .line();
    let mut sessions = Vec::new();
    let mut finder = Finder::default();
    for &pid in pids {
        let Some(path) = finder.socket_of(pid) else {
            continue;
        };
        let mut c = match UnixStream::connect(&path) {
            Ok(c) => c,
            // A file left by a process that ended.
            Err(e) => {
                debug!(pid, path = %path.display(), error = %e, "no libcr listening");
                continue;
            }
        };
        c.write_all(ask.as_bytes())
            .map_err(|e| coop_error(pid, format!("cannot ask libcr for a checkpoint: {e}")))?;
        sessions.push(Session {
            pid,
            path,
            reader: BufReader::new(c),
        });
    }
    if sessions.is_empty() {
        return Ok(Coop { ready: Vec::new() });
    }
    for s in &mut sessions {
        wait_ready(s, deadline, limits)?;
    }
    let freeze = wire::freeze_line(&wire::node_name());
    for s in &mut sessions {
        let c = s.reader.get_mut();
        c.write_all(freeze.as_bytes())
            .map_err(|e| coop_error(s.pid, format!("libcr went away: {e}")))?;
    }
    // Each closes its end before waiting for the outcome: wait for that, so
    // that no connection to us is left in the tree at the freeze.
    for s in &mut sessions {
        let _ = s
            .reader
            .get_ref()
            .set_read_timeout(Some(Duration::from_secs(5)));
        let mut rest = Vec::new();
        let _ = s.reader.read_to_end(&mut rest);
    }
    info!(
        processes = sessions.len(),
        ms = t0.elapsed().as_millis() as u64,
        "libcr callbacks ready"
    );
    Ok(Coop {
        ready: sessions.into_iter().map(|s| (s.pid, s.path)).collect(),
    })
}

/// Read one process's messages until READY.
fn wait_ready(s: &mut Session, deadline: Instant, limits: Limits) -> Result<(), CheckpointError> {
    // Callbacks started and not yet at their cr_checkpoint: (id, context, name).
    let mut running: Vec<(usize, String, String)> = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut line = String::new();
        let read = if left.is_zero() {
            Err(std::io::ErrorKind::TimedOut.into())
        } else {
            let _ = s.reader.get_ref().set_read_timeout(Some(left));
            s.reader.read_line(&mut line)
        };
        match read {
            Ok(0) => {
                return Err(coop_error(s.pid, "libcr closed the connection".into()));
            }
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                let reason = match running.last() {
                    Some((id, context, name)) => format!(
                        "callback #{id} {name} ({context} context) did not call cr_checkpoint within {}",
                        humantime::format_duration(limits.callback_timeout)
                    ),
                    None => format!(
                        "libcr did not answer within {} (critical sections, or an earlier checkpoint's callback still running)",
                        humantime::format_duration(limits.cs_wait + limits.callback_timeout)
                    ),
                };
                return Err(coop_error(s.pid, reason));
            }
            Err(e) => return Err(coop_error(s.pid, format!("cannot read from libcr: {e}"))),
        }
        match Reply::parse(&line) {
            Some(Reply::Started { id, context, name }) => {
                debug!(pid = s.pid, id, %name, "callback started");
                running.push((id, context, name));
            }
            Some(Reply::Reached { id }) => running.retain(|r| r.0 != id),
            Some(Reply::Ready) => return Ok(()),
            Some(Reply::Failed(why)) => return Err(coop_error(s.pid, why)),
            None => debug!(pid = s.pid, line = line.trim_end(), "unknown libcr message"),
        }
    }
}

/// Send `line` to process `pid`'s libcr socket `path` (best effort: a
/// process that ended has nobody listening).
fn tell_line(pid: i32, path: &Path, line: &str) {
    match UnixStream::connect(path) {
        Ok(mut c) => {
            if let Err(e) = c.write_all(line.as_bytes()) {
                debug!(pid, error = %e, "cannot tell libcr");
            }
        }
        Err(e) => debug!(pid, error = %e, "cannot tell libcr"),
    }
}

fn tell(pid: i32, path: &Path, outcome: &Outcome) {
    tell_line(pid, path, &outcome.line());
}

/// Tell process `pid` how the checkpoint it asked for ended.
pub fn tell_done(pid: i32, done: &Done) {
    match Finder::default().socket_of(pid) {
        Some(path) => tell_line(pid, &path, &done.line()),
        None => debug!(
            pid,
            "the process that asked for a checkpoint has no libcr socket any more"
        ),
    }
}

impl Coop {
    /// How many processes got ready (their callbacks ran).
    pub fn len(&self) -> usize {
        self.ready.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ready.is_empty()
    }

    /// The checkpoint is done: the callbacks return from `cr_checkpoint`
    /// with 0.
    pub fn finish(mut self) {
        for (pid, path) in std::mem::take(&mut self.ready) {
            tell(pid, &path, &Outcome::Continue);
        }
    }
}

impl Drop for Coop {
    fn drop(&mut self) {
        for (pid, path) in std::mem::take(&mut self.ready) {
            tell(pid, &path, &Outcome::Abort);
        }
    }
}

/// After a restore from `dir`, once the tree of `root` runs: its libcr
/// callbacks return from `cr_checkpoint` with a value > 0.
pub fn restarted(root: i32, dir: &Path) {
    let mut finder = Finder::default();
    let restart = Outcome::Restart {
        node: wire::node_name(),
        dir: dir.display().to_string(),
    };
    for pid in tree::walk(root).unwrap_or_default() {
        if let Some(path) = finder.socket_of(pid) {
            tell(pid, &path, &restart);
        }
    }
}
