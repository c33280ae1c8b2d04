//! wl_append WORKDIR [SLEEP_MS]
//!
//! Writes numbered fixed-size records in a loop (short sleeps between) to two
//! files: `append.dat` opened O_WRONLY|O_APPEND and `plain.dat` opened O_WRONLY.
//! Also holds fds of other supported kinds: a read-only file at a known offset,
//! a directory, /dev/null, /dev/zero, /dev/urandom, a read-write fd 200 without
//! FD_CLOEXEC, and a sparse file positioned beyond 4 GiB.
//!
//! At `go`: the offsets of both writers match its own count of bytes written,
//! both files hold every record exactly once and in order, the other fds still
//! work and have their flags/offsets; prints `records N`, then OK or FAIL.

use std::ffi::CString;

use cr_tests::wl;

const REC: usize = 64;

fn record(i: u64) -> [u8; REC] {
    let mut r = [b'.'; REC];
    let head = format!("rec {i:010} {:016x} ", wl::mix64(i));
    r[..head.len()].copy_from_slice(head.as_bytes());
    r[REC - 1] = b'\n';
    r
}

fn open(path: &std::path::Path, flags: i32) -> i32 {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).expect("no NUL");
    // SAFETY: c is a valid path string.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC, 0o644) };
    if fd < 0 {
        wl::fail(&format!(
            "open {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    fd
}

fn getfl(fd: i32) -> i32 {
    // SAFETY: fcntl F_GETFL on an fd number (returns -1 if not open).
    unsafe { libc::fcntl(fd, libc::F_GETFL) }
}

fn lseek_cur(fd: i32) -> i64 {
    // SAFETY: lseek on an fd number (returns -1 if not open).
    unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) }
}

fn read_fd(fd: i32, n: usize) -> Result<Vec<u8>, String> {
    let mut buf = vec![0u8; n];
    // SAFETY: buf has n writable bytes.
    let r = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), n) };
    if r < 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    buf.truncate(r as usize);
    Ok(buf)
}

fn check_file(path: &std::path::Path, n: u64, problems: &mut Vec<String>) {
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) => {
            problems.push(format!("read {}: {e}", path.display()));
            return;
        }
    };
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    if data.len() as u64 != n * REC as u64 {
        problems.push(format!(
            "{name}: {} bytes, expected {} ({n} records of {REC})",
            data.len(),
            n * REC as u64
        ));
    }
    for (i, chunk) in data.chunks(REC).enumerate() {
        if chunk != record(i as u64) {
            problems.push(format!(
                "{name}: record #{i} at offset {} is {:?}",
                i * REC,
                String::from_utf8_lossy(chunk)
            ));
            break;
        }
    }
}

