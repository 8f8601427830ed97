//! Rotary position embeddings applied to a grouped-query QKV projection, expanding the
//! key/value heads to one per query head on the way.
//!
//! The projection gives each token `[q: H x D | k: K x D | v: K x D]` with `K` key/value heads
//! shared by `H / K` query heads each. Attention kernels take one key and value head per query
//! head, packed `[q | k | v]` of `H x D` each, so one pass reads the projection once, rotates
//! the queries and keys and writes the packed tensor, and the backward reverses it (rotating
//! back and summing the gradients of the query heads that shared a key/value head).
//!
//! The rotation follows Hugging Face's `rotate_half` convention, the layout of every Llama,
//! Qwen and Mistral checkpoint: within the first `rot` dimensions of a head, dimension `i`
//! pairs with `i + rot/2` and the pair turns by `pos * inv_freq[i]`. Dimensions past `rot`
//! (partial rotary) pass through.

use rayon::prelude::*;

/// Shape of one rotary call. `rows` tokens, each with its own position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    pub rows: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Dimensions of each head that rotate (even, at most `head_dim`).
    pub rot_dim: usize,
}

impl RopeShape {
    /// Width of a projected row: `(H + 2K) x D`.
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// Width of a packed attention row: `3 x H x D`.
    pub fn packed_width(&self) -> usize {
        3 * self.heads * self.head_dim
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// How a model stretches its rotary frequencies for long contexts.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_context: usize,
}

/// The rotation angle of dimension pair `i` per position step: `theta^(-2i/rot)`, with
/// Llama 3's frequency scaling when given. Computed in f32 as the reference implementation
/// does, so the angles agree bit for bit with it wherever the math library does.
pub fn inverse_frequencies(theta: f32, rot_dim: usize, scaling: Option<Llama3Scaling>) -> Vec<f32> {
    (0..rot_dim / 2)
        .map(|i| {
            let f = 1.0 / theta.powf((2 * i) as f32 / rot_dim as f32);
            match scaling {
                None => f,
                Some(s) => {
                    let old = s.original_context as f32;
                    let (low_wavelen, high_wavelen) =
                        (old / s.low_freq_factor, old / s.high_freq_factor);
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / s.factor
                    } else {
                        let smooth = (old / wavelen - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        (1.0 - smooth) * f / s.factor + smooth * f
                    }
                }
            }
        })
        .collect()
}

/// Most dimension pairs a head's per-pair rotary factors cover (head size 256).
pub const MAX_ROPE_PAIRS: usize = 128;

/// Per-pair divisors of the rotary frequencies (LongRoPE's short or long factors, Phi-3):
/// pair `i` turns by `pos / (factor[i] * theta^(2i/rot))`. A fixed array, so that a model's
/// shape stays `Copy`; serialised as the list of its values.
#[derive(Clone, Copy, PartialEq)]
pub struct PairFactors {
    len: usize,
    values: [f32; MAX_ROPE_PAIRS],
}

impl PairFactors {
    /// The factors `values`, or `None` past [`MAX_ROPE_PAIRS`] of them.
    pub fn new(values: &[f32]) -> Option<PairFactors> {
        if values.len() > MAX_ROPE_PAIRS {
            return None;
        }
        let mut v = [0.0; MAX_ROPE_PAIRS];
        v[..values.len()].copy_from_slice(values);
        Some(PairFactors {
            len: values.len(),
            values: v,
        })
    }

    pub fn as_slice(&self) -> &[f32] {
        &self.values[..self.len]
    }
}

impl std::fmt::Debug for PairFactors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl serde::Serialize for PairFactors {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.as_slice())
    }
}

impl<'de> serde::Deserialize<'de> for PairFactors {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Vec::<f32>::deserialize(d)?;
        PairFactors::new(&v).ok_or_else(|| {
            serde::de::Error::custom(format!("{} rotary factors, past {MAX_ROPE_PAIRS}", v.len()))
        })
    }
}

/// The inverse frequencies with LongRoPE's per-pair divisors: `1 / (factor[i] *
/// theta^(2i/rot))`, in f32 in the order transformers computes them.
pub fn factored_inverse_frequencies(theta: f32, rot_dim: usize, factors: &[f32]) -> Vec<f32> {
    assert_eq!(factors.len(), rot_dim / 2, "rope: one factor per pair");
    factors
        .iter()
        .enumerate()
        .map(|(i, f)| 1.0 / (f * theta.powf((2 * i) as f32 / rot_dim as f32)))
        .collect()
}

