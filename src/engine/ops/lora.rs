//! A low-rank adapter's backward products `dH = s dy B` and `dB (+)= s dy^T H` on its column
//! block of a layer's output gradient: one CUDA kernel reading dy once where it takes the call
//! (16-bit operands, ranks 8 to 64, sm_80 or newer), else two strided GEMMs, which are also
//! its reference and the CPU's path.

use super::*;
use crate::engine::LoraGradShape;
use crate::engine::cuda::{LoraGrid, lora_kernels_take};

/// `dh[:, view] = scale * dy[:, view] @ b` and, with `db`, `dB = scale * dy[:, view]^T @
/// h[:, view]` added to or overwriting `db` (see [`WeightGrad`]). `views` are dy's (the
/// adapter's columns of the layer's output) and the one `h` and `dh` share (`[rows, R]`, the
/// adapter at column `offset`); `b` is `[cols, rank]`. Returns whether the fused kernel ran
/// (its f32 workspace comes from the pool for the call); otherwise the products ran as GEMMs.
#[allow(clippy::too_many_arguments)]
pub fn lora_grads(
    shape: LoraGradShape,
    scale: f32,
    views: [MatrixView; 2],
    dy: &Tensor,
    b: &Tensor,
    h: &Tensor,
    dh: &mut Tensor,
    mut db: Option<WeightGrad<'_>>,
) -> Result<bool> {
    const OP: &str = "lora_grads";
    let _prof = profile::scope(OP, dy);
    let on = device_of(OP, &[dy, b, h, dh])?;
    if let Some(d) = &db {
        device_of(OP, &[dy, d.grad])?;
    }
    shape
        .check_views(
            views,
            [dy.len(), b.len(), h.len(), dh.len()],
            db.as_ref().map(|d| d.grad.len()),
        )
        .map_err(|detail| EngineError::Shape { op: OP, detail })?;
    let operands_fit = [b, h, &*dh].iter().all(|t| t.dtype() == dy.dtype())
        && db.as_ref().is_none_or(|d| d.grad.dtype() == DType::F32)
        && shape.rows > 0
        && shape.cols > 0;
    // A meta pass standing for a GPU books the workspace as the GPU would (a GPU older than
    // sm_80, or short of shared memory, runs the GEMMs instead, and then the call's peak is
    // the workspace less than planned).
    let fused = operands_fit
        && adapter_kernel_on(AdapterKernel::Grads)
        && match &on {
            On::Gpu(g) => g.lora_grads_fit(dy.dtype(), shape.rank),
            On::Meta => {
                matches!(dy.device(), Device::Cuda(_)) && lora_kernels_take(dy.dtype(), shape.rank)
            }
            On::Cpu => false,
        };
    if fused {
        let grid = LoraGrid::new(shape);
        let len = grid.workspace_len(shape, db.is_some());
        let mut workspace = Tensor::uninit(dy.pool(), &[len], DType::F32)?;
        let ran = match &on {
            On::Gpu(g) => with_elem!(dy.dtype(), T => g.lora_grads::<T>(
                shape,
                scale,
                views,
                dy.cuda(),
                b.cuda(),
                h.cuda(),
                dh.cuda_mut(),
                db.as_mut().map(|d| (d.grad.cuda_mut(), d.overwrite)),
                workspace.cuda_mut(),
            ))?,
            _ => true,
        };
        if ran {
            return Ok(true);
        }
    }
    let [dy_view, h_view] = views;
    let packed = MatrixView::packed(shape.rank);
    matmul_view(
        shape.dh_product(),
        [dy_view, packed, h_view],
        scale,
        dy,
        b,
        0.0,
        dh,
    )?;
    if let Some(db) = db {
        matmul_view(
            shape.db_product(),
            [dy_view, h_view, packed],
            scale,
            dy,
            h,
            db.beta(),
            db.grad,
        )?;
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, salt: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 + salt * 11) % 17) as f32 / 8.0 - 1.0)
            .collect()
    }

    #[test]
    fn the_cpu_runs_the_two_products_on_the_adapters_columns() {
        let cpu = MemoryPool::new(Device::Cpu);
        let s = LoraGradShape {
            rows: 7,
            cols: 5,
            rank: 3,
        };
        let views = [
            MatrixView { ld: 9, offset: 2 },
            MatrixView { ld: 6, offset: 1 },
        ];
        let t = |shape: &[usize], salt| {
            let n = shape.iter().product();
            Tensor::from_vec(&cpu, shape, DType::F32, values(n, salt)).unwrap()
        };
        let (dy, b, h) = (t(&[7, 9], 1), t(&[5, 3], 2), t(&[7, 6], 3));
        let (mut dh, mut db) = (t(&[7, 6], 4), t(&[5, 3], 5));
        let (dh0, db0) = (dh.to_vec().unwrap(), db.to_vec().unwrap());
        let db_arg = Some(WeightGrad {
            grad: &mut db,
            overwrite: false,
        });
        let fused = lora_grads(s, 0.5, views, &dy, &b, &h, &mut dh, db_arg).unwrap();
        assert!(!fused);
        let (dy, b, h, dh) = (dy.host(), b.host(), h.host(), dh.to_vec().unwrap());
        let db = db.to_vec().unwrap();
        for i in 0..s.rows {
            for k in 0..6 {
                let got = dh[i * 6 + k];
                if !(1..4).contains(&k) {
                    assert_eq!(got, dh0[i * 6 + k]);
                    continue;
                }
                let j = k - 1;
                let want: f32 = (0..s.cols).map(|c| dy[i * 9 + 2 + c] * b[c * 3 + j]).sum();
                assert!((got - 0.5 * want).abs() < 1e-5, "dH[{i}, {j}]");
            }
        }
        for c in 0..s.cols {
            for j in 0..s.rank {
                let want: f32 = (0..s.rows)
                    .map(|i| dy[i * 9 + 2 + c] * h[i * 6 + 1 + j])
                    .sum();
                let got = db[c * 3 + j] - db0[c * 3 + j];
                assert!((got - 0.5 * want).abs() < 1e-5, "dB[{c}, {j}]");
            }
        }
    }

    #[test]
    fn a_meta_pass_for_a_gpu_books_the_fused_kernels_workspace() {
        let gpu = MemoryPool::meta(Device::Cuda(0));
        // Llama-3.2-1B's gate block of its fused gate/up output, rank 16 of 32.
        let s = LoraGradShape {
            rows: 8192,
            cols: 8192,
            rank: 16,
        };
        let views = [
            MatrixView {
                ld: 16384,
                offset: 0,
            },
            MatrixView { ld: 32, offset: 16 },
        ];
        let booked = |dtype, rank| {
            let s = LoraGradShape { rank, ..s };
            let t = |shape: &[usize], dtype| Tensor::uninit(&gpu, shape, dtype).unwrap();
            let (dy, b, h) = (
                t(&[s.rows, 16384], dtype),
                t(&[s.cols, rank], dtype),
                t(&[s.rows, 32], dtype),
            );
            let (mut dh, mut db) = (t(&[s.rows, 32], dtype), t(&[s.cols, rank], DType::F32));
            gpu.reset_peak();
            let before = gpu.stats().current;
            let db_arg = Some(WeightGrad {
                grad: &mut db,
                overwrite: true,
            });
            let fused = lora_grads(s, 1.0, views, &dy, &b, &h, &mut dh, db_arg).unwrap();
            (fused, gpu.stats().peak - before)
        };
        assert_eq!(booked(DType::BF16, 16), (true, 16 << 20));
        // f32 operands and ranks without a kernel take the GEMMs, with no workspace.
        assert_eq!(booked(DType::F32, 16), (false, 0));
        assert_eq!(booked(DType::BF16, 12), (false, 0));
    }
}
