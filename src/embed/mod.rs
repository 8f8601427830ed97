//! Sentence embeddings from a pretrained model: a BERT-family encoder with its
//! sentence-transformers pooling, or a Llama-family decoder whose final hidden states are
//! mean-pooled.
//!
//! Texts are tokenised (pairs as `[CLS] a [SEP] b [SEP]` with token types for BERT, joined
//! by a line break for decoders), truncated to the model's maximum length (counted), sorted
//! by length and run in batches of similar lengths, so padding costs little; the embeddings
//! come back in the input order. Decoders need no padding mask: their attention is causal,
//! so right padding never reaches a real token.

pub mod io;

use crate::data::HfTokenizer;
use crate::engine::GemmShape;
use crate::engine::device::DeviceRequest;
use crate::engine::{DType, Device, MemoryPool, Tensor, ops};
use crate::error::{KilnError, Result};
use crate::models::bert::{Bert, EncoderBatch};
use crate::models::import::bert::{self as bert_import, Pooling, PoolingMode};
use crate::models::import::{Provenance, pretrained};
use crate::models::llama::{Llama, LlamaConfig};
use crate::nn::builder::{NameMap, WeightSource};
use crate::nn::{ParamBuilder, Params};
use std::path::Path;
use std::sync::Arc;
use tokenizers::{TruncationDirection, TruncationParams, TruncationStrategy};

/// The longest input a decoder gets when `--max-length` is not given: its context is often
/// far longer than a classification text needs, and attention grows with the square.
pub const DECODER_DEFAULT_MAX_LENGTH: usize = 512;

/// What joins a text and its pair for a decoder, which has no segment tokens.
const DECODER_PAIR_SEPARATOR: &str = "\n";

/// How to open an encoder.
#[derive(Debug, Clone)]
pub struct EncoderOptions {
    /// `auto`, `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// `fp32`, `bf16` or `f16` (GPU); `None` is fp32 on the CPU and bf16 on a GPU.
    pub precision: Option<String>,
    /// The longest input in tokens, special tokens included (default: the model's).
    pub max_length: Option<usize>,
}

impl Default for EncoderOptions {
    fn default() -> Self {
        EncoderOptions {
            device: "auto".into(),
            precision: None,
            max_length: None,
        }
    }
}

/// One text's tokens, ready to batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub type_ids: Vec<u32>,
    /// Whether tokens were cut to fit the maximum length.
    pub truncated: bool,
}

enum Network {
    Bert {
        model: Box<Bert>,
        tokenizer: Box<tokenizers::Tokenizer>,
    },
    Llama {
        model: Box<Llama>,
        tokenizer: Box<HfTokenizer>,
    },
}

/// A frozen pretrained model that turns texts into fixed-size vectors.
pub struct TextEncoder {
    net: Network,
    pooling: Pooling,
    max_length: usize,
    pad_id: u32,
    dim: usize,
    pool: Arc<MemoryPool>,
    precision: &'static str,
    source: Provenance,
    /// A short human description: the model, the device and the precision.
    pub description: String,
}

/// The compute dtype `precision` asks for on `device`, and its name.
fn compute_dtype(device: Device, precision: Option<&str>) -> Result<(Option<DType>, &'static str)> {
    match (device, precision) {
        (Device::Cpu, None | Some("fp32")) => Ok((None, "fp32")),
        (Device::Cpu, Some(p @ ("bf16" | "f16"))) => Err(KilnError::Setting(format!(
            "--precision {p} needs a GPU; the CPU embeds in fp32 (drop --precision or use --device cuda)"
        ))),
        (_, Some("fp32")) => Ok((None, "fp32")),
        (_, None | Some("bf16")) => Ok((Some(DType::BF16), "bf16")),
        (_, Some("f16")) => Ok((Some(DType::F16), "f16")),
        (_, Some(p)) => Err(KilnError::Setting(format!(
            "--precision {p} is not one kiln embeds in; use fp32, bf16 or f16"
        ))),
    }
}

/// The longest input: `asked`, else `default`, refused beyond `limit` (the model's positions).
fn max_length(asked: Option<usize>, default: usize, limit: usize) -> Result<usize> {
    match asked {
        Some(0) | Some(1) => Err(KilnError::Setting(
            "--max-length must be at least 2 (room for a token besides the special ones)".into(),
        )),
        Some(n) if n > limit => Err(KilnError::Setting(format!(
            "--max-length {n} is longer than the model's {limit} positions; use at most {limit}"
        ))),
        Some(n) => Ok(n),
        None => Ok(default.min(limit)),
    }
}

