//! ELF files and images read with goblin: the GNU build id of an
//! executable (to tell later whether the file is still the same) and of a
//! process's vDSO (code the process calls at fixed addresses).

use crate::error::{io_err, Result};
use goblin::elf::note::NT_GNU_BUILD_ID;
use goblin::elf::Elf;

/// The GNU build id in the ELF image `bytes` (empty when it has none).
pub fn build_id(bytes: &[u8]) -> Vec<u8> {
    let Ok(header) = Elf::parse_header(bytes) else {
        return Vec::new();
    };
    let Ok(mut elf) = Elf::lazy_parse(header) else {
        return Vec::new();
    };
    let ctx = goblin::container::Ctx::new(
        if header.e_ident[goblin::elf::header::EI_CLASS] == goblin::elf::header::ELFCLASS64 {
            goblin::container::Container::Big
        } else {
            goblin::container::Container::Little
        },
        goblin::container::Endian::Little,
    );
    let Ok(phdrs) = goblin::elf::ProgramHeader::parse(
        bytes,
        header.e_phoff as usize,
        header.e_phnum as usize,
        ctx,
    ) else {
        return Vec::new();
    };
    elf.program_headers = phdrs;
    let Some(notes) = elf.iter_note_headers(bytes) else {
        return Vec::new();
    };
    notes
        .flatten()
        .find(|n| n.n_type == NT_GNU_BUILD_ID && n.name == "GNU")
        .map(|n| n.desc.to_vec())
        .unwrap_or_default()
}

/// The GNU build id of the ELF file at `path` (mapped, not read whole).
pub fn file_build_id(path: &str) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path).map_err(io_err(path))?;
    let map = crate::mem::FileMap::map(&file, path)?;
    Ok(build_id(map.bytes()))
}

/// The GNU build id of the ELF image mapped at `start..end` in process
/// `pid` (its vDSO).
pub fn mapped_build_id(pid: i32, start: u64, end: u64) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; (end - start).min(1 << 20) as usize];
    crate::mem::read_vm(pid, start, &mut buf)?;
    Ok(build_id(&buf))
}

/// The function of ELF file `path`, loaded at `base`, that holds code
/// address `addr`, from its full symbol table (static functions too) when
/// the file is not stripped.
pub fn function_at(path: &str, base: u64, addr: u64) -> Option<String> {
    let bytes = std::fs::read(path).ok()?;
    let elf = Elf::parse(&bytes).ok()?;
    // Symbols of a position-independent object are relative to its base.
    let at = if elf.header.e_type == goblin::elf::header::ET_EXEC {
        addr
    } else {
        addr.checked_sub(base)?
    };
    elf.syms
        .iter()
        .find(|s| s.is_function() && s.st_value <= at && at < s.st_value + s.st_size.max(1))
        .and_then(|s| elf.strtab.get_at(s.st_name))
        .map(str::to_string)
}
