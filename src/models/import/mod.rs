//! Reading pretrained models from the formats they are published in.
//!
//! `gguf` reads llama.cpp's single-file format (metadata, tensor directory and quantised
//! blocks) and dequantises tensors to f32; `pretrained` turns a Hugging Face directory or a
//! GGUF file into kiln's model settings, tokenizer and named weights. The errors of this layer name the file and say what
//! to do, and convert to [`KilnError::Checkpoint`] (exit code 4) at the command line.

pub mod gguf;
pub mod pretrained;

pub use gguf::{GgmlType, GgufFile, GgufTensorInfo, GgufValue};
pub use pretrained::{HostTensor, Pretrained, Provenance};

use crate::error::KilnError;
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
         F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K and Q6_K); convert the file to one of those, for \
         example with llama.cpp's llama-quantize",
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

impl From<ImportError> for KilnError {
    fn from(e: ImportError) -> Self {
        KilnError::Checkpoint {
            path: e.path().to_path_buf(),
            reason: e.reason(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_import_error_becomes_a_checkpoint_error_with_exit_code_4() {
        let e = ImportError::UnsupportedType {
            path: "/models/x.gguf".into(),
            tensor: "blk.0.ffn_up.weight".into(),
            dtype: "IQ2_XS".into(),
        };
        let k = KilnError::from(e);
        assert_eq!(k.exit_code(), 4);
        let msg = k.to_string();
        assert!(
            msg.starts_with(
                "checkpoint /models/x.gguf: tensor blk.0.ffn_up.weight is stored as IQ2_XS"
            ),
            "{msg}"
        );
        assert!(!msg.contains("x.gguf: /models"), "{msg}");
    }
}
