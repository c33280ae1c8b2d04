//! What a checkpoint and a restore are asked to do. These structs are the
//! command-line options too (`cr_checkpoint` and `cr_restart` flatten them
//! into their clap parsers), so no option is copied from one struct to
//! another on the way from the user to the engine.

use cr_image::model::Compression;
pub use cr_image::progress::Progress;
use std::net::IpAddr;
use std::path::PathBuf;

/// What happens to the processes after a successful dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Action {
    /// They run on (the default).
    #[default]
    Continue,
    /// They are left stopped (SIGSTOP).
    Stop,
    /// They are killed (SIGKILL).
    Kill,
}

/// How pages unchanged since the parent image are found (`--dirty`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirtyChoice {
    /// The best the kernel offers: uffd-wp, else soft-dirty, else hashes.
    #[default]
    Auto,
    Uffd,
    SoftDirty,
    Hash,
}

impl std::str::FromStr for DirtyChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DirtyChoice::Auto),
            "uffd" | "uffd-wp" => Ok(DirtyChoice::Uffd),
            "soft-dirty" => Ok(DirtyChoice::SoftDirty),
            "hash" => Ok(DirtyChoice::Hash),
            _ => Err(format!(
                "unknown dirty tracking {s:?} (auto, uffd, soft-dirty or hash)"
            )),
        }
    }
}

impl DirtyChoice {
    /// As users type it.
    pub fn name(self) -> &'static str {
        match self {
            DirtyChoice::Auto => "auto",
            DirtyChoice::Uffd => "uffd",
            DirtyChoice::SoftDirty => "soft-dirty",
            DirtyChoice::Hash => "hash",
        }
    }
}

