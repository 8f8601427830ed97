//! Labelled records for classification: JSON lines with `text`, optional `text_pair`,
//! `label` (a string, number or boolean) and optional `group` (records of one group never
//! sit on both sides of a fold; a record without one is a group of its own).

use crate::data::DataError;
use crate::embed::io::{json_records, read_text_file};
use crate::error::{KilnError, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub text: String,
    pub text_pair: Option<String>,
    /// Index into [`Dataset::classes`].
    pub label: usize,
    /// Index into [`Dataset::groups`].
    pub group: usize,
}

#[derive(Debug, Clone)]
pub struct Dataset {
    pub records: Vec<Record>,
    /// Class names, sorted (numbers by value, then strings).
    pub classes: Vec<String>,
    /// Group names; records without a `group` get `#line N`.
    pub groups: Vec<String>,
    /// How many records named a group.
    pub grouped_records: usize,
}

fn bad(path: &Path, reason: String) -> KilnError {
    KilnError::Data(DataError::File {
        path: path.to_path_buf(),
        reason,
    })
}

/// A label as text: strings as they are, numbers and booleans as JSON writes them.
fn label_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if !s.trim().is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

impl Dataset {
    /// Reads `path`, naming the line of any bad record.
    pub fn read(path: &Path) -> Result<Dataset> {
        let text = read_text_file(path)?;
        let mut raw = Vec::new();
        for (line, o) in json_records(path, &text)? {
            let text = match o.get("text") {
                Some(Value::String(s)) => s.clone(),
                _ => {
                    return Err(bad(
                        path,
                        format!("line {line} has no string field \"text\""),
                    ));
                }
            };
            let text_pair = match o.get("text_pair") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(_) => {
                    return Err(bad(
                        path,
                        format!("line {line}: \"text_pair\" must be a string"),
                    ));
                }
            };
            let label = o.get("label").and_then(label_text).ok_or_else(|| {
                bad(
                    path,
                    format!(
                        "line {line} has no \"label\" (a non-empty string, a number or a boolean); every record needs one"
                    ),
                )
            })?;
            let group = match o.get("group") {
                None | Some(Value::Null) => None,
                Some(v) => Some(label_text(v).ok_or_else(|| {
                    bad(
                        path,
                        format!("line {line}: \"group\" must be a non-empty string or a number"),
                    )
                })?),
            };
            raw.push((line, text, text_pair, label, group));
        }
        if raw.is_empty() {
            return Err(bad(
                path,
                "holds no records; write one JSON object per line".into(),
            ));
        }
        let mut classes: Vec<String> = raw.iter().map(|r| r.3.clone()).collect();
        classes.sort_by(|a, b| match (a.parse::<f64>(), b.parse::<f64>()) {
            (Ok(x), Ok(y)) => x.total_cmp(&y),
            _ => a.cmp(b),
        });
        classes.dedup();
        if classes.len() < 2 {
            return Err(bad(
                path,
                format!(
                    "every one of its {} records has the label {:?}; a classifier needs at least two classes",
                    raw.len(),
                    classes[0]
                ),
            ));
        }
        let class_index: BTreeMap<&str, usize> = classes
            .iter()
            .enumerate()
            .map(|(i, c)| (c.as_str(), i))
            .collect();
        let mut groups = Vec::new();
        let mut group_index: BTreeMap<String, usize> = BTreeMap::new();
        let mut grouped_records = 0;
        let mut records = Vec::with_capacity(raw.len());
        for (line, text, text_pair, label, group) in &raw {
            grouped_records += usize::from(group.is_some());
            let name = match group {
                Some(g) => format!("group {g}"),
                None => format!("#line {line}"),
            };
            let g = *group_index.entry(name.clone()).or_insert_with(|| {
                groups.push(name);
                groups.len() - 1
            });
            records.push(Record {
                text: text.clone(),
                text_pair: text_pair.clone(),
                label: class_index[label.as_str()],
                group: g,
            });
        }
        Ok(Dataset {
            records,
            classes,
            groups,
            grouped_records,
        })
    }

    pub fn labels(&self) -> Vec<usize> {
        self.records.iter().map(|r| r.label).collect()
    }

    pub fn group_ids(&self) -> Vec<usize> {
        self.records.iter().map(|r| r.group).collect()
    }

    /// sha256 of the texts (and pairs) in order: what the features depend on.
    pub fn texts_sha256(&self) -> String {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for r in &self.records {
            h.update((r.text.len() as u64).to_le_bytes());
            h.update(r.text.as_bytes());
            match &r.text_pair {
                Some(p) => {
                    h.update([1]);
                    h.update((p.len() as u64).to_le_bytes());
                    h.update(p.as_bytes());
                }
                None => h.update([0]),
            }
        }
        format!("{:x}", h.finalize())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(body: &str) -> Result<Dataset> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.jsonl");
        std::fs::write(&p, body).unwrap();
        Dataset::read(&p)
    }

    #[test]
    fn labels_groups_and_pairs_are_read() {
        let d = read(
            "{\"text\": \"a\", \"label\": 1, \"group\": \"g\"}\n{\"text\": \"b\", \"text_pair\": \"c\", \"label\": 0}\n{\"text\": \"d\", \"label\": 10, \"group\": \"g\"}\n",
        )
        .unwrap();
        assert_eq!(d.classes, vec!["0", "1", "10"]);
        assert_eq!(d.labels(), vec![1, 0, 2]);
        assert_eq!(d.group_ids(), vec![0, 1, 0]);
        assert_eq!(d.grouped_records, 2);
        assert_eq!(d.records[1].text_pair.as_deref(), Some("c"));
    }

    #[test]
    fn bad_records_are_named_by_line() {
        let e = read("{\"text\": \"a\", \"label\": 1}\n{\"text\": \"b\"}\n").unwrap_err();
        assert!(e.to_string().contains("line 2 has no \"label\""), "{e}");
        assert_eq!(e.exit_code(), 3);
        let e =
            read("{\"text\": \"a\", \"label\": 1}\n{\"text\": \"b\", \"label\": 1}\n").unwrap_err();
        assert!(e.to_string().contains("at least two classes"), "{e}");
        let e = read("{\"text\": \"a\", \"label\": 1}\nnot json\n").unwrap_err();
        assert!(e.to_string().contains("line 2 is not valid JSON"), "{e}");
    }
}
