//! Pairwise cosine diversity on the GPU; reference: [`crate::engine::cpu::diversity`].
//! Embeddings are `T` (f32, bf16 or f16); D, the saved column sums `s` and reciprocal norms
//! are f32, and the gradient is written in `T`.
//!
//! The forward is three launches: the row norms and the chunked column sums of the
//! normalised rows (one read of the embeddings), the column sums over chunks with their
//! squared norm, and D per set. The backward is one launch, a block per row.

use super::{
    CudaBackend, CudaError, ELEM_DTYPES, Elem, ElemKernel, Kernel, Program, Result, as_i32,
    check_len,
};
use crate::engine::cpu::diversity::SetShape;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

pub(super) const PROGRAM: Program = Program {
    name: "diversity",
    source: include_str!("diversity.cu"),
    kernels: &[Kernel::DiversityColumnSums, Kernel::DiversityValue],
    elem_kernels: &[ElemKernel::DiversityPartial, ElemKernel::DiversityBackward],
    dtypes: ELEM_DTYPES,
};

/// Rows one block of the first stage normalises and sums (at most the kernel's
/// `DIVERSITY_MAX_ROWS`): 4096 rows make 128 blocks, about one per SM of a Hopper, and the
/// partial sums stay a sixteenth of the bf16 input or less.
const ROWS_PER_CHUNK: usize = 32;
// diversity.cu keeps one rnorm per row of a chunk in shared memory.
const _: () = assert!(ROWS_PER_CHUNK <= 64);
const PARTIAL_BLOCK: u32 = 256;
const COLUMN_BLOCK: u32 = 256;
/// Most sets in one call (the grid's y dimension).
const MAX_SETS: usize = 65_535;

/// Checks the shape and returns `(n, d)` as the kernels' ints.
fn check_shape(op: &'static str, shape: SetShape) -> Result<(i32, i32)> {
    shape
        .check()
        .map_err(|detail| CudaError::Shape { op, detail })?;
    if shape.sets > MAX_SETS {
        return Err(CudaError::Shape {
            op,
            detail: format!(
                "{} sets in one call; the kernel takes at most {MAX_SETS}, so split the batch",
                shape.sets
            ),
        });
    }
    as_i32(op, "rows", shape.rows() * shape.d)?;
    Ok((as_i32(op, "n", shape.n)?, as_i32(op, "d", shape.d)?))
}

