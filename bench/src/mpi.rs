//! `cr-bench mpi`: what periodic coordinated checkpoints cost a real MPI
//! job: the pause (longest time a process of the job was frozen), the
//! checkpoint's duration, and the job's slowdown at a checkpoint interval,
//! next to the same job without checkpoints.
//!
//! The cluster is the one of the end-to-end tests (`cr_tests::cluster`):
//! nodes n1..nK (network, UTS and mount namespaces) joined by a bridge, one
//! cr-agent per node, cr-coordinatord, crctl. The job is
//! tests/workloads/mpi_check.c built with Open MPI's `mpicc`, run by
//! `mpirun` under `cr_run --job` on n1 with cr_rsh as its ssh
//! (docs/MPI.md): `--ranks` ranks spread evenly over `--nodes` nodes, each
//! holding `--mib` MiB of memory of its own (filled at start, checked whole
//! at the end) and running `--iters` allreduce iterations (each rank checks
//! every sum); ranks waiting for a message yield the CPU unless `--spin`.
//! Rank 0 prints a timed progress line every `--progress-every`
//! iterations.
//!
//! First the machine's limits for this job, in the same run: a short run
//! of the same job whose ranks are, once they run, all stopped at once and
//! let go (`stop_ms`: the least any freeze of the job costs), then stopped
//! with all their writable memory read (`read_ms`: the plainest pause of
//! a checkpoint that copies everything while frozen; [`crate::freeze`]).
//! Then the job runs without checkpoints, then once per `--modes` entry,
//! checkpointed (`crctl --json checkpoint`, the job runs on; `--pre-copy`
//! and/or `--non-blocking` as the mode says) every `--interval` seconds
//! from its start; every run must end with the program's `RESULT OK`, all
//! with the same result. The slowdown compares their wall times, from
//! `cr_run`'s start to its exit. Retention keeps the last checkpoint only;
//! with `--incremental` the jobs are incremental (each checkpoint, and a
//! pre-copy's first round, copies only what changed since the one before).
//!
//! Per checkpoint: `pause_ms` (CheckpointInfo: longest time a process of
//! the job was frozen), `member_ms` (the longest `frozen_ms` of its
//! member images), `duration_ms` (freeze to commit), `pre_copy_ms` (the
//! pre-dump rounds before the freeze), and what the MPI program saw, from
//! its progress lines: `stall_ms`, the longest gap between two progress
//! lines that overlaps the checkpoint (pre-copy and freeze) less what its
//! iterations take at the run's usual pace (its median gap: the machine
//! is shared, the pace varies from run to run), and `lost_ms`, the time
//! from the last progress line before the checkpoint to the first one
//! after it less what the iterations done in between take at that pace. The
//! overhead at a 10-minute interval is `lost_ms` / 600 s.
//!
//! Needs root, Open MPI (`openmpi-bin`, `libopenmpi-dev`) and the
//! workspace's binaries (cr-agent, cr-coordinatord, crctl, cr_run, cr_rsh)
//! next to cr-bench, or in `--bin-dir`.

use crate::cluster::{median, on_cluster};
use crate::int_in;
use clap::{ArgAction, Args};
use cr_tests::cluster::{jlist, jstr, ju64, poll_until, program_pids, Cluster, POLL_PERIOD};
use cr_tests::{mpi, read_text, tail, Harness};
use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::Path;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Longest a run may take.
const RUN_TIMEOUT: Duration = Duration::from_secs(3600);

/// How the checkpointed runs checkpoint (`--modes`).
const MODES: [&str; 4] = ["plain", "pre-copy", "non-blocking", "pre-copy+non-blocking"];

/// Iterations of the short run that measures the limits.
const LIMITS_ITERS: usize = 200;

/// The interval the overhead is worked out for (the goal: < 1 %
/// at 10 minutes).
const OVERHEAD_INTERVAL_S: f64 = 600.0;

