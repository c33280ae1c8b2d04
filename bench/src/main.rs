//! cr-bench: measures `cr_checkpoint` / `cr_restart` against what the machine
//! can do at best with the plainest means (process_vm_readv + write + fsync for
//! dumping, pread into fresh anonymous memory for restoring).
//!
//! See bench/README.md for the meaning of every column. `cr-bench fds ...`
//! is the open-fd benchmark (module [`fds`]), `cr-bench tcp ...` the TCP
//! connection benchmark (module [`tcp`]), `cr-bench incr ...` the
//! incremental checkpoint, pre-dump and compression benchmark (module
//! [`incr`]), `cr-bench coord ...` the coordinator's protocol cost with
//! simulated agents (module [`coord`]), `cr-bench coordinator ...` the
//! same round of a real cr-coordinatord over gRPC with up to a million
//! simulated agents (module [`coordinator`]), `cr-bench cluster ...` the pause of
//! a coordinated checkpoint of a multi-node job (module [`cluster`]),
//! `cr-bench migrate ...` the downtime of a migration (module [`migrate`]),
//! `cr-bench mpi ...` the cost of periodic checkpoints to a real MPI job
//! (module [`mpi`]), `cr-bench tree ...` the restore of one process tree
//! against single-process restores in a row (module [`tree`]).

mod cluster;
mod coord;
mod coordinator;
mod fds;
mod freeze;
mod hostfds;
mod incr;
mod json;
mod migrate;
mod mpi;
mod protocols;
mod tcp;
mod tree;

use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};
use std::ffi::{CString, OsStr};
use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read as _, Write as _};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// Chunk size of every "plain" copy loop.
const CHUNK: usize = 4 * MIB;
/// memcpy source is at most this large (bigger than any cache), reused cyclically.
const MEMCPY_SRC_MAX: usize = GIB;

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

type Res<T> = Result<T, String>;

/// A clap value parser: an integer in `range`, spaces around it ignored
/// (`--sizes "256, 1024"`).
/// The type must be given (`int_in::<usize>(1..)`): clap does not infer it
/// from the field, and a mismatch only shows when the field is read.
pub(crate) fn int_in<T>(
    range: impl std::ops::RangeBounds<T> + std::fmt::Debug + Clone + Send + Sync + 'static,
) -> impl Fn(&str) -> Res<T> + Clone + Send + Sync + 'static
where
    T: std::str::FromStr + PartialOrd,
{
    move |s| match s.trim().parse::<T>() {
        Ok(n) if range.contains(&n) => Ok(n),
        _ => Err(format!("not an integer in {range:?}")),
    }
}

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

/// Measures cr_checkpoint and cr_restart against what the machine can do at
/// best with the plainest means. Without a subcommand: the memory benchmark
/// (see bench/README.md for the meaning of every column).
#[derive(Parser)]
#[command(
    name = "cr-bench",
    args_conflicts_with_subcommands = true,
    args_override_self = true
)]
struct Cli {
    #[command(subcommand)]
    bench: Option<Bench>,
    #[command(flatten)]
    opts: Opts,
}

#[derive(Subcommand)]
enum Bench {
    /// The open-fd benchmark.
    Fds(fds::FdOpts),
    /// The TCP connection benchmark.
    Tcp(tcp::TcpOpts),
    /// Incremental checkpoints, pre-dump, compression.
    Incr(incr::IncrOpts),
    /// The coordinator's protocol cost with simulated agents.
    Coord(coord::Opts),
    /// A coordinated round of a real cr-coordinatord with simulated
    /// agents over gRPC, its RSS and CPU.
    Coordinator(coordinator::Opts),
    /// The simulated agents' server of `coordinator` (run by it).
    #[command(hide = true)]
    CoordinatorAgents(coordinator::AgentsOpts),
    /// Pause of a coordinated checkpoint of a ring job over nodes.
    Cluster(cluster::Opts),
    /// Downtime of a migration against memory and dirty rate.
    Migrate(migrate::Opts),
    /// Member pauses and work lost at a failure: coordinated,
    /// non-blocking and uncoordinated checkpoints at the same interval.
    Protocols(protocols::Opts),
    /// Pause, checkpoint time and slowdown of a checkpointed MPI job.
    Mpi(mpi::Opts),
    /// Restore of one process tree against single-process restores in a row.
    Tree(tree::Opts),
    /// Frozen time of a checkpoint against the fds other processes hold.
    HostFds(hostfds::Opts),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum FsKind {
    Tmpfs,
    Disk,
}

impl FsKind {
    fn name(self) -> &'static str {
        match self {
            FsKind::Tmpfs => "tmpfs",
            FsKind::Disk => "disk",
        }
    }
}

/// The memory benchmark: `cr-bench [--sizes ...]`.
#[derive(Args)]
struct Opts {
    /// Workload sizes in MiB.
    #[arg(
        long = "sizes",
        value_name = "MIB,MIB,...",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = "256,1024,4096",
        value_parser = int_in::<usize>(1..),
    )]
    sizes_mib: Vec<usize>,
    /// Target filesystems; tmpfs is mounted by cr-bench at a fresh temp dir,
    /// disk is a fresh dir under --disk-base.
    #[arg(
        long = "fs",
        value_name = "tmpfs,disk",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = "tmpfs,disk",
    )]
    fss: Vec<FsKind>,
    /// Repetitions of every measurement; best and median are reported.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = int_in::<usize>(1..))]
    reps: usize,
    /// Print the results as JSON instead of markdown tables.
    #[arg(long)]
    json: bool,
    /// Skip hashing the workload memory before dump / after restore.
    #[arg(long = "no-verify", action = ArgAction::SetFalse)]
    verify: bool,
    /// Only run the limit and context measurements (no engine needed).
    #[arg(long)]
    limits_only: bool,
    /// Do not touch SIZE of scratch memory before each timed phase.
    #[arg(long = "no-prewarm", action = ArgAction::SetFalse)]
    prewarm: bool,
    /// Where cr_checkpoint, cr_restart and bench_mem live (default: the
    /// directory of this executable).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
    /// Parent of the on-disk image directory.
    #[arg(long, value_name = "DIR", default_value = "/var/tmp")]
    disk_base: PathBuf,
}

// ---------------------------------------------------------------------------
// Small OS helpers
// ---------------------------------------------------------------------------

fn os_err(what: impl std::fmt::Display) -> String {
    format!("{what}: {}", io::Error::last_os_error())
}

fn check_interrupted() -> Res<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        Err("interrupted".into())
    } else {
        Ok(())
    }
}

extern "C" fn on_signal(_sig: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value;
        // the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

fn cstr(p: &Path) -> Res<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| format!("NUL in path {}", p.display()))
}

