//! `cr_srun`: the stand-in of `srun` in a checkpointable Slurm batch job
//! (docs/SLURM.md, "srun steps").
//!
//! A real srun in the batch script's tree cannot be checkpointed: it holds
//! connections to slurmctld and to the slurmstepd of every node of its
//! step, which lead outside the job, and a restored srun could not talk to
//! a new allocation's daemons. So the batch script never runs it: the
//! SPANK plugin puts a directory whose `srun` is this program first on the
//! batch script's PATH. `srun ARGS...` then:
//!
//! 1. listens on a TCP port of its node and asks the batch step's
//!    launcher (`cr_srun --cr-launcher JOB`, started by the batch step's
//!    cr_run before the job: outside the job, inside Slurm's batch step)
//!    to run the real srun with the same arguments and environment, plus
//!    `CR_SRUN_RELAY=ADDRS PORT` and a one-time token;
//! 2. the plugin, in each task of that step, runs `cr_run --job JOB --
//!    cr_rsh --cr-serve-task ADDRS PORT COMMAND` instead of COMMAND: the
//!    task is a member of the job on its node, connects back, says which
//!    task it is, runs COMMAND and relays its stdio and exit status, as
//!    for cr_rsh;
//! 3. once every task of the step connected, cr_srun relays: its stdin to
//!    every task (as srun does by default), their stdout and stderr to its
//!    own, and exits with the highest exit status of the tasks.
//!
//! cr_srun is in the job (in the batch member's tree), the tasks are
//! members on their nodes, and every connection between them is one
//! between members: a checkpoint captures them, and a restart (also onto
//! a new allocation) carries them over; the real srun, outside the job,
//! ends with the killed tasks and is not needed again. The start of a
//! step (until every task connected) is a libcr critical section: a
//! checkpoint waits for it. If the real srun ends before every task
//! connected (a bad option, no resources), the launcher tells cr_srun,
//! which exits with its status (srun's messages are in the job's output).
//!
//! Outside a checkpointable batch step (no `CR_SLURM_JOB`, no launcher)
//! cr_srun runs the real srun in its place (the job then cannot be
//! checkpointed while the step runs, and says so).
#![forbid(unsafe_code)]

use cr_agent::relay::{
    listen, read_some, send, token, wait_input, Frames, EXIT, SRUN_EXIT, STDERR, STDIN, STDIN_EOF,
    STDOUT, TASK, TOKEN_ENV,
};
use nix::poll::PollTimeout;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

/// The environment variable that tells a task's plugin where its stand-in
/// listens: `ADDR[,ADDR...] PORT`.
const RELAY_ENV: &str = "CR_SRUN_RELAY";
/// The environment variable that tells a task's plugin the port of the
/// step's PMI server (on the addresses of [`RELAY_ENV`]), when cr_srun
/// serves the step's PMI itself.
const PMI_ENV: &str = "CR_SRUN_PMI";
/// How long a connecting task has to send its token and first frame.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// What the stand-in asks its launcher for: one line of JSON, a step to
/// launch or (`wait`) the end of the real srun of one it launched.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum Request {
    Wait { wait: u32 },
    Launch(LaunchStep),
}

/// A step to launch.
#[derive(Serialize, Deserialize)]
struct LaunchStep {
    /// The real srun.
    srun: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    cwd: String,
    /// Where the stand-in listens (told when the real srun ends early).
    relay: Vec<SocketAddr>,
    token: String,
}

/// The launcher's answer: the real srun's PID, or why it could not run.
#[derive(Serialize, Deserialize)]
struct Launched {
    pid: Option<u32>,
    error: Option<String>,
}

/// The launcher's abstract socket name for cluster job `job` (one batch
/// step per job and node).
fn launcher_name(job: &str) -> String {
    format!("cr-srun/{job}")
}

/// This program, as its file (not the `srun` link that named it).
fn own_exe() -> Option<PathBuf> {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.canonicalize().ok())
}

