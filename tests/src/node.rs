//! A test node's own host name and file system view: the UTS and mount
//! namespaces of one node of a [`crate::cluster::Cluster`], next to its
//! network namespace ([`crate::netns::Netns`]).
//!
//! With only a network namespace, every "node" would share the test's host
//! name and its /dev/shm: MPI runtimes then take ranks on different nodes
//! for local peers (shared memory between them). A [`NodeNs`] is a holder
//! process started by the harness in the node's network namespace with
//! `unshare --uts --mount --propagation private`; it sets the host name to
//! the node's name, mounts a tmpfs of its own on /dev/shm and a node-private
//! tmpfs on the node's root directory (empty, mode 0700, seen from anywhere
//! else: a local disk of the node, e.g. its image root) and the cluster's
//! hosts file on /etc/hosts (node names resolve, as a cluster's DNS would
//! make them), then sleeps.
//! Everything of the node (agents, cr_run, commands) is started with
//! `nsenter -t HOLDER -n -u -m`, so it sees the node's network, host name
//! and mounts; the rest of the file system (the harness directory) is shared
//! by all nodes, as a cluster file system would be.
//!
//! The holder also drops its copies of /run/netns's bind mounts, so that
//! the network namespaces of other tests are not kept alive by it. Dropping
//! a [`NodeNs`] kills the holder by PID; the namespaces go with the last
//! process in them (the cluster kills whatever is left in its nodes).

use crate::{read_text, wait_until, Proc};
use std::ffi::OsString;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Deadline for a holder to set its namespaces up.
const SETUP_TIMEOUT: Duration = Duration::from_secs(20);

/// The holder's set-up, run by `sh -c` in the new namespaces (`$1`: host
/// name, `$2`: the node's private directory, `$3`: the cluster's hosts
/// file). It prints `ready` last.
const SETUP: &str = r#"set -e
hostname "$1"
mount -t tmpfs -o mode=1777,size=4g cr-node-shm /dev/shm
mount -t tmpfs -o mode=0700,size=8g cr-node-root "$2"
mount --bind "$3" /etc/hosts
# Copies of other tests' network namespaces (bind mounts under /run/netns)
# would keep them alive as long as this node lives. A test running beside
# this one may remove its namespace while ours is copied: umount -R then
# fails on that gone entry, and the lazy umount of the top one still does.
if mountpoint -q /run/netns; then umount -R -l /run/netns 2>/dev/null || umount -l /run/netns || true; fi
for m in $(awk '$2 ~ "^/run/netns/" {print $2}' /proc/self/mounts); do umount -l "$m" || true; done
echo ready
exec sleep infinity
"#;

/// The UTS and mount namespaces of a node, held by a process (see the
/// module docs).
pub struct NodeNs {
    /// The node's host name.
    pub hostname: String,
    /// The node-private directory (a tmpfs in the node's mount namespace).
    pub root: PathBuf,
    holder: Proc,
}

impl NodeNs {
    /// Starts the holder in the network namespace `netns` (a path such as
    /// `/run/netns/NAME`) with host name `hostname` and private directory
    /// `root` (created here, mode 0700) and hosts file `hosts`, and waits
    /// until it is set up. `log`: the holder's output (its `ready` line, or
    /// why it failed).
    pub fn new(netns: &Path, hostname: &str, root: &Path, hosts: &Path, log: &Path) -> NodeNs {
        std::fs::create_dir_all(root).unwrap_or_else(|e| panic!("mkdir {}: {e}", root.display()));
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))
                .unwrap_or_else(|e| panic!("chmod {}: {e}", root.display()));
        }
        let out = File::create(log).unwrap_or_else(|e| panic!("create {}: {e}", log.display()));
        let err = out.try_clone().expect("dup the holder's log");
        let mut cmd = Command::new(crate::cluster::nsenter());
        cmd.arg(format!("--net={}", netns.display()))
            .args([
                "--",
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
            ])
            .args(["--", "sh", "-c", SETUP, "cr-node"])
            .arg(hostname)
            .arg(root)
            .arg(hosts)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        crate::isolate_fds(&mut cmd, &[]);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("start the holder of node {hostname}: {e}"));
        // nsenter, unshare and sh all exec: the holder keeps the child's PID.
        let mut holder = Proc::from_child(child, &format!("namespace holder of {hostname}"));
        wait_until(
            &format!("the namespaces of node {hostname} to be set up"),
            SETUP_TIMEOUT,
            || {
                if let Some(st) = holder.try_exit() {
                    panic!(
                        "the holder of node {hostname} exited ({}): {}",
                        crate::status_str(st),
                        read_text(log)
                    );
                }
                read_text(log).lines().any(|l| l == "ready")
            },
            || read_text(log),
        );
        NodeNs {
            hostname: hostname.to_string(),
            root: root.to_path_buf(),
            holder,
        }
    }

    /// The holder's PID.
    pub fn pid(&self) -> i32 {
        self.holder.pid
    }

    /// nsenter(1)'s arguments that enter the node's network, UTS and mount
    /// namespaces (before `--`), with working directory `cwd` (entering a
    /// mount namespace moves to its root otherwise).
    pub fn nsenter_args(&self, cwd: &Path) -> Vec<OsString> {
        let mut wd = OsString::from("--wd=");
        wd.push(cwd);
        vec![
            "-t".into(),
            self.holder.pid.to_string().into(),
            "-n".into(),
            "-u".into(),
            "-m".into(),
            wd,
        ]
    }

    /// The inode of a namespace of the holder (`uts`, `mnt`).
    pub fn ns_inode(&self, kind: &str) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(format!("/proc/{}/ns/{kind}", self.holder.pid))
            .ok()
            .map(|m| m.ino())
    }
}

impl Drop for NodeNs {
    fn drop(&mut self) {
        self.holder.kill_and_reap();
    }
}
