//! `cr-bench fds`: cost of `cr_checkpoint` and `cr_restart` against the
//! number of open file descriptors, next to the time the program itself took
//! to open them. See the "Open fds" section of bench/README.md.

use crate::{
    check_interrupted, describe_status, dir_bytes, file_tail, fmt_opt, install_signal_handlers,
    int_in, kernel_release, only_std_fds, proc_exists, proc_state, reap_strays, run_timed, settle,
    tool_ok, wait_gone, DirGuard, FsKind, ProcGuard, Res, Target, GIB, INTERRUPTED,
};
use clap::{ArgAction, Args, ValueEnum};
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{self, Write as _};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// What the user asked for when no count is given: 50,000 is capped on
/// machines whose hard limit is lower.
const DEFAULT_COUNTS: &str = "10,1000,10000,50000";

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mix {
    Files,
    Pipes,
    Mixed,
    Eventfds,
}

impl Mix {
    fn name(self) -> &'static str {
        match self {
            Mix::Files => "files",
            Mix::Pipes => "pipes",
            Mix::Mixed => "mixed",
            Mix::Eventfds => "eventfds",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Count {
    N(usize),
    Max,
}

impl Count {
    /// clap value parser of one `--counts` element: `max` or a positive integer.
    fn parse(s: &str) -> Res<Count> {
        match s.trim() {
            "max" => Ok(Count::Max),
            n => int_in::<usize>(1..)(n).map(Count::N),
        }
    }
}

/// `cr-bench fds`: the open-fd benchmark.
#[derive(Args)]
pub struct FdOpts {
    /// Numbers of open fds; `max` is the largest the hard RLIMIT_NOFILE
    /// allows; larger counts are capped to it (with a note saying why).
    #[arg(
        long,
        value_name = "N,N,...|max",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = DEFAULT_COUNTS,
        value_parser = Count::parse,
    )]
    counts: Vec<Count>,
    /// Kinds of fds (eventfds is a diagnostic mix).
    #[arg(
        long = "mix",
        value_name = "files,pipes,mixed",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = "files,pipes,mixed",
    )]
    mixes: Vec<Mix>,
    /// Repetitions; tables show the best, and the median in parentheses.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = int_in::<usize>(1..))]
    reps: usize,
    /// Where images and the workload's files go (tmpfs: mounted by
    /// cr-bench; disk: a fresh dir under --disk-base).
    #[arg(long, value_name = "tmpfs|disk", default_value = "tmpfs")]
    fs: FsKind,
    /// Fds kept free below the hard limit for `max`.
    #[arg(long, value_name = "M", default_value_t = 100, value_parser = int_in::<usize>(8..))]
    margin: usize,
    /// Soft RLIMIT_NOFILE for cr_checkpoint and cr_restart (default:
    /// inherited from cr-bench).
    #[arg(long, value_name = "SOFT", value_parser = int_in::<u64>(1..))]
    tool_nofile: Option<u64>,
    /// Run cr_checkpoint and cr_restart (and so the restored process) on
    /// this one CPU only (default: no affinity set).
    #[arg(long, value_name = "CPU", value_parser = int_in::<usize>(0..libc::CPU_SETSIZE as usize))]
    pin_cpu: Option<usize>,
    /// Where cr_checkpoint, cr_restart and bench_fds live (default: the
    /// directory of this executable).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
    /// Parent of the on-disk directory.
    #[arg(long, value_name = "DIR", default_value = "/var/tmp")]
    disk_base: PathBuf,
}

// ---------------------------------------------------------------------------
// fd limit
// ---------------------------------------------------------------------------

fn nofile() -> (u64, u64) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `l` is a valid out-parameter.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
    }
    (l.rlim_cur, l.rlim_max)
}

/// Whether CAP_SYS_RESOURCE is in our effective set.
fn has_cap_sys_resource() -> Option<bool> {
    let s = fs::read_to_string("/proc/self/status").ok()?;
    let hex = s.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim();
    let caps = u64::from_str_radix(hex, 16).ok()?;
    const CAP_SYS_RESOURCE: u32 = 24;
    Some(caps & (1 << CAP_SYS_RESOURCE) != 0)
}

