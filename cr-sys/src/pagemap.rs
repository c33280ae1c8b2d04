//! /proc/PID/pagemap: one 64-bit entry per virtual page.
//!
//! Bits we use: 63 present, 62 swapped, 61 file page or shared anonymous,
//! 58 guard region, 56 exclusively mapped, 55 soft-dirty. A private file mapping's page with
//! bit 61 set is still the file's own page (not stored); a present or
//! swapped page without it is the process's private copy (stored).

use crate::error::{io_err, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;

pub const PM_PRESENT: u64 = 1 << 63;
pub const PM_SWAP: u64 = 1 << 62;
pub const PM_FILE: u64 = 1 << 61;
pub const PM_EXCLUSIVE: u64 = 1 << 56;
pub const PM_SOFT_DIRTY: u64 = 1 << 55;
/// The pte is write-protected by userfaultfd.
pub const PM_UFFD_WP: u64 = 1 << 57;
/// The page is in a guard region (madvise MADV_GUARD_INSTALL, Linux
/// 6.13; shown in pagemap since 6.15): a pte marker, any access faults.
pub const PM_GUARD_REGION: u64 = 1 << 58;
/// Swap type of pte markers (the highest of the 5-bit swap types): an
/// empty pte that only carries a userfaultfd write-protect mark.
const SWP_PTE_MARKER: u64 = 31;

/// Whether a pagemap entry is a pte marker (visible only to readers with
/// CAP_SYS_ADMIN, who see swap types): no page, reads as zero.
pub fn is_pte_marker(pm: u64) -> bool {
    pm & PM_SWAP != 0 && pm & PFN_MASK & 0x1f == SWP_PTE_MARKER
}

/// Page frame number (bits 0-54; zero unless the reader has CAP_SYS_ADMIN).
pub const PFN_MASK: u64 = (1 << 55) - 1;

pub struct Pagemap {
    path: String,
    file: File,
}

impl Pagemap {
    pub fn open(pid: i32) -> Result<Self> {
        let path = format!("/proc/{pid}/pagemap");
        let file = File::open(&path).map_err(io_err(&path))?;
        Ok(Pagemap { path, file })
    }

    /// The open `/proc/PID/pagemap` (for PAGEMAP_SCAN, `crate::dirty`).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Entries for `out.len()` pages starting at virtual address `start`.
    pub fn read(&self, start: u64, out: &mut [u64]) -> Result<()> {
        let mut bytes = vec![0u8; out.len() * 8];
        self.file
            .read_exact_at(&mut bytes, start / crate::PAGE_SIZE * 8)
            .map_err(io_err(&self.path))?;
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(8)) {
            *o = u64::from_le_bytes(b.try_into().expect("8-byte chunk"));
        }
        Ok(())
    }

    /// The guard regions in `[start, end)`: sorted, disjoint ranges of
    /// pages with [`PM_GUARD_REGION`].
    pub fn guards(&self, start: u64, end: u64) -> Result<Vec<(u64, u64)>> {
        const CHUNK: u64 = 32 * 1024;
        let page = crate::PAGE_SIZE;
        let mut out: Vec<(u64, u64)> = Vec::new();
        let mut buf = vec![0u64; CHUNK as usize];
        let mut addr = start;
        while addr < end {
            let n = ((end - addr) / page).min(CHUNK);
            let entries = &mut buf[..n as usize];
            self.read(addr, entries)?;
            for (i, &pm) in entries.iter().enumerate() {
                if pm & PM_GUARD_REGION == 0 {
                    continue;
                }
                let at = addr + i as u64 * page;
                match out.last_mut() {
                    Some(last) if last.1 == at => last.1 = at + page,
                    _ => out.push((at, at + page)),
                }
            }
            addr += n * page;
        }
        Ok(out)
    }
}