/// Options of a checkpoint (`cr_checkpoint`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CheckpointOptions {
    /// Image directory (created if missing) [default: the job's `cr_run
    /// --dir`, else ./ckpt.PID].
    #[arg(long, short = 'd')]
    pub dir: Option<PathBuf>,
    /// Kill the processes after a successful checkpoint.
    #[arg(long, conflicts_with = "stop")]
    pub kill: bool,
    /// Leave the processes stopped (SIGSTOP) after a successful checkpoint.
    #[arg(long, alias = "leave-stopped")]
    pub stop: bool,
    /// Do not fsync the image (faster, not crash-safe).
    #[arg(long)]
    pub no_fsync: bool,
    /// Threads copying memory [default: number of CPUs].
    #[arg(long)]
    pub workers: Option<usize>,
    /// With --kill or --stop, drop TCP connections that a listening socket
    /// has not accepted yet (they cannot be put back in its queue) instead
    /// of refusing the checkpoint. Their clients will see a reset.
    #[arg(long, alias = "skip-in-flight")]
    pub tcp_skip_in_flight: bool,
    /// With --kill or --stop, drop inotify and fanotify events queued and
    /// not read yet at once, without first giving the program a short
    /// while to read them (the kernel cannot queue them again: what is
    /// left after that wait is dropped anyway, with a warning). The
    /// restored program will not see them; its watches and marks work.
    #[arg(long)]
    pub skip_queued_events: bool,
    /// Incremental checkpoint: store only the pages written since this
    /// earlier image of the same processes, and refer to it for the rest
    /// (`cr_restart` follows the chain).
    #[arg(long, value_name = "DIR")]
    pub parent: Option<PathBuf>,
    /// Copy memory while the processes run on (they are frozen only to list
    /// their mappings and start dirty-page tracking). The image cannot be
    /// restored by itself: it is the --parent of the checkpoint that
    /// follows, which then freezes the processes only for what changed.
    #[arg(long, conflicts_with_all = ["kill", "stop"])]
    pub pre_dump: bool,
    /// Leave dirty-page tracking on in the processes, so that the next
    /// checkpoint with --parent reads only what they write from now on.
    #[arg(long)]
    pub track_mem: bool,
    /// How pages unchanged since --parent are found: uffd (userfaultfd
    /// write-protect, Linux 6.7+), soft-dirty, hash (read every page and
    /// compare its hash: works everywhere), or auto (the best available).
    #[arg(long, default_value = "auto", value_name = "METHOD")]
    pub dirty: DirtyChoice,
    /// Compression of the page store: none, lz4 (fast) or zstd (small).
    #[arg(long, default_value = "none", value_name = "ALG")]
    pub compress: Compression,
    /// Also save the System V IPC objects (shared memory, semaphores,
    /// message queues) of the host's IPC namespace with this key (0x1234
    /// or decimal; repeatable). Saved anyway: the segments the processes
    /// attach or created, and the semaphores and queues a process of the
    /// tree used last; a job with its own IPC namespace saves all of it.
    #[arg(long = "ipc-key", value_name = "KEY", value_parser = parse_ipc_key)]
    pub ipc_keys: Vec<i32>,
    /// Also save every System V IPC object of the host's IPC namespace
    /// owned by this uid (repeatable).
    #[arg(long = "ipc-owner", value_name = "UID")]
    pub ipc_owners: Vec<u32>,
    /// Store in the image the content of every regular file the processes
    /// hold open, each up to LIMIT bytes (e.g. 64M, the default; 1G), so a
    /// restore puts back files since changed or deleted (a sort's temporary
    /// files, a database): the image is self-contained.
    #[arg(long, value_name = "LIMIT", num_args = 0..=1, require_equals = true,
          default_missing_value = "64M",
          value_parser = parse_size)]
    pub save_files: Option<u64>,
    /// Store in the image the content of this file (any size; repeatable),
    /// whether the processes hold it open or not.
    #[arg(long = "save-file", value_name = "PATH")]
    pub save_file: Vec<PathBuf>,
    /// The job's frame in a control group hierarchy: a group at or above
    /// the root process's own, whose subtree is the job's (CONTROLLERS:
    /// "memory", "cpu", "name=systemd"...; none: every hierarchy not named
    /// by another; repeatable). `cr_restart --cgroup-root` replaces it
    /// [default: the root process's own group].
    #[arg(long = "cgroup-root", value_name = "[CONTROLLERS:]PATH")]
    pub cgroup_root: Vec<crate::kinds::cgroups::frames::CgroupRoot>,
    /// After the dump, before the processes run on, capture them again and
    /// compare with the image just written, attribute by attribute; any
    /// difference fails the checkpoint (the image is removed, the
    /// processes run on) naming the process, resource and attribute.
    #[arg(long)]
    pub verify: bool,
    #[command(flatten)]
    pub coop: CoopArgs,
    /// How progress is shown (set by the tools: a bar on a terminal, JSON
    /// lines with --json).
    #[arg(skip)]
    pub progress: Progress,
    /// Name of the network lock (nft table), so a caller can record it
    /// before it exists [default: `cr_lock_ROOT_MILLIS`].
    #[arg(skip)]
    pub lock_name: Option<String>,
}

/// What a checkpoint allows programs linked with libcr (`cr_checkpoint`,
/// `crctl checkpoint`).
#[derive(clap::Args, Debug, Clone, Default, PartialEq)]
pub struct CoopArgs {
    /// Programs linked with libcr: how long their checkpoint callbacks may
    /// run before the checkpoint fails naming the one still running (the
    /// processes run on) [default: 30s].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub callback_timeout: Option<std::time::Duration>,
    /// Programs linked with libcr: how long an open critical section
    /// (cr_enter_cs) may delay the checkpoint [default: 10s]; then it fails,
    /// or with --cs-proceed goes on.
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub cs_wait: Option<std::time::Duration>,
    /// Checkpoint programs whose critical sections are still open after
    /// --cs-wait instead of failing.
    #[arg(long)]
    pub cs_proceed: bool,
}

impl CheckpointOptions {
    pub fn action(&self) -> Action {
        if self.kill {
            Action::Kill
        } else if self.stop {
            Action::Stop
        } else {
            Action::Continue
        }
    }

