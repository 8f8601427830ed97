//! Token and learned position embeddings, summed.

use super::{Cost, Init, Param, ParamBuilder, params};
use crate::engine::{DType, Result, Tensor, ops};

pub struct Embedding {
    /// `[vocab, C]`; also the output head's weight when the head is tied.
    pub wte: Param,
    /// `[context, C]`.
    pub wpe: Param,
}

params!(Embedding { wte, wpe });

impl Embedding {
    /// Tables `wte` and `wpe` in `b`'s scope, normal with standard deviation 0.02.
    pub fn new(b: &mut ParamBuilder, vocab: usize, context: usize, c: usize) -> Result<Embedding> {
        Ok(Embedding {
            // Written by `backward` below and, when the head is tied, by the head's product,
            // both through Param's accessors.
            wte: b
                .scope("wte")
                .param("weight", &[vocab, c], Init::Normal(0.02))?
                .with_lazy_grad(),
            wpe: b
                .scope("wpe")
                .param("weight", &[context, c], Init::Normal(0.02))?,
        })
    }

    pub fn forward(&self, tokens: &[u32], batch: usize, seq: usize) -> Result<Tensor> {
        ops::embedding_forward(tokens, batch, seq, self.wte.weight(), self.wpe.weight())
    }

    /// Accumulates into the table gradients; the tokens are the forward's.
    /// Frozen tables (under adapters) get nothing: the kernel writes both tables' gradients,
    /// and a frozen one's go to scratch, or the kernel is skipped when both are frozen.
    pub fn backward(&mut self, dout: &Tensor, tokens: &[u32], seq: usize) -> Result<()> {
        if self.wte.frozen && self.wpe.frozen {
            return Ok(());
        }
        let scratch = |p: &Param| -> Result<Option<Tensor>> {
            p.frozen
                .then(|| Tensor::zeros(dout.pool(), p.value.shape(), DType::F32))
                .transpose()
        };
        let (mut wte_scratch, mut wpe_scratch) = (scratch(&self.wte)?, scratch(&self.wpe)?);
        self.wte.settle_grad()?;
        ops::embedding_backward(
            wte_scratch.as_mut().unwrap_or(&mut self.wte.grad),
            wpe_scratch.as_mut().unwrap_or(&mut self.wpe.grad),
            dout,
            tokens,
            seq,
        )
    }

    pub fn cost(&self, tokens: usize) -> Cost {
        let (table, positions) = (self.wte.value.shape(), self.wpe.value.shape());
        Self::cost_of(table[0], positions[0], table[1], tokens)
    }

    /// Saves only the token ids (4 bytes per token, in host memory).
    pub fn cost_of(vocab: usize, context: usize, c: usize, tokens: usize) -> Cost {
        Cost {
            params: (vocab + context) * c,
            flops_forward: (tokens * c) as u64,
            flops_backward: 2 * (tokens * c) as u64,
            saved_bytes: 4 * tokens,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::gradcheck::*;

    #[test]
    fn backward_matches_finite_differences() {
        let p = pool();
        let mut emb = build(&p, "", 1, |b| Embedding::new(b, 7, 4, 3));
        let tokens = [1u32, 6, 1, 0, 2, 2, 5, 1];
        let w = random_tensor(&p, &[2, 4, 3], 2);
        emb.backward(&w, &tokens, 4).unwrap();
        let (dte, dpe) = (
            emb.wte.grad.to_vec().unwrap(),
            emb.wpe.grad.to_vec().unwrap(),
        );
        let (te, pe) = (
            emb.wte.value.try_clone().unwrap(),
            emb.wpe.value.try_clone().unwrap(),
        );
        check("dwte", &te, &dte, 100, |t| {
            weighted_sum(&ops::embedding_forward(&tokens, 2, 4, t, &pe).unwrap(), &w)
        });
        check("dwpe", &pe, &dpe, 100, |q| {
            weighted_sum(&ops::embedding_forward(&tokens, 2, 4, &te, q).unwrap(), &w)
        });
    }
}
