//! BERT-family encoders from a Hugging Face or sentence-transformers directory:
//! `config.json` (BertModel), `model.safetensors`, the WordPiece `tokenizer.json`, and the
//! sentence-transformers modules (`modules.json`, `1_Pooling/config.json`,
//! `sentence_bert_config.json`) that say how token states become one sentence embedding.
//!
//! Query, key and value projections are stacked into kiln's fused QKV matrix; the pooler,
//! the masked-language-model head and the `position_ids` buffer are not needed to embed and
//! are left out. A directory without sentence-transformers files pools by mean without
//! normalising, which is what sentence-transformers itself does with a plain BERT.

use super::pretrained::{
    HostTensor, Provenance, architecture, bad, json_f64, json_usize, need, read_safetensors, take,
    take_stacked, weight_files,
};
use crate::data::HfTokenizer;
use crate::engine::MemoryPool;
use crate::error::Result;
use crate::models::bert::{Bert, BertConfig};
use crate::nn::ParamBuilder;
use crate::nn::builder::{NameMap, WeightSource};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Architectures whose encoder is a `BertModel` (heads other than the encoder are ignored).
const ARCHITECTURES: &[&str] = &["BertModel", "BertForMaskedLM", "BertForPreTraining"];

/// Whether `config.json`'s architecture is one this module reads.
pub fn is_bert_architecture(arch: &str) -> bool {
    ARCHITECTURES.contains(&arch)
}

/// Whether `path` is a directory holding a BERT-family encoder.
pub fn is_bert_dir(path: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(path.join("config.json")) else {
        return false;
    };
    let Ok(cfg) = serde_json::from_str::<Value>(&text) else {
        return false;
    };
    let arch = cfg
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .unwrap_or("");
    is_bert_architecture(arch) || cfg.get("model_type").and_then(Value::as_str) == Some("bert")
}

/// How token states become one embedding per text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum PoolingMode {
    /// The mean over the real tokens (special tokens included, padding not).
    Mean,
    /// The first token's state ([CLS]).
    Cls,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Pooling {
    pub mode: PoolingMode,
    /// Scale each embedding to unit length (a `Normalize` module follows the pooling).
    pub normalize: bool,
}

/// An encoder read from disk, ready to build.
pub struct BertPretrained {
    pub cfg: BertConfig,
    pub weights: BTreeMap<String, HostTensor>,
    pub tokenizer: HfTokenizer,
    pub pooling: Pooling,
    /// The longest input in tokens, special tokens included: sentence-transformers'
    /// `max_seq_length` where the directory has one, else the position table's size.
    pub max_seq_length: usize,
    pub source: Provenance,
}

impl BertPretrained {
    /// The encoder with these weights in `pool`, computing in f32 (compute copies can be set
    /// on its parameters afterwards).
    pub fn build(&self, pool: &Arc<MemoryPool>) -> Result<Bert> {
        let path = self.source.path.display();
        let mut source = WeightSource::new(path, &self.weights, NameMap::identity());
        let bert = Bert::build(&mut ParamBuilder::load(pool, &mut source), self.cfg)?;
        source.finish()?;
        Ok(bert)
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| bad(path, format!("is not valid JSON: {e}"))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(bad(path, format!("cannot be read: {e}"))),
    }
}

