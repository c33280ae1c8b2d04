//! `cr-bench coordinator`: a coordinated checkpoint round of a job with one
//! member on each of N agents, against a real `cr-coordinatord` process
//! over real gRPC (plain TCP: TLS is not part of it). The N agents are
//! simulated in this process: one Agent server on one port of every
//! loopback address `127.10.0.0 + i` (the address a connection came to
//! says which agent it is for), each agent with its own channel to the
//! coordinator, registering and heartbeating like a real one; they answer
//! PREPARE/FREEZE/DUMP/COMMIT/FINISH at once, as the ring of
//! [`crate::coord`] (one connection to each neighbour, so CHECK matches N
//! connections).
//!
//! Measured: the registration of all agents at once (a coordinator that
//! restarts sees that), the first round (which opens the coordinator's
//! channels to every agent) and the next ones, the coordinator's CPU time
//! per round and while the agents only heartbeat, its peak and current RSS,
//! threads and fds. The same-run limit is the plainest fan-out: this
//! process calling Abort (of no session: a no-op) on every agent at once
//! over connections already open, four times in a row (a round's four
//! fan-outs: PREPARE, FREEZE, DUMP, FINISH). The stream limit is the same
//! on one `Commands` stream per agent, as the coordinator sends the round's
//! calls (`cr_rpc::commands`).

use crate::coord::{member, node_name, Ring, JOB};
use crate::{bin_dir, int_in, mkdtemp, require_bins, DirGuard, Res};
use clap::Args;
use cr_coordinatord::pb;
use cr_coordinatord::pb::agent_server::{Agent, AgentServer};
use cr_coordinatord::pb::coordinator_client::CoordinatorClient;
use cr_rpc::tls::Security;
use futures_util::future::join_all;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// `cr-bench coordinator`: the coordinator's round with simulated agents
/// over gRPC.
#[derive(Args)]
#[command(after_help = AFTER_HELP)]
pub struct Opts {
    /// Simulated agents, one job member each.
    #[arg(long, value_name = "N", default_value_t = 10000, value_parser = int_in::<usize>(1..=1_000_000))]
    agents: usize,
    /// Measured rounds, after the first one.
    #[arg(long, value_name = "R", default_value_t = 3, value_parser = int_in::<usize>(1..))]
    rounds: usize,
    /// Heartbeat period the coordinator tells the agents.
    #[arg(long, value_name = "MS", default_value_t = 1000, value_parser = int_in::<u32>(100..))]
    heartbeat_ms: u32,
    /// Agents sharing one connection to the coordinator for Register and
    /// Heartbeat (a real agent has its own; 1 needs 2 fds per agent in
    /// the coordinator).
    #[arg(long, value_name = "K", default_value_t = 1, value_parser = int_in::<usize>(1..))]
    agents_per_conn: usize,
    /// Where cr-coordinatord lives (default: next to this executable).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
    /// Where the catalog goes: a fresh directory under it.
    #[arg(long, value_name = "DIR", default_value = "/var/tmp")]
    disk_base: PathBuf,
}

const AFTER_HELP: &str = "\
The agents' Agent server runs in a child process (`cr-bench coordinator-agents`),
so that no process needs more fds than its hard limit: the coordinator holds one
connection to each agent and one from each group of --agents-per-conn agents.";

/// `cr-bench coordinator-agents`: the simulated agents' server (run by
/// `cr-bench coordinator`): prints `PORT P` once it listens, serves until its
/// stdin closes.
#[derive(Args)]
pub struct AgentsOpts {
    #[arg(long, value_name = "N", value_parser = int_in::<usize>(1..=1_000_000))]
    agents: usize,
}

/// Agent `i` is reached at this address plus `i`.
const BASE: Ipv4Addr = Ipv4Addr::new(127, 10, 0, 0);

fn agent_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(BASE) + i as u32)
}

/// The simulated agents: one server, the agent told by the address called.
struct Sim {
    ring: Arc<Ring>,
    n: usize,
}

impl Sim {
    fn agent<T>(&self, r: &Request<T>) -> Result<usize, Status> {
        let i = match r.local_addr().map(|a| a.ip()) {
            Some(IpAddr::V4(ip)) => u32::from(ip).wrapping_sub(u32::from(BASE)) as usize,
            other => return Err(Status::internal(format!("called at {other:?}"))),
        };
        if i >= self.n {
            return Err(Status::not_found(format!("no agent at {}", agent_ip(i))));
        }
        Ok(i)
    }
}

