//! `cr-bench incr`: incremental checkpoints, pre-dump, compression and
//! parallel dumping of a large process whose memory changes a little
//! between checkpoints, next to the machine's own copy limits.
//!
//! One run, all on a tmpfs mounted by cr-bench, every dump with
//! `--no-fsync`:
//!
//! 1. `bench_dirty SIZE` (random, unique, incompressible pages; a model
//!    of every page so that it can check itself). Control: it dirties the
//!    given share of its pages (no tracking) and checks itself.
//! 2. Limits (memcpy, process_vm_readv into fresh memory and into a 4 MiB
//!    buffer, process_vm_readv + write to the tmpfs) and full dumps with
//!    `--workers 1` and `--workers 2`, `--compress none|lz4|zstd`.
//! 3. Pre-dump, then the workload dirties 5 % / 0.1 % / nothing / writes at
//!    a steady rate in the background since before the pre-dump, then the
//!    checkpoint with `--parent` of the pre-dump: its frozen time.
//! 4. Full checkpoint with `--track-mem`, dirty 5 %, incremental with
//!    `--parent` (uffd-wp), and the same with `--dirty hash`.
//! 5. The workload is killed; the full image alone and both chains are
//!    restored (same pid) and the restored process checks every page.
//! 6. A python3 process holding a dict of ~1 GiB, dumped with each
//!    compression.

use crate::json;
use crate::{
    check_interrupted, describe_status, dir_bytes, file_tail, fmt_opt, install_signal_handlers,
    int_in, kernel_release, limit_dump, measure_memcpy, measure_pvm_fresh, mem_available,
    only_std_fds, proc_exists, proc_state, reap_strays, run_timed, tool_ok, DirGuard, Mapping,
    ProcGuard, Res, Target, GIB, INTERRUPTED, MIB,
};
use clap::{ArgAction, Args};
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const PAGE: u64 = 4096;
/// Ids of the workload's commands: never reused, also across restores.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Defaults of the workload size, the repetitions and the python3 dict's
/// RSS, and the same with --quick.
const DEFAULT_GIB: usize = 4;
const DEFAULT_REPS: usize = 3;
const DEFAULT_PYTHON_MIB: usize = 1024;
const QUICK_MIB: usize = 256;
const QUICK_REPS: usize = 1;
const QUICK_PYTHON_MIB: usize = 128;

/// `cr-bench incr`: incremental checkpoints, pre-dump, compression.
#[derive(Args)]
#[command(
    after_help = "Images go to a tmpfs mounted by cr-bench (removed at the end); every \
                   cr_checkpoint runs with --no-fsync."
)]
pub struct IncrOpts {
    /// Workload size in GiB (default 4).
    #[arg(long, value_name = "N", value_parser = int_in::<usize>(1..))]
    gib: Option<usize>,
    /// Smoke run: 256 MiB workload, 1 rep, 128 MiB python dict.
    #[arg(long)]
    quick: bool,
    /// Repetitions of every measurement (default 3, --quick 1); cells show
    /// the best, and the median in parentheses.
    #[arg(long, value_name = "N", value_parser = int_in::<usize>(1..))]
    reps: Option<usize>,
    /// Share of pages dirtied between checkpoints, in %.
    #[arg(long = "dirty-pct", value_name = "P", default_value = "5", value_parser = ppm)]
    dirty_ppm: u64,
    /// The "small amount" of the pre-dump case, in %.
    #[arg(long = "small-pct", value_name = "P", default_value = "0.1", value_parser = ppm)]
    small_ppm: u64,
    /// Rate of the background writer of the pre-dump case, in % of the pages
    /// per second.
    #[arg(long = "bg-pct-per-s", value_name = "P", default_value = "1", value_parser = ppm)]
    bg_ppm_per_s: u64,
    /// RSS the python3 dict is grown to (default 1024).
    #[arg(long, value_name = "M", value_parser = int_in::<usize>(1..))]
    python_mib: Option<usize>,
    /// Do not touch (and free) the memory a timed phase is about to fill.
    #[arg(long = "no-prewarm", action = ArgAction::SetFalse)]
    prewarm: bool,
    /// Where cr_checkpoint, cr_restart, cr_image and bench_dirty live
    /// (default: the directory of this executable).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
}

impl IncrOpts {
    fn size_mib(&self) -> usize {
        match self.gib {
            Some(g) => g * 1024,
            None if self.quick => QUICK_MIB,
            None => DEFAULT_GIB * 1024,
        }
    }

    fn reps(&self) -> usize {
        let default = if self.quick { QUICK_REPS } else { DEFAULT_REPS };
        self.reps.unwrap_or(default)
    }

    fn python_mib(&self) -> usize {
        let default = if self.quick {
            QUICK_PYTHON_MIB
        } else {
            DEFAULT_PYTHON_MIB
        };
        self.python_mib.unwrap_or(default)
    }
}

/// clap value parser of a percentage (0..100), as parts per million.
fn ppm(v: &str) -> Res<u64> {
    match v.trim().parse::<f64>() {
        Ok(p) if (0.0..=100.0).contains(&p) => Ok((p * 10_000.0).round() as u64),
        _ => Err("not a percentage (0..100)".into()),
    }
}

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

fn mib(b: u64) -> f64 {
    b as f64 / MIB as f64
}

/// The number after `key` (e.g. "pages=") in `s`, up to a space or comma.
pub(crate) fn kv(s: &str, key: &str) -> Option<f64> {
    let rest = &s[s.find(key)? + key.len()..];
    rest.split(|c: char| c.is_whitespace() || c == ',')
        .next()?
        .parse()
        .ok()
}

fn best(v: &[f64]) -> Option<f64> {
    v.iter().copied().filter(|x| x.is_finite()).reduce(f64::min)
}

fn median(v: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    })
}

/// "best (median)" with `scale` applied, or just "best" for one sample.
fn cell(v: &[f64], scale: f64, prec: usize) -> String {
    let b = fmt_opt(best(v).map(|x| x * scale), prec);
    if v.len() > 1 {
        format!("{b} ({})", fmt_opt(median(v).map(|x| x * scale), prec))
    } else {
        b
    }
}

fn pct(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(100.0 * a / b),
        _ => None,
    }
}

