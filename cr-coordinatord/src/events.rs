//! What happens, as it happens: the events `crctl watch` streams
//! (`Coordinator.Watch`), and the migrations and drains in progress that
//! `crctl status` shows.
//!
//! Every event goes to one broadcast channel, [`BUFFER`] events deep.
//! Sending never waits: a slow watcher never holds the coordinator up. A
//! watcher that falls more than the buffer behind gets one `lagged` event
//! saying how many it missed, then the newest ones.
//!
//! While a migration of job J is in progress, the phases of J's checkpoint
//! and restart are the migration's phases (kind `migration`, with its
//! [`pb::MigrationProgress`]): a watcher sees one story from `started` to
//! `done`, `failed` or `rolled back`. The bytes of a copy in progress come
//! with the target agents' heartbeats ([`pb::TransferProgress`]), so a
//! copy shorter than a heartbeat period shows only when it ends.

use crate::coordinator::{now_unix_ms, Coordinator};
use cr_rpc::pb;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;

/// Events a watcher may fall behind before it misses some.
pub const BUFFER: usize = 1024;

/// A migration in progress, with what its figures are made of.
struct Migration {
    info: pb::MigrationProgress,
    t0: Instant,
    /// Bytes of the copies that ended.
    base: u64,
    /// Copies in progress, by target node: (bytes, total, elapsed ms).
    inflight: HashMap<String, (u64, u64, u64)>,
    /// When the last pre-copy round and the one before started.
    round_at: Option<Instant>,
    prev_round_at: Option<Instant>,
}

impl Migration {
    fn refresh(&mut self) {
        let i = &mut self.info;
        i.elapsed_ms = self.t0.elapsed().as_millis() as u64;
        let (bytes, total, ms) = self
            .inflight
            .values()
            .fold((0, 0, 0), |(b, t, m), (b2, t2, m2)| {
                (b + b2, t + t2, m.max(*m2))
            });
        i.bytes_sent = self.base + bytes;
        i.copy_bytes = bytes;
        i.copy_total = total;
        if ms > 0 && bytes > 0 {
            i.rate = bytes * 1000 / ms;
            i.eta_ms = total.saturating_sub(bytes) * 1000 / i.rate.max(1);
        } else {
            i.eta_ms = 0;
        }
    }
}

/// The coordinator's events and what is in progress.
pub struct Events {
    tx: broadcast::Sender<pb::Event>,
    migrations: Mutex<BTreeMap<String, Migration>>,
    drains: Mutex<BTreeMap<String, pb::DrainProgress>>,
}

impl Default for Events {
    fn default() -> Self {
        Events {
            tx: broadcast::channel(BUFFER).0,
            migrations: Mutex::default(),
            drains: Mutex::default(),
        }
    }
}

/// `n` bytes for people.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// One line saying where migration `i` is.
fn migration_text(i: &pb::MigrationProgress) -> String {
    let mut t = format!(
        "migration of {} ({}): {}",
        i.job,
        i.moves.join(", "),
        i.phase
    );
    match i.phase.as_str() {
        "failed" | "rolled back" => t += &format!(": {}", i.error),
        "done" => {
            t += &format!(
                ": down {} ms, {} sent in {:.1} s",
                i.downtime_ms,
                bytes(i.bytes_sent),
                i.elapsed_ms as f64 / 1000.0
            );
            return t;
        }
        _ => {}
    }
    if i.bytes_sent > 0 {
        t += &format!(", {} sent", bytes(i.bytes_sent));
    }
    // The rates belong to the copies and rounds, not to the other phases.
    let copying = i.copy_total > 0 || i.phase.starts_with("pre-copy") || i.phase == "copied";
    if !copying {
        return t;
    }
    if i.copy_total > 0 {
        t += &format!(" (copy {} of {})", bytes(i.copy_bytes), bytes(i.copy_total));
    }
    if i.rate > 0 {
        t += &format!(", {}/s", bytes(i.rate));
    }
    if i.dirty_rate > 0 {
        t += &format!(", dirty {}/s", bytes(i.dirty_rate));
    }
    if i.eta_ms > 0 {
        t += &format!(", {:.1} s left", i.eta_ms as f64 / 1000.0);
    }
    t
}

