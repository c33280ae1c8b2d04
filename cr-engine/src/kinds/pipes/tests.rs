//! Round trip of kind "pipes": a pipe and a FIFO holding buffered bytes,
//! with the pipe's capacity.

use crate::kinds::testkit::round_trip;

#[test]
fn pipes_round_trip() {
    let rt = round_trip(
        "pipes",
        r#"
r, w = os.pipe()
fcntl.fcntl(w, 1031, 1 << 20)     # F_SETPIPE_SZ
os.write(w, b"in the pipe" * 100)
fifo = os.path.join(DIR, "fifo")
os.mkfifo(fifo)
fr = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
fw = os.open(fifo, os.O_WRONLY)
os.write(fw, b"in the fifo")
"#,
        r#"
expect(os.read(r, 2000) == b"in the pipe" * 100, "pipe data")
expect(fcntl.fcntl(w, 1032) == 1 << 20, "pipe capacity")       # F_GETPIPE_SZ
expect(os.read(fr, 100) == b"in the fifo", "fifo data")
os.write(w, b"more")
expect(os.read(r, 10) == b"more", "the pipe still works")
"#,
    );
    let buffered = |c: &cr_image::model::Checkpoint| {
        let mut v: Vec<_> = c
            .objects
            .iter()
            .filter_map(|o| match &o.kind {
                cr_image::model::ObjectKind::Pipe(p) => Some((p.data.clone(), p.capacity)),
                cr_image::model::ObjectKind::Fifo(f) => Some((f.data.clone(), f.capacity)),
                _ => None,
            })
            .collect();
        v.sort();
        v
    };
    assert_eq!(buffered(&rt.before), buffered(&rt.after));
}
