//! A cluster in network namespaces, for the tests of `cr-agent`,
//! `cr-coordinatord` and `crctl` (docs/CLUSTER.md), and ring jobs on it.
//!
//! Topology (every namespace is created by the [`Cluster`] and deleted when
//! it is dropped; nothing is configured outside them, so concurrent tests can
//! all use the same addresses):
//!
//! ```text
//!   n1 10.99.0.1/24 ─┐
//!   n2 10.99.0.2/24 ─┤ br0 in the "switch" namespace
//!   n3 10.99.0.3/24 ─┤
//!   coordinator 10.99.0.254/24 ─┘
//! ```
//!
//! Each namespace reaches the bridge through a veth pair (`eth0` inside,
//! `pK` / `pc` on the bridge). A node is more than its network namespace:
//! it has its own UTS namespace (host name `nK`) and mount namespace (its
//! own /dev/shm, and a private tmpfs on `DIR/node-nK`, [`Cluster::node_root`],
//! that no other node sees; node names resolve through its /etc/hosts),
//! held by a process per node ([`NodeNs`]).
//! Everything of node K is started with `nsenter -t HOLDER -n -u -m -- PROG
//! ...`; the coordinator's namespace is a network namespace only
//! (`nsenter --net=/run/netns/NAME`). Apart from `DIR/node-nK`, the nodes
//! share the test's file system, which stands for the storage the nodes
//! share. Certificates come from `crctl pki` in `DIR/pki` (`ca`,
//! `n1`..`nK`, `cr-coordinatord`, `admin`).
//!
//! The coordinator and the agents log to files in the harness directory
//! (`coordinator.log`, `agent-nK.log`, appended to across restarts); their
//! tails are part of every panic message of [`Cluster::diag`] and
//! [`Ring::diag`]. Every process started is a [`Proc`], killed by PID and
//! reaped on drop; when the cluster is dropped, whatever still runs in its
//! namespaces (processes the agents restored) is killed by PID too, then the
//! namespaces are deleted.
//!
//! A [`Ring`] is a job of `wl_ring` members (see `src/bin/wl_ring.rs`),
//! member i on node placement\[i\], listening on `10.99.0.K:(7300+i)` and
//! connected to member i+1: every member checks every message it gets and
//! reports in a status file, which the ring's waits read.
//!
//! Every wait has a deadline (no fixed sleeps); polls of `crctl` are spaced
//! by [`POLL_PERIOD`].

use crate::netns::Netns;
use crate::node::NodeNs;
use crate::{
    describe, is_alive, isolate_fds, read_text, reap_orphans, status_str, tail, tool_path,
    wait_until, workload_path, Harness, Proc, ToolOutput, Workload,
};
use serde_json::Value;
use std::cell::{Cell, RefCell};
use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The first three octets of every address of the cluster.
pub const SUBNET: &str = "10.99.0";
/// The coordinator's address (in its own namespace).
pub const COORDINATOR_IP: &str = "10.99.0.254";
/// The coordinator's port.
pub const COORDINATOR_PORT: u16 = 7170;
/// The port of every agent's Agent service.
pub const AGENT_PORT: u16 = 7171;
/// Ring member i listens on this port + i.
pub const RING_PORT_BASE: u16 = 7300;
/// Deadline for a daemon to answer / register.
pub const DAEMON_TIMEOUT: Duration = Duration::from_secs(30);
/// Deadline for one crctl command.
pub const CRCTL_TIMEOUT: Duration = Duration::from_secs(90);
/// Deadline for a ring to be up and for it to advance.
pub const RING_TIMEOUT: Duration = Duration::from_secs(20);
/// Name of the administrator's certificate crctl uses.
pub const ADMIN: &str = "admin";
/// Time between two polls that run a command (crctl).
pub const POLL_PERIOD: Duration = Duration::from_millis(200);

/// IP address of node `k` (1-based).
pub fn node_ip(k: usize) -> String {
    format!("{SUBNET}.{k}")
}

/// Name of node `k` (1-based): `nK`.
pub fn node_name(k: usize) -> String {
    format!("n{k}")
}

/// nsenter(1) (util-linux).
pub fn nsenter() -> PathBuf {
    for p in ["/usr/bin/nsenter", "/bin/nsenter", "/usr/sbin/nsenter"] {
        if Path::new(p).is_file() {
            return PathBuf::from(p);
        }
    }
    panic!("nsenter not found (install util-linux)");
}

/// The inode of a network namespace file (`/run/netns/NAME` or
/// `/proc/PID/ns/net`): equal inodes, same namespace.
pub fn netns_inode(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok().map(|m| m.ino())
}

/// The network namespace (inode) of a process.
pub fn proc_netns(pid: i32) -> Option<u64> {
    let link = std::fs::read_link(format!("/proc/{pid}/ns/net")).ok()?;
    let s = link.to_string_lossy();
    s.strip_prefix("net:[")?.strip_suffix(']')?.parse().ok()
}

/// Like `wait_until`, but evaluates `cond` at most once per `period` (for
/// conditions that run a command).
pub fn poll_until(
    what: &str,
    timeout: Duration,
    period: Duration,
    mut cond: impl FnMut() -> bool,
    diag: impl Fn() -> String,
) {
    let mut last: Option<Instant> = None;
    wait_until(
        what,
        timeout,
        || {
            if last.is_some_and(|t| t.elapsed() < period) {
                return false;
            }
            last = Some(Instant::now());
            cond()
        },
        diag,
    );
}

// ---------------------------------------------------------------------------
// JSON of crctl --json
// ---------------------------------------------------------------------------

fn camel(key: &str) -> String {
    let mut out = String::new();
    let mut up = false;
    for ch in key.chars() {
        if ch == '_' {
            up = true;
        } else if up {
            out.extend(ch.to_uppercase());
            up = false;
        } else {
            out.push(ch);
        }
    }
    out
}

/// Field `key` of a JSON object, under its proto name (`pause_ms`) or its
/// proto3 JSON name (`pauseMs`).
pub fn jget<'v>(v: &'v Value, key: &str) -> Option<&'v Value> {
    v.get(key).or_else(|| v.get(camel(key)))
}

/// A number field (also accepted as a string, as proto3 JSON writes 64-bit
/// integers); 0 if absent (proto3 omits zero values).
pub fn ju64(v: &Value, key: &str) -> u64 {
    match jget(v, key) {
        Some(Value::Number(n)) => n
            .as_u64()
            .or_else(|| n.as_f64().map(|f| f as u64))
            .unwrap_or(0),
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        _ => 0,
    }
}

/// A string field; "" if absent.
pub fn jstr(v: &Value, key: &str) -> String {
    match jget(v, key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    }
}

/// A list field; a JSON document that is itself a list is that list.
pub fn jlist<'v>(v: &'v Value, key: &str) -> Vec<&'v Value> {
    if let Value::Array(a) = v {
        return a.iter().collect();
    }
    match jget(v, key) {
        Some(Value::Array(a)) => a.iter().collect(),
        _ => Vec::new(),
    }
}

// ---------------------------------------------------------------------------
// Processes in a namespace
// ---------------------------------------------------------------------------

/// A daemon: its process and its log file.
pub struct Daemon {
    pub proc: Proc,
    pub log: PathBuf,
}

/// A process started by [`Cluster::spawn_in`], with its output files.
pub struct Spawned {
    pub proc: Proc,
    pub cmdline: String,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
}

impl Spawned {
    /// Command line, exit status (if any) and output tails.
    pub fn diag(&mut self) -> String {
        let st = match self.proc.try_exit() {
            Some(s) => status_str(s),
            None => format!("running: {}", describe(self.proc.pid)),
        };
        format!(
            "--- {} ({st})\n--- stdout:\n{}\n--- stderr:\n{}",
            self.cmdline,
            tail(&read_text(&self.stdout), 20),
            tail(&read_text(&self.stderr), 20)
        )
    }

    /// Like `diag`, without reaping: the process as /proc shows it.
    pub fn describe(&self) -> String {
        format!(
            "--- {} ({})\n--- stdout:\n{}\n--- stderr:\n{}",
            self.cmdline,
            describe(self.proc.pid),
            tail(&read_text(&self.stdout), 20),
            tail(&read_text(&self.stderr), 20)
        )
    }

