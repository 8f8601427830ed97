//! General matrix multiply and the linear-layer products built on it.
//!
//! Matrices are row-major. Weights are stored `[out, in]` (the PyTorch layout, so checkpoints
//! load there unchanged), which makes the forward product `x @ W^T`. The heavy lifting is
//! `matrixmultiply`, whose blocked kernels give every output element to one thread with a fixed
//! summation order: results do not depend on the thread count.

use crate::engine::{GemmShape, MatrixView};
use rayon::prelude::*;

/// `C = alpha * op(A) @ op(B) + beta * C` with `op(X) = X` or `X^T`; `op(A)` is `m x k`,
/// `op(B)` is `k x n`, `C` is `m x n`. `beta = 0` ignores C's old contents.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    trans_a: bool,
    trans_b: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    if !trans_a && trans_b && few_rows(m, n, k) {
        rows_dot_rows(m, n, k, alpha, (a, k), (b, k), beta, (c, n));
        return;
    }
    // Row/column strides of op(A) and op(B) as stored.
    let (rsa, csa) = if trans_a { (1, m) } else { (k, 1) };
    let (rsb, csb) = if trans_b { (1, k) } else { (n, 1) };
    // SAFETY: the asserts above guarantee every index the strides reach is in bounds, and
    // `c` does not alias `a` or `b` (distinct borrows).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
}

/// [`sgemm`] on matrices that lie inside larger buffers ([`MatrixView`]: the row stride and
/// first element of A, B and C as stored), for one product (`s.batch` is 1): how an adapter
/// reads and adds into its block of a fused projection's columns without copying it out.
pub fn sgemm_strided(
    s: GemmShape,
    [va, vb, vc]: [MatrixView; 3],
    alpha: f32,
    a: &[f32],
    b: &[f32],
    beta: f32,
    c: &mut [f32],
) {
    let GemmShape { m, n, k, .. } = s;
    assert_eq!(s.batch, 1, "sgemm_strided: one product");
    if m == 0 || n == 0 {
        return;
    }
    if let Err(e) = s.check_views([va, vb, vc], [a.len(), b.len(), c.len()]) {
        panic!("sgemm_strided: {e}");
    }
    if !s.trans_a && s.trans_b && few_rows(m, n, k) {
        rows_dot_rows(
            m,
            n,
            k,
            alpha,
            (&a[va.offset..], va.ld),
            (&b[vb.offset..], vb.ld),
            beta,
            (&mut c[vc.offset..], vc.ld),
        );
        return;
    }
    let (rsa, csa) = if s.trans_a { (1, va.ld) } else { (va.ld, 1) };
    let (rsb, csb) = if s.trans_b { (1, vb.ld) } else { (vb.ld, 1) };
    if k == 0 {
        // matrixmultiply reads no operand then; C still scales by beta.
        for r in 0..m {
            for x in &mut c[vc.offset + r * vc.ld..][..n] {
                *x = if beta == 0.0 { 0.0 } else { *x * beta };
            }
        }
        return;
    }
    // SAFETY: the view check above bounds every index the strides reach from each offset, and
    // `c` does not alias `a` or `b` (distinct borrows).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.as_ptr().add(va.offset),
            rsa as isize,
            csa as isize,
            b.as_ptr().add(vb.offset),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr().add(vc.offset),
            vc.ld as isize,
            1,
        );
    }
}

/// Rows of `A` up to which `A @ B^T` (both stored with `k` contiguous: activations against a
/// weight stored `[out, in]`) is formed as dot products read straight from B's rows.
/// `matrixmultiply` copies B into its panel layout on every call, which for a decode step's
/// one row was a copy of every weight a token: 58% of a CPU decode step's time.
const DOT_ROWS: usize = 8;
/// Columns of C a task of [`rows_dot_rows`] takes.
const DOT_COLS: usize = 32;

/// Whether [`rows_dot_rows`] takes an `m x n x k` product: few rows, and enough columns and
/// depth for the weight's read to be what counts.
fn few_rows(m: usize, n: usize, k: usize) -> bool {
    m > 0 && m <= DOT_ROWS && n >= DOT_COLS && k >= 16
}

