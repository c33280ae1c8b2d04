//! `cr_rsh`: ssh for a job's own processes (docs/MPI.md).
//!
//! `cr_rsh [SSH OPTIONS] HOST COMMAND [ARGS...]` starts COMMAND on HOST (a
//! node name, or one of a node's addresses) as a new member of the caller's
//! job (the `cr_run --job` whose tree holds the caller), and relays stdin,
//! stdout, stderr and the exit status as ssh does: the words of the command
//! are joined by spaces and run by `sh -c` there. It is what MPI runtimes
//! start their remote daemons with: `mpirun --mca plm_rsh_agent cr_rsh`
//! (Open MPI), `mpiexec -launcher ssh -launcher-exec cr_rsh` (MPICH).
//! ssh's options are accepted and ignored (`-n` reads no stdin).
//!
//! How: cr_rsh listens on a TCP port of its node, asks its node's agent to
//! start `cr_rsh --cr-serve ADDRS PORT` on HOST (the agent finds the
//! caller's job; the coordinator finds HOST's node; that node's agent runs
//! it under `cr_run --job`). The serving side connects back, proves itself
//! with a one-time token (`CR_RSH_TOKEN` in its environment, removed before
//! COMMAND runs), runs COMMAND and relays. The relay is one TCP connection
//! between two members of the job, so a checkpoint of the job captures it
//! like any other (both ends, bytes in flight), and a restart, on the same
//! or other nodes, carries it over: cr_rsh and COMMAND never notice.
//!
//! On the wire, frames `[kind u8][length u32 BE][payload]`: stdin data
//! and its end from cr_rsh, stdout and stderr data and the exit status
//! (i32 BE) from the serving side.
#![forbid(unsafe_code)]

use cr_agent::relay::{
    listen, read_some, send, token, wait_input, Frames, EXIT, STDERR, STDIN, STDIN_EOF, STDOUT,
    TASK, TOKEN_ENV,
};
use nix::poll::PollTimeout;
use std::ffi::OsString;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

/// How long cr_rsh waits for the command to connect back.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the serving side tries each address of cr_rsh.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Environment passed to the remote command (as ssh gives a login's).
const PASS_ENV: &[&str] = &[
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "TMPDIR", "TERM",
];

/// ssh's options that take an argument (`ssh -p 22`, `-oX=Y`, `-l user`).
const WITH_ARG: &str = "bcDEeFIiJLlmOopQRSWw";
/// ssh's options without one.
const FLAGS: &str = "46AaCfGgKkMNnqsTtVvXxYy";

/// What the command line asks for.
#[derive(Debug, PartialEq)]
enum Mode {
    /// `cr_rsh [OPTIONS] HOST WORDS...`.
    Client {
        host: String,
        words: Vec<String>,
        no_stdin: bool,
    },
    /// `cr_rsh --cr-serve ADDR,... PORT COMMAND`: the remote side;
    /// `--cr-serve-task`: the same for a task of an srun step whose
    /// stand-in is `cr_srun`, which first says which task it is.
    Serve {
        addrs: Vec<IpAddr>,
        port: u16,
        command: String,
        task: bool,
    },
}

fn parse(args: &[String]) -> Result<Mode, String> {
    let first = args.first().map(String::as_str);
    if first == Some("--cr-serve") || first == Some("--cr-serve-task") {
        let [_, addrs, port, command] = args else {
            return Err("usage: cr_rsh --cr-serve[-task] ADDR[,ADDR...] PORT COMMAND".into());
        };
        let addrs = addrs
            .split(',')
            .map(|a| a.parse().map_err(|_| format!("bad address {a:?}")))
            .collect::<Result<_, _>>()?;
        let port = port.parse().map_err(|_| format!("bad port {port:?}"))?;
        return Ok(Mode::Serve {
            addrs,
            port,
            command: command.clone(),
            task: first == Some("--cr-serve-task"),
        });
    }
    let mut no_stdin = false;
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        if a == "--" {
            i += 1;
            break;
        }
        let Some(opts) = a.strip_prefix('-').filter(|o| !o.is_empty()) else {
            break;
        };
        for (j, c) in opts.char_indices() {
            if WITH_ARG.contains(c) {
                // The rest of the word is its argument, else the next word.
                if j + c.len_utf8() == opts.len() {
                    i += 1;
                    if i >= args.len() {
                        return Err(format!("option -{c} needs an argument"));
                    }
                }
                break;
            } else if FLAGS.contains(c) {
                no_stdin |= c == 'n';
            } else {
                return Err(format!("unknown option -{c}"));
            }
        }
        i += 1;
    }
    let Some(host) = args.get(i) else {
        return Err("usage: cr_rsh [SSH OPTIONS] HOST COMMAND [ARGS...]".into());
    };
    // user@host: the user is the caller's (the agent starts it as the caller).
    let host = host.rsplit('@').next().unwrap_or(host).to_string();
    let words: Vec<String> = args[i + 1..].to_vec();
    if words.is_empty() {
        return Err(format!(
            "no command for {host}: cr_rsh runs commands, not interactive logins"
        ));
    }
    Ok(Mode::Client {
        host,
        words,
        no_stdin,
    })
}

