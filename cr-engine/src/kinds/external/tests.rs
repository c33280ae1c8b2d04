//! `--inherit-fd` specifications (the round trips with real processes are
//! in tests/tests/external.rs: the other end of the fd must be held by a
//! process outside the tree).

use crate::options::{Binding, ExternalFd, InheritFd};

fn parse(s: &str) -> Result<InheritFd, String> {
    s.parse()
}

#[test]
fn forms_of_fd_and_target() {
    let cases = [
        (
            "5=/var/log/a.log",
            ExternalFd::Number(5),
            Binding::Path("/var/log/a.log".into()),
        ),
        (
            "123:7=fd:3",
            ExternalFd::OfProcess(123, 7),
            Binding::OwnFd(3),
        ),
        (
            "pipe:[99]=fd:0",
            ExternalFd::Key("pipe:[99]".into()),
            Binding::OwnFd(0),
        ),
        (
            "/dev/pts/3=/tmp/x=y",
            ExternalFd::Key("/dev/pts/3".into()),
            Binding::Path("/tmp/x=y".into()),
        ),
    ];
    for (text, which, to) in cases {
        let b = parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(b, InheritFd { which, to }, "{text}");
        assert_eq!(b.to_string(), text, "shown as given");
    }
}

#[test]
fn bad_specifications_are_refused() {
    for bad in ["5", "=/tmp/x", "5=", "5=fd:x", "5=fd:-1"] {
        assert!(parse(bad).is_err(), "{bad} was accepted");
    }
}

#[test]
fn what_a_binding_binds() {
    let n = parse("5=/x").unwrap();
    let p = parse("10:5=/x").unwrap();
    let k = parse("pipe:[7]=/x").unwrap();
    assert!(n.binds(10, 5, "pipe:[1]") && n.binds(11, 5, "x") && !n.binds(10, 6, "pipe:[1]"));
    assert!(p.binds(10, 5, "y") && !p.binds(11, 5, "y"));
    assert!(k.binds(1, 3, "pipe:[7]") && !k.binds(1, 3, "pipe:[8]"));
}
