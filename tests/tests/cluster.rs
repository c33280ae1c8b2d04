//! End-to-end tests of multi-node jobs (docs/CLUSTER.md): cr-agent on three
//! nodes, cr-coordinatord and crctl, each node in its own network namespace
//! joined by a bridge (`cr_tests::cluster`). The job is a ring of `wl_ring`
//! members started with `cr_run --job`: every member checks every message
//! it gets from its two neighbours, so a checkpoint or restart that loses,
//! duplicates or corrupts a byte of any connection shows as `FAIL`.
//!
//! * a ring whose members are started directly (no daemon): the harness and
//!   the workload themselves;
//! * (a) checkpoint with CONTINUE; (b) checkpoint --kill and restart on the
//!   same nodes; (c) restart on other nodes (addresses rewritten);
//! * (d) an agent killed during PREPARE: the checkpoint aborts, the other
//!   nodes' members run on, the agent's restart sweeps what it left;
//! * (e) the coordinator killed and restarted on its catalog;
//! * (f) certificates of another CA are refused (agent registration, and a
//!   gRPC call to an agent made by the test itself);
//! * (g) uncoordinated member checkpoints and a restart from the recovery
//!   line;
//! * (h) a non-blocking coordinated checkpoint and a restart from it.

use cr_rpc::pb::agent_client::AgentClient;
use cr_rpc::pb::SessionRequest;
use cr_rpc::tls::{Security, TlsFiles};
use cr_tests::cluster::{
    jlist, jstr, ju64, node_ip, node_name, poll_until, AgentOpts, Cluster, Ring, RingStatus,
    AGENT_PORT, POLL_PERIOD,
};
use cr_tests::{assert_running_untraced, proc_status, read_text, wait_until, Harness};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Messages every member must carry (on each connection, each way) to
/// count as advancing: 0.25 s at full pace.
const MARGIN: u64 = 5000;
/// The ring of the scenarios: 4 members on 3 nodes.
const PLACEMENT: [usize; 4] = [1, 2, 3, 1];
const JOB: &str = "ring";

/// Prefix of every crctl error line.
const CRCTL_ERR: &str = "crctl: error: ";

/// A cluster of 3 nodes with its coordinator and agents up.
fn cluster(h: &Harness) -> Cluster<'_> {
    let c = Cluster::new(h, 3);
    c.start_coordinator();
    c.start_agents(&[1, 2, 3]);
    c
}

/// Panics with the ring's diagnostics unless `cond`.
fn ensure(ring: &Ring, cond: bool, msg: &str) {
    if !cond {
        panic!("{msg}\n{}", ring.diag());
    }
}

/// `crctl --json checkpoint JOB EXTRA...`: asserts it committed with one
/// image per member and every ring connection matched, returns the
/// CheckpointInfo.
fn checkpoint(c: &Cluster, ring: &Ring, extra: &[&str]) -> Value {
    let mut args = vec!["checkpoint", JOB];
    args.extend_from_slice(extra);
    let info = c.crctl_json(&args);
    let n = ring.len();
    ensure(
        ring,
        jstr(&info, "state") == "committed"
            && jlist(&info, "images").len() == n
            && ju64(&info, "connections") == n as u64
            && ju64(&info, "external") == 0
            && !jstr(&info, "id").is_empty(),
        &format!(
            "crctl checkpoint {JOB} {extra:?}: expected a committed checkpoint with {n} images \
             and {n} connections matched, none external; got {info:#}"
        ),
    );
    info
}

/// The checkpoint `id` as `crctl checkpoints JOB [--all] --json` lists it.
fn listed(c: &Cluster, all: bool, id: &str) -> Option<Value> {
    let mut args = vec!["checkpoints", JOB];
    if all {
        args.push("--all");
    }
    let v = c.crctl_json(&args);
    jlist(&v, "checkpoints")
        .into_iter()
        .find(|x| jstr(x, "id") == id)
        .cloned()
}

/// Panics unless every member of the ring is a live process of the job on
/// its node, as `crctl jobs --json` reports it.
fn assert_jobs_list_members(c: &Cluster, ring: &Ring, nodes: &[usize]) {
    let procs = c.job_procs(JOB);
    let pids = ring.host_pids();
    for (i, (&pid, &k)) in pids.iter().zip(nodes).enumerate() {
        ensure(
            ring,
            procs
                .iter()
                .any(|(n, p, alive)| *n == node_name(k) && *p == pid && *alive),
            &format!(
                "member {i} (pid {pid} on {}) should be listed alive by `crctl jobs`: {procs:?}",
                node_name(k)
            ),
        );
    }
}

/// The harness and wl_ring alone: a ring started directly in the node
/// namespaces runs (each member in its node's namespace, reporting its own
/// pid), and when one member is killed its neighbours report FAIL.
/// Every node has its own host name, /dev/shm and private directory: what
/// a command started on node k sees (node-local state written by every
/// node first, then read back by every node).
fn assert_nodes_apart(c: &Cluster) {
    for k in 1..=c.nodes {
        let root = c.node_root(k).join("probe");
        let script = format!(
            "hostname; getent hosts n1 | cut -d' ' -f1; \
             echo {name} > /dev/shm/cr-node-probe; echo {name} > {root}",
            name = node_name(k),
            root = root.display()
        );
        let out = c.run_on(k, &["/bin/sh", "-c", &script]);
        out.assert_success("write node-local files");
        assert_eq!(
            out.stdout,
            format!("{}\n{}\n", node_name(k), node_ip(1)),
            "host name of node {k}, and n1's address there"
        );
    }
    for k in 1..=c.nodes {
        let mut script = format!(
            "cat /dev/shm/cr-node-probe {}",
            c.node_root(k).join("probe").display()
        );
        for other in (1..=c.nodes).filter(|&o| o != k) {
            script.push_str(&format!(
                "; test ! -e {} || echo seen-{other}",
                c.node_root(other).join("probe").display()
            ));
        }
        let out = c.run_on(k, &["/bin/sh", "-c", &script]);
        out.assert_success("read node-local files");
        let want = format!("{n}\n{n}\n", n = node_name(k));
        assert_eq!(
            out.stdout, want,
            "node {k} sees its own /dev/shm and directory only"
        );
    }
    assert!(
        !Path::new("/dev/shm/cr-node-probe").exists() && !c.node_root(1).join("probe").exists(),
        "the nodes' /dev/shm and directories are not the test's"
    );
}

