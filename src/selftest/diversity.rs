//! The `diversity` group: the pairwise cosine diversity kernel and its gradient.

use super::*;

/// The pairwise diversity kernels against the CPU reference (which accumulates in f64): one
/// small set, the largest benchmarked (4096 x 1024), a batch of sets as polychromic training
/// embeds them (64 prompts x 8 replies at MiniLM's width), ragged sizes (a partial row chunk
/// and column block), and clustered sets whose small D would show cancellation. The
/// backward reads the CPU's saved sums, so it is checked on its own; `n = 1` must be refused.
pub(super) fn diversity_rows(gpu: &CudaBackend, inp: &mut Inputs) -> Vec<Row> {
    use cpu::diversity::SetShape;
    let mut rows = Vec::new();
    let cases = [
        (1, 8, 64, false),
        (1, 4096, 1024, false),
        (64, 8, 384, false),
        (3, 37, 1001, false),
        (16, 16, 384, true),
    ];
    for (sets, n, d, clustered) in cases {
        let shape = SetShape { sets, n, d };
        let label = format!(
            "{sets}x{n}x{d}{}",
            if clustered { " clustered" } else { "" }
        );
        for (dtype, bound) in [("f32", BOUND_FP32), ("bf16", BOUND_BF16)] {
            let (fwd, bwd) = if dtype == "f32" {
                check_diversity::<f32>(gpu, inp, shape, clustered)
            } else {
                check_diversity::<Bf16>(gpu, inp, shape, clustered)
            };
            for (kernel, result) in [("diversity_forward", fwd), ("diversity_backward", bwd)] {
                rows.push(Row {
                    kernel: kernel.into(),
                    dtype,
                    shape: label.clone(),
                    result,
                    bound,
                });
            }
        }
    }
    let single = SetShape {
        sets: 1,
        n: 1,
        d: 64,
    };
    let refused = (|| -> Check {
        let e = gpu.upload_as::<f32>(&inp.uniform(64, 1.0, DType::F32))?;
        let (mut v, mut s, mut r) = (
            gpu.alloc::<f32>(1)?,
            gpu.alloc::<f32>(64)?,
            gpu.alloc::<f32>(1)?,
        );
        Ok(
            match gpu.diversity_forward(&mut v, &mut s, &mut r, &e, single) {
                Err(CudaError::Shape { .. }) => 0.0,
                _ => f64::INFINITY,
            },
        )
    })();
    rows.push(Row {
        kernel: "diversity_forward n=1 refused".into(),
        dtype: "f32",
        shape: "1x1x64".into(),
        result: refused,
        bound: 0.0,
    });
    rows
}

/// One shape and type: (forward: D, s and rnorm; backward: the gradient).
fn check_diversity<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    shape: cpu::diversity::SetShape,
    clustered: bool,
) -> (Check, Check) {
    let (sets, n, d) = (shape.sets, shape.n, shape.d);
    let mut e = inp.uniform(sets * n * d, 1.0, DType::F32);
    if clustered {
        // Each set: one centre plus noise a third its size (D around 0.1).
        for set in e.chunks_mut(n * d) {
            let centre = inp.uniform(d, 1.0, DType::F32);
            for row in set.chunks_mut(d) {
                for (x, c) in row.iter_mut().zip(&centre) {
                    *x = c + 0.3 * *x;
                }
            }
        }
    }
    T::DTYPE.round_slice(&mut e);
    let (mut value, mut s, mut rnorm) = (vec![0.0; sets], vec![0.0; sets * d], vec![0.0; sets * n]);
    if let Err(detail) =
        cpu::diversity::diversity_forward(&mut value, &mut s, &mut rnorm, &e, shape)
    {
        let err = || CudaError::Shape {
            op: "diversity",
            detail: detail.clone(),
        };
        return (Err(err()), Err(err()));
    }
    let fwd = (|| -> Check {
        let d_e = gpu.upload_as::<T>(&e)?;
        let (mut d_v, mut d_s, mut d_r) = (
            poisoned::<f32>(gpu, sets)?,
            poisoned::<f32>(gpu, sets * d)?,
            poisoned::<f32>(gpu, sets * n)?,
        );
        gpu.diversity_forward(&mut d_v, &mut d_s, &mut d_r, &d_e, shape)?;
        Ok(worst(&[
            rel_err(&gpu.download(&d_v)?, &value, ELEMENTWISE_FLOOR),
            rel_err(&gpu.download(&d_s)?, &s, ELEMENTWISE_FLOOR),
            rel_err(&gpu.download(&d_r)?, &rnorm, ELEMENTWISE_FLOOR),
        ]))
    })();
    let bwd = (|| -> Check {
        let dd = inp.uniform(sets, 2.0, DType::F32);
        let mut de = vec![0.0; e.len()];
        cpu::diversity::diversity_backward(&mut de, &dd, &e, &s, &rnorm, shape).map_err(
            |detail| CudaError::Shape {
                op: "diversity_backward",
                detail,
            },
        )?;
        let (d_e, d_dd) = (gpu.upload_as::<T>(&e)?, gpu.upload(&dd)?);
        let (d_s, d_r) = (gpu.upload(&s)?, gpu.upload(&rnorm)?);
        let mut d_de = poisoned::<T>(gpu, e.len())?;
        gpu.diversity_backward(&mut d_de, &d_dd, &d_e, &d_s, &d_r, shape)?;
        Ok(rel_err(&gpu.download_f32(&d_de)?, &de, ELEMENTWISE_FLOOR))
    })();
    (fwd, bwd)
}
