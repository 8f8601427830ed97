//! BK-Core: the diagonal of the resolvent `G = (H - zI)^-1` of a tridiagonal `H`, in O(N)
//! per sequence, and its exact gradient in O(N).
//!
//! `H` has diagonal `a_i = -2 + v_i` (the discrete Laplacian plus a potential `v`), super-
//! diagonal `b_i` and sub-diagonal `c_i` (ones unless given); only the products
//! `p_i = b_i c_i` enter. With `s_i = a_i - z`:
//!
//! ```text
//! r_0 = s_0,          r_i = s_i - p_{i-1} / r_{i-1}     (pivots from the left)
//! q_{N-1} = s_{N-1},  q_i = s_i - p_i / q_{i+1}         (pivots from the right)
//! G_ii = 1 / (r_i + q_i - s_i)     full mode
//! G_ii = 1 / r_i                   causal mode: the last diagonal entry of the resolvent
//!                                  of the leading (i+1) x (i+1) block
//! ```
//!
//! Why this form: the textbook route divides determinants, `theta_i = s_i theta_{i-1} -
//! p_{i-1} theta_{i-2}`, which grow like the product of the `|s_i|` and overflow (f32 from N
//! near 128, f64 near 1000), after which the quotient is inf/inf or 0. The ratios `r_i =
//! theta_i / theta_{i-1}` carry the same information at the scale of one matrix entry. For real
//! `a`, `p > 0` and `Im z > 0`, every `r_i` and `q_i` has imaginary part at most `-Im z`, so no
//! divisor gets closer to zero than `Im z` and nothing can overflow.
//!
//! The gradient is the exact adjoint (reverse-mode derivative) of these recurrences, which is
//! the same number as the contraction `dL/dv_j = Re sum_i gbar_i (-G_ij G_ji)` but costs O(N)
//! and never forms an off-diagonal `G_ij`. All maps are holomorphic in the complex inputs, so
//! one complex adjoint per quantity suffices; for a real loss of `(Re G_i, Im G_i)` with
//! partials `(gr_i, gi_i)` the seed is `gbar_i = gr_i - i gi_i` and a real input `x` gets
//! `dL/dx = Re(xbar)`. Backwards through the recurrences:
//!
//! ```text
//! dbar_i = -gbar_i G_i^2                                 (d_i = r_i + q_i - s_i, or r_i)
//! rbar_i = dbar_i + rbar_{i+1} p_i / r_i^2               (sweep right to left)
//! qbar_i = dbar_i + qbar_{i-1} p_{i-1} / q_i^2           (sweep left to right; full mode)
//! sbar_i = rbar_i + qbar_i - dbar_i                      (causal: sbar_i = rbar_i)
//! pbar_i = -rbar_{i+1} / r_i - qbar_i / q_{i+1}
//! dL/dv_i = Re sbar_i,  dL/dz = -sum sbar_i,  dL/db_i = Re(pbar_i) c_i,  dL/dc_i = Re(pbar_i) b_i
//! ```
//!
//! The carried adjoints are multiplied by `p_i / r_i^2` and `p_{i-1} / q_i^2`, the same
//! bounded ratios as the forward (at most 1 in magnitude for `p = 1` and `Im z >= 1`), so the
//! backward is as stable as the forward: it needs only the stored `r` and `q`.
//!
//! This file is the reference (plain sequential sweeps, one sequence per rayon task, f32 or
//! f64); the GPU kernel in `engine/cuda/bk_core.cu` computes the same numbers with the
//! sequence split into chunks.

use rayon::prelude::*;
use std::ops::{Add, Div, Mul, Neg, Sub};

/// The real scalar of the complex arithmetic: f32 or f64.
pub trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

/// A complex number; only the operations the recurrences need.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cx<T> {
    pub re: T,
    pub im: T,
}

impl<T: Real> Cx<T> {
    pub fn new(re: T, im: T) -> Self {
        Cx { re, im }
    }

    fn real(re: T) -> Self {
        Cx { re, im: T::ZERO }
    }

    /// `1 / self`. Plain `conj / |.|^2`: the divisors here are bounded away from zero and
    /// far from overflow (see the module doc), so no scaling is needed, and a zero divisor
    /// gives NaN (0/0), never a silent zero.
    pub fn recip(self) -> Self {
        let d = self.re * self.re + self.im * self.im;
        Cx::new(self.re / d, -self.im / d)
    }

    pub fn scale(self, k: T) -> Self {
        Cx::new(self.re * k, self.im * k)
    }

    pub fn is_finite(self) -> bool {
        self.re.to_f64().is_finite() && self.im.to_f64().is_finite()
    }
}