/// Whether `dir/srun` is this program (the directory the plugin put first
/// on PATH).
fn is_stand_in(dir: &Path, me: Option<&Path>) -> bool {
    let c = dir.join("srun").canonicalize().ok();
    c.is_some() && c.as_deref() == me
}

/// The real srun: the first `srun` on PATH that is not this program;
/// and PATH without the stand-in's directories.
fn real_srun() -> Result<(PathBuf, OsString), String> {
    let me = own_exe();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut found = None;
    let mut kept = Vec::new();
    for dir in std::env::split_paths(&path) {
        if is_stand_in(&dir, me.as_deref()) {
            continue;
        }
        let cand = dir.join("srun");
        if found.is_none() && cand.is_file() {
            found = Some(cand);
        }
        kept.push(dir);
    }
    let path = std::env::join_paths(kept).map_err(|e| format!("PATH: {e}"))?;
    let srun = found.ok_or("no srun on PATH besides cr_srun")?;
    Ok((srun, path))
}

/// Runs the real srun in this process's place (not checkpointable).
fn exec_real(srun: &Path, path: &OsString, args: &[OsString]) -> String {
    let err = Command::new(srun).args(args).env("PATH", path).exec();
    format!("cannot run {}: {err}", srun.display())
}

/// A task of the step, connected.
struct Task {
    sock: TcpStream,
    frames: Frames,
    /// Frames read with its first one, not yet handled.
    pending: Vec<(u8, Vec<u8>)>,
}

/// The first connection's token and frame, within [`HELLO_TIMEOUT`].
fn hello(mut s: TcpStream, token: &str) -> Option<(Task, u8, Vec<u8>)> {
    s.set_read_timeout(Some(HELLO_TIMEOUT)).ok();
    let mut got = vec![0u8; token.len()];
    if s.read_exact(&mut got).is_err() || got != token.as_bytes() {
        tracing::warn!("a connection without the token: closed");
        return None;
    }
    let mut frames = Frames::default();
    let mut pending = Vec::new();
    while pending.is_empty() {
        match read_some(&mut s) {
            Ok(d) if !d.is_empty() => pending = frames.push(&d),
            _ => return None,
        }
    }
    s.set_read_timeout(None).ok();
    s.set_nodelay(true).ok();
    let (kind, payload) = pending.remove(0);
    Some((
        Task {
            sock: s,
            frames,
            pending,
        },
        kind,
        payload,
    ))
}

/// Two u32 BE, or one i32 BE.
fn u32s(p: &[u8]) -> Option<(u32, u32)> {
    let a = u32::from_be_bytes(p.get(0..4)?.try_into().ok()?);
    let b = u32::from_be_bytes(p.get(4..8)?.try_into().ok()?);
    Some((a, b))
}

fn i32_of(p: &[u8]) -> Option<i32> {
    Some(i32::from_be_bytes(p.get(0..4)?.try_into().ok()?))
}

/// Waits until every task of the step connected (`Ok`), or the real srun
/// ended first (`Err(status)`).
fn gather(listener: &TcpListener, token: &str) -> Result<Vec<Task>, u8> {
    let mut tasks: Vec<Option<Task>> = Vec::new();
    let mut expected: Option<usize> = None;
    while expected.is_none_or(|n| tasks.iter().flatten().count() < n) {
        match wait_input(&[listener.as_fd()], PollTimeout::from(1000u16)) {
            Ok(r) if r[0] => {}
            Ok(_) => continue,
            Err(e) => {
                eprintln!("cr_srun: error: {e}");
                return Err(255);
            }
        }
        let s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => {
                eprintln!("cr_srun: error: accept: {e}");
                return Err(255);
            }
        };
        let Some((task, kind, payload)) = hello(s, token) else {
            continue;
        };
        match (kind, u32s(&payload), i32_of(&payload)) {
            (TASK, Some((rank, n)), _) if rank < n => {
                let n = n as usize;
                if *expected.get_or_insert(n) != n {
                    tracing::warn!(rank, n, "a task of another step size: closed");
                    continue;
                }
                tasks.resize_with(n, || None);
                tasks[rank as usize] = Some(task);
            }
            (SRUN_EXIT, _, Some(st)) => return Err(st.clamp(0, 255) as u8),
            _ => tracing::warn!(kind, "an unexpected first frame: closed"),
        }
    }
    Ok(tasks.into_iter().flatten().collect())
}

