//! Causal attention on the GPU without the T x T matrix; reference:
//! [`crate::engine::cpu::attention`] (same `qkv[B, T, 3C]` layout and results).
//!
//! The forward saves one log-sum-exp per row instead of the probabilities; the backward
//! recomputes them. Two kinds of kernel, both deterministic (no atomics):
//! - bf16 or f16 with head size 64 (GPT-2's shape) or 128 (Llama 3's, Qwen3's) on sm_80 and
//!   newer: tensor cores (`mma.sync`), a warp per 16 rows, tiles double-buffered in shared
//!   memory; on sm_90 (Hopper) all three kernels run on warpgroup MMA instead (`wgmma`,
//!   attention_wgmma.cu), a warpgroup per 64 rows, tiles triple-buffered;
//! - f32 with head size 64 or 128 on sm_80 and newer: the same schedule on tf32 tensor cores
//!   (attention_tf32.cu), its products rounded to tf32 under the tf32 policy
//!   ([`GemmMath::Tf32`]) and split into three tf32 products (about f32's accuracy) under fp32;
//! - everything else (head sizes 16 and 32, older GPUs): one query (or key) row per thread on
//!   CUDA cores, f32 arithmetic. Head size 128 has no such kernel (a thread would hold four
//!   128-float rows): a GPU older than sm_80 gets an error that says so.
//!
//! Both take a sliding window (`window`, 0 for none) and skip the key tiles it leaves out.

use super::{
    CudaBackend, CudaError, Elem, ElemKernel, F16, GemmMath, Program, Result, as_i32, check_len,
    raw_ptr,
};
use crate::engine::AttnShape;
use crate::engine::DType;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaSlice, CudaViewMut, LaunchConfig, PushKernelArg};

/// The CUDA-core kernels of every head size, as each element type's program instantiates them.
const CUDA_CORE_KERNELS: &[ElemKernel] = &[
    ElemKernel::AttentionForwardHs16,
    ElemKernel::AttentionForwardHs32,
    ElemKernel::AttentionForwardHs64,
    ElemKernel::AttentionBackwardDqHs16,
    ElemKernel::AttentionBackwardDqHs32,
    ElemKernel::AttentionBackwardDqHs64,
    ElemKernel::AttentionBackwardDkvHs16,
    ElemKernel::AttentionBackwardDkvHs32,
    ElemKernel::AttentionBackwardDkvHs64,
];

/// The CUDA-core kernels for f32 activations: one program per element type, so that a first
/// start compiles them side by side.
pub(super) const PROGRAM_F32: Program = Program {
    name: "attention_f32",
    source: concat!(
        include_str!("attention.cu"),
        "\nATTENTION_ENTRY_POINTS(16, float, f32)\nATTENTION_ENTRY_POINTS(32, float, f32)\nATTENTION_ENTRY_POINTS(64, float, f32)\n"
    ),
    kernels: &[],
    elem_kernels: CUDA_CORE_KERNELS,
    dtypes: &[DType::F32],
};

/// The CUDA-core kernels for bf16 activations: one program per element type, so that a first
/// start compiles them side by side.
pub(super) const PROGRAM_BF16: Program = Program {
    name: "attention_bf16",
    source: concat!(
        include_str!("attention.cu"),
        "\nATTENTION_ENTRY_POINTS(16, bf16, bf16)\nATTENTION_ENTRY_POINTS(32, bf16, bf16)\nATTENTION_ENTRY_POINTS(64, bf16, bf16)\n"
    ),
    kernels: &[],
    elem_kernels: CUDA_CORE_KERNELS,
    dtypes: &[DType::BF16],
};

/// The CUDA-core kernels for f16 activations: one program per element type, so that a first
/// start compiles them side by side.
pub(super) const PROGRAM_F16: Program = Program {
    name: "attention_f16",
    source: concat!(
        include_str!("attention.cu"),
        "\nATTENTION_ENTRY_POINTS(16, f16, f16)\nATTENTION_ENTRY_POINTS(32, f16, f16)\nATTENTION_ENTRY_POINTS(64, f16, f16)\n"
    ),
    kernels: &[],
    elem_kernels: CUDA_CORE_KERNELS,
    dtypes: &[DType::F16],
};

/// The tensor-core kernels: bf16 and f16, head sizes 64 and 128, and the Hopper forward and
/// backward that share their helpers (nvrtc.rs compiles this program for sm_90a on sm_90;
/// elsewhere the Hopper kernels compile to a trap and are never launched).
pub(super) const PROGRAM_TC: Program = Program {
    name: "attention_tc",
    source: concat!(
        include_str!("attention_tc.cu"),
        "\nTC_ENTRY_POINTS(64, TcBf16, bf16)\nTC_ENTRY_POINTS(64, TcF16, f16)\nTC_ENTRY_POINTS(128, TcBf16, bf16)\nTC_ENTRY_POINTS(128, TcF16, f16)\nTC_ENTRY_POINTS(96, TcBf16, bf16)\nTC_ENTRY_POINTS(96, TcF16, f16)\n",
        include_str!("attention_wgmma.cu"),
        "\nWG_ENTRY_POINTS(64, WgBf16, bf16)\nWG_ENTRY_POINTS(64, WgF16, f16)\nWG_ENTRY_POINTS(128, WgBf16, bf16)\nWG_ENTRY_POINTS(128, WgF16, f16)\n",
        "WG_TMA_ENTRY_POINT(64, 64, WgBf16, attention_forward_bf16_hs64_wgmma_tma)\n",
        "WG_TMA_ENTRY_POINT(64, 64, WgF16, attention_forward_f16_hs64_wgmma_tma)\n",
        "WG_TMA_ENTRY_POINT(128, 64, WgBf16, attention_forward_bf16_hs128_wgmma_tma)\n",
        "WG_TMA_ENTRY_POINT(128, 64, WgF16, attention_forward_f16_hs128_wgmma_tma)\n",
        "WG_TMA_BACKWARD_ENTRY_POINTS(64, WgBf16, bf16)\nWG_TMA_BACKWARD_ENTRY_POINTS(64, WgF16, f16)\n",
        "WG_TMA_BACKWARD_ENTRY_POINTS(128, WgBf16, bf16)\nWG_TMA_BACKWARD_ENTRY_POINTS(128, WgF16, f16)\n",
        "WG_PERSIST_ORDER_ENTRY_POINT(128, 128, 2, true, 2, WG_ORDER_COUNTER_SECTIONS, WgBf16, attention_forward_bf16_hs128_wgmma_persist)\n",
        "WG_PERSIST_ORDER_ENTRY_POINT(128, 128, 2, true, 2, WG_ORDER_COUNTER_SECTIONS, WgF16, attention_forward_f16_hs128_wgmma_persist)\n",
        "WG_PERSIST_ORDER_ENTRY_POINT(64, 128, 2, true, 3, WG_ORDER_COUNTER_SECTIONS, WgBf16, attention_forward_bf16_hs64_wgmma_persist)\n",
        "WG_PERSIST_ORDER_ENTRY_POINT(64, 128, 2, true, 3, WG_ORDER_COUNTER_SECTIONS, WgF16, attention_forward_f16_hs64_wgmma_persist)\n",
        "WG_VALUE_BOUND_ENTRY_POINT(64)\nWG_VALUE_BOUND_ENTRY_POINT(128)\n"
    ),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::AttentionForwardHs64Tc,
        ElemKernel::AttentionBackwardDqHs64Tc,
        ElemKernel::AttentionBackwardDkvHs64Tc,
        ElemKernel::AttentionForwardHs128Tc,
        ElemKernel::AttentionBackwardDqHs128Tc,
        ElemKernel::AttentionBackwardDkvHs128Tc,
        ElemKernel::AttentionForwardHs96Tc,
        ElemKernel::AttentionBackwardDqHs96Tc,
        ElemKernel::AttentionBackwardDkvHs96Tc,
        ElemKernel::AttentionForwardHs64Wgmma,
        ElemKernel::AttentionBackwardDqHs64Wgmma,
        ElemKernel::AttentionBackwardDkvHs64Wgmma,
        ElemKernel::AttentionForwardHs128Wgmma,
        ElemKernel::AttentionBackwardDqHs128Wgmma,
        ElemKernel::AttentionBackwardDkvHs128Wgmma,
        ElemKernel::AttentionForwardHs64WgmmaTma,
        ElemKernel::AttentionBackwardDqHs64WgmmaTma,
        ElemKernel::AttentionBackwardDkvHs64WgmmaTma,
        ElemKernel::AttentionForwardHs128WgmmaTma,
        ElemKernel::AttentionBackwardDqHs128WgmmaTma,
        ElemKernel::AttentionBackwardDkvHs128WgmmaTma,
        ElemKernel::AttentionForwardHs128WgmmaPersist,
        ElemKernel::AttentionForwardHs64WgmmaPersist,
        ElemKernel::AttentionValueBoundHs64,
        ElemKernel::AttentionValueBoundHs128,
    ],
    dtypes: &[DType::BF16, DType::F16],
};

