//! SwiGLU, the gated feed-forward activation of Llama-family models: `h = silu(gate) * up`.
//!
//! The gate and up projections run as one GEMM whose rows are `[gate: F | up: F]`, so the
//! activation reads both halves of a row and writes one row of `F`; the backward writes the
//! gradient of both halves.

use rayon::prelude::*;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `h[n, i] = silu(gu[n, i]) * gu[n, F + i]`.
pub fn swiglu_forward(h: &mut [f32], gate_up: &[f32], f: usize) {
    assert_eq!(
        h.len() * 2,
        gate_up.len(),
        "swiglu: gate_up is twice as wide as h"
    );
    h.par_chunks_mut(f)
        .zip(gate_up.par_chunks(2 * f))
        .for_each(|(h, gu)| {
            let (gate, up) = gu.split_at(f);
            for ((h, g), u) in h.iter_mut().zip(gate).zip(up) {
                *h = g * sigmoid(*g) * u;
            }
        });
}

/// `dgu = [dh * up * silu'(gate) | dh * silu(gate)]`, every element written.
pub fn swiglu_backward(dgate_up: &mut [f32], gate_up: &[f32], dh: &[f32], f: usize) {
    assert_eq!(
        dgate_up.len(),
        gate_up.len(),
        "swiglu_backward: gradient shape"
    );
    assert_eq!(dh.len() * 2, gate_up.len(), "swiglu_backward: dh shape");
    dgate_up
        .par_chunks_mut(2 * f)
        .zip(gate_up.par_chunks(2 * f))
        .zip(dh.par_chunks(f))
        .for_each(|((d, gu), dh)| {
            let (dgate, dup) = d.split_at_mut(f);
            let (gate, up) = gu.split_at(f);
            for i in 0..f {
                let s = sigmoid(gate[i]);
                let silu = gate[i] * s;
                dup[i] = dh[i] * silu;
                dgate[i] = dh[i] * up[i] * s * (1.0 + gate[i] * (1.0 - s));
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::random;

    #[test]
    fn backward_matches_finite_differences() {
        let (n, f) = (3, 5);
        let gu = random(n * 2 * f, 1, 3.0);
        let w = random(n * f, 2, 1.0);
        let loss = |gu: &[f32]| -> f64 {
            let mut h = vec![0.0; n * f];
            swiglu_forward(&mut h, gu, f);
            h.iter().zip(&w).map(|(a, b)| *a as f64 * *b as f64).sum()
        };
        let mut d = vec![f32::NAN; gu.len()];
        swiglu_backward(&mut d, &gu, &w, f);
        let eps = 1e-3f32;
        for i in 0..gu.len() {
            let (mut p, mut m) = (gu.clone(), gu.clone());
            p[i] += eps;
            m[i] -= eps;
            let fd = (loss(&p) - loss(&m)) / (2.0 * eps as f64);
            assert!(
                (d[i] as f64 - fd).abs() < 1e-3 * fd.abs().max(1.0),
                "[{i}] {} vs {fd}",
                d[i]
            );
        }
    }
}
