//! Round trip of kind "fds": numbers with gaps and a high one, close-on-exec
//! flags, an open file description shared by dup (one offset for both).

use crate::kinds::testkit::round_trip;

#[test]
fn fd_table_round_trip() {
    let rt = round_trip(
        "fds",
        r#"
p = os.path.join(DIR, "shared")
a = os.open(p, os.O_RDWR | os.O_CREAT)
os.write(a, b"0123456789")
b = os.dup(a)                 # one description, one offset
high = os.dup2(a, 900)
os.set_inheritable(a, True)
os.set_inheritable(high, False)
gap = os.open("/dev/null", os.O_RDONLY)
os.close(gap)
"#,
        r#"
os.lseek(a, 3, os.SEEK_SET)
expect(os.lseek(b, 0, os.SEEK_CUR) == 3 and os.lseek(high, 0, os.SEEK_CUR) == 3, "one offset")
expect(os.get_inheritable(a) and not os.get_inheritable(high), "close-on-exec flags")
expect(not os.path.exists("/proc/self/fd/%d" % gap), "the gap")
"#,
    );
    let (a, b) = rt.roots();
    let table = |p: &cr_image::model::Process| {
        p.fds
            .iter()
            .map(|f| (f.fd, f.flags, f.shared.map(|s| s.fd), f.kind.name()))
            .collect::<Vec<_>>()
    };
    assert_eq!(table(a), table(b));
    assert!(a.fds.iter().any(|f| f.fd == 900 && f.shared.is_some()));
}
