//! Kind "aio": the contexts a process made with io_setup. A context shows
//! to user space as its completion ring, a shared mapping ("/[aio]
//! (deleted)") whose address is the context's id:
//!
//! ```text
//! struct aio_ring { u32 id, nr, head, tail, magic, compat_features,
//!                   incompat_features, header_length; struct io_event[nr]; }
//! ```
//!
//! Capture reads the ring: its size (`nr`), `head` (next event to reap),
//! `tail` (next to complete) and the completed events not yet reaped.
//! Requests still in flight cannot be seen from user space (the kernel
//! keeps them in the context, with no /proc view and no way to list them):
//! they are assumed to be none, as other checkpointers assume too. A request
//! in flight at a checkpoint that kills is lost (its completion never comes);
//! with a checkpoint that continues, the original still gets it.
//!
//! Restore, in the stub once its memory is mapped: io_setup with the
//! request count that gives a ring of the same size, mremap of the new ring
//! to the saved address (the kernel follows the move: the context's id is
//! that address again), then the kernel's own tail — which only completions
//! move — is brought to the saved one by requests that complete at once
//! (zero-byte reads of /dev/null), reaped up to the saved head; the
//! pending events are then written back into their slots.

#[cfg(test)]
mod tests;

use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::restore::Rebuild;
use crate::stub::Stub;
use cr_image::model::{AioRing, Process, Vma, VmaKind, AIO_EVENT};
use cr_sys::mem::{read_vm, write_vm};
use cr_sys::PAGE_SIZE;

/// struct aio_ring's `magic`.
const AIO_RING_MAGIC: u32 = 0xa10a10a1;
/// Bytes of struct aio_ring before the events (its `header_length`).
const HEADER: usize = 32;
/// Bytes of struct iocb.
const IOCB: usize = 64;
/// Requests submitted (and events reaped) by one system call at restore.
const BATCH: usize = 32;

/// The u32 at `i` (in u32s) of the ring header `h`.
fn word(h: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(h[i * 4..i * 4 + 4].try_into().expect("4 bytes"))
}

/// Read the ring of the AIO context mapped at `v` in process `pid`.
pub fn capture(pid: i32, v: &Vma) -> Result<AioRing, CheckpointError> {
    let bad = |what: String| {
        CheckpointError::unsupported(pid, format!("the AIO context at {:#x}: {what}", v.start))
    };
    let mut ring = vec![0u8; v.len() as usize];
    read_vm(pid, v.start, &mut ring).map_err(|e| CheckpointError::from_sys(pid, e))?;
    let (nr, head, tail, magic) = (
        word(&ring, 1),
        word(&ring, 2),
        word(&ring, 3),
        word(&ring, 4),
    );
    if magic != AIO_RING_MAGIC || word(&ring, 7) as usize != HEADER {
        return Err(bad(format!(
            "its ring has magic {magic:#x} and a header of {} bytes (a kernel this build does not know)",
            word(&ring, 7)
        )));
    }
    if nr < 2 || HEADER + nr as usize * AIO_EVENT > ring.len() {
        return Err(bad(format!(
            "its ring of {} bytes claims {nr} events",
            ring.len()
        )));
    }
    // The kernel reads head and tail modulo nr (the program may write head).
    let mut saved = AioRing {
        nr,
        head: head % nr,
        tail: tail % nr,
        events: Vec::new(),
    };
    let mut i = saved.head;
    while i != saved.tail {
        let at = HEADER + i as usize * AIO_EVENT;
        saved.events.extend_from_slice(&ring[at..at + AIO_EVENT]);
        i = (i + 1) % nr;
    }
    Ok(saved)
}

/// The io_setup request count that makes a ring of `nr` events here. The
/// kernel doubles the count (after raising it to 4 per possible CPU), adds
/// 2, rounds the ring up to whole pages and fills them with events: with
/// `nr` = pages * 128 - 1, asking (nr - 2) / 2 gives the same pages.
fn requests_for(nr: u32) -> u64 {
    (nr as u64 - 2) / 2
}

/// Make the AIO contexts of `p` again, each ring at its saved address.
pub fn restore_process(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    for v in p.vmas.iter().filter(|v| v.kind == VmaKind::Aio) {
        let ring = v.aio.as_ref().ok_or_else(|| {
            RestoreError::Unsupported(format!("the AIO ring at {:#x} has no state", v.start))
        })?;
        restore_ring(cx, v, ring)?;
    }
    Ok(())
}

