//! Section of kind "timers": interval timers (setitimer) and POSIX timers
//! (timer_create), with the time they had left.

use super::{known_case, pb, Bad, Process};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Timers {
    /// Armed interval timers.
    pub itimers: Vec<ITimer>,
    /// POSIX timers, armed or not.
    pub posix: Vec<PosixTimer>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ITimer {
    /// ITIMER_REAL (0), ITIMER_VIRTUAL (1) or ITIMER_PROF (2).
    pub which: i32,
    pub interval_us: u64,
    /// Time left when the image was taken.
    pub value_us: u64,
}

/// How a POSIX timer tells its expiration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Notify {
    /// A signal to the process (SIGEV_SIGNAL).
    Signal,
    /// A signal to this thread, by its TID inside the process's PID
    /// namespace (SIGEV_THREAD_ID, what glibc's SIGEV_THREAD uses too).
    Thread(i32),
    /// Nothing (SIGEV_NONE).
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PosixTimer {
    pub id: i32,
    pub clockid: i32,
    pub notify: Notify,
    pub signo: i32,
    pub sigval: u64,
    /// Time left (0: disarmed) and period.
    pub value_ns: u64,
    pub interval_ns: u64,
    /// Missed expirations when read (not restored: the kernel counts again).
    pub overrun: i32,
}

/// Clocks a POSIX timer may use: REALTIME, MONOTONIC, PROCESS_CPUTIME,
/// THREAD_CPUTIME, BOOTTIME, REALTIME_ALARM, BOOTTIME_ALARM, TAI (and the
/// negative ids of per-process/thread CPU clocks).
fn known_clock(c: i32) -> bool {
    matches!(c, 0..=3 | 7..=9 | 11) || c < 0
}

impl Timers {
    pub(crate) fn from_pb(t: pb::Timers) -> Result<Timers, Bad> {
        let itimers = t
            .itimers
            .into_iter()
            .map(|i| {
                if !(0..=2).contains(&i.which) {
                    return Err(format!("interval timer {} does not exist", i.which));
                }
                Ok(ITimer {
                    which: i.which,
                    interval_us: i.interval_us,
                    value_us: i.value_us,
                })
            })
            .collect::<Result<_, _>>()?;
        let posix = t
            .posix
            .into_iter()
            .map(|p| {
                use pb::posix_timer::Notify as N;
                let notify = match known_case(p.notify, "the notification of a POSIX timer")? {
                    N::Signal(_) => Notify::Signal,
                    N::Thread(t) => Notify::Thread(t),
                    N::None(_) => Notify::None,
                };
                if p.id < 0 || !known_clock(p.clockid) || !(0..=64).contains(&p.signo) {
                    return Err(format!(
                        "POSIX timer {} (clock {}, signal {})",
                        p.id, p.clockid, p.signo
                    ));
                }
                Ok(PosixTimer {
                    id: p.id,
                    clockid: p.clockid,
                    notify,
                    signo: p.signo,
                    sigval: p.sigval,
                    value_ns: p.value_ns,
                    interval_ns: p.interval_ns,
                    overrun: p.overrun,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Timers { itimers, posix })
    }

    pub(crate) fn to_pb(&self) -> pb::Timers {
        use pb::posix_timer::Notify as N;
        pb::Timers {
            itimers: self
                .itimers
                .iter()
                .map(|i| pb::ITimer {
                    which: i.which,
                    interval_us: i.interval_us,
                    value_us: i.value_us,
                })
                .collect(),
            posix: self
                .posix
                .iter()
                .map(|p| pb::PosixTimer {
                    id: p.id,
                    clockid: p.clockid,
                    notify: Some(match p.notify {
                        Notify::Signal => N::Signal(pb::Empty {}),
                        Notify::Thread(t) => N::Thread(t),
                        Notify::None => N::None(pb::Empty {}),
                    }),
                    signo: p.signo,
                    sigval: p.sigval,
                    value_ns: p.value_ns,
                    interval_ns: p.interval_ns,
                    overrun: p.overrun,
                })
                .collect(),
        }
    }
}

/// Timer ids are unique; a timer signalling a thread names one of the
/// process's threads.
pub(crate) fn validate(p: &Process) -> Result<(), Bad> {
    let mut ids: Vec<i32> = p.timers.posix.iter().map(|t| t.id).collect();
    ids.sort();
    if ids.windows(2).any(|w| w[0] == w[1]) {
        return Err("two POSIX timers with one id".into());
    }
    for t in &p.timers.posix {
        if let Notify::Thread(tid) = t.notify {
            let known = p
                .threads
                .iter()
                .any(|th| th.ns_tid as i32 == tid || th.tid as i32 == tid);
            if !known {
                return Err(format!(
                    "POSIX timer {} signals thread {tid}, not in the process",
                    t.id
                ));
            }
        }
    }
    Ok(())
}
