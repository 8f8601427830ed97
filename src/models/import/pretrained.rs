//! Pretrained models from outside kiln: a Hugging Face model directory or a GGUF file, read
//! into kiln's model settings, its tokenizer and its weights under kiln's parameter names.
//!
//! Each family's mapping lives here as a table from the checkpoint's names to kiln's. Query,
//! key and value projections are concatenated into kiln's fused QKV matrix, gate and up into
//! the fused SwiGLU matrix, GPT-2's Conv1D weights are transposed, and a llama GGUF's query
//! and key rows are put back in the Hugging Face order (llama.cpp's converter interleaves each
//! head's rotary halves; its qwen2 and qwen3 files keep Hugging Face's order). Embedding and head rows are padded to kiln's vocabulary multiple with
//! zeros, which the loss never reads.

use super::gguf::GgufFile;
use crate::config::{FamilySettings, LlamaSettings, ModelConfig};
use crate::data::HfTokenizer;
use crate::engine::MemoryPool;
use crate::error::{KilnError, Result};
use crate::models::{Model, padded_vocab};
use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use crate::nn::builder::HostTensor;

/// Where imported weights came from, recorded in the run directory.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Provenance {
    pub path: PathBuf,
    /// "hf" (a Hugging Face directory) or "gguf".
    pub format: String,
    /// The architecture the checkpoint declares.
    pub architecture: String,
    /// sha256 of each weight file, by file name; filled by [`Provenance::hash_files`] (only
    /// a run that records its provenance pays for reading the files twice).
    pub sha256: BTreeMap<String, String>,
    /// The weight files read.
    #[serde(skip)]
    pub files: Vec<PathBuf>,
}

/// A model read from disk, ready to build and load.
pub struct Pretrained {
    /// The `[model]` settings of the checkpoint's shape (kind included).
    pub model: ModelConfig,
    /// Rows of the model's embedding (the checkpoint's vocabulary size).
    pub vocab: usize,
    pub weights: BTreeMap<String, HostTensor>,
    pub tokenizer: HfTokenizer,
    pub source: Provenance,
    /// The longest `model.context` a run may ask of this model: its own context, or for a
    /// LongRoPE model (imported at the context its short factors serve) the longest its long
    /// factors were made for.
    pub longest_context: usize,
}

/// Architectures kiln imports, in the order error messages list them.
pub const ARCHITECTURES: &[&str] = &[
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "GPT2LMHeadModel",
    "GGUF general.architecture = llama, qwen2, qwen3 or phi3",
];

pub(super) fn bad(path: &Path, reason: impl Into<String>) -> KilnError {
    KilnError::checkpoint(path, reason)
}

fn sha256_file(path: &Path) -> Result<String> {
    use sha2::Digest;
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| bad(path, e.to_string()))?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| bad(path, e.to_string()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(format!("{:x}", h.finalize()))
}

/// Reads `path`: a directory with `config.json` or a `.gguf` file.
pub fn open(path: &Path) -> Result<Pretrained> {
    if path.is_dir() {
        open_hf_dir(path)
    } else if path.is_file() {
        open_gguf(path)
    } else {
        Err(bad(
            path,
            "does not exist; --init-from takes a Hugging Face model directory (with config.json) or a .gguf file",
        ))
    }
}

// ---------- Hugging Face directories ----------

/// The first entry of a Hugging Face `config.json`'s `architectures` list.
pub(super) fn architecture(cfg: &Value) -> Option<&str> {
    cfg.get("architectures")?.get(0)?.as_str()
}

pub(super) fn json_usize(cfg: &Value, key: &str) -> Option<usize> {
    cfg.get(key).and_then(Value::as_u64).map(|v| v as usize)
}

pub(super) fn json_f64(cfg: &Value, key: &str) -> Option<f64> {
    cfg.get(key).and_then(Value::as_f64)
}

pub(super) fn need<T>(path: &Path, key: &str, v: Option<T>) -> Result<T> {
    v.ok_or_else(|| bad(path, format!("config.json has no usable \"{key}\"")))
}

/// The weight files of a directory: `model.safetensors`, or the shards a
/// `model.safetensors.index.json` names (each must exist).
pub(super) fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(bad(
            dir,
            "has neither model.safetensors nor model.safetensors.index.json; save the model with safetensors (save_pretrained's default)",
        ));
    }
    let text = std::fs::read_to_string(&index).map_err(|e| bad(&index, e.to_string()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(&index, e.to_string()))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad(&index, "has no \"weight_map\" object"))?;
    let mut files: Vec<String> = map
        .values()
        .filter_map(|f| f.as_str().map(String::from))
        .collect();
    files.sort();
    files.dedup();
    let files: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
    if let Some(missing) = files.iter().find(|f| !f.is_file()) {
        return Err(bad(
            &index,
            format!(
                "names the shard {} which does not exist; copy every shard of the model",
                missing.display()
            ),
        ));
    }
    Ok(files)
}

pub(crate) fn to_f32(path: &Path, name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    let two = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
    Ok(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_bits(two(b)).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(two(b)).to_f32())
            .collect(),
        other => {
            return Err(bad(
                path,
                format!("tensor {name} is {other:?}; kiln reads f32, bf16 and f16 weights"),
            ));
        }
    })
}

/// Every float tensor of the safetensors `files` (kiln's checkpoints or any other: f32, bf16
/// or f16), by name, as f32. Integer buffers (a BERT's `position_ids`) are no weights and are
/// skipped; any other type is refused.
pub(crate) fn read_safetensors(files: &[PathBuf]) -> Result<BTreeMap<String, HostTensor>> {
    let mut out = BTreeMap::new();
    for f in files {
        let file = std::fs::File::open(f).map_err(|e| bad(f, e.to_string()))?;
        // SAFETY: the map is read-only and lives only while this loop body reads it; a file
        // changed underneath by another process gives wrong numbers, never unsafety in kiln.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| bad(f, e.to_string()))?;
        let st = SafeTensors::deserialize(&map).map_err(|e| {
            bad(
                f,
                format!("is not a readable safetensors file ({e}); it may be truncated"),
            )
        })?;
        for (name, view) in st.tensors() {
            if matches!(
                view.dtype(),
                Dtype::I64 | Dtype::I32 | Dtype::I16 | Dtype::I8 | Dtype::U8 | Dtype::BOOL
            ) {
                continue;
            }
            let data = to_f32(f, &name, view.dtype(), view.data())?;
            out.insert(
                name,
                HostTensor {
                    shape: view.shape().to_vec(),
                    data,
                },
            );
        }
    }
    Ok(out)
}

/// The error for a config.json whose architecture kiln cannot import.
fn unsupported_architecture(cfg_path: &Path, arch: &str) -> KilnError {
    // Phi-3-small shares Phi-3's name but not its layers: block-sparse attention in alternate
    // layers, a GeGELU MLP and muP scalings, none of which kiln has.
    let why = if arch == "Phi3SmallForCausalLM" {
        " (Phi-3-small's block-sparse attention and GeGELU MLP are not Phi-3-mini's layers; \
         Phi-3-mini and Phi-3-medium directories, Phi3ForCausalLM, import)"
    } else {
        ""
    };
    bad(
        cfg_path,
        format!(
            "declares the architecture \"{arch}\", which kiln cannot import{why}; supported: {}",
            ARCHITECTURES.join(", ")
        ),
    )
}

fn open_hf_dir(dir: &Path) -> Result<Pretrained> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| {
        bad(
            &cfg_path,
            format!("cannot be read ({e}); a Hugging Face model directory has one"),
        )
    })?;
    let cfg: Value = serde_json::from_str(&text).map_err(|e| bad(&cfg_path, e.to_string()))?;
    let arch = architecture(&cfg).unwrap_or("").to_string();
    if super::bert::is_bert_architecture(&arch) {
        return Err(bad(
            &cfg_path,
            format!(
                "declares {arch}, an encoder: `kiln embed` and `kiln classify` read it; train, eval and generate need a decoder ({})",
                ARCHITECTURES.join(", ")
            ),
        ));
    }
    // Refused before a byte of the weights is read.
    if !ARCHITECTURES.contains(&arch.as_str()) {
        return Err(unsupported_architecture(&cfg_path, &arch));
    }
    let files = weight_files(dir)?;
    let tokenizer = HfTokenizer::from_dir(dir).map_err(|e| {
        bad(
            dir,
            format!("has no usable tokenizer ({e}); copy tokenizer.json beside config.json"),
        )
    })?;
    let raw = read_safetensors(&files)?;
    let mut longest_context = 0;
    let (model, vocab, weights) = match arch.as_str() {
        "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" | "Qwen3ForCausalLM"
        | "Phi3ForCausalLM" => {
            let (m, vocab, w, longest) = llama_from_hf(&cfg_path, &cfg, &arch, raw)?;
            longest_context = longest;
            (m, vocab, w)
        }
        "GPT2LMHeadModel" => gpt2_from_hf(&cfg_path, &cfg, raw)?,
        other => return Err(unsupported_architecture(&cfg_path, other)),
    };
    check_tokenizer(dir, &tokenizer, vocab)?;
    Ok(Pretrained {
        longest_context: longest_context.max(model.context),
        model,
        vocab,
        weights,
        tokenizer,
        source: Provenance {
            path: dir.to_path_buf(),
            format: "hf".into(),
            architecture: arch,
            sha256: BTreeMap::new(),
            files,
        },
    })
}

fn check_tokenizer(path: &Path, tok: &HfTokenizer, vocab: usize) -> Result<()> {
    if tok.vocab_size() > vocab {
        return Err(bad(
            path,
            format!(
                "its tokenizer has {} tokens but the model's embedding only {vocab} rows; the tokenizer belongs to another model",
                tok.vocab_size()
            ),
        ));
    }
    Ok(())
}

/// Takes tensor `name` out of `raw`, checking its shape.
pub(super) fn take(
    path: &Path,
    raw: &mut BTreeMap<String, HostTensor>,
    name: &str,
    shape: &[usize],
) -> Result<HostTensor> {
    let t = raw.remove(name).ok_or_else(|| {
        bad(
            path,
            format!(
                "has no tensor {name}; the checkpoint is incomplete or of another architecture"
            ),
        )
    })?;
    if t.shape != shape {
        return Err(bad(
            path,
            format!(
                "tensor {name} has shape {:?} but the configuration implies {shape:?}",
                t.shape
            ),
        ));
    }
    Ok(t)
}

