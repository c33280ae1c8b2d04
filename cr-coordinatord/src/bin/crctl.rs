//! crctl: the administration client of cr-coordinatord (docs/CLUSTER.md):
//! nodes, jobs, checkpoints and restarts, job settings, and a small PKI for
//! the cluster's certificates (`crctl pki`, no coordinator needed).
//!
//! The coordinator is found by `--coordinator`, else `CR_COORDINATOR`, else
//! the config file (`/etc/cr/crctl.toml`, an error only when named with
//! `--config`), else 127.0.0.1:7170. `--json` prints one JSON document
//! whose objects are named after the proto messages' fields.
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};
use cr_coordinatord::events::bytes;
use cr_rpc::pb;
use cr_rpc::pb::coordinator_client::CoordinatorClient;
use cr_rpc::tls::{Security, TlsFiles};
use serde::Deserialize;
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;
use tonic::transport::Channel;

const DEFAULT_CONFIG: &str = "/etc/cr/crctl.toml";
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Parser)]
#[command(name = "crctl", version, about = "Administer cr-coordinatord")]
struct Cli {
    /// ADDR:PORT of cr-coordinatord (default: $CR_COORDINATOR, the config
    /// file, 127.0.0.1:7170).
    #[arg(long, global = true, value_name = "ADDR:PORT")]
    coordinator: Option<String>,
    /// Config file (TOML; default /etc/cr/crctl.toml if it exists).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[arg(long, global = true, value_name = "FILE")]
    ca: Option<PathBuf>,
    #[arg(long, global = true, value_name = "FILE")]
    cert: Option<PathBuf>,
    #[arg(long, global = true, value_name = "FILE")]
    key: Option<PathBuf>,
    /// Plain TCP without authentication.
    #[arg(long, global = true)]
    insecure: bool,
    /// TLS name of the coordinator's certificate (default cr-coordinatord).
    #[arg(long, global = true, value_name = "TLSNAME")]
    name: Option<String>,
    /// Print one JSON document.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// The coordinator's state.
    Status,
    /// Registered nodes.
    Nodes,
    /// Jobs and their processes.
    Jobs,
    /// Checkpoint a job (all its members, consistently).
    Checkpoint {
        job: String,
        /// Kill the processes once the checkpoint is committed.
        #[arg(long, conflicts_with = "stop")]
        kill: bool,
        /// Stop (SIGSTOP) the processes once the checkpoint is committed.
        #[arg(long)]
        stop: bool,
        /// Deadline of the whole protocol (default: the coordinator's).
        #[arg(long, value_name = "SECS")]
        timeout: Option<u32>,
        /// Longest time the members may stay frozen (default: the job's,
        /// else the coordinator's); past it the checkpoint is aborted.
        #[arg(long, value_name = "SECS")]
        freeze_timeout: Option<f64>,
        /// Pre-dump every member while the job runs (rounds while what
        /// changed shrinks), then freeze it and dump only what changed
        /// since (also when the job's --pre-copy is on).
        #[arg(long)]
        pre_copy: bool,
        /// Freeze, dump and let go each member on its own (its
        /// connections held until every member is dumped): each is paused
        /// only for its own dump (also when the job's mode is
        /// non-blocking). Only with continue.
        #[arg(long, conflicts_with_all = ["kill", "stop"])]
        non_blocking: bool,
        #[command(flatten)]
        coop: cr_rpc::opts::CoopArgs,
    },
    /// Restart a job from a checkpoint.
    Restart {
        job: String,
        /// Checkpoint id (default: the latest committed).
        #[arg(long, value_name = "ID")]
        checkpoint: Option<String>,
        /// Target nodes: the i-th node of the checkpoint goes to the
        /// (i mod n)-th --on (default: the same nodes).
        #[arg(long, value_name = "NODE")]
        on: Vec<String>,
        #[arg(long, value_name = "SECS")]
        timeout: Option<u32>,
        /// Restore although files outside the images (programs,
        /// libraries, open files not saved in the images) changed since
        /// the checkpoint.
        #[arg(long)]
        allow_changed_files: bool,
        /// Restart each member from its checkpoint on the job's recovery
        /// line (an uncoordinated job; see `crctl recovery-line`).
        #[arg(long, conflicts_with = "checkpoint")]
        line: bool,
    },
    /// The recovery line of a job: per member, the latest checkpoint that
    /// forms a consistent cut with the others', and what a restart from it
    /// rolls back.
    RecoveryLine { job: String },
    /// A job's checkpoints.
    Checkpoints {
        job: String,
        /// Also the aborted and removed ones.
        #[arg(long)]
        all: bool,
    },
    /// Show or change a job's settings.
    Job {
        job: String,
        /// Periodic checkpoints every SECS seconds (0: none).
        #[arg(long, value_name = "SECS")]
        interval: Option<u32>,
        /// Keep the last N committed checkpoints (0: all).
        #[arg(long, value_name = "N")]
        keep: Option<u32>,
        /// Connections to peers outside the job: abort the checkpoint, or allow them.
        #[arg(long, value_parser = ["abort", "allow"])]
        external: Option<String>,
        /// Store only what changed since the job's previous checkpoint.
        #[arg(long, value_name = "on|off", value_parser = ["on", "off"])]
        incremental: Option<String>,
        /// Freeze bound of its checkpoints (0: the coordinator's default).
        #[arg(long, value_name = "SECS")]
        freeze_timeout: Option<f64>,
        /// Keep each committed checkpoint on N nodes (its images copied to
        /// N - 1 other nodes after the commit), so that losing a node loses
        /// no checkpoint.
        #[arg(long, value_name = "N")]
        replicas: Option<u32>,
        /// Every checkpoint of the job pre-copies memory first (as
        /// `crctl checkpoint --pre-copy`), periodic ones too.
        #[arg(long, value_name = "on|off", value_parser = ["on", "off"])]
        pre_copy: Option<String>,
        /// coordinated: every checkpoint freezes the whole job at once;
        /// non-blocking: coordinated, each member frozen only for its own
        /// dump (as `crctl checkpoint --non-blocking`); uncoordinated:
        /// each member is checkpointed on its own (every --interval, with
        /// a jitter) and restarts use the recovery line.
        #[arg(long, value_parser = ["coordinated", "non-blocking", "uncoordinated"])]
        mode: Option<String>,
        /// Open regular files up to SIZE (e.g. 64M) are saved in the
        /// job's images and put back at a restart where they changed or
        /// are gone (a file written then renamed away, a scratch file
        /// removed); 0: none.
        #[arg(long, value_name = "SIZE", value_parser = cr_rpc::opts::parse_size)]
        save_files: Option<u64>,
    },
    /// Move a running job, or one member of it, to another node
    /// (stop-and-copy: checkpoint, copy of the images, restart there).
    Migrate {
        job: String,
        /// Target node.
        #[arg(long, value_name = "NODE")]
        to: String,
        /// The member to move: NODE:PID as `crctl job JOB` lists it, or
        /// #N (its row); default: the whole job.
        #[arg(long, value_name = "M")]
        member: Option<String>,
        /// Copy memory while the job runs (rounds while what changed
        /// shrinks), then stop it and copy only the rest.
        #[arg(long)]
        pre_copy: bool,
        /// Post-copy restore on the target: the member runs there as soon
        /// as all but its private anonymous memory is restored; those pages
        /// are put in while it runs (from the image fetched there).
        #[arg(long)]
        lazy: bool,
        #[arg(long, value_name = "SECS")]
        timeout: Option<u32>,
    },
    /// Move every job member off a node and refuse new ones there.
    Drain {
        /// The node (not with --self).
        #[arg(required_unless_present = "self_", conflicts_with = "self_")]
        node: Option<String>,
        /// Give up migrating after SECS (default: the coordinator's timeout).
        #[arg(long, value_name = "SECS")]
        deadline: Option<u32>,
        /// Drain the node this runs on, through its agent's socket
        /// ($CR_AGENT_SOCKET, default /run/cr/agent.sock; root only, no
        /// certificate needed): for a health check or a script on the node.
        #[arg(long = "self")]
        self_: bool,
        /// Why (logged by the coordinator, shown by crctl watch); with --self.
        #[arg(long, requires = "self_")]
        reason: Option<String>,
    },
    /// Print what happens, one line per event, as it happens (checkpoint
    /// and restart phases, migrations with their bytes, rates and time
    /// left, drains, nodes up, down and drained), until interrupted or the
    /// coordinator stops. With --json: one JSON object per line.
    Watch {
        /// Only the events of this job.
        #[arg(long, value_name = "JOB")]
        job: Option<String>,
    },
    /// Accept new members on a drained node again.
    Undrain { node: String },
    /// The cluster's certificates.
    Pki {
        #[command(subcommand)]
        cmd: PkiCmd,
    },
}

