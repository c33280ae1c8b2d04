//! `cr-bench tree`: the restore of one process tree of N processes against
//! N single-process restores one after another, with the same memory in
//! all, next to the machine's plainest fill of that memory measured in the
//! same run. See the "Process tree restore" section of bench/README.md.
//!
//! Every rep: the tree (`bench_tree N M`: a root and N-1 children, M MiB of
//! written memory, a file and a pipe each) is checkpointed with `--kill`
//! and restored by one `cr_restart --detach`; N single processes
//! (`bench_tree 1 M` each) are checkpointed, killed, and restored by N
//! `cr_restart --detach` in a row. Each restored process checks its memory
//! and its file offset itself (OK/FAIL); only verified restores count.
//! The limit: `process_vm_writev` of N × M MiB from a warm buffer into
//! fresh anonymous memory, on one thread and on one thread per CPU.

use crate::{
    check_interrupted, file_tail, install_signal_handlers, int_in, proc_comm, proc_exists,
    reap_strays, restore_detached, run_timed, settle, tool_ok, wait_gone, DirGuard, Mapping,
    ProcGuard, Res, Target, CHUNK, MIB,
};
use clap::Args;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct Opts {
    /// Processes of the tree (the root included), and single processes
    /// restored one after another.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = int_in::<usize>(1..=512))]
    procs: usize,
    /// MiB of written memory in each process.
    #[arg(long, value_name = "MIB", default_value_t = 32, value_parser = int_in::<usize>(1..=4096))]
    mib: usize,
    /// Repetitions; the best and the median are shown.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = int_in::<usize>(1..))]
    reps: usize,
    /// Extra arguments for every cr_restart (e.g. `--workers 1`), split at spaces.
    #[arg(long, value_name = "ARGS", default_value = "")]
    restart_args: String,
    /// Directory of cr_checkpoint, cr_restart and bench_tree (default:
    /// next to cr-bench).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
}

struct Sample {
    /// One cr_restart of the tree.
    tree_s: Option<f64>,
    /// N cr_restarts of single processes, one after another.
    serial_s: Option<f64>,
    /// The plainest fill of N × M MiB, one thread / one thread per CPU.
    limit1_s: Option<f64>,
    limit_s: Option<f64>,
}

pub fn run(o: Opts) -> Res<()> {
    let tools = crate::find_tools(o.bin_dir.as_deref(), "bench_tree")?;
    install_signal_handlers();
    crate::become_subreaper();
    let total = o.procs * o.mib * MIB;
    // Two images of the whole memory (tree, singles) at most, and slack.
    let target = Target::tmpfs(2 * total + 512 * MIB)?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut samples = Vec::new();
    for rep in 0..o.reps {
        check_interrupted()?;
        eprintln!("cr-bench tree: rep {}/{} ...", rep + 1, o.reps);
        let limit1_s = Some(limit_fill(o.procs, o.mib * MIB, 1)?);
        let limit_s = Some(limit_fill(o.procs, o.mib * MIB, cpus)?);
        let tree_s = Some(tree_once(&o, &tools, &target.dir, rep)?);
        reap_strays();
        let serial_s = Some(serial_once(&o, &tools, &target.dir, rep)?);
        reap_strays();
        let s = Sample {
            tree_s,
            serial_s,
            limit1_s,
            limit_s,
        };
        eprintln!(
            "cr-bench tree:   tree {:.3} s, serial {:.3} s, ratio {:.2}, limit {:.3} s ({} threads), {:.3} s (1 thread)",
            s.tree_s.unwrap_or(f64::NAN),
            s.serial_s.unwrap_or(f64::NAN),
            s.serial_s.unwrap_or(f64::NAN) / s.tree_s.unwrap_or(f64::NAN),
            s.limit_s.unwrap_or(f64::NAN),
            cpus,
            s.limit1_s.unwrap_or(f64::NAN),
        );
        samples.push(s);
    }
    print!("{}", table(&o, cpus, &samples));
    Ok(())
}

