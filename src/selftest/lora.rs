//! A LoRA adapter's backward products from one read of the output gradient (the fused kernels
//! of `engine/cuda/lora.cu`) against the CPU's two strided products, and against themselves:
//! two runs on the same inputs must give the same bits.

use super::*;
use crate::engine::LoraGradShape;
use crate::engine::cuda::LoraGrid;

/// Where an adapter's operands lie: its `cols` columns from column `col0` of a dy `ldy`
/// wide, its `rank` columns from column `k0` of H and dH `ldh` wide, `rows` rows of each.
#[derive(Debug, Clone, Copy)]
pub(super) struct LoraCase {
    pub rows: usize,
    pub cols: usize,
    pub col0: usize,
    pub ldy: usize,
    pub rank: usize,
    pub k0: usize,
    pub ldh: usize,
}

/// What happens to the adapter's `B` gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LoraDb {
    /// Written whole (beta 0; the buffer starts as NaN).
    Overwrite,
    /// Added to (beta 1; the buffer starts random).
    Add,
    /// None: a frozen `B` (H is not read).
    Frozen,
}

impl std::fmt::Display for LoraDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LoraDb::Overwrite => "dB =",
            LoraDb::Add => "dB +=",
            LoraDb::Frozen => "B frozen",
        })
    }
}

impl std::fmt::Display for LoraCase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = self;
        write!(
            f,
            "{}x{} at col {} of {}, r{} at col {} of {}",
            c.rows, c.cols, c.col0, c.ldy, c.rank, c.k0, c.ldh
        )
    }
}

/// The products' outputs from one run: dH whole (`rows x ldh`) and dB (`cols x rank`).
type LoraOutputs = (Vec<f32>, Vec<f32>);

/// dH's columns outside the adapter start random and must come back unchanged, its own start
/// as NaN; dB starts as `db` says; the workspace starts as NaN (every partial the finishing
/// kernel reads must have been written). The error is the worse of dH's (rounded to `T`) and
/// dB's against the CPU's f32 products, relative to each buffer's largest value.
pub(super) fn check_lora_grads<T: Elem>(
    gpu: &CudaBackend,
    inp: &mut Inputs,
    c: LoraCase,
    db: LoraDb,
) -> Check {
    const OP: &str = "lora_grads";
    let d = T::DTYPE;
    let shape = LoraGradShape {
        rows: c.rows,
        cols: c.cols,
        rank: c.rank,
    };
    let views = [
        MatrixView {
            ld: c.ldy,
            offset: c.col0,
        },
        MatrixView {
            ld: c.ldh,
            offset: c.k0,
        },
    ];
    let scale = 0.75;
    let dy = inp.uniform(c.rows * c.ldy, 1.0, d);
    let b = inp.uniform(c.cols * c.rank, 1.0, d);
    let h = inp.uniform(c.rows * c.ldh, 1.0, d);
    let mut dh0 = inp.uniform(c.rows * c.ldh, 1.0, d);
    for row in dh0.chunks_mut(c.ldh) {
        row[c.k0..c.k0 + c.rank].fill(f32::NAN);
    }
    let db0 = match db {
        LoraDb::Add => inp.uniform(c.cols * c.rank, 1.0, DType::F32),
        _ => vec![f32::NAN; c.cols * c.rank],
    };

    let packed = MatrixView::packed(c.rank);
    let mut dh_want = vec![0.0; c.rows * c.rank];
    cpu::gemm::sgemm_strided(
        shape.dh_product(),
        [views[0], packed, packed],
        scale,
        &dy,
        &b,
        0.0,
        &mut dh_want,
    );
    let mut db_want = match db {
        LoraDb::Add => db0.clone(),
        _ => vec![0.0; c.cols * c.rank],
    };
    cpu::gemm::sgemm_strided(
        shape.db_product(),
        [views[0], views[1], packed],
        scale,
        &dy,
        &h,
        1.0,
        &mut db_want,
    );

    let (d_dy, d_b, d_h) = (
        gpu.upload_as::<T>(&dy)?,
        gpu.upload_as::<T>(&b)?,
        gpu.upload_as::<T>(&h)?,
    );
    let run = |gpu: &CudaBackend| -> std::result::Result<LoraOutputs, CudaError> {
        let mut d_dh = gpu.upload_as::<T>(&dh0)?;
        let mut d_db = gpu.upload(&db0)?;
        let len = LoraGrid::new(shape).workspace_len(shape, db != LoraDb::Frozen);
        let mut workspace = poisoned::<f32>(gpu, len)?;
        let db_arg = match db {
            LoraDb::Frozen => None,
            _ => Some((&mut d_db, db == LoraDb::Overwrite)),
        };
        let ran = gpu.lora_grads::<T>(
            shape,
            scale,
            views,
            &d_dy,
            &d_b,
            &d_h,
            &mut d_dh,
            db_arg,
            &mut workspace,
        )?;
        if !ran {
            return Err(CudaError::Shape {
                op: OP,
                detail: "the fused kernels declined the call".into(),
            });
        }
        Ok((gpu.download_f32(&d_dh)?, gpu.download(&d_db)?))
    };
    let (dh_got, db_got) = run(gpu)?;
    let (dh_again, db_again) = run(gpu)?;
    let differ = bits_differ(&dh_got, &dh_again).max(bits_differ(&db_got, &db_again));
    if differ > 0.0 {
        return Err(CudaError::Shape {
            op: OP,
            detail: format!("two runs on the same inputs differ by up to {differ:e}"),
        });
    }

    let mut own = Vec::with_capacity(c.rows * c.rank);
    for (got, start) in dh_got.chunks(c.ldh).zip(dh0.chunks(c.ldh)) {
        let outside = |v: &[f32]| [&v[..c.k0], &v[c.k0 + c.rank..]].concat();
        if bits_differ(&outside(got), &outside(start)) > 0.0 {
            return Err(CudaError::Shape {
                op: OP,
                detail: "dH changed outside the adapter's columns".into(),
            });
        }
        own.extend_from_slice(&got[c.k0..c.k0 + c.rank]);
    }
    let db_err = match db {
        LoraDb::Overwrite => rel_err(&db_got, &db_want, GEMM_FLOOR),
        LoraDb::Add => accumulated_err(&db_got, &db0, &db_want, GEMM_FLOOR),
        LoraDb::Frozen => 0.0,
    };
    Ok(worst(&[rel_err(&own, &dh_want, GEMM_FLOOR), db_err]))
}
