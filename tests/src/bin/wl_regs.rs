//! wl_regs WORKDIR spin|sleep
//!
//! Keeps its whole state in CPU registers while it is checkpointed: nine
//! general-purpose registers (rbx, rdx, r8-r10, r12-r15), the vector registers
//! (ymm0-15, or zmm0-31 and the mask registers k0-7 with AVX-512), a non-default
//! MXCSR (round toward zero, FTZ, DAZ) and x87 control word.
//!
//! One asm loop evolves the GP and vector registers (add/adc/sbb/rol/xor chains,
//! so EFLAGS matter too) and counts iterations in r12. Every 2^20 iterations
//! (`spin`: almost always in user space when frozen) or every 2^10 iterations
//! followed by a 20 ms raw nanosleep (`sleep`: almost always in the syscall) it
//! checks for WORKDIR/go with a raw access(2). When go exists, it stores the
//! registers, recomputes the same number of iterations from the same start in
//! one go, and compares everything: prints OK or FAIL.

use std::arch::asm;
use std::ffi::CString;

use cr_tests::wl;

const NGP: usize = 9;
const GP_NAMES: [&str; NGP] = ["rbx", "rdx", "r8", "r9", "r10", "r12", "r13", "r14", "r15"];

/// Register image, laid out for the asm (offsets are hard-coded there).
#[repr(C, align(64))]
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Regs {
    gp: [u64; NGP],    // 0..72
    _pad0: [u64; 7],   // 72..128
    v: [[u64; 8]; 32], // 128..2176: zmm/ymm i at 128 + 64 * i
    k: [u64; 8],       // 2176..2240
    mxcsr: u32,        // 2240
    fcw: u16,          // 2244
    _pad1: [u16; 29],
}

/// Arguments the asm keeps on the stack.
#[repr(C)]
struct Args {
    go: *const libc::c_char,
    req: *const libc::timespec,
    mask: u64,
    target: u64,
    sleep: u64,
}

macro_rules! prologue {
    () => {
        concat!(
            "push rbx\n",
            "push rdi\n", // out
            "push rsi\n", // args
            "mov rbx, [rax + 0]\n",
            "mov rdx, [rax + 8]\n",
            "mov r8, [rax + 16]\n",
            "mov r9, [rax + 24]\n",
            "mov r10, [rax + 32]\n",
            "mov r12, [rax + 40]\n",
            "mov r13, [rax + 48]\n",
            "mov r14, [rax + 56]\n",
            "mov r15, [rax + 64]\n",
            "ldmxcsr [rax + 2240]\n",
            "fldcw [rax + 2244]\n",
        )
    };
}