/// Untimed: faults in and frees `len` bytes of anonymous memory right
/// before a timed phase that needs that much new memory (see the memory
/// benchmark's `prewarm`: in a VM with free page reporting, pages not
/// touched lately cost several times more on first touch).
fn prewarm(o: &IncrOpts, len: u64) -> Res<()> {
    if !o.prewarm || len == 0 {
        return Ok(());
    }
    let mut m = Mapping::new(len as usize)?;
    for page in m.as_mut_slice().chunks_mut(PAGE as usize) {
        page[0] = 1;
    }
    drop(m);
    Ok(())
}

/// Field 22 of /proc/PID/stat (start time), the key of cr_checkpoint's
/// dirty-tracking state file.
fn start_time(pid: i32) -> Option<String> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s[s.rfind(')')? + 1..]
        .split_whitespace()
        .nth(19)
        .map(String::from)
}

/// Removes, on drop, cr_checkpoint's dirty-tracking state files of the
/// processes we started (they outlive the processes otherwise).
#[derive(Default)]
struct TrackingStates(Vec<(i32, String)>);

impl TrackingStates {
    fn add(&mut self, pid: i32) {
        if let Some(st) = start_time(pid) {
            self.0.push((pid, st));
        }
    }
}

impl Drop for TrackingStates {
    fn drop(&mut self) {
        let dir = match std::env::var_os("CR_STATE_DIR") {
            Some(d) => PathBuf::from(d).join("tracking"),
            // SAFETY: getuid never fails.
            None if unsafe { libc::getuid() } == 0 => PathBuf::from("/run/cr/tracking"),
            // SAFETY: getuid never fails.
            None => std::env::temp_dir().join(format!("cr-tracking-{}", unsafe { libc::getuid() })),
        };
        for (pid, st) in &self.0 {
            let _ = fs::remove_file(dir.join(format!("{pid}-{st}")));
        }
    }
}

// ---------------------------------------------------------------------------
// Workloads
// ---------------------------------------------------------------------------

type Bins = crate::Tools;

