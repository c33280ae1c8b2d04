//! Migration and drain (docs/CLUSTER.md, "Storage", "Migration", "Drain"):
//! 3 nodes whose image roots are in their private tmpfs (the node's own
//! mount namespace: no other node can read them), ring jobs of
//! `wl_ring` members (every byte of every connection checked by the
//! members themselves: a byte lost, duplicated or corrupted, an error or
//! an EOF shows as FAIL).
//!
//! * one member migrated (`crctl migrate --member NODE:PID --to`): its
//!   image is copied by the target's agent from the source's, its peers'
//!   connections follow it to its new address; then the whole job
//!   (`--to`); then a checkpoint restarted on a node that never held it;
//! * a node with 3 jobs drained: every member moved off, the node listed
//!   drained, a new member refused there, undrained;
//! * targets chosen by placement (no `--to`, no `--on`) with one node
//!   whose cgroup leaves it almost no free memory: a member migrated, a
//!   node drained and a job restarted, each onto the node with room and
//!   never the capped one; refused in one line when no node has room;
//! * on the same cluster, checkpoints with pre-copy (`crctl checkpoint
//!   --pre-copy`, the job's `--pre-copy on`) of a ring whose member holds a
//!   checked ballast: killed and restarted, the pre-dumps removed with the
//!   last checkpoint that needs them;
//! * failures: the target's agent killed during the copy, the target's
//!   link cut during the copy, the coordinator killed between the
//!   checkpoint and the restart: the job runs on (or again) where it was,
//!   no image and no partial copy is left on the target; the source's
//!   agent killed during a post-copy (`--lazy`): the moved member is lost,
//!   and the job restarts from the migration's checkpoint.
//!
//! Each test prints `MEASURED:` lines: the downtime of each migration and
//! the copy's rate.

use cr_tests::cluster::{jlist, jstr, ju64, node_name, AgentOpts, Cluster, Ring, Spawned};
use cr_tests::faults::{run_to_fault, Faults};
use cr_tests::{read_text, wait_until, Harness};
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

/// Messages every member must carry to count as advancing.
const MARGIN: u64 = 3000;
const CRCTL_ERR: &str = "crctl: error: ";

fn ensure(ring: &Ring, cond: bool, msg: &str) {
    if !cond {
        panic!("{msg}\n{}", ring.diag());
    }
}

/// The member of `ring` running member `i`, as `NODE:PID` for crctl (the
/// PID as its node's agent sees it).
fn member_id(c: &Cluster, ring: &Ring, i: usize) -> String {
    let pid = ring.host_pids()[i];
    let procs = c.job_procs(&ring.job);
    let k = ring.nodes_now()[i].expect("member on a node");
    // The member's root is what the agent lists: cr_run made the
    // wl_ring process itself the member.
    let m = procs
        .iter()
        .find(|(n, p, alive)| *n == node_name(k) && *p == pid && *alive)
        .unwrap_or_else(|| panic!("member {i} (pid {pid}) not listed by crctl jobs: {procs:?}"));
    format!("{}:{}", m.0, m.1)
}

/// `crctl --json migrate ARGS`: its reply; prints the figures.
fn migrate(c: &Cluster, ring: &mut Ring, args: &[&str], what: &str) -> Value {
    let mut all = vec!["migrate"];
    all.extend_from_slice(args);
    let out = c.crctl(&["--json"].iter().chain(&all).copied().collect::<Vec<_>>());
    if !out.status.success() {
        panic!("crctl {all:?} failed\n{}\n{}", out.show(), ring.diag());
    }
    let r: Value = serde_json::from_str(&out.stdout).expect("crctl --json migrate");
    let (bytes, copy_ms) = (ju64(&r, "bytes"), ju64(&r, "copy_ms"));
    println!(
        "MEASURED: migration ({what}): down {} ms, {bytes} bytes copied in {copy_ms} ms ({:.1} MiB/s)",
        ju64(&r, "downtime_ms"),
        bytes as f64 / (1 << 20) as f64 / (copy_ms.max(1) as f64 / 1000.0)
    );
    ring.adopt();
    r
}

/// `crctl --json restart JOB ARGS` of `ring`'s job: its reply; prints
/// the figures of the fetch.
fn restart_fetching(c: &Cluster, ring: &mut Ring, args: &[&str], what: &str) -> Value {
    let mut all = vec!["restart", ring.job.as_str()];
    all.extend_from_slice(args);
    let r = c.crctl_json(&all);
    ring.adopt();
    println!(
        "MEASURED: restart {what}: {} ms, {} bytes fetched in {} ms",
        ju64(&r, "duration_ms"),
        ju64(&r, "fetched_bytes"),
        ju64(&r, "fetch_ms")
    );
    r
}

fn agent_opts(c: &Cluster, k: usize, env: &[(String, String)]) -> AgentOpts {
    AgentOpts {
        env: env.to_vec(),
        images: Some(c.local_images(k)),
        ..Default::default()
    }
}

/// The images (`CHECKPOINT/NODE-PID`) of `job` in node `k`'s image root,
/// as the node sees them.
fn images_on(c: &Cluster, k: usize, job: &str) -> Vec<String> {
    let root = c.local_images(k).join(job);
    let root_s = root.to_string_lossy().into_owned();
    let out = c.run_on(k, &["/usr/bin/find", &root_s, "-name", "checkpoint.img"]);
    let mut v: Vec<String> = out
        .stdout
        .lines()
        .filter_map(|l| {
            Path::new(l)
                .strip_prefix(&root)
                .ok()?
                .parent()
                .map(|p| p.to_string_lossy().into_owned())
        })
        .collect();
    v.sort();
    v
}

/// `crctl nodes` lists `node` drained (or not).
fn assert_listed(c: &Cluster, node: &str, drained: bool) {
    let nodes = c.crctl(&["nodes"]);
    assert!(
        nodes
            .stdout
            .lines()
            .any(|l| l.starts_with(node) && l.contains("drained") == drained),
        "crctl nodes should list {node} {}drained:\n{}",
        if drained { "" } else { "not " },
        nodes.show()
    );
}

/// Whether a partial copy is left in node `k`'s image root (as the node
/// sees it).
fn partial_copies(c: &Cluster, k: usize) -> bool {
    let p = c.local_images(k).join(".incoming");
    c.run_on(k, &["/usr/bin/test", "-e", &p.to_string_lossy()])
        .status
        .success()
}

