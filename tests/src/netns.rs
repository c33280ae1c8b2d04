//! Network namespaces for the socket tests, made with ip(8).
//!
//! A [`Netns`] is a named namespace (`ip netns add`, so it lives under
//! `/run/netns/NAME`) with `lo` up; dropping it runs `ip netns del` (also while
//! a test panics). Names are unique per test process and per namespace
//! (`crtest<pid>x<n>-<tag>`); namespaces left behind by a test process that was
//! killed are removed the next time one is created. [`link`] joins two
//! namespaces with a veth pair and gives each end its addresses. Nothing is
//! ever configured outside the namespaces the tests create.
//!
//! [`Netns::run`] / [`Netns::connect_tcp`] let the test process itself act
//! inside a namespace: a helper thread `setns(CLONE_NEWNET)`s into it (the
//! network namespace is per thread), creates the socket (which stays in that
//! namespace wherever it is used from) and hands it back.

use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Prefix of every namespace name the tests create.
const PREFIX: &str = "crtest";

static NS_SEQ: AtomicU32 = AtomicU32::new(0);

/// Runs `ip ARGS...`, panicking with its output if it fails.
pub fn ip(args: &[&str]) {
    let out = ip_output(args);
    assert!(
        out.status.success(),
        "ip {} failed ({}): {}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `ip ARGS...` and returns its output, whatever the status.
pub fn ip_output(args: &[&str]) -> std::process::Output {
    Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run ip(8) (install iproute2): {e}"))
}

/// Removes namespaces named `crtest<pid>x...` whose test process is gone.
fn remove_stale() {
    let Ok(rd) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let Some((pid, _)) = rest.split_once('x') else {
            continue;
        };
        let Ok(pid) = pid.parse::<i32>() else {
            continue;
        };
        if pid > 0 && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip_output(&["netns", "del", &name]);
        }
    }
}

/// A network namespace created for one test; deleted on drop.
pub struct Netns {
    pub name: String,
    deleted: bool,
}

impl Netns {
    /// `ip netns add crtest<pid>x<n>-TAG` and `lo` up in it.
    pub fn new(tag: &str) -> Netns {
        remove_stale();
        let name = format!(
            "{PREFIX}{}x{}-{tag}",
            std::process::id(),
            NS_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        ip(&["netns", "add", &name]);
        let ns = Netns {
            name,
            deleted: false,
        };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// `/run/netns/NAME`.
    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// `ip -n NAME ARGS...` (panics if it fails).
    pub fn ip(&self, args: &[&str]) {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        ip(&all);
    }

    /// `ip -n NAME ARGS...`, its stdout (panics if it fails).
    pub fn ip_text(&self, args: &[&str]) -> String {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        let out = ip_output(&all);
        assert!(
            out.status.success(),
            "ip {} failed: {}",
            all.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Adds `cidr` (e.g. `10.77.1.1/24`, `fd77::1/64`) to `dev` and sets it up.
    /// IPv6 addresses get `nodad`, so they are usable at once.
    pub fn add_addr(&self, dev: &str, cidr: &str) {
        if cidr.contains(':') {
            self.ip(&["addr", "add", cidr, "dev", dev, "nodad"]);
        } else {
            self.ip(&["addr", "add", cidr, "dev", dev]);
        }
        self.ip(&["link", "set", dev, "up"]);
    }

    /// Runs `f` on a thread whose network namespace is this one, returns its result.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = self.path();
        std::thread::spawn(move || {
            enter(&path);
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }

    /// A TCP connection to `addr` made inside this namespace (retried on
    /// ECONNREFUSED until `timeout`).
    pub fn connect_tcp(&self, addr: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
        self.run(move || {
            let deadline = Instant::now() + timeout;
            loop {
                match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
                    Err(e)
                        if e.kind() == std::io::ErrorKind::ConnectionRefused
                            && Instant::now() < deadline =>
                    {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    r => return r,
                }
            }
        })
    }

    /// `ip netns del` now (also done on drop), e.g. to make a node disappear.
    pub fn delete(&mut self) {
        if !self.deleted {
            self.deleted = true;
            ip(&["netns", "del", &self.name]);
        }
    }

    /// Sockets (`ss -tuanoi`) and nft rules of the namespace, for messages.
    pub fn diag(&self) -> String {
        let run = |args: &[&str]| {
            let out = Command::new("ip")
                .args(["netns", "exec", &self.name])
                .args(args)
                .stdin(Stdio::null())
                .output();
            match out {
                Ok(o) => format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ),
                Err(e) => format!("{args:?}: {e}\n"),
            }
        };
        if self.deleted {
            return format!("--- netns {}: deleted\n", self.name);
        }
        format!(
            "--- netns {}: ss -tuanoi\n{}--- nft list ruleset\n{}",
            self.name,
            run(&["ss", "-tuanoi"]),
            run(&["nft", "list", "ruleset"])
        )
    }

    /// True if `/run/netns/NAME` exists.
    pub fn exists(&self) -> bool {
        self.path().exists()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if !self.deleted {
            self.deleted = true;
            let _ = ip_output(&["netns", "del", &self.name]);
        }
    }
}

/// Moves the calling thread into the network namespace at `path`.
pub fn enter(path: &std::path::Path) {
    let f = std::fs::File::open(path)
        .unwrap_or_else(|e| panic!("open network namespace {}: {e}", path.display()));
    // SAFETY: setns on an fd we own; it only changes this thread's namespace.
    let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(
        r,
        0,
        "setns({}): {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

/// Joins `a` and `b` with a veth pair (`veth-a` in a, `veth-b` in b, created
/// in `a` then one end moved) and adds `a_addrs` / `b_addrs` (CIDR) to the ends.
/// The pair disappears with either namespace. Returns the device names.
pub fn link(a: &Netns, a_addrs: &[&str], b: &Netns, b_addrs: &[&str]) -> (String, String) {
    let (da, db) = ("veth-a".to_string(), "veth-b".to_string());
    a.ip(&["link", "add", &da, "type", "veth", "peer", "name", &db]);
    a.ip(&["link", "set", &db, "netns", &b.name]);
    a.ip(&["link", "set", &da, "up"]);
    b.ip(&["link", "set", &db, "up"]);
    for c in a_addrs {
        a.add_addr(&da, c);
    }
    for c in b_addrs {
        b.add_addr(&db, c);
    }
    (da, db)
}
