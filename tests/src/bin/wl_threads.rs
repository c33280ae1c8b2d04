//! Workload: many threads, checked from inside after restore.
//!
//! N workers (default 16) each add to their own counter and, under a mutex,
//! to a shared total, sleeping a little between rounds; each keeps its index
//! in thread-local storage (so a wrong fs base after restore is caught). One
//! more thread waits on a condition variable (a futex wait with no timeout)
//! for a value the main thread sends at the end. The main thread prints
//! `total N` every 100 ms until `<workdir>/go` appears, then stops and joins
//! everyone and checks: the per-thread counters add up to the total, every
//! worker made progress, TLS is intact, the waiter got the value. Prints OK
//! or FAIL: reason.
//!
//! Usage: wl_threads WORKDIR [N]

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

thread_local! {
    static INDEX: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn say(s: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = std::path::PathBuf::from(args.next().expect("usage: wl_threads WORKDIR [N]"));
    let n: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(16);
    let total = Arc::new(Mutex::new(0u64));
    let per: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let mailbox = Arc::new((Mutex::new(None::<u64>), Condvar::new()));

    let workers: Vec<_> = (0..n)
        .map(|i| {
            let (total, per, stop) = (total.clone(), per.clone(), stop.clone());
            std::thread::spawn(move || {
                INDEX.with(|c| c.set(i));
                while !stop.load(Ordering::SeqCst) {
                    {
                        let mut t = total.lock().expect("lock");
                        *t += 1;
                        per[i].fetch_add(1, Ordering::SeqCst);
                    }
                    std::thread::sleep(Duration::from_millis(2 + (i as u64 % 5)));
                }
                INDEX.with(|c| c.get()) == i
            })
        })
        .collect();
    let waiter = {
        let mailbox = mailbox.clone();
        std::thread::spawn(move || {
            let (m, cv) = &*mailbox;
            let mut v = m.lock().expect("lock");
            while v.is_none() {
                v = cv.wait(v).expect("condvar wait");
            }
            v.expect("value")
        })
    };
    while per.iter().any(|c| c.load(Ordering::SeqCst) == 0) {
        std::thread::sleep(Duration::from_millis(5));
    }
    say("READY");
    while !dir.join("go").exists() {
        say(&format!("total {}", *total.lock().expect("lock")));
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::SeqCst);
    let mut fails = Vec::new();
    for (i, w) in workers.into_iter().enumerate() {
        match w.join() {
            Ok(true) => {}
            Ok(false) => fails.push(format!("thread {i}: thread-local index lost")),
            Err(_) => fails.push(format!("thread {i} panicked")),
        }
    }
    {
        let (m, cv) = &*mailbox;
        *m.lock().expect("lock") = Some(4242);
        cv.notify_all();
    }
    match waiter.join() {
        Ok(4242) => {}
        other => fails.push(format!("condvar waiter returned {other:?}")),
    }
    let sum: u64 = per.iter().map(|c| c.load(Ordering::SeqCst)).sum();
    let t = *total.lock().expect("lock");
    if sum != t {
        fails.push(format!("per-thread counters add up to {sum}, total is {t}"));
    }
    if fails.is_empty() {
        say("OK");
    } else {
        say(&format!("FAIL: {}", fails.join("; ")));
        std::process::exit(1);
    }
}
