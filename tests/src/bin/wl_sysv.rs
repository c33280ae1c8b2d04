//! wl_sysv WORKDIR [job]
//!
//! Two processes sharing System V IPC objects, which must survive a
//! checkpoint (continue, or --kill and restore) with their ids:
//!
//! * segment `a` (8 pages + 123 bytes, IPC_PRIVATE), attached by the parent,
//!   its last 2 pages made read-only (one attach, two mappings), inherited by
//!   the child: `shm_nattch` is 4; every page filled from a fresh seed;
//! * segment `b` (keyed), attached and then removed (IPC_RMID) while
//!   attached: it must still be there, marked SHM_DEST;
//! * segment `c`, created and filled, then detached by everyone (nobody
//!   attaches it: saved because the tree created it), locked (SHM_LOCK);
//! * a semaphore set of 3: the parent took 1 from semaphore 0, the child
//!   added 5 to semaphore 1, semaphore 2 holds 32767 (SEMVMX); each
//!   semaphore's last-operation pid is checked;
//! * a message queue of 4 messages of types 3, 1, 3, 7 (0 to 5000 bytes).
//!
//! After `go`, the child checks `a` and `b` and then writes a marker into
//! `a`, which the parent must see (the memory is still shared); the parent
//! checks everything (contents at the same addresses, the ids, values,
//! messages in order with their types, `shmdt` of `a` removes both of its
//! mappings), removes the objects and prints `OK`.
//!
//! With `job` (run under cr_run), it also checks what a job's own
//! namespaces give: getpid() is 1 and /proc/self is 1, /proc lists exactly
//! the job's two processes, and /dev/shm is private: a file there (written
//! through a shared mapping, as POSIX shm users do) keeps its content.
//! Prints `IDS a=.. b=.. c=.. sem=.. msg=..` and `SHMFILE NAME` before `READY`.

use cr_tests::wl::{self, check, errno_str};
use std::ffi::CString;

const PAGE: usize = wl::PAGE;
/// shmctl command and the mode bit it sets (<sys/shm.h>).
const SHM_LOCK: i32 = 11;
const SHM_LOCKED: u16 = 0o2000;
const A_SIZE: usize = 8 * PAGE + 123;
const B_SIZE: usize = 2 * PAGE;
const C_SIZE: usize = 3 * PAGE;
const MSGS: [(i64, usize); 4] = [(3, 10), (1, 0), (3, 5000), (7, 300)];
/// Word of page 0 of `a` the child writes its marker to; the next one is
/// the parent's answer, after which the child exits (so that `shm_nattch`
/// is read while both are attached).
const MARK: usize = 7;

/// Byte `i` of the content of segment `region` (seeded).
fn byte(seed: u64, region: u64, i: usize) -> u8 {
    (wl::mix64(seed ^ region.wrapping_mul(0x9e37) ^ (i as u64 / 8)) >> ((i % 8) * 8)) as u8
}

fn fill(seed: u64, region: u64, p: *mut u8, len: usize) {
    // SAFETY: the caller passes an attach of at least `len` writable bytes.
    let s = unsafe { std::slice::from_raw_parts_mut(p, len) };
    for (i, b) in s.iter_mut().enumerate() {
        *b = byte(seed, region, i);
    }
}

/// The first byte of `len` at `p` that is not the content of `region`
/// (the child's marker in `a` excepted).
fn differs(seed: u64, region: u64, p: *const u8, len: usize) -> Option<usize> {
    // SAFETY: the caller passes an attach of at least `len` readable bytes.
    let s = unsafe { std::slice::from_raw_parts(p, len) };
    let mark = MARK * 8..MARK * 8 + 16;
    s.iter()
        .enumerate()
        .find(|(i, b)| **b != byte(seed, region, *i) && !(region == 1 && mark.contains(i)))
        .map(|(i, _)| i)
}

fn msg_body(seed: u64, n: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| byte(seed, 100 + n as u64, i)).collect()
}

fn shm_stat(id: i32) -> Result<libc::shmid_ds, String> {
    // SAFETY: all-zero is a valid shmid_ds; IPC_STAT fills it.
    let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
    // SAFETY: see above.
    if unsafe { libc::shmctl(id, libc::IPC_STAT, &mut ds) } < 0 {
        return Err(format!("shmctl({id}, IPC_STAT): {}", errno_str()));
    }
    Ok(ds)
}

