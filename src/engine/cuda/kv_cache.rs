//! The key/value cache of generation on the GPU; reference: [`crate::engine::cpu::kv_cache`].
//! Caches, queries and outputs are `T`; slots and positions are u32 per row and the cos/sin
//! tables f32 `[positions, rot/2]`.
//!
//! [`CudaBackend::cache_attention`] is the decode kernel: one block per (row, key/value head,
//! chunk of up to 8 query heads), so the query heads of a group share every key and value
//! loaded. When those blocks alone would leave the GPU underfilled and the rows are long (a
//! few sequences decoding far into their context), each row's positions are split over
//! several blocks whose partial softmax states a second kernel merges (flash-decoding). A
//! decode step's appending calls at head sizes 64 and 128 take a kernel that gives each thread
//! a position's scores and then a range of the values' dimensions (`cache_attention_positions`
//! in `kv_cache.cu`): its chains of dependent instructions are shorter than those of the
//! kernel of a group of lanes per cached vector, which serves the other calls.
//! [`CudaBackend::prefill_pack`] lays a prefill's prompts out for the training attention
//! instead (`engine::ops` decides which path a call takes).

use super::overlap::kernel_params;
use super::{
    CudaBackend, CudaError, Elem, ElemKernel, Program, Result, as_i32, check_len, elementwise_grid,
    raw_ptr,
};
use crate::engine::DType;
use crate::engine::cpu::kv_cache::CacheShape;
use crate::engine::cpu::rope::RopeShape;
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

/// One program per element type, so that a first start compiles them side by side.
macro_rules! program {
    ($name:ident, $t:literal, $s:literal, $d:ident) => {
        pub(super) const $name: Program = Program {
            name: concat!("kv_cache_", $s),
            source: concat!(
                include_str!("kv_cache.cu"),
                "\nKV_KERNELS(",
                $t,
                ", ",
                $s,
                ")\n"
            ),
            kernels: &[],
            elem_kernels: &[
                ElemKernel::KvAppend,
                ElemKernel::KvAppendNormed,
                ElemKernel::KvAppendRows,
                ElemKernel::KvAppendNormedRows,
                ElemKernel::CopyCacheSlot,
                ElemKernel::PrefillPack,
                ElemKernel::CacheAttentionCombine,
                ElemKernel::CacheAttentionL8G2,
                ElemKernel::CacheAttentionL8G4,
                ElemKernel::CacheAttentionL8G8,
                ElemKernel::CacheAttentionL16G2,
                ElemKernel::CacheAttentionL16G4,
                ElemKernel::CacheAttentionL16G8,
                ElemKernel::CacheAttentionL32G2,
                ElemKernel::CacheAttentionL32G4,
                ElemKernel::CacheAttentionL32G8,
                ElemKernel::CacheAttentionWideL8G2,
                ElemKernel::CacheAttentionWideL8G3,
                ElemKernel::CacheAttentionWideL8G4,
                ElemKernel::CacheAttentionWideL8G8,
                ElemKernel::CacheAttentionWideL16G2,
                ElemKernel::CacheAttentionWideL16G4,
                ElemKernel::CacheAttentionWideL16G8,
                ElemKernel::CacheAttentionAppendL8G2,
                ElemKernel::CacheAttentionAppendL8G3,
                ElemKernel::CacheAttentionAppendL8G4,
                ElemKernel::CacheAttentionAppendL8G8,
                ElemKernel::CacheAttentionAppendL16G2,
                ElemKernel::CacheAttentionAppendL16G4,
                ElemKernel::CacheAttentionAppendL16G8,
                ElemKernel::CacheAttentionAppendD64G2,
                ElemKernel::CacheAttentionAppendD64G3,
                ElemKernel::CacheAttentionAppendD64G4,
                ElemKernel::CacheAttentionAppendD64G8,
                ElemKernel::CacheAttentionAppendD128G2,
                ElemKernel::CacheAttentionAppendD128G4,
                ElemKernel::CacheAttentionAppendD128G8,
            ],
            dtypes: &[DType::$d],
        };
    };
}

program!(PROGRAM_F32, "float", "f32", F32);
program!(PROGRAM_BF16, "bf16", "bf16", BF16);
program!(PROGRAM_F16, "f16", "f16", F16);

const BLOCK: u32 = 256;

/// Threads of a narrow attention block.
const NARROW_THREADS: u32 = 128;
/// Threads of a wide one (head sizes up to 128: at 256, the warps' merged states of eight
/// heads of 256 would pass the 48 KiB of static shared memory).
const WIDE_THREADS: u32 = 256;
/// The largest head size the attention kernels take (32 lanes of 8 elements).
pub const MAX_HEAD_DIM: usize = 256;

/// The kernels' `AppendDims`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AppendDims {
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    rot_dim: i32,
    positions: u32,
    slots: i32,
    max_len: i32,
}

// SAFETY: i32s and a u32, `repr(C)`, the same layout as the CUDA struct.
unsafe impl DeviceRepr for AppendDims {}

/// The kernels' `AttnDims`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AttnDims {
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    max_len: i32,
    slots: i32,
    chunks: i32,
    splits: i32,
    scale_log2: f32,
    window: i32,
}

// SAFETY: seven i32, an f32 and an i32, `repr(C)`, the same layout as the CUDA struct.
unsafe impl DeviceRepr for AttnDims {}