// ---------------------------------------------------------------- client

fn client(host: &str, words: &[String], no_stdin: bool) -> Result<u8, String> {
    let (addrs, listener, port) = listen()?;
    let token = token()?;
    let me = std::env::current_exe().map_err(|e| format!("cannot find cr_rsh itself: {e}"))?;
    let addr_list = addrs
        .iter()
        .map(IpAddr::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut env: Vec<String> = PASS_ENV
        .iter()
        .filter_map(|k| std::env::var(k).ok().map(|v| format!("{k}={v}")))
        .collect();
    env.push(format!("{TOKEN_ENV}={token}"));
    let req = cr_rpc::pb::LaunchRequest {
        host: host.to_string(),
        command: vec![
            me.to_string_lossy().into_owned(),
            "--cr-serve".into(),
            addr_list,
            port.to_string(),
            words.join(" "),
        ],
        env,
        cwd: std::env::current_dir()
            .map(|d| d.to_string_lossy().into_owned())
            .unwrap_or_default(),
        ..Default::default()
    };
    {
        let socket = cr_rpc::channel::agent_socket();
        let mut agent = cr_rpc::local::Agent::connect(&socket)
            .map_err(|e| format!("cr_rsh needs the node's cr-agent: {e}"))?;
        let r = agent.launch(req)?;
        tracing::debug!(node = r.node, pid = r.pid, "launched");
    }
    let mut sock = accept(&listener, &token, host)?;
    drop(listener);
    relay_client(&mut sock, no_stdin, host)
}

/// The serving side's connection, once it sent the token.
fn accept(listener: &TcpListener, token: &str, host: &str) -> Result<TcpStream, String> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "the command did not start on {host} within {} s (see the log of {host}'s cr-agent)",
                START_TIMEOUT.as_secs()
            ));
        }
        let ms =
            PollTimeout::try_from(left.as_millis().min(1000) as i32).unwrap_or(PollTimeout::NONE);
        if !wait_input(&[listener.as_fd()], ms)?[0] {
            continue;
        }
        let (mut s, _) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("accept: {e}")),
        };
        s.set_read_timeout(Some(Duration::from_secs(5))).ok();
        let mut got = vec![0u8; token.len()];
        if s.read_exact(&mut got).is_ok() && got == token.as_bytes() {
            s.set_read_timeout(None).ok();
            s.set_nodelay(true).ok();
            return Ok(s);
        }
        tracing::warn!("a connection without the token: closed");
    }
}

fn relay_client(sock: &mut TcpStream, no_stdin: bool, host: &str) -> Result<u8, String> {
    let stdin = std::io::stdin();
    let mut stdin_open = !no_stdin;
    if no_stdin {
        send(sock, STDIN_EOF, &[]).map_err(|e| format!("connection to {host}: {e}"))?;
    }
    let mut frames = Frames::default();
    let lost = |e: std::io::Error| format!("connection to {host} lost: {e}");
    loop {
        let ready = if stdin_open {
            wait_input(&[sock.as_fd(), stdin.as_fd()], PollTimeout::NONE)?
        } else {
            let r = wait_input(&[sock.as_fd()], PollTimeout::NONE)?;
            vec![r[0], false]
        };
        if ready[1] {
            let data = read_some(&mut stdin.lock()).unwrap_or_default();
            if data.is_empty() {
                stdin_open = false;
                send(sock, STDIN_EOF, &[]).map_err(lost)?;
            } else {
                send(sock, STDIN, &data).map_err(lost)?;
            }
        }
        if ready[0] {
            let data = read_some(sock).map_err(lost)?;
            if data.is_empty() {
                return Err(format!(
                    "connection to {host} closed before the command's exit status"
                ));
            }
            for (kind, payload) in frames.push(&data) {
                match kind {
                    STDOUT => {
                        let mut o = std::io::stdout().lock();
                        let _ = o.write_all(&payload).and_then(|()| o.flush());
                    }
                    STDERR => {
                        let _ = std::io::stderr().write_all(&payload);
                    }
                    EXIT if payload.len() == 4 => {
                        let code =
                            i32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                        return Ok(code.clamp(0, 255) as u8);
                    }
                    _ => return Err(format!("{host} sent a frame of unknown kind {kind}")),
                }
            }
        }
    }
}