/// One frame of task `i`: its output to ours, its exit status noted.
fn handle(i: usize, kind: u8, payload: Vec<u8>, status: &mut [Option<i32>]) {
    match kind {
        STDOUT => {
            let mut o = std::io::stdout().lock();
            let _ = o.write_all(&payload).and_then(|()| o.flush());
        }
        STDERR => {
            let _ = std::io::stderr().write_all(&payload);
        }
        EXIT => status[i] = Some(i32_of(&payload).unwrap_or(255)),
        k => tracing::warn!(task = i, kind = k, "a frame of unknown kind: ignored"),
    }
}

/// Relays stdin to every task and their output to ours until each sent
/// its exit status; the highest one.
fn relay(mut tasks: Vec<Task>) -> u8 {
    let stdin = std::io::stdin();
    let mut stdin_open = true;
    let mut status: Vec<Option<i32>> = vec![None; tasks.len()];
    let mut open: Vec<bool> = vec![true; tasks.len()];
    for (i, t) in tasks.iter_mut().enumerate() {
        for (k, p) in std::mem::take(&mut t.pending) {
            handle(i, k, p, &mut status);
        }
    }
    loop {
        for i in 0..tasks.len() {
            if open[i] && status[i].is_some() {
                open[i] = false;
                let _ = tasks[i].sock.shutdown(std::net::Shutdown::Both);
            }
        }
        let live: Vec<usize> = (0..tasks.len()).filter(|&i| open[i]).collect();
        if live.is_empty() {
            break;
        }
        let mut fds: Vec<_> = live.iter().map(|&i| tasks[i].sock.as_fd()).collect();
        if stdin_open {
            fds.push(stdin.as_fd());
        }
        let ready = match wait_input(&fds, PollTimeout::NONE) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("cr_srun: error: {e}");
                return 255;
            }
        };
        if stdin_open && ready[live.len()] {
            let data = read_some(&mut stdin.lock()).unwrap_or_default();
            let (kind, data) = if data.is_empty() {
                stdin_open = false;
                (STDIN_EOF, Vec::new())
            } else {
                (STDIN, data)
            };
            for &i in &live {
                let _ = send(&mut tasks[i].sock, kind, &data);
            }
        }
        for (j, &i) in live.iter().enumerate() {
            if !ready[j] {
                continue;
            }
            let t = &mut tasks[i];
            match read_some(&mut t.sock) {
                Ok(d) if !d.is_empty() => {
                    for (k, p) in t.frames.push(&d) {
                        handle(i, k, p, &mut status);
                    }
                }
                r => {
                    let why = r.err().map_or("closed".to_string(), |e| e.to_string());
                    eprintln!(
                        "cr_srun: error: task {i}: connection lost before its exit status ({why})"
                    );
                    status[i] = Some(255);
                }
            }
        }
    }
    status
        .into_iter()
        .map(|s| s.unwrap_or(255).clamp(0, 255))
        .max()
        .unwrap_or(0) as u8
}

