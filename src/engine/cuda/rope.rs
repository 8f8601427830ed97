//! Rotary position embeddings with grouped-query heads expanded, on the GPU; reference:
//! [`crate::engine::cpu::rope`]. The projection and the packed tensor are `T`; the positions
//! are u32 per row and the cos/sin tables f32 `[positions, rot/2]`.

use super::{
    CudaBackend, CudaError, ELEM_DTYPES, Elem, ElemKernel, Program, Result, as_i32, check_len,
    raw_ptr,
};
use crate::engine::cpu::rope::RopeShape;
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "rope",
    source: include_str!("rope.cu"),
    kernels: &[],
    elem_kernels: &[
        ElemKernel::RopeExpandForward,
        ElemKernel::RopeExpandBackward,
        ElemKernel::RopePairsForward,
        ElemKernel::RopePairsBackward,
    ],
    dtypes: ELEM_DTYPES,
};

const BLOCK: u32 = 256;

/// The kernels' `RopeDims`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct KernelDims {
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    rot_dim: i32,
    positions: u32,
    vec4: i32,
}

// SAFETY: four i32, a u32 and an i32, `repr(C)`, the same layout as the CUDA struct.
unsafe impl DeviceRepr for KernelDims {}

/// Checks a rotary call's shape and buffers; returns the kernels' dimensions and the number
/// of output elements.
fn check(
    op: &'static str,
    s: RopeShape,
    pos: &CudaSlice<u32>,
    cos: &CudaSlice<f32>,
    sin: &CudaSlice<f32>,
    out_width: usize,
) -> Result<(KernelDims, usize)> {
    let bad = |detail: String| Err(CudaError::Shape { op, detail });
    if s.kv_heads == 0 || !s.heads.is_multiple_of(s.kv_heads) {
        return bad(format!(
            "{} query heads cannot share {} key/value heads evenly",
            s.heads, s.kv_heads
        ));
    }
    if !s.rot_dim.is_multiple_of(2) || s.rot_dim > s.head_dim {
        return bad(format!(
            "rotary dimensions {} must be even and at most the head size {}",
            s.rot_dim, s.head_dim
        ));
    }
    if s.head_dim > 1024 {
        return bad(format!(
            "a head size of {} (a block's threads walk one head; at most 1024)",
            s.head_dim
        ));
    }
    if cos.len() != sin.len() {
        return bad("the cos and sin tables differ in length".into());
    }
    check_len(op, "pos", pos, s.rows)?;
    let half = s.rot_dim / 2;
    // With nothing to rotate the tables are never read.
    let positions = cos.len().checked_div(half).unwrap_or(u32::MAX as usize);
    as_i32(op, "rows", s.rows)?;
    as_i32(op, "projection width", s.qkv_width())?;
    as_i32(op, "packed width", s.packed_width())?;
    let total = s.rows * out_width;
    let dims = KernelDims {
        heads: as_i32(op, "heads", s.heads)?,
        kv_heads: as_i32(op, "kv_heads", s.kv_heads)?,
        head_dim: as_i32(op, "head_dim", s.head_dim)?,
        rot_dim: as_i32(op, "rot_dim", s.rot_dim)?,
        positions: positions.min(u32::MAX as usize) as u32,
        vec4: 0,
    };
    Ok((dims, total))
}

/// Head units (query, key and value heads of a row) a block takes at most: two batches of the
/// kernels' ROPE_BATCH.
const UNITS_PER_PART: usize = 8;

/// A head's dimensions (`vw` a thread) over x, rows over y (as many as fill [`BLOCK`]
/// threads), rows over blocks, and the row's `units` head units in parts of at most
/// [`UNITS_PER_PART`] over the grid's y (the kernels' `head_part`).
fn row_grid(rows: usize, head_dim: usize, vw: usize, units: usize) -> LaunchConfig {
    let x = head_dim.div_ceil(vw).max(1) as u32;
    let y = (BLOCK / x).max(1);
    let parts = units.div_ceil(UNITS_PER_PART).clamp(1, 64) as u32;
    LaunchConfig {
        grid_dim: (rows.div_ceil(y as usize).clamp(1, 1 << 20) as u32, parts, 1),
        block_dim: (x, y, 1),
        shared_mem_bytes: 0,
    }
}

/// Whether the pair kernels serve `s`: four dimensions a thread, every dimension rotating, and
/// a head's `head_dim / 4` threads a power of two of at most a warp, so that partners (rot/8
/// lanes apart) share a warp and whole heads' segments tile it.
fn pairs_by_shuffle(vec4: bool, s: RopeShape) -> bool {
    let threads = s.head_dim / 4;
    vec4 && s.rot_dim == s.head_dim && threads.is_power_of_two() && (2..=32).contains(&threads)
}