/// The tensor-core kernels for f32 activations (tf32 and 3xtf32 products), which share the
/// 16-bit tensor-core program's helpers (its templates compile only where instantiated).
pub(super) const PROGRAM_TF32: Program = Program {
    name: "attention_tf32",
    source: concat!(
        include_str!("attention_tc.cu"),
        include_str!("attention_tf32.cu"),
        "\nTF_ENTRY_POINTS(64, false, tf32)\nTF_ENTRY_POINTS(128, false, tf32)\nTF_ENTRY_POINTS(64, true, tf32x3)\nTF_ENTRY_POINTS(128, true, tf32x3)\n"
    ),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::AttentionForwardHs64Tf32,
        ElemKernel::AttentionBackwardDqHs64Tf32,
        ElemKernel::AttentionBackwardDkvHs64Tf32,
        ElemKernel::AttentionForwardHs128Tf32,
        ElemKernel::AttentionBackwardDqHs128Tf32,
        ElemKernel::AttentionBackwardDkvHs128Tf32,
        ElemKernel::AttentionForwardHs64Tf32x3,
        ElemKernel::AttentionBackwardDqHs64Tf32x3,
        ElemKernel::AttentionBackwardDkvHs64Tf32x3,
        ElemKernel::AttentionForwardHs128Tf32x3,
        ElemKernel::AttentionBackwardDqHs128Tf32x3,
        ElemKernel::AttentionBackwardDkvHs128Tf32x3,
    ],
    dtypes: &[DType::F32],
};

/// Query rows per block (forward, dQ) and key rows per block (dK/dV), as in attention.cu.
const BR: u32 = 64;
const KR: u32 = 32;
/// Rows per block of the tensor-core kernels (TC_ROWS), and their threads: 4 warps of 16 rows.
const TC_ROWS: u32 = 64;
const TC_THREADS: u32 = 128;

/// Queries per block of the tensor-core forward (`TcForward::rows`): its warps own two tiles
/// of 16 rows at head size 64 and one at 128.
const fn tc_forward_rows(hs: usize) -> u32 {
    if hs == 64 { 2 * TC_ROWS } else { TC_ROWS }
}
/// Head sizes of the tensor-core kernels in every form (mma.sync, wgmma, f32).
const TC_HEAD_SIZES: [usize; 2] = [64, 128];
/// Head sizes with mma.sync kernels for 16-bit activations only (Phi-3-mini's 96): no Hopper
/// or f32 form, so f32 at these sizes has no fused kernel.
const TC_16BIT_HEAD_SIZES: [usize; 1] = [96];

/// f32 values of the scratch an attention backward takes from the driver outside the pool:
/// the row terms d of every (batch, head, query), then three bound words a head (read only by
/// the Hopper f16 kernels, taken on every path so that the planner's figure does not depend on
/// the GPU).
pub fn backward_scratch_len(s: AttnShape) -> usize {
    let heads = s.batch * s.heads;
    heads * s.seq + 3 * heads
}

/// The f16 Hopper backward's first kernel at head size `hs`: each head's largest |V_j| into
/// its bounds ([`Plan::head_bounds`]).
fn value_bound_kernel(hs: usize) -> Option<ElemKernel> {
    match hs {
        64 => Some(ElemKernel::AttentionValueBoundHs64),
        128 => Some(ElemKernel::AttentionValueBoundHs128),
        _ => None,
    }
}

/// The Hopper (sm_90) forward, dQ and dK/dV kernels at head size `hs`; the forward's
/// configuration is [`wgmma_config`], the backward's [`wgmma_backward_shared`].
fn wgmma_kernels(hs: usize) -> Option<[ElemKernel; 3]> {
    use ElemKernel::*;
    match hs {
        64 => Some([
            AttentionForwardHs64Wgmma,
            AttentionBackwardDqHs64Wgmma,
            AttentionBackwardDkvHs64Wgmma,
        ]),
        128 => Some([
            AttentionForwardHs128Wgmma,
            AttentionBackwardDqHs128Wgmma,
            AttentionBackwardDkvHs128Wgmma,
        ]),
        _ => None,
    }
}

/// The Hopper kernels whose streamed tiles the TMA unit copies (`wg_forward`'s and
/// `wg_backward`'s TMA) at head size `hs`, sm_90's default unless `KILN_ATTENTION_TMA=0`
/// ([`attention_tma`]).
#[derive(Debug, Clone, Copy)]
struct TmaKernels {
    forward: ElemKernel,
    /// dQ's TMA form: at head size 128 (64-row tiles) 1.5-3% faster than the threads' copies
    /// on an H200 (docs/benchmarks/2026-12-02-h200/persistent-forward).
    dq: Option<ElemKernel>,
    /// dK/dV's TMA form: head size 64 only. At 128 (when both kernels streamed 32-row tiles)
    /// the TMA backward measured level with the threads' copies in bf16 and 3.4% slower in
    /// f16 on an H200, and 1-1.4% slower again with four stages
    /// (docs/benchmarks/2026-11-30-h200/attention-tma); dK/dV still streams 32-row tiles there.
    dkv: Option<ElemKernel>,
}

fn wgmma_tma_kernels(hs: usize) -> Option<TmaKernels> {
    use ElemKernel::*;
    match hs {
        64 => Some(TmaKernels {
            forward: AttentionForwardHs64WgmmaTma,
            dq: Some(AttentionBackwardDqHs64WgmmaTma),
            dkv: Some(AttentionBackwardDkvHs64WgmmaTma),
        }),
        128 => Some(TmaKernels {
            forward: AttentionForwardHs128WgmmaTma,
            dq: Some(AttentionBackwardDqHs128WgmmaTma),
            dkv: Some(AttentionBackwardDkvHs128WgmmaTma),
        }),
        _ => None,
    }
}

/// The persistent warp-specialised forward at head size `hs` (`wg_forward_persist`: one block
/// an SM walks the work tiles; its consumer warpgroups of 64 queries each, one producer thread
/// issuing TMA copies, the consumers' products in turn), sm_90's forward with the TMA forms
/// unless `KILN_ATTENTION_PERSISTENT=0` ([`attention_persistent`]). On an H200 (B 4, T 4096) it
/// took 14-16% off the one-warpgroup TMA forward at head size 128 with two consumers
/// (docs/benchmarks/2026-12-02-h200/persistent-forward) and 12% at head size 64 with three
/// (docs/benchmarks/2026-12-02-h200/three-consumers), where two had measured 4-9% slower.
fn wgmma_persistent_forward(hs: usize) -> Option<ElemKernel> {
    match hs {
        128 => Some(ElemKernel::AttentionForwardHs128WgmmaPersist),
        64 => Some(ElemKernel::AttentionForwardHs64WgmmaPersist),
        _ => None,
    }
}

/// The persistent forward's shape at head size `hs`, its entry points' `WgPersistShape`
/// (attention_wgmma.cu), which this mirrors: 128-key tiles, two stages, and two consumer
/// warpgroups at head size 128 or three at 64 (FlashAttention-3's 192-query tile there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PersistentShape {
    keys: usize,
    stages: usize,
    consumers: usize,
}

const fn persistent_config(hs: usize) -> PersistentShape {
    PersistentShape {
        keys: 128,
        stages: 2,
        consumers: if hs == 64 { 3 } else { 2 },
    }
}

/// Queries and threads of a persistent forward block: its consumer warpgroups of 64 queries
/// each and a producer warpgroup.
const fn persistent_rows(hs: usize) -> u32 {
    64 * persistent_config(hs).consumers as u32
}
const fn persistent_threads(hs: usize) -> u32 {
    128 * (persistent_config(hs).consumers as u32 + 1)
}

/// Dynamic shared memory of the persistent forward (`WgPersistShape::bytes`): 1024 bytes of
/// alignment, the block's rows of Q, the stages of K and V, each consumer warp's output
/// staging (16 rows of 2 hs + 16 bytes) and the barriers (four a stage, two for Q).
const fn persistent_shared(hs: usize) -> u32 {
    let PersistentShape {
        keys,
        stages,
        consumers,
    } = persistent_config(hs);
    let q = (hs / 64) * 64 * consumers * 128;
    let tile = (hs / 64) * keys * 128;
    let staging = 4 * consumers * 16 * (2 * hs + 16);
    (1024 + q + 2 * stages * tile + staging + (4 * stages + 2) * 8) as u32
}