    /// Waits for the process to exit (panics after `timeout` with `more()`)
    /// and returns its result.
    pub fn wait(&mut self, timeout: Duration, more: impl Fn() -> String) -> ToolOutput {
        let t0 = Instant::now();
        let (cmdline, out, err) = (
            self.cmdline.clone(),
            self.stdout.clone(),
            self.stderr.clone(),
        );
        let st = self
            .proc
            .wait_exit(timeout, || {
                format!(
                    "--- {cmdline}\n--- stdout:\n{}\n--- stderr:\n{}\n{}",
                    read_text(&out),
                    read_text(&err),
                    more()
                )
            })
            .expect("a process we spawned is our child");
        ToolOutput {
            cmdline: self.cmdline.clone(),
            status: st,
            stdout: read_text(&self.stdout),
            stderr: read_text(&self.stderr),
            elapsed: t0.elapsed(),
            max_rss_kib: self.proc.max_rss_kib,
        }
    }
}

/// How an agent is started.
#[derive(Default, Clone)]
pub struct AgentOpts {
    /// Extra environment (e.g. `CR_AGENT_FAULT`).
    pub env: Vec<(String, String)>,
    /// Take the CA and the node's certificate and key from this `crctl pki`
    /// directory instead of the cluster's.
    pub pki: Option<PathBuf>,
    /// Use this CA certificate (whatever `pki` says).
    pub ca: Option<PathBuf>,
    /// No `--coordinator`: a standalone node. Then it is ready once its
    /// socket exists.
    pub standalone: bool,
    /// Do not wait for it to be ready.
    pub no_wait: bool,
    /// Its image root (default: [`Cluster::images`], shared by all nodes).
    pub images: Option<PathBuf>,
    /// More flags (e.g. `--health-check CMD`).
    pub args: Vec<String>,
}

/// A cluster of `nodes` nodes and a coordinator in network namespaces (see
/// the module docs). Methods take `&self`, so that a [`Ring`] can hold the
/// cluster while agents are killed and started.
pub struct Cluster<'h> {
    pub h: &'h Harness,
    /// The harness directory: pki, logs, images, sockets, rings.
    pub dir: PathBuf,
    pub pki: PathBuf,
    pub nodes: usize,
    seq: Cell<u32>,
    // Processes are declared before the namespaces, so they are dropped first.
    coordinator: RefCell<Option<Daemon>>,
    agents: RefCell<Vec<Option<Daemon>>>,
    /// The UTS and mount namespaces of node k are `node_holders[k - 1]`
    /// (dropped before the network namespaces).
    pub node_holders: Vec<NodeNs>,
    /// Node k is `node_ns[k - 1]`.
    pub node_ns: Vec<Netns>,
    pub coord_ns: Netns,
    pub switch: Netns,
}

/// Joins `ns` to the bridge of `sw` (`eth0` in ns, `port` on the bridge)
/// with address `cidr`.
fn attach(sw: &Netns, ns: &Netns, port: &str, cidr: &str) {
    ns.ip(&["link", "add", "eth0", "type", "veth", "peer", "name", port]);
    ns.ip(&["link", "set", port, "netns", &sw.name]);
    sw.ip(&["link", "set", port, "master", "br0"]);
    sw.ip(&["link", "set", port, "up"]);
    ns.add_addr("eth0", cidr);
}