/// `cr-bench mpi`.
#[derive(Args)]
#[command(after_help = crate::cluster::CLUSTER_HELP)]
pub struct Opts {
    /// MPI ranks of the job.
    #[arg(long, value_name = "N", default_value_t = 12, value_parser = int_in::<usize>(1..=256))]
    ranks: usize,
    /// Nodes the ranks are spread over (evenly).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = int_in::<usize>(1..=16))]
    nodes: usize,
    /// Memory of each rank, MiB.
    #[arg(long, value_name = "MIB", default_value_t = 256, value_parser = int_in::<usize>(0..=65536))]
    mib: usize,
    /// Allreduce iterations of the job (its length).
    #[arg(long, value_name = "N", default_value_t = 20000, value_parser = int_in::<usize>(1..))]
    iters: usize,
    /// Pause of each rank between two iterations, microseconds.
    #[arg(long, value_name = "US", default_value_t = 0, value_parser = int_in::<usize>(0..=10_000_000))]
    pace_us: usize,
    /// Let ranks waiting for a message spin on the CPU (Open MPI's
    /// default) instead of yielding it (`mpi_yield_when_idle 1`, the
    /// default here): the nodes of the test cluster share this machine's
    /// cores, and spinning ranks take them from the ranks that have work.
    #[arg(long)]
    spin: bool,
    /// Seconds between two checkpoints of the checkpointed runs.
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = int_in::<u64>(1..))]
    interval: u64,
    /// One checkpointed run per mode: `plain` (`crctl checkpoint`),
    /// `pre-copy` (`--pre-copy`: memory pre-dumped while the job runs,
    /// then a short freeze), `non-blocking` (`--non-blocking`: each member
    /// frozen only for its own dump) or both.
    #[arg(
        long,
        value_name = "MODE,...",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = "plain,pre-copy",
        value_parser = MODES,
    )]
    modes: Vec<String>,
    /// The checkpointed jobs are incremental (`crctl job J --incremental
    /// on`): each checkpoint stores what changed since the one before,
    /// and with pre-copy its first round copies only that too (else every
    /// checkpoint copies the whole memory again).
    #[arg(long)]
    incremental: bool,
    /// Iterations between two progress lines of the program (the
    /// resolution of the stall it sees).
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = int_in::<usize>(1..))]
    progress_every: usize,
    /// Where cr-agent, cr-coordinatord, crctl, cr_run and cr_rsh live
    /// (default: the directory of this executable).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
}

/// The times of one checkpoint, from its CheckpointInfo.
struct Sample {
    pause: u64,
    /// The longest `frozen_ms` of its member images.
    member: u64,
    duration: u64,
    pre_copy: u64,
    rounds: u64,
    /// Non-blocking: how long connections were held.
    held: u64,
    /// When its freeze began (after the pre-copy), Unix ms.
    started_ms: u64,
    /// What the program saw ([`Run::seen`]): longest progress gap over
    /// the checkpoint less the usual one, and the time lost, ms.
    stall: Option<f64>,
    lost: Option<f64>,
}

/// One run of the job.
struct Run {
    mode: String,
    wall: Duration,
    result: String,
    samples: Vec<Sample>,
    /// The first line of each failed checkpoint's error.
    failed: Vec<String>,
    /// Rank 0's progress lines: (iteration, wall clock s).
    progress: Vec<(u64, f64)>,
}

/// Gaps between consecutive progress lines: (from, to) in s, iterations.
fn gaps(p: &[(u64, f64)]) -> impl Iterator<Item = (f64, f64, u64)> + '_ {
    p.windows(2).map(|w| (w[0].1, w[1].1, w[1].0 - w[0].0))
}

impl Run {
    /// Median seconds per iteration between progress lines: the run's
    /// usual pace (checkpoints cover few of its gaps).
    fn sec_per_iter(&self) -> Option<f64> {
        let mut v: Vec<f64> = gaps(&self.progress)
            .filter(|g| g.2 > 0)
            .map(|(a, b, n)| (b - a) / n as f64)
            .collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    }

