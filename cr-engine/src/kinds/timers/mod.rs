//! Kind "timers": interval timers (setitimer) and POSIX timers
//! (timer_create), with the time they had left.
//!
//! Capture: getitimer, and for every POSIX timer listed in
//! /proc/PID/timers (id, signal and value, notification, clock)
//! timer_gettime and timer_getoverrun, all injected. The remaining time
//! goes on counting while the image waits; it is restored as read.
//!
//! Restore: setitimer; POSIX timers are created again with their ids
//! (PR_TIMER_CREATE_RESTORE_IDS, Linux 6.13+: refused by name on an older
//! kernel when the ids cannot come back) and armed with the time they had
//! left. Their overrun count starts again from zero.

#[cfg(test)]
mod tests;

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::Kind;
use crate::restore::Rebuild;
use cr_image::model::{ITimer, Notify, PosixTimer, Process};
use cr_sys::proc;

pub struct Timers;

const PR_TIMER_CREATE_RESTORE_IDS: u64 = 77;
const SIGEV_SIGNAL: i32 = 0;
const SIGEV_NONE: i32 = 1;
const SIGEV_THREAD_ID: i32 = 4;

/// One timer of /proc/PID/timers:
/// ```text
/// ID: 0
/// signal: 14/0000000000000007
/// notify: signal/tid.1235
/// ClockID: 1
/// ```
/// ("tid." for SIGEV_THREAD_ID: the kernel prints the notification without
/// that bit, then whom it signals.)
fn parse_timers(text: &str) -> Result<Vec<PosixTimer>, String> {
    let mut out: Vec<PosixTimer> = Vec::new();
    let bad = |l: &str| format!("an unreadable line {l:?} of /proc/PID/timers");
    for l in text.lines() {
        let Some((k, v)) = l.split_once(':') else {
            continue;
        };
        let v = v.trim();
        if k == "ID" {
            out.push(PosixTimer {
                id: v.parse().map_err(|_| bad(l))?,
                clockid: 0,
                notify: Notify::Signal,
                signo: 0,
                sigval: 0,
                value_ns: 0,
                interval_ns: 0,
                overrun: 0,
            });
            continue;
        }
        let Some(t) = out.last_mut() else { continue };
        match k {
            "signal" => {
                let (sig, val) = v.split_once('/').ok_or_else(|| bad(l))?;
                t.signo = sig.parse().map_err(|_| bad(l))?;
                t.sigval = u64::from_str_radix(val, 16).map_err(|_| bad(l))?;
            }
            "notify" => {
                let (how, whom) = v.split_once('/').ok_or_else(|| bad(l))?;
                t.notify = match (how, whom.strip_prefix("tid.")) {
                    (_, Some(tid)) => Notify::Thread(tid.parse().map_err(|_| bad(l))?),
                    ("none", None) => Notify::None,
                    _ => Notify::Signal,
                };
            }
            "ClockID" => t.clockid = v.parse().map_err(|_| bad(l))?,
            _ => {}
        }
    }
    Ok(out)
}

fn timespec_ns(raw: &[u8], i: usize) -> u64 {
    let w = |k| crate::probe::word(raw, k);
    w(i).saturating_mul(1_000_000_000).saturating_add(w(i + 1))
}

impl Kind for Timers {
    const NAME: &'static str = "timers";

