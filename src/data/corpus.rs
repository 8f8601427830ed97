//! The training text: a user's file, or the Shakespeare corpus compiled into the binary.
//!
//! The default corpus is embedded (gzip, about 2 MB) so that a fresh build trains with no
//! download and every default run sees exactly the same bytes.

use std::io::Read;
use std::path::Path;

use super::DataError;

/// The gzip-compressed default corpus: the 42 works of Shakespeare, 5,057,282 bytes of ASCII.
static BUNDLED_GZ: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/data/shakespeare.txt.gz"
));

/// Name reported as the source of the embedded corpus.
pub const BUNDLED_SOURCE: &str = "bundled shakespeare.txt";

/// Uncompressed size of the embedded corpus, used to size the buffer in one allocation.
const BUNDLED_LEN: usize = 5_057_282;

/// A loaded corpus: the whole text and where it came from (for logs and run records).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corpus {
    pub text: String,
    pub source: String,
}

impl Corpus {
    /// Loads `path`, or the bundled corpus when `path` is `None`.
    ///
    /// The text must be UTF-8 and contain something other than whitespace. A leading byte-order
    /// mark is dropped, since editors add it invisibly and it would otherwise become a token.
    pub fn load(path: Option<&Path>) -> Result<Corpus, DataError> {
        let (bytes, source) = match path {
            None => (bundled_bytes()?, BUNDLED_SOURCE.to_string()),
            Some(path) => (read_file(path)?, path.display().to_string()),
        };
        let mut text = String::from_utf8(bytes).map_err(|e| DataError::CorpusNotUtf8 {
            source_name: source.clone(),
            offset: e.utf8_error().valid_up_to(),
        })?;
        if text.starts_with('\u{feff}') {
            text.drain(..'\u{feff}'.len_utf8());
        }
        if text.trim().is_empty() {
            return Err(DataError::CorpusEmpty {
                source_name: source,
            });
        }
        Ok(Corpus { text, source })
    }
}

fn bundled_bytes() -> Result<Vec<u8>, DataError> {
    let mut out = Vec::with_capacity(BUNDLED_LEN);
    flate2::read::GzDecoder::new(BUNDLED_GZ)
        .read_to_end(&mut out)
        .map_err(DataError::BundledCorrupt)?;
    Ok(out)
}

fn read_file(path: &Path) -> Result<Vec<u8>, DataError> {
    std::fs::read(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            DataError::CorpusMissing {
                path: path.to_path_buf(),
            }
        } else {
            DataError::CorpusUnreadable {
                path: path.to_path_buf(),
                source,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// A path under the temp directory that no other test (or test run) uses.
    fn temp_path(tag: &str) -> PathBuf {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        std::env::temp_dir().join(format!("kiln-corpus-{tag}-{}-{n}.txt", std::process::id()))
    }

    #[test]
    fn bundled_corpus_loads() {
        let c = Corpus::load(None).unwrap();
        assert_eq!(c.text.len(), BUNDLED_LEN);
        assert_eq!(c.source, BUNDLED_SOURCE);
        assert!(c.text.is_ascii());
        assert!(
            c.text
                .starts_with("ALL'S WELL THAT ENDS WELL\n\nby William Shakespeare\n"),
            "{:?}",
            &c.text[..80]
        );
    }

    #[test]
    fn missing_file_names_path_and_fix() {
        let p = temp_path("missing");
        let err = Corpus::load(Some(&p)).unwrap_err();
        assert!(matches!(err, DataError::CorpusMissing { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(msg.contains(&p.display().to_string()), "{msg}");
        assert!(msg.contains("data.corpus"), "{msg}");
    }

    #[test]
    fn empty_and_blank_files_are_errors() {
        for (tag, content) in [("empty", ""), ("blank", " \n\t\n")] {
            let p = temp_path(tag);
            std::fs::write(&p, content).unwrap();
            let err = Corpus::load(Some(&p)).unwrap_err();
            std::fs::remove_file(&p).unwrap();
            assert!(matches!(err, DataError::CorpusEmpty { .. }), "{err:?}");
            assert!(err.to_string().contains("empty"), "{err}");
        }
    }

    #[test]
    fn non_utf8_reports_offset_and_bom_is_dropped() {
        let p = temp_path("latin1");
        std::fs::write(&p, b"caf\xe9 au lait").unwrap();
        let err = Corpus::load(Some(&p)).unwrap_err();
        std::fs::remove_file(&p).unwrap();
        assert!(
            matches!(err, DataError::CorpusNotUtf8 { offset: 3, .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains("UTF-8"), "{err}");

        let p = temp_path("bom");
        std::fs::write(&p, "\u{feff}hello").unwrap();
        let c = Corpus::load(Some(&p)).unwrap();
        std::fs::remove_file(&p).unwrap();
        assert_eq!(c.text, "hello");
        assert_eq!(c.source, p.display().to_string());
    }

    #[test]
    fn directory_is_unreadable_not_missing() {
        let err = Corpus::load(Some(&std::env::temp_dir())).unwrap_err();
        assert!(matches!(err, DataError::CorpusUnreadable { .. }), "{err:?}");
    }
}