#[derive(Debug, Subcommand)]
enum PkiCmd {
    /// Make a CA: DIR/ca.crt and DIR/ca.key.
    Init {
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
    },
    /// Sign DIR/NAME.crt and DIR/NAME.key with the CA in DIR.
    Issue {
        #[arg(long, value_name = "DIR")]
        dir: PathBuf,
        /// DNS name (a node name, or the coordinator's TLS name).
        #[arg(long)]
        name: String,
        /// IP addresses to name as well.
        #[arg(long, value_name = "IP")]
        ip: Vec<IpAddr>,
        /// An administrator's certificate (crctl's): the only one the
        /// coordinator takes for administration, never for a node.
        #[arg(long)]
        admin: bool,
    },
}

/// /etc/cr/crctl.toml.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CtlConfig {
    coordinator: Option<String>,
    coordinator_name: Option<String>,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    #[serde(default)]
    insecure: bool,
}

type Res<T> = Result<T, String>;

/// Exit status when the request was carried out only in part (a checkpoint
/// committed, but some node could not kill or stop its members).
const EXIT_PARTIAL: i32 = 2;

/// The request was not met in full: what to say, and the exit status.
struct Partial(String);

fn main() {
    let cli = Cli::parse();
    match run(cli) {
        Ok(None) => {}
        Ok(Some(Partial(msg))) => {
            eprintln!("crctl: {msg}");
            std::process::exit(EXIT_PARTIAL);
        }
        Err(e) => {
            eprintln!("crctl: error: {e}");
            std::process::exit(1);
        }
    }
}