    pub fn set_action(&mut self, a: Action) {
        self.kill = a == Action::Kill;
        self.stop = a == Action::Stop;
    }

    pub fn fsync(&self) -> bool {
        !self.no_fsync
    }

    /// Leave dirty tracking on (asked for, or implied by a pre-dump).
    pub fn track(&self) -> bool {
        self.track_mem || self.pre_dump
    }

    pub fn workers(&self) -> usize {
        workers(self.workers)
    }

    /// The image directory for a checkpoint of `pid`: `--dir`, else the
    /// directory its `cr_run` job was started with, else ./ckpt.PID.
    /// What the options say about programs linked with libcr.
    pub fn coop_limits(&self) -> crate::coop::Limits {
        crate::coop::Limits {
            callback_timeout: self
                .coop
                .callback_timeout
                .unwrap_or(crate::coop::CALLBACK_TIMEOUT),
            cs_wait: self.coop.cs_wait.unwrap_or(crate::coop::CS_WAIT),
            cs_proceed: self.coop.cs_proceed,
        }
    }

    pub fn image_dir(&self, pid: i32) -> PathBuf {
        self.dir
            .clone()
            .or_else(|| crate::capture::job_dir(pid))
            .unwrap_or_else(|| PathBuf::from(format!("ckpt.{pid}")))
    }
}

/// A size in bytes: a number with an optional K, M, G or T suffix (powers
/// of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, shift) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("{s:?} is not a size (e.g. 4096, 64M, 1G)")),
            };
            (&t[..i], shift)
        }
        _ => (t, 0),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .ok_or_else(|| format!("{s:?} is not a size (e.g. 4096, 64M, 1G)"))
}

/// A System V IPC key as `ipcs` prints it (0x hex) or in decimal.
pub fn parse_ipc_key(s: &str) -> Result<i32, String> {
    let bad = || format!("{s:?} is not an IPC key (0x1234abcd or a decimal number)");
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u32::from_str_radix(h, 16)
            .map(|k| k as i32)
            .map_err(|_| bad()),
        None => s.parse::<i32>().map_err(|_| bad()),
    }
}

/// `OLD=NEW`: an IP address of the image rewritten at restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddrRewrite {
    pub old: IpAddr,
    /// Only the endpoint with this port (`OLD:PORT=NEW`): the sockets of
    /// one migrated process among others that keep the old address.
    pub port: Option<u16>,
    pub new: IpAddr,
}

impl std::str::FromStr for AddrRewrite {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) = s
            .split_once('=')
            .ok_or_else(|| format!("--map-addr {s}: expected OLD=NEW or OLD:PORT=NEW"))?;
        let parse = |x: &str| {
            x.trim()
                .trim_matches(|c| c == '[' || c == ']')
                .parse::<IpAddr>()
                .map_err(|_| format!("--map-addr {s}: {x:?} is not an IP address"))
        };
        let (old, port) = match parse(a) {
            Ok(ip) => (ip, None),
            Err(e) => match a.trim().parse::<std::net::SocketAddr>() {
                Ok(sa) => (sa.ip(), Some(sa.port())),
                Err(_) => return Err(e),
            },
        };
        let new = parse(b)?;
        if old.is_ipv4() != new.is_ipv4() {
            return Err(format!(
                "--map-addr {s}: both addresses must be IPv4, or both IPv6"
            ));
        }
        Ok(AddrRewrite { old, port, new })
    }
}

impl std::fmt::Display for AddrRewrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.port {
            Some(p) => write!(f, "{}={}", std::net::SocketAddr::new(self.old, p), self.new),
            None => write!(f, "{}={}", self.old, self.new),
        }
    }
}