/// How an attention call is laid out: lanes per cached vector, query heads per block (2, 4 or
/// 8, a block with fewer repeating its last; 3 for three a key/value head in wide blocks of
/// eight lanes), chunks of them per key/value head, and splits of each row's positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnPlan {
    pub lanes: usize,
    pub group: usize,
    pub chunks: usize,
    pub splits: usize,
    /// Wide blocks: the call's blocks alone leave room on the GPU.
    pub wide: bool,
}

/// Rows at most this long are never split: one block reads them quickly enough.
const SPLIT_FROM: usize = 256;
/// Each split covers at least this many positions.
const MIN_SPLIT: usize = 128;
const MAX_SPLITS: usize = 64;
/// Blocks per SM a call aims for before it splits rows.
const BLOCKS_PER_SM: usize = 4;
/// Calls of at most this many blocks an SM take wide blocks (measured on an H200: SmolLM2's
/// decode at batch 64, 1.45 blocks an SM, gains 7% from them, Llama-3.2-1B's at batch 64, 3.9,
/// loses 4%).
const WIDE_UP_TO: usize = 2;

/// The layout of a call of `rows` rows, the longest attending to `longest` positions, on a GPU
/// of `sm_count` SMs; `None` for a head size past [`MAX_HEAD_DIM`].
pub fn attention_plan(
    rows: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    longest: usize,
    sm_count: usize,
) -> Option<AttnPlan> {
    let lanes = match head_dim {
        0..=64 => 8,
        65..=128 => 16,
        129..=MAX_HEAD_DIM => 32,
        _ => return None,
    };
    let g = (heads / kv_heads.max(1)).max(1);
    let group = g.next_power_of_two().clamp(2, 8);
    let chunks = g.div_ceil(group);
    let blocks = rows * kv_heads * chunks;
    let splits = if longest <= SPLIT_FROM || blocks == 0 {
        1
    } else {
        (BLOCKS_PER_SM * sm_count / blocks).clamp(1, longest.div_ceil(MIN_SPLIT).min(MAX_SPLITS))
    };
    let wide = blocks * splits <= WIDE_UP_TO * sm_count;
    // Three heads a key/value head (one chunk either way) take the wide kernels of three
    // where they exist instead of repeating a fourth.
    let group = if g == 3 && wide && lanes == 8 {
        3
    } else {
        group
    };
    Some(AttnPlan {
        lanes,
        group,
        chunks,
        splits,
        wide,
    })
}

/// The attention kernel of a layout's lanes per vector and query heads per block, wide or
/// narrow, appending or not, and its threads a block. Head sizes past 128 have narrow blocks
/// only, and only wide blocks append.
fn cache_attention_kernel(
    lanes: usize,
    group: usize,
    wide: bool,
    append: bool,
) -> Option<(ElemKernel, u32)> {
    use ElemKernel::*;
    let kernel = match (lanes, group, wide, append) {
        (8, 2, false, false) => CacheAttentionL8G2,
        (8, 4, false, false) => CacheAttentionL8G4,
        (8, 8, false, false) => CacheAttentionL8G8,
        (16, 2, false, false) => CacheAttentionL16G2,
        (16, 4, false, false) => CacheAttentionL16G4,
        (16, 8, false, false) => CacheAttentionL16G8,
        (32, 2, _, false) => CacheAttentionL32G2,
        (32, 4, _, false) => CacheAttentionL32G4,
        (32, 8, _, false) => CacheAttentionL32G8,
        (8, 2, true, false) => CacheAttentionWideL8G2,
        (8, 3, true, false) => CacheAttentionWideL8G3,
        (8, 4, true, false) => CacheAttentionWideL8G4,
        (8, 8, true, false) => CacheAttentionWideL8G8,
        (16, 2, true, false) => CacheAttentionWideL16G2,
        (16, 4, true, false) => CacheAttentionWideL16G4,
        (16, 8, true, false) => CacheAttentionWideL16G8,
        (8, 2, true, true) => CacheAttentionAppendL8G2,
        (8, 3, true, true) => CacheAttentionAppendL8G3,
        (8, 4, true, true) => CacheAttentionAppendL8G4,
        (8, 8, true, true) => CacheAttentionAppendL8G8,
        (16, 2, true, true) => CacheAttentionAppendL16G2,
        (16, 4, true, true) => CacheAttentionAppendL16G4,
        (16, 8, true, true) => CacheAttentionAppendL16G8,
        _ => return None,
    };
    let threads = if wide && lanes < 32 {
        WIDE_THREADS
    } else {
        NARROW_THREADS
    };
    Some((kernel, threads))
}

/// The appending kernel a position a thread (`cache_attention_positions`) for a head size and
/// query heads per block, where one is compiled: head sizes 64 and 128 exactly.
fn positions_kernel(head_dim: usize, group: usize) -> Option<ElemKernel> {
    use ElemKernel::*;
    Some(match (head_dim, group) {
        (64, 2) => CacheAttentionAppendD64G2,
        (64, 3) => CacheAttentionAppendD64G3,
        (64, 4) => CacheAttentionAppendD64G4,
        (64, 8) => CacheAttentionAppendD64G8,
        (128, 2) => CacheAttentionAppendD128G2,
        (128, 4) => CacheAttentionAppendD128G4,
        (128, 8) => CacheAttentionAppendD128G8,
        _ => return None,
    })
}

