//! AdamW with decoupled weight decay, one pass over a parameter tensor.
//!
//! The pass fuses everything an optimizer step does per element: it scales the raw gradient
//! (undoing the loss scale and applying the clipping factor in one multiply), updates the
//! moments, updates the fp32 master weight and writes the rounded compute copy, so each
//! element is read and written once.
//!
//! The compute copy is written as f32 values rounded to a dtype (the CPU's emulation of bf16
//! and f16), or as the 16-bit types themselves: the offloaded optimizer writes those into
//! pinned staging that is copied to the GPU as is.
//!
//! [`adamw_update_unfused`] is the same update as the chain of elementwise passes a
//! framework's non-fused ("foreach") AdamW runs, each reading and writing whole tensors:
//! scale the gradient, update `m`, update `v`, update the master, round the compute copy.
//! Both forms share the per-element arithmetic below ([`first_moment`], [`second_moment`],
//! [`AdamWStep::apply`]), so on the CPU they agree bit for bit.

use crate::engine::DType;
use crate::engine::cuda::Elem;
use rayon::prelude::*;

/// Hyper-parameters of one step; `t` is the 1-based step count for bias correction.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub t: u64,
    /// Multiplies the stored gradient before use (1 / loss scale x clip coefficient).
    pub grad_scale: f32,
}

impl AdamWStep {
    /// Bias corrections `(1 - beta1^t, 1 - beta2^t)`, as every form of the step computes them.
    pub fn bias_corrections(&self) -> (f32, f32) {
        (
            1.0 - self.beta1.powi(self.t as i32),
            1.0 - self.beta2.powi(self.t as i32),
        )
    }

    /// The new master weight from the old one and the updated moments.
    #[inline]
    fn apply(&self, p: f32, m: f32, v: f32, (bc1, bc2): (f32, f32)) -> f32 {
        let m_hat = m / bc1;
        let v_hat = v / bc2;
        p - self.lr * (m_hat / (v_hat.sqrt() + self.eps) + self.weight_decay * p)
    }
}

#[inline]
fn first_moment(m: f32, g: f32, beta1: f32) -> f32 {
    beta1 * m + (1.0 - beta1) * g
}

#[inline]
fn second_moment(v: f32, g: f32, beta2: f32) -> f32 {
    beta2 * v + (1.0 - beta2) * g * g
}

const CHUNK: usize = 4096;

/// The compute value of master `p`: f32 elements hold `p` rounded to `dtype`; a 16-bit
/// element type is its own dtype and rounds (to nearest even, as `DType::round`) on conversion.
#[inline]
fn compute_value<C: Elem>(p: f32, dtype: DType) -> C {
    if C::DTYPE == DType::F32 {
        C::from_f32(dtype.round(p))
    } else {
        C::from_f32(p)
    }
}

/// Updates `param`, `m`, `v` in place; writes `compute` if given: `(values, dtype)` with
/// f32 values rounded to `dtype`, or 16-bit values whose type must be `dtype`.
pub fn adamw_update<C: Elem>(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    compute: Option<(&mut [C], DType)>,
    h: AdamWStep,
) {
    let bc = h.bias_corrections();
    let update = |p: &mut f32, g: f32, m: &mut f32, v: &mut f32| {
        let g = g * h.grad_scale;
        *m = first_moment(*m, g, h.beta1);
        *v = second_moment(*v, g, h.beta2);
        *p = h.apply(*p, *m, *v, bc);
    };
    let parts = param
        .par_chunks_mut(CHUNK)
        .zip(grad.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)));
    match compute {
        None => parts.for_each(|((p, g), (m, v))| {
            for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m).zip(v) {
                update(p, g, m, v);
            }
        }),
        Some((c, dtype)) => {
            debug_assert!(C::DTYPE == DType::F32 || C::DTYPE == dtype);
            parts
                .zip(c.par_chunks_mut(CHUNK))
                .for_each(|(((p, g), (m, v)), c)| {
                    for ((((p, &g), m), v), c) in p.iter_mut().zip(g).zip(m).zip(v).zip(c) {
                        update(p, g, m, v);
                        *c = compute_value(*p, dtype);
                    }
                })
        }
    }
}

