//! Token plus position embedding, forward and backward.
//!
//! The backward scatters rows of the output gradient into the table rows their tokens used.
//! It runs sequentially over positions so that repeated tokens add up in a fixed order.

use rayon::prelude::*;

/// `out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]`.
pub fn embedding_forward(
    out: &mut [f32],
    tokens: &[u32],
    wte: &[f32],
    wpe: &[f32],
    seq: usize,
    c: usize,
) {
    out.par_chunks_mut(c)
        .zip(tokens.par_iter())
        .enumerate()
        .for_each(|(i, (o, &tok))| {
            let te = &wte[tok as usize * c..][..c];
            let pe = &wpe[(i % seq) * c..][..c];
            for ((o, a), b) in o.iter_mut().zip(te).zip(pe) {
                *o = a + b;
            }
        });
}

/// Accumulates into `dwte` and `dwpe`.
pub fn embedding_backward(
    dwte: &mut [f32],
    dwpe: &mut [f32],
    dout: &[f32],
    tokens: &[u32],
    seq: usize,
    c: usize,
) {
    for (i, (d, &tok)) in dout.chunks(c).zip(tokens).enumerate() {
        let te = &mut dwte[tok as usize * c..][..c];
        te.iter_mut().zip(d).for_each(|(w, d)| *w += d);
        let pe = &mut dwpe[(i % seq) * c..][..c];
        pe.iter_mut().zip(d).for_each(|(w, d)| *w += d);
    }
}

/// Token rows only (models whose positions are rotary): `dwte[tokens[i]] += dout[i]`, in
/// token order, so repeated tokens sum in a fixed order.
pub fn token_embedding_backward(dwte: &mut [f32], dout: &[f32], tokens: &[u32], c: usize) {
    for (d, &tok) in dout.chunks(c).zip(tokens) {
        let te = &mut dwte[tok as usize * c..][..c];
        te.iter_mut().zip(d).for_each(|(w, d)| *w += d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testutil::{assert_close, random};

    #[test]
    fn forward_gathers_and_backward_scatters_repeated_tokens() {
        let (vocab, seq, c) = (5, 3, 4);
        let wte = random(vocab * c, 1, 1.0);
        let wpe = random(seq * c, 2, 1.0);
        let tokens = [4u32, 1, 4, 0, 4, 2]; // two sequences, token 4 three times
        let mut out = vec![f32::NAN; tokens.len() * c];
        embedding_forward(&mut out, &tokens, &wte, &wpe, seq, c);
        for (i, &tok) in tokens.iter().enumerate() {
            for j in 0..c {
                assert_eq!(
                    out[i * c + j],
                    wte[tok as usize * c + j] + wpe[(i % seq) * c + j]
                );
            }
        }
        let dout = random(out.len(), 3, 1.0);
        let (mut dwte, mut dwpe) = (vec![0.0; vocab * c], vec![0.0; seq * c]);
        embedding_backward(&mut dwte, &mut dwpe, &dout, &tokens, seq, c);
        let mut want_te = vec![0.0f32; vocab * c];
        let mut want_pe = vec![0.0f32; seq * c];
        for (i, &tok) in tokens.iter().enumerate() {
            for j in 0..c {
                want_te[tok as usize * c + j] += dout[i * c + j];
                want_pe[(i % seq) * c + j] += dout[i * c + j];
            }
        }
        assert_close(&dwte, &want_te, 1e-6, "dwte");
        assert_close(&dwpe, &want_pe, 1e-6, "dwpe");
    }
}