macro_rules! load_v {
    (ymm) => {
        concat!(
            "vmovdqu ymm0, [rax + 128]\n",
            "vmovdqu ymm1, [rax + 192]\n",
            "vmovdqu ymm2, [rax + 256]\n",
            "vmovdqu ymm3, [rax + 320]\n",
            "vmovdqu ymm4, [rax + 384]\n",
            "vmovdqu ymm5, [rax + 448]\n",
            "vmovdqu ymm6, [rax + 512]\n",
            "vmovdqu ymm7, [rax + 576]\n",
            "vmovdqu ymm8, [rax + 640]\n",
            "vmovdqu ymm9, [rax + 704]\n",
            "vmovdqu ymm10, [rax + 768]\n",
            "vmovdqu ymm11, [rax + 832]\n",
            "vmovdqu ymm12, [rax + 896]\n",
            "vmovdqu ymm13, [rax + 960]\n",
            "vmovdqu ymm14, [rax + 1024]\n",
            "vmovdqu ymm15, [rax + 1088]\n",
        )
    };
    (zmm) => {
        concat!(
            "vmovdqu64 zmm0, [rax + 128]\n",
            "vmovdqu64 zmm1, [rax + 192]\n",
            "vmovdqu64 zmm2, [rax + 256]\n",
            "vmovdqu64 zmm3, [rax + 320]\n",
            "vmovdqu64 zmm4, [rax + 384]\n",
            "vmovdqu64 zmm5, [rax + 448]\n",
            "vmovdqu64 zmm6, [rax + 512]\n",
            "vmovdqu64 zmm7, [rax + 576]\n",
            "vmovdqu64 zmm8, [rax + 640]\n",
            "vmovdqu64 zmm9, [rax + 704]\n",
            "vmovdqu64 zmm10, [rax + 768]\n",
            "vmovdqu64 zmm11, [rax + 832]\n",
            "vmovdqu64 zmm12, [rax + 896]\n",
            "vmovdqu64 zmm13, [rax + 960]\n",
            "vmovdqu64 zmm14, [rax + 1024]\n",
            "vmovdqu64 zmm15, [rax + 1088]\n",
            "vmovdqu64 zmm16, [rax + 1152]\n",
            "vmovdqu64 zmm17, [rax + 1216]\n",
            "vmovdqu64 zmm18, [rax + 1280]\n",
            "vmovdqu64 zmm19, [rax + 1344]\n",
            "vmovdqu64 zmm20, [rax + 1408]\n",
            "vmovdqu64 zmm21, [rax + 1472]\n",
            "vmovdqu64 zmm22, [rax + 1536]\n",
            "vmovdqu64 zmm23, [rax + 1600]\n",
            "vmovdqu64 zmm24, [rax + 1664]\n",
            "vmovdqu64 zmm25, [rax + 1728]\n",
            "vmovdqu64 zmm26, [rax + 1792]\n",
            "vmovdqu64 zmm27, [rax + 1856]\n",
            "vmovdqu64 zmm28, [rax + 1920]\n",
            "vmovdqu64 zmm29, [rax + 1984]\n",
            "vmovdqu64 zmm30, [rax + 2048]\n",
            "vmovdqu64 zmm31, [rax + 2112]\n",
            "kmovq k1, [rax + 2184]\n",
            "kmovq k2, [rax + 2192]\n",
            "kmovq k3, [rax + 2200]\n",
            "kmovq k4, [rax + 2208]\n",
            "kmovq k5, [rax + 2216]\n",
            "kmovq k6, [rax + 2224]\n",
            "kmovq k7, [rax + 2232]\n",
        )
    };
}

macro_rules! step_gp {
    () => {
        concat!(
            "add r12, 1\n",
            "mov rax, r13\n",
            "rol rax, 13\n",
            "xor rax, r12\n",
            "add r14, rax\n",
            "mov r13, r14\n",
            "xor r15, r13\n",
            "add rbx, r15\n",
            "sub rdx, rbx\n",
            "adc r8, rdx\n",
            "sbb r9, r8\n",
            "xor r10, r9\n",
            "rol r10, 1\n",
        )
    };
}