#[test]
fn ring_direct_without_daemons() {
    let h = Harness::new("cluster-direct");
    let c = Cluster::network_only(&h, 3);
    assert_nodes_apart(&c);
    let mut ring = c.start_ring_direct("direct", &PLACEMENT);
    ring.wait_advanced(MARGIN, "started directly");
    ring.assert_on_nodes(&PLACEMENT, "started directly");
    ring.assert_running_untraced("started directly");
    ring.assert_status_pids("started directly");
    let pids = ring.host_pids();
    let reported: Vec<Option<i32>> = ring.status_pids();
    ensure(
        &ring,
        reported == pids.iter().map(|&p| Some(p)).collect::<Vec<_>>(),
        &format!("status files should report the pids {pids:?}: {reported:?}"),
    );

    ring.kill_member(1);
    wait_until(
        "members 0 and 2 (the neighbours of the killed member 1) to report FAIL",
        Duration::from_secs(10),
        || {
            let st = ring.statuses();
            matches!(st[0], RingStatus::Fail(_)) && matches!(st[2], RingStatus::Fail(_))
        },
        || ring.diag(),
    );
    let st = ring.statuses();
    eprintln!("after killing member 1: {st:?}");
    for i in [0, 2] {
        wait_until(
            &format!("member {i} to exit after its FAIL"),
            Duration::from_secs(10),
            || ring.find_pids(i).is_empty(),
            || ring.diag(),
        );
    }
}

/// (a) A checkpoint with CONTINUE commits one image per member with every
/// connection matched, and the ring runs on.
#[test]
fn checkpoint_continue() {
    let h = Harness::new("cluster-continue");
    let c = cluster(&h);
    let ring = c.start_ring(JOB, &PLACEMENT);
    ring.wait_advanced(MARGIN, "before the checkpoint");
    let t0 = Instant::now();
    let info = checkpoint(&c, &ring, &[]);
    eprintln!(
        "checkpoint in {:?}: pause {} ms, prepare {} ms, check {} ms, dump {} ms, commit {} ms",
        t0.elapsed(),
        ju64(&info, "pause_ms"),
        ju64(&info, "prepare_ms"),
        ju64(&info, "check_ms"),
        ju64(&info, "dump_ms"),
        ju64(&info, "commit_ms")
    );
    let id = jstr(&info, "id");
    let l = listed(&c, false, &id);
    ensure(
        &ring,
        l.as_ref().is_some_and(|x| {
            jstr(x, "state") == "committed"
                && jlist(x, "images").len() == PLACEMENT.len()
                && ju64(x, "connections") == PLACEMENT.len() as u64
        }),
        &format!("`crctl checkpoints {JOB}` should list {id} committed with 4 images: {l:?}"),
    );
    ring.wait_advanced(MARGIN, "after the checkpoint (continue)");
    ring.assert_running_untraced("after the checkpoint (continue)");
    ring.assert_on_nodes(&PLACEMENT, "after the checkpoint (continue)");
    ring.assert_status_pids("after the checkpoint (continue)");
    ring.assert_no_fail();
}

/// Checkpoint --kill: every member is gone; returns the counts they had
/// reported (the checkpointed state is at least that far).
fn checkpoint_kill(c: &Cluster, ring: &mut Ring) -> (Value, Vec<u64>) {
    ring.wait_advanced(MARGIN, "before the checkpoint");
    let info = checkpoint(c, ring, &["--kill"]);
    ring.wait_gone("after checkpoint --kill");
    let snap = ring.mins();
    (info, snap)
}

/// (b) Checkpoint --kill, restart on the same nodes: every member resumes
/// from the checkpoint in its node's namespace and goes on.
#[test]
fn checkpoint_kill_restart_same_nodes() {
    let h = Harness::new("cluster-restart");
    let c = cluster(&h);
    let mut ring = c.start_ring(JOB, &PLACEMENT);
    let (_, snap) = checkpoint_kill(&c, &mut ring);
    let out = c.crctl(&["restart", JOB]);
    if !out.status.success() {
        panic!("crctl restart failed\n{}\n{}", out.show(), ring.diag());
    }
    ring.adopt();
    ring.wait_past(&snap, MARGIN, "after the restart");
    ring.assert_on_nodes(&PLACEMENT, "after the restart");
    ring.assert_running_untraced("after the restart");
    ring.assert_status_pids("after the restart");
    assert_jobs_list_members(&c, &ring, &PLACEMENT);
    ring.assert_no_fail();
}