/// One line saying where drain `d` is.
fn drain_text(d: &pb::DrainProgress) -> String {
    format!(
        "drain of {}: {} of {} jobs moved off, {} failed, {} left to their batch system",
        d.node, d.moved, d.jobs, d.failed, d.left
    )
}

impl Events {
    /// Send `ev` to every watcher (stamped now); never waits.
    pub fn emit(&self, mut ev: pb::Event) {
        ev.unix_ms = now_unix_ms();
        tracing::debug!(kind = ev.kind, phase = ev.phase, "{}", ev.text);
        // No watcher: nobody to tell.
        let _ = self.tx.send(ev);
    }

    /// A new watcher's receiver: the events from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<pb::Event> {
        self.tx.subscribe()
    }

    fn simple(&self, kind: &str, job: &str, node: &str, phase: &str, id: &str, text: String) {
        self.emit(pb::Event {
            kind: kind.into(),
            job: job.into(),
            node: node.into(),
            phase: phase.into(),
            id: id.into(),
            text,
            ..Default::default()
        });
    }

    // ------------------------------------------------------------ nodes

    pub fn node(&self, node: &str, phase: &str, why: &str) {
        let text = if why.is_empty() {
            format!("node {node} is {phase}")
        } else {
            format!("node {node} is {phase} ({why})")
        };
        self.simple("node", "", node, phase, "", text);
    }

    // ------------------------------------------- checkpoints and restarts

    /// A checkpoint's or restart's phase (`what`: "checkpoint J-3",
    /// "restart of J from J-3"); a migration's phase while `job` migrates.
    pub fn op_phase(&self, kind: &str, job: &str, id: &str, what: &str, phase: &str) {
        if self.migration_phase(job, id, phase) {
            return;
        }
        self.simple(kind, job, "", phase, id, format!("{what}: {phase}"));
    }

    /// The end of a checkpoint or restart (`phase` "committed", "aborted",
    /// "done", "failed"), unless `job` migrates (its migration says).
    pub fn op_end(&self, kind: &str, job: &str, id: &str, phase: &str, text: String) {
        if self.is_migrating(job) {
            return;
        }
        self.simple(kind, job, "", phase, id, text);
    }

    // ------------------------------------------------------- migrations

    fn is_migrating(&self, job: &str) -> bool {
        self.migrations
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(job)
    }

    /// Tell the watchers where `m` is; the event's phase is `phase`, else
    /// the migration's.
    fn migration_event(&self, m: &mut Migration, phase: Option<&str>) {
        m.refresh();
        let info = m.info.clone();
        self.emit(pb::Event {
            kind: "migration".into(),
            job: info.job.clone(),
            phase: phase.unwrap_or(&info.phase).to_string(),
            id: info.checkpoint.clone(),
            text: migration_text(&info),
            migration: Some(info),
            ..Default::default()
        });
    }

    /// Change migration `job` with `f` and tell the watchers (the event's
    /// phase: what `f` returns, else the migration's); false when no
    /// migration of `job` is in progress.
    fn with_migration(
        &self,
        job: &str,
        f: impl FnOnce(&mut Migration) -> Option<&'static str>,
    ) -> bool {
        let mut all = self.migrations.lock().unwrap_or_else(|p| p.into_inner());
        let Some(m) = all.get_mut(job) else {
            return false;
        };
        let phase = f(m);
        self.migration_event(m, phase);
        true
    }

    /// A migration of `job` starts (`moves`: NODE:PID=TARGET).
    pub fn migration_started(&self, job: &str, moves: &[String], pre_copy: bool, lazy: bool) {
        let mut m = Migration {
            info: pb::MigrationProgress {
                job: job.into(),
                moves: moves.to_vec(),
                phase: "started".into(),
                pre_copy,
                lazy,
                started_unix_ms: now_unix_ms(),
                ..Default::default()
            },
            t0: Instant::now(),
            base: 0,
            inflight: HashMap::new(),
            round_at: None,
            prev_round_at: None,
        };
        self.migration_event(&mut m, None);
        self.migrations
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(job.into(), m);
    }

    fn migration_phase(&self, job: &str, id: &str, phase: &str) -> bool {
        self.with_migration(job, |m| {
            if !id.is_empty() && !id.contains("-restart-") {
                m.info.checkpoint = id.into();
            }
            if phase.starts_with("pre-copy round") {
                m.prev_round_at = m.round_at.replace(Instant::now());
            }
            m.info.phase = phase.into();
            None
        })
    }

    /// Pre-copy round `round` of `job` wrote `written` bytes; `fetched`:
    /// bytes its targets copied by now, all rounds.
    pub fn pre_copy_round(&self, job: &str, round: u32, written: u64, fetched: u64) {
        self.with_migration(job, |m| {
            // What this round wrote was dirtied since the round before
            // started (round 1 writes the whole memory: no rate).
            if let (true, Some(at), Some(prev)) = (round > 1, m.round_at, m.prev_round_at) {
                let ms = at.saturating_duration_since(prev).as_millis().max(1) as u64;
                m.info.dirty_rate = written * 1000 / ms;
            }
            if let Some(at) = m.round_at {
                let ms = at.elapsed().as_millis().max(1) as u64;
                let sent = fetched.saturating_sub(m.base);
                if sent > 0 {
                    m.info.rate = sent * 1000 / ms;
                }
            }
            m.info.rounds = round;
            m.inflight.clear();
            m.base = fetched;
            m.info.phase = format!("pre-copy round {round} done");
            None
        });
    }

    /// Copies to `node` in progress (its heartbeat): event phase "progress".
    /// Only a copy of the migration's current phase counts (its FETCH's
    /// `what`, as `crate::precopy` and `crate::protocol` name them): a
    /// heartbeat sent before a copy ended may arrive after its end was
    /// counted.
    pub fn transfers(&self, node: &str, transfers: &[pb::TransferProgress]) {
        let mut all = self.migrations.lock().unwrap_or_else(|p| p.into_inner());
        for t in transfers {
            let Some(m) = all.get_mut(&t.job) else {
                continue;
            };
            let phase = &m.info.phase;
            let current = if phase.starts_with("pre-copy round ") && !phase.ends_with(" done") {
                t.what == format!("{phase} of {}", t.job)
            } else {
                phase == "fetching images"
                    && t.what.starts_with(&format!("restart of {} from ", t.job))
            };
            if !current {
                continue;
            }
            m.inflight
                .insert(node.to_string(), (t.bytes, t.total, t.elapsed_ms));
            self.migration_event(m, Some("progress"));
        }
    }

    /// The copies of `job`'s restart ended: `bytes` in `ms`.
    pub fn copied(&self, job: &str, bytes: u64, ms: u64) {
        self.with_migration(job, |m| {
            m.inflight.clear();
            m.base += bytes;
            if ms > 0 && bytes > 0 {
                m.info.rate = bytes * 1000 / ms;
            }
            m.info.phase = "copied".into();
            None
        });
    }

    /// Migration of `job` ended: `Ok(downtime)`, or why it failed and
    /// whether the job was restarted where it was.
    pub fn migration_end(&self, job: &str, r: Result<u64, (String, bool)>) {
        self.with_migration(job, |m| {
            m.inflight.clear();
            match r {
                Ok(down) => {
                    m.info.phase = "done".into();
                    m.info.downtime_ms = down;
                }
                Err((e, back)) => {
                    m.info.phase = if back { "rolled back" } else { "failed" }.into();
                    m.info.error = e;
                }
            }
            None
        });
        self.migrations
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(job);
    }

    /// The migrations in progress, as they are now.
    pub fn migrations(&self) -> Vec<pb::MigrationProgress> {
        let mut all = self.migrations.lock().unwrap_or_else(|p| p.into_inner());
        all.values_mut()
            .map(|m| {
                m.refresh();
                m.info.clone()
            })
            .collect()
    }

    // ----------------------------------------------------------- drains

    fn drain_event(&self, d: &pb::DrainProgress, phase: &str, job: &str, text: String) {
        self.emit(pb::Event {
            kind: "drain".into(),
            job: job.into(),
            node: d.node.clone(),
            phase: phase.into(),
            text,
            drain: Some(d.clone()),
            ..Default::default()
        });
    }

    /// A drain of `node` starts, `jobs` jobs to move off.
    pub fn drain_started(&self, node: &str, jobs: u32, reason: &str) {
        let d = pb::DrainProgress {
            node: node.into(),
            phase: "started".into(),
            jobs,
            started_unix_ms: now_unix_ms(),
            reason: reason.into(),
            ..Default::default()
        };
        let why = if reason.is_empty() {
            String::new()
        } else {
            format!(" ({reason})")
        };
        self.drain_event(
            &d,
            "started",
            "",
            format!("drain of {node}: started, {jobs} jobs to move off{why}"),
        );
        self.drains
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.into(), d);
    }

    /// Drain of `node`: job `job` is being moved off (`phase` "moving"),
    /// was moved ("moved"), could not be ("failed"), or is left to its
    /// batch system ("left"); `what` says how.
    pub fn drain_job(&self, node: &str, job: &str, phase: &str, what: &str) {
        let mut all = self.drains.lock().unwrap_or_else(|p| p.into_inner());
        let Some(d) = all.get_mut(node) else {
            return;
        };
        match phase {
            "moved" => d.moved += 1,
            "failed" => d.failed += 1,
            "left" => d.left += 1,
            _ => {}
        }
        d.phase = "moving".into();
        d.job = if phase == "moving" {
            job.into()
        } else {
            String::new()
        };
        let text = format!("drain of {node}: job {job} {phase}: {what}");
        let d = d.clone();
        drop(all);
        self.drain_event(&d, phase, job, text);
    }

    /// The drain of `node` is over.
    pub fn drain_done(&self, node: &str) {
        let d = self
            .drains
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(node);
        if let Some(mut d) = d {
            d.phase = "done".into();
            d.job.clear();
            let text = format!("{}: done", drain_text(&d));
            self.drain_event(&d, "done", "", text);
        }
    }

    /// The drains in progress.
    pub fn drains(&self) -> Vec<pb::DrainProgress> {
        self.drains
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }
}

