//! The kernel's special mappings: [vvar], [vvar_vclock] and [vdso]. A
//! restored process keeps calling the vDSO at the addresses it had, so the
//! stub's own special mappings are moved there (mremap), and the image
//! records the vDSO's GNU build id: a kernel with another vDSO is refused
//! by name instead of letting the process jump into the wrong code.

use crate::error::{RestoreError, StepContext};
use crate::stub::Stub;
use cr_image::model::{Checkpoint, Vma, VmaKind};
use cr_sys::proc::{self, MapEntry};
use cr_sys::PAGE_SIZE;

/// The build id of the vDSO of process `pid`.
pub fn build_id_of(pid: i32) -> Option<Vec<u8>> {
    let maps = proc::maps(pid).ok()?;
    let v = maps.iter().find(|m| m.path == "[vdso]")?;
    cr_sys::elf::mapped_build_id(pid, v.start, v.end).ok()
}

/// Refuse an image whose processes used another vDSO than this kernel's.
pub fn check(ck: &Checkpoint) -> Result<(), RestoreError> {
    if ck.meta.vdso_build_id.is_empty() {
        return Ok(());
    }
    let ours = build_id_of(std::process::id() as i32).unwrap_or_default();
    if !ours.is_empty() && ours != ck.meta.vdso_build_id {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        return Err(RestoreError::VdsoLayout(format!(
            "build id {} here, {} in the image (kernel {}); the processes would call into code that is not there",
            hex(&ours),
            hex(&ck.meta.vdso_build_id),
            ck.meta.kernel_release
        )));
    }
    Ok(())
}

/// Move the stub's [vvar], [vvar_vclock] and [vdso] (as `maps` lists
/// them) to where the image had them, through the free `park` range;
/// `ip` is the stub's `syscall` instruction, in its vDSO. Those the
/// program had unmapped go: a [vvar] at once, the [vdso] (whose `syscall`
/// instruction the stub runs) stays parked until [`unmap_parked`].
pub fn move_to_saved(
    stub: &mut Stub<'_>,
    maps: &[MapEntry],
    saved: &[Vma],
    park: u64,
    ip: u64,
) -> Result<(), RestoreError> {
    let mut moves = Vec::new();
    for kind in [VmaKind::Vvar, VmaKind::VvarVclock, VmaKind::Vdso] {
        let name = kind.special_name().unwrap_or("?");
        let here = maps.iter().find(|m| m.path == name);
        let there = saved.iter().find(|v| v.kind == kind);
        match (here, there) {
            (None, None) => {}
            (Some(h), Some(t)) if h.len() == t.len() => {
                moves.push((name, h.start, Some(t.start), h.len()))
            }
            (Some(h), None) if kind == VmaKind::Vdso => moves.push((name, h.start, None, h.len())),
            (Some(h), None) => {
                stub.call("munmap", libc::SYS_munmap, [h.start, h.len(), 0, 0, 0, 0])
                    .step(|| format!("cannot unmap {name}, which the image lacks"))?;
            }
            (h, t) => {
                return Err(RestoreError::VdsoLayout(format!(
                    "{name}: {} pages here, {} in the image",
                    h.map_or(0, |m| m.len() / PAGE_SIZE),
                    t.map_or(0, |v| v.len() / PAGE_SIZE)
                )))
            }
        }
    }
    let flags = (libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED) as u64;
    let vdso_here = moves.iter().find(|m| m.0 == "[vdso]").map_or(0, |m| m.1);
    // Park first, so a target may overlap where another one is now.
    let mut parked = Vec::new();
    let mut at = park;
    for &(name, from, to, len) in &moves {
        if Some(from) == to {
            continue;
        }
        stub.call("mremap", libc::SYS_mremap, [from, len, len, flags, at, 0])
            .step(|| format!("cannot move {name}"))?;
        if name == "[vdso]" {
            stub.inj.set_syscall_ip(ip - from + at);
        }
        if let Some(to) = to {
            parked.push((name, at, to, len));
        }
        at += len;
    }
    for (name, from, to, len) in parked {
        stub.call("mremap", libc::SYS_mremap, [from, len, len, flags, to, 0])
            .step(|| format!("cannot move {name} to {to:#x}"))?;
        if name == "[vdso]" {
            stub.inj.set_syscall_ip(ip - vdso_here + to);
        }
    }
    Ok(())
}

/// For a process that had unmapped its [vdso] (kept parked by
/// [`move_to_saved`] while the stub ran its calls there): unmap it, and
/// run the calls left from a `syscall` instruction of the restored
/// program's own code.
pub fn unmap_parked(stub: &mut Stub<'_>, saved: &[Vma]) -> Result<(), RestoreError> {
    if saved.iter().any(|v| v.kind == VmaKind::Vdso) {
        return Ok(());
    }
    let pid = stub.pid();
    let Some(v) = proc::maps(pid)?.into_iter().find(|m| m.path == "[vdso]") else {
        return Ok(());
    };
    let ip = cr_sys::remote::find_syscall_insn_outside(pid, v.start, v.end)?;
    stub.call("munmap", libc::SYS_munmap, [v.start, v.len(), 0, 0, 0, 0])
        .step(|| "cannot unmap the [vdso], which the image lacks".into())?;
    stub.inj.set_syscall_ip(ip);
    Ok(())
}
