//! A PMI-1 server of a step's own: what `srun --mpi=pmi2` gives MPI ranks
//! (MPICH, and MPIs built on its PMI client), served by `cr_srun`, the
//! stand-in of srun in a checkpointable Slurm job (docs/SLURM.md).
//!
//! Slurm's PMI server lives in slurmstepd and reaches each rank through an
//! inherited socket (`PMI_FD`): after a restore that slurmstepd is gone, and
//! a rank that talks to PMI again (at `MPI_Finalize`, or a later fence)
//! would fail. Served by the stand-in instead, every PMI connection is a
//! TCP connection between two members of the job, which a checkpoint
//! captures and a restart carries over, also onto other nodes, and the
//! key-value space lives in the stand-in's memory.
//!
//! The wire is PMI-1's "simple" protocol, one request and its answer per
//! line of `key=value` words: a rank told `PMI_PORT=ADDR:PORT` and
//! `PMI_ID=RANK` connects, introduces itself (`cmd=initack pmiid=RANK`),
//! and then asks for sizes, its key-value space, `put`s and `get`s
//! between `barrier_in`s, and ends with `finalize`. Each connection is
//! served by a thread of its own; a barrier waits for every rank. Every
//! request, and the count of each barrier as ranks enter it, is logged
//! at debug level (`CR_LOG=cr_agent::pmi=debug` in the batch script's
//! environment: in the job's output), to tell a rank that never asked
//! from a request the server lost.
//!
//! A barrier that has waited [`BARRIER_WARN`] for ranks that never entered
//! it says so once, naming them (a warning, in the job's output): MPICH
//! 4.0.2's ranks over UCX's TCP transport can deadlock in `MPI_Finalize`
//! that way, a rank spinning in its endpoint closes while the peer whose
//! answer it waits for sits in the finalize barrier (docs/SLURM.md). The
//! barrier itself is never released early: that would break what it
//! promises every rank.
//!
//! `PMI_process_mapping` (which ranks share a node, for shared memory)
//! puts each rank on a node of its own: each task of the step is a member
//! of the job of its own, with its own PID namespace and its own /dev/shm,
//! so ranks on one node cannot map each other's shared memory; they talk
//! through the MPI's network transport, whose connections a checkpoint
//! carries over like any other.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a barrier waits before it names the ranks it still waits for.
pub const BARRIER_WARN: Duration = Duration::from_secs(60);

/// Longest key-value space name, key and value a client may use (as MPICH's
/// own launcher says: values longer than this are split by the client).
const KVSNAME_MAX: usize = 256;
const KEYLEN_MAX: usize = 64;
const VALLEN_MAX: usize = 1024;

/// What every rank of the step shares.
#[derive(Default)]
struct State {
    kvs: HashMap<String, String>,
    /// Ranks in the current barrier, and how many barriers were passed.
    in_barrier: usize,
    barriers: u64,
    /// The ranks in the current barrier (by `PMI_ID`).
    entered: Vec<bool>,
    /// The last barrier whose wait was reported.
    warned: Option<u64>,
}

/// A step's PMI service.
struct Service {
    size: usize,
    kvsname: String,
    state: Mutex<State>,
    changed: Condvar,
}

impl Service {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank's thread that panicked leaves the state as it was.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for a change, at most `d`.
    fn wait<'a>(&self, g: MutexGuard<'a, State>, d: Duration) -> MutexGuard<'a, State> {
        self.changed
            .wait_timeout(g, d)
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0)
    }
}

/// The ranks not (yet) in a barrier.
fn missing(entered: &[bool]) -> Vec<usize> {
    entered
        .iter()
        .enumerate()
        .filter(|(_, e)| !**e)
        .map(|(r, _)| r)
        .collect()
}

/// Serves the PMI of a step of `size` ranks on `listener`, in background
/// threads, for as long as the process lives; `abort(code)` is called when
/// a rank asks to abort the job (`PMI_Abort`).
pub fn serve(
    listener: TcpListener,
    size: usize,
    kvsname: String,
    abort: fn(i32),
) -> std::io::Result<()> {
    let service = Arc::new(Service {
        size,
        kvsname,
        state: Mutex::new(State {
            entered: vec![false; size],
            ..State::default()
        }),
        changed: Condvar::new(),
    });
    std::thread::Builder::new()
        .name("pmi".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let conn = match conn {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "PMI: accept");
                        continue;
                    }
                };
                let s = service.clone();
                let spawned =
                    std::thread::Builder::new()
                        .name("pmi-rank".into())
                        .spawn(move || {
                            if let Err(e) = client(&s, conn, abort) {
                                tracing::warn!(error = %e, "PMI: a rank's connection");
                            }
                        });
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "PMI: cannot start a thread for a rank");
                }
            }
        })?;
    Ok(())
}