fn run(cli: Cli) -> Res<Option<Partial>> {
    if let Cmd::Pki { cmd } = &cli.cmd {
        return pki(cmd, cli.json).map(|_| None);
    }
    if let Cmd::Drain {
        self_: true,
        deadline,
        reason,
        ..
    } = &cli.cmd
    {
        return drain_self(cli.json, *deadline, reason.clone());
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    rt.block_on(remote(cli))
}

/// `crctl drain --self`: through the node's agent (its Unix socket).
fn drain_self(
    as_json: bool,
    deadline: Option<u32>,
    reason: Option<String>,
) -> Res<Option<Partial>> {
    let socket = cr_rpc::channel::agent_socket();
    let mut agent = cr_rpc::local::Agent::connect(&socket).map_err(|e| {
        format!(
            "no agent answers on {} ({e}): --self drains the node whose agent runs here",
            socket.display()
        )
    })?;
    let r = agent.drain_node(pb::DrainRequest {
        deadline_secs: deadline.unwrap_or(0),
        reason: reason.unwrap_or_default(),
        ..Default::default()
    })?;
    out(as_json, drain_json(&r), || drain_text(&r));
    Ok(drain_partial(&r))
}

/// Exit status 2 when not every job could be moved off.
fn drain_partial(r: &pb::DrainReply) -> Option<Partial> {
    (!r.failed.is_empty()).then(|| {
        Partial(format!(
            "node {} is drained, but not every job could be moved off: {}",
            r.node,
            r.failed.join("; ")
        ))
    })
}

fn pki(cmd: &PkiCmd, as_json: bool) -> Res<()> {
    match cmd {
        PkiCmd::Init { dir } => {
            let crt = cr_rpc::pki::init_ca(dir).map_err(|e| e.to_string())?;
            let key = dir.join("ca.key");
            if as_json {
                print_json(&json!({"cert": crt, "key": key}));
            } else {
                println!("CA made: {} and {}", crt.display(), key.display());
            }
        }
        PkiCmd::Issue {
            dir,
            name,
            ip,
            admin,
        } => {
            let role = admin.then_some(cr_rpc::identity::ROLE_ADMIN);
            let (crt, key) =
                cr_rpc::pki::issue_with_role(dir, name, ip, role).map_err(|e| e.to_string())?;
            if as_json {
                print_json(&json!({"cert": crt, "key": key}));
            } else {
                let what = if *admin {
                    "administrator certificate"
                } else {
                    "certificate"
                };
                println!("{what} of {name}: {} and {}", crt.display(), key.display());
            }
        }
    }
    Ok(())
}

/// The connection to the coordinator: its client, address and whether TLS
/// is used (for the messages of failures).
struct Conn {
    client: CoordinatorClient<Channel>,
    addr: String,
    tls: bool,
}

impl Conn {
    fn rpc<T>(&self, r: Result<tonic::Response<T>, tonic::Status>) -> Res<T> {
        rpc(&self.addr, self.tls, r)
    }
}

async fn connect(cli: &Cli) -> Res<Conn> {
    let (path, required) = match &cli.config {
        Some(p) => (p.clone(), true),
        None => (PathBuf::from(DEFAULT_CONFIG), false),
    };
    let cfg: CtlConfig = cr_rpc::config::load(&path, required).map_err(|e| e.to_string())?;
    let addr = cli
        .coordinator
        .clone()
        .or_else(|| {
            std::env::var("CR_COORDINATOR")
                .ok()
                .filter(|s| !s.is_empty())
        })
        .or(cfg.coordinator)
        .unwrap_or_else(|| format!("127.0.0.1:{}", cr_rpc::COORDINATOR_PORT));
    let name = cli
        .name
        .clone()
        .or(cfg.coordinator_name)
        .unwrap_or_else(|| cr_rpc::COORDINATOR_NAME.to_string());
    let files = TlsFiles {
        ca: cfg.ca,
        cert: cfg.cert,
        key: cfg.key,
        insecure: cfg.insecure,
    }
    .merge(
        cli.ca.clone(),
        cli.cert.clone(),
        cli.key.clone(),
        cli.insecure,
    );
    let sec = Security::load(&files).map_err(|e| e.to_string())?;
    let ch = cr_rpc::channel::connect(&addr, &sec, &name, CONNECT_TIMEOUT)
        .await
        .map_err(|e| match e {
            cr_rpc::RpcError::Connect { what, .. } => transport_line(&addr, sec.is_tls(), &what),
            e => e.to_string(),
        })?;
    Ok(Conn {
        client: CoordinatorClient::new(ch),
        addr,
        tls: sec.is_tls(),
    })
}

/// One readable line for a failure to talk to the coordinator at `addr`:
/// never a raw transport or TLS library message.
fn transport_line(addr: &str, tls: bool, what: &str) -> String {
    let w = what.to_lowercase();
    let why = if w.contains("connection refused") {
        "connection refused (is cr-coordinatord running there?)".to_string()
    } else if w.contains("timed out") || w.contains("deadline") || w.contains("elapsed") {
        "no answer (timed out)".to_string()
    } else if w.contains("unknownissuer")
        || w.contains("unknown issuer")
        || w.contains("badsignature")
    {
        "its certificate is not signed by our CA (check --ca)".to_string()
    } else if w.contains("notvalidforname")
        || w.contains("not valid for name")
        || w.contains("certnotvalidforname")
    {
        "its certificate does not name it as expected (check --name / coordinator_name)".to_string()
    } else if w.contains("certificate") || w.contains("handshake") || w.contains("alert") {
        "the TLS handshake failed: it does not accept our certificate (is it of the cluster CA?)"
            .to_string()
    } else if !tls
        && (w.contains("broken pipe")
            || w.contains("connection reset")
            || w.contains("stream closed")
            || w.contains("frame")
            || w.contains("http2"))
    {
        "it does not speak plain TCP (it uses TLS: drop --insecure and give --ca/--cert/--key)"
            .to_string()
    } else if tls
        && (w.contains("invalidcontenttype")
            || w.contains("corrupt message")
            || w.contains("invalid content"))
    {
        "it does not speak TLS (it runs with --insecure?)".to_string()
    } else if w.contains("no route") || w.contains("unreachable") {
        "no route to it".to_string()
    } else {
        cr_rpc::error::plain(what)
    };
    format!("cannot talk to the coordinator at {addr}: {why}")
}

fn rpc<T>(addr: &str, tls: bool, r: Result<tonic::Response<T>, tonic::Status>) -> Res<T> {
    r.map(|r| r.into_inner()).map_err(|s| match s.code() {
        // Failures of the connection itself: the transport's cause, said plainly.
        tonic::Code::Unavailable
        | tonic::Code::Unknown
        | tonic::Code::Cancelled
        | tonic::Code::Internal
            if std::error::Error::source(&s).is_some()
                || ["transport", "h2 protocol", "http2", "connection"]
                    .iter()
                    .any(|w| s.message().contains(w)) =>
        {
            transport_line(
                addr,
                tls,
                &format!("{} {}", s.message(), cr_rpc::error::innermost(&s)),
            )
        }
        tonic::Code::DeadlineExceeded => {
            format!("cannot talk to the coordinator at {addr}: no answer (timed out)")
        }
        _ => cr_rpc::status_line(&s),
    })
}

async fn remote(cli: Cli) -> Res<Option<Partial>> {
    let conn = connect(&cli).await?;
    let mut c = conn.client.clone();
    let js = cli.json;
    let mut partial = None;
    match cli.cmd {
        Cmd::Status => {
            let s = conn.rpc(c.status(pb::Empty {}).await)?;
            out(js, status_json(&s), || status_text(&s));
        }
        Cmd::Nodes => {
            let n = conn.rpc(c.nodes(pb::Empty {}).await)?;
            out(
                js,
                json!({"nodes": n.nodes.iter().map(node_json).collect::<Vec<_>>()}),
                || nodes_text(&n.nodes),
            );
        }
        Cmd::Jobs => {
            let j = conn.rpc(c.jobs(pb::Empty {}).await)?;
            out(
                js,
                json!({"jobs": j.jobs.iter().map(job_json).collect::<Vec<_>>()}),
                || jobs_text(&j.jobs),
            );
        }
        Cmd::Checkpoint {
            job,
            kill,
            stop,
            timeout,
            freeze_timeout,
            pre_copy,
            non_blocking,
            coop,
        } => {
            let after = if kill {
                pb::After::Kill
            } else if stop {
                pb::After::Stop
            } else {
                pb::After::Continue
            };
            let req = pb::CheckpointRequest {
                job,
                after: after as i32,
                timeout_secs: timeout.unwrap_or(0),
                freeze_timeout_ms: secs_to_ms(freeze_timeout, "--freeze-timeout")?,
                pre_copy,
                non_blocking,
                coop: cr_rpc::opts::cooperation(&coop),
                ..Default::default()
            };
            let ck = conn.rpc(c.checkpoint(req).await)?;
            out(js, checkpoint_json(&ck), || checkpoint_text(&ck));
            if !ck.unfinished.is_empty() && ck.after != pb::After::Continue as i32 {
                partial = Some(Partial(format!(
                    "checkpoint {} committed, but not carried out on {}: {}",
                    ck.id,
                    ck.unfinished.join(", "),
                    ck.notes
                        .iter()
                        .filter(|n| ck.unfinished.iter().any(|u| n.starts_with(u.as_str())))
                        .cloned()
                        .collect::<Vec<_>>()
                        .join("; ")
                )));
            }
        }
        Cmd::Restart {
            job,
            checkpoint,
            on,
            timeout,
            allow_changed_files,
            line,
        } => {
            let req = pb::RestartRequest {
                job,
                checkpoint: checkpoint.unwrap_or_default(),
                on,
                timeout_secs: timeout.unwrap_or(0),
                allow_changed_files,
                line,
                ..Default::default()
            };
            let r = conn.rpc(c.restart(req).await)?;
            out(js, restart_json(&r), || restart_text(&r));
        }
        Cmd::RecoveryLine { job } => {
            let r = conn.rpc(c.recovery_line(pb::RecoveryLineRequest { job }).await)?;
            out(js, line_json(&r), || line_text(&r));
        }
        Cmd::Checkpoints { job, all } => {
            let r = conn.rpc(c.checkpoints(pb::CheckpointsRequest { job, all }).await)?;
            out(
                js,
                json!({"checkpoints": r.checkpoints.iter().map(checkpoint_json).collect::<Vec<_>>()}),
                || checkpoints_text(&r.checkpoints, all),
            );
        }
        Cmd::Job {
            job,
            interval,
            keep,
            external,
            incremental,
            freeze_timeout,
            replicas,
            pre_copy,
            mode,
            save_files,
        } => {
            let req = pb::ConfigureRequest {
                job,
                interval_secs: interval,
                keep,
                external,
                incremental: incremental.map(|v| v == "on"),
                freeze_timeout_ms: match freeze_timeout {
                    None => None,
                    f => Some(secs_to_ms(f, "--freeze-timeout")?),
                },
                replicas,
                pre_copy: pre_copy.map(|v| v == "on"),
                mode,
                save_files,
                ..Default::default()
            };
            let j = conn.rpc(c.configure(req).await)?;
            out(js, job_json(&j), || job_text(&j));
        }
        Cmd::Migrate {
            job,
            to,
            member,
            pre_copy,
            lazy,
            timeout,
        } => {
            let req = pb::MigrateRequest {
                job,
                to,
                member: member.unwrap_or_default(),
                timeout_secs: timeout.unwrap_or(0),
                pre_copy,
                lazy,
            };
            let r = conn.rpc(c.migrate(req).await)?;
            out(js, migrate_json(&r), || migrate_text(&r));
        }
        Cmd::Drain { node, deadline, .. } => {
            let req = pb::DrainRequest {
                node: node.unwrap_or_default(),
                deadline_secs: deadline.unwrap_or(0),
                ..Default::default()
            };
            let r = conn.rpc(c.drain(req).await)?;
            out(js, drain_json(&r), || drain_text(&r));
            partial = drain_partial(&r);
        }
        Cmd::Watch { job } => {
            let req = pb::WatchRequest {
                job: job.unwrap_or_default(),
            };
            let mut stream = conn.rpc(c.watch(req).await)?;
            loop {
                let msg = tokio::select! {
                    m = stream.message() => m,
                    // Interrupted: a normal end.
                    _ = tokio::signal::ctrl_c() => break,
                };
                match msg {
                    Ok(Some(ev)) => {
                        if js {
                            println!("{}", event_json(&ev));
                        } else {
                            println!("{}", event_text(&ev));
                        }
                    }
                    // The coordinator ended the stream: it stops.
                    Ok(None) => break,
                    Err(s) => {
                        conn.rpc::<()>(Err(s))?;
                        break;
                    }
                }
            }
        }
        Cmd::Undrain { node } => {
            let n = conn.rpc(
                c.undrain(pb::DrainRequest {
                    node,
                    ..Default::default()
                })
                .await,
            )?;
            out(js, node_json(&n), || {
                format!("node {} accepts new members again\n", n.name)
            });
        }
        Cmd::Pki { .. } => unreachable!("handled without a coordinator"),
    }
    Ok(partial)
}

/// Seconds (with decimals) as milliseconds; refused unless finite and >= 0.
fn secs_to_ms(v: Option<f64>, flag: &str) -> Res<u64> {
    match v {
        None => Ok(0),
        Some(s) if s.is_finite() && (0.0..1e9).contains(&s) => Ok((s * 1000.0).round() as u64),
        Some(s) => Err(format!("{flag} {s}: expected a number of seconds")),
    }
}

fn out(as_json: bool, v: Value, text: impl FnOnce() -> String) {
    if as_json {
        print_json(&v);
    } else {
        print!("{}", text());
    }
}

fn print_json(v: &Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
    );
}