impl<'h> Cluster<'h> {
    /// The namespaces, the bridge and the certificates; no daemon yet.
    pub fn new(h: &'h Harness, nodes: usize) -> Cluster<'h> {
        let c = Cluster::network_only(h, nodes);
        let mut names: Vec<(String, Option<String>)> = (1..=nodes)
            .map(|k| (node_name(k), Some(node_ip(k))))
            .collect();
        names.push(("cr-coordinatord".into(), Some(COORDINATOR_IP.into())));
        names.push(("admin".into(), None));
        c.make_pki(&c.pki, &names);
        c
    }

    /// The namespaces and the bridge only (no certificates: crctl is not
    /// needed), e.g. for rings started directly.
    pub fn network_only(h: &'h Harness, nodes: usize) -> Cluster<'h> {
        assert!(
            (1..=250).contains(&nodes),
            "a cluster has 1 to 250 nodes, not {nodes}"
        );
        let switch = Netns::new("sw");
        switch.ip(&["link", "add", "br0", "type", "bridge"]);
        switch.ip(&["link", "set", "br0", "up"]);
        let coord_ns = Netns::new("coord");
        attach(&switch, &coord_ns, "pc", &format!("{COORDINATOR_IP}/24"));
        let mut node_ns = Vec::new();
        for k in 1..=nodes {
            let ns = Netns::new(&node_name(k));
            attach(
                &switch,
                &ns,
                &format!("p{k}"),
                &format!("{}/24", node_ip(k)),
            );
            node_ns.push(ns);
        }
        let dir = h.dir.clone();
        for d in ["images", "cmds"] {
            std::fs::create_dir_all(dir.join(d)).expect("mkdir in the harness dir");
        }
        // Node names (and the coordinator's) resolve on every node.
        let hosts = dir.join("hosts");
        let mut text = std::fs::read_to_string("/etc/hosts").unwrap_or_default();
        text.push_str("\n# the test cluster\n");
        for k in 1..=nodes {
            text.push_str(&format!("{} {}\n", node_ip(k), node_name(k)));
        }
        text.push_str(&format!("{COORDINATOR_IP} cr-coordinatord\n"));
        std::fs::write(&hosts, text).expect("write the cluster's hosts file");
        // After every network namespace exists (a holder does not see
        // /run/netns entries made later; it needs none).
        let node_holders = (1..=nodes)
            .map(|k| {
                let name = node_name(k);
                NodeNs::new(
                    &node_ns[k - 1].path(),
                    &name,
                    &dir.join(format!("node-{name}")),
                    &hosts,
                    &dir.join(format!("holder-{name}.log")),
                )
            })
            .collect();
        Cluster {
            h,
            pki: dir.join("pki"),
            dir,
            nodes,
            seq: Cell::new(0),
            coordinator: RefCell::new(None),
            agents: RefCell::new((0..nodes).map(|_| None).collect()),
            node_holders,
            node_ns,
            coord_ns,
            switch,
        }
    }

    /// `crctl pki init --dir DIR` and `crctl pki issue --dir DIR --name N
    /// [--ip IP]` for each name (a second, unrelated CA if DIR is not the
    /// cluster's).
    pub fn make_pki(&self, dir: &Path, names: &[(String, Option<String>)]) {
        let d = dir.to_string_lossy().into_owned();
        self.crctl_local(&["pki", "init", "--dir", &d])
            .assert_success("crctl pki init");
        for (name, ip) in names {
            let mut args = vec!["pki", "issue", "--dir", &d, "--name", name];
            if let Some(ip) = ip {
                args.extend(["--ip", ip.as_str()]);
            }
            // crctl's certificate is an administrator's.
            if name == ADMIN {
                args.push("--admin");
            }
            self.crctl_local(&args).assert_success("crctl pki issue");
            for ext in ["crt", "key"] {
                let f = dir.join(format!("{name}.{ext}"));
                assert!(
                    f.is_file(),
                    "crctl pki issue --name {name} should write {}",
                    f.display()
                );
            }
        }
    }

    /// The network namespace of node `k` (1-based).
    pub fn ns(&self, k: usize) -> &Netns {
        assert!((1..=self.nodes).contains(&k), "no node {k}");
        &self.node_ns[k - 1]
    }

    /// The UTS and mount namespaces of node `k` (1-based).
    pub fn node(&self, k: usize) -> &NodeNs {
        assert!((1..=self.nodes).contains(&k), "no node {k}");
        &self.node_holders[k - 1]
    }

    /// Node `k`'s private directory: a tmpfs of its own mount namespace
    /// (e.g. a node-local image root); empty seen from anywhere else.
    pub fn node_root(&self, k: usize) -> PathBuf {
        self.node(k).root.clone()
    }

    /// The inode of node `k`'s network namespace.
    pub fn ns_inode(&self, k: usize) -> u64 {
        netns_inode(&self.ns(k).path()).expect("node namespace exists")
    }

    /// The node (1-based) whose namespace process `pid` is in, if any.
    pub fn node_of(&self, pid: i32) -> Option<usize> {
        let ino = proc_netns(pid)?;
        (1..=self.nodes).find(|&k| self.ns_inode(k) == ino)
    }

    /// The agent's Unix socket of node `k`.
    pub fn socket(&self, k: usize) -> PathBuf {
        self.dir.join(format!("{}.sock", node_name(k)))
    }

    /// The shared image root.
    pub fn images(&self) -> PathBuf {
        self.dir.join("images")
    }

    /// Node `k`'s local image root: in its private tmpfs (see
    /// [`Cluster::node_root`]), which no other node can read.
    pub fn local_images(&self, k: usize) -> PathBuf {
        self.node_root(k).join("images")
    }

    /// Starts the agents of `ks`, each with its local image root
    /// ([`Cluster::local_images`]) and `env`, and waits until they are up.
    pub fn start_agents_local(&self, ks: &[usize], env: &[(String, String)]) {
        for &k in ks {
            self.start_agent_with(
                k,
                &AgentOpts {
                    env: env.to_vec(),
                    images: Some(self.local_images(k)),
                    no_wait: true,
                    ..Default::default()
                },
            );
        }
        self.wait_nodes_up(ks);
    }

    /// The agent log of node `k`.
    pub fn agent_log(&self, k: usize) -> PathBuf {
        self.dir.join(format!("agent-{}.log", node_name(k)))
    }

    /// The coordinator's log.
    pub fn coordinator_log(&self) -> PathBuf {
        self.dir.join("coordinator.log")
    }

    fn next_seq(&self) -> u32 {
        let n = self.seq.get() + 1;
        self.seq.set(n);
        n
    }

    /// Starts `exe ARGS...` in namespace `ns` (through nsenter, into all
    /// the namespaces of a node if `ns` is a node's; None: here)
    /// with `env`, stdin /dev/null, stdout and stderr appended to the files
    /// of `output` (the same file twice is fine).
    pub fn spawn_in(
        &self,
        ns: Option<&Netns>,
        label: &str,
        exe: &Path,
        args: &[OsString],
        env: &[(String, String)],
        output: (&Path, &Path),
    ) -> Spawned {
        let (stdout, stderr) = output;
        let mut cmd;
        let mut cmdline = String::new();
        for (k, v) in env {
            cmdline.push_str(&format!("{k}={v} "));
        }
        match ns {
            Some(ns) => {
                let args = match self.node_ns.iter().position(|n| n.name == ns.name) {
                    Some(i) => self.node_holders[i].nsenter_args(&self.dir),
                    None => vec![format!("--net={}", ns.path().display()).into()],
                };
                cmd = Command::new(nsenter());
                cmd.args(&args).arg("--").arg(exe);
                cmdline.push_str("nsenter ");
                for a in &args {
                    cmdline.push_str(&a.to_string_lossy());
                    cmdline.push(' ');
                }
                cmdline.push_str("-- ");
            }
            None => cmd = Command::new(exe),
        }
        cmd.args(args);
        cmdline.push_str(&exe.display().to_string());
        for a in args {
            cmdline.push(' ');
            cmdline.push_str(&a.to_string_lossy());
        }
        let open = |p: &Path| {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .unwrap_or_else(|e| panic!("open {}: {e}", p.display()))
        };
        let out = open(stdout);
        let err = if stderr == stdout {
            out.try_clone().expect("dup an output file")
        } else {
            open(stderr)
        };
        cmd.stdin(File::open("/dev/null").expect("open /dev/null"))
            .stdout(out)
            .stderr(err)
            .current_dir(&self.dir);
        for (k, v) in env {
            cmd.env(k, v);
        }
        isolate_fds(&mut cmd, &[]);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmdline}: {e}"));
        Spawned {
            proc: Proc::from_child(child, label),
            cmdline,
            stdout: stdout.to_path_buf(),
            stderr: stderr.to_path_buf(),
        }
    }

    /// Appends a marked line to a log (who started what, when).
    fn log_mark(&self, log: &Path, what: &str) {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        if let Ok(mut f) = OpenOptions::new().create(true).append(true).open(log) {
            let _ = writeln!(f, "===== [test harness, unix time {secs:.3}] {what}");
        }
    }

    fn daemon_env(&self, extra: &[(String, String)]) -> Vec<(String, String)> {
        let level = std::env::var("CR_LOG").unwrap_or_else(|_| {
            "info,cr_agent=debug,cr_coordinatord=debug,cr_restart=debug,cr_rpc=debug,\
             cr_image=debug,cr_sys=debug"
                .into()
        });
        let mut env = vec![("CR_LOG".to_string(), level)];
        env.extend(extra.iter().cloned());
        env
    }

    // -----------------------------------------------------------------------
    // The coordinator
    // -----------------------------------------------------------------------

    /// Starts cr-coordinatord on `10.99.0.254:7170` with `DIR/coord.redb`
    /// (kept across restarts) and waits until `crctl status` answers.
    pub fn start_coordinator(&self) {
        self.start_coordinator_with(&[], &[]);
    }

    /// [`Cluster::start_coordinator`] with extra environment (e.g.
    /// `CR_COORD_FAULT`) and flags.
    pub fn start_coordinator_with(&self, env: &[(String, String)], extra: &[&str]) {
        assert!(
            self.coordinator.borrow().is_none(),
            "the coordinator is already running"
        );
        let p = |n: &str| self.pki.join(n).into_os_string();
        let args: Vec<OsString> = vec![
            "--listen".into(),
            format!("{COORDINATOR_IP}:{COORDINATOR_PORT}").into(),
            "--db".into(),
            self.dir.join("coord.redb").into_os_string(),
            "--ca".into(),
            p("ca.crt"),
            "--cert".into(),
            p("cr-coordinatord.crt"),
            "--key".into(),
            p("cr-coordinatord.key"),
        ];
        let mut args = args;
        args.extend(extra.iter().map(OsString::from));
        let log = self.coordinator_log();
        self.log_mark(&log, "starting cr-coordinatord");
        let sp = self.spawn_in(
            Some(&self.coord_ns),
            "cr-coordinatord",
            &tool_path("cr-coordinatord"),
            &args,
            &self.daemon_env(env),
            (&log, &log),
        );
        *self.coordinator.borrow_mut() = Some(Daemon { proc: sp.proc, log });
        poll_until(
            "cr-coordinatord to answer `crctl status`",
            DAEMON_TIMEOUT,
            POLL_PERIOD,
            || {
                self.check_coordinator_alive("while waiting for it to answer");
                self.crctl_poll(&["status"]).status.success()
            },
            || self.diag(),
        );
    }

    fn check_coordinator_alive(&self, ctx: &str) {
        let mut c = self.coordinator.borrow_mut();
        if let Some(d) = c.as_mut() {
            if let Some(st) = d.proc.try_exit() {
                drop(c);
                panic!(
                    "cr-coordinatord exited ({}) {ctx}\n{}",
                    status_str(st),
                    self.diag()
                );
            }
        }
    }

    /// The running coordinator, no longer the cluster's to stop.
    fn take_coordinator(&self) -> Daemon {
        self.coordinator
            .borrow_mut()
            .take()
            .expect("the coordinator is not running")
    }

    /// SIGKILLs the coordinator (by PID) and reaps it.
    pub fn kill_coordinator(&self) {
        let d = self.take_coordinator();
        let mut proc = d.proc;
        proc.kill_and_reap();
        assert!(
            proc.has_exited(),
            "cr-coordinatord did not die: {}",
            describe(proc.pid)
        );
        self.log_mark(&d.log, "cr-coordinatord killed (SIGKILL)");
    }

    /// Stops the coordinator as an operator would (SIGTERM) and waits until
    /// it exited; its exit status.
    pub fn stop_coordinator(&self) -> Option<std::process::ExitStatus> {
        let d = self.take_coordinator();
        let mut proc = d.proc;
        proc.signal(libc::SIGTERM);
        let st = proc.wait_exit(DAEMON_TIMEOUT, || self.diag());
        self.log_mark(&d.log, "cr-coordinatord stopped (SIGTERM)");
        st
    }

    /// Cuts node `k` off the bridge (`ip link set eth0 down` in its
    /// namespace): its agent and members reach nobody, nobody reaches them.
    pub fn cut_link(&self, k: usize) {
        self.ns(k).ip(&["link", "set", "eth0", "down"]);
    }

    /// Joins node `k` to the bridge again (and its route to the subnet).
    pub fn restore_link(&self, k: usize) {
        self.ns(k).ip(&["link", "set", "eth0", "up"]);
    }

    /// Limits what every node sends to `mbit` Mbit/s (a token bucket,
    /// `tc qdisc ... tbf`, on each node's `eth0`): the cluster's links then
    /// behave like a real network's, slower than this machine's CPUs copy.
    pub fn shape_links(&self, mbit: u32) {
        // The bucket must hold at least one GSO packet (64 KiB) and what
        // the rate sends in a timer tick (4 ms at HZ=250).
        let burst = (u64::from(mbit) * 1_000_000 / 8 / 250).max(256 << 10);
        for k in 1..=self.nodes {
            let ns = &self.ns(k).name;
            let (rate, burst) = (format!("{mbit}mbit"), burst.to_string());
            let args = [
                "-n", ns, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", &rate, "burst",
                &burst, "latency", "50ms",
            ];
            let out = Command::new("tc")
                .args(args)
                .stdin(Stdio::null())
                .output()
                .expect("run tc");
            assert!(
                out.status.success(),
                "tc {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// The nft tables of node `k`'s namespace (`inet NAME` lines' names).
    pub fn nft_tables(&self, k: usize) -> Vec<String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns(k).name, "nft", "list", "tables"])
            .stdin(Stdio::null())
            .output()
            .expect("run nft list tables");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().strip_prefix("table "))
            .map(|t| t.split_whitespace().last().unwrap_or("").to_string())
            .collect()
    }

