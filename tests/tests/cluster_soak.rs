//! Soak of the cluster daemons, benchmark style (docs/CLUSTER.md,
//! "Guarantees and bounds"): a ring of 2 members on 2 nodes goes through
//! 200 coordinated checkpoints that continue, then 20 cycles of
//! checkpoint --kill and restart, without a hang (every crctl has a
//! deadline) or a leak: the file descriptors and the resident memory of
//! the agents and of the coordinator (read from /proc) and the nft tables
//! of the nodes are measured after a warm-up and at the end, and must not
//! grow beyond a small slack. The ring checks every byte throughout.

use cr_tests::cluster::{jstr, Cluster, Ring};
use cr_tests::Harness;
use std::time::Instant;

const JOB: &str = "soak";
const PLACEMENT: [usize; 2] = [1, 2];
const CHECKPOINTS: usize = 200;
const CYCLES: usize = 20;
/// Warm-up before the first measure (caches, channels, thread pools).
const WARMUP: usize = 20;
/// Growth allowed between the measures.
const FD_SLACK: i64 = 8;
const RSS_SLACK_KIB: i64 = 24 * 1024;

/// (open fds, VmRSS in KiB) of a process.
fn usage(pid: i32) -> (i64, i64) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count()) as i64;
    let rss = cr_sys::proc::status(pid)
        .ok()
        .and_then(|st| st.vmrss)
        .map_or(0, |kib| kib as i64);
    (fds, rss)
}

/// Usage of every daemon: (name, fds, rss).
fn measure(c: &Cluster) -> Vec<(String, i64, i64)> {
    let mut out = Vec::new();
    if let Some(p) = c.coordinator_pid() {
        let (f, r) = usage(p);
        out.push(("coordinator".to_string(), f, r));
    }
    for k in 1..=c.nodes {
        if let Some(p) = c.agent_pid(k) {
            let (f, r) = usage(p);
            out.push((format!("agent n{k}"), f, r));
        }
    }
    out
}

fn tables(c: &Cluster) -> Vec<(usize, Vec<String>)> {
    (1..=c.nodes).map(|k| (k, c.nft_tables(k))).collect()
}

fn checkpoint(c: &Cluster, ring: &Ring, extra: &[&str]) {
    let mut args = vec!["checkpoint", JOB];
    args.extend_from_slice(extra);
    let info = c.crctl_json(&args);
    if jstr(&info, "state") != "committed" {
        panic!(
            "checkpoint {extra:?} did not commit: {info:#}\n{}",
            ring.diag()
        );
    }
}

#[test]
fn soak_checkpoints_and_restarts_without_leaks() {
    let h = Harness::new("cluster-soak");
    let c = Cluster::new(&h, 2);
    c.start_coordinator();
    c.start_agents(&[1, 2]);
    let mut ring = c.start_ring(JOB, &PLACEMENT);
    // Keep the catalog and the image root small.
    c.crctl(&["job", JOB, "--keep", "3"])
        .assert_success("crctl job --keep 3");
    ring.wait_advanced(500, "before the soak");

    let t0 = Instant::now();
    let mut base = Vec::new();
    let mut base_tables = Vec::new();
    for i in 0..CHECKPOINTS {
        checkpoint(&c, &ring, &[]);
        if i + 1 == WARMUP {
            base = measure(&c);
            base_tables = tables(&c);
        }
        if i % 50 == 49 {
            ring.wait_advanced(100, &format!("after {} checkpoints", i + 1));
        }
    }
    let t_ck = t0.elapsed();
    ring.wait_advanced(500, "after the checkpoints");
    ring.assert_running_untraced("after the checkpoints");
    let after_ck = measure(&c);
    eprintln!(
        "MEASURED: {CHECKPOINTS} checkpoints in {t_ck:?} ({:?} each); usage after {WARMUP}: {base:?}, after {CHECKPOINTS}: {after_ck:?}",
        t_ck / CHECKPOINTS as u32
    );

    let t1 = Instant::now();
    for i in 0..CYCLES {
        ring.wait_advanced(100, &format!("before cycle {i}"));
        checkpoint(&c, &ring, &["--kill"]);
        ring.wait_gone(&format!("after the kill of cycle {i}"));
        let out = c.crctl(&["restart", JOB]);
        if !out.status.success() {
            panic!(
                "restart of cycle {i} failed\n{}\n{}",
                out.show(),
                ring.diag()
            );
        }
        ring.adopt();
    }
    let t_cycles = t1.elapsed();
    ring.wait_advanced(500, "after the restarts");
    ring.assert_running_untraced("after the restarts");
    ring.assert_no_fail();
    // A few more checkpoints of the restored members, then the last measure.
    for _ in 0..5 {
        checkpoint(&c, &ring, &[]);
    }
    let end = measure(&c);
    // The last restart's reset guard goes once its elements expired.
    let mut end_tables = tables(&c);
    cr_tests::wait_until(
        "the nodes' nft tables to be what they were before the soak",
        std::time::Duration::from_secs(30),
        || {
            end_tables = tables(&c);
            end_tables == base_tables
        },
        || format!("{:?} vs {base_tables:?}\n{}", tables(&c), c.diag()),
    );
    eprintln!(
        "MEASURED: {CYCLES} kill/restart cycles in {t_cycles:?} ({:?} each); usage at the end: {end:?}; nft tables {end_tables:?}",
        t_cycles / CYCLES as u32
    );
    for ((name, f0, r0), (_, f1, r1)) in base.iter().zip(&end) {
        assert!(
            f1 - f0 <= FD_SLACK,
            "{name}: open fds grew from {f0} to {f1} over the soak\n{}",
            c.diag()
        );
        assert!(
            r1 - r0 <= RSS_SLACK_KIB,
            "{name}: resident memory grew from {r0} KiB to {r1} KiB over the soak\n{}",
            c.diag()
        );
    }
    assert_eq!(
        base_tables, end_tables,
        "the nodes' nft tables changed over the soak"
    );
    for (k, t) in &end_tables {
        assert!(
            t.iter()
                .all(|t| !t.starts_with("cr_lock_") && t != "cr_reset_guard"),
            "node {k} keeps tables {t:?}"
        );
    }
}