impl TextEncoder {
    /// Opens the model at `path`: a BERT-family directory, or a Llama-family Hugging Face
    /// directory or GGUF file.
    pub fn open(path: &Path, opts: &EncoderOptions) -> Result<TextEncoder> {
        let request: DeviceRequest = opts.device.parse().map_err(KilnError::Setting)?;
        // Settings first: a bad --precision should not wait for a model to load.
        if let Some(p) = opts.precision.as_deref()
            && !matches!(p, "fp32" | "bf16" | "f16")
        {
            return Err(KilnError::Setting(format!(
                "--precision {p} is not one kiln embeds in; use fp32, bf16 or f16"
            )));
        }
        let (pool, note) = crate::engine::open(request)?;
        if let Some(n) = note {
            eprintln!("{n}");
        }
        let (dtype, precision) = compute_dtype(pool.device(), opts.precision.as_deref())?;
        let mut enc = if path.is_dir() && bert_import::is_bert_dir(path) {
            Self::open_bert(path, &pool, opts, precision)?
        } else {
            Self::open_decoder(path, &pool, opts, precision)?
        };
        for p in enc.params_mut() {
            p.set_compute_dtype(dtype)?;
        }
        Ok(enc)
    }

    fn open_bert(
        path: &Path,
        pool: &Arc<MemoryPool>,
        opts: &EncoderOptions,
        precision: &'static str,
    ) -> Result<TextEncoder> {
        let pre = bert_import::open(path)?;
        let max_length = max_length(opts.max_length, pre.max_seq_length, pre.cfg.max_positions)?;
        let mut tokenizer = pre.tokenizer.inner().clone();
        // The library's own truncation, as sentence-transformers calls it, so ids match.
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(|e| {
                KilnError::checkpoint(path, format!("its tokenizer cannot truncate: {e}"))
            })?;
        let pad_id = pre.tokenizer.pad_id().unwrap_or(0);
        let model = pre.build(pool)?;
        let c = &pre.cfg;
        Ok(TextEncoder {
            description: format!(
                "{} (BERT encoder: {} layers, width {}, {} pooling{}, max {} tokens) on {} in {precision}",
                path.display(),
                c.n_layers,
                c.d_model,
                match pre.pooling.mode {
                    PoolingMode::Mean => "mean",
                    PoolingMode::Cls => "CLS",
                },
                if pre.pooling.normalize {
                    ", normalised"
                } else {
                    ""
                },
                max_length,
                pool.device()
            ),
            dim: c.d_model,
            net: Network::Bert {
                model: Box::new(model),
                tokenizer: Box::new(tokenizer),
            },
            pooling: pre.pooling,
            max_length,
            pad_id,
            pool: pool.clone(),
            precision,
            source: pre.source,
        })
    }

    fn open_decoder(
        path: &Path,
        pool: &Arc<MemoryPool>,
        opts: &EncoderOptions,
        precision: &'static str,
    ) -> Result<TextEncoder> {
        let pre = pretrained::open(path)?;
        let Some(cfg) = LlamaConfig::from_model(&pre.model, pre.vocab) else {
            return Err(KilnError::checkpoint(
                path,
                format!(
                    "is a {} model; kiln embeds with BERT-family encoders and Llama-family decoders",
                    pre.source.architecture
                ),
            ));
        };
        let max_length = max_length(opts.max_length, DECODER_DEFAULT_MAX_LENGTH, cfg.context)?;
        let mut source = WeightSource::new(path.display(), &pre.weights, NameMap::identity());
        let model = Llama::build(&mut ParamBuilder::load(pool, &mut source), cfg)?;
        source.finish()?;
        let pad_id = pre.tokenizer.pad_id().unwrap_or(0);
        Ok(TextEncoder {
            description: format!(
                "{} (Llama decoder: {} layers, width {}, mean of final hidden states, max {} tokens) on {} in {precision}",
                path.display(),
                cfg.n_layers,
                cfg.d_model,
                max_length,
                pool.device()
            ),
            dim: cfg.d_model,
            net: Network::Llama {
                model: Box::new(model),
                tokenizer: Box::new(pre.tokenizer),
            },
            pooling: Pooling {
                mode: PoolingMode::Mean,
                normalize: false,
            },
            max_length,
            pad_id,
            pool: pool.clone(),
            precision,
            source: pre.source,
        })
    }

    /// The BERT-family encoder to fine-tune, or `None` for a decoder.
    pub fn bert_mut(&mut self) -> Option<&mut Bert> {
        match &mut self.net {
            Network::Bert { model, .. } => Some(model),
            Network::Llama { .. } => None,
        }
    }

    pub fn bert(&self) -> Option<&Bert> {
        match &self.net {
            Network::Bert { model, .. } => Some(model),
            Network::Llama { .. } => None,
        }
    }

    pub fn pooling_mode(&self) -> PoolingMode {
        self.pooling.mode
    }

    /// The token id padded positions hold.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// The pool the encoder's tensors live in.
    pub fn memory_pool(&self) -> &Arc<MemoryPool> {
        &self.pool
    }

