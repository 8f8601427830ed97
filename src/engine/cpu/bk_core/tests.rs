//! BK-Core against independent references: a dense complex inverse and a tridiagonal solve
//! with partial pivoting (LAPACK's gttrf/gttrs scheme, whose pivots are not the ratio
//! recurrence's), finite differences, the dense `-G_ij G_ji` contraction, and the determinant
//! recurrence that the ratio form replaces.

use super::*;
use crate::engine::rng::{Rng, stream};

type C = Cx<f64>;

fn c(re: f64, im: f64) -> C {
    Cx::new(re, im)
}

fn abs(x: C) -> f64 {
    x.re.hypot(x.im)
}

fn div(a: C, b: C) -> C {
    a * b.recip()
}

/// A random problem: potential in [-scale, scale), off-diagonals in [0.5, 1.5) (or mixed
/// signs), both non-uniform.
#[derive(Clone)]
struct Problem {
    v: Vec<f64>,
    b: Vec<f64>,
    c: Vec<f64>,
    z: C,
}

impl Problem {
    fn random(n: usize, seed: u64, scale: f64, mixed_signs: bool) -> Problem {
        let mut r = Rng::new(seed, stream::INIT);
        let mut u = |lo: f64, hi: f64| lo + (hi - lo) * r.next_f64();
        let v = (0..n).map(|_| u(-scale, scale)).collect();
        let mut off = |sign_flip: bool| -> Vec<f64> {
            (0..n.saturating_sub(1))
                .map(|i| {
                    let x = u(0.5, 1.5);
                    if sign_flip && i % 3 == 1 { -x } else { x }
                })
                .collect()
        };
        Problem {
            v,
            b: off(false),
            c: off(mixed_signs),
            z: c(0.3, 0.8),
        }
    }

    fn coeffs(&self) -> BkCoeffs<'_, f64> {
        BkCoeffs {
            z: self.z,
            offdiag: Some((&self.b, &self.c)),
        }
    }

    /// Diagonal of `H - zI` (of a leading block, when `v` is shorter).
    fn diag(&self, len: usize) -> Vec<C> {
        (0..len)
            .map(|i| c(-2.0 + self.v[i], 0.0) - self.z)
            .collect()
    }

    fn dense(&self, len: usize) -> Vec<Vec<C>> {
        let mut m = vec![vec![c(0.0, 0.0); len]; len];
        for (i, d) in self.diag(len).into_iter().enumerate() {
            m[i][i] = d;
            if i + 1 < len {
                m[i][i + 1] = c(self.b[i], 0.0);
                m[i + 1][i] = c(self.c[i], 0.0);
            }
        }
        m
    }

    fn run(&self, causal: bool) -> Vec<C> {
        let n = self.v.len();
        let mut out = vec![f64::NAN; 2 * n];
        let s = BkShape {
            batch: 1,
            n,
            causal,
        };
        forward(&mut out, &self.v, self.coeffs(), s);
        out.chunks(2).map(|g| c(g[0], g[1])).collect()
    }
}

/// Gauss-Jordan inverse with partial pivoting.
fn dense_inverse(mut a: Vec<Vec<C>>) -> Vec<Vec<C>> {
    let n = a.len();
    let mut inv: Vec<Vec<C>> = (0..n)
        .map(|i| {
            (0..n)
                .map(|j| c(if i == j { 1.0 } else { 0.0 }, 0.0))
                .collect()
        })
        .collect();
    for col in 0..n {
        let piv = (col..n)
            .max_by(|&x, &y| abs(a[x][col]).total_cmp(&abs(a[y][col])))
            .unwrap();
        a.swap(col, piv);
        inv.swap(col, piv);
        let d = a[col][col].recip();
        for j in 0..n {
            a[col][j] = a[col][j] * d;
            inv[col][j] = inv[col][j] * d;
        }
        for row in 0..n {
            if row != col {
                let f = a[row][col];
                for j in 0..n {
                    a[row][j] = a[row][j] - f * a[col][j];
                    inv[row][j] = inv[row][j] - f * inv[col][j];
                }
            }
        }
    }
    inv
}

/// LU of a tridiagonal matrix with partial pivoting (fill-in on a second super-diagonal).
struct PivotedTri {
    dl: Vec<C>,
    d: Vec<C>,
    du: Vec<C>,
    du2: Vec<C>,
    swapped: Vec<bool>,
}