/// (a) one member moved, (b) the whole job moved, (c) a restart on a node
/// that never held the image.
#[test]
fn migrate_member_then_job_then_restart_elsewhere() {
    let h = Harness::new("cluster-migrate");
    let c = Cluster::new(&h, 3);
    c.start_coordinator();
    c.start_agents_local(&[1, 2, 3], &[]);
    // Members 0 and 3 on n1 (3 connects to 0 over n1's own address).
    let placement = [1, 2, 3, 1];
    let mut ring = c.start_ring("ring", &placement);
    ring.wait_advanced(MARGIN, "before the migration");

    // (a) member 0: n1 -> n2; member 3 stays on n1 and reaches it there.
    let m0 = member_id(&c, &ring, 0);
    let snap = ring.mins();
    let r = migrate(
        &c,
        &mut ring,
        &["ring", "--member", &m0, "--to", "n2"],
        "one member",
    );
    ensure(
        &ring,
        jlist(&r, "moved").len() == 1
            && jstr(&r, "checkpoint").starts_with("ring-")
            && ju64(&r, "bytes") > 0,
        &format!("one member should be moved, its image copied by n2: {r:#}"),
    );
    let id = jstr(&r, "checkpoint");
    let copied = images_on(&c, 2, "ring");
    ensure(
        &ring,
        copied.iter().any(|i| i.starts_with(&format!("{id}/n1-"))),
        &format!("n2 should hold the copy of the n1 image of {id}: {copied:?}"),
    );
    ring.wait_past(&snap, MARGIN, "after member 0 moved to n2");
    ring.assert_on_nodes(&[2, 2, 3, 1], "after member 0 moved to n2");
    ring.assert_running_untraced("after member 0 moved");
    ring.assert_no_fail();

    // (a2) member 1: n2 -> n3 with --pre-copy (its memory copied while it
    // runs, then only what changed).
    let m1 = member_id(&c, &ring, 1);
    let snap = ring.mins();
    let r = migrate(
        &c,
        &mut ring,
        &["ring", "--member", &m1, "--to", "n3", "--pre-copy"],
        "one member, pre-copy",
    );
    ensure(
        &ring,
        ju64(&r, "rounds") >= 1 && ju64(&r, "pre_copy_bytes") > 0,
        &format!("a pre-copy migration should report its rounds and bytes: {r:#}"),
    );
    ring.wait_past(&snap, MARGIN, "after member 1 moved to n3 with pre-copy");
    ring.assert_on_nodes(&[2, 3, 3, 1], "after member 1 moved to n3");
    ring.assert_no_fail();

    // (b) the whole job to n3.
    let snap = ring.mins();
    migrate(&c, &mut ring, &["ring", "--to", "n3"], "whole job");
    ring.wait_past(&snap, MARGIN, "after the job moved to n3");
    ring.assert_on_nodes(&[3, 3, 3, 3], "after the job moved to n3");
    ring.assert_no_fail();

    // (c) checkpoint --kill on n3, restart on n1 (which never held it).
    let info = c.crctl_json(&["checkpoint", "ring", "--kill"]);
    let id = jstr(&info, "id");
    ring.wait_gone("after checkpoint --kill");
    let snap = ring.mins();
    ensure(
        &ring,
        images_on(&c, 1, "ring")
            .iter()
            .all(|i| !i.starts_with(&format!("{id}/"))),
        &format!("n1 should not hold {id} yet"),
    );
    let r = restart_fetching(
        &c,
        &mut ring,
        &["--on", "n1"],
        "on a node without its images",
    );
    ensure(
        &ring,
        ju64(&r, "fetched_bytes") > 0,
        &format!("n1 should fetch the images of {id}: {r:#}"),
    );
    ring.wait_past(&snap, MARGIN, "after the restart on n1");
    ring.assert_on_nodes(&[1, 1, 1, 1], "after the restart on n1");
    ring.assert_no_fail();
    // The copies are recorded: the checkpoint lists n1 as a holder.
    let cks = c.crctl_json(&["checkpoints", "ring"]);
    let ck = jlist(&cks, "checkpoints")
        .into_iter()
        .find(|x| jstr(x, "id") == id)
        .cloned()
        .unwrap_or_default();
    ensure(
        &ring,
        jlist(&ck, "images").iter().all(|i| {
            jlist(i, "replicas")
                .iter()
                .any(|r| r.as_str().is_some_and(|s| s.starts_with("n1=")))
        }),
        &format!("every image of {id} should list its copy on n1: {ck:#}"),
    );
    for k in 1..=3 {
        assert!(
            !partial_copies(&c, k),
            "no partial copy may be left on n{k}"
        );
    }

    // (d) on the same cluster: checkpoints with pre-copy.
    pre_copy_checkpoints(&c);
    // (e) and post-copy restores of moved members.
    lazy_migrations(&c);
}

/// `crctl migrate --lazy` of the member of a ring that holds 64 MiB it
/// rewrites at 10 MB/s and checks: it runs on its target before its pages
/// are there (post-copy: the target fetched the image without its page
/// store, whose blocks its agent gets from the source's agent, those the
/// process faults on first, while it runs; it logs when every block is in
/// and when every page is in the process); then once more with
/// `--pre-copy` too. Every byte of the ring and the ballast are checked by
/// the members.
/// What a post-copy target's agent logs for a store the source did not
/// hash whole.
const BLOCK_CHECKED: &str = "store checked block by block against its image's hashes";

fn lazy_migrations(c: &Cluster) {
    let job = "lazy";
    let mut ring = c.start_ring_ballast(job, &[1, 2, 3], "64:10");
    ring.wait_advanced(MARGIN, "before the lazy migrations");
    for (to, k, extra, placement) in [
        ("n2", 2, None, [2, 2, 3]),
        ("n3", 3, Some("--pre-copy"), [3, 2, 3]),
    ] {
        let what = format!("member 0 to {to} with --lazy {}", extra.unwrap_or(""));
        let log = read_text(&c.agent_log(k));
        let done_before = log.matches("post-copy done").count();
        let blocks_before = log.matches("every page block is in").count();
        let checked_before = log.matches(BLOCK_CHECKED).count();
        let m0 = member_id(c, &ring, 0);
        let snap = ring.mins();
        let mut args = vec![job, "--member", m0.as_str(), "--to", to, "--lazy"];
        args.extend(extra);
        let r = migrate(c, &mut ring, &args, &what);
        // The 64 MiB ballast was not copied before the member ran there.
        ensure(
            &ring,
            ju64(&r, "bytes") < 16 << 20,
            &format!("{what}: the pages should come after the restore, not before: {r:#}"),
        );
        wait_until(
            &format!(
                "{to}'s agent to get every page block and put every page of the moved member in"
            ),
            Duration::from_secs(120),
            || {
                let log = read_text(&c.agent_log(k));
                log.matches("post-copy done").count() > done_before
                    && log.matches("every page block is in").count() > blocks_before
            },
            || ring.diag(),
        );
        // The source listed the store unhashed (its manifest does not read
        // the whole store before the restore): the target checked it block
        // by block once complete.
        ensure(
            &ring,
            read_text(&c.agent_log(k)).matches(BLOCK_CHECKED).count() > checked_before,
            &format!("{what}: {to}'s agent should check the page store block by block"),
        );
        ring.wait_past(&snap, MARGIN, &format!("after {what}"));
        ring.assert_on_nodes(&placement, &format!("after {what}"));
        ring.assert_running_untraced(&format!("after {what}"));
        ring.assert_no_fail();
    }
}