/// The counts to run, after capping them to what RLIMIT_NOFILE allows, and
/// notes on what was capped and why. If a count needs a higher hard limit,
/// we try to raise ours (children inherit it); that needs CAP_SYS_RESOURCE.
fn plan_counts(o: &FdOpts) -> (Vec<usize>, Vec<String>) {
    let mut notes = Vec::new();
    let (soft, mut hard) = nofile();
    let want = o
        .counts
        .iter()
        .filter_map(|c| match c {
            Count::N(n) => Some(*n as u64),
            Count::Max => None,
        })
        .max()
        .unwrap_or(0);
    let need = want + o.margin as u64;
    if hard < need {
        let l = libc::rlimit {
            rlim_cur: soft,
            rlim_max: need,
        };
        // SAFETY: `l` is a valid rlimit; the kernel refuses (EPERM) unless we
        // may raise the hard limit.
        let r = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) };
        if r == 0 {
            notes.push(format!(
                "raised the hard RLIMIT_NOFILE from {hard} to {need} for {want} fds"
            ));
            hard = need;
        } else {
            let e = io::Error::last_os_error();
            let cap = match has_cap_sys_resource() {
                Some(true) => "although CAP_SYS_RESOURCE is in CapEff",
                Some(false) => "CAP_SYS_RESOURCE is not in CapEff",
                None => "CapEff unreadable",
            };
            let nr_open = fs::read_to_string("/proc/sys/fs/nr_open")
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "?".into());
            notes.push(format!(
                "cannot raise the hard RLIMIT_NOFILE from {hard} to {need} ({e}; {cap}; \
                 fs.nr_open is {nr_open})"
            ));
        }
    }
    let cap = hard.saturating_sub(o.margin as u64) as usize;
    let mut out: Vec<usize> = Vec::new();
    for c in &o.counts {
        let n = match *c {
            Count::Max => cap,
            Count::N(n) if n > cap => {
                notes.push(format!(
                    "N={n} capped to {cap}: the hard RLIMIT_NOFILE is {hard}, minus a margin \
                     of {} fds (standard fds, the check's /proc listing, room for the tools)",
                    o.margin
                ));
                cap
            }
            Count::N(n) => n,
        };
        if n > 0 && !out.contains(&n) {
            out.push(n);
        }
    }
    (out, notes)
}

// ---------------------------------------------------------------------------
// One run
// ---------------------------------------------------------------------------

struct Bins {
    workload: PathBuf,
    checkpoint: PathBuf,
    restart: PathBuf,
}

#[derive(Default, Clone)]
struct Sample {
    /// The workload's own time to open its N fds.
    open_s: Option<f64>,
    /// readdir + readlink + fdinfo of every fd, from outside.
    scan_s: Option<f64>,
    dump_s: Option<f64>,
    dump_rss_kib: Option<u64>,
    /// cr_checkpoint's own figures: "... in X s ..., frozen Y s".
    tool_in_s: Option<f64>,
    frozen_s: Option<f64>,
    /// fds cr_checkpoint says it saved.
    tool_fds: Option<usize>,
    image_bytes: Option<u64>,
    restore_s: Option<f64>,
    restore_rss_kib: Option<u64>,
    /// Time of a restore whose workload then failed its check.
    unverified_restore_s: Option<f64>,
    same_pid: Option<bool>,
    /// Some(Ok(verify seconds)) or Some(Err(the FAIL line)).
    verified: Option<Result<f64, String>>,
    /// The same workload, not checkpointed, checks itself OK (rep 1 only).
    control: Option<Result<(), String>>,
    error: Option<String>,
}