fn mkdtemp(prefix: &Path) -> Res<PathBuf> {
    let mut tmpl = prefix.as_os_str().as_bytes().to_vec();
    tmpl.extend_from_slice(b"XXXXXX\0");
    // SAFETY: `tmpl` is a writable NUL-terminated buffer ending in XXXXXX.
    let r = unsafe { libc::mkdtemp(tmpl.as_mut_ptr().cast()) };
    if r.is_null() {
        return Err(os_err(format!("mkdtemp {}XXXXXX", prefix.display())));
    }
    tmpl.pop();
    Ok(PathBuf::from(OsStr::from_bytes(&tmpl)))
}

fn fs_type_name(p: &Path) -> String {
    let Ok(c) = cstr(p) else {
        return "?".into();
    };
    // SAFETY: zeroed statfs is a valid out-parameter.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid C string and `st` a valid out-parameter.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return "?".into();
    }
    #[allow(clippy::unnecessary_cast)]
    match st.f_type as u64 {
        0x0102_1994 => "tmpfs".into(),
        0xEF53 => "ext4".into(),
        0x5846_5342 => "xfs".into(),
        0x9123_683E => "btrfs".into(),
        0x794c_7630 => "overlayfs".into(),
        0x2FC1_2FC1 => "zfs".into(),
        0xF2F5_2010 => "f2fs".into(),
        other => format!("0x{other:x}"),
    }
}

fn kernel_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "?".into())
}

fn mem_available() -> Option<usize> {
    let s = fs::read_to_string("/proc/meminfo").ok()?;
    let l = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = l.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Anonymous private mapping, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> Res<Mapping> {
        // SAFETY: fresh anonymous mapping with no address hint.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err(format!("mmap {len} bytes")));
        }
        Ok(Mapping { ptr: p.cast(), len })
    }

    /// A mapping whose pages are already faulted in. (4 MiB work buffers are
    /// mmapped rather than malloc'ed so that glibc does not keep them in the
    /// heap: our RSS stays small, and it is the floor of the tools' ru_maxrss.)
    fn touched(len: usize) -> Res<Mapping> {
        let mut m = Mapping::new(len)?;
        m.as_mut_slice().fill(1);
        Ok(m)
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr/len describe a live read-write mapping owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len is exactly the mapping created in `new`.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// process_vm_readv of `len` bytes at `remote` in `pid` into `dst`, looping
/// over partial transfers (the kernel caps one call at ~2 GiB).
fn pvm_read(pid: i32, remote: usize, dst: *mut u8, len: usize) -> Res<()> {
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(GIB);
        let local = libc::iovec {
            iov_base: dst.wrapping_add(done).cast(),
            iov_len: n,
        };
        let rem = libc::iovec {
            iov_base: (remote + done) as *mut libc::c_void,
            iov_len: n,
        };
        // SAFETY: `local` points into a writable buffer of at least `len`
        // bytes owned by the caller; `rem` is only read by the kernel in the
        // other process.
        let r = unsafe { libc::process_vm_readv(pid, &local, 1, &rem, 1, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(format!(
                "process_vm_readv pid {pid} at 0x{:x}: {e}",
                remote + done
            ));
        }
        if r == 0 {
            return Err(format!("process_vm_readv pid {pid}: short read at {done}"));
        }
        done += r as usize;
    }
    Ok(())
}

fn wyrand(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0xa076_1d64_78bd_642f);
    let t = u128::from(*state) * u128::from(*state ^ 0xe703_7ed1_a0b4_28db);
    ((t >> 64) as u64) ^ (t as u64)
}

/// Cheap 4-lane order-dependent hash (corruption detection, not security).
fn hash_words(h: &mut [u64; 4], buf: &[u8]) {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    for c in buf.chunks_exact(32) {
        for (i, lane) in h.iter_mut().enumerate() {
            let w = u64::from_ne_bytes(c[i * 8..i * 8 + 8].try_into().unwrap());
            *lane = (*lane ^ w).wrapping_mul(K).rotate_left(29);
        }
    }
}

/// Hash of the remote region (untimed, used to verify the restored memory).
fn remote_hash(pid: i32, addr: usize, len: usize) -> Res<u64> {
    let mut buf = Mapping::touched(CHUNK)?;
    let buf = buf.as_mut_slice();
    let mut h = [1u64, 2, 3, 4];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(CHUNK);
        pvm_read(pid, addr + off, buf.as_mut_ptr(), n)?;
        hash_words(&mut h, &buf[..n]);
        off += n;
    }
    Ok(h.iter()
        .fold(0u64, |a, &x| (a ^ x).wrapping_mul(0x100_0000_01b3)))
}

// ---------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------

fn proc_exists(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn proc_comm(pid: i32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// State letter from /proc/PID/stat (R, S, Z, ...).
fn proc_state(pid: i32) -> Option<char> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s[s.rfind(')')? + 1..].trim_start().chars().next()
}

/// Non-blocking reap of `pid` if it is our (zombie) child. Returns true if
/// reaped or if it is not our child at all.
fn try_reap(pid: i32) -> bool {
    let mut st = 0;
    // SAFETY: plain waitpid on a specific pid with a valid status pointer.
    let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
    r == pid || r < 0
}

/// Waits until `pid` is gone from /proc (reaping it if it is our child).
fn wait_gone(pid: i32, timeout: Duration) -> bool {
    let t0 = Instant::now();
    loop {
        try_reap(pid);
        if !proc_exists(pid) {
            return true;
        }
        if t0.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Reaps any zombie children (processes re-parented to us as subreaper).
fn reap_strays() {
    loop {
        let mut st = 0;
        // SAFETY: waitpid(-1, WNOHANG) with a valid status pointer.
        let r = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) };
        if r <= 0 {
            break;
        }
    }
}

/// A process we are responsible for: SIGKILLed and waited for on drop.
struct ProcGuard {
    pid: i32,
    armed: bool,
}

impl ProcGuard {
    fn new(pid: i32) -> Self {
        ProcGuard { pid, armed: true }
    }

    /// Kills (if still there) and waits until the pid is gone.
    fn finish(&mut self) -> Res<()> {
        if !self.armed {
            return Ok(());
        }
        self.armed = false;
        if proc_exists(self.pid) {
            // SAFETY: kill(2) of a pid we spawned / that cr_restart restored.
            unsafe {
                libc::kill(self.pid, libc::SIGKILL);
            }
        }
        if wait_gone(self.pid, Duration::from_secs(30)) {
            Ok(())
        } else {
            Err(format!("pid {} did not go away after SIGKILL", self.pid))
        }
    }
}

impl Drop for ProcGuard {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            eprintln!("cr-bench: warning: {e}");
        }
    }
}

/// Makes every fd above 2 close-on-exec in the child (fork+exec path), so
/// that no descriptor inherited by cr-bench (pipes of a CI runner, a shell)
/// leaks into the workload or the tools.
fn only_std_fds(cmd: &mut Command) {
    // SAFETY: the closure only calls close_range(2), which is
    // async-signal-safe. Marking (rather than closing) keeps std's own
    // exec-error pipe working until exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::close_range(
                3,
                libc::c_uint::MAX,
                libc::CLOSE_RANGE_CLOEXEC as libc::c_int,
            );
            Ok(())
        });
    }
}