/// (c) Checkpoint --kill, restart with `--on n2 --on n3 --on n1`: every
/// member runs in its new node's namespace, its sockets rewritten to the
/// new addresses, and the ring goes on.
#[test]
fn checkpoint_kill_restart_moved() {
    let h = Harness::new("cluster-move");
    let c = cluster(&h);
    let mut ring = c.start_ring(JOB, &PLACEMENT);
    let (info, snap) = checkpoint_kill(&c, &mut ring);
    // The checkpoint's nodes sorted by name (n1, n2, n3) go to the `--on`
    // nodes in order: every node moves one further, n1 -> n2 -> n3 -> n1.
    let mut nodes: Vec<String> = jlist(&info, "images")
        .into_iter()
        .map(|img| jstr(img, "node"))
        .collect();
    nodes.sort();
    nodes.dedup();
    ensure(
        &ring,
        nodes == ["n1", "n2", "n3"],
        &format!("the checkpoint should have images on n1, n2 and n3: {info:#}"),
    );
    let moved = |old: usize| old % 3 + 1;
    let on: Vec<String> = (1..=3).map(|k| node_name(moved(k))).collect();
    let want: Vec<usize> = PLACEMENT.iter().map(|&k| moved(k)).collect();
    let reply = c.crctl_json(&[
        "restart", JOB, "--on", &on[0], "--on", &on[1], "--on", &on[2],
    ]);
    ring.adopt();
    ring.wait_past(&snap, MARGIN, "after the restart on other nodes");
    ring.assert_on_nodes(&want, "after the restart on other nodes");
    ring.assert_running_untraced("after the restart on other nodes");
    let maps: Vec<String> = jlist(&reply, "map_addr")
        .into_iter()
        .filter_map(|m| m.as_str().map(str::to_string))
        .collect();
    for k in 1..=3 {
        let expect = format!("{}={}", node_ip(k), node_ip(moved(k)));
        ensure(
            &ring,
            maps.contains(&expect),
            &format!("the restart should rewrite {expect}: map_addr {maps:?} in {reply:#}"),
        );
    }
    assert_jobs_list_members(&c, &ring, &want);
    ring.assert_no_fail();
}

/// (d) The agent of n2 is killed while it holds its members frozen in
/// PREPARE: crctl fails naming n2, the checkpoint is recorded aborted, the
/// members of n1 and n3 run on untraced; once the agent is restarted (its
/// start-up sweeps the session it left), the whole ring advances.
#[test]
fn agent_killed_during_prepare() {
    let h = Harness::new("cluster-fault");
    let c = Cluster::new(&h, 3);
    c.start_coordinator();
    let fault = h.dir.join("fault-reached");
    let fault_s = fault.to_string_lossy().into_owned();
    c.start_agent_with(
        2,
        &AgentOpts {
            env: vec![
                ("CR_AGENT_FAULT".into(), "prepare-hang".into()),
                ("CR_AGENT_FAULT_FILE".into(), fault_s),
            ],
            no_wait: true,
            ..Default::default()
        },
    );
    c.start_agents(&[1, 3]);
    c.wait_nodes_up(&[2]);
    let ring = c.start_ring(JOB, &PLACEMENT);
    ring.wait_advanced(MARGIN, "before the checkpoint");

    let mut ck = c.crctl_bg(&["checkpoint", JOB]);
    let (ck_out, ck_err) = (ck.stdout.clone(), ck.stderr.clone());
    wait_until(
        "the agent of n2 to reach the prepare-hang fault",
        Duration::from_secs(30),
        || fault.exists() || ck.proc.has_exited(),
        || {
            format!(
                "--- crctl checkpoint stdout:\n{}\n--- stderr:\n{}\n{}",
                read_text(&ck_out),
                read_text(&ck_err),
                ring.diag()
            )
        },
    );
    if !fault.exists() {
        panic!(
            "crctl checkpoint ended before the fault was reached\n{}\n{}",
            ck.diag(),
            ring.diag()
        );
    }
    c.kill_agent(2);
    let out = ck.wait(Duration::from_secs(60), || ring.diag());
    let line = out.assert_error(
        "crctl checkpoint with n2's agent killed",
        CRCTL_ERR,
        &["n2"],
    );
    eprintln!("crctl checkpoint: {line}");

    let v = c.crctl_json(&["checkpoints", JOB, "--all"]);
    let cks = jlist(&v, "checkpoints");
    ensure(
        &ring,
        !cks.is_empty()
            && cks.iter().all(|x| jstr(x, "state") == "aborted")
            && cks.iter().all(|x| !jstr(x, "error").is_empty()),
        &format!("every checkpoint of {JOB} should be aborted, with a reason: {v:#}"),
    );

    // Members on n1 and n3: resumed by the abort.
    let pids = ring.host_pids();
    let others: Vec<(usize, i32)> = PLACEMENT
        .iter()
        .zip(&pids)
        .enumerate()
        .filter(|(_, (&k, _))| k != 2)
        .map(|(i, (_, &p))| (i, p))
        .collect();
    wait_until(
        "the members on n1 and n3 to run untraced after the abort",
        Duration::from_secs(15),
        || {
            others.iter().all(|&(_, p)| {
                matches!(proc_status(p), Some(s) if s.tracer_pid == 0
                    && !matches!(s.state, 't' | 'T' | 'Z' | 'X'))
            })
        },
        || ring.diag(),
    );
    for &(i, p) in &others {
        assert_running_untraced(p, &format!("member {i} after the abort"));
    }
    ring.assert_no_fail();

    // The agent comes back (as systemd would restart it).
    c.start_agent(2);
    ring.wait_advanced(MARGIN, "after the agent of n2 was restarted");
    ring.assert_running_untraced("after the agent of n2 was restarted");
    ring.assert_no_fail();
}