/// The pre-copy rounds (`JOB-precopy-STAMP`) of `job` whose pre-dumps are
/// in node `k`'s image root.
fn pre_copies_on(c: &Cluster, k: usize, job: &str) -> Vec<String> {
    let prefix = format!("{job}-precopy-");
    let mut v: Vec<String> = images_on(c, k, job)
        .into_iter()
        .filter(|i| i.starts_with(&prefix))
        .filter_map(|i| i.split('/').next().map(str::to_string))
        .collect();
    v.dedup();
    v
}

/// `crctl checkpoint --pre-copy` (and the job setting `--pre-copy on`) of
/// a ring over 3 nodes whose member 0 holds 64 MiB it rewrites at 10 MB/s
/// and checks: committed with its rounds, killed, restarted, every byte and
/// the ballast checked by the members; the pre-dumps of a checkpoint go
/// with it (retention), none is left once no checkpoint needs them.
fn pre_copy_checkpoints(c: &Cluster) {
    let job = "pre";
    let mut ring = c.start_ring_ballast(job, &[1, 2, 3], "64:10");
    let out = c.crctl(&["job", job, "--keep", "1"]);
    assert!(out.status.success(), "crctl job --keep 1\n{}", out.show());
    ring.wait_advanced(MARGIN, "before the first pre-copy checkpoint");

    let info = c.crctl_json(&["checkpoint", job, "--pre-copy"]);
    println!(
        "MEASURED: checkpoint --pre-copy: paused {} ms after {} rounds ({} bytes in {} ms)",
        ju64(&info, "pause_ms"),
        ju64(&info, "pre_copy_rounds"),
        ju64(&info, "pre_copy_bytes"),
        ju64(&info, "pre_copy_ms")
    );
    ensure(
        &ring,
        jstr(&info, "state") == "committed"
            && ju64(&info, "pre_copy_rounds") >= 1
            && ju64(&info, "pre_copy_bytes") >= 64 << 20,
        &format!(
            "a pre-copy checkpoint should commit after rounds that copied the ballast: {info:#}"
        ),
    );
    ring.wait_advanced(MARGIN, "after a pre-copy checkpoint (continue)");

    // The job's setting: this --kill pre-copies too.
    let out = c.crctl(&["job", job, "--pre-copy", "on"]);
    assert!(
        out.status.success(),
        "crctl job --pre-copy on\n{}",
        out.show()
    );
    let info = c.crctl_json(&["checkpoint", job, "--kill"]);
    ensure(
        &ring,
        jstr(&info, "state") == "committed" && ju64(&info, "pre_copy_rounds") >= 1,
        &format!("the job's --pre-copy should pre-copy its checkpoints: {info:#}"),
    );
    ring.wait_gone("after checkpoint --kill with pre-copy");
    // Retention removed the first checkpoint and its pre-dumps; the
    // second one's are its images' parents: kept, on every node.
    let mut rounds = Vec::new();
    for k in 1..=3 {
        let r = pre_copies_on(c, k, job);
        ensure(
            &ring,
            r.len() == 1,
            &format!("n{k} should hold the pre-dumps of the kept checkpoint only: {r:?}"),
        );
        rounds.extend(r);
    }
    rounds.dedup();
    ensure(
        &ring,
        rounds.len() == 1,
        &format!("one pre-copy's pre-dumps should be left: {rounds:?}"),
    );

    let snap = ring.mins();
    restart_fetching(c, &mut ring, &[], "from a pre-copy checkpoint");
    ring.wait_past(
        &snap,
        MARGIN,
        "after the restart from a pre-copy checkpoint",
    );
    ring.assert_on_nodes(&[1, 2, 3], "after the restart");
    ring.assert_no_fail();

    // A checkpoint without pre-copy: retention removes the pre-copy one,
    // and its pre-dumps go with it.
    let out = c.crctl(&["job", job, "--pre-copy", "off"]);
    assert!(
        out.status.success(),
        "crctl job --pre-copy off\n{}",
        out.show()
    );
    let info = c.crctl_json(&["checkpoint", job]);
    ensure(
        &ring,
        jstr(&info, "state") == "committed" && ju64(&info, "pre_copy_rounds") == 0,
        &format!("a checkpoint without pre-copy: {info:#}"),
    );
    for k in 1..=3 {
        let r = pre_copies_on(c, k, job);
        ensure(
            &ring,
            r.is_empty(),
            &format!("no pre-dump should be left on n{k} once no checkpoint needs it: {r:?}"),
        );
    }
    ring.wait_advanced(MARGIN, "after the last checkpoint");
    ring.assert_no_fail();
}

