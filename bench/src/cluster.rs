//! `cr-bench cluster`: the pause a coordinated checkpoint (CONTINUE) imposes
//! on a multi-node job, against the number of members and of nodes.
//!
//! The cluster is the one of the end-to-end tests (`cr_tests::cluster`):
//! nodes n1..nK and a coordinator in network namespaces joined by a bridge,
//! one cr-agent per node, cr-coordinatord, crctl. For every (members,
//! nodes) with members >= nodes, a ring of `wl_ring` members (member i on
//! node i % nodes + 1, each exchanging paced, self-checked messages with
//! both neighbours) is checkpointed `--reps` times with `crctl --json
//! checkpoint`; between two checkpoints every member must have advanced
//! (and none may report FAIL). The table shows the medians of the
//! CheckpointInfo's times: `pause_ms` (longest time a process of the job
//! was frozen), `prepare_ms`, `check_ms`, `dump_ms`, `commit_ms`,
//! `duration_ms`; with `--modes pre-copy` (`crctl checkpoint --pre-copy`)
//! also the pre-copy's `rounds` and `pre_copy_ms` (before the freeze, not
//! in `duration_ms`). `--ballast MIB:MBS` gives member 0 that much memory,
//! rewritten at that rate (and checked by the member). Retention keeps the last checkpoint of each ring only.
//! Before each checkpoint, `limit_ms` is the machine's own limit for the
//! same members, in the same run: their plainest pause ([`crate::freeze`]:
//! all stopped at once with ptrace, their writable memory read, let go).
//!
//! Needs root and the workspace's binaries (`cargo build --release
//! --workspace`): cr-agent, cr-coordinatord, crctl, cr_run and wl_ring next
//! to cr-bench, or in `--bin-dir`.

use crate::{int_in, require_bins};
use clap::{ArgAction, Args};
use cr_tests::cluster::{jstr, ju64, Cluster};
use cr_tests::Harness;
use std::fmt::Write as _;
use std::path::PathBuf;

/// Messages every member must carry between two checkpoints.
const ADVANCE: u64 = 2000;

/// The help's last words of every benchmark on the test cluster.
pub(crate) const CLUSTER_HELP: &str = "Everything runs in network namespaces created and \
     removed by cr-bench (10.99.0.0/24 inside them only). Progress goes to stderr, the \
     table to stdout.";

/// `cr-bench cluster`: pause of a coordinated checkpoint of a ring job over
/// nodes.
#[derive(Args)]
#[command(after_help = CLUSTER_HELP)]
pub struct Opts {
    /// Ring sizes (at most 200).
    #[arg(
        long,
        value_name = "N,N,...",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = "1,4,16,32",
        value_parser = int_in::<usize>(1..=200),
    )]
    members: Vec<usize>,
    /// Numbers of nodes the ring is spread over (at most 200); a ring is only
    /// run over at most as many nodes as it has members.
    #[arg(
        long,
        value_name = "N,N,...",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = "1,2,3",
        value_parser = int_in::<usize>(1..=200),
    )]
    nodes: Vec<usize>,
    /// Checkpoints per ring and mode; the table shows medians.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = int_in::<usize>(1..))]
    reps: usize,
    /// How each ring is checkpointed: `plain` (`crctl checkpoint`) and/or
    /// `pre-copy` (`crctl checkpoint --pre-copy`: pre-dump rounds while
    /// the job runs, then the freeze).
    #[arg(
        long,
        value_name = "MODE,...",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = "plain",
        value_parser = ["plain", "pre-copy"],
    )]
    modes: Vec<String>,
    /// Member 0 of each ring holds MIB MiB it rewrites at MBS MB/s (and
    /// checks), e.g. 1024:10.
    #[arg(long, value_name = "MIB:MBS")]
    ballast: Option<String>,
    /// Where cr-agent, cr-coordinatord, crctl, cr_run and wl_ring live
    /// (default: the directory of this executable).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
}

/// The times of one checkpoint, from its CheckpointInfo.
#[derive(Default, Clone, Copy)]
struct Sample {
    pause: u64,
    /// The plainest pause of the same members ([`crate::freeze`]), ms.
    limit: u64,
    prepare: u64,
    check: u64,
    dump: u64,
    commit: u64,
    duration: u64,
    /// Pre-copy: its rounds and their time (before the freeze).
    rounds: u64,
    pre_copy: u64,
}

struct Row {
    members: usize,
    nodes: usize,
    mode: String,
    samples: Vec<Sample>,
}

pub(crate) fn median(mut v: Vec<u64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2] as f64
    } else {
        (v[n / 2 - 1] + v[n / 2]) as f64 / 2.0
    })
}

