//! Round trip of kind "identity": supplementary groups, a dropped
//! capability, a resource limit, no_new_privs, the audit login uid.

use crate::kinds::testkit::round_trip;

#[test]
fn identity_round_trip() {
    let rt = round_trip(
        "identity",
        r#"
import resource
os.setgroups([5, 6, 7])
resource.setrlimit(resource.RLIMIT_NOFILE, (512, 4096))
libc.prctl(24, 27, 0, 0, 0)      # PR_CAPBSET_DROP CAP_MKNOD
libc.prctl(38, 1, 0, 0, 0)       # PR_SET_NO_NEW_PRIVS
with open("/proc/self/loginuid", "w") as fh:
    fh.write("1234")
"#,
        r#"
import resource
expect(sorted(os.getgroups()) == [5, 6, 7], "groups %r" % os.getgroups())
expect(resource.getrlimit(resource.RLIMIT_NOFILE) == (512, 4096), "limit")
expect(libc.prctl(23, 27, 0, 0, 0) == 0, "the bounding set")      # PR_CAPBSET_READ
expect(libc.prctl(39, 0, 0, 0, 0) == 1, "no_new_privs")
with open("/proc/self/loginuid") as fh:
    got = fh.read()
expect(got == "1234", "the audit login uid %r" % got)
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(a.identity, b.identity);
}
