//! Diversity of sampled replies: the mean pairwise cosine distance of their embeddings.

use super::*;

/// What [`pairwise_diversity_backward`] needs from the forward: per set, the sum of the
/// normalised rows `[sets, d]`, and each row's reciprocal norm `[sets * n]` (both f32).
pub struct DiversitySaved {
    pub shape: SetShape,
    pub s: Tensor,
    pub rnorm: Tensor,
}

fn diversity_shape(op: &'static str, e: &Tensor, n: usize) -> Result<SetShape> {
    let (rows, d) = rows_cols(op, e)?;
    let shape = SetShape {
        sets: rows.checked_div(n).unwrap_or(0),
        n,
        d,
    };
    shape
        .check()
        .map_err(|detail| EngineError::Shape { op, detail })?;
    if rows != shape.rows() {
        return Err(EngineError::Shape {
            op,
            detail: format!(
                "{rows} embeddings do not split into sets of {n}; give the same number of replies for every prompt"
            ),
        });
    }
    Ok(shape)
}

/// D (mean over pairs of `1 - cos`) of each set of `n` consecutive rows of `e` `[sets * n,
/// d]`, read back to the host, and what the backward needs. `n < 2` is an error.
pub fn pairwise_diversity(e: &Tensor, n: usize) -> Result<(Vec<f32>, DiversitySaved)> {
    const OP: &str = "pairwise_diversity";
    let _prof = profile::scope(OP, e);
    let on = device_of(OP, &[e])?;
    let shape = diversity_shape(OP, e, n)?;
    let mut s = Tensor::uninit(e.pool(), &[shape.sets, shape.d], DType::F32)?;
    let mut rnorm = Tensor::uninit(e.pool(), &[shape.rows()], DType::F32)?;
    let value = match on {
        On::Meta => vec![0.0; shape.sets],
        On::Cpu => {
            let mut value = vec![0.0; shape.sets];
            cpu::diversity::diversity_forward(
                &mut value,
                s.host_mut(),
                rnorm.host_mut(),
                e.host(),
                shape,
            )
            .map_err(|detail| EngineError::Shape { op: OP, detail })?;
            value
        }
        On::Gpu(g) => {
            let mut value = g.alloc::<f32>(shape.sets)?;
            with_elem!(e.dtype(), T => g.diversity_forward::<T>(
                &mut value,
                s.cuda_mut(),
                rnorm.cuda_mut(),
                e.cuda(),
                shape,
            ))?;
            g.download(&value)?
        }
    };
    Ok((value, DiversitySaved { shape, s, rnorm }))
}

/// `dd[set] * dD/de` for every row of `e` (a new tensor shaped like `e`): the gradient of a
/// loss that depends on D with `dd = dLoss/dD` per set.
pub fn pairwise_diversity_backward(
    e: &Tensor,
    saved: &DiversitySaved,
    dd: &[f32],
) -> Result<Tensor> {
    const OP: &str = "pairwise_diversity_backward";
    let _prof = profile::scope(OP, e);
    let on = device_of(OP, &[e, &saved.s, &saved.rnorm])?;
    let shape = diversity_shape(OP, e, saved.shape.n)?;
    if shape != saved.shape || dd.len() != shape.sets {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!(
                "embeddings {shape:?} and {} upstream gradients do not match the forward's {:?}",
                dd.len(),
                saved.shape
            ),
        });
    }
    let mut de = Tensor::uninit(e.pool(), e.shape(), act_dtype(e))?;
    match on {
        On::Meta => {}
        On::Cpu => cpu::diversity::diversity_backward(
            de.host_mut(),
            dd,
            e.host(),
            saved.s.host(),
            saved.rnorm.host(),
            shape,
        )
        .map_err(|detail| EngineError::Shape { op: OP, detail })?,
        On::Gpu(g) => {
            let d_dd = g.upload(dd)?;
            with_elem!(e.dtype(), T => g.diversity_backward::<T>(
                de.cuda_mut(),
                &d_dd,
                e.cuda(),
                saved.s.cuda(),
                saved.rnorm.cuda(),
                shape,
            ))?
        }
    }
    Ok(de)
}
