//! Inverted dropout with a mask that is a pure function of `(seed, element index)`: element
//! `i` is kept when the top 32 bits of a SplitMix64 hash of `seed + (i + 1) * golden` reach
//! the drop threshold, and kept values are scaled by `1 / (1 - p)`. The CUDA kernel computes
//! the same integers, so both devices drop the same elements, a recomputed forward and the
//! backward see the mask of the forward, and a resumed run draws the masks it would have.

/// SplitMix64's increment (the golden ratio in 64 bits).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The 32-bit threshold below which an element is dropped with probability `p` in [0, 1).
pub fn threshold(p: f32) -> u32 {
    ((p as f64) * 4_294_967_296.0).round().min(u32::MAX as f64) as u32
}

/// Whether element `i` survives under `seed` and `threshold`.
pub fn keeps(seed: u64, i: u64, threshold: u32) -> bool {
    let h = mix(seed.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN)));
    (h >> 32) as u32 >= threshold
}

/// `out[i] = x[i] / (1 - p)` where element `i` is kept, else 0.
pub fn dropout(out: &mut [f32], x: &[f32], p: f32, seed: u64) {
    let (t, scale) = (threshold(p), 1.0 / (1.0 - p));
    for (i, (o, &v)) in out.iter_mut().zip(x).enumerate() {
        *o = if keeps(seed, i as u64, t) {
            v * scale
        } else {
            0.0
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_about_p_and_keeps_the_mean() {
        let n = 200_000;
        let x = vec![1.0f32; n];
        for p in [0.05f32, 0.1, 0.5] {
            let mut out = vec![0.0; n];
            dropout(&mut out, &x, p, 42);
            let dropped = out.iter().filter(|&&v| v == 0.0).count() as f64 / n as f64;
            assert!(
                (dropped - p as f64).abs() < 0.005,
                "p {p}: dropped {dropped}"
            );
            let mean = out.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
            assert!((mean - 1.0).abs() < 0.01, "p {p}: mean {mean}");
        }
        // p = 0 keeps everything exactly; another seed draws another mask.
        let mut out = vec![0.0; 1000];
        dropout(&mut out, &x[..1000], 0.0, 7);
        assert!(out.iter().all(|&v| v == 1.0));
        let (mut a, mut b) = (vec![0.0; 1000], vec![0.0; 1000]);
        dropout(&mut a, &x[..1000], 0.5, 1);
        dropout(&mut b, &x[..1000], 0.5, 2);
        assert_ne!(a, b);
    }
}
