//! Round trip of kind "identity": supplementary groups, a dropped
//! capability, a resource limit, no_new_privs.

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
"#,
        r#"
import resource
expect(sorted(os.getgroups()) == [5, 6, 7], "groups %r" % os.getgroups())
expect(resource.getrlimit(resource.RLIMIT_NOFILE) == (512, 4096), "limit")
expect(libc.prctl(23, 27, 0, 0, 0) == 0, "the bounding set")      # PR_CAPBSET_READ
expect(libc.prctl(39, 0, 0, 0, 0) == 1, "no_new_privs")
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(a.identity, b.identity);
}