// ------------------------------------------------------------------ JSON

fn after_name(a: i32) -> &'static str {
    pb::After::try_from(a).map_or("AFTER_UNKNOWN", |a| a.as_str_name())
}

fn status_json(s: &pb::StatusReply) -> Value {
    json!({
        "version": s.version, "uptime_ms": s.uptime_ms, "nodes": s.nodes,
        "nodes_up": s.nodes_up, "jobs": s.jobs, "checkpoints": s.checkpoints,
        "active": s.active, "db": s.db,
        "migrations": s.migrations.iter().map(migration_json).collect::<Vec<_>>(),
        "drains": s.drains.iter().map(drain_progress_json).collect::<Vec<_>>(),
    })
}

fn migration_json(m: &pb::MigrationProgress) -> Value {
    json!({
        "job": m.job, "moves": m.moves, "phase": m.phase, "pre_copy": m.pre_copy,
        "lazy": m.lazy, "checkpoint": m.checkpoint, "started_unix_ms": m.started_unix_ms,
        "elapsed_ms": m.elapsed_ms, "rounds": m.rounds, "bytes_sent": m.bytes_sent,
        "copy_bytes": m.copy_bytes, "copy_total": m.copy_total, "rate": m.rate,
        "dirty_rate": m.dirty_rate, "eta_ms": m.eta_ms, "downtime_ms": m.downtime_ms,
        "error": m.error,
    })
}

