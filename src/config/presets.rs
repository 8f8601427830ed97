//! Named model sizes (`model.preset`). A preset is a layer between the defaults and the file:
//! it sets the model keys that neither the file nor an override set, so `model.preset=small
//! model.n_layers=6` is the small model with six layers, and `--print-config` shows
//! "preset small" beside each value it chose. Each family lists its presets in its registry
//! entry ([`crate::models::family::Family::presets`]).

use super::{ConfigError, Flat, Source};
use crate::models::family::{self, FAMILIES};
use std::collections::BTreeMap;
use toml::Value;

/// The preset names for `kind`, for error messages.
fn names(kind: &str) -> Vec<&'static str> {
    family::of(kind).map_or_else(Vec::new, |f| f.presets.iter().map(|p| p.name).collect())
}

/// The error for a preset `kind` does not have, listing the ones it has.
pub(crate) fn unknown(kind: &str, name: &str) -> ConfigError {
    let known = names(kind);
    ConfigError::NotAllowed {
        key: "model.preset",
        value: name.to_string(),
        allowed: if known.is_empty() {
            let others: Vec<String> = FAMILIES
                .iter()
                .filter(|f| !f.presets.is_empty())
                .map(|f| format!("{} has {}", f.kind, names(f.kind).join(", ")))
                .collect();
            format!(
                "\"\" (model.kind \"{kind}\" has no presets; {})",
                others.join("; ")
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
    let preset = family::of(&kind)
        .and_then(|f| f.presets.iter().find(|p| p.name == name))
        .ok_or_else(|| unknown(&kind, &name))?;
    for &(key, value) in preset.settings {
        if matches!(sources.get(key), Some(Source::Default)) {
            values.insert(key.to_string(), Value::Integer(value));
            sources.insert(key.to_string(), Source::Preset(preset.name));
        }
    }
    Ok(())
}
