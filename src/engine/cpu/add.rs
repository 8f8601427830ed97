//! Elementwise addition: the residual add of the unfused path (`train.fused_kernels=false`),
//! where kiln's fused kernels add inside the layernorm, and the meeting of two gradients.

use rayon::prelude::*;

const CHUNK: usize = 4096;

/// `out = a + b`.
pub fn add(out: &mut [f32], a: &[f32], b: &[f32]) {
    out.par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(o, (a, b))| {
            o.iter_mut()
                .zip(a.iter().zip(b))
                .for_each(|(o, (a, b))| *o = a + b)
        });
}

/// `dst += src`.
pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    dst.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| *d += s));
}

/// `dst[r, col0 + j] += alpha * src[r, j]` for rows of `row` (dst) and `c` (src) values.
pub fn add_cols_scaled(
    dst: &mut [f32],
    src: &[f32],
    row: usize,
    col0: usize,
    c: usize,
    alpha: f32,
) {
    dst.par_chunks_mut(row)
        .zip(src.par_chunks(c))
        .for_each(|(d, s)| {
            d[col0..col0 + c]
                .iter_mut()
                .zip(s)
                .for_each(|(d, s)| *d += alpha * s)
        });
}

/// `out[r, j] = alpha * src[r, col0 + j]`.
pub fn cols_scaled(out: &mut [f32], src: &[f32], row: usize, col0: usize, c: usize, alpha: f32) {
    out.par_chunks_mut(c)
        .zip(src.par_chunks(row))
        .for_each(|(o, s)| {
            o.iter_mut()
                .zip(&s[col0..col0 + c])
                .for_each(|(o, s)| *o = alpha * s)
        });
}

/// `dst[row0 + r, col0 + j] = src[r, j]` for the rows of `src` (`c` values each) and rows of
/// `row` values in `dst`.
pub fn set_block(dst: &mut [f32], src: &[f32], row: usize, row0: usize, col0: usize, c: usize) {
    for (r, s) in src.chunks(c.max(1)).enumerate() {
        let at = (row0 + r) * row + col0;
        dst[at..at + c].copy_from_slice(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::{assert_close, random};

    #[test]
    fn adds_every_element() {
        let n = 3 * CHUNK + 17;
        let (a, b) = (random(n, 1, 2.0), random(n, 2, 3.0));
        let want: Vec<f32> = a.iter().zip(&b).map(|(a, b)| a + b).collect();
        let mut out = vec![f32::NAN; n];
        add(&mut out, &a, &b);
        assert_close(&out, &want, 0.0, "add");
        let mut dst = a.clone();
        add_assign(&mut dst, &b);
        assert_close(&dst, &want, 0.0, "add_assign");
    }
}