// ---------------------------------------------------------------- serve

/// `--cr-serve-task`: this task's rank and its step's number of tasks,
/// from Slurm's environment of the task.
/// The task's rank and the step's task count, from Slurm's environment.
fn task_slot() -> Result<(u32, u32), String> {
    let num = |k: &str| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .ok_or_else(|| format!("no {k} in the task's environment"))
    };
    let rank = num("SLURM_PROCID")?;
    let tasks = num("SLURM_STEP_NUM_TASKS").or_else(|_| num("SLURM_NTASKS"))?;
    Ok((rank, tasks))
}

fn task_frame((rank, tasks): (u32, u32)) -> Vec<u8> {
    let mut f = rank.to_be_bytes().to_vec();
    f.extend_from_slice(&tasks.to_be_bytes());
    f
}

/// The port of the step's PMI server, when its cr_srun serves one (on the
/// addresses of the relay).
const PMI_ENV: &str = "CR_SRUN_PMI";

/// The PMI-1 environment of a task's rank when its cr_srun serves the
/// step's PMI (`CR_SRUN_PMI`): its server on the address this task
/// reached cr_srun at, its id being the task's rank.
fn pmi_env(relay: &TcpStream, (rank, size): (u32, u32)) -> Vec<(String, String)> {
    let (Ok(port), Ok(to)) = (std::env::var(PMI_ENV), relay.peer_addr()) else {
        return Vec::new();
    };
    vec![
        ("PMI_PORT".into(), format!("{}:{port}", to.ip())),
        ("PMI_ID".into(), rank.to_string()),
        ("PMI_RANK".into(), rank.to_string()),
        ("PMI_SIZE".into(), size.to_string()),
    ]
}

fn serve(addrs: &[IpAddr], port: u16, command: &str, task: bool) -> Result<u8, String> {
    let slot = task.then(task_slot).transpose()?;
    let token = std::env::var(TOKEN_ENV).map_err(|_| format!("no {TOKEN_ENV}"))?;
    let mut sock = None;
    let mut errors = Vec::new();
    for a in addrs {
        let sa = SocketAddr::new(*a, port);
        match TcpStream::connect_timeout(&sa, CONNECT_TIMEOUT) {
            Ok(s) => {
                sock = Some(s);
                break;
            }
            Err(e) => errors.push(format!("{sa}: {e}")),
        }
    }
    let mut sock = sock.ok_or_else(|| format!("cannot reach cr_rsh: {}", errors.join("; ")))?;
    let pmi = slot.map_or_else(Vec::new, |slot| pmi_env(&sock, slot));
    sock.set_nodelay(true).ok();
    sock.write_all(token.as_bytes())
        .map_err(|e| format!("connection to cr_rsh: {e}"))?;
    if let Some(slot) = slot {
        send(&mut sock, TASK, &task_frame(slot))
            .map_err(|e| format!("connection to cr_srun: {e}"))?;
    }
    let shell = "/bin/sh";
    let mut child = Command::new(shell)
        .arg("-c")
        .arg(command)
        .env_remove(TOKEN_ENV)
        .env_remove(PMI_ENV)
        .env_remove("PMI_FD")
        .envs(pmi)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {shell}: {e}"))?;
    let mut cin = child.stdin.take();
    let mut cout = child.stdout.take();
    let mut cerr = child.stderr.take();
    let mut frames = Frames::default();
    let mut status: Option<i32> = None;
    let mut exited_at: Option<Instant> = None;
    let lost = |e: std::io::Error| format!("connection to cr_rsh lost: {e}");
    loop {
        // As PID 1 of the member's PID namespace, reap whatever is orphaned
        // to us; note the command's own status.
        reap(child.id() as i32, &mut status);
        if status.is_some() && exited_at.is_none() {
            exited_at = Some(Instant::now());
        }
        let pipes_done = cout.is_none() && cerr.is_none();
        // Output of the command's background children may keep its pipes
        // open: the status goes one second after its exit at the latest.
        if let Some(code) = status {
            if pipes_done || exited_at.is_some_and(|t| t.elapsed() > Duration::from_secs(1)) {
                send(&mut sock, EXIT, &code.to_be_bytes()).map_err(lost)?;
                let _ = sock.shutdown(std::net::Shutdown::Write);
                // Until cr_rsh has read it (it closes first).
                let _ = wait_input(&[sock.as_fd()], PollTimeout::from(5000u16));
                return Ok(0);
            }
        }
        let mut fds: Vec<BorrowedFd<'_>> = vec![sock.as_fd()];
        if let Some(o) = cout.as_ref() {
            fds.push(o.as_fd());
        }
        if let Some(e) = cerr.as_ref() {
            fds.push(e.as_fd());
        }
        let ready = wait_input(&fds, PollTimeout::from(200u16))?;
        let mut i = 1;
        let mut out_ready = false;
        let mut err_ready = false;
        if cout.is_some() {
            out_ready = ready[i];
            i += 1;
        }
        if cerr.is_some() {
            err_ready = ready[i];
        }
        if out_ready {
            let data = read_some(cout.as_mut().expect("stdout")).unwrap_or_default();
            if data.is_empty() {
                cout = None;
            } else {
                send(&mut sock, STDOUT, &data).map_err(lost)?;
            }
        }
        if err_ready {
            let data = read_some(cerr.as_mut().expect("stderr")).unwrap_or_default();
            if data.is_empty() {
                cerr = None;
            } else {
                send(&mut sock, STDERR, &data).map_err(lost)?;
            }
        }
        if ready[0] {
            let data = read_some(&mut sock).map_err(lost)?;
            if data.is_empty() {
                // cr_rsh is gone: so is the command's reason to run.
                let _ = child.kill();
                return Err("cr_rsh closed the connection".into());
            }
            for (kind, payload) in frames.push(&data) {
                match kind {
                    STDIN => {
                        if let Some(w) = cin.as_mut() {
                            if w.write_all(&payload).is_err() {
                                cin = None;
                            }
                        }
                    }
                    STDIN_EOF => cin = None,
                    _ => return Err(format!("cr_rsh sent a frame of unknown kind {kind}")),
                }
            }
        }
    }
}