/// `crctl job J --replicas 2`: every image of a committed checkpoint is
/// copied to another node after the commit; the node that wrote an image
/// is then lost (agent killed, its image root wiped) and the job restarts
/// on the other nodes from the copies, every byte checked.
#[test]
fn replicas_outlive_their_node() {
    let h = Harness::new("cluster-replicas");
    let c = Cluster::new(&h, 3);
    c.start_coordinator();
    c.start_agents_local(&[1, 2, 3], &[]);
    let mut ring = c.start_ring("rep", &[1, 2]);
    ring.wait_advanced(MARGIN, "before the checkpoint");
    let j = c.crctl_json(&["job", "rep", "--replicas", "2"]);
    ensure(
        &ring,
        ju64(&j, "replicas") == 2,
        &format!("crctl job --replicas 2 should be recorded: {j:#}"),
    );

    let info = c.crctl_json(&["checkpoint", "rep", "--kill"]);
    let id = jstr(&info, "id");
    ring.wait_gone("after checkpoint --kill");
    let snap = ring.mins();
    // Each image is on its own node and on one more, as listed and as the
    // nodes' own image roots show.
    let images = jlist(&info, "images");
    ensure(
        &ring,
        images.len() == 2,
        &format!("2 images expected: {info:#}"),
    );
    for img in &images {
        let own = jstr(img, "node");
        let reps = jlist(img, "replicas");
        ensure(
            &ring,
            reps.len() == 1,
            &format!("the image of {own} should have one copy elsewhere: {info:#}"),
        );
        let r = reps[0].as_str().unwrap_or_default();
        let (node, _) = r.split_once('=').unwrap_or_default();
        let k: usize = node.trim_start_matches('n').parse().unwrap_or(0);
        ensure(
            &ring,
            node != own
                && (1..=3).contains(&k)
                && images_on(&c, k, "rep")
                    .iter()
                    .any(|i| i.starts_with(&format!("{id}/{own}-"))),
            &format!("the copy {r} of {own}'s image should be in {node}'s image root: {info:#}"),
        );
    }

    // n1 is lost with its disk.
    c.kill_agent(1);
    let root = c.local_images(1).to_string_lossy().into_owned();
    let out = c.run_on(1, &["/bin/sh", "-c", &format!("rm -rf {root}/*")]);
    assert!(out.status.success(), "wiping n1's images\n{}", out.show());
    c.wait_nodes("n1 down in `crctl nodes`", |nodes| {
        nodes.iter().any(|(n, st, _)| n == "n1" && st != "up")
    });

    restart_fetching(
        &c,
        &mut ring,
        &["--on", "n2", "--on", "n3"],
        "from the replicas, the node that wrote one lost",
    );
    ring.wait_past(&snap, MARGIN, "after the restart from the replicas");
    ring.assert_on_nodes(&[2, 3], "after the restart from the replicas");
    ring.assert_no_fail();
}

/// A node with 3 jobs drained: every member moved off (two members
/// connected over loopback together), every job runs on OK; the node is
/// listed drained and refuses a new member; undrained.
#[test]
fn drain_node_with_three_jobs() {
    let h = Harness::new("cluster-drain");
    let c = Cluster::new(&h, 3);
    c.start_coordinator();
    c.start_agents_local(&[1, 2, 3], &[]);
    let mut rings: Vec<Ring> = vec![
        c.start_ring("a", &[1, 2]),
        c.start_ring("b", &[1, 3]),
        // c's members 0 and 1 talk over 127.0.0.1 on n1: they must land
        // on one node.
        c.start_ring_loopback("c", &[1, 1, 2]),
    ];
    let snaps: Vec<Vec<u64>> = rings.iter().map(|r| r.mins()).collect();
    let out = c.crctl(&["--json", "drain", "n1"]);
    if !out.status.success() {
        panic!("crctl drain n1 failed\n{}\n{}", out.show(), c.diag());
    }
    let r: Value = serde_json::from_str(&out.stdout).expect("crctl --json drain");
    let migs = jlist(&r, "migrations");
    assert_eq!(migs.len(), 3, "3 jobs should be moved off n1: {r:#}");
    for m in &migs {
        println!(
            "MEASURED: drain of n1, job {}: down {} ms",
            jstr(m, "job"),
            ju64(m, "downtime_ms")
        );
    }
    for (ring, snap) in rings.iter_mut().zip(&snaps) {
        ring.adopt();
        ring.wait_past(snap, MARGIN, "after the drain of n1");
        let now = ring.nodes_now();
        ensure(
            ring,
            now.iter().all(|k| k.is_some() && *k != Some(1)),
            &format!("no member of ring {} may be left on n1: {now:?}", ring.job),
        );
        ring.assert_no_fail();
    }
    let c_now = rings[2].nodes_now();
    ensure(
        &rings[2],
        c_now[0] == c_now[1],
        &format!("ring c's loopback peers must stay together: {c_now:?}"),
    );
    // Listed drained; a new member is refused there.
    assert_listed(&c, "n1", true);
    // The agent hears it with a heartbeat reply: wait for that.
    let log = c.agent_log(1);
    wait_until(
        "n1's agent to learn that its node is drained",
        Duration::from_secs(20),
        || read_text(&log).contains("the coordinator changed the node's drain state drained=true"),
        || c.diag(),
    );
    let mut sp = c.run_member("d", 1, "refused", &["/bin/sleep".into(), "30".into()]);
    let o = sp.wait(Duration::from_secs(20), || c.diag());
    assert!(
        !o.status.success() && o.stderr.contains("drained"),
        "cr_run on a drained node must be refused:\n{}",
        o.show()
    );
    let out = c.crctl(&["migrate", "a", "--to", "n1"]);
    assert!(
        !out.status.success()
            && out.stderr.starts_with(CRCTL_ERR)
            && out.stderr.contains("drained"),
        "a migration to a drained node must be refused:\n{}",
        out.show()
    );
    let out = c.crctl(&["undrain", "n1"]);
    assert!(out.status.success(), "crctl undrain n1\n{}", out.show());
    assert_listed(&c, "n1", false);
    for ring in &rings {
        ring.wait_advanced(MARGIN, "at the end");
        ring.assert_no_fail();
    }
}

/// A directory holding what the agent reads of a cgroup v2 group
/// (`cgroup.procs`, `memory.max`, `memory.current`; cr-sys
/// `capacity::read`), standing for the cgroup of a node that has `free`
/// bytes left under its `memory.max`: given to `cr-agent --node-cgroup`.
/// (This host's cgroup v2 may have no memory controller to cap a real
/// group with: a hybrid hierarchy keeps it on v1.)
fn capped_cgroup(c: &Cluster, k: usize, free: u64) -> String {
    let dir = c.dir.join(format!("cgroup-{}", node_name(k)));
    std::fs::create_dir_all(&dir).expect("mkdir the node's cgroup");
    let max: u64 = 64 << 20;
    for (f, v) in [
        ("cgroup.procs", String::new()),
        ("memory.max", format!("{max}\n")),
        ("memory.current", format!("{}\n", max - free)),
    ] {
        std::fs::write(dir.join(f), v).expect("write the node's cgroup files");
    }
    dir.to_string_lossy().into_owned()
}

/// Free memory `crctl nodes` shows for `node` (None: not reported).
fn mem_free(c: &Cluster, node: &str) -> Option<u64> {
    let v = c.crctl_json(&["nodes"]);
    jlist(&v, "nodes")
        .into_iter()
        .find(|n| jstr(n, "name") == node)
        .and_then(|n| {
            n.get("capacity")
                .filter(|c| !c.is_null())
                .map(|c| ju64(c, "mem_free"))
        })
}

