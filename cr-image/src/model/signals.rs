//! Section of kind "signals": dispositions and process-wide pending signals
//! here; the per-thread part (mask, pending, alternate stack) lives in
//! [`super::Thread`].

use super::{pb, Bad};
use serde::Serialize;

/// Highest signal number.
pub const NSIG: u32 = 64;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Signals {
    /// Every signal whose action is not the default, by number.
    #[serde(rename = "sigactions")]
    pub actions: Vec<SigAction>,
    /// Pending for the whole process.
    pub shared_pending: Vec<SigInfo>,
}

/// struct kernel_sigaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SigAction {
    pub signo: u32,
    pub handler: u64,
    pub flags: u64,
    pub restorer: u64,
    pub mask: u64,
}

/// A raw siginfo_t (128 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SigInfo(Box<[u8; 128]>);

impl SigInfo {
    pub fn new(raw: [u8; 128]) -> SigInfo {
        SigInfo(Box::new(raw))
    }

    pub fn bytes(&self) -> &[u8; 128] {
        &self.0
    }

    /// si_signo.
    pub fn signo(&self) -> u32 {
        u32::from_le_bytes([self.0[0], self.0[1], self.0[2], self.0[3]])
    }

    pub(crate) fn from_pb(b: Vec<u8>) -> Result<SigInfo, Bad> {
        let raw: [u8; 128] = b
            .try_into()
            .map_err(|b: Vec<u8>| format!("a pending signal of {} bytes (not 128)", b.len()))?;
        let s = SigInfo::new(raw);
        if s.signo() == 0 || s.signo() > NSIG {
            return Err(format!("a pending signal numbered {}", s.signo()));
        }
        Ok(s)
    }
}

impl Serialize for SigInfo {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(self.signo())
    }
}

/// stack_t of sigaltstack(2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AltStack {
    pub sp: u64,
    pub flags: i32,
    pub size: u64,
}

impl Default for AltStack {
    /// None set.
    fn default() -> Self {
        AltStack {
            sp: 0,
            flags: 2, // SS_DISABLE
            size: 0,
        }
    }
}

impl Signals {
    pub(crate) fn from_pb(s: pb::Signals) -> Result<Signals, Bad> {
        let mut actions = Vec::with_capacity(s.actions.len());
        for a in s.actions {
            let last = actions.last().map_or(0, |l: &SigAction| l.signo);
            if a.signo == 0 || a.signo > NSIG || a.signo <= last {
                return Err(format!("the action of signal {} is out of order", a.signo));
            }
            actions.push(SigAction {
                signo: a.signo,
                handler: a.handler,
                flags: a.flags,
                restorer: a.restorer,
                mask: a.mask,
            });
        }
        Ok(Signals {
            actions,
            shared_pending: s
                .shared_pending
                .into_iter()
                .map(SigInfo::from_pb)
                .collect::<Result<_, _>>()?,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::Signals {
        pb::Signals {
            actions: self
                .actions
                .iter()
                .map(|a| pb::SigAction {
                    signo: a.signo,
                    handler: a.handler,
                    flags: a.flags,
                    restorer: a.restorer,
                    mask: a.mask,
                })
                .collect(),
            shared_pending: self.shared_pending.iter().map(|s| s.0.to_vec()).collect(),
        }
    }

    /// The action of `signo`, if it is not the default.
    pub fn action(&self, signo: u32) -> Option<&SigAction> {
        self.actions
            .binary_search_by_key(&signo, |a| a.signo)
            .ok()
            .map(|i| &self.actions[i])
    }
}

impl AltStack {
    pub(crate) fn from_pb(a: Option<pb::AltStack>) -> AltStack {
        a.map_or_else(AltStack::default, |a| AltStack {
            sp: a.sp,
            flags: a.flags,
            size: a.size,
        })
    }

    pub(crate) fn to_pb(self) -> pb::AltStack {
        pb::AltStack {
            sp: self.sp,
            flags: self.flags,
            size: self.size,
        }
    }
}