fn attach(id: i32, what: &str) -> *mut u8 {
    // SAFETY: shmat at an address the kernel chooses.
    let p = unsafe { libc::shmat(id, std::ptr::null(), 0) };
    if p as isize == -1 {
        wl::fail(&format!("shmat {what}: {}", errno_str()));
    }
    p.cast()
}

fn semop(id: i32, num: u16, op: i16) {
    let mut b = libc::sembuf {
        sem_num: num,
        sem_op: op,
        sem_flg: 0,
    };
    // SAFETY: one valid sembuf.
    check(unsafe { libc::semop(id, &mut b, 1) } as i64, "semop");
}

fn sem_get(id: i32, cmd: i32, num: i32) -> i32 {
    // SAFETY: GETVAL/GETPID take no argument.
    unsafe { libc::semctl(id, num, cmd) }
}

/// The numeric entries of /proc (the processes it shows).
fn proc_pids() -> Vec<i32> {
    let mut v: Vec<i32> = std::fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

struct Objs {
    a: i32,
    b: i32,
    c: i32,
    sem: i32,
    msg: i32,
    pa: *mut u8,
    pb: *mut u8,
}

fn child_main(seed: u64, o: &Objs, go: &wl::Go) -> ! {
    semop(o.sem, 1, 5);
    go.wait();
    let mut problems = Vec::new();
    if let Some(i) = differs(seed, 1, o.pa, A_SIZE) {
        problems.push(format!("child: segment a differs at byte {i}"));
    }
    if let Some(i) = differs(seed, 2, o.pb, B_SIZE) {
        problems.push(format!("child: segment b differs at byte {i}"));
    }
    // SAFETY: page 0 of `a` is attached read-write; MARK is inside it.
    unsafe { o.pa.cast::<u64>().add(MARK).write_volatile(seed ^ 0xc1) };
    let t0 = wl::mono_ns();
    // SAFETY: as above.
    while unsafe { o.pa.cast::<u64>().add(MARK + 1).read_volatile() } != seed ^ 0xa1 {
        if wl::mono_ns() - t0 > 30_000_000_000 {
            problems.push("child: no answer from the parent".into());
            break;
        }
        wl::sleep_ms(2);
    }
    for p in &problems {
        wl::note(p);
    }
    std::process::exit(if problems.is_empty() { 0 } else { 1 });
}

fn main() {
    let args = wl::args("wl_sysv WORKDIR [job]");
    let job = args.rest.first().is_some_and(|a| a == "job");
    let go = wl::Go::new(&args.workdir);
    let seed = wl::fresh_seed();
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let key = 0x5300_0000 | (me & 0xff_ffff);
    // SAFETY: System V calls with integer arguments; the attaches are
    // used within their sizes.
    let o = unsafe {
        let a = check(
            libc::shmget(libc::IPC_PRIVATE, A_SIZE, libc::IPC_CREAT | 0o600) as i64,
            "shmget a",
        ) as i32;
        let b = check(
            libc::shmget(key, B_SIZE, libc::IPC_CREAT | libc::IPC_EXCL | 0o640) as i64,
            "shmget b",
        ) as i32;
        let c = check(
            libc::shmget(libc::IPC_PRIVATE, C_SIZE, libc::IPC_CREAT | 0o600) as i64,
            "shmget c",
        ) as i32;
        let sem = check(
            libc::semget(key, 3, libc::IPC_CREAT | libc::IPC_EXCL | 0o600) as i64,
            "semget",
        ) as i32;
        let msg = check(
            libc::msgget(key, libc::IPC_CREAT | libc::IPC_EXCL | 0o600) as i64,
            "msgget",
        ) as i32;
        let pa = attach(a, "a");
        fill(seed, 1, pa, A_SIZE);
        check(
            libc::mprotect(pa.add(7 * PAGE).cast(), 2 * PAGE, libc::PROT_READ) as i64,
            "mprotect a",
        );
        let pb = attach(b, "b");
        fill(seed, 2, pb, B_SIZE);
        check(
            libc::shmctl(b, libc::IPC_RMID, std::ptr::null_mut()) as i64,
            "IPC_RMID b",
        );
        let pc = attach(c, "c");
        fill(seed, 3, pc, C_SIZE);
        check(libc::shmdt(pc.cast()) as i64, "shmdt c");
        check(
            libc::shmctl(c, SHM_LOCK, std::ptr::null_mut()) as i64,
            "SHM_LOCK c",
        );
        let mut vals = [(seed % 100) as u16 + 10, 0, 32767];
        check(
            libc::semctl(sem, 0, libc::SETALL, vals.as_mut_ptr()) as i64,
            "SETALL",
        );
        Objs {
            a,
            b,
            c,
            sem,
            msg,
            pa,
            pb,
        }
    };
    let v0 = (seed % 100) as i32 + 10;
    semop(o.sem, 0, -1);
    for (n, &(t, len)) in MSGS.iter().enumerate() {
        let mut buf = t.to_ne_bytes().to_vec();
        buf.extend(msg_body(seed, n, len));
        // SAFETY: buf is a struct msgbuf with `len` bytes of text.
        check(
            unsafe { libc::msgsnd(o.msg, buf.as_ptr().cast(), len, 0) } as i64,
            "msgsnd",
        );
    }
    let shm_file = format!("/dev/shm/wl-sysv-{seed:016x}");
    let shm_map = job.then(|| {
        let path = CString::new(shm_file.clone()).expect("no NUL");
        // SAFETY: open/ftruncate/mmap of a new file; the mapping is used
        // within its size.
        unsafe {
            let fd = check(
                libc::open(
                    path.as_ptr(),
                    libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
                    0o600,
                ) as i64,
                "open /dev/shm file",
            ) as i32;
            check(libc::ftruncate(fd, PAGE as i64 * 2) as i64, "ftruncate");
            let p = libc::mmap(
                std::ptr::null_mut(),
                2 * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            if p == libc::MAP_FAILED {
                wl::fail(&format!("mmap /dev/shm file: {}", errno_str()));
            }
            libc::close(fd);
            fill(seed, 4, p.cast(), 2 * PAGE);
            p.cast::<u8>()
        }
    });
    // SAFETY: fork of a single-threaded process.
    let child = unsafe { libc::fork() };
    if child == 0 {
        child_main(seed, &o, &go);
    }
    check(child as i64, "fork");
    let t0 = wl::mono_ns();
    while sem_get(o.sem, libc::GETVAL, 1) != 5 {
        if wl::mono_ns() - t0 > 30_000_000_000 {
            wl::fail("the child did not operate on the semaphore");
        }
        wl::sleep_ms(5);
    }
    wl::say(&format!(
        "IDS a={} b={} c={} sem={} msg={}",
        o.a, o.b, o.c, o.sem, o.msg
    ));
    if job {
        wl::say(&format!("SHMFILE {shm_file}"));
    }
    wl::say("READY");
    go.wait();

    let mut problems: Vec<String> = Vec::new();
    let mut expect = |ok: bool, what: String| {
        if !ok {
            problems.push(what);
        }
    };
    // Shared memory.
    match shm_stat(o.a) {
        Ok(ds) => expect(
            ds.shm_segsz == A_SIZE && ds.shm_nattch == 4 && ds.shm_perm.mode & 0o777 == 0o600,
            format!(
                "segment a: size {} nattch {} mode {:o}",
                ds.shm_segsz, ds.shm_nattch, ds.shm_perm.mode
            ),
        ),
        Err(e) => expect(false, e),
    }
    expect(
        differs(seed, 1, o.pa, A_SIZE).is_none(),
        "segment a's memory differs".into(),
    );
    let maps = wl::read_maps();
    let base = o.pa as usize;
    expect(
        wl::check_mapping(&maps, "a", base, 7 * PAGE, "rw-s", None).is_ok()
            && wl::check_mapping(&maps, "a", base + 7 * PAGE, 2 * PAGE, "r--s", None).is_ok(),
        "segment a's mappings and protections".into(),
    );
    match shm_stat(o.b) {
        Ok(ds) => expect(
            ds.shm_perm.mode as u32 & 0o1000 != 0 && ds.shm_perm.__key == 0,
            format!(
                "segment b is not removed-while-attached (mode {:o})",
                ds.shm_perm.mode
            ),
        ),
        Err(e) => expect(false, e),
    }
    expect(
        differs(seed, 2, o.pb, B_SIZE).is_none(),
        "segment b's memory differs".into(),
    );
    match shm_stat(o.c) {
        Ok(ds) => expect(
            ds.shm_nattch == 0 && ds.shm_perm.mode & SHM_LOCKED != 0,
            format!(
                "segment c: nattch {}, mode {:o} (SHM_LOCKED expected)",
                ds.shm_nattch, ds.shm_perm.mode
            ),
        ),
        Err(e) => expect(false, e),
    }
    let pc = attach(o.c, "c");
    expect(
        differs(seed, 3, pc, C_SIZE).is_none(),
        "segment c's memory differs".into(),
    );
    // Semaphores.
    let vals: Vec<i32> = (0..3).map(|i| sem_get(o.sem, libc::GETVAL, i)).collect();
    expect(
        vals == vec![v0 - 1, 5, 32767],
        format!("semaphore values {vals:?}"),
    );
    let pids: Vec<i32> = (0..3).map(|i| sem_get(o.sem, libc::GETPID, i)).collect();
    expect(
        pids[0] == me && pids[1] == child,
        format!("last-operation pids {pids:?} (parent {me}, child {child})"),
    );
    // Messages, in order, with their types.
    for (n, &(t, len)) in MSGS.iter().enumerate() {
        let mut buf = vec![0u8; 8 + 8192];
        // SAFETY: buf holds a long and 8192 bytes.
        let r = unsafe { libc::msgrcv(o.msg, buf.as_mut_ptr().cast(), 8192, 0, libc::IPC_NOWAIT) };
        let mtype = i64::from_ne_bytes(buf[..8].try_into().expect("8 bytes"));
        expect(
            r == len as isize && mtype == t && buf[8..8 + len] == msg_body(seed, n, len)[..],
            format!("message {n}: got {r} bytes of type {mtype}, want {len} of type {t}"),
        );
    }
    if job {
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        let self_link = std::fs::read_link("/proc/self").map(|p| p.display().to_string());
        expect(
            pid == 1 && self_link.as_ref().is_ok_and(|l| l == "1"),
            format!("getpid {pid}, /proc/self -> {self_link:?}"),
        );
        let listed = proc_pids();
        expect(
            listed == vec![1, child],
            format!("/proc lists {listed:?}, not the job's processes 1 and {child}"),
        );
        if let Some(p) = shm_map {
            expect(
                differs(seed, 4, p, 2 * PAGE).is_none(),
                "the /dev/shm file's mapping differs".into(),
            );
        }
        match std::fs::read(&shm_file) {
            Ok(data) => expect(
                data.len() == 2 * PAGE && differs(seed, 4, data.as_ptr(), 2 * PAGE).is_none(),
                format!("{shm_file} has {} bytes, or others", data.len()),
            ),
            Err(e) => expect(false, format!("{shm_file}: {e}")),
        }
        let _ = std::fs::remove_file(&shm_file);
    }
    // The child still shares `a`: its marker shows here, our answer there.
    let t0 = wl::mono_ns();
    let seen = loop {
        // SAFETY: page 0 of `a` is attached read-write.
        if unsafe { o.pa.cast::<u64>().add(MARK).read_volatile() } == seed ^ 0xc1 {
            break true;
        }
        if wl::mono_ns() - t0 > 30_000_000_000 {
            break false;
        }
        wl::sleep_ms(2);
    };
    expect(
        seen,
        "the child's write to a is not seen: not shared".into(),
    );
    // SAFETY: as above.
    unsafe { o.pa.cast::<u64>().add(MARK + 1).write_volatile(seed ^ 0xa1) };
    let mut status = 0;
    // SAFETY: waiting for our child.
    let w = unsafe { libc::waitpid(child, &mut status, 0) };
    expect(
        w == child && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        format!("the child's checks (status {status:#x})"),
    );

    // shmdt of a's base address detaches both of its mappings.
    // SAFETY: `a` and `c` are our attaches.
    unsafe {
        expect(
            libc::shmdt(o.pa.cast()) == 0,
            format!("shmdt a: {}", errno_str()),
        );
        libc::shmdt(pc.cast());
    }
    let left = wl::read_maps()
        .iter()
        .any(|m| m.start < base + 9 * PAGE && m.end > base);
    expect(!left, "shmdt of a left a mapping".into());
    // SAFETY: removing our objects.
    unsafe {
        libc::shmctl(o.a, libc::IPC_RMID, std::ptr::null_mut());
        libc::shmctl(o.c, libc::IPC_RMID, std::ptr::null_mut());
        libc::semctl(o.sem, 0, libc::IPC_RMID);
        libc::msgctl(o.msg, libc::IPC_RMID, std::ptr::null_mut());
    }
    wl::finish(&problems);
}