/// The coordinator killed in the middle of a checkpoint (n2's agent hangs
/// in PREPARE, so the others hold their members frozen): the agents of n1
/// and n3 miss three heartbeats, abort their sessions and let their
/// members run, without waiting for the session timeout. Then n2's agent
/// is replaced and the coordinator restarted: the lost checkpoint is
/// listed aborted and the ring runs on.
#[test]
fn coordinator_killed_during_checkpoint() {
    let h = Harness::new("cluster-coord-crash");
    let c = Cluster::new(&h, 3);
    c.start_coordinator();
    let fault = h.dir.join("fault-reached");
    c.start_agent_with(
        2,
        &AgentOpts {
            env: vec![
                ("CR_AGENT_FAULT".into(), "prepare-hang".into()),
                (
                    "CR_AGENT_FAULT_FILE".into(),
                    fault.to_string_lossy().into_owned(),
                ),
            ],
            no_wait: true,
            ..Default::default()
        },
    );
    c.start_agents(&[1, 3]);
    c.wait_nodes_up(&[2]);
    let ring = c.start_ring(JOB, &PLACEMENT);
    ring.wait_advanced(MARGIN, "before the checkpoint");
    let mut ck = c.crctl_bg(&["checkpoint", JOB]);
    wait_until(
        "the agent of n2 to reach the prepare-hang fault",
        Duration::from_secs(30),
        || fault.exists() || ck.proc.has_exited(),
        || ring.diag(),
    );
    assert!(
        fault.exists(),
        "crctl ended before the fault\n{}",
        ck.diag()
    );
    // The others have frozen their members by now (PREPARE runs in parallel).
    let pids = ring.host_pids();
    let others: Vec<i32> = PLACEMENT
        .iter()
        .zip(&pids)
        .filter(|(&k, _)| k != 2)
        .map(|(_, &p)| p)
        .collect();
    wait_until(
        "the members on n1 and n3 to be frozen by PREPARE",
        Duration::from_secs(10),
        || {
            others
                .iter()
                .all(|&p| proc_status(p).is_some_and(|s| s.tracer_pid > 0))
        },
        || ring.diag(),
    );
    c.kill_coordinator();
    let _ = ck.wait(Duration::from_secs(30), || ring.diag());
    let t0 = Instant::now();
    wait_until(
        "the members on n1 and n3 to run untraced once their agents lost the coordinator",
        Duration::from_secs(20),
        || {
            others.iter().all(|&p| {
                matches!(proc_status(p), Some(s) if s.tracer_pid == 0
                    && !matches!(s.state, 't' | 'T' | 'Z' | 'X'))
            })
        },
        || ring.diag(),
    );
    eprintln!(
        "members resumed {:?} after the coordinator died",
        t0.elapsed()
    );
    // n2's agent is stuck: replace it (its start sweeps the lost lock), and
    // bring the coordinator back on its catalog.
    c.start_coordinator();
    c.kill_agent(2);
    c.start_agent(2);
    c.wait_nodes_up(&[1, 2, 3]);
    let v = c.crctl_json(&["checkpoints", JOB, "--all"]);
    let cks = jlist(&v, "checkpoints");
    ensure(
        &ring,
        !cks.is_empty() && cks.iter().all(|x| jstr(x, "state") == "aborted"),
        &format!("the lost checkpoint should be listed aborted: {v:#}"),
    );
    ring.wait_advanced(MARGIN, "after the coordinator and n2's agent came back");
    ring.assert_running_untraced("after the coordinator and n2's agent came back");
    ring.assert_no_fail();
    checkpoint(&c, &ring, &[]);
}

/// (e) The coordinator is killed after a checkpoint and restarted on the
/// same catalog: the checkpoint is still listed committed, the agents
/// register again, a second checkpoint commits and the ring runs on.
#[test]
fn coordinator_restart() {
    let h = Harness::new("cluster-coord");
    let c = cluster(&h);
    let ring = c.start_ring(JOB, &PLACEMENT);
    ring.wait_advanced(MARGIN, "before the first checkpoint");
    let first = checkpoint(&c, &ring, &[]);
    let id1 = jstr(&first, "id");

    c.kill_coordinator();
    c.start_coordinator();
    let l = listed(&c, false, &id1);
    ensure(
        &ring,
        l.as_ref().is_some_and(|x| jstr(x, "state") == "committed"),
        &format!("after the restart of the coordinator, {id1} should be listed committed: {l:?}"),
    );
    // Registered again, with their members (2 on n1, 1 on n2, 1 on n3).
    c.wait_nodes(
        "the 3 agents registered again with their members",
        |nodes| {
            [("n1", 2), ("n2", 1), ("n3", 1)].iter().all(|(n, m)| {
                nodes
                    .iter()
                    .any(|(name, st, members)| name == n && st == "up" && *members == *m)
            })
        },
    );

    ring.wait_advanced(MARGIN, "before the second checkpoint");
    let out = c.crctl(&["checkpoint", JOB]);
    let first_line = out.stdout.lines().next().unwrap_or("").to_string();
    ensure(
        &ring,
        out.status.success()
            && first_line.starts_with("checkpoint ")
            && first_line.contains("committed"),
        &format!(
            "the second checkpoint should commit and say so on its first line\n{}",
            out.show()
        ),
    );
    let id2 = first_line
        .split_whitespace()
        .nth(1)
        .unwrap_or("")
        .to_string();
    ensure(
        &ring,
        id2 != id1 && listed(&c, false, &id2).is_some(),
        &format!("the second checkpoint {id2:?} should be new ({id1}) and listed"),
    );
    ring.wait_advanced(MARGIN, "after the second checkpoint");
    ring.assert_no_fail();
}

/// What a gRPC call to an agent came to.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// No channel (TLS or TCP failed).
    ConnectFailed,
    /// The call failed in transport (no answer of the server).
    Failed,
    /// The server answered (OK or a status of its own).
    Answered,
}