/// Options of a restore (`cr_restart`).
#[derive(Debug, Clone, clap::Args)]
pub struct RestoreOptions {
    /// The job was started from an interactive shell: it joins cr_restart's
    /// session, becomes the foreground job of its terminal, and its
    /// terminal settings come back.
    #[arg(long)]
    pub shell_job: bool,
    /// Threads filling memory [default: number of CPUs].
    #[arg(long)]
    pub workers: Option<usize>,
    /// Rewrite an IP address of the image's TCP and UDP sockets, on both
    /// the local and the remote end (repeatable), e.g. to restore on
    /// another host processes that talked over TCP: OLD=NEW.
    #[arg(long = "map-addr", value_name = "OLD=NEW")]
    pub map_addr: Vec<AddrRewrite>,
    /// For this many seconds after the restore, TCP connections ignore
    /// resets from their peers, so that peers restored one after the other
    /// (on other hosts) find each other; 0 turns the guard off.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    pub reset_guard: u32,
    /// TCP connections (established, half closed or being made) come back
    /// closed, as after a reset: reads give end-of-file, writes fail with
    /// EPIPE. For a restore where the peers are gone (a host no longer
    /// reachable, a peer not restored); listeners and UDP sockets are
    /// restored as usual.
    #[arg(long)]
    pub tcp_close: bool,
    /// Bind an fd that led outside the tree (a pipe or socket shared with
    /// a process outside, a terminal) to TARGET (repeatable). FD is `N`
    /// (fd N of every process where it led outside), `PID:N`, or the key
    /// the error message names (`pipe:[1234]`); TARGET is a path (opened
    /// with the fd's access mode, created if missing; a unix socket is
    /// connected to) or `fd:M`, this command's own fd M. Unbound, fds 0-2
    /// are cr_restart's own; others refuse the restore.
    #[arg(long = "inherit-fd", value_name = "FD=TARGET")]
    pub inherit_fd: Vec<InheritFd>,
    /// Bind every fd that led outside the tree and is not bound with
    /// --inherit-fd to /dev/null (fds 0-2 still default to cr_restart's).
    #[arg(long)]
    pub external_to_null: bool,
    /// Restore even if files outside the image that the processes use
    /// (open files, mappings, executables, working directories) changed
    /// since the checkpoint; each change is logged as a warning.
    #[arg(long)]
    pub allow_changed_files: bool,
    /// Before the restored tree runs, capture it again and compare it with
    /// the image, attribute by attribute (mappings, fds, credentials,
    /// scheduling, limits, signals...); any difference aborts the restore
    /// (nothing runs) naming the process, the resource and the attribute.
    #[arg(long)]
    pub verify: bool,
    /// Post-copy: the processes run as soon as everything but the contents
    /// of their private anonymous memory is restored; those pages are put
    /// in on first touch (userfaultfd) and pushed in the background. The
    /// restorer stays until every page is in; if it cannot put one in, the
    /// process is killed (the image stays intact).
    #[arg(long)]
    pub lazy_pages: bool,
    /// Where the processes' control groups go: `auto`, back into the saved
    /// groups when the root's group exists here, else under cr_restart's
    /// own; `here`, the root in cr_restart's groups and the groups below
    /// it made again under them (a job resumed in a new allocation);
    /// `off`, every process in cr_restart's groups.
    #[arg(
        long,
        alias = "manage-cgroups",
        value_enum,
        value_name = "MODE",
        default_value_t
    )]
    pub cgroups: crate::kinds::cgroups::CgroupMode,
    /// Put the job's groups under this group instead (CONTROLLERS:
    /// "memory", "cpu", "name=systemd"...; none: every hierarchy not named
    /// by another; repeatable): the job's frame (`cr_checkpoint
    /// --cgroup-root`, else the root process's group) is replaced by PATH,
    /// made if missing, the groups below it keep their paths below it.
    /// Ignored with `--cgroups off`.
    #[arg(long = "cgroup-root", value_name = "[CONTROLLERS:]PATH")]
    pub cgroup_root: Vec<crate::kinds::cgroups::frames::CgroupRoot>,
    /// Page stores still arriving from another node (set by the agent for
    /// a post-copy migration): their blocks are asked for before they are
    /// read ([`crate::kinds::memory::remote`]).
    #[arg(skip)]
    pub remote_pages: Option<std::sync::Arc<dyn crate::kinds::memory::remote::RemoteStores>>,
    /// The release does not tell the tree's libcr programs that they were
    /// restarted: the caller does ([`crate::coop::restarted`]) once the
    /// whole job is back (the agent, at the coordinator's JOBBACK).
    #[arg(skip)]
    pub restart_callbacks_later: bool,
    /// How progress is shown (set by the tools: a bar on a terminal, JSON
    /// lines with --json).
    #[arg(skip)]
    pub progress: Progress,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            shell_job: false,
            workers: None,
            map_addr: Vec::new(),
            reset_guard: 60,
            tcp_close: false,
            inherit_fd: Vec::new(),
            external_to_null: false,
            allow_changed_files: false,
            verify: false,
            lazy_pages: false,
            cgroups: Default::default(),
            cgroup_root: Vec::new(),
            remote_pages: None,
            restart_callbacks_later: false,
            progress: Progress::Off,
        }
    }
}

