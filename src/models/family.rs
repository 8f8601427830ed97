//! The model families kiln builds from `[model]` settings, one [`Family`] entry each.
//!
//! A family declares here, in one value, everything the rest of kiln asks of it by
//! `model.kind`: how its model is built, which settings it accepts beyond the shared checks,
//! how `kiln plan` describes it, its named sizes, a tiny shape for tests, and the features
//! that other code would otherwise find out by comparing kind strings. Each entry lives in
//! its family's model file; [`FAMILIES`] lists them. Its keys are the variant of
//! [`crate::config::FamilySettings`] that `defaults` returns.
//!
//! BERT-family encoders are not here: they come only from pretrained checkpoints
//! (`kiln embed`, `kiln classify`), never from `model.kind`.

use super::Model;
use crate::config::{ConfigError, FamilySettings, ModelConfig};
use crate::error::KilnError;
use crate::nn::ParamBuilder;

/// A named size: values for model keys that neither the file nor an override set.
pub struct Preset {
    pub name: &'static str,
    pub settings: &'static [(&'static str, i64)],
}

/// What a family's models can do, for the code that would otherwise test `model.kind`. A
/// test builds every family's tiny model and checks each flag against what it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    /// Block recomputation (`train.recompute=blocks`).
    pub recompute: bool,
    /// The unfused kernel chains (`train.fused_kernels=false`).
    pub unfused_kernels: bool,
    /// Mixture-of-experts layers, whose routing the trainer reports.
    pub moe: bool,
    /// Incremental decoding with a key/value cache (generation otherwise re-runs the window).
    pub kv_cache: bool,
    /// Low-rank adapters (`kiln finetune`, `lora.*`), and QLoRA's NF4 base with them.
    pub lora: bool,
    /// Planned by the analytic [`crate::plan::PlanRequest`] model beside the meta step; a
    /// family without it is planned by its meta step alone.
    pub analytic_plan: bool,
}

impl Features {
    /// None of them: a family names the ones it has (`..Features::NONE`).
    pub const NONE: Features = Features {
        recompute: false,
        unfused_kernels: false,
        moe: false,
        kv_cache: false,
        lora: false,
        analytic_plan: false,
    };
}

/// Builds the model `m` describes, with a `vocab`-token vocabulary, its parameters named and
/// filled (initialised or loaded) by the builder.
pub type Build =
    fn(m: &ModelConfig, vocab: usize, b: &mut ParamBuilder) -> Result<Box<dyn Model>, KilnError>;

/// One model family: everything kiln needs to know about `model.kind = kind`.
pub struct Family {
    /// The `model.kind` value.
    pub kind: &'static str,
    /// The name people know it by, for messages ("GPT", "ResNet-BK").
    pub name: &'static str,
    /// Its own settings at their defaults (the `[model]` keys only it has).
    pub defaults: fn() -> FamilySettings,
    /// The model `m` describes, with a `vocab`-token vocabulary, filled by a builder.
    pub build: Build,
    /// The range and consistency checks of its settings (the shared keys' are the config's).
    pub validate: fn(m: &ModelConfig) -> Result<(), ConfigError>,
    /// Its shape in a few words, for `kiln plan` ("d_model 64, 2 layers, 2 heads").
    pub describe: fn(m: &ModelConfig) -> String,
    /// Its named sizes (`model.preset`).
    pub presets: &'static [Preset],
    /// A shape small enough for a forward on the CPU in a test.
    pub tiny: fn() -> ModelConfig,
    pub features: Features,
    /// The parameters (kiln's names) a 4-bit base keeps in NF4, its block projections'
    /// weights: a base loaded for QLoRA leaves them on the host and quantises them from
    /// there, never holding them dense on the device. `None` without adapters.
    pub nf4_weights: Option<fn(&str) -> bool>,
}

/// Every family, in the order `--help` and error messages list them. A static (as is each
/// family's entry), so that every use sees the same addresses: a `const` is copied at each use,
/// and identity checks (`std::ptr::eq`) then depend on what the compiler happened to merge.
pub static FAMILIES: &[&Family] = &[
    &super::gpt::FAMILY,
    &super::resnet_bk::FAMILY,
    &super::llama::FAMILY,
];