/// An outcome and what was said.
type Call = (Outcome, String);

/// `Agent.Abort` of an unknown session on node `k`'s agent, made from the
/// coordinator's namespace, trusting the cluster CA and presenting the
/// `admin` certificate of `pki`.
fn call_agent(c: &Cluster, k: usize, pki: &Path) -> Call {
    let files = TlsFiles {
        ca: Some(c.pki.join("ca.crt")),
        cert: Some(pki.join("admin.crt")),
        key: Some(pki.join("admin.key")),
        insecure: false,
    };
    let addr = format!("{}:{AGENT_PORT}", node_ip(k));
    let node = node_name(k);
    c.coord_ns.run(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        rt.block_on(async move {
            let sec = match Security::load(&files) {
                Ok(s) => s,
                Err(e) => {
                    return (
                        Outcome::ConnectFailed,
                        format!("loading the certificates: {e}"),
                    )
                }
            };
            let ch =
                match cr_rpc::channel::connect(&addr, &sec, &node, Duration::from_secs(5)).await {
                    Ok(ch) => ch,
                    Err(e) => return (Outcome::ConnectFailed, e.to_string()),
                };
            let mut cl = AgentClient::new(ch);
            let req = SessionRequest {
                session: "no-such-session-of-the-test".into(),
            };
            match tokio::time::timeout(Duration::from_secs(10), cl.abort(req)).await {
                Err(_) => (Outcome::Failed, "no answer within 10 s".into()),
                Ok(Ok(_)) => (Outcome::Answered, "OK".into()),
                Ok(Err(s)) => match s.code() {
                    tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
                        (Outcome::Failed, format!("{:?}: {}", s.code(), s.message()))
                    }
                    code => (Outcome::Answered, format!("{code:?}: {}", s.message())),
                },
            }
        })
    })
}

/// (f) Certificates of another CA: an agent holding one (and trusting the
/// cluster's CA) never registers, and a call to an agent with one fails in
/// the handshake, while the same call with the cluster's admin certificate
/// is answered.
#[test]
fn foreign_ca_refused() {
    let h = Harness::new("cluster-ca");
    let c = Cluster::new(&h, 3);
    c.start_coordinator();
    let other: PathBuf = h.dir.join("pki-other");
    c.make_pki(
        &other,
        &[
            (node_name(3), Some(node_ip(3))),
            ("admin".to_string(), None),
        ],
    );
    // n3 trusts the cluster's CA (so only the coordinator can refuse it)
    // but holds a certificate of the other CA.
    c.start_agent_with(
        3,
        &AgentOpts {
            pki: Some(other.clone()),
            ca: Some(c.pki.join("ca.crt")),
            no_wait: true,
            ..Default::default()
        },
    );
    // Started after the foreign one, the good agents register; meanwhile
    // and for 3 s more, n3 must never appear.
    c.start_agents(&[1, 2]);
    let until = Instant::now() + Duration::from_secs(3);
    poll_until(
        "3 s in which n3 must never appear in `crctl nodes`",
        Duration::from_secs(30),
        POLL_PERIOD,
        || {
            let nodes = c.nodes_status();
            assert!(
                nodes.iter().all(|(n, _, _)| *n != node_name(3)),
                "the agent with a certificate of another CA must never be listed: {nodes:?}\n{}",
                c.diag()
            );
            Instant::now() > until
        },
        || c.diag(),
    );

    let good = call_agent(&c, 1, &c.pki);
    assert!(
        good.0 == Outcome::Answered,
        "Agent.Abort with the cluster's admin certificate should be answered: {good:?}\n{}",
        c.diag()
    );
    let bad = call_agent(&c, 1, &other);
    assert!(
        bad.0 != Outcome::Answered,
        "Agent.Abort with a certificate of another CA should fail in the handshake: {bad:?}\n{}",
        c.diag()
    );
    eprintln!("with the cluster's admin certificate: {good:?}; with another CA's: {bad:?}");
}

