//! wl_counter WORKDIR [SLEEP_MS]
//!
//! Increments a counter in a loop with short sleeps and prints every value as
//! `count N`. Keeps a running checksum of the sequence (and a copy of the
//! counter) in memory. At `go`: prints `final N`, recomputes the checksum of
//! 1..=N and compares, checks pid/cwd/umask, prints OK or FAIL. If the go file
//! holds `exit N`, it exits with status N after printing OK (to test how exit
//! statuses are passed on).

use cr_tests::wl;

fn step(sum: u64, n: u64) -> u64 {
    wl::mix64(sum ^ n).rotate_left(7) ^ n
}

fn main() {
    let args = wl::args("wl_counter WORKDIR [SLEEP_MS]");
    let sleep_ms: u64 = args
        .rest
        .first()
        .map(|s| s.parse().unwrap_or_else(|_| wl::fail("bad SLEEP_MS")))
        .unwrap_or(5);
    let state = wl::ProcState::setup(&args.workdir);
    let go = wl::Go::new(&args.workdir);

    let mut count: u64 = 0;
    let mut shadow: u64 = !0; // a second copy, kept as !count
    let mut sum: u64 = 0;
    loop {
        count += 1;
        shadow = !(!shadow + 1);
        sum = step(sum, count);
        wl::say(&format!("count {count}"));
        if count == 10 {
            wl::say("READY");
        }
        if count >= 10 && go.check() {
            break;
        }
        wl::sleep_ms(sleep_ms);
    }
    wl::say(&format!("final {count}"));
    let mut problems = Vec::new();
    if !shadow != count {
        problems.push(format!("shadow counter {} != count {count}", !shadow));
    }
    let mut s = 0;
    for n in 1..=count {
        s = step(s, n);
    }
    if s != sum {
        problems.push(format!(
            "checksum of 1..={count} is {s:#x}, memory has {sum:#x}"
        ));
    }
    state.verify(&mut problems);
    let go_text = std::fs::read_to_string(args.workdir.join("go")).unwrap_or_default();
    if let Some(code) = go_text.trim().strip_prefix("exit ") {
        if problems.is_empty() {
            wl::say("OK");
            std::process::exit(code.parse().unwrap_or(99));
        }
    }
    wl::finish(&problems);
}