impl<T: Real> Add for Cx<T> {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Cx::new(self.re + o.re, self.im + o.im)
    }
}

impl<T: Real> Sub for Cx<T> {
    type Output = Self;
    fn sub(self, o: Self) -> Self {
        Cx::new(self.re - o.re, self.im - o.im)
    }
}

impl<T: Real> Mul for Cx<T> {
    type Output = Self;
    fn mul(self, o: Self) -> Self {
        Cx::new(
            self.re * o.re - self.im * o.im,
            self.re * o.im + self.im * o.re,
        )
    }
}

impl<T: Real> Neg for Cx<T> {
    type Output = Self;
    fn neg(self) -> Self {
        Cx::new(-self.re, -self.im)
    }
}

/// The shape and mode of one BK-Core call: `batch` sequences of `n` positions each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BkShape {
    pub batch: usize,
    pub n: usize,
    pub causal: bool,
}

/// Everything besides the potential that defines `H - zI`, shared by every sequence.
#[derive(Debug, Clone, Copy)]
pub struct BkCoeffs<'a, T> {
    pub z: Cx<T>,
    /// Super- and sub-diagonal, `n - 1` values each (more are ignored); `None` means ones.
    pub offdiag: Option<(&'a [T], &'a [T])>,
}

impl<T: Real> BkCoeffs<'_, T> {
    /// `p_i = b_i c_i`.
    fn p(&self, i: usize) -> T {
        match self.offdiag {
            Some((b, c)) => b[i] * c[i],
            None => T::ONE,
        }
    }

    fn s(&self, v: T) -> Cx<T> {
        Cx::new(T::from_f64(-2.0) + v - self.z.re, -self.z.im)
    }
}

/// Pivots of one sequence: `r` always, `q` in full mode (empty in causal mode).
fn pivots<T: Real>(v: &[T], k: &BkCoeffs<T>, causal: bool, r: &mut Vec<Cx<T>>, q: &mut Vec<Cx<T>>) {
    let n = v.len();
    r.clear();
    q.clear();
    let mut prev = k.s(v[0]);
    r.push(prev);
    for (i, &vi) in v.iter().enumerate().skip(1) {
        prev = k.s(vi) - prev.recip().scale(k.p(i - 1));
        r.push(prev);
    }
    if causal {
        return;
    }
    q.resize(n, Cx::real(T::ZERO));
    let mut next = k.s(v[n - 1]);
    q[n - 1] = next;
    for i in (0..n - 1).rev() {
        next = k.s(v[i]) - next.recip().scale(k.p(i));
        q[i] = next;
    }
}

/// `d_i`, whose reciprocal is `G_ii`.
fn pivot_sum<T: Real>(r: &[Cx<T>], q: &[Cx<T>], s: Cx<T>, i: usize) -> Cx<T> {
    if q.is_empty() { r[i] } else { r[i] + q[i] - s }
}

/// `out[(b*n + i)*2 + {0,1}] = (Re, Im) G_ii` of sequence `b` for `v[b*n + i]`.
pub fn forward<T: Real>(out: &mut [T], v: &[T], k: BkCoeffs<T>, s: BkShape) {
    let n = s.n;
    assert!(n > 0 && v.len() == s.batch * n && out.len() == 2 * v.len());
    check_offdiag(&k, n);
    out.par_chunks_mut(2 * n)
        .zip(v.par_chunks(n))
        .for_each_init(
            || (Vec::new(), Vec::new()),
            |(r, q), (out, v)| {
                pivots(v, &k, s.causal, r, q);
                for i in 0..n {
                    let g = pivot_sum(r, q, k.s(v[i]), i).recip();
                    out[2 * i] = g.re;
                    out[2 * i + 1] = g.im;
                }
            },
        );
}

fn check_offdiag<T>(k: &BkCoeffs<T>, n: usize) {
    if let Some((b, c)) = k.offdiag {
        assert!(
            b.len() + 1 >= n && c.len() + 1 >= n,
            "off-diagonals shorter than n - 1"
        );
    }
}

/// Gradients of the shared coefficients, summed over the batch.
#[derive(Debug, Clone, PartialEq)]
pub struct BkCoeffGrads<T> {
    /// `(dL/dRe z, dL/dIm z)`.
    pub dz: (T, T),
    /// `dL/dp_i` (real), `n - 1` values; `dL/db_i = dp_i c_i`, `dL/dc_i = dp_i b_i`.
    pub dp: Vec<T>,
}