/// One block per row of the backward, about eight elements per thread, at most 512.
fn one_block_per_row(rows: usize, d: usize) -> LaunchConfig {
    let threads = d.div_ceil(8).next_multiple_of(32).clamp(32, 512);
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// Writes `value[set]` (D), `s[set, d]` and `rnorm[row]` for `[sets, n, d]` embeddings.
    pub fn diversity_forward<T: Elem>(
        &self,
        value: &mut CudaSlice<f32>,
        s: &mut CudaSlice<f32>,
        rnorm: &mut CudaSlice<f32>,
        e: &CudaSlice<T>,
        shape: SetShape,
    ) -> Result<()> {
        const OP: &str = "diversity_forward";
        let (n32, d32) = check_shape(OP, shape)?;
        let SetShape { sets, n, d } = shape;
        check_len(OP, "value", value, sets)?;
        check_len(OP, "s", s, sets * d)?;
        check_len(OP, "rnorm", rnorm, sets * n)?;
        check_len(OP, "e", e, sets * n * d)?;
        let chunks = n.div_ceil(ROWS_PER_CHUNK);
        let col_blocks = d.div_ceil(COLUMN_BLOCK as usize);
        let mut partial = self.alloc::<f32>(sets * chunks * d)?;
        let mut q_partial = self.alloc::<f32>(sets * chunks)?;
        let mut ss_partial = self.alloc::<f64>(sets * col_blocks)?;
        let (chunks32, rpc) = (as_i32(OP, "chunks", chunks)?, ROWS_PER_CHUNK as i32);

        let f = self.elem_function::<T>(ElemKernel::DiversityPartial)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut partial)
            .arg(&mut q_partial)
            .arg(&mut *rnorm)
            .arg(e)
            .arg(&n32)
            .arg(&d32)
            .arg(&rpc);
        let cfg = LaunchConfig {
            grid_dim: (chunks as u32, sets as u32, 1),
            block_dim: (PARTIAL_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: lengths checked above; block (chunk, set) reads rows of its chunk and writes
        // its own partial row, q partial and rnorm entries.
        unsafe { b.launch(cfg) }?;

        let f = self.function(Kernel::DiversityColumnSums)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&mut *s)
            .arg(&mut ss_partial)
            .arg(&partial)
            .arg(&d32)
            .arg(&chunks32);
        let cfg = LaunchConfig {
            grid_dim: (col_blocks as u32, sets as u32, 1),
            block_dim: (COLUMN_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `partial` holds `sets * chunks * d` values; each thread writes one column
        // of `s`, each block one `ss_partial`.
        unsafe { b.launch(cfg) }?;

        let f = self.function(Kernel::DiversityValue)?;
        let (sets32, cb32) = (sets as i32, col_blocks as i32);
        let mut b = self.stream.launch_builder(f);
        b.arg(value)
            .arg(&ss_partial)
            .arg(&q_partial)
            .arg(&sets32)
            .arg(&n32)
            .arg(&cb32)
            .arg(&chunks32);
        let cfg = LaunchConfig {
            grid_dim: (sets.div_ceil(128) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one thread per set reads its partials and writes `value[set]`.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Writes `de = dd[set] * dD/de` for every row, from the forward's `s` and `rnorm`.
    pub fn diversity_backward<T: Elem>(
        &self,
        de: &mut CudaSlice<T>,
        dd: &CudaSlice<f32>,
        e: &CudaSlice<T>,
        s: &CudaSlice<f32>,
        rnorm: &CudaSlice<f32>,
        shape: SetShape,
    ) -> Result<()> {
        const OP: &str = "diversity_backward";
        let (n32, d32) = check_shape(OP, shape)?;
        let SetShape { sets, n, d } = shape;
        check_len(OP, "de", de, sets * n * d)?;
        check_len(OP, "dd", dd, sets)?;
        check_len(OP, "e", e, sets * n * d)?;
        check_len(OP, "s", s, sets * d)?;
        check_len(OP, "rnorm", rnorm, sets * n)?;
        let scale = shape.grad_scale() as f32;
        let f = self.elem_function::<T>(ElemKernel::DiversityBackward)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(de)
            .arg(dd)
            .arg(e)
            .arg(s)
            .arg(rnorm)
            .arg(&n32)
            .arg(&d32)
            .arg(&scale);
        // SAFETY: lengths checked above; one block per row writes that row of `de`.
        unsafe { b.launch(one_block_per_row(sets * n, d)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_without_pairs_or_beyond_the_grid_are_refused() {
        let shape = SetShape {
            sets: 1,
            n: 1,
            d: 8,
        };
        assert!(check_shape("t", shape).is_err());
        let too_many = SetShape {
            sets: MAX_SETS + 1,
            n: 2,
            d: 8,
        };
        assert!(check_shape("t", too_many).is_err());
    }

    /// The diversity program compiles on its own for the architectures kiln targets (the
    /// test over every program covers it too; this one names it when it breaks).
    #[test]
    fn diversity_program_compiles_with_nvrtc() {
        use super::super::loader::{CudaLibrary, ensure_loaded};
        if let Err(e) = ensure_loaded(CudaLibrary::Nvrtc) {
            eprintln!("skipped: {e}");
            return;
        }
        for arch in [80, 90] {
            let compiled =
                super::super::nvrtc::compile(PROGRAM.name, &PROGRAM.full_source(), arch, None)
                    .unwrap_or_else(|e| panic!("{e}"));
            assert!(!compiled.cubin.is_empty());
        }
    }
}