/// Reads the encoder in `dir`.
pub fn open(dir: &Path) -> Result<BertPretrained> {
    let cfg_path = dir.join("config.json");
    let cfg = read_json(&cfg_path)?.ok_or_else(|| {
        bad(
            &cfg_path,
            "does not exist; an encoder directory has config.json, model.safetensors and tokenizer.json",
        )
    })?;
    let arch = architecture(&cfg).unwrap_or("BertModel").to_string();
    if !is_bert_architecture(&arch) {
        return Err(bad(
            &cfg_path,
            format!(
                "declares {arch}, not a BERT-family encoder ({})",
                ARCHITECTURES.join(", ")
            ),
        ));
    }
    let act = cfg
        .get("hidden_act")
        .and_then(Value::as_str)
        .unwrap_or("gelu");
    if act != "gelu" {
        return Err(bad(
            &cfg_path,
            format!("has hidden_act = {act:?}; kiln's encoder has the exact GELU (\"gelu\") only"),
        ));
    }
    let positions = cfg
        .get("position_embedding_type")
        .and_then(Value::as_str)
        .unwrap_or("absolute");
    if positions != "absolute" {
        return Err(bad(
            &cfg_path,
            format!("has position_embedding_type = {positions:?}; kiln reads \"absolute\" only"),
        ));
    }
    let usize_of = |key| need(&cfg_path, key, json_usize(&cfg, key));
    let bert = BertConfig {
        vocab: usize_of("vocab_size")?,
        d_model: usize_of("hidden_size")?,
        n_layers: usize_of("num_hidden_layers")?,
        n_heads: usize_of("num_attention_heads")?,
        ffn_hidden: usize_of("intermediate_size")?,
        max_positions: usize_of("max_position_embeddings")?,
        type_vocab: json_usize(&cfg, "type_vocab_size").unwrap_or(2),
        norm_eps: json_f64(&cfg, "layer_norm_eps").unwrap_or(1e-12) as f32,
    };
    bert.check().map_err(|e| bad(&cfg_path, e))?;
    let tokenizer = HfTokenizer::from_dir(dir).map_err(|e| {
        bad(
            dir,
            format!(
                "has no usable tokenizer ({e}); an encoder needs its tokenizer.json beside config.json"
            ),
        )
    })?;
    if tokenizer.vocab_size() > bert.vocab {
        return Err(bad(
            dir,
            format!(
                "its tokenizer has {} tokens but the model's embedding only {} rows; the tokenizer belongs to another model",
                tokenizer.vocab_size(),
                bert.vocab
            ),
        ));
    }
    let files = weight_files(dir)?;
    let weights = map_weights(&files, &bert)?;
    let (pooling, max_seq_length) = sentence_transformers_modules(dir, &bert)?;
    Ok(BertPretrained {
        cfg: bert,
        weights,
        tokenizer,
        pooling,
        max_seq_length,
        source: Provenance {
            path: dir.to_path_buf(),
            format: "hf".into(),
            architecture: arch,
            sha256: BTreeMap::new(),
            files,
        },
    })
}

/// The checkpoint's tensors under kiln's names, shapes checked against `cfg`.
fn map_weights(files: &[PathBuf], cfg: &BertConfig) -> Result<BTreeMap<String, HostTensor>> {
    let mut raw = read_safetensors(files)?;
    let path = &files[0];
    // BertModel saves bare names; the task models (BertForMaskedLM, ...) prefix "bert.".
    let prefix = if raw.contains_key("bert.embeddings.word_embeddings.weight") {
        "bert."
    } else {
        ""
    };
    let (c, f) = (cfg.d_model, cfg.ffn_hidden);
    let mut out = BTreeMap::new();
    let mut put = |kiln: String, t: HostTensor| {
        out.insert(kiln, t);
    };
    let e = |n: &str| format!("{prefix}embeddings.{n}");
    put(
        "embeddings.word.weight".into(),
        take(
            path,
            &mut raw,
            &e("word_embeddings.weight"),
            &[cfg.vocab, c],
        )?,
    );
    put(
        "embeddings.position.weight".into(),
        take(
            path,
            &mut raw,
            &e("position_embeddings.weight"),
            &[cfg.max_positions, c],
        )?,
    );
    put(
        "embeddings.token_type.weight".into(),
        take(
            path,
            &mut raw,
            &e("token_type_embeddings.weight"),
            &[cfg.type_vocab, c],
        )?,
    );
    for part in ["weight", "bias"] {
        put(
            format!("embeddings.ln.{part}"),
            take(path, &mut raw, &e(&format!("LayerNorm.{part}")), &[c])?,
        );
    }
    for l in 0..cfg.n_layers {
        let hf = |n: &str| format!("{prefix}encoder.layer.{l}.{n}");
        let kiln = |n: &str| format!("layers.{l}.{n}");
        let qkv = |part: &str| -> Vec<(String, usize)> {
            ["query", "key", "value"]
                .iter()
                .map(|p| (hf(&format!("attention.self.{p}.{part}")), c))
                .collect()
        };
        put(
            kiln("attn.qkv.weight"),
            take_stacked(path, &mut raw, &qkv("weight"), &[c])?,
        );
        put(
            kiln("attn.qkv.bias"),
            take_stacked(path, &mut raw, &qkv("bias"), &[])?,
        );
        // (kiln name, Hugging Face name, shape of the weight)
        let linears = [
            ("attn.out", "attention.output.dense", [c, c]),
            ("mlp.fc_in", "intermediate.dense", [f, c]),
            ("mlp.fc_out", "output.dense", [c, f]),
        ];
        for (k, h, shape) in linears {
            put(
                kiln(&format!("{k}.weight")),
                take(path, &mut raw, &hf(&format!("{h}.weight")), &shape)?,
            );
            put(
                kiln(&format!("{k}.bias")),
                take(path, &mut raw, &hf(&format!("{h}.bias")), &shape[..1])?,
            );
        }
        for (k, h) in [
            ("ln_attn", "attention.output.LayerNorm"),
            ("ln_mlp", "output.LayerNorm"),
        ] {
            for part in ["weight", "bias"] {
                put(
                    kiln(&format!("{k}.{part}")),
                    take(path, &mut raw, &hf(&format!("{h}.{part}")), &[c])?,
                );
            }
        }
    }
    Ok(out)
}