fn drain_progress_json(d: &pb::DrainProgress) -> Value {
    json!({
        "node": d.node, "phase": d.phase, "jobs": d.jobs, "moved": d.moved,
        "failed": d.failed, "left": d.left, "job": d.job,
        "started_unix_ms": d.started_unix_ms, "reason": d.reason,
    })
}

/// One line of JSON (crctl --json watch).
fn event_json(e: &pb::Event) -> Value {
    json!({
        "unix_ms": e.unix_ms, "kind": e.kind, "job": e.job, "node": e.node,
        "phase": e.phase, "id": e.id, "text": e.text,
        "migration": e.migration.as_ref().map(migration_json),
        "drain": e.drain.as_ref().map(drain_progress_json),
        "lagged": e.lagged,
    })
}

/// `HH:MM:SS.mmm KIND TEXT` (UTC).
fn event_text(e: &pb::Event) -> String {
    let t = datetime(e.unix_ms);
    let time = t.split_once(' ').map_or(t.as_str(), |(_, hms)| hms);
    format!("{time}.{:03} {:<10} {}", e.unix_ms % 1000, e.kind, e.text)
}

fn node_json(n: &pb::NodeInfo) -> Value {
    json!({
        "name": n.name, "agent_addr": n.agent_addr, "addresses": n.addresses,
        "state": n.state, "last_seen_unix_ms": n.last_seen_unix_ms,
        "members": n.members, "version": n.version, "drained": n.drained,
        "capacity": n.capacity.as_ref().map(|c| json!({
            "mem_free": c.mem_free, "mem_source": c.mem_source,
            "cpus": c.cpus, "load": c.load,
        })),
    })
}

fn proc_json(p: &pb::ProcInfo) -> Value {
    json!({"node": p.node, "pid": p.pid, "uid": p.uid, "command": p.command, "alive": p.alive})
}

fn job_json(j: &pb::JobInfo) -> Value {
    json!({
        "name": j.name, "state": j.state,
        "procs": j.procs.iter().map(proc_json).collect::<Vec<_>>(),
        "interval_secs": j.interval_secs, "keep": j.keep, "external": j.external,
        "incremental": j.incremental, "freeze_timeout_ms": j.freeze_timeout_ms,
        "replicas": j.replicas, "pre_copy": j.pre_copy, "mode": j.mode,
        "save_files": j.save_files,
        "last_checkpoint": j.last_checkpoint, "checkpoints": j.checkpoints,
    })
}

fn bookmark_json(b: &pb::Bookmark) -> Value {
    json!({
        "local": b.local, "remote": b.remote, "snd_una": b.snd_una, "snd_nxt": b.snd_nxt,
        "rcv_nxt": b.rcv_nxt, "write_seq": b.write_seq, "pid": b.pid,
    })
}

fn image_json(i: &pb::ImageInfo) -> Value {
    json!({
        "node": i.node, "pid": i.pid, "dir": i.dir, "processes": i.processes,
        "page_bytes": i.page_bytes, "store_bytes": i.store_bytes, "frozen_ms": i.frozen_ms,
        "bookmarks": i.bookmarks.iter().map(bookmark_json).collect::<Vec<_>>(),
        "command": i.command, "uid": i.uid, "replicas": i.replicas,
    })
}

fn checkpoint_json(c: &pb::CheckpointInfo) -> Value {
    json!({
        "id": c.id, "job": c.job, "state": c.state, "after": after_name(c.after),
        "started_unix_ms": c.started_unix_ms, "duration_ms": c.duration_ms,
        "pause_ms": c.pause_ms,
        "images": c.images.iter().map(image_json).collect::<Vec<_>>(),
        "error": c.error, "connections": c.connections, "external": c.external,
        "prepare_ms": c.prepare_ms, "check_ms": c.check_ms, "dump_ms": c.dump_ms,
        "commit_ms": c.commit_ms, "notes": c.notes, "unfinished": c.unfinished,
        "freeze_timeout_ms": c.freeze_timeout_ms,
        "pre_copy_rounds": c.pre_copy_rounds, "pre_copy_bytes": c.pre_copy_bytes,
        "pre_copy_ms": c.pre_copy_ms, "pre_copy_fetched": c.pre_copy_fetched,
        "scope": c.scope, "non_blocking": c.non_blocking, "held_ms": c.held_ms,
        "callbacks_ms": c.callbacks_ms,
    })
}

