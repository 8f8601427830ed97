//! Hardware profiles: the layer between the built-in defaults and a `--config` file.
//!
//! A profile is a small TOML file under `profiles/` in the repository (compiled into the
//! binary, so kiln needs no files at run time) holding the settings that suit one class of
//! machine: precision, recomputation, loader depth. `--profile NAME` picks one by name,
//! `--profile PATH.toml` reads a file, and `--profile auto` (the default) picks the profile
//! that matches the detected GPU and then lets [`super::auto`] derive the values that
//! depend on the exact machine and model (precision from the compute capability, the
//! micro-batch from the memory planner).

use std::path::Path;

use super::ConfigError;

/// A profile's name and TOML text.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    pub name: String,
    pub text: String,
}

/// The profiles shipped with kiln, by name.
pub const BUILTIN: &[(&str, &str)] = &[
    ("h100", include_str!("../../profiles/h100.toml")),
    ("a100", include_str!("../../profiles/a100.toml")),
    ("rtx4090", include_str!("../../profiles/rtx4090.toml")),
    ("rtx3090", include_str!("../../profiles/rtx3090.toml")),
    ("lowmem", include_str!("../../profiles/lowmem.toml")),
    ("cpu", include_str!("../../profiles/cpu.toml")),
];

/// Names accepted by `--profile` besides file paths.
pub fn known_names() -> String {
    let mut names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
    names.push("auto");
    names.push("none");
    names.join(", ")
}

impl Profile {
    /// A built-in profile by name, or a TOML file when `name` ends in `.toml`.
    pub fn load(name: &str) -> Result<Profile, ConfigError> {
        if let Some((n, text)) = BUILTIN.iter().find(|(n, _)| *n == name) {
            return Ok(Profile {
                name: n.to_string(),
                text: text.to_string(),
            });
        }
        if name.ends_with(".toml") {
            let path = Path::new(name);
            let text = std::fs::read_to_string(path).map_err(|e| ConfigError::ReadFile {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
            return Ok(Profile {
                name: name.to_string(),
                text,
            });
        }
        Err(ConfigError::UnknownProfile {
            name: name.to_string(),
            known: known_names(),
        })
    }
}

/// The built-in profile for a GPU, from its name and memory; `None` means the CPU profile.
pub fn for_gpu(gpu: Option<(&str, usize)>) -> &'static str {
    let Some((name, memory)) = gpu else {
        return "cpu";
    };
    let name = name.to_ascii_lowercase();
    let gib = memory as f64 / (1u64 << 30) as f64;
    if name.contains("h100") || name.contains("h200") || name.contains("gh200") {
        "h100"
    } else if name.contains("a100") {
        "a100"
    } else if gib <= 12.5 {
        "lowmem"
    } else if name.contains("4090") {
        "rtx4090"
    } else if name.contains("3090") {
        "rtx3090"
    } else if gib >= 40.0 {
        // Another data-centre GPU (L40S, A6000, B200, ...): memory like an A100's.
        "a100"
    } else {
        // A 16-24 GB card without its own profile.
        "rtx3090"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ResolvedConfig;

    const GIB: usize = 1 << 30;

    #[test]
    fn gpus_map_to_profiles() {
        assert_eq!(for_gpu(None), "cpu");
        assert_eq!(for_gpu(Some(("NVIDIA H200", 141 * GIB))), "h100");
        assert_eq!(for_gpu(Some(("NVIDIA H100 80GB HBM3", 80 * GIB))), "h100");
        assert_eq!(for_gpu(Some(("NVIDIA A100-SXM4-40GB", 40 * GIB))), "a100");
        assert_eq!(
            for_gpu(Some(("NVIDIA GeForce RTX 4090", 24 * GIB))),
            "rtx4090"
        );
        assert_eq!(
            for_gpu(Some(("NVIDIA GeForce RTX 3060", 12 * GIB))),
            "lowmem"
        );
        assert_eq!(for_gpu(Some(("Tesla T4", 15 * GIB))), "rtx3090");
        assert_eq!(for_gpu(Some(("NVIDIA L40S", 45 * GIB))), "a100");
    }

    /// Every shipped profile parses, uses only known keys and validates on top of the
    /// defaults.
    #[test]
    fn every_builtin_profile_resolves() {
        for (name, _) in BUILTIN {
            let p = Profile::load(name).unwrap();
            let r = ResolvedConfig::resolve_layers(Some(&p), None, &[])
                .unwrap_or_else(|e| panic!("profile {name}: {e}"));
            assert!(
                r.sources
                    .values()
                    .any(|s| *s == crate::config::Source::Profile(name.to_string())),
                "profile {name} sets nothing"
            );
        }
    }

    #[test]
    fn unknown_profile_lists_the_known_ones() {
        let err = Profile::load("h300").unwrap_err().to_string();
        assert!(
            err.contains("h300") && err.contains("rtx3090, lowmem, cpu, auto, none"),
            "{err}"
        );
    }

    #[test]
    fn a_profile_with_a_bad_key_or_value_names_it() {
        let bad_key = Profile {
            name: "mine".into(),
            text: "[train]\nmicro_bach = 4\n".into(),
        };
        let err = ResolvedConfig::resolve_layers(Some(&bad_key), None, &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("micro_bach")
                && err.contains("profile mine")
                && err.contains("micro_batch"),
            "{err}"
        );
        let zero = Profile {
            name: "mine".into(),
            text: "[train]\nmicro_batch = 0\n".into(),
        };
        let err = ResolvedConfig::resolve_layers(Some(&zero), None, &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("train.micro_batch"), "{err}");
    }
}