/// The MPI plugin asked for (`--mpi=TYPE`, `--mpi TYPE`, or
/// `SLURM_MPI_TYPE`), and the arguments for the real srun when cr_srun
/// serves the step's PMI itself: then with `--mpi=none`, Slurm's own PMI
/// (in slurmstepd, gone after a restore) left out.
///
/// cr_srun serves PMI-1 (what Slurm's `pmi2` plugin also serves, and
/// what MPICH's ranks speak) for `pmi2`, `pmi1` and when no type is named;
/// `none` is left alone, and `pmix` (Open MPI's direct launch) too, with a
/// warning: its server would not survive a restore.
fn mpi_plugin(args: &[OsString]) -> (Option<String>, Vec<OsString>) {
    let mut kind = std::env::var("SLURM_MPI_TYPE").ok();
    let mut rest = Vec::with_capacity(args.len() + 1);
    let mut it = args.iter();
    let mut command_started = false;
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if command_started {
            rest.push(a.clone());
            continue;
        }
        if let Some(v) = s.strip_prefix("--mpi=") {
            kind = Some(v.to_string());
        } else if s == "--mpi" {
            kind = it.next().map(|v| v.to_string_lossy().into_owned());
        } else {
            // The first word that is no option starts the command (an
            // option's own value is taken as its next word only with `=`
            // absent; the command's words are never looked at).
            command_started = !s.starts_with('-') && !takes_value(rest.last());
            rest.push(a.clone());
        }
    }
    match kind.as_deref() {
        None | Some("pmi2") | Some("pmi1") | Some("pmi") => {
            let mut with = vec![OsString::from("--mpi=none")];
            with.extend(rest);
            (Some(kind.unwrap_or_else(|| "pmi2".into())), with)
        }
        Some(k) => {
            if k.starts_with("pmix") {
                eprintln!(
                    "cr_srun: warning: --mpi={k}: Slurm's PMIx server does not survive a \
                     restore; use --mpi=pmi2 for a step that must resume"
                );
            }
            (None, args.to_vec())
        }
    }
}

/// Whether srun option `prev` (the word before) takes the next word as
/// its value (`-n 4`, `--ntasks 4`): a short option of one letter, or a
/// long one without `=`, that is not one of srun's switches.
fn takes_value(prev: Option<&OsString>) -> bool {
    const SWITCHES: &[&str] = &[
        "-l",
        "--label",
        "-u",
        "--unbuffered",
        "-v",
        "--verbose",
        "-Q",
        "--quiet",
        "-X",
        "--disable-status",
        "-Z",
        "--no-allocate",
        "-O",
        "--overcommit",
        "-E",
        "--preserve-env",
        "-k",
        "--no-kill",
        "-K",
        "--kill-on-bad-exit",
        "-s",
        "--oversubscribe",
        "--exclusive",
        "--overlap",
        "--pty",
        "--multi-prog",
        "--exact",
        "--whole",
        "-H",
        "--hold",
        "-I",
        "--immediate",
        "--contiguous",
        "--test-only",
    ];
    let Some(p) = prev.map(|p| p.to_string_lossy()) else {
        return false;
    };
    let is_short = p.len() == 2 && p.starts_with('-') && !p.starts_with("--");
    let is_long = p.starts_with("--") && !p.contains('=');
    (is_short || is_long) && !SWITCHES.contains(&p.as_ref())
}

/// A rank asked to abort the step (PMI_Abort): cr_srun ends with its code,
/// and with it every task (their relays close), as srun ends a step one of
/// whose tasks aborted. The aborting rank prints why and exits by itself:
/// its output has a moment to come through the relay first.
fn pmi_abort(code: i32) {
    std::thread::sleep(ABORT_GRACE);
    eprintln!("cr_srun: a task aborted the step (PMI abort, exit code {code})");
    let _ = std::io::stdout().flush();
    std::process::exit(code.clamp(1, 255));
}

/// How long the tasks' output may still come after a rank aborted.
const ABORT_GRACE: Duration = Duration::from_secs(1);