/// Writes `dv` (same layout as `v`) for the upstream gradient `d_out` (layout of `out`) and
/// returns the gradients of `z` and the off-diagonal products, summed over sequences in order.
pub fn backward<T: Real>(
    dv: &mut [T],
    d_out: &[T],
    v: &[T],
    k: BkCoeffs<T>,
    s: BkShape,
) -> BkCoeffGrads<T> {
    let n = s.n;
    assert!(n > 0 && v.len() == s.batch * n && dv.len() == v.len() && d_out.len() == 2 * v.len());
    check_offdiag(&k, n);
    let per_seq: Vec<(Cx<T>, Vec<T>)> = dv
        .par_chunks_mut(n)
        .zip(v.par_chunks(n).zip(d_out.par_chunks(2 * n)))
        .map(|(dv, (v, d_out))| backward_one(dv, d_out, v, &k, s.causal))
        .collect();
    let mut sum_sbar = Cx::real(T::ZERO);
    let mut dp = vec![T::ZERO; n - 1];
    for (sb, p) in per_seq {
        sum_sbar = sum_sbar + sb;
        for (a, b) in dp.iter_mut().zip(p) {
            *a = *a + b;
        }
    }
    // s = a - z: dL/dRe z = Re(-sum sbar), dL/dIm z = Re(-i sum sbar) = Im(sum sbar).
    BkCoeffGrads {
        dz: (-sum_sbar.re, sum_sbar.im),
        dp,
    }
}

/// One sequence: writes `dv`, returns `(sum_i sbar_i, Re pbar)`.
fn backward_one<T: Real>(
    dv: &mut [T],
    d_out: &[T],
    v: &[T],
    k: &BkCoeffs<T>,
    causal: bool,
) -> (Cx<T>, Vec<T>) {
    let n = v.len();
    let (mut r, mut q) = (Vec::with_capacity(n), Vec::with_capacity(n));
    pivots(v, k, causal, &mut r, &mut q);
    // dbar_i, kept for the left-to-right sweep.
    let mut dbar = Vec::with_capacity(n);
    for i in 0..n {
        let g = pivot_sum(&r, &q, k.s(v[i]), i).recip();
        let gbar = Cx::new(d_out[2 * i], -d_out[2 * i + 1]);
        dbar.push(-(gbar * g * g));
    }
    let mut sbar: Vec<Cx<T>> = Vec::with_capacity(n);
    let mut pbar = vec![T::ZERO; n.saturating_sub(1)];
    // Right to left: rbar.
    let mut rbar_next = Cx::real(T::ZERO);
    sbar.resize(n, Cx::real(T::ZERO));
    for i in (0..n).rev() {
        let carry = if i + 1 < n {
            let rinv = r[i].recip();
            pbar[i] = (-(rbar_next * rinv)).re;
            rbar_next * rinv * rinv.scale(k.p(i))
        } else {
            Cx::real(T::ZERO)
        };
        let rbar = dbar[i] + carry;
        sbar[i] = if causal { rbar } else { rbar - dbar[i] };
        rbar_next = rbar;
    }
    if !causal {
        // Left to right: qbar.
        let mut qbar_prev = Cx::real(T::ZERO);
        for i in 0..n {
            let qbar = if i > 0 {
                let qinv = q[i].recip();
                pbar[i - 1] = pbar[i - 1] - (qbar_prev * qinv).re;
                dbar[i] + qbar_prev * qinv * qinv.scale(k.p(i - 1))
            } else {
                dbar[i]
            };
            sbar[i] = sbar[i] + qbar;
            qbar_prev = qbar;
        }
    }
    let mut sum = Cx::real(T::ZERO);
    for (d, sb) in dv.iter_mut().zip(&sbar) {
        *d = sb.re;
        sum = sum + *sb;
    }
    (sum, pbar)
}

/// An interval `[lo, hi]` holding the real spectrum of `H` (Gershgorin: the range of the
/// diagonal `-2 + v` widened by the largest off-diagonal magnitudes). A real `z` inside it
/// can hit an eigenvalue, where `H - zI` is singular.
pub fn spectrum_bound(v: &[f32], offdiag: Option<(&[f32], &[f32])>) -> (f64, f64) {
    let (lo, hi) = v
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
            (lo.min(x as f64), hi.max(x as f64))
        });
    let max_abs = |x: &[f32]| x.iter().fold(0.0f64, |m, &y| m.max((y as f64).abs()));
    let radius = offdiag.map_or(2.0, |(b, c)| max_abs(b) + max_abs(c));
    (-2.0 + lo - radius, -2.0 + hi + radius)
}

#[cfg(test)]
mod tests;