/// Whether the Hopper forward is the persistent one (with the TMA forms on): yes unless
/// `KILN_ATTENTION_PERSISTENT=0`, which takes the one-warpgroup forward, to compare the two
/// in one build (their key tiles differ, so their bits may too; both are in the selftest).
fn attention_persistent() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_ATTENTION_PERSISTENT").map_or(true, |v| v != "0"))
}

/// Whether the Hopper kernels run their TMA forms: yes unless `KILN_ATTENTION_TMA=0`, which
/// takes the forms whose threads copy the tiles (cp.async), to compare the two in one build
/// (bench/wgmma_attention has the forward's as `wg_*_n64_tma`). The two give the same bits.
fn attention_tma() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_ATTENTION_TMA").map_or(true, |v| v != "0"))
}

/// A TMA tensor map of an attention call's `[B][T][width]` buffer of `T` (`qkv`: width 3C;
/// `dout`: C): boxes of 64 columns (128 bytes, the span of the 128-byte swizzle the products
/// read) by `rows` rows, rows past T read as zeros. Passed by value to the TMA kernels.
#[repr(transparent)]
struct RowsTensorMap(cudarc::driver::sys::CUtensorMap);

// SAFETY: a plain 128-byte value, which the kernels take by value as trailing parameters.
unsafe impl cudarc::driver::DeviceRepr for RowsTensorMap {}

fn rows_tensor_map<T: Elem>(
    ptr: u64,
    width: usize,
    s: AttnShape,
    rows: usize,
) -> Result<RowsTensorMap> {
    use cudarc::driver::sys;
    let dtype = match T::DTYPE {
        DType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::F32 => {
            return Err(CudaError::Shape {
                op: "attention_forward",
                detail: "the TMA kernels take bf16 and f16".into(),
            });
        }
    };
    let row = (width * std::mem::size_of::<T>()) as u64;
    let dims = [width as u64, s.seq as u64, s.batch as u64];
    let strides = [row, row * s.seq as u64];
    let boxes = [64u32, rows as u32, 1];
    let unit = [1u32; 3];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every array holds the rank's (3) entries (strides: rank - 1); `ptr` is a device
    // buffer of B T width values on a 16-byte boundary (the caller's plan checks alignment),
    // its row stride a multiple of 16 bytes (width a multiple of 64); the driver writes `map`
    // only.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            3,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            unit.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(CudaError::Driver(format!(
            "cuTensorMapEncodeTiled for an attention buffer of rows of {width} ({s:?}): {r:?}"
        )));
    }
    // SAFETY: the driver filled the map (it returned success).
    Ok(RowsTensorMap(unsafe { map.assume_init() }))
}

/// A configuration of the Hopper forward (`WgShape` of attention_wgmma.cu): key tile rows,
/// warpgroups a block (each 128 threads and 64 queries, sharing every K and V tile), and
/// whether Q is read from shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct WgmmaConfig {
    keys: usize,
    groups: u32,
    q_shared: bool,
}

/// The configuration the Hopper forward's entry point at head size `hs` is compiled for:
/// `WgForward` of attention_wgmma.cu, which this mirrors (the two change together): one
/// warpgroup, 64 keys, Q in registers at both head sizes (two warpgroups sharing the tiles
/// measured slower at head size 128 and at T 1024; see the kernel's comment).
const fn wgmma_config(_hs: usize) -> WgmmaConfig {
    WgmmaConfig {
        keys: 64,
        groups: 1,
        q_shared: false,
    }
}

/// Queries per block of the Hopper forward (64 a warpgroup, WG_ROWS) and its threads (128 a
/// warpgroup, WG_THREADS).
const fn wgmma_rows(hs: usize) -> u32 {
    64 * wgmma_config(hs).groups
}
const fn wgmma_threads(hs: usize) -> u32 {
    128 * wgmma_config(hs).groups
}

/// Dynamic shared memory of the Hopper forward at head size `hs`, in bytes: `WgShape::bytes`
/// of attention_wgmma.cu (which traps when launched with less) for [`wgmma_config`]: Q's tile
/// of 64 rows a warpgroup where it is read from shared memory, three stages of a K and a V
/// tile, all of 128-byte rows (a row of `hs` elements is `hs / 64` of them), and 1024 bytes
/// to align them.
const fn wgmma_shared(hs: usize) -> u32 {
    let config = wgmma_config(hs);
    let q = if config.q_shared {
        (hs / 64) * 64 * config.groups as usize * 128
    } else {
        0
    };
    let tile = (hs / 64) * config.keys * 128;
    (q + 2 * 3 * tile + 1024) as u32
}

/// Dynamic shared memory of the Hopper backward at head size `hs` (`WgBackShape::bytes` of
/// attention_wgmma.cu, which traps when launched with less): each warpgroup's own tiles of 64
/// rows that its products read from shared memory ([`wgmma_backward_owned_shared`]), three
/// stages of two streamed tiles ([`wgmma_backward_rows`]) that the block's warpgroups share,
/// all of 128-byte rows, for dK/dV each stage's queries' lse and d (f32), and 1024 bytes to
/// align the tiles; `groups` warpgroups a block ([`wgmma_backward_groups`]).
const fn wgmma_backward_shared(hs: usize, dkv: bool, tma: bool, groups: u32) -> u32 {
    let stream = wgmma_backward_rows(hs, dkv, tma);
    let own = (hs / 64) * 64 * 128;
    let tile = (hs / 64) * stream * 128;
    let row_terms = if dkv { 2 * stream * 4 } else { 0 };
    (groups as usize * wgmma_backward_owned_shared(hs, dkv, tma) * own
        + 3 * (2 * tile + row_terms)
        + 1024) as u32
}

/// Warpgroups a block of the Hopper backward (`WgBackward`'s `dq_groups`, `dkv_groups` and
/// `dkv_tma_groups`), each owning 64 rows and sharing the streamed tiles: two in dK/dV's TMA
/// form, where on an H200 that took 3-4% off the backward at head size 64 and, with 64-row
/// tiles, 10-12% at 128 (docs/benchmarks/2026-12-03-h200/dkv-64-rows); one elsewhere, where two
/// measured slower (docs/benchmarks/2026-12-02-h200/backward-pairs).
const fn wgmma_backward_groups(dkv: bool, tma: bool) -> u32 {
    if dkv && tma { 2 } else { 1 }
}

/// How a Hopper backward kernel at head size `hs` is launched: 64 rows and 128 threads a
/// warpgroup, [`wgmma_backward_shared`] bytes.
fn wgmma_backward_launch(kernel: ElemKernel, hs: usize, dkv: bool) -> Launch {
    let tma = is_tma_kernel(kernel);
    let groups = wgmma_backward_groups(dkv, tma);
    Launch {
        kernel,
        rows: groups * TC_ROWS,
        threads: groups * TC_THREADS,
        shared: wgmma_backward_shared(hs, dkv, tma, groups),
    }
}

/// How many of the Hopper backward's two own tiles stay in shared memory (`WgBackShape::owned`
/// of `WgBackward`'s `dq_regs` / `dkv_regs` / `dkv_tma_regs`; the others are register
/// operands): dQ none at head size 128 and both at 64; dK/dV none at 64, and at 128 V in its
/// threads' copies and both K and V in its TMA form.
const fn wgmma_backward_owned_shared(hs: usize, dkv: bool, tma: bool) -> usize {
    match (hs, dkv) {
        (64, false) => 2,
        (64, true) => 0,
        (_, false) => 0,
        (_, true) if tma => 2,
        (_, true) => 1,
    }
}

/// Rows of the tiles the Hopper backward streams (`WgBackward::dq_stream` / `dkv_stream` /
/// `dkv_tma_stream`): 64, except dK/dV's 32 at head size 128 in its threads' copies (where
/// dK's and dV's accumulators take 128 registers and K stays in registers too).
const fn wgmma_backward_rows(hs: usize, dkv: bool, tma: bool) -> usize {
    if dkv && hs != 64 && !tma { 32 } else { 64 }
}

/// The forward, dQ and dK/dV tensor-core kernels at head size `hs`.
fn tc_kernels(hs: usize) -> Option<[ElemKernel; 3]> {
    use ElemKernel::*;
    match hs {
        64 => Some([
            AttentionForwardHs64Tc,
            AttentionBackwardDqHs64Tc,
            AttentionBackwardDkvHs64Tc,
        ]),
        128 => Some([
            AttentionForwardHs128Tc,
            AttentionBackwardDqHs128Tc,
            AttentionBackwardDkvHs128Tc,
        ]),
        96 => Some([
            AttentionForwardHs96Tc,
            AttentionBackwardDqHs96Tc,
            AttentionBackwardDkvHs96Tc,
        ]),
        _ => None,
    }
}