/// The `key=value` words of a request line.
fn words(line: &str) -> HashMap<&str, &str> {
    line.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .collect()
}

/// `PMI_process_mapping` for `size` ranks each on a node of its own (see
/// the module docs).
pub fn process_mapping(size: usize) -> String {
    format!("(vector,(0,{size},1))")
}

/// Serves one rank's connection until it finalizes or closes.
fn client(s: &Service, conn: TcpStream, abort: fn(i32)) -> std::io::Result<()> {
    conn.set_nodelay(true).ok();
    let mut out = conn.try_clone()?;
    let mut lines = BufReader::new(conn);
    let mut rank: Option<usize> = None;
    let mut line = String::new();
    loop {
        line.clear();
        if lines.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let w = words(&line);
        let cmd = w.get("cmd").copied().unwrap_or("");
        tracing::debug!(rank, request = line.trim(), "PMI request");
        let answer = match cmd {
            "initack" => {
                let r = w
                    .get("pmiid")
                    .and_then(|v| v.parse::<usize>().ok())
                    .filter(|r| *r < s.size)
                    .ok_or_else(|| bad(format!("initack of no rank of {}: {line:?}", s.size)))?;
                rank = Some(r);
                format!(
                    "cmd=initack\ncmd=set size={}\ncmd=set rank={r}\ncmd=set debug=0\n",
                    s.size
                )
            }
            "init" => {
                if w.get("pmi_version") == Some(&"1") {
                    "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0\n".to_string()
                } else {
                    "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=-1\n".to_string()
                }
            }
            "get_maxes" => format!(
                "cmd=maxes kvsname_max={KVSNAME_MAX} keylen_max={KEYLEN_MAX} vallen_max={VALLEN_MAX} rc=0\n"
            ),
            "get_appnum" => "cmd=appnum appnum=0 rc=0\n".to_string(),
            "get_universe_size" => format!("cmd=universe_size size={} rc=0\n", s.size),
            "get_my_kvsname" => format!("cmd=my_kvsname kvsname={} rc=0\n", s.kvsname),
            "put" => match (w.get("key"), w.get("value")) {
                (Some(k), Some(v)) => {
                    s.lock().kvs.insert(k.to_string(), v.to_string());
                    "cmd=put_result rc=0 msg=success\n".to_string()
                }
                _ => "cmd=put_result rc=-1 msg=no_key_or_value\n".to_string(),
            },
            "get" => {
                let key = w.get("key").copied().unwrap_or("");
                let value = if key == "PMI_process_mapping" {
                    Some(process_mapping(s.size))
                } else {
                    s.lock().kvs.get(key).cloned()
                };
                match value {
                    Some(v) => format!("cmd=get_result rc=0 msg=success value={v}\n"),
                    None => format!("cmd=get_result rc=-1 msg=key_{key}_not_found\n"),
                }
            }
            "barrier_in" => {
                let mut st = s.lock();
                let passed = st.barriers;
                st.in_barrier += 1;
                if let Some(e) = rank.and_then(|r| st.entered.get_mut(r)) {
                    *e = true;
                }
                tracing::debug!(rank, passed, in_barrier = st.in_barrier, "PMI barrier entered");
                if st.in_barrier == s.size {
                    st.in_barrier = 0;
                    st.barriers += 1;
                    st.entered.iter_mut().for_each(|e| *e = false);
                    s.changed.notify_all();
                } else {
                    let warn_at = Instant::now() + BARRIER_WARN;
                    while st.barriers == passed {
                        let left = warn_at.saturating_duration_since(Instant::now());
                        if left.is_zero() && st.warned != Some(passed) {
                            st.warned = Some(passed);
                            tracing::warn!(
                                barrier = passed,
                                waiting = st.in_barrier,
                                missing = ?missing(&st.entered),
                                "PMI: a barrier has waited {} s for ranks that never entered it \
                                 (MPICH 4.0.2 over UCX's TCP transport can deadlock so in \
                                 MPI_Finalize: docs/SLURM.md)",
                                BARRIER_WARN.as_secs()
                            );
                        }
                        let d = if left.is_zero() { Duration::from_secs(3600) } else { left };
                        st = s.wait(st, d);
                    }
                }
                "cmd=barrier_out rc=0\n".to_string()
            }
            "finalize" => {
                out.write_all(b"cmd=finalize_ack rc=0\n")?;
                return Ok(());
            }
            "abort" => {
                let code = w
                    .get("exitcode")
                    .and_then(|v| v.parse::<i32>().ok())
                    .unwrap_or(1);
                tracing::error!(rank, code, "PMI: a rank aborted the job");
                abort(code);
                return Ok(());
            }
            other => {
                tracing::warn!(rank, request = line.trim(), "PMI: unsupported request");
                format!("cmd={other}_result rc=-1 msg=unsupported\n")
            }
        };
        out.write_all(answer.as_bytes())?;
    }
}