    /// Fills every sample's `stall` and `lost` from the progress lines,
    /// against `per_iter` seconds per iteration (the usual pace).
    fn seen(&mut self, per_iter: f64) {
        for s in &mut self.samples {
            let from = (s.started_ms.saturating_sub(s.pre_copy)) as f64 / 1000.0;
            let to = (s.started_ms + s.duration) as f64 / 1000.0;
            let over: Vec<(f64, f64, u64)> = gaps(&self.progress)
                .filter(|&(a, b, _)| b > from && a < to)
                .collect();
            let (Some(first), Some(last)) = (over.first(), over.last()) else {
                continue;
            };
            let n: u64 = over.iter().map(|g| g.2).sum();
            s.lost = Some(((last.1 - first.0) - n as f64 * per_iter) * 1000.0);
            s.stall = over
                .iter()
                .map(|&(a, b, n)| (b - a - n as f64 * per_iter) * 1000.0)
                .max_by(f64::total_cmp);
        }
    }
}

/// The CheckpointInfo's times of one committed checkpoint.
fn sample(info: &serde_json::Value) -> Sample {
    Sample {
        pause: ju64(info, "pause_ms"),
        member: jlist(info, "images")
            .iter()
            .map(|i| ju64(i, "frozen_ms"))
            .max()
            .unwrap_or(0),
        duration: ju64(info, "duration_ms"),
        pre_copy: ju64(info, "pre_copy_ms"),
        rounds: ju64(info, "pre_copy_rounds"),
        held: ju64(info, "held_ms"),
        started_ms: ju64(info, "started_unix_ms"),
        stall: None,
        lost: None,
    }
}

/// The machine's limits for the job's ranks, measured on a short run.
struct Limits {
    /// All stopped at once and let go, ms.
    stop: u64,
    /// All stopped, their writable memory read, let go, ms; bytes read.
    read: u64,
    bytes: u64,
}

/// What a run does besides waiting for the job's end.
enum Action<'a> {
    /// Nothing (the run without checkpoints).
    Nothing,
    /// Checkpoints every `interval` with `crctl checkpoint` and `args`.
    Checkpoints {
        interval: Duration,
        args: &'a [&'a str],
    },
    /// Once the job runs, measure the limits on its ranks.
    Limits(&'a mut Option<Limits>),
}