/// Runs `cmd` (`cr_restart --detach IMG`, output into `run_dir`) and takes
/// charge of the PID it prints, before anything else can fail: only the
/// original `pid`, or a process named `comm`, is ever killed. Fails unless
/// cr_restart succeeded and that process runs.
pub(crate) fn restore_detached(
    cmd: Command,
    run_dir: &Path,
    pid: i32,
    comm: &str,
) -> Res<(Timed, ProcGuard, i32)> {
    let rs_out = run_dir.join("cr_restart.out");
    let rs_err = run_dir.join("cr_restart.err");
    let t = run_timed(cmd, &rs_out, &rs_err)?;
    let printed = file_tail(&rs_out, 4000);
    let new_pid = printed
        .lines()
        .find_map(|l| l.trim().parse::<i32>().ok())
        .or_else(|| {
            printed
                .split_whitespace()
                .find_map(|w| w.parse::<i32>().ok())
        })
        .filter(|&p| p > 1);
    let restored = match new_pid {
        Some(p) if p == pid || proc_comm(p).as_deref() == Some(comm) => Some(ProcGuard::new(p)),
        _ => None,
    };
    if !(libc::WIFEXITED(t.status) && libc::WEXITSTATUS(t.status) == 0) {
        return Err(format!(
            "cr_restart failed ({}): {} {}",
            describe_status(t.status),
            file_tail(&rs_err, 1500),
            printed
        ));
    }
    let Some(new_pid) = new_pid else {
        return Err(format!("cr_restart printed no pid: {printed:?}"));
    };
    let Some(guard) = restored else {
        return Err(format!(
            "cr_restart printed pid {new_pid}, which is neither the original pid {pid} nor a \
             {comm} process; not touching it"
        ));
    };
    if !proc_exists(new_pid) || proc_state(new_pid) == Some('Z') {
        return Err(format!("restored pid {new_pid} is not running"));
    }
    Ok((t, guard, new_pid))
}

pub(crate) struct Timed {
    secs: f64,
    maxrss_kib: u64,
    status: i32,
}

fn describe_status(st: i32) -> String {
    if libc::WIFEXITED(st) {
        format!("exit code {}", libc::WEXITSTATUS(st))
    } else if libc::WIFSIGNALED(st) {
        format!("killed by signal {}", libc::WTERMSIG(st))
    } else {
        format!("wait status 0x{st:x}")
    }
}

/// The last lines `t`'s tool printed, or an error with its status and
/// output when it did not exit 0.
pub(crate) fn tool_ok(t: &Timed, what: &str, out: &Path, err: &Path) -> Res<String> {
    let printed = file_tail(out, 2000);
    if !(libc::WIFEXITED(t.status) && libc::WEXITSTATUS(t.status) == 0) {
        return Err(format!(
            "{what} failed ({}): {} {}",
            describe_status(t.status),
            file_tail(err, 1500),
            file_tail(out, 300)
        ));
    }
    Ok(printed)
}

/// Runs `cmd` (stdout/stderr to the given files), measuring wall time from
/// spawn to wait4() and peak RSS from wait4()'s rusage.
fn run_timed(mut cmd: Command, out: &Path, err: &Path) -> Res<Timed> {
    cmd.stdin(Stdio::null())
        .stdout(File::create(out).map_err(|e| format!("{}: {e}", out.display()))?)
        .stderr(File::create(err).map_err(|e| format!("{}: {e}", err.display()))?);
    // Also forces fork()+exec instead of posix_spawn()'s vfork: with CLONE_VM
    // the exec saves *our* peak RSS (hundreds of MiB after the limit
    // measurements) into the child's ru_maxrss. After fork the child's
    // high-water mark starts at our current, small RSS.
    only_std_fds(&mut cmd);
    let prog = cmd.get_program().to_string_lossy().into_owned();
    let t0 = Instant::now();
    let child = cmd.spawn().map_err(|e| format!("spawn {prog}: {e}"))?;
    let pid = child.id() as i32;
    // `child` is never waited for through std: we reap it with wait4 below.
    drop(child);
    let mut guard = ProcGuard::new(pid);
    let mut st = 0;
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: wait4 on our own child with valid out-pointers.
        let r = unsafe { libc::wait4(pid, &mut st, 0, &mut ru) };
        if r == pid {
            break;
        }
        let e = io::Error::last_os_error();
        if r < 0 && e.kind() == io::ErrorKind::Interrupted {
            check_interrupted()?; // guard kills and reaps the child
            continue;
        }
        return Err(format!("wait4 {prog}: {e}"));
    }
    let secs = t0.elapsed().as_secs_f64();
    guard.armed = false;
    Ok(Timed {
        secs,
        maxrss_kib: ru.ru_maxrss as u64,
        status: st,
    })
}

fn file_tail(p: &Path, max: usize) -> String {
    let mut s = String::new();
    if let Ok(mut f) = File::open(p) {
        let _ = f.read_to_string(&mut s);
    }
    let s = s.trim();
    if s.len() > max {
        let mut cut = s.len() - max;
        while !s.is_char_boundary(cut) {
            cut += 1;
        }
        format!("...{}", &s[cut..])
    } else {
        s.to_string()
    }
}

/// Untimed: faults in and frees `len` bytes of anonymous memory right before
/// a timed phase that needs that much new memory (page cache, tmpfs or anon).
/// In a VM with free page reporting (virtio-balloon) pages the guest has not
/// touched lately are backed lazily by the host and cost several times more
/// on first touch; recently freed pages are handed out first, so this gives
/// every timed phase (limit or tool) the same warm start.
fn prewarm(opts: &Opts, len: usize) -> Res<()> {
    if !opts.prewarm {
        return Ok(());
    }
    let mut m = Mapping::new(len)?;
    for page in m.as_mut_slice().chunks_mut(4096) {
        page[0] = 1;
    }
    drop(m);
    Ok(())
}

/// Untimed: like [`prewarm`], for a phase that writes `len` bytes of files in
/// `dir`. Writes and unlinks a scratch file there (no fsync, so with delayed
/// allocation nothing reaches the disk), which leaves freshly freed page
/// cache folios of the sizes the filesystem uses (large folios on ext4/xfs)
/// on the free lists, exactly what the timed phase is about to allocate.
fn prewarm_file(opts: &Opts, dir: &Path, len: usize) -> Res<()> {
    if !opts.prewarm {
        return Ok(());
    }
    let path = dir.join("prewarm.tmp");
    let mut buf = Mapping::touched(CHUNK)?;
    let buf = buf.as_mut_slice();
    let res = (|| -> io::Result<()> {
        let mut f = File::create(&path)?;
        let mut off = 0;
        while off < len {
            let n = (len - off).min(CHUNK);
            f.write_all(&buf[..n])?;
            off += n;
        }
        Ok(())
    })();
    let _ = fs::remove_file(&path);
    res.map_err(|e| format!("prewarm {}: {e}", path.display()))
}

