//! The key/value-cached decoder of the decoder families that have one (GPT, the Llama family):
//! everything a [`Decoder`] does but running the rows through the blocks, which each family
//! does in its own file ([`CachedStack::decode_hidden`]). The cache holds every layer's keys
//! and values as `[slots, kv_heads, max_len, head_dim]`; the final norm's output of the rows
//! asked for goes through the head.

use super::{DecodeRows, Decoder, KvCache, padded_vocab};
use crate::engine::cpu::kv_cache::CacheShape;
use crate::engine::ops::Ids;
use crate::engine::{DType, Result, Tensor, ops};

/// A decoder stack that can run rows against a key/value cache.
pub trait CachedStack {
    /// Layers, each with a key and a value cache.
    fn cached_layers(&self) -> usize;

    /// The cache's shape for `slots` sequences of up to `max_len` tokens (at most the
    /// model's context) and the dtype it holds (the activations').
    fn cache_layout(&self, slots: usize, max_len: usize) -> (CacheShape, DType);

    /// The output head's weight `[padded vocab, C]`.
    fn head(&self) -> &Tensor;

    /// The vocabulary without its padding.
    fn logit_vocab(&self) -> usize;

    /// The rows run through every block against the cache (appending their keys and
    /// values), after the final norm: `[rows, C]`. Allocates nothing it keeps and never waits
    /// for the device (see [`Decoder::decode_into`]).
    fn decode_hidden(&self, cache: &mut KvCache, rows: &DecodeRows) -> Result<Tensor>;

    /// [`Decoder::rotary_variant`].
    fn prefill_variant(&self, _positions: usize) -> usize {
        0
    }

    /// [`Decoder::restart_at`].
    fn restart_position(&self) -> Option<usize> {
        None
    }
}

impl<S: CachedStack> Decoder for S {
    fn cache_bytes(&self, slots: usize, max_len: usize) -> usize {
        let (shape, dtype) = self.cache_layout(slots, max_len);
        2 * self.cached_layers() * shape.len() * dtype.size_bytes()
    }

    fn new_cache(&self, slots: usize, max_len: usize) -> Result<KvCache> {
        let (shape, dtype) = self.cache_layout(slots, max_len);
        let pool = self.head().pool();
        let layers = (0..self.cached_layers())
            .map(|_| {
                Ok((
                    Tensor::zeros(pool, &[shape.len()], dtype)?,
                    Tensor::zeros(pool, &[shape.len()], dtype)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache { layers, shape })
    }

    fn decode(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        slot: &[u32],
        pos: &[u32],
        emit: &[u32],
    ) -> Result<Vec<f32>> {
        let longest = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(0);
        let rows = DecodeRows {
            tokens: Ids::Host(tokens),
            slot: Ids::Host(slot),
            pos: Ids::Host(pos),
            longest,
            positions: longest,
            distinct_slots: {
                let mut seen = slot.to_vec();
                seen.sort_unstable();
                seen.windows(2).all(|w| w[0] != w[1])
            },
            emit: None,
        };
        let ln = self.decode_hidden(cache, &rows)?;
        let last = ops::gather_rows(&ln, emit, None)?;
        let logits = ops::linear_forward(&last, self.head(), None)?.to_vec()?;
        let (padded, vocab) = (padded_vocab(self.logit_vocab()), self.logit_vocab());
        Ok(logits
            .chunks(padded)
            .flat_map(|row| &row[..vocab])
            .copied()
            .collect())
    }

    fn new_logits(&self, rows: usize) -> Result<Tensor> {
        let (_, dtype) = self.cache_layout(1, 1);
        Tensor::uninit(
            self.head().pool(),
            &[rows, padded_vocab(self.logit_vocab())],
            dtype,
        )
    }

    fn decode_into(
        &self,
        cache: &mut KvCache,
        rows: &DecodeRows,
        logits: &mut Tensor,
    ) -> Result<()> {
        let ln = self.decode_hidden(cache, rows)?;
        let last = match rows.emit {
            Some(emit) => ops::gather_rows_at(&ln, emit, None)?,
            None => ln,
        };
        ops::linear_forward_into(logits, &last, self.head(), None)
    }

    fn rotary_variant(&self, positions: usize) -> usize {
        self.prefill_variant(positions)
    }

    fn restart_at(&self) -> Option<usize> {
        self.restart_position()
    }
}
