//! Fault injection into the coordinated protocol (docs/CLUSTER.md,
//! "Guarantees and bounds"): the agent of a node or the coordinator is
//! killed, or a node's link cut, at each step (PREPARE, DUMP, COMMIT,
//! FINISH, RESTORE), for checkpoints that continue and that kill, with
//! members started by cr_run and restored by the agents. Each test shares
//! one cluster across its scenarios (CI time); the fault points are the
//! daemons' test hooks (`CR_AGENT_FAULT=@FILE`, `CR_COORD_FAULT=@FILE`:
//! the step is read from a file the test writes before each scenario).
//!
//! Every scenario asserts what the issue asks for:
//! * no member harmed: the ring (`wl_ring`, which checks every byte of
//!   every connection and FAILs on a gap, a duplicate, an error or an EOF)
//!   advances again and reports no FAIL;
//! * nothing partial: an aborted checkpoint is listed aborted and has no
//!   image left; a committed one has every image (`cr_image verify`); a
//!   failed restart leaves no member running;
//! * crctl tells the truth: its exit status and its one line (or notes)
//!   say what happened on each node;
//! * no member frozen after the bound: every surviving member runs
//!   untraced within the freeze bound (or the lock's lease) plus a margin,
//!   and the time it took is printed (the measured bounds);
//! * no leftover lock: once the daemons are back, no `cr_lock_*` table of
//!   a session and no `cr_reset_guard` is left on any node.

use cr_tests::cluster::{jlist, jstr, node_name, AgentOpts, Cluster, Ring, RingStatus};
use cr_tests::faults::{run_to_fault, Faults};
use cr_tests::{proc_status, wait_until, Harness, ToolOutput};
use serde_json::Value;
use std::time::{Duration, Instant};

const JOB: &str = "ring";
/// One member per node; n2 is the one that fails.
const PLACEMENT: [usize; 3] = [1, 2, 3];
/// The member on the failing node.
const VICTIM: usize = 1;
const VICTIM_NODE: usize = 2;
/// Messages each member must carry to count as advancing.
const MARGIN: u64 = 2000;
/// The coordinator's freeze bound in these tests.
const FREEZE_MS: u64 = 6000;
/// Slack on top of a bound for a loaded machine.
const SLACK: Duration = Duration::from_secs(6);
const CRCTL_ERR: &str = "crctl: error: ";

/// A 3-node cluster whose coordinator runs with the test's freeze bound
/// and whose n2 agent (and coordinator) carry the fault hooks.
fn cluster<'h>(h: &'h Harness, f: &Faults) -> Cluster<'h> {
    let c = Cluster::new(h, 3);
    start_coordinator(&c, f);
    c.start_agents(&[1, 3]);
    start_victim_agent(&c, f);
    c
}

fn start_coordinator(c: &Cluster, f: &Faults) {
    c.start_coordinator_with(
        &f.coord_env(),
        &["--freeze-timeout-ms", &FREEZE_MS.to_string()],
    );
}

fn start_victim_agent(c: &Cluster, f: &Faults) {
    c.start_agent_with(
        VICTIM_NODE,
        &AgentOpts {
            env: f.agent_env(),
            ..Default::default()
        },
    );
}

fn ensure(ring: &Ring, cond: bool, msg: &str) {
    if !cond {
        panic!("{msg}\n{}", ring.diag());
    }
}

/// What a checkpoint asks for at the end.
#[derive(Clone, Copy, PartialEq, Debug)]
enum After {
    Continue,
    Kill,
}

impl After {
    fn args(self) -> Vec<&'static str> {
        match self {
            After::Continue => vec!["checkpoint", JOB],
            After::Kill => vec!["checkpoint", JOB, "--kill"],
        }
    }
}

/// Member `i` runs, untraced and not stopped.
fn running_untraced(ring: &Ring, i: usize) -> bool {
    let p = ring.find_pids(i);
    p.len() == 1
        && proc_status(p[0])
            .is_some_and(|s| s.tracer_pid == 0 && !matches!(s.state, 't' | 'T' | 'Z' | 'X'))
}