impl CudaBackend {
    /// `packed[row] = [rot(q) | rot(k) repeated per group | v repeated per group]` from
    /// `qkv[row] = [q: H D | k: K D | v: K D]`, each row turned by `pos[row]`. A position past
    /// the tables gives NaN in the rotated dimensions.
    pub fn rope_expand_forward<T: Elem>(
        &self,
        packed: &mut CudaSlice<T>,
        qkv: &CudaSlice<T>,
        pos: &CudaSlice<u32>,
        cos: &CudaSlice<f32>,
        sin: &CudaSlice<f32>,
        s: RopeShape,
    ) -> Result<()> {
        let widths = (s.packed_width(), s.qkv_width());
        self.launch_rope(
            [ElemKernel::RopeExpandForward, ElemKernel::RopePairsForward],
            packed,
            qkv,
            widths,
            pos,
            cos,
            sin,
            s,
        )
    }

    /// The backward of [`Self::rope_expand_forward`]: writes every element of `dqkv` from
    /// `dpacked`, each key/value head summing its group's gradients in head order.
    pub fn rope_expand_backward<T: Elem>(
        &self,
        dqkv: &mut CudaSlice<T>,
        dpacked: &CudaSlice<T>,
        pos: &CudaSlice<u32>,
        cos: &CudaSlice<f32>,
        sin: &CudaSlice<f32>,
        s: RopeShape,
    ) -> Result<()> {
        let widths = (s.qkv_width(), s.packed_width());
        self.launch_rope(
            [
                ElemKernel::RopeExpandBackward,
                ElemKernel::RopePairsBackward,
            ],
            dqkv,
            dpacked,
            widths,
            pos,
            cos,
            sin,
            s,
        )
    }

    /// Checks and launches `kernels[0]`, or `kernels[1]` (the same result, partners by warp
    /// shuffle) where every dimension rotates and a head's threads are a power of two up to a
    /// warp (rows over blocks, see `row_grid`): rows of `widths.0` in `out`, of `widths.1` in
    /// `inp`.
    #[allow(clippy::too_many_arguments)]
    fn launch_rope<T: Elem>(
        &self,
        kernels: [ElemKernel; 2],
        out: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        widths: (usize, usize),
        pos: &CudaSlice<u32>,
        cos: &CudaSlice<f32>,
        sin: &CudaSlice<f32>,
        s: RopeShape,
    ) -> Result<()> {
        let op = kernels[0].op();
        let (mut dims, total) = check(op, s, pos, cos, sin, widths.0)?;
        check_len(op, "out", out, total)?;
        check_len(op, "inp", inp, s.rows * widths.1)?;
        if total == 0 {
            return Ok(());
        }
        // Four dimensions a thread where every access of four stays inside one head, on one
        // side of rot/2, and 4-element aligned.
        let aligned = |p: u64| p.is_multiple_of(4 * std::mem::size_of::<T>() as u64);
        let vec4 = s.head_dim.is_multiple_of(4)
            && s.rot_dim.is_multiple_of(8)
            && aligned(raw_ptr(out, &self.stream))
            && aligned(raw_ptr(inp, &self.stream));
        dims.vec4 = vec4 as i32;
        let f = self.elem_function::<T>(kernels[pairs_by_shuffle(vec4, s) as usize])?;
        let rows64 = s.rows as i64;
        let units = s.heads + 2 * s.kv_heads;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(inp)
            .arg(pos)
            .arg(cos)
            .arg(sin)
            .arg(&rows64)
            .arg(&dims);
        // SAFETY: lengths checked above; table reads are bounded by `dims.positions` (the
        // tables' rows) in the kernel; each block writes only its part's heads.
        unsafe {
            b.launch(row_grid(
                s.rows,
                s.head_dim,
                if vec4 { 4 } else { 1 },
                units,
            ))
        }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(head_dim: usize, rot_dim: usize) -> RopeShape {
        RopeShape {
            rows: 3,
            heads: 4,
            kv_heads: 2,
            head_dim,
            rot_dim,
        }
    }

    #[test]
    fn pairs_serve_fully_rotating_heads_of_up_to_a_warp() {
        for d in [8, 16, 32, 64, 128] {
            assert!(pairs_by_shuffle(true, shape(d, d)), "{d}");
        }
        // Partial rotary, a head wider than a warp's threads, threads not a power of two,
        // or one dimension a thread: the general kernels.
        assert!(!pairs_by_shuffle(true, shape(64, 32)));
        assert!(!pairs_by_shuffle(true, shape(256, 256)));
        assert!(!pairs_by_shuffle(true, shape(96, 96)));
        assert!(!pairs_by_shuffle(false, shape(64, 64)));
    }

    #[test]
    fn heads_split_into_parts_of_at_most_eight() {
        // Llama-3.2-1B: 32 + 2 x 8 head units in 6 parts; SmolLM2: 9 + 2 x 3 in 2.
        assert_eq!(row_grid(8192, 64, 4, 48).grid_dim, (512, 6, 1));
        assert_eq!(row_grid(8192, 64, 4, 15).grid_dim, (512, 2, 1));
        assert_eq!(row_grid(5, 128, 4, 3).grid_dim, (1, 1, 1));
        assert_eq!(row_grid(5, 128, 4, 3).block_dim, (32, 8, 1));
    }
}