/// `C = alpha * A @ B^T + beta * C` for `A` `m x k` and `B` `n x k`, each given as (slice from
/// its first element, row stride), with `m <= DOT_ROWS`: every element of C one dot product
/// in a fixed order ([`dot`]), the columns split over threads, so the result does not depend
/// on the thread count.
#[allow(clippy::too_many_arguments)]
fn rows_dot_rows(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    (a, lda): (&[f32], usize),
    (b, ldb): (&[f32], usize),
    beta: f32,
    (c, ldc): (&mut [f32], usize),
) {
    assert!(m <= DOT_ROWS && a.len() >= (m - 1) * lda + k && b.len() >= (n - 1) * ldb + k);
    assert!(c.len() >= (m - 1) * ldc + n);
    let dot = dot_kernel();
    // Column-major scratch, DOT_COLS columns a task: every task writes its own part.
    let mut t = vec![0f32; n * m];
    t.par_chunks_mut(DOT_COLS * m)
        .enumerate()
        .for_each(|(task, t)| {
            for (jj, t) in t.chunks_exact_mut(m).enumerate() {
                let j = task * DOT_COLS + jj;
                let w = &b[j * ldb..j * ldb + k];
                for (i, t) in t.iter_mut().enumerate() {
                    *t = dot(&a[i * lda..i * lda + k], w);
                }
            }
        });
    for i in 0..m {
        let row = &mut c[i * ldc..i * ldc + n];
        for (j, y) in row.iter_mut().enumerate() {
            let v = alpha * t[j * m + i];
            *y = if beta == 0.0 { v } else { v + beta * *y };
        }
    }
}

/// The dot product of two equal-length slices: sixteen partial sums over the chunks of sixteen,
/// added pairwise, then the tail in order. Written element by element, so every build (and
/// the wider vector units chosen at run time) adds in the same order and gets the same bits.
#[inline(always)]
fn dot_in_order(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut width = 16;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    let mut s = acc[0];
    for (x, y) in ta.iter().zip(tb) {
        s += x * y;
    }
    s
}

/// [`dot_in_order`] compiled for AVX2 (eight lanes a vector instead of SSE2's four).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_in_order(a, b)
}

/// The widest [`dot_in_order`] this CPU runs.
fn dot_kernel() -> fn(&[f32], &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return |a, b| unsafe { dot_avx2(a, b) };
    }
    dot_in_order
}

/// [`sgemm`] on each of `s.batch` matrix triples: `C_i = alpha * op(A_i) @ op(B_i) + beta * C_i`.
/// The products own disjoint parts of `c`, so they run in parallel.
pub fn sgemm_batched(s: GemmShape, alpha: f32, a: &[f32], b: &[f32], beta: f32, c: &mut [f32]) {
    let (sa, sb, sc) = (s.m * s.k, s.k * s.n, s.m * s.n);
    assert!(a.len() >= s.batch * sa && b.len() >= s.batch * sb && c.len() >= s.batch * sc);
    if sc == 0 {
        return;
    }
    c[..s.batch * sc]
        .par_chunks_mut(sc)
        .enumerate()
        .for_each(|(i, c)| {
            let (a, b) = (&a[i * sa..][..sa], &b[i * sb..][..sb]);
            sgemm(s.trans_a, s.trans_b, s.m, s.n, s.k, alpha, a, b, beta, c);
        });
}

/// `out[n, c_out] = inp[n, c_in] @ weight[c_out, c_in]^T + bias`.
pub fn linear_forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c_in: usize,
    c_out: usize,
) {
    sgemm(false, true, n, c_out, c_in, 1.0, inp, weight, 0.0, out);
    if let Some(bias) = bias {
        for row in out.chunks_mut(c_out) {
            row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
        }
    }
}

/// Backward of [`linear_forward`]: overwrites `dinp`, accumulates into `dweight` and `dbias`.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    c_in: usize,
    c_out: usize,
) {
    sgemm(false, false, n, c_in, c_out, 1.0, dout, weight, 0.0, dinp);
    sgemm(true, false, c_out, c_in, n, 1.0, dout, inp, 1.0, dweight);
    if let Some(dbias) = dbias {
        for row in dout.chunks(c_out) {
            dbias.iter_mut().zip(row).for_each(|(db, d)| *db += d);
        }
    }
}

