//! The conversation between a checkpointer (`cr_engine::coop`) and libcr
//! (crate `cr-libcr`) in a target process, over the Unix socket libcr
//! listens on once the program called `cr_init`: `<dir>/<pid>.sock`, where `dir` is
//! `$CR_COOP_DIR` of the program, else [`DEFAULT_DIR`], and `pid` the
//! process's id in its own PID namespace.
//!
//! One line per message. A checkpoint:
//!
//! 1. checkpointer → library: `PREPARE <cs_wait_ms> <cs_proceed 0|1> <image dir>`;
//! 2. library → checkpointer, while the callbacks run: `START <id> <context> <name>`
//!    when a callback starts, `REACHED <id>` when it calls `cr_checkpoint`;
//!    then `READY` or `FAIL <reason>`;
//! 3. after `READY`, checkpointer → library: `FREEZE <node>`; the library closes the
//!    connection and waits on its listener (a socket bound to a name, which
//!    the checkpoint saves and the restore brings back);
//! 4. a new connection tells what happened: `CONTINUE` (the checkpoint is
//!    done, or `ABORT`: it failed) from the checkpointer, or `RESTART <node>
//!    <image dir>` from the restorer once the restored processes run.
//!
//! A checkpointer that drops the connection before `FREEZE` (timeout,
//! another process failed) aborts the checkpoint for this process.
//!
//! A checkpoint the program asked for (`cr_request_checkpoint`) is asked
//! on the agent's libcr socket ([`agent_libcr_socket`]; no gRPC, so that
//! libcr links no RPC stack): `SELF <request> <job 0|1> <dir>`, answered
//! `ACCEPTED` or `REFUSED <why>` (the agent's `Local.RequestCheckpoint`
//! does the same over gRPC). It ends with one more connection from the
//! agent: `DONE <request> ok|error <message>`.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Environment variable naming the directory of the sockets.
pub const DIR_ENV: &str = "CR_COOP_DIR";
/// The directory of the sockets when `$CR_COOP_DIR` is not set.
pub const DEFAULT_DIR: &str = "/run/cr/coop";

/// The socket of process `pid` of the PID namespace with inode `pidns`, in
/// `dir` (both in the name: every job's first process is PID 1).
pub fn socket_path(dir: &Path, pidns: u64, pid: i32) -> PathBuf {
    dir.join(format!("libcr-{pidns}-{pid}.sock"))
}

/// Whether a socket bound to `path` is a libcr socket (the checkpointer
/// finds it among the listening sockets a process holds).
pub fn is_socket_path(path: &str) -> bool {
    Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("libcr-") && n.ends_with(".sock"))
}

/// The PID (in its own PID namespace) of the process that made the libcr
/// socket bound to `path` ([`socket_path`]); None for another name.
pub fn socket_pid(path: &str) -> Option<i32> {
    let name = Path::new(path).file_name()?.to_str()?;
    let rest = name.strip_prefix("libcr-")?.strip_suffix(".sock")?;
    rest.rsplit_once('-')?.1.parse().ok()
}

/// The agent's socket for libcr, next to its gRPC socket `agent_socket`:
/// `<agent_socket>.libcr`.
pub fn agent_libcr_socket(agent_socket: &Path) -> PathBuf {
    let mut p = agent_socket.as_os_str().to_owned();
    p.push(".libcr");
    PathBuf::from(p)
}

/// A program asks the agent for a checkpoint of itself (the caller is
/// known from the socket's credentials).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelfRequest {
    /// The library's number for the request, repeated in the DONE line.
    pub request: u64,
    /// The caller's whole cluster job, else the caller's tree.
    pub job: bool,
    /// Image directory of a tree's checkpoint (empty: the default).
    pub dir: String,
}

impl SelfRequest {
    pub fn line(&self) -> String {
        format!(
            "SELF {} {} {}\n",
            self.request,
            u8::from(self.job),
            self.dir.replace('\n', " ")
        )
    }