/// syncfs() of the target filesystem (untimed), so that each timed write
/// phase starts without the previous phase's dirty data or pending deletes.
fn settle(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        // SAFETY: syncfs on a valid open file descriptor.
        unsafe {
            libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&d));
        }
    }
}

fn dir_bytes(p: &Path) -> u64 {
    let mut total = 0;
    if let Ok(rd) = fs::read_dir(p) {
        for e in rd.flatten() {
            if let Ok(m) = e.metadata() {
                if m.is_dir() {
                    total += dir_bytes(&e.path());
                } else {
                    total += m.len();
                }
            }
        }
    }
    total
}

// ---------------------------------------------------------------------------
// Target filesystems
// ---------------------------------------------------------------------------

struct Target {
    kind: FsKind,
    dir: PathBuf,
    fs_type: String,
    mounted: bool,
}

impl Target {
    fn tmpfs(size_bytes: usize) -> Res<Target> {
        let dir = mkdtemp(Path::new("/tmp/cr-bench-tmpfs."))?;
        let c = cstr(&dir)?;
        let opts = CString::new(format!("size={}m,mode=0700", size_bytes / MIB)).unwrap();
        // SAFETY: all pointers are valid NUL-terminated strings.
        let r = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                c.as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV,
                opts.as_ptr().cast(),
            )
        };
        if r != 0 {
            let e = os_err(format!("mount -t tmpfs {}", dir.display()));
            let _ = fs::remove_dir(&dir);
            return Err(e);
        }
        let fs_type = fs_type_name(&dir);
        Ok(Target {
            kind: FsKind::Tmpfs,
            dir,
            fs_type,
            mounted: true,
        })
    }

    fn disk(base: &Path) -> Res<Target> {
        let dir = mkdtemp(&base.join("cr-bench."))?;
        let fs_type = fs_type_name(&dir);
        Ok(Target {
            kind: FsKind::Disk,
            dir,
            fs_type,
            mounted: false,
        })
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if self.mounted {
            let Ok(c) = cstr(&self.dir) else { return };
            let mut ok = false;
            for _ in 0..50 {
                // SAFETY: valid C string path.
                if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
                    ok = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            if !ok {
                eprintln!(
                    "cr-bench: warning: {}; detaching",
                    os_err(format!("umount {}", self.dir.display()))
                );
                // SAFETY: valid C string path.
                unsafe {
                    libc::umount2(c.as_ptr(), libc::MNT_DETACH);
                }
            }
            if let Err(e) = fs::remove_dir(&self.dir) {
                eprintln!("cr-bench: warning: rmdir {}: {e}", self.dir.display());
            }
        } else if let Err(e) = fs::remove_dir_all(&self.dir) {
            eprintln!("cr-bench: warning: rm -r {}: {e}", self.dir.display());
        }
    }
}

/// Removes a per-run directory on drop.
struct DirGuard(PathBuf);

