//! `cr-bench coord`: the coordinator's own cost of a coordinated checkpoint
//! with many agents. The agents are in-process fakes that do no work:
//! agent i hosts one member whose two TCP connections go to agents i-1 and
//! i+1 (a ring), so CHECK matches one connection per agent (two bookmarks
//! each) on the PREPARE bookmarks and again on the images'. What is left is
//! the protocol itself: fan-outs, the cut check, and the catalog's durable
//! transactions (on a real disk, with fsync).

use crate::{fs_type_name, int_in, mkdtemp, DirGuard, Res};
use clap::Args;
use cr_coordinatord::{pb, AgentApi, AgentResult, Catalog, Coordinator, Settings};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The end of `cr-bench coord --help`: what the columns measure.
pub(crate) const PHASES: &str = "\
Phases, as seen by the agents (so with microsecond resolution):
  prepare  round start (busy check, id, `preparing` transaction) to the
           last PREPARE reply
  check    to the first DUMP call: cut check, `dumping` transaction
  dump     to the last DUMP reply
  commit   to the first FINISH call: cut check of the images, the commit
           transaction, Commit to every agent
  finish   to the end: FINISH to every agent, its transaction, retention";

/// `cr-bench coord`: the coordinator's protocol cost with simulated agents.
#[derive(Args)]
#[command(after_help = PHASES)]
pub struct Opts {
    /// Simulated agents, one job member each.
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = int_in::<usize>(1..))]
    agents: usize,
    /// Measured checkpoints, after one warm-up.
    #[arg(long, value_name = "R", default_value_t = 10, value_parser = int_in::<usize>(1..))]
    rounds: usize,
    /// Where the catalog goes: a fresh directory under it.
    #[arg(long, value_name = "DIR", default_value = "/var/tmp")]
    disk_base: PathBuf,
}

/// When the phases of the current round started and ended, as the agents saw them.
#[derive(Default, Clone, Copy)]
pub(crate) struct Marks {
    prepare_last: Option<Instant>,
    dump_first: Option<Instant>,
    dump_last: Option<Instant>,
    finish_first: Option<Instant>,
}

/// The ring of simulated agents: node `a{i}` hosts pid 1000+i, whose two
/// connections go to the members of `a{i-1}` and `a{i+1}` (addresses
/// ip(i)); what each agent answers, whatever carries the call (in-process
/// here, real gRPC in [`crate::coordinator`]).
pub(crate) struct Ring {
    n: usize,
    marks: Mutex<Marks>,
}

fn ip(i: usize) -> String {
    format!("10.{}.{}.{}", (i >> 16) & 255, (i >> 8) & 255, i & 255)
}

/// The index of node `a{i}`.
pub(crate) fn index(node: &str) -> usize {
    node[1..].parse().unwrap_or(0)
}

/// The name of node `i`.
pub(crate) fn node_name(i: usize) -> String {
    format!("a{i}")
}

/// The member that node `i` reports.
pub(crate) fn member(i: usize) -> pb::Member {
    pb::Member {
        job: JOB.into(),
        pid: 1000 + i as i32,
        uid: 0,
        command: "sim".into(),
        start_time: 1,
        ..Default::default()
    }
}

/// The job of the simulated agents.
pub(crate) const JOB: &str = "bench";

impl Ring {
    pub(crate) fn new(n: usize) -> Ring {
        Ring {
            n,
            marks: Mutex::new(Marks::default()),
        }
    }

    fn bookmarks(&self, i: usize) -> Vec<pb::Bookmark> {
        let next = (i + 1) % self.n;
        let prev = (i + self.n - 1) % self.n;
        let b = |local: String, remote: String| pb::Bookmark {
            local,
            remote,
            snd_una: 1000,
            snd_nxt: 1000,
            rcv_nxt: 1000,
            write_seq: 1000,
            pid: 1000 + i as i32,
        };
        vec![
            b(format!("{}:40000", ip(i)), format!("{}:5000", ip(next))),
            b(format!("{}:5000", ip(i)), format!("{}:40000", ip(prev))),
        ]
    }

