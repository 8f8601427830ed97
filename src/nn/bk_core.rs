//! The BK-Core layer: per position, the diagonal of the resolvent `(H - zI)^-1` of a
//! tridiagonal Hamiltonian whose potential `v` comes from the token features (the mixing
//! layer of ResNet-BK). O(N) per sequence forward and backward; the math lives in
//! [`crate::engine::cpu::bk_core`], the kernels behind [`ops::bk_core_forward`].
//!
//! `z` (default `i`) and the off-diagonals may be learned. They are tiny and precision
//! sensitive, so the layer always reads their fp32 master values, never a bf16/f16 copy.

use super::{Cost, Init, Param, ParamBuilder, f32_bytes, params};
use crate::engine::cpu::bk_core::{BkShape, spectrum_bound};
use crate::engine::ops::{self, BkCoeffGrads, BkCoeffs};
use crate::engine::{EngineError, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BkCoreOptions {
    /// Position i sees positions up to i only (language modelling).
    pub causal: bool,
    pub learn_z: bool,
    /// Learn the super- and sub-diagonal (ones, and fixed, otherwise).
    pub learn_offdiag: bool,
    /// Initial `(Re z, Im z)`.
    pub z: (f64, f64),
}

impl Default for BkCoreOptions {
    fn default() -> Self {
        BkCoreOptions {
            causal: true,
            learn_z: false,
            learn_offdiag: false,
            z: (0.0, 1.0),
        }
    }
}

pub struct BkCore {
    name: String,
    n_max: usize,
    opts: BkCoreOptions,
    /// `[Re z, Im z]`; a parameter only when learned.
    z: Param,
    /// Super- and sub-diagonal, `n_max - 1` values each, when learned.
    offdiag: Option<(Param, Param)>,
    warned_real_z: AtomicBool,
}

/// What the backward needs: the potentials (the pivots are recomputed, O(N)).
pub struct BkSaved {
    v: Tensor,
    batch: usize,
    n: usize,
}

params!(BkCore { z if opts.learn_z, offdiag });

impl BkCore {
    /// A layer named by `b`'s scope; only the parameters it learns are built through `b`
    /// (loaded, when `b` loads).
    pub fn new(b: &mut ParamBuilder, n_max: usize, opts: BkCoreOptions) -> Result<BkCore> {
        let name = b.prefix().to_string();
        let bad = |detail: String| EngineError::Shape {
            op: "bk_core",
            detail: format!("layer {name}: {detail}"),
        };
        if n_max == 0 {
            return Err(bad("n_max must be at least 1".into()));
        }
        if !(opts.z.0.is_finite() && opts.z.1.is_finite()) {
            return Err(bad(format!("z = {:?} must be finite", opts.z)));
        }
        // Deterministic inits (ones, the given z): no random draws.
        let z_values = vec![opts.z.0 as f32, opts.z.1 as f32];
        let z = if opts.learn_z {
            b.param_from("z", &[2], z_values)?
        } else {
            Param::holding(b.pool(), b.name("z"), &[2], z_values, false)?
        };
        let offdiag = if opts.learn_offdiag {
            let m = (n_max - 1).max(1);
            Some((
                b.param("offdiag_upper", &[m], Init::Ones)?,
                b.param("offdiag_lower", &[m], Init::Ones)?,
            ))
        } else {
            None
        };
        // The recurrences read these as f32 masters under every precision.
        let mut z = z;
        z.master_read = true;
        let mut offdiag = offdiag;
        if let Some((upper, lower)) = &mut offdiag {
            upper.master_read = true;
            lower.master_read = true;
        }
        let layer = BkCore {
            name,
            n_max,
            opts,
            z,
            offdiag,
            warned_real_z: AtomicBool::new(false),
        };
        Ok(layer)
    }

    fn coeffs(&self) -> BkCoeffs<'_> {
        BkCoeffs {
            z: &self.z.value,
            offdiag: self.offdiag.as_ref().map(|(b, c)| (&b.value, &c.value)),
        }
    }

    fn shape(&self, v: &Tensor, batch: usize, n: usize) -> Result<BkShape> {
        if n == 0 || n > self.n_max || batch == 0 || v.len() != batch * n {
            return Err(EngineError::Shape {
                op: "bk_core",
                detail: format!(
                    "layer {}: {} potentials for batch {batch} x n {n} (n must be 1..={})",
                    self.name,
                    v.len(),
                    self.n_max
                ),
            });
        }
        Ok(BkShape {
            batch,
            n,
            causal: self.opts.causal,
        })
    }

    /// `[batch * n, 2]`: `(Re, Im) G_ii` for the potentials `v` (`[batch * n]`, f32).
    pub fn forward(&self, v: &Tensor, batch: usize, n: usize) -> Result<(Tensor, BkSaved)> {
        let s = self.shape(v, batch, n)?;
        self.warn_if_z_may_be_singular(v, n)?;
        let (out, finite) = ops::bk_core_forward(v, &self.coeffs(), s)?;
        if !finite {
            return Err(self.explain_non_finite(v, n));
        }
        Ok((
            out,
            BkSaved {
                v: v.try_clone()?,
                batch,
                n,
            },
        ))
    }

    /// dL/dv for `d_out` (`[batch * n, 2]`: dL/dRe G, dL/dIm G); adds the gradients of a
    /// learned `z` and off-diagonals into their parameters.
    pub fn backward(&mut self, d_out: &Tensor, saved: &BkSaved) -> Result<Tensor> {
        let s = self.shape(&saved.v, saved.batch, saved.n)?;
        let dz = self.opts.learn_z.then_some(&mut self.z.grad);
        // The off-diagonal values are read while their gradients are written: split borrows.
        let (offdiag, doffdiag) = match &mut self.offdiag {
            Some((b, c)) => (Some((&b.value, &c.value)), Some((&mut b.grad, &mut c.grad))),
            None => (None, None),
        };
        let coeffs = BkCoeffs {
            z: &self.z.value,
            offdiag,
        };
        ops::bk_core_backward(d_out, &saved.v, &coeffs, s, BkCoeffGrads { dz, doffdiag })
    }

    /// FLOPs count the real operations of the complex recurrences (a reciprocal as 6): about
    /// 30 per position forward in full mode (two pivots and G), 15 causal; the backward
    /// re-runs the forward and adds the two adjoint sweeps. Saves the potentials.
    pub fn cost(&self, batch: usize, n: usize) -> Cost {
        Self::cost_of(self.opts, self.n_max, batch, n)
    }

    /// [`BkCore::cost`] from the options alone (for the planner).
    pub fn cost_of(opts: BkCoreOptions, n_max: usize, batch: usize, n: usize) -> Cost {
        let elems = (batch * n) as u64;
        let fwd = if opts.causal { 15 } else { 30 };
        let params = if opts.learn_z { 2 } else { 0 }
            + if opts.learn_offdiag {
                2 * (n_max - 1).max(1)
            } else {
                0
            };
        Cost {
            params,
            flops_forward: fwd * elems,
            flops_backward: (fwd + 3 * fwd) * elems,
            saved_bytes: f32_bytes(batch * n),
        }
    }

    /// `z` on the real axis inside the spectrum can hit an eigenvalue: say so once.
    fn warn_if_z_may_be_singular(&self, v: &Tensor, n: usize) -> Result<()> {
        // A fixed z off the real axis never needs the check (nor the device read).
        if self.warned_real_z.load(Ordering::Relaxed)
            || (!self.opts.learn_z && self.opts.z.1 != 0.0)
        {
            return Ok(());
        }
        let z = self.z.value.to_vec()?;
        if z[1] != 0.0 {
            return Ok(());
        }
        let off = match &self.offdiag {
            Some((b, c)) => Some((b.value.to_vec()?, c.value.to_vec()?)),
            None => None,
        };
        let (lo, hi) = spectrum_bound(
            &v.to_vec()?,
            off.as_ref().map(|(b, c)| (&b[..n - 1], &c[..n - 1])),
        );
        if (lo..=hi).contains(&(z[0] as f64)) {
            self.warned_real_z.store(true, Ordering::Relaxed);
            eprintln!(
                "warning: {}: z = {} is real and inside the spectrum bound [{lo:.3}, {hi:.3}] of H; \
                 G = (H - zI)^-1 may be singular. Give z a positive imaginary part (default z = i)",
                self.name, z[0]
            );
        }
        Ok(())
    }

    /// Why the forward produced inf/NaN: a bad potential, or a singular `H - zI`.
    fn explain_non_finite(&self, v: &Tensor, n: usize) -> EngineError {
        let layer = format!("bk_core layer {}", self.name);
        let detail = match v.to_vec() {
            Ok(host) => match host.iter().position(|x| !x.is_finite()) {
                Some(i) => format!(
                    "the potential v is {} at sequence {}, position {}; the layer feeding it \
                     diverged (lower the learning rate or clip gradients)",
                    host[i],
                    i / n,
                    i % n
                ),
                None => {
                    let z = self.z.value.to_vec().unwrap_or_default();
                    format!(
                        "G = (H - zI)^-1 is not finite: a zero pivot, H - zI is singular at \
                         z = {z:?}. Move z off the real axis (Im z > 0)"
                    )
                }
            },
            Err(e) => format!("G is not finite, and reading v back failed: {e}"),
        };
        EngineError::NonFinite { layer, detail }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::DType;
    use crate::nn::gradcheck::*;

    fn layer(causal: bool, learn: bool) -> BkCore {
        let opts = BkCoreOptions {
            causal,
            learn_z: learn,
            learn_offdiag: learn,
            z: (0.2, 0.9),
        };
        let mut l = build(&pool(), "blocks.0.bk", 0, |b| BkCore::new(b, 16, opts));
        if let Some((b, c)) = &mut l.offdiag {
            let nb = b.value.len();
            b.value
                .copy_from_host(
                    &(0..nb)
                        .map(|i| 1.0 + 0.1 * (i % 4) as f32)
                        .collect::<Vec<_>>(),
                )
                .unwrap();
            c.value
                .copy_from_host(
                    &(0..nb)
                        .map(|i| 0.7 + 0.05 * (i % 3) as f32)
                        .collect::<Vec<_>>(),
                )
                .unwrap();
        }
        l
    }

    #[test]
    fn backward_matches_finite_differences_for_v_z_and_offdiagonals() {
        let p = pool();
        let (batch, n) = (2, 7);
        for causal in [false, true] {
            let mut l = layer(causal, true);
            let v = random_tensor(&p, &[batch * n], 3);
            let w = random_tensor(&p, &[batch * n, 2], 4);
            let (_, saved) = l.forward(&v, batch, n).unwrap();
            let dv = l.backward(&w, &saved).unwrap();
            check("dv", &v, dv.host(), 100, |v| {
                weighted_sum(&l.forward(v, batch, n).unwrap().0, &w)
            });
            let (dz, db, dc) = {
                let (b, c) = l.offdiag.as_ref().unwrap();
                (
                    l.z.grad.to_vec().unwrap(),
                    b.grad.to_vec().unwrap(),
                    c.grad.to_vec().unwrap(),
                )
            };
            let z0 = l.z.value.try_clone().unwrap();
            check("dz", &z0, &dz, 2, |z| {
                l.z.value = z.try_clone().unwrap();
                weighted_sum(&l.forward(&v, batch, n).unwrap().0, &w)
            });
            l.z.value = z0;
            // Only the first n - 1 off-diagonal entries take part.
            for (which, grad) in [(0, &db), (1, &dc)] {
                assert!(grad[n - 1..].iter().all(|&g| g == 0.0));
                let t0 = {
                    let (b, c) = l.offdiag.as_ref().unwrap();
                    if which == 0 { b } else { c }.value.try_clone().unwrap()
                };
                check("doffdiag", &t0, grad, 100, |t| {
                    let (b, c) = l.offdiag.as_mut().unwrap();
                    if which == 0 { b } else { c }.value = t.try_clone().unwrap();
                    weighted_sum(&l.forward(&v, batch, n).unwrap().0, &w)
                });
                let (b, c) = l.offdiag.as_mut().unwrap();
                if which == 0 { b } else { c }.value = t0;
            }
        }
    }

    #[test]
    fn params_follow_the_options_and_cost_counts_them() {
        assert!(layer(true, false).params().is_empty());
        let l = layer(false, true);
        assert_eq!(l.params().len(), 3);
        assert_eq!(l.cost(4, 16).params, 2 + 2 * 15);
        assert_eq!(l.cost(4, 16).saved_bytes, 4 * 64);
    }

    #[test]
    fn n_equal_one_works() {
        let l = layer(false, false);
        let v = Tensor::from_vec(&pool(), &[3], DType::F32, vec![0.5, -0.5, 2.0]).unwrap();
        let (g, _) = l.forward(&v, 3, 1).unwrap();
        let g = g.to_vec().unwrap();
        for (i, &x) in [0.5f64, -0.5, 2.0].iter().enumerate() {
            // 1 / (-2 + v - z)
            let (re, im) = (-2.0 + x - 0.2, -0.9f64);
            let d = re * re + im * im;
            assert!((g[2 * i] as f64 - re / d).abs() < 1e-6);
            assert!((g[2 * i + 1] as f64 + im / d).abs() < 1e-6);
        }
    }

    #[test]
    fn nan_or_inf_potential_is_an_error_naming_the_layer_and_position() {
        let l = layer(true, false);
        for bad in [f32::NAN, f32::INFINITY] {
            let mut v = vec![0.1f32; 8];
            v[5] = bad;
            let v = Tensor::from_vec(&pool(), &[8], DType::F32, v).unwrap();
            let err = l.forward(&v, 2, 4).err().unwrap().to_string();
            assert!(
                err.contains("blocks.0.bk") && err.contains("sequence 1, position 1"),
                "{err}"
            );
        }
    }

    #[test]
    fn singular_z_is_reported_never_silent_zeros() {
        // N = 1, v = 2: H = [0]; z = 0 is exactly its eigenvalue.
        let opts = BkCoreOptions {
            z: (0.0, 0.0),
            ..BkCoreOptions::default()
        };
        let l = build(&pool(), "bk", 0, |b| BkCore::new(b, 4, opts));
        let v = Tensor::from_vec(&pool(), &[1], DType::F32, vec![2.0]).unwrap();
        let err = l.forward(&v, 1, 1).err().unwrap().to_string();
        assert!(err.contains("singular") && err.contains("bk"), "{err}");
        assert!(l.warned_real_z.load(Ordering::Relaxed));
    }

    #[test]
    fn bad_shapes_are_refused() {
        let l = layer(true, false);
        let v = Tensor::from_vec(&pool(), &[6], DType::F32, vec![0.0; 6]).unwrap();
        assert!(l.forward(&v, 2, 4).is_err());
        let v = Tensor::from_vec(&pool(), &[34], DType::F32, vec![0.0; 34]).unwrap();
        let err = l.forward(&v, 2, 17).err().unwrap().to_string();
        assert!(err.contains("1..=16"), "{err}");
    }
}