impl Drop for DirGuard {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------------------
// Measurements
// ---------------------------------------------------------------------------

/// memcpy of `len` bytes, in 4 MiB chunks, from a (cache-cold) source of
/// min(len, 1 GiB) into one reused 4 MiB buffer.
fn measure_memcpy(len: usize) -> Res<f64> {
    let src_len = len.clamp(CHUNK, MEMCPY_SRC_MAX);
    let mut src = Mapping::new(src_len)?;
    let mut st = 0x1234_5678u64;
    for c in src.as_mut_slice().chunks_exact_mut(8) {
        c.copy_from_slice(&wyrand(&mut st).to_ne_bytes());
    }
    let mut dst = Mapping::touched(CHUNK)?;
    let dst = dst.as_mut_slice();
    let src = src.as_mut_slice();
    let t0 = Instant::now();
    let mut off = 0usize;
    let mut done = 0usize;
    while done < len {
        let n = (len - done).min(CHUNK).min(src_len - off);
        dst[..n].copy_from_slice(&src[off..off + n]);
        std::hint::black_box(&mut *dst);
        done += n;
        off = (off + n) % src_len;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// process_vm_readv of the whole workload region into freshly mmapped memory
/// (includes the page faults of the destination).
fn measure_pvm_fresh(pid: i32, addr: usize, len: usize) -> Res<f64> {
    let t0 = Instant::now();
    let m = Mapping::new(len)?;
    pvm_read(pid, addr, m.ptr, len)?;
    let secs = t0.elapsed().as_secs_f64();
    drop(m);
    Ok(secs)
}

/// Plainest dump: process_vm_readv into one reused 4 MiB buffer, write(),
/// fsync() at the end. Timed from open(O_CREAT|O_TRUNC) to close.
fn limit_dump(pid: i32, addr: usize, len: usize, path: &Path) -> Res<(f64, [f64; 3])> {
    let _ = fs::remove_file(path);
    let mut buf = Mapping::touched(CHUNK)?; // faulted in before timing
    let buf = buf.as_mut_slice();
    let (mut t_read, mut t_write) = (0f64, 0f64);
    let t0 = Instant::now();
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let mut off = 0;
    while off < len {
        let n = (len - off).min(CHUNK);
        let a = Instant::now();
        pvm_read(pid, addr + off, buf.as_mut_ptr(), n)?;
        let b = Instant::now();
        f.write_all(&buf[..n])
            .map_err(|e| format!("write {}: {e}", path.display()))?;
        t_read += (b - a).as_secs_f64();
        t_write += b.elapsed().as_secs_f64();
        off += n;
    }
    let a = Instant::now();
    f.sync_all()
        .map_err(|e| format!("fsync {}: {e}", path.display()))?;
    drop(f);
    let t_sync = a.elapsed().as_secs_f64();
    Ok((t0.elapsed().as_secs_f64(), [t_read, t_write, t_sync]))
}

/// Plainest restore: pread the (page-cache warm) file into freshly mmapped
/// anonymous memory, one pread per 4 MiB chunk. Timed from open to the last
/// pread (the memory is not unmapped inside the timing).
fn limit_restore(path: &Path, len: usize) -> Res<f64> {
    let t0 = Instant::now();
    let f = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut m = Mapping::new(len)?;
    let mem = m.as_mut_slice();
    let mut off = 0;
    while off < len {
        let n = (len - off).min(CHUNK);
        f.read_exact_at(&mut mem[off..off + n], off as u64)
            .map_err(|e| format!("pread {}: {e}", path.display()))?;
        off += n;
    }
    let secs = t0.elapsed().as_secs_f64();
    std::hint::black_box(&mut m);
    drop(m);
    Ok(secs)
}

// ---------------------------------------------------------------------------
// One repetition for one (size, fs)
// ---------------------------------------------------------------------------

struct Bins {
    workload: PathBuf,
    checkpoint: PathBuf,
    restart: PathBuf,
}

#[derive(Default, Clone)]
struct Sample {
    memcpy_s: Option<f64>,
    pvm_fresh_s: Option<f64>,
    limit_dump_s: Option<f64>,
    /// limit_dump split into process_vm_readv, write and fsync seconds.
    limit_dump_parts: Option<[f64; 3]>,
    limit_restore_s: Option<f64>,
    /// Checkpoint that continues (the default mode, with fsync): wall
    /// time of the tool and how long the process was frozen.
    cont_wall_s: Option<f64>,
    cont_frozen_s: Option<f64>,
    cont_rss_kib: Option<u64>,
    dump_s: Option<f64>,
    dump_rss_kib: Option<u64>,
    restore_s: Option<f64>,
    restore_rss_kib: Option<u64>,
    /// The same restore with `cr_restart --verify` (the tree captured
    /// again and compared with the image before it runs).
    restore_verify_s: Option<f64>,
    image_bytes: Option<u64>,
    /// Some(true): restored memory hashes equal to the dumped memory.
    verified: Option<bool>,
    same_pid: Option<bool>,
    error: Option<String>,
}

fn wait_ready(out: &Path, pid: i32, timeout: Duration) -> Res<(usize, usize)> {
    let t0 = Instant::now();
    loop {
        check_interrupted()?;
        if let Ok(s) = fs::read_to_string(out) {
            if let Some(line) = s.lines().find(|l| l.starts_with("READY ")) {
                let mut it = line.split_whitespace().skip(1);
                let addr = it.next().and_then(|a| usize::from_str_radix(a, 16).ok());
                let len = it.next().and_then(|l| l.parse().ok());
                if let (Some(a), Some(l)) = (addr, len) {
                    return Ok((a, l));
                }
                return Err(format!("bad READY line {line:?}"));
            }
        }
        let mut st = 0;
        // SAFETY: non-blocking waitpid on our own child.
        if unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) } == pid {
            return Err(format!("workload exited early ({})", describe_status(st)));
        }
        if t0.elapsed() > timeout {
            return Err("workload did not print READY in time".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn run_one(
    opts: &Opts,
    bins: &Bins,
    target: &Target,
    size_mib: usize,
    rep: usize,
    s: &mut Sample,
) -> Res<()> {
    let run_dir = target.dir.join(format!("run-{size_mib}-{rep}"));
    let _ = fs::remove_dir_all(&run_dir);
    fs::create_dir(&run_dir).map_err(|e| format!("{}: {e}", run_dir.display()))?;
    let _dir_guard = DirGuard(run_dir.clone());
    let len = size_mib * MIB;

    // --- workload ---
    let wl_out = run_dir.join("bench_mem.out");
    let wl_err = run_dir.join("bench_mem.err");
    let mut cmd = Command::new(&bins.workload);
    only_std_fds(&mut cmd);
    let child = cmd
        .arg(size_mib.to_string())
        .current_dir(&run_dir)
        .stdin(Stdio::null())
        .stdout(File::create(&wl_out).map_err(|e| e.to_string())?)
        .stderr(File::create(&wl_err).map_err(|e| e.to_string())?)
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", bins.workload.display()))?;
    let pid = child.id() as i32;
    drop(child); // reaped by hand (waitpid), never through std
    let mut workload = ProcGuard::new(pid);
    let (addr, rlen) = wait_ready(&wl_out, pid, Duration::from_secs(300))
        .map_err(|e| format!("{e}; stderr: {}", file_tail(&wl_err, 400)))?;
    if rlen != len {
        return Err(format!("workload reports {rlen} bytes, expected {len}"));
    }
    let hash = if opts.verify {
        Some(remote_hash(pid, addr, len)?)
    } else {
        None
    };

    // --- context ---
    check_interrupted()?;
    s.memcpy_s = Some(measure_memcpy(len)?);
    check_interrupted()?;
    prewarm(opts, len)?;
    s.pvm_fresh_s = Some(measure_pvm_fresh(pid, addr, len)?);

    // --- limits ---
    check_interrupted()?;
    let limit_path = run_dir.join("limit.img");
    prewarm_file(opts, &run_dir, len)?;
    settle(&run_dir);
    let (secs, parts) = limit_dump(pid, addr, len, &limit_path)?;
    s.limit_dump_s = Some(secs);
    s.limit_dump_parts = Some(parts);
    check_interrupted()?;
    prewarm(opts, len)?;
    s.limit_restore_s = Some(limit_restore(&limit_path, len)?);
    // Free the space (the tmpfs holds one image at a time).
    fs::remove_file(&limit_path).map_err(|e| format!("rm {}: {e}", limit_path.display()))?;

    if opts.limits_only {
        return Ok(());
    }

    // --- checkpoint that continues ---
    check_interrupted()?;
    let (wall, frozen, rss) = continue_dump(bins, opts, &run_dir, pid, len)?;
    s.cont_wall_s = Some(wall);
    s.cont_frozen_s = Some(frozen);
    s.cont_rss_kib = Some(rss);

    // --- dump ---
    check_interrupted()?;
    let img = run_dir.join("img");
    prewarm_file(opts, &run_dir, len)?;
    settle(&run_dir);
    fs::create_dir(&img).map_err(|e| format!("{}: {e}", img.display()))?;
    let ck_out = run_dir.join("cr_checkpoint.out");
    let ck_err = run_dir.join("cr_checkpoint.err");
    let mut cmd = Command::new(&bins.checkpoint);
    cmd.arg("--dir")
        .arg(&img)
        .arg("--kill")
        .arg(pid.to_string());
    let dump = run_timed(cmd, &ck_out, &ck_err)?;
    tool_ok(&dump, "cr_checkpoint", &ck_out, &ck_err)?;
    // The target was killed by --kill: reap it so that its pid is free.
    if !wait_gone(pid, Duration::from_secs(5)) {
        return Err(format!(
            "cr_checkpoint --kill exited 0 but left pid {pid} alive (image: {} bytes)",
            dir_bytes(&img)
        ));
    }
    workload.finish()?;
    if !img.join("checkpoint.img").exists() {
        return Err(format!(
            "cr_checkpoint exited 0 but wrote no {}",
            img.join("checkpoint.img").display()
        ));
    }
    // Only a dump that did its job counts.
    s.dump_s = Some(dump.secs);
    s.dump_rss_kib = Some(dump.maxrss_kib);
    s.image_bytes = Some(dir_bytes(&img));

    // --- restore ---
    check_interrupted()?;
    prewarm(opts, len)?;
    let mut cmd = Command::new(&bins.restart);
    cmd.arg("--detach").arg(&img);
    let (t, guard, new_pid) = restore_detached(cmd, &run_dir, pid, "bench_mem")?;
    let mut restored = Some(guard);
    s.restore_s = Some(t.secs);
    s.restore_rss_kib = Some(t.maxrss_kib);
    s.same_pid = Some(new_pid == pid);
    if let Some(h) = hash {
        s.verified = Some(
            remote_hash(new_pid, addr, len)
                .map(|h2| h2 == h)
                .unwrap_or(false),
        );
    }
    if let Some(g) = restored.as_mut() {
        g.finish()?;
    }
    reap_strays();

    // --- restore with --verify: its cost next to the plain one ---
    check_interrupted()?;
    prewarm(opts, len)?;
    let mut cmd = Command::new(&bins.restart);
    cmd.arg("--detach").arg("--verify").arg(&img);
    let (t, mut guard, _) = restore_detached(cmd, &run_dir, pid, "bench_mem")?;
    s.restore_verify_s = Some(t.secs);
    guard.finish()?;
    reap_strays();
    Ok(())
}

/// `cr_checkpoint PID` in its default mode (the process runs on, fsync
/// on): the tool's wall time and the frozen time it reports. The process
/// should be thawed once its memory is copied, before the write and the
/// fsync: the frozen time is to be compared with the copy limit.
fn continue_dump(
    bins: &Bins,
    opts: &Opts,
    run_dir: &Path,
    pid: i32,
    len: usize,
) -> Res<(f64, f64, u64)> {
    let img = run_dir.join("img-continue");
    prewarm_file(opts, run_dir, len)?;
    settle(run_dir);
    fs::create_dir(&img).map_err(|e| format!("{}: {e}", img.display()))?;
    let out = run_dir.join("cr_checkpoint-continue.out");
    let err = run_dir.join("cr_checkpoint-continue.err");
    let mut cmd = Command::new(&bins.checkpoint);
    cmd.arg("--dir").arg(&img).arg(pid.to_string());
    let t = run_timed(cmd, &out, &err)?;
    let printed = tool_ok(&t, "cr_checkpoint (continue)", &out, &err)?;
    let frozen = incr::kv(&printed, "frozen ")
        .ok_or_else(|| format!("cr_checkpoint printed no frozen time: {printed}"))?;
    if !proc_exists(pid) {
        return Err(format!(
            "pid {pid} is gone after a checkpoint that continues"
        ));
    }
    // Free the space (the tmpfs holds one image at a time).
    fs::remove_dir_all(&img).map_err(|e| format!("rm {}: {e}", img.display()))?;
    Ok((t.secs, frozen, t.maxrss_kib))
}

// ---------------------------------------------------------------------------
// Statistics and output
// ---------------------------------------------------------------------------

struct Row {
    size_mib: usize,
    fs: FsKind,
    fs_type: String,
    samples: Vec<Sample>,
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / 1e9 / secs
}

#[derive(Clone, Copy)]
enum Agg {
    Best,
    Median,
}

/// Aggregates throughputs (GB/s) over the reps: best = max, median = median.
fn agg_rate(row: &Row, agg: Agg, f: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
    let bytes = row.size_mib * MIB;
    let mut v: Vec<f64> = row
        .samples
        .iter()
        .filter_map(&f)
        .map(|s| gbps(bytes, s))
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(match agg {
        Agg::Best => v[v.len() - 1],
        Agg::Median => {
            let m = v.len() / 2;
            if v.len() % 2 == 1 {
                v[m]
            } else {
                (v[m - 1] + v[m]) / 2.0
            }
        }
    })
}

/// The shortest of a time over the reps.
fn min_secs(row: &Row, f: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
    row.samples
        .iter()
        .filter_map(f)
        .filter(|x| x.is_finite())
        .reduce(f64::min)
}

/// Peak RSS in MiB, maximum over reps.
fn max_rss_mib(row: &Row, f: impl Fn(&Sample) -> Option<u64>) -> Option<f64> {
    row.samples
        .iter()
        .filter_map(f)
        .max()
        .map(|k| k as f64 / 1024.0)
}

fn fmt_opt(v: Option<f64>, prec: usize) -> String {
    match v {
        Some(x) => format!("{x:.prec$}"),
        None => "n/a".into(),
    }
}

fn pct(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(100.0 * a / b),
        _ => None,
    }
}

fn size_label(mib: usize) -> String {
    if mib >= 1024 && mib & 1023 == 0 {
        format!("{} GiB", mib / 1024)
    } else {
        format!("{mib} MiB")
    }
}

fn markdown(rows: &[Row], opts: &Opts, targets: &[Target]) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# cr-bench results\n");
    let _ = writeln!(
        o,
        "kernel {}, {} CPUs, reps {}; GB/s = 10^9 bytes/s of workload memory; \
         peak RSS = ru_maxrss of the tool process (wait4).",
        kernel_release(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        opts.reps
    );
    for t in targets {
        let _ = writeln!(
            o,
            "- {}: {} ({}){}",
            t.kind.name(),
            t.dir.display(),
            t.fs_type,
            if t.mounted {
                ", mounted by cr-bench"
            } else {
                ""
            }
        );
    }
    let _ = writeln!(
        o,
        "- page cache is kept warm: limit_restore and restore read files that were just \
         written (no cache drop); dump and limit_dump both fsync.\n"
    );
    let aggs: &[(Agg, &str)] = if opts.reps > 1 {
        &[(Agg::Best, "best"), (Agg::Median, "median")]
    } else {
        &[(Agg::Best, "")]
    };
    for &(agg, name) in aggs {
        if !name.is_empty() {
            let _ = writeln!(o, "## {name} of {} reps\n", opts.reps);
        }
        let _ = writeln!(
            o,
            "| size | fs | limit_dump GB/s | dump GB/s | dump % of limit | dump peak RSS MiB \
             | limit_restore GB/s | restore GB/s | restore % of limit | restore peak RSS MiB |"
        );
        let _ = writeln!(o, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for r in rows {
            let ld = agg_rate(r, agg, |s| s.limit_dump_s);
            let d = agg_rate(r, agg, |s| s.dump_s);
            let lr = agg_rate(r, agg, |s| s.limit_restore_s);
            let rs = agg_rate(r, agg, |s| s.restore_s);
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                size_label(r.size_mib),
                r.fs.name(),
                fmt_opt(ld, 2),
                fmt_opt(d, 2),
                fmt_opt(pct(d, ld), 0),
                fmt_opt(max_rss_mib(r, |s| s.dump_rss_kib), 1),
                fmt_opt(lr, 2),
                fmt_opt(rs, 2),
                fmt_opt(pct(rs, lr), 0),
                fmt_opt(max_rss_mib(r, |s| s.restore_rss_kib), 1),
            );
        }
        let _ = writeln!(o);
    }

    let _ = writeln!(
        o,
        "## checkpoint that continues (default mode, fsync on)\n\n\
         The process is thawed once its memory is copied; writing and fsync run \
         while it runs. copy s = the whole memory read with process_vm_readv into \
         fresh memory, measured in the same run (best of the reps).\n"
    );
    let _ = writeln!(
        o,
        "| size | fs | copy s | frozen s | frozen ÷ copy | checkpoint wall s | peak RSS MiB |"
    );
    let _ = writeln!(o, "|---|---|---:|---:|---:|---:|---:|");
    for r in rows {
        let best = |f: fn(&Sample) -> Option<f64>| min_secs(r, f);
        let copy = best(|s| s.pvm_fresh_s);
        let frozen = best(|s| s.cont_frozen_s);
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} |",
            size_label(r.size_mib),
            r.fs.name(),
            fmt_opt(copy, 3),
            fmt_opt(frozen, 3),
            fmt_opt(pct(frozen, copy).map(|p| p / 100.0), 2),
            fmt_opt(best(|s| s.cont_wall_s), 3),
            fmt_opt(max_rss_mib(r, |s| s.cont_rss_kib), 1),
        );
    }
    let _ = writeln!(o);

    let _ = writeln!(o, "## context\n");
    let _ = writeln!(
        o,
        "| size | fs | memcpy GB/s | process_vm_readv→fresh GB/s | dump s | restore s \
         | restore --verify s | image MiB | same pid | memory verified |"
    );
    let _ = writeln!(o, "|---|---|---:|---:|---:|---:|---:|---:|---|---|");
    for r in rows {
        let secs = |f: fn(&Sample) -> Option<f64>| min_secs(r, f);
        let img = r.samples.iter().filter_map(|s| s.image_bytes).max();
        let all = |f: fn(&Sample) -> Option<bool>| {
            let v: Vec<bool> = r.samples.iter().filter_map(f).collect();
            if v.is_empty() {
                "n/a".to_string()
            } else if v.iter().all(|&b| b) {
                "yes".to_string()
            } else {
                format!("NO ({}/{} ok)", v.iter().filter(|&&b| b).count(), v.len())
            }
        };
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            size_label(r.size_mib),
            r.fs.name(),
            fmt_opt(agg_rate(r, aggs[0].0, |s| s.memcpy_s), 2),
            fmt_opt(agg_rate(r, aggs[0].0, |s| s.pvm_fresh_s), 2),
            fmt_opt(secs(|s| s.dump_s), 3),
            fmt_opt(secs(|s| s.restore_s), 3),
            fmt_opt(secs(|s| s.restore_verify_s), 3),
            fmt_opt(img.map(|b| b as f64 / MIB as f64), 1),
            all(|s| s.same_pid),
            all(|s| s.verified),
        );
    }
    let errors: Vec<String> = rows
        .iter()
        .flat_map(|r| {
            r.samples.iter().enumerate().filter_map(move |(i, s)| {
                s.error.as_ref().map(|e| {
                    format!(
                        "- {} {} rep {}: {}",
                        size_label(r.size_mib),
                        r.fs.name(),
                        i + 1,
                        e
                    )
                })
            })
        })
        .collect();
    if !errors.is_empty() {
        let _ = writeln!(o, "\n## errors\n");
        for e in errors {
            let _ = writeln!(o, "{e}");
        }
    }
    o
}

fn json(rows: &[Row], opts: &Opts, targets: &[Target]) -> String {
    use serde_json::{json, Value};
    let targets: Vec<Value> = targets
        .iter()
        .map(|t| json!({"fs": t.kind.name(), "dir": t.dir, "fs_type": t.fs_type}))
        .collect();
    let rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            let mut row = json!({
                "size_mib": r.size_mib,
                "fs": r.fs.name(),
                "fs_type": r.fs_type,
                "dump_peak_rss_mib": max_rss_mib(r, |s| s.dump_rss_kib),
                "restore_peak_rss_mib": max_rss_mib(r, |s| s.restore_rss_kib),
            });
            for (agg, name) in [(Agg::Best, "best"), (Agg::Median, "median")] {
                let ld = agg_rate(r, agg, |s| s.limit_dump_s);
                let d = agg_rate(r, agg, |s| s.dump_s);
                let lr = agg_rate(r, agg, |s| s.limit_restore_s);
                let rs = agg_rate(r, agg, |s| s.restore_s);
                row[name] = json!({
                    "limit_dump_gbps": ld,
                    "dump_gbps": d,
                    "dump_pct_of_limit": pct(d, ld),
                    "limit_restore_gbps": lr,
                    "restore_gbps": rs,
                    "restore_pct_of_limit": pct(rs, lr),
                    "memcpy_gbps": agg_rate(r, agg, |s| s.memcpy_s),
                    "pvm_fresh_gbps": agg_rate(r, agg, |s| s.pvm_fresh_s),
                });
            }
            row["samples"] = r
                .samples
                .iter()
                .map(|s| {
                    json!({
                        "memcpy_s": s.memcpy_s,
                        "pvm_fresh_s": s.pvm_fresh_s,
                        "limit_dump_s": s.limit_dump_s,
                        "limit_dump_parts_s": s.limit_dump_parts.map(|p| json!({
                            "read": p[0], "write": p[1], "fsync": p[2],
                        })),
                        "limit_restore_s": s.limit_restore_s,
                        "continue_wall_s": s.cont_wall_s,
                        "continue_frozen_s": s.cont_frozen_s,
                        "continue_maxrss_kib": s.cont_rss_kib,
                        "dump_s": s.dump_s,
                        "dump_maxrss_kib": s.dump_rss_kib,
                        "restore_s": s.restore_s,
                        "restore_maxrss_kib": s.restore_rss_kib,
                        "restore_verify_s": s.restore_verify_s,
                        "image_bytes": s.image_bytes,
                        "same_pid": s.same_pid,
                        "verified": s.verified,
                        "error": s.error,
                    })
                })
                .collect();
            row
        })
        .collect();
    let doc = json!({
        "kernel": kernel_release(),
        "reps": opts.reps,
        "gb": 1e9,
        "page_cache": "warm",
        "targets": targets,
        "rows": rows,
    });
    format!("{doc}\n")
}