macro_rules! step_v {
    (ymm) => {
        concat!(
            "vpaddq ymm0, ymm0, ymm1\n",
            "vpxor ymm1, ymm1, ymm2\n",
            "vpaddq ymm2, ymm2, ymm3\n",
            "vpxor ymm3, ymm3, ymm4\n",
            "vpaddq ymm4, ymm4, ymm5\n",
            "vpxor ymm5, ymm5, ymm6\n",
            "vpaddq ymm6, ymm6, ymm7\n",
            "vpxor ymm7, ymm7, ymm8\n",
            "vpaddq ymm8, ymm8, ymm9\n",
            "vpxor ymm9, ymm9, ymm10\n",
            "vpaddq ymm10, ymm10, ymm11\n",
            "vpxor ymm11, ymm11, ymm12\n",
            "vpaddq ymm12, ymm12, ymm13\n",
            "vpxor ymm13, ymm13, ymm14\n",
            "vpaddq ymm14, ymm14, ymm15\n",
            "vpaddq ymm15, ymm15, ymm0\n",
        )
    };
    (zmm) => {
        concat!(
            "vpaddq zmm0, zmm0, zmm1\n",
            "vpxorq zmm1, zmm1, zmm2\n",
            "vpaddq zmm2, zmm2, zmm3\n",
            "vpxorq zmm3, zmm3, zmm4\n",
            "vpaddq zmm4, zmm4, zmm5\n",
            "vpxorq zmm5, zmm5, zmm6\n",
            "vpaddq zmm6, zmm6, zmm7\n",
            "vpxorq zmm7, zmm7, zmm8\n",
            "vpaddq zmm8, zmm8, zmm9\n",
            "vpxorq zmm9, zmm9, zmm10\n",
            "vpaddq zmm10, zmm10, zmm11\n",
            "vpxorq zmm11, zmm11, zmm12\n",
            "vpaddq zmm12, zmm12, zmm13\n",
            "vpxorq zmm13, zmm13, zmm14\n",
            "vpaddq zmm14, zmm14, zmm15\n",
            "vpxorq zmm15, zmm15, zmm16\n",
            "vpaddq zmm16, zmm16, zmm17\n",
            "vpxorq zmm17, zmm17, zmm18\n",
            "vpaddq zmm18, zmm18, zmm19\n",
            "vpxorq zmm19, zmm19, zmm20\n",
            "vpaddq zmm20, zmm20, zmm21\n",
            "vpxorq zmm21, zmm21, zmm22\n",
            "vpaddq zmm22, zmm22, zmm23\n",
            "vpxorq zmm23, zmm23, zmm24\n",
            "vpaddq zmm24, zmm24, zmm25\n",
            "vpxorq zmm25, zmm25, zmm26\n",
            "vpaddq zmm26, zmm26, zmm27\n",
            "vpxorq zmm27, zmm27, zmm28\n",
            "vpaddq zmm28, zmm28, zmm29\n",
            "vpxorq zmm29, zmm29, zmm30\n",
            "vpaddq zmm30, zmm30, zmm31\n",
            "vpaddq zmm31, zmm31, zmm0\n",
        )
    };
}

/// Loop exit with the go file: at every (r12 & mask) == 0, optionally nanosleep,
/// then access(go, F_OK) and leave if it returns 0.
macro_rules! check_go {
    () => {
        concat!(
            "mov rax, [rsp]\n", // args
            "test qword ptr [rax + 16], r12\n",
            "jnz 2b\n",
            "cmp qword ptr [rax + 32], 0\n",
            "je 3f\n",
            "mov rdi, [rax + 8]\n",
            "xor esi, esi\n",
            "mov eax, 35\n", // nanosleep(req, NULL)
            "syscall\n",
            "mov rax, [rsp]\n",
            "3:\n",
            "mov rdi, [rax + 0]\n",
            "xor esi, esi\n",
            "mov eax, 21\n", // access(go, F_OK)
            "syscall\n",
            "test rax, rax\n",
            "jnz 2b\n",
        )
    };
}

/// Loop exit by count: leave once r12 reaches args.target.
macro_rules! check_count {
    () => {
        concat!("mov rax, [rsp]\n", "cmp r12, [rax + 24]\n", "jb 2b\n",)
    };
}

macro_rules! epilogue {
    () => {
        concat!(
            "mov rax, [rsp + 8]\n", // out
            "mov [rax + 0], rbx\n",
            "mov [rax + 8], rdx\n",
            "mov [rax + 16], r8\n",
            "mov [rax + 24], r9\n",
            "mov [rax + 32], r10\n",
            "mov [rax + 40], r12\n",
            "mov [rax + 48], r13\n",
            "mov [rax + 56], r14\n",
            "mov [rax + 64], r15\n",
            "stmxcsr [rax + 2240]\n",
            "fnstcw [rax + 2244]\n",
            "push 0x1f80\n",
            "ldmxcsr [rsp]\n",
            "mov dword ptr [rsp], 0x037f\n",
            "fldcw [rsp]\n",
            "add rsp, 8\n",
        )
    };
}