    fn mark(&self, f: impl FnOnce(&mut Marks)) {
        f(&mut self.marks.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// FREEZE of node `i`: its one member frozen.
    pub(crate) fn freeze(&self, i: usize) -> pb::PrepareReply {
        let reply = pb::PrepareReply {
            bookmarks: self.bookmarks(i),
            processes: 1,
            threads: 1,
            ..Default::default()
        };
        self.mark(|m| m.prepare_last = Some(Instant::now()));
        reply
    }

    /// DUMP of node `i` in `session`: the image of its member.
    pub(crate) fn dump(&self, i: usize, session: &str) -> pb::DumpReply {
        let now = Instant::now();
        self.mark(|m| {
            m.dump_first.get_or_insert(now);
        });
        let node = node_name(i);
        let job = session.rsplit_once('-').map_or("", |(j, _)| j);
        let reply = pb::DumpReply {
            images: vec![pb::ImageInfo {
                pid: 1000 + i as i32,
                dir: format!("/images/{job}/{session}/{node}-{}", 1000 + i),
                node,
                processes: 1,
                page_bytes: 0,
                store_bytes: 0,
                frozen_ms: 0,
                bookmarks: self.bookmarks(i),
                command: "sim".into(),
                uid: 0,
                replicas: Vec::new(),
            }],
            gone: vec![],
        };
        self.mark(|m| m.dump_last = Some(Instant::now()));
        reply
    }

    /// FINISH of any node.
    pub(crate) fn finish(&self) -> pb::FinishReply {
        let now = Instant::now();
        self.mark(|m| {
            m.finish_first.get_or_insert(now);
        });
        pb::FinishReply::default()
    }

    /// A new round starts: forget the last one's marks.
    pub(crate) fn reset(&self) {
        self.mark(|m| *m = Marks::default());
    }

    /// The phases of the round that started at `t0` and ended at `end`
    /// with `info`, which must hold every agent's image and connection.
    pub(crate) fn round(&self, t0: Instant, end: Instant, info: &pb::CheckpointInfo) -> Res<Round> {
        if info.images.len() != self.n || info.connections as usize != self.n {
            return Err(format!(
                "checkpoint {}: {} images and {} connections, expected {} of each",
                info.id,
                info.images.len(),
                info.connections,
                self.n
            ));
        }
        let m = *self.marks.lock().unwrap_or_else(|p| p.into_inner());
        let (Some(pl), Some(df), Some(dl), Some(ff)) =
            (m.prepare_last, m.dump_first, m.dump_last, m.finish_first)
        else {
            return Err("a phase was not seen by the agents".into());
        };
        let s = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
        Ok(Round {
            prepare: s(t0, pl),
            check: s(pl, df),
            dump: s(df, dl),
            commit: s(dl, ff),
            finish: s(ff, end),
            total: s(t0, end),
        })
    }
}

#[cr_coordinatord::async_trait]
impl AgentApi for Ring {
    /// The callbacks (no member uses libcr here).
    async fn prepare(&self, _: &str, _: pb::PrepareRequest) -> AgentResult<pb::PrepareReply> {
        Ok(pb::PrepareReply::default())
    }
    /// One member per node.
    async fn freeze(&self, node: &str, _: pb::SessionRequest) -> AgentResult<pb::PrepareReply> {
        Ok(Ring::freeze(self, index(node)))
    }
    async fn dump(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::DumpReply> {
        Ok(Ring::dump(self, index(node), &req.session))
    }
    async fn abort(&self, _: &str, _: pb::SessionRequest) -> AgentResult<pb::Empty> {
        Ok(pb::Empty {})
    }
    async fn finish(&self, _: &str, _: pb::FinishRequest) -> AgentResult<pb::FinishReply> {
        Ok(Ring::finish(self))
    }
    async fn restore(&self, node: &str, _: pb::RestoreRequest) -> AgentResult<pb::RestoreReply> {
        Err(format!("{node}: restore is not simulated"))
    }
    async fn release(&self, node: &str, _: pb::SessionRequest) -> AgentResult<pb::ReleaseReply> {
        Err(format!("{node}: release is not simulated"))
    }
    async fn job_back(&self, node: &str, _: pb::SessionRequest) -> AgentResult<pb::Empty> {
        Err(format!("{node}: job back is not simulated"))
    }
    async fn remove(&self, _: &str, _: pb::RemoveRequest) -> AgentResult<pb::Empty> {
        Ok(pb::Empty {})
    }
    async fn unlock(&self, _: &str, _: pb::RemoveRequest) -> AgentResult<pb::Empty> {
        Ok(pb::Empty {})
    }
}

/// A phase's name and where a round keeps its time.
type Phase = (&'static str, fn(&Round) -> f64);

/// Phase times of one round, in seconds.
#[derive(Clone, Copy, Default)]
pub(crate) struct Round {
    prepare: f64,
    check: f64,
    dump: f64,
    commit: f64,
    finish: f64,
    pub(crate) total: f64,
}

async fn one_round(coord: &Coordinator, ring: &Ring) -> Res<Round> {
    ring.reset();
    let t0 = Instant::now();
    let info = coord
        .checkpoint(JOB, pb::After::Continue, None)
        .await
        .map_err(|e| e.to_string())?;
    ring.round(t0, Instant::now(), &info)
}

async fn bench(o: &Opts, db: &Path) -> Res<Vec<Round>> {
    let catalog = Arc::new(Catalog::open(db).map_err(|e| e.to_string())?);
    let ring = Arc::new(Ring::new(o.agents));
    let settings = Settings {
        heartbeat_ms: 1000,
        node_timeout: Duration::from_secs(3600),
        timeout: Duration::from_secs(600),
        freeze_timeout: Duration::from_secs(600),
        ..Default::default()
    };
    let coord = Arc::new(Coordinator::new(catalog, ring.clone(), settings));
    eprintln!("cr-bench coord: registering {} agents ...", o.agents);
    for i in 0..o.agents {
        coord
            .register(pb::RegisterRequest {
                node: node_name(i),
                agent_addr: format!("{}:7171", ip(i)),
                addresses: vec![ip(i)],
                version: "sim".into(),
                members: vec![member(i)],
                generation: 1,
                ..Default::default()
            })
            .await
            .map_err(|e| e.to_string())?;
    }
    eprintln!("cr-bench coord: warm-up round ...");
    one_round(&coord, &ring).await?;
    let mut rounds = Vec::with_capacity(o.rounds);
    for r in 0..o.rounds {
        crate::check_interrupted()?;
        let x = one_round(&coord, &ring).await?;
        eprintln!(
            "cr-bench coord: round {}/{}: {:.2} ms",
            r + 1,
            o.rounds,
            x.total * 1e3
        );
        rounds.push(x);
    }
    Ok(rounds)
}

/// Mean, min and max of `v` (seconds), in ms.
pub(crate) fn stats(v: impl Iterator<Item = f64>) -> (f64, f64, f64) {
    let v: Vec<f64> = v.collect();
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(0.0, f64::max);
    (mean * 1e3, min * 1e3, max * 1e3)
}

/// `cr-bench coord [--agents N] [--rounds R] [--disk-base DIR]`.
pub fn run(o: Opts) -> Res<()> {
    crate::install_signal_handlers();
    let dir = mkdtemp(&o.disk_base.join("cr-bench-coord."))?;
    let _guard = DirGuard(dir.clone());
    let fs = fs_type_name(&dir);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("tokio runtime: {e}"))?;
    let rounds = rt.block_on(bench(&o, &dir.join("catalog.redb")))?;

    println!("# cr-bench coord\n");
    println!(
        "{} simulated agents, 1 member each, {} connections ({} bookmarks) in a ring; \
         {} rounds after a warm-up; catalog on {} ({fs}); {} CPUs.\n",
        o.agents,
        o.agents,
        2 * o.agents,
        o.rounds,
        o.disk_base.display(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    print_rounds(o.agents, &rounds);
    Ok(())
}

/// The tables of `rounds` with `agents` agents: means per phase, then each
/// phase's mean, min and max.
pub(crate) fn print_rounds(agents: usize, rounds: &[Round]) {
    println!("| agents | rounds | ms/round | prepare | check | dump | commit | finish |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mean = |f: fn(&Round) -> f64| stats(rounds.iter().map(f)).0;
    println!(
        "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
        agents,
        rounds.len(),
        mean(|r| r.total),
        mean(|r| r.prepare),
        mean(|r| r.check),
        mean(|r| r.dump),
        mean(|r| r.commit),
        mean(|r| r.finish),
    );
    println!("\n| phase | mean ms | min ms | max ms |");
    println!("|---|---:|---:|---:|");
    let phases: [Phase; 6] = [
        ("prepare", |r| r.prepare),
        ("check", |r| r.check),
        ("dump", |r| r.dump),
        ("commit", |r| r.commit),
        ("finish", |r| r.finish),
        ("round", |r| r.total),
    ];
    for (name, f) in phases {
        let (mean, min, max) = stats(rounds.iter().map(f));
        println!("| {name} | {mean:.2} | {min:.2} | {max:.2} |");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{assert_refused, parsed};

    #[test]
    fn command_lines() {
        let o = parsed::<Opts>("coord");
        assert_eq!((o.agents, o.rounds), (1000, 10));
        assert_eq!(o.disk_base, Path::new("/var/tmp"));
        let o = parsed::<Opts>("coord --agents 10 --rounds 2 --disk-base /srv");
        assert_eq!((o.agents, o.rounds), (10, 2));
        assert_eq!(o.disk_base, Path::new("/srv"));
        assert_refused(&["coord --agents 0", "coord --rounds 0"]);
    }
}