/// The kernel a position a thread for an appending call of this layout, where it takes it:
/// wide blocks of head size 64 or 128 whose chunks of query heads are all full. (Qwen2.5's
/// seven query heads a key/value head, in blocks of eight, keep the older kernel: the new
/// kernel's handling of a partial chunk has not yet run against the CPU reference on a GPU.)
fn appending_positions_kernel(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    plan: &AttnPlan,
) -> Option<ElemKernel> {
    let full_chunks = kv_heads > 0 && (heads / kv_heads).is_multiple_of(plan.group);
    (plan.wide && plan.lanes < 32 && full_chunks)
        .then(|| positions_kernel(head_dim, plan.group))
        .flatten()
}

/// Whether appending calls take the kernel a position a thread where one fits
/// (`KILN_DECODE_ATTENTION=lanes` keeps the kernel of a group of lanes per cached vector, for
/// comparing the two in one build).
fn positions_layout() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_DECODE_ATTENTION").map_or(true, |v| v != "lanes"))
}

/// An attention call laid out: the kernel's dimensions, its plan and its grid.
struct AttnLaunch {
    dims: AttnDims,
    plan: AttnPlan,
    kernel: ElemKernel,
    /// The kernel appends the rows' keys and values itself.
    appends: bool,
    cfg: LaunchConfig,
    /// Rows x query heads: the outputs, and the combine kernel's blocks.
    outputs: usize,
}