    /// The coordinator's PID, if it runs.
    pub fn coordinator_pid(&self) -> Option<i32> {
        self.coordinator.borrow().as_ref().map(|d| d.proc.pid)
    }

    // -----------------------------------------------------------------------
    // Agents
    // -----------------------------------------------------------------------

    /// Starts the agent of node `k` and waits until `crctl nodes` shows it up.
    pub fn start_agent(&self, k: usize) {
        self.start_agent_with(k, &AgentOpts::default());
    }

    /// Starts the agents of `ks`, then waits until all are up.
    pub fn start_agents(&self, ks: &[usize]) {
        let o = AgentOpts {
            no_wait: true,
            ..Default::default()
        };
        for &k in ks {
            self.start_agent_with(k, &o);
        }
        self.wait_nodes_up(ks);
    }

    /// Starts the agent of node `k` as `o` says:
    /// `cr-agent --node nK --listen 10.99.0.K:7171 --socket DIR/nK.sock
    /// --coordinator 10.99.0.254:7170 --images DIR/images --state-dir
    /// DIR/state-nK --ca --cert --key`.
    pub fn start_agent_with(&self, k: usize, o: &AgentOpts) {
        let node = node_name(k);
        assert!(
            self.agents.borrow()[k - 1].is_none(),
            "the agent of {node} is already running"
        );
        let pki = o.pki.clone().unwrap_or_else(|| self.pki.clone());
        let state = self.dir.join(format!("state-{node}"));
        let mut args: Vec<OsString> = vec![
            "--node".into(),
            node.clone().into(),
            "--listen".into(),
            format!("{}:{AGENT_PORT}", node_ip(k)).into(),
            "--socket".into(),
            self.socket(k).into_os_string(),
            "--images".into(),
            o.images
                .clone()
                .unwrap_or_else(|| self.images())
                .into_os_string(),
            "--state-dir".into(),
            state.into_os_string(),
            "--ca".into(),
            o.ca.clone()
                .unwrap_or_else(|| pki.join("ca.crt"))
                .into_os_string(),
            "--cert".into(),
            pki.join(format!("{node}.crt")).into_os_string(),
            "--key".into(),
            pki.join(format!("{node}.key")).into_os_string(),
        ];
        if !o.standalone {
            args.push("--coordinator".into());
            args.push(format!("{COORDINATOR_IP}:{COORDINATOR_PORT}").into());
        }
        args.extend(o.args.iter().map(OsString::from));
        let log = self.agent_log(k);
        let started_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.log_mark(
            &log,
            &format!("starting cr-agent of {node} (extra env {:?})", o.env),
        );
        let sp = self.spawn_in(
            Some(self.ns(k)),
            &format!("cr-agent {node}"),
            &tool_path("cr-agent"),
            &args,
            &self.daemon_env(&o.env),
            (&log, &log),
        );
        self.agents.borrow_mut()[k - 1] = Some(Daemon { proc: sp.proc, log });
        if o.no_wait {
            return;
        }
        if o.standalone {
            let sock = self.socket(k);
            wait_until(
                &format!(
                    "the standalone agent of {node} to create {}",
                    sock.display()
                ),
                DAEMON_TIMEOUT,
                || {
                    self.check_agent_alive(k, "while waiting for its socket");
                    sock.exists()
                },
                || self.diag(),
            );
        } else {
            self.wait_nodes_up(&[k]);
            // A node restarted quickly may still be "up" from its previous
            // agent's heartbeats: wait until this agent was heard from.
            poll_until(
                &format!("the new agent of {node} to register"),
                DAEMON_TIMEOUT,
                POLL_PERIOD,
                || {
                    self.check_agent_alive(k, "before registering");
                    let out = self.crctl_poll(&["--json", "nodes"]);
                    serde_json::from_str::<Value>(&out.stdout).is_ok_and(|v| {
                        jlist(&v, "nodes").into_iter().any(|n| {
                            jstr(n, "name") == node && ju64(n, "last_seen_unix_ms") >= started_ms
                        })
                    })
                },
                || self.diag(),
            );
        }
    }

    fn check_agent_alive(&self, k: usize, ctx: &str) {
        let mut a = self.agents.borrow_mut();
        if let Some(d) = a[k - 1].as_mut() {
            if let Some(st) = d.proc.try_exit() {
                drop(a);
                panic!(
                    "the agent of {} exited ({}) {ctx}\n{}",
                    node_name(k),
                    status_str(st),
                    self.diag()
                );
            }
        }
    }

    /// True if the agent of node `k` was started and has not exited.
    pub fn agent_running(&self, k: usize) -> bool {
        self.agents.borrow_mut()[k - 1]
            .as_mut()
            .is_some_and(|d| !d.proc.has_exited())
    }

    /// The PID of the agent of node `k`, if started.
    pub fn agent_pid(&self, k: usize) -> Option<i32> {
        self.agents.borrow()[k - 1].as_ref().map(|d| d.proc.pid)
    }

    /// SIGKILLs the agent of node `k` (by PID) and reaps it.
    pub fn kill_agent(&self, k: usize) {
        let d = self.agents.borrow_mut()[k - 1]
            .take()
            .unwrap_or_else(|| panic!("the agent of {} is not running", node_name(k)));
        let mut proc = d.proc;
        proc.kill_and_reap();
        assert!(
            proc.has_exited(),
            "the agent of {} did not die: {}",
            node_name(k),
            describe(proc.pid)
        );
        self.log_mark(&d.log, "cr-agent killed (SIGKILL)");
    }

    /// `crctl nodes --json`: (name, state, members) of every node.
    pub fn nodes_status(&self) -> Vec<(String, String, u64)> {
        let v = self.crctl_json(&["nodes"]);
        jlist(&v, "nodes")
            .into_iter()
            .map(|n| (jstr(n, "name"), jstr(n, "state"), ju64(n, "members")))
            .collect()
    }

