//! `--verify`: a tree captured again, with the capture code of every kind
//! (`capture::capture_process` in its verifying mode: no page, no file
//! content, no queued data is read), and compared with its image attribute
//! by attribute; the first difference is reported in one line naming the
//! process, the resource and the attribute.
//!
//! `cr_restart --verify` runs it on the restored tree after every process
//! is rebuilt and before any runs (`restore::prepare`); `cr_checkpoint
//! --verify` on the tree after its dump, before it runs on
//! (`capture::checkpoint`). Each kind compares its own section
//! (`kinds::<kind>::verify`); what the kernel gives anew at a restore
//! (inode numbers of pipes and sockets, the time left on a timer) is not
//! compared, and the data inside objects (queues, file contents) is
//! checked by their checksums, not here.

use crate::capture::{capture_process, Dump};
use crate::error::CheckpointError;
use crate::kinds::fds::{Objects, TreeFds};
use crate::kinds::tree::Frozen;
use crate::kinds::{self, Stash};
use crate::options::CheckpointOptions;
use cr_image::model::{Checkpoint, DirtyMethod, Process};
use cr_image::ImageDir;
use std::collections::HashMap;
use std::fmt::Debug;
use std::time::{Duration, Instant};
use tracing::debug;

/// What the comparison of one process knows and finds.
pub struct Compare<'a> {
    /// The image's PID of the process compared (for messages).
    pub pid: u32,
    /// PIDs of the live tree -> PIDs of the image.
    pub pids: &'a HashMap<u32, u32>,
    /// The tree was restored from the image (registers went through the
    /// syscall-restart fix-ups), rather than checkpointed into it.
    pub restored: bool,
    /// The tree's root is PID 1 of its own namespace.
    pub pidns: bool,
    /// The process is the tree's root.
    pub root: bool,
    /// Its TCP connections were restored closed (`cr_restart --tcp-close`).
    pub tcp_closed: bool,
    /// The first difference, in words.
    first: Option<String>,
}

impl Compare<'_> {
    /// Whether `image` and `now` (attribute `attr` of `resource`) are equal;
    /// the first difference is kept.
    pub fn same<T: PartialEq + Debug + ?Sized>(
        &mut self,
        resource: &str,
        attr: &str,
        image: &T,
        now: &T,
    ) -> bool {
        let same = image == now;
        if !same && self.first.is_none() {
            self.first = Some(format!(
                "process {}: {resource}: {attr} is {now:?}, the image has {image:?}",
                self.pid
            ));
        }
        same
    }

    /// Whether lists `image` and `now` are equal; the first difference is
    /// kept, naming the first item that differs (not the whole lists).
    pub fn same_list<T: PartialEq + Debug>(
        &mut self,
        resource: &str,
        attr: &str,
        image: &[T],
        now: &[T],
    ) -> bool {
        if image == now {
            return true;
        }
        let at = image.iter().zip(now).take_while(|(a, b)| a == b).count();
        let what = match (image.get(at), now.get(at)) {
            (Some(a), Some(b)) => format!("{attr} #{at} is {b:?}, the image has {a:?}"),
            (Some(a), None) => format!("{attr} #{at} ({a:?}) is missing"),
            (None, Some(b)) => format!("{attr} #{at} ({b:?}) is not in the image"),
            (None, None) => format!("{attr} differ"),
        };
        self.differ(resource, what);
        false
    }

    /// A difference found otherwise (a missing or extra item).
    pub fn differ(&mut self, resource: &str, what: String) {
        if self.first.is_none() {
            self.first = Some(format!("process {}: {resource}: {what}", self.pid));
        }
    }

    /// A PID of the live tree as the image names it.
    pub fn image_pid(&self, now: u32) -> u32 {
        self.pids.get(&now).copied().unwrap_or(now)
    }

    /// Whether `pid` is the PID of a process of the image.
    pub fn is_image_pid(&self, pid: u32) -> bool {
        self.pids.values().any(|&p| p == pid)
    }

    pub fn found(&self) -> bool {
        self.first.is_some()
    }
}

/// What a verification found: the first difference (None: none) and its
/// cost.
pub struct Verdict {
    pub difference: Option<String>,
    pub elapsed: Duration,
}

