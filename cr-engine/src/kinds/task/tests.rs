//! Round trip of kind "task": working directory, umask, name, personality.

use crate::kinds::testkit::round_trip;

#[test]
fn task_attributes_round_trip() {
    let rt = round_trip(
        "task",
        r#"
os.mkdir(os.path.join(DIR, "work dir"))
os.chdir(os.path.join(DIR, "work dir"))
os.umask(0o027)
libc.prctl(15, b"cr-task-test", 0, 0, 0)          # PR_SET_NAME
libc.personality(0x0040000)                        # ADDR_NO_RANDOMIZE
"#,
        r#"
expect(os.getcwd() == os.path.join(DIR, "work dir"), "cwd " + os.getcwd())
u = os.umask(0); os.umask(u)
expect(u == 0o027, "umask %o" % u)
expect(open("/proc/self/comm").read().strip() == "cr-task-test", "comm")
expect(libc.personality(0xffffffff) & 0x0040000, "personality")
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(
        a.task, b.task,
        "the task section changed across the round trip"
    );
}