/// A watcher's stream (`Coordinator.Watch`): a `watching` event, then
/// every event (only `job`'s when named) until the coordinator stops (a
/// last `shutdown` event) or the watcher goes away. Its own task forwards
/// them: a watcher that reads slowly makes only that task wait, and its
/// receiver lag (a `lagged` event then says how many it missed).
pub fn watch(
    coord: Arc<Coordinator>,
    job: String,
) -> ReceiverStream<Result<pb::Event, tonic::Status>> {
    let mut rx = coord.events.subscribe();
    let (tx, out) = mpsc::channel(FORWARD_BUFFER);
    let st = coord.status();
    let hello = pb::Event {
        unix_ms: now_unix_ms(),
        kind: "watching".into(),
        job: job.clone(),
        text: format!(
            "watching {}: nodes up {} of {}, jobs {}, operations in progress {}",
            if job.is_empty() {
                "everything".to_string()
            } else {
                format!("job {job}")
            },
            st.nodes_up,
            st.nodes,
            st.jobs,
            st.active.len()
        ),
        ..Default::default()
    };
    tokio::spawn(async move {
        let mut next = Some(hello);
        loop {
            let ev = match next.take() {
                Some(ev) => ev,
                None => tokio::select! {
                    r = rx.recv() => match r {
                        Ok(ev) if job.is_empty() || ev.job == job => ev,
                        Ok(_) => continue,
                        Err(broadcast::error::RecvError::Lagged(n)) => pb::Event {
                            unix_ms: now_unix_ms(),
                            kind: "lagged".into(),
                            lagged: n,
                            text: format!("lagged {n} events: this watcher read too slowly"),
                            ..Default::default()
                        },
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                    _ = coord.stopped() => {
                        let bye = pb::Event {
                            unix_ms: now_unix_ms(),
                            kind: "shutdown".into(),
                            text: "the coordinator is stopping".into(),
                            ..Default::default()
                        };
                        let _ = tx.try_send(Ok(bye));
                        return;
                    }
                    _ = tx.closed() => return,
                },
            };
            tokio::select! {
                r = tx.send(Ok(ev)) => if r.is_err() { return },
                _ = coord.stopped() => return,
            }
        }
    });
    ReceiverStream::new(out)
}

/// Events queued for one watcher's connection.
const FORWARD_BUFFER: usize = 64;