/// Runs every ring; panics (the harness's way) on any failure.
fn measure(o: &Opts) -> Vec<Row> {
    let h = Harness::new("bench-cluster");
    let max_nodes = o.nodes.iter().copied().max().unwrap_or(1);
    let c = Cluster::new(&h, max_nodes);
    c.start_coordinator();
    c.start_agents(&(1..=max_nodes).collect::<Vec<_>>());
    let mut rows = Vec::new();
    for &nodes in &o.nodes {
        for &members in &o.members {
            if members < nodes {
                continue;
            }
            let job = format!("bench-{members}x{nodes}");
            let placement: Vec<usize> = (0..members).map(|i| i % nodes + 1).collect();
            eprintln!("cr-bench: ring of {members} members over {nodes} nodes ...");
            let ring = match &o.ballast {
                Some(b) => c.start_ring_ballast(&job, &placement, b),
                None => c.start_ring(&job, &placement),
            };
            // A big member may stay frozen long on a loaded machine.
            let out = c.crctl(&["job", &job, "--keep", "1", "--freeze-timeout", "300"]);
            if !out.status.success() {
                panic!("crctl job {job} --keep 1 failed\n{}", out.show());
            }
            ring.wait_advanced(ADVANCE, "before the first checkpoint");
            for mode in &o.modes {
                let mut samples = Vec::new();
                for rep in 0..o.reps {
                    let (limit, _) = crate::freeze::limit_pause(&ring.host_pids())
                        .unwrap_or_else(|e| panic!("the plainest pause of {job}: {e}"));
                    ring.wait_advanced(ADVANCE, "after the plainest pause");
                    let mut args = vec!["checkpoint", job.as_str()];
                    if mode == "pre-copy" {
                        args.push("--pre-copy");
                    }
                    let info = c.crctl_json(&args);
                    if jstr(&info, "state") != "committed" {
                        panic!(
                            "checkpoint of {job} not committed: {info:#}\n{}",
                            ring.diag()
                        );
                    }
                    let s = Sample {
                        pause: ju64(&info, "pause_ms"),
                        limit: limit.as_millis() as u64,
                        prepare: ju64(&info, "prepare_ms"),
                        check: ju64(&info, "check_ms"),
                        dump: ju64(&info, "dump_ms"),
                        commit: ju64(&info, "commit_ms"),
                        duration: ju64(&info, "duration_ms"),
                        rounds: ju64(&info, "pre_copy_rounds"),
                        pre_copy: ju64(&info, "pre_copy_ms"),
                    };
                    eprintln!(
                    "cr-bench:   {mode} {}/{}: pause {} ms (limit {} ms), duration {} ms, pre-copy {} rounds in {} ms",
                    rep + 1,
                    o.reps,
                    s.pause,
                    s.limit,
                    s.duration,
                    s.rounds,
                    s.pre_copy
                );
                    samples.push(s);
                    ring.wait_advanced(ADVANCE, "after a checkpoint (continue)");
                }
                ring.assert_no_fail();
                rows.push(Row {
                    members,
                    nodes,
                    mode: mode.clone(),
                    samples,
                });
            }
        }
    }
    rows
}

fn table(rows: &[Row], reps: usize) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# coordinated checkpoint (CONTINUE) of a ring job: medians of {reps} checkpoints\n"
    );
    let _ = writeln!(
        o,
        "| members | nodes | mode | pause_ms | pause min-max | limit_ms | prepare_ms | check_ms \
         | dump_ms | commit_ms | duration_ms | rounds | pre_copy_ms |"
    );
    let _ = writeln!(
        o,
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows {
        let m = |f: fn(&Sample) -> u64| {
            median(r.samples.iter().map(f).collect()).map_or("-".into(), |v| format!("{v:.1}"))
        };
        let pauses: Vec<u64> = r.samples.iter().map(|s| s.pause).collect();
        let range = match (pauses.iter().min(), pauses.iter().max()) {
            (Some(a), Some(b)) => format!("{a}-{b}"),
            _ => "-".into(),
        };
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {range} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.members,
            r.nodes,
            r.mode,
            m(|s| s.pause),
            m(|s| s.limit),
            m(|s| s.prepare),
            m(|s| s.check),
            m(|s| s.dump),
            m(|s| s.commit),
            m(|s| s.duration),
            m(|s| s.rounds),
            m(|s| s.pre_copy),
        );
    }
    o
}

/// Run `measure` on the test harness's cluster, as root, with the
/// binaries of `bin_dir` (or of this executable's directory); a panic of the
/// harness becomes one error line (its details are printed above it).
pub(crate) fn on_cluster<T>(
    what: &str,
    bin_dir: Option<&std::path::Path>,
    measure: impl FnOnce() -> T,
) -> Result<T, String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(format!(
            "cr-bench {what} needs root (network namespaces, ptrace)"
        ));
    }
    let dir = crate::bin_dir(bin_dir)?;
    let bins: Vec<PathBuf> = [
        "cr-agent",
        "cr-coordinatord",
        "crctl",
        "cr_run",
        "cr_rsh",
        "wl_ring",
    ]
    .iter()
    .map(|b| dir.join(b))
    .collect();
    require_bins(&bins.iter().collect::<Vec<_>>())?;
    // The harness finds the binaries there.
    std::env::set_var("CR_BIN_DIR", &dir);
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(measure)).map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .and_then(|m| m.lines().next().map(str::to_string))
            .map(|l| format!("{l} (details above)"))
            .unwrap_or_else(|| "the cluster harness panicked (details above)".into())
    })
}

/// `cr-bench cluster ARGS...`.
pub fn run(o: Opts) -> Result<(), String> {
    let rows = on_cluster("cluster", o.bin_dir.as_deref(), || measure(&o))?;
    print!("{}", table(&rows, o.reps));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{assert_refused, parsed};

    #[test]
    fn command_lines() {
        let o = parsed::<Opts>("cluster");
        assert!(o.members == [1, 4, 16, 32] && o.nodes == [1, 2, 3] && o.reps == 3);
        assert!(o.bin_dir.is_none() && o.modes == ["plain"] && o.ballast.is_none());
        let o = parsed::<Opts>(
            "cluster --members 2,200 --nodes 2 --reps 1 --modes plain,pre-copy --ballast 1024:10",
        );
        assert!(o.members == [2, 200] && o.nodes == [2] && o.reps == 1);
        assert!(o.modes == ["plain", "pre-copy"] && o.ballast.as_deref() == Some("1024:10"));
        assert_refused(&[
            "cluster --members 0",
            "cluster --members 201",
            "cluster --nodes 201",
            "cluster --reps 0",
            "cluster --modes lazy",
        ]);
    }
}
