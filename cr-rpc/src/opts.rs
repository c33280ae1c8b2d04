//! The one conversion between the engines' options and results and the
//! messages of the agent's Local service, both ways: `cr_checkpoint` and
//! `cr_restart` send what the user asked for to the agent, which runs the
//! engine with exactly that.

use crate::pb;
/// Sizes on command lines (64M, 1G...), as every tool reads them.
pub use cr_engine::options::parse_size;
/// The libcr flags (`--callback-timeout`, `--cs-wait`, `--cs-proceed`), for
/// tools that do not link the engine.
pub use cr_engine::options::CoopArgs;
use cr_engine::options::{
    Action, AddrRewrite, Binding, CheckpointOptions, InheritFd, RestoreOptions,
};
use cr_engine::Summary;
use cr_image::model::DirtyMethod;
use std::path::{Path, PathBuf};
use std::time::Duration;

fn after(a: Action) -> pb::After {
    match a {
        Action::Continue => pb::After::Continue,
        Action::Stop => pb::After::Stop,
        Action::Kill => pb::After::Kill,
    }
}

/// What the protocol's After means for the processes.
pub fn action(a: pb::After) -> Action {
    match a {
        pb::After::Continue => Action::Continue,
        pb::After::Stop => Action::Stop,
        pb::After::Kill => Action::Kill,
    }
}

/// The request for a checkpoint of `pid` into `dir` (both made absolute by
/// the caller).
pub fn checkpoint_request(
    pid: i32,
    dir: &Path,
    o: &CheckpointOptions,
) -> pb::LocalCheckpointRequest {
    pb::LocalCheckpointRequest {
        pid,
        dir: dir.display().to_string(),
        after: after(o.action()) as i32,
        parent: o
            .parent
            .as_deref()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        pre_dump: o.pre_dump,
        track_mem: o.track_mem,
        verify: o.verify,
        dirty: o.dirty.name().into(),
        compress: o.compress.name().into(),
        workers: o.workers.unwrap_or(0) as u32,
        no_fsync: o.no_fsync,
        tcp_skip_in_flight: o.tcp_skip_in_flight,
        skip_queued_events: o.skip_queued_events,
        ipc_keys: o.ipc_keys.clone(),
        ipc_owners: o.ipc_owners.clone(),
        save_files_limit: o.save_files.unwrap_or(0),
        save_file: o
            .save_file
            .iter()
            .map(|p| p.display().to_string())
            .collect(),
        coop: cooperation(&o.coop),
    }
}

fn millis(d: Option<Duration>) -> u32 {
    d.map_or(0, |d| d.as_millis().clamp(1, u128::from(u32::MAX)) as u32)
}

/// What the options allow programs linked with libcr, for the wire; None
/// when all is default.
pub fn cooperation(o: &CoopArgs) -> Option<pb::Cooperation> {
    let c = pb::Cooperation {
        callback_timeout_ms: millis(o.callback_timeout),
        cs_wait_ms: millis(o.cs_wait),
        cs_proceed: o.cs_proceed,
    };
    (c != pb::Cooperation::default()).then_some(c)
}

/// Set what `c` allows programs linked with libcr in `o` (0: default).
pub fn set_cooperation(o: &mut CheckpointOptions, c: Option<&pb::Cooperation>) {
    let Some(c) = c else { return };
    let ms = |v: u32| (v > 0).then(|| Duration::from_millis(u64::from(v)));
    o.coop = CoopArgs {
        callback_timeout: ms(c.callback_timeout_ms),
        cs_wait: ms(c.cs_wait_ms),
        cs_proceed: c.cs_proceed,
    };
}

/// The engine's options from a checkpoint request (paths already checked).
pub fn checkpoint_options(r: &pb::LocalCheckpointRequest) -> Result<CheckpointOptions, String> {
    let mut o = CheckpointOptions {
        dir: Some(PathBuf::from(&r.dir)),
        no_fsync: r.no_fsync,
        workers: (r.workers > 0).then_some(r.workers as usize),
        tcp_skip_in_flight: r.tcp_skip_in_flight,
        skip_queued_events: r.skip_queued_events,
        ipc_keys: r.ipc_keys.clone(),
        ipc_owners: r.ipc_owners.clone(),
        save_files: (r.save_files_limit > 0).then_some(r.save_files_limit),
        save_file: r.save_file.iter().map(PathBuf::from).collect(),
        parent: (!r.parent.is_empty()).then(|| PathBuf::from(&r.parent)),
        pre_dump: r.pre_dump,
        track_mem: r.track_mem,
        verify: r.verify,
        dirty: if r.dirty.is_empty() { "auto" } else { &r.dirty }.parse()?,
        compress: if r.compress.is_empty() {
            "none"
        } else {
            &r.compress
        }
        .parse()?,
        ..Default::default()
    };
    o.set_action(action(
        pb::After::try_from(r.after).map_err(|_| format!("unknown action {}", r.after))?,
    ));
    set_cooperation(&mut o, r.coop.as_ref());
    Ok(o)
}

