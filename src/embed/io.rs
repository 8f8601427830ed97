//! Texts in and embeddings out: plain text (one text per line) or JSON lines with a `text`
//! field; JSON lines or safetensors by the output file's extension.

use crate::data::DataError;
use crate::error::{KilnError, Result};
use serde_json::Value;
use std::path::Path;

fn data_error(path: &Path, reason: impl Into<String>) -> KilnError {
    KilnError::Data(DataError::File {
        path: path.to_path_buf(),
        reason: reason.into(),
    })
}

/// Whether `path` names a JSON-lines file by its extension.
pub fn is_json_lines(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("jsonl" | "json" | "ndjson")
    )
}

/// The JSON object on each non-blank line of `text`, with its 1-based line number; a line
/// that is not a JSON object is an error naming it.
pub fn json_records(
    path: &Path,
    text: &str,
) -> Result<Vec<(usize, serde_json::Map<String, Value>)>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(line) {
            Ok(Value::Object(o)) => out.push((i + 1, o)),
            Ok(_) => {
                return Err(data_error(
                    path,
                    format!(
                        "line {} is not a JSON object; write one {{\"text\": ...}} object per line",
                        i + 1
                    ),
                ));
            }
            Err(e) => {
                return Err(data_error(
                    path,
                    format!(
                        "line {} is not valid JSON ({e}); write one JSON object per line",
                        i + 1
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// Reads the whole of `path` as UTF-8.
pub fn read_text_file(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path)
        .map_err(|e| data_error(path, format!("cannot be read ({e}); check the path")))?;
    String::from_utf8(bytes).map_err(|e| {
        data_error(
            path,
            format!(
                "is not UTF-8 (first bad byte at offset {}); convert it to UTF-8",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// The texts of `path`: every line of a plain text file (blank ones included, so output row
/// `i` is input line `i`), or the `text` field of each JSON line.
pub fn read_texts(path: &Path) -> Result<Vec<String>> {
    let text = read_text_file(path)?;
    let texts: Vec<String> = if is_json_lines(path) {
        json_records(path, &text)?
            .into_iter()
            .map(|(line, o)| match o.get("text") {
                Some(Value::String(s)) => Ok(s.clone()),
                _ => Err(data_error(
                    path,
                    format!("line {line} has no string field \"text\""),
                )),
            })
            .collect::<Result<_>>()?
    } else {
        text.lines().map(String::from).collect()
    };
    if texts.is_empty() {
        return Err(data_error(path, "holds no texts; write one text per line"));
    }
    Ok(texts)
}

/// Writes `rows` to `path`: safetensors (one f32 tensor `embeddings` of `[texts, dim]`) for a
/// `.safetensors` file, JSON lines (`{"index": i, "embedding": [...]}`) otherwise. Written to
/// a temporary name and renamed, so a failed write leaves no half file.
pub fn write_embeddings(path: &Path, rows: &[Vec<f32>]) -> Result<()> {
    let dim = rows.first().map_or(0, Vec::len);
    let bytes: Vec<u8> = if path.extension().and_then(|e| e.to_str()) == Some("safetensors") {
        let flat: Vec<u8> = rows
            .iter()
            .flatten()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let view = safetensors::tensor::TensorView::new(
            safetensors::Dtype::F32,
            vec![rows.len(), dim],
            &flat,
        )
        .map_err(|e| KilnError::output(path, e))?;
        safetensors::serialize([("embeddings", view)], None)
            .map_err(|e| KilnError::output(path, e))?
    } else {
        let mut s = String::new();
        for (i, r) in rows.iter().enumerate() {
            s += &serde_json::json!({ "index": i, "embedding": r }).to_string();
            s.push('\n');
        }
        s.into_bytes()
    };
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, &bytes)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            KilnError::output(path, e)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_come_from_lines_or_json_and_bad_lines_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("t.txt");
        std::fs::write(&plain, "a b\n\nc\n").unwrap();
        assert_eq!(read_texts(&plain).unwrap(), vec!["a b", "", "c"]);
        let json = dir.path().join("t.jsonl");
        std::fs::write(&json, "{\"text\": \"x\"}\n\n{\"text\": \"y\", \"id\": 3}\n").unwrap();
        assert_eq!(read_texts(&json).unwrap(), vec!["x", "y"]);
        std::fs::write(&json, "{\"text\": \"x\"}\n{\"text\": \"y\"\n").unwrap();
        let e = read_texts(&json).unwrap_err();
        assert_eq!(e.exit_code(), 3);
        assert!(e.to_string().contains("line 2 is not valid JSON"), "{e}");
        std::fs::write(&json, "{\"txt\": \"x\"}\n").unwrap();
        assert!(
            read_texts(&json)
                .unwrap_err()
                .to_string()
                .contains("line 1 has no string field")
        );
    }

    #[test]
    fn embeddings_round_trip_through_safetensors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e.safetensors");
        write_embeddings(&path, &[vec![1.0, 2.0], vec![3.0, 4.5]]).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor("embeddings").unwrap();
        assert_eq!(t.shape(), &[2, 2]);
        assert_eq!(&t.data()[12..16], &4.5f32.to_le_bytes());
    }
}