    /// The dtype the encoder computes in (`None`: f32).
    pub fn compute_dtype(&self) -> Option<DType> {
        match self.precision {
            "bf16" => Some(DType::BF16),
            "f16" => Some(DType::F16),
            _ => None,
        }
    }

    fn params_mut(&mut self) -> Vec<&mut crate::nn::Param> {
        match &mut self.net {
            Network::Bert { model, .. } => model.params_mut(),
            Network::Llama { model, .. } => model.params_mut(),
        }
    }

    /// Width of the embeddings.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The longest input in tokens, special tokens included.
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    pub fn device(&self) -> Device {
        self.pool.device()
    }

    /// The pool of the encoder's device, for work on its embeddings there.
    pub fn pool(&self) -> &Arc<MemoryPool> {
        &self.pool
    }

    /// `fp32`, `bf16` or `f16`.
    pub fn precision(&self) -> &'static str {
        self.precision
    }

    /// Identifies what the embeddings depend on: the weight files' sha256, the pooling, the
    /// maximum length and the precision (hashing reads every weight file once).
    pub fn fingerprint(&self) -> Result<String> {
        use sha2::Digest;
        let mut source = self.source.clone();
        source.hash_files()?;
        let mut h = sha2::Sha256::new();
        for (name, sha) in &source.sha256 {
            h.update(format!("{name}={sha};"));
        }
        h.update(format!(
            "pooling={:?};normalize={};max_length={};precision={}",
            self.pooling.mode, self.pooling.normalize, self.max_length, self.precision
        ));
        Ok(format!("{:x}", h.finalize()))
    }

    /// The tokens of `text` (and its `pair`), truncated to the maximum length.
    pub fn encode(&self, text: &str, pair: Option<&str>) -> Result<Encoded> {
        match &self.net {
            Network::Bert { tokenizer, .. } => {
                let enc = match pair {
                    None => tokenizer.encode(text, true),
                    Some(b) => tokenizer.encode((text, b), true),
                }
                .map_err(|e| KilnError::Setting(format!("cannot tokenise {text:?}: {e}")))?;
                Ok(Encoded {
                    ids: enc.get_ids().to_vec(),
                    type_ids: enc.get_type_ids().to_vec(),
                    truncated: !enc.get_overflowing().is_empty(),
                })
            }
            Network::Llama { tokenizer, .. } => {
                let bos: Vec<u32> = tokenizer
                    .bos_id()
                    .filter(|_| tokenizer.adds_bos())
                    .into_iter()
                    .collect();
                let mut a = tokenizer.encode(text);
                let sep = tokenizer.encode(DECODER_PAIR_SEPARATOR);
                let mut b = pair.map(|p| tokenizer.encode(p)).unwrap_or_default();
                // The EOS token ends the input where the model's configuration asks for it
                // (add_eos_token), as its own tokenizer would put it there.
                let eos: Vec<u32> = tokenizer
                    .eos_ids()
                    .first()
                    .copied()
                    .filter(|_| tokenizer.adds_eos())
                    .into_iter()
                    .collect();
                let fixed = bos.len() + eos.len() + if pair.is_some() { sep.len() } else { 0 };
                let room = self.max_length.saturating_sub(fixed).max(1);
                let truncated = a.len() + b.len() > room;
                // Longest first, as the tokenizers library truncates pairs.
                while a.len() + b.len() > room {
                    if a.len() >= b.len() {
                        a.pop();
                    } else {
                        b.pop();
                    }
                }
                let mut ids = bos;
                ids.extend(a);
                if pair.is_some() {
                    ids.extend(sep);
                    ids.extend(b);
                }
                ids.extend(eos);
                if ids.is_empty() {
                    // An empty text still needs one position to pool over.
                    ids.push(self.pad_id);
                }
                Ok(Encoded {
                    type_ids: vec![0; ids.len()],
                    ids,
                    truncated,
                })
            }
        }
    }

    /// The tokens of many texts (with their optional pairs), tokenised on all cores: on a
    /// GPU, tokenising one text after another costs more than the encoder's forward pass.
    pub fn encode_all(&self, texts: &[(&str, Option<&str>)]) -> Result<Vec<Encoded>> {
        use rayon::prelude::*;
        texts.par_iter().map(|(a, b)| self.encode(a, *b)).collect()
    }

    /// One embedding per input, in the input order, computed in batches of at most
    /// `batch_size` texts of similar length.
    pub fn embed(&self, inputs: &[Encoded], batch_size: usize) -> Result<Vec<Vec<f32>>> {
        let batch_size = batch_size.max(1);
        let mut order: Vec<usize> = (0..inputs.len()).collect();
        // Longest first: the first batch finds out early whether memory suffices.
        order.sort_by_key(|&i| std::cmp::Reverse(inputs[i].ids.len()));
        let mut out = vec![Vec::new(); inputs.len()];
        for chunk in order.chunks(batch_size) {
            let seqs: Vec<(&[u32], &[u32])> = chunk
                .iter()
                .map(|&i| (inputs[i].ids.as_slice(), inputs[i].type_ids.as_slice()))
                .collect();
            // On a GPU, lengths rounded up to 32 keep the GEMM shapes few (each new shape is
            // timed once to choose its algorithm); the CPU pays for every padded row.
            let multiple = if self.pool.device() == Device::Cpu {
                1
            } else {
                32
            };
            let batch = EncoderBatch::pad_to(&seqs, self.pad_id, multiple, self.max_length);
            for (&i, e) in chunk.iter().zip(self.embed_batch(&batch)?) {
                out[i] = e;
            }
        }
        Ok(out)
    }

    /// The pooled (and, if the model asks, normalised) embeddings of one padded batch.
    fn embed_batch(&self, b: &EncoderBatch) -> Result<Vec<Vec<f32>>> {
        let hidden = match &self.net {
            Network::Bert { model, .. } => model.forward(b)?,
            Network::Llama { model, .. } => model.final_hidden_states(&b.tokens, b.batch, b.seq)?,
        };
        let mut rows = pool_hidden(&hidden, &b.lens, b.seq, self.pooling.mode)?;
        if self.pooling.normalize {
            for r in &mut rows {
                let norm = r.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
                r.iter_mut().for_each(|v| *v /= norm);
            }
        }
        Ok(rows)
    }
}