/// `dinp = dout @ weight` alone: the backward of a linear layer whose weight is frozen (no
/// weight gradient, no bias gradient).
pub fn linear_backward_input(
    dinp: &mut [f32],
    dout: &[f32],
    weight: &[f32],
    n: usize,
    c_in: usize,
    c_out: usize,
) {
    sgemm(false, false, n, c_in, c_out, 1.0, dout, weight, 0.0, dinp);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::{assert_close, random};

    fn naive(ta: bool, tb: bool, m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
        let at = |i: usize, p: usize| if ta { a[p * m + i] } else { a[i * k + p] };
        let bt = |p: usize, j: usize| if tb { b[j * k + p] } else { b[p * n + j] };
        let mut c = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| at(i, p) as f64 * bt(p, j) as f64)
                    .sum::<f64>() as f32;
            }
        }
        c
    }

    #[test]
    fn all_transposes_match_naive() {
        let (m, n, k) = (37, 29, 53);
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let a = random(m * k, 1, 1.0);
            let b = random(k * n, 2, 1.0);
            let mut c = random(m * n, 3, 1.0);
            let c0 = c.clone();
            sgemm(ta, tb, m, n, k, 0.5, &a, &b, 2.0, &mut c);
            let want: Vec<f32> = naive(ta, tb, m, n, k, &a, &b)
                .iter()
                .zip(&c0)
                .map(|(p, c)| 0.5 * p + 2.0 * c)
                .collect();
            assert_close(&c, &want, 1e-5, &format!("sgemm ta={ta} tb={tb}"));
        }
    }

    /// Column blocks of wider matrices: the packed product of the blocks copied out, added
    /// into C's block, every other element of C untouched.
    #[test]
    fn strided_views_match_the_packed_product_of_their_blocks() {
        let (m, n, k) = (11, 7, 5);
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let (ar, ac) = if ta { (k, m) } else { (m, k) };
            let (br, bc) = if tb { (n, k) } else { (k, n) };
            let view = |cols: usize, offset: usize| MatrixView {
                ld: cols + offset + 3,
                offset,
            };
            let (va, vb, vc) = (view(ac, 2), view(bc, 1), view(n, 4));
            let a = random(ar * va.ld, 1, 1.0);
            let b = random(br * vb.ld, 2, 1.0);
            let mut c = random(m * vc.ld, 3, 1.0);
            let c0 = c.clone();
            let block = |x: &[f32], v: MatrixView, rows: usize, cols: usize| -> Vec<f32> {
                (0..rows)
                    .flat_map(|r| x[v.offset + r * v.ld..][..cols].to_vec())
                    .collect()
            };
            let s = GemmShape::single(ta, tb, m, n, k);
            sgemm_strided(s, [va, vb, vc], 0.5, &a, &b, 1.0, &mut c);
            let p = naive(
                ta,
                tb,
                m,
                n,
                k,
                &block(&a, va, ar, ac),
                &block(&b, vb, br, bc),
            );
            let mut want = c0.clone();
            for r in 0..m {
                for j in 0..n {
                    want[vc.offset + r * vc.ld + j] += 0.5 * p[r * n + j];
                }
            }
            assert_close(&c, &want, 1e-5, &format!("strided ta={ta} tb={tb}"));
        }
    }

    /// A few rows against a weight stored `[out, in]` (decode steps, short prefills) take the
    /// dot-product path: the same products as the naive ones, packed or inside wider
    /// buffers, with `beta = 0` ignoring C's old contents (NaN here) and C's other elements
    /// left as they were; nine rows take the blocked path again.
    #[test]
    fn few_rows_against_a_transposed_weight_match_naive() {
        for (m, n, k) in [
            (1, 70, 37),
            (3, 64, 64),
            (8, 33, 16),
            (9, 40, 20),
            (2, 31, 40),
        ] {
            assert_eq!(
                few_rows(m, n, k),
                m <= 8 && n >= 32 && k >= 16,
                "{m}x{n}x{k}"
            );
            let a = random(m * k, 11, 1.0);
            let b = random(n * k, 12, 1.0);
            let p = naive(false, true, m, n, k, &a, &b);
            let mut c = vec![f32::NAN; m * n];
            sgemm(false, true, m, n, k, 0.5, &a, &b, 0.0, &mut c);
            let want: Vec<f32> = p.iter().map(|p| 0.5 * p).collect();
            assert_close(&c, &want, 1e-5, &format!("few rows {m}x{n}x{k}, beta 0"));

            let view = |cols: usize, offset: usize| MatrixView {
                ld: cols + offset + 3,
                offset,
            };
            let (va, vb, vc) = (view(k, 2), view(k, 1), view(n, 4));
            let mut wide_a = random(m * va.ld, 13, 1.0);
            let mut wide_b = random(n * vb.ld, 14, 1.0);
            for r in 0..m {
                wide_a[va.offset + r * va.ld..][..k].copy_from_slice(&a[r * k..][..k]);
            }
            for r in 0..n {
                wide_b[vb.offset + r * vb.ld..][..k].copy_from_slice(&b[r * k..][..k]);
            }
            let mut c = random(m * vc.ld, 15, 1.0);
            let c0 = c.clone();
            let s = GemmShape::single(false, true, m, n, k);
            sgemm_strided(s, [va, vb, vc], 0.5, &wide_a, &wide_b, 2.0, &mut c);
            let mut want = c0.clone();
            for r in 0..m {
                for j in 0..n {
                    let at = vc.offset + r * vc.ld + j;
                    want[at] = 0.5 * p[r * n + j] + 2.0 * c0[at];
                }
            }
            assert_close(&c, &want, 1e-5, &format!("few rows {m}x{n}x{k}, strided"));
        }
    }

    #[test]
    fn batched_matches_a_loop_of_naive_products() {
        for (ta, tb, batch, m, n, k) in [
            (false, true, 5, 13, 13, 8),
            (false, false, 3, 17, 6, 33),
            (true, false, 4, 9, 7, 11),
            (true, true, 2, 5, 19, 3),
        ] {
            let s = GemmShape {
                trans_a: ta,
                trans_b: tb,
                batch,
                m,
                n,
                k,
            };
            let a = random(batch * m * k, 7, 1.0);
            let b = random(batch * k * n, 8, 1.0);
            let mut c = random(batch * m * n, 9, 1.0);
            let c0 = c.clone();
            sgemm_batched(s, 0.25, &a, &b, -1.0, &mut c);
            let mut want = Vec::new();
            for i in 0..batch {
                let p = naive(ta, tb, m, n, k, &a[i * m * k..], &b[i * k * n..]);
                want.extend(p.iter().zip(&c0[i * m * n..]).map(|(p, c)| 0.25 * p - c));
            }
            assert_close(&c, &want, 1e-5, &format!("batched {s:?}"));
        }
    }

    #[test]
    fn linear_backward_matches_naive_products() {
        let (n, ci, co) = (11, 7, 5);
        let inp = random(n * ci, 4, 1.0);
        let w = random(co * ci, 5, 1.0);
        let bias = random(co, 6, 1.0);
        let mut out = vec![9.0; n * co];
        linear_forward(&mut out, &inp, &w, Some(&bias), n, ci, co);
        let mut want = naive(false, true, n, co, ci, &inp, &w);
        for (i, v) in want.iter_mut().enumerate() {
            *v += bias[i % co];
        }
        assert_close(&out, &want, 1e-5, "linear forward");

        let dout = random(n * co, 7, 1.0);
        let mut dinp = vec![9.0; n * ci];
        let mut dw = vec![1.0; co * ci];
        let mut db = vec![1.0; co];
        linear_backward(
            &mut dinp,
            &mut dw,
            Some(&mut db),
            &dout,
            &inp,
            &w,
            n,
            ci,
            co,
        );
        assert_close(
            &dinp,
            &naive(false, false, n, ci, co, &dout, &w),
            1e-5,
            "dinp",
        );
        let dw_want: Vec<f32> = naive(true, false, co, ci, n, &dout, &inp)
            .iter()
            .map(|v| v + 1.0)
            .collect();
        assert_close(&dw, &dw_want, 1e-5, "dweight accumulates");
        let db_want: Vec<f32> = (0..co)
            .map(|j| 1.0 + (0..n).map(|i| dout[i * co + j]).sum::<f32>())
            .collect();
        assert_close(&db, &db_want, 1e-5, "dbias accumulates");
    }
}
