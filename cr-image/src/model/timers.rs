//! Section of kind "timers": interval timers (setitimer).

use super::{pb, Bad};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Timers {
    /// Armed interval timers.
    pub itimers: Vec<ITimer>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ITimer {
    /// ITIMER_REAL (0), ITIMER_VIRTUAL (1) or ITIMER_PROF (2).
    pub which: i32,
    pub interval_us: u64,
    /// Time left when the image was taken.
    pub value_us: u64,
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
        Ok(Timers { itimers })
    }

    pub(crate) fn to_pb(&self) -> pb::Timers {
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
        }
    }
}