    pub fn parse(line: &str) -> Option<SelfRequest> {
        let rest = line.trim_end_matches('\n').strip_prefix("SELF ")?;
        let mut it = rest.splitn(3, ' ');
        Some(SelfRequest {
            request: it.next()?.parse().ok()?,
            job: it.next()? == "1",
            dir: it.next().unwrap_or("").to_string(),
        })
    }
}

/// The agent's answer to a [`SelfRequest`]: accepted, or why not.
pub fn answer_line(r: &Result<(), String>) -> String {
    match r {
        Ok(()) => "ACCEPTED\n".into(),
        Err(why) => format!("REFUSED {}\n", why.replace('\n', " ")),
    }
}

/// Read an [`answer_line`]; None if it is neither.
pub fn parse_answer(line: &str) -> Option<Result<(), String>> {
    let line = line.trim_end_matches('\n');
    match line.split_once(' ').unwrap_or((line, "")) {
        ("ACCEPTED", _) => Some(Ok(())),
        ("REFUSED", why) => Some(Err(why.to_string())),
        _ => None,
    }
}

/// What a checkpointer asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepare {
    /// How long an open critical section may delay the checkpoint.
    pub cs_wait: Duration,
    /// After `cs_wait`: go on anyway (true) or fail (false).
    pub cs_proceed: bool,
    /// Where the image goes (for `cr_get_checkpoint_info`).
    pub dest: String,
}

impl Prepare {
    pub fn line(&self) -> String {
        format!(
            "PREPARE {} {} {}\n",
            self.cs_wait.as_millis(),
            u8::from(self.cs_proceed),
            self.dest
        )
    }

    pub fn parse(line: &str) -> Option<Prepare> {
        let rest = line.strip_prefix("PREPARE ")?;
        let mut it = rest.splitn(3, ' ');
        let ms = it.next()?.parse().ok()?;
        let proceed = it.next()? == "1";
        Some(Prepare {
            cs_wait: Duration::from_millis(ms),
            cs_proceed: proceed,
            dest: it.next().unwrap_or("").to_string(),
        })
    }
}

/// The library's messages during the callbacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Started {
        id: usize,
        context: String,
        name: String,
    },
    Reached {
        id: usize,
    },
    Ready,
    Failed(String),
}

impl Reply {
    pub fn line(&self) -> String {
        match self {
            Reply::Started { id, context, name } => format!("START {id} {context} {name}\n"),
            Reply::Reached { id } => format!("REACHED {id}\n"),
            Reply::Ready => "READY\n".into(),
            Reply::Failed(why) => format!("FAIL {}\n", why.replace('\n', " ")),
        }
    }

    pub fn parse(line: &str) -> Option<Reply> {
        let line = line.trim_end_matches('\n');
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        match word {
            "START" => {
                let mut it = rest.splitn(3, ' ');
                Some(Reply::Started {
                    id: it.next()?.parse().ok()?,
                    context: it.next()?.to_string(),
                    name: it.next().unwrap_or("?").to_string(),
                })
            }
            "REACHED" => Some(Reply::Reached {
                id: rest.parse().ok()?,
            }),
            "READY" => Some(Reply::Ready),
            "FAIL" => Some(Reply::Failed(rest.to_string())),
            _ => None,
        }
    }
}

/// The checkpointer's go-ahead after `READY`: `FREEZE <node>`, the node's
/// host name (the checkpointer's: a job in a UTS namespace of its own keeps
/// the name it had, wherever it is restarted).
pub fn freeze_line(node: &str) -> String {
    format!("FREEZE {node}\n")
}

/// The node of a [`freeze_line`]; None if it is not one.
pub fn parse_freeze(line: &str) -> Option<String> {
    let line = line.trim_end_matches('\n');
    match line.split_once(' ').unwrap_or((line, "")) {
        ("FREEZE", node) => Some(node.to_string()),
        _ => None,
    }
}

/// The host name of this process's UTS namespace (for a checkpointer or a
/// restorer: the node's).
pub fn node_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim_end().to_string())
        .unwrap_or_default()
}

/// What happened to the checkpoint, told on a new connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Done; the process runs on.
    Continue,
    /// Failed or cancelled; the process runs on.
    Abort,
    /// The process was restored on `node` (the restorer's host name) from
    /// the image in directory `dir`.
    Restart { node: String, dir: String },
}