/// The family `model.kind = kind` names.
pub fn of(kind: &str) -> Option<&'static Family> {
    FAMILIES.iter().copied().find(|f| f.kind == kind)
}

/// The `model.kind` values, comma-separated, for messages.
pub fn kinds() -> String {
    FAMILIES
        .iter()
        .map(|f| f.kind)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The shared keys at their defaults with `family` as the kind: the start of a `tiny` shape.
pub(crate) fn tiny_shape(family: FamilySettings) -> ModelConfig {
    ModelConfig {
        family,
        d_model: 32,
        n_layers: 2,
        n_heads: 2,
        context: 32,
        ..ModelConfig::default()
    }
}

/// The error for an entry handed another family's settings: a dispatch bug, not a setting.
pub(crate) fn other_family(entry: &str, m: &ModelConfig) -> ConfigError {
    ConfigError::Decode {
        reason: format!(
            "the {entry} family was given model.kind = \"{}\" settings",
            m.kind()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Device, MemoryPool};
    use crate::models::{Recompute, StepPrecision};
    use crate::nn::lora::LoraSpec;

    #[test]
    fn every_settings_variant_has_one_entry() {
        let kinds: Vec<&str> = FAMILIES.iter().map(|f| f.kind).collect();
        let mut unique = kinds.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), kinds.len(), "a kind listed twice: {kinds:?}");
        for f in FAMILIES {
            assert_eq!(
                (f.defaults)().kind(),
                f.kind,
                "{}: defaults of another kind",
                f.kind
            );
            assert_eq!(
                (f.tiny)().kind(),
                f.kind,
                "{}: tiny of another kind",
                f.kind
            );
            assert!(std::ptr::eq(of(f.kind).unwrap(), *f));
        }
        assert!(of("bert").is_none() && of("").is_none());
    }

    /// Each family's tiny shape passes its checks, builds, runs a forward and a training step
    /// on the CPU, and does what its features say.
    #[test]
    fn every_family_builds_runs_and_has_its_features() {
        for f in FAMILIES {
            let m = (f.tiny)();
            (f.validate)(&m).unwrap_or_else(|e| panic!("{}: tiny shape invalid: {e}", f.kind));
            assert!(!(f.describe)(&m).is_empty());
            let (vocab, batch, seq) = (40, 2, 8);
            let pool = MemoryPool::new(Device::Cpu);
            assert!(
                std::ptr::eq(m.entry(), *f),
                "{}: tiny shape of another kind",
                f.kind
            );
            let mut model = crate::models::build(&m, vocab, &pool, 7).unwrap();
            let inputs: Vec<u32> = (0..batch * seq).map(|i| (i * 7 % vocab) as u32).collect();
            let targets: Vec<u32> = (0..batch * seq).map(|i| (i * 3 % vocab) as u32).collect();
            let loss = model.loss(&inputs, &targets, batch, seq).unwrap();
            assert!(loss.is_finite() && loss > 0.0, "{}: loss {loss}", f.kind);
            // Built again from its own weights, nothing initialised, it computes the same.
            let weights: std::collections::BTreeMap<_, _> = model
                .params()
                .iter()
                .map(|p| {
                    let t = crate::nn::builder::HostTensor {
                        shape: p.value.shape().to_vec(),
                        data: p.value.to_vec().unwrap(),
                    };
                    (p.name.clone(), t)
                })
                .collect();
            let origin = std::path::Path::new("weights");
            let loaded = crate::models::load(&m, vocab, &pool, &weights, origin).unwrap();
            let again = loaded.loss(&inputs, &targets, batch, seq).unwrap();
            assert_eq!(
                again.to_bits(),
                loss.to_bits(),
                "{}: loaded model differs",
                f.kind
            );
            assert_eq!(model.next_logits(&inputs[..seq]).unwrap().len(), vocab);

            let step = StepPrecision {
                grad_scale: 1.0,
                grad_dtype: crate::engine::DType::F32,
            };
            model
                .forward_backward(&inputs, &targets, batch, seq, step)
                .unwrap();
            let feats = f.features;
            assert_eq!(
                model.take_routing_stats().is_some(),
                feats.moe,
                "{}: moe",
                f.kind
            );
            assert_eq!(model.decoder().is_some(), feats.kv_cache, "{}: kv", f.kind);
            assert_eq!(
                model.set_recompute(Recompute::Blocks).is_ok(),
                feats.recompute,
                "{}: recompute",
                f.kind
            );
            assert_eq!(
                model.set_kernels(crate::nn::Kernels::Unfused).is_ok(),
                feats.unfused_kernels,
                "{}: unfused kernels",
                f.kind
            );
            let spec = LoraSpec::from_config(&crate::config::LoraConfig {
                rank: 2,
                targets: "all-linear".into(),
                ..Default::default()
            });
            assert_eq!(
                model.attach_lora(&spec, 1).is_ok(),
                feats.lora,
                "{}: lora",
                f.kind
            );
            assert_eq!(f.nf4_weights.is_some(), feats.lora, "{}: nf4", f.kind);
            if let Some(nf4) = f.nf4_weights {
                // The names it gives are exactly the weights quantisation replaces.
                let named: Vec<String> = model
                    .params()
                    .iter()
                    .map(|p| p.name.clone())
                    .filter(|n| nf4(n))
                    .collect();
                model
                    .quantize_base_nf4(crate::engine::DType::F32, None)
                    .unwrap();
                let replaced: Vec<String> = model
                    .params()
                    .iter()
                    .filter(|p| p.value.is_empty())
                    .map(|p| p.name.clone())
                    .collect();
                assert!(!named.is_empty());
                assert_eq!(named, replaced, "{}: nf4 names", f.kind);
                // Loaded leaving those weights on the host, the pool never holds them, and
                // quantising from the host gives the model quantised after a dense load.
                let dense_loss = model.loss(&inputs, &targets, batch, seq).unwrap();
                let pool = MemoryPool::new(Device::Cpu);
                let mut deferred = crate::models::load_deferring(
                    &m,
                    vocab,
                    &pool,
                    &weights,
                    origin,
                    crate::models::Role::Train,
                    Some(nf4),
                )
                .unwrap();
                let kept: usize = weights
                    .iter()
                    .filter(|(n, _)| !nf4(n))
                    .map(|(_, t)| t.data.len())
                    .sum();
                let smallest = weights
                    .iter()
                    .filter(|(n, _)| nf4(n))
                    .map(|(_, t)| t.data.len())
                    .min()
                    .unwrap();
                // Values and gradients of the other parameters, and tables (rotary) less
                // than any one of the deferred weights would have taken.
                let peak = pool.stats().peak;
                assert!(
                    peak >= 2 * 4 * kept && peak < 2 * 4 * kept + 4 * smallest,
                    "{}: pool peak {peak} at load, other parameters {}",
                    f.kind,
                    2 * 4 * kept
                );
                deferred.attach_lora(&spec, 1).unwrap();
                deferred
                    .quantize_base_nf4(crate::engine::DType::F32, Some(&weights))
                    .unwrap();
                let loss = deferred.loss(&inputs, &targets, batch, seq).unwrap();
                assert_eq!(loss.to_bits(), dense_loss.to_bits(), "{}", f.kind);
            }
        }
    }

    #[test]
    fn presets_set_only_model_keys_of_their_family() {
        let own = crate::config::model::family_keys();
        for f in FAMILIES {
            for p in f.presets {
                for (key, _) in p.settings {
                    assert!(
                        own.get(*key).is_none_or(|k| *k == f.kind),
                        "{} preset {}: {key} is another family's",
                        f.kind,
                        p.name
                    );
                    assert!(crate::config::key_help(key).is_some(), "{key}");
                }
            }
        }
    }
}
