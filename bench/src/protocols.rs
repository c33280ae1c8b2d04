//! `cr-bench protocols`: the three checkpoint protocols of a job
//! (docs/PROTOCOLS.md) side by side at the same interval: how long each
//! member is paused, and how much work is lost when the job fails at a
//! random moment.
//!
//! The cluster is the one of the end-to-end tests (`cr_tests::cluster`). For
//! each protocol a ring of `wl_ring` members (member i on node i % nodes +
//! 1; bursts of traffic with quiet phases between them, `--phases`, so
//! that an uncoordinated job has recovery lines at all) is checkpointed
//! by the coordinator's own schedule every `--interval` seconds
//! (`crctl job J --mode M --interval I`). Each repetition waits for two
//! checkpoints of the schedule (for an uncoordinated job: two of every
//! member), then for a random time of up to one interval, and fails the
//! job there: every member is killed. The work lost is, per member, the
//! time from the point it restarts from to the failure: the job's latest
//! checkpoint for the coordinated protocols (when it began), the member's
//! checkpoint on the recovery line for the uncoordinated one (its start
//! when it has none). The job is then restarted from there (`crctl
//! restart`, `--line` when uncoordinated) and must go on, every member
//! checking every byte it gets. The jobs save their open files in their
//! images (`--save-files`): a member caught between writing its status
//! file's `.tmp` and renaming it has that file open, gone by the restart.
//!
//! The pause columns come from every member image of every committed
//! checkpoint (`frozen_ms`: from the member's freeze to its let-go);
//! `held_ms` is how long a non-blocking round held a member's connections.
//! Next to them, `limit_ms` is the machine's plainest pause of the whole
//! job, measured in the same run ([`crate::freeze::limit_pause`]: every
//! member stopped at once with ptrace, its writable memory read, let go).

use crate::cluster::{median, on_cluster};
use crate::int_in;
use clap::{ArgAction, Args};
use cr_tests::cluster::{jlist, jstr, ju64, Cluster, Ring};
use cr_tests::Harness;
use serde_json::Value;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Messages every member must carry after a restart before the next
/// repetition.
const ADVANCE: u64 = 2000;

const PROTOCOLS: [&str; 3] = ["coordinated", "non-blocking", "uncoordinated"];

/// `cr-bench protocols`.
#[derive(Args)]
#[command(after_help = crate::cluster::CLUSTER_HELP)]
pub struct Opts {
    /// Members of the ring (at most 200).
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = int_in::<usize>(2..=200))]
    members: usize,
    /// Nodes it is spread over (at most as many as members).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = int_in::<usize>(1..=200))]
    nodes: usize,
    /// Checkpoint interval of every protocol, seconds.
    #[arg(long, value_name = "SECS", default_value_t = 10, value_parser = int_in::<u32>(1..=3600))]
    interval: u32,
    /// Failures per protocol; the table shows medians.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = int_in::<usize>(1..))]
    reps: usize,
    /// The members' traffic: a burst of BURST_MS every PERIOD_MS
    /// (wl_ring's WL_RING_PHASES).
    #[arg(long, value_name = "PERIOD_MS:BURST_MS", default_value = "6000:1500")]
    phases: String,
    /// Which protocols (default: all three).
    #[arg(
        long,
        value_name = "P,...",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = "coordinated,non-blocking,uncoordinated",
        value_parser = PROTOCOLS,
    )]
    protocols: Vec<String>,
    /// Seed of the failure times.
    #[arg(long, value_name = "N", default_value_t = 1)]
    seed: u64,
    /// Where cr-agent, cr-coordinatord, crctl, cr_run and wl_ring live
    /// (default: the directory of this executable).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
}

/// One failure and what came before it.
#[derive(Default)]
struct Sample {
    /// Every member image's freeze of the checkpoints before the failure.
    frozen: Vec<u64>,
    /// Non-blocking: each checkpoint's longest held lock.
    held: Vec<u64>,
    /// Seconds of work lost, per member.
    lost: Vec<f64>,
    /// Members that roll back to their start.
    at_start: usize,
    limit: u64,
}