/// The pooling and the longest input of a sentence-transformers directory; mean pooling
/// without normalisation and the position table's length where there is none.
fn sentence_transformers_modules(dir: &Path, cfg: &BertConfig) -> Result<(Pooling, usize)> {
    let mut pooling = Pooling {
        mode: PoolingMode::Mean,
        normalize: false,
    };
    let modules_path = dir.join("modules.json");
    let mut pooling_dir = None;
    if let Some(modules) = read_json(&modules_path)? {
        let list = modules
            .as_array()
            .ok_or_else(|| bad(&modules_path, "is not a list of modules"))?;
        for m in list {
            let kind = m.get("type").and_then(Value::as_str).unwrap_or("");
            let sub = m.get("path").and_then(Value::as_str).unwrap_or("");
            match kind.rsplit('.').next().unwrap_or("") {
                "Transformer" => {}
                "Pooling" => pooling_dir = Some(dir.join(sub)),
                "Normalize" => pooling.normalize = true,
                other => {
                    return Err(bad(
                        &modules_path,
                        format!(
                            "lists a {other} module ({kind}); kiln embeds with Transformer, Pooling and Normalize modules only"
                        ),
                    ));
                }
            }
        }
    }
    if let Some(p) = pooling_dir {
        let path = p.join("config.json");
        let pc = read_json(&path)?.ok_or_else(|| {
            bad(
                &path,
                "does not exist, but modules.json names a Pooling module there",
            )
        })?;
        let on = |key: &str| pc.get(key).and_then(Value::as_bool).unwrap_or(false);
        let modes: Vec<&str> = [
            "pooling_mode_cls_token",
            "pooling_mode_mean_tokens",
            "pooling_mode_max_tokens",
            "pooling_mode_mean_sqrt_len_tokens",
            "pooling_mode_weightedmean_tokens",
            "pooling_mode_lasttoken",
        ]
        .into_iter()
        .filter(|k| on(k))
        .collect();
        pooling.mode = match modes.as_slice() {
            ["pooling_mode_mean_tokens"] => PoolingMode::Mean,
            ["pooling_mode_cls_token"] => PoolingMode::Cls,
            other => {
                return Err(bad(
                    &path,
                    format!(
                        "asks for pooling {other:?}; kiln pools by one of pooling_mode_mean_tokens or pooling_mode_cls_token"
                    ),
                ));
            }
        };
    }
    let st_path = dir.join("sentence_bert_config.json");
    let max = read_json(&st_path)?
        .and_then(|v| json_usize(&v, "max_seq_length"))
        .unwrap_or(cfg.max_positions)
        .min(cfg.max_positions);
    Ok((pooling, max))
}
