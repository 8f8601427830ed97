//! The errors of reading a pretrained model file (a GGUF file's header, metadata and tensors).
//! Every message names the file and says what to do; at the command line they become
//! checkpoint errors (exit code 4).

use std::path::{Path, PathBuf};

/// Everything that can go wrong reading a pretrained model file. Every message starts with the
/// file's path followed by ": ".
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("{}: cannot read the file: {source}; check the path and that the file is readable", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The file is not in the format asked for, or its header contradicts itself.
    #[error("{}: {reason}", path.display())]
    Format { path: PathBuf, reason: String },

    /// Something the header describes lies past the end of the file.
    #[error(
        "{}: the file is truncated: {what} ends at byte {end} but the file has only {len} bytes; \
         the download or copy is incomplete, fetch the file again",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        what: String,
        end: u64,
        len: u64,
    },

    #[error(
        "{}: tensor {tensor} is stored as {dtype}, which kiln cannot dequantise (it reads F32, \
         F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_NL \
         and IQ4_XS); convert the file to one of those, for example with llama.cpp's \
         llama-quantize",
        path.display()
    )]
    UnsupportedType {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },

    #[error("{}: there is no tensor named {name:?}; {hint}", path.display())]
    MissingTensor {
        path: PathBuf,
        name: String,
        hint: String,
    },

    /// A metadata entry a caller needs is absent or has the wrong type.
    #[error("{}: metadata {key}: {reason}", path.display())]
    Metadata {
        path: PathBuf,
        key: String,
        reason: String,
    },
}

impl ImportError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            ImportError::Io { path, .. }
            | ImportError::Format { path, .. }
            | ImportError::Truncated { path, .. }
            | ImportError::UnsupportedType { path, .. }
            | ImportError::MissingTensor { path, .. }
            | ImportError::Metadata { path, .. } => path,
        }
    }

    /// The message without the leading path, for wrappers that print the path themselves.
    pub fn reason(&self) -> String {
        let full = self.to_string();
        let prefix = format!("{}: ", self.path().display());
        match full.strip_prefix(&prefix) {
            Some(rest) => rest.to_string(),
            None => full,
        }
    }
}