impl Outcome {
    pub fn line(&self) -> String {
        match self {
            Outcome::Continue => "CONTINUE\n".into(),
            Outcome::Abort => "ABORT\n".into(),
            Outcome::Restart { node, dir } => format!("RESTART {node} {dir}\n"),
        }
    }

    pub fn parse(line: &str) -> Option<Outcome> {
        let line = line.trim_end_matches('\n');
        match line.split_once(' ').unwrap_or((line, "")) {
            ("CONTINUE", _) => Some(Outcome::Continue),
            ("ABORT", _) => Some(Outcome::Abort),
            ("RESTART", rest) => {
                let (node, dir) = rest.split_once(' ').unwrap_or(("", rest));
                Some(Outcome::Restart {
                    node: node.to_string(),
                    dir: dir.to_string(),
                })
            }
            _ => None,
        }
    }
}

/// The end of a checkpoint the program asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Done {
    /// The library's number of the request.
    pub request: u64,
    pub ok: bool,
    /// What was done, or the error.
    pub message: String,
}

impl Done {
    pub fn line(&self) -> String {
        format!(
            "DONE {} {} {}\n",
            self.request,
            if self.ok { "ok" } else { "error" },
            self.message.replace('\n', " ")
        )
    }

    pub fn parse(line: &str) -> Option<Done> {
        let rest = line.trim_end_matches('\n').strip_prefix("DONE ")?;
        let mut it = rest.splitn(3, ' ');
        let request = it.next()?.parse().ok()?;
        let ok = match it.next()? {
            "ok" => true,
            "error" => false,
            _ => return None,
        };
        Some(Done {
            request,
            ok,
            message: it.next().unwrap_or("").to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        let p = Prepare {
            cs_wait: Duration::from_millis(1500),
            cs_proceed: true,
            dest: "/tmp/a b".into(),
        };
        assert_eq!(Prepare::parse(p.line().trim_end()), Some(p));
        for r in [
            Reply::Started {
                id: 3,
                context: "signal".into(),
                name: "close_conn".into(),
            },
            Reply::Reached { id: 3 },
            Reply::Ready,
            Reply::Failed("callback 2 returned -1".into()),
        ] {
            assert_eq!(Reply::parse(&r.line()), Some(r));
        }
        for o in [
            Outcome::Continue,
            Outcome::Abort,
            Outcome::Restart {
                node: "n3".into(),
                dir: "/x y".into(),
            },
        ] {
            assert_eq!(Outcome::parse(&o.line()), Some(o));
        }
        assert_eq!(Reply::parse("BOGUS"), None);
        assert_eq!(parse_freeze(&freeze_line("n1")), Some("n1".into()));
        assert_eq!(parse_freeze("READY"), None);
        let d = Done {
            request: 7,
            ok: false,
            message: "process 3: no such process".into(),
        };
        assert_eq!(Done::parse(&d.line()), Some(d));
        assert_eq!(Done::parse("DONE x ok"), None);
        let q = SelfRequest {
            request: 9,
            job: true,
            dir: "/img/a b".into(),
        };
        assert_eq!(SelfRequest::parse(&q.line()), Some(q));
        for a in [Ok(()), Err("no such job".to_string())] {
            assert_eq!(parse_answer(&answer_line(&a)), Some(a));
        }
        assert_eq!(
            agent_libcr_socket(Path::new("/run/cr/agent.sock")),
            Path::new("/run/cr/agent.sock.libcr")
        );
        let p = socket_path(Path::new(DEFAULT_DIR), 4026531836, 1);
        assert!(is_socket_path(&p.display().to_string()));
        assert!(!is_socket_path("/run/other.sock"));
        assert_eq!(socket_pid(&p.display().to_string()), Some(1));
        assert_eq!(
            socket_pid("/proc/9/root/run/cr/coop/libcr-7-1234.sock"),
            Some(1234)
        );
        assert_eq!(socket_pid("/run/other.sock"), None);
    }
}
