//! The one error type of the data pipeline.
//!
//! Every message names what is wrong and the setting or file to change, because these errors
//! reach the user directly from the CLI and usually mean a configuration mistake.

use std::path::PathBuf;

/// Everything that can go wrong between a corpus file and a batch of token ids.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error(
        "corpus file {} does not exist; check the path, or leave data.corpus empty to train on \
         the bundled Shakespeare corpus",
        path.display()
    )]
    CorpusMissing { path: PathBuf },

    #[error("cannot read corpus file {}: {source}; check that it is a readable file", path.display())]
    CorpusUnreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "corpus {source_name} is not valid UTF-8 (first bad byte at offset {offset}); convert it \
         to UTF-8 text, for example with `iconv -t UTF-8`"
    )]
    CorpusNotUtf8 { source_name: String, offset: usize },

    #[error(
        "corpus {source_name} is empty or contains only whitespace; point data.corpus at a text \
         file, or leave it empty to train on the bundled Shakespeare corpus"
    )]
    CorpusEmpty { source_name: String },

    #[error(
        "the bundled corpus could not be decompressed ({0}); the binary is damaged, rebuild it"
    )]
    BundledCorrupt(#[source] std::io::Error),

    #[error("unknown tokenizer {name:?}; known tokenizers: {known}")]
    UnknownTokenizer { name: String, known: String },

    #[error("the {name} tokenizer could not be initialised: {reason}")]
    TokenizerInit { name: String, reason: String },

    /// A split holds fewer tokens than one training or evaluation window needs.
    #[error(
        "the {split} split has {have} tokens, but one window of train.seq_len + 1 needs {need}; \
         {hint}"
    )]
    TooShort {
        split: &'static str,
        have: usize,
        need: usize,
        hint: &'static str,
    },

    /// A tokenizer file (tokenizer.json, a tokenizer_config.json beside it, or a GGUF
    /// vocabulary) that cannot be loaded.
    #[error("tokenizer {}: {reason}", path.display())]
    TokenizerFile { path: PathBuf, reason: String },

    /// A chat template that does not parse or fails while rendering (its own
    /// `raise_exception` included).
    #[error(
        "the chat template fails{}: {reason}",
        line.map(|l| format!(" at line {l}")).unwrap_or_default()
    )]
    ChatTemplate { line: Option<usize>, reason: String },

    /// A data file other than the corpus (prompts, fine-tuning records) is unreadable or has
    /// a bad record; `reason` names the line where there is one.
    #[error("{}: {reason}", path.display())]
    File { path: PathBuf, reason: String },

    #[error("invalid data setting: {0}")]
    InvalidSpec(String),

    /// The background loader stopped without a result (its thread panicked or could not start).
    #[error("the data loader failed: {0}")]
    Loader(String),
}