macro_rules! store_v {
    (ymm) => {
        concat!(
            "vmovdqu [rax + 128], ymm0\n",
            "vmovdqu [rax + 192], ymm1\n",
            "vmovdqu [rax + 256], ymm2\n",
            "vmovdqu [rax + 320], ymm3\n",
            "vmovdqu [rax + 384], ymm4\n",
            "vmovdqu [rax + 448], ymm5\n",
            "vmovdqu [rax + 512], ymm6\n",
            "vmovdqu [rax + 576], ymm7\n",
            "vmovdqu [rax + 640], ymm8\n",
            "vmovdqu [rax + 704], ymm9\n",
            "vmovdqu [rax + 768], ymm10\n",
            "vmovdqu [rax + 832], ymm11\n",
            "vmovdqu [rax + 896], ymm12\n",
            "vmovdqu [rax + 960], ymm13\n",
            "vmovdqu [rax + 1024], ymm14\n",
            "vmovdqu [rax + 1088], ymm15\n",
            "vzeroupper\n",
            "add rsp, 16\n",
            "pop rbx\n",
        )
    };
    (zmm) => {
        concat!(
            "vmovdqu64 [rax + 128], zmm0\n",
            "vmovdqu64 [rax + 192], zmm1\n",
            "vmovdqu64 [rax + 256], zmm2\n",
            "vmovdqu64 [rax + 320], zmm3\n",
            "vmovdqu64 [rax + 384], zmm4\n",
            "vmovdqu64 [rax + 448], zmm5\n",
            "vmovdqu64 [rax + 512], zmm6\n",
            "vmovdqu64 [rax + 576], zmm7\n",
            "vmovdqu64 [rax + 640], zmm8\n",
            "vmovdqu64 [rax + 704], zmm9\n",
            "vmovdqu64 [rax + 768], zmm10\n",
            "vmovdqu64 [rax + 832], zmm11\n",
            "vmovdqu64 [rax + 896], zmm12\n",
            "vmovdqu64 [rax + 960], zmm13\n",
            "vmovdqu64 [rax + 1024], zmm14\n",
            "vmovdqu64 [rax + 1088], zmm15\n",
            "vmovdqu64 [rax + 1152], zmm16\n",
            "vmovdqu64 [rax + 1216], zmm17\n",
            "vmovdqu64 [rax + 1280], zmm18\n",
            "vmovdqu64 [rax + 1344], zmm19\n",
            "vmovdqu64 [rax + 1408], zmm20\n",
            "vmovdqu64 [rax + 1472], zmm21\n",
            "vmovdqu64 [rax + 1536], zmm22\n",
            "vmovdqu64 [rax + 1600], zmm23\n",
            "vmovdqu64 [rax + 1664], zmm24\n",
            "vmovdqu64 [rax + 1728], zmm25\n",
            "vmovdqu64 [rax + 1792], zmm26\n",
            "vmovdqu64 [rax + 1856], zmm27\n",
            "vmovdqu64 [rax + 1920], zmm28\n",
            "vmovdqu64 [rax + 1984], zmm29\n",
            "vmovdqu64 [rax + 2048], zmm30\n",
            "vmovdqu64 [rax + 2112], zmm31\n",
            "kmovq [rax + 2184], k1\n",
            "kmovq [rax + 2192], k2\n",
            "kmovq [rax + 2200], k3\n",
            "kmovq [rax + 2208], k4\n",
            "kmovq [rax + 2216], k5\n",
            "kmovq [rax + 2224], k6\n",
            "kmovq [rax + 2232], k7\n",
            "vzeroupper\n",
            "add rsp, 16\n",
            "pop rbx\n",
        )
    };
}

macro_rules! run_fn {
    ($name:ident, $v:tt, $check:ident) => {
        /// # Safety
        /// The CPU must support the vector extension used.
        unsafe fn $name(inp: &Regs, out: &mut Regs, args: &Args) {
            // SAFETY: the asm saves and restores rbx, keeps the stack balanced,
            // only touches `inp`, `out` and `args`, and declares every other
            // register it changes as clobbered (clobber_abi plus r12-r15).
            unsafe {
                asm!(
                    prologue!(),
                    load_v!($v),
                    "2:",
                    step_gp!(),
                    step_v!($v),
                    $check!(),
                    epilogue!(),
                    store_v!($v),
                    in("rax") inp as *const Regs,
                    in("rdi") out as *mut Regs,
                    in("rsi") args as *const Args,
                    out("r12") _,
                    out("r13") _,
                    out("r14") _,
                    out("r15") _,
                    clobber_abi("C"),
                );
            }
        }
    };
}