/// `FD=TARGET`: what an fd that led outside the tree is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InheritFd {
    pub which: ExternalFd,
    pub to: Binding,
}

/// Which external fds an `--inherit-fd` binds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExternalFd {
    /// Fd N of any process.
    Number(i32),
    /// Fd N of process PID (as the image names it).
    OfProcess(u32, i32),
    /// Every fd that led to this (`pipe:[1234]`, `socket:[99]`, `/dev/pts/3`).
    Key(String),
}

/// What an external fd becomes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Binding {
    Path(PathBuf),
    /// The restorer's own fd M.
    OwnFd(i32),
}

impl InheritFd {
    /// Whether this binds fd `fd` of process `pid`, which led to `key`.
    pub fn binds(&self, pid: u32, fd: i32, key: &str) -> bool {
        match &self.which {
            ExternalFd::Number(n) => *n == fd,
            ExternalFd::OfProcess(p, n) => *p == pid && *n == fd,
            ExternalFd::Key(k) => k == key,
        }
    }
}

impl std::str::FromStr for InheritFd {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, b) = s
            .split_once('=')
            .ok_or_else(|| format!("--inherit-fd {s}: expected FD=TARGET"))?;
        let num = |x: &str| x.parse::<i32>().ok().filter(|n| *n >= 0);
        let which = if let Some(n) = num(a) {
            ExternalFd::Number(n)
        } else if let Some((p, n)) = a
            .split_once(':')
            .and_then(|(p, n)| Some((p.parse::<u32>().ok()?, num(n)?)))
        {
            ExternalFd::OfProcess(p, n)
        } else if !a.is_empty() {
            ExternalFd::Key(a.to_string())
        } else {
            return Err(format!("--inherit-fd {s}: no fd before `=`"));
        };
        let to = match b.strip_prefix("fd:") {
            Some(m) => Binding::OwnFd(
                num(m).ok_or_else(|| format!("--inherit-fd {s}: {m:?} is not an fd number"))?,
            ),
            None if b.is_empty() => return Err(format!("--inherit-fd {s}: no target after `=`")),
            None => Binding::Path(PathBuf::from(b)),
        };
        Ok(InheritFd { which, to })
    }
}

impl std::fmt::Display for InheritFd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.which {
            ExternalFd::Number(n) => write!(f, "{n}")?,
            ExternalFd::OfProcess(p, n) => write!(f, "{p}:{n}")?,
            ExternalFd::Key(k) => write!(f, "{k}")?,
        }
        match &self.to {
            Binding::Path(p) => write!(f, "={}", p.display()),
            Binding::OwnFd(m) => write!(f, "=fd:{m}"),
        }
    }
}

impl RestoreOptions {
    pub fn workers(&self) -> usize {
        workers(self.workers)
    }
}

/// `n`, or one per CPU.
fn workers(n: Option<usize>) -> usize {
    n.filter(|&n| n > 0).unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    })
}