fn line_json(r: &pb::RecoveryLineReply) -> Value {
    json!({
        "job": r.job, "at_start": r.at_start, "unmatched": r.unmatched, "garbage": r.garbage,
        "members": r.members.iter().map(|m| json!({
            "node": m.node, "pid": m.pid, "command": m.command, "checkpoint": m.checkpoint,
            "dir": m.dir, "taken_unix_ms": m.taken_unix_ms, "rolled_back": m.rolled_back,
            "checkpoints": m.checkpoints,
        })).collect::<Vec<_>>(),
    })
}

fn line_text(r: &pb::RecoveryLineReply) -> String {
    let rows: Vec<Vec<String>> = r
        .members
        .iter()
        .map(|m| {
            vec![
                format!("{}:{}", m.node, m.pid),
                m.command.clone(),
                if m.checkpoint.is_empty() {
                    "(start)".into()
                } else {
                    m.checkpoint.clone()
                },
                if m.taken_unix_ms == 0 {
                    "-".into()
                } else {
                    datetime(m.taken_unix_ms)
                },
                format!("{} of {}", m.rolled_back, m.checkpoints),
            ]
        })
        .collect();
    let mut o = format!("recovery line of job {}\n", r.job);
    o += &table(
        &[
            "MEMBER",
            "COMMAND",
            "CHECKPOINT",
            "TAKEN (UTC)",
            "ROLLED BACK",
        ],
        &rows,
    );
    if r.at_start {
        o += "every member rolls back to its start: restart the job from the start\n";
    }
    for u in &r.unmatched {
        let _ = writeln!(o, "unmatched connection (peer not in the job): {u}");
    }
    if !r.garbage.is_empty() {
        let _ = writeln!(o, "behind the line (garbage): {}", r.garbage.join(", "));
    }
    o
}

fn restart_json(r: &pb::RestartReply) -> Value {
    json!({
        "job": r.job, "checkpoint": r.checkpoint,
        "procs": r.procs.iter().map(proc_json).collect::<Vec<_>>(),
        "duration_ms": r.duration_ms, "map_addr": r.map_addr,
        "fetched_bytes": r.fetched_bytes, "fetch_ms": r.fetch_ms, "placed": r.placed,
    })
}

fn migrate_json(r: &pb::MigrateReply) -> Value {
    json!({
        "job": r.job, "checkpoint": r.checkpoint, "moved": r.moved,
        "downtime_ms": r.downtime_ms, "duration_ms": r.duration_ms,
        "bytes": r.bytes, "copy_ms": r.copy_ms,
        "procs": r.procs.iter().map(proc_json).collect::<Vec<_>>(),
        "rounds": r.rounds, "pre_copy_bytes": r.pre_copy_bytes, "pre_copy_ms": r.pre_copy_ms,
    })
}

fn drain_json(r: &pb::DrainReply) -> Value {
    json!({
        "node": r.node,
        "migrations": r.migrations.iter().map(migrate_json).collect::<Vec<_>>(),
        "failed": r.failed,
        "left": r.left,
    })
}

/// MiB/s of `bytes` in `ms`.
fn rate(bytes: u64, ms: u64) -> String {
    format!(
        "{:.1} MiB/s",
        bytes as f64 / (1 << 20) as f64 / (ms.max(1) as f64 / 1000.0)
    )
}

fn migrate_text(r: &pb::MigrateReply) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "job {} migrated with {}: {} (down {} ms; {} copied in {} ms, {})",
        r.job,
        r.checkpoint,
        r.moved.join(", "),
        r.downtime_ms,
        bytes(r.bytes),
        r.copy_ms,
        rate(r.bytes, r.copy_ms)
    );
    if r.rounds > 0 {
        let _ = writeln!(
            o,
            "pre-copy while it ran: {} rounds, {} in {} ms ({})",
            r.rounds,
            bytes(r.pre_copy_bytes),
            r.pre_copy_ms,
            rate(r.pre_copy_bytes, r.pre_copy_ms)
        );
    }
    o.push_str(&procs_table(&r.procs, false));
    o
}

fn drain_text(r: &pb::DrainReply) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "node {} drained: {} jobs moved off, {} failed",
        r.node,
        r.migrations.len(),
        r.failed.len()
    );
    for m in &r.migrations {
        let _ = writeln!(
            o,
            "  {}: {} (down {} ms)",
            m.job,
            m.moved.join(", "),
            m.downtime_ms
        );
    }
    for f in &r.failed {
        let _ = writeln!(o, "  failed: {f}");
    }
    for l in &r.left {
        let _ = writeln!(o, "  left: {l}");
    }
    o
}

// ------------------------------------------------------------------ text

/// Columns aligned, two spaces apart; the last column is not padded.
fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let mut o = String::new();
    let mut line = |cells: Vec<&str>| {
        let n = cells.len();
        let mut l = String::new();
        for (i, c) in cells.into_iter().enumerate() {
            if i + 1 < n {
                let _ = write!(l, "{c:<width$}  ", width = w[i]);
            } else {
                l.push_str(c);
            }
        }
        o.push_str(l.trim_end());
        o.push('\n');
    };
    line(headers.to_vec());
    for r in rows {
        line(r.iter().map(String::as_str).collect());
    }
    o
}

fn duration(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0 => format!("{ms} ms"),
        1..60 => format!("{:.1} s", ms as f64 / 1000.0),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m{:02}s", s / 3600, s / 60 % 60, s % 60),
    }
}

