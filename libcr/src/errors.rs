//! Numbers of the C API: `cr_checkpoint` flags and libcr's error codes
//! (returned negated, or in errno), as in `include/libcr.h`.

/// `cr_checkpoint` flags (BLCR's values).
pub const CR_CHECKPOINT_READY: i32 = 0;
pub const CR_CHECKPOINT_TEMP_FAILURE: i32 = 1;
pub const CR_CHECKPOINT_PERM_FAILURE: i32 = 2;
pub const CR_CHECKPOINT_OMIT: i32 = 4;
pub const CR_CHECKPOINT_ABORT_MASK: i32 =
    CR_CHECKPOINT_TEMP_FAILURE | CR_CHECKPOINT_PERM_FAILURE | CR_CHECKPOINT_OMIT;

/// Error codes beyond errno's.
pub const CR_ENOINIT: i32 = 200;
pub const CR_ENOTCB: i32 = 201;
pub const CR_ETEMPFAIL: i32 = 202;
pub const CR_EPERMFAIL: i32 = 203;
pub const CR_ERESTARTED: i32 = 204;
pub const CR_ENOSUPPORT: i32 = 205;

/// Text of an error code (libcr's or errno's).
pub fn text(code: i32) -> String {
    match code {
        CR_ENOINIT => "libcr: cr_init was not called".into(),
        CR_ENOTCB => "libcr: not called from a checkpoint callback".into(),
        CR_ETEMPFAIL => "libcr: the checkpoint was cancelled; the process runs on".into(),
        CR_EPERMFAIL => "libcr: a callback refused the checkpoint permanently".into(),
        CR_ERESTARTED => "libcr: the process was restarted from the checkpoint".into(),
        CR_ENOSUPPORT => "libcr: not supported".into(),
        c => nix::errno::Errno::from_raw(c).desc().into(),
    }
}