    fn capture(cx: &mut Proc<'_, '_>, p: &mut Process) -> Result<(), CheckpointError> {
        let pid = cx.pid;
        let sys = |e| CheckpointError::from_sys(pid, e);
        let scratch = cx.probe.scratch().map_err(sys)?;
        // Asked with the rest of the main thread's state (`crate::asked`).
        let raw = &cx.main.itimers;
        let word = |i| crate::probe::word(raw, i);
        p.timers.itimers = (0..3)
            .filter_map(|w| {
                let b = w * 4;
                let interval_us = word(b) * 1_000_000 + word(b + 1);
                let value_us = word(b + 2) * 1_000_000 + word(b + 3);
                (value_us != 0).then_some(ITimer {
                    which: w as i32,
                    interval_us,
                    value_us,
                })
            })
            .collect();
        // Listed only with CONFIG_CHECKPOINT_RESTORE.
        let Ok(text) = proc::read_string(&format!("/proc/{pid}/timers")) else {
            return Ok(());
        };
        let mut timers = parse_timers(&text).map_err(|w| CheckpointError::unsupported(pid, w))?;
        // Each timer's setting and overrun, as many timers per stop as
        // the scratch page holds settings.
        const PER_PAGE: usize = (crate::probe::Probe::SCRATCH / 32) as usize;
        for group in timers.chunks_mut(PER_PAGE) {
            let calls: Vec<_> = group
                .iter()
                .enumerate()
                .flat_map(|(k, t)| {
                    let id = t.id as u64;
                    [
                        (
                            "timer_gettime",
                            libc::SYS_timer_gettime,
                            [id, scratch + k as u64 * 32, 0, 0, 0, 0],
                        ),
                        (
                            "timer_getoverrun",
                            libc::SYS_timer_getoverrun,
                            [id, 0, 0, 0, 0, 0],
                        ),
                    ]
                })
                .collect();
            let got = cx.probe.calls(0, &calls).map_err(sys)?;
            let mut specs = vec![0u8; group.len() * 32];
            cx.probe.read(0, &mut specs).map_err(sys)?;
            for (k, t) in group.iter_mut().enumerate() {
                let spec = &specs[k * 32..k * 32 + 32];
                t.interval_ns = timespec_ns(spec, 0);
                t.value_ns = timespec_ns(spec, 2);
                t.overrun = got[2 * k + 1] as i32;
            }
        }
        // /proc lists the newest timer first; keep the image in id order
        // (the order a kernel without preset ids would hand them out).
        timers.sort_by_key(|t| t.id);
        p.timers.posix = timers;
        Ok(())
    }

    fn restore(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
        for t in &p.timers.itimers {
            let addr = cx
                .stub
                .put(&two_times([t.interval_us, t.value_us], 1_000_000))?;
            cx.stub
                .call(
                    "setitimer",
                    libc::SYS_setitimer,
                    [t.which as u64, addr, 0, 0, 0, 0],
                )
                .step(|| format!("cannot arm interval timer {}", t.which))?;
        }
        if p.timers.posix.is_empty() {
            return Ok(());
        }
        let preset = cx.stub.call(
            "prctl(PR_TIMER_CREATE_RESTORE_IDS)",
            libc::SYS_prctl,
            [PR_TIMER_CREATE_RESTORE_IDS, 1, 0, 0, 0, 0],
        );
        if preset.is_err() {
            // Before Linux 6.13 a process's timer ids count up from 0, so
            // timers 0..n come back right when created in order; any other
            // set of ids cannot be rebuilt.
            let dense = p
                .timers
                .posix
                .iter()
                .enumerate()
                .all(|(i, t)| t.id as usize == i);
            if !dense {
                return Err(RestoreError::Unsupported(format!(
                    "this kernel cannot create POSIX timers with given ids \
                     (PR_TIMER_CREATE_RESTORE_IDS, Linux 6.13+) and the image has timer ids {:?}",
                    p.timers.posix.iter().map(|t| t.id).collect::<Vec<_>>()
                )));
            }
            return p.timers.posix.iter().try_for_each(|t| posix_timer(cx, t));
        }
        let made = p.timers.posix.iter().try_for_each(|t| posix_timer(cx, t));
        cx.stub.call(
            "prctl(PR_TIMER_CREATE_RESTORE_IDS)",
            libc::SYS_prctl,
            [PR_TIMER_CREATE_RESTORE_IDS, 0, 0, 0, 0, 0],
        )?;
        made
    }
}

/// Interval and value as the kernel reads them (`struct itimerval` with
/// `per_sec` = 10^6, `struct itimerspec` with 10^9): seconds and remainder,
/// each a 64-bit word.
fn two_times(times: [u64; 2], per_sec: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(32);
    for t in times {
        v.extend_from_slice(&(t / per_sec).to_le_bytes());
        v.extend_from_slice(&(t % per_sec).to_le_bytes());
    }
    v
}