/// The forward, dQ and dK/dV kernels for f32 activations on the tensor cores at head size `hs`:
/// tf32 products under [`GemmMath::Tf32`], three tf32 products each (f32's accuracy) under
/// [`GemmMath::Fp32`].
fn tf32_kernels(hs: usize, math: GemmMath) -> Option<[ElemKernel; 3]> {
    use ElemKernel::*;
    match (hs, math) {
        (64, GemmMath::Tf32) => Some([
            AttentionForwardHs64Tf32,
            AttentionBackwardDqHs64Tf32,
            AttentionBackwardDkvHs64Tf32,
        ]),
        (128, GemmMath::Tf32) => Some([
            AttentionForwardHs128Tf32,
            AttentionBackwardDqHs128Tf32,
            AttentionBackwardDkvHs128Tf32,
        ]),
        (64, GemmMath::Fp32) => Some([
            AttentionForwardHs64Tf32x3,
            AttentionBackwardDqHs64Tf32x3,
            AttentionBackwardDkvHs64Tf32x3,
        ]),
        (128, GemmMath::Fp32) => Some([
            AttentionForwardHs128Tf32x3,
            AttentionBackwardDqHs128Tf32x3,
            AttentionBackwardDkvHs128Tf32x3,
        ]),
        _ => None,
    }
}

/// Dynamic shared memory of the f32 tensor-core kernels at head size `hs`: `TfShape` of
/// attention_tf32.cu (which traps when launched with less). Rows of `hs + 4` floats; the
/// forward streams 64-row tiles at head size 64 and 32-row ones at 128, the backward 32 and 16
/// (its registers hold two score tiles); dK/dV keeps each query's lse and d in the padding of
/// its Q and dO rows and, at head size 128, the block's 64 K and 64 V rows.
const fn tf32_shared(hs: usize) -> TcShared {
    let (stream, back) = if hs == 64 { (64, 32) } else { (32, 16) };
    let ld = hs + 4;
    let own = if hs == 64 {
        0
    } else {
        2 * TC_ROWS as usize * ld
    };
    TcShared {
        forward: (4 * stream * ld * 4) as u32,
        dq: (4 * back * ld * 4) as u32,
        dkv: ((4 * back * ld + own) * 4) as u32,
    }
}

/// The forward, dQ and dK/dV CUDA-core kernels at head size `hs`.
fn cuda_core_kernels(hs: usize) -> Option<[ElemKernel; 3]> {
    use ElemKernel::*;
    match hs {
        16 => Some([
            AttentionForwardHs16,
            AttentionBackwardDqHs16,
            AttentionBackwardDkvHs16,
        ]),
        32 => Some([
            AttentionForwardHs32,
            AttentionBackwardDqHs32,
            AttentionBackwardDkvHs32,
        ]),
        64 => Some([
            AttentionForwardHs64,
            AttentionBackwardDqHs64,
            AttentionBackwardDkvHs64,
        ]),
        _ => None,
    }
}
/// Shared memory a kernel gets without opting in to more.
const DEFAULT_SHARED_BYTES: u32 = 48 << 10;

/// Dynamic shared memory of the three tensor-core kernels at one head size, in bytes: the
/// layouts of `TcShape` in attention_tc.cu (which trap when launched with less).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TcShared {
    forward: u32,
    dq: u32,
    dkv: u32,
}

const fn tc_shared(hs: usize) -> TcShared {
    let rows = TC_ROWS as usize;
    // Streamed tiles: 64 rows at head size 64, 32 at 128; rows padded by 8 elements.
    let stream = if hs == 64 { 64 } else { 32 };
    let ld = hs + 8;
    let tile = stream * ld;
    let dq_staged = 2 * tile + 2 * rows * ld;
    let dq = if dq_staged > 4 * tile {
        dq_staged
    } else {
        4 * tile
    };
    let kv_tiles = if hs == 64 { 0 } else { 2 * rows * ld };
    TcShared {
        forward: (4 * tile * 2) as u32,
        dq: (dq * 2) as u32,
        dkv: ((4 * tile + kv_tiles) * 2 + 4 * stream * 4) as u32,
    }
}

/// Whether the fused attention has kernels for head size `hs` in some dtype (128 and 96 on
/// sm_80 or newer).
pub fn has_head_size(hs: usize) -> bool {
    cuda_core_kernels(hs).is_some() || tc_kernels(hs).is_some()
}

/// Whether the fused attention has kernels for head size `hs` with `dtype` activations: the
/// CUDA-core ones (16, 32, 64), the tensor-core ones at 64 and 128 in every dtype, and at 96
/// for 16-bit activations only.
pub fn has_kernel(hs: usize, dtype: DType) -> bool {
    cuda_core_kernels(hs).is_some()
        || (tc_kernels(hs).is_some() && (dtype != DType::F32 || TC_HEAD_SIZES.contains(&hs)))
}

/// Checks the shape and returns `(T, C, NH, HS)` as the kernels' ints.
fn dims(s: AttnShape) -> Result<(i32, i32, i32, usize)> {
    const OP: &str = "attention";
    let hs = s.channels / s.heads.max(1);
    if !has_head_size(hs) || hs * s.heads != s.channels {
        return Err(CudaError::Shape {
            op: OP,
            detail: format!(
                "head size {} (d_model {} / {} heads) has no GPU kernel; use 16, 32, 64 or 128 \
                 (128 on sm_80 or newer)",
                s.channels as f64 / s.heads.max(1) as f64,
                s.channels,
                s.heads
            ),
        });
    }
    Ok((
        as_i32(OP, "seq", s.seq)?,
        as_i32(OP, "channels", s.channels)?,
        as_i32(OP, "heads", s.heads)?,
        hs,
    ))
}

/// The window as the kernels' `int W`.
fn window_arg(window: usize) -> Result<i32> {
    as_i32("attention", "window", window)
}

/// One block per `per_block` rows of each (batch, head), `threads` threads and `shared` bytes
/// of dynamic shared memory each.
fn rows_grid(rows: usize, launch: Launch, s: AttnShape) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            rows.div_ceil(launch.rows as usize) as u32,
            (s.batch * s.heads) as u32,
            1,
        ),
        block_dim: (launch.threads, 1, 1),
        shared_mem_bytes: launch.shared,
    }
}

/// One kernel of an attention call and how it is launched: rows per block, threads per block
/// and dynamic shared memory.
#[derive(Debug, Clone, Copy)]
struct Launch {
    kernel: ElemKernel,
    rows: u32,
    threads: u32,
    shared: u32,
}

/// The kernels of one attention call: the tensor-core ones where they apply, else the
/// row-per-thread ones.
struct Plan {
    forward: Launch,
    dq: Launch,
    dkv: Launch,
    /// The tensor-core dQ kernel takes the row term d from the forward's output (`out`); the
    /// CUDA-core one sums it over the keys and takes no `out`.
    tensor_cores: bool,
    /// The Hopper backward: both kernels take `bounds` after `d`, three u32 a head, where in
    /// f16 the dQ kernel records the head's largest |dO_i| and |d_i| for the dK/dV kernel, and
    /// [`value_bound_kernel`], launched first, its largest |V_j| for both: the bounds that fix
    /// their dS scales (zeroed before).
    head_bounds: bool,
}

/// Whether `kernel` is one of the TMA forms ([`wgmma_tma_kernels`]), which take tensor maps.
fn is_tma_kernel(kernel: ElemKernel) -> bool {
    TC_HEAD_SIZES
        .iter()
        .filter_map(|&hs| wgmma_tma_kernels(hs))
        .any(|k| k.forward == kernel || k.dq == Some(kernel) || k.dkv == Some(kernel))
        || is_persistent_kernel(kernel)
}

/// Whether `kernel` is a persistent forward ([`wgmma_persistent_forward`]): a TMA form whose
/// grid is the SMs and which takes batch x heads after its map.
fn is_persistent_kernel(kernel: ElemKernel) -> bool {
    TC_HEAD_SIZES
        .iter()
        .any(|&hs| wgmma_persistent_forward(hs) == Some(kernel))
}

impl Plan {
    /// The forward is the TMA form: it takes a tensor map of `qkv` as its last parameter
    /// (boxes of [`wgmma_config`]'s key rows).
    fn forward_map(&self) -> bool {
        is_tma_kernel(self.forward.kernel)
    }