/// The launch of the row kernels (`kv_append_rows`: one block a row, a piece of eight
/// elements a thread, 16-byte loads and stores) where the pieces line up: head size and rotary
/// half multiples of eight, every buffer (`bufs`, device addresses) on a 16-byte boundary.
/// `None` leaves the call to the element kernels, a thread an element.
fn rows_launch(s: RopeShape, bufs: &[u64]) -> Option<LaunchConfig> {
    let lined_up = s.head_dim.is_multiple_of(8)
        && s.rot_dim.is_multiple_of(16)
        && bufs.iter().all(|p| p.is_multiple_of(16));
    if !lined_up || s.rows == 0 {
        return None;
    }
    let threads = (s.qkv_width() / 8).next_multiple_of(32).clamp(32, 256);
    Some(LaunchConfig {
        grid_dim: (u32::try_from(s.rows).ok().filter(|&r| r < 1 << 31)?, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (elementwise_grid(n, BLOCK), 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Checks the cache buffers against their shape; returns the shape's sizes as `int`s.
fn check_cache<T>(
    op: &'static str,
    k: &CudaSlice<T>,
    v: &CudaSlice<T>,
    c: CacheShape,
) -> Result<(i32, i32)> {
    check_len(op, "k_cache", k, c.len())?;
    check_len(op, "v_cache", v, c.len())?;
    as_i32(op, "kv_heads", c.kv_heads)?;
    as_i32(op, "head_dim", c.head_dim)?;
    Ok((
        as_i32(op, "slots", c.slots)?,
        as_i32(op, "max_len", c.max_len)?,
    ))
}

impl CudaBackend {
    /// Checks an append's buffers against its shapes and returns the kernels' dimensions.
    #[allow(clippy::too_many_arguments)]
    fn append_dims<T: Elem>(
        &self,
        op: &'static str,
        q: Option<&CudaSlice<T>>,
        k_cache: &CudaSlice<T>,
        v_cache: &CudaSlice<T>,
        qkv: &CudaSlice<T>,
        slot: &CudaSlice<u32>,
        pos: &CudaSlice<u32>,
        cos: &CudaSlice<f32>,
        sin: &CudaSlice<f32>,
        s: RopeShape,
        c: CacheShape,
    ) -> Result<AppendDims> {
        let bad = |detail: String| Err(CudaError::Shape { op, detail });
        if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
            return bad(format!(
                "{} query heads cannot share {} key/value heads evenly",
                s.heads, s.kv_heads
            ));
        }
        if s.kv_heads != c.kv_heads || s.head_dim != c.head_dim {
            return bad(format!(
                "{} key/value heads of {} for a cache of {} heads of {}",
                s.kv_heads, s.head_dim, c.kv_heads, c.head_dim
            ));
        }
        if !s.rot_dim.is_multiple_of(2) || s.rot_dim > s.head_dim {
            return bad(format!(
                "rotary dimensions {} must be even and at most the head size {}",
                s.rot_dim, s.head_dim
            ));
        }
        if cos.len() != sin.len() {
            return bad("the cos and sin tables differ in length".into());
        }
        let (slots, max_len) = check_cache(op, k_cache, v_cache, c)?;
        check_len(op, "slot", slot, s.rows)?;
        check_len(op, "pos", pos, s.rows)?;
        if let Some(q) = q {
            check_len(op, "q", q, s.rows * s.heads * s.head_dim)?;
        }
        check_len(op, "qkv", qkv, s.rows * s.qkv_width())?;
        as_i32(op, "projection width", s.qkv_width())?;
        let positions = cos
            .len()
            .checked_div(s.rot_dim / 2)
            .unwrap_or(u32::MAX as usize);
        Ok(AppendDims {
            heads: as_i32(op, "heads", s.heads)?,
            kv_heads: as_i32(op, "kv_heads", s.kv_heads)?,
            head_dim: as_i32(op, "head_dim", s.head_dim)?,
            rot_dim: as_i32(op, "rot_dim", s.rot_dim)?,
            positions: positions.min(u32::MAX as usize) as u32,
            slots,
            max_len,
        })
    }

    /// [`rows_launch`] for an append's buffers (`[q, k_cache, v_cache, qkv]`, the cos and sin
    /// tables, and the bias's address if it has one).
    fn append_rows_launch<T>(
        &self,
        s: RopeShape,
        bufs: [&CudaSlice<T>; 4],
        tables: [&CudaSlice<f32>; 2],
        bias: Option<u64>,
    ) -> Option<LaunchConfig> {
        let ptrs: Vec<u64> = (bufs.iter().map(|b| raw_ptr(b, &self.stream)))
            .chain(tables.iter().map(|t| raw_ptr(t, &self.stream)))
            .chain(bias)
            .collect();
        rows_launch(s, &ptrs)
    }

    /// Rotates each row's query heads into `q[rows, H D]`, and its rotated keys and its values
    /// into the caches at `(slot[row], pos[row])`, from `qkv[rows, (H + 2K) D]`. A row outside
    /// the cache writes nothing there and NaN queries; a position past the tables gives NaN in
    /// the rotated dimensions. Rows must name distinct `(slot, pos)` pairs.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append<T: Elem>(
        &self,
        q: &mut CudaSlice<T>,
        k_cache: &mut CudaSlice<T>,
        v_cache: &mut CudaSlice<T>,
        qkv: &CudaSlice<T>,
        slot: &CudaSlice<u32>,
        pos: &CudaSlice<u32>,
        cos: &CudaSlice<f32>,
        sin: &CudaSlice<f32>,
        s: RopeShape,
        c: CacheShape,
    ) -> Result<()> {
        const OP: &str = "kv_append";
        let dims = self.append_dims(
            OP,
            Some(&*q),
            k_cache,
            v_cache,
            qkv,
            slot,
            pos,
            cos,
            sin,
            s,
            c,
        )?;
        let total = s.rows * s.qkv_width();
        if total == 0 {
            return Ok(());
        }
        // The row kernel where the pieces line up, else a thread an element (which also takes
        // the element count).
        let rows_cfg =
            self.append_rows_launch(s, [&*q, &*k_cache, &*v_cache, qkv], [cos, sin], None);
        let kernel = match rows_cfg {
            Some(_) => ElemKernel::KvAppendRows,
            None => ElemKernel::KvAppend,
        };
        let f = self.elem_function::<T>(kernel)?;
        let total64 = total as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(qkv)
            .arg(slot)
            .arg(pos)
            .arg(cos)
            .arg(sin);
        if rows_cfg.is_none() {
            b.arg(&total64);
        }
        b.arg(&dims);
        // SAFETY: lengths checked above; the kernel bounds each row's slot and position by
        // the cache's and its table reads by `dims.positions`; `rows_launch` checked the row
        // kernel's alignment.
        unsafe { b.launch(rows_cfg.unwrap_or_else(|| grid(total))) }?;
        Ok(())
    }

    /// [`Self::kv_append`] of the projection of an unnormalised stream `x` (`rows` of `c`):
    /// every element of a row scaled first by `1 / sqrt(mean(x_row^2) + eps)`, then given the
    /// projection's `bias` (`qkv_width` values) if it has one.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_append_normed<T: Elem>(
        &self,
        q: &mut CudaSlice<T>,
        k_cache: &mut CudaSlice<T>,
        v_cache: &mut CudaSlice<T>,
        qkv: &CudaSlice<T>,
        x: &CudaSlice<T>,
        c: usize,
        eps: f32,
        bias: Option<&CudaSlice<T>>,
        slot: &CudaSlice<u32>,
        pos: &CudaSlice<u32>,
        cos: &CudaSlice<f32>,
        sin: &CudaSlice<f32>,
        s: RopeShape,
        cache: CacheShape,
    ) -> Result<()> {
        const OP: &str = "kv_append_normed";
        let dims = self.append_dims(
            OP,
            Some(&*q),
            k_cache,
            v_cache,
            qkv,
            slot,
            pos,
            cos,
            sin,
            s,
            cache,
        )?;
        check_len(OP, "x", x, s.rows * c)?;
        if let Some(b) = bias {
            check_len(OP, "bias", b, s.qkv_width())?;
        }
        // The bias's address, or null for none (the kernel tests for it).
        let bias_ptr = bias.map_or(0u64, |b| super::raw_ptr(b, &self.stream));
        if s.rows * s.qkv_width() == 0 {
            return Ok(());
        }
        let c32 = as_i32(OP, "c", c)?;
        let rows_cfg = self.append_rows_launch(
            s,
            [&*q, &*k_cache, &*v_cache, qkv],
            [cos, sin],
            bias.map(|_| bias_ptr),
        );
        let kernel = match rows_cfg {
            Some(_) => ElemKernel::KvAppendNormedRows,
            None => ElemKernel::KvAppendNormed,
        };
        let f = self.elem_function::<T>(kernel)?;
        let st = &self.stream;
        let [qp, kp, vp] = [&*q, &*k_cache, &*v_cache].map(|b| raw_ptr(b, st));
        let [qkvp, xp] = [qkv, x].map(|b| raw_ptr(b, st));
        let [slotp, posp] = [slot, pos].map(|b| raw_ptr(b, st));
        let [cosp, sinp] = [cos, sin].map(|b| raw_ptr(b, st));
        let mut params = kernel_params![
            qp, kp, vp, qkvp, xp, c32, eps, bias_ptr, slotp, posp, cosp, sinp, dims
        ];
        // A row's elements over a few blocks of 256 threads, each block taking the row's factor
        // (or the row kernel's one block a row).
        let cfg = rows_cfg.unwrap_or(LaunchConfig {
            grid_dim: (
                s.qkv_width().div_ceil(4 * 256) as u32,
                u32::try_from(s.rows).map_err(|_| CudaError::Shape {
                    op: OP,
                    detail: format!("{} rows exceed the grid", s.rows),
                })?,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        });
        // SAFETY: the kernel's parameters in order; lengths checked above; the kernel bounds
        // each row's slot and position by the cache's and its table reads by
        // `dims.positions`; `rows_launch` checked the row kernel's alignment; it waits for the
        // previous kernel first (grid_chain).
        unsafe { self.launch_overlapped(f, cfg, &mut params) }?;
        Ok(())
    }

    /// Checks an attention call of `slot.len()` rows and lays it out, with the appending
    /// kernel if `append` asks for it and the layout has one; `None` when it has nothing to
    /// compute.
    #[allow(clippy::too_many_arguments)]
    fn attention_launch<T: Elem>(
        &self,
        op: &'static str,
        append: bool,
        out: &CudaSlice<T>,
        k_cache: &CudaSlice<T>,
        v_cache: &CudaSlice<T>,
        slot: &CudaSlice<u32>,
        pos: &CudaSlice<u32>,
        heads: usize,
        window: usize,
        longest: usize,
        c: CacheShape,
    ) -> Result<Option<AttnLaunch>> {
        let bad = |detail: String| Err(CudaError::Shape { op, detail });
        if c.kv_heads == 0 || !heads.is_multiple_of(c.kv_heads) {
            return bad(format!(
                "{heads} query heads cannot share {} key/value heads evenly",
                c.kv_heads
            ));
        }
        let rows = slot.len();
        let (slots, max_len) = check_cache(op, k_cache, v_cache, c)?;
        check_len(op, "pos", pos, rows)?;
        check_len(op, "out", out, rows * heads * c.head_dim)?;
        let sm_count = self.info().sm_count as usize;
        // A row reads at most `window` positions, however far into the cache it is.
        let read = if window > 0 {
            longest.min(window)
        } else {
            longest
        };
        let Some(plan) = attention_plan(rows, heads, c.kv_heads, c.head_dim, read, sm_count) else {
            return bad(format!(
                "head size {} is past the kernel's {MAX_HEAD_DIM}",
                c.head_dim
            ));
        };
        if rows == 0 || heads == 0 || c.head_dim == 0 {
            return Ok(None);
        }
        let dims = AttnDims {
            heads: as_i32(op, "heads", heads)?,
            kv_heads: as_i32(op, "kv_heads", c.kv_heads)?,
            head_dim: as_i32(op, "head_dim", c.head_dim)?,
            max_len,
            slots,
            chunks: as_i32(op, "chunks", plan.chunks)?,
            splits: as_i32(op, "splits", plan.splits)?,
            scale_log2: std::f32::consts::LOG2_E / (c.head_dim as f32).sqrt(),
            window: as_i32(op, "window", window)?,
        };
        as_i32(op, "rows", rows)?;
        let y = c.kv_heads * plan.chunks;
        if y > 65_535 {
            return bad(format!("{y} blocks of heads per row exceed the grid"));
        }
        let appends = append && plan.wide && plan.lanes < 32;
        let positions = appending_positions_kernel(heads, c.kv_heads, c.head_dim, &plan)
            .filter(|_| appends && positions_layout())
            .map(|k| (k, WIDE_THREADS));
        let Some((kernel, threads)) = positions
            .or_else(|| cache_attention_kernel(plan.lanes, plan.group, plan.wide, appends))
        else {
            return Err(CudaError::Driver(format!(
                "no cache attention kernel for {} lanes and groups of {}",
                plan.lanes, plan.group
            )));
        };
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, y as u32, plan.splits as u32),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        Ok(Some(AttnLaunch {
            dims,
            plan,
            kernel,
            appends,
            cfg,
            outputs: rows * heads,
        }))
    }

    /// The splits' partial outputs and (max, sum) pairs of a launch; none with one split
    /// (the kernel never touches them then, and a decode step's chain of kernels stays free
    /// of allocations).
    fn attention_parts(
        &self,
        l: &AttnLaunch,
        head_dim: usize,
    ) -> Result<Option<[CudaSlice<f32>; 2]>> {
        if l.plan.splits == 1 {
            return Ok(None);
        }
        let parts = l.outputs * l.plan.splits;
        Ok(Some([
            self.alloc::<f32>(parts * head_dim.max(1))?,
            self.alloc::<f32>(2 * parts)?,
        ]))
    }

    /// The addresses of [`Self::attention_parts`]'s buffers, null for none.
    fn parts_ptrs(&self, parts: &Option<[CudaSlice<f32>; 2]>) -> [u64; 2] {
        parts
            .as_ref()
            .map_or([0, 0], |p| [&p[0], &p[1]].map(|b| raw_ptr(b, &self.stream)))
    }

    /// Merges a launch's splits into `out`; nothing with one split.
    fn combine_splits<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        l: &AttnLaunch,
        parts: &Option<[CudaSlice<f32>; 2]>,
        head_dim: usize,
    ) -> Result<()> {
        if parts.is_none() {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::CacheAttentionCombine)?;
        let cfg = LaunchConfig {
            grid_dim: (
                as_i32("cache_attention", "rows x heads", l.outputs)? as u32,
                1,
                1,
            ),
            block_dim: ((head_dim.div_ceil(32) * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let outp = raw_ptr(&*out, &self.stream);
        let [po, pml] = self.parts_ptrs(parts);
        let dims = l.dims;
        let mut params = kernel_params![outp, po, pml, dims];
        // SAFETY: the kernel's parameters in order; one block per (row, head) of `out`,
        // reading the splits the attention wrote, after waiting for it (grid_chain).
        unsafe { self.launch_overlapped(f, cfg, &mut params) }?;
        Ok(())
    }

    /// `out[r, h] = softmax(q[r, h] . K[slot, h/g, lo..=pos] / sqrt(D)) V[slot, h/g, lo..=pos]`
    /// for `q, out: [rows, H D]`, rows = `slot.len()`, with `lo` the first position of the
    /// sliding `window` (0 without one). `longest` is the longest row's length (its position
    /// plus one), which only chooses whether to split rows: each row reads its own position
    /// from `pos`. A row outside the cache gives NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn cache_attention<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        q: &CudaSlice<T>,
        k_cache: &CudaSlice<T>,
        v_cache: &CudaSlice<T>,
        slot: &CudaSlice<u32>,
        pos: &CudaSlice<u32>,
        heads: usize,
        window: usize,
        longest: usize,
        c: CacheShape,
    ) -> Result<()> {
        const OP: &str = "cache_attention";
        check_len(OP, "q", q, slot.len() * heads * c.head_dim)?;
        let Some(l) = self.attention_launch(
            OP, false, out, k_cache, v_cache, slot, pos, heads, window, longest, c,
        )?
        else {
            return Ok(());
        };
        let parts = self.attention_parts(&l, c.head_dim)?;
        let st = &self.stream;
        let outp = raw_ptr(&*out, st);
        let [po, pml] = self.parts_ptrs(&parts);
        let [qp, kp, vp] = [q, k_cache, v_cache].map(|b| raw_ptr(b, st));
        let [slotp, posp] = [slot, pos].map(|b| raw_ptr(b, st));
        let dims = l.dims;
        let mut params = kernel_params![outp, po, pml, qp, kp, vp, slotp, posp, dims];
        // SAFETY: the kernel's parameters in order; lengths checked above; the kernel bounds
        // each row's slot and position by the cache's, and writes the partial buffers only
        // with several splits, which then hold `outputs * splits` entries; it waits for the
        // previous kernel first (grid_chain).
        let f = self.elem_function::<T>(l.kernel)?;
        unsafe { self.launch_overlapped(f, l.cfg, &mut params) }?;
        self.combine_splits(out, &l, &parts, c.head_dim)
    }

    /// A decode step's [`Self::kv_append_normed`] followed by [`Self::cache_attention`] on the
    /// queries it rotates (`out: [rows, H D]`, rows = `s.rows`). Where the call has few blocks
    /// (wide ones: see [`AttnPlan::wide`]) one kernel does both and never stores the queries;
    /// otherwise the two kernels run. Rows must name distinct slots: a row cannot attend to
    /// another row's append of the same call (a prefill takes the two ops).
    #[allow(clippy::too_many_arguments)]
    pub fn cache_attention_append<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        k_cache: &mut CudaSlice<T>,
        v_cache: &mut CudaSlice<T>,
        qkv: &CudaSlice<T>,
        x: &CudaSlice<T>,
        c_x: usize,
        eps: f32,
        bias: Option<&CudaSlice<T>>,
        slot: &CudaSlice<u32>,
        pos: &CudaSlice<u32>,
        cos: &CudaSlice<f32>,
        sin: &CudaSlice<f32>,
        s: RopeShape,
        window: usize,
        longest: usize,
        c: CacheShape,
    ) -> Result<()> {
        const OP: &str = "cache_attention_append";
        let ad = self.append_dims(OP, None, k_cache, v_cache, qkv, slot, pos, cos, sin, s, c)?;
        check_len(OP, "x", x, s.rows * c_x)?;
        if let Some(b) = bias {
            check_len(OP, "bias", b, s.qkv_width())?;
        }
        let Some(l) = self.attention_launch(
            OP, true, out, k_cache, v_cache, slot, pos, s.heads, window, longest, c,
        )?
        else {
            return Ok(());
        };
        if !l.appends {
            let mut q = self.alloc::<T>(s.rows * s.heads * s.head_dim)?;
            self.kv_append_normed(
                &mut q, k_cache, v_cache, qkv, x, c_x, eps, bias, slot, pos, cos, sin, s, c,
            )?;
            return self.cache_attention(
                out, &q, k_cache, v_cache, slot, pos, s.heads, window, longest, c,
            );
        }
        let bias_ptr = bias.map_or(0u64, |b| super::raw_ptr(b, &self.stream));
        let c32 = as_i32(OP, "c", c_x)?;
        let parts = self.attention_parts(&l, c.head_dim)?;
        let st = &self.stream;
        let outp = raw_ptr(&*out, st);
        let [po, pml] = self.parts_ptrs(&parts);
        let [kp, vp] = [&*k_cache, &*v_cache].map(|b| raw_ptr(b, st));
        let [slotp, posp] = [slot, pos].map(|b| raw_ptr(b, st));
        let [qkvp, xp] = [qkv, x].map(|b| raw_ptr(b, st));
        let [cosp, sinp] = [cos, sin].map(|b| raw_ptr(b, st));
        let dims = l.dims;
        let mut params = kernel_params![
            outp, po, pml, kp, vp, slotp, posp, dims, qkvp, xp, bias_ptr, cosp, sinp, c32, eps, ad
        ];
        // SAFETY: the kernel's parameters in order; lengths checked above; the kernel bounds
        // each row's slot and position by the cache's and its table reads by `ad.positions`,
        // and writes the partial buffers only with several splits; it waits for the previous
        // kernel first (grid_chain).
        let f = self.elem_function::<T>(l.kernel)?;
        unsafe { self.launch_overlapped(f, l.cfg, &mut params) }?;
        self.combine_splits(out, &l, &parts, c.head_dim)
    }

    /// Lays out a prefill's queries `q[rows, heads D]` and its runs' cached keys and values as
    /// the training attention's fused `packed[runs, tmax, 3 heads D]` (keys and values repeated
    /// for every query head of their group, zeros past each run's length). `runs` holds
    /// (slot, first row, length) per run, a run being one slot's positions `0..length`; the
    /// kernel reads the same values from `d_runs` (the host's are checked here).
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_pack<T: Elem>(
        &self,
        packed: &mut CudaSlice<T>,
        q: &CudaSlice<T>,
        k_cache: &CudaSlice<T>,
        v_cache: &CudaSlice<T>,
        runs: &[u32],
        d_runs: &CudaSlice<u32>,
        tmax: usize,
        heads: usize,
        c: CacheShape,
    ) -> Result<()> {
        const OP: &str = "prefill_pack";
        let (_, max_len) = check_cache(OP, k_cache, v_cache, c)?;
        let width = heads * c.head_dim;
        let rows = q.len() / width.max(1);
        check_len(OP, "q", q, rows * width)?;
        let n = runs.len() / 3;
        check_len(OP, "packed", packed, n * tmax * 3 * width)?;
        let bad = runs.len() != 3 * n
            || c.kv_heads == 0
            || !heads.is_multiple_of(c.kv_heads)
            || runs.chunks(3).any(|r| {
                let (slot, first, len) = (r[0] as usize, r[1] as usize, r[2] as usize);
                slot >= c.slots || len > tmax || len > c.max_len || first + len > rows
            });
        if bad {
            return Err(CudaError::Shape {
                op: OP,
                detail: format!(
                    "runs {runs:?} over {rows} rows, {tmax} positions, a cache of {} slots of {} positions, {heads} heads over {}",
                    c.slots, c.max_len, c.kv_heads
                ),
            });
        }
        check_len(OP, "d_runs", d_runs, runs.len())?;
        if packed.is_empty() {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::PrefillPack)?;
        let (tmax32, heads32) = (as_i32(OP, "tmax", tmax)?, as_i32(OP, "heads", heads)?);
        let (kvh, d) = (c.kv_heads as i32, c.head_dim as i32);
        // 16-byte pieces where every head and buffer starts on one.
        let piece = 16 / std::mem::size_of::<T>();
        let aligned = [
            raw_ptr(packed, &self.stream),
            raw_ptr(q, &self.stream),
            raw_ptr(k_cache, &self.stream),
            raw_ptr(v_cache, &self.stream),
        ]
        .iter()
        .all(|p| p % 16 == 0);
        let vec = i32::from(aligned && c.head_dim.is_multiple_of(piece));
        let blocks = u32::try_from(n * tmax).map_err(|_| CudaError::Shape {
            op: OP,
            detail: format!("{n} x {tmax} packed rows"),
        })?;
        let mut b = self.stream.launch_builder(f);
        b.arg(packed)
            .arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(d_runs)
            .arg(&tmax32)
            .arg(&heads32)
            .arg(&kvh)
            .arg(&d)
            .arg(&max_len)
            .arg(&vec);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every run was checked to lie inside `q`'s rows, the cache's slots and
        // positions and `packed`'s positions; block `r tmax + t` writes packed row (r, t).
        // The 16-byte pieces run only where every buffer starts on 16 bytes and the head size
        // is a multiple of a piece, so every piece is aligned.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Copies positions `0..len` of every key/value head of cache slot `from` into slot `to`.
    pub fn copy_cache_slot<T: Elem>(
        &self,
        cache: &mut CudaSlice<T>,
        from: usize,
        to: usize,
        len: usize,
        c: CacheShape,
    ) -> Result<()> {
        const OP: &str = "copy_cache_slot";
        check_len(OP, "cache", cache, c.len())?;
        if from >= c.slots || to >= c.slots || len > c.max_len {
            return Err(CudaError::Shape {
                op: OP,
                detail: format!(
                    "slots {from} -> {to} of {}, {len} positions of {}",
                    c.slots, c.max_len
                ),
            });
        }
        let total = c.kv_heads * len * c.head_dim;
        if from == to || total == 0 {
            return Ok(());
        }
        let f = self.elem_function::<T>(ElemKernel::CopyCacheSlot)?;
        let (src, dst) = (c.at(from, 0, 0) as i64, c.at(to, 0, 0) as i64);
        let head_stride = (c.max_len * c.head_dim) as i64;
        let run = (len * c.head_dim) as i64;
        let total64 = total as i64;
        let mut b = self.stream.launch_builder(f);
        b.arg(cache)
            .arg(&src)
            .arg(&dst)
            .arg(&head_stride)
            .arg(&run)
            .arg(&total64);
        // SAFETY: both slots lie inside the checked cache and are distinct, so the copy
        // neither leaves the buffer nor overlaps itself.
        unsafe { b.launch(grid(total)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_splits_long_rows_only_when_blocks_underfill_the_gpu() {
        // SmolLM2 (9 over 3 heads) decoding 64 rows on 132 SMs: 192 blocks, two splits.
        let p = attention_plan(64, 9, 3, 64, 1500, 132).unwrap();
        assert_eq!((p.lanes, p.group, p.chunks, p.splits), (8, 4, 1, 2));
        // Llama-3.2-1B: 512 blocks fill the GPU.
        assert_eq!(attention_plan(64, 32, 8, 64, 1500, 132).unwrap().splits, 1);
        // One sequence far into its context: many splits, each at least MIN_SPLIT long.
        let p = attention_plan(1, 16, 8, 128, 4000, 132).unwrap();
        assert_eq!((p.lanes, p.group, p.splits), (16, 2, 32));
        assert_eq!(attention_plan(1, 16, 8, 128, 1000, 132).unwrap().splits, 8);
        // Short rows never split.
        assert_eq!(attention_plan(1, 16, 8, 128, 256, 132).unwrap().splits, 1);
        // Multi-query: 32 heads over one in chunks of 8; multi-head: blocks of two, one
        // repeated; head sizes past 256 have no kernel.
        let p = attention_plan(4, 32, 1, 256, 100, 132).unwrap();
        assert_eq!((p.lanes, p.group, p.chunks), (32, 8, 4));
        let p = attention_plan(4, 12, 12, 64, 100, 132).unwrap();
        assert_eq!((p.group, p.chunks), (2, 1));
        assert!(attention_plan(4, 8, 8, 257, 100, 132).is_none());
    }

    #[test]
    fn wide_blocks_only_where_a_calls_blocks_leave_room() {
        // SmolLM2 decoding 64 rows of a 192-token bench: 192 blocks on 132 SMs, wide, in
        // blocks of its three query heads a key/value head (narrow blocks take four).
        let p = attention_plan(64, 9, 3, 64, 192, 132).unwrap();
        assert!(p.wide && p.group == 3 && p.chunks == 1);
        assert_eq!(attention_plan(256, 9, 3, 64, 192, 132).unwrap().group, 4);
        // Llama-3.2-1B at batch 64 (512 blocks) and SmolLM2 at 256 (768): narrow.
        assert!(!attention_plan(64, 32, 8, 64, 192, 132).unwrap().wide);
        assert!(!attention_plan(256, 9, 3, 64, 192, 132).unwrap().wide);
        // A prefill's rows are many: narrow.
        assert!(!attention_plan(4096, 9, 3, 64, 64, 132).unwrap().wide);
        // Splits count: one long row split 32 ways over 8 key/value heads is 256 blocks.
        let p = attention_plan(1, 16, 8, 128, 4000, 132).unwrap();
        assert!(p.wide && p.splits == 32);
        // Head sizes past 128 have no wide kernels: the layout may say wide, the kernel is
        // the narrow one, and it never appends.
        let p = attention_plan(1, 8, 8, 256, 100, 132).unwrap();
        assert_eq!(
            cache_attention_kernel(p.lanes, p.group, p.wide, false).map(|k| k.1),
            Some(NARROW_THREADS)
        );
        assert!(cache_attention_kernel(32, 2, true, true).is_none());
    }

    #[test]
    fn appending_calls_of_head_sizes_64_and_128_take_the_kernel_a_position_a_thread() {
        // SmolLM2 at batch 64 (three heads a block), Llama-3.2-1B at batch 8 (four), a
        // head size of 128 with two, and a multi-query chunk of eight.
        for (rows, heads, kv, d, kernel) in [
            (64, 9, 3, 64, ElemKernel::CacheAttentionAppendD64G3),
            (8, 32, 8, 64, ElemKernel::CacheAttentionAppendD64G4),
            (8, 16, 8, 128, ElemKernel::CacheAttentionAppendD128G2),
            (4, 16, 1, 64, ElemKernel::CacheAttentionAppendD64G8),
        ] {
            let p = attention_plan(rows, heads, kv, d, 192, 132).unwrap();
            assert!(p.wide, "{rows} rows of {heads}/{kv} heads of {d}");
            assert_eq!(appending_positions_kernel(heads, kv, d, &p), Some(kernel));
        }
        // Partial chunks (Qwen2.5-0.5B: seven heads a key/value head in blocks of eight) and
        // narrow blocks (Llama-3.2-1B at batch 64) keep the older kernels.
        let p = attention_plan(8, 14, 2, 64, 192, 132).unwrap();
        assert!(p.wide && p.group == 8);
        assert_eq!(appending_positions_kernel(14, 2, 64, &p), None);
        let p = attention_plan(64, 32, 8, 64, 192, 132).unwrap();
        assert_eq!(appending_positions_kernel(32, 8, 64, &p), None);
        // Other head sizes keep the kernel of a group of lanes.
        for d in [32, 80, 96, 256] {
            assert!(positions_kernel(d, 4).is_none());
        }
    }

    /// Every layout a plan can choose has a compiled decode kernel, plain and (wide blocks of
    /// head sizes to 128) appending: head sizes up to MAX_HEAD_DIM, any number of query heads
    /// per key/value head, calls of few and of many blocks.
    #[test]
    fn every_decode_plan_has_a_kernel() {
        for (head_dim, rows) in (1..=MAX_HEAD_DIM).flat_map(|d| [(d, 8), (d, 512)]) {
            for kv_heads in [1, 2, 3, 8] {
                for per_kv in 1..=40 {
                    let p = attention_plan(rows, kv_heads * per_kv, kv_heads, head_dim, 300, 132)
                        .unwrap();
                    assert!(
                        [(p.wide, false), (p.wide, p.wide && p.lanes < 32)]
                            .into_iter()
                            .all(|(w, a)| cache_attention_kernel(p.lanes, p.group, w, a).is_some()),
                        "head size {head_dim}, {per_kv} query heads per key/value head: lanes {} group {}",
                        p.lanes,
                        p.group
                    );
                }
            }
        }
    }
}