    /// Polls `crctl nodes --json` until every node of `ks` is `up` (panics
    /// at once if one of their agents exits).
    pub fn wait_nodes_up(&self, ks: &[usize]) {
        self.wait_nodes(&format!("nodes {ks:?} up in `crctl nodes`"), |nodes| {
            for &k in ks {
                self.check_agent_alive(k, "before registering");
            }
            ks.iter().all(|&k| {
                nodes
                    .iter()
                    .any(|(n, st, _)| *n == node_name(k) && st == "up")
            })
        });
    }

    /// Polls `crctl nodes --json` until `pred` holds for its list of (name,
    /// state, members).
    pub fn wait_nodes(&self, what: &str, mut pred: impl FnMut(&[(String, String, u64)]) -> bool) {
        let last = RefCell::new(String::new());
        poll_until(
            what,
            DAEMON_TIMEOUT,
            POLL_PERIOD,
            || {
                self.check_coordinator_alive("while polling crctl nodes");
                let out = self.crctl_poll(&["--json", "nodes"]);
                *last.borrow_mut() = out.show();
                if !out.status.success() {
                    return false;
                }
                let Ok(v) = serde_json::from_str::<Value>(&out.stdout) else {
                    return false;
                };
                let nodes: Vec<(String, String, u64)> = jlist(&v, "nodes")
                    .into_iter()
                    .map(|n| (jstr(n, "name"), jstr(n, "state"), ju64(n, "members")))
                    .collect();
                pred(&nodes)
            },
            || format!("--- last crctl nodes:\n{}\n{}", last.borrow(), self.diag()),
        );
    }

    // -----------------------------------------------------------------------
    // crctl and cr_run
    // -----------------------------------------------------------------------

    fn crctl_args(&self, args: &[&str]) -> Vec<OsString> {
        self.crctl_args_as(ADMIN, args)
    }

    fn crctl_args_as(&self, cert: &str, args: &[&str]) -> Vec<OsString> {
        let p = |n: &str| self.pki.join(n).into_os_string();
        let mut v: Vec<OsString> = vec![
            "--coordinator".into(),
            format!("{COORDINATOR_IP}:{COORDINATOR_PORT}").into(),
            "--ca".into(),
            p("ca.crt"),
            "--cert".into(),
            p(&format!("{cert}.crt")),
            "--key".into(),
            p(&format!("{cert}.key")),
        ];
        v.extend(args.iter().map(OsString::from));
        v
    }

    fn run_to_end(
        &self,
        ns: Option<&Netns>,
        name: &str,
        exe: &Path,
        args: &[OsString],
    ) -> ToolOutput {
        self.run_env(ns, name, exe, args, &[])
    }

    /// `exe ARGS...` with extra environment `env`, run to completion in
    /// namespace `ns` (see [`Cluster::spawn_in`]), output in
    /// `DIR/cmds/NNNN-NAME.{out,err}`.
    pub fn run_env(
        &self,
        ns: Option<&Netns>,
        name: &str,
        exe: &Path,
        args: &[OsString],
        env: &[(String, String)],
    ) -> ToolOutput {
        let n = self.next_seq();
        let base = self.dir.join("cmds").join(format!("{n:04}-{name}"));
        self.run_files(ns, exe, args, env, &base)
    }

    fn run_files(
        &self,
        ns: Option<&Netns>,
        exe: &Path,
        args: &[OsString],
        env: &[(String, String)],
        base: &Path,
    ) -> ToolOutput {
        let out = base.with_extension("out");
        let err = base.with_extension("err");
        let _ = std::fs::remove_file(&out);
        let _ = std::fs::remove_file(&err);
        let label = exe
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut sp = self.spawn_in(ns, &label, exe, args, env, (&out, &err));
        sp.wait(CRCTL_TIMEOUT, || self.diag())
    }

    /// `ARGV...` run to completion on node `k` (all its namespaces).
    pub fn run_on(&self, k: usize, argv: &[&str]) -> ToolOutput {
        let (exe, rest) = argv.split_first().expect("a command");
        let args: Vec<OsString> = rest.iter().map(OsString::from).collect();
        let name = Path::new(exe)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        self.run_to_end(
            Some(self.ns(k)),
            &format!("{}-{name}", node_name(k)),
            Path::new(exe),
            &args,
        )
    }

    /// `crctl ARGS...` (with the cluster's admin certificate, in the
    /// coordinator's namespace), run to completion.
    pub fn crctl(&self, args: &[&str]) -> ToolOutput {
        let word = args
            .iter()
            .find(|a| !a.starts_with('-'))
            .copied()
            .unwrap_or("crctl");
        self.run_to_end(
            Some(&self.coord_ns),
            &format!("crctl-{word}"),
            &tool_path("crctl"),
            &self.crctl_args(args),
        )
    }

    /// `crctl ARGS...` with the certificate `cert` of the cluster's pki
    /// (e.g. a node's) instead of the administrator's.
    pub fn crctl_as(&self, cert: &str, args: &[&str]) -> ToolOutput {
        self.run_to_end(
            Some(&self.coord_ns),
            &format!("crctl-as-{cert}"),
            &tool_path("crctl"),
            &self.crctl_args_as(cert, args),
        )
    }

    /// `crctl ARGS...` exactly as given (no address, no certificate added),
    /// in the coordinator's namespace.
    pub fn crctl_raw(&self, args: &[&str]) -> ToolOutput {
        let a: Vec<OsString> = args.iter().map(OsString::from).collect();
        self.run_to_end(Some(&self.coord_ns), "crctl-raw", &tool_path("crctl"), &a)
    }

    /// `crctl ARGS...` for polls (its output files are reused).
    fn crctl_poll(&self, args: &[&str]) -> ToolOutput {
        self.run_files(
            Some(&self.coord_ns),
            &tool_path("crctl"),
            &self.crctl_args(args),
            &[],
            &self.dir.join("cmds").join("poll"),
        )
    }