/// `srun ARGS...` in the batch script (see the module docs).
fn stand_in(args: Vec<OsString>) -> Result<u8, String> {
    let (srun, path) = real_srun()?;
    let Ok(job) = std::env::var("CR_SLURM_JOB") else {
        return Err(exec_real(&srun, &path, &args));
    };
    let name = launcher_name(&job);
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| format!("socket name {name}: {e}"))?;
    let mut launcher = match UnixStream::connect_addr(&addr) {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "cr_srun: job {job}: no step launcher ({e}): srun runs inside the job, which \
                 cannot be checkpointed while this step runs"
            );
            return Err(exec_real(&srun, &path, &args));
        }
    };
    // No checkpoint while the step starts: the connection to the launcher
    // and half of the tasks would not survive it.
    if let Err(e) = cr::init() {
        tracing::warn!(error = %e, "libcr: a checkpoint may catch the step's start");
    }
    let _starting = cr::critical_section();
    let (mpi, args) = mpi_plugin(&args);
    let (addrs, listener, port) = listen()?;
    // The step's PMI server, its port told to the tasks; it serves once the
    // step's size is known (ranks that connect before wait in its backlog).
    let pmi = match &mpi {
        Some(_) => {
            let (_, l, p) = listen()?;
            Some((l, p))
        }
        None => None,
    };
    let token = token()?;
    let list = addrs
        .iter()
        .map(IpAddr::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            k != "PATH"
                && k != RELAY_ENV
                && k != TOKEN_ENV
                && k != PMI_ENV
                && (mpi.is_none() || k != "SLURM_MPI_TYPE")
        })
        .collect();
    if let Some((_, p)) = &pmi {
        env.push((PMI_ENV.into(), p.to_string()));
    }
    env.push(("PATH".into(), path.to_string_lossy().into_owned()));
    env.push((RELAY_ENV.into(), format!("{list} {port}")));
    env.push((TOKEN_ENV.into(), token.clone()));
    let req = LaunchStep {
        srun: srun.clone(),
        args: args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
        env,
        cwd: std::env::current_dir()
            .map(|d| d.to_string_lossy().into_owned())
            .unwrap_or_default(),
        relay: addrs.iter().map(|a| SocketAddr::new(*a, port)).collect(),
        token: token.clone(),
    };
    let mut line = serde_json::to_string(&Request::Launch(req)).map_err(|e| e.to_string())?;
    line.push('\n');
    launcher
        .write_all(line.as_bytes())
        .map_err(|e| format!("step launcher: {e}"))?;
    let mut answer = String::new();
    BufReader::new(&launcher)
        .read_line(&mut answer)
        .map_err(|e| format!("step launcher: {e}"))?;
    drop(launcher);
    let got: Launched = serde_json::from_str(&answer)
        .map_err(|e| format!("step launcher: bad answer {answer:?}: {e}"))?;
    if let Some(e) = got.error {
        return Err(e);
    }
    tracing::debug!(pid = got.pid, "real srun started");
    let tasks = match gather(&listener, &token) {
        Ok(t) => t,
        Err(status) => return Ok(status),
    };
    drop(listener);
    if let Some((l, _)) = pmi {
        let kvsname = format!("kvs_{job}_{}", std::process::id());
        cr_agent::pmi::serve(l, tasks.len(), kvsname, pmi_abort)
            .map_err(|e| format!("cannot start the step's PMI server: {e}"))?;
        tracing::debug!(mpi, tasks = tasks.len(), "PMI served by the stand-in");
    }
    drop(_starting);
    tracing::debug!(tasks = tasks.len(), "every task connected");
    let status = relay(tasks);
    // As srun, return once Slurm has the step's end: a batch script that
    // ends right after would have its step cut short.
    if let Some(pid) = got.pid {
        let _ending = cr::critical_section();
        let srun_ended = UnixStream::connect_addr(&addr).and_then(|mut s| {
            s.write_all(format!("{{\"wait\":{pid}}}\n").as_bytes())?;
            BufReader::new(&s).read_line(&mut String::new())
        });
        if let Err(e) = srun_ended {
            tracing::warn!(error = %e, "cannot wait for the real srun");
        }
    }
    Ok(status)
}

// ------------------------------------------------------------- launcher

/// `cr_srun --cr-launcher JOB`: serve the stand-ins of job JOB on this
/// node (see the module docs), as the user who runs it, until killed
/// (it dies with the batch step's cr_run).
fn launcher(job: &str) -> Result<u8, String> {
    let name = launcher_name(job);
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| format!("socket name {name}: {e}"))?;
    let listener =
        UnixListener::bind_addr(&addr).map_err(|e| format!("cannot listen on @{name}: {e}"))?;
    // cr_run starts the batch script once it reads this (its stdout is a
    // pipe from cr_run, not used again: the real sruns write to stderr).
    {
        let mut o = std::io::stdout().lock();
        o.write_all(b"ready\n")
            .and_then(|()| o.flush())
            .map_err(|e| format!("cannot tell cr_run: {e}"))?;
    }
    let me = nix::unistd::getuid().as_raw();
    let ended = Ended::default();
    for conn in listener.incoming() {
        let Ok(s) = conn else { continue };
        // Abstract sockets are open to every user of the node.
        let uid = nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)
            .map(|c| c.uid());
        if uid != Ok(me) {
            tracing::warn!(?uid, "a stand-in of another user: refused");
            continue;
        }
        let ended = ended.clone();
        std::thread::spawn(move || launch(s, ended));
    }
    Ok(0)
}