/// Create POSIX timer `t` with its id and arm it with what it had left.
fn posix_timer(cx: &mut Rebuild<'_, '_, '_>, t: &PosixTimer) -> Result<(), RestoreError> {
    let what = || format!("cannot create POSIX timer {} (clock {})", t.id, t.clockid);
    // struct sigevent: sigev_value, sigev_signo, sigev_notify, then the
    // union (sigev_notify_thread_id first), 64 bytes in all.
    let mut ev = vec![0u8; 64];
    ev[0..8].copy_from_slice(&t.sigval.to_le_bytes());
    ev[8..12].copy_from_slice(&t.signo.to_le_bytes());
    let (notify, tid) = match t.notify {
        Notify::Signal => (SIGEV_SIGNAL, 0),
        Notify::None => (SIGEV_NONE, 0),
        Notify::Thread(tid) => (SIGEV_THREAD_ID, tid),
    };
    ev[12..16].copy_from_slice(&notify.to_le_bytes());
    ev[16..20].copy_from_slice(&tid.to_le_bytes());
    let ev_addr = cx.stub.put(&ev)?;
    let id_addr = cx.stub.put(&t.id.to_le_bytes())?;
    cx.stub
        .call(
            "timer_create",
            libc::SYS_timer_create,
            [t.clockid as u64, ev_addr, id_addr, 0, 0, 0],
        )
        .step(what)?;
    let mut got = [0u8; 4];
    cr_sys::mem::read_vm(cx.stub.pid(), id_addr, &mut got)?;
    if i32::from_le_bytes(got) != t.id {
        return Err(RestoreError::Unsupported(format!(
            "{}: the kernel gave id {}",
            what(),
            i32::from_le_bytes(got)
        )));
    }
    if t.value_ns != 0 {
        let addr = cx
            .stub
            .put(&two_times([t.interval_ns, t.value_ns], 1_000_000_000))?;
        cx.stub
            .call(
                "timer_settime",
                libc::SYS_timer_settime,
                [t.id as u64, 0, addr, 0, 0, 0],
            )
            .step(|| format!("cannot arm POSIX timer {}", t.id))?;
    }
    Ok(())
}

/// `--verify`: which timers exist, their clocks, notifications and
/// periods (the time left runs on and is not compared).
pub fn verify(c: &mut crate::verify::Compare<'_>, image: &Process, now: &Process) {
    let (a, b) = (&image.timers, &now.timers);
    // A one-shot interval timer restored with little time left may have
    // fired (and disarmed) before --verify looks: the tree's clocks run.
    let armed_now = |which: i32| b.itimers.iter().any(|i| i.which == which);
    let itimers = |t: &cr_image::model::Timers| {
        t.itimers
            .iter()
            .filter(|i| i.interval_us > 0 || armed_now(i.which))
            .map(|i| (i.which, i.interval_us))
            .collect::<Vec<_>>()
    };
    c.same(
        "interval timers",
        "(which, interval in us)",
        &itimers(a),
        &itimers(b),
    );
    let posix = |t: &cr_image::model::Timers| {
        t.posix
            .iter()
            .map(|p| (p.id, p.clockid, p.notify, p.signo, p.sigval, p.interval_ns))
            .collect::<Vec<_>>()
    };
    c.same(
        "POSIX timers",
        "(id, clock, notification, signal, value, interval in ns)",
        &posix(a),
        &posix(b),
    );
}

#[cfg(test)]
mod parse_tests {
    use super::*;

    #[test]
    fn proc_timers() {
        let t = parse_timers(
            "ID: 0\nsignal: 14/0000000000000007\nnotify: signal/pid.77\nClockID: 1\nID: 3\nsignal: 34/0000000000000000\nnotify: signal/tid.78\nClockID: 0\nID: 4\nsignal: 0/0000000000000000\nnotify: none/pid.77\nClockID: 7\n",
        )
        .unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t[2].notify, Notify::None);
        assert_eq!(
            (t[0].id, t[0].signo, t[0].sigval, t[0].clockid),
            (0, 14, 7, 1)
        );
        assert_eq!(t[1].notify, Notify::Thread(78));
    }
}
