//! Register layouts used with ptrace on x86_64.

/// `struct user_regs_struct`, as PTRACE_GETREGS/SETREGS see it.
pub type UserRegs = libc::user_regs_struct;

/// The syscall-restart error codes the kernel leaves in `rax` of a thread
/// stopped inside an interrupted system call (never seen by user space).
pub const ERESTARTSYS: i64 = 512;
pub const ERESTARTNOINTR: i64 = 513;
pub const ERESTARTNOHAND: i64 = 514;
pub const ERESTART_RESTARTBLOCK: i64 = 516;

/// An all-zero register set.
pub fn zeroed() -> UserRegs {
    // SAFETY: user_regs_struct is plain old data; all-zero is a valid value.
    unsafe { std::mem::zeroed() }
}

/// Offset of the `xfeatures` (XCR0) field of the software-reserved bytes of
/// an XSAVE area as ptrace returns it (`struct _fpx_sw_bytes` at byte 464).
pub const XSTATE_SW_XFEATURES_OFFSET: usize = 464 + 8;
/// Offset of XSTATE_BV in the XSAVE header.
pub const XSTATE_BV_OFFSET: usize = 512;

/// XCR0 recorded by the kernel in an NT_X86_XSTATE buffer.
pub fn xstate_xfeatures(xstate: &[u8]) -> Option<u64> {
    let b = xstate.get(XSTATE_SW_XFEATURES_OFFSET..XSTATE_SW_XFEATURES_OFFSET + 8)?;
    Some(u64::from_le_bytes(b.try_into().ok()?))
}