/// Pools `hidden[B, T, C]` over each sequence's first `lens[b]` rows on its device: the mean
/// as one batched GEMM (`ones[B, 1, T] @ hidden`, the sum, divided on the host so no 1/len
/// is rounded to the activation dtype), or the first row.
fn pool_hidden(
    hidden: &Tensor,
    lens: &[u32],
    seq: usize,
    mode: PoolingMode,
) -> Result<Vec<Vec<f32>>> {
    let (batch, c) = (lens.len(), hidden.len() / (lens.len() * seq).max(1));
    let flat = match mode {
        PoolingMode::Mean => {
            let mut ones = vec![0.0f32; batch * seq];
            for (b, &len) in lens.iter().enumerate() {
                ones[b * seq..b * seq + len as usize].fill(1.0);
            }
            let w = Tensor::from_vec(hidden.pool(), &[batch, 1, seq], hidden.dtype(), ones)?;
            let shape = GemmShape {
                trans_a: false,
                trans_b: false,
                batch,
                m: 1,
                n: c,
                k: seq,
            };
            let mut sums = ops::batched_matmul(shape, 1.0, &w, hidden)?.to_vec()?;
            for (row, &len) in sums.chunks_mut(c).zip(lens) {
                row.iter_mut().for_each(|v| *v /= len as f32);
            }
            sums
        }
        PoolingMode::Cls => {
            let rows = hidden.try_clone()?.reshaped(&[batch * seq, c]);
            let first: Vec<u32> = (0..batch).map(|b| (b * seq) as u32).collect();
            ops::gather_rows(&rows, &first, None)?.to_vec()?
        }
    };
    Ok(flat.chunks(c).map(<[f32]>::to_vec).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mean_pooling_skips_padding_and_cls_takes_the_first_row() {
        let pool = MemoryPool::new(Device::Cpu);
        // Two sequences of 3 rows, width 2; the second has 2 real rows.
        let h = Tensor::from_vec(
            &pool,
            &[2, 3, 2],
            DType::F32,
            vec![1., 2., 3., 4., 5., 6., 10., 20., 30., 40., 99., 99.],
        )
        .unwrap();
        let mean = pool_hidden(&h, &[3, 2], 3, PoolingMode::Mean).unwrap();
        assert_eq!(mean, vec![vec![3., 4.], vec![20., 30.]]);
        let cls = pool_hidden(&h, &[3, 2], 3, PoolingMode::Cls).unwrap();
        assert_eq!(cls, vec![vec![1., 2.], vec![10., 20.]]);
    }

    #[test]
    fn lengths_and_precisions_are_checked() {
        assert_eq!(max_length(None, 256, 512).unwrap(), 256);
        assert_eq!(max_length(None, 1024, 512).unwrap(), 512);
        assert!(max_length(Some(600), 256, 512).is_err());
        assert!(max_length(Some(1), 256, 512).is_err());
        assert!(compute_dtype(Device::Cpu, Some("bf16")).is_err());
        assert_eq!(compute_dtype(Device::Cuda(0), None).unwrap().1, "bf16");
        assert!(compute_dtype(Device::Cuda(0), Some("int8")).is_err());
    }
}
