//! Export: a kiln model written as a Hugging Face model directory that transformers loads
//! with `from_pretrained` (config.json, model.safetensors, tokenizer files).
//!
//! The inverse of `import::pretrained`'s mapping: fused QKV and gate/up matrices are split
//! back into the checkpoint's projections, GPT-2's linear weights are transposed into Conv1D
//! layout, and the vocabulary padding is dropped.

use crate::config::ModelConfig;
use crate::error::{KilnError, Result};
use crate::models::Model;
use crate::models::import::pretrained::transposed;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;

/// A tensor to write: its shape and f32 values.
pub(crate) struct Out {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

fn rows(t: &[f32], cols: usize, from: usize, to: usize) -> Vec<f32> {
    t[from * cols..to * cols].to_vec()
}

/// The model's tensors under Hugging Face names, and its config.json.
pub(crate) fn hf_tensors(
    model: &dyn Model,
    m: &ModelConfig,
    vocab: usize,
) -> Result<(BTreeMap<String, Out>, serde_json::Value)> {
    let mut by_name: BTreeMap<String, (Vec<usize>, Vec<f32>)> = BTreeMap::new();
    for p in model.params() {
        by_name.insert(
            p.name.clone(),
            (p.value.shape().to_vec(), p.value.to_vec()?),
        );
    }
    let mut get = |name: &str| {
        by_name.remove(name).ok_or_else(|| {
            KilnError::Setting(format!("the model has no parameter {name} to export"))
        })
    };
    let d = m.d_model;
    let mut out = BTreeMap::new();
    let mut put = |name: String, shape: Vec<usize>, data: Vec<f32>| {
        out.insert(name, Out { shape, data });
    };
    let config = match (
        m.kind(),
        crate::models::llama::LlamaConfig::from_model(m, vocab),
    ) {
        (_, Some(l)) => {
            let settings = m.llama().cloned().unwrap_or_default();
            let phi3 = settings.checkpoint_arch == "phi3";
            if phi3 && (l.qk_norm || l.qkv_bias || l.full_attention_layers > 0) {
                return Err(KilnError::Setting(
                    "Phi3ForCausalLM has no query/key norms, projection biases or full-attention first layers; export this model with model.checkpoint_arch=\"\" for the architecture its settings describe".into(),
                ));
            }
            // transformers' Llama has no window: a windowed model is a Mistral, or a Qwen2
            // when its first layers attend fully or its projections have biases (Qwen2's
            // are always there; a model without them writes zeros).
            let windowed = l.sliding_window > 0;
            let (arch, model_type) = if phi3 {
                ("Phi3ForCausalLM", "phi3")
            } else if l.qk_norm {
                ("Qwen3ForCausalLM", "qwen3")
            } else if windowed && (l.qkv_bias || l.full_attention_layers > 0) {
                ("Qwen2ForCausalLM", "qwen2")
            } else if windowed {
                ("MistralForCausalLM", "mistral")
            } else {
                ("LlamaForCausalLM", "llama")
            };
            let zero_bias = arch == "Qwen2ForCausalLM" && !l.qkv_bias;
            let (qd, kvd, ffn) = (
                l.n_heads * l.head_dim,
                l.n_kv_heads * l.head_dim,
                l.ffn_hidden,
            );
            let (_, e) = get("embed.weight")?;
            put(
                "model.embed_tokens.weight".into(),
                vec![vocab, d],
                rows(&e, d, 0, vocab),
            );
            for i in 0..l.n_layers {
                let (k, p) = (format!("layers.{i}"), format!("model.layers.{i}"));
                put(
                    format!("{p}.input_layernorm.weight"),
                    vec![d],
                    get(&format!("{k}.ln1.weight"))?.1,
                );
                let (_, qkv) = get(&format!("{k}.attn.qkv.weight"))?;
                if phi3 {
                    put(
                        format!("{p}.self_attn.qkv_proj.weight"),
                        vec![qd + 2 * kvd, d],
                        qkv,
                    );
                } else {
                    put(
                        format!("{p}.self_attn.q_proj.weight"),
                        vec![qd, d],
                        rows(&qkv, d, 0, qd),
                    );
                    put(
                        format!("{p}.self_attn.k_proj.weight"),
                        vec![kvd, d],
                        rows(&qkv, d, qd, qd + kvd),
                    );
                    put(
                        format!("{p}.self_attn.v_proj.weight"),
                        vec![kvd, d],
                        rows(&qkv, d, qd + kvd, qd + 2 * kvd),
                    );
                }
                if l.qk_norm {
                    for x in ["q", "k"] {
                        put(
                            format!("{p}.self_attn.{x}_norm.weight"),
                            vec![l.head_dim],
                            get(&format!("{k}.attn.{x}_norm.weight"))?.1,
                        );
                    }
                }
                if l.qkv_bias || zero_bias {
                    let b = if zero_bias {
                        vec![0.0; qd + 2 * kvd]
                    } else {
                        get(&format!("{k}.attn.qkv.bias"))?.1
                    };
                    put(
                        format!("{p}.self_attn.q_proj.bias"),
                        vec![qd],
                        b[..qd].to_vec(),
                    );
                    put(
                        format!("{p}.self_attn.k_proj.bias"),
                        vec![kvd],
                        b[qd..qd + kvd].to_vec(),
                    );
                    put(
                        format!("{p}.self_attn.v_proj.bias"),
                        vec![kvd],
                        b[qd + kvd..].to_vec(),
                    );
                }
                put(
                    format!("{p}.self_attn.o_proj.weight"),
                    vec![d, qd],
                    get(&format!("{k}.attn.out.weight"))?.1,
                );
                put(
                    format!("{p}.post_attention_layernorm.weight"),
                    vec![d],
                    get(&format!("{k}.ln2.weight"))?.1,
                );
                let (_, gu) = get(&format!("{k}.mlp.gate_up.weight"))?;
                if phi3 {
                    put(format!("{p}.mlp.gate_up_proj.weight"), vec![2 * ffn, d], gu);
                } else {
                    put(
                        format!("{p}.mlp.gate_proj.weight"),
                        vec![ffn, d],
                        rows(&gu, d, 0, ffn),
                    );
                    put(
                        format!("{p}.mlp.up_proj.weight"),
                        vec![ffn, d],
                        rows(&gu, d, ffn, 2 * ffn),
                    );
                }
                put(
                    format!("{p}.mlp.down_proj.weight"),
                    vec![d, ffn],
                    get(&format!("{k}.mlp.down.weight"))?.1,
                );
            }
            put("model.norm.weight".into(), vec![d], get("ln_f.weight")?.1);
            if !l.tied_head {
                let (_, h) = get("lm_head.weight")?;
                put(
                    "lm_head.weight".into(),
                    vec![vocab, d],
                    rows(&h, d, 0, vocab),
                );
            }
            let mut c = json!({
                "architectures": [arch],
                "model_type": model_type,
                "hidden_size": d,
                "intermediate_size": ffn,
                "num_hidden_layers": l.n_layers,
                "num_attention_heads": l.n_heads,
                "num_key_value_heads": l.n_kv_heads,
                "head_dim": l.head_dim,
                "max_position_embeddings": l.context,
                "rms_norm_eps": l.norm_eps,
                "rope_theta": l.rope_theta,
                "vocab_size": vocab,
                "tie_word_embeddings": l.tied_head,
                "attention_bias": l.qkv_bias,
                "mlp_bias": false,
                "hidden_act": "silu",
                "torch_dtype": "float32",
            });
            if let Some(s) = l.rope_scaling {
                c["rope_scaling"] = json!({
                    "rope_type": "llama3",
                    "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_context,
                });
            }
            if !settings.rope_short_factors.is_empty() {
                longrope_config(&mut c, &settings, &l);
            }
            if phi3 {
                phi3_config(&mut c, &l);
            } else if windowed {
                c["sliding_window"] = json!(l.sliding_window);
                if arch != "MistralForCausalLM" {
                    let layer_types: Vec<&str> = (0..l.n_layers)
                        .map(|i| {
                            if l.window_of(i) > 0 {
                                "sliding_attention"
                            } else {
                                "full_attention"
                            }
                        })
                        .collect();
                    c["use_sliding_window"] = json!(true);
                    c["max_window_layers"] = json!(l.full_attention_layers);
                    c["layer_types"] = json!(layer_types);
                }
            }
            if l.rot_dim != l.head_dim {
                c["partial_rotary_factor"] = json!(l.rot_dim as f64 / l.head_dim as f64);
            }
            c
        }
        ("gpt", None) => {
            let (_, e) = get("wte.weight")?;
            put(
                "transformer.wte.weight".into(),
                vec![vocab, d],
                rows(&e, d, 0, vocab),
            );
            let (s, pe) = get("wpe.weight")?;
            put("transformer.wpe.weight".into(), s, pe);
            for i in 0..m.n_layers {
                let (k, p) = (format!("blocks.{i}"), format!("transformer.h.{i}"));
                for (kiln, hf) in [
                    ("attn.qkv", "attn.c_attn"),
                    ("attn.proj", "attn.c_proj"),
                    ("mlp.fc", "mlp.c_fc"),
                    ("mlp.proj", "mlp.c_proj"),
                ] {
                    let (s, w) = get(&format!("{k}.{kiln}.weight"))?;
                    put(
                        format!("{p}.{hf}.weight"),
                        vec![s[1], s[0]],
                        transposed(&w, s[0], s[1]),
                    );
                    let (s, b) = get(&format!("{k}.{kiln}.bias"))?;
                    put(format!("{p}.{hf}.bias"), s, b);
                }
                for (kiln, hf) in [("ln1", "ln_1"), ("ln2", "ln_2")] {
                    for part in ["weight", "bias"] {
                        let (s, v) = get(&format!("{k}.{kiln}.{part}"))?;
                        put(format!("{p}.{hf}.{part}"), s, v);
                    }
                }
            }
            for part in ["weight", "bias"] {
                let (s, v) = get(&format!("ln_f.{part}"))?;
                put(format!("transformer.ln_f.{part}"), s, v);
            }
            if !m.tied_head {
                return Err(KilnError::Setting(
                    "GPT-2 checkpoints tie the head to the embedding; a GPT trained with model.tied_head=false cannot be exported as GPT2LMHeadModel".into(),
                ));
            }
            json!({
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "n_embd": d,
                "n_layer": m.n_layers,
                "n_head": m.n_heads,
                "n_positions": m.context,
                "n_ctx": m.context,
                "n_inner": 4 * d,
                "vocab_size": vocab,
                "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5,
                "tie_word_embeddings": true,
                "torch_dtype": "float32",
            })
        }
        (other, None) => {
            return Err(KilnError::Setting(format!(
                "model.kind = \"{other}\" has no Hugging Face architecture to export to; llama and gpt do"
            )));
        }
    };
    Ok((out, config))
}

/// LongRoPE's keys, which every Llama-family config.json of transformers reads: both factor
/// lists, the trained context, and the attention factor written out (transformers would
/// derive one from the positions otherwise).
fn longrope_config(
    c: &mut serde_json::Value,
    settings: &crate::config::LlamaSettings,
    l: &crate::models::llama::LlamaConfig,
) {
    c["original_max_position_embeddings"] = json!(settings.rope_original_context);
    c["max_position_embeddings"] = json!(settings.stated_positions(l.context));
    c["rope_scaling"] = json!({
        "rope_type": "longrope",
        "short_factor": settings.rope_short_factors,
        "long_factor": settings.rope_long_factors,
        "original_max_position_embeddings": settings.rope_original_context,
        "attention_factor": settings.rope_attention_factor,
    });
}

/// The keys of a Phi3ForCausalLM config.json beyond a Llama's: its window (null for none) and
/// no special-token ids (Phi3Config's defaults, 32000 among them, may lie outside a small
/// vocabulary; the tokenizer files carry the real ones).
fn phi3_config(c: &mut serde_json::Value, l: &crate::models::llama::LlamaConfig) {
    c["sliding_window"] = if l.sliding_window > 0 {
        json!(l.sliding_window)
    } else {
        serde_json::Value::Null
    };
    for key in ["pad_token_id", "bos_token_id", "eos_token_id"] {
        c[key] = serde_json::Value::Null;
    }
    for key in ["resid_pdrop", "embd_pdrop", "attention_dropout"] {
        c[key] = json!(0.0);
    }
}

/// Writes `model` (of settings `m`, `vocab` embedding rows) as a Hugging Face directory in
/// `dir`, with the tokenizer files of `tokenizer` (a data.tokenizer value: a pretrained
/// model's, or a built-in one written as its `tokenizer.json`). Returns notes for the user.
pub fn export_hf(
    model: &dyn Model,
    m: &ModelConfig,
    vocab: usize,
    tokenizer: &str,
    dir: &Path,
) -> Result<Vec<String>> {
    let (tensors, config) = hf_tensors(model, m, vocab)?;
    std::fs::create_dir_all(dir).map_err(|e| KilnError::output(dir, e))?;
    let bytes: BTreeMap<&String, Vec<u8>> = tensors
        .iter()
        .map(|(k, t)| (k, t.data.iter().flat_map(|v| v.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(k, t)| {
            let view = TensorView::new(Dtype::F32, t.shape.clone(), &bytes[k])
                .map_err(|e| KilnError::Setting(format!("tensor {k}: {e}")))?;
            Ok((k.clone(), view))
        })
        .collect::<Result<_>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let st = safetensors::serialize(views, Some(meta))
        .map_err(|e| KilnError::output(dir.join("model.safetensors"), e))?;
    let write = |name: &str, data: &[u8]| {
        std::fs::write(dir.join(name), data).map_err(|e| KilnError::output(dir.join(name), e))
    };
    write("model.safetensors", &st)?;
    write(
        "config.json",
        serde_json::to_string_pretty(&config)
            .unwrap_or_default()
            .as_bytes(),
    )?;
    // A built-in tokenizer is written as the byte-level BPE file that encodes the same ids.
    let tok = if crate::data::is_tokenizer_path(tokenizer) {
        crate::data::tokenizer_from_path(Path::new(tokenizer))?
    } else {
        crate::data::HfTokenizer::from_builtin(tokenizer)?
    };
    tok.save_dir(dir)?;
    Ok(Vec::new())
}
