//! Round trip of kind "tty": a pseudo-terminal pair with its settings and
//! window size, carrying data after the restore.

use crate::kinds::testkit::round_trip;

#[test]
fn pty_round_trip() {
    let rt = round_trip(
        "tty",
        r#"
import termios, tty
m, s = os.openpty()
tty.setraw(s)
attrs = termios.tcgetattr(s)
fcntl.ioctl(s, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
"#,
        r#"
import termios
expect(termios.tcgetattr(s) == attrs, "terminal settings")
expect(struct.unpack("HHHH", fcntl.ioctl(s, termios.TIOCGWINSZ, b"\0" * 8))[:2] == (33, 101), "window size")
os.write(m, b"typed")
expect(os.read(s, 10) == b"typed", "the pair is connected")
"#,
    );
    let ptys = |c: &cr_image::model::Checkpoint| {
        c.objects
            .iter()
            .filter_map(|o| match &o.kind {
                cr_image::model::ObjectKind::Pty(p) => {
                    Some((p.index, p.termios.clone(), p.winsize.clone()))
                }
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(ptys(&rt.before).len(), 1);
    assert_eq!(ptys(&rt.before), ptys(&rt.after));
}
