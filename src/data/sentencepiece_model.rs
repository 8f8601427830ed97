//! SentencePiece's `tokenizer.model` (a `ModelProto` protocol buffer), read far enough to build
//! the tokenizer transformers builds from it for Llama-family models: the pieces with their
//! scores and types, the model type, byte fallback and the normalizer's settings.
//!
//! Hugging Face directories of older Llama 2 and Mistral fine-tunes often carry only this file;
//! kiln turns it into the same BPE tokenizer a GGUF SentencePiece vocabulary gives
//! (`HfTokenizer::from_sentencepiece_model`). The reader knows protobuf's wire format only
//! (varints, fixed 32/64-bit values and length-delimited fields) and skips every field it does
//! not need.

/// What kiln needs of a `ModelProto`.
#[derive(Debug)]
pub struct SentencePieceModel {
    /// (piece, score, type) in id order; types as SentencePiece numbers them (1 normal,
    /// 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte), which GGUF shares.
    pub pieces: Vec<(String, f32, i64)>,
    /// `TrainerSpec.model_type`: 1 unigram (the default), 2 BPE, 3 word, 4 char.
    pub model_type: u64,
    pub byte_fallback: bool,
    pub unk_id: u64,
    pub bos_id: i64,
    pub eos_id: i64,
    /// `NormalizerSpec`: its rule name, whether a space goes in front of the text and
    /// whether runs of whitespace are collapsed.
    pub normalizer: String,
    pub add_dummy_prefix: bool,
    pub remove_extra_whitespaces: bool,
}

/// A field of a message: its number and its value.
enum Value<'a> {
    Varint(u64),
    Fixed32(u32),
    /// A 64-bit value: no field kiln reads has one, so it is skipped unread.
    Fixed64,
    Bytes(&'a [u8]),
}

/// Walks the fields of one message.
struct Fields<'a> {
    buf: &'a [u8],
}

fn varint(buf: &mut &[u8]) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = buf.split_first().ok_or("the file ends inside a number")?;
        *buf = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("a number runs past ten bytes".into())
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u64, Value<'a>), String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.buf.is_empty() {
            return None;
        }
        let mut step = || -> Result<(u64, Value<'a>), String> {
            let key = varint(&mut self.buf)?;
            let take = |buf: &mut &'a [u8], n: usize| -> Result<&'a [u8], String> {
                if buf.len() < n {
                    return Err("a field runs past the end of the file".into());
                }
                let (head, rest) = buf.split_at(n);
                *buf = rest;
                Ok(head)
            };
            let value = match key & 7 {
                0 => Value::Varint(varint(&mut self.buf)?),
                1 => {
                    take(&mut self.buf, 8)?;
                    Value::Fixed64
                }
                2 => {
                    let n = varint(&mut self.buf)? as usize;
                    Value::Bytes(take(&mut self.buf, n)?)
                }
                5 => {
                    let b = take(&mut self.buf, 4)?;
                    Value::Fixed32(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                }
                t => {
                    return Err(format!(
                        "field {} has wire type {t}, which protobuf 3 does not use",
                        key >> 3
                    ));
                }
            };
            Ok((key >> 3, value))
        };
        let r = step();
        if r.is_err() {
            self.buf = &[];
        }
        Some(r)
    }
}

fn fields(buf: &[u8]) -> Fields<'_> {
    Fields { buf }
}

impl SentencePieceModel {
    /// Parses a `tokenizer.model`'s bytes; the error says what is wrong with them.
    pub fn parse(bytes: &[u8]) -> Result<SentencePieceModel, String> {
        let mut m = SentencePieceModel {
            pieces: Vec::new(),
            model_type: 1,
            byte_fallback: false,
            unk_id: 0,
            bos_id: 1,
            eos_id: 2,
            normalizer: String::new(),
            add_dummy_prefix: true,
            remove_extra_whitespaces: true,
        };
        for f in fields(bytes) {
            match f? {
                (1, Value::Bytes(b)) => {
                    let (mut piece, mut score, mut ty) = (None, 0.0f32, 1i64);
                    for g in fields(b) {
                        match g? {
                            (1, Value::Bytes(s)) => {
                                piece = Some(
                                    String::from_utf8(s.to_vec())
                                        .map_err(|_| "a piece is not UTF-8")?,
                                )
                            }
                            (2, Value::Fixed32(bits)) => score = f32::from_bits(bits),
                            (3, Value::Varint(t)) => ty = t as i64,
                            _ => {}
                        }
                    }
                    let piece = piece.ok_or("a piece has no text")?;
                    m.pieces.push((piece, score, ty));
                }
                (2, Value::Bytes(b)) => {
                    for g in fields(b) {
                        match g? {
                            (3, Value::Varint(t)) => m.model_type = t,
                            (35, Value::Varint(v)) => m.byte_fallback = v != 0,
                            (40, Value::Varint(v)) => m.unk_id = v,
                            // int32 fields: -1 (none) arrives as a ten-byte varint.
                            (41, Value::Varint(v)) => m.bos_id = v as i64 as i32 as i64,
                            (42, Value::Varint(v)) => m.eos_id = v as i64 as i32 as i64,
                            _ => {}
                        }
                    }
                }
                (3, Value::Bytes(b)) => {
                    for g in fields(b) {
                        match g? {
                            (1, Value::Bytes(s)) => {
                                m.normalizer = String::from_utf8_lossy(s).into_owned()
                            }
                            (3, Value::Varint(v)) => m.add_dummy_prefix = v != 0,
                            (4, Value::Varint(v)) => m.remove_extra_whitespaces = v != 0,
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        if m.pieces.is_empty() {
            return Err("it holds no pieces; it is not a SentencePiece model".into());
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The committed fixture (scripts/make-spm-fixture.py): its pieces, scores and types are
    /// the ones SentencePiece reported for the same model (tests/data/spm_bpe.json), and its
    /// settings are Llama 2's.
    #[test]
    fn reads_the_fixture_as_sentencepiece_describes_it() {
        let m =
            SentencePieceModel::parse(include_bytes!("../../tests/data/spm_bpe.model")).unwrap();
        let fixture: serde_json::Value =
            serde_json::from_str(include_str!("../../tests/data/spm_bpe.json")).unwrap();
        let want = fixture["pieces"].as_array().unwrap();
        assert_eq!(m.pieces.len(), want.len());
        for ((piece, score, ty), w) in m.pieces.iter().zip(want) {
            assert_eq!(piece, w[0].as_str().unwrap());
            assert!((score - w[1].as_f64().unwrap() as f32).abs() < 1e-6);
            assert_eq!(*ty, w[2].as_i64().unwrap());
        }
        assert_eq!(m.model_type, 2);
        assert!(m.byte_fallback);
        assert_eq!((m.unk_id, m.bos_id, m.eos_id), (0, 1, 2));
        assert_eq!(m.normalizer, "identity");
        assert!(m.add_dummy_prefix);
        assert!(!m.remove_extra_whitespaces);
    }

    #[test]
    fn damaged_files_say_what_is_wrong() {
        let bytes = include_bytes!("../../tests/data/spm_bpe.model");
        let cut = SentencePieceModel::parse(&bytes[..bytes.len() / 2]).unwrap_err();
        assert!(
            cut.contains("past the end") || cut.contains("ends inside"),
            "{cut}"
        );
        assert!(
            SentencePieceModel::parse(b"")
                .unwrap_err()
                .contains("no pieces")
        );
        assert!(
            SentencePieceModel::parse(&[0x0b])
                .unwrap_err()
                .contains("wire type 3")
        );
    }
}