/// The update of [`adamw_update`] as five whole-tensor passes: `scaled = grad * grad_scale`
/// (`scaled` is scratch of the parameter's length), then `m`, then `v`, then the master, then
/// the compute copy (f32 values rounded to the dtype on the CPU).
pub fn adamw_update_unfused(
    param: &mut [f32],
    grad: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    scaled: &mut [f32],
    compute: Option<(&mut [f32], DType)>,
    h: AdamWStep,
) {
    scaled
        .par_iter_mut()
        .zip(grad.par_iter())
        .for_each(|(s, &g)| *s = g * h.grad_scale);
    m.par_iter_mut()
        .zip(scaled.par_iter())
        .for_each(|(m, &g)| *m = first_moment(*m, g, h.beta1));
    v.par_iter_mut()
        .zip(scaled.par_iter())
        .for_each(|(v, &g)| *v = second_moment(*v, g, h.beta2));
    let bc = h.bias_corrections();
    param
        .par_iter_mut()
        .zip(m.par_iter().zip(v.par_iter()))
        .for_each(|(p, (&m, &v))| *p = h.apply(*p, m, v, bc));
    if let Some((c, dtype)) = compute {
        c.par_iter_mut()
            .zip(param.par_iter())
            .for_each(|(c, &p)| *c = compute_value::<f32>(p, dtype));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::{assert_close, random};

    #[test]
    fn matches_the_textbook_update_over_several_steps() {
        let n = 10_001;
        let mut p = random(n, 1, 1.0);
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        let mut c = vec![f32::NAN; n];
        let (mut p64, mut m64, mut v64): (Vec<f64>, Vec<f64>, Vec<f64>) = (
            p.iter().map(|&x| x as f64).collect(),
            vec![0.0; n],
            vec![0.0; n],
        );
        for t in 1..=3u64 {
            let g = random(n, 10 + t, 2.0);
            let h = AdamWStep {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                t,
                grad_scale: 0.25,
            };
            adamw_update(&mut p, &g, &mut m, &mut v, Some((&mut c, DType::BF16)), h);
            for i in 0..n {
                let gi = g[i] as f64 * 0.25;
                m64[i] = 0.9 * m64[i] + 0.1 * gi;
                v64[i] = 0.95 * v64[i] + 0.05 * gi * gi;
                let mh = m64[i] / (1.0 - 0.9f64.powi(t as i32));
                let vh = v64[i] / (1.0 - 0.95f64.powi(t as i32));
                p64[i] -= 1e-2 * (mh / (vh.sqrt() + 1e-8) + 0.1 * p64[i]);
            }
        }
        let want: Vec<f32> = p64.iter().map(|&x| x as f32).collect();
        assert_close(&p, &want, 1e-5, "master weights");
        let rounded: Vec<f32> = p.iter().map(|&x| DType::BF16.round(x)).collect();
        assert_close(&c, &rounded, 0.0, "compute copy is the rounded master");
    }

    /// The five passes land exactly where the fused pass does: every element goes through
    /// the same f32 operations in the same order (Rust neither contracts nor widens them), so
    /// the tolerance on the CPU is zero. On the GPU each kernel may contract a multiply-add
    /// differently, a few ulp, which `kiln selftest` bounds like the fused kernel.
    #[test]
    fn unfused_passes_equal_the_fused_update() {
        let n = 10_007;
        let p0 = random(n, 31, 1.0);
        let m0 = random(n, 32, 0.1);
        let v0: Vec<f32> = random(n, 33, 0.01).iter().map(|x| x.abs()).collect();
        for (t, decay, dtype) in [(1, 0.1, Some(DType::BF16)), (9, 0.0, None)] {
            let g = random(n, 40 + t, 3.0);
            let h = AdamWStep {
                lr: 3e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: decay,
                t,
                grad_scale: 1.0 / 1024.0 * 0.7,
            };
            let (mut p1, mut m1, mut v1) = (p0.clone(), m0.clone(), v0.clone());
            let mut c1 = vec![f32::NAN; n];
            let fused_c = dtype.map(|d| (c1.as_mut_slice(), d));
            adamw_update(&mut p1, &g, &mut m1, &mut v1, fused_c, h);
            let (mut p2, mut m2, mut v2) = (p0.clone(), m0.clone(), v0.clone());
            let (mut c2, mut scratch) = (vec![f32::NAN; n], vec![f32::NAN; n]);
            let unfused_c = dtype.map(|d| (c2.as_mut_slice(), d));
            adamw_update_unfused(&mut p2, &g, &mut m2, &mut v2, &mut scratch, unfused_c, h);
            assert_eq!(p1, p2, "masters, step {t}");
            assert_eq!(m1, m2, "m, step {t}");
            assert_eq!(v1, v2, "v, step {t}");
            if dtype.is_some() {
                assert_eq!(c1, c2, "compute copies, step {t}");
            }
            assert_ne!(p2, p0, "the step changed the masters");
        }
    }

    /// The offloaded step writes bf16/f16 bits for upload; they must be the very values the
    /// CPU's rounded-f32 emulation holds, overflow to infinity included.
    #[test]
    fn sixteen_bit_output_holds_the_emulated_values() {
        use crate::engine::cuda::{Bf16, F16};
        fn check<C: Elem>() {
            let n = 9_000;
            let h = AdamWStep {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                t: 2,
                grad_scale: 0.5,
            };
            // Large masters make f16 overflow part of the check.
            let p0: Vec<f32> = random(n, 4, 1.0).iter().map(|x| x * 1e5).collect();
            let g = random(n, 5, 1.0);
            let m0 = random(n, 6, 0.1);
            let v0: Vec<f32> = random(n, 7, 0.01).iter().map(|x| x.abs()).collect();
            let (mut p1, mut m1, mut v1) = (p0.clone(), m0.clone(), v0.clone());
            let mut emulated = vec![f32::NAN; n];
            adamw_update(
                &mut p1,
                &g,
                &mut m1,
                &mut v1,
                Some((&mut emulated, C::DTYPE)),
                h,
            );
            let (mut p2, mut m2, mut v2) = (p0, m0, v0);
            let mut bits = vec![C::from_f32(f32::NAN); n];
            adamw_update(
                &mut p2,
                &g,
                &mut m2,
                &mut v2,
                Some((&mut bits, C::DTYPE)),
                h,
            );
            assert_eq!(p1, p2);
            let got: Vec<u32> = bits.iter().map(|b| b.to_f32().to_bits()).collect();
            let want: Vec<u32> = emulated.iter().map(|x| x.to_bits()).collect();
            assert_eq!(got, want, "{}", C::SUFFIX);
            if C::DTYPE == DType::F16 {
                assert!(
                    emulated.iter().any(|x| x.is_infinite()),
                    "no overflow exercised"
                );
            }
        }
        check::<Bf16>();
        check::<F16>();
    }
}
