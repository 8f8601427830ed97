//! Adapters in PEFT's format: `adapter_model.safetensors` with PEFT's tensor names
//! (`base_model.model.<module>.lora_A.weight` `[r, in]` and `.lora_B.weight` `[out, r]`) and
//! `adapter_config.json`, which `peft.PeftModel.from_pretrained(base, dir)` loads onto the
//! same base in transformers. kiln's adapters carry the module names of a Hugging Face
//! checkpoint (see [`crate::nn::lora`]), so the mapping is by name and needs no reshaping.

use crate::config::LoraConfig;
use crate::error::{KilnError, Result};
use crate::models::Model;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;

pub const WEIGHTS: &str = "adapter_model.safetensors";
pub const CONFIG: &str = "adapter_config.json";

fn key(module: &str, which: &str) -> String {
    format!("base_model.model.{module}.lora_{which}.weight")
}

/// Writes the model's adapters to `dir` in PEFT's format; `base` is recorded as
/// `base_model_name_or_path`.
pub fn save_adapter(model: &dyn Model, lora: &LoraConfig, base: &str, dir: &Path) -> Result<usize> {
    let adapters = model.adapters();
    if adapters.is_empty() {
        return Err(KilnError::Setting(
            "the model has no adapters to save (it was not fine-tuned with lora.enabled=true)"
                .into(),
        ));
    }
    let mut tensors: BTreeMap<String, (Vec<usize>, Vec<u8>)> = BTreeMap::new();
    let mut targets: Vec<String> = Vec::new();
    for ad in &adapters {
        for (which, p) in [("A", &ad.a), ("B", &ad.b)] {
            let bytes = p
                .value
                .to_vec()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            tensors.insert(
                key(&ad.block.module, which),
                (p.value.shape().to_vec(), bytes),
            );
        }
        let short = ad.block.short_name().to_string();
        if !targets.contains(&short) {
            targets.push(short);
        }
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(k, (shape, bytes))| {
            let view = TensorView::new(Dtype::F32, shape.clone(), bytes)
                .map_err(|e| KilnError::Setting(format!("tensor {k}: {e}")))?;
            Ok((k.clone(), view))
        })
        .collect::<Result<_>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let st = safetensors::serialize(views, Some(meta))
        .map_err(|e| KilnError::output(dir.join(WEIGHTS), e))?;
    std::fs::create_dir_all(dir).map_err(|e| KilnError::output(dir, e))?;
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.rslora,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": model.lora_fan_in_fan_out(),
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    });
    let write = |name: &str, data: &[u8]| {
        std::fs::write(dir.join(name), data).map_err(|e| KilnError::output(dir.join(name), e))
    };
    write(WEIGHTS, &st)?;
    write(
        CONFIG,
        serde_json::to_string_pretty(&config)
            .unwrap_or_default()
            .as_bytes(),
    )?;
    Ok(adapters.len())
}

/// The `[lora]` settings an adapter directory's `adapter_config.json` describes.
pub fn read_config(dir: &Path) -> Result<LoraConfig> {
    let path = dir.join(CONFIG);
    let bad = |reason: String| KilnError::checkpoint(&path, reason);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        bad(format!(
            "cannot be read ({e}); an adapter directory holds {CONFIG} and {WEIGHTS}"
        ))
    })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("is not JSON ({e})")))?;
    if v.get("peft_type").and_then(|t| t.as_str()) != Some("LORA") {
        return Err(bad(
            "is not a LoRA adapter (peft_type is not \"LORA\")".into()
        ));
    }
    let rank = v
        .get("r")
        .and_then(|r| r.as_u64())
        .ok_or_else(|| bad("has no rank \"r\"".into()))?;
    let alpha = v
        .get("lora_alpha")
        .and_then(|a| a.as_f64())
        .unwrap_or(rank as f64);
    let targets = match v.get("target_modules") {
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|t| t.as_str())
            .collect::<Vec<_>>()
            .join(","),
        Some(serde_json::Value::String(s)) => s.clone(),
        _ => return Err(bad("has no target_modules".into())),
    };
    Ok(LoraConfig {
        enabled: true,
        base: v
            .get("base_model_name_or_path")
            .and_then(|b| b.as_str())
            .unwrap_or_default()
            .to_string(),
        rank: rank as usize,
        alpha,
        dropout: 0.0,
        targets,
        rslora: v
            .get("use_rslora")
            .and_then(|b| b.as_bool())
            .unwrap_or(false),
        ..LoraConfig::default()
    })
}

/// Loads a PEFT adapter's weights into a model whose adapters were attached with the
/// directory's settings ([`read_config`]). Every adapter must be in the file with its shape.
pub fn load_adapter(model: &mut dyn Model, dir: &Path) -> Result<usize> {
    let path = dir.join(WEIGHTS);
    let bytes = std::fs::read(&path)
        .map_err(|e| KilnError::checkpoint(&path, format!("cannot be read ({e})")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| KilnError::checkpoint(&path, format!("is not a safetensors file ({e})")))?;
    let mut n = 0;
    for ad in model.adapters_mut() {
        for (which, p) in [("A", &mut ad.a), ("B", &mut ad.b)] {
            let k = key(&ad.block.module, which);
            let t = st.tensor(&k).map_err(|_| {
                KilnError::checkpoint(
                    &path,
                    format!("has no tensor {k}; the adapter does not match this base model"),
                )
            })?;
            if t.shape() != p.value.shape() {
                return Err(KilnError::checkpoint(
                    &path,
                    format!(
                        "tensor {k} has shape {:?}, the base model's adapter needs {:?}; the adapter was trained on another base",
                        t.shape(),
                        p.value.shape()
                    ),
                ));
            }
            let data = crate::models::import::pretrained::to_f32(&path, &k, t.dtype(), t.data())?;
            p.value.copy_from_host(&data)?;
            p.refresh_compute()?;
            n += 1;
        }
    }
    Ok(n / 2)
}

/// Attaches the adapters of a PEFT directory to `model` (freezing the base) and loads their
/// weights: a base plus adapter for `eval` and `generate`. Returns the adapted modules.
pub fn apply(model: &mut dyn Model, dir: &Path) -> Result<usize> {
    let cfg = read_config(dir)?;
    let spec = crate::nn::lora::LoraSpec {
        rank: cfg.rank,
        alpha: cfg.alpha,
        rslora: cfg.rslora,
        // Loaded for evaluation and sampling, which never drop.
        dropout: 0.0,
        targets: cfg
            .targets
            .split(',')
            .map(|t| t.trim().to_string())
            .collect(),
    };
    let adapted = model.attach_lora(&spec, 0).map_err(KilnError::Setting)?;
    if adapted.is_empty() {
        return Err(KilnError::checkpoint(
            dir.join(CONFIG),
            format!(
                "targets {} match no module of this model; the adapter belongs to another architecture",
                cfg.targets
            ),
        ));
    }
    load_adapter(model, dir)
}
