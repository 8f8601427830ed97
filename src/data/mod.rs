//! The data pipeline: corpus, tokenizers (built-in, and pretrained models' own with their
//! chat templates), the GGUF file reader (vocabularies and weights), train/validation split,
//! batches and the background loader.
//!
//! Everything here is deterministic. The validation set is a fixed tail of the token stream,
//! validation windows are evenly spaced, and each training window's position is a pure
//! function of `(seed, step, micro, row)`, so a run's data is fully described by its
//! configuration and the step it is at.

mod batch;
mod builtin_json;
mod chat;
mod corpus;
mod error;
pub mod gguf;
pub(crate) mod hf_tokenizer;
mod import_error;
mod prefetch;
pub(crate) mod sentencepiece_model;
pub mod sft;
mod tokenizer;

pub use batch::{
    Batch, TokenSplits, check_train_len, split_tokens, train_batch, train_rows,
    unigram_cross_entropy, val_batches, window_counter,
};
pub use chat::{ChatMessage, render_chat};
pub use corpus::{BUNDLED_SOURCE, Corpus};
pub use error::DataError;
pub use hf_tokenizer::HfTokenizer;
pub use import_error::ImportError;
pub use prefetch::{DataSpec, Prefetcher, epoch_rows, load_splits};
pub use tokenizer::{
    ByteTokenizer, Gpt2Tokenizer, TOKENIZER_NAMES, Tokenizer, chunk_text, encode_chunked,
    is_tokenizer_path, tokenizer_by_name, tokenizer_from_path, tokenizer_vocab_size,
};