fn restart_cmd(o: &Opts, tools: &crate::Tools, img: &Path) -> Command {
    let mut cmd = Command::new(&tools.restart);
    cmd.args(o.restart_args.split_whitespace());
    cmd.arg("--detach").arg(img);
    cmd
}

/// The tree checkpointed, killed, restored by one cr_restart (timed) and
/// checked by its processes.
fn tree_once(o: &Opts, tools: &crate::Tools, base: &Path, rep: usize) -> Res<f64> {
    let dir = fresh_dir(base, &format!("tree-{rep}"))?;
    let _dir_guard = DirGuard(dir.clone());
    let (guards, out) = start(tools, &dir, o.procs, o.mib)?;
    let pids: Vec<i32> = guards.iter().map(|g| g.pid).collect();
    let img = dir.join("img");
    checkpoint(tools, &dir, &img, &pids)?;
    drop(guards);
    let (t, root, _) = restore_detached(restart_cmd(o, tools, &img), &dir, pids[0], "bench_tree")?;
    let mut restored = vec![root];
    restored.extend(adopt(&pids[1..])?);
    check(&dir, &out, o.procs)?;
    drop(restored);
    Ok(t.secs)
}

/// N single processes checkpointed and killed, then restored one after
/// another (timed: the sum of the N cr_restarts) and checked.
fn serial_once(o: &Opts, tools: &crate::Tools, base: &Path, rep: usize) -> Res<f64> {
    let top = fresh_dir(base, &format!("serial-{rep}"))?;
    let _dir_guard = DirGuard(top.clone());
    let mut runs = Vec::new();
    for i in 0..o.procs {
        check_interrupted()?;
        let dir = top.join(i.to_string());
        fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let (mut guards, out) = start(tools, &dir, 1, o.mib)?;
        let pid = guards[0].pid;
        let img = dir.join("img");
        checkpoint(tools, &dir, &img, &[pid])?;
        guards.clear();
        runs.push((dir, out, img, pid));
    }
    let mut total = 0.0;
    let mut restored = Vec::new();
    for (dir, _, img, pid) in &runs {
        check_interrupted()?;
        let (t, g, _) = restore_detached(restart_cmd(o, tools, img), dir, *pid, "bench_tree")?;
        total += t.secs;
        restored.push(g);
    }
    for (dir, out, _, _) in &runs {
        check(dir, out, 1)?;
    }
    drop(restored);
    Ok(total)
}

fn fresh_dir(base: &Path, name: &str) -> Res<PathBuf> {
    let dir = base.join(name);
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}

/// Start `bench_tree procs mib` in `dir`; a guard per process (root
/// first) once all are ready, and the path of their stdout.
fn start(
    tools: &crate::Tools,
    dir: &Path,
    procs: usize,
    mib: usize,
) -> Res<(Vec<ProcGuard>, PathBuf)> {
    let out = dir.join("bench_tree.out");
    let err = dir.join("bench_tree.err");
    let mut cmd = Command::new(&tools.workload);
    crate::only_std_fds(&mut cmd);
    let child = cmd
        .arg(procs.to_string())
        .arg(mib.to_string())
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(File::create(&out).map_err(|e| format!("{}: {e}", out.display()))?)
        .stderr(File::create(&err).map_err(|e| format!("{}: {e}", err.display()))?)
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", tools.workload.display()))?;
    let root = child.id() as i32;
    drop(child); // reaped by hand
    let mut guards = vec![ProcGuard::new(root)];
    let lines = wait_lines(&out, &["READY "], 1, Duration::from_secs(300), &err)?;
    for w in lines[0].split_whitespace().skip(2) {
        let pid = w
            .parse()
            .map_err(|_| format!("bad READY line {:?}", lines[0]))?;
        guards.push(ProcGuard::new(pid));
    }
    if guards.len() != procs {
        return Err(format!(
            "READY names {} processes, not {procs}",
            guards.len()
        ));
    }
    Ok((guards, out))
}