/// Periodic checkpoints with retention and incremental images: with
/// `--interval 1 --keep 2 --incremental on` the coordinator checkpoints the
/// running ring every second, each image of a member refers to the
/// member's previous one, and all but the last two are removed (their
/// pages folded into the images that need them). The last one, taken with
/// --kill, restarts the ring from its chain.
#[test]
fn periodic_incremental_with_retention() {
    let h = Harness::new("cluster-periodic");
    let c = cluster(&h);
    let mut ring = c.start_ring(JOB, &PLACEMENT);
    ring.wait_advanced(MARGIN, "before the periodic checkpoints");
    c.crctl(&[
        "job",
        JOB,
        "--interval",
        "1",
        "--keep",
        "2",
        "--incremental",
        "on",
        "--save-files",
        "64K",
    ])
    .assert_success("crctl job --interval 1 --keep 2 --incremental on");
    let all = || {
        jlist(&c.crctl_json(&["checkpoints", JOB, "--all"]), "checkpoints")
            .into_iter()
            .cloned()
            .collect::<Vec<Value>>()
    };
    let count = |v: &[Value], st: &str| v.iter().filter(|x| jstr(x, "state") == st).count();
    wait_until(
        "four periodic checkpoints, two of them removed by retention",
        Duration::from_secs(30),
        || {
            let v = all();
            count(&v, "committed") == 2 && count(&v, "removed") >= 2
        },
        || format!("{:#?}\n{}", all(), ring.diag()),
    );
    c.crctl(&["job", JOB, "--interval", "0"])
        .assert_success("crctl job --interval 0");
    ring.assert_no_fail();
    // Removed checkpoints have no images left; committed ones are intact
    // chains (the newest refers to its predecessor).
    let v = all();
    for ck in &v {
        for img in jlist(ck, "images") {
            let dir = PathBuf::from(jstr(img, "dir"));
            match jstr(ck, "state").as_str() {
                "removed" => ensure(
                    &ring,
                    !dir.exists(),
                    &format!("{} of a removed checkpoint still exists", dir.display()),
                ),
                "committed" => {
                    h.cr_image(&["verify".as_ref(), dir.as_os_str()])
                        .assert_success("cr_image verify of a kept image");
                }
                _ => {}
            }
        }
    }
    // The last checkpoint (with --kill, retried while a periodic one ends)
    // is incremental too, and the ring restarts from it.
    let mut info = Value::Null;
    wait_until(
        "crctl checkpoint --kill to run (not busy)",
        Duration::from_secs(20),
        || {
            let out = c.crctl(&["--json", "checkpoint", JOB, "--kill"]);
            if out.status.success() {
                info = serde_json::from_str(&out.stdout).unwrap_or(Value::Null);
                return true;
            }
            assert!(
                out.stderr.contains("busy"),
                "crctl checkpoint --kill failed\n{}",
                out.show()
            );
            false
        },
        || ring.diag(),
    );
    ring.wait_gone("after checkpoint --kill");
    let snap = ring.mins();
    let img = jlist(&info, "images")
        .first()
        .map(|i| jstr(i, "dir"))
        .unwrap_or_default();
    let stats = h.cr_image(&["stats".as_ref(), "--json".as_ref(), img.as_ref()]);
    stats.assert_success("cr_image stats --json");
    let st: Value = serde_json::from_str(&stats.stdout).expect("cr_image stats --json");
    ensure(
        &ring,
        st["parent"].as_str().is_some_and(|p| !p.is_empty()),
        &format!(
            "the last image should have a parent (incremental): {}",
            stats.stdout
        ),
    );
    let out = c.crctl(&["restart", JOB]);
    if !out.status.success() {
        panic!("crctl restart failed\n{}\n{}", out.show(), ring.diag());
    }
    ring.adopt();
    ring.wait_past(&snap, MARGIN, "after the restart from an incremental chain");
    ring.assert_on_nodes(&PLACEMENT, "after the restart from an incremental chain");
    ring.assert_no_fail();
}

/// `Coordinator.Register` of node `node` made from n3's namespace with the
/// certificate `cert` of the cluster's pki; the status code (Ok: None).
fn register_as(c: &Cluster, cert: &str, node: &str) -> Option<tonic::Code> {
    let files = TlsFiles {
        ca: Some(c.pki.join("ca.crt")),
        cert: Some(c.pki.join(format!("{cert}.crt"))),
        key: Some(c.pki.join(format!("{cert}.key"))),
        insecure: false,
    };
    let node = node.to_string();
    c.ns(3).run(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        rt.block_on(async move {
            let sec = Security::load(&files).expect("certificates");
            let addr = format!(
                "{}:{}",
                cr_tests::cluster::COORDINATOR_IP,
                cr_tests::cluster::COORDINATOR_PORT
            );
            let ch = cr_rpc::channel::connect(
                &addr,
                &sec,
                cr_rpc::COORDINATOR_NAME,
                Duration::from_secs(5),
            )
            .await
            .expect("a channel to the coordinator");
            let mut cl = cr_rpc::pb::coordinator_client::CoordinatorClient::new(ch);
            let req = cr_rpc::pb::RegisterRequest {
                node,
                agent_addr: format!("{}:{AGENT_PORT}", node_ip(3)),
                addresses: vec![node_ip(3)],
                version: "test".into(),
                ..Default::default()
            };
            match cl.register(req).await {
                Ok(_) => None,
                Err(s) => Some(s.code()),
            }
        })
    })
}

/// Identities are bound to certificates: a node's certificate registers
/// only its own node (n3's cannot take over n1, which stays pointed at its
/// agent), the administrator's registers no node, a node's certificate is
/// refused for administration (crctl says so in one line), and an agent
/// takes calls only from the coordinator's certificate.
#[test]
fn identities_bound_to_certificates() {
    let h = Harness::new("cluster-identity");
    let c = cluster(&h);
    let before = c.crctl_json(&["nodes"]);
    let addr_of = |v: &Value, n: &str| {
        jlist(v, "nodes")
            .into_iter()
            .find(|x| jstr(x, "name") == n)
            .map(|x| jstr(x, "agent_addr"))
    };
    // n3's certificate registering as n1.
    let code = register_as(&c, "n3", "n1");
    assert_eq!(
        code,
        Some(tonic::Code::PermissionDenied),
        "Register of n1 with n3's certificate must be refused\n{}",
        c.diag()
    );
    // The administrator's certificate registering any node.
    let code = register_as(&c, "admin", "n9");
    assert_eq!(
        code,
        Some(tonic::Code::PermissionDenied),
        "Register with the administrator's certificate must be refused"
    );
    // n3's own certificate registering n3 is fine.
    assert_eq!(register_as(&c, "n3", "n3"), None, "n3 registers as n3");
    let after = c.crctl_json(&["nodes"]);
    assert_eq!(
        addr_of(&before, "n1"),
        addr_of(&after, "n1"),
        "n1 must still point at its own agent: {after:#}"
    );
    assert!(
        jlist(&after, "nodes")
            .iter()
            .all(|x| jstr(x, "name") != "n9"),
        "no node n9: {after:#}"
    );
    // A node's certificate used for administration.
    let out = c.crctl_as("n1", &["jobs"]);
    let line = out.assert_error(
        "crctl jobs with n1's certificate",
        CRCTL_ERR,
        &["administrator"],
    );
    eprintln!("crctl with a node's certificate: {line}");
    // An agent called with the administrator's certificate.
    let (outcome, said) = call_agent(&c, 1, &c.pki);
    assert!(
        outcome == Outcome::Answered && said.contains("PermissionDenied"),
        "an agent must refuse a call made with the administrator's certificate: {said}"
    );
}