fn main() {
    let args = wl::args("wl_append WORKDIR [SLEEP_MS]");
    let sleep_ms: u64 = args
        .rest
        .first()
        .map(|s| s.parse().unwrap_or_else(|_| wl::fail("bad SLEEP_MS")))
        .unwrap_or(5);
    let state = wl::ProcState::setup(&args.workdir);
    let go = wl::Go::new(&args.workdir);
    let dir = args.workdir.join("files");
    if let Err(e) = std::fs::create_dir_all(&dir) {
        wl::fail(&format!("mkdir: {e}"));
    }
    let append_path = dir.join("append.dat");
    let plain_path = dir.join("plain.dat");
    let ro_path = dir.join("readonly.dat");

    // A read-only file left at a known offset.
    let ro_content: Vec<u8> = (0..100_000u32)
        .map(|i| (wl::mix64(i as u64) & 0xff) as u8)
        .collect();
    if let Err(e) = std::fs::write(&ro_path, &ro_content) {
        wl::fail(&format!("write readonly.dat: {e}"));
    }
    let ro_off = 12_345usize;

    let fd_app = open(
        &append_path,
        libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_APPEND,
    );
    let fd_plain = open(&plain_path, libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC);
    let fd_ro = open(&ro_path, libc::O_RDONLY);
    // SAFETY: lseek on our own fd.
    unsafe { libc::lseek(fd_ro, ro_off as i64, libc::SEEK_SET) };
    let fd_dir = open(&dir, libc::O_RDONLY | libc::O_DIRECTORY);
    let fd_null = open(std::path::Path::new("/dev/null"), libc::O_WRONLY);
    let fd_zero = open(std::path::Path::new("/dev/zero"), libc::O_RDONLY);
    let fd_rand = open(std::path::Path::new("/dev/urandom"), libc::O_RDONLY);
    // A read-write fd without FD_CLOEXEC at a high number, left mid-file.
    let rw_path = dir.join("readwrite.dat");
    let rw_content: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
    if let Err(e) = std::fs::write(&rw_path, &rw_content) {
        wl::fail(&format!("write readwrite.dat: {e}"));
    }
    let tmp = open(&rw_path, libc::O_RDWR);
    const FD_RW: i32 = 200;
    // SAFETY: dup2/close/lseek on our own fds (dup2 clears FD_CLOEXEC on the copy).
    unsafe {
        if libc::dup2(tmp, FD_RW) != FD_RW {
            wl::fail("dup2");
        }
        libc::close(tmp);
        libc::lseek(FD_RW, 500, libc::SEEK_SET);
    }
    // A sparse file read at an offset beyond 4 GiB.
    let big_path = dir.join("sparse-big.dat");
    let fd_big = open(&big_path, libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC);
    const BIG_OFF: i64 = (5 << 30) + 12_345;
    // SAFETY: our fd and a valid 8-byte buffer.
    unsafe {
        libc::pwrite(fd_big, b"far away".as_ptr().cast(), 8, BIG_OFF);
        libc::lseek(fd_big, BIG_OFF, libc::SEEK_SET);
    }
    let all = [
        fd_app, fd_plain, fd_ro, fd_dir, fd_null, fd_zero, fd_rand, FD_RW, fd_big,
    ];
    let flags_before: Vec<i32> = all.iter().map(|&fd| getfl(fd)).collect();
    // SAFETY: fcntl F_GETFD on fd numbers.
    let fdflags_before: Vec<i32> = all
        .iter()
        .map(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) })
        .collect();
    wl::note(&format!("fds {all:?} flags {flags_before:x?}"));

    let mut written: u64 = 0;
    let mut n: u64 = 0;
    loop {
        let r = record(n);
        if let Err(e) = wl::write_all_fd(fd_app, &r) {
            wl::fail(&e);
        }
        if let Err(e) = wl::write_all_fd(fd_plain, &r) {
            wl::fail(&e);
        }
        n += 1;
        written += REC as u64;
        if n == 20 {
            wl::say("READY");
        }
        if n >= 20 && go.check() {
            break;
        }
        wl::sleep_ms(sleep_ms);
    }
    wl::say(&format!("records {n}"));

    let mut problems = Vec::new();
    for (fd, name) in [(fd_app, "append.dat"), (fd_plain, "plain.dat")] {
        let pos = lseek_cur(fd);
        if pos != written as i64 {
            problems.push(format!(
                "{name}: offset {pos}, but {written} bytes were written"
            ));
        }
    }
    let flags_after: Vec<i32> = all.iter().map(|&fd| getfl(fd)).collect();
    if flags_after != flags_before {
        problems.push(format!(
            "file status flags of fds {all:?} are {flags_after:x?}, were {flags_before:x?}"
        ));
    }
    // SAFETY: fcntl F_GETFD on fd numbers.
    let fdflags_after: Vec<i32> = all
        .iter()
        .map(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) })
        .collect();
    if fdflags_after != fdflags_before {
        problems.push(format!(
            "fd flags (FD_CLOEXEC) of fds {all:?} are {fdflags_after:?}, were {fdflags_before:?}"
        ));
    }
    let pos = lseek_cur(FD_RW);
    if pos != 500 {
        problems.push(format!(
            "readwrite.dat (fd {FD_RW}): offset {pos}, expected 500"
        ));
    } else {
        match read_fd(FD_RW, 100) {
            Ok(b) if b == rw_content[500..600] => {}
            Ok(b) => problems.push(format!("readwrite.dat: wrong bytes at 500: {b:?}")),
            Err(e) => problems.push(format!("readwrite.dat: read: {e}")),
        }
        if let Err(e) = wl::write_all_fd(FD_RW, b"written after restore") {
            problems.push(format!("readwrite.dat: {e}"));
        }
    }
    let pos = lseek_cur(fd_big);
    if pos != BIG_OFF {
        problems.push(format!("sparse-big.dat: offset {pos}, expected {BIG_OFF}"));
    } else {
        match read_fd(fd_big, 8) {
            Ok(b) if b == b"far away" => {}
            other => problems.push(format!("sparse-big.dat: read at 5 GiB gave {other:?}")),
        }
    }
    if getfl(fd_app) & libc::O_APPEND == 0 {
        problems.push("append.dat lost O_APPEND".into());
    }
    check_file(&append_path, n, &mut problems);
    check_file(&plain_path, n, &mut problems);

    // Read-only file: offset and content.
    let pos = lseek_cur(fd_ro);
    if pos != ro_off as i64 {
        problems.push(format!("readonly.dat: offset {pos}, expected {ro_off}"));
    } else {
        match read_fd(fd_ro, 100) {
            Ok(b) if b == ro_content[ro_off..ro_off + 100] => {}
            Ok(b) => problems.push(format!("readonly.dat: wrong bytes at {ro_off}: {b:?}")),
            Err(e) => problems.push(format!("readonly.dat: read: {e}")),
        }
    }
    // Directory fd: a file opened relative to it is the same file.
    let c = CString::new("append.dat").expect("no NUL");
    // SAFETY: openat with a valid relative path.
    let fd = unsafe { libc::openat(fd_dir, c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        problems.push(format!(
            "openat(dir fd, append.dat): {}",
            std::io::Error::last_os_error()
        ));
    } else {
        // SAFETY: stat is plain data; fstat on our fds.
        let (mut a, mut b): (libc::stat, libc::stat) = unsafe { std::mem::zeroed() };
        // SAFETY: valid fds and stat buffers.
        unsafe {
            libc::fstat(fd, &mut a);
            libc::fstat(fd_app, &mut b);
            libc::close(fd);
        }
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) {
            problems.push("dir fd: append.dat relative to it is another file".into());
        }
    }
    // Devices.
    match read_fd(fd_zero, 4096) {
        Ok(b) if b.len() == 4096 && b.iter().all(|&x| x == 0) => {}
        Ok(b) => problems.push(format!("/dev/zero gave {} bytes, not all zero", b.len())),
        Err(e) => problems.push(format!("read /dev/zero: {e}")),
    }
    match read_fd(fd_rand, 64) {
        Ok(b) if b.len() == 64 && b.iter().any(|&x| x != 0) => {}
        Ok(b) => problems.push(format!("/dev/urandom gave {b:?}")),
        Err(e) => problems.push(format!("read /dev/urandom: {e}")),
    }
    if let Err(e) = wl::write_all_fd(fd_null, b"discarded") {
        problems.push(format!("write /dev/null: {e}"));
    }
    for (fd, want) in [
        (fd_dir, dir.clone()),
        (fd_null, "/dev/null".into()),
        (fd_zero, "/dev/zero".into()),
        (fd_rand, "/dev/urandom".into()),
        (fd_app, append_path.clone()),
    ] {
        match std::fs::read_link(format!("/proc/self/fd/{fd}")) {
            Ok(p) if p == want => {}
            Ok(p) => problems.push(format!(
                "fd {fd} is {}, expected {}",
                p.display(),
                want.display()
            )),
            Err(e) => problems.push(format!("fd {fd}: {e}")),
        }
    }
    state.verify(&mut problems);
    wl::finish(&problems);
}
