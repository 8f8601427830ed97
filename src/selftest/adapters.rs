//! Checks of the fused low-rank adapter kernels against the CPU's per-adapter products.

use super::*;
use crate::engine::cuda::AdapterColumns;

/// One adapter of a check: first column and width of its block of the output, its rank.
pub(super) type AdapterBlock = (usize, usize, usize);

/// [`CudaBackend::lora_outputs`]: every adapter's `scale * H_k B_k^T` written over (or, with
/// `accumulate`, added to) its block of a `[rows, ld_y]` output in one launch, against the
/// CPU's products. Without `accumulate` the blocks start as NaN (a read of them would show),
/// and the columns outside every block must keep their values either way.
pub(super) fn check_lora_outputs<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    rows: usize,
    ld_y: usize,
    blocks: &[AdapterBlock],
    accumulate: bool,
) -> Check {
    let d = T::DTYPE;
    let ld_h: usize = blocks.iter().map(|b| b.2).sum();
    let h = inp.uniform(rows * ld_h, 1.0, d);
    let mut y0 = inp.uniform(rows * ld_y, 4.0, d);
    let mut columns = Vec::new();
    let mut bs = Vec::new();
    let mut k0 = 0;
    for (i, &(col0, cols, rank)) in blocks.iter().enumerate() {
        columns.push(AdapterColumns {
            col0,
            cols,
            k0,
            rank,
            scale: [2.0, 0.5, 1.25, 0.75][i % 4],
        });
        bs.push(inp.uniform(cols * rank, 1.0, d));
        k0 += rank;
    }
    if !accumulate {
        for a in &columns {
            for row in y0.chunks_mut(ld_y) {
                row[a.col0..a.col0 + a.cols].fill(f32::NAN);
            }
        }
    }
    let mut want = y0.clone();
    for (a, b) in columns.iter().zip(&bs) {
        for (r, out) in want.chunks_mut(ld_y).enumerate() {
            let hr = &h[r * ld_h + a.k0..][..a.rank];
            for (c, o) in out[a.col0..a.col0 + a.cols].iter_mut().enumerate() {
                let dot: f64 = hr
                    .iter()
                    .zip(&b[c * a.rank..][..a.rank])
                    .map(|(&x, &w)| x as f64 * w as f64)
                    .sum();
                let v = a.scale as f64 * dot;
                *o = if accumulate {
                    (*o as f64 + v) as f32
                } else {
                    v as f32
                };
            }
        }
    }
    let mut d_y = gpu.upload_as::<T>(&y0)?;
    let d_h = gpu.upload_as::<T>(&h)?;
    let d_bs = bs
        .iter()
        .map(|b| gpu.upload_as::<T>(b))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let refs: Vec<&CudaSlice<T>> = d_bs.iter().collect();
    let taken = gpu.lora_outputs(
        &mut d_y,
        &d_h,
        &refs,
        &columns,
        (rows, ld_y, ld_h),
        accumulate,
    )?;
    if !taken {
        return Err(CudaError::Shape {
            op: "lora_outputs",
            detail: "the adapter-output kernel declined a shape it takes".into(),
        });
    }
    Ok(rel_err(&gpu.download_f32(&d_y)?, &want, GEMM_FLOOR))
}