pub fn summary_reply(s: &Summary) -> pb::LocalCheckpointReply {
    pb::LocalCheckpointReply {
        pid: s.pid,
        processes: s.processes as u32,
        threads: s.threads as u32,
        page_bytes: s.page_bytes,
        store_bytes: s.store_bytes,
        pages_parent: s.pages_parent,
        dirty: s.dirty.name().to_string(),
        vmas: s.vmas as u32,
        fds: s.fds as u32,
        frozen_us: s.frozen.as_micros() as u64,
        elapsed_us: s.elapsed.as_micros() as u64,
    }
}

pub fn summary(r: &pb::LocalCheckpointReply) -> Summary {
    Summary {
        pid: r.pid,
        processes: r.processes as usize,
        threads: r.threads as usize,
        page_bytes: r.page_bytes,
        store_bytes: r.store_bytes,
        pages_parent: r.pages_parent,
        dirty: DirtyMethod::from_name(&r.dirty).unwrap_or_default(),
        vmas: r.vmas as usize,
        fds: r.fds as usize,
        frozen: Duration::from_micros(r.frozen_us),
        elapsed: Duration::from_micros(r.elapsed_us),
    }
}

/// The request for a restore of `dir` (absolute).
pub fn restore_request(dir: &Path, o: &RestoreOptions) -> pb::LocalRestoreRequest {
    pb::LocalRestoreRequest {
        dir: dir.display().to_string(),
        map_addr: o.map_addr.iter().map(|m| m.to_string()).collect(),
        reset_guard_secs: o.reset_guard,
        workers: o.workers.unwrap_or(0) as u32,
        inherit_fd: o.inherit_fd.iter().map(|b| b.to_string()).collect(),
        external_to_null: o.external_to_null,
        allow_changed_files: o.allow_changed_files,
        verify: o.verify,
        tcp_close: o.tcp_close,
    }
}

/// `OLD=NEW` rewrites as the protocol carries them.
pub fn addr_rewrites(specs: &[String]) -> Result<Vec<AddrRewrite>, String> {
    specs.iter().map(|s| s.parse()).collect()
}

/// The engine's options from a restore request.
pub fn restore_options(r: &pb::LocalRestoreRequest) -> Result<RestoreOptions, String> {
    Ok(RestoreOptions {
        workers: (r.workers > 0).then_some(r.workers as usize),
        map_addr: addr_rewrites(&r.map_addr)?,
        reset_guard: r.reset_guard_secs,
        inherit_fd: r
            .inherit_fd
            .iter()
            .map(|s| {
                let b: InheritFd = s.parse()?;
                match b.to {
                    Binding::OwnFd(_) => Err(format!(
                        "--inherit-fd {s}: the agent restores with no fds of the caller; name a path"
                    )),
                    Binding::Path(_) => Ok(b),
                }
            })
            .collect::<Result<_, String>>()?,
        external_to_null: r.external_to_null,
        allow_changed_files: r.allow_changed_files,
        verify: r.verify,
        tcp_close: r.tcp_close,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the user asked for reaches the agent's engine unchanged: the
    /// action and the switches about what cannot be saved.
    #[test]
    fn checkpoint_switches_cross_the_wire() {
        let mut o = CheckpointOptions {
            tcp_skip_in_flight: true,
            skip_queued_events: true,
            ..Default::default()
        };
        o.set_action(Action::Kill);
        let back = checkpoint_options(&checkpoint_request(7, Path::new("/img"), &o)).unwrap();
        assert_eq!(back.action(), Action::Kill);
        assert!(back.tcp_skip_in_flight && back.skip_queued_events);
        let plain = checkpoint_options(&checkpoint_request(
            7,
            Path::new("/img"),
            &CheckpointOptions::default(),
        ))
        .unwrap();
        assert!(!plain.tcp_skip_in_flight && !plain.skip_queued_events);
    }
}