/// Takes the tensors `names` (each with its row count, and the trailing dimensions `cols`)
/// and stacks them: the fused matrices kiln keeps (QKV, gate/up).
pub(super) fn take_stacked(
    path: &Path,
    raw: &mut BTreeMap<String, HostTensor>,
    names: &[(String, usize)],
    cols: &[usize],
) -> Result<HostTensor> {
    let parts = names
        .iter()
        .map(|(name, rows)| {
            let shape: Vec<usize> = std::iter::once(*rows).chain(cols.iter().copied()).collect();
            take(path, raw, name, &shape)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(concat_rows(parts))
}

/// Stacks tensors' rows: `[a; b; ...]` along the first dimension.
pub(super) fn concat_rows(parts: Vec<HostTensor>) -> HostTensor {
    let cols: usize = parts[0].shape[1..].iter().product();
    let rows: usize = parts.iter().map(|p| p.shape[0]).sum();
    let mut shape = parts[0].shape.clone();
    shape[0] = rows;
    let mut data = Vec::with_capacity(rows * cols);
    for p in parts {
        data.extend(p.data);
    }
    HostTensor { shape, data }
}

/// Zero rows appended up to `rows`.
fn pad_rows(mut t: HostTensor, rows: usize) -> HostTensor {
    let cols: usize = t.shape[1..].iter().product();
    t.data.resize(rows * cols, 0.0);
    t.shape[0] = rows;
    t
}

/// The transpose of a row-major `r x c` matrix (GPT-2's Conv1D `[in, out]` against kiln's
/// `[out, in]`, in both directions).
pub(crate) fn transposed(data: &[f32], r: usize, c: usize) -> Vec<f32> {
    let mut out = vec![0.0; r * c];
    for i in 0..r {
        for j in 0..c {
            out[j * r + i] = data[i * c + j];
        }
    }
    out
}

fn transpose(t: HostTensor) -> HostTensor {
    let (r, c) = (t.shape[0], t.shape[1]);
    HostTensor {
        shape: vec![c, r],
        data: transposed(&t.data, r, c),
    }
}

/// The sliding window of a Hugging Face decoder config and the layers that ignore it, as
/// transformers 5 reads them: Mistral attends within `sliding_window` on every layer (null:
/// none); Qwen2 and Qwen3 only with `use_sliding_window`, and then only from layer
/// `max_window_layers` on (or where `layer_types` says "sliding_attention"); Llama has no
/// window. A window covers `sliding_window` positions, the query's own included
/// (transformers' `kv_idx > q_idx - sliding_window`).
fn sliding_window_from_hf(
    path: &Path,
    cfg: &Value,
    arch: &str,
    n_layers: usize,
) -> Result<(usize, usize)> {
    let mistral = arch == "MistralForCausalLM";
    let qwen = matches!(arch, "Qwen2ForCausalLM" | "Qwen3ForCausalLM");
    if arch == "Phi3ForCausalLM" {
        // transformers' Phi-3 masks with its window whenever one is set (Phi-3-mini-4k:
        // 2047); one at least as long as the model's positions is full attention.
        let longest = json_usize(cfg, "max_position_embeddings").unwrap_or(4096);
        return Ok(match cfg.get("sliding_window") {
            None | Some(Value::Null) => (0, 0),
            Some(v) => match v.as_u64() {
                Some(w) if w as usize >= longest => (0, 0),
                Some(w) if w >= 1 => (w as usize, 0),
                _ => {
                    return Err(bad(
                        path,
                        format!(
                            "has \"sliding_window\": {v}; it must be a whole number of positions, at least 1, or null for full attention"
                        ),
                    ));
                }
            },
        });
    }
    let enabled = cfg
        .get("use_sliding_window")
        .and_then(Value::as_bool)
        .unwrap_or(mistral);
    if !(mistral || qwen) || !enabled {
        return Ok((0, 0));
    }
    let window = match cfg.get("sliding_window") {
        None | Some(Value::Null) if mistral => return Ok((0, 0)),
        Some(v) => v.as_u64().filter(|&w| w >= 1).map(|w| w as usize),
        None => None,
    };
    let Some(window) = window else {
        return Err(bad(
            path,
            format!(
                "turns sliding-window attention on but its \"sliding_window\" is {}; it must be a whole number of positions, at least 1 (set \"use_sliding_window\": false{} for full attention)",
                cfg.get("sliding_window")
                    .map_or("missing".to_string(), Value::to_string),
                if mistral {
                    " or \"sliding_window\": null"
                } else {
                    ""
                }
            ),
        ));
    };
    if window > crate::models::llama::MAX_SLIDING_WINDOW {
        return Err(bad(
            path,
            format!(
                "has \"sliding_window\": {window}, past the {} positions kiln takes; a window at least as long as the sequence is full attention: set \"sliding_window\": null",
                crate::models::llama::MAX_SLIDING_WINDOW
            ),
        ));
    }
    if mistral {
        return Ok((window, 0));
    }
    let full = match cfg.get("layer_types").and_then(Value::as_array) {
        Some(types) => {
            let kinds: Vec<&str> = types.iter().map(|t| t.as_str().unwrap_or("")).collect();
            let full = kinds.iter().take_while(|&&k| k == "full_attention").count();
            if kinds.len() != n_layers || kinds[full..].iter().any(|&k| k != "sliding_attention") {
                return Err(bad(
                    path,
                    format!(
                        "has \"layer_types\" {kinds:?}; kiln imports {n_layers} layers of full attention followed by sliding-window ones (Qwen2's max_window_layers), no other pattern"
                    ),
                ));
            }
            full
        }
        None => json_usize(cfg, "max_window_layers")
            .unwrap_or(28)
            .min(n_layers),
    };
    Ok(if full == n_layers {
        (0, 0)
    } else {
        (window, full)
    })
}

/// A Llama-family checkpoint's settings, vocabulary and weights under kiln's names, and the
/// longest context a run may ask of it (past its own only for LongRoPE).
#[allow(clippy::type_complexity)]
fn llama_from_hf(
    path: &Path,
    cfg: &Value,
    arch: &str,
    mut raw: BTreeMap<String, HostTensor>,
) -> Result<(ModelConfig, usize, BTreeMap<String, HostTensor>, usize)> {
    let phi3 = arch == "Phi3ForCausalLM";
    let d = need(path, "hidden_size", json_usize(cfg, "hidden_size"))?;
    let n_layers = need(
        path,
        "num_hidden_layers",
        json_usize(cfg, "num_hidden_layers"),
    )?;
    let n_heads = need(
        path,
        "num_attention_heads",
        json_usize(cfg, "num_attention_heads"),
    )?;
    let n_kv = json_usize(cfg, "num_key_value_heads").unwrap_or(n_heads);
    let head_dim = json_usize(cfg, "head_dim").unwrap_or(d / n_heads.max(1));
    let ffn = need(
        path,
        "intermediate_size",
        json_usize(cfg, "intermediate_size"),
    )?;
    let vocab = need(path, "vocab_size", json_usize(cfg, "vocab_size"))?;
    let mut context = json_usize(cfg, "max_position_embeddings").unwrap_or(2048);
    let longest_context = context;
    let (sliding_window, full_attention_layers) =
        sliding_window_from_hf(path, cfg, arch, n_layers)?;
    let tied = cfg
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    // transformers 5 saves the rotary settings in one `rope_parameters` object; earlier
    // versions wrote `rope_theta`, `rope_scaling` and `partial_rotary_factor` at the top.
    let rope = cfg.get("rope_parameters").filter(|r| r.is_object());
    let rope_f64 = |key: &str| json_f64(cfg, key).or_else(|| rope.and_then(|r| json_f64(r, key)));
    let partial = rope_f64("partial_rotary_factor").unwrap_or(1.0);
    let mut l = LlamaSettings {
        n_kv_heads: n_kv,
        head_dim,
        ffn_hidden: ffn,
        rope_theta: rope_f64("rope_theta").unwrap_or(10000.0),
        rot_dim: ((head_dim as f64 * partial) as usize) & !1,
        norm_eps: json_f64(cfg, "rms_norm_eps").unwrap_or(1e-6),
        qkv_bias: arch == "Qwen2ForCausalLM"
            || cfg
                .get("attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        qk_norm: arch == "Qwen3ForCausalLM",
        sliding_window,
        full_attention_layers,
        checkpoint_arch: if phi3 { "phi3".into() } else { String::new() },
        ..LlamaSettings::default()
    };
    if let Some(s) = cfg.get("rope_scaling").filter(|s| !s.is_null()).or(rope) {
        let kind = s
            .get("rope_type")
            .or_else(|| s.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("");
        if !matches!(kind, "llama3" | "longrope" | "default" | "") {
            return Err(bad(
                path,
                format!(
                    "uses rope_scaling type \"{kind}\"; kiln implements Llama 3's (\"llama3\") and LongRoPE (\"longrope\") only"
                ),
            ));
        }
        if kind == "longrope" {
            let original = json_usize(s, "original_max_position_embeddings")
                .or_else(|| json_usize(cfg, "original_max_position_embeddings"))
                .unwrap_or(context);
            let factors = |key: &str| -> Result<Vec<f64>> {
                let list = s.get(key).and_then(Value::as_array).ok_or_else(|| {
                    bad(
                        path,
                        format!("uses LongRoPE but has no rope_scaling.{key} list"),
                    )
                })?;
                list.iter()
                    .map(|v| {
                        v.as_f64().ok_or_else(|| {
                            bad(
                                path,
                                format!("has a rope_scaling.{key} entry {v} that is not a number"),
                            )
                        })
                    })
                    .collect()
            };
            l.rope_short_factors = factors("short_factor")?;
            l.rope_long_factors = factors("long_factor")?;
            l.rope_original_context = original;
            // transformers' rule: the attention factor given, or from the stretch of the
            // context (the `factor` given, or max_position_embeddings over the original).
            let stretch = json_f64(s, "factor").unwrap_or(context as f64 / original as f64);
            l.rope_attention_factor = json_f64(s, "attention_factor")
                .unwrap_or_else(|| longrope_attention_factor(stretch, original));
            // Imported at the context its short factors serve, the most positions a
            // sequence has before transformers switches to the long factors; a run may ask
            // for more (model.context), and then passes longer than the trained context take
            // the long factors. Exports state the longest again.
            l.rope_longest_context = context;
            context = context.min(original);
        }
        if kind == "llama3" {
            l.rope_scaling_factor = need(path, "rope_scaling.factor", json_f64(s, "factor"))?;
            l.rope_low_freq_factor = json_f64(s, "low_freq_factor").unwrap_or(1.0);
            l.rope_high_freq_factor = json_f64(s, "high_freq_factor").unwrap_or(4.0);
            l.rope_original_context =
                json_usize(s, "original_max_position_embeddings").unwrap_or(8192);
        }
    }
    let (qkv_bias, qk_norm) = (l.qkv_bias, l.qk_norm);
    let m = ModelConfig {
        family: FamilySettings::Llama(l),
        d_model: d,
        n_layers,
        n_heads,
        context,
        tied_head: tied,
        ..ModelConfig::default()
    };
    let qd = n_heads * head_dim;
    let kvd = n_kv * head_dim;
    let padded = padded_vocab(vocab);
    let mut w = BTreeMap::new();
    w.insert(
        "embed.weight".into(),
        pad_rows(
            take(path, &mut raw, "model.embed_tokens.weight", &[vocab, d])?,
            padded,
        ),
    );
    for l in 0..n_layers {
        let p = format!("model.layers.{l}");
        let k = format!("layers.{l}");
        w.insert(
            format!("{k}.ln1.weight"),
            take(path, &mut raw, &format!("{p}.input_layernorm.weight"), &[d])?,
        );
        let qkv = |part: &str| -> Vec<(String, usize)> {
            [("q", qd), ("k", kvd), ("v", kvd)]
                .map(|(x, rows)| (format!("{p}.self_attn.{x}_proj.{part}"), rows))
                .to_vec()
        };
        // Phi-3 stores the query/key/value and gate/up projections fused, in kiln's order.
        let qkv_weight = if phi3 {
            take(
                path,
                &mut raw,
                &format!("{p}.self_attn.qkv_proj.weight"),
                &[qd + 2 * kvd, d],
            )?
        } else {
            take_stacked(path, &mut raw, &qkv("weight"), &[d])?
        };
        w.insert(format!("{k}.attn.qkv.weight"), qkv_weight);
        if qkv_bias {
            w.insert(
                format!("{k}.attn.qkv.bias"),
                take_stacked(path, &mut raw, &qkv("bias"), &[])?,
            );
        }
        if qk_norm {
            for x in ["q", "k"] {
                w.insert(
                    format!("{k}.attn.{x}_norm.weight"),
                    take(
                        path,
                        &mut raw,
                        &format!("{p}.self_attn.{x}_norm.weight"),
                        &[head_dim],
                    )?,
                );
            }
        }
        w.insert(
            format!("{k}.attn.out.weight"),
            take(
                path,
                &mut raw,
                &format!("{p}.self_attn.o_proj.weight"),
                &[d, qd],
            )?,
        );
        w.insert(
            format!("{k}.ln2.weight"),
            take(
                path,
                &mut raw,
                &format!("{p}.post_attention_layernorm.weight"),
                &[d],
            )?,
        );
        let gate_up = [("gate", ffn), ("up", ffn)]
            .map(|(x, rows)| (format!("{p}.mlp.{x}_proj.weight"), rows));
        let gate_up_weight = if phi3 {
            take(
                path,
                &mut raw,
                &format!("{p}.mlp.gate_up_proj.weight"),
                &[2 * ffn, d],
            )?
        } else {
            take_stacked(path, &mut raw, &gate_up, &[d])?
        };
        w.insert(format!("{k}.mlp.gate_up.weight"), gate_up_weight);
        w.insert(
            format!("{k}.mlp.down.weight"),
            take(
                path,
                &mut raw,
                &format!("{p}.mlp.down_proj.weight"),
                &[d, ffn],
            )?,
        );
    }
    w.insert(
        "ln_f.weight".into(),
        take(path, &mut raw, "model.norm.weight", &[d])?,
    );
    if !tied {
        w.insert(
            "lm_head.weight".into(),
            pad_rows(take(path, &mut raw, "lm_head.weight", &[vocab, d])?, padded),
        );
    }
    Ok((m, vocab, w, longest_context))
}

fn gpt2_from_hf(
    path: &Path,
    cfg: &Value,
    mut raw: BTreeMap<String, HostTensor>,
) -> Result<(ModelConfig, usize, BTreeMap<String, HostTensor>)> {
    let d = need(path, "n_embd", json_usize(cfg, "n_embd"))?;
    let n_layers = need(path, "n_layer", json_usize(cfg, "n_layer"))?;
    let n_heads = need(path, "n_head", json_usize(cfg, "n_head"))?;
    let vocab = need(path, "vocab_size", json_usize(cfg, "vocab_size"))?;
    let context = need(path, "n_positions", json_usize(cfg, "n_positions"))?;
    // transformers saves GPT-2 either with or without the `transformer.` prefix.
    let prefix = if raw.contains_key("transformer.wte.weight") {
        "transformer."
    } else {
        ""
    };
    let m = ModelConfig {
        family: FamilySettings::Gpt,
        d_model: d,
        n_layers,
        n_heads,
        context,
        tied_head: true,
        ..ModelConfig::default()
    };
    let padded = padded_vocab(vocab);
    let mut w = BTreeMap::new();
    let mut get =
        |name: &str, shape: &[usize]| take(path, &mut raw, &format!("{prefix}{name}"), shape);
    w.insert(
        "wte.weight".to_string(),
        pad_rows(get("wte.weight", &[vocab, d])?, padded),
    );
    w.insert("wpe.weight".to_string(), get("wpe.weight", &[context, d])?);
    for l in 0..n_layers {
        let (p, k) = (format!("h.{l}"), format!("blocks.{l}"));
        // Conv1D stores `[in, out]`; kiln's linear layers store `[out, in]`.
        for (hf, kiln, shape) in [
            ("attn.c_attn", "attn.qkv", [d, 3 * d]),
            ("attn.c_proj", "attn.proj", [d, d]),
            ("mlp.c_fc", "mlp.fc", [d, 4 * d]),
            ("mlp.c_proj", "mlp.proj", [4 * d, d]),
        ] {
            w.insert(
                format!("{k}.{kiln}.weight"),
                transpose(get(&format!("{p}.{hf}.weight"), &shape)?),
            );
            w.insert(
                format!("{k}.{kiln}.bias"),
                get(&format!("{p}.{hf}.bias"), &[shape[1]])?,
            );
        }
        for (hf, kiln) in [("ln_1", "ln1"), ("ln_2", "ln2")] {
            w.insert(
                format!("{k}.{kiln}.weight"),
                get(&format!("{p}.{hf}.weight"), &[d])?,
            );
            w.insert(
                format!("{k}.{kiln}.bias"),
                get(&format!("{p}.{hf}.bias"), &[d])?,
            );
        }
    }
    w.insert("ln_f.weight".to_string(), get("ln_f.weight", &[d])?);
    w.insert("ln_f.bias".to_string(), get("ln_f.bias", &[d])?);
    Ok((m, vocab, w))
}

// ---------- GGUF ----------

/// Puts a GGUF query or key matrix `[heads * D, C]` back in Hugging Face's row order: the
/// converter moved row `i + D/2` of each head next to row `i` (interleaved rotary pairs).
fn unpermute_rotary_rows(t: HostTensor, heads: usize) -> HostTensor {
    let (rows, cols) = (t.shape[0], t.shape[1]);
    let d = rows / heads;
    let half = d / 2;
    let mut data = vec![0.0; rows * cols];
    for h in 0..heads {
        for i in 0..half {
            for (j, src_pair) in [(i, 2 * i), (i + half, 2 * i + 1)] {
                let src = (h * d + src_pair) * cols;
                let dst = (h * d + j) * cols;
                data[dst..dst + cols].copy_from_slice(&t.data[src..src + cols]);
            }
        }
    }
    HostTensor {
        shape: t.shape,
        data,
    }
}

/// The GGUF tensor of per-pair rotary divisors (llama.cpp's form of Llama 3's scaling: pair
/// `i` turns at `theta^(-2i/rot) / divisor[i]`).
pub(crate) const ROPE_FREQS: &str = "rope_freqs.weight";
/// Phi-3's LongRoPE factors in a GGUF file, one a rotated pair.
pub(crate) const ROPE_FACTORS_LONG: &str = "rope_factors_long.weight";
pub(crate) const ROPE_FACTORS_SHORT: &str = "rope_factors_short.weight";

/// The Llama 3 scaling whose divisors are `table`, or `None` for a table of ones.
///
/// The divisor is 1 for short wavelengths, `factor` for long ones and blends between, where
/// `1/divisor = (1 - s)/factor + s` with `s = (old/wavelength - low)/(high - low)`, linear in
/// `1/wavelength`. The blend fixes `old/(high - low)` and `low/(high - low)`, not `old` itself
/// (scaling all three changes nothing), so `old` is taken as Llama 3's 8192 and `low` and
/// `high` follow from the blend's two outermost pairs; with fewer than two blended pairs Llama
/// 3's own values (1, 4, 8192) are tried. The answer is checked against every entry.
pub(crate) fn llama3_scaling_from_divisors(
    theta: f32,
    rot_dim: usize,
    table: &[f32],
) -> std::result::Result<Option<crate::engine::cpu::rope::Llama3Scaling>, String> {
    use crate::engine::cpu::rope::{Llama3Scaling, inverse_frequencies};
    if let Some(bad) = table.iter().find(|v| !(v.is_finite() && **v >= 1.0 - 1e-6)) {
        return Err(format!(
            "holds {bad}; Llama 3's divisors are finite and at least 1"
        ));
    }
    let largest = table.iter().copied().fold(1.0f32, f32::max);
    if largest <= 1.0 + 1e-6 {
        return Ok(None);
    }
    let base = inverse_frequencies(theta, rot_dim, None);
    let old = 8192usize;
    // The factor is the largest divisor when some pair lies past the blend; when every long
    // pair is still blending it is not in the table, so Llama 3's usual factors are tried.
    let mut last_err = String::new();
    for factor in [largest, 8.0, 16.0, 32.0, 4.0, 2.0, 64.0] {
        if factor < largest {
            continue;
        }
        let blended: Vec<(f32, f32)> = table
            .iter()
            .zip(&base)
            .filter(|(r, _)| **r > 1.0 + 1e-4 && **r < factor * (1.0 - 1e-4))
            .map(|(r, f)| {
                let s = (1.0 / r - 1.0 / factor) / (1.0 - 1.0 / factor);
                (f / (2.0 * std::f32::consts::PI), s)
            })
            .collect();
        let (low, high) = match (blended.first(), blended.last()) {
            (Some(&(x0, s0)), Some(&(x1, s1))) if blended.len() >= 2 && x0 != x1 => {
                // s = a x - b with a = old/(high - low), b = low/(high - low).
                let a = (s1 - s0) / (x1 - x0);
                let b = a * x0 - s0;
                let span = old as f32 / a;
                (b * span, b * span + span)
            }
            _ => (1.0, 4.0),
        };
        let s = Llama3Scaling {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_context: old,
        };
        let scaled = inverse_frequencies(theta, rot_dim, Some(s));
        let mismatch = base
            .iter()
            .zip(table)
            .zip(&scaled)
            .enumerate()
            .find(|(_, ((f, r), got))| (*got - *f / *r).abs() > 1e-4 * (*f / *r).abs());
        match mismatch {
            None => return Ok(Some(s)),
            Some((i, ((f, r), got))) if last_err.is_empty() => {
                last_err = format!(
                    "is not Llama 3's frequency scaling (pair {i}: divisor {r}, where the closest Llama 3 scaling, factor {factor}, low {low}, high {high}, original context {old}, gives {}); kiln implements Llama 3's scaling only",
                    f / got
                );
            }
            Some(_) => {}
        }
    }
    Err(last_err)
}

/// GGUF architectures kiln imports: llama.cpp's names for the Llama family.
const GGUF_ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3", "phi3"];

/// A Llama-family GGUF file (`general.architecture` llama, qwen2 or qwen3), metadata under
/// `<arch>.*`. llama.cpp's converter interleaves the rotary halves of llama's query and key
/// rows (its rotation pairs neighbours) and leaves qwen2's and qwen3's as Hugging Face has
/// them (its NEOX rotation pairs halves, as kiln's does), so only llama's are put back. Qwen2
/// brings query, key and value biases, Qwen3 per-head query and key norms (`attn_q_norm`,
/// `attn_k_norm`) and a head width of its own (`attention.key_length`). Phi-3 keeps its
/// projections fused (`attn_qkv`, and gate and up in one `ffn_up`) and LongRoPE's factors as
/// `rope_factors_short` / `rope_factors_long` with `rope.scaling.*` metadata. llama.cpp runs
/// these files with full attention (Phi-3's window included), so a GGUF import has no
/// sliding window.
fn open_gguf(path: &Path) -> Result<Pretrained> {
    let g = GgufFile::open(path)?;
    let arch = g.get_str("general.architecture").unwrap_or("").to_string();
    if !GGUF_ARCHITECTURES.contains(&arch.as_str()) {
        return Err(bad(
            path,
            format!(
                "is a GGUF file of architecture \"{arch}\"; kiln imports: {}",
                ARCHITECTURES.join(", ")
            ),
        ));
    }
    let key = |k: &str| format!("{arch}.{k}");
    let meta_usize = |k: &str| -> Result<usize> {
        g.get_u64(&key(k))
            .map(|v| v as usize)
            .ok_or_else(|| bad(path, format!("has no metadata {}", key(k))))
    };
    let d = meta_usize("embedding_length")?;
    let n_layers = meta_usize("block_count")?;
    let n_heads = meta_usize("attention.head_count")?;
    let n_kv = g
        .get_u64(&key("attention.head_count_kv"))
        .map_or(n_heads, |v| v as usize);
    let ffn = meta_usize("feed_forward_length")?;
    let context = meta_usize("context_length")?;
    let head_dim = g
        .get_u64(&key("attention.key_length"))
        .map_or(d / n_heads.max(1), |v| v as usize);
    if let Some(v) = g.get_u64(&key("attention.value_length"))
        && v as usize != head_dim
    {
        return Err(bad(
            path,
            format!(
                "has values of {v} dimensions per head and keys of {head_dim}; kiln's attention needs them equal"
            ),
        ));
    }
    let tokenizer = HfTokenizer::from_gguf(&g)
        .map_err(|e| bad(path, format!("has no usable tokenizer: {e}")))?;
    let read = |name: &str, shape: &[usize]| -> Result<HostTensor> {
        let (s, data) = g.tensor_f32(name)?;
        if s != shape {
            return Err(bad(
                path,
                format!("tensor {name} has shape {s:?} but the metadata implies {shape:?}"),
            ));
        }
        Ok(HostTensor { shape: s, data })
    };
    let embed = {
        let (s, data) = g.tensor_f32("token_embd.weight")?;
        HostTensor { shape: s, data }
    };
    let vocab = embed.shape[0];
    if embed.shape != [vocab, d] {
        return Err(bad(
            path,
            format!(
                "token_embd.weight has shape {:?}, expected [vocab, {d}]",
                embed.shape
            ),
        ));
    }
    let has = |name: &str| g.tensor_names().any(|n| n == name);
    let has_output = has("output.weight");
    let phi3 = arch == "phi3";
    let fused_qkv = has("blk.0.attn_qkv.weight");
    let qkv_bias = has("blk.0.attn_q.bias");
    let qk_norm = has("blk.0.attn_q_norm.weight");
    if arch == "qwen2" && !qkv_bias {
        return Err(bad(
            path,
            "is a qwen2 GGUF without query/key/value biases (blk.0.attn_q.bias); the file is incomplete",
        ));
    }
    if arch == "qwen3" && !qk_norm {
        return Err(bad(
            path,
            "is a qwen3 GGUF without query/key norms (blk.0.attn_q_norm.weight); the file is incomplete",
        ));
    }
    let mut l = LlamaSettings {
        n_kv_heads: n_kv,
        head_dim,
        ffn_hidden: ffn,
        rope_theta: g.get_f64(&key("rope.freq_base")).unwrap_or(10000.0),
        rot_dim: g
            .get_u64(&key("rope.dimension_count"))
            .map_or(head_dim, |v| v as usize),
        norm_eps: g
            .get_f64(&key("attention.layer_norm_rms_epsilon"))
            .unwrap_or(1e-5),
        qkv_bias,
        qk_norm,
        checkpoint_arch: if phi3 { "phi3".into() } else { String::new() },
        ..LlamaSettings::default()
    };
    let mut context = context;
    let longest_context = context;
    if phi3 && has(ROPE_FACTORS_LONG) {
        let pairs = [l.rot_dim / 2];
        l.rope_long_factors = read(ROPE_FACTORS_LONG, &pairs)?
            .data
            .iter()
            .map(|&v| v as f64)
            .collect();
        l.rope_short_factors = read(ROPE_FACTORS_SHORT, &pairs)?
            .data
            .iter()
            .map(|&v| v as f64)
            .collect();
        let original = meta_usize("rope.scaling.original_context_length")?;
        l.rope_original_context = original;
        // llama.cpp's converter stores the factor it derives from the stretch of the context.
        l.rope_attention_factor =
            g.get_f64(&key("rope.scaling.attn_factor"))
                .unwrap_or_else(|| {
                    longrope_attention_factor(context as f64 / original as f64, original)
                });
        l.rope_longest_context = context;
        context = context.min(original);
    }
    // Llama 3.1 and later carry their frequency scaling as a table of per-pair divisors.
    if has(ROPE_FREQS) {
        let (shape, table) = g.tensor_f32(ROPE_FREQS)?;
        if shape != [l.rot_dim / 2] {
            return Err(bad(
                path,
                format!(
                    "tensor {ROPE_FREQS} has shape {shape:?}; one divisor per rotary pair is {:?}",
                    [l.rot_dim / 2]
                ),
            ));
        }
        if let Some(s) = llama3_scaling_from_divisors(l.rope_theta as f32, l.rot_dim, &table)
            .map_err(|e| bad(path, format!("has a {ROPE_FREQS} table that {e}")))?
        {
            l.rope_scaling_factor = s.factor as f64;
            l.rope_low_freq_factor = s.low_freq_factor as f64;
            l.rope_high_freq_factor = s.high_freq_factor as f64;
            l.rope_original_context = s.original_context;
        }
    }
    let m = ModelConfig {
        family: FamilySettings::Llama(l),
        d_model: d,
        n_layers,
        n_heads,
        context,
        tied_head: !has_output,
        ..ModelConfig::default()
    };
    // llama's query and key rows (and their biases, if any) come interleaved.
    let interleaved = arch == "llama";
    let rotary_rows = |t: HostTensor, heads: usize| {
        if !interleaved {
            return t;
        }
        let shape = t.shape.clone();
        let cols: usize = shape[1..].iter().product();
        let rows = HostTensor {
            shape: vec![shape[0], cols],
            data: t.data,
        };
        HostTensor {
            shape,
            data: unpermute_rotary_rows(rows, heads).data,
        }
    };
    let (qd, kvd) = (n_heads * head_dim, n_kv * head_dim);
    let padded = padded_vocab(vocab);
    let mut w = BTreeMap::new();
    w.insert("embed.weight".to_string(), pad_rows(embed, padded));
    for l in 0..n_layers {
        let (p, k) = (format!("blk.{l}"), format!("layers.{l}"));
        w.insert(
            format!("{k}.ln1.weight"),
            read(&format!("{p}.attn_norm.weight"), &[d])?,
        );
        let qkv = |part: &str, cols: &[usize]| -> Result<HostTensor> {
            if fused_qkv {
                let shape: Vec<usize> = std::iter::once(qd + 2 * kvd)
                    .chain(cols.iter().copied())
                    .collect();
                return read(&format!("{p}.attn_qkv.{part}"), &shape);
            }
            let shape = |rows: usize| -> Vec<usize> {
                std::iter::once(rows).chain(cols.iter().copied()).collect()
            };
            let q = read(&format!("{p}.attn_q.{part}"), &shape(qd))?;
            let kk = read(&format!("{p}.attn_k.{part}"), &shape(kvd))?;
            let v = read(&format!("{p}.attn_v.{part}"), &shape(kvd))?;
            Ok(concat_rows(vec![
                rotary_rows(q, n_heads),
                rotary_rows(kk, n_kv),
                v,
            ]))
        };
        w.insert(format!("{k}.attn.qkv.weight"), qkv("weight", &[d])?);
        if qkv_bias {
            w.insert(format!("{k}.attn.qkv.bias"), qkv("bias", &[])?);
        }
        if qk_norm {
            for x in ["q", "k"] {
                w.insert(
                    format!("{k}.attn.{x}_norm.weight"),
                    read(&format!("{p}.attn_{x}_norm.weight"), &[head_dim])?,
                );
            }
        }
        w.insert(
            format!("{k}.attn.out.weight"),
            read(&format!("{p}.attn_output.weight"), &[d, qd])?,
        );
        w.insert(
            format!("{k}.ln2.weight"),
            read(&format!("{p}.ffn_norm.weight"), &[d])?,
        );
        let gate_up = if phi3 {
            // gate then up, in one tensor of twice the rows.
            read(&format!("{p}.ffn_up.weight"), &[2 * ffn, d])?
        } else {
            let gate = read(&format!("{p}.ffn_gate.weight"), &[ffn, d])?;
            let up = read(&format!("{p}.ffn_up.weight"), &[ffn, d])?;
            concat_rows(vec![gate, up])
        };
        w.insert(format!("{k}.mlp.gate_up.weight"), gate_up);
        w.insert(
            format!("{k}.mlp.down.weight"),
            read(&format!("{p}.ffn_down.weight"), &[d, ffn])?,
        );
    }
    w.insert("ln_f.weight".to_string(), read("output_norm.weight", &[d])?);
    if has_output {
        w.insert(
            "lm_head.weight".to_string(),
            pad_rows(read("output.weight", &[vocab, d])?, padded),
        );
    }
    check_tokenizer(path, &tokenizer, vocab)?;
    Ok(Pretrained {
        longest_context: longest_context.max(m.context),
        model: m,
        vocab,
        weights: w,
        tokenizer,
        source: Provenance {
            path: path.to_path_buf(),
            format: "gguf".into(),
            architecture: arch,
            sha256: BTreeMap::new(),
            files: vec![path.to_path_buf()],
        },
    })
}

impl Provenance {
    /// Fills `sha256` with the hash of every weight file.
    pub fn hash_files(&mut self) -> Result<()> {
        for f in &self.files {
            let name = f
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            self.sha256.insert(name, sha256_file(f)?);
        }
        Ok(())
    }
}

impl Pretrained {
    /// The model built on the CPU with these weights (fp32), for evaluation and generation.
    pub fn build_on_cpu(&self) -> Result<Box<dyn Model>> {
        let pool = crate::engine::MemoryPool::new(crate::engine::Device::Cpu);
        self.build(&pool)
    }

    /// The model with these weights in `pool`, computing in f32.
    pub fn build(&self, pool: &Arc<MemoryPool>) -> Result<Box<dyn Model>> {
        let (m, vocab, path) = (&self.model, self.vocab, &self.source.path);
        crate::models::load(m, vocab, pool, &self.weights, path)
    }

    /// The `KEY=VALUE` settings that describe this model to a run: its shape, its vocabulary
    /// and its tokenizer (the checkpoint's own, by path).
    pub fn overrides(&self) -> Vec<String> {
        let m = &self.model;
        let mut v = vec![
            format!("model.kind={}", m.kind()),
            format!("model.d_model={}", m.d_model),
            format!("model.n_layers={}", m.n_layers),
            format!("model.n_heads={}", m.n_heads),
            format!("model.context={}", m.context),
            format!("model.tied_head={}", m.tied_head),
            format!("model.vocab={}", self.vocab),
            format!("data.tokenizer={}", self.source.path.display()),
        ];
        // A model whose context is shorter than the default sequence length (a small test
        // model) trains and evaluates on sequences of its whole context.
        let default_seq = crate::config::TrainConfig::default().seq_len;
        if m.context < default_seq {
            v.push(format!("train.seq_len={}", m.context));
        }
        if let Some(l) = m.llama() {
            v.extend([
                format!("model.n_kv_heads={}", l.n_kv_heads),
                format!("model.head_dim={}", l.head_dim),
                format!("model.ffn_hidden={}", l.ffn_hidden),
                format!("model.rope_theta={:?}", l.rope_theta),
                format!("model.rot_dim={}", l.rot_dim),
                format!("model.rope_scaling_factor={:?}", l.rope_scaling_factor),
                format!("model.rope_low_freq_factor={:?}", l.rope_low_freq_factor),
                format!("model.rope_high_freq_factor={:?}", l.rope_high_freq_factor),
                format!("model.rope_original_context={}", l.rope_original_context),
                format!("model.norm_eps={:?}", l.norm_eps),
                format!("model.qkv_bias={}", l.qkv_bias),
                format!("model.qk_norm={}", l.qk_norm),
                format!("model.sliding_window={}", l.sliding_window),
                format!("model.full_attention_layers={}", l.full_attention_layers),
                format!(
                    "model.rope_short_factors={}",
                    float_list(&l.rope_short_factors)
                ),
                format!(
                    "model.rope_long_factors={}",
                    float_list(&l.rope_long_factors)
                ),
                format!("model.rope_attention_factor={:?}", l.rope_attention_factor),
                format!("model.rope_longest_context={}", l.rope_longest_context),
                format!("model.checkpoint_arch={}", l.checkpoint_arch),
            ]);
        }
        v
    }

    /// Refuses user settings that contradict the imported model: any `model.*` key but a
    /// shorter `model.context`, and another `data.tokenizer`.
    pub fn check_overrides(&self, user: &[String]) -> Result<()> {
        for o in user {
            let Some((key, value)) = o.split_once('=') else {
                continue;
            };
            let key = key.trim();
            let contradicts = if key == "model.context" {
                value
                    .trim()
                    .parse::<usize>()
                    .map_or(true, |c| c > self.longest_context)
            } else {
                key.starts_with("model.") || key == "data.tokenizer"
            };
            if contradicts {
                return Err(KilnError::Setting(format!(
                    "{o} contradicts --init-from {}, which sets the model's shape and tokenizer itself; drop it (model.context may be at most {})",
                    self.source.path.display(),
                    self.longest_context
                )));
            }
        }
        Ok(())
    }
}

/// LongRoPE's attention factor for a context stretched `stretch` times past the `original`
/// one it was trained for: sqrt(1 + ln(stretch) / ln(original)), 1 for no stretch (the rule of
/// transformers and of llama.cpp's converter).
fn longrope_attention_factor(stretch: f64, original: usize) -> f64 {
    if stretch <= 1.0 {
        1.0
    } else {
        (1.0 + stretch.ln() / (original as f64).ln()).sqrt()
    }
}

/// A list of numbers as a `KEY=VALUE` override writes it: `[1.0, 1.5]`, each value exact.
fn float_list(v: &[f64]) -> String {
    let items: Vec<String> = v.iter().map(|x| format!("{x:?}")).collect();
    format!("[{}]", items.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An architecture kiln cannot import is refused from config.json alone, before any
    /// weights or tokenizer are read (this directory has neither), naming what imports;
    /// Phi-3-small's refusal says how it differs from the Phi-3 kiln reads.
    #[test]
    fn an_unsupported_architecture_is_refused_before_the_weights() {
        let dir = tempfile::tempdir().unwrap();
        for (arch, extra) in [
            ("Phi3SmallForCausalLM", "block-sparse attention"),
            ("FalconForCausalLM", "supported: LlamaForCausalLM"),
        ] {
            std::fs::write(
                dir.path().join("config.json"),
                format!(r#"{{"architectures": ["{arch}"], "hidden_size": 64}}"#),
            )
            .unwrap();
            let e = open_hf_dir(dir.path()).err().unwrap().to_string();
            assert!(
                e.contains(&format!("\"{arch}\", which kiln cannot import")),
                "{e}"
            );
            assert!(e.contains(extra) && e.contains("Phi3ForCausalLM"), "{e}");
        }
    }

    /// Interleaving each head's halves (what llama.cpp's converter does) and undoing it
    /// gives back the original rows.
    /// llama.cpp's converter writes Llama 3's scaling as divisors `base / scaled`; reading
    /// them back gives a scaling with the same frequencies, and a table that no Llama 3
    /// scaling makes is refused.
    #[test]
    fn llama3_divisor_tables_give_back_their_scaling() {
        use crate::engine::cpu::rope::{Llama3Scaling, inverse_frequencies};
        for (theta, rot, factor) in [
            (500000.0f32, 64, 32.0f32),
            (500000.0, 128, 8.0),
            (1e4, 64, 4.0),
        ] {
            let want = Llama3Scaling {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context: 8192,
            };
            let base = inverse_frequencies(theta, rot, None);
            let scaled = inverse_frequencies(theta, rot, Some(want));
            let table: Vec<f32> = base.iter().zip(&scaled).map(|(b, s)| b / s).collect();
            let got = llama3_scaling_from_divisors(theta, rot, &table)
                .unwrap()
                .unwrap();
            assert_eq!(got.factor, factor);
            for (a, b) in inverse_frequencies(theta, rot, Some(got))
                .iter()
                .zip(&scaled)
            {
                assert!((a - b).abs() <= 1e-5 * b, "{theta} {rot}: {a} vs {b}");
            }
        }
        assert_eq!(
            llama3_scaling_from_divisors(1e4, 64, &[1.0; 32]).unwrap(),
            None
        );
        let mut odd = vec![1.0f32; 32];
        odd[3] = 5.0; // a lone long divisor among short wavelengths
        odd[31] = 8.0;
        let e = llama3_scaling_from_divisors(1e4, 64, &odd).unwrap_err();
        assert!(e.contains("not Llama 3's frequency scaling"), "{e}");
        let e = llama3_scaling_from_divisors(1e4, 64, &[0.5; 32]).unwrap_err();
        assert!(e.contains("at least 1"), "{e}");
    }

    #[test]
    fn unpermuting_inverts_the_gguf_interleave() {
        let (heads, d, cols) = (3, 8, 2);
        let rows = heads * d;
        let orig: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
        let mut permuted = vec![0.0; orig.len()];
        for h in 0..heads {
            for i in 0..d / 2 {
                for (pair, src) in [(2 * i, i), (2 * i + 1, i + d / 2)] {
                    let (s, t) = ((h * d + src) * cols, (h * d + pair) * cols);
                    permuted[t..t + cols].copy_from_slice(&orig[s..s + cols]);
                }
            }
        }
        let back = unpermute_rotary_rows(
            HostTensor {
                shape: vec![rows, cols],
                data: permuted,
            },
            heads,
        );
        assert_eq!(back.data, orig);
    }

    /// A tiny Qwen2 or Qwen3 checkpoint: its tensors under Hugging Face names, random.
    struct TinyQwen {
        qwen3: bool,
        cfg: Value,
        hf: BTreeMap<String, HostTensor>,
    }

    impl TinyQwen {
        /// Qwen3: per-head norms, a head width (16) other than width / heads (8), a tied
        /// head. Qwen2: QKV biases, heads of width / heads, an untied head.
        fn new(qwen3: bool) -> TinyQwen {
            let (d, layers, heads, kv, ffn, vocab) = (32, 2, 4, 2, 48, 40);
            let hd = if qwen3 { 16 } else { d / heads };
            let mut rng = crate::engine::rng::Rng::new(7, crate::engine::rng::stream::INIT);
            let mut hf = BTreeMap::new();
            let mut put = |name: String, shape: Vec<usize>, center: f32| {
                let n = shape.iter().product();
                let data = (0..n)
                    .map(|_| center + 0.4 * (rng.next_f32() - 0.5))
                    .collect();
                hf.insert(name, HostTensor { shape, data });
            };
            put("model.embed_tokens.weight".into(), vec![vocab, d], 0.0);
            put("model.norm.weight".into(), vec![d], 1.0);
            if !qwen3 {
                put("lm_head.weight".into(), vec![vocab, d], 0.0);
            }
            for l in 0..layers {
                let p = format!("model.layers.{l}");
                put(format!("{p}.input_layernorm.weight"), vec![d], 1.0);
                put(format!("{p}.post_attention_layernorm.weight"), vec![d], 1.0);
                for (x, rows) in [("q", heads * hd), ("k", kv * hd), ("v", kv * hd)] {
                    put(format!("{p}.self_attn.{x}_proj.weight"), vec![rows, d], 0.0);
                    if !qwen3 {
                        put(format!("{p}.self_attn.{x}_proj.bias"), vec![rows], 0.0);
                    }
                }
                if qwen3 {
                    put(format!("{p}.self_attn.q_norm.weight"), vec![hd], 1.0);
                    put(format!("{p}.self_attn.k_norm.weight"), vec![hd], 1.0);
                }
                put(
                    format!("{p}.self_attn.o_proj.weight"),
                    vec![d, heads * hd],
                    0.0,
                );
                put(format!("{p}.mlp.gate_proj.weight"), vec![ffn, d], 0.0);
                put(format!("{p}.mlp.up_proj.weight"), vec![ffn, d], 0.0);
                put(format!("{p}.mlp.down_proj.weight"), vec![d, ffn], 0.0);
            }
            let cfg = serde_json::json!({
                "architectures": [if qwen3 { "Qwen3ForCausalLM" } else { "Qwen2ForCausalLM" }],
                "hidden_size": d, "num_hidden_layers": layers, "num_attention_heads": heads,
                "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": ffn,
                "vocab_size": vocab, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0, "tie_word_embeddings": qwen3,
            });
            TinyQwen { qwen3, cfg, hf }
        }

        /// The same weights as llama.cpp's converter writes them: GGUF names, rows as Hugging
        /// Face has them, f32, `qwen2.*` / `qwen3.*` metadata and a small byte-level BPE
        /// vocabulary.
        fn gguf(&self, dir: &Path) -> PathBuf {
            use crate::data::gguf::GgufValue as V;
            use crate::data::gguf::writer::{Tensor, gguf_bytes};
            let arch = if self.qwen3 { "qwen3" } else { "qwen2" };
            let c = &self.cfg;
            let u = |k: &str| V::U32(c[k].as_u64().unwrap() as u32);
            let key = |k: &str| format!("{arch}.{k}");
            let keys: Vec<(String, V)> = vec![
                ("general.architecture".into(), V::String(arch.into())),
                (key("embedding_length"), u("hidden_size")),
                (key("block_count"), u("num_hidden_layers")),
                (key("attention.head_count"), u("num_attention_heads")),
                (key("attention.head_count_kv"), u("num_key_value_heads")),
                (key("attention.key_length"), u("head_dim")),
                (key("attention.value_length"), u("head_dim")),
                (key("feed_forward_length"), u("intermediate_size")),
                (key("context_length"), u("max_position_embeddings")),
                (key("rope.freq_base"), V::F32(1e6)),
                (key("attention.layer_norm_rms_epsilon"), V::F32(1e-6)),
                ("tokenizer.ggml.model".into(), V::String("gpt2".into())),
                ("tokenizer.ggml.pre".into(), V::String("qwen2".into())),
                (
                    "tokenizer.ggml.tokens".into(),
                    V::Array(
                        ["<|endoftext|>", "a", "b", "ab"]
                            .map(|t| V::String(t.into()))
                            .to_vec(),
                    ),
                ),
                (
                    "tokenizer.ggml.merges".into(),
                    V::Array(vec![V::String("a b".into())]),
                ),
            ];
            let metadata: Vec<(&str, V)> =
                keys.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
            let tensors: Vec<Tensor> = self
                .hf
                .iter()
                .map(|(name, t)| Tensor {
                    name: crate::models::export_gguf::gguf_name(name)
                        .unwrap_or_else(|| panic!("no GGUF name for {name}")),
                    // ggml lists the fastest-varying dimension first.
                    dims: t.shape.iter().rev().map(|&n| n as u64).collect(),
                    ggml_type: 0,
                    data: t.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
                })
                .collect();
            let path = dir.join(format!("{arch}.gguf"));
            std::fs::write(&path, gguf_bytes(&metadata, &tensors)).unwrap();
            path
        }

        /// The model from a Hugging Face-style directory's `config.json` and
        /// `model.safetensors`, through the same mapping `open` uses.
        fn model_via_hf_files(&self, dir: &Path) -> Box<dyn Model> {
            use safetensors::tensor::TensorView;
            let bytes: BTreeMap<&String, Vec<u8>> = self
                .hf
                .iter()
                .map(|(n, t)| (n, t.data.iter().flat_map(|v| v.to_le_bytes()).collect()))
                .collect();
            let views: Vec<(&String, TensorView)> = self
                .hf
                .iter()
                .map(|(n, t)| {
                    (
                        n,
                        TensorView::new(Dtype::F32, t.shape.clone(), &bytes[n]).unwrap(),
                    )
                })
                .collect();
            let file = dir.join("model.safetensors");
            std::fs::write(&file, safetensors::serialize(views, None).unwrap()).unwrap();
            std::fs::write(dir.join("config.json"), self.cfg.to_string()).unwrap();
            let arch = self.cfg["architectures"][0].as_str().unwrap();
            let raw = read_safetensors(&[file]).unwrap();
            let (m, vocab, weights, _) =
                llama_from_hf(&dir.join("config.json"), &self.cfg, arch, raw).unwrap();
            let pool = crate::engine::MemoryPool::new(crate::engine::Device::Cpu);
            crate::models::load(&m, vocab, &pool, &weights, dir).unwrap()
        }
    }

    /// A qwen2 GGUF (QKV biases, untied head) and a qwen3 GGUF (per-head query/key norms,
    /// head width 16 from `attention.key_length`, tied head) give the logits of the same
    /// weights read from a Hugging Face-style directory, bit for bit: their query and key rows
    /// are not interleaved, unlike a llama GGUF's.
    #[test]
    fn qwen2_and_qwen3_gguf_files_give_the_logits_of_their_hf_weights() {
        for qwen3 in [false, true] {
            let tiny = TinyQwen::new(qwen3);
            let dir = tempfile::tempdir().unwrap();
            let p = open(&tiny.gguf(dir.path())).unwrap();
            assert_eq!(p.source.architecture, if qwen3 { "qwen3" } else { "qwen2" });
            let (m, l) = (&p.model, p.model.llama().unwrap());
            assert_eq!((l.qk_norm, l.qkv_bias, m.tied_head), (qwen3, !qwen3, qwen3));
            assert_eq!(l.head_dim, if qwen3 { 16 } else { 8 });
            assert_eq!(l.sliding_window, 0);
            let from_gguf = p.build_on_cpu().unwrap();
            let from_hf = tiny.model_via_hf_files(dir.path());
            let ids = [3u32, 1, 2, 2, 0, 3, 1, 1, 2, 3, 0, 0];
            let want = from_hf.next_logits(&ids).unwrap();
            assert_eq!(from_gguf.next_logits(&ids).unwrap(), want, "qwen3={qwen3}");
            // Read as llama's interleaved rows, the same file computes something else.
            let mut permuted = p.weights.clone();
            let qkv = permuted.get_mut("layers.0.attn.qkv.weight").unwrap();
            let q_rows = m.n_heads * l.head_dim;
            let q = HostTensor {
                shape: vec![q_rows, m.d_model],
                data: qkv.data[..q_rows * m.d_model].to_vec(),
            };
            let q = unpermute_rotary_rows(q, m.n_heads);
            qkv.data[..q_rows * m.d_model].copy_from_slice(&q.data);
            let pool = crate::engine::MemoryPool::new(crate::engine::Device::Cpu);
            let wrong = crate::models::load(m, p.vocab, &pool, &permuted, dir.path()).unwrap();
            assert_ne!(wrong.next_logits(&ids).unwrap(), want);
        }
    }

    /// A qwen3 GGUF missing its query/key norms is refused, saying what is missing.
    #[test]
    fn a_qwen3_gguf_without_its_norms_is_refused() {
        let mut tiny = TinyQwen::new(true);
        tiny.hf
            .retain(|n, _| !n.contains("_norm.weight") || n.contains("layernorm"));
        let dir = tempfile::tempdir().unwrap();
        let err = open(&tiny.gguf(dir.path())).err().unwrap().to_string();
        assert!(err.contains("without query/key norms"), "{err}");
    }

    /// A tiny Phi-3 checkpoint's config.json and tensors (fused query/key/value and gate/up
    /// projections, half the head rotated, LongRoPE over 64 trained positions stretched to
    /// 256, an untied head), and the same weights as a Llama checkpoint with split
    /// projections and the same rotary settings.
    fn tiny_phi3(window: Option<usize>) -> [(Value, BTreeMap<String, HostTensor>); 2] {
        let (d, layers, heads, kv, ffn, vocab) = (32, 2, 4, 2, 48, 40);
        let hd = d / heads;
        let mut rng = crate::engine::rng::Rng::new(11, crate::engine::rng::stream::INIT);
        let mut phi = BTreeMap::new();
        let mut llama = BTreeMap::new();
        let mut put = |shape: Vec<usize>, center: f32| {
            let n = shape.iter().product();
            let data: Vec<f32> = (0..n)
                .map(|_| center + 0.4 * (rng.next_f32() - 0.5))
                .collect();
            HostTensor { shape, data }
        };
        for (name, shape, center) in [
            ("model.embed_tokens.weight", vec![vocab, d], 0.0),
            ("model.norm.weight", vec![d], 1.0),
            ("lm_head.weight", vec![vocab, d], 0.0),
        ] {
            let t = put(shape, center);
            phi.insert(name.to_string(), t.clone());
            llama.insert(name.to_string(), t);
        }
        let split = |t: &HostTensor,
                     at: &[(&str, usize)],
                     p: &str,
                     out: &mut BTreeMap<String, HostTensor>| {
            let mut row = 0;
            for (name, rows) in at {
                out.insert(
                    format!("{p}.{name}.weight"),
                    HostTensor {
                        shape: vec![*rows, d],
                        data: t.data[row * d..(row + rows) * d].to_vec(),
                    },
                );
                row += rows;
            }
        };
        for l in 0..layers {
            let p = format!("model.layers.{l}");
            for (name, shape, center) in [
                ("input_layernorm", vec![d], 1.0),
                ("post_attention_layernorm", vec![d], 1.0),
                ("self_attn.o_proj", vec![d, heads * hd], 0.0),
                ("mlp.down_proj", vec![d, ffn], 0.0),
            ] {
                let t = put(shape, center);
                phi.insert(format!("{p}.{name}.weight"), t.clone());
                llama.insert(format!("{p}.{name}.weight"), t);
            }
            let qkv = put(vec![(heads + 2 * kv) * hd, d], 0.0);
            split(
                &qkv,
                &[
                    ("self_attn.q_proj", heads * hd),
                    ("self_attn.k_proj", kv * hd),
                    ("self_attn.v_proj", kv * hd),
                ],
                &p,
                &mut llama,
            );
            phi.insert(format!("{p}.self_attn.qkv_proj.weight"), qkv);
            let gate_up = put(vec![2 * ffn, d], 0.0);
            split(
                &gate_up,
                &[("mlp.gate_proj", ffn), ("mlp.up_proj", ffn)],
                &p,
                &mut llama,
            );
            phi.insert(format!("{p}.mlp.gate_up_proj.weight"), gate_up);
        }
        let cfg = |arch: &str| {
            serde_json::json!({
                "architectures": [arch],
                "hidden_size": d, "num_hidden_layers": layers, "num_attention_heads": heads,
                "num_key_value_heads": kv, "intermediate_size": ffn, "vocab_size": vocab,
                "max_position_embeddings": 256, "original_max_position_embeddings": 64,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5],
                                 "long_factor": [3.0, 7.5]},
                "sliding_window": window, "tie_word_embeddings": false,
            })
        };
        [
            (cfg("Phi3ForCausalLM"), phi),
            (cfg("LlamaForCausalLM"), llama),
        ]
    }

    fn load_llama(
        m: &ModelConfig,
        vocab: usize,
        w: &BTreeMap<String, HostTensor>,
    ) -> Box<dyn Model> {
        let pool = crate::engine::MemoryPool::new(crate::engine::Device::Cpu);
        crate::models::load(m, vocab, &pool, w, Path::new("tiny")).unwrap()
    }

    /// Phi-3's fused projections import as kiln's own fused ones (the same logits, bit for bit,
    /// as the split Llama checkpoint); LongRoPE follows transformers: the short factors at the
    /// trained context, the long ones for a longer model.context, and an attention factor of
    /// sqrt(1 + ln(256 / 64) / ln 64); export writes Phi-3's layout back and reads back as the
    /// same model.
    #[test]
    fn phi3_checkpoints_import_fused_and_export_back() {
        let path = Path::new("config.json");
        let [(phi_cfg, phi), (llama_cfg, llama)] = tiny_phi3(None);
        let (m, vocab, w, longest) = llama_from_hf(path, &phi_cfg, "Phi3ForCausalLM", phi).unwrap();
        let l = m.llama().unwrap().clone();
        assert_eq!((m.context, longest, l.rope_longest_context), (64, 256, 256));
        assert_eq!((l.rot_dim, l.rope_original_context), (4, 64));
        assert_eq!(l.rope_short_factors, vec![1.0, 1.5]);
        assert_eq!(l.rope_long_factors, vec![3.0, 7.5]);
        let want = (1.0 + (4.0f64).ln() / (64.0f64).ln()).sqrt();
        assert!(
            (l.rope_attention_factor - want).abs() < 1e-12,
            "{}",
            l.rope_attention_factor
        );
        assert_eq!(l.checkpoint_arch, "phi3");
        let (lm, _, lw, _) = llama_from_hf(path, &llama_cfg, "LlamaForCausalLM", llama).unwrap();
        let ids = [3u32, 1, 2, 2, 0, 3, 1, 1, 2, 3, 0, 0, 5, 9];
        let phi_model = load_llama(&m, vocab, &w);
        let logits = phi_model.next_logits(&ids).unwrap();
        assert_eq!(
            load_llama(&lm, vocab, &lw).next_logits(&ids).unwrap(),
            logits
        );

        // A longer context keeps the short factors for passes that fit the trained 64
        // positions and takes the long ones past them, pass by pass, as transformers does.
        let cfg = crate::models::llama::LlamaConfig::from_model(&m, vocab).unwrap();
        assert_eq!(cfg.rope_factors.unwrap().as_slice(), &[1.0, 1.5]);
        assert_eq!(cfg.rope_long_factors, None);
        let with_factors = |short: [f64; 2], long: [f64; 2]| {
            let mut c = m.clone();
            c.context = 128;
            if let crate::config::FamilySettings::Llama(s) = &mut c.family {
                (s.rope_short_factors, s.rope_long_factors) = (short.to_vec(), long.to_vec());
            }
            c
        };
        let long = with_factors([1.0, 1.5], [3.0, 7.5]);
        let cfg = crate::models::llama::LlamaConfig::from_model(&long, vocab).unwrap();
        assert_eq!(cfg.rope_factors.unwrap().as_slice(), &[1.0, 1.5]);
        assert_eq!(cfg.rope_long_factors.unwrap().as_slice(), &[3.0, 7.5]);
        assert_eq!(cfg.rope_trained_context, 64);
        let long_model = load_llama(&long, vocab, &w);
        assert_eq!(long_model.next_logits(&ids).unwrap(), logits);
        let all_short = load_llama(&with_factors([1.0, 1.5], [1.0, 1.5]), vocab, &w);
        let all_long = load_llama(&with_factors([3.0, 7.5], [3.0, 7.5]), vocab, &w);
        let past: Vec<u32> = (0..80u32).map(|i| (i * 7 + 3) % vocab as u32).collect();
        let past_logits = long_model.next_logits(&past).unwrap();
        assert_eq!(past_logits, all_long.next_logits(&past).unwrap());
        assert_ne!(past_logits, all_short.next_logits(&past).unwrap());

        // A decode step at the trained context: the prompt's keys were rotated with the short
        // factors when they entered the cache and stay so; the row at position 64 rotates its
        // query and key with the long ones (each row its own choice). Generation prefills a
        // sequence again before such a step (Decoder::restart_at), as transformers' Phi-3
        // generation does, so that its keys all carry the long factors.
        let step = |prefill: &dyn Model, next: &dyn Model| -> Vec<f32> {
            let (dp, dn) = (prefill.decoder().unwrap(), next.decoder().unwrap());
            let mut cache = dp.new_cache(1, 128).unwrap();
            let prompt = &past[..64];
            let pos: Vec<u32> = (0..64).collect();
            dp.decode(&mut cache, prompt, &[0; 64], &pos, &[63])
                .unwrap();
            dn.decode(&mut cache, &past[64..65], &[0], &[64], &[0])
                .unwrap()
        };
        let switched = step(long_model.as_ref(), long_model.as_ref());
        assert_eq!(switched, step(all_short.as_ref(), all_long.as_ref()));
        assert_ne!(switched, step(all_short.as_ref(), all_short.as_ref()));
        assert_ne!(switched, step(all_long.as_ref(), all_long.as_ref()));
        // Without the attention factor the logits change too: it scales queries and keys.
        let mut plain = m.clone();
        if let crate::config::FamilySettings::Llama(s) = &mut plain.family {
            s.rope_attention_factor = 1.0;
        }
        assert_ne!(
            load_llama(&plain, vocab, &w).next_logits(&ids).unwrap(),
            logits
        );

        let (tensors, config) =
            crate::models::export::hf_tensors(phi_model.as_ref(), &m, vocab).unwrap();
        assert_eq!(config["architectures"][0], "Phi3ForCausalLM");
        assert!(tensors.contains_key("model.layers.1.self_attn.qkv_proj.weight"));
        assert!(tensors.contains_key("model.layers.1.mlp.gate_up_proj.weight"));
        assert!(!tensors.contains_key("model.layers.1.self_attn.q_proj.weight"));
        assert_eq!(config["rope_scaling"]["rope_type"], "longrope");
        // The checkpoint's positions, stated again though the model runs at 64.
        assert_eq!(config["max_position_embeddings"], 256);
        let raw: BTreeMap<String, HostTensor> = tensors
            .into_iter()
            .map(|(k, t)| {
                (
                    k,
                    HostTensor {
                        shape: t.shape,
                        data: t.data,
                    },
                )
            })
            .collect();
        let (back, _, bw, _) = llama_from_hf(path, &config, "Phi3ForCausalLM", raw).unwrap();
        // The epsilon goes out as the f32 the model computes with.
        let mut back_l = back.llama().unwrap().clone();
        assert_eq!(back_l.norm_eps as f32, l.norm_eps as f32);
        back_l.norm_eps = l.norm_eps;
        assert_eq!(back_l, l);
        assert_eq!(back.context, m.context);
        assert_eq!(
            load_llama(&back, vocab, &bw).next_logits(&ids).unwrap(),
            logits
        );

        // The split Llama checkpoint with the same LongRoPE exports its factors as well.
        let llama_model = load_llama(&lm, vocab, &lw);
        let (_, config) =
            crate::models::export::hf_tensors(llama_model.as_ref(), &lm, vocab).unwrap();
        assert_eq!(config["architectures"][0], "LlamaForCausalLM");
        assert_eq!(config["rope_scaling"]["rope_type"], "longrope");
        assert_eq!(
            config["rope_scaling"]["long_factor"],
            serde_json::json!([3.0, 7.5])
        );
    }

    /// Phi-3's window: one shorter than the positions masks (and changes the logits of a
    /// sequence longer than it), one at least as long is full attention, a bad one is refused.
    #[test]
    fn phi3_sliding_windows_import_as_transformers_masks() {
        let path = Path::new("config.json");
        let ids = [3u32, 1, 2, 2, 0, 3, 1, 1, 2, 3, 0, 0, 5, 9];
        let mut logits = Vec::new();
        for window in [None, Some(4), Some(256)] {
            let [(cfg, phi), _] = tiny_phi3(window);
            let (m, vocab, w, _) = llama_from_hf(path, &cfg, "Phi3ForCausalLM", phi).unwrap();
            let l = m.llama().unwrap();
            assert_eq!(l.sliding_window, if window == Some(4) { 4 } else { 0 });
            logits.push(load_llama(&m, vocab, &w).next_logits(&ids).unwrap());
        }
        assert_eq!(logits[0], logits[2]);
        assert_ne!(logits[0], logits[1]);
        let [(mut cfg, phi), _] = tiny_phi3(None);
        cfg["sliding_window"] = serde_json::json!(-3);
        let e = llama_from_hf(path, &cfg, "Phi3ForCausalLM", phi)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("sliding_window"), "{e}");
    }

    /// A phi3 GGUF as llama.cpp's converter writes one (fused `attn_qkv` and `ffn_up`, no
    /// interleaved rows, LongRoPE's factors as tensors and its attention factor and trained
    /// context as metadata, the window dropped) gives the logits of the same weights read from
    /// the Hugging Face directory, bit for bit, and exports back as Phi-3: to a Hugging Face
    /// directory, and to the same GGUF file.
    #[test]
    fn phi3_gguf_files_give_the_logits_of_their_hf_weights() {
        use crate::data::gguf::GgufValue as V;
        use crate::data::gguf::writer::{Tensor, gguf_bytes};
        let path = Path::new("config.json");
        let [(cfg, phi), _] = tiny_phi3(None);
        let (m, vocab, w, _) = llama_from_hf(path, &cfg, "Phi3ForCausalLM", phi.clone()).unwrap();
        let l = m.llama().unwrap();
        let gguf_name = |name: &str| -> String {
            let name = name
                .replace("model.layers.", "blk.")
                .replace(".self_attn.qkv_proj", ".attn_qkv")
                .replace(".self_attn.o_proj", ".attn_output")
                .replace(".mlp.gate_up_proj", ".ffn_up")
                .replace(".mlp.down_proj", ".ffn_down")
                .replace(".input_layernorm", ".attn_norm")
                .replace(".post_attention_layernorm", ".ffn_norm");
            match name.as_str() {
                "model.embed_tokens.weight" => "token_embd.weight".into(),
                "model.norm.weight" => "output_norm.weight".into(),
                "lm_head.weight" => "output.weight".into(),
                _ => name,
            }
        };
        let f32_tensor = |name: String, shape: &[usize], data: &[f32]| Tensor {
            name,
            dims: shape.iter().rev().map(|&n| n as u64).collect(),
            ggml_type: 0,
            data: data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        };
        let mut tensors: Vec<Tensor> = phi
            .iter()
            .map(|(name, t)| f32_tensor(gguf_name(name), &t.shape, &t.data))
            .collect();
        for (name, f) in [
            (ROPE_FACTORS_SHORT, &l.rope_short_factors),
            (ROPE_FACTORS_LONG, &l.rope_long_factors),
        ] {
            let v: Vec<f32> = f.iter().map(|&x| x as f32).collect();
            tensors.push(f32_tensor(name.into(), &[v.len()], &v));
        }
        let c = &cfg;
        let u = |k: &str| V::U32(c[k].as_u64().unwrap() as u32);
        let keys: Vec<(&str, V)> = vec![
            ("general.architecture", V::String("phi3".into())),
            ("phi3.embedding_length", u("hidden_size")),
            ("phi3.block_count", u("num_hidden_layers")),
            ("phi3.attention.head_count", u("num_attention_heads")),
            ("phi3.attention.head_count_kv", u("num_key_value_heads")),
            ("phi3.feed_forward_length", u("intermediate_size")),
            ("phi3.context_length", u("max_position_embeddings")),
            (
                "phi3.rope.scaling.original_context_length",
                u("original_max_position_embeddings"),
            ),
            ("phi3.rope.dimension_count", V::U32(l.rot_dim as u32)),
            ("phi3.rope.freq_base", V::F32(10000.0)),
            (
                "phi3.rope.scaling.attn_factor",
                V::F32(l.rope_attention_factor as f32),
            ),
            ("phi3.attention.layer_norm_rms_epsilon", V::F32(1e-5)),
            ("phi3.attention.sliding_window", V::U32(0)),
            ("tokenizer.ggml.model", V::String("gpt2".into())),
            ("tokenizer.ggml.pre", V::String("qwen2".into())),
            (
                "tokenizer.ggml.tokens",
                // One token an embedding row, as the converter writes them.
                V::Array(
                    ["<|endoftext|>", "a", "b", "ab"]
                        .into_iter()
                        .map(String::from)
                        .chain((4..vocab).map(|i| format!("t{i}")))
                        .map(V::String)
                        .collect(),
                ),
            ),
            (
                "tokenizer.ggml.merges",
                V::Array(vec![V::String("a b".into())]),
            ),
        ];
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("phi3.gguf");
        std::fs::write(&file, gguf_bytes(&keys, &tensors)).unwrap();
        let p = open(&file).unwrap();
        assert_eq!(p.source.architecture, "phi3");
        assert_eq!((p.model.context, p.longest_context), (64, 256));
        let gl = p.model.llama().unwrap();
        assert_eq!(gl.checkpoint_arch, "phi3");
        assert_eq!(
            (&gl.rope_short_factors, &gl.rope_long_factors),
            (&l.rope_short_factors, &l.rope_long_factors)
        );
        assert!((gl.rope_attention_factor - l.rope_attention_factor).abs() < 1e-6);
        let ids = [3u32, 1, 2, 2, 0, 3, 1, 1, 2, 3, 0, 0, 5, 9];
        // The attention factor went through f32 metadata: give the HF model the same.
        let mut hf = m.clone();
        if let FamilySettings::Llama(s) = &mut hf.family {
            s.rope_attention_factor = gl.rope_attention_factor;
        }
        let want = load_llama(&hf, vocab, &w).next_logits(&ids).unwrap();
        let from_gguf = p.build_on_cpu().unwrap();
        assert_eq!(from_gguf.next_logits(&ids).unwrap(), want);
        let (_, config) =
            crate::models::export::hf_tensors(from_gguf.as_ref(), &p.model, p.vocab).unwrap();
        assert_eq!(config["architectures"][0], "Phi3ForCausalLM");

        // kiln's GGUF export of the same model writes the converter's file: the same tensors
        // bit for bit, the same metadata (the longest context stated again), and it reads
        // back to the same logits.
        let out = dir.path().join("kiln-phi3.gguf");
        crate::models::export_gguf::export_gguf(
            from_gguf.as_ref(),
            &p.model,
            p.vocab,
            file.to_str().unwrap(),
            &out,
            crate::models::export_gguf::GgufType::F32,
        )
        .unwrap();
        let (theirs, ours) = (
            GgufFile::open(&file).unwrap(),
            GgufFile::open(&out).unwrap(),
        );
        let names = |g: &GgufFile| {
            let mut n: Vec<String> = g.tensor_names().map(String::from).collect();
            n.sort();
            n
        };
        assert_eq!(names(&ours), names(&theirs));
        for name in names(&theirs) {
            assert_eq!(
                ours.tensor_f32(&name).unwrap(),
                theirs.tensor_f32(&name).unwrap(),
                "{name}"
            );
        }
        for (k, v) in &keys {
            let got = ours.metadata().iter().find(|(n, _)| n == k).map(|(_, v)| v);
            assert_eq!(got, Some(v), "{k}");
        }
        let again = open(&out).unwrap();
        assert_eq!(again.model.llama(), p.model.llama());
        assert_eq!(
            again.build_on_cpu().unwrap().next_logits(&ids).unwrap(),
            want
        );
    }
}
