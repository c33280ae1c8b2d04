//! A real Slurm on a test [`Cluster`]: Debian's `slurm-wlm` 22.05 and
//! `munge`, configured by the test in `DIR/slurm`, for the Slurm
//! integration tests (docs/SLURM.md).
//!
//! ```text
//!   "slurm-ctl" host (the coordinator's network namespace 10.99.0.254, a
//!   UTS and mount namespace of its own, host name `slurm-ctl`): slurmctld;
//!   sbatch, scontrol, squeue run here (a login node)
//!   n1..nK (the cluster's nodes): one slurmd each, NodeName=nK,
//!   NodeAddr=10.99.0.K
//!   munged: one, in the coordinator's network namespace; its socket
//!   DIR/slurm/munge/munge.sock is reached through the shared file system
//! ```
//!
//! Every daemon runs in the foreground (`-D`, `-F`) as a [`Proc`] of the
//! test, logging to `DIR/slurm/*.log`; dropping the [`Slurm`] stops them by
//! PID (SIGTERM, then SIGKILL after [`STOP_TIMEOUT`]). slurmstepd processes
//! left in the nodes are killed with the cluster's namespaces
//! ([`Cluster::kill_leftovers`]).
//!
//! The configuration is what the issue asks for: `proctrack/linuxproc`
//! (no cgroups), `select/linear` (whole nodes), `preempt/partition_prio`
//! with `PreemptMode=REQUEUE`: partition `low` (the default, preemptable,
//! with [`SlurmOpts::grace_time`]) and partition `high`, which preempts it;
//! `preempt_send_user_signal` (a job's `--signal` starts its grace time).
//! Every wait has a deadline and polls the daemons' state (no sleeps).

use crate::cluster::{
    node_ip, node_name, nsenter, poll_until, Cluster, Daemon, ADMIN, COORDINATOR_IP,
    COORDINATOR_PORT, POLL_PERIOD,
};
use crate::node::NodeNs;
use crate::{read_text, tail, tool_path, wait_until, Proc, ToolOutput};
use std::cell::RefCell;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Host name of the controller's namespace.
pub const CTL_HOST: &str = "slurm-ctl";
/// Deadline for a daemon to come up, and for a job to change state.
pub const SLURM_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a daemon gets to stop on SIGTERM before it is SIGKILLed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// What the test adds to the configuration.
#[derive(Default, Clone)]
pub struct SlurmOpts {
    /// Lines of plugstack.conf (e.g. `required /path/libcr_spank.so ...`).
    pub plugstack: Vec<String>,
    /// GraceTime of the preemptable partition `low`, seconds.
    pub grace_time: u32,
}

/// munged, slurmctld and one slurmd per node of a [`Cluster`] (see the
/// module docs).
pub struct Slurm<'c, 'h> {
    pub c: &'c Cluster<'h>,
    /// `DIR/slurm`: configuration, state, spool directories, logs.
    pub dir: PathBuf,
    /// slurm.conf (what `SLURM_CONF` points at).
    pub conf: PathBuf,
    slurmd: RefCell<Vec<Option<Daemon>>>,
    slurmctld: RefCell<Option<Daemon>>,
    munged: RefCell<Option<Daemon>>,
    /// cr-slurm-drain, once started ([`Slurm::start_drain_watcher`]).
    watcher: RefCell<Option<Daemon>>,
    /// The controller's UTS and mount namespaces (dropped last).
    ctl: NodeNs,
}

/// The slurm.conf of a test cluster of `nodes` nodes in `dir`.
fn slurm_conf(dir: &Path, nodes: usize, o: &SlurmOpts) -> String {
    let d = dir.display();
    let mut s = format!(
        "# Written by the test harness (tests/src/slurm.rs).
ClusterName=crtest
SlurmctldHost={CTL_HOST}({COORDINATOR_IP})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.sock
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=debug
SlurmdDebug=debug
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
MinJobAge=3600
KillWait=10
MessageTimeout=20
JobRequeue=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# The job's --signal (B:USR1: its batch script, whose cr_run checkpoints the
# job) instead of SIGTERM at the start of a preemption's GraceTime (22.05:
# a SlurmctldParameters, although the man page lists it under
# SchedulerParameters); pending jobs are looked at every 2 s.
SlurmctldParameters=preempt_send_user_signal
SchedulerParameters=sched_interval=2
PlugStackConfig={d}/plugstack.conf
"
    );
    for k in 1..=nodes {
        let _ = writeln!(
            s,
            "NodeName={} NodeAddr={} NodeHostname={} CPUs=2 RealMemory=1000 State=UNKNOWN",
            node_name(k),
            node_ip(k),
            node_name(k)
        );
    }
    let all = (1..=nodes).map(node_name).collect::<Vec<_>>().join(",");
    let _ = writeln!(
        s,
        "PartitionName=low Nodes={all} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 \
         PreemptMode=REQUEUE GraceTime={}",
        o.grace_time
    );
    let _ = writeln!(
        s,
        "PartitionName=high Nodes={all} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF"
    );
    s
}

