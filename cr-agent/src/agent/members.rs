//! The job members this node hosts: process trees started by `cr_run
//! --job` or restored by the agent. Kept in `state_dir/members.json` so an
//! agent restart forgets none; a member whose process is gone (or whose
//! PID now names another process: start times differ) is dropped. Every
//! change bumps a generation number, so the coordinator can tell a stale
//! report from a fresh one.

use cr_rpc::pb::Member;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Mutex;

pub struct Members {
    path: PathBuf,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    generation: u64,
    list: Vec<Member>,
}

/// Start time of a process (clock ticks after boot), None if it is gone.
pub fn start_time(pid: i32) -> Option<u64> {
    let st = cr_sys::proc::stat(pid).ok()?;
    (st.state != 'Z' && st.state != 'X').then_some(st.starttime)
}

/// Real uid of a process and its command line (for listings).
pub fn describe(pid: i32) -> (u32, String) {
    let uid = cr_sys::proc::status(pid).map_or(0, |s| s.ruid);
    let cmd = cr_sys::proc::read_bytes(&format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|&c| c == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    (uid, cmd)
}

fn to_json(m: &Member) -> Value {
    json!({"job": m.job, "pid": m.pid, "uid": m.uid, "command": m.command,
           "start_time": m.start_time, "save_file": m.save_file})
}

fn from_json(v: &Value) -> Option<Member> {
    Some(Member {
        job: v.get("job")?.as_str()?.to_string(),
        pid: v.get("pid")?.as_i64()? as i32,
        uid: v.get("uid")?.as_u64()? as u32,
        command: v.get("command")?.as_str()?.to_string(),
        start_time: v.get("start_time")?.as_u64()?,
        rss: 0,
        save_file: v
            .get("save_file")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|f| f.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default(),
    })
}

impl Members {
    /// Load the saved members (those still alive).
    pub fn load(state_dir: &std::path::Path) -> Members {
        let path = state_dir.join("members.json");
        let list = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .and_then(|v| {
                v.as_array()
                    .map(|a| a.iter().filter_map(from_json).collect())
            })
            .unwrap_or_default();
        let m = Members {
            path,
            state: Mutex::new(State {
                generation: 1,
                list,
            }),
        };
        m.sweep();
        m
    }

    fn save(&self, st: &State) {
        let v = Value::Array(st.list.iter().map(to_json).collect());
        let tmp = self.path.with_extension("json.tmp");
        let r = std::fs::write(&tmp, v.to_string()).and_then(|_| std::fs::rename(&tmp, &self.path));
        if let Err(e) = r {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot save the job members");
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Add (or replace, by PID) a member.
    pub fn add(&self, m: Member) -> u64 {
        let mut st = self.lock();
        st.list.retain(|x| x.pid != m.pid);
        tracing::info!(job = m.job, pid = m.pid, "job member added");
        st.list.push(m);
        st.generation += 1;
        self.save(&st);
        st.generation
    }

    /// Drop members that are gone; true if any was.
    pub fn sweep(&self) -> bool {
        let mut st = self.lock();
        let before = st.list.len();
        st.list.retain(|m| {
            let alive = start_time(m.pid) == Some(m.start_time);
            if !alive {
                tracing::info!(job = m.job, pid = m.pid, "job member ended");
            }
            alive
        });
        let changed = st.list.len() != before;
        if changed {
            st.generation += 1;
            self.save(&st);
        }
        changed
    }

    /// Drop the members `pids` (killed, their exit still under way: not
    /// to be reported as running meanwhile).
    pub fn forget(&self, pids: &[i32]) {
        let mut st = self.lock();
        let before = st.list.len();
        st.list.retain(|m| !pids.contains(&m.pid));
        if st.list.len() != before {
            st.generation += 1;
            self.save(&st);
        }
    }

    /// The live members and the generation of this list.
    pub fn snapshot(&self) -> (Vec<Member>, u64) {
        let st = self.lock();
        (st.list.clone(), st.generation)
    }

    /// The member with this PID.
    pub fn get(&self, pid: i32) -> Option<Member> {
        self.lock().list.iter().find(|m| m.pid == pid).cloned()
    }
}
