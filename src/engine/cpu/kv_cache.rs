//! The key/value cache of generation: appending rotated keys and values, and attention of
//! new queries against a slot's cached positions.
//!
//! A layer's cache is `k, v: [slots, K, max_len, D]` (K key/value heads, unexpanded, so a
//! grouped-query model caches `H / K` times less than its query heads would need). Each row
//! of a call names its slot and position: a decode step has one row per sequence, a prefill
//! one row per prompt token in the same slot. [`kv_append`] rotates the row's query and key
//! (the same rotation as [`super::rope`]), stores key and value at the row's position and
//! returns the rotated queries; [`cache_attention`] lets each row attend to positions
//! `0..=pos` of its slot, which is causal attention for a prefill and full attention over
//! the past for a decode step. With a sliding window `W` a row sees only positions
//! `pos - W < t <= pos` (see [`super::attention`]); the cache still holds every position, so
//! the window changes what is read, not what is stored.

use super::attention::first_key;
use super::rope::{RopeShape, rotate};
use rayon::prelude::*;

/// Shape of a layer's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    pub slots: usize,
    pub kv_heads: usize,
    pub max_len: usize,
    pub head_dim: usize,
}

impl CacheShape {
    pub fn len(&self) -> usize {
        self.slots * self.kv_heads * self.max_len * self.head_dim
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Offset of `(slot, head, pos)`'s vector.
    pub fn at(&self, slot: usize, head: usize, pos: usize) -> usize {
        ((slot * self.kv_heads + head) * self.max_len + pos) * self.head_dim
    }
}

/// Rotates each row's queries into `q[rows, H D]`, and its rotated keys and its values into
/// the cache at `(slot[r], pos[r])`.
#[allow(clippy::too_many_arguments)]
pub fn kv_append(
    q: &mut [f32],
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    qkv: &[f32],
    slot: &[u32],
    pos: &[u32],
    cos: &[f32],
    sin: &[f32],
    s: RopeShape,
    c: CacheShape,
) {
    let (d, h, k, half) = (s.head_dim, s.heads, s.kv_heads, s.rot_dim / 2);
    for r in 0..s.rows {
        let row = &qkv[r * s.qkv_width()..][..s.qkv_width()];
        let p = pos[r] as usize;
        let (cs, sn) = (&cos[p * half..][..half], &sin[p * half..][..half]);
        for hq in 0..h {
            rotate(
                &mut q[(r * h + hq) * d..][..d],
                &row[hq * d..][..d],
                cs,
                sn,
                1.0,
            );
        }
        for j in 0..k {
            let at = c.at(slot[r] as usize, j, p);
            rotate(
                &mut k_cache[at..at + d],
                &row[(h + j) * d..][..d],
                cs,
                sn,
                1.0,
            );
            v_cache[at..at + d].copy_from_slice(&row[(h + k + j) * d..][..d]);
        }
    }
}

/// `out[r, h] = softmax(q[r, h] . K[slot, h/g, lo..=pos] / sqrt(D)) V[slot, h/g, lo..=pos]`
/// with `lo` the first position of the sliding `window` (0 without one).
#[allow(clippy::too_many_arguments)]
pub fn cache_attention(
    out: &mut [f32],
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    slot: &[u32],
    pos: &[u32],
    heads: usize,
    window: usize,
    c: CacheShape,
) {
    let d = c.head_dim;
    let g = heads / c.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    out.par_chunks_mut(heads * d)
        .zip(q.par_chunks(heads * d))
        .zip(slot.par_iter().zip(pos.par_iter()))
        .for_each(|((out, q), (&sl, &p))| {
            let lo = first_key(p as usize, window);
            let mut scores = vec![0.0f32; p as usize + 1 - lo];
            for h in 0..heads {
                let qh = &q[h * d..][..d];
                let base = c.at(sl as usize, h / g, lo);
                let mut max = f32::NEG_INFINITY;
                for (t, sc) in scores.iter_mut().enumerate() {
                    let kt = &k_cache[base + t * d..][..d];
                    *sc = qh.iter().zip(kt).map(|(a, b)| a * b).sum::<f32>() * scale;
                    max = max.max(*sc);
                }
                let mut sum = 0.0f32;
                for sc in scores.iter_mut() {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                let o = &mut out[h * d..][..d];
                o.fill(0.0);
                for (t, sc) in scores.iter().enumerate() {
                    let w = sc / sum;
                    let vt = &v_cache[base + t * d..][..d];
                    o.iter_mut().zip(vt).for_each(|(o, v)| *o += w * v);
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::AttnShape;
    use crate::engine::cpu::attention::windowed_attention_forward;
    use crate::engine::cpu::rope::{inverse_frequencies, rope_expand_forward, rope_tables};
    use crate::engine::cpu::testutil::{assert_close, random};

    /// A prefill through the cache (one slot, positions 0..T) gives the same attention output
    /// as rotating and expanding the heads and running the causal attention kernel, without
    /// a window and within windows of 1, 3 and the whole sequence.
    #[test]
    fn cached_prefill_matches_causal_attention_with_grouped_heads() {
        let (t, h, k, d) = (7, 4, 2, 8);
        let s = RopeShape {
            rows: t,
            heads: h,
            kv_heads: k,
            head_dim: d,
            rot_dim: d,
        };
        let c = CacheShape {
            slots: 3,
            kv_heads: k,
            max_len: 10,
            head_dim: d,
        };
        let (cos, sin) = rope_tables(&inverse_frequencies(100.0, d, None), 10);
        let qkv = random(t * s.qkv_width(), 1, 1.0);
        let pos: Vec<u32> = (0..t as u32).collect();
        let mut packed = vec![0.0; t * s.packed_width()];
        rope_expand_forward(&mut packed, &qkv, &pos, &cos, &sin, s);
        let a = AttnShape {
            batch: 1,
            seq: t,
            heads: h,
            channels: h * d,
        };
        let (mut kc, mut vc) = (vec![f32::NAN; c.len()], vec![f32::NAN; c.len()]);
        let mut q = vec![f32::NAN; t * h * d];
        let slot = vec![2u32; t];
        kv_append(
            &mut q, &mut kc, &mut vc, &qkv, &slot, &pos, &cos, &sin, s, c,
        );
        let mut outputs = Vec::new();
        for window in [0, 1, 3, t] {
            let mut want = vec![0.0; t * h * d];
            let mut probs = vec![0.0; h * t * t];
            windowed_attention_forward(&mut want, &mut probs, &packed, a, window);
            let mut got = vec![f32::NAN; t * h * d];
            cache_attention(&mut got, &q, &kc, &vc, &slot, &pos, h, window, c);
            assert_close(
                &got,
                &want,
                1e-5,
                &format!("cached attention, window {window}"),
            );
            outputs.push(got);
        }
        assert_ne!(outputs[0], outputs[2], "a short window changes the output");
        assert_eq!(
            outputs[0], outputs[3],
            "a window of the whole sequence does not"
        );
    }
}