/// crctl's errors are one line, never a raw transport or TLS message: the
/// coordinator down, plain TCP against TLS, a certificate of another CA.
#[test]
fn crctl_errors_are_one_line() {
    let h = Harness::new("cluster-errors");
    let c = Cluster::new(&h, 1);
    c.start_coordinator();
    let other: PathBuf = h.dir.join("pki-other");
    c.make_pki(&other, &[("admin".to_string(), None)]);
    let addr = format!(
        "{}:{}",
        cr_tests::cluster::COORDINATOR_IP,
        cr_tests::cluster::COORDINATOR_PORT
    );
    let runs: Vec<(&str, ToolOutputArgs)> = vec![
        (
            "--insecure against TLS",
            vec![
                "--coordinator".into(),
                addr.clone(),
                "--insecure".into(),
                "status".into(),
            ],
        ),
        (
            "a certificate of another CA",
            vec![
                "--coordinator".into(),
                addr.clone(),
                "--ca".into(),
                c.pki.join("ca.crt").display().to_string(),
                "--cert".into(),
                other.join("admin.crt").display().to_string(),
                "--key".into(),
                other.join("admin.key").display().to_string(),
                "status".into(),
            ],
        ),
    ];
    for (what, args) in runs {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = c.crctl_raw(&a);
        let line = out.assert_error(what, CRCTL_ERR, &["coordinator"]);
        assert!(
            !line.contains("transport error")
                && !line.contains("https://")
                && !line.to_lowercase().contains("rustls")
                && !line.contains("broken pipe"),
            "{what}: crctl should say in words what is wrong: {line}"
        );
        eprintln!("{what}: {line}");
    }
    c.kill_coordinator();
    let out = c.crctl(&["status"]);
    let line = out.assert_error(
        "the coordinator down",
        CRCTL_ERR,
        &["coordinator", "refused"],
    );
    eprintln!("coordinator down: {line}");
}

type ToolOutputArgs = Vec<String>;

/// (g) Uncoordinated checkpoints (docs/PROTOCOLS.md): a ring of 3 members
/// whose exchanges come in bursts (`WL_RING_PHASES`: 1.5 s of writes every
/// 6 s, then quiet) in mode `uncoordinated`, each member checkpointed on
/// its own every ~1 s while the others run on. `crctl recovery-line` finds
/// a checkpoint of every member on the line, the checkpoints wholly behind
/// it are removed as garbage, and a member checkpointed mid-exchange has a
/// checkpoint after the line; the members are then killed (no checkpoint of
/// the whole job) and `crctl restart --line` resumes each from its own
/// checkpoint (that member rolled back past its latest): every member
/// checks every byte of both its connections.
#[test]
fn uncoordinated_restart_from_the_recovery_line() {
    let h = Harness::new("cluster-uncoordinated");
    let c = cluster(&h);
    let placement = [1, 2, 3];
    let env = [("WL_RING_PHASES".to_string(), "6000:1500".to_string())];
    let mut ring = c.start_ring_env(JOB, &placement, &env);
    ring.wait_advanced(MARGIN, "before the member checkpoints");
    // Incremental: each member checkpoint on that member's previous one;
    // the garbage behind the line is folded into what depends on it. A
    // member caught between writing its STATUS.tmp and renaming it has the
    // file saved (it is gone, renamed, by the restart otherwise).
    c.crctl(&[
        "job",
        JOB,
        "--mode",
        "uncoordinated",
        "--interval",
        "1",
        "--incremental",
        "on",
        "--save-files",
        "64K",
    ])
    .assert_success(
        "crctl job --mode uncoordinated --interval 1 --incremental on --save-files 64K",
    );
    let line = || c.crctl_json(&["recovery-line", JOB]);
    let all = || c.crctl_json(&["checkpoints", JOB, "--all"]);
    let garbage = |v: &Value| {
        jlist(v, "checkpoints").into_iter().any(|ck| {
            jstr(ck, "state") == "removed"
                && jlist(ck, "notes")
                    .iter()
                    .any(|n| n.as_str().is_some_and(|n| n.contains("recovery line")))
        })
    };
    wait_until(
        "a recovery line through a checkpoint of every member, garbage behind it, and a member checkpointed mid-exchange after it",
        Duration::from_secs(120),
        || {
            let l = line();
            jlist(&l, "members").len() == placement.len()
                && jlist(&l, "members")
                    .iter()
                    .all(|m| !jstr(m, "checkpoint").is_empty())
                && jlist(&l, "members")
                    .iter()
                    .any(|m| ju64(m, "rolled_back") > 0)
                && garbage(&all())
        },
        || format!("{:#}\n{:#}\n{}", line(), all(), ring.diag()),
    );
    ring.assert_no_fail();
    // Every member checkpoint is one member's image, taken while the others
    // ran on.
    for ck in jlist(&all(), "checkpoints") {
        if jstr(ck, "scope") == "member" && jstr(ck, "state") == "committed" {
            ensure(
                &ring,
                jlist(ck, "images").len() == 1,
                &format!("a member checkpoint should have one image: {ck:#}"),
            );
        }
    }
    c.crctl(&["job", JOB, "--interval", "0"])
        .assert_success("crctl job --interval 0");
    c.wait_job_idle(JOB);
    // The kept member images are whole chains, and some are incremental
    // on their member's previous image.
    let mut incremental = 0;
    for ck in jlist(&all(), "checkpoints") {
        if jstr(ck, "state") != "committed" {
            continue;
        }
        for img in jlist(ck, "images") {
            let dir = jstr(img, "dir");
            h.cr_image(&["verify".as_ref(), dir.as_ref()])
                .assert_success("cr_image verify of a kept member image");
            let stats = h.cr_image(&["stats".as_ref(), "--json".as_ref(), dir.as_ref()]);
            let st: Value = serde_json::from_str(&stats.stdout).expect("cr_image stats --json");
            if st["parent"].as_str().is_some_and(|p| !p.is_empty()) {
                incremental += 1;
            }
        }
    }
    ensure(
        &ring,
        incremental > 0,
        &format!("some member checkpoint should be incremental: {:#}", all()),
    );
    let snap = ring.mins();
    ring.kill_all();
    c.wait_members_gone(JOB);
    // A member killed after a peer may have seen it go and written FAIL:
    // not held against the members restored from the line.
    ring.forget_statuses();
    let before = line();
    eprintln!(
        "recovery line: {:?}",
        jlist(&before, "members")
            .iter()
            .map(|m| format!(
                "{}:{} {} (rolls back {} of {})",
                jstr(m, "node"),
                ju64(m, "pid"),
                jstr(m, "checkpoint"),
                ju64(m, "rolled_back"),
                ju64(m, "checkpoints")
            ))
            .collect::<Vec<_>>()
    );
    let mut out = None;
    wait_until(
        "crctl restart --line to run (not busy)",
        Duration::from_secs(30),
        || {
            let o = c.crctl(&["--json", "restart", JOB, "--line"]);
            if o.status.success() || !o.stderr.contains("busy") {
                out = Some(o);
                return true;
            }
            false
        },
        || c.diag(),
    );
    let out = out.unwrap();
    if !out.status.success() {
        panic!(
            "crctl restart --line failed\n{}\nline: {before:#}\n{}",
            out.show(),
            ring.diag()
        );
    }
    let reply: Value = serde_json::from_str(&out.stdout).expect("crctl --json restart");
    ensure(
        &ring,
        jstr(&reply, "checkpoint") == format!("{JOB}-line"),
        &format!("the restart should be from the line: {reply:#}"),
    );
    ring.adopt();
    // The line lies some bursts behind the kill: a longer wait than
    // `wait_past`'s, every status checked for FAIL meanwhile.
    wait_until(
        "every member to advance past its count at the kill",
        Duration::from_secs(90),
        || {
            ring.assert_no_fail();
            ring.statuses()
                .iter()
                .zip(&snap)
                .all(|(s, &base)| s.min() >= base + MARGIN)
        },
        || ring.diag(),
    );
    ring.assert_on_nodes(&placement, "after the restart from the recovery line");
    ring.assert_running_untraced("after the restart from the recovery line");
    ring.assert_no_fail();
}