/// UTC date and time of a Unix time in ms.
fn datetime(unix_ms: u64) -> String {
    if unix_ms == 0 {
        return "-".into();
    }
    let secs = unix_ms / 1000;
    let (days, rem) = ((secs / 86400) as i64, secs % 86400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn status_text(s: &pb::StatusReply) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "cr-coordinatord {}, up {}",
        s.version,
        duration(s.uptime_ms)
    );
    let _ = writeln!(o, "catalog      {}", s.db);
    let _ = writeln!(o, "nodes        {} ({} up)", s.nodes, s.nodes_up);
    let _ = writeln!(o, "jobs         {}", s.jobs);
    let _ = writeln!(o, "checkpoints  {} committed", s.checkpoints);
    if s.active.is_empty() {
        let _ = writeln!(o, "active       none");
    }
    for (i, a) in s.active.iter().enumerate() {
        let _ = writeln!(
            o,
            "{}{a}",
            if i == 0 {
                "active       "
            } else {
                "             "
            }
        );
    }
    for m in &s.migrations {
        let mut l = format!(
            "migration    {} ({}): {}, {} sent",
            m.job,
            m.moves.join(", "),
            m.phase,
            bytes(m.bytes_sent)
        );
        if m.rate > 0 {
            let _ = write!(l, ", {}/s", bytes(m.rate));
        }
        if m.dirty_rate > 0 {
            let _ = write!(l, ", dirty {}/s", bytes(m.dirty_rate));
        }
        if m.eta_ms > 0 {
            let _ = write!(l, ", {} left", duration(m.eta_ms));
        }
        let _ = writeln!(o, "{l}, for {}", duration(m.elapsed_ms));
    }
    for d in &s.drains {
        let _ = writeln!(
            o,
            "drain        {}: {} of {} jobs moved off, {} failed, {} left{}",
            d.node,
            d.moved,
            d.jobs,
            d.failed,
            d.left,
            if d.job.is_empty() {
                String::new()
            } else {
                format!(", moving {}", d.job)
            }
        );
    }
    o
}

fn nodes_text(nodes: &[pb::NodeInfo]) -> String {
    if nodes.is_empty() {
        return "no node registered\n".into();
    }
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .map(|n| {
            vec![
                n.name.clone(),
                if n.drained {
                    format!("{},drained", n.state)
                } else {
                    n.state.clone()
                },
                n.agent_addr.clone(),
                if n.addresses.is_empty() {
                    "-".into()
                } else {
                    n.addresses.join(",")
                },
                n.members.to_string(),
                match &n.capacity {
                    Some(c) => format!("{} MiB", c.mem_free >> 20),
                    None => "-".into(),
                },
                n.capacity
                    .as_ref()
                    .map_or("-".into(), |c| format!("{:.1}", c.cpus)),
                n.capacity
                    .as_ref()
                    .map_or("-".into(), |c| format!("{:.2}", c.load)),
                datetime(n.last_seen_unix_ms),
                n.version.clone(),
            ]
        })
        .collect();
    table(
        &[
            "NODE",
            "STATE",
            "AGENT",
            "ADDRESSES",
            "MEMBERS",
            "MEM FREE",
            "CPUS",
            "LOAD",
            "LAST SEEN (UTC)",
            "VERSION",
        ],
        &rows,
    )
}

fn interval(secs: u32) -> String {
    if secs == 0 {
        "-".into()
    } else {
        format!("{secs} s")
    }
}

fn keep(n: u32) -> String {
    if n == 0 {
        "all".into()
    } else {
        n.to_string()
    }
}

fn jobs_text(jobs: &[pb::JobInfo]) -> String {
    if jobs.is_empty() {
        return "no job\n".into();
    }
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            let alive = j.procs.iter().filter(|p| p.alive).count();
            let nodes: std::collections::BTreeSet<&str> = j
                .procs
                .iter()
                .filter(|p| p.alive)
                .map(|p| p.node.as_str())
                .collect();
            vec![
                j.name.clone(),
                j.state.clone(),
                format!("{alive}/{}", j.procs.len()),
                nodes.len().to_string(),
                interval(j.interval_secs),
                keep(j.keep),
                j.external.clone(),
                if j.last_checkpoint.is_empty() {
                    "-".into()
                } else {
                    j.last_checkpoint.clone()
                },
                j.checkpoints.to_string(),
            ]
        })
        .collect();
    table(
        &[
            "JOB",
            "STATE",
            "PROCS",
            "NODES",
            "INTERVAL",
            "KEEP",
            "EXTERNAL",
            "LAST",
            "CHECKPOINTS",
        ],
        &rows,
    )
}

fn procs_table(procs: &[pb::ProcInfo], with_alive: bool) -> String {
    let rows: Vec<Vec<String>> = procs
        .iter()
        .map(|p| {
            let mut r = vec![p.node.clone(), p.pid.to_string(), p.uid.to_string()];
            if with_alive {
                r.push(if p.alive { "yes" } else { "no" }.into());
            }
            r.push(p.command.clone());
            r
        })
        .collect();
    if with_alive {
        table(&["NODE", "PID", "UID", "ALIVE", "COMMAND"], &rows)
    } else {
        table(&["NODE", "PID", "UID", "COMMAND"], &rows)
    }
}

fn job_text(j: &pb::JobInfo) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "job {}: {}", j.name, j.state);
    let _ = writeln!(o, "interval   {}", interval(j.interval_secs));
    let _ = writeln!(o, "keep       {}", keep(j.keep));
    let _ = writeln!(o, "external   {}", j.external);
    let _ = writeln!(
        o,
        "incremental {}",
        if j.incremental { "on" } else { "off" }
    );
    let _ = writeln!(
        o,
        "freeze     {}",
        if j.freeze_timeout_ms == 0 {
            "default".to_string()
        } else {
            duration(j.freeze_timeout_ms)
        }
    );
    let _ = writeln!(o, "replicas   {}", j.replicas.max(1));
    let _ = writeln!(o, "pre-copy   {}", if j.pre_copy { "on" } else { "off" });
    let _ = writeln!(o, "mode       {}", j.mode);
    if j.save_files > 0 {
        let _ = writeln!(o, "save files up to {}", bytes(j.save_files));
    }
    let _ = writeln!(
        o,
        "last       {} ({} committed)",
        if j.last_checkpoint.is_empty() {
            "-"
        } else {
            &j.last_checkpoint
        },
        j.checkpoints
    );
    if !j.procs.is_empty() {
        o.push_str(&procs_table(&j.procs, true));
    }
    o
}