/// One context: io_setup, move the ring, bring head and tail, put back the
/// pending events.
fn restore_ring(cx: &mut Rebuild<'_, '_, '_>, v: &Vma, ring: &AioRing) -> Result<(), RestoreError> {
    let what = || format!("the AIO context at {:#x}", v.start);
    let stub = &mut cx.stub;
    let pid = stub.pid();
    // Scratch layout: iocbs, their pointers, events, the context id, a
    // timeout.
    let iocbs = 0;
    let ptrs = iocbs + BATCH * IOCB;
    let events = ptrs + BATCH * 8;
    let ctx_at = events + BATCH * AIO_EVENT;
    let ts_at = ctx_at + 8;
    let mut area = vec![0u8; ts_at + 16];
    area[ts_at..ts_at + 8].copy_from_slice(&5u64.to_le_bytes());
    let base = stub.put(&area)?;
    let nr_req = requests_for(ring.nr);
    stub.call(
        "io_setup",
        libc::SYS_io_setup,
        [nr_req, base + ctx_at as u64, 0, 0, 0, 0],
    )
    .step(|| {
        format!(
            "{}: io_setup({nr_req}) failed (see /proc/sys/fs/aio-max-nr)",
            what()
        )
    })?;
    let mut id = [0u8; 8];
    read_vm(pid, base + ctx_at as u64, &mut id)?;
    let mut ctx = u64::from_le_bytes(id);
    let mut header = [0u8; HEADER];
    read_vm(pid, ctx, &mut header)?;
    if word(&header, 1) != ring.nr {
        return Err(RestoreError::Unsupported(format!(
            "{}: this machine makes a ring of {} events for it, the image holds {} (another number of CPUs)",
            what(),
            word(&header, 1),
            ring.nr
        )));
    }
    if ctx != v.start {
        // The kernel's mremap hook for the ring moves the context's id along.
        let len = v.len().next_multiple_of(PAGE_SIZE);
        let flags = (libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED) as u64;
        let got = stub
            .call(
                "mremap",
                libc::SYS_mremap,
                [ctx, len, len, flags, v.start, 0],
            )
            .step(|| format!("{}: cannot move its ring from {ctx:#x}", what()))?;
        if got != v.start {
            return Err(RestoreError::Unsupported(format!(
                "{}: its ring moved to {got:#x}",
                what()
            )));
        }
        ctx = v.start;
    }
    // The kernel writes completions at its own tail, which only completions
    // move: complete `head` requests and reap them, then `pending` more.
    let pending = ring.pending() as u64;
    if ring.head as u64 + pending > 0 {
        let null = stub
            .open("/dev/null", libc::O_RDONLY | libc::O_CLOEXEC)
            .step(|| format!("{}: cannot open /dev/null in the restored process", what()))?;
        for i in 0..BATCH {
            let at = iocbs + i * IOCB;
            // aio_lio_opcode (IOCB_CMD_PREAD = 0) at 16, aio_fildes at 20,
            // aio_buf at 24, aio_nbytes (0) at 32.
            area[at + 20..at + 24].copy_from_slice(&(null as u32).to_le_bytes());
            area[at + 24..at + 32].copy_from_slice(&(base + events as u64).to_le_bytes());
            let ptr = ptrs + i * 8;
            area[ptr..ptr + 8].copy_from_slice(&(base + at as u64).to_le_bytes());
        }
        write_vm(pid, base, &area[..events])?;
        let r = advance(cx, ctx, base, ring.head as u64, pending);
        cx.stub
            .call("close", libc::SYS_close, [null, 0, 0, 0, 0, 0])?;
        r?;
    }
    read_vm(cx.stub.pid(), ctx, &mut header)?;
    if (word(&header, 2), word(&header, 3)) != (ring.head, ring.tail) {
        return Err(RestoreError::Unsupported(format!(
            "{}: its ring came to head {} and tail {}, not {} and {}",
            what(),
            word(&header, 2),
            word(&header, 3),
            ring.head,
            ring.tail
        )));
    }
    for (k, e) in ring.events.chunks(AIO_EVENT).enumerate() {
        let slot = (ring.head as u64 + k as u64) % ring.nr as u64;
        write_vm(
            cx.stub.pid(),
            ctx + HEADER as u64 + slot * AIO_EVENT as u64,
            e,
        )?;
    }
    tracing::debug!(
        ctx = format_args!("{ctx:#x}"),
        nr = ring.nr,
        head = ring.head,
        tail = ring.tail,
        "AIO context restored"
    );
    Ok(())
}

/// Complete `reap` requests and reap them, then complete `keep` more left
/// unreaped (iocbs, their pointers, an event buffer and a timeout at
/// `base`, as [`restore_ring`] lays them out).
fn advance(
    cx: &mut Rebuild<'_, '_, '_>,
    ctx: u64,
    base: u64,
    reap: u64,
    keep: u64,
) -> Result<(), RestoreError> {
    let events = base + (BATCH * (IOCB + 8)) as u64;
    let ts = events + (BATCH * AIO_EVENT) as u64 + 8;
    let mut reaped = 0;
    while reaped < reap {
        let k = (reap - reaped).min(BATCH as u64);
        submit(&mut cx.stub, ctx, base, k)?;
        // Completed already (reads of /dev/null finish at submission).
        let got = cx
            .stub
            .call(
                "io_getevents",
                libc::SYS_io_getevents,
                [ctx, k, k, events, ts, 0],
            )
            .step(|| {
                format!("the AIO context at {ctx:#x}: cannot reap requests to set its head")
            })?;
        if got != k {
            return Err(RestoreError::Unsupported(format!(
                "the AIO context at {ctx:#x}: {got} of {k} requests completed"
            )));
        }
        reaped += k;
    }
    submit(&mut cx.stub, ctx, base, keep)
}

/// Submit `n` of the prepared requests (iocb pointers after the iocbs at
/// `base`), a batch at a time.
fn submit(stub: &mut Stub<'_>, ctx: u64, base: u64, n: u64) -> Result<(), RestoreError> {
    let ptrs = base + (BATCH * IOCB) as u64;
    let mut done = 0;
    while done < n {
        let k = (n - done).min(BATCH as u64);
        let got = stub
            .call("io_submit", libc::SYS_io_submit, [ctx, k, ptrs, 0, 0, 0])
            .step(|| {
                format!("the AIO context at {ctx:#x}: cannot complete requests to set its tail")
            })?;
        if got == 0 {
            return Err(RestoreError::Unsupported(format!(
                "the AIO context at {ctx:#x}: io_submit took no request"
            )));
        }
        done += got;
    }
    Ok(())
}