/// Waits for a complete line of `out` for which `want` holds. Fails when
/// `pid` ends (or is a zombie) without printing it.
fn wait_for(
    out: &Path,
    pid: i32,
    our_child: bool,
    what: &str,
    want: impl Fn(&str) -> bool,
    timeout: Duration,
) -> Res<String> {
    let t0 = Instant::now();
    let find = || {
        let s = fs::read_to_string(out).unwrap_or_default();
        let complete = &s[..s.rfind('\n').map_or(0, |i| i + 1)];
        complete.lines().find(|l| want(l)).map(String::from)
    };
    loop {
        check_interrupted()?;
        if let Some(l) = find() {
            return Ok(l);
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
            if let Some(l) = find() {
                return Ok(l);
            }
            return Err(format!("pid {pid} ended ({how}) without printing {what}"));
        }
        if t0.elapsed() > timeout {
            return Err(format!("pid {pid} printed no {what} in {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A running bench_dirty (started by us, or restored), and the bench's
/// model of it: how many page writes it was asked for.
struct Dirtier {
    guard: ProcGuard,
    our_child: bool,
    dir: PathBuf,
    out: PathBuf,
    err: PathBuf,
    addr: usize,
    len: usize,
    pages: u64,
    writes: u64,
}

impl Dirtier {
    fn start(bins: &Bins, dir: &Path, size_mib: usize) -> Res<(Dirtier, f64)> {
        let out = dir.join("bench_dirty.out");
        let err = dir.join("bench_dirty.err");
        let mut cmd = Command::new(&bins.workload);
        only_std_fds(&mut cmd);
        let child = cmd
            .arg(size_mib.to_string())
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(File::create(&out).map_err(|e| format!("{}: {e}", out.display()))?)
            .stderr(File::create(&err).map_err(|e| format!("{}: {e}", err.display()))?)
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", bins.workload.display()))?;
        let pid = child.id() as i32;
        drop(child); // reaped by hand (waitpid), never through std
        let guard = ProcGuard::new(pid);
        let line = wait_for(
            &out,
            pid,
            true,
            "READY",
            |l| l.starts_with("READY ") || l.starts_with("FAIL"),
            Duration::from_secs(600),
        )
        .map_err(|e| format!("bench_dirty: {e}; stderr: {}", file_tail(&err, 400)))?;
        if !line.starts_with("READY ") {
            return Err(format!("bench_dirty: {line}"));
        }
        let addr = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("addr="))
            .and_then(|a| usize::from_str_radix(a, 16).ok());
        let len = kv(&line, "len=");
        let pages = kv(&line, "pages=");
        let fill = kv(&line, "fill_s=");
        let (Some(addr), Some(len), Some(pages), Some(fill)) = (addr, len, pages, fill) else {
            return Err(format!("bench_dirty: bad READY line {line:?}"));
        };
        Ok((
            Dirtier {
                guard,
                our_child: true,
                dir: dir.to_path_buf(),
                out,
                err,
                addr,
                len: len as usize,
                pages: pages as u64,
                writes: 0,
            },
            fill,
        ))
    }

    fn pid(&self) -> i32 {
        self.guard.pid
    }

    /// Sends `verb ARGS`, waits for `WANT ID ...` (a FAIL answer is an error).
    fn request(&mut self, verb: &str, want: &str, timeout: Duration) -> Res<String> {
        check_interrupted()?;
        let id = format!("r{}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
        let tmp = self.dir.join("cmd.tmp");
        fs::write(&tmp, format!("{id} {verb}\n"))
            .and_then(|()| fs::rename(&tmp, self.dir.join("cmd")))
            .map_err(|e| format!("write {}: {e}", tmp.display()))?;
        let ok = format!("{want} {id} ");
        let bad = format!("FAIL {id} ");
        let line = wait_for(
            &self.out,
            self.pid(),
            self.our_child,
            &ok,
            |l| l.contains(&ok) || l.contains(&bad) || l.starts_with("FAIL - "),
            timeout,
        )
        .map_err(|e| {
            format!(
                "bench_dirty ({verb}): {e}; stderr: {}",
                file_tail(&self.err, 400)
            )
        })?;
        if line.contains(&ok) {
            Ok(line)
        } else {
            Err(format!("bench_dirty pid {} ({verb}): {line}", self.pid()))
        }
    }

    /// Dirties `ppm` parts per million of the pages: (pages, seconds).
    fn dirty(&mut self, ppm: u64) -> Res<(u64, f64)> {
        let rseed = NEXT_ID.load(Ordering::Relaxed) * 7919;
        let l = self.request(
            &format!("dirty {ppm} {rseed}"),
            "DONE",
            Duration::from_secs(600),
        )?;
        let (Some(k), Some(s)) = (kv(&l, "pages="), kv(&l, "secs=")) else {
            return Err(format!("bench_dirty: bad answer {l:?}"));
        };
        self.writes += k as u64;
        Ok((k as u64, s))
    }

    /// The workload checks every page against its model: Ok(seconds), or
    /// an error saying FAIL.
    fn verify(&mut self, what: &str) -> Res<f64> {
        let l = self
            .request(
                &format!("verify {}", self.writes),
                "OK",
                Duration::from_secs(900),
            )
            .map_err(|e| format!("VERIFY FAILED ({what}): {e}"))?;
        Ok(kv(&l, "secs=").unwrap_or(f64::NAN))
    }

    /// Background writer at `pages_per_s`; returns the pages it wrote so far.
    fn rate(&mut self, pages_per_s: u64) -> Res<u64> {
        let l = self.request(
            &format!("rate {pages_per_s}"),
            "RATE",
            Duration::from_secs(60),
        )?;
        Ok(kv(&l, "bg=").unwrap_or(0.0) as u64)
    }
}

/// A python3 process holding a dict grown to `rss_mib` MiB of RSS:
/// (guard, stdout path, entries, RSS bytes, build seconds).
const PY_DICT: &str = r#"
import sys, time
target = int(sys.argv[1])
def rss():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * 4096
t0 = time.monotonic()
d = {}
i = 0
while rss() < target:
    d.update((j, str(j) * 3) for j in range(i, i + 100000))
    i += 100000
print('READY n=%d rss=%d secs=%.3f' % (i, rss(), time.monotonic() - t0), flush=True)
while True:
    time.sleep(1)
"#;

fn start_python(dir: &Path, rss_mib: usize) -> Res<(ProcGuard, u64, u64, f64)> {
    let out = dir.join("python.out");
    let err = dir.join("python.err");
    let mut cmd = Command::new("python3");
    only_std_fds(&mut cmd);
    let child = cmd
        .arg("-c")
        .arg(PY_DICT)
        .arg((rss_mib * MIB).to_string())
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(File::create(&out).map_err(|e| format!("{}: {e}", out.display()))?)
        .stderr(File::create(&err).map_err(|e| format!("{}: {e}", err.display()))?)
        .spawn()
        .map_err(|e| format!("spawn python3: {e}"))?;
    let pid = child.id() as i32;
    drop(child);
    let guard = ProcGuard::new(pid);
    let line = wait_for(
        &out,
        pid,
        true,
        "READY",
        |l| l.starts_with("READY "),
        Duration::from_secs(600),
    )
    .map_err(|e| format!("python3: {e}; stderr: {}", file_tail(&err, 600)))?;
    let (Some(n), Some(rss), Some(s)) = (kv(&line, "n="), kv(&line, "rss="), kv(&line, "secs="))
    else {
        return Err(format!("python3: bad READY line {line:?}"));
    };
    Ok((guard, n as u64, rss as u64, s))
}

// ---------------------------------------------------------------------------
// The tools
// ---------------------------------------------------------------------------

/// One cr_checkpoint run and what `cr_image stats` says of its image.
#[derive(Clone, Default)]
struct Dump {
    wall_s: f64,
    /// The tool's own "in X s" (from its start to the commit).
    tool_s: Option<f64>,
    frozen_s: Option<f64>,
    store_bytes: u64,
    store_raw: u64,
    pages_read: u64,
    pages_stored: u64,
    pages_parent: u64,
    dirty: String,
    image_bytes: u64,
}

fn dump(bins: &Bins, run_dir: &Path, pid: i32, img: &Path, extra: &[&str]) -> Res<Dump> {
    check_interrupted()?;
    let out = run_dir.join("cr_checkpoint.out");
    let err = run_dir.join("cr_checkpoint.err");
    let mut cmd = Command::new(&bins.checkpoint);
    cmd.arg("--no-fsync")
        .arg("--dir")
        .arg(img)
        .args(extra)
        .arg(pid.to_string());
    let t = run_timed(cmd, &out, &err)?;
    let printed = tool_ok(
        &t,
        &format!("cr_checkpoint {}", extra.join(" ")),
        &out,
        &err,
    )?;
    let stats = image_stats(bins, img)?;
    let doc = json::parse(&stats, "cr_image stats")?;
    let num = |k: &str| {
        json::first(&doc, k)
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| format!("cr_image stats: no {k} in {stats}"))
    };
    Ok(Dump {
        wall_s: t.secs,
        tool_s: kv(&printed, " fds in "),
        frozen_s: kv(&printed, "frozen "),
        store_bytes: num("store_bytes")?,
        store_raw: num("store_raw_bytes")?,
        pages_read: num("pages_read")?,
        pages_stored: num("pages_stored")?,
        pages_parent: num("pages_parent")?,
        dirty: json::first(&doc, "dirty")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .to_string(),
        image_bytes: dir_bytes(img),
    })
}

fn image_stats(bins: &Bins, img: &Path) -> Res<String> {
    let mut cmd = Command::new(&bins.image);
    cmd.arg("stats").arg("--json").arg(img).stdin(Stdio::null());
    only_std_fds(&mut cmd);
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bins.image.display()))?;
    if !out.status.success() {
        return Err(format!(
            "cr_image stats --json {} failed ({}): {}",
            img.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn rm_img(img: &Path) -> Res<()> {
    match fs::remove_dir_all(img) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("rm -r {}: {e}", img.display())),
    }
}

/// Kills `w` and restores `img` (same pid); returns the restore seconds
/// and the restored workload, its model as it was at `writes`.
fn restore(
    bins: &Bins,
    run_dir: &Path,
    img: &Path,
    w: &Dirtier,
    writes: u64,
) -> Res<(f64, Dirtier)> {
    check_interrupted()?;
    let pid = w.pid();
    if proc_exists(pid) && proc_state(pid) != Some('Z') {
        return Err(format!(
            "pid {pid} still runs: cannot restore {}",
            img.display()
        ));
    }
    let mut cmd = Command::new(&bins.restart);
    cmd.arg("--detach").arg(img);
    let (t, guard, new_pid) = crate::restore_detached(cmd, run_dir, pid, "bench_dirty")?;
    if new_pid != pid {
        return Err(format!(
            "{} restored as pid {new_pid}, not the original {pid}",
            img.display()
        ));
    }
    Ok((
        t.secs,
        Dirtier {
            guard,
            our_child: false,
            dir: w.dir.clone(),
            out: w.out.clone(),
            err: w.err.clone(),
            addr: w.addr,
            len: w.len,
            pages: w.pages,
            writes,
        },
    ))
}

// ---------------------------------------------------------------------------
// Results
// ---------------------------------------------------------------------------

struct FullCfg {
    workers: usize,
    comp: &'static str,
    dumps: Vec<Dump>,
}

struct PreCase {
    name: String,
    pre: Vec<Dump>,
    fin: Vec<Dump>,
    /// Pages the workload wrote between the pre-dump and the final
    /// checkpoint (asked for; or by the background writer, from right
    /// before the pre-dump to a little after the final freeze: an upper
    /// bound, shown with "≤").
    written: Vec<u64>,
    upper_bound: bool,
}

struct RestoreRow {
    name: &'static str,
    secs: Vec<f64>,
    verified: usize,
    verify_s: Vec<f64>,
}

#[derive(Default)]
struct Py {
    entries: u64,
    rss: u64,
    build_s: f64,
    dumps: Vec<(&'static str, Vec<Dump>)>,
}

#[derive(Default)]
struct Results {
    len: u64,
    pages: u64,
    fill_s: f64,
    dirty_untracked: Vec<(u64, f64)>,
    dirty_tracked: Vec<(u64, f64)>,
    /// (what, seconds) of every check the live or restored workload passed.
    checks: Vec<(String, f64)>,
    memcpy_s: Vec<f64>,
    pvm_fresh_s: Vec<f64>,
    pvm_buf_s: Vec<f64>,
    limit_dump_s: Vec<f64>,
    full: Vec<FullCfg>,
    inc_full: Vec<Dump>,
    inc_uffd: Vec<Dump>,
    inc_hash: Vec<Dump>,
    pre: Vec<PreCase>,
    restore: Vec<RestoreRow>,
    py: Option<Py>,
    notes: Vec<String>,
}

impl Results {
    fn full_cfg(&mut self, workers: usize, comp: &'static str) -> &mut FullCfg {
        let i = match self
            .full
            .iter()
            .position(|c| c.workers == workers && c.comp == comp)
        {
            Some(i) => i,
            None => {
                self.full.push(FullCfg {
                    workers,
                    comp,
                    dumps: Vec::new(),
                });
                self.full.len() - 1
            }
        };
        &mut self.full[i]
    }

    fn full_of(&self, workers: usize, comp: &str) -> Option<&FullCfg> {
        self.full
            .iter()
            .find(|c| c.workers == workers && c.comp == comp)
    }
}

// ---------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------

const COMPS: [&str; 3] = ["none", "lz4", "zstd"];

fn run(
    o: &IncrOpts,
    bins: &Bins,
    target: &Target,
    r: &mut Results,
    states: &mut TrackingStates,
) -> Res<()> {
    let run_dir = target.dir.join("incr");
    let _ = fs::remove_dir_all(&run_dir);
    fs::create_dir(&run_dir).map_err(|e| format!("{}: {e}", run_dir.display()))?;
    let _dir_guard = DirGuard(run_dir.clone());
    let img = |name: &str| run_dir.join(name);
    let say = |s: &str| eprintln!("cr-bench incr: {s}");

    // --- workload and control ---
    say(&format!("starting bench_dirty {} MiB ...", o.size_mib()));
    let (mut w, fill_s) = Dirtier::start(bins, &run_dir, o.size_mib())?;
    states.add(w.pid());
    r.len = w.len as u64;
    r.pages = w.pages;
    r.fill_s = fill_s;
    let len = r.len;
    let dirty_bytes = len * o.dirty_ppm / 1_000_000;
    for _ in 0..o.reps() {
        r.dirty_untracked.push(w.dirty(o.dirty_ppm)?);
    }
    let v = w.verify("control: live workload, never checkpointed")?;
    r.checks
        .push(("control (live, no checkpoint yet)".into(), v));

    // --- limits and full dumps: workers, compression ---
    for rep in 0..o.reps() {
        say(&format!(
            "limits and full dumps, rep {}/{} ...",
            rep + 1,
            o.reps()
        ));
        r.memcpy_s.push(measure_memcpy(w.len)?);
        check_interrupted()?;
        prewarm(o, len)?;
        r.pvm_fresh_s
            .push(measure_pvm_fresh(w.pid(), w.addr, w.len)?);
        check_interrupted()?;
        prewarm(o, len)?;
        let lpath = run_dir.join("limit.img");
        let (secs, parts) = limit_dump(w.pid(), w.addr, w.len, &lpath)?;
        fs::remove_file(&lpath).map_err(|e| format!("rm {}: {e}", lpath.display()))?;
        r.limit_dump_s.push(secs);
        r.pvm_buf_s.push(parts[0]);
        for (workers, comp) in [(1, "none"), (2, "none"), (2, "lz4"), (2, "zstd")] {
            prewarm(o, len)?;
            let d = img("full");
            let ws = workers.to_string();
            let res = dump(
                bins,
                &run_dir,
                w.pid(),
                &d,
                &["--workers", &ws, "--compress", comp],
            )?;
            rm_img(&d)?;
            r.full_cfg(workers, comp).dumps.push(res);
        }
    }

    // --- pre-dump, then the final checkpoint ---
    let bg_rate = w.pages * o.bg_ppm_per_s / 1_000_000;
    let cases: Vec<(String, Option<u64>, u64)> = vec![
        (
            format!("dirty {}% after the pre-dump", o.dirty_ppm as f64 / 1e4),
            Some(o.dirty_ppm),
            0,
        ),
        (
            format!("dirty {}% after the pre-dump", o.small_ppm as f64 / 1e4),
            Some(o.small_ppm),
            0,
        ),
        ("nothing written".to_string(), None, 0),
        (
            format!(
                "background writer {}%/s ({bg_rate} pages/s), from before the pre-dump",
                o.bg_ppm_per_s as f64 / 1e4
            ),
            None,
            bg_rate,
        ),
    ];
    for (name, ppm, rate) in cases {
        let mut c = PreCase {
            name,
            pre: Vec::new(),
            fin: Vec::new(),
            written: Vec::new(),
            upper_bound: rate > 0,
        };
        for rep in 0..o.reps() {
            say(&format!(
                "pre-dump: {}, rep {}/{} ...",
                c.name,
                rep + 1,
                o.reps()
            ));
            let (p, d) = (img("pre"), img("final"));
            let mut bg0 = 0;
            if rate > 0 {
                w.rate(rate)?;
                // Let it reach its steady rate.
                std::thread::sleep(Duration::from_millis(200));
            }
            prewarm(o, len)?;
            if rate > 0 {
                bg0 = w.rate(rate)?;
            }
            let pre = dump(bins, &run_dir, w.pid(), &p, &["--pre-dump"])?;
            let mut written = 0;
            if let Some(ppm) = ppm {
                written = w.dirty(ppm)?.0;
            }
            prewarm(o, dirty_bytes)?;
            let fin = dump(
                bins,
                &run_dir,
                w.pid(),
                &d,
                &["--parent", p.to_str().unwrap()],
            );
            if rate > 0 {
                // From right before the pre-dump's freeze to a little after
                // the final one: an upper bound.
                written += w.rate(0)?.saturating_sub(bg0);
            }
            let fin = fin?;
            rm_img(&p)?;
            rm_img(&d)?;
            c.pre.push(pre);
            c.fin.push(fin);
            c.written.push(written);
        }
        r.pre.push(c);
    }
    let v = w.verify("live workload after the pre-dumps")?;
    r.checks
        .push(("live, after all full dumps and pre-dumps".into(), v));

    // --- full --track-mem, dirty, incremental (uffd-wp, then hash) ---
    let (d1, d2, d3) = (img("d1"), img("d2"), img("d3"));
    let mut writes_at = (0, 0);
    for rep in 0..o.reps() {
        say(&format!(
            "full + incremental, rep {}/{} ...",
            rep + 1,
            o.reps()
        ));
        for d in [&d1, &d2, &d3] {
            rm_img(d)?;
        }
        prewarm(o, len)?;
        r.inc_full
            .push(dump(bins, &run_dir, w.pid(), &d1, &["--track-mem"])?);
        writes_at.0 = w.writes;
        r.dirty_tracked.push(w.dirty(o.dirty_ppm)?);
        writes_at.1 = w.writes;
        prewarm(o, dirty_bytes)?;
        let p1 = d1.to_str().unwrap();
        r.inc_uffd.push(dump(
            bins,
            &run_dir,
            w.pid(),
            &d2,
            &["--parent", p1, "--track-mem"],
        )?);
        prewarm(o, dirty_bytes)?;
        r.inc_hash.push(dump(
            bins,
            &run_dir,
            w.pid(),
            &d3,
            &["--parent", p1, "--dirty", "hash"],
        )?);
    }
    let v = w.verify("live workload after the incremental checkpoints")?;
    r.checks
        .push(("live, after the incremental checkpoints".into(), v));

    // --- restore: the full image alone, and both chains ---
    w.guard.finish()?;
    reap_strays();
    let rows: [(&'static str, &PathBuf, u64); 3] = [
        ("full image alone (d1)", &d1, writes_at.0),
        ("chain d2 (uffd-wp) → d1", &d2, writes_at.1),
        ("chain d3 (hash) → d1", &d3, writes_at.1),
    ];
    for (name, _, _) in rows {
        r.restore.push(RestoreRow {
            name,
            secs: Vec::new(),
            verified: 0,
            verify_s: Vec::new(),
        });
    }
    for rep in 0..o.reps() {
        for (i, (name, dir, writes)) in rows.iter().enumerate() {
            say(&format!("restore {name}, rep {}/{} ...", rep + 1, o.reps()));
            prewarm(o, len)?;
            let (secs, mut restored) = restore(bins, &run_dir, dir, &w, *writes)?;
            r.restore[i].secs.push(secs);
            let v = restored.verify(&format!("restored from {name}"))?;
            r.restore[i].verified += 1;
            r.restore[i].verify_s.push(v);
            restored.guard.finish()?;
            reap_strays();
        }
    }
    r.checks.push((
        format!("restored, {} times (every image, every rep)", 3 * o.reps()),
        best(
            &r.restore
                .iter()
                .flat_map(|x| x.verify_s.iter().copied())
                .collect::<Vec<_>>(),
        )
        .unwrap_or(f64::NAN),
    ));
    for d in [&d1, &d2, &d3] {
        rm_img(d)?;
    }

    // --- python3 dict: compression of a realistic heap ---
    say(&format!("python3 dict of ~{} MiB RSS ...", o.python_mib()));
    let py_dir = run_dir.join("py");
    fs::create_dir(&py_dir).map_err(|e| format!("{}: {e}", py_dir.display()))?;
    let (mut pg, entries, rss, build_s) = start_python(&py_dir, o.python_mib())?;
    let mut py = Py {
        entries,
        rss,
        build_s,
        dumps: COMPS.iter().map(|&c| (c, Vec::new())).collect(),
    };
    for rep in 0..o.reps() {
        for (comp, v) in py.dumps.iter_mut() {
            say(&format!(
                "python3 --compress {comp}, rep {}/{} ...",
                rep + 1,
                o.reps()
            ));
            prewarm(o, rss)?;
            let d = img("py-img");
            v.push(dump(
                bins,
                &run_dir,
                pg.pid,
                &d,
                &["--workers", "2", "--compress", comp],
            )?);
            rm_img(&d)?;
        }
    }
    if !proc_exists(pg.pid) || proc_state(pg.pid) == Some('Z') {
        return Err("python3 did not survive its checkpoints".into());
    }
    pg.finish()?;
    r.py = Some(py);
    reap_strays();
    Ok(())
}

// ---------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------

fn walls(d: &[Dump]) -> Vec<f64> {
    d.iter().map(|x| x.wall_s).collect()
}

fn frozens(d: &[Dump]) -> Vec<f64> {
    d.iter().filter_map(|x| x.frozen_s).collect()
}

fn tools(d: &[Dump]) -> Vec<f64> {
    d.iter().filter_map(|x| x.tool_s).collect()
}

fn med_u(d: &[Dump], f: impl Fn(&Dump) -> u64) -> Option<f64> {
    median(&d.iter().map(|x| f(x) as f64).collect::<Vec<_>>())
}

/// GB/s of `bytes` over each time in `secs`.
fn rates(bytes: f64, secs: &[f64]) -> Vec<f64> {
    secs.iter().map(|s| bytes / 1e9 / s).collect()
}

/// "best (median)" of rates (best = highest).
fn rate_cell(v: &[f64], prec: usize) -> String {
    let b = fmt_opt(
        v.iter().copied().filter(|x| x.is_finite()).reduce(f64::max),
        prec,
    );
    if v.len() > 1 {
        format!("{b} ({})", fmt_opt(median(v), prec))
    } else {
        b
    }
}

fn verdict(ok: Option<bool>, miss: String) -> String {
    match ok {
        Some(true) => "met".into(),
        Some(false) => format!("**missed** ({miss})"),
        None => "n/a".into(),
    }
}

fn markdown(o: &IncrOpts, r: &Results, target: &Target, err: Option<&str>) -> String {
    let mut out = String::new();
    let size = mib(r.len);
    let _ = writeln!(out, "# cr-bench incr results\n");
    let _ = writeln!(
        out,
        "kernel {}, {} CPUs, workload {} MiB ({} pages), reps {}{}.",
        kernel_release(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        size,
        r.pages,
        o.reps(),
        if o.reps() > 1 {
            " (cells: best (median))"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "- images: {} ({}){}; every cr_checkpoint with `--no-fsync`, continue mode; wall = \
         spawn to wait4 of the tool; frozen and tool s = what cr_checkpoint prints",
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
        "- bench_dirty: every page its own PRNG stream (unique, non-zero, incompressible), \
         filled in {:.2} s; \"dirty\" writes 8 bytes into each of {}% of the pages, distinct, \
         chosen at random (also bumps a u32 version per page: a {} KiB array)",
        r.fill_s,
        o.dirty_ppm as f64 / 1e4,
        r.pages * 4 / 1024
    );
    for n in &r.notes {
        let _ = writeln!(out, "- {n}");
    }
    let _ = writeln!(out);

    // 1. incremental
    let full_w = best(&walls(&r.inc_full));
    let full_f = best(&frozens(&r.inc_full));
    let full_b = med_u(&r.inc_full, |d| d.store_bytes);
    if !r.inc_full.is_empty() {
        let _ = writeln!(
            out,
            "## Full vs incremental ({}% of the pages dirtied in between)\n",
            o.dirty_ppm as f64 / 1e4
        );
        let _ = writeln!(
            out,
            "| checkpoint | found by | wall s | frozen s | read MiB | pages stored | stored MiB \
             | image dir MiB | from parent MiB | wall % of full | frozen % of full | stored % \
             of full |"
        );
        let _ = writeln!(
            out,
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for (name, d) in [
            ("full `--track-mem`", &r.inc_full),
            (
                "incremental `--parent d1 --track-mem` (uffd-wp)",
                &r.inc_uffd,
            ),
            ("incremental `--parent d1 --dirty hash`", &r.inc_hash),
        ] {
            if d.is_empty() {
                continue;
            }
            let _ = writeln!(
                out,
                "| {name} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                d[0].dirty,
                cell(&walls(d), 1.0, 3),
                cell(&frozens(d), 1.0, 3),
                fmt_opt(med_u(d, |x| x.pages_read * PAGE).map(|b| b / MIB as f64), 1),
                fmt_opt(med_u(d, |x| x.pages_stored), 0),
                fmt_opt(med_u(d, |x| x.store_bytes).map(|b| b / MIB as f64), 1),
                fmt_opt(med_u(d, |x| x.image_bytes).map(|b| b / MIB as f64), 1),
                fmt_opt(
                    med_u(d, |x| x.pages_parent * PAGE).map(|b| b / MIB as f64),
                    1
                ),
                fmt_opt(pct(best(&walls(d)), full_w), 1),
                fmt_opt(pct(best(&frozens(d)), full_f), 1),
                fmt_opt(pct(med_u(d, |x| x.store_bytes), full_b), 1),
            );
        }
        let dm = |v: &[(u64, f64)]| v.iter().map(|x| x.1).collect::<Vec<f64>>();
        let _ = writeln!(
            out,
            "\nThe workload's own time to dirty {} pages: {} ms untracked, {} ms with uffd-wp \
             tracking on (write faults).\n",
            r.dirty_untracked.first().map_or(0, |x| x.0),
            cell(&dm(&r.dirty_untracked), 1e3, 1),
            cell(&dm(&r.dirty_tracked), 1e3, 1),
        );
    }

    // 2. pre-dump
    if !r.pre.is_empty() {
        let _ = writeln!(out, "## Pre-dump, then checkpoint with `--parent` of it\n");
        let _ = writeln!(
            out,
            "| workload between the two | pre-dump wall s | pre-dump frozen ms | written after \
             pre-dump MiB | final read MiB | final stored MiB | final wall s | **final frozen \
             ms** | < 50 ms |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---|");
        for c in &r.pre {
            let ff = best(&frozens(&c.fin));
            let _ = writeln!(
                out,
                "| {} | {} | {} | {}{} | {} | {} | {} | **{}** | {} |",
                c.name,
                cell(&walls(&c.pre), 1.0, 3),
                cell(&frozens(&c.pre), 1e3, 1),
                if c.upper_bound { "≤ " } else { "" },
                fmt_opt(
                    median(&c.written.iter().map(|&p| mib(p * PAGE)).collect::<Vec<_>>()),
                    1
                ),
                fmt_opt(
                    med_u(&c.fin, |x| x.pages_read * PAGE).map(|b| b / MIB as f64),
                    1
                ),
                fmt_opt(med_u(&c.fin, |x| x.store_bytes).map(|b| b / MIB as f64), 1),
                cell(&walls(&c.fin), 1.0, 3),
                cell(&frozens(&c.fin), 1e3, 1),
                match ff {
                    Some(f) if f < 0.050 => "yes".to_string(),
                    Some(f) => format!("no (+{:.0} ms)", f * 1e3 - 50.0),
                    None => "n/a".into(),
                },
            );
        }
        let _ = writeln!(out);
    }

    // 3. compression
    let _ = writeln!(out, "## Compression (full checkpoint, `--workers 2`)\n");
    let _ = writeln!(
        out,
        "| workload | compression | pages MiB (raw) | stored MiB | % of none | wall s | GB/s (read \
         ÷ wall) | frozen s |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|");
    let comp_rows = |out: &mut String, label: &str, rows: &[(&str, &[Dump])]| {
        let none = rows
            .iter()
            .find(|(c, _)| *c == "none")
            .and_then(|(_, d)| med_u(d, |x| x.store_bytes));
        for (comp, d) in rows {
            if d.is_empty() {
                continue;
            }
            let bytes = med_u(d, |x| x.pages_read * PAGE).unwrap_or(0.0);
            let _ = writeln!(
                out,
                "| {label} | {comp} | {} | {} | {} | {} | {} | {} |",
                fmt_opt(med_u(d, |x| x.store_raw).map(|b| b / MIB as f64), 1),
                fmt_opt(med_u(d, |x| x.store_bytes).map(|b| b / MIB as f64), 1),
                fmt_opt(pct(med_u(d, |x| x.store_bytes), none), 1),
                cell(&walls(d), 1.0, 3),
                rate_cell(&rates(bytes, &walls(d)), 2),
                cell(&frozens(d), 1.0, 3),
            );
        }
    };
    let rnd: Vec<(&str, &[Dump])> = COMPS
        .iter()
        .filter_map(|&c| r.full_of(2, c).map(|f| (c, &f.dumps[..])))
        .collect();
    comp_rows(&mut out, &format!("bench_dirty {size} MiB"), &rnd);
    if let Some(py) = &r.py {
        let rows: Vec<(&str, &[Dump])> = py.dumps.iter().map(|(c, d)| (*c, &d[..])).collect();
        comp_rows(
            &mut out,
            &format!(
                "python3 dict ({} entries, RSS {:.0} MiB, built in {:.1} s)",
                py.entries,
                mib(py.rss),
                py.build_s
            ),
            &rows,
        );
    }
    let _ = writeln!(out);

    // 4. throughput
    let _ = writeln!(
        out,
        "## Dump throughput vs the machine's limits ({size} MiB, same run)\n"
    );
    let _ = writeln!(out, "| what | s | GB/s | % of process_vm_readv → fresh |");
    let _ = writeln!(out, "|---|---:|---:|---:|");
    let lb = r.len as f64;
    let pvm_best = best(&r.pvm_fresh_s);
    let tp = |out: &mut String, name: &str, secs: &[f64], bytes: f64| {
        let _ = writeln!(
            out,
            "| {name} | {} | {} | {} |",
            cell(secs, 1.0, 3),
            rate_cell(&rates(bytes, secs), 2),
            fmt_opt(pct(pvm_best, best(secs)), 0),
        );
    };
    tp(&mut out, "memcpy, 4 MiB chunks", &r.memcpy_s, lb);
    tp(
        &mut out,
        "process_vm_readv → fresh memory",
        &r.pvm_fresh_s,
        lb,
    );
    tp(
        &mut out,
        "process_vm_readv → one 4 MiB buffer",
        &r.pvm_buf_s,
        lb,
    );
    tp(
        &mut out,
        "process_vm_readv + write() to the tmpfs (limit_dump)",
        &r.limit_dump_s,
        lb,
    );
    for workers in [1, 2] {
        if let Some(c) = r.full_of(workers, "none") {
            let bytes = med_u(&c.dumps, |x| x.pages_read * PAGE).unwrap_or(lb);
            tp(
                &mut out,
                &format!("cr_checkpoint `--workers {workers}`, wall"),
                &walls(&c.dumps),
                bytes,
            );
            tp(
                &mut out,
                &format!("cr_checkpoint `--workers {workers}`, its own \"in X s\""),
                &tools(&c.dumps),
                bytes,
            );
        }
    }
    let _ = writeln!(out);

    // 5. restore
    if !r.restore.is_empty() {
        let _ = writeln!(
            out,
            "## Restore (`cr_restart --detach`), then the workload checks every page\n"
        );
        let _ = writeln!(
            out,
            "| image | restore s | GB/s | % of full alone | verified | verify s |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|---|---:|");
        let base = r.restore.first().and_then(|x| best(&x.secs));
        for row in &r.restore {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {}/{} OK | {} |",
                row.name,
                cell(&row.secs, 1.0, 3),
                rate_cell(&rates(lb, &row.secs), 2),
                fmt_opt(pct(best(&row.secs), base), 0),
                row.verified,
                row.secs.len(),
                cell(&row.verify_s, 1.0, 2),
            );
        }
        let _ = writeln!(out);
    }

    // checks
    if !r.checks.is_empty() {
        let _ = writeln!(
            out,
            "Workload self-checks passed (every word of every page against its model):"
        );
        for (what, s) in &r.checks {
            let _ = writeln!(out, "- {what} ({s:.2} s)");
        }
        let _ = writeln!(out);
    }

    // summary
    let _ = writeln!(out, "## Summary\n");
    let _ = writeln!(out, "| measure | value | target | verdict |");
    let _ = writeln!(out, "|---|---:|---|---|");
    let inc_w = pct(best(&walls(&r.inc_uffd)), full_w);
    let inc_f = pct(best(&frozens(&r.inc_uffd)), full_f);
    let inc_b = pct(med_u(&r.inc_uffd, |d| d.store_bytes), full_b);
    for (name, v) in [
        ("incremental (uffd-wp) wall ÷ full wall", inc_w),
        ("incremental (uffd-wp) frozen ÷ full frozen", inc_f),
        ("incremental (uffd-wp) stored ÷ full stored", inc_b),
    ] {
        let _ = writeln!(
            out,
            "| {name} | {} % | ≤ 10 % | {} |",
            fmt_opt(v, 1),
            verdict(
                v.map(|x| x <= 10.0),
                v.map_or(String::new(), |x| format!("by {:.1} points", x - 10.0))
            )
        );
    }
    let hw = pct(best(&walls(&r.inc_hash)), full_w);
    let hb = pct(med_u(&r.inc_hash, |d| d.store_bytes), full_b);
    let _ = writeln!(
        out,
        "| incremental (`--dirty hash`) wall ÷ full; stored ÷ full | {} %; {} % | (fallback) | — |",
        fmt_opt(hw, 1),
        fmt_opt(hb, 1)
    );
    let dirty_ms = |v: &[(u64, f64)]| best(&v.iter().map(|x| x.1 * 1e3).collect::<Vec<_>>());
    let _ = writeln!(
        out,
        "| workload's time to dirty {}% of its pages: untracked / uffd-wp on | {} / {} ms | — | — |",
        o.dirty_ppm as f64 / 1e4,
        fmt_opt(dirty_ms(&r.dirty_untracked), 1),
        fmt_opt(dirty_ms(&r.dirty_tracked), 1),
    );
    for c in &r.pre {
        let ff = best(&frozens(&c.fin));
        let _ = writeln!(
            out,
            "| frozen, checkpoint after pre-dump: {} | {} ms | < 50 ms | {} |",
            c.name,
            fmt_opt(ff.map(|x| x * 1e3), 1),
            verdict(
                ff.map(|x| x < 0.050),
                ff.map_or(String::new(), |x| format!("by {:.0} ms", x * 1e3 - 50.0))
            )
        );
    }
    let rate_of = |workers: usize| {
        r.full_of(workers, "none").and_then(|c| {
            let bytes = med_u(&c.dumps, |x| x.pages_read * PAGE)?;
            best(&walls(&c.dumps)).map(|s| bytes / 1e9 / s)
        })
    };
    let _ = writeln!(
        out,
        "| dump GB/s `--workers 1` / `--workers 2` / process_vm_readv→fresh / memcpy | {} / {} / {} / {} | — | — |",
        fmt_opt(rate_of(1), 2),
        fmt_opt(rate_of(2), 2),
        fmt_opt(pvm_best.map(|s| lb / 1e9 / s), 2),
        fmt_opt(best(&r.memcpy_s).map(|s| lb / 1e9 / s), 2),
    );
    let cmp = |list: &[(&str, &[Dump])], c: &str| {
        let none = list
            .iter()
            .find(|x| x.0 == "none")
            .and_then(|x| med_u(x.1, |d| d.store_bytes));
        let v = list
            .iter()
            .find(|x| x.0 == c)
            .and_then(|x| med_u(x.1, |d| d.store_bytes));
        pct(v, none)
    };
    let _ = writeln!(
        out,
        "| size lz4 / zstd, % of none: random data | {} / {} | ≈ 100 | — |",
        fmt_opt(cmp(&rnd, "lz4"), 1),
        fmt_opt(cmp(&rnd, "zstd"), 1)
    );
    if let Some(py) = &r.py {
        let rows: Vec<(&str, &[Dump])> = py.dumps.iter().map(|(c, d)| (*c, &d[..])).collect();
        let _ = writeln!(
            out,
            "| size lz4 / zstd, % of none: python3 dict | {} / {} | — | — |",
            fmt_opt(cmp(&rows, "lz4"), 1),
            fmt_opt(cmp(&rows, "zstd"), 1)
        );
    }
    if r.restore.len() >= 2 {
        let a = best(&r.restore[0].secs);
        let b = best(&r.restore[1].secs);
        let _ = writeln!(
            out,
            "| restore s: full alone / chain full+incremental | {} / {} | — | — |",
            fmt_opt(a, 3),
            fmt_opt(b, 3)
        );
    }
    let ok: usize = r.restore.iter().map(|x| x.verified).sum();
    let all: usize = r.restore.iter().map(|x| x.secs.len()).sum();
    let _ = writeln!(
        out,
        "| restored workloads verified | {ok}/{all} | all OK | {} |",
        if ok == all && err.is_none() && all > 0 {
            "met"
        } else {
            "**FAILED**"
        }
    );
    if let Some(e) = err {
        let _ = writeln!(out, "\n## error\n\n{e}");
    }
    out
}

// ---------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------

fn find_bins(o: &IncrOpts) -> Res<Bins> {
    crate::find_tools(o.bin_dir.as_deref(), "bench_dirty")
}

/// `cr-bench incr ...`
pub fn main(o: IncrOpts) -> Res<()> {
    let bins = find_bins(&o)?;
    install_signal_handlers();
    crate::become_subreaper();
    let len = o.size_mib() * MIB;
    // Live workload + full image + two incrementals + a restored copy or a
    // fresh copy (limits), + the python dict.
    let need = 3 * len + len / 4 + o.python_mib() * MIB + GIB;
    let mut notes = Vec::new();
    if let Some(avail) = mem_available() {
        if avail < need {
            notes.push(format!(
                "warning: MemAvailable {} MiB < ~{} MiB this run needs",
                avail / MIB,
                need / MIB
            ));
            eprintln!("cr-bench incr: {}", notes[0]);
        }
    }
    let target = Target::tmpfs((2 * len + len / 2 + o.python_mib() * 2 * MIB).max(2 * GIB))?;
    let mut r = Results {
        notes,
        ..Default::default()
    };
    let load = || {
        fs::read_to_string("/proc/loadavg")
            .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
            .unwrap_or_else(|_| "?".into())
    };
    let load0 = load();
    let t0 = Instant::now();
    let res = {
        let mut states = TrackingStates::default();
        run(&o, &bins, &target, &mut r, &mut states)
    };
    reap_strays();
    r.notes.push(format!(
        "the whole run took {:.0} s; load average {load0} at the start, {} at the end",
        t0.elapsed().as_secs_f64(),
        load()
    ));
    if let Err(e) = &res {
        eprintln!("cr-bench incr: error: {e}");
    }
    let out = markdown(&o, &r, &target, res.as_ref().err().map(String::as_str));
    drop(target); // unmount before printing the result
    let mut so = io::stdout().lock();
    let _ = so.write_all(out.as_bytes());
    let _ = so.flush();
    if INTERRUPTED.load(Ordering::SeqCst) {
        return Err("interrupted".into());
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{assert_refused, parsed};

    #[test]
    fn command_lines() {
        let o = parsed::<IncrOpts>("incr");
        assert_eq!((o.size_mib(), o.reps(), o.python_mib()), (4096, 3, 1024));
        assert_eq!(
            (o.dirty_ppm, o.small_ppm, o.bg_ppm_per_s),
            (50_000, 1_000, 10_000)
        );
        assert!(o.prewarm && o.bin_dir.is_none());
        let o = parsed::<IncrOpts>("incr --quick");
        assert_eq!((o.size_mib(), o.reps(), o.python_mib()), (256, 1, 128));
        // Explicit values win over --quick, in any order.
        let o = parsed::<IncrOpts>("incr --gib 1 --quick --reps 2 --python-mib 64");
        assert_eq!((o.size_mib(), o.reps(), o.python_mib()), (1024, 2, 64));
        let o = parsed::<IncrOpts>(
            "incr --dirty-pct 0.5 --small-pct 0 --bg-pct-per-s 100 --no-prewarm",
        );
        assert_eq!(
            (o.dirty_ppm, o.small_ppm, o.bg_ppm_per_s),
            (5_000, 0, 1_000_000)
        );
        assert!(!o.prewarm);
        assert_refused(&[
            "incr --gib 0",
            "incr --dirty-pct 101",
            "incr --small-pct -1",
            "incr --reps 0",
        ]);
    }
}