impl PivotedTri {
    fn factor(mut d: Vec<C>, mut dl: Vec<C>, mut du: Vec<C>) -> PivotedTri {
        let n = d.len();
        let mut du2 = vec![c(0.0, 0.0); n.saturating_sub(2)];
        let mut swapped = vec![false; n.saturating_sub(1)];
        for i in 0..n.saturating_sub(1) {
            if abs(d[i]) >= abs(dl[i]) {
                let f = div(dl[i], d[i]);
                dl[i] = f;
                d[i + 1] = d[i + 1] - f * du[i];
            } else {
                let f = div(d[i], dl[i]);
                d[i] = dl[i];
                dl[i] = f;
                let t = du[i];
                du[i] = d[i + 1];
                d[i + 1] = t - f * d[i + 1];
                if i + 2 < n {
                    du2[i] = du[i + 1];
                    du[i + 1] = -(f * du[i + 1]);
                }
                swapped[i] = true;
            }
        }
        PivotedTri {
            dl,
            d,
            du,
            du2,
            swapped,
        }
    }

    fn solve(&self, x: &mut [C]) {
        let n = x.len();
        for i in 0..n - 1 {
            if self.swapped[i] {
                x.swap(i, i + 1);
            }
            x[i + 1] = x[i + 1] - self.dl[i] * x[i];
        }
        for i in (0..n).rev() {
            let mut t = x[i];
            if i + 1 < n {
                t = t - self.du[i] * x[i + 1];
            }
            if i + 2 < n {
                t = t - self.du2[i] * x[i + 2];
            }
            x[i] = div(t, self.d[i]);
        }
    }
}

/// `G_ii` of the leading `len x len` block, by a pivoted solve against `e_i`.
fn pivoted_diag(p: &Problem, len: usize, only: Option<usize>) -> Vec<C> {
    let lu = PivotedTri::factor(
        p.diag(len),
        p.c[..len - 1].iter().map(|&x| c(x, 0.0)).collect(),
        p.b[..len - 1].iter().map(|&x| c(x, 0.0)).collect(),
    );
    let rows: Vec<usize> = only.map_or((0..len).collect(), |i| vec![i]);
    rows.into_iter()
        .map(|i| {
            let mut x = vec![c(0.0, 0.0); len];
            x[i] = c(1.0, 0.0);
            lu.solve(&mut x);
            x[i]
        })
        .collect()
}

/// The reference diagonal: full `G_ii`, or per position the leading block's last entry.
fn reference(p: &Problem, causal: bool) -> Vec<C> {
    let n = p.v.len();
    if causal {
        (0..n).map(|i| pivoted_diag(p, i + 1, Some(i))[0]).collect()
    } else {
        pivoted_diag(p, n, None)
    }
}

/// `max |got - want| / max |want|`.
fn rel_err(got: &[C], want: &[C]) -> f64 {
    let scale = want.iter().fold(0.0f64, |m, &w| m.max(abs(w)));
    got.iter()
        .zip(want)
        .fold(0.0f64, |m, (&g, &w)| m.max(abs(g - w) / scale))
}

#[test]
fn forward_matches_dense_inverse_with_general_offdiagonals() {
    for (n, mixed) in [(1, false), (2, false), (3, true), (17, false), (64, true)] {
        let p = Problem::random(n, 10 + n as u64, 3.0, mixed);
        let g = dense_inverse(p.dense(n));
        let want: Vec<C> = (0..n).map(|i| g[i][i]).collect();
        let err = rel_err(&p.run(false), &want);
        assert!(err < 1e-12, "full, n = {n}: error {err:e}");
        // Causal: the last diagonal entry of each leading block's inverse.
        let want: Vec<C> = (1..=n)
            .map(|k| dense_inverse(p.dense(k))[k - 1][k - 1])
            .collect();
        let err = rel_err(&p.run(true), &want);
        assert!(err < 1e-12, "causal, n = {n}: error {err:e}");
    }
}

#[test]
fn forward_matches_pivoted_solve_at_n_4096_in_f64_and_f32() {
    let n = 4096;
    for causal in [false, true] {
        let p = Problem::random(n, 7, 2.0, false);
        let want = reference(&p, causal);
        let err = rel_err(&p.run(causal), &want);
        assert!(err <= 1e-10, "f64 causal={causal}: error {err:e}");

        let v32: Vec<f32> = p.v.iter().map(|&x| x as f32).collect();
        let b32: Vec<f32> = p.b.iter().map(|&x| x as f32).collect();
        let c32: Vec<f32> = p.c.iter().map(|&x| x as f32).collect();
        let mut out = vec![f32::NAN; 2 * n];
        let k = BkCoeffs {
            z: Cx::new(p.z.re as f32, p.z.im as f32),
            offdiag: Some((&b32[..], &c32[..])),
        };
        forward(
            &mut out,
            &v32,
            k,
            BkShape {
                batch: 1,
                n,
                causal,
            },
        );
        let got: Vec<C> = out.chunks(2).map(|g| c(g[0] as f64, g[1] as f64)).collect();
        let err = rel_err(&got, &want);
        assert!(err <= 1e-4, "f32 causal={causal}: error {err:e}");
    }
}