run_fn!(run_go_ymm, ymm, check_go);
run_fn!(run_count_ymm, ymm, check_count);
run_fn!(run_go_zmm, zmm, check_go);
run_fn!(run_count_zmm, zmm, check_count);

fn main() {
    let args = wl::args("wl_regs WORKDIR spin|sleep");
    let mode = args.rest.first().cloned().unwrap_or_default();
    let (mask, sleep) = match mode.as_str() {
        "spin" => ((1u64 << 20) - 1, 0u64),
        "sleep" => ((1u64 << 10) - 1, 1u64),
        other => wl::fail(&format!("unknown mode {other:?}")),
    };
    let state = wl::ProcState::setup(&args.workdir);
    let zmm = std::arch::is_x86_feature_detected!("avx512f");
    if !zmm && !std::arch::is_x86_feature_detected!("avx2") {
        wl::fail("needs AVX2");
    }
    let seed = wl::fresh_seed();
    let mut inp = Regs {
        gp: [0; NGP],
        _pad0: [0; 7],
        v: [[0; 8]; 32],
        k: [0; 8],
        mxcsr: 0x1f80 | 0x6000 | 0x8040, // round toward zero, FTZ, DAZ
        fcw: 0x0e7f,                     // round up, extended precision
        _pad1: [0; 29],
    };
    for (i, g) in inp.gp.iter_mut().enumerate() {
        *g = wl::mix64(seed ^ (i as u64 + 1));
    }
    inp.gp[5] = 0; // r12: the iteration counter
    for (i, v) in inp.v.iter_mut().enumerate() {
        for (j, w) in v.iter_mut().enumerate() {
            *w = wl::mix64(seed ^ ((100 + i * 8 + j) as u64));
        }
    }
    if zmm {
        for (i, k) in inp.k.iter_mut().enumerate().skip(1) {
            *k = wl::mix64(seed ^ (1000 + i as u64));
        }
    }
    let go = CString::new(args.workdir.join("go").as_os_str().as_encoded_bytes()).expect("no NUL");
    let req = libc::timespec {
        tv_sec: 0,
        tv_nsec: 20_000_000,
    };
    let mut a = Args {
        go: go.as_ptr(),
        req: &req,
        mask,
        target: 0,
        sleep,
    };
    let mut got = inp;
    wl::say(&format!("READY {}", if zmm { "zmm" } else { "ymm" }));
    // SAFETY: the needed CPU feature was checked above.
    unsafe {
        if zmm {
            run_go_zmm(&inp, &mut got, &a)
        } else {
            run_go_ymm(&inp, &mut got, &a)
        }
    };
    let iters = got.gp[5];
    wl::say(&format!("iterations {iters}"));

    let mut want = inp;
    a.target = iters;
    // SAFETY: as above.
    unsafe {
        if zmm {
            run_count_zmm(&inp, &mut want, &a)
        } else {
            run_count_ymm(&inp, &mut want, &a)
        }
    };
    want.mxcsr = inp.mxcsr;
    want.fcw = inp.fcw;

    let mut problems = Vec::new();
    for ((name, g), w) in GP_NAMES.iter().zip(got.gp).zip(want.gp) {
        if g != w {
            problems.push(format!("{name}: {g:#x}, expected {w:#x}"));
        }
    }
    let (nv, width) = if zmm { (32, 8) } else { (16, 4) };
    for i in 0..nv {
        if got.v[i][..width] != want.v[i][..width] {
            problems.push(format!(
                "{}mm{i}: {:x?}, expected {:x?}",
                if zmm { "z" } else { "y" },
                &got.v[i][..width],
                &want.v[i][..width]
            ));
        }
    }
    if got.k != want.k {
        problems.push(format!("k regs {:x?}, expected {:x?}", got.k, want.k));
    }
    if got.mxcsr != want.mxcsr {
        problems.push(format!(
            "MXCSR {:#x}, expected {:#x}",
            got.mxcsr, want.mxcsr
        ));
    }
    if got.fcw != want.fcw {
        problems.push(format!(
            "x87 control word {:#x}, expected {:#x}",
            got.fcw, want.fcw
        ));
    }
    state.verify(&mut problems);
    wl::finish(&problems);
}