    /// `crctl --json ARGS...`: asserts it succeeds, returns the document.
    pub fn crctl_json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.crctl(&all);
        if !out.status.success() {
            panic!("crctl failed\n{}\n{}", out.show(), self.diag());
        }
        serde_json::from_str(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "crctl --json printed no JSON document ({e})\n{}\n{}",
                out.show(),
                self.diag()
            )
        })
    }

    /// `crctl ARGS...` in the background.
    pub fn crctl_bg(&self, args: &[&str]) -> Spawned {
        let n = self.next_seq();
        let base = self.dir.join("cmds").join(format!("{n:04}-crctl-bg"));
        let (out, err) = (base.with_extension("out"), base.with_extension("err"));
        self.spawn_in(
            Some(&self.coord_ns),
            "crctl (background)",
            &tool_path("crctl"),
            &self.crctl_args(args),
            &[],
            (&out, &err),
        )
    }

    /// `crctl ARGS...` outside any namespace and without certificates
    /// (`crctl pki`).
    pub fn crctl_local(&self, args: &[&str]) -> ToolOutput {
        let a: Vec<OsString> = args.iter().map(OsString::from).collect();
        self.run_to_end(None, "crctl-local", &tool_path("crctl"), &a)
    }

    /// `cr_run --job JOB -- ARGV...` on node `k` (in its namespace, with
    /// `CR_AGENT_SOCKET` set to its agent), stdout and stderr to
    /// `DIR/cmds/NNNN-member-LABEL.{out,err}`.
    pub fn run_member(&self, job: &str, k: usize, label: &str, argv: &[OsString]) -> Spawned {
        self.run_member_env(job, k, label, argv, &[])
    }

    /// [`Cluster::run_member`] with extra environment.
    pub fn run_member_env(
        &self,
        job: &str,
        k: usize,
        label: &str,
        argv: &[OsString],
        extra_env: &[(String, String)],
    ) -> Spawned {
        let n = self.next_seq();
        let base = self
            .dir
            .join("cmds")
            .join(format!("{n:04}-member-{}", label.replace('/', "_")));
        let mut args: Vec<OsString> = vec!["--job".into(), job.into(), "--".into()];
        args.extend(argv.iter().cloned());
        let mut env = vec![(
            "CR_AGENT_SOCKET".to_string(),
            self.socket(k).to_string_lossy().into_owned(),
        )];
        env.extend(extra_env.iter().cloned());
        self.spawn_in(
            Some(self.ns(k)),
            &format!("cr_run {label}"),
            &tool_path("cr_run"),
            &args,
            &env,
            (&base.with_extension("out"), &base.with_extension("err")),
        )
    }

    /// Starts a ring job (see [`Ring`]) through `cr_run --job`, and waits
    /// until every member has carried messages both ways.
    pub fn start_ring(&self, job: &str, placement: &[usize]) -> Ring<'_> {
        let mut r = Ring::launch(self, job, placement, true, None, &[], false);
        r.wait_up();
        r
    }

    /// [`Cluster::start_ring`] whose member 0 holds a ballast
    /// (`MIB[:DIRTY_MB_S]`, see wl_ring).
    pub fn start_ring_ballast(&self, job: &str, placement: &[usize], ballast: &str) -> Ring<'_> {
        let mut r = Ring::launch(self, job, placement, true, Some(ballast), &[], false);
        r.wait_up();
        r
    }

    /// [`Cluster::start_ring`] whose members listen on every address and
    /// connect to a next member on the same node over 127.0.0.1: those
    /// two must stay together wherever they go.
    pub fn start_ring_loopback(&self, job: &str, placement: &[usize]) -> Ring<'_> {
        let mut r = Ring::launch(self, job, placement, true, None, &[], true);
        r.wait_up();
        r
    }

    /// [`Cluster::start_ring`] with extra environment for every member
    /// (e.g. `WL_RING_PHASES`, see wl_ring).
    pub fn start_ring_env(
        &self,
        job: &str,
        placement: &[usize],
        env: &[(String, String)],
    ) -> Ring<'_> {
        let mut r = Ring::launch(self, job, placement, true, None, env, false);
        r.wait_up();
        r
    }

    /// A ring whose members are started directly in their nodes'
    /// namespaces (no cr_run, no agent): for the harness's own checks.
    pub fn start_ring_direct(&self, job: &str, placement: &[usize]) -> Ring<'_> {
        let mut r = Ring::launch(self, job, placement, false, None, &[], false);
        r.wait_up();
        r
    }

    /// `crctl --json jobs`: the state of `job` ("running", "checkpointing",
    /// "restarting", "partial", "stopped"; "" when unknown).
    pub fn job_state(&self, job: &str) -> String {
        jlist(&self.crctl_json(&["jobs"]), "jobs")
            .into_iter()
            .find(|j| jstr(j, "name") == job)
            .map(|j| jstr(j, "state"))
            .unwrap_or_default()
    }

    /// Once the periodic checkpoints of `job` are off: waits until the one
    /// under way (and its retention) has ended.
    pub fn wait_job_idle(&self, job: &str) {
        wait_until(
            &format!("the operation under way on job {job} to end"),
            RING_TIMEOUT,
            || !matches!(self.job_state(job).as_str(), "checkpointing" | "restarting"),
            || self.diag(),
        );
    }

    /// Once its members were killed: waits until the coordinator sees
    /// every member of `job` gone.
    pub fn wait_members_gone(&self, job: &str) {
        wait_until(
            "the coordinator to see every member gone",
            RING_TIMEOUT,
            || self.job_procs(job).iter().all(|(_, _, alive)| !alive),
            || format!("{:?}\n{}", self.job_procs(job), self.diag()),
        );
    }

    /// `crctl --json jobs`: (node, pid, alive) of every process of `job`.
    pub fn job_procs(&self, job: &str) -> Vec<(String, i32, bool)> {
        let v = self.crctl_json(&["jobs"]);
        let mut out = Vec::new();
        for j in jlist(&v, "jobs") {
            if jstr(j, "name") != job {
                continue;
            }
            for p in jlist(j, "procs") {
                let alive = matches!(jget(p, "alive"), Some(Value::Bool(true)));
                out.push((jstr(p, "node"), ju64(p, "pid") as i32, alive));
            }
        }
        out
    }

    /// Tails of the coordinator's and the agents' logs, and their state.
    pub fn diag(&self) -> String {
        let mut s = String::new();
        let state = |p: Option<&mut Proc>| match p {
            None => "not running".to_string(),
            Some(p) => match p.try_exit() {
                Some(st) => format!("exited: {}", status_str(st)),
                None => describe(p.pid),
            },
        };
        let c = state(self.coordinator.borrow_mut().as_mut().map(|d| &mut d.proc));
        s.push_str(&format!(
            "--- cr-coordinatord ({c}), {}:\n{}\n",
            self.coordinator_log().display(),
            tail(&read_text(&self.coordinator_log()), 40)
        ));
        for k in 1..=self.nodes {
            let a = state(
                self.agents.borrow_mut()[k - 1]
                    .as_mut()
                    .map(|d| &mut d.proc),
            );
            s.push_str(&format!(
                "--- cr-agent {} ({a}), {}:\n{}\n",
                node_name(k),
                self.agent_log(k).display(),
                tail(&read_text(&self.agent_log(k)), 40)
            ));
        }
        s
    }

    /// `ss` and nft rules of every node's namespace.
    pub fn net_diag(&self) -> String {
        self.node_ns.iter().map(Netns::diag).collect()
    }

    /// Kills (by PID) every process left in the cluster's namespaces, e.g.
    /// processes the agents restored, and reaps those that are ours (not
    /// the nodes' namespace holders: they go when the cluster is dropped).
    pub fn kill_leftovers(&self) {
        let inodes: Vec<u64> = self
            .node_ns
            .iter()
            .chain([&self.coord_ns, &self.switch])
            .filter_map(|ns| netns_inode(&ns.path()))
            .collect();
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() };
        let holders: Vec<i32> = self.node_holders.iter().map(NodeNs::pid).collect();
        let mut procs = Vec::new();
        for pid in all_pids() {
            if pid != me
                && !holders.contains(&pid)
                && proc_netns(pid).is_some_and(|i| inodes.contains(&i))
                && is_alive(pid)
            {
                procs.push(Proc::adopt(
                    pid,
                    "process left in a cluster namespace",
                    None,
                ));
            }
        }
        for p in procs.iter_mut() {
            p.kill_and_reap();
        }
        reap_orphans();
    }
}

impl Drop for Cluster<'_> {
    fn drop(&mut self) {
        // Daemons first (so that nothing is restored any more), then whatever
        // still runs in the namespaces; the namespaces go with the fields.
        if let Ok(mut a) = self.agents.try_borrow_mut() {
            for d in a.iter_mut() {
                if let Some(d) = d.as_mut() {
                    d.proc.kill_and_reap();
                }
            }
        }
        if let Ok(mut c) = self.coordinator.try_borrow_mut() {
            if let Some(d) = c.as_mut() {
                d.proc.kill_and_reap();
            }
        }
        self.kill_leftovers();
    }
}

/// Every PID in /proc.
fn all_pids() -> Vec<i32> {
    std::fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// argv of a process (empty if gone or a kernel thread).
fn cmdline(pid: i32) -> Vec<OsString> {
    use std::os::unix::ffi::OsStrExt;
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|s| !s.is_empty())
                .map(|s| OsStr::from_bytes(s).to_os_string())
                .collect()
        })
        .unwrap_or_default()
}

/// The live processes (PIDs in our namespace) running the program `prog`
/// (their argv[0]), e.g. the ranks of an MPI job.
pub fn program_pids(prog: &Path) -> Vec<i32> {
    all_pids()
        .into_iter()
        .filter(|&pid| cmdline(pid).first().is_some_and(|a| Path::new(a) == prog) && is_alive(pid))
        .collect()
}

/// The innermost PID of a process (last field of `NSpid:`): what it sees
/// as its own PID.
pub fn inner_pid(pid: i32) -> Option<i32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with("NSpid:"))?;
    line.split_whitespace().last()?.parse().ok()
}

// ---------------------------------------------------------------------------
// Rings
// ---------------------------------------------------------------------------