/// Waits for a line of `out` that starts with one of `prefixes`, after the
/// first `skip` lines. Fails when `pid` is gone or a zombie (or, if
/// `our_child`, has exited) without printing it.
fn wait_line(
    out: &Path,
    skip: usize,
    prefixes: &[&str],
    pid: i32,
    our_child: bool,
    timeout: Duration,
) -> Res<String> {
    let t0 = Instant::now();
    loop {
        check_interrupted()?;
        let s = fs::read_to_string(out).unwrap_or_default();
        // A line is complete once its newline is there.
        let complete = &s[..s.rfind('\n').map_or(0, |i| i + 1)];
        if let Some(l) = complete
            .lines()
            .skip(skip)
            .find(|l| prefixes.iter().any(|p| l.starts_with(p)))
        {
            return Ok(l.to_string());
        }
        let dead = if our_child {
            let mut st = 0;
            // SAFETY: non-blocking waitpid on our own child.
            let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
            (r == pid).then(|| describe_status(st))
        } else {
            (!proc_exists(pid) || proc_state(pid) == Some('Z')).then(|| "gone".to_string())
        };
        if let Some(how) = dead {
            // It may have written its line right before exiting.
            let s = fs::read_to_string(out).unwrap_or_default();
            if let Some(l) = s
                .lines()
                .skip(skip)
                .find(|l| prefixes.iter().any(|p| l.starts_with(p)))
            {
                return Ok(l.to_string());
            }
            return Err(format!(
                "workload pid {pid} ended ({how}) without printing {prefixes:?}"
            ));
        }
        if t0.elapsed() > timeout {
            return Err(format!(
                "workload pid {pid} printed no {prefixes:?} in time"
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The number after `key` in `s` (up to the next space).
fn num_after(s: &str, key: &str) -> Option<f64> {
    let rest = &s[s.find(key)? + key.len()..];
    rest.split(|c: char| c.is_whitespace() || c == ',')
        .next()?
        .parse()
        .ok()
}

/// The word before `key` in `s`, as a number.
fn num_before(s: &str, key: &str) -> Option<usize> {
    s[..s.find(key)?].split_whitespace().last()?.parse().ok()
}

/// Starts `bench_fds N MIX` in `dir`, waits for READY and returns the guard,
/// the open time and the stdout path.
fn start_workload(bins: &Bins, dir: &Path, n: usize, mix: Mix) -> Res<(ProcGuard, f64, PathBuf)> {
    let out = dir.join("bench_fds.out");
    let err = dir.join("bench_fds.err");
    let mut cmd = Command::new(&bins.workload);
    only_std_fds(&mut cmd);
    let child = cmd
        .arg(n.to_string())
        .arg(mix.name())
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(File::create(&out).map_err(|e| format!("{}: {e}", out.display()))?)
        .stderr(File::create(&err).map_err(|e| format!("{}: {e}", err.display()))?)
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", bins.workload.display()))?;
    let pid = child.id() as i32;
    drop(child); // reaped by hand (waitpid), never through std
    let guard = ProcGuard::new(pid);
    let line = wait_line(
        &out,
        0,
        &["READY ", "FAIL"],
        pid,
        true,
        Duration::from_secs(300),
    )
    .map_err(|e| format!("{e}; stderr: {}", file_tail(&err, 400)))?;
    if !line.starts_with("READY ") {
        return Err(format!("workload: {line}"));
    }
    let open_s = num_after(&line, "open_s=").ok_or_else(|| format!("bad READY line {line:?}"))?;
    Ok((guard, open_s, out))
}

/// Tells the workload in `dir` to check itself; waits for OK or FAIL.
fn verify(dir: &Path, out: &Path, pid: i32, our_child: bool) -> Res<Result<f64, String>> {
    File::create(dir.join("go")).map_err(|e| format!("create go: {e}"))?;
    let line = wait_line(
        out,
        1,
        &["OK ", "FAIL"],
        pid,
        our_child,
        Duration::from_secs(300),
    )?;
    Ok(if line.starts_with("OK ") {
        Ok(num_after(&line, "verify_s=").unwrap_or(f64::NAN))
    } else {
        Err(line)
    })
}

/// The plainest look at every fd from outside: readdir /proc/PID/fd, and
/// readlink + read fdinfo for each. Returns (seconds, fds seen).
fn scan_fds(pid: i32) -> Res<(f64, usize)> {
    let t0 = Instant::now();
    let dir = format!("/proc/{pid}/fd");
    let mut n = 0;
    for e in fs::read_dir(&dir).map_err(|e| format!("{dir}: {e}"))? {
        let e = e.map_err(|e| format!("{dir}: {e}"))?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        fs::read_link(e.path()).map_err(|e| format!("readlink {dir}/{name}: {e}"))?;
        fs::read(format!("/proc/{pid}/fdinfo/{name}"))
            .map_err(|e| format!("/proc/{pid}/fdinfo/{name}: {e}"))?;
        n += 1;
    }
    Ok((t0.elapsed().as_secs_f64(), n))
}

/// A tool command with the soft RLIMIT_NOFILE of `--tool-nofile` and the
/// CPU of `--pin-cpu`.
fn tool_cmd(prog: &Path, o: &FdOpts) -> Command {
    let mut cmd = Command::new(prog);
    if let Some(cpu) = o.pin_cpu {
        // SAFETY: an all-zero cpu_set_t is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `cpu` < CPU_SETSIZE (checked when parsing).
        unsafe { libc::CPU_SET(cpu, &mut set) };
        // SAFETY: the closure only calls sched_setaffinity(2), which is
        // async-signal-safe, on a set built before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    if let Some(soft) = o.tool_nofile {
        let (_, hard) = nofile();
        let l = libc::rlimit {
            rlim_cur: soft.min(hard),
            rlim_max: hard,
        };
        // SAFETY: the closure only calls setrlimit(2), which is
        // async-signal-safe, on a valid rlimit.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setrlimit(libc::RLIMIT_NOFILE, &l) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    cmd
}

fn run_one(
    o: &FdOpts,
    bins: &Bins,
    target: &Target,
    mix: Mix,
    n: usize,
    rep: usize,
    s: &mut Sample,
) -> Res<()> {
    let run_dir = target.dir.join(format!("fds-{}-{n}-{rep}", mix.name()));
    let _ = fs::remove_dir_all(&run_dir);
    fs::create_dir(&run_dir).map_err(|e| format!("{}: {e}", run_dir.display()))?;
    let _dir_guard = DirGuard(run_dir.clone());

    // --- control: the workload checks itself OK without any checkpoint ---
    if rep == 0 {
        let dir = run_dir.join("control");
        fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let (mut g, _, out) = start_workload(bins, &dir, n, mix)?;
        s.control = Some(verify(&dir, &out, g.pid, true)?.map(|_| ()));
        g.finish()?;
        if let Some(Err(e)) = &s.control {
            return Err(format!(
                "the workload fails its own check without any checkpoint: {e}"
            ));
        }
    }

    // --- workload ---
    check_interrupted()?;
    let (mut workload, open_s, out) = start_workload(bins, &run_dir, n, mix)?;
    let pid = workload.pid;
    s.open_s = Some(open_s);

    // --- limit: look at every fd from outside ---
    let (scan_s, seen) = scan_fds(pid)?;
    if seen != n + 3 {
        return Err(format!(
            "/proc/{pid}/fd lists {seen} fds, expected {}",
            n + 3
        ));
    }
    s.scan_s = Some(scan_s);

    // --- dump ---
    check_interrupted()?;
    let img = run_dir.join("img");
    settle(&run_dir);
    let ck_out = run_dir.join("cr_checkpoint.out");
    let ck_err = run_dir.join("cr_checkpoint.err");
    let mut cmd = tool_cmd(&bins.checkpoint, o);
    cmd.arg("--kill")
        .arg("--no-fsync")
        .arg("--dir")
        .arg(&img)
        .arg(pid.to_string());
    let t = run_timed(cmd, &ck_out, &ck_err)?;
    tool_ok(&t, "cr_checkpoint", &ck_out, &ck_err)?;
    if !wait_gone(pid, Duration::from_secs(5)) {
        return Err(format!(
            "cr_checkpoint --kill exited 0 but left pid {pid} alive"
        ));
    }
    workload.finish()?;
    let printed = file_tail(&ck_out, 2000);
    s.dump_s = Some(t.secs);
    s.dump_rss_kib = Some(t.maxrss_kib);
    s.frozen_s = num_after(&printed, "frozen ");
    s.tool_in_s = num_after(&printed, " fds in ");
    s.tool_fds = num_before(&printed, " fds in ");
    s.image_bytes = Some(dir_bytes(&img));

    // --- restore ---
    check_interrupted()?;
    let mut cmd = tool_cmd(&bins.restart, o);
    cmd.arg("--detach").arg(&img);
    let (t, mut guard, new_pid) = crate::restore_detached(cmd, &run_dir, pid, "bench_fds")?;
    s.restore_rss_kib = Some(t.maxrss_kib);
    s.same_pid = Some(new_pid == pid);

    // --- the restored workload checks itself ---
    check_interrupted()?;
    let v = verify(&run_dir, &out, new_pid, false)?;
    // Only a restore that brought every fd back counts.
    if v.is_ok() {
        s.restore_s = Some(t.secs);
    } else {
        s.unverified_restore_s = Some(t.secs);
    }
    s.verified = Some(v);
    guard.finish()?;
    reap_strays();
    Ok(())
}

// ---------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------

struct Row {
    mix: Mix,
    n: usize,
    samples: Vec<Sample>,
}

impl Row {
    fn vals(&self, f: impl Fn(&Sample) -> Option<f64>) -> Vec<f64> {
        // Every field is set only once its phase has succeeded.
        let mut v: Vec<f64> = self.samples.iter().filter_map(f).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v
    }

    /// Smallest time over the reps that completed.
    fn best(&self, f: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
        self.vals(f).first().copied()
    }

    fn median(&self, f: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
        let v = self.vals(f);
        if v.is_empty() {
            return None;
        }
        let m = v.len() / 2;
        Some(if v.len() % 2 == 1 {
            v[m]
        } else {
            (v[m - 1] + v[m]) / 2.0
        })
    }
}

/// "best" or, with several reps, "best (median)".
fn cell(r: &Row, reps: usize, prec: usize, f: impl Fn(&Sample) -> Option<f64> + Copy) -> String {
    let b = fmt_opt(r.best(f), prec);
    if reps > 1 {
        format!("{b} ({})", fmt_opt(r.median(f), prec))
    } else {
        b
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// "12×", rounded, or n/a.
fn times(x: Option<f64>) -> String {
    match x {
        // A negative ratio (a larger N restored faster) is noise, not a cost.
        Some(x) if x.is_finite() && x > 0.0 => format!("{}×", x.round()),
        _ => "n/a".into(),
    }
}

fn us_per_fd(secs: Option<f64>, n: usize) -> Option<f64> {
    secs.map(|s| s * 1e6 / n as f64)
}

/// Marginal cost between two sizes: Δt / ΔN, in µs per fd.
fn marginal(a: Option<f64>, b: Option<f64>, na: usize, nb: usize) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if nb > na => Some((b - a) * 1e6 / (nb - na) as f64),
        _ => None,
    }
}

fn verified_cell(r: &Row) -> String {
    let v: Vec<&Result<f64, String>> = r
        .samples
        .iter()
        .filter_map(|s| s.verified.as_ref())
        .collect();
    if v.is_empty() {
        "n/a".into()
    } else if v.iter().all(|x| x.is_ok()) {
        "OK".into()
    } else {
        format!(
            "FAIL ({}/{} ok)",
            v.iter().filter(|x| x.is_ok()).count(),
            v.len()
        )
    }
}

fn markdown(rows: &[Row], o: &FdOpts, target: &Target, notes: &[String]) -> String {
    let mut out = String::new();
    let (soft, hard) = nofile();
    let _ = writeln!(out, "# cr-bench fds results\n");
    let _ = writeln!(
        out,
        "kernel {}, {} CPUs, reps {}{}; `cr_checkpoint --kill --no-fsync --dir D PID`, \
         `cr_restart --detach D`.",
        kernel_release(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        o.reps,
        if o.reps > 1 {
            " (cells: best (median))"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "- images and workload files: {} ({}){}",
        target.dir.display(),
        target.fs_type,
        if target.mounted {
            ", mounted by cr-bench"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "- RLIMIT_NOFILE of cr-bench: soft {soft}, hard {hard}; the workload raises its soft \
         limit to the hard one; the tools get soft {}",
        o.tool_nofile.map_or_else(
            || format!("{soft} (inherited)"),
            |t| t.min(hard).to_string()
        )
    );
    if let Some(cpu) = o.pin_cpu {
        let _ = writeln!(
            out,
            "- cr_checkpoint and cr_restart (and so the restored process) run on CPU {cpu} only"
        );
    }
    for n in notes {
        let _ = writeln!(out, "- {n}");
    }
    let _ = writeln!(out);

    for mix in o.mixes.iter().copied() {
        let rs: Vec<&Row> = rows.iter().filter(|r| r.mix == mix).collect();
        if rs.is_empty() {
            continue;
        }
        let _ = writeln!(out, "## {}\n", mix.name());
        let _ = writeln!(
            out,
            "| N | open ms (limit) | scan ms | dump s | frozen s | restore s | restore ÷ open \
             | image KiB | dump µs/fd | restore µs/fd | verified |"
        );
        let _ = writeln!(
            out,
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
        );
        for r in &rs {
            let open = r.best(|s| s.open_s);
            let restore = r.best(|s| s.restore_s);
            let img = r
                .samples
                .iter()
                .filter_map(|s| s.image_bytes)
                .max()
                .map(|b| b as f64 / 1024.0);
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                r.n,
                cell(r, o.reps, 3, |s| s.open_s.map(|x| x * 1e3)),
                cell(r, o.reps, 3, |s| s.scan_s.map(|x| x * 1e3)),
                cell(r, o.reps, 3, |s| s.dump_s),
                cell(r, o.reps, 3, |s| s.frozen_s),
                cell(r, o.reps, 3, |s| s.restore_s),
                times(ratio(restore, open)),
                fmt_opt(img, 0),
                fmt_opt(us_per_fd(r.best(|s| s.dump_s), r.n), 1),
                fmt_opt(us_per_fd(restore, r.n), 1),
                verified_cell(r),
            );
        }
        let _ = writeln!(out);
        if rs.len() > 1 {
            let _ = writeln!(
                out,
                "Growth from one N to the next: ×t is the ratio of the best times (linear \
                 cost: ×t ≈ ×N); µs/fd is the marginal cost Δt/ΔN, which stays flat when the \
                 cost is linear; restore ÷ open is the ratio of the marginal costs.\n"
            );
            let _ = writeln!(
                out,
                "| N | ×N | open ×t | scan ×t | dump ×t | frozen ×t | restore ×t \
                 | open µs/fd | scan µs/fd | dump µs/fd | frozen µs/fd | restore µs/fd \
                 | restore ÷ open |"
            );
            let _ = writeln!(
                out,
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            );
            for w in rs.windows(2) {
                let (a, b) = (w[0], w[1]);
                let x = |f: fn(&Sample) -> Option<f64>| fmt_opt(ratio(b.best(f), a.best(f)), 1);
                let mg = |f: fn(&Sample) -> Option<f64>| marginal(a.best(f), b.best(f), a.n, b.n);
                let m = |f: fn(&Sample) -> Option<f64>| fmt_opt(mg(f), 1);
                let _ = writeln!(
                    out,
                    "| {}→{} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    a.n,
                    b.n,
                    b.n as f64 / a.n as f64,
                    x(|s| s.open_s),
                    x(|s| s.scan_s),
                    x(|s| s.dump_s),
                    x(|s| s.frozen_s),
                    x(|s| s.restore_s),
                    m(|s| s.open_s),
                    m(|s| s.scan_s),
                    m(|s| s.dump_s),
                    m(|s| s.frozen_s),
                    m(|s| s.restore_s),
                    times(ratio(mg(|s| s.restore_s), mg(|s| s.open_s))),
                );
            }
            let _ = writeln!(out);
        }
        let _ = writeln!(
            out,
            "| N | fds in image | cr_checkpoint's own s | dump peak RSS MiB | restore peak RSS \
             MiB | verify s | same pid | control |"
        );
        let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---|---|");
        for r in &rs {
            let rss = |f: fn(&Sample) -> Option<u64>| {
                r.samples
                    .iter()
                    .filter_map(f)
                    .max()
                    .map(|k| k as f64 / 1024.0)
            };
            let all = |f: fn(&Sample) -> Option<bool>| {
                let v: Vec<bool> = r.samples.iter().filter_map(f).collect();
                if v.is_empty() {
                    "n/a"
                } else if v.iter().all(|&b| b) {
                    "yes"
                } else {
                    "NO"
                }
            };
            let fds = r
                .samples
                .iter()
                .filter_map(|s| s.tool_fds)
                .max()
                .map_or("n/a".to_string(), |f| f.to_string());
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                r.n,
                fds,
                cell(r, o.reps, 3, |s| s.tool_in_s),
                fmt_opt(rss(|s| s.dump_rss_kib), 1),
                fmt_opt(rss(|s| s.restore_rss_kib), 1),
                cell(r, o.reps, 4, |s| s
                    .verified
                    .as_ref()
                    .and_then(|v| v.clone().ok())),
                all(|s| s.same_pid),
                all(|s| s.control.as_ref().map(|c| c.is_ok())),
            );
        }
        let _ = writeln!(out);
    }

    let mut problems = Vec::new();
    for r in rows {
        for (i, s) in r.samples.iter().enumerate() {
            let at = format!("{} N={} rep {}", r.mix.name(), r.n, i + 1);
            if let Some(e) = &s.error {
                problems.push(format!("- {at}: {e}"));
            }
            if let Some(Err(e)) = &s.verified {
                problems.push(format!(
                    "- {at}: restored workload ({} s restore, not counted): {e}",
                    fmt_opt(s.unverified_restore_s, 3)
                ));
            }
            if let Some(f) = s.tool_fds {
                if f != r.n + 3 {
                    problems.push(format!(
                        "- {at}: cr_checkpoint saved {f} fds, the workload has {}",
                        r.n + 3
                    ));
                }
            }
        }
    }
    if !problems.is_empty() {
        let _ = writeln!(out, "## errors\n");
        for p in problems {
            let _ = writeln!(out, "{p}");
        }
    }
    out
}

// ---------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------

fn find_bins(o: &FdOpts) -> Res<Bins> {
    let dir = crate::bin_dir(o.bin_dir.as_deref())?;
    let b = Bins {
        workload: dir.join("bench_fds"),
        checkpoint: dir.join("cr_checkpoint"),
        restart: dir.join("cr_restart"),
    };
    crate::require_bins(&[&b.workload, &b.checkpoint, &b.restart])?;
    Ok(b)
}

/// `cr-bench fds ...`
pub fn main(o: FdOpts) -> Res<()> {
    let bins = find_bins(&o)?;
    install_signal_handlers();
    crate::become_subreaper();
    let (counts, notes) = plan_counts(&o);
    for n in &notes {
        eprintln!("cr-bench fds: {n}");
    }
    if counts.is_empty() {
        return Err("no fd count fits the RLIMIT_NOFILE hard limit".into());
    }
    let target = match o.fs {
        FsKind::Tmpfs => Target::tmpfs(GIB)?,
        FsKind::Disk => Target::disk(&o.disk_base)?,
    };

    let mut rows = Vec::new();
    'outer: for &mix in &o.mixes {
        for &n in &counts {
            let mut row = Row {
                mix,
                n,
                samples: Vec::new(),
            };
            for rep in 0..o.reps {
                eprintln!(
                    "cr-bench fds: {} N={n}, rep {}/{} ...",
                    mix.name(),
                    rep + 1,
                    o.reps
                );
                let mut s = Sample::default();
                if let Err(e) = run_one(&o, &bins, &target, mix, n, rep, &mut s) {
                    eprintln!("cr-bench fds:   error: {e}");
                    s.error = Some(e);
                }
                if let Some(Err(e)) = &s.verified {
                    eprintln!("cr-bench fds:   restored workload: {e}");
                }
                reap_strays();
                row.samples.push(s);
                if INTERRUPTED.load(Ordering::SeqCst) {
                    rows.push(row);
                    break 'outer;
                }
            }
            rows.push(row);
        }
    }
    let out = markdown(&rows, &o, &target, &notes);
    drop(target); // unmount / remove before printing the result
    let mut so = io::stdout().lock();
    let _ = so.write_all(out.as_bytes());
    let _ = so.flush();
    if INTERRUPTED.load(Ordering::SeqCst) {
        return Err("interrupted".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{assert_refused, parsed};

    #[test]
    fn command_lines() {
        let o = parsed::<FdOpts>("fds");
        assert!(o.counts == [10, 1000, 10000, 50000].map(Count::N));
        assert!(o.mixes == [Mix::Files, Mix::Pipes, Mix::Mixed]);
        assert!(o.reps == 1 && o.fs == FsKind::Tmpfs && o.margin == 100);
        assert!(o.tool_nofile.is_none() && o.pin_cpu.is_none() && o.bin_dir.is_none());
        assert_eq!(o.disk_base, Path::new("/var/tmp"));

        let o = parsed::<FdOpts>("fds --counts 10,1000,max --reps 3");
        assert!(o.counts == [Count::N(10), Count::N(1000), Count::Max] && o.reps == 3);
        let o = parsed::<FdOpts>("fds --mix eventfds --counts 10,1000,10000");
        assert!(o.mixes == [Mix::Eventfds] && o.counts == [10, 1000, 10000].map(Count::N));
        assert_eq!(parsed::<FdOpts>("fds --pin-cpu 1").pin_cpu, Some(1));
        assert_eq!(
            parsed::<FdOpts>("fds --tool-nofile 1024").tool_nofile,
            Some(1024)
        );
        let o = parsed::<FdOpts>("fds --fs disk --margin 8 --disk-base /srv --bin-dir b");
        assert!(o.fs == FsKind::Disk && o.margin == 8);
        assert_eq!(
            (o.disk_base.as_path(), o.bin_dir.as_deref()),
            (Path::new("/srv"), Some(Path::new("b")))
        );

        assert_refused(&[
            "fds --counts 0",
            "fds --mix socks",
            "fds --fs tmpfs,disk",
            "fds --margin 7",
            "fds --pin-cpu -1",
        ]);
    }
}