    /// The dQ kernel is the TMA form: it takes a tensor map of `qkv` as its last parameter
    /// (boxes of [`wgmma_backward_rows`]).
    fn dq_map(&self) -> bool {
        is_tma_kernel(self.dq.kernel)
    }

    /// The dK/dV kernel is the TMA form: it takes a tensor map of `qkv` then one of `dout`
    /// (boxes of [`wgmma_backward_rows`]).
    fn dkv_maps(&self) -> bool {
        is_tma_kernel(self.dkv.kernel)
    }

    /// The same call on the Hopper kernels whose threads copy the tiles (with their own launch
    /// shapes), for when a tensor map cannot be encoded.
    fn without_tma(self, hs: usize) -> Plan {
        let Some([forward, dq, dkv]) = wgmma_kernels(hs) else {
            return self;
        };
        Plan {
            forward: Launch {
                kernel: forward,
                rows: wgmma_rows(hs),
                threads: wgmma_threads(hs),
                shared: wgmma_shared(hs),
            },
            dq: wgmma_backward_launch(dq, hs, false),
            dkv: wgmma_backward_launch(dkv, hs, true),
            ..self
        }
    }
}

/// Says once per process, on standard error, that attention leaves its TMA forms because a
/// tensor map could not be encoded, and why.
fn note_tma_fallback(e: &CudaError) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        eprintln!(
            "note: attention runs its Hopper kernels with the threads copying the tiles, because \
             the TMA unit's tensor map could not be encoded ({e}); KILN_ATTENTION_TMA=0 takes \
             that path without trying"
        )
    });
}

impl CudaBackend {
    /// Whether attention with head size `head_size` runs on the tensor cores here, whatever
    /// the activations' type: head size 64 or 128 on sm_80+ (16-bit `mma.sync` for bf16 and
    /// f16, tf32 for f32).
    pub fn attention_uses_tensor_cores(&self, head_size: usize) -> bool {
        (TC_HEAD_SIZES.contains(&head_size) || TC_16BIT_HEAD_SIZES.contains(&head_size))
            && self.info.arch() >= 80
    }

    /// The kernels of a call: the tensor-core ones where [`Self::attention_uses_tensor_cores`]
    /// and the buffers lie on 16-byte boundaries (their tiles move 16 bytes per access; rows
    /// stay aligned because C is a multiple of 64), else the CUDA-core ones, which have no
    /// head size 128.
    fn attention_plan<T: Elem>(&self, hs: usize, ptrs: &[u64], math: GemmMath) -> Result<Plan> {
        let aligned = ptrs.iter().all(|p| p % 16 == 0);
        if T::DTYPE == DType::F32
            && self.attention_uses_tensor_cores(hs)
            && aligned
            && let Some([forward, dq, dkv]) = tf32_kernels(hs, math)
        {
            let shared = tf32_shared(hs);
            let launch = |kernel, shared| Launch {
                kernel,
                rows: TC_ROWS,
                threads: TC_THREADS,
                shared,
            };
            return Ok(Plan {
                forward: launch(forward, shared.forward),
                dq: launch(dq, shared.dq),
                dkv: launch(dkv, shared.dkv),
                tensor_cores: true,
                head_bounds: false,
            });
        }
        if T::DTYPE != DType::F32
            && self.attention_uses_tensor_cores(hs)
            && aligned
            && let Some([forward, dq, dkv]) = tc_kernels(hs)
        {
            let shared = tc_shared(hs);
            let launch = |kernel, rows, shared| Launch {
                kernel,
                rows,
                threads: TC_THREADS,
                shared,
            };
            // Hopper's warpgroup MMA kernels where the GPU is sm_90 (their program is compiled
            // for sm_90a there); the mma.sync ones elsewhere.
            if self.info.arch() == 90
                && let Some([forward, dq, dkv]) = wgmma_kernels(hs)
            {
                let tma = attention_tma().then(|| wgmma_tma_kernels(hs)).flatten();
                let dq = tma.and_then(|k| k.dq).unwrap_or(dq);
                let dkv = tma.and_then(|k| k.dkv).unwrap_or(dkv);
                let persistent = match tma.is_some() && attention_persistent() {
                    true => wgmma_persistent_forward(hs),
                    false => None,
                };
                let forward = match persistent {
                    Some(kernel) => Launch {
                        kernel,
                        rows: persistent_rows(hs),
                        threads: persistent_threads(hs),
                        shared: persistent_shared(hs),
                    },
                    None => Launch {
                        kernel: tma.map_or(forward, |k| k.forward),
                        rows: wgmma_rows(hs),
                        threads: wgmma_threads(hs),
                        shared: wgmma_shared(hs),
                    },
                };
                return Ok(Plan {
                    forward,
                    dq: wgmma_backward_launch(dq, hs, false),
                    dkv: wgmma_backward_launch(dkv, hs, true),
                    tensor_cores: true,
                    head_bounds: true,
                });
            }
            return Ok(Plan {
                forward: launch(forward, tc_forward_rows(hs), shared.forward),
                dq: launch(dq, TC_ROWS, shared.dq),
                dkv: launch(dkv, TC_ROWS, shared.dkv),
                tensor_cores: true,
                head_bounds: false,
            });
        }
        let Some([forward, dq, dkv]) = cuda_core_kernels(hs) else {
            let why = if self.info.arch() < 80 {
                format!("sm_{} (tensor cores need sm_80 or newer)", self.info.arch())
            } else {
                "a buffer that is not on a 16-byte boundary".to_string()
            };
            return Err(CudaError::Shape {
                op: "attention",
                detail: format!(
                    "head size {hs} runs on the GPU only on the tensor cores (sm_80 or newer), \
                     and this call has {why}"
                ),
            });
        };
        self.note_cuda_core_attention(hs, aligned);
        let launch = |kernel, rows| Launch {
            kernel,
            rows,
            threads: rows,
            shared: 0,
        };
        Ok(Plan {
            forward: launch(forward, BR),
            dq: launch(dq, BR),
            dkv: launch(dkv, KR),
            tensor_cores: false,
            head_bounds: false,
        })
    }

    /// Says once per process and reason, on standard error, that attention runs on the
    /// general CUDA-core kernels and why: a slower path is never taken silently.
    fn note_cuda_core_attention(&self, hs: usize, aligned: bool) {
        use std::collections::HashSet;
        use std::sync::Mutex;
        static SAID: Mutex<Option<HashSet<String>>> = Mutex::new(None);
        let why = if self.info.arch() < 80 {
            format!("sm_{} (they need sm_80 or newer)", self.info.arch())
        } else if !TC_HEAD_SIZES.contains(&hs) && !TC_16BIT_HEAD_SIZES.contains(&hs) {
            format!("head size {hs}")
        } else if !aligned {
            "a buffer off a 16-byte boundary".to_string()
        } else {
            return;
        };
        let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
        if said.get_or_insert_with(HashSet::new).insert(why.clone()) {
            eprintln!(
                "note: attention runs on the CUDA-core kernels because of {why}; the tensor-core \
                 kernels take head size 64 or 128 on sm_80 or newer, several times faster"
            );
        }
    }

