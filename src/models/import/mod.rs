//! Reading pretrained models from the formats they are published in.
//!
//! `gguf` reads llama.cpp's single-file format (metadata, tensor directory and quantised
//! blocks) and dequantises tensors to f32; it lives in `data`, below the models, because
//! tokenizers read GGUF vocabularies too, and is re-exported here. `pretrained` turns a
//! Hugging Face directory or a GGUF file into kiln's model settings, tokenizer and named
//! weights; `bert` does the same for BERT-family encoders with their sentence-transformers
//! pooling. The errors of this layer name the file and say what to do, and convert to
//! [`KilnError::Checkpoint`] (exit code 4) at the command line.

pub mod bert;
pub mod pretrained;

pub use crate::data::ImportError;
pub use crate::data::gguf::{self, GgmlType, GgufFile, GgufTensorInfo, GgufValue};
pub use pretrained::{HostTensor, Pretrained, Provenance};

use crate::error::KilnError;

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