/// `cos` and `sin` tables `[positions, rot/2]` for the inverse frequencies `inv_freq`.
pub fn rope_tables(inv_freq: &[f32], positions: usize) -> (Vec<f32>, Vec<f32>) {
    let mut cos = Vec::with_capacity(positions * inv_freq.len());
    let mut sin = Vec::with_capacity(positions * inv_freq.len());
    for p in 0..positions {
        for f in inv_freq {
            let angle = p as f32 * f;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    (cos, sin)
}

/// Rotates one head `x[D]` into `y[D]` by the angles of `cos`/`sin` (`rot/2` each);
/// `sign` -1 rotates back (the transpose, for the backward).
pub(crate) fn rotate(y: &mut [f32], x: &[f32], cos: &[f32], sin: &[f32], sign: f32) {
    let half = cos.len();
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        let (c, s) = (cos[i], sign * sin[i]);
        y[i] = a * c - b * s;
        y[i + half] = b * c + a * s;
    }
    y[2 * half..].copy_from_slice(&x[2 * half..]);
}

fn check(s: RopeShape, qkv: usize, packed: usize, pos: &[u32], cos: &[f32], sin: &[f32]) {
    assert_eq!(qkv, s.rows * s.qkv_width(), "rope: projection length");
    assert_eq!(packed, s.rows * s.packed_width(), "rope: packed length");
    assert_eq!(pos.len(), s.rows, "rope: one position per row");
    assert_eq!(cos.len(), sin.len(), "rope: table lengths");
    let half = s.rot_dim / 2;
    let max = pos.iter().copied().max().unwrap_or(0) as usize;
    assert!(
        (max + 1) * half <= cos.len(),
        "rope: position {max} past the table"
    );
}

/// `packed[row] = [rot(q) | rot(k) repeated per group | v repeated per group]`.
pub fn rope_expand_forward(
    packed: &mut [f32],
    qkv: &[f32],
    pos: &[u32],
    cos: &[f32],
    sin: &[f32],
    s: RopeShape,
) {
    check(s, qkv.len(), packed.len(), pos, cos, sin);
    let (d, h, k, g, half) = (s.head_dim, s.heads, s.kv_heads, s.group(), s.rot_dim / 2);
    packed
        .par_chunks_mut(s.packed_width())
        .zip(qkv.par_chunks(s.qkv_width()))
        .zip(pos.par_iter())
        .for_each(|((out, row), &p)| {
            let (c, sn) = (
                &cos[p as usize * half..][..half],
                &sin[p as usize * half..][..half],
            );
            for hq in 0..h {
                rotate(&mut out[hq * d..][..d], &row[hq * d..][..d], c, sn, 1.0);
            }
            for j in 0..k {
                let key = &row[(h + j) * d..][..d];
                let value = &row[(h + k + j) * d..][..d];
                for r in 0..g {
                    let hq = j * g + r;
                    rotate(&mut out[(h + hq) * d..][..d], key, c, sn, 1.0);
                    out[(2 * h + hq) * d..][..d].copy_from_slice(value);
                }
            }
        });
}

/// The backward of [`rope_expand_forward`]: writes every element of `dqkv` from `dpacked`.
/// Each key/value head's gradient sums its group's query-head gradients in head order.
pub fn rope_expand_backward(
    dqkv: &mut [f32],
    dpacked: &[f32],
    pos: &[u32],
    cos: &[f32],
    sin: &[f32],
    s: RopeShape,
) {
    check(s, dqkv.len(), dpacked.len(), pos, cos, sin);
    let (d, h, k, g, half) = (s.head_dim, s.heads, s.kv_heads, s.group(), s.rot_dim / 2);
    dqkv.par_chunks_mut(s.qkv_width())
        .zip(dpacked.par_chunks(s.packed_width()))
        .zip(pos.par_iter())
        .for_each(|((out, row), &p)| {
            let (c, sn) = (
                &cos[p as usize * half..][..half],
                &sin[p as usize * half..][..half],
            );
            for hq in 0..h {
                rotate(&mut out[hq * d..][..d], &row[hq * d..][..d], c, sn, -1.0);
            }
            let mut summed = vec![0.0f32; d];
            for j in 0..k {
                for (which, src0) in [(h + j, h), (h + k + j, 2 * h)] {
                    summed.fill(0.0);
                    for r in 0..g {
                        let src = &row[(src0 + j * g + r) * d..][..d];
                        summed.iter_mut().zip(src).for_each(|(a, b)| *a += b);
                    }
                    let dst = &mut out[which * d..][..d];
                    if which < h + k {
                        rotate(dst, &summed, c, sn, -1.0);
                    } else {
                        dst.copy_from_slice(&summed);
                    }
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::{assert_close, random};

    fn shape() -> RopeShape {
        RopeShape {
            rows: 6,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            rot_dim: 6,
        }
    }

    /// The rotation against a direct complex-number reading of `rotate_half`, partial rotary
    /// dimensions passing through, and the key/value heads repeated per group.
    #[test]
    fn forward_rotates_pairs_and_repeats_kv_heads() {
        let s = shape();
        let inv = inverse_frequencies(10000.0, s.rot_dim, None);
        let (cos, sin) = rope_tables(&inv, 16);
        let qkv = random(s.rows * s.qkv_width(), 1, 1.0);
        let pos: Vec<u32> = vec![0, 3, 7, 1, 15, 2];
        let mut out = vec![f32::NAN; s.rows * s.packed_width()];
        rope_expand_forward(&mut out, &qkv, &pos, &cos, &sin, s);
        let (d, h) = (s.head_dim, s.heads);
        for (n, &p) in pos.iter().enumerate() {
            let row = &qkv[n * s.qkv_width()..][..s.qkv_width()];
            let got = &out[n * s.packed_width()..][..s.packed_width()];
            let want_head = |src: &[f32]| {
                let mut w = src.to_vec();
                for i in 0..3 {
                    let a = p as f64 * inv[i] as f64;
                    let (x, y) = (src[i] as f64, src[i + 3] as f64);
                    w[i] = (x * a.cos() - y * a.sin()) as f32;
                    w[i + 3] = (y * a.cos() + x * a.sin()) as f32;
                }
                w
            };
            for hq in 0..h {
                assert_close(
                    &got[hq * d..][..d],
                    &want_head(&row[hq * d..][..d]),
                    1e-5,
                    "q",
                );
                let j = hq / 2;
                let key = &row[(h + j) * d..][..d];
                assert_close(&got[(h + hq) * d..][..d], &want_head(key), 1e-5, "k");
                let value = &row[(h + 2 + j) * d..][..d];
                assert_eq!(&got[(2 * h + hq) * d..][..d], value, "v");
            }
        }
    }

    /// `<backward(dy), x> == <dy, forward(x)>`: the backward is the forward's transpose.
    #[test]
    fn backward_is_the_transpose_of_forward() {
        let s = shape();
        let scaling = Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8,
        };
        let (cos, sin) = rope_tables(&inverse_frequencies(500.0, s.rot_dim, Some(scaling)), 16);
        let pos: Vec<u32> = vec![5, 0, 9, 9, 2, 14];
        let x = random(s.rows * s.qkv_width(), 2, 1.0);
        let dy = random(s.rows * s.packed_width(), 3, 1.0);
        let mut y = vec![0.0; dy.len()];
        rope_expand_forward(&mut y, &x, &pos, &cos, &sin, s);
        let mut dx = vec![f32::NAN; x.len()];
        rope_expand_backward(&mut dx, &dy, &pos, &cos, &sin, s);
        let lhs: f64 = dx.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
        let rhs: f64 = dy.iter().zip(&y).map(|(a, b)| *a as f64 * *b as f64).sum();
        assert!(
            (lhs - rhs).abs() < 1e-4 * rhs.abs().max(1.0),
            "{lhs} vs {rhs}"
        );
        assert!(dx.iter().all(|v| v.is_finite()), "every element written");
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let s = Llama3Scaling {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192,
        };
        let plain = inverse_frequencies(500000.0, 64, None);
        let scaled = inverse_frequencies(500000.0, 64, Some(s));
        assert_eq!(plain[0], scaled[0], "the fastest pair is untouched");
        let last = plain.len() - 1;
        assert!(
            (scaled[last] * 32.0 - plain[last]).abs() < 1e-12,
            "the slowest is divided"
        );
    }

    #[test]
    fn longrope_factors_divide_each_pair() {
        let plain = inverse_frequencies(10000.0, 8, None);
        let f = [1.0, 2.0, 4.0, 8.0];
        let scaled = factored_inverse_frequencies(10000.0, 8, &f);
        for i in 0..4 {
            assert!((scaled[i] * f[i] - plain[i]).abs() <= 1e-6 * plain[i]);
        }
        let p = PairFactors::new(&f).unwrap();
        assert_eq!(p.as_slice(), &f);
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(json, "[1.0,2.0,4.0,8.0]");
        assert_eq!(serde_json::from_str::<PairFactors>(&json).unwrap(), p);
        assert!(PairFactors::new(&[1.0; MAX_ROPE_PAIRS + 1]).is_none());
    }
}