/// `cr_checkpoint --kill` of the tree rooted at `pids[0]`; waits until
/// every one of `pids` is gone.
fn checkpoint(tools: &crate::Tools, dir: &Path, img: &Path, pids: &[i32]) -> Res<()> {
    settle(dir);
    let (out, err) = (dir.join("cr_checkpoint.out"), dir.join("cr_checkpoint.err"));
    let mut cmd = Command::new(&tools.checkpoint);
    cmd.arg("--kill")
        .arg("--no-fsync")
        .arg("--dir")
        .arg(img)
        .arg(pids[0].to_string());
    let t = run_timed(cmd, &out, &err)?;
    tool_ok(&t, "cr_checkpoint", &out, &err)?;
    for &p in pids {
        if !wait_gone(p, Duration::from_secs(10)) {
            return Err(format!(
                "cr_checkpoint --kill exited 0 but left pid {p} alive"
            ));
        }
    }
    Ok(())
}

/// Guards for the restored children `pids` (each must be a bench_tree).
fn adopt(pids: &[i32]) -> Res<Vec<ProcGuard>> {
    pids.iter()
        .map(|&p| {
            if proc_exists(p) && proc_comm(p).as_deref() == Some("bench_tree") {
                Ok(ProcGuard::new(p))
            } else {
                Err(format!("restored child {p} is not there"))
            }
        })
        .collect()
}

/// Tell the processes in `dir` to check themselves; all `procs` must say OK.
fn check(dir: &Path, out: &Path, procs: usize) -> Res<()> {
    File::create(dir.join("go")).map_err(|e| format!("create go: {e}"))?;
    let err = dir.join("bench_tree.err");
    let lines = wait_lines(out, &["OK ", "FAIL"], procs, Duration::from_secs(300), &err)?;
    match lines.iter().find(|l| l.starts_with("FAIL")) {
        Some(f) => Err(format!("a restored process failed its check: {f}")),
        None => Ok(()),
    }
}

