//! Tokenizers: raw UTF-8 bytes, and GPT-2's byte-level BPE.
//!
//! Both are deterministic and lossless on valid text, and both decode any id sequence without
//! panicking, since decoding is also applied to whatever a half-trained model samples.

use std::sync::atomic::{AtomicBool, Ordering};

use super::DataError;

/// Maps text to token ids and back.
///
/// Contract relied on by [`encode_chunked`]: for any split of a text `a + b` where `a` ends with
/// a non-whitespace character and `b` starts with whitespace, `encode(a + b)` equals
/// `encode(a)` followed by `encode(b)`. Both built-in tokenizers satisfy it.
pub trait Tokenizer: Send + Sync {
    fn name(&self) -> &str;
    fn vocab_size(&self) -> usize;
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Decodes lossily: invalid UTF-8 and out-of-range ids become U+FFFD, never a panic.
    fn decode(&self, ids: &[u32]) -> String;
}

/// Names accepted by [`tokenizer_by_name`], in the order error messages list them.
pub const TOKENIZER_NAMES: &[&str] = &["byte", "gpt2"];

const REPLACEMENT: &str = "\u{fffd}";

fn unknown(name: &str) -> DataError {
    DataError::UnknownTokenizer {
        name: name.to_string(),
        known: TOKENIZER_NAMES.join(", "),
    }
}

/// Whether `name` names a pretrained model's tokenizer by path (a `tokenizer.json`, a model
/// directory or a `.gguf` file) rather than a built-in one. A directory in the working
/// directory counts without a slash (`--init-from Llama-3.2-1B`).
pub fn is_tokenizer_path(name: &str) -> bool {
    !TOKENIZER_NAMES.contains(&name)
        && (name.contains('/')
            || name.ends_with(".json")
            || name.ends_with(".gguf")
            || name.ends_with(".model")
            || std::path::Path::new(name).is_dir())
}

/// The tokenizer of a pretrained model at `path`: a directory with `tokenizer.json` (or only
/// a SentencePiece `tokenizer.model`), a `tokenizer.json` or `tokenizer.model` itself, or a
/// GGUF file's embedded vocabulary.
pub fn tokenizer_from_path(path: &std::path::Path) -> Result<super::HfTokenizer, DataError> {
    if path.is_dir() {
        super::HfTokenizer::from_dir(path)
    } else if path.extension().is_some_and(|e| e == "gguf") {
        let g = super::gguf::GgufFile::open(path).map_err(|e| DataError::TokenizerFile {
            path: path.to_path_buf(),
            reason: e.reason(),
        })?;
        super::HfTokenizer::from_gguf(&g)
    } else if path.extension().is_some_and(|e| e == "model") {
        super::HfTokenizer::from_sentencepiece_model(path)
    } else {
        super::HfTokenizer::from_file(path)
    }
}

/// Builds the tokenizer called `name` ("byte", "gpt2", or the path of a pretrained model's
/// tokenizer, see [`tokenizer_from_path`]).
pub fn tokenizer_by_name(name: &str) -> Result<Box<dyn Tokenizer>, DataError> {
    match name {
        "byte" => Ok(Box::new(ByteTokenizer)),
        "gpt2" => Ok(Box::new(Gpt2Tokenizer::new()?)),
        _ if is_tokenizer_path(name) => {
            Ok(Box::new(tokenizer_from_path(std::path::Path::new(name))?))
        }
        _ => Err(unknown(name)),
    }
}

/// The vocabulary size of tokenizer `name` without building it (building GPT-2's takes a
/// noticeable fraction of a second, parsing 50k ranks).
pub fn tokenizer_vocab_size(name: &str) -> Result<usize, DataError> {
    match name {
        "byte" => Ok(ByteTokenizer::VOCAB),
        "gpt2" => Ok(Gpt2Tokenizer::VOCAB),
        _ if is_tokenizer_path(name) => Ok(tokenizer_by_name(name)?.vocab_size()),
        _ => Err(unknown(name)),
    }
}

/// One token per UTF-8 byte: vocabulary 256, no training, no unknown input.
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub const VOCAB: usize = 256;
}

impl Tokenizer for ByteTokenizer {
    fn name(&self) -> &str {
        "byte"
    }