// ---------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------

fn find_bins(opts: &Opts) -> Res<Bins> {
    let dir = match &opts.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()
            .map_err(|e| format!("current_exe: {e}"))?
            .parent()
            .ok_or("current_exe has no parent")?
            .to_path_buf(),
    };
    Ok(Bins {
        workload: dir.join("bench_mem"),
        checkpoint: dir.join("cr_checkpoint"),
        restart: dir.join("cr_restart"),
    })
}

fn real_main(mut opts: Opts) -> Res<()> {
    let bins = find_bins(&opts)?;
    if !bins.workload.exists() {
        return Err(format!(
            "{} not found (build with `cargo build --release --workspace`)",
            bins.workload.display()
        ));
    }
    if !opts.limits_only {
        for b in [&bins.checkpoint, &bins.restart] {
            if !b.exists() {
                eprintln!(
                    "cr-bench: {} not found; measuring the limits only",
                    b.display()
                );
                opts.limits_only = true;
            }
        }
    }
    install_signal_handlers();
    // PID 1 of a container may not reap the restored processes; we do.
    become_subreaper();

    let max_len = opts.sizes_mib.iter().max().copied().unwrap_or(0) * MIB;
    if let Some(avail) = mem_available() {
        // workload + fresh copy + (tmpfs) file
        let need = 3 * max_len + GIB;
        if avail < need {
            eprintln!(
                "cr-bench: warning: MemAvailable {} MiB < ~{} MiB needed for {} MiB",
                avail / MIB,
                need / MIB,
                max_len / MIB
            );
        }
    }

    let mut targets = Vec::new();
    for &fs in &opts.fss {
        targets.push(match fs {
            FsKind::Tmpfs => Target::tmpfs((6 * GIB).max(max_len + 2 * GIB))?,
            FsKind::Disk => Target::disk(&opts.disk_base)?,
        });
    }

    let mut rows = Vec::new();
    'outer: for &size in &opts.sizes_mib {
        for t in &targets {
            let mut row = Row {
                size_mib: size,
                fs: t.kind,
                fs_type: t.fs_type.clone(),
                samples: Vec::new(),
            };
            for rep in 0..opts.reps {
                eprintln!(
                    "cr-bench: {} on {} ({}), rep {}/{} ...",
                    size_label(size),
                    t.kind.name(),
                    t.fs_type,
                    rep + 1,
                    opts.reps
                );
                let mut s = Sample::default();
                if let Err(e) = run_one(&opts, &bins, t, size, rep, &mut s) {
                    eprintln!("cr-bench:   error: {e}");
                    s.error = Some(e);
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

    let out = if opts.json {
        json(&rows, &opts, &targets)
    } else {
        markdown(&rows, &opts, &targets)
    };
    drop(targets); // unmount / remove before printing the final result
    let mut so = io::stdout().lock();
    let _ = so.write_all(out.as_bytes());
    let _ = so.flush();
    if INTERRUPTED.load(Ordering::SeqCst) {
        return Err("interrupted".into());
    }
    Ok(())
}

/// The binaries a bench that checkpoints and restores a workload runs.
pub(crate) struct Tools {
    pub workload: PathBuf,
    pub checkpoint: PathBuf,
    pub restart: PathBuf,
    pub image: PathBuf,
}

/// `workload` and the cr tools, in `bin_dir` or next to cr-bench; fails
/// naming the first one missing.
/// Where the tools and workloads are: `--bin-dir` made absolute (the
/// workloads start in their own run directory), or this binary's directory.
pub(crate) fn bin_dir(given: Option<&std::path::Path>) -> Res<PathBuf> {
    match given {
        Some(d) => std::path::absolute(d).map_err(|e| format!("--bin-dir {}: {e}", d.display())),
        None => Ok(std::env::current_exe()
            .map_err(|e| format!("current_exe: {e}"))?
            .parent()
            .ok_or("current_exe has no parent")?
            .to_path_buf()),
    }
}

pub(crate) fn find_tools(bin_dir: Option<&std::path::Path>, workload: &str) -> Res<Tools> {
    let dir = crate::bin_dir(bin_dir)?;
    let t = Tools {
        workload: dir.join(workload),
        checkpoint: dir.join("cr_checkpoint"),
        restart: dir.join("cr_restart"),
        image: dir.join("cr_image"),
    };
    require_bins(&[&t.workload, &t.checkpoint, &t.restart, &t.image])?;
    Ok(t)
}

/// Fail with one line naming the first of `bins` that is missing.
pub(crate) fn require_bins(bins: &[&PathBuf]) -> Res<()> {
    for p in bins {
        if !p.exists() {
            return Err(format!(
                "{} not found (build with `cargo build --release --workspace`, or --bin-dir)",
                p.display()
            ));
        }
    }
    Ok(())
}

/// Restored processes are re-parented to us when cr_restart exits.
pub(crate) fn become_subreaper() {
    // SAFETY: prctl with integer arguments only.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
}

fn main() {
    let cli = Cli::parse();
    let res = match cli.bench {
        Some(Bench::Fds(o)) => fds::main(o),
        Some(Bench::Tcp(o)) => tcp::main(o),
        Some(Bench::Incr(o)) => incr::main(o),
        Some(Bench::Coord(o)) => coord::run(o),
        Some(Bench::Coordinator(o)) => coordinator::run(o),
        Some(Bench::CoordinatorAgents(o)) => coordinator::serve_agents(o),
        Some(Bench::Cluster(o)) => cluster::run(o),
        Some(Bench::Migrate(o)) => migrate::run(o),
        Some(Bench::Protocols(o)) => protocols::run(o),
        Some(Bench::Mpi(o)) => mpi::run(o),
        Some(Bench::Tree(o)) => tree::run(o),
        Some(Bench::HostFds(o)) => hostfds::run(o),
        None => real_main(cli.opts),
    };
    let code = match res {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("cr-bench: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// Test support: `cr-bench ARGS` (split at spaces) parsed, as the options of
/// its subcommand, or of the memory benchmark without one.
#[cfg(test)]
fn parsed<T: clap::FromArgMatches>(args: &str) -> T {
    use clap::CommandFactory;
    let m = Cli::command()
        .try_get_matches_from(std::iter::once("cr-bench").chain(args.split_whitespace()))
        .unwrap_or_else(|e| panic!("{args}: {e}"));
    T::from_arg_matches(m.subcommand().map_or(&m, |(_, sub)| sub))
        .unwrap_or_else(|e| panic!("{args}: {e}"))
}

/// Test support: asserts that every `cr-bench ARGS` of `lines` is refused.
#[cfg(test)]
fn assert_refused(lines: &[&str]) {
    for args in lines {
        let argv = std::iter::once("cr-bench").chain(args.split_whitespace());
        assert!(Cli::try_parse_from(argv).is_err(), "{args}: accepted");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn memory_benchmark_command_lines() {
        let o: Opts = parsed("");
        assert_eq!(o.sizes_mib, [256, 1024, 4096]);
        assert_eq!(o.fss, [FsKind::Tmpfs, FsKind::Disk]);
        assert_eq!(o.reps, 1);
        assert!(!o.json && o.verify && !o.limits_only && o.prewarm);
        assert_eq!(o.bin_dir, None);
        assert_eq!(o.disk_base, Path::new("/var/tmp"));

        assert_eq!(parsed::<Opts>("--sizes 256").sizes_mib, [256]);
        let o: Opts = parsed("--reps 3 --json");
        assert!(o.reps == 3 && o.json);
        assert!(parsed::<Opts>("--limits-only").limits_only);
        let o: Opts =
            parsed("--sizes=16,32 --fs=disk --no-verify --no-prewarm --bin-dir target/debug");
        assert_eq!(o.sizes_mib, [16, 32]);
        assert_eq!(o.fss, [FsKind::Disk]);
        assert!(!o.verify && !o.prewarm);
        assert_eq!(o.bin_dir.as_deref(), Some(Path::new("target/debug")));
        assert_eq!(
            parsed::<Opts>("--disk-base /srv").disk_base,
            Path::new("/srv")
        );
        // The last occurrence of a flag counts, lists included.
        let o: Opts = parsed("--sizes 1,2 --sizes 3 --reps 2 --reps 4");
        assert!(o.sizes_mib == [3] && o.reps == 4);

        // Top-level flags belong to the memory benchmark only.
        assert_refused(&[
            "--sizes 0",
            "--sizes x",
            "--fs nfs",
            "--reps 0",
            "--bogus",
            "x",
            "--reps 3 fds",
        ]);
    }
}