/// Waits until every member of `which` runs untraced (within `bound` +
/// slack); returns how long it took from `since`.
fn wait_thawed(
    ring: &Ring,
    which: &[usize],
    since: Instant,
    bound: Duration,
    what: &str,
) -> Duration {
    wait_until(
        &format!("members {which:?} to run untraced {what}"),
        bound + SLACK,
        || which.iter().all(|&i| running_untraced(ring, i)),
        || ring.diag(),
    );
    let took = since.elapsed();
    eprintln!("MEASURED: members {which:?} ran untraced {took:?} after {what}");
    took
}

/// Waits until the whole ring advances (its connections flow again);
/// returns how long it took from `since`.
fn wait_flowing(ring: &Ring, since: Instant, what: &str) -> Duration {
    ring.wait_advanced(MARGIN, what);
    let took = since.elapsed();
    eprintln!("MEASURED: the ring flowed again {took:?} after {what}");
    took
}

/// The checkpoint `id` as listed with --all.
fn listed(c: &Cluster, id: &str) -> Option<Value> {
    let v = c.crctl_json(&["checkpoints", JOB, "--all"]);
    jlist(&v, "checkpoints")
        .into_iter()
        .find(|x| jstr(x, "id") == id)
        .cloned()
}

/// The newest checkpoint of the job (any state).
fn newest(c: &Cluster) -> Value {
    let v = c.crctl_json(&["checkpoints", JOB, "--all"]);
    jlist(&v, "checkpoints")
        .last()
        .cloned()
        .cloned()
        .unwrap_or_else(|| panic!("no checkpoint of {JOB} listed: {v:#}\n{}", c.diag()))
}

/// Asserts the newest checkpoint is aborted with a reason and its images
/// are gone (nothing partial).
fn assert_aborted_clean(c: &Cluster, ring: &Ring) -> String {
    let ck = newest(c);
    let id = jstr(&ck, "id");
    ensure(
        ring,
        jstr(&ck, "state") == "aborted" && !jstr(&ck, "error").is_empty(),
        &format!("checkpoint {id} should be aborted with a reason: {ck:#}"),
    );
    let dir = c.images().join(JOB).join(&id);
    wait_until(
        &format!(
            "the images of the aborted {id} to be removed ({})",
            dir.display()
        ),
        Duration::from_secs(20),
        || std::fs::read_dir(&dir).map_or(true, |mut d| d.next().is_none()),
        || ring.diag(),
    );
    id
}

/// Asserts checkpoint `ck` is committed with every image intact.
fn assert_committed_intact(c: &Cluster, ring: &Ring, ck: &Value) {
    let id = jstr(ck, "id");
    let l = listed(c, &id).unwrap_or(Value::Null);
    ensure(
        ring,
        jstr(&l, "state") == "committed" && jlist(&l, "images").len() == ring.len(),
        &format!("{id} should be committed with {} images: {l:#}", ring.len()),
    );
    for img in jlist(&l, "images") {
        let dir = jstr(img, "dir");
        c.h.cr_image(&["verify".as_ref(), dir.as_ref()])
            .assert_success(&format!("cr_image verify {dir} of the committed {id}"));
    }
}

/// No `cr_lock_*` table of a session (leased) and no reset guard on any
/// node; image locks of killed members (`keep`) are allowed when given.
fn assert_no_leftover_locks(c: &Cluster, ring: &Ring, allowed: &[String]) {
    wait_until(
        "no session lock and no reset guard left on any node",
        Duration::from_secs(30),
        || {
            (1..=c.nodes).all(|k| {
                c.nft_tables(k).iter().all(|t| {
                    allowed.contains(t) || (!t.starts_with("cr_lock_") && t != "cr_reset_guard")
                })
            })
        },
        || {
            let t: Vec<(usize, Vec<String>)> =
                (1..=c.nodes).map(|k| (k, c.nft_tables(k))).collect();
            format!("tables: {t:?} (allowed {allowed:?})\n{}", ring.diag())
        },
    );
}

/// crctl failed with one line naming `words`.
fn assert_one_line_error(out: &ToolOutput, ctx: &str, words: &[&str]) -> String {
    let line = out.assert_error(ctx, CRCTL_ERR, words);
    assert!(
        !line.contains("transport error") && !line.contains("https://") && !line.contains("rustls"),
        "{ctx}: crctl printed a raw transport message: {line}"
    );
    line
}

