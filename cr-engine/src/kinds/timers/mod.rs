//! Kind "timers": the interval timers (setitimer), with the time they had
//! left. (POSIX timers are refused by kind "identity" until they are saved.)
//!
//! Capture: getitimer injected for each of the three timers (the remaining
//! time goes on counting while the image waits; it is restored as read).
//! Restore: setitimer with the saved interval and remaining time.

#[cfg(test)]
mod tests;

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::Kind;
use crate::restore::Rebuild;
use cr_image::model::{ITimer, Process};

pub struct Timers;

impl Kind for Timers {
    const NAME: &'static str = "timers";

    fn capture(cx: &mut Proc<'_, '_>, p: &mut Process) -> Result<(), CheckpointError> {
        let pid = cx.pid;
        let sys = |e| CheckpointError::from_sys(pid, e);
        let scratch = cx.probe.scratch().map_err(sys)?;
        cx.probe
            .on(0, |inj| {
                for which in 0..3u64 {
                    inj.call(
                        "getitimer",
                        libc::SYS_getitimer,
                        [which, scratch + which * 32, 0, 0, 0, 0],
                    )?;
                }
                Ok(())
            })
            .map_err(sys)?;
        let mut raw = [0u8; 96];
        cx.probe.read(0, &mut raw).map_err(sys)?;
        let word = |i| crate::probe::word(&raw, i);
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
        Ok(())
    }

    fn restore(cx: &mut Rebuild<'_, '_>, p: &Process) -> Result<(), RestoreError> {
        for t in &p.timers.itimers {
            let mut v = Vec::with_capacity(32);
            for us in [t.interval_us, t.value_us] {
                v.extend_from_slice(&(us / 1_000_000).to_le_bytes());
                v.extend_from_slice(&(us % 1_000_000).to_le_bytes());
            }
            let addr = cx.stub.put(&v)?;
            cx.stub
                .call(
                    "setitimer",
                    libc::SYS_setitimer,
                    [t.which as u64, addr, 0, 0, 0, 0],
                )
                .step(|| format!("cannot arm interval timer {}", t.which))?;
        }
        Ok(())
    }
}