/// The determinant (three-term) recurrence: `theta_i = s_i theta_{i-1} - p_{i-1} theta_{i-2}`,
/// `phi` likewise from the right, `G_ii = theta_{i-1} phi_{i+1} / theta_{N-1}`.
fn determinant_diag(p: &Problem) -> Vec<C> {
    let n = p.v.len();
    let s = p.diag(n);
    let pp = |i: usize| c(p.b[i] * p.c[i], 0.0);
    let mut theta = vec![c(1.0, 0.0); n + 1]; // theta[k] = det of the leading k x k block
    theta[1] = s[0];
    for k in 2..=n {
        theta[k] = s[k - 1] * theta[k - 1] - pp(k - 2) * theta[k - 2];
    }
    let mut phi = vec![c(1.0, 0.0); n + 2]; // phi[k] = det of the trailing block from k
    phi[n - 1] = s[n - 1];
    for k in (0..n - 1).rev() {
        phi[k] = s[k] * phi[k + 1] - pp(k) * phi[k + 2];
    }
    (0..n)
        .map(|i| div(theta[i] * phi[i + 1], theta[n]))
        .collect()
}

#[test]
fn huge_potential_stays_finite_where_the_determinant_recurrence_fails() {
    let n = 4096;
    let p = Problem::random(n, 3, 1e3, false);
    let want = reference(&p, false);
    let got = p.run(false);
    assert!(got.iter().all(|g| g.is_finite()));
    let err = rel_err(&got, &want);
    assert!(err <= 1e-10, "ratio form: error {err:e}");
    // The determinants overflow f64 long before N = 4096 at |s| ~ 1e3.
    let det = determinant_diag(&p);
    let broken = det
        .iter()
        .filter(|g| !g.is_finite() || abs(**g) == 0.0)
        .count();
    assert!(
        broken > n / 2,
        "determinant form: only {broken} of {n} entries broke"
    );
    // At a small size both agree, so the comparison above is about overflow, not a bug.
    let small = Problem::random(40, 3, 1.0, false);
    assert!(rel_err(&determinant_diag(&small), &reference(&small, false)) < 1e-10);
}

#[test]
fn a_zero_pivot_gives_nan_not_zero() {
    // N = 1, v = 2: a = 0, and z = 0 makes H - zI exactly singular.
    let mut out = [0.0f64; 2];
    let k = BkCoeffs {
        z: Cx::new(0.0, 0.0),
        offdiag: None,
    };
    forward(
        &mut out,
        &[2.0],
        k,
        BkShape {
            batch: 1,
            n: 1,
            causal: false,
        },
    );
    assert!(out.iter().all(|x| x.is_nan()), "{out:?}");
}

#[test]
fn n_equal_one_is_one_over_s() {
    let v = [0.7f64, -1.5];
    let mut out = [f64::NAN; 4];
    let k = BkCoeffs {
        z: Cx::new(0.25, 1.0),
        offdiag: None,
    };
    forward(
        &mut out,
        &v,
        k,
        BkShape {
            batch: 2,
            n: 1,
            causal: false,
        },
    );
    for (i, &x) in v.iter().enumerate() {
        let want = c(-2.0 + x - 0.25, -1.0).recip();
        assert!(abs(c(out[2 * i], out[2 * i + 1]) - want) < 1e-15);
    }
}

/// `L = sum_i gr_i Re G_i + gi_i Im G_i` over a batch of one.
fn loss(p: &Problem, causal: bool, w: &[f64]) -> f64 {
    p.run(causal)
        .iter()
        .enumerate()
        .map(|(i, g)| w[2 * i] * g.re + w[2 * i + 1] * g.im)
        .sum()
}

fn grads(p: &Problem, causal: bool, w: &[f64]) -> (Vec<f64>, BkCoeffGrads<f64>) {
    let n = p.v.len();
    let mut dv = vec![f64::NAN; n];
    let s = BkShape {
        batch: 1,
        n,
        causal,
    };
    let g = backward(&mut dv, w, &p.v, p.coeffs(), s);
    (dv, g)
}