/// What a member's status file says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RingStatus {
    /// Not written yet.
    Missing,
    Ok {
        sent: u64,
        recv: u64,
        min: u64,
        pid: i32,
    },
    Fail(String),
    /// Anything else (a bug of the workload).
    Other(String),
}

impl RingStatus {
    /// Parses the text of a status file.
    pub fn parse(text: &str) -> RingStatus {
        let line = text.lines().next().unwrap_or("").trim();
        if line.is_empty() {
            return RingStatus::Missing;
        }
        if let Some(r) = line.strip_prefix("FAIL") {
            return RingStatus::Fail(r.trim().to_string());
        }
        if let Some(rest) = line.strip_prefix("ok ") {
            let mut f = std::collections::HashMap::new();
            for kv in rest.split_whitespace() {
                if let Some((k, v)) = kv.split_once('=') {
                    f.insert(k, v);
                }
            }
            let num = |k: &str| f.get(k).and_then(|v| v.parse::<u64>().ok());
            if let (Some(sent), Some(recv), Some(min), Some(pid)) =
                (num("sent"), num("recv"), num("min"), num("pid"))
            {
                return RingStatus::Ok {
                    sent,
                    recv,
                    min,
                    pid: pid as i32,
                };
            }
        }
        RingStatus::Other(line.to_string())
    }

    /// The smallest count, 0 unless `Ok`.
    pub fn min(&self) -> u64 {
        match self {
            RingStatus::Ok { min, .. } => *min,
            _ => 0,
        }
    }
}

/// One member of a ring.
struct RingMember {
    status: PathBuf,
    /// cr_run (or wl_ring itself when started directly).
    runner: Option<Spawned>,
    /// The member's process after a restart, found in /proc.
    adopted: Option<Proc>,
}

/// A ring job: member i runs `wl_ring STATUS i N 10.99.0.K:(7300+i)
/// NEXT` on node K = placement\[i\]. Dropping it kills every member (by PID).
pub struct Ring<'c> {
    pub c: &'c Cluster<'c>,
    pub job: String,
    /// The nodes members were started on (1-based).
    pub placement: Vec<usize>,
    pub dir: PathBuf,
    members: Vec<RingMember>,
}

impl<'c> Ring<'c> {
    fn launch(
        c: &'c Cluster<'c>,
        job: &str,
        placement: &[usize],
        via_cr_run: bool,
        ballast: Option<&str>,
        env: &[(String, String)],
        loopback: bool,
    ) -> Ring<'c> {
        let n = placement.len();
        assert!(n > 0 && n <= 1000, "a ring has 1 to 1000 members");
        let dir = c.dir.join(format!("ring-{job}"));
        std::fs::create_dir_all(&dir).expect("mkdir ring dir");
        let wl = workload_path("wl_ring");
        let addr = |i: usize| format!("{}:{}", node_ip(placement[i]), RING_PORT_BASE + i as u16);
        let mut members = Vec::new();
        for (i, &k) in placement.iter().enumerate() {
            let status = dir.join(format!("member-{i}.status"));
            let mut argv: Vec<OsString> = vec![
                status.clone().into_os_string(),
                i.to_string().into(),
                n.to_string().into(),
                if loopback {
                    format!("0.0.0.0:{}", RING_PORT_BASE + i as u16).into()
                } else {
                    addr(i).into()
                },
                if loopback && placement[(i + 1) % n] == k {
                    format!("127.0.0.1:{}", RING_PORT_BASE + ((i + 1) % n) as u16).into()
                } else {
                    addr((i + 1) % n).into()
                },
            ];
            argv.extend(ballast.filter(|_| i == 0).map(OsString::from));
            let label = format!("{job}-{i}");
            let runner = if via_cr_run {
                let mut full = vec![wl.clone().into_os_string()];
                full.extend(argv);
                c.run_member_env(job, k, &label, &full, env)
            } else {
                let base = dir.join(format!("member-{i}"));
                c.spawn_in(
                    Some(c.ns(k)),
                    &format!("wl_ring {label}"),
                    &wl,
                    &argv,
                    env,
                    (&base.with_extension("out"), &base.with_extension("err")),
                )
            };
            members.push(RingMember {
                status,
                runner: Some(runner),
                adopted: None,
            });
        }
        Ring {
            c,
            job: job.to_string(),
            placement: placement.to_vec(),
            dir,
            members,
        }
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// True if the ring has no member (never: a ring has at least one).
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Every member's status file, parsed.
    pub fn statuses(&self) -> Vec<RingStatus> {
        self.members
            .iter()
            .map(|m| RingStatus::parse(&read_text(&m.status)))
            .collect()
    }

    /// Every member's smallest count (panics on a FAIL).
    pub fn mins(&self) -> Vec<u64> {
        self.assert_no_fail();
        self.statuses().iter().map(RingStatus::min).collect()
    }

    /// The PIDs the members report (as they see themselves).
    pub fn status_pids(&self) -> Vec<Option<i32>> {
        self.statuses()
            .iter()
            .map(|s| match s {
                RingStatus::Ok { pid, .. } => Some(*pid),
                _ => None,
            })
            .collect()
    }

    /// Panics (with [`Ring::diag`]) if a member reported FAIL or garbage.
    pub fn assert_no_fail(&self) {
        let st = self.statuses();
        if st
            .iter()
            .any(|s| matches!(s, RingStatus::Fail(_) | RingStatus::Other(_)))
        {
            panic!("a member of ring {} failed\n{}", self.job, self.diag());
        }
    }

    /// The live processes running member `i` (normally one), found in /proc
    /// by their command line (`wl_ring STATUS_FILE ...`).
    pub fn find_pids(&self, i: usize) -> Vec<i32> {
        let status = self.members[i].status.as_os_str();
        all_pids()
            .into_iter()
            .filter(|&pid| {
                let argv = cmdline(pid);
                argv.len() >= 2
                    && argv[1] == status
                    && Path::new(&argv[0])
                        .file_name()
                        .is_some_and(|n| n == "wl_ring")
                    && is_alive(pid)
            })
            .collect()
    }

    /// The PID (in our PID namespace) of every member; panics unless each
    /// runs exactly once.
    pub fn host_pids(&self) -> Vec<i32> {
        let mut out = Vec::new();
        for i in 0..self.len() {
            let p = self.find_pids(i);
            if p.len() != 1 {
                panic!(
                    "member {i} of ring {} should run exactly once, found pids {p:?}\n{}",
                    self.job,
                    self.diag()
                );
            }
            out.push(p[0]);
        }
        out
    }

    /// Node (1-based) whose namespace each member runs in (None: not in one
    /// of the cluster's nodes, or not running).
    pub fn nodes_now(&self) -> Vec<Option<usize>> {
        self.host_pids()
            .into_iter()
            .map(|p| self.c.node_of(p))
            .collect()
    }

    /// Panics unless member i runs in the namespace of node `want[i]`.
    pub fn assert_on_nodes(&self, want: &[usize], ctx: &str) {
        let now = self.nodes_now();
        let want_opt: Vec<Option<usize>> = want.iter().map(|&k| Some(k)).collect();
        if now != want_opt {
            let pids = self.host_pids();
            let ns: Vec<Option<u64>> = pids.iter().map(|&p| proc_netns(p)).collect();
            let node_ns: Vec<u64> = (1..=self.c.nodes).map(|k| self.c.ns_inode(k)).collect();
            panic!(
                "{ctx}: members of ring {} should run on nodes {want:?}, they run on {now:?} \
                 (pids {pids:?}, their netns {ns:?}, nodes' netns {node_ns:?})\n{}",
                self.job,
                self.diag()
            );
        }
    }

    /// Panics unless every member reports (in its status file) the PID it
    /// has in its own PID namespace (members started by cr_run run in a
    /// PID namespace of their own).
    pub fn assert_status_pids(&self, ctx: &str) {
        let host = self.host_pids();
        let inner: Vec<Option<i32>> = host.iter().map(|&p| inner_pid(p)).collect();
        let reported = self.status_pids();
        if inner != reported {
            panic!(
                "{ctx}: members of ring {} report pids {reported:?}, they are {inner:?} in their \
                 PID namespaces ({host:?} here)\n{}",
                self.job,
                self.diag()
            );
        }
    }

