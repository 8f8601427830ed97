//! CPU kernels: plain f32 Rust, parallel with rayon where the work splits cleanly.
//!
//! These are the fallback when no GPU is present and the reference every GPU kernel is tested
//! against, so each one favours a fixed reduction order (bit-reproducible results) over the
//! last few percent of speed. Each file holds one operation and a test against a naive version.

pub mod adamw;
pub mod add;
pub mod attention;
pub mod attention_masked;
pub mod attention_unfused;
pub mod bk_core;
pub mod cross_entropy;
pub mod diversity;
pub mod dropout;
pub mod embedding;
pub mod fastmath;
pub mod gelu;
pub mod gelu_erf;
pub mod gemm;
pub mod kv_cache;
pub mod layernorm;
pub mod nf4;
pub mod rmsnorm;
pub mod rope;
pub mod rows;
pub mod sampling;
pub mod swiglu;

#[cfg(test)]
pub(crate) mod testutil {
    use crate::engine::rng::{Rng, stream};

    /// Fresh random values in [-scale, scale); never zeros, so unwritten outputs show up.
    pub fn random(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut r = Rng::new(seed, stream::INIT);
        (0..n).map(|_| (r.next_f32() * 2.0 - 1.0) * scale).collect()
    }

    pub fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let err = (g - w).abs() / w.abs().max(1.0);
            assert!(err <= tol, "{what}[{i}]: got {g}, want {w} (error {err:e})");
        }
    }
}