    fn vocab_size(&self) -> usize {
        Self::VOCAB
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            match u8::try_from(id) {
                Ok(b) => bytes.push(b),
                Err(_) => bytes.extend_from_slice(REPLACEMENT.as_bytes()),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// GPT-2's tokenizer (tiktoken `r50k_base`): 50,256 BPE tokens plus `<|endoftext|>` (50256).
///
/// Text is encoded as ordinary text, so a literal "<|endoftext|>" in a corpus is spelled out
/// in pieces rather than becoming the special token.
pub struct Gpt2Tokenizer {
    bpe: tiktoken_rs::CoreBPE,
}

impl Gpt2Tokenizer {
    pub const VOCAB: usize = 50_257;

    pub fn new() -> Result<Self, DataError> {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| DataError::TokenizerInit {
            name: "gpt2".to_string(),
            reason: e.to_string(),
        })?;
        Ok(Gpt2Tokenizer { bpe })
    }
}

impl std::fmt::Debug for Gpt2Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gpt2Tokenizer(r50k_base)")
    }
}

impl Tokenizer for Gpt2Tokenizer {
    fn name(&self) -> &str {
        "gpt2"
    }

    fn vocab_size(&self) -> usize {
        Self::VOCAB
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    fn decode(&self, ids: &[u32]) -> String {
        // Fast path: every id known. Otherwise decode one id at a time so that an unknown id
        // costs one replacement character instead of the whole string.
        let bytes = match self.bpe.decode_bytes(ids) {
            Ok(bytes) => bytes,
            Err(_) => {
                let mut bytes = Vec::with_capacity(ids.len() * 4);
                for &id in ids {
                    match self.bpe.decode_bytes(&[id]) {
                        Ok(b) => bytes.extend_from_slice(&b),
                        Err(_) => bytes.extend_from_slice(REPLACEMENT.as_bytes()),
                    }
                }
                bytes
            }
        };
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Target chunk size for [`encode_chunked`]: small enough that cancellation is prompt, large
/// enough that per-chunk overhead is invisible.
const CHUNK_BYTES: usize = 64 * 1024;

/// Splits `text` into pieces of roughly `target` bytes that a [`Tokenizer`] encodes
/// independently with the same result as encoding the whole text.
///
/// A piece ends just before a line break ("\n" or "\r\n") that follows a non-whitespace
/// character. GPT-2's pre-tokeniser never puts a non-whitespace character and a following
/// whitespace character in one piece, and none of its rules looks back, so the token stream
/// is cut there anyway. Text without such a line break stays in one piece.
pub fn chunk_text(text: &str, target: usize) -> Vec<&str> {
    let mut chunks = Vec::with_capacity(text.len() / target.max(1) + 1);
    let mut start = 0;
    while start < text.len() {
        let end = chunk_end(text, start, target.max(1));
        chunks.push(&text[start..end]);
        start = end;
    }
    chunks
}

fn chunk_end(text: &str, start: usize, target: usize) -> usize {
    let mut from = start + target;
    if from >= text.len() {
        return text.len();
    }
    // `find` needs a char boundary; '\n' is ASCII so moving forward never skips one.
    while !text.is_char_boundary(from) {
        from += 1;
    }
    while let Some(i) = text[from..].find('\n') {
        let nl = from + i;
        let cut = if text[..nl].ends_with('\r') {
            nl - 1
        } else {
            nl
        };
        if let Some(prev) = text[..cut].chars().next_back()
            && cut > start
            && !prev.is_whitespace()
        {
            return cut;
        }
        from = nl + 1;
    }
    text.len()
}

/// Encodes `text` in chunks (see [`chunk_text`]) on `threads` threads, checking `cancel`
/// between chunks so that a loader being shut down stops within one chunk. Returns `None`
/// when cancelled. The result equals `tok.encode(text)`: each thread takes a contiguous run
/// of chunks and the runs are joined in order.
pub fn encode_chunked(
    tok: &dyn Tokenizer,
    text: &str,
    cancel: &AtomicBool,
    threads: usize,
) -> Option<Vec<u32>> {
    let chunks = chunk_text(text, CHUNK_BYTES);
    let encode_run = |run: &[&str]| -> Option<Vec<u32>> {
        // About 3.5 bytes per GPT-2 token in English; one reservation avoids most regrowth.
        let bytes: usize = run.iter().map(|c| c.len()).sum();
        let mut out = Vec::with_capacity(bytes / 3 + 16);
        for chunk in run {
            if cancel.load(Ordering::Relaxed) {
                return None;
            }
            out.extend(tok.encode(chunk));
        }
        Some(out)
    };
    let threads = threads.clamp(1, chunks.len().max(1));
    if threads == 1 {
        return encode_run(&chunks);
    }
    let per = chunks.len().div_ceil(threads);
    let parts: Vec<Option<Vec<u32>>> = std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .chunks(per)
            .map(|run| s.spawn(move || encode_run(run)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(None))
            .collect()
    });
    let mut out = Vec::with_capacity(text.len() / 3 + 16);
    for part in parts {
        out.extend(part?);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_round_trip_and_lossy_decode() {
        let t = ByteTokenizer;
        let s = "Hello, wörld! \u{1f600}\n";
        let ids = t.encode(s);
        assert_eq!(ids.len(), s.len());
        assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
        assert_eq!(t.decode(&ids), s);
        // A cut multi-byte character and an out-of-range id both become U+FFFD.
        assert_eq!(t.decode(&[104, 0xc3]), "h\u{fffd}");
        assert_eq!(t.decode(&[104, 300, 105]), "h\u{fffd}i");
    }

    #[test]
    fn gpt2_known_ids_and_round_trip() {
        let t = Gpt2Tokenizer::new().unwrap();
        assert_eq!(t.vocab_size(), 50_257);
        assert_eq!(t.encode("Hello world"), vec![15496, 995]);
        let s = "To be, or not to be: that is the question.\n\nWhether 'tis nobler — 42 ✓";
        assert_eq!(t.decode(&t.encode(s)), s);
        // Special-token text is ordinary text here.
        assert_ne!(t.encode("<|endoftext|>"), vec![50256]);
    }

    #[test]
    fn gpt2_decodes_every_id_without_panic() {
        let t = Gpt2Tokenizer::new().unwrap();
        let all: Vec<u32> = (0..t.vocab_size() as u32).collect();
        assert!(!t.decode(&all).is_empty());
        for id in [0, 50255, 50256] {
            let _ = t.decode(&[id]);
        }
        assert_eq!(t.decode(&[15496, 60_000, 995]), "Hello\u{fffd} world");
    }

    #[test]
    fn by_name() {
        assert_eq!(tokenizer_by_name("byte").unwrap().vocab_size(), 256);
        assert_eq!(tokenizer_by_name("gpt2").unwrap().name(), "gpt2");
        assert_eq!(tokenizer_vocab_size("gpt2").unwrap(), 50_257);
        let msg = tokenizer_by_name("bpe").err().unwrap().to_string();
        assert!(msg.contains("byte") && msg.contains("gpt2"), "{msg}");
        assert!(tokenizer_vocab_size("x").is_err());
    }

    #[test]
    fn chunks_partition_text_at_line_ends() {
        let text = "ab\n\ncd  \n\nef\r\n\r\ngh\n";
        for target in 1..text.len() + 2 {
            let chunks = chunk_text(text, target);
            assert_eq!(chunks.concat(), text, "target {target}");
            for c in &chunks[1..] {
                assert!(c.starts_with(char::is_whitespace), "{chunks:?}");
            }
        }
        assert_eq!(chunk_text("", 4), Vec::<&str>::new());
        assert_eq!(chunk_text("no breaks at all", 2), vec!["no breaks at all"]);
    }

    #[test]
    fn chunked_encoding_equals_whole_encoding() {
        let corpus = super::super::Corpus::load(None).unwrap();
        // A slice with dialogue, blank-line runs and indentation keeps the test quick.
        let end = (400_000..)
            .find(|&i| corpus.text.is_char_boundary(i))
            .unwrap();
        let text = &corpus.text[..end];
        let never = AtomicBool::new(false);
        let crlf = text.replace('\n', "\r\n");
        for tok in [
            Box::new(ByteTokenizer) as Box<dyn Tokenizer>,
            Box::new(Gpt2Tokenizer::new().unwrap()),
        ] {
            for text in [text, crlf.as_str()] {
                let whole = tok.encode(text);
                for target in [1000, CHUNK_BYTES] {
                    let mut chunked = Vec::new();
                    for c in chunk_text(text, target) {
                        chunked.extend(tok.encode(c));
                    }
                    assert_eq!(chunked, whole, "{} target {target}", tok.name());
                }
                for threads in [1, 3] {
                    assert_eq!(
                        encode_chunked(tok.as_ref(), text, &never, threads).unwrap(),
                        whole
                    );
                }
            }
        }
        assert!(encode_chunked(&ByteTokenizer, text, &AtomicBool::new(true), 2).is_none());
    }
}