/// When the coordinator last heard from `node` (unix ms).
fn last_seen_ms(c: &Cluster, node: &str) -> u64 {
    let v = c.crctl_json(&["nodes"]);
    jlist(&v, "nodes")
        .into_iter()
        .find(|n| jstr(n, "name") == node)
        .map(|n| ju64(n, "last_seen_unix_ms"))
        .unwrap_or(0)
}

/// Targets chosen by free memory and CPU when none is named. n1's agent
/// reports 256 KiB free (its node cgroup's `memory.max` nearly used up),
/// less than any member's RSS; n2 and n3 report the host's memory. The
/// ring starts on n3, n3, n2, so that by member count alone n1, the
/// emptiest node, would be chosen each time:
/// (a) `crctl migrate --member` (member 2, on n2) without `--to` lands on
/// n3; (b) `crctl drain n3` puts all three on n2; (c) with n3 drained a
/// migration without `--to` is refused in one line (nothing moved, the
/// ring runs on); (d) stopped with `checkpoint --kill`, n2 drained and n3
/// undrained, `crctl restart` without `--on` brings n2's images to n3.
/// Every byte of the ring is checked by its members throughout.
#[test]
fn targets_chosen_by_room_when_not_named() {
    let h = Harness::new("cluster-place");
    let c = Cluster::new(&h, 3);
    c.start_coordinator();
    let capped = capped_cgroup(&c, 1, 256 << 10);
    for k in 1..=3 {
        let mut o = agent_opts(&c, k, &[]);
        o.no_wait = true;
        if k == 1 {
            o.args = vec!["--node-cgroup".into(), capped.clone()];
        }
        c.start_agent_with(k, &o);
    }
    c.wait_nodes_up(&[1, 2, 3]);
    cr_tests::cluster::poll_until(
        "n1 to report its capped free memory",
        Duration::from_secs(20),
        cr_tests::cluster::POLL_PERIOD,
        || mem_free(&c, "n1").is_some_and(|f| f <= 256 << 10),
        || format!("crctl nodes:\n{}\n{}", c.crctl(&["nodes"]).show(), c.diag()),
    );
    let mut ring = c.start_ring("placed", &[3, 3, 2]);
    ring.wait_advanced(MARGIN, "before any move");

    // (a) member 2: n2 -> n3, not n1.
    let m2 = member_id(&c, &ring, 2);
    let snap = ring.mins();
    let r = migrate(&c, &mut ring, &["placed", "--member", &m2], "no --to");
    let moved: Vec<String> = jlist(&r, "moved")
        .iter()
        .map(|v| v.as_str().unwrap_or("").to_string())
        .collect();
    ensure(
        &ring,
        moved.len() == 1 && moved[0].starts_with(&format!("{m2} -> n3:")),
        &format!("member {m2} should go to n3, the node with room: {r:#}"),
    );
    ring.wait_past(&snap, MARGIN, "after member 2 moved without --to");
    ring.assert_on_nodes(&[3, 3, 3], "after member 2 moved without --to");
    ring.assert_no_fail();

    // (b) drain n3: everything to n2, nothing to n1.
    let snap = ring.mins();
    let out = c.crctl(&["--json", "drain", "n3"]);
    if !out.status.success() {
        panic!("crctl drain n3 failed\n{}\n{}", out.show(), ring.diag());
    }
    ring.adopt();
    ring.wait_past(&snap, MARGIN, "after the drain of n3");
    ring.assert_on_nodes(&[2, 2, 2], "after the drain of n3");
    ring.assert_no_fail();
    assert_listed(&c, "n3", true);

    // (c) no node with room: refused in one line, nothing moved. The
    // members' sizes are their resident memory as n2's agent reports it:
    // wait for a report made after the drain (the second heartbeat seen
    // since: the first may have been on its way).
    let mut seen = last_seen_ms(&c, "n2");
    for _ in 0..2 {
        let after = seen;
        wait_until(
            "a heartbeat of n2 after the drain",
            Duration::from_secs(30),
            || {
                seen = last_seen_ms(&c, "n2");
                seen > after
            },
            || ring.diag(),
        );
    }
    let m0 = member_id(&c, &ring, 0);
    let out = c.crctl(&["migrate", "placed", "--member", &m0]);
    ensure(
        &ring,
        !out.status.success()
            && out.stderr.starts_with(CRCTL_ERR)
            && out.stderr.trim_end().lines().count() == 1
            && out
                .stderr
                .contains(&format!("no node has room for member {m0}"))
            && out.stderr.contains("most free: n1"),
        &format!(
            "a migration without --to and without room must be refused:\n{}",
            out.show()
        ),
    );
    ring.wait_advanced(MARGIN, "after the refused migration");
    ring.assert_on_nodes(&[2, 2, 2], "after the refused migration");
    ring.assert_no_fail();

    // (d) stopped, n2 drained, n3 undrained: a restart without --on goes
    // to n3 (n1 has no room), its images fetched from n2.
    c.crctl_json(&["checkpoint", "placed", "--kill"]);
    ring.wait_gone("after checkpoint --kill");
    let snap = ring.mins();
    for args in [["undrain", "n3"], ["drain", "n2"]] {
        let out = c.crctl(&args);
        assert!(out.status.success(), "crctl {args:?}\n{}", out.show());
    }
    let r = restart_fetching(&c, &mut ring, &[], "without --on, n2 drained");
    ensure(
        &ring,
        ju64(&r, "fetched_bytes") > 0,
        &format!("n3 should fetch n2's images: {r:#}"),
    );
    ring.wait_past(&snap, MARGIN, "after the restart without --on");
    ring.assert_on_nodes(&[3, 3, 3], "after the restart without --on");
    ring.assert_no_fail();
}

/// The migration `bg` failed, saying the job was restarted where it was,
/// and the ring runs again on `placement`, every byte checked.
fn assert_rolled_back(ring: &mut Ring, bg: &mut Spawned, placement: &[usize], what: &str) {
    let out = bg.wait(Duration::from_secs(120), || ring.diag());
    ensure(
        ring,
        !out.status.success()
            && out.stderr.starts_with(CRCTL_ERR)
            && out.stderr.contains("restarted where it was"),
        &format!(
            "the migration should fail and roll back ({what}):\n{}",
            out.show()
        ),
    );
    ring.adopt();
    ring.wait_advanced(MARGIN, &format!("after {what}"));
    ring.assert_on_nodes(placement, &format!("after {what}"));
    ring.assert_no_fail();
}