/// The real sruns launched, and their exit status once they ended.
type Ended = std::sync::Arc<(
    std::sync::Mutex<HashMap<u32, Option<i32>>>,
    std::sync::Condvar,
)>;

/// How long a stand-in waits for the end of its real srun once its tasks
/// ended.
const SRUN_END_TIMEOUT: Duration = Duration::from_secs(30);

/// One request of a stand-in: runs the real srun, answers, and tells the
/// stand-in if it ends (it has stopped listening once its step started);
/// or answers once a real srun it ran ended (at once for one it does not
/// know: launched before a restart, by another launcher).
fn launch(s: UnixStream, ended: Ended) {
    let mut line = String::new();
    if BufReader::new(&s).read_line(&mut line).is_err() {
        return;
    }
    let req = match serde_json::from_str(&line) {
        Ok(Request::Launch(r)) => r,
        Ok(Request::Wait { wait }) => {
            let (lock, cv) = &*ended;
            if let Ok(g) = lock.lock() {
                let _ = cv.wait_timeout_while(g, SRUN_END_TIMEOUT, |m| {
                    m.get(&wait).is_some_and(|st| st.is_none())
                });
            }
            let _ = (&s).write_all(b"ended\n");
            return;
        }
        Err(e) => {
            tracing::warn!(error = %e, "a bad request");
            return;
        }
    };
    let mut cmd = Command::new(&req.srun);
    cmd.args(&req.args)
        .env_clear()
        .envs(req.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null());
    // Both to the job's output (stdout is the pipe to cr_run).
    if let Ok(err) = std::io::stderr().as_fd().try_clone_to_owned() {
        cmd.stdout(Stdio::from(err));
    }
    if !req.cwd.is_empty() {
        cmd.current_dir(&req.cwd);
    }
    let (answer, child) = match cmd.spawn() {
        Ok(c) => (
            Launched {
                pid: Some(c.id()),
                error: None,
            },
            Some(c),
        ),
        Err(e) => (
            Launched {
                pid: None,
                error: Some(format!("cannot run {}: {e}", req.srun.display())),
            },
            None,
        ),
    };
    let mut out = serde_json::to_string(&answer).unwrap_or_default();
    out.push('\n');
    let _ = (&s).write_all(out.as_bytes());
    drop(s);
    let Some(mut child) = child else { return };
    let pid = child.id();
    if let Ok(mut m) = ended.0.lock() {
        m.insert(pid, None);
    }
    let code = match child.wait() {
        Ok(st) => st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0)),
        Err(_) => 255,
    };
    if let Ok(mut m) = ended.0.lock() {
        m.insert(pid, Some(code));
    }
    ended.1.notify_all();
    tracing::debug!(code, "real srun ended");
    for a in &req.relay {
        if let Ok(mut t) = TcpStream::connect_timeout(a, Duration::from_secs(2)) {
            let _ = t
                .write_all(req.token.as_bytes())
                .and_then(|()| send(&mut t, SRUN_EXIT, &code.to_be_bytes()));
            break;
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("CR_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let r = match args.first().and_then(|a| a.to_str()) {
        Some("--cr-launcher") => match args.get(1).and_then(|a| a.to_str()) {
            Some(job) => launcher(job),
            None => Err("usage: cr_srun --cr-launcher JOB".into()),
        },
        _ => stand_in(args),
    };
    match r {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("cr_srun: error: {e}");
            ExitCode::from(255)
        }
    }
}