fn weights(n: usize, seed: u64) -> Vec<f64> {
    let mut r = Rng::new(seed, stream::INIT);
    (0..2 * n).map(|_| r.next_f64() * 2.0 - 1.0).collect()
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    for (n, causal, mixed) in [
        (1, false, false),
        (1, true, false),
        (2, false, true),
        (9, false, true),
        (9, true, false),
        (30, false, false),
    ] {
        let p = Problem::random(n, 100 + n as u64, 2.0, mixed);
        let w = weights(n, 5 + n as u64);
        let (dv, g) = grads(&p, causal, &w);
        let h = 1e-6;
        let fd = |perturb: &dyn Fn(&mut Problem, f64)| {
            let (mut a, mut b) = (p.clone(), p.clone());
            perturb(&mut a, h);
            perturb(&mut b, -h);
            (loss(&a, causal, &w) - loss(&b, causal, &w)) / (2.0 * h)
        };
        let close = |what: &str, i: usize, got: f64, want: f64| {
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{what}[{i}] n={n} causal={causal}: {got} vs finite difference {want}"
            );
        };
        for (i, &d) in dv.iter().enumerate() {
            close("dv", i, d, fd(&|q: &mut Problem, e| q.v[i] += e));
        }
        close("dz.re", 0, g.dz.0, fd(&|q: &mut Problem, e| q.z.re += e));
        close("dz.im", 0, g.dz.1, fd(&|q: &mut Problem, e| q.z.im += e));
        assert_eq!(g.dp.len(), n - 1);
        for i in 0..n - 1 {
            // dL/db_i = dp_i c_i and dL/dc_i = dp_i b_i.
            close(
                "db",
                i,
                g.dp[i] * p.c[i],
                fd(&|q: &mut Problem, e| q.b[i] += e),
            );
            close(
                "dc",
                i,
                g.dp[i] * p.b[i],
                fd(&|q: &mut Problem, e| q.c[i] += e),
            );
        }
    }
}

#[test]
fn gradient_equals_the_dense_green_function_contraction() {
    // dG_ii/dv_j = -G_ij G_ji, so dL/dv_j = Re sum_i gbar_i (-G_ij G_ji), gbar = gr - i gi.
    let n = 48;
    for causal in [false, true] {
        let p = Problem::random(n, 77, 2.0, true);
        let w = weights(n, 9);
        let (dv, _) = grads(&p, causal, &w);
        let mut want = vec![0.0; n];
        let blocks: Vec<(usize, Vec<Vec<C>>)> = if causal {
            (0..n).map(|i| (i, dense_inverse(p.dense(i + 1)))).collect()
        } else {
            let g = dense_inverse(p.dense(n));
            (0..n).map(|i| (i, g.clone())).collect()
        };
        for (i, g) in &blocks {
            let gbar = c(w[2 * i], -w[2 * i + 1]);
            for (j, wj) in want.iter_mut().enumerate().take(g.len()) {
                *wj += (-(gbar * g[*i][j] * g[j][*i])).re;
            }
        }
        for j in 0..n {
            assert!(
                (dv[j] - want[j]).abs() <= 1e-10 * want[j].abs().max(1.0),
                "causal={causal} dv[{j}]: {} vs contraction {}",
                dv[j],
                want[j]
            );
        }
    }
}

#[test]
fn batch_gradients_sum_over_sequences_in_order() {
    let (n, batch) = (6, 3);
    let ps: Vec<Problem> = (0..batch)
        .map(|k| Problem::random(n, 40 + k as u64, 1.0, false))
        .collect();
    // One shared set of coefficients: take them from the first problem.
    let shared = |mut q: Problem| {
        q.b = ps[0].b.clone();
        q.c = ps[0].c.clone();
        q
    };
    let ps: Vec<Problem> = ps.iter().cloned().map(shared).collect();
    let w = weights(n * batch, 3);
    let v: Vec<f64> = ps.iter().flat_map(|q| q.v.clone()).collect();
    let mut dv = vec![f64::NAN; n * batch];
    let s = BkShape {
        batch,
        n,
        causal: false,
    };
    let g = backward(&mut dv, &w, &v, ps[0].coeffs(), s);
    let mut dp = vec![0.0; n - 1];
    let mut dz = (0.0, 0.0);
    for (k, q) in ps.iter().enumerate() {
        let (dvk, gk) = grads(q, false, &w[2 * n * k..2 * n * (k + 1)]);
        assert_eq!(&dv[n * k..n * (k + 1)], &dvk[..]);
        dz = (dz.0 + gk.dz.0, dz.1 + gk.dz.1);
        dp.iter_mut().zip(&gk.dp).for_each(|(a, b)| *a += b);
    }
    assert!((g.dz.0 - dz.0).abs() < 1e-12 && (g.dz.1 - dz.1).abs() < 1e-12);
    for (a, b) in g.dp.iter().zip(&dp) {
        assert!((a - b).abs() < 1e-12);
    }
}

#[test]
fn spectrum_bound_covers_the_eigenvalues() {
    // The Laplacian alone has eigenvalues in (-4, 0).
    let (lo, hi) = spectrum_bound(&[0.0; 16], None);
    assert!(lo <= -4.0 && hi >= 0.0);
    let (lo, hi) = spectrum_bound(&[5.0, -1.0], Some((&[3.0], &[-0.5])));
    assert_eq!((lo, hi), (-3.0 - 3.5, 3.0 + 3.5));
}
