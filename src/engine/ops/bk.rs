//! The ResNet-BK core forward and backward.

use super::*;

/// What defines `H - zI` for the BK-Core besides the potential: `z` as `[Re, Im]` and the
/// optional super- and sub-diagonals (at least `n - 1` values each; ones when absent), all
/// f32 on the potential's device. `z` stays on the device so no forward waits on a copy.
pub struct BkCoeffs<'a> {
    pub z: &'a Tensor,
    pub offdiag: Option<(&'a Tensor, &'a Tensor)>,
}

/// Where the BK-Core backward adds the gradients of learned coefficients (`None`: not learned).
#[derive(Default)]
pub struct BkCoeffGrads<'a> {
    pub dz: Option<&'a mut Tensor>,
    pub doffdiag: Option<(&'a mut Tensor, &'a mut Tensor)>,
}

fn check_bk(op: &'static str, v: &Tensor, k: &BkCoeffs, s: cpu::bk_core::BkShape) -> Result<()> {
    let bad = |detail: String| Err(EngineError::Shape { op, detail });
    if s.n == 0 || s.batch == 0 {
        return bad(format!(
            "batch {} x n {}: both must be at least 1",
            s.batch, s.n
        ));
    }
    expect_len(op, "potential v", v, s.batch * s.n)?;
    expect_len(op, "z", k.z, 2)?;
    let mut ts = vec![v, k.z];
    if let Some((b, c)) = k.offdiag {
        for (what, t) in [("super-diagonal", b), ("sub-diagonal", c)] {
            if t.len() + 1 < s.n {
                return bad(format!(
                    "{what} has {} values, n = {} needs {}",
                    t.len(),
                    s.n,
                    s.n - 1
                ));
            }
        }
        ts.extend([b, c]);
    }
    if let Some(t) = ts.iter().find(|t| t.dtype() != DType::F32) {
        return bad(format!(
            "expects f32 tensors (the recurrences run in f32 or wider), got {:?}",
            t.dtype()
        ));
    }
    Ok(())
}

/// Super- and sub-diagonal as f64 host values.
type HostOffdiag = Option<(Vec<f64>, Vec<f64>)>;

/// The coefficients as f64 host values for the CPU kernel.
fn bk_host_coeffs(k: &BkCoeffs) -> (cpu::bk_core::Cx<f64>, HostOffdiag) {
    let z = k.z.host();
    let wide = |t: &Tensor| t.host().iter().map(|&x| x as f64).collect::<Vec<f64>>();
    (
        cpu::bk_core::Cx::new(z[0] as f64, z[1] as f64),
        k.offdiag.map(|(b, c)| (wide(b), wide(c))),
    )
}

/// BK-Core forward: `[batch * n, 2]` holding `(Re, Im) G_ii` per position, and whether every
/// value is finite (a NaN/inf potential or a singular `H - zI` makes some not; the caller
/// reports it). The CPU computes in f64, the GPU in f32.
pub fn bk_core_forward(
    v: &Tensor,
    k: &BkCoeffs,
    s: cpu::bk_core::BkShape,
) -> Result<(Tensor, bool)> {
    let _prof = profile::scope("bk_core_forward", v);
    let mut ts = vec![v, k.z];
    if let Some((b, c)) = k.offdiag {
        ts.extend([b, c]);
    }
    let on = device_of("bk_core", &ts)?;
    check_bk("bk_core", v, k, s)?;
    let mut out = Tensor::uninit(v.pool(), &[s.batch * s.n, 2], DType::F32)?;
    let finite = match on {
        On::Meta => true,
        On::Cpu => {
            let (z, off) = bk_host_coeffs(k);
            let v64: Vec<f64> = v.host().iter().map(|&x| x as f64).collect();
            let mut out64 = vec![0.0f64; 2 * v64.len()];
            let coeffs = cpu::bk_core::BkCoeffs {
                z,
                offdiag: off.as_ref().map(|(b, c)| (&b[..], &c[..])),
            };
            cpu::bk_core::forward(&mut out64, &v64, coeffs, s);
            for (o, &x) in out.host_mut().iter_mut().zip(&out64) {
                *o = x as f32;
            }
            out.host().iter().all(|x| x.is_finite())
        }
        On::Gpu(g) => g.bk_core_forward(
            out.cuda_mut(),
            v.cuda(),
            k.z.cuda(),
            k.offdiag.map(|(b, c)| (b.cuda(), c.cuda())),
            s,
        )?,
    };
    Ok((out, finite))
}

/// BK-Core backward: returns `dv` (layout of `v`) for the output gradient `d_out`
/// (`[batch * n, 2]`) and adds the gradients of `z` and of the off-diagonals into `grads`.
pub fn bk_core_backward(
    d_out: &Tensor,
    v: &Tensor,
    k: &BkCoeffs,
    s: cpu::bk_core::BkShape,
    grads: BkCoeffGrads,
) -> Result<Tensor> {
    let _prof = profile::scope("bk_core_backward", v);
    let mut ts = vec![d_out, v, k.z];
    if let Some((b, c)) = k.offdiag {
        ts.extend([b, c]);
    }
    let on = device_of("bk_core_backward", &ts)?;
    check_bk("bk_core_backward", v, k, s)?;
    expect_len("bk_core_backward", "d_out", d_out, 2 * s.batch * s.n)?;
    if let Some(dz) = &grads.dz {
        expect_len("bk_core_backward", "dz", dz, 2)?;
    }
    if let Some((db, dc)) = &grads.doffdiag {
        let Some((b, c)) = k.offdiag else {
            return Err(EngineError::Shape {
                op: "bk_core_backward",
                detail: "off-diagonal gradients asked for without off-diagonals".into(),
            });
        };
        expect_len("bk_core_backward", "db", db, b.len())?;
        expect_len("bk_core_backward", "dc", dc, c.len())?;
    }
    let mut dv = Tensor::uninit(v.pool(), v.shape(), DType::F32)?;
    match on {
        On::Meta => {}
        On::Cpu => {
            let (z, off) = bk_host_coeffs(k);
            let v64: Vec<f64> = v.host().iter().map(|&x| x as f64).collect();
            let d64: Vec<f64> = d_out.host().iter().map(|&x| x as f64).collect();
            let mut dv64 = vec![0.0f64; v64.len()];
            let coeffs = cpu::bk_core::BkCoeffs {
                z,
                offdiag: off.as_ref().map(|(b, c)| (&b[..], &c[..])),
            };
            let g = cpu::bk_core::backward(&mut dv64, &d64, &v64, coeffs, s);
            for (o, &x) in dv.host_mut().iter_mut().zip(&dv64) {
                *o = x as f32;
            }
            if let Some(dz) = grads.dz {
                let dz = dz.host_mut();
                dz[0] += g.dz.0 as f32;
                dz[1] += g.dz.1 as f32;
            }
            if let (Some((db, dc)), Some((b, c))) = (grads.doffdiag, off) {
                for i in 0..s.n - 1 {
                    db.host_mut()[i] += (g.dp[i] * c[i]) as f32;
                    dc.host_mut()[i] += (g.dp[i] * b[i]) as f32;
                }
            }
        }
        On::Gpu(g) => g.bk_core_backward(
            dv.cuda_mut(),
            d_out.cuda(),
            v.cuda(),
            k.z.cuda(),
            k.offdiag.map(|(b, c)| (b.cuda(), c.cuda())),
            s,
            grads.dz.map(|t| t.cuda_mut()),
            grads.doffdiag.map(|(b, c)| (b.cuda_mut(), c.cuda_mut())),
        )?,
    }
    Ok(dv)
}