/// Capture the frozen tree `procs` (in the image's order) again and
/// compare every live process with its image in `ck`. `dir` is the image's
/// directory (nothing is written there); `restored`: see [`Compare`].
pub fn tree(
    ck: &Checkpoint,
    procs: &mut [Frozen],
    dir: &ImageDir,
    restored: bool,
    tcp_closed: bool,
) -> Result<Verdict, CheckpointError> {
    let t0 = Instant::now();
    let pids: HashMap<u32, u32> = procs
        .iter()
        .zip(&ck.processes)
        .map(|(f, p)| (f.pid as u32, p.pid))
        .collect();
    let live: Vec<i32> = procs.iter().map(|f| f.pid).collect();
    let opts = CheckpointOptions::default();
    let mut fds = TreeFds::new(&live);
    fds.verifying = true;
    let mut d = Dump {
        opts: &opts,
        dir,
        store: None,
        parent: None,
        method: DirtyMethod::Full,
        image_id: &ck.meta.image_id,
        fds,
        objects: Objects::new(None, &ck.meta.image_id, false),
        stash: Stash::default(),
        read: 0,
        arena: None,
        early: None,
    };
    let mut difference = None;
    for (f, image) in procs.iter_mut().zip(&ck.processes) {
        if image.is_zombie() || f.zombie.is_some() {
            continue;
        }
        let now = capture_process(f, &mut d)?;
        let mut c = Compare {
            pid: image.pid,
            pids: &pids,
            restored,
            pidns: ck.pidns,
            root: image.pid == ck.root_pid,
            tcp_closed,
            first: None,
        };
        process(&mut c, image, &now);
        kinds::inet::verify(&mut c, ck, image, f.pid);
        kinds::tty::verify(&mut c, ck, image, f.pid);
        if c.first.is_some() {
            difference = c.first;
            break;
        }
    }
    if difference.is_none() {
        if let Some(root) = procs.first() {
            difference = kinds::cgroups::verify_ns(ck, root.pid)
                .or_else(|| kinds::netns::verify(ck, root.pid))
                .or_else(|| kinds::mounts::verify(ck, root.pid));
        }
    }
    let elapsed = t0.elapsed();
    debug!(
        processes = procs.len(),
        us = elapsed.as_micros() as u64,
        different = difference.is_some(),
        "tree verified against its image"
    );
    Ok(Verdict {
        difference,
        elapsed,
    })
}

/// Compare one process, kind by kind (the order of the capture).
fn process(c: &mut Compare<'_>, image: &Process, now: &Process) {
    kinds::tree::verify(c, image, now);
    kinds::threads::verify(c, image, now);
    kinds::signals::verify(c, image, now);
    kinds::timers::verify(c, image, now);
    kinds::identity::verify(c, image, now);
    kinds::task::verify(c, image, now);
    kinds::cgroups::verify(c, image, now);
    kinds::fds::verify(c, image, now);
    kinds::memory::verify(c, image, now);
}

#[cfg(test)]
mod tests {
    //! The comparison on its own: each kind reports what differs, by name.
    //! (The round-trip tests of every kind run `--verify` on real
    //! processes: `kinds::testkit`.)

    use super::*;
    use cr_image::model::{Fd, FdKind, Thread, Vma, VmaKind};

    /// A change made to a copy of a process.
    type Change = Box<dyn Fn(&mut Process)>;

    fn first(image: &Process, now: &Process, pidns: bool) -> Option<String> {
        let pids = HashMap::from([(now.pid, image.pid)]);
        let mut c = Compare {
            pid: image.pid,
            pids: &pids,
            restored: true,
            pidns,
            root: false,
            tcp_closed: false,
            first: None,
        };
        process(&mut c, image, now);
        c.first
    }

    fn vma(start: u64, end: u64, flags: &[&str]) -> Vma {
        Vma {
            start,
            end,
            prot: 3,
            shared: false,
            kind: VmaKind::AnonPrivate,
            pgoff: 0,
            path: String::new(),
            dev: 0,
            inode: 0,
            vm_flags: flags.iter().map(|f| f.to_string()).collect(),
            anon_name: String::new(),
            shm_owner: None,
            object: None,
            aio: None,
            guards: Vec::new(),
            huge_page_size: 0,
            relink: None,
        }
    }

    fn sample() -> Process {
        let mut p = Process {
            pid: 40,
            ..Default::default()
        };
        p.task.nice = 5;
        p.vmas = vec![vma(0x1000, 0x3000, &["rd", "wr"])];
        p.fds = vec![Fd {
            fd: 3,
            flags: 2,
            pos: 7,
            path: "/etc/hostname".into(),
            shared: None,
            locks: Vec::new(),
            owner: None,
            signal: 0,
            kind: FdKind::Regular {
                size: 9,
                relink: None,
            },
        }];
        p
    }

    #[test]
    fn equal_processes_have_no_difference() {
        assert_eq!(first(&sample(), &sample(), false), None);
    }