/// (h) Non-blocking coordinated checkpoints (the job's mode): each member
/// is frozen only for its own dump while the others run on, its
/// connections held until every member is dumped; the members are then
/// killed and the job restarted from that checkpoint: every member checks
/// every byte of both its connections from there on.
#[test]
fn non_blocking_checkpoint_and_restart() {
    let h = Harness::new("cluster-non-blocking");
    let c = cluster(&h);
    let mut ring = c.start_ring(JOB, &PLACEMENT);
    ring.wait_advanced(MARGIN, "before the checkpoint");
    // Its status file's .tmp, should a member have it open, is saved.
    c.crctl(&["job", JOB, "--mode", "non-blocking", "--save-files", "64K"])
        .assert_success("crctl job --mode non-blocking --save-files 64K");
    let refused = c.crctl(&["checkpoint", JOB, "--kill"]);
    ensure(
        &ring,
        !refused.status.success() && refused.stderr.contains("non-blocking"),
        &format!(
            "checkpoint --kill of a non-blocking job should be refused naming why\n{}",
            refused.show()
        ),
    );
    let info = checkpoint(&c, &ring, &[]);
    eprintln!(
        "non-blocking checkpoint: longest member pause {} ms, connections held at most {} ms, dump round {} ms; per member: {:?}",
        ju64(&info, "pause_ms"),
        ju64(&info, "held_ms"),
        ju64(&info, "dump_ms"),
        jlist(&info, "images")
            .iter()
            .map(|i| format!("{}:{} {} ms", jstr(i, "node"), ju64(i, "pid"), ju64(i, "frozen_ms")))
            .collect::<Vec<_>>()
    );
    ensure(
        &ring,
        info["non_blocking"].as_bool() == Some(true)
            && ju64(&info, "held_ms") >= ju64(&info, "pause_ms"),
        &format!("the checkpoint should be non-blocking, its locks held at least as long as any pause: {info:#}"),
    );
    let id = jstr(&info, "id");
    ring.wait_advanced(MARGIN, "after the non-blocking checkpoint");
    ring.assert_running_untraced("after the non-blocking checkpoint");
    let snap = ring.mins();
    ring.kill_all();
    c.wait_members_gone(JOB);
    let out = c.crctl(&["restart", JOB, "--checkpoint", &id]);
    if !out.status.success() {
        panic!("crctl restart failed\n{}\n{}", out.show(), ring.diag());
    }
    ring.adopt();
    ring.wait_past(
        &snap,
        MARGIN,
        "after the restart from the non-blocking checkpoint",
    );
    ring.assert_on_nodes(&PLACEMENT, "after the restart");
    ring.assert_running_untraced("after the restart");
    ring.assert_no_fail();
}