    /// The kernel of `launch`, allowed the dynamic shared memory `launch` gives it (above
    /// 48 KiB a kernel must opt in; every sm_80+ GPU allows the tensor-core kernels' 68.5 KiB).
    fn attention_kernel<T: Elem>(&self, launch: Launch) -> Result<&CudaFunction> {
        let f = self.elem_function::<T>(launch.kernel)?;
        if launch.shared > DEFAULT_SHARED_BYTES {
            if launch.shared as usize > self.info.shared_memory_per_block_optin {
                return Err(CudaError::Shape {
                    op: "attention",
                    detail: format!(
                        "{} needs {} bytes of shared memory per block; this GPU allows {}",
                        launch.kernel.name(T::DTYPE),
                        launch.shared,
                        self.info.shared_memory_per_block_optin
                    ),
                });
            }
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                launch.shared as i32,
            )?;
        }
        Ok(f)
    }

    /// Writes `out[B, T, C]` and `lse[B, NH, T]` from `qkv[B, T, 3C]`; `math` picks the
    /// products of f32 activations (16-bit ones ignore it).
    pub fn attention_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        lse: &mut CudaSlice<f32>,
        qkv: &CudaSlice<T>,
        s: AttnShape,
        math: GemmMath,
    ) -> Result<()> {
        self.windowed_attention_forward(out, lse, qkv, s, 0, math)
    }

    /// [`Self::attention_forward`] within a sliding `window` (0: none).
    pub fn windowed_attention_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        lse: &mut CudaSlice<f32>,
        qkv: &CudaSlice<T>,
        s: AttnShape,
        window: usize,
        math: GemmMath,
    ) -> Result<()> {
        let (t, c, nh, hs) = dims(s)?;
        let w = window_arg(window)?;
        check_len(
            "attention_forward",
            "qkv",
            qkv,
            s.batch * s.seq * 3 * s.channels,
        )?;
        check_len(
            "attention_forward",
            "out",
            out,
            s.batch * s.seq * s.channels,
        )?;
        check_len("attention_forward", "lse", lse, s.batch * s.heads * s.seq)?;
        let mut plan = self.attention_plan::<T>(
            hs,
            &[raw_ptr(qkv, &self.stream), raw_ptr(out, &self.stream)],
            math,
        )?;
        let mut map = None;
        if plan.forward_map() {
            let keys = if is_persistent_kernel(plan.forward.kernel) {
                persistent_config(hs).keys
            } else {
                wgmma_config(hs).keys
            };
            match rows_tensor_map::<T>(raw_ptr(qkv, &self.stream), 3 * s.channels, s, keys) {
                Ok(m) => map = Some(m),
                Err(e) => {
                    note_tma_fallback(&e);
                    plan = plan.without_tma(hs);
                }
            }
        }
        let f = self.attention_kernel::<T>(plan.forward)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(qkv)
            .arg(out)
            .arg(lse)
            .arg(&t)
            .arg(&c)
            .arg(&nh)
            .arg(&w);
        if let Some(map) = &map {
            b.arg(map);
        }
        let mut grid = rows_grid(s.seq, plan.forward, s);
        let heads = (s.batch * s.heads) as i32;
        if is_persistent_kernel(plan.forward.kernel) {
            // One block an SM (at most one a work tile), each walking the work tiles.
            b.arg(&heads);
            let work = grid.grid_dim.0 * grid.grid_dim.1;
            grid.grid_dim = (work.min(self.info.sm_count), 1, 1);
        }
        // SAFETY: buffer sizes checked above; the grid covers B*NH x ceil(T/rows) row tiles
        // (the persistent form's blocks walk them all); the TMA form's map describes `qkv`
        // itself.
        unsafe { b.launch(grid) }?;
        Ok(())
    }

    /// Overwrites `dqkv[B, T, 3C]` from `dout` and the forward's `qkv`, output `out` and
    /// `lse`, with the forward's `math`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward<T: Elem>(
        &self,
        dqkv: &mut CudaSlice<T>,
        dout: &CudaSlice<T>,
        qkv: &CudaSlice<T>,
        out: &CudaSlice<T>,
        lse: &CudaSlice<f32>,
        s: AttnShape,
        math: GemmMath,
    ) -> Result<()> {
        self.windowed_attention_backward(dqkv, dout, qkv, out, lse, s, 0, math)
    }

    /// Each head's largest |V_j| (the L2 norm of a token's head-size values) in an f16 `qkv` of
    /// `[B, T, 3C]`, as the f16 Hopper backward's first kernel ([`value_bound_kernel`]) finds
    /// it for its dS scales: sm_90 and head sizes 64 and 128 only. `B NH` values, for the
    /// selftest's check of that kernel against the CPU.
    pub fn attention_value_bounds(&self, qkv: &CudaSlice<F16>, s: AttnShape) -> Result<Vec<f32>> {
        let (_, _, _, hs) = dims(s)?;
        check_len(
            "attention_value_bounds",
            "qkv",
            qkv,
            3 * s.batch * s.seq * s.channels,
        )?;
        let kernel = value_bound_kernel(hs)
            .filter(|_| self.info.arch() == 90)
            .ok_or_else(|| CudaError::Shape {
                op: "attention_value_bounds",
                detail: format!(
                    "the value bound kernel runs on sm_90 at head sizes 64 and 128, not sm_{} \
                     at head size {hs}",
                    self.info.arch()
                ),
            })?;
        let mut words = self.alloc::<f32>(3 * s.batch * s.heads)?;
        let mut bounds = words.slice_mut(..);
        self.stream.memset_zeros(&mut bounds)?;
        self.launch_value_bound(kernel, qkv, &mut bounds, s)?;
        let words = self.download_f32(&words)?;
        Ok(words.chunks_exact(3).map(|w| w[2]).collect())
    }

    /// Launches the value bound kernel `kernel` on `qkv` into `bounds` (three words a head,
    /// zeroed before: it raises the third of each to the head's largest |V_j|, as f32 bits).
    fn launch_value_bound<T: Elem>(
        &self,
        kernel: ElemKernel,
        qkv: &CudaSlice<T>,
        bounds: &mut CudaViewMut<f32>,
        s: AttnShape,
    ) -> Result<()> {
        let (t, c, nh, _) = dims(s)?;
        let f = self.elem_function::<T>(kernel)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(qkv).arg(bounds).arg(&t).arg(&c).arg(&nh);
        let launch = Launch {
            kernel,
            rows: TC_ROWS,
            threads: TC_THREADS,
            shared: 0,
        };
        // SAFETY: the kernel reads the V third of `qkv` ([B, T, 3C], checked by the callers)
        // and raises one word a head of `bounds` (3 B NH values) by atomicMax.
        unsafe { b.launch(rows_grid(s.seq, launch, s)) }?;
        Ok(())
    }

    /// [`Self::attention_backward`] of [`Self::windowed_attention_forward`] with the same
    /// `window`.
    #[allow(clippy::too_many_arguments)]
    pub fn windowed_attention_backward<T: Elem>(
        &self,
        dqkv: &mut CudaSlice<T>,
        dout: &CudaSlice<T>,
        qkv: &CudaSlice<T>,
        out: &CudaSlice<T>,
        lse: &CudaSlice<f32>,
        s: AttnShape,
        window: usize,
        math: GemmMath,
    ) -> Result<()> {
        let (t, c, nh, hs) = dims(s)?;
        let w = window_arg(window)?;
        let rows = s.batch * s.heads * s.seq;
        check_len(
            "attention_backward",
            "dqkv",
            dqkv,
            s.batch * s.seq * 3 * s.channels,
        )?;
        check_len(
            "attention_backward",
            "dout",
            dout,
            s.batch * s.seq * s.channels,
        )?;
        check_len(
            "attention_backward",
            "out",
            out,
            s.batch * s.seq * s.channels,
        )?;
        check_len("attention_backward", "lse", lse, rows)?;
        let mut plan = self.attention_plan::<T>(
            hs,
            &[
                raw_ptr(dqkv, &self.stream),
                raw_ptr(dout, &self.stream),
                raw_ptr(qkv, &self.stream),
                raw_ptr(out, &self.stream),
            ],
            math,
        )?;
        // Written by the dQ kernel, read by the dK/dV kernel (same stream, so in order): the
        // row terms d, then the heads' bounds (Plan::head_bounds), as f32 bit patterns.
        let mut scratch = self.alloc::<f32>(backward_scratch_len(s))?;
        let (mut d, mut bounds) = scratch.split_at_mut(rows);
        if plan.head_bounds
            && T::DTYPE == DType::F16
            && let Some(kernel) = value_bound_kernel(hs)
        {
            self.stream.memset_zeros(&mut bounds)?;
            self.launch_value_bound(kernel, qkv, &mut bounds, s)?;
        }
        // The TMA forms' maps of the streamed tiles, each kernel's boxes its own tile rows:
        // dQ's of K and V in `qkv`; dK/dV's of Q in `qkv` and of dO.
        let qkv_map =
            |rows| rows_tensor_map::<T>(raw_ptr(qkv, &self.stream), 3 * s.channels, s, rows);
        let encode_dkv = |rows| -> Result<_> {
            let g = rows_tensor_map::<T>(raw_ptr(dout, &self.stream), s.channels, s, rows)?;
            Ok((qkv_map(rows)?, g))
        };
        let encoded = (|| -> Result<_> {
            let dq = plan
                .dq_map()
                .then(|| qkv_map(wgmma_backward_rows(hs, false, true)));
            let dkv = plan
                .dkv_maps()
                .then(|| encode_dkv(wgmma_backward_rows(hs, true, true)));
            Ok((dq.transpose()?, dkv.transpose()?))
        })();
        let (dq_map, dkv_maps) = match encoded {
            Ok(m) => m,
            Err(e) => {
                note_tma_fallback(&e);
                plan = plan.without_tma(hs);
                (None, None)
            }
        };
        {
            let f = self.attention_kernel::<T>(plan.dq)?;
            let mut b = self.stream.launch_builder(f);
            b.arg(qkv);
            if plan.tensor_cores {
                b.arg(out);
            }
            b.arg(dout).arg(lse).arg(&mut d);
            if plan.head_bounds {
                b.arg(&mut bounds);
            }
            b.arg(&mut *dqkv).arg(&t).arg(&c).arg(&nh).arg(&w);
            if let Some(map) = &dq_map {
                b.arg(map);
            }
            // SAFETY: as above; this kernel writes the Q third of each dqkv row, `d`, and with
            // head_bounds two of the three words a head of `bounds` (its `3 B NH` values); the
            // TMA form's map describes `qkv` itself.
            unsafe { b.launch(rows_grid(s.seq, plan.dq, s)) }?;
        }
        let f = self.attention_kernel::<T>(plan.dkv)?;
        let mut b = self.stream.launch_builder(f);
        // The views are passed mutably (the kernel only reads them): cudarc pushes a view
        // mutably or a whole slice either way.
        b.arg(qkv).arg(dout).arg(lse).arg(&mut d);
        if plan.head_bounds {
            b.arg(&mut bounds);
        }
        b.arg(dqkv).arg(&t).arg(&c).arg(&nh).arg(&w);
        if let Some((qkv_map, dout_map)) = &dkv_maps {
            b.arg(qkv_map).arg(dout_map);
        }
        // SAFETY: as above; this kernel writes only the K and V thirds of each dqkv row; the
        // TMA form's maps describe `qkv` and `dout` themselves.
        unsafe { b.launch(rows_grid(s.seq, plan.dkv, s)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cuda::loader::{CudaLibrary, ensure_loaded};
    use crate::engine::cuda::nvrtc;

    /// The byte counts the launcher passes must be those of the kernels' layouts (a launch with
    /// fewer traps), and every sm_80..sm_90 GPU must allow them: sm_86 and sm_89 give a block
    /// at most 99 KiB, the least of those generations.
    #[test]
    fn tensor_core_shared_memory_fits_every_sm80_gpu() {
        // Head size 64: forward [K0 V0 K1 V1] of 64 x 72; dQ the same (Q, dO staged in K1, V1);
        // dK/dV [Q0 dO0 Q1 dO1] and two 64-float lse and d buffers.
        assert_eq!(
            tc_shared(64),
            TcShared {
                forward: 4 * 64 * 72 * 2,
                dq: 4 * 64 * 72 * 2,
                dkv: 4 * 64 * 72 * 2 + 4 * 64 * 4,
            }
        );
        // Head size 128: 32-row tiles of 136; dQ stages Q and dO (64 rows each) from K1 on;
        // dK/dV adds its K and V tiles (64 rows each).
        assert_eq!(
            tc_shared(128),
            TcShared {
                forward: 4 * 32 * 136 * 2,
                dq: (2 * 32 + 2 * 64) * 136 * 2,
                dkv: (4 * 32 + 2 * 64) * 136 * 2 + 4 * 32 * 4,
            }
        );
        for hs in TC_HEAD_SIZES {
            let s = tc_shared(hs);
            assert!(s.forward.max(s.dq).max(s.dkv) <= 99 << 10, "{hs}: {s:?}");
        }
        // GPT-2's shape needs no opt-in, as before.
        let s = tc_shared(64);
        assert!(s.forward.max(s.dq).max(s.dkv) <= DEFAULT_SHARED_BYTES);
    }

    /// The f32 kernels' byte counts are `TfShape`'s, and every sm_80..sm_90 GPU allows them
    /// (99 KiB a block on sm_86 and sm_89, the least: dK/dV at head size 128 takes all of it).
    #[test]
    fn tf32_shared_memory_is_the_kernel_layout_and_fits_every_sm80_gpu() {
        // Head size 64: rows of 68 floats; the forward streams 64-row K and V tiles, the
        // backward 32-row ones; dK/dV keeps K and V in registers.
        assert_eq!(
            tf32_shared(64),
            TcShared {
                forward: 4 * 64 * 68 * 4,
                dq: 4 * 32 * 68 * 4,
                dkv: 4 * 32 * 68 * 4,
            }
        );
        // Head size 128: rows of 132; 32 and 16-row tiles; dK/dV adds 64 K and 64 V rows.
        assert_eq!(
            tf32_shared(128),
            TcShared {
                forward: 4 * 32 * 132 * 4,
                dq: 4 * 16 * 132 * 4,
                dkv: (4 * 16 + 2 * 64) * 132 * 4,
            }
        );
        for hs in TC_HEAD_SIZES {
            let s = tf32_shared(hs);
            assert!(s.forward.max(s.dq).max(s.dkv) <= 99 << 10, "{hs}: {s:?}");
        }
    }

    /// Static shared memory of the TMA forms (ptxas: their 24 bytes of barriers, padded to the
    /// dynamic memory's 1024-byte alignment), beside the dynamic bytes the launcher asks for.
    const TMA_STATIC_SHARED: u32 = 1024;

    /// The Hopper forward's byte counts are `WgShape::bytes` of its configurations, and the
    /// blocks that its registers allow an SM (three at head size 64, two at 128) fit an sm_90
    /// SM's shared memory (228 KiB, 1 KiB of it reserved per block; at most 227 KiB a block).
    #[test]
    fn wgmma_shared_memory_is_the_kernel_layout_and_blocks_fit() {
        // Head size 64: one warpgroup (64 queries, 128 threads); three stages of [K | V] of
        // 64 keys x 64 columns; 1024 bytes of alignment slack.
        assert_eq!(
            wgmma_config(64),
            WgmmaConfig {
                keys: 64,
                groups: 1,
                q_shared: false
            }
        );
        assert_eq!((wgmma_rows(64), wgmma_threads(64)), (64, 128));
        assert_eq!(wgmma_shared(64), 2 * 3 * 64 * 128 + 1024);
        assert!(3 * (wgmma_shared(64) + 1024 + TMA_STATIC_SHARED) <= 228 << 10);
        // Head size 128: the same, each tile two 64-column halves; two blocks an SM.
        assert_eq!(wgmma_config(128), wgmma_config(64));
        assert_eq!((wgmma_rows(128), wgmma_threads(128)), (64, 128));
        assert_eq!(wgmma_shared(128), 2 * 3 * 2 * 64 * 128 + 1024);
        assert!(2 * (wgmma_shared(128) + 1024 + TMA_STATIC_SHARED) <= 228 << 10);
    }

    /// The Hopper backward's byte counts are `WgBackShape::bytes`, and two warpgroups of each
    /// kernel (what their registers allow: two blocks of one, or one of two) fit an sm_90 SM's
    /// shared memory.
    #[test]
    fn wgmma_backward_shared_memory_is_the_kernel_layout_and_two_blocks_fit() {
        // Warpgroups a block (WgBackward's dq_groups, dkv_groups, dkv_tma_groups): two in
        // dK/dV's TMA form at both head sizes, launched as 128 rows of 256 threads.
        for (hs, dkv, tma, groups) in [
            (64, true, true, 2),
            (64, true, false, 1),
            (64, false, true, 1),
            (128, true, true, 2),
            (128, false, true, 1),
        ] {
            assert_eq!(wgmma_backward_groups(dkv, tma), groups, "{hs} {dkv} {tma}");
        }
        let l = wgmma_backward_launch(ElemKernel::AttentionBackwardDkvHs64WgmmaTma, 64, true);
        assert_eq!((l.rows, l.threads), (128, 256));
        let l = wgmma_backward_launch(ElemKernel::AttentionBackwardDkvHs64Wgmma, 64, true);
        assert_eq!((l.rows, l.threads), (64, 128));
        // Head size 64: dQ's Q and dO, 64 x 64 each (dK/dV's K and V are in registers);
        // three stages of two 64-row tiles; dK/dV adds each stage's 64 lse and 64 d.
        assert_eq!(
            wgmma_backward_shared(64, false, false, 1),
            2 * 64 * 128 + 3 * 2 * 64 * 128 + 1024
        );
        for groups in [1, 2] {
            assert_eq!(
                wgmma_backward_shared(64, true, groups == 2, groups),
                3 * (2 * 64 * 128 + 2 * 64 * 4) + 1024
            );
        }
        // Head size 128: rows of two 64-column halves; dQ streams 64-row tiles with Q and dO
        // in registers, dK/dV 32-row tiles with V alone in shared memory (a warpgroup's own).
        assert_eq!(
            wgmma_backward_shared(128, false, false, 1),
            3 * 2 * 2 * 64 * 128 + 1024
        );
        assert_eq!(
            wgmma_backward_shared(128, true, false, 1),
            2 * 64 * 128 + 3 * (2 * 2 * 32 * 128 + 2 * 32 * 4) + 1024
        );
        // dK/dV's TMA form: two warpgroups, each with K and V in shared memory, 64-row tiles.
        assert_eq!(
            wgmma_backward_shared(128, true, true, 2),
            2 * 2 * 2 * 64 * 128 + 3 * (2 * 2 * 64 * 128 + 2 * 64 * 4) + 1024
        );
        for hs in TC_HEAD_SIZES {
            for dkv in [false, true] {
                // Two warpgroups' blocks, each with the 1 KiB the driver reserves and the TMA
                // forms' static barriers.
                let groups = wgmma_backward_groups(dkv, true);
                assert!(
                    2 / groups
                        * (wgmma_backward_shared(hs, dkv, true, groups) + 1024 + TMA_STATIC_SHARED)
                        <= 228 << 10
                );
            }
        }
    }

    /// The persistent forward's shared memory is its kernel's layout (`WgPersistShape::bytes`):
    /// Q's rows, two stages of 128-key K and V tiles, the consumer warps' output staging and
    /// the barriers; one block an SM with the driver's reserved KiB.
    #[test]
    fn persistent_shared_memory_is_the_kernel_layout() {
        assert_eq!(
            persistent_config(128),
            PersistentShape {
                keys: 128,
                stages: 2,
                consumers: 2
            }
        );
        assert_eq!((persistent_rows(128), persistent_threads(128)), (128, 384));
        assert_eq!(
            persistent_shared(128),
            1024 + 2 * 128 * 128 + 2 * 2 * 2 * 128 * 128 + 8 * 16 * 272 + 10 * 8
        );
        // Head size 64: three consumers, 192 rows of Q, twelve warps' staging.
        assert_eq!(persistent_config(64).consumers, 3);
        assert_eq!((persistent_rows(64), persistent_threads(64)), (192, 512));
        assert_eq!(
            persistent_shared(64),
            1024 + 192 * 128 + 2 * 2 * 128 * 128 + 12 * 16 * 144 + 10 * 8
        );
        for hs in [64, 128] {
            assert!(persistent_shared(hs) + 1024 <= 228 << 10);
            let kernel = wgmma_persistent_forward(hs).expect("a persistent forward");
            assert!(is_persistent_kernel(kernel) && is_tma_kernel(kernel));
        }
    }

    /// Where a tensor map cannot be encoded, a TMA plan falls back to the kernels whose threads
    /// copy the tiles, with their launch shapes and no maps.
    #[test]
    fn a_tma_plan_without_tma_takes_the_threads_copies() {
        for hs in TC_HEAD_SIZES {
            let tma = wgmma_tma_kernels(hs).unwrap_or_else(|| panic!("no TMA kernels for {hs}"));
            let [forward, dq, dkv] = wgmma_kernels(hs).unwrap_or_else(|| panic!("none for {hs}"));
            let (tma_dq, tma_dkv) = (tma.dq.unwrap_or(dq), tma.dkv.unwrap_or(dkv));
            let plan = Plan {
                forward: Launch {
                    kernel: tma.forward,
                    rows: wgmma_rows(hs),
                    threads: wgmma_threads(hs),
                    shared: wgmma_shared(hs),
                },
                dq: wgmma_backward_launch(tma_dq, hs, false),
                dkv: wgmma_backward_launch(tma_dkv, hs, true),
                tensor_cores: true,
                head_bounds: true,
            };
            assert!(plan.forward_map());
            assert_eq!(
                (plan.dq_map(), plan.dkv_maps()),
                (tma.dq.is_some(), tma.dkv.is_some())
            );
            let back = plan.without_tma(hs);
            assert_eq!(
                [back.forward.kernel, back.dq.kernel, back.dkv.kernel],
                [forward, dq, dkv]
            );
            assert!(!back.forward_map() && !back.dq_map() && !back.dkv_maps());
            assert!(back.tensor_cores && back.head_bounds);
            assert_eq!(back.forward.shared, wgmma_shared(hs));
            // The backward's blocks are the threads' copies' (one warpgroup in dK/dV).
            for (launch, dkv) in [(back.dq, false), (back.dkv, true)] {
                assert_eq!(
                    (launch.rows, launch.threads, launch.shared),
                    (
                        TC_ROWS,
                        TC_THREADS,
                        wgmma_backward_shared(hs, dkv, false, 1)
                    )
                );
            }
            // The persistent forward falls back to the one-warpgroup forward's launch shape.
            if let Some(kernel) = wgmma_persistent_forward(hs) {
                let persistent = Plan {
                    forward: Launch {
                        kernel,
                        rows: persistent_rows(hs),
                        threads: persistent_threads(hs),
                        shared: persistent_shared(hs),
                    },
                    dq: wgmma_backward_launch(tma_dq, hs, false),
                    dkv: wgmma_backward_launch(tma_dkv, hs, true),
                    tensor_cores: true,
                    head_bounds: true,
                };
                assert!(persistent.forward_map());
                let back = persistent.without_tma(hs);
                assert_eq!(back.forward.kernel, forward);
                assert_eq!(
                    (back.forward.rows, back.forward.threads, back.forward.shared),
                    (wgmma_rows(hs), wgmma_threads(hs), wgmma_shared(hs))
                );
            }
        }
    }

    /// Every kernel the launcher asks for is one the program defines: each dtype, head size and
    /// kernel, compiled for sm_80, sm_86 and sm_90 (skipped where NVRTC is absent).
    #[test]
    fn every_tensor_core_kernel_is_in_the_compiled_program() {
        let mut names = Vec::new();
        for hs in TC_HEAD_SIZES {
            let kernels = tc_kernels(hs).unwrap_or_else(|| panic!("no kernels for {hs}"));
            let hopper = wgmma_kernels(hs).unwrap_or_else(|| panic!("no wgmma for {hs}"));
            let tma = wgmma_tma_kernels(hs).unwrap_or_else(|| panic!("no TMA kernels for {hs}"));
            for dtype in [DType::BF16, DType::F16] {
                names.extend(kernels.iter().map(|k| k.name(dtype)));
                names.extend(hopper.iter().map(|k| k.name(dtype)));
                names.push(tma.forward.name(dtype));
                names.extend([tma.dq, tma.dkv].iter().flatten().map(|k| k.name(dtype)));
                names.extend(wgmma_persistent_forward(hs).map(|k| k.name(dtype)));
            }
            names.extend(value_bound_kernel(hs).map(|k| k.name(DType::F16)));
        }
        for hs in TC_16BIT_HEAD_SIZES {
            let kernels = tc_kernels(hs).unwrap_or_else(|| panic!("no kernels for {hs}"));
            assert!(wgmma_kernels(hs).is_none() && tf32_kernels(hs, GemmMath::Tf32).is_none());
            for dtype in [DType::BF16, DType::F16] {
                names.extend(kernels.iter().map(|k| k.name(dtype)));
            }
        }
        assert_program_defines(&PROGRAM_TC, names);
    }

    /// The same for the f32 tensor-core program: both product kinds at both head sizes.
    #[test]
    fn every_tf32_kernel_is_in_the_compiled_program() {
        let mut names = Vec::new();
        for hs in TC_HEAD_SIZES {
            for math in [GemmMath::Tf32, GemmMath::Fp32] {
                let kernels = tf32_kernels(hs, math).unwrap_or_else(|| panic!("none for {hs}"));
                names.extend(kernels.iter().map(|k| k.name(DType::F32)));
            }
        }
        assert_program_defines(&PROGRAM_TF32, names);
    }

    /// `program` lists exactly the kernels `names`, and its CUBIN for sm_80, sm_86 and sm_90
    /// holds each of them (skipped where NVRTC is absent).
    fn assert_program_defines(program: &Program, mut names: Vec<&str>) {
        if let Err(e) = ensure_loaded(CudaLibrary::Nvrtc) {
            eprintln!("skipped: {e}");
            return;
        }
        let mut listed: Vec<&str> = program.entries().map(|(_, name)| name).collect();
        listed.sort();
        names.sort();
        assert_eq!(listed, names);
        let has = |cubin: &[u8], name: &str| {
            let symbol = format!("{name}\0");
            cubin.windows(symbol.len()).any(|w| w == symbol.as_bytes())
        };
        for arch in [80, 86, 90] {
            let cubin = nvrtc::compile(program.name, &program.full_source(), arch, None)
                .unwrap_or_else(|e| panic!("sm_{arch}: {e}"))
                .cubin;
            for name in &names {
                assert!(has(&cubin, name), "sm_{arch}: {name} missing");
            }
            // A name the program does not define is not found by the same search.
            assert!(!has(&cubin, "attention_f32_hs128"));
        }
    }
}
