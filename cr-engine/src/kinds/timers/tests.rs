//! Round trip of kind "timers": an interval timer keeps its period and the
//! time it had left.

use crate::kinds::testkit::round_trip;

#[test]
fn interval_timer_round_trip() {
    let rt = round_trip(
        "timers",
        r#"
signal.signal(signal.SIGALRM, lambda s, f: None)
signal.setitimer(signal.ITIMER_REAL, 300, 7)
"#,
        r#"
left, interval = signal.getitimer(signal.ITIMER_REAL)
expect(0 < left <= 300 and interval == 7, "timer %r %r" % (left, interval))
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(a.timers.itimers.len(), 1);
    assert_eq!(
        a.timers.itimers[0].interval_us,
        b.timers.itimers[0].interval_us
    );
    assert!(b.timers.itimers[0].value_us <= a.timers.itimers[0].value_us);
}