impl<'c, 'h> Slurm<'c, 'h> {
    /// Writes the configuration, starts munged, slurmctld and the slurmd of
    /// every node of `c`, and waits until every node is idle.
    pub fn start(c: &'c Cluster<'h>, o: &SlurmOpts) -> Slurm<'c, 'h> {
        let dir = c.dir.join("slurm");
        let munge = dir.join("munge");
        std::fs::create_dir_all(&munge).expect("mkdir DIR/slurm/munge");
        std::fs::create_dir_all(dir.join("state")).expect("mkdir DIR/slurm/state");
        std::fs::set_permissions(&munge, std::fs::Permissions::from_mode(0o700))
            .expect("chmod the munge directory");
        // The cluster's own munge key (not the host's /etc/munge).
        let mut key = vec![0u8; 1024];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key))
            .expect("read /dev/urandom");
        let key_file = munge.join("munge.key");
        std::fs::write(&key_file, &key).expect("write the munge key");
        std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o400))
            .expect("chmod the munge key");
        let conf = dir.join("slurm.conf");
        std::fs::write(&conf, slurm_conf(&dir, c.nodes, o)).expect("write slurm.conf");
        let mut plug = o.plugstack.join("\n");
        plug.push('\n');
        std::fs::write(dir.join("plugstack.conf"), plug).expect("write plugstack.conf");
        let ctl = NodeNs::new(
            &c.coord_ns.path(),
            CTL_HOST,
            &dir.join("ctl-root"),
            &c.dir.join("hosts"),
            &dir.join("holder-ctl.log"),
        );
        let hosts = c.dir.join("hosts");
        let mut text = read_text(&hosts);
        text.push_str(&format!("{COORDINATOR_IP} {CTL_HOST}\n"));
        std::fs::write(&hosts, text).expect("add the controller to the hosts file");
        let s = Slurm {
            c,
            conf,
            slurmd: RefCell::new((0..c.nodes).map(|_| None).collect()),
            slurmctld: RefCell::new(None),
            munged: RefCell::new(None),
            watcher: RefCell::new(None),
            ctl,
            dir,
        };
        s.start_munged();
        s.start_slurmctld();
        for k in 1..=c.nodes {
            s.start_slurmd(k);
        }
        s.wait_nodes_state(&(1..=c.nodes).collect::<Vec<_>>(), "idle");
        s
    }

    /// The munge socket.
    pub fn munge_socket(&self) -> PathBuf {
        self.dir.join("munge").join("munge.sock")
    }

    /// `SLURM_CONF` for the commands and daemons.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![(
            "SLURM_CONF".to_string(),
            self.conf.to_string_lossy().into_owned(),
        )]
    }

    fn start_munged(&self) {
        let m = self.dir.join("munge");
        let p = |n: &str| m.join(n).to_string_lossy().into_owned();
        let args: Vec<OsString> = vec![
            "-F".into(),
            // The test directory is not root-owned all the way up.
            "--force".into(),
            format!("--socket={}", p("munge.sock")).into(),
            format!("--key-file={}", p("munge.key")).into(),
            format!("--pid-file={}", p("munged.pid")).into(),
            format!("--seed-file={}", p("munged.seed")).into(),
            format!("--log-file={}", self.dir.join("munged.log").display()).into(),
        ];
        let log = self.dir.join("munged.out");
        let sp = self.c.spawn_in(
            Some(&self.c.coord_ns),
            "munged",
            Path::new("/usr/sbin/munged"),
            &args,
            &[],
            (&log, &log),
        );
        *self.munged.borrow_mut() = Some(Daemon { proc: sp.proc, log });
        let sock = self.munge_socket();
        wait_until(
            "munged to create its socket",
            SLURM_TIMEOUT,
            || {
                self.check_alive(&self.munged, "munged");
                sock.exists()
            },
            || self.diag(),
        );
    }

    /// nsenter(1) arguments into the controller's namespaces, then `argv`.
    fn ctl_args(&self, argv: &[OsString]) -> Vec<OsString> {
        let mut a = self.ctl.nsenter_args(&self.c.dir);
        a.push("--".into());
        a.extend(argv.iter().cloned());
        a
    }

    fn start_slurmctld(&self) {
        let log = self.dir.join("slurmctld.out");
        let args = self.ctl_args(&[
            "/usr/sbin/slurmctld".into(),
            "-D".into(),
            "-i".into(),
            "-f".into(),
            self.conf.clone().into_os_string(),
        ]);
        let sp = self.c.spawn_in(
            None,
            "slurmctld",
            &nsenter(),
            &args,
            &self.env(),
            (&log, &log),
        );
        *self.slurmctld.borrow_mut() = Some(Daemon { proc: sp.proc, log });
        poll_until(
            "slurmctld to answer `scontrol ping`",
            SLURM_TIMEOUT,
            POLL_PERIOD,
            || {
                self.check_alive(&self.slurmctld, "slurmctld");
                let out = self.cmd(&["scontrol", "ping"]);
                out.status.success() && out.stdout.contains("is UP")
            },
            || self.diag(),
        );
    }

    /// Starts `cr-slurm-drain` on the controller's host (docs/SLURM.md,
    /// Drain): configured by a file (a look every second; crctl with the
    /// administrator's certificate), logging to `DIR/slurm/drain.log`.
    pub fn start_drain_watcher(&self) {
        let p = |n: &str| self.c.pki.join(n).to_string_lossy().into_owned();
        let crctl_conf = self.dir.join("crctl.toml");
        std::fs::write(
            &crctl_conf,
            format!(
                "coordinator = \"{COORDINATOR_IP}:{COORDINATOR_PORT}\"\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
                p("ca.crt"),
                p(&format!("{ADMIN}.crt")),
                p(&format!("{ADMIN}.key"))
            ),
        )
        .expect("write crctl.toml");
        let conf = self.dir.join("slurm-drain.toml");
        std::fs::write(
            &conf,
            format!(
                "period = 1.0\ntimeout = 60\ncrctl = {:?}\ncrctl_config = {:?}\n",
                tool_path("crctl"),
                crctl_conf
            ),
        )
        .expect("write slurm-drain.toml");
        let log = self.dir.join("drain.log");
        let args = self.ctl_args(&[
            tool_path("cr-slurm-drain").into_os_string(),
            "--config".into(),
            conf.into_os_string(),
        ]);
        let mut env = self.env();
        env.push(("CR_LOG".into(), "debug".into()));
        let sp = self.c.spawn_in(
            None,
            "cr-slurm-drain",
            &nsenter(),
            &args,
            &env,
            (&log, &log),
        );
        *self.watcher.borrow_mut() = Some(Daemon { proc: sp.proc, log });
        let log = self.dir.join("drain.log");
        wait_until(
            "cr-slurm-drain to start watching",
            SLURM_TIMEOUT,
            || {
                self.check_alive(&self.watcher, "cr-slurm-drain");
                read_text(&log).contains("watching drained nodes")
            },
            || self.diag(),
        );
    }

    /// Starts the slurmd of node `k` (in all its namespaces); does not wait.
    pub fn start_slurmd(&self, k: usize) {
        let node = node_name(k);
        let log = self.dir.join(format!("slurmd-{node}.out"));
        let args: Vec<OsString> = vec![
            "-D".into(),
            "-N".into(),
            node.clone().into(),
            "-f".into(),
            self.conf.clone().into_os_string(),
        ];
        let sp = self.c.spawn_in(
            Some(self.c.ns(k)),
            &format!("slurmd {node}"),
            Path::new("/usr/sbin/slurmd"),
            &args,
            &self.env(),
            (&log, &log),
        );
        self.slurmd.borrow_mut()[k - 1] = Some(Daemon { proc: sp.proc, log });
    }

    fn check_alive(&self, d: &RefCell<Option<Daemon>>, what: &str) {
        let mut d = d.borrow_mut();
        if let Some(st) = d.as_mut().and_then(|d| d.proc.try_exit()) {
            drop(d);
            panic!(
                "{what} exited ({}) before it was ready\n{}",
                crate::status_str(st),
                self.diag()
            );
        }
    }

    /// A Slurm command (`sbatch`, `scontrol`, ...) run to completion on
    /// the controller's host, with `SLURM_CONF`.
    pub fn cmd(&self, argv: &[&str]) -> ToolOutput {
        self.cmd_env(argv, &[])
    }

    /// [`Slurm::cmd`] with extra environment.
    pub fn cmd_env(&self, argv: &[&str], env: &[(String, String)]) -> ToolOutput {
        let a: Vec<OsString> = argv.iter().map(OsString::from).collect();
        let mut all = self.env();
        all.extend(env.iter().cloned());
        self.c
            .run_env(None, argv[0], &nsenter(), &self.ctl_args(&a), &all)
    }

    /// `sbatch --parsable ARGS...`: the job id (panics if refused).
    pub fn sbatch(&self, args: &[&str]) -> u32 {
        let mut argv = vec!["sbatch", "--parsable"];
        argv.extend_from_slice(args);
        let out = self.cmd(&argv);
        let id = out
            .stdout
            .trim()
            .split(';')
            .next()
            .and_then(|s| s.parse().ok());
        match (out.status.success(), id) {
            (true, Some(id)) => id,
            _ => panic!("sbatch refused the job\n{}\n{}", out.show(), self.diag()),
        }
    }

    /// `scontrol show job -o ID` as (key, value) pairs (empty if unknown).
    pub fn job_fields(&self, id: u32) -> Vec<(String, String)> {
        let out = self.cmd(&["scontrol", "show", "job", "-o", &id.to_string()]);
        out.stdout
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// One field of `scontrol show job` ("" if absent).
    pub fn job_field(&self, id: u32, key: &str) -> String {
        self.job_fields(id)
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
            .unwrap_or_default()
    }

    /// Waits until job `id` is in one of `states` (`RUNNING`, `COMPLETED`,
    /// ...); returns the state. Panics if it reaches a final state not
    /// listed, or after `timeout`.
    pub fn wait_job(&self, id: u32, states: &[&str], timeout: Duration) -> String {
        let mut last = String::new();
        poll_until(
            &format!("job {id} to be {states:?}"),
            timeout,
            POLL_PERIOD,
            || {
                last = self.job_field(id, "JobState");
                if states.contains(&last.as_str()) {
                    return true;
                }
                let final_states = ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"];
                if final_states.contains(&last.as_str()) {
                    panic!(
                        "job {id} ended {last}, expected {states:?}\n{}",
                        self.diag_job(id)
                    );
                }
                false
            },
            || self.diag_job(id),
        );
        last
    }

    /// `sinfo` state (`idle`, `alloc`, `drain`, ...) of node `k`.
    pub fn node_state(&self, k: usize) -> String {
        self.node_state_of(&node_name(k))
    }

    /// `sinfo` state of the node named `node`.
    pub fn node_state_of(&self, node: &str) -> String {
        let out = self.cmd(&["sinfo", "-h", "-N", "-n", node, "-o", "%T"]);
        // One line per partition holding the node, all the same.
        out.stdout.lines().next().unwrap_or("").trim().to_string()
    }

    /// Waits until every node of `ks` is in `state` (as sinfo writes it).
    pub fn wait_nodes_state(&self, ks: &[usize], state: &str) {
        poll_until(
            &format!("nodes {ks:?} to be {state} in sinfo"),
            SLURM_TIMEOUT,
            POLL_PERIOD,
            || {
                self.check_alive(&self.slurmctld, "slurmctld");
                ks.iter().all(|&k| self.node_state(k) == state)
            },
            || self.diag(),
        );
    }

    /// The job's state and output (`StdOut`), then the daemons' logs.
    pub fn diag_job(&self, id: u32) -> String {
        let out = self.job_field(id, "StdOut");
        format!(
            "--- scontrol show job {id}:\n{}\n--- job output {out}:\n{}\n{}",
            self.cmd(&["scontrol", "show", "job", &id.to_string()])
                .stdout,
            tail(&read_text(Path::new(&out)), 40),
            self.diag()
        )
    }

    /// Tails of the Slurm daemons' logs and of the cluster's.
    pub fn diag(&self) -> String {
        let mut s = String::new();
        let mut logs = vec![
            self.dir.join("munged.log"),
            self.dir.join("slurmctld.out"),
            self.dir.join("slurmctld.log"),
            self.dir.join("drain.log"),
        ];
        for k in 1..=self.c.nodes {
            logs.push(self.dir.join(format!("slurmd-{}.log", node_name(k))));
        }
        for l in logs {
            let _ = write!(s, "\n--- {}:\n{}", l.display(), tail(&read_text(&l), 15));
        }
        s.push('\n');
        s.push_str(&self.c.diag());
        s
    }
}

/// Stops a daemon by PID: SIGTERM, then SIGKILL after [`STOP_TIMEOUT`].
fn stop(p: &mut Proc) {
    p.terminate(STOP_TIMEOUT);
}

impl Drop for Slurm<'_, '_> {
    fn drop(&mut self) {
        if let Some(d) = self.watcher.borrow_mut().as_mut() {
            stop(&mut d.proc);
        }
        for d in self.slurmd.borrow_mut().iter_mut().flatten() {
            stop(&mut d.proc);
        }
        for d in [&self.slurmctld, &self.munged] {
            if let Some(d) = d.borrow_mut().as_mut() {
                stop(&mut d.proc);
            }
        }
    }
}