    /// Panics unless every member runs, not stopped and not traced.
    pub fn assert_running_untraced(&self, ctx: &str) {
        for (i, pid) in self.host_pids().into_iter().enumerate() {
            crate::assert_running_untraced(pid, &format!("{ctx}: member {i}"));
        }
    }

    /// Status lines, processes, runners' output, then the cluster's logs.
    pub fn diag(&self) -> String {
        let mut s = format!(
            "=== ring {} (placement {:?}), status files in {}:\n",
            self.job,
            self.placement,
            self.dir.display()
        );
        for i in 0..self.members.len() {
            let pids = self.find_pids(i);
            let procs: Vec<String> = pids
                .iter()
                .map(|&p| {
                    format!(
                        "{} in node {:?} (inner pid {:?})",
                        describe(p),
                        self.c.node_of(p).map(node_name),
                        inner_pid(p)
                    )
                })
                .collect();
            let m = &self.members[i];
            s.push_str(&format!(
                "member {i}: {:?}\n    processes: {procs:?}\n",
                read_text(&m.status).trim()
            ));
            if let Some(r) = m.runner.as_ref() {
                s.push_str(&format!("    {}\n", r.describe().replace('\n', "\n    ")));
            }
        }
        s.push_str(&self.c.diag());
        s
    }

    /// Panics at once if a runner (cr_run) exited while members are
    /// expected to run under it.
    fn check_runners(&mut self, ctx: &str) {
        let mut dead = None;
        for (i, m) in self.members.iter_mut().enumerate() {
            if m.adopted.is_some() {
                continue;
            }
            if let Some(r) = m.runner.as_mut() {
                if let Some(st) = r.proc.try_exit() {
                    dead = Some((i, status_str(st)));
                    break;
                }
            }
        }
        if let Some((i, st)) = dead {
            panic!(
                "{ctx}: the runner of member {i} of ring {} exited ({st})\n{}",
                self.job,
                self.diag()
            );
        }
    }

    /// Waits until every member has carried messages both ways on both
    /// connections.
    fn wait_up(&mut self) {
        let deadline = Instant::now() + RING_TIMEOUT;
        loop {
            self.assert_no_fail();
            if self.statuses().iter().all(|s| s.min() > 0) {
                return;
            }
            self.check_runners("while the ring starts");
            if Instant::now() > deadline {
                panic!(
                    "timed out after {RING_TIMEOUT:?} waiting for ring {} to be up\n{}",
                    self.job,
                    self.diag()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until every member's `min` grew by `delta` since now.
    pub fn wait_advanced(&self, delta: u64, what: &str) {
        let snap = self.mins();
        self.wait_past(&snap, delta, what);
    }

    /// Waits until member i's `min` reaches `snap[i] + delta` for every i;
    /// panics at once on a FAIL.
    pub fn wait_past(&self, snap: &[u64], delta: u64, what: &str) {
        wait_until(
            &format!(
                "every member of ring {} to advance by {delta} messages {what} (from {snap:?})",
                self.job
            ),
            RING_TIMEOUT,
            || {
                self.assert_no_fail();
                self.statuses()
                    .iter()
                    .zip(snap)
                    .all(|(s, &base)| s.min() >= base + delta)
            },
            || format!("{}\n{}", self.diag(), self.c.net_diag()),
        );
    }

    /// After a checkpoint with --kill: waits until no member runs any more
    /// and reaps the runners.
    pub fn wait_gone(&mut self, what: &str) {
        let deadline = Instant::now() + RING_TIMEOUT;
        loop {
            let left: Vec<(usize, Vec<i32>)> = (0..self.len())
                .map(|i| (i, self.find_pids(i)))
                .filter(|(_, p)| !p.is_empty())
                .collect();
            let runners_done = self
                .members
                .iter_mut()
                .all(|m| m.runner.as_mut().is_none_or(|r| r.proc.has_exited()));
            if left.is_empty() && runners_done {
                for m in &mut self.members {
                    m.adopted = None;
                }
                reap_orphans();
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out after {RING_TIMEOUT:?} waiting for the members of ring {} to be \
                     gone {what}; still running: {left:?}\n{}",
                    self.job,
                    self.diag()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// After a restart: finds the restored members (one process each) and
    /// tracks them, so that they are killed on drop.
    pub fn adopt(&mut self) {
        let pids = self.host_pids();
        for (m, pid) in self.members.iter_mut().zip(pids) {
            m.adopted = Some(Proc::adopt(pid, "restored ring member", None));
        }
    }

    /// SIGKILLs member `i` (by PID: its runner, or the process found).
    pub fn kill_member(&mut self, i: usize) {
        let m = &mut self.members[i];
        if let Some(p) = m.adopted.as_mut() {
            p.kill_and_reap();
        }
        if let Some(r) = m.runner.as_mut() {
            r.proc.kill_and_reap();
        }
        for pid in self.find_pids(i) {
            Proc::adopt(pid, "ring member", None).kill_and_reap();
        }
        reap_orphans();
    }

    /// Forgets what the members last reported (their status files), once
    /// they are all gone: after a member was lost, its peers' FAIL (they
    /// saw it go) is not held against the job restarted from its
    /// checkpoint, whose members write theirs again.
    pub fn forget_statuses(&self) {
        for m in &self.members {
            let _ = std::fs::remove_file(&m.status);
        }
    }

    /// Kills every process of the ring (restored ones too) by PID.
    pub fn kill_all(&mut self) {
        for m in &mut self.members {
            if let Some(p) = m.adopted.as_mut() {
                p.kill_and_reap();
            }
            if let Some(r) = m.runner.as_mut() {
                r.proc.kill_and_reap();
            }
        }
        for i in 0..self.len() {
            for pid in self.find_pids(i) {
                // Its command line names our status file: ours.
                Proc::adopt(pid, "ring member", None).kill_and_reap();
            }
        }
        reap_orphans();
    }
}

impl Drop for Ring<'_> {
    fn drop(&mut self) {
        self.kill_all();
    }
}

// ---------------------------------------------------------------------------
// Workloads as another user
// ---------------------------------------------------------------------------

/// Starts workload `bin` (`wl_NAME WORKDIR ARGS...`) as `uid`/`gid`
/// (setgroups([]), setgid, setuid), with its work directory and output
/// files owned by that user, so that it (and a restore made with its
/// rights) can write them.
pub fn spawn_wl_as(h: &Harness, bin: &str, args: &[&str], uid: u32, gid: u32) -> Workload {
    let n = h.next_seq();
    let workdir = h.dir.join(format!("wl{n}-{bin}-uid{uid}"));
    std::fs::create_dir_all(&workdir).expect("mkdir workdir");
    let stdout = workdir.join("stdout.txt");
    let stderr = workdir.join("stderr.txt");
    for p in [&stdout, &stderr] {
        File::create(p).expect("create output file");
    }
    for p in [&workdir, &stdout, &stderr] {
        std::os::unix::fs::chown(p, Some(uid), Some(gid))
            .unwrap_or_else(|e| panic!("chown {}: {e}", p.display()));
    }
    let exe = workload_path(bin);
    let mut cmd = Command::new(&exe);
    cmd.arg(&workdir)
        .args(args)
        .current_dir(&workdir)
        .stdin(Stdio::null())
        .stdout(
            OpenOptions::new()
                .append(true)
                .open(&stdout)
                .expect("open stdout"),
        )
        .stderr(
            OpenOptions::new()
                .append(true)
                .open(&stderr)
                .expect("open stderr"),
        );
    isolate_fds(&mut cmd, &[]);
    {
        // std drops the supplementary groups (setgroups([])) when root sets a uid.
        use std::os::unix::process::CommandExt;
        cmd.uid(uid).gid(gid);
    }
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {} as uid {uid}: {e}", exe.display()));
    Workload {
        proc: Proc::from_child(child, &format!("{bin} (uid {uid})")),
        label: format!("{bin} (uid {uid})"),
        exe: std::fs::canonicalize(&exe).unwrap_or(exe),
        workdir,
        stdout,
        stderr,
    }
}