/// Failures during a migration of member 0 (n1) to n3: the job goes on
/// where it was, the target keeps nothing of it.
#[test]
fn migration_failures_roll_back() {
    let h = Harness::new("cluster-migrate-faults");
    let f = Faults::new(&h.dir);
    let c = Cluster::new(&h, 3);
    c.start_coordinator_with(&f.coord_env(), &[]);
    // n1 (every migration's source) with the hooks too, for post-copy.
    let source_opts = agent_opts(&c, 1, &f.agent_env());
    c.start_agent_with(1, &source_opts);
    c.start_agents_local(&[2], &[]);
    let target_opts = agent_opts(&c, 3, &f.agent_env());
    c.start_agent_with(3, &target_opts);
    // The member on n1 holds 64 MiB, so that a copy takes a while.
    let placement = [1, 2, 1];
    let mut ring = c.start_ring_ballast("ring", &placement, "64:10");
    ring.wait_advanced(MARGIN, "at the start");

    // (1) The target's agent killed in the middle of the copy.
    f.clear();
    std::fs::write(&f.agent_ctl, "fetch").unwrap();
    let m0 = member_id(&c, &ring, 0);
    let args = ["migrate", "ring", "--member", m0.as_str(), "--to", "n3"];
    let mut bg = run_to_fault(&c, &ring, &args, &f.agent_reached);
    c.kill_agent(3);
    assert_rolled_back(
        &mut ring,
        &mut bg,
        &placement,
        "the target died during the copy",
    );
    assert!(
        partial_copies(&c, 3),
        "the killed target should have left a partial copy (the test's premise)"
    );
    f.clear();
    c.start_agent_with(3, &target_opts);
    assert!(
        !partial_copies(&c, 3),
        "the target's start removes partial copies"
    );
    assert!(
        images_on(&c, 3, "ring").is_empty(),
        "no image of the job on the target"
    );

    // (2) The target's link cut during the copy.
    std::fs::write(&f.agent_ctl, "fetch").unwrap();
    let m0 = member_id(&c, &ring, 0);
    let args = [
        "migrate",
        "ring",
        "--member",
        m0.as_str(),
        "--to",
        "n3",
        "--timeout",
        "30",
    ];
    let mut bg = run_to_fault(&c, &ring, &args, &f.agent_reached);
    c.cut_link(3);
    let _ = std::fs::remove_file(&f.agent_reached);
    assert_rolled_back(
        &mut ring,
        &mut bg,
        &placement,
        "the target's link was cut during the copy",
    );
    // The target notices that the coordinator's call is gone (its server
    // keepalive) and removes what it copied. (A link back within those
    // few seconds would let the copy finish: see docs/CLUSTER.md.)
    wait_until(
        "the target to give its partial copy up",
        Duration::from_secs(60),
        || !partial_copies(&c, 3),
        || c.diag(),
    );
    c.restore_link(3);
    assert!(
        images_on(&c, 3, "ring").is_empty(),
        "no image of the job on the target"
    );
    f.clear();

    // (3) The coordinator killed after the checkpoint, before the restart.
    std::fs::write(&f.coord_ctl, "migrate").unwrap();
    let m0 = member_id(&c, &ring, 0);
    let args = ["migrate", "ring", "--member", m0.as_str(), "--to", "n3"];
    let mut bg = run_to_fault(&c, &ring, &args, &f.coord_reached);
    c.kill_coordinator();
    let _ = bg.wait(Duration::from_secs(60), || ring.diag());
    f.clear();
    c.start_coordinator_with(&f.coord_env(), &[]);
    wait_until(
        "the job to run again where it was (rolled back)",
        Duration::from_secs(60),
        || (0..ring.len()).all(|i| ring.find_pids(i).len() == 1),
        || ring.diag(),
    );
    ring.adopt();
    ring.wait_advanced(MARGIN, "after the coordinator's restart");
    ring.assert_on_nodes(&placement, "after the coordinator's restart");
    ring.assert_no_fail();
    assert!(
        images_on(&c, 3, "ring").is_empty(),
        "no image of the job on the target"
    );

    // (4) Post-copy (--lazy), the source's agent killed while the moved
    // member runs on the target with pages still missing (the source
    // holds its push at the first block): the member is lost (killed on
    // the target, one error in its agent's log), the target's incomplete
    // copy is removed, and the job restarts from the migration's
    // checkpoint, whose image the source kept.
    std::fs::write(&f.agent_ctl, "postcopy").unwrap();
    let m0 = member_id(&c, &ring, 0);
    let args = [
        "--json",
        "migrate",
        "ring",
        "--member",
        m0.as_str(),
        "--to",
        "n3",
        "--lazy",
    ];
    let mut bg = run_to_fault(&c, &ring, &args, &f.agent_reached);
    let out = bg.wait(Duration::from_secs(120), || ring.diag());
    assert!(
        out.status.success(),
        "the lazy migration should succeed before the source is lost\n{}",
        out.show()
    );
    let id = jstr(
        &serde_json::from_str::<Value>(&out.stdout).expect("crctl --json migrate"),
        "checkpoint",
    );
    ring.adopt();
    ring.assert_on_nodes(&[3, 2, 1], "after the lazy migration");
    c.kill_agent(1);
    // The member's death, the agent's two lines (the transfer's and the
    // tree's, from different threads) and the copy's removal happen in no
    // fixed order: wait for all of them.
    let copy_gone = || {
        images_on(&c, 3, "ring")
            .iter()
            .all(|i| !i.starts_with(&format!("{id}/")))
    };
    wait_until(
        "the moved member to be killed on the target, its loss logged, its copy removed",
        Duration::from_secs(60),
        || {
            let log = read_text(&c.agent_log(3));
            ring.find_pids(0).is_empty()
                && log.contains("post-copy from the source failed")
                && log.contains("post-copy failed")
                && copy_gone()
        },
        || format!("{}\n{}", ring.diag(), read_text(&c.agent_log(3))),
    );
    // The job restarts from its last checkpoint (the migration's).
    ring.kill_all();
    f.clear();
    c.start_agent_with(1, &source_opts);
    c.wait_members_gone("ring");
    ring.forget_statuses();
    let out = c.crctl(&["restart", "ring", "--checkpoint", &id]);
    assert!(
        out.status.success(),
        "the job should restart from {id}\n{}\n{}",
        out.show(),
        ring.diag()
    );
    ring.adopt();
    ring.wait_advanced(MARGIN, "after the restart from the migration's checkpoint");
    ring.assert_on_nodes(
        &placement,
        "after the restart from the migration's checkpoint",
    );
    ring.assert_no_fail();
}

