//! Section of kind "task": what a process is apart from its resources
//! (name, executable, working directory, umask, personality, command line,
//! scheduling, OOM score adjustment, child-subreaper and THP-disable).

use super::{pb, ser, Bad};

/// The flag sched_getscheduler adds to the policy.
pub const SCHED_RESET_ON_FORK: u32 = 0x4000_0000;
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Task {
    pub comm: String,
    /// /proc/PID/exe at checkpoint time.
    pub exe: String,
    pub cwd: String,
    #[serde(serialize_with = "ser::octal")]
    pub umask: u32,
    pub personality: u32,
    /// Raw /proc/PID/cmdline (informational: the real one is in memory).
    #[serde(serialize_with = "cmdline")]
    pub cmdline: Vec<u8>,
    /// GNU build id of the executable (empty when it has none).
    #[serde(serialize_with = "ser::hex_bytes")]
    pub exe_build_id: Vec<u8>,
    /// Scheduling of the main thread: policy (SCHED_*, with
    /// SCHED_RESET_ON_FORK), real-time priority, nice value.
    pub sched_policy: u32,
    pub sched_priority: u32,
    pub nice: i32,
    /// /proc/PID/oom_score_adj.
    pub oom_score_adj: i32,
    /// PR_SET_CHILD_SUBREAPER.
    pub child_subreaper: bool,
    /// PR_SET_THP_DISABLE.
    pub thp_disable: bool,
    /// Root directory (chroot; "/" or empty: the checkpointer's own).
    pub root: String,
    /// Timer slack of the main thread in ns (0: not known).
    pub timer_slack_ns: u64,
    /// ioprio_get() of the main thread (class << 13 | level; 0: never set).
    pub ioprio: u32,
    /// The membarrier REGISTER_* commands the process's memory is
    /// registered for (MEMBARRIER_CMD_GET_REGISTRATIONS; 0: none).
    pub membarrier: u32,
}

/// An I/O priority as ioprio_get answers it: classes none, real-time,
/// best-effort, idle; levels 0-7.
pub(crate) fn check_ioprio(prio: u32) -> Result<(), Bad> {
    if prio >> 13 > 3 || prio & 0x1fff > 7 {
        return Err(format!("unknown I/O priority {prio:#x}"));
    }
    Ok(())
}

fn cmdline<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeSeq;
    let text = String::from_utf8_lossy(v);
    let words: Vec<&str> = text.split('\0').filter(|w| !w.is_empty()).collect();
    let mut seq = s.serialize_seq(Some(words.len()))?;
    for w in words {
        seq.serialize_element(w)?;
    }
    seq.end()
}

/// The scheduling of one thread: policy (SCHED_*, with
/// SCHED_RESET_ON_FORK), real-time priority, nice value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Sched {
    pub policy: u32,
    pub priority: u32,
    pub nice: i32,
}

impl Sched {
    /// A policy the kernel knows, a real-time priority, a nice value.
    pub(crate) fn check(&self) -> Result<(), Bad> {
        let policy = self.policy & !SCHED_RESET_ON_FORK;
        if policy > 6 || policy == 4 {
            return Err(format!("unknown scheduling policy {:#x}", self.policy));
        }
        if self.priority > 99 {
            return Err(format!("real-time priority {} above 99", self.priority));
        }
        if !(-20..=19).contains(&self.nice) {
            return Err(format!("nice value {} outside -20..19", self.nice));
        }
        Ok(())
    }

    pub(crate) fn from_pb(s: pb::ThreadSched) -> Result<Sched, Bad> {
        let s = Sched {
            policy: s.policy,
            priority: s.priority,
            nice: s.nice,
        };
        s.check()?;
        Ok(s)
    }

    pub(crate) fn to_pb(self) -> pb::ThreadSched {
        pb::ThreadSched {
            policy: self.policy,
            priority: self.priority,
            nice: self.nice,
        }
    }
}

impl Task {
    /// The main thread's scheduling.
    pub fn sched(&self) -> Sched {
        Sched {
            policy: self.sched_policy,
            priority: self.sched_priority,
            nice: self.nice,
        }
    }

    pub(crate) fn from_pb(t: pb::Task) -> Result<Task, Bad> {
        Sched {
            policy: t.sched_policy,
            priority: t.sched_priority,
            nice: t.nice,
        }
        .check()?;
        check_ioprio(t.ioprio)?;
        if !(-1000..=1000).contains(&t.oom_score_adj) {
            return Err(format!(
                "oom_score_adj {} outside -1000..1000",
                t.oom_score_adj
            ));
        }
        Ok(Task {
            comm: t.comm,
            exe: t.exe,
            cwd: t.cwd,
            umask: t.umask,
            personality: t.personality,
            cmdline: t.cmdline,
            exe_build_id: t.exe_build_id,
            sched_policy: t.sched_policy,
            sched_priority: t.sched_priority,
            nice: t.nice,
            oom_score_adj: t.oom_score_adj,
            child_subreaper: t.child_subreaper,
            thp_disable: t.thp_disable,
            root: t.root,
            timer_slack_ns: t.timer_slack_ns,
            ioprio: t.ioprio,
            membarrier: t.membarrier,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::Task {
        pb::Task {
            comm: self.comm.clone(),
            exe: self.exe.clone(),
            cwd: self.cwd.clone(),
            umask: self.umask,
            personality: self.personality,
            cmdline: self.cmdline.clone(),
            exe_build_id: self.exe_build_id.clone(),
            sched_policy: self.sched_policy,
            sched_priority: self.sched_priority,
            nice: self.nice,
            oom_score_adj: self.oom_score_adj,
            child_subreaper: self.child_subreaper,
            thp_disable: self.thp_disable,
            root: self.root.clone(),
            timer_slack_ns: self.timer_slack_ns,
            ioprio: self.ioprio,
            membarrier: self.membarrier,
        }
    }
}