/// Reaps every exited child; the status of `pid` (exit code, or 128 +
/// signal) goes to `status`.
fn reap(pid: i32, status: &mut Option<i32>) {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(p, c)) => {
                if p.as_raw() == pid {
                    *status = Some(c);
                }
            }
            Ok(WaitStatus::Signaled(p, s, _)) => {
                if p.as_raw() == pid {
                    *status = Some(128 + s as i32);
                }
            }
            Ok(WaitStatus::StillAlive) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("CR_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a: OsString| a.to_string_lossy().into_owned())
        .collect();
    let r = parse(&args).and_then(|m| match m {
        Mode::Client {
            host,
            words,
            no_stdin,
        } => client(&host, &words, no_stdin),
        Mode::Serve {
            addrs,
            port,
            command,
            task,
        } => serve(&addrs, port, &command, task),
    });
    match r {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("cr_rsh: error: {e}");
            ExitCode::from(255)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(args: &[&str]) -> Mode {
        parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn ssh_options_are_skipped() {
        let m = client(&[
            "-x",
            "-q",
            "-o",
            "StrictHostKeyChecking=no",
            "-p22",
            "-l",
            "me",
            "n2",
            "orted",
            "-mca",
            "x",
        ]);
        assert_eq!(
            m,
            Mode::Client {
                host: "n2".into(),
                words: vec!["orted".into(), "-mca".into(), "x".into()],
                no_stdin: false
            }
        );
        let m = client(&["-xn", "root@10.0.0.2", "echo", "hi"]);
        assert_eq!(
            m,
            Mode::Client {
                host: "10.0.0.2".into(),
                words: vec!["echo".into(), "hi".into()],
                no_stdin: true
            }
        );
    }

    #[test]
    fn bad_command_lines_are_named() {
        let p = |a: &[&str]| parse(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert!(p(&["n2"]).unwrap_err().contains("no command for n2"));
        assert!(p(&["-Z", "n2", "ls"])
            .unwrap_err()
            .contains("unknown option -Z"));
        assert!(p(&["-o"]).unwrap_err().contains("needs an argument"));
        assert!(p(&[]).unwrap_err().starts_with("usage"));
    }

    #[test]
    fn frames_split_anywhere() {
        let mut wire = Vec::new();
        for (k, d) in [
            (STDOUT, &b"hello"[..]),
            (STDERR, b""),
            (EXIT, &7i32.to_be_bytes()),
        ] {
            wire.push(k);
            wire.extend_from_slice(&(d.len() as u32).to_be_bytes());
            wire.extend_from_slice(d);
        }
        for cut in 0..wire.len() {
            let mut f = Frames::default();
            let mut got = f.push(&wire[..cut]);
            got.extend(f.push(&wire[cut..]));
            assert_eq!(got.len(), 3, "cut at {cut}");
            assert_eq!(got[0], (STDOUT, b"hello".to_vec()));
            assert_eq!(got[2].1, 7i32.to_be_bytes().to_vec());
        }
    }
}
