//! Errors raised while building or checking a run configuration.
//!
//! Every message is meant to be read by the person launching a run, so each
//! one names the offending key, says where the bad value came from when that
//! is known, and suggests what to write instead.

use std::fmt;
use std::path::PathBuf;

use super::Source;

/// Everything that can go wrong while resolving or validating a [`super::Config`].
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The `--config` file could not be read.
    #[error("cannot read config file {}: {reason}; check the path given to --config", path.display())]
    ReadFile { path: PathBuf, reason: String },

    /// The `--config` file is not valid TOML.
    #[error("config file {} is not valid TOML: {reason}", path.display())]
    ParseFile { path: PathBuf, reason: String },

    /// An override argument is not of the form `KEY=VALUE`.
    #[error("override '{arg}' is not of the form KEY=VALUE; write for example train.steps=100")]
    OverrideSyntax { arg: String },

    /// A key that the configuration does not have.
    #[error("unknown config key '{key}' (from {origin}); {hint}")]
    UnknownKey {
        key: String,
        origin: Source,
        /// Either "did you mean ...?" or the list of valid keys.
        hint: String,
    },

    /// A key of another model family than the chosen `model.kind`.
    #[error(
        "{key} (from {origin}) is a setting of model.kind = \"{family}\", but model.kind is \"{kind}\"; remove {key}, or set model.kind={family} to use it"
    )]
    OtherFamilyKey {
        key: String,
        family: &'static str,
        kind: String,
        origin: Source,
    },

    /// A whole section was given a plain value, as in `model=3`.
    #[error(
        "'{section}' (from {origin}) is a section, not a value; set a key inside it instead, e.g. {example}"
    )]
    SectionAsValue {
        section: String,
        origin: Source,
        example: String,
    },

    /// A plain value was treated as a section, as in `train.steps.max=3`.
    #[error(
        "'{key}' (from {origin}) is a single value, not a section; set it directly, e.g. {key} = {example}"
    )]
    ValueAsSection {
        key: String,
        origin: Source,
        example: String,
    },

    /// `--profile` named neither a built-in profile nor a `.toml` file.
    #[error("unknown profile '{name}'; use one of {known}, or a path ending in .toml")]
    UnknownProfile { name: String, known: String },

    /// `train.global_batch` and the micro-batch or accumulation disagree.
    #[error("{detail}")]
    GlobalBatch { detail: String },

    /// A value of the wrong TOML type.
    #[error(
        "{key} expects {expected}, got {got} ({got_type}) from {origin}; use a value like {example}"
    )]
    WrongType {
        key: &'static str,
        expected: &'static str,
        got: String,
        got_type: &'static str,
        origin: Source,
        example: Box<str>,
    },

    /// A float that is NaN or infinite.
    #[error("{key} is {value}; it must be a finite number")]
    NotFinite { key: &'static str, value: f64 },

    /// A number outside the range the key accepts.
    #[error("{key} = {value} is out of range; {rule}")]
    OutOfRange {
        key: &'static str,
        value: String,
        /// What the value must satisfy, phrased as the fix.
        rule: String,
    },

    /// A string that is not one of the accepted choices.
    #[error("{key} = \"{value}\" is not supported; use one of: {allowed}")]
    NotAllowed {
        key: &'static str,
        value: String,
        allowed: String,
    },

    /// Attention heads must split the model width evenly.
    #[error(
        "model.d_model {d_model} is not divisible by model.n_heads {n_heads}; pick d_model as a multiple of n_heads"
    )]
    HeadsDoNotDivide { d_model: usize, n_heads: usize },

    /// Training sequences longer than the positional table the model has.
    #[error(
        "train.seq_len {seq_len} is longer than the model's context model.context {context}; lower train.seq_len or raise model.context"
    )]
    SeqLenExceedsContext { seq_len: usize, context: usize },

    /// The merged table did not decode into a `Config`; the per-key checks
    /// make this unreachable for user input, so it signals a bug.
    #[error("internal error: resolved config did not decode: {reason}")]
    Decode { reason: String },
}

/// Levenshtein distance over chars.
pub(crate) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    // Single rolling row: only the previous row is ever consulted.
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            let cost = usize::from(ca != *cb);
            row[j + 1] = (diag + cost).min(above + 1).min(row[j] + 1);
            diag = above;
        }
    }
    row[b.len()]
}

fn last_segment(key: &str) -> &str {
    key.rsplit('.').next().unwrap_or(key)
}

fn section_of(key: &str) -> &str {
    key.split('.').next().unwrap_or(key)
}

/// A candidate is "close" when the edit distance is at most a third of the
/// longer string (and always allows one typo), so short keys like `lr` don't
/// match everything while long ones tolerate a couple of slips.
fn close(a: &str, b: &str) -> Option<usize> {
    let d = edit_distance(a, b);
    let limit = (a.chars().count().max(b.chars().count()) / 3).max(1);
    (d <= limit).then_some(d)
}

/// Builds the hint for an unknown key: up to three close keys, or failing
/// that the keys of the section the user seemed to mean.
pub(crate) fn unknown_key_hint(key: &str, keys: &[&'static str]) -> String {
    // Comparing the last segment too catches a right field name placed under
    // the wrong section (`train.lr` -> `optim.lr`) and bare field names.
    let mut scored: Vec<(usize, bool, usize, &str)> = keys
        .iter()
        .enumerate()
        .filter_map(|(idx, cand)| {
            let full = close(key, cand);
            let (typed, field) = (last_segment(key), last_segment(cand));
            // A fragment of the real name (`batch` for `micro_batch`) is far
            // in edit distance but plainly what was meant.
            let seg = if typed.len() >= 3 && (field.contains(typed) || typed.contains(field)) {
                Some(1.min(edit_distance(typed, field)))
            } else {
                close(typed, field)
            };
            let score = match (full, seg) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => return None,
            };
            let other_section = section_of(key) != section_of(cand);
            Some((score, other_section, idx, *cand))
        })
        .collect();
    scored.sort();
    let picks: Vec<String> = scored
        .iter()
        .take(3)
        .map(|(_, _, _, k)| format!("'{k}'"))
        .collect();
    if !picks.is_empty() {
        return format!("did you mean {}?", join_or(&picks));
    }
    let section = section_of(key);
    let in_section: Vec<&str> = keys
        .iter()
        .copied()
        .filter(|k| section_of(k) == section && k.contains('.'))
        .collect();
    if in_section.is_empty() {
        let mut sections: Vec<&str> = keys.iter().map(|k| section_of(k)).collect();
        sections.dedup();
        format!(
            "the sections are {}; run with --print-config to see every key",
            sections.join(", ")
        )
    } else {
        format!("valid keys in [{section}] are {}", in_section.join(", "))
    }
}

fn join_or(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::File(path) => write!(f, "{}", path.display()),
            Source::Override => f.write_str("override"),
            Source::Profile(name) => write!(f, "profile {name}"),
            Source::Auto(rule) => write!(f, "auto: {rule}"),
            Source::Preset(name) => write!(f, "preset {name}"),
        }
    }
}