fn node_count(images: &[pb::ImageInfo]) -> usize {
    images
        .iter()
        .map(|i| i.node.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .len()
}

fn checkpoint_text(c: &pb::CheckpointInfo) -> String {
    let mut o = String::new();
    let procs: u32 = c.images.iter().map(|i| i.processes).sum();
    let stored: u64 = c.images.iter().map(|i| i.store_bytes).sum();
    let state = if c.unfinished.is_empty() {
        c.state.clone()
    } else {
        format!("{} (not finished on {})", c.state, c.unfinished.join(", "))
    };
    let _ = writeln!(
        o,
        "checkpoint {} {state}: {procs} processes on {} nodes, paused {} ms, {stored} bytes in {} ms",
        c.id,
        node_count(&c.images),
        c.pause_ms,
        c.duration_ms
    );
    if c.non_blocking {
        let _ = writeln!(
            o,
            "non-blocking: each member paused only for its own dump; connections held at most {} ms",
            c.held_ms
        );
    }
    if c.pre_copy_rounds > 0 {
        let _ = writeln!(
            o,
            "pre-copy while it ran: {} rounds, {} in {} ms",
            c.pre_copy_rounds,
            bytes(c.pre_copy_bytes),
            c.pre_copy_ms
        );
    }
    for n in &c.notes {
        let _ = writeln!(o, "note: {n}");
    }
    let _ = writeln!(
        o,
        "connections {} matched, {} external; prepare {} ms (callbacks {} ms), check {} ms, dump {} ms, commit {} ms",
        c.connections,
        c.external,
        c.prepare_ms,
        c.callbacks_ms,
        c.check_ms,
        c.dump_ms,
        c.commit_ms
    );
    let rows: Vec<Vec<String>> = c
        .images
        .iter()
        .map(|i| {
            vec![
                i.node.clone(),
                i.pid.to_string(),
                i.processes.to_string(),
                bytes(i.page_bytes),
                bytes(i.store_bytes),
                format!("{} ms", i.frozen_ms),
                i.dir.clone(),
            ]
        })
        .collect();
    o.push_str(&table(
        &["NODE", "PID", "PROCS", "MEMORY", "STORED", "FROZEN", "DIR"],
        &rows,
    ));
    o
}

fn restart_text(r: &pb::RestartReply) -> String {
    let mut o = String::new();
    let nodes: std::collections::BTreeSet<&str> = r.procs.iter().map(|p| p.node.as_str()).collect();
    let _ = writeln!(
        o,
        "job {} restarted from {}: {} processes on {} nodes in {} ms",
        r.job,
        r.checkpoint,
        r.procs.len(),
        nodes.len(),
        r.duration_ms
    );
    if !r.map_addr.is_empty() {
        let _ = writeln!(o, "addresses rewritten: {}", r.map_addr.join(", "));
    }
    if r.fetched_bytes > 0 {
        let _ = writeln!(
            o,
            "images fetched by their new nodes: {} in {} ms ({})",
            bytes(r.fetched_bytes),
            r.fetch_ms,
            rate(r.fetched_bytes, r.fetch_ms)
        );
    }
    o.push_str(&procs_table(&r.procs, false));
    o
}

fn checkpoints_text(cks: &[pb::CheckpointInfo], all: bool) -> String {
    if cks.is_empty() {
        return if all {
            "no checkpoint\n".into()
        } else {
            "no committed checkpoint (--all shows the others)\n".into()
        };
    }
    let rows: Vec<Vec<String>> = cks
        .iter()
        .map(|c| {
            let garbage = c.state == "removed" && c.notes.iter().any(|n| n.starts_with("garbage"));
            let mut r = vec![
                c.id.clone(),
                if garbage {
                    "garbage (removed)".into()
                } else {
                    c.state.clone()
                },
                match (c.scope.as_str(), c.images.first()) {
                    ("member", Some(i)) => format!("member {}:{}", i.node, i.pid),
                    ("member", None) => "member".into(),
                    _ => after_name(c.after)
                        .trim_start_matches("AFTER_")
                        .to_lowercase(),
                },
                datetime(c.started_unix_ms),
                format!("{} ms", c.duration_ms),
                format!("{} ms", c.pause_ms),
                c.images
                    .iter()
                    .map(|i| i.processes)
                    .sum::<u32>()
                    .to_string(),
                node_count(&c.images).to_string(),
                bytes(c.images.iter().map(|i| i.store_bytes).sum()),
            ];
            if all {
                r.push(c.error.clone());
            }
            r
        })
        .collect();
    let mut h = vec![
        "ID",
        "STATE",
        "AFTER",
        "STARTED (UTC)",
        "DURATION",
        "PAUSE",
        "PROCS",
        "NODES",
        "STORED",
    ];
    if all {
        h.push("ERROR");
    }
    table(&h, &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(datetime(0), "-");
        assert_eq!(datetime(86_400_000), "1970-01-02 00:00:00");
        assert_eq!(datetime(1_709_210_096_000), "2024-02-29 12:34:56");
    }

    #[test]
    fn tables_align() {
        let t = table(
            &["A", "BB"],
            &[
                vec!["xxx".into(), "1".into()],
                vec!["y".into(), "22".into()],
            ],
        );
        assert_eq!(t, "A    BB\nxxx  1\ny    22\n");
    }
}
