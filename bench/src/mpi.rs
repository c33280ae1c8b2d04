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
//! It runs twice, first without checkpoints, then checkpointed
//! (`crctl --json checkpoint`, the job runs on) every `--interval` seconds
//! from its start; both runs must end with the program's `RESULT OK`. The
//! slowdown compares their wall times, from `cr_run`'s start to its exit.
//! Retention keeps the last checkpoint only.
//!
//! Needs root, Open MPI (`openmpi-bin`, `libopenmpi-dev`) and the
//! workspace's binaries (cr-agent, cr-coordinatord, crctl, cr_run, cr_rsh)
//! next to cr-bench, or in `--bin-dir`.

use crate::cluster::{median, on_cluster};
use crate::int_in;
use clap::Args;
use cr_tests::cluster::{jstr, ju64, poll_until, Cluster, POLL_PERIOD};
use cr_tests::{mpi, read_text, tail, Harness};
use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// Longest a run may take.
const RUN_TIMEOUT: Duration = Duration::from_secs(3600);

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
    /// Seconds between two checkpoints of the checkpointed run.
    #[arg(long, value_name = "SECS", default_value_t = 60, value_parser = int_in::<u64>(1..))]
    interval: u64,
    /// Where cr-agent, cr-coordinatord, crctl, cr_run and cr_rsh live
    /// (default: the directory of this executable).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
}

/// The times of one checkpoint, from its CheckpointInfo.
struct Sample {
    pause: u64,
    duration: u64,
}

/// One run of the job.
struct Run {
    wall: Duration,
    result: String,
    samples: Vec<Sample>,
}

/// Runs the job once as `job` (checkpointed every `interval` if given) and
/// waits for its `RESULT OK`; panics (the harness's way) on any failure.
fn run_job(c: &Cluster, o: &Opts, prog: &str, job: &str, interval: Option<Duration>) -> Run {
    let per_node = o.ranks.div_ceil(o.nodes);
    let hosts: Vec<String> = (1..=o.nodes).map(|k| format!("n{k}:{per_node}")).collect();
    let (iters, pace, mib) = (
        o.iters.to_string(),
        o.pace_us.to_string(),
        o.mib.to_string(),
    );
    let tmp = c.dir.join(format!("tmp-{job}"));
    let idle = if o.spin { "0" } else { "1" };
    let argv: Vec<OsString> = mpi::open_mpi(
        &tmp,
        o.ranks,
        &hosts.join(","),
        &[("mpi_yield_when_idle", idle)],
        &[prog, "allreduce", &iters, &pace, &mib],
    )
    .into_iter()
    .map(OsString::from)
    .collect();
    eprintln!(
        "cr-bench: job {job}: {} ranks x {} MiB on {} nodes, {} iterations{}",
        o.ranks,
        o.mib,
        o.nodes,
        o.iters,
        interval.map_or(", no checkpoints".into(), |i| format!(
            ", a checkpoint every {} s",
            i.as_secs()
        ))
    );
    let t0 = Instant::now();
    let mut runner = c.run_member_env(job, 1, job, &argv, &[mpi::path_env()]);
    if interval.is_some() {
        // The coordinator knows the job once n1's agent has reported its
        // member (a heartbeat after cr_run joined it).
        poll_until(
            &format!("crctl job {job} --keep 1 to find the job"),
            Duration::from_secs(60),
            POLL_PERIOD,
            || c.crctl(&["job", job, "--keep", "1"]).status.success(),
            || runner.describe(),
        );
    }
    let mut samples = Vec::new();
    let mut next = interval.map(|i| t0 + i);
    loop {
        if runner.proc.try_exit().is_some() {
            break;
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
        match next {
            Some(at) if Instant::now() >= at => {
                let info = c.crctl_json(&["checkpoint", job, "--freeze-timeout", "120"]);
                // The job may have ended meanwhile: only committed ones count.
                if jstr(&info, "state") == "committed" {
                    let s = Sample {
                        pause: ju64(&info, "pause_ms"),
                        duration: ju64(&info, "duration_ms"),
                    };
                    eprintln!(
                        "cr-bench:   checkpoint {} at {:.0} s: pause {} ms, duration {} ms",
                        samples.len() + 1,
                        t0.elapsed().as_secs_f64(),
                        s.pause,
                        s.duration
                    );
                    samples.push(s);
                }
                next = Some(at + interval.unwrap_or_default());
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
        wall,
        result: result.to_string(),
        samples,
    }
}

fn measure(o: &Opts) -> (Run, Run) {
    let h = Harness::new("bench-mpi");
    let prog = mpi::build_check(&h.dir, "mpicc.openmpi", "mpi_check_ompi");
    let prog = prog.to_string_lossy().into_owned();
    let c = Cluster::new(&h, o.nodes);
    c.start_coordinator();
    c.start_agents(&(1..=o.nodes).collect::<Vec<_>>());
    let plain = run_job(&c, o, &prog, "mpi-plain", None);
    let ckpt = run_job(
        &c,
        o,
        &prog,
        "mpi-ckpt",
        Some(Duration::from_secs(o.interval)),
    );
    if plain.result != ckpt.result {
        panic!(
            "the checkpointed job's result differs: {:?} without checkpoints, {:?} with",
            plain.result, ckpt.result
        );
    }
    (plain, ckpt)
}

fn table(o: &Opts, plain: &Run, ckpt: &Run) -> String {
    let mut s = String::new();
    let m = |f: fn(&Sample) -> u64| {
        median(ckpt.samples.iter().map(f).collect()).map_or("-".into(), |v| format!("{v:.0}"))
    };
    let max = |f: fn(&Sample) -> u64| {
        ckpt.samples
            .iter()
            .map(f)
            .max()
            .map_or("-".into(), |v| v.to_string())
    };
    let (a, b) = (plain.wall.as_secs_f64(), ckpt.wall.as_secs_f64());
    let _ = writeln!(
        s,
        "# Open MPI job, {} ranks x {} MiB on {} nodes, {} allreduce iterations \
         (pace {} us, idle ranks {}); a checkpoint every {} s\n",
        o.ranks,
        o.mib,
        o.nodes,
        o.iters,
        o.pace_us,
        if o.spin { "spin" } else { "yield" },
        o.interval
    );
    let _ = writeln!(
        s,
        "| run | wall_s | checkpoints | pause_ms median | pause_ms max | duration_ms median \
         | duration_ms max | slowdown |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
    let _ = writeln!(s, "| no checkpoints | {a:.1} | 0 | - | - | - | - | - |");
    let _ = writeln!(
        s,
        "| every {} s | {b:.1} | {} | {} | {} | {} | {} | {:+.1} % |",
        o.interval,
        ckpt.samples.len(),
        m(|x| x.pause),
        max(|x| x.pause),
        m(|x| x.duration),
        max(|x| x.duration),
        (b - a) / a * 100.0
    );
    let _ = writeln!(s, "\nresult of both runs: {}", plain.result);
    s
}

/// `cr-bench mpi ARGS...`.
pub fn run(o: Opts) -> Result<(), String> {
    let (plain, ckpt) = on_cluster("mpi", o.bin_dir.as_deref(), || measure(&o))?;
    print!("{}", table(&o, &plain, &ckpt));
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
        let o = parsed::<Opts>("mpi --ranks 6 --mib 0 --iters 100 --interval 5 --spin");
        assert!(o.ranks == 6 && o.mib == 0 && o.iters == 100 && o.interval == 5 && o.spin);
        assert_refused(&["mpi --ranks 0", "mpi --nodes 0", "mpi --interval 0"]);
    }
}