    #[test]
    fn each_difference_names_its_resource_and_attribute() {
        let image = sample();
        let cases: Vec<(&str, Change)> = vec![
            ("scheduling: nice", Box::new(|p| p.task.nice = 0)),
            (
                "task: oom_score_adj",
                Box::new(|p| p.task.oom_score_adj = 9),
            ),
            (
                "task: root directory",
                Box::new(|p| p.task.root = "/x".into()),
            ),
            (
                "fd 3 (/etc/hostname): offset",
                Box::new(|p| p.fds[0].pos = 0),
            ),
            (
                "fds: open fd #1",
                Box::new(|p| {
                    let mut f = p.fds[0].clone();
                    f.fd = 4;
                    p.fds.push(f)
                }),
            ),
            ("protection", Box::new(|p| p.vmas[0].prot = 1)),
            ("flags", Box::new(|p| p.vmas[0].vm_flags.push("dc".into()))),
            (
                "credentials: uids",
                Box::new(|p| p.identity.creds.uids[1] = 1),
            ),
        ];
        for (want, change) in cases {
            let mut now = image.clone();
            change(&mut now);
            let got = first(&image, &now, false).unwrap_or_default();
            assert!(
                got.starts_with("process 40: ") && got.contains(want),
                "{want}: {got}"
            );
        }
    }

    #[test]
    fn threads_are_compared_state_by_state() {
        let mut image = sample();
        image.threads = vec![Thread {
            tid: 40,
            ns_tid: 40,
            // Not inside a system call: the fix-ups leave them alone.
            regs: cr_image::model::GpRegs {
                orig_rax: u64::MAX,
                ..Default::default()
            },
            xstate: Vec::new(),
            rseq: None,
            clear_child_tid: 0,
            pdeathsig: 0,
            robust_list: 0,
            robust_list_len: 0,
            affinity: Vec::new(),
            sigmask: 0,
            pending: Vec::new(),
            sigaltstack: Default::default(),
            seccomp: Default::default(),
            comm: String::new(),
            timer_slack_ns: 0,
            ioprio: None,
            sched: None,
            cgroups: Vec::new(),
        }];
        let mut now = image.clone();
        now.threads[0].pdeathsig = 9;
        let got = first(&image, &now, false).unwrap_or_default();
        assert!(got.contains("thread 40: parent-death signal"), "{got}");
        let mut now = image.clone();
        now.threads[0].regs.rip = 0x1000;
        let got = first(&image, &now, false).unwrap_or_default();
        assert!(got.contains("thread 40: registers"), "{got}");
        // A bound thread (an unbound one is left where the restore puts it).
        image.threads[0].affinity = vec![0];
        let mut now = image.clone();
        now.threads[0].affinity = vec![1];
        let got = first(&image, &now, false).unwrap_or_default();
        assert!(got.contains("thread 40: CPU affinity"), "{got}");
        // Timer slack and I/O priority, when the image knows them.
        image.threads[0].timer_slack_ns = 50_000;
        image.threads[0].ioprio = Some(0);
        let mut now = image.clone();
        now.threads[0].timer_slack_ns = 61_000;
        let got = first(&image, &now, false).unwrap_or_default();
        assert!(got.contains("thread 40: timer slack"), "{got}");
        let mut now = image.clone();
        now.threads[0].ioprio = Some(3 << 13);
        let got = first(&image, &now, false).unwrap_or_default();
        assert!(got.contains("thread 40: I/O priority"), "{got}");
        // Each thread's scheduling, when the image knows it.
        image.threads[0].sched = Some(cr_image::model::Sched {
            policy: 3,
            priority: 0,
            nice: 5,
        });
        let mut now = image.clone();
        now.threads[0].sched = Some(cr_image::model::Sched {
            policy: 0,
            priority: 0,
            nice: 5,
        });
        let got = first(&image, &now, false).unwrap_or_default();
        assert!(got.contains("thread 40: scheduling"), "{got}");
    }

    #[test]
    fn neighbours_the_kernel_merges_count_as_one() {
        let mut image = sample();
        image.vmas = vec![vma(0x1000, 0x2000, &["rd"]), vma(0x2000, 0x3000, &["rd"])];
        let mut now = image.clone();
        now.vmas = vec![vma(0x1000, 0x3000, &["rd"])];
        assert_eq!(first(&image, &now, false), None);
        now.vmas = vec![
            vma(0x1000, 0x2000, &["rd"]),
            vma(0x2000, 0x3000, &["rd", "dc"]),
        ];
        let got = first(&image, &now, false).unwrap_or_default();
        assert!(got.contains("memory: mapping #0"), "{got}");
    }

    #[test]
    fn a_job_is_compared_by_its_ids_inside_its_namespace() {
        let mut image = sample();
        image.ns_pid = 1;
        let mut now = image.clone();
        now.pid = 5000; // another PID outside
        assert_eq!(first(&image, &now, true), None);
        now.ns_pid = 2;
        let got = first(&image, &now, true).unwrap_or_default();
        assert!(got.contains("pid in its namespace"), "{got}");
    }
}