/// Runs the job once as `job` (`iters` iterations, doing `act` meanwhile)
/// and waits for its `RESULT OK`; panics (the harness's way) on any
/// failure.
fn run_job(c: &Cluster, o: &Opts, prog: &str, job: &str, iters: usize, mut act: Action) -> Run {
    let per_node = o.ranks.div_ceil(o.nodes);
    let hosts: Vec<String> = (1..=o.nodes).map(|k| format!("n{k}:{per_node}")).collect();
    let (iters, pace, mib, every) = (
        iters.to_string(),
        o.pace_us.to_string(),
        o.mib.to_string(),
        o.progress_every.to_string(),
    );
    let tmp = c.dir.join(format!("tmp-{job}"));
    let idle = if o.spin { "0" } else { "1" };
    let argv: Vec<OsString> = mpi::open_mpi(
        &tmp,
        o.ranks,
        &hosts.join(","),
        &[("mpi_yield_when_idle", idle)],
        &[prog, "allreduce", &iters, &pace, &mib, &every],
    )
    .into_iter()
    .map(OsString::from)
    .collect();
    eprintln!(
        "cr-bench: job {job}: {} ranks x {} MiB on {} nodes, {iters} iterations{}",
        o.ranks,
        o.mib,
        o.nodes,
        match &act {
            Action::Nothing => ", no checkpoints".into(),
            Action::Checkpoints { interval, args } => format!(
                ", a checkpoint every {} s (crctl checkpoint{})",
                interval.as_secs(),
                args.iter().map(|a| format!(" {a}")).collect::<String>()
            ),
            Action::Limits(_) => ", to measure the limits".into(),
        }
    );
    let t0 = Instant::now();
    let mut runner = c.run_member_env(job, 1, job, &argv, &[mpi::path_env()]);
    if let Action::Checkpoints { .. } = act {
        // The coordinator knows the job once n1's agent has reported its
        // member (a heartbeat after cr_run joined it).
        poll_until(
            &format!("crctl job {job} --keep 1 to find the job"),
            Duration::from_secs(60),
            POLL_PERIOD,
            || {
                let incr = if o.incremental { "on" } else { "off" };
                c.crctl(&["job", job, "--keep", "1", "--incremental", incr])
                    .status
                    .success()
            },
            || runner.describe(),
        );
    }
    let mut samples = Vec::new();
    let mut failed = Vec::new();
    let mut next = match act {
        Action::Checkpoints { interval, .. } => Some(t0 + interval),
        _ => None,
    };
    loop {
        if runner.proc.try_exit().is_some() {
            break;
        }
        if crate::check_interrupted().is_err() {
            // Unwinds through the cluster's drop: everything is removed.
            panic!("interrupted");
        }
        if t0.elapsed() > RUN_TIMEOUT {
            panic!(
                "job {job} did not end within {RUN_TIMEOUT:?}\n{}",
                runner.diag()
            );
        }
        if read_text(&runner.stdout).contains("FAIL") {
            panic!("job {job} reported a failure\n{}", runner.diag());
        }
        if let Action::Limits(slot) = &mut act {
            if slot.is_none() && !mpi::progress_lines(&read_text(&runner.stdout)).is_empty() {
                **slot = Some(limits(Path::new(prog), o.ranks));
            }
        }
        match (next, &act) {
            (Some(at), Action::Checkpoints { interval, args }) if Instant::now() >= at => {
                let mut cmd = vec!["--json", "checkpoint", job, "--freeze-timeout", "120"];
                cmd.extend_from_slice(args);
                let out = c.crctl(&cmd);
                // A checkpoint may fail (the job runs on, as the loop
                // checks): counted, with its reason.
                let info = if out.status.success() {
                    serde_json::from_str(&out.stdout).unwrap_or_default()
                } else {
                    let why = out.stderr.lines().next().unwrap_or("").to_string();
                    eprintln!("cr-bench:   checkpoint failed: {why}");
                    failed.push(why);
                    serde_json::Value::Null
                };
                // The job may have ended meanwhile: only committed ones count.
                if jstr(&info, "state") == "committed" {
                    let s = sample(&info);
                    eprintln!(
                        "cr-bench:   checkpoint {} at {:.0} s: pause {} ms (longest member {} ms), \
                         duration {} ms, pre-copy {} rounds in {} ms",
                        samples.len() + 1,
                        t0.elapsed().as_secs_f64(),
                        s.pause,
                        s.member,
                        s.duration,
                        s.rounds,
                        s.pre_copy
                    );
                    samples.push(s);
                }
                next = Some(at + *interval);
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    let wall = t0.elapsed();
    let out = read_text(&runner.stdout);
    let Some(result) = out.lines().find(|l| l.starts_with("RESULT OK")) else {
        panic!(
            "job {job} ended without RESULT OK\n{}\n{}",
            tail(&out, 20),
            runner.diag()
        );
    };
    eprintln!("cr-bench:   {result} ({:.1} s)", wall.as_secs_f64());
    Run {
        mode: job.to_string(),
        wall,
        result: result.to_string(),
        samples,
        failed,
        progress: mpi::progress_lines(&out),
    }
}

/// The limits on the running ranks of `prog` (`ranks` of them).
fn limits(prog: &Path, ranks: usize) -> Limits {
    let pids = program_pids(prog);
    if pids.len() != ranks {
        panic!(
            "found {} ranks of {} running, want {ranks}",
            pids.len(),
            prog.display()
        );
    }
    let stop = crate::freeze::stop_pause(&pids)
        .unwrap_or_else(|e| panic!("stopping the job's ranks: {e}"));
    let (read, bytes) = crate::freeze::limit_pause(&pids)
        .unwrap_or_else(|e| panic!("the plainest pause of the job's ranks: {e}"));
    let l = Limits {
        stop: stop.as_millis() as u64,
        read: read.as_millis() as u64,
        bytes,
    };
    eprintln!(
        "cr-bench:   limits: {ranks} ranks stopped and let go in {} ms; stopped, {} MiB read, let go in {} ms",
        l.stop,
        l.bytes >> 20,
        l.read
    );
    l
}

fn measure(o: &Opts) -> (Limits, Run, Vec<Run>) {
    let h = Harness::new("bench-mpi");
    let prog = mpi::build_check(&h.dir, "mpicc.openmpi", "mpi_check_ompi");
    let prog = prog.to_string_lossy().into_owned();
    let c = Cluster::new(&h, o.nodes);
    c.start_coordinator();
    c.start_agents(&(1..=o.nodes).collect::<Vec<_>>());
    let mut lim = None;
    run_job(
        &c,
        o,
        &prog,
        "mpi-limits",
        LIMITS_ITERS,
        Action::Limits(&mut lim),
    );
    let Some(lim) = lim else {
        panic!("the limits job ended before it printed progress");
    };
    let plain = run_job(&c, o, &prog, "mpi-plain", o.iters, Action::Nothing);
    let interval = Duration::from_secs(o.interval);
    let mut runs = Vec::new();
    for mode in &o.modes {
        let args: Vec<&str> = mode
            .split('+')
            .filter(|m| *m != "plain")
            .map(|m| {
                if m == "pre-copy" {
                    "--pre-copy"
                } else {
                    "--non-blocking"
                }
            })
            .collect();
        let job = format!("mpi-ckpt-{}", mode.replace('+', "-"));
        let act = Action::Checkpoints {
            interval,
            args: &args,
        };
        let mut run = run_job(&c, o, &prog, &job, o.iters, act);
        run.mode = mode.clone();
        if plain.result != run.result {
            panic!(
                "the checkpointed job's result differs: {:?} without checkpoints, {:?} with {mode}",
                plain.result, run.result
            );
        }
        // Against the run's own pace: the machine is shared, the pace
        // varies from one run to the next.
        let per_iter = run
            .sec_per_iter()
            .unwrap_or_else(|| panic!("job {job} printed too few progress lines"));
        run.seen(per_iter);
        runs.push(run);
    }
    (lim, plain, runs)
}

fn table(o: &Opts, lim: &Limits, plain: &Run, runs: &[Run]) -> String {
    let mut s = String::new();
    let a = plain.wall.as_secs_f64();
    let _ = writeln!(
        s,
        "# Open MPI job, {} ranks x {} MiB on {} nodes, {} allreduce iterations \
         (pace {} us, idle ranks {}, progress every {}); a checkpoint every {} s{}\n",
        o.ranks,
        o.mib,
        o.nodes,
        o.iters,
        o.pace_us,
        if o.spin { "spin" } else { "yield" },
        o.progress_every,
        o.interval,
        if o.incremental { ", incremental" } else { "" }
    );
    let _ = writeln!(
        s,
        "limits (same run, the {} ranks): all stopped and let go {} ms; all stopped, \
         {} MiB read, let go {} ms\n",
        o.ranks,
        lim.stop,
        lim.bytes >> 20,
        lim.read
    );
    let _ = writeln!(
        s,
        "| mode | wall_s | slowdown | checkpoints (failed) | pause_ms median (max) | member_ms median \
         | stall_ms median (max) | lost_ms median | duration_ms median | pre_copy_ms median \
         | rounds | held_ms | overhead at 10 min |"
    );
    let _ = writeln!(
        s,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let _ = writeln!(
        s,
        "| no checkpoints | {a:.1} | - | 0 | - | - | - | - | - | - | - | - | - |"
    );
    for r in runs {
        let m = |f: fn(&Sample) -> u64| {
            median(r.samples.iter().map(f).collect()).map_or("-".into(), |v| format!("{v:.0}"))
        };
        let max = |f: fn(&Sample) -> u64| {
            r.samples
                .iter()
                .map(f)
                .max()
                .map_or("-".into(), |v| v.to_string())
        };
        let seen = |f: fn(&Sample) -> Option<f64>| {
            let mut v: Vec<f64> = r.samples.iter().filter_map(f).collect();
            v.sort_by(f64::total_cmp);
            (v.get(v.len() / 2).copied(), v.last().copied())
        };
        let (stall, stall_max) = seen(|x| x.stall);
        let (lost, _) = seen(|x| x.lost);
        let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
        let b = r.wall.as_secs_f64();
        let _ = writeln!(
            s,
            "| {} | {b:.1} | {:+.1} % | {} ({}) | {} ({}) | {} | {} ({}) | {} | {} | {} | {} | {} | {} |",
            r.mode,
            (b - a) / a * 100.0,
            r.samples.len(),
            r.failed.len(),
            m(|x| x.pause),
            max(|x| x.pause),
            m(|x| x.member),
            ms(stall),
            ms(stall_max),
            ms(lost),
            m(|x| x.duration),
            m(|x| x.pre_copy),
            m(|x| x.rounds),
            m(|x| x.held),
            lost.map_or("-".into(), |l| format!(
                "{:.3} %",
                l / 1000.0 / OVERHEAD_INTERVAL_S * 100.0
            )),
        );
    }
    for r in runs {
        for why in &r.failed {
            let _ = writeln!(s, "\n{}: a checkpoint failed: {why}", r.mode);
        }
    }
    let _ = writeln!(
        s,
        "\nstall_ms: longest progress gap over a checkpoint less the same iterations' time \
         at the run's median pace; lost_ms: time from the last progress line before a \
         checkpoint (pre-copy included) to the first after it, less the same; overhead at 10 min: \
         lost_ms / 600 s.\nresult of every run: {}",
        plain.result
    );
    s
}

/// `cr-bench mpi ARGS...`.
pub fn run(o: Opts) -> Result<(), String> {
    crate::install_signal_handlers();
    let (lim, plain, runs) = on_cluster("mpi", o.bin_dir.as_deref(), || measure(&o))?;
    print!("{}", table(&o, &lim, &plain, &runs));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{assert_refused, parsed};

    #[test]
    fn command_lines() {
        let o = parsed::<Opts>("mpi");
        assert!(o.ranks == 12 && o.nodes == 3 && o.mib == 256 && o.interval == 60 && !o.spin);
        assert!(o.modes == ["plain", "pre-copy"] && o.progress_every == 5 && !o.incremental);
        let o = parsed::<Opts>(
            "mpi --ranks 6 --mib 0 --iters 100 --interval 5 --spin \
             --modes pre-copy+non-blocking,non-blocking --progress-every 1 --incremental",
        );
        assert!(o.incremental);
        assert!(o.ranks == 6 && o.mib == 0 && o.iters == 100 && o.interval == 5 && o.spin);
        assert!(o.modes == ["pre-copy+non-blocking", "non-blocking"] && o.progress_every == 1);
        assert_refused(&[
            "mpi --ranks 0",
            "mpi --nodes 0",
            "mpi --interval 0",
            "mpi --modes lazy",
            "mpi --progress-every 0",
        ]);
    }

    /// What the program saw of a checkpoint, from made-up progress lines:
    /// 1 iteration every 10 ms, one gap of 510 ms over the checkpoint.
    #[test]
    fn stall_and_lost_time() {
        let mut p: Vec<(u64, f64)> = (0..10).map(|i| (i, 100.0 + i as f64 * 0.01)).collect();
        p.extend((10..20).map(|i| (i, 100.6 + (i - 10) as f64 * 0.01)));
        let s = sample(&serde_json::json!({
            "started_unix_ms": 100_150u64, "duration_ms": 200u64, "pre_copy_ms": 50u64,
        }));
        let mut r = Run {
            mode: "pre-copy".into(),
            wall: Duration::ZERO,
            result: String::new(),
            samples: vec![s],
            failed: Vec::new(),
            progress: p,
        };
        let per_iter = r.sec_per_iter().unwrap();
        assert!((per_iter - 0.01).abs() < 1e-9);
        r.seen(per_iter);
        let (stall, lost) = (r.samples[0].stall.unwrap(), r.samples[0].lost.unwrap());
        assert!((stall - 500.0).abs() < 1e-6, "{stall}");
        assert!((lost - 500.0).abs() < 1e-6, "{lost}");
    }
}