fn none<T>(what: &str) -> Result<Response<T>, Status> {
    Err(Status::unimplemented(format!("{what} is not simulated")))
}

#[tonic::async_trait]
impl Agent for Sim {
    type ReadImageFileStream =
        tokio_stream::wrappers::ReceiverStream<Result<pb::FileChunk, Status>>;
    type ServePagesStream = tokio_stream::wrappers::ReceiverStream<Result<pb::PageBlock, Status>>;
    type CommandsStream = cr_rpc::commands::ReplyStream;

    async fn commands(
        &self,
        r: Request<tonic::Streaming<pb::Command>>,
    ) -> Result<Response<Self::CommandsStream>, Status> {
        // The agent is the one of the address the stream came to.
        let i = self.agent(&r)?;
        let ring = self.ring.clone();
        Ok(Response::new(cr_rpc::commands::serve(
            r.into_inner(),
            move |call| {
                use pb::command::Call;
                use pb::command_reply::Reply;
                let reply = match call {
                    Call::Prepare(_) => Reply::Prepare(pb::PrepareReply::default()),
                    Call::Freeze(_) => Reply::Freeze(ring.freeze(i)),
                    Call::Dump(r) => Reply::Dump(ring.dump(i, &r.session)),
                    Call::Abort(_) => Reply::Abort(pb::Empty {}),
                    Call::Finish(_) => Reply::Finish(ring.finish()),
                };
                std::future::ready(Ok(reply))
            },
        )))
    }

    async fn prepare(
        &self,
        r: Request<pb::PrepareRequest>,
    ) -> Result<Response<pb::PrepareReply>, Status> {
        self.agent(&r)?;
        // The callbacks (no member uses libcr).
        Ok(Response::new(pb::PrepareReply::default()))
    }
    async fn freeze(
        &self,
        r: Request<pb::SessionRequest>,
    ) -> Result<Response<pb::PrepareReply>, Status> {
        Ok(Response::new(self.ring.freeze(self.agent(&r)?)))
    }
    async fn dump(
        &self,
        r: Request<pb::SessionRequest>,
    ) -> Result<Response<pb::DumpReply>, Status> {
        let i = self.agent(&r)?;
        Ok(Response::new(self.ring.dump(i, &r.get_ref().session)))
    }
    async fn abort(&self, r: Request<pb::SessionRequest>) -> Result<Response<pb::Empty>, Status> {
        self.agent(&r)?;
        Ok(Response::new(pb::Empty {}))
    }
    async fn finish(
        &self,
        r: Request<pb::FinishRequest>,
    ) -> Result<Response<pb::FinishReply>, Status> {
        self.agent(&r)?;
        Ok(Response::new(self.ring.finish()))
    }
    async fn remove(&self, r: Request<pb::RemoveRequest>) -> Result<Response<pb::Empty>, Status> {
        self.agent(&r)?;
        Ok(Response::new(pb::Empty {}))
    }
    async fn unlock(&self, r: Request<pb::RemoveRequest>) -> Result<Response<pb::Empty>, Status> {
        self.agent(&r)?;
        Ok(Response::new(pb::Empty {}))
    }
    async fn restore(
        &self,
        _: Request<pb::RestoreRequest>,
    ) -> Result<Response<pb::RestoreReply>, Status> {
        none("RESTORE")
    }
    async fn release(
        &self,
        _: Request<pb::SessionRequest>,
    ) -> Result<Response<pb::ReleaseReply>, Status> {
        none("RELEASE")
    }
    async fn job_back(
        &self,
        _: Request<pb::SessionRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        none("JOBBACK")
    }
    async fn launch(
        &self,
        _: Request<pb::LaunchRequest>,
    ) -> Result<Response<pb::LaunchReply>, Status> {
        none("LAUNCH")
    }
    async fn pre_dump(
        &self,
        _: Request<pb::PreDumpRequest>,
    ) -> Result<Response<pb::PreDumpReply>, Status> {
        none("PREDUMP")
    }
    async fn fetch(
        &self,
        _: Request<pb::FetchRequest>,
    ) -> Result<Response<pb::FetchReply>, Status> {
        none("FETCH")
    }
    async fn image_manifest(
        &self,
        _: Request<pb::ManifestRequest>,
    ) -> Result<Response<pb::Manifest>, Status> {
        none("ImageManifest")
    }
    async fn read_image_file(
        &self,
        _: Request<pb::ReadFileRequest>,
    ) -> Result<Response<Self::ReadImageFileStream>, Status> {
        none("ReadImageFile")
    }
    async fn serve_pages(
        &self,
        _: Request<tonic::Streaming<pb::PageWant>>,
    ) -> Result<Response<Self::ServePagesStream>, Status> {
        none("ServePages")
    }
}

