//! `cr-bench host-fds`: the frozen time of a checkpoint against the number
//! of fds other processes on the host hold. A process whose pipe leads
//! outside its tree makes the checkpoint search every process of the host
//! for the pipe's other end; that search must not be made while the tree
//! is frozen.
//!
//! Every count: `--holders` python3 processes each open `N / holders`
//! fds of /dev/null; the target (`sleep`, its stdout a pipe whose read end
//! this bench keeps) is checkpointed `--reps` times, continuing. Shown:
//! its frozen time and the whole checkpoint's, next to the same run's cost
//! of the search alone (one readlink of every fd in /proc/*/fd).

use crate::{int_in, Res};
use clap::Args;
use std::io::{BufRead, BufReader, Write as _};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

#[derive(Args, Debug)]
pub struct Opts {
    /// Total fds held by the other processes, per row.
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', default_value = "0,20000,190000", value_parser = int_in::<usize>(0..=2_000_000))]
    counts: Vec<usize>,
    /// Processes holding them.
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = int_in::<usize>(1..=1000))]
    holders: usize,
    /// Checkpoints per row; the median and the range are shown.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = int_in::<usize>(1..))]
    reps: usize,
    /// Directory of cr_checkpoint (default: next to cr-bench).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
}

/// Processes holding fds, ended (stdin closed) and reaped on drop.
struct Holders(Vec<Child>);

impl Holders {
    fn start(n: usize, each: usize) -> Res<Holders> {
        let code = format!(
            "import os, resource, sys\n\
             resource.setrlimit(resource.RLIMIT_NOFILE, ({m}, {m}))\n\
             fds = [os.open('/dev/null', os.O_RDONLY) for _ in range({each})]\n\
             print('R', flush=True)\n\
             sys.stdin.read()\n",
            m = each + 64
        );
        let mut h = Holders(Vec::new());
        for _ in 0..n {
            let c = Command::new("python3")
                .args(["-c", &code])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| format!("start python3: {e}"))?;
            h.0.push(c);
        }
        for c in &mut h.0 {
            let mut line = String::new();
            BufReader::new(c.stdout.as_mut().ok_or("holder stdout")?)
                .read_line(&mut line)
                .map_err(|e| format!("read a holder: {e}"))?;
            if line != "R\n" {
                return Err(format!("a holder did not open its {each} fds"));
            }
        }
        Ok(h)
    }
}

impl Drop for Holders {
    fn drop(&mut self) {
        for c in &mut self.0 {
            drop(c.stdin.take());
            let _ = c.wait();
        }
    }
}

/// The search alone: one readlink of every fd of every process; (seconds,
/// fds seen).
fn search_cost() -> (f64, usize) {
    let t = Instant::now();
    let mut n = 0;
    for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        if !p
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        for f in std::fs::read_dir(p.path().join("fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if std::fs::read_link(f.path()).is_ok() {
                n += 1;
            }
        }
    }
    (t.elapsed().as_secs_f64(), n)
}

fn median_range(v: &mut [f64]) -> String {
    v.sort_by(f64::total_cmp);
    match v {
        [] => "-".into(),
        _ => format!(
            "{:.1} ({:.1}-{:.1})",
            v[v.len() / 2] * 1e3,
            v[0] * 1e3,
            v[v.len() - 1] * 1e3
        ),
    }
}

pub fn run(o: Opts) -> Res<()> {
    let ckpt = crate::bin_dir(o.bin_dir.as_deref())?.join("cr_checkpoint");
    crate::require_bins(&[&ckpt])?;
    let dir = std::env::temp_dir().join(format!("cr-bench-hostfds-{}", std::process::id()));
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "| fds on the host (others) | frozen ms median (range) | checkpoint ms median (range) | limit: the search alone, ms | fds seen |\n|---:|---:|---:|---:|---:|"
    );
    for &count in &o.counts {
        let holders = Holders::start(if count == 0 { 0 } else { o.holders }, count / o.holders)?;
        let mut fds = [0i32; 2];
        // SAFETY: pipe2 writes two new fds into the array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(format!("pipe2: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: both fds were just made and are owned by nothing else.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let mut target = Command::new("sleep")
            .arg("600")
            .stdout(Stdio::from(w))
            .spawn()
            .map_err(|e| format!("start sleep: {e}"))?;
        let (mut frozen, mut total) = (Vec::new(), Vec::new());
        let mut failed = None;
        for _ in 0..o.reps {
            let _ = std::fs::remove_dir_all(&dir);
            let res = Command::new(&ckpt)
                .arg("--json")
                .arg("--dir")
                .arg(&dir)
                .arg(target.id().to_string())
                .output()
                .map_err(|e| format!("run cr_checkpoint: {e}"))?;
            if !res.status.success() {
                failed = Some(String::from_utf8_lossy(&res.stderr).trim().to_string());
                break;
            }
            let text = String::from_utf8_lossy(&res.stdout);
            let Some(doc) = text
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .find_map(|v| v.get("result").cloned())
            else {
                failed = Some("cr_checkpoint printed no result".into());
                break;
            };
            frozen.push(doc["frozen_secs"].as_f64().unwrap_or(f64::NAN));
            total.push(doc["elapsed_secs"].as_f64().unwrap_or(f64::NAN));
        }
        let (limit, seen) = search_cost();
        let _ = target.kill();
        let _ = target.wait();
        drop(r);
        drop(holders);
        let _ = std::fs::remove_dir_all(&dir);
        if let Some(e) = failed {
            return Err(format!("checkpoint with {count} fds on the host: {e}"));
        }
        let _ = writeln!(
            out,
            "| {count} | {} | {} | {:.1} | {seen} |",
            median_range(&mut frozen),
            median_range(&mut total),
            limit * 1e3
        );
    }
    Ok(())
}