/// The JSON events `crctl --json watch` printed so far, one per line (a
/// line still being written is left for the next look).
fn events(watcher: &Spawned) -> Vec<Value> {
    read_text(&watcher.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// `crctl ARGS` (a watch) in the background, once it says it watches.
fn start_watcher(c: &Cluster, args: &[&str], hello: &str) -> Spawned {
    let mut w = c.crctl_bg(args);
    wait_until(
        &format!("crctl {args:?} to say it watches"),
        Duration::from_secs(30),
        || read_text(&w.stdout).contains(hello) || w.proc.has_exited(),
        || c.diag(),
    );
    assert!(
        read_text(&w.stdout).contains(hello),
        "crctl {args:?} ended before it watched\n{}",
        w.diag()
    );
    w
}

/// `crctl watch` started before a pre-copy migration of a member of a
/// ring (its memory rewritten at 10 MB/s) sees the migration's phases in
/// order, its bytes never going back, each round's figures and its end,
/// the same as crctl migrate says; held in the middle of a copy (the
/// target's fetch hook), `crctl status --json` shows the migration in
/// progress with its bytes. Every byte of the ring is checked by the
/// members. Stopping the coordinator ends the watchers cleanly.
#[test]
fn watch_and_status_follow_a_pre_copy_migration() {
    let h = Harness::new("cluster-watch");
    let f = Faults::new(&h.dir);
    let c = Cluster::new(&h, 3);
    c.start_coordinator();
    c.start_agents_local(&[1, 2], &[]);
    let target_opts = agent_opts(&c, 3, &f.agent_env());
    c.start_agent_with(3, &target_opts);
    let mut ring = c.start_ring_ballast("watched", &[1, 2], "64:10");
    ring.wait_advanced(MARGIN, "before the migration");
    let mut json_watcher =
        start_watcher(&c, &["--json", "watch", "--job", "watched"], "\"watching\"");
    let mut text_watcher = start_watcher(&c, &["watch"], "watching everything");

    // The migration, held in its first copy to n3.
    std::fs::write(&f.agent_ctl, "fetch").unwrap();
    let m0 = member_id(&c, &ring, 0);
    let snap = ring.mins();
    let args = [
        "--json",
        "migrate",
        "watched",
        "--member",
        m0.as_str(),
        "--to",
        "n3",
        "--pre-copy",
    ];
    let mut bg = run_to_fault(&c, &ring, &args, &f.agent_reached);
    // The copy's bytes come with n3's heartbeats: a "progress" event.
    wait_until(
        "the watcher to see the held copy's bytes",
        Duration::from_secs(30),
        || {
            events(&json_watcher)
                .iter()
                .any(|e| jstr(e, "phase") == "progress" && ju64(&e["migration"], "copy_bytes") > 0)
        },
        || format!("{}\n{}", json_watcher.describe(), ring.diag()),
    );
    let st = c.crctl_json(&["status"]);
    let held = jlist(&st, "migrations")
        .into_iter()
        .find(|m| jstr(m, "job") == "watched")
        .cloned()
        .unwrap_or_else(|| panic!("crctl status --json shows no migration of watched: {st:#}"));
    ensure(
        &ring,
        jstr(&held, "phase").starts_with("pre-copy round 1")
            && jlist(&held, "moves").len() == 1
            && held["pre_copy"] == Value::Bool(true)
            && ju64(&held, "bytes_sent") >= ju64(&held, "copy_bytes")
            && ju64(&held, "copy_total") >= ju64(&held, "copy_bytes")
            && ju64(&held, "rate") > 0,
        &format!("the migration in progress, as crctl status shows it: {held:#}"),
    );
    let text = c.crctl(&["status"]);
    assert!(
        text.stdout
            .lines()
            .any(|l| l.starts_with("migration") && l.contains("watched") && l.contains("sent")),
        "crctl status should show the migration:\n{}",
        text.show()
    );
    f.clear();
    let out = bg.wait(Duration::from_secs(120), || ring.diag());
    assert!(out.status.success(), "crctl migrate\n{}", out.show());
    let r: Value = serde_json::from_str(&out.stdout).expect("crctl --json migrate");
    ring.adopt();
    ring.wait_past(&snap, MARGIN, "after the watched migration");
    ring.assert_on_nodes(&[3, 2], "after the watched migration");
    ring.assert_no_fail();

    // What the watcher saw, up to the end of the migration.
    wait_until(
        "the watcher to see the migration end",
        Duration::from_secs(30),
        || {
            events(&json_watcher)
                .iter()
                .any(|e| jstr(e, "kind") == "migration" && jstr(e, "phase") == "done")
        },
        || json_watcher.describe(),
    );
    let evs = events(&json_watcher);
    assert!(
        evs.iter().all(|e| jstr(e, "kind") != "lagged"),
        "a watcher reading at once must not lag:\n{}",
        read_text(&json_watcher.stdout)
    );
    let migs: Vec<&Value> = evs
        .iter()
        .filter(|e| jstr(e, "kind") == "migration")
        .collect();
    let phases: Vec<String> = migs.iter().map(|e| jstr(e, "phase")).collect();
    println!("watched phases: {phases:?}");
    let at = |p: &str| {
        phases
            .iter()
            .position(|x| x == p)
            .unwrap_or_else(|| panic!("no migration event of phase {p:?}: {phases:?}"))
    };
    let order = [
        "started",
        "pre-copy round 1",
        "pre-copy round 1 done",
        "preparing",
        "dumping",
        "committing",
        "restarting",
        "fetching images",
        "restoring",
        "releasing",
        "done",
    ];
    for w in order.windows(2) {
        assert!(
            at(w[0]) < at(w[1]),
            "phase {:?} should come before {:?}: {phases:?}",
            w[0],
            w[1]
        );
    }
    assert_eq!(phases.first().map(String::as_str), Some("started"));
    assert_eq!(phases.last().map(String::as_str), Some("done"));
    assert!(
        phases.iter().any(|p| p == "progress"),
        "the held copy's bytes should come as progress events: {phases:?}"
    );
    let prog: Vec<&Value> = migs.iter().map(|e| &e["migration"]).collect();
    for w in prog.windows(2) {
        assert!(
            ju64(w[1], "bytes_sent") >= ju64(w[0], "bytes_sent"),
            "bytes sent may only grow: {:#} then {:#}",
            w[0],
            w[1]
        );
    }
    let rounds = ju64(&r, "rounds");
    for e in migs.iter().filter(|e| jstr(e, "phase").ends_with(" done")) {
        let m = &e["migration"];
        let n = ju64(m, "rounds");
        assert!(
            jstr(e, "phase") == format!("pre-copy round {n} done") && ju64(m, "bytes_sent") > 0,
            "a pre-copy round's end says its round and the bytes sent: {e:#}"
        );
        if n >= 2 {
            assert!(
                ju64(m, "dirty_rate") > 0,
                "round {n} should measure the job's dirty rate: {e:#}"
            );
        }
    }
    let done = &migs.last().expect("a migration event")["migration"];
    assert_eq!(
        ju64(done, "bytes_sent"),
        ju64(&r, "bytes") + ju64(&r, "pre_copy_bytes"),
        "the watcher's bytes sent are crctl migrate's (copy and pre-copy): {done:#}\n{r:#}"
    );
    assert_eq!(ju64(done, "downtime_ms"), ju64(&r, "downtime_ms"));
    assert_eq!(ju64(done, "rounds"), rounds);
    assert!(
        jstr(done, "checkpoint") == jstr(&r, "checkpoint"),
        "the migration's checkpoint: {done:#}"
    );
    println!(
        "MEASURED: watched migration: {} events, {} rounds, {} bytes sent, down {} ms",
        migs.len(),
        rounds,
        ju64(done, "bytes_sent"),
        ju64(done, "downtime_ms")
    );
    // Every event of a job only: none of another job or of a node.
    assert!(
        evs.iter()
            .skip(1)
            .all(|e| jstr(e, "job") == "watched" || jstr(e, "kind") == "lagged"),
        "--job watched shows that job's events only"
    );
    // The text watcher printed one line per event, the migration's too.
    let text = read_text(&text_watcher.stdout);
    println!("crctl watch printed:\n{text}");
    assert!(
        text.lines()
            .any(|l| l.contains(" migration ") && l.contains(": done: down ")),
        "the text watcher should print the migration's end:\n{text}"
    );

    // The coordinator stops: the watchers say so and end, status 0.
    c.stop_coordinator();
    for w in [&mut json_watcher, &mut text_watcher] {
        let o = w.wait(Duration::from_secs(30), String::new);
        assert!(
            o.status.success() && o.stdout.contains("the coordinator is stopping"),
            "a watcher ends cleanly when the coordinator stops\n{}",
            o.show()
        );
    }
    ring.wait_advanced(MARGIN, "with the coordinator stopped");
    ring.assert_no_fail();
}

/// The health check of n1's agent fails (a file it tests appears): after
/// two failures in a row the agent asks for the drain of its own node, its
/// ring member is moved off and the job runs on OK; a watcher sees the
/// drain, with the reason. Then `crctl drain --self` on n2 (through n2's
/// agent socket, no certificate) drains n2 the same way.
#[test]
fn a_failing_health_check_drains_its_node() {
    let h = Harness::new("cluster-health");
    let c = Cluster::new(&h, 3);
    let flag = c.dir.join("n1-is-broken");
    c.start_coordinator();
    let mut n1 = agent_opts(&c, 1, &[]);
    n1.args = [
        "--health-check",
        &format!("test ! -e {}", flag.display()),
        "--health-interval",
        "0.2",
        "--health-failures",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    c.start_agent_with(1, &n1);
    c.start_agents_local(&[2, 3], &[]);
    let mut ring = c.start_ring("healthy", &[1, 2]);
    ring.wait_advanced(MARGIN, "before the health check fails");
    let watcher = start_watcher(&c, &["--json", "watch"], "\"watching\"");

    let snap = ring.mins();
    std::fs::write(&flag, "broken\n").unwrap();
    let drained = |e: &Value, node: &str| {
        jstr(e, "kind") == "drain" && jstr(e, "phase") == "done" && jstr(e, "node") == node
    };
    wait_until(
        "the watcher to see n1 drained by its health check",
        Duration::from_secs(120),
        || events(&watcher).iter().any(|e| drained(e, "n1")),
        || format!("{}\n{}", c.diag(), ring.diag()),
    );
    // The coordinator tells the watcher before its reply to the agent's
    // DRAIN arrives: the agent's line may come a little later.
    wait_until(
        "n1's agent to log the failed checks and the drain",
        Duration::from_secs(30),
        || {
            let log = read_text(&c.agent_log(1));
            log.contains("health check failed") && log.contains("this node is drained")
        },
        || read_text(&c.agent_log(1)),
    );
    let evs = events(&watcher);
    let started = evs
        .iter()
        .find(|e| jstr(e, "kind") == "drain" && jstr(e, "phase") == "started")
        .unwrap_or_else(|| panic!("no drain start seen: {evs:#?}"));
    assert!(
        jstr(&started["drain"], "reason").contains("health check")
            && jstr(&started["drain"], "reason").contains("failed 2 times in a row"),
        "the drain says why: {started:#}"
    );
    assert!(
        evs.iter()
            .any(|e| jstr(e, "kind") == "node" && jstr(e, "phase") == "drained"),
        "the watcher should see n1 drained"
    );
    let done = evs.iter().find(|e| drained(e, "n1")).unwrap();
    assert_eq!(ju64(&done["drain"], "moved"), 1, "{done:#}");
    ring.adopt();
    ring.wait_past(&snap, MARGIN, "after n1 was drained");
    let now = ring.nodes_now();
    ensure(
        &ring,
        now.iter().all(|k| k.is_some() && *k != Some(1)),
        &format!("no member may be left on n1: {now:?}"),
    );
    ring.assert_no_fail();
    assert_listed(&c, "n1", true);

    // A script on n2: crctl drain --self, through n2's agent.
    let snap = ring.mins();
    let out = c.run_env(
        Some(c.ns(2)),
        "drain-self",
        &cr_tests::tool_path("crctl"),
        &["--json", "drain", "--self", "--reason", "maintenance"]
            .iter()
            .map(std::ffi::OsString::from)
            .collect::<Vec<_>>(),
        &[(
            "CR_AGENT_SOCKET".to_string(),
            c.socket(2).display().to_string(),
        )],
    );
    assert!(out.status.success(), "crctl drain --self\n{}", out.show());
    let r: Value = serde_json::from_str(&out.stdout).expect("crctl --json drain --self");
    assert!(
        jstr(&r, "node") == "n2" && jlist(&r, "migrations").len() == 1,
        "n2's member moved off: {r:#}"
    );
    ring.adopt();
    ring.wait_past(&snap, MARGIN, "after n2 drained itself");
    ring.assert_on_nodes(&[3, 3], "after n1 and n2 were drained");
    ring.assert_no_fail();
    wait_until(
        "the watcher to see n2 drained, with its reason",
        Duration::from_secs(30),
        || {
            events(&watcher).iter().any(|e| {
                jstr(e, "kind") == "drain"
                    && jstr(e, "phase") == "started"
                    && jstr(e, "node") == "n2"
                    && jstr(&e["drain"], "reason").contains("maintenance")
            })
        },
        || c.diag(),
    );
}
