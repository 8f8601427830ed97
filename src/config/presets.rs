//! Named model sizes (`model.preset`). A preset is a layer between the defaults and the file:
//! it sets the model keys that neither the file nor an override set, so `model.preset=small
//! model.n_layers=6` is the small model with six layers, and `--print-config` shows
//! "preset small" beside each value it chose.

use super::{ConfigError, Flat, Source};
use std::collections::BTreeMap;
use toml::Value;

struct Preset {
    kind: &'static str,
    name: &'static str,
    settings: &'static [(&'static str, i64)],
}

const PRESETS: &[Preset] = &[
    Preset {
        kind: "resnet_bk",
        name: "tiny",
        settings: &[
            ("model.d_model", 64),
            ("model.n_layers", 2),
            ("model.moe_experts", 4),
            ("model.moe_top_k", 1),
            ("model.moe_hidden", 128),
        ],
    },
    // Two of four experts of width 2 x d_model per token: the compute of a dense 4 x d_model
    // MLP, with twice its parameters.
    Preset {
        kind: "resnet_bk",
        name: "small",
        settings: &[
            ("model.d_model", 128),
            ("model.n_layers", 4),
            ("model.moe_experts", 4),
            ("model.moe_top_k", 2),
            ("model.moe_hidden", 256),
        ],
    },
    Preset {
        kind: "resnet_bk",
        name: "base",
        settings: &[
            ("model.d_model", 256),
            ("model.n_layers", 8),
            ("model.moe_experts", 8),
            ("model.moe_top_k", 2),
            ("model.moe_hidden", 512),
        ],
    },
];

/// The preset names for `kind`, for error messages.
pub(crate) fn names(kind: &str) -> Vec<&'static str> {
    PRESETS
        .iter()
        .filter(|p| p.kind == kind)
        .map(|p| p.name)
        .collect()
}

/// The error for a preset `kind` does not have, listing the ones it has.
pub(crate) fn unknown(kind: &str, name: &str) -> ConfigError {
    let known = names(kind);
    ConfigError::NotAllowed {
        key: "model.preset",
        value: name.to_string(),
        allowed: if known.is_empty() {
            format!(
                "\"\" (model.kind \"{kind}\" has no presets; resnet_bk has {})",
                names("resnet_bk").join(", ")
            )
        } else {
            format!(
                "{} (for model.kind \"{kind}\"), or \"\" for none",
                known.join(", ")
            )
        },
    }
}

/// Applies `model.preset` (if set) to the keys still at their defaults.
pub(super) fn apply(
    values: &mut Flat,
    sources: &mut BTreeMap<String, Source>,
) -> Result<(), ConfigError> {
    let text = |key: &str| match values.get(key) {
        Some(Value::String(s)) => s.clone(),
        _ => String::new(),
    };
    let (name, kind) = (text("model.preset"), text("model.kind"));
    if name.is_empty() {
        return Ok(());
    }
    let preset = PRESETS
        .iter()
        .find(|p| p.kind == kind && p.name == name)
        .ok_or_else(|| unknown(&kind, &name))?;
    for &(key, value) in preset.settings {
        if matches!(sources.get(key), Some(Source::Default)) {
            values.insert(key.to_string(), Value::Integer(value));
            sources.insert(key.to_string(), Source::Preset(preset.name));
        }
    }
    Ok(())
}