/// The cr-coordinatord process; stopped (SIGTERM, then SIGKILL) on drop.
struct Daemon {
    child: Child,
}

impl Daemon {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn stop(&mut self) {
        // SAFETY: a signal to our own child, which we have not reaped yet.
        unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.stop();
        }
    }
}

/// Raise our own soft fd limit to the hard one; fails when `want` is
/// above it (raising it needs CAP_SYS_RESOURCE).
fn raise_nofile(want: u64) -> Res<u64> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `l` is a valid out pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return Err(crate::os_err("getrlimit(RLIMIT_NOFILE)"));
    }
    if want > l.rlim_max {
        return Err(format!(
            "{want} fds needed, the hard RLIMIT_NOFILE is {} (fewer --agents, or more \
             --agents-per-conn)",
            l.rlim_max
        ));
    }
    l.rlim_cur = l.rlim_max;
    // SAFETY: `l` is a valid in pointer.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) } != 0 {
        return Err(crate::os_err("setrlimit(RLIMIT_NOFILE)"));
    }
    Ok(l.rlim_max)
}

/// A free TCP port of 127.0.0.1.
fn free_port() -> Res<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("bind: {e}"))?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// Start cr-coordinatord with a config in `dir`, listening on `port`; its
/// soft fd limit is the usual 1024 (it must raise it itself).
fn start_coordinator(bin: &Path, dir: &Path, port: u16, hb: u32) -> Res<Daemon> {
    let conf = dir.join("coordinatord.toml");
    std::fs::write(
        &conf,
        format!(
            "listen = \"127.0.0.1:{port}\"\ndb = \"{}\"\nheartbeat_ms = {hb}\n\
             node_timeout_ms = {}\ntimeout_secs = 600\nfreeze_timeout_ms = 600000\ninsecure = true\n",
            dir.join("catalog.redb").display(),
            u64::from(hb) * 5,
        ),
    )
    .map_err(|e| format!("{}: {e}", conf.display()))?;
    let log = std::fs::File::create(dir.join("coordinatord.log")).map_err(|e| e.to_string())?;
    let mut cmd = Command::new(bin);
    cmd.arg("--config")
        .arg(&conf)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| e.to_string())?)
        .stderr(log);
    // SAFETY: only setrlimit (async-signal-safe) between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let mut l = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
            l.rlim_cur = l.rlim_max.min(1024);
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|e| format!("{}: {e}", bin.display()))?;
    let mut d = Daemon { child };
    let t = Instant::now();
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(d);
        }
        if let Ok(Some(st)) = d.child.try_wait() {
            return Err(format!(
                "cr-coordinatord exited ({st}): {}",
                crate::file_tail(&dir.join("coordinatord.log"), 2000)
            ));
        }
        if t.elapsed() > Duration::from_secs(30) {
            return Err("cr-coordinatord did not listen within 30 s".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A field of /proc/PID/status in kB.
fn status_kb(pid: i32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key)?.trim().split(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// User plus system CPU time of `pid`, in seconds.
fn cpu_secs(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    // After the command: the state, then ppid ...; utime and stime are
    // the 14th and 15th fields of the line, the 12th and 13th here.
    let f: Vec<&str> = after.split_whitespace().collect();
    let field = |k: usize| f.get(k).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    let ticks = field(11) + field(12);
    // SAFETY: sysconf with a constant name.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks as f64 / hz
}

fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn lazy(addr: &str) -> Res<Channel> {
    cr_rpc::channel::lazy(
        addr,
        &Security::Insecure,
        cr_rpc::COORDINATOR_NAME,
        Duration::from_secs(30),
    )
    .map_err(|e| e.to_string())
}

fn register_req(i: usize, port: u16, generation: u64) -> pb::RegisterRequest {
    pb::RegisterRequest {
        node: node_name(i),
        agent_addr: format!("{}:{port}", agent_ip(i)),
        addresses: vec![agent_ip(i).to_string()],
        version: "sim".into(),
        members: vec![member(i)],
        generation,
        ..Default::default()
    }
}

/// What the agents' heartbeats met.
#[derive(Default)]
struct Beats {
    sent: AtomicU64,
    failed: AtomicU64,
    again: AtomicU64,
    /// Slowest reply, µs.
    slowest_us: AtomicU64,
    /// Longest period the coordinator told, ms.
    period_ms: AtomicU64,
}

/// Agent `i` heartbeats every `hb` (its first after `offset`) until the end
/// of the process's runtime, registering again when asked; like a real
/// agent, it takes the period the coordinator's replies give.
async fn heartbeat(
    i: usize,
    mut c: pb::coordinator_client::CoordinatorClient<Channel>,
    port: u16,
    hb: Duration,
    offset: Duration,
    beats: Arc<Beats>,
) {
    tokio::time::sleep(offset).await;
    let mut period = hb;
    let mut next = tokio::time::Instant::now();
    loop {
        tokio::time::sleep_until(next).await;
        next += period;
        let t = Instant::now();
        let r = c
            .heartbeat(pb::HeartbeatRequest {
                node: node_name(i),
                members: vec![member(i)],
                generation: 1,
                ..Default::default()
            })
            .await;
        beats.sent.fetch_add(1, Ordering::Relaxed);
        beats
            .slowest_us
            .fetch_max(t.elapsed().as_micros() as u64, Ordering::Relaxed);
        match r {
            Ok(r) if r.get_ref().register_again => {
                beats.again.fetch_add(1, Ordering::Relaxed);
                let _ = c.register(register_req(i, port, 1)).await;
            }
            Ok(r) => {
                let told = Duration::from_millis(u64::from(r.get_ref().heartbeat_ms));
                beats
                    .period_ms
                    .fetch_max(told.as_millis() as u64, Ordering::Relaxed);
                if !told.is_zero() && told != period {
                    // Spread over the new period as they were over the old.
                    next += (told.saturating_sub(period))
                        .mul_f64(offset.as_secs_f64() / hb.as_secs_f64().max(1e-9));
                    period = told;
                }
            }
            Err(_) => {
                beats.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Everything measured.
struct Figures {
    register_s: f64,
    first_round_ms: f64,
    /// Per measured round: its time as crctl sees it (ms), the
    /// coordinator's own record of it and its CPU seconds.
    rounds: Vec<(f64, pb::CheckpointInfo, f64)>,
    /// The coordinator's CPU share (of one CPU) while the agents only
    /// heartbeat, over `idle_s`.
    idle_cpu: f64,
    idle_s: f64,
    hwm_kb: u64,
    rss_kb: u64,
    threads: u64,
    fds: usize,
    beats: Arc<Beats>,
}

/// One Checkpoint call, as crctl makes it: its time (ms) and the record,
/// which must hold every agent's image and connection.
async fn one_round(
    admin: &mut CoordinatorClient<Channel>,
    n: usize,
) -> Res<(f64, pb::CheckpointInfo)> {
    let t0 = Instant::now();
    let info = admin
        .checkpoint(pb::CheckpointRequest {
            job: JOB.into(),
            after: pb::After::Continue as i32,
            ..Default::default()
        })
        .await
        .map_err(|s| format!("checkpoint: {}", cr_rpc::status_line(&s)))?
        .into_inner();
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    if info.images.len() != n || info.connections as usize != n {
        return Err(format!(
            "checkpoint {}: {} images and {} connections, expected {n} of each",
            info.id,
            info.images.len(),
            info.connections
        ));
    }
    Ok((ms, info))
}

/// A checkpoint round's calls to every agent: PREPARE, FREEZE, DUMP,
/// FINISH.
const ROUND_FAN_OUTS: usize = 4;

/// The same-run limit: [`ROUND_FAN_OUTS`] fan-outs of Abort to every agent
/// at once over open connections (one warm-up fan-out opens them), three
/// times; seconds.
async fn limit(n: usize, port: u16) -> Res<Vec<f64>> {
    let clients: Vec<_> = (0..n)
        .map(|i| lazy(&format!("{}:{port}", agent_ip(i))).map(pb::agent_client::AgentClient::new))
        .collect::<Res<_>>()?;
    let fan_out = || async {
        let all = join_all(clients.iter().map(|c| {
            let mut c = c.clone();
            async move {
                c.abort(pb::SessionRequest {
                    session: "limit".into(),
                })
                .await
            }
        }))
        .await;
        for r in all {
            r.map_err(|s| format!("limit: {}", cr_rpc::status_line(&s)))?;
        }
        Ok::<_, String>(())
    };
    timed_rounds(fan_out).await
}

/// One `fan_out` to warm up, then three times [`ROUND_FAN_OUTS`] of them
/// in a row: seconds each.
async fn timed_rounds<F, Fut>(fan_out: F) -> Res<Vec<f64>>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Res<()>>,
{
    fan_out().await?;
    let mut out = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        for _ in 0..ROUND_FAN_OUTS {
            fan_out().await?;
        }
        out.push(t.elapsed().as_secs_f64());
    }
    Ok(out)
}

/// The same with one command stream per agent (as the coordinator's
/// [`cr_rpc::commands::Client`]): [`ROUND_FAN_OUTS`] fan-outs of an Abort
/// command, three times; seconds.
async fn stream_limit(n: usize, port: u16) -> Res<Vec<f64>> {
    let streams = join_all((0..n).map(|i| async move {
        let ch = lazy(&format!("{}:{port}", agent_ip(i)))?;
        cr_rpc::commands::Client::open(ch)
            .await
            .map_err(|s| format!("stream limit: {}", cr_rpc::status_line(&s)))
    }))
    .await
    .into_iter()
    .collect::<Res<Vec<_>>>()?;
    let fan_out = || async {
        let all = join_all(streams.iter().map(|c| {
            c.call(pb::command::Call::Abort(pb::SessionRequest {
                session: "limit".into(),
            }))
        }))
        .await;
        for r in all {
            r.map_err(|e| format!("stream limit: {e}"))?;
        }
        Ok::<_, String>(())
    };
    timed_rounds(fan_out).await
}

async fn bench(o: &Opts, coord_pid: i32, coord_port: u16, port: u16) -> Res<Figures> {
    let n = o.agents;
    // Every agent registers at once; each group of agents_per_conn shares
    // a connection.
    let coord_addr = format!("127.0.0.1:{coord_port}");
    let conns: Vec<CoordinatorClient<Channel>> = (0..n.div_ceil(o.agents_per_conn))
        .map(|_| lazy(&coord_addr).map(CoordinatorClient::new))
        .collect::<Res<_>>()?;
    let client = |i: usize| conns[i / o.agents_per_conn].clone();
    eprintln!("cr-bench coordinator: {n} agents register ...");
    let t = Instant::now();
    let regs = join_all((0..n).map(|i| {
        let mut c = client(i);
        async move { c.register(register_req(i, port, 1)).await }
    }))
    .await;
    let register_s = t.elapsed().as_secs_f64();
    for (i, r) in regs.into_iter().enumerate() {
        r.map_err(|s| format!("register {}: {}", node_name(i), cr_rpc::status_line(&s)))?;
    }
    eprintln!("cr-bench coordinator: registered in {register_s:.2} s");
    let beats = Arc::new(Beats::default());
    let hb = Duration::from_millis(u64::from(o.heartbeat_ms));
    let beating: Vec<_> = (0..n)
        .map(|i| {
            let offset = hb * i as u32 / n as u32;
            tokio::spawn(heartbeat(i, client(i), port, hb, offset, beats.clone()))
        })
        .collect();

    let mut admin = CoordinatorClient::new(lazy(&coord_addr)?)
        .max_decoding_message_size(1 << 30)
        .max_encoding_message_size(1 << 30);
    eprintln!("cr-bench coordinator: first round (opens the channels to the agents) ...");
    let (first_round_ms, _) = one_round(&mut admin, n).await?;
    eprintln!("cr-bench coordinator: first round {first_round_ms:.0} ms");
    let mut rounds = Vec::new();
    for r in 0..o.rounds {
        crate::check_interrupted()?;
        let c0 = cpu_secs(coord_pid);
        let (ms, info) = one_round(&mut admin, n).await?;
        let cpu = cpu_secs(coord_pid) - c0;
        eprintln!(
            "cr-bench coordinator: round {}/{}: {ms:.0} ms (coordinator CPU {:.0} ms)",
            r + 1,
            o.rounds,
            cpu * 1e3
        );
        rounds.push((ms, info, cpu));
    }
    // Heartbeats only.
    let idle_s = 3.0;
    let c0 = cpu_secs(coord_pid);
    tokio::time::sleep(Duration::from_secs_f64(idle_s)).await;
    let idle_cpu = (cpu_secs(coord_pid) - c0) / idle_s;
    // No heartbeats once the coordinator stops (nor during the limit).
    for b in beating {
        b.abort();
    }
    Ok(Figures {
        register_s,
        first_round_ms,
        rounds,
        idle_cpu,
        idle_s,
        hwm_kb: status_kb(coord_pid, "VmHWM:"),
        rss_kb: status_kb(coord_pid, "VmRSS:"),
        threads: status_kb(coord_pid, "Threads:"),
        fds: open_fds(coord_pid),
        beats,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn runtime() -> Res<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))
}

/// `cr-bench coordinator-agents --agents N`.
pub fn serve_agents(o: AgentsOpts) -> Res<()> {
    // The coordinator's connections, then (once it is gone) the limit's.
    raise_nofile(o.agents as u64 + 1024)?;
    let rt = runtime()?;
    let port = rt.block_on(async {
        let sock = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
        sock.set_reuseaddr(true).map_err(|e| e.to_string())?;
        sock.bind(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)))
            .map_err(|e| format!("bind: {e}"))?;
        let listener = sock.listen(65535).map_err(|e| format!("listen: {e}"))?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        let svc = AgentServer::new(Sim {
            ring: Arc::new(Ring::new(o.agents)),
            n: o.agents,
        });
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Ok::<_, String>(port)
    })?;
    println!("PORT {port}");
    use std::io::{Read as _, Write as _};
    let _ = std::io::stdout().flush();
    // Serve (on the runtime's threads) until cr-bench closes our stdin.
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    Ok(())
}

/// The agents' server process; killed on drop.
struct AgentsProc {
    child: Child,
    port: u16,
}

impl AgentsProc {
    fn start(n: usize) -> Res<AgentsProc> {
        let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
        let mut child = Command::new(exe)
            .args(["coordinator-agents", "--agents", &n.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cr-bench coordinator-agents: {e}"))?;
        let out = child.stdout.take().ok_or("no stdout")?;
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line)
            .map_err(|e| format!("cr-bench coordinator-agents: {e}"))?;
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .and_then(|p| p.parse().ok());
        let mut p = AgentsProc { child, port: 0 };
        p.port = port.ok_or_else(|| format!("cr-bench coordinator-agents said {line:?}"))?;
        Ok(p)
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for AgentsProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `cr-bench coordinator [--agents N] [--rounds R] [--heartbeat-ms MS]`.
pub fn run(o: Opts) -> Res<()> {
    crate::install_signal_handlers();
    let bin = bin_dir(o.bin_dir.as_deref())?.join("cr-coordinatord");
    require_bins(&[&bin])?;
    // Here: the connections to the coordinator, then the limit's to every
    // agent.
    let nofile = raise_nofile((o.agents + o.agents.div_ceil(o.agents_per_conn)) as u64 + 1024)?;
    let dir = mkdtemp(&o.disk_base.join("cr-bench-coordinator."))?;
    let _guard = DirGuard(dir.clone());
    let agents = AgentsProc::start(o.agents)?;
    let port = free_port()?;
    let mut daemon = start_coordinator(&bin, &dir, port, o.heartbeat_ms)?;
    let rt = runtime()?;
    let res = rt.block_on(bench(&o, daemon.pid(), port, agents.port));
    daemon.stop();
    let agents_fds = open_fds(agents.pid());
    // The limit once the coordinator is gone (its connections closed).
    let limit_s = res
        .as_ref()
        .ok()
        .map(|_| {
            eprintln!(
                "cr-bench coordinator: the limit ({ROUND_FAN_OUTS} fan-outs from one client) ..."
            );
            rt.block_on(limit(o.agents, agents.port))
        })
        .transpose();
    let stream_limit_s = res
        .as_ref()
        .ok()
        .map(|_| {
            eprintln!(
                "cr-bench coordinator: the stream limit ({ROUND_FAN_OUTS} fan-outs on one \
                 stream per agent) ..."
            );
            rt.block_on(stream_limit(o.agents, agents.port))
        })
        .transpose();
    rt.shutdown_timeout(Duration::from_secs(1));
    let f = res.map_err(|e| {
        format!(
            "{e}; coordinator log: {}",
            crate::file_tail(&dir.join("coordinatord.log"), 1500)
        )
    })?;
    let limit_s = limit_s?.unwrap_or_default();
    let stream_limit_s = stream_limit_s?.unwrap_or_default();

    println!("# cr-bench coordinator\n");
    println!(
        "{} simulated agents over gRPC (plain TCP, loopback; agents' server in process {}, \
         {agents_fds} fds), 1 member each, {} connections in a ring, {} agent(s) per \
         connection to the coordinator; {} with heartbeat {} ms; {} rounds after the first; \
         catalog on {} ({}); {} CPUs; load average {}; our fd limit {nofile}.\n",
        o.agents,
        agents.pid(),
        o.agents,
        o.agents_per_conn,
        bin.display(),
        o.heartbeat_ms,
        o.rounds,
        o.disk_base.display(),
        crate::fs_type_name(&dir),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split(' ')
            .take(3)
            .collect::<Vec<_>>()
            .join(" "),
    );
    let limit = median(limit_s.clone()) * 1e3;
    let slimit = median(stream_limit_s.clone()) * 1e3;
    let round = median(f.rounds.iter().map(|r| r.0).collect());
    println!(
        "| agents | register all s | first round ms | round ms (median) | limit ms (4 fan-outs, median) | stream limit ms (median) | round ÷ limit | coordinator CPU ms/round | idle CPU % (heartbeats) | peak RSS MiB | RSS MiB | threads | fds |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} |",
        o.agents,
        f.register_s,
        f.first_round_ms,
        round,
        limit,
        slimit,
        round / limit.max(1e-9),
        median(f.rounds.iter().map(|r| r.2).collect()) * 1e3,
        f.idle_cpu * 100.0,
        f.hwm_kb as f64 / 1024.0,
        f.rss_kb as f64 / 1024.0,
        f.threads,
        f.fds,
    );
    println!("\nAs the coordinator recorded the rounds (ms):\n");
    println!("| checkpoint | round | prepare | check | dump | commit | duration | CPU |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (ms, i, cpu) in &f.rounds {
        println!(
            "| {} | {ms:.0} | {} | {} | {} | {} | {} | {:.0} |",
            i.id,
            i.prepare_ms,
            i.check_ms,
            i.dump_ms,
            i.commit_ms,
            i.duration_ms,
            cpu * 1e3
        );
    }
    println!(
        "\nHeartbeats: {} sent, {} failed, {} answered \"register again\", slowest {:.0} ms, \
         period told up to {} ms; idle CPU over {:.0} s. Limit runs (s): {:?}; stream limit \
         runs (s): {:?}.",
        f.beats.sent.load(Ordering::Relaxed),
        f.beats.failed.load(Ordering::Relaxed),
        f.beats.again.load(Ordering::Relaxed),
        f.beats.slowest_us.load(Ordering::Relaxed) as f64 / 1e3,
        f.beats.period_ms.load(Ordering::Relaxed),
        f.idle_s,
        limit_s,
        stream_limit_s
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{assert_refused, parsed};

    #[test]
    fn command_lines() {
        let o = parsed::<Opts>("coordinator");
        assert_eq!((o.agents, o.rounds, o.heartbeat_ms), (10000, 3, 1000));
        let o = parsed::<Opts>("coordinator --agents 10 --rounds 2 --heartbeat-ms 500");
        assert_eq!((o.agents, o.rounds, o.heartbeat_ms), (10, 2, 500));
        assert_refused(&["coordinator --agents 0", "coordinator --heartbeat-ms 10"]);
    }

    #[test]
    fn agent_addresses() {
        assert_eq!(agent_ip(0).to_string(), "127.10.0.0");
        assert_eq!(agent_ip(9999).to_string(), "127.10.39.15");
        assert_eq!(agent_ip(70000).to_string(), "127.11.17.112");
    }
}