/// The first `n` complete lines of `out` starting with one of `prefixes`,
/// waited for until `timeout`.
fn wait_lines(
    out: &Path,
    prefixes: &[&str],
    n: usize,
    timeout: Duration,
    err: &Path,
) -> Res<Vec<String>> {
    let t0 = Instant::now();
    loop {
        check_interrupted()?;
        let s = fs::read_to_string(out).unwrap_or_default();
        let complete = &s[..s.rfind('\n').map_or(0, |i| i + 1)];
        let found: Vec<String> = complete
            .lines()
            .filter(|l| prefixes.iter().any(|p| l.starts_with(p)))
            .map(str::to_string)
            .collect();
        if found.len() >= n {
            return Ok(found);
        }
        if t0.elapsed() > timeout {
            return Err(format!(
                "{} of {n} lines {prefixes:?} in {} in time; stderr: {}",
                found.len(),
                out.display(),
                file_tail(err, 400)
            ));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The plainest fill of `procs` × `len` bytes: `process_vm_writev` from a
/// warm 4 MiB buffer into fresh anonymous memory of our own, one mapping
/// per process, on `threads` threads (each taking whole mappings).
fn limit_fill(procs: usize, len: usize, threads: usize) -> Res<f64> {
    let mut src = Mapping::touched(CHUNK)?;
    let mut st = 0x1234_5678u64;
    for c in src.as_mut_slice().chunks_exact_mut(8) {
        c.copy_from_slice(&crate::wyrand(&mut st).to_ne_bytes());
    }
    let src = src.ptr as usize;
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t0 = Instant::now();
    // Addresses of the mappings filled (unmapped after the timing).
    let maps: Res<Vec<Vec<usize>>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| -> Res<Vec<usize>> {
                    let mut mine = Vec::new();
                    while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < procs {
                        let m = Mapping::new(len)?;
                        let mut off = 0;
                        while off < len {
                            let n = (len - off).min(CHUNK);
                            pvm_write(m.ptr as usize + off, src as *mut u8, n)?;
                            off += n;
                        }
                        mine.push(m.ptr as usize);
                        std::mem::forget(m);
                    }
                    Ok(mine)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().map_err(|_| "a fill thread panicked".to_string())?)
            .collect()
    });
    let secs = t0.elapsed().as_secs_f64();
    for addr in maps?.into_iter().flatten() {
        drop(Mapping {
            ptr: addr as *mut u8,
            len,
        });
    }
    Ok(secs)
}

/// process_vm_writev of `len` bytes from `src` to `dst` in our own process.
fn pvm_write(dst: usize, src: *mut u8, len: usize) -> Res<()> {
    let mut done = 0;
    while done < len {
        let local = libc::iovec {
            iov_base: src.wrapping_add(done).cast(),
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (dst + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: `local` is a readable buffer of at least `len` bytes;
        // `remote` lies in a writable mapping of ours of at least `len`
        // bytes that nothing else uses.
        let r =
            unsafe { libc::process_vm_writev(std::process::id() as i32, &local, 1, &remote, 1, 0) };
        if r <= 0 {
            return Err(crate::os_err("process_vm_writev"));
        }
        done += r as usize;
    }
    Ok(())
}

fn stats(v: &[Option<f64>]) -> (Option<f64>, Option<f64>) {
    let mut x: Vec<f64> = v.iter().flatten().copied().collect();
    x.sort_by(f64::total_cmp);
    (x.first().copied(), x.get(x.len() / 2).copied())
}

fn table(o: &Opts, cpus: usize, samples: &[Sample]) -> String {
    let f = |x: Option<f64>| x.map_or("n/a".to_string(), |x| format!("{:.3}", x));
    let (tb, tm) = stats(&samples.iter().map(|s| s.tree_s).collect::<Vec<_>>());
    let (sb, sm) = stats(&samples.iter().map(|s| s.serial_s).collect::<Vec<_>>());
    let (lb, lm) = stats(&samples.iter().map(|s| s.limit_s).collect::<Vec<_>>());
    let (l1b, l1m) = stats(&samples.iter().map(|s| s.limit1_s).collect::<Vec<_>>());
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.2}", a / b),
        _ => "n/a".into(),
    };
    let gib = (o.procs * o.mib) as f64 / 1024.0;
    let mut s = String::new();
    s += &format!(
        "# cr-bench tree: {} processes x {} MiB ({gib:.2} GiB), {} reps, {cpus} CPUs, restart args {:?}, load {}\n\n",
        o.procs,
        o.mib,
        samples.len(),
        o.restart_args,
        fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    s += "| measure | best s | median s |\n|---|---:|---:|\n";
    s += &format!("| one cr_restart of the tree | {} | {} |\n", f(tb), f(tm));
    s += &format!(
        "| {} cr_restarts of single processes, in a row | {} | {} |\n",
        o.procs,
        f(sb),
        f(sm)
    );
    s += &format!(
        "| limit: process_vm_writev into fresh memory, {cpus} threads | {} | {} |\n",
        f(lb),
        f(lm)
    );
    s += &format!(
        "| limit: process_vm_writev into fresh memory, 1 thread | {} | {} |\n",
        f(l1b),
        f(l1m)
    );
    s += &format!(
        "\nserial / tree: {} (best), {} (median); tree / limit: {} (best)\n",
        ratio(sb, tb),
        ratio(sm, tm),
        ratio(tb, lb)
    );
    let per: Vec<String> = samples
        .iter()
        .map(|x| format!("{}/{}", f(x.tree_s), f(x.serial_s)))
        .collect();
    s += &format!("per rep (tree/serial s): {}\n", per.join(", "));
    s
}