/// Kill the member left running on the victim node, as an operator would
/// before restarting the job, and destroy its sockets (`ss -K`): killed
/// normally, they would linger in FIN-WAIT (their peers' images hold their
/// packets) and take the addresses its restored self needs.
fn kill_survivor(c: &Cluster, ring: &mut Ring) {
    ring.kill_member(VICTIM);
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &c.ns(VICTIM_NODE).name, "ss", "-K"])
        .args(["( sport >= :7300 and sport < :7400 ) or ( dport >= :7300 and dport < :7400 )"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run ss -K");
    eprintln!(
        "ss -K in n2: {} {}",
        String::from_utf8_lossy(&out.stdout).lines().count(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Waits until the coordinator knows no live member of the job (a member
/// killed by the test is reported gone by its node's next heartbeat).
fn wait_no_live_member(c: &Cluster, ring: &Ring) {
    wait_until(
        "the coordinator to know no live member of the job",
        Duration::from_secs(20),
        || c.job_procs(JOB).iter().all(|(_, _, alive)| !alive),
        || format!("{:?}\n{}", c.job_procs(JOB), ring.diag()),
    );
}

/// Restart the job (every member dead) and adopt the restored members.
/// A checkpoint --kill that goes as planned, once the ring has moved on:
/// the members' progress at that point, with no member left alive.
fn clean_kill(c: &Cluster, ring: &mut Ring) -> Vec<u64> {
    ring.wait_advanced(MARGIN, "before the clean --kill");
    c.crctl_json(&["checkpoint", JOB, "--kill"]);
    ring.wait_gone("after the clean --kill");
    let snap = ring.mins();
    wait_no_live_member(c, ring);
    snap
}

fn restart(c: &Cluster, ring: &mut Ring, snap: &[u64], what: &str) {
    wait_no_live_member(c, ring);
    let out = c.crctl(&["restart", JOB]);
    if !out.status.success() {
        panic!(
            "crctl restart {what} failed\n{}\n{}",
            out.show(),
            ring.diag()
        );
    }
    ring.adopt();
    ring.wait_past(snap, MARGIN, what);
    ring.assert_running_untraced(what);
    ring.assert_no_fail();
}

/// The counts every member reached (FAILs are not allowed).
/// Kill the agent of n2 at `step` of a checkpoint that ends with `after`;
/// assert the outcome; bring the agent back. Returns the checkpoint's
/// final listing.
fn agent_dies_in_checkpoint(
    c: &Cluster,
    f: &Faults,
    ring: &mut Ring,
    step: &str,
    after: After,
) -> Value {
    let what = format!("the agent of n2 killed at {step} of a checkpoint ({after:?})");
    eprintln!("=== scenario: {what}");
    ring.wait_advanced(MARGIN, &format!("before: {what}"));
    std::fs::write(&f.agent_ctl, step).unwrap();
    let mut ck = run_to_fault(c, ring, &after.args(), &f.agent_reached);
    let t_kill = Instant::now();
    c.kill_agent(VICTIM_NODE);
    f.clear();
    let others: Vec<usize> = (0..ring.len()).filter(|&i| i != VICTIM).collect();
    let committed = matches!(step, "commit" | "finish");
    // The victim's member was let go by the kernel when its tracer died.
    wait_thawed(
        ring,
        &[VICTIM],
        t_kill,
        Duration::ZERO,
        &format!("{what} (n2)"),
    );
    if !committed {
        // Aborted at once: the other nodes thaw.
        wait_thawed(
            ring,
            &others,
            t_kill,
            Duration::ZERO,
            &format!("{what} (other nodes)"),
        );
    }
    let out = ck.wait(Duration::from_secs(90), || ring.diag());
    if !committed {
        // crctl says it was aborted, naming n2; nobody was killed.
        assert_one_line_error(&out, &what, &["n2"]);
        // Its lock lifts with its lease, before any restart of the agent.
        wait_flowing(ring, t_kill, &format!("{what} (lease of n2's lock)"));
    } else {
        // Committed: crctl tells that n2 did not finish.
        let first = out.stdout.lines().next().unwrap_or("").to_string();
        ensure(
            ring,
            first.contains("committed") && out.stdout.contains("n2 could not finish"),
            &format!(
                "{what}: crctl should say committed and that n2 could not finish\n{}",
                out.show()
            ),
        );
        match after {
            After::Continue => ensure(
                ring,
                out.status.success(),
                &format!(
                    "{what}: a continue carried out everywhere exits 0\n{}",
                    out.show()
                ),
            ),
            After::Kill => ensure(
                ring,
                out.status.code() == Some(2) && out.stderr.contains("n2"),
                &format!(
                    "{what}: a kill not carried out on n2 exits 2 naming it\n{}",
                    out.show()
                ),
            ),
        }
        if after == After::Continue {
            wait_thawed(
                ring,
                &others,
                t_kill,
                Duration::ZERO,
                &format!("{what} (others)"),
            );
            wait_flowing(ring, t_kill, &format!("{what} (lease of n2's lock)"));
        }
    }
    ring.assert_no_fail();
    start_victim_agent(c, f);
    let ck = newest(c);
    if committed {
        assert_committed_intact(c, ring, &ck);
    } else {
        // n2's images go with the sweep of its agent's start.
        assert_aborted_clean(c, ring);
    }
    ck
}

/// (1) The agent of n2 killed at each step, with started members, then
/// with restored ones (the first checkpoint after a restart hung in 1 of
/// 24 runs when the reaper took a ptrace stop; an agent killed during a
/// --kill of restored members killed one), and at RESTORE.
#[test]
fn agent_killed_at_each_step() {
    let h = Harness::new("faults-agent");
    let f = Faults::new(&h.dir);
    let c = cluster(&h, &f);
    let mut ring = c.start_ring(JOB, &PLACEMENT);

    agent_dies_in_checkpoint(&c, &f, &mut ring, "prepare", After::Continue);
    assert_no_leftover_locks(&c, &ring, &[]);
    agent_dies_in_checkpoint(&c, &f, &mut ring, "dump", After::Kill);
    assert_no_leftover_locks(&c, &ring, &[]);

    // Killed at FINISH once the commit is recorded on n2, before anything
    // is let go: committed; n1 and n3 killed, n2's member still running
    // (never killed but by a FINISH carried out).
    let ck = agent_dies_in_checkpoint(&c, &f, &mut ring, "commit", After::Kill);
    let others: Vec<usize> = (0..ring.len()).filter(|&i| i != VICTIM).collect();
    wait_until(
        "the members on n1 and n3 to be gone (killed by FINISH)",
        Duration::from_secs(20),
        || others.iter().all(|&i| ring.find_pids(i).is_empty()),
        || ring.diag(),
    );
    ensure(
        &ring,
        running_untraced(&ring, VICTIM),
        "n2's member must still run after its agent died before FINISH",
    );
    let snap = ring.mins();
    kill_survivor(&c, &mut ring);
    assert_committed_intact(&c, &ring, &ck);
    restart(&c, &mut ring, &snap, "after the partial --kill");
    assert_no_leftover_locks(&c, &ring, &[]);

    // Restored members from here on.
    agent_dies_in_checkpoint(&c, &f, &mut ring, "dump", After::Continue);
    assert_no_leftover_locks(&c, &ring, &[]);
    agent_dies_in_checkpoint(&c, &f, &mut ring, "prepare", After::Kill);
    assert_no_leftover_locks(&c, &ring, &[]);
    agent_dies_in_checkpoint(&c, &f, &mut ring, "finish", After::Continue);
    assert_no_leftover_locks(&c, &ring, &[]);

    // RESTORE: a clean --kill, then a restart during which n2's agent dies
    // with its trees rebuilt: the restart fails naming n2, nothing runs.
    let snap = clean_kill(&c, &mut ring);
    std::fs::write(&f.agent_ctl, "restore").unwrap();
    let mut rs = run_to_fault(&c, &ring, &["restart", JOB], &f.agent_reached);
    c.kill_agent(VICTIM_NODE);
    f.clear();
    let out = rs.wait(Duration::from_secs(90), || ring.diag());
    assert_one_line_error(&out, "restart with n2's agent killed at RESTORE", &["n2"]);
    wait_until(
        "no member of the failed restart to run",
        Duration::from_secs(20),
        || (0..ring.len()).all(|i| ring.find_pids(i).is_empty()),
        || ring.diag(),
    );
    start_victim_agent(&c, &f);
    restart(&c, &mut ring, &snap, "after the failed restart");

    // The first checkpoint of restored members commits (no wait stolen).
    ring.wait_advanced(MARGIN, "before the last checkpoint");
    let info = c.crctl_json(&["checkpoint", JOB]);
    ensure(
        &ring,
        jstr(&info, "state") == "committed",
        &format!("the checkpoint of restored members should commit: {info:#}"),
    );
    ring.wait_advanced(MARGIN, "after the last checkpoint");
    ring.assert_running_untraced("at the end");
    assert_no_leftover_locks(&c, &ring, &[]);
}

/// Kill the coordinator at `step` (its own fault point, reached when the
/// step is done on every node); crctl fails in one line; the agents,
/// having lost it, let their members run on within LOST + slack. Returns
/// the time the members took to run untraced.
fn coordinator_dies(c: &Cluster, f: &Faults, ring: &Ring, step: &str, args: &[&str]) -> ToolOutput {
    let what = format!("the coordinator killed at {step} ({args:?})");
    eprintln!("=== scenario: {what}");
    std::fs::write(&f.coord_ctl, step).unwrap();
    let mut ck = run_to_fault(c, ring, args, &f.coord_reached);
    let t_kill = Instant::now();
    c.kill_coordinator();
    f.clear();
    if step != "restore" {
        let all: Vec<usize> = (0..ring.len()).collect();
        wait_thawed(ring, &all, t_kill, Duration::from_secs(4), &what);
    }
    let out = ck.wait(Duration::from_secs(60), || ring.diag());
    assert_one_line_error(&out, &what, &["coordinator"]);
    start_coordinator(c, f);
    c.wait_nodes_up(&[1, 2, 3]);
    out
}

/// (2) The coordinator killed at each step.
#[test]
fn coordinator_killed_at_each_step() {
    let h = Harness::new("faults-coord");
    let f = Faults::new(&h.dir);
    let c = cluster(&h, &f);
    let mut ring = c.start_ring(JOB, &PLACEMENT);

    for (step, after) in [("prepare", After::Continue), ("dump", After::Kill)] {
        ring.wait_advanced(MARGIN, &format!("before {step}"));
        let t0 = Instant::now();
        coordinator_dies(&c, &f, &ring, step, &after.args());
        wait_flowing(&ring, t0, &format!("the coordinator killed at {step}"));
        let ck = newest(&c);
        ensure(
            &ring,
            jstr(&ck, "state") == "aborted",
            &format!("the checkpoint the coordinator lost at {step} is aborted: {ck:#}"),
        );
        assert_no_leftover_locks(&c, &ring, &[]);
    }

    // Killed right after the commit was recorded (no agent told): the
    // agents keep their images (in doubt) and let their members run on;
    // when the coordinator is back, the checkpoint is committed, intact,
    // and says that no node finished the --kill.
    for (step, after) in [("commit", After::Kill), ("finish", After::Kill)] {
        ring.wait_advanced(MARGIN, &format!("before {step}"));
        let t0 = Instant::now();
        coordinator_dies(&c, &f, &ring, step, &after.args());
        wait_flowing(&ring, t0, &format!("the coordinator killed at {step}"));
        let ck = newest(&c);
        assert_committed_intact(&c, &ring, &ck);
        let id = jstr(&ck, "id");
        wait_until(
            &format!("{id} to say that no node carried out the kill"),
            Duration::from_secs(30),
            || {
                let l = listed(&c, &id).unwrap_or(Value::Null);
                jlist(&l, "unfinished").len() == 3
            },
            || {
                format!(
                    "{:#}\n{}",
                    listed(&c, &id).unwrap_or(Value::Null),
                    ring.diag()
                )
            },
        );
        ring.assert_running_untraced(&format!("after the coordinator died at {step}"));
        assert_no_leftover_locks(&c, &ring, &[]);
    }

    // RESTORE: a clean --kill, the restart's trees rebuilt, then the
    // coordinator dies: the agents kill what they built.
    let snap = clean_kill(&c, &mut ring);
    coordinator_dies(&c, &f, &ring, "restore", &["restart", JOB]);
    wait_until(
        "nothing of the lost restart to run",
        Duration::from_secs(20),
        || (0..ring.len()).all(|i| ring.find_pids(i).is_empty()),
        || ring.diag(),
    );
    restart(
        &c,
        &mut ring,
        &snap,
        "after the coordinator died at RESTORE",
    );
    assert_no_leftover_locks(&c, &ring, &[]);
}

/// (3) n2's link cut at each step (its agent held at the step meanwhile;
/// at COMMIT, the coordinator, once the commit is recorded):
/// the healthy nodes thaw within seconds (the call to n2 fails on its
/// keepalive), n2 lets go on its own once it has lost the coordinator; the
/// ring flows again once the link is back.
#[test]
fn link_cut_at_each_step() {
    let h = Harness::new("faults-link");
    let f = Faults::new(&h.dir);
    let c = cluster(&h, &f);
    let mut ring = c.start_ring(JOB, &PLACEMENT);
    let others: Vec<usize> = (0..ring.len()).filter(|&i| i != VICTIM).collect();
    for (step, after) in [
        ("prepare", After::Continue),
        ("dump", After::Kill),
        ("commit", After::Kill),
    ] {
        let what = format!("n2's link cut at {step} ({after:?})");
        eprintln!("=== scenario: {what}");
        ring.wait_advanced(MARGIN, &format!("before: {what}"));
        // COMMIT is the coordinator's alone (FINISH carries it to the
        // agents): held there, before FINISH is sent.
        let (ctl, hold, reached) = match step {
            "commit" => (&f.coord_ctl, "finish", &f.coord_reached),
            _ => (&f.agent_ctl, step, &f.agent_reached),
        };
        std::fs::write(ctl, hold).unwrap();
        let mut ck = run_to_fault(&c, &ring, &after.args(), reached);
        c.cut_link(VICTIM_NODE);
        let t_cut = Instant::now();
        f.clear(); // n2's agent goes on, cut off
        if step != "commit" {
            wait_thawed(
                &ring,
                &others,
                t_cut,
                Duration::from_secs(4),
                &format!("{what} (n1, n3)"),
            );
        }
        wait_thawed(
            &ring,
            &[VICTIM],
            t_cut,
            Duration::from_secs(4),
            &format!("{what} (n2)"),
        );
        let out = ck.wait(Duration::from_secs(90), || ring.diag());
        let took = t_cut.elapsed();
        eprintln!("MEASURED: crctl answered {took:?} after {what}");
        if step == "commit" {
            ensure(
                &ring,
                out.status.code() == Some(2) && out.stdout.contains("n2 could not finish"),
                &format!(
                    "{what}: committed, not carried out on n2 (exit 2)\n{}",
                    out.show()
                ),
            );
            c.restore_link(VICTIM_NODE);
            let snap = ring.mins();
            kill_survivor(&c, &mut ring);
            wait_until(
                "every member gone before the restart",
                Duration::from_secs(20),
                || (0..ring.len()).all(|i| ring.find_pids(i).is_empty()),
                || ring.diag(),
            );
            c.wait_nodes_up(&[1, 2, 3]);
            restart(&c, &mut ring, &snap, &format!("after {what}"));
        } else {
            assert_one_line_error(&out, &what, &["n2"]);
            c.restore_link(VICTIM_NODE);
            wait_flowing(&ring, t_cut, &format!("{what}, link back"));
            c.wait_nodes_up(&[1, 2, 3]);
            assert_aborted_clean(&c, &ring);
        }
        ring.assert_no_fail();
        assert_no_leftover_locks(&c, &ring, &[]);
    }
    // After all that, a checkpoint commits and the ring runs on.
    ring.wait_advanced(MARGIN, "before the last checkpoint");
    let info = c.crctl_json(&["checkpoint", JOB]);
    ensure(
        &ring,
        jstr(&info, "state") == "committed",
        &format!("the last checkpoint should commit: {info:#}"),
    );
    ring.wait_advanced(MARGIN, "after the last checkpoint");
    let _ = RingStatus::Missing;
    let _ = node_name(1);
}

/// The image root of n1 in these tests: a small tmpfs of its own, which
/// the ballast of member 0 does not fit in.
const SMALL_ROOT_MIB: u64 = 24;
/// Member 0's ballast: more than the whole image root.
const BALLAST_MIB: u64 = 64;

/// (4) Dumps in parallel, one fails: n1 dumps its four members at once
/// into an image root (a tmpfs of 24 MiB) that member 0's ballast (64 MiB)
/// cannot fit in; its dump fails (no space left), while the others' run
/// on. The whole checkpoint aborts: every member (the three of n1 whose
/// dumps ran beside the failing one, and n2's) runs on untraced, the ring
/// carries on checking every message, nothing of the images is left. With
/// room again, the next checkpoint commits, and a --kill and restart
/// rebuilds n1's four members at once.
#[test]
fn one_dump_fails_among_parallel_ones() {
    let h = Harness::new("faults-parallel-dump");
    let c = Cluster::new(&h, 2);
    c.start_coordinator_with(&[], &["--freeze-timeout-ms", &FREEZE_MS.to_string()]);
    let root = c.local_images(1);
    let root_s = root.display().to_string();
    c.run_on(1, &["mkdir", "-p", &root_s])
        .assert_success("mkdir n1's image root");
    let size = format!("size={SMALL_ROOT_MIB}m");
    c.run_on(
        1,
        &[
            "mount",
            "-t",
            "tmpfs",
            "-o",
            &size,
            "cr-small-images",
            &root_s,
        ],
    )
    .assert_success("mount a small tmpfs on n1's image root");
    c.start_agent_with(
        1,
        &AgentOpts {
            images: Some(root.clone()),
            ..Default::default()
        },
    );
    c.start_agents(&[2]);
    let placement = [1, 1, 1, 1, 2, 2];
    let mut ring = c.start_ring_ballast(JOB, &placement, &BALLAST_MIB.to_string());
    let all: Vec<usize> = (0..ring.len()).collect();
    ring.wait_advanced(MARGIN, "before the checkpoint");

    let t0 = Instant::now();
    let out = c.crctl(&["checkpoint", JOB]);
    let what = "a checkpoint whose dump of member 0 finds no space on n1";
    let line = assert_one_line_error(&out, what, &["n1"]);
    ensure(
        &ring,
        line.to_lowercase().contains("space"),
        &format!("{what}: the error should name the cause (no space): {line}"),
    );
    // Aborted at once: every member runs on, untraced.
    wait_thawed(&ring, &all, t0, Duration::ZERO, what);
    wait_flowing(&ring, t0, what);
    ring.assert_no_fail();
    let ck = newest(&c);
    let id = jstr(&ck, "id");
    ensure(
        &ring,
        jstr(&ck, "state") == "aborted" && !jstr(&ck, "error").is_empty(),
        &format!("{what}: {id} should be listed aborted with its reason: {ck:#}"),
    );
    // Nothing of it left on either node (n1's images are in its own
    // mount namespace: looked at from there).
    let n1_dir = root.join(JOB).join(&id).display().to_string();
    wait_until(
        &format!("the images of the aborted {id} to be removed on n1 ({n1_dir})"),
        Duration::from_secs(20),
        || {
            let ls = c.run_on(1, &["sh", "-c", &format!("ls -A '{n1_dir}' 2>/dev/null")]);
            ls.stdout.trim().is_empty()
        },
        || ring.diag(),
    );
    let n2_dir = c.images().join(JOB).join(&id);
    ensure(
        &ring,
        std::fs::read_dir(&n2_dir).map_or(true, |mut d| d.next().is_none()),
        &format!(
            "{what}: n2's images of {id} should be gone ({})",
            n2_dir.display()
        ),
    );
    assert_no_leftover_locks(&c, &ring, &[]);

    // Room again: the next checkpoint commits every member's image.
    c.run_on(1, &["mount", "-o", "remount,size=512m", &root_s])
        .assert_success("grow n1's image root");
    ring.wait_advanced(MARGIN, "before the checkpoint with room");
    let info = c.crctl_json(&["checkpoint", JOB]);
    ensure(
        &ring,
        jstr(&info, "state") == "committed" && jlist(&info, "images").len() == ring.len(),
        &format!("with room, the checkpoint should commit every image: {info:#}"),
    );
    ring.wait_advanced(MARGIN, "after the checkpoint with room");
    ring.assert_running_untraced("after the checkpoint with room");
    ring.assert_no_fail();
    // And back: n1 rebuilds its four members at once, every member resumes
    // where its image left it.
    let snap = clean_kill(&c, &mut ring);
    restart(
        &c,
        &mut ring,
        &snap,
        "after a --kill (n1 rebuilds 4 members at once)",
    );
}