struct Row {
    protocol: String,
    samples: Vec<Sample>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// xorshift64*: the failure times, reproducible from `--seed`.
struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The committed checkpoints of `job` begun at or after `since` (unix ms).
fn committed_since(c: &Cluster, job: &str, since: u64) -> Vec<Value> {
    jlist(&c.crctl_json(&["checkpoints", job, "--all"]), "checkpoints")
        .into_iter()
        .filter(|ck| jstr(ck, "state") == "committed" && ju64(ck, "started_unix_ms") >= since)
        .cloned()
        .collect()
}

/// Two checkpoints of the schedule since `since`: of the job, or (member
/// checkpoints) of every member.
fn schedule_ran(c: &Cluster, job: &str, since: u64, members: usize, member_scope: bool) -> bool {
    let cks = committed_since(c, job, since);
    if !member_scope {
        return cks.len() >= 2;
    }
    let mut per: std::collections::HashMap<(String, u64), usize> = Default::default();
    for ck in &cks {
        for i in jlist(ck, "images") {
            *per.entry((jstr(i, "node"), ju64(i, "pid"))).or_default() += 1;
        }
    }
    per.len() >= members && per.values().all(|&n| n >= 2)
}

/// Waits (a benchmark: its schedule is the coordinator's) until `ok`.
fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let until = std::time::Instant::now() + limit;
    while !ok() {
        if std::time::Instant::now() >= until {
            panic!("cr-bench: no {what} within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// One repetition: schedule on, failure at a random moment, work lost,
/// restart; `false` when there was nothing to restart from (an
/// uncoordinated line through some member's start: the job must start
/// anew).
fn one_failure(
    c: &Cluster,
    ring: &mut Ring,
    job: &str,
    protocol: &str,
    o: &Opts,
    rng: &mut Rng,
    started: u64,
) -> (Sample, bool) {
    let uncoordinated = protocol == "uncoordinated";
    let (limit, _) = crate::freeze::limit_pause(&ring.host_pids())
        .unwrap_or_else(|e| panic!("the plainest pause of {job}: {e}"));
    let since = now_ms();
    let interval = o.interval.to_string();
    c.crctl(&["job", job, "--mode", protocol, "--interval", &interval])
        .assert_success("crctl job --mode --interval");
    let slack = Duration::from_secs(u64::from(o.interval) * 4 + 120);
    wait_for("two checkpoints of the schedule", slack, || {
        schedule_ran(c, job, since, ring.len(), uncoordinated)
    });
    std::thread::sleep(Duration::from_secs_f64(rng.unit() * f64::from(o.interval)));
    // The schedule stops and the checkpoint under way ends first: a
    // checkpoint that saw members die would drop them from the job.
    c.crctl(&["job", job, "--interval", "0"])
        .assert_success("crctl job --interval 0");
    c.wait_job_idle(job);
    let failed = now_ms();
    ring.kill_all();
    let mut s = Sample {
        limit: limit.as_millis() as u64,
        ..Default::default()
    };
    for ck in committed_since(c, job, since) {
        if ju64(&ck, "started_unix_ms") > failed {
            continue;
        }
        s.frozen
            .extend(jlist(&ck, "images").iter().map(|i| ju64(i, "frozen_ms")));
        if ck["non_blocking"].as_bool() == Some(true) {
            s.held.push(ju64(&ck, "held_ms"));
        }
    }
    c.wait_members_gone(job);
    let restart: Vec<&str> = if uncoordinated {
        let line = c.crctl_json(&["recovery-line", job]);
        for m in jlist(&line, "members") {
            let point = match ju64(m, "taken_unix_ms") {
                0 => {
                    s.at_start += 1;
                    started
                }
                t => t,
            };
            s.lost.push(failed.saturating_sub(point) as f64 / 1000.0);
        }
        vec!["restart", job, "--line"]
    } else {
        let last = committed_since(c, job, 0)
            .into_iter()
            .filter(|ck| jstr(ck, "scope").is_empty())
            .map(|ck| ju64(&ck, "started_unix_ms"))
            .filter(|&t| t <= failed)
            .max()
            .unwrap_or(started);
        s.lost = vec![failed.saturating_sub(last) as f64 / 1000.0; ring.len()];
        vec!["restart", job]
    };
    eprintln!(
        "cr-bench:   {protocol}: failed {:.1} s after the schedule began; lost {:.1} member-s ({} members back to their start)",
        (failed - since) as f64 / 1000.0,
        s.lost.iter().sum::<f64>(),
        s.at_start
    );
    if s.at_start > 0 {
        return (s, false);
    }
    let out = c.crctl(&restart);
    if !out.status.success() {
        panic!("crctl {restart:?} failed\n{}\n{}", out.show(), ring.diag());
    }
    ring.adopt();
    ring.wait_advanced(ADVANCE, "after the restart");
    ring.assert_no_fail();
    (s, true)
}

/// A ring of `job` with the bench's traffic, its retention and freeze
/// bound set; when it started (unix ms).
fn start<'c>(c: &'c Cluster, job: &str, o: &Opts) -> (Ring<'c>, u64) {
    eprintln!(
        "cr-bench: ring {job}: {} members over {} nodes, every {} s ...",
        o.members, o.nodes, o.interval
    );
    let placement: Vec<usize> = (0..o.members).map(|i| i % o.nodes + 1).collect();
    let env = [("WL_RING_PHASES".to_string(), o.phases.clone())];
    let started = now_ms();
    let ring = c.start_ring_env(job, &placement, &env);
    let freeze = (u64::from(o.interval) * 2 + 60).to_string();
    c.crctl(&[
        "job",
        job,
        "--keep",
        "2",
        "--freeze-timeout",
        &freeze,
        "--save-files",
        "64K",
    ])
    .assert_success("crctl job --keep --freeze-timeout --save-files");
    (ring, started)
}

fn measure(o: &Opts) -> Vec<Row> {
    if o.members < o.nodes {
        panic!("--members {} is fewer than --nodes {}", o.members, o.nodes);
    }
    let h = Harness::new("bench-protocols");
    let c = Cluster::new(&h, o.nodes);
    c.start_coordinator();
    c.start_agents(&(1..=o.nodes).collect::<Vec<_>>());
    let mut rng = Rng(o.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut rows = Vec::new();
    for protocol in &o.protocols {
        let mut job = format!("proto-{protocol}");
        let (mut ring, mut started) = start(&c, &job, o);
        let mut samples = Vec::new();
        for rep in 0..o.reps {
            let (s, restarted) = one_failure(&c, &mut ring, &job, protocol, o, &mut rng, started);
            samples.push(s);
            if !restarted && rep + 1 < o.reps {
                job = format!("proto-{protocol}-{}", rep + 1);
                (ring, started) = start(&c, &job, o);
            }
        }
        ring.kill_all();
        rows.push(Row {
            protocol: protocol.clone(),
            samples,
        });
    }
    rows
}

fn table(rows: &[Row], o: &Opts) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "# checkpoint protocols: {} members over {} nodes, every {} s, traffic {} (period:burst ms); \
         {} failures each at a random moment (medians)\n",
        o.members, o.nodes, o.interval, o.phases, o.reps
    );
    let _ = writeln!(
        t,
        "| protocol | member pause_ms median | p90 | max | limit_ms | held_ms | lost s per member | lost member-s | back to start |"
    );
    let _ = writeln!(t, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let frozen: Vec<u64> = r.samples.iter().flat_map(|s| s.frozen.clone()).collect();
        let mut sorted = frozen.clone();
        sorted.sort_unstable();
        let p90 = sorted
            .get((sorted.len() * 9 / 10).min(sorted.len().saturating_sub(1)))
            .map_or("-".into(), |v| v.to_string());
        let fmt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
        let per_member: Vec<u64> = r
            .samples
            .iter()
            .map(|s| (s.lost.iter().sum::<f64>() / s.lost.len().max(1) as f64 * 10.0) as u64)
            .collect();
        let total: Vec<u64> = r
            .samples
            .iter()
            .map(|s| (s.lost.iter().sum::<f64>() * 10.0) as u64)
            .collect();
        let _ = writeln!(
            t,
            "| {} | {} | {p90} | {} | {} | {} | {} | {} | {} |",
            r.protocol,
            fmt(median(frozen)),
            sorted.last().map_or("-".into(), |v| v.to_string()),
            fmt(median(r.samples.iter().map(|s| s.limit).collect())),
            fmt(median(
                r.samples.iter().flat_map(|s| s.held.clone()).collect()
            )),
            fmt(median(per_member).map(|v| v / 10.0)),
            fmt(median(total).map(|v| v / 10.0)),
            r.samples.iter().map(|s| s.at_start).sum::<usize>(),
        );
    }
    t
}

/// `cr-bench protocols ARGS...`.
pub fn run(o: Opts) -> Result<(), String> {
    let rows = on_cluster("protocols", o.bin_dir.as_deref(), || measure(&o))?;
    print!("{}", table(&rows, &o));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{assert_refused, parsed};

    #[test]
    fn command_lines() {
        let o = parsed::<Opts>("protocols");
        assert!(o.members == 32 && o.nodes == 3 && o.interval == 10 && o.reps == 3);
        assert_eq!(o.protocols, PROTOCOLS);
        let o = parsed::<Opts>("protocols --members 4 --protocols non-blocking --interval 2");
        assert!(o.members == 4 && o.protocols == ["non-blocking"] && o.interval == 2);
        assert_refused(&[
            "protocols --members 1",
            "protocols --interval 0",
            "protocols --protocols lazy",
            "protocols --reps 0",
        ]);
    }

    #[test]
    fn failure_times_spread_over_the_interval() {
        let mut r = Rng(0x9E37_79B9_7F4A_7C15);
        let v: Vec<f64> = (0..1000).map(|_| r.unit()).collect();
        assert!(v.iter().all(|x| (0.0..1.0).contains(x)));
        let mean = v.iter().sum::<f64>() / v.len() as f64;
        assert!((0.45..0.55).contains(&mean), "{mean}");
    }
}