fn bad(what: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_is_a_node_of_its_own() {
        assert_eq!(process_mapping(4), "(vector,(0,4,1))");
        assert_eq!(process_mapping(1), "(vector,(0,1,1))");
    }

    #[test]
    fn a_barrier_names_the_ranks_it_waits_for() {
        assert_eq!(missing(&[true, false, true, false]), vec![1, 3]);
        assert!(missing(&[true, true]).is_empty());
    }

    #[test]
    fn request_words() {
        let w = words("cmd=put kvsname=k key=a value=b=c\n");
        assert_eq!(w.get("cmd"), Some(&"put"));
        assert_eq!(w.get("value"), Some(&"b=c"));
    }
}

#[cfg(test)]
mod with_mpich {
    //! A real MPICH program (tests/workloads/mpi_check.c built with
    //! mpicc.mpich, which tests/run.sh installs) started as 4 ranks that
    //! find each other through this server alone.

    use super::*;
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    fn abort(code: i32) {
        panic!("a rank aborted the job ({code})");
    }

    #[test]
    fn mpich_ranks_start_exchange_and_finish_through_the_server() {
        let dir = std::env::temp_dir().join(format!("cr-pmi-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let src =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/workloads/mpi_check.c");
        let prog = dir.join("mpi_check");
        let st = Command::new("mpicc.mpich")
            .args(["-O2", "-o"])
            .arg(&prog)
            .arg(&src)
            .status()
            .expect("mpicc.mpich (libmpich-dev)");
        assert!(st.success(), "mpicc.mpich: {st}");
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        serve(listener, 4, "kvs_test".into(), abort).unwrap();
        let mut ranks: Vec<std::process::Child> = (0..4)
            .map(|r| {
                Command::new(&prog)
                    .args(["ring", "200", "0"])
                    .env("PMI_PORT", format!("127.0.0.1:{port}"))
                    .env("PMI_ID", r.to_string())
                    .env("PMI_RANK", r.to_string())
                    .env("PMI_SIZE", "4")
                    .env_remove("PMI_FD")
                    .stdout(Stdio::from(
                        std::fs::File::create(dir.join(format!("out{r}"))).unwrap(),
                    ))
                    .stderr(Stdio::from(
                        std::fs::File::create(dir.join(format!("err{r}"))).unwrap(),
                    ))
                    .spawn()
                    .unwrap()
            })
            .collect();
        // Each rank's end, as it comes; the deadline for all of them.
        let (tx, rx) = std::sync::mpsc::channel();
        let pids: Vec<u32> = ranks.iter().map(|c| c.id()).collect();
        for (r, mut c) in ranks.drain(..).enumerate() {
            let tx = tx.clone();
            std::thread::spawn(move || tx.send((r, c.wait().ok())));
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut status = vec![None; 4];
        while status.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((r, st)) => status[r] = st,
                Err(_) => break,
            }
        }
        let text = |n: &str| std::fs::read_to_string(dir.join(n)).unwrap_or_default();
        let all = (0..4)
            .map(|r| {
                format!(
                    "rank {r}:\n{}{}",
                    text(&format!("out{r}")),
                    text(&format!("err{r}"))
                )
            })
            .collect::<String>();
        for (r, pid) in pids.iter().enumerate() {
            if status[r].is_none() {
                // Ours, still running past the deadline.
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        assert!(
            status.iter().all(|s| s.is_some_and(|s| s.success()))
                && text("out0")
                    .lines()
                    .any(|l| l.starts_with("RESULT OK ring")),
            "every rank ends 0 and rank 0 says RESULT OK: {status:?}\n{all}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
