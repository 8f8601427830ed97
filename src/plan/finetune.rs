//! The weights of a low-rank fine-tune of a Llama-family base: the frozen base in the compute
//! dtype or, with `lora.quantize = "nf4"`, its projections in NF4 (4 bits a weight plus the
//! double-quantised scales) beside the workspace they are expanded into, against the same
//! base in bf16. Exact against the pool: the test builds the trainer and compares.

use crate::engine::quant::nf4;
use crate::engine::{DType, Device};
use crate::models::llama::LlamaConfig;
use crate::models::padded_vocab;
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FinetuneWeights {
    /// Values of the block projections (q/k/v, o, gate/up, down).
    pub projection_values: usize,
    /// Bytes those projections hold: NF4 when quantised, else the compute dtype.
    pub projection_bytes: usize,
    /// Embeddings, norms, biases and an untied head, in the compute dtype.
    pub other_bytes: usize,
    /// The whole frozen base on the device.
    pub base_bytes: usize,
    /// The same base with every weight in bf16.
    pub bf16_base_bytes: usize,
    /// The shared dequantisation workspace (NF4 only): the largest projection.
    pub workspace_bytes: usize,
}

/// The frozen weights of `m` (a tokenizer of `vocab` tokens) on `device` computing in `compute`.
pub fn finetune_weights(
    m: &LlamaConfig,
    vocab: usize,
    compute: DType,
    device: Device,
    nf4: bool,
) -> FinetuneWeights {
    let (c, f) = (m.d_model, m.ffn_hidden);
    let (q, kv) = (m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim);
    // [rows, cols] of each block's projections, as `Llama::new` builds them.
    let projections = [(q + 2 * kv, c), (c, q), (2 * f, c), (c, f)];
    let vocab_rows = padded_vocab(vocab);
    let other_values = vocab_rows * c * if m.tied_head { 1 } else { 2 }
        + m.n_layers * (2 * c + if m.qkv_bias { q + 2 * kv } else { 0 })
        + c;
    let projection_values = m.n_layers * projections.iter().map(|(r, k)| r * k).sum::<usize>();
    let projection_bytes = if nf4 {
        m.n_layers
            * projections
                .iter()
                .map(|&(r, k)| nf4::stored_bytes(r, k, device))
                .sum::<usize>()
    } else {
        projection_values * compute.size_bytes()
    };
    let other_bytes = other_values * compute.size_bytes();
    let largest = projections.iter().map(|(r, k)| r * k).max().unwrap_or(0);
    FinetuneWeights {
        projection_values,
        projection_bytes,
        other_bytes,
        base_bytes: projection_bytes + other_bytes,
        bf16_base_bytes: (projection_values + other_values) * DType::BF16.size_bytes(),
        workspace_bytes: if nf4 && m.n_layers > 0 {
            largest * compute.size_bytes()
        } else {
            0
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ResolvedConfig;
    use crate::engine::MemoryPool;
    use crate::train::{Precision, Trainer};

    /// The planned base and workspace equal what a real trainer books, with and without NF4,
    /// in bf16 and fp32, tied head or not, with query/key/value biases or not.
    #[test]
    fn the_plan_matches_the_trainers_books() {
        for (quantize, precision, tied, bias) in [
            ("nf4", Precision::Bf16Mixed, true, false),
            ("nf4", Precision::Fp32, false, true),
            ("none", Precision::Bf16Mixed, true, true),
        ] {
            let cfg = ResolvedConfig::resolve(
                None,
                &[
                    "model.kind=llama".into(),
                    "model.d_model=48".into(),
                    "model.n_layers=2".into(),
                    "model.n_heads=4".into(),
                    "model.n_kv_heads=2".into(),
                    "model.ffn_hidden=80".into(),
                    "model.context=32".into(),
                    "train.seq_len=32".into(),
                    format!("model.tied_head={tied}"),
                    format!("model.qkv_bias={bias}"),
                    "lora.enabled=true".into(),
                    "lora.base=initialised".into(),
                    "lora.rank=4".into(),
                    format!("lora.quantize={quantize}"),
                ],
            )
            .unwrap()
            .config;
            let pool = MemoryPool::new(Device::Cpu);
            let t = Trainer::over_initialised_base(&cfg, 256, &pool, precision).unwrap();
            let compute = precision.compute_dtype().unwrap_or(DType::F32);
            let lc = LlamaConfig::from_model(&cfg.model, 256).unwrap();
            let plan = finetune_weights(&lc, 256, compute, Device::Cpu, quantize == "nf4");
            let what = format!("{quantize} {precision} tied {tied} bias {bias}");
            assert_eq!(plan.base_bytes, t.base_weight_bytes(), "{what}");
            assert_eq!(
                plan.workspace_bytes,
                t.quantized.map_or(0, |q| q.workspace_bytes),
                "{what}"
            );
            if let Some(q) = t.quantized {
                assert_eq!(plan.projection_bytes, q.nf4_bytes, "{what}");
                assert_eq!(plan.projection_values, q.values, "{what}");
                assert!(plan.base_bytes < plan.bf16_base_bytes, "{what}");
            }
        }
    }
}
