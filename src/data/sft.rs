//! Supervised fine-tuning data: JSON lines of prompt/completion pairs, Alpaca instructions or
//! chat conversations, tokenised with the model's own tokenizer (and chat template), packed
//! into rows of `seq + 1` tokens with a loss mask.
//!
//! The shapes fine-tuning data has on disk are read as they are: `{"prompt", "completion"}`
//! strings; Stanford Alpaca's `{"instruction", "input", "output"}` (rendered with Alpaca's own
//! prompt text, or as one user turn and its reply through the chat template); conversations as
//! `{"messages": [{"role", "content"}]}`, ShareGPT's `{"conversations": [{"from", "value"}]}`
//! and TRL's conversational `{"prompt": [turns], "completion": [turns]}`.
//!
//! Only completion tokens (and, for chats, assistant turns) are trained: every other target is
//! [`IGNORE_TARGET`], which the cross-entropy kernels give zero loss and zero gradient.
//! Examples are packed whole, in file order, into as few rows as greedy filling allows; the
//! rest of a row is padding whose targets are ignored. An example longer than a row is cut to
//! the row's length (counted in [`SftStats::truncated`]). Examples packed into one row attend
//! to those before them in the row, as with packing in most trainers; their losses stay
//! separate.
//!
//! The validation split is the last `val_fraction` of the examples (at least one), so no
//! example is on both sides. Training rows are drawn as training windows are: row `r` of
//! micro-batch `micro` of `step` is a pure function of `(seed, step, micro, r)`.

use super::chat::{ChatMessage, render_chat};
use super::{Batch, DataError, HfTokenizer, Tokenizer, window_counter};
use crate::engine::ops::IGNORE_TARGET;
use crate::engine::rng::{hash3, stream};
use std::path::Path;

/// How the JSON lines of a fine-tuning file are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SftFormat {
    /// `{"prompt": ..., "completion": ...}`: the completion is trained.
    PromptCompletion,
    /// A conversation rendered by the model's chat template; its assistant turns are trained
    /// (with TRL's `{"prompt": [turns], "completion": [turns]}`, those of the completion).
    /// See [`conversation`] for the shapes read.
    Chat,
    /// Stanford Alpaca's `{"instruction", "input", "output"}` (`input` optional or empty) under
    /// Alpaca's prompt text: the output is trained.
    Alpaca,
}

impl SftFormat {
    /// The format `data.format` names (`None` for plain text).
    pub fn from_setting(s: &str) -> Option<SftFormat> {
        match s {
            "prompt_completion" => Some(SftFormat::PromptCompletion),
            "chat" => Some(SftFormat::Chat),
            "alpaca" => Some(SftFormat::Alpaca),
            _ => None,
        }
    }
}

/// Rows of `seq` inputs and `seq` targets, back to back.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SftRows {
    pub seq: usize,
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
}

impl SftRows {
    pub fn len(&self) -> usize {
        self.inputs.len() / self.seq.max(1)
    }

    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }

    /// Targets that are trained (not [`IGNORE_TARGET`]).
    pub fn trained_tokens(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_TARGET).count()
    }

    fn push_row(&self, b: &mut Batch, r: usize) {
        let span = r * self.seq..(r + 1) * self.seq;
        b.inputs.extend_from_slice(&self.inputs[span.clone()]);
        b.targets.extend_from_slice(&self.targets[span]);
        b.batch += 1;
    }
}

/// What loading found, for the run's log.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SftStats {
    pub examples: usize,
    pub val_examples: usize,
    /// Examples cut to the row length.
    pub truncated: usize,
    pub train_trained_tokens: usize,
    pub val_trained_tokens: usize,
}

/// The packed training and validation rows of a fine-tuning file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftSplits {
    pub train: SftRows,
    pub val: SftRows,
    pub stats: SftStats,
}

/// One tokenised example: its tokens and, per token, whether predicting it is trained.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftExample {
    pub tokens: Vec<u32>,
    pub trained: Vec<bool>,
}

impl SftExample {
    fn push(&mut self, ids: &[u32], trained: bool) {
        self.tokens.extend_from_slice(ids);
        self.trained.extend(std::iter::repeat_n(trained, ids.len()));
    }
}

/// A tokenizer as fine-tuning needs it: the model's own (special tokens, chat template) or a
/// built-in one (prompt/completion only).
pub enum SftTokenizer<'a> {
    Pretrained(&'a HfTokenizer),
    Plain(&'a dyn Tokenizer),
}

impl SftTokenizer<'_> {
    fn encode(&self, text: &str) -> Vec<u32> {
        match self {
            SftTokenizer::Pretrained(t) => t.encode(text),
            SftTokenizer::Plain(t) => t.encode(text),
        }
    }

    fn bos(&self) -> Option<u32> {
        match self {
            SftTokenizer::Pretrained(t) if t.adds_bos() => t.bos_id(),
            _ => None,
        }
    }

    fn eos(&self) -> Option<u32> {
        match self {
            SftTokenizer::Pretrained(t) => t.eos_ids().first().copied(),
            SftTokenizer::Plain(_) => None,
        }
    }
}

fn line_error(path: &Path, line: usize, reason: impl std::fmt::Display) -> DataError {
    DataError::File {
        path: path.to_path_buf(),
        reason: format!("line {line}: {reason}"),
    }
}

/// Stanford Alpaca's prompt for an instruction and its optional input: the text the Alpaca
/// models were trained on, which the output follows.
pub fn alpaca_prompt(instruction: &str, input: &str) -> String {
    if input.is_empty() {
        format!(
            "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
        )
    } else {
        format!(
            "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
        )
    }
}

/// An optional string field: absent or null reads as empty; anything else but a string is
/// an error.
fn optional_str<'a>(v: &'a serde_json::Value, name: &str) -> Result<&'a str, String> {
    match v.get(name) {
        None | Some(serde_json::Value::Null) => Ok(""),
        Some(serde_json::Value::String(s)) => Ok(s),
        Some(other) => Err(format!(
            "field \"{name}\" is {} where a string belongs",
            json_kind(other)
        )),
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

/// One turn: `{"role", "content"}`, or ShareGPT's `{"from", "value"}` with its speakers
/// (`human` and `gpt`) named as chat templates name them (`user` and `assistant`).
fn turn(v: &serde_json::Value, list: &str, i: usize) -> Result<ChatMessage, String> {
    let text = |key: &str| v.get(key).and_then(|x| x.as_str());
    if let (Some(role), Some(content)) = (text("role"), text("content")) {
        return Ok(ChatMessage::new(role, content));
    }
    if let (Some(from), Some(value)) = (text("from"), text("value")) {
        let role = match from {
            "human" | "user" => "user",
            "gpt" | "assistant" => "assistant",
            "system" => "system",
            "tool" | "function_response" | "observation" => "tool",
            other => {
                return Err(format!(
                    "\"{list}\" turn {} is from \"{other}\", a speaker kiln does not know; ShareGPT turns are from \"human\", \"gpt\", \"system\" or \"tool\"",
                    i + 1
                ));
            }
        };
        return Ok(ChatMessage::new(role, value));
    }
    Err(format!(
        "\"{list}\" turn {} is not {{\"role\": string, \"content\": string}} or ShareGPT's {{\"from\": string, \"value\": string}} (it is {})",
        i + 1,
        match v {
            serde_json::Value::Object(m) => format!(
                "an object with {}",
                m.iter()
                    .map(|(k, x)| format!("\"{k}\" ({})", json_kind(x)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            other => json_kind(other).to_string(),
        }
    ))
}

fn turns(v: &serde_json::Value, list: &str) -> Result<Vec<ChatMessage>, String> {
    let items = v
        .as_array()
        .ok_or_else(|| format!("\"{list}\" is {}, not a list of turns", json_kind(v)))?;
    items
        .iter()
        .enumerate()
        .map(|(i, t)| turn(t, list, i))
        .collect()
}

/// The conversation of a chat line and the index of its first turn that may be trained: a
/// `messages` or `conversations` list (every assistant turn trained), TRL's conversational
/// `prompt` and `completion` lists (only the completion's assistant turns), or an Alpaca
/// line as one user turn (instruction, a blank line, input) and the output as the reply.
pub fn conversation(v: &serde_json::Value) -> Result<(Vec<ChatMessage>, usize), String> {
    if let Some(m) = v.get("messages") {
        return Ok((turns(m, "messages")?, 0));
    }
    if let Some(c) = v.get("conversations") {
        return Ok((turns(c, "conversations")?, 0));
    }
    if let Some(p) = v.get("prompt").filter(|p| p.is_array()) {
        let mut all = turns(p, "prompt")?;
        let first = all.len();
        let c = v
            .get("completion")
            .ok_or("has a \"prompt\" list of turns but no \"completion\" list")?;
        all.extend(turns(c, "completion")?);
        return Ok((all, first));
    }
    if let Some(instruction) = v.get("instruction").and_then(|x| x.as_str()) {
        let input = optional_str(v, "input")?;
        let output = v
            .get("output")
            .and_then(|x| x.as_str())
            .ok_or("has an \"instruction\" but no string \"output\"")?;
        let user = if input.is_empty() {
            instruction.to_string()
        } else {
            format!("{instruction}\n\n{input}")
        };
        return Ok((
            vec![
                ChatMessage::new("user", user),
                ChatMessage::new("assistant", output),
            ],
            0,
        ));
    }
    Err("has no conversation: data.format=chat reads {\"messages\": [{\"role\", \"content\"}, ...]}, ShareGPT's {\"conversations\": [{\"from\", \"value\"}, ...]}, TRL's {\"prompt\": [turns], \"completion\": [turns]} or an Alpaca {\"instruction\", \"input\", \"output\"}".into())
}

/// Tokenises one JSON line.
fn example(
    path: &Path,
    line: usize,
    text: &str,
    format: SftFormat,
    tok: &SftTokenizer,
) -> Result<SftExample, DataError> {
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| line_error(path, line, format!("not valid JSON ({e})")))?;
    let field = |name: &str| -> Result<&str, DataError> {
        v.get(name).and_then(|x| x.as_str()).ok_or_else(|| {
            line_error(
                path,
                line,
                format!(
                    "has no string field \"{name}\"; data.format={} needs {}",
                    fmt_name(format),
                    fmt_fields(format)
                ),
            )
        })
    };
    let mut ex = SftExample {
        tokens: Vec::new(),
        trained: Vec::new(),
    };
    if let Some(bos) = tok.bos() {
        ex.push(&[bos], false);
    }
    match format {
        SftFormat::PromptCompletion => {
            let (prompt, completion) = (field("prompt")?, field("completion")?);
            ex.push(&tok.encode(prompt), false);
            ex.push(&tok.encode(completion), true);
            if let Some(eos) = tok.eos() {
                ex.push(&[eos], true);
            }
        }
        SftFormat::Alpaca => {
            let (instruction, output) = (field("instruction")?, field("output")?);
            let input = optional_str(&v, "input").map_err(|r| line_error(path, line, r))?;
            ex.push(&tok.encode(&alpaca_prompt(instruction, input)), false);
            ex.push(&tok.encode(output), true);
            if let Some(eos) = tok.eos() {
                ex.push(&[eos], true);
            }
        }
        SftFormat::Chat => {
            let SftTokenizer::Pretrained(hf) = tok else {
                return Err(DataError::InvalidSpec(
                    "data.format=chat needs a pretrained model's tokenizer with a chat template (kiln finetune --init-from sets it)".into(),
                ));
            };
            let template = hf.chat_template().ok_or_else(|| {
                DataError::InvalidSpec(
                    "the model's tokenizer has no chat template; use data.format=prompt_completion"
                        .into(),
                )
            })?;
            let (messages, first_trained) =
                conversation(&v).map_err(|r| line_error(path, line, r))?;
            let trained = |i: usize| i >= first_trained && messages[i].role == "assistant";
            if !(0..messages.len()).any(trained) {
                return Err(line_error(
                    path,
                    line,
                    if first_trained > 0 {
                        "has no assistant turn in its \"completion\", so nothing in it would be trained"
                    } else {
                        "has no assistant message, so nothing in it would be trained"
                    },
                ));
            }
            let render = |upto: usize, prompt: bool| {
                render_chat(
                    template,
                    &messages[..upto],
                    prompt,
                    hf.bos_token(),
                    hf.eos_token(),
                )
            };
            // The text grows turn by turn; each piece is tokenised on its own and an assistant
            // turn's piece (after its generation prompt) is trained.
            let mut done = String::new();
            for i in 0..messages.len() {
                if trained(i) {
                    let prompt = render(i, true)?;
                    if let Some(piece) = prompt.strip_prefix(done.as_str()) {
                        ex.push(&tok.encode(piece), false);
                        done = prompt;
                    }
                }
                let full = render(i + 1, false)?;
                let piece = full.strip_prefix(done.as_str()).ok_or_else(|| {
                    line_error(
                        path,
                        line,
                        "the chat template renders a conversation that is not an extension of its first turns; it cannot be masked per turn",
                    )
                })?;
                ex.push(&tok.encode(piece), trained(i));
                done = full;
            }
            // The template's text starts with its own BOS where it writes one.
            if tok.bos().is_some() && ex.tokens.get(1) == tok.bos().as_ref() {
                ex.tokens.remove(0);
                ex.trained.remove(0);
            }
        }
    }
    Ok(ex)
}

fn fmt_name(f: SftFormat) -> &'static str {
    match f {
        SftFormat::PromptCompletion => "prompt_completion",
        SftFormat::Chat => "chat",
        SftFormat::Alpaca => "alpaca",
    }
}

fn fmt_fields(f: SftFormat) -> &'static str {
    match f {
        SftFormat::PromptCompletion => "{\"prompt\": ..., \"completion\": ...} on every line",
        SftFormat::Chat => "{\"messages\": [...]} on every line",
        SftFormat::Alpaca => {
            "{\"instruction\": ..., \"input\": ... (optional), \"output\": ...} on every line"
        }
    }
}

/// Tokenises every non-blank line of `text` (the file at `path`).
pub fn examples(
    path: &Path,
    text: &str,
    format: SftFormat,
    tok: &SftTokenizer,
) -> Result<Vec<SftExample>, DataError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| example(path, i + 1, l, format, tok))
        .collect()
}

/// Packs whole examples greedily, in order, into rows of `seq + 1` tokens. Returns the rows
/// and how many examples were cut to fit.
pub fn pack(examples: &[SftExample], seq: usize, pad: u32) -> (SftRows, usize) {
    let width = seq + 1;
    let mut rows = SftRows {
        seq,
        ..SftRows::default()
    };
    let mut truncated = 0;
    let mut row: Vec<(u32, bool)> = Vec::with_capacity(width);
    let flush = |row: &mut Vec<(u32, bool)>, rows: &mut SftRows| {
        if row.is_empty() {
            return;
        }
        row.resize(width, (pad, false));
        rows.inputs.extend(row[..seq].iter().map(|&(t, _)| t));
        rows.targets.extend(
            row[1..]
                .iter()
                .map(|&(t, trained)| if trained { t } else { IGNORE_TARGET }),
        );
        row.clear();
    };
    for ex in examples {
        let mut toks: Vec<(u32, bool)> = ex
            .tokens
            .iter()
            .copied()
            .zip(ex.trained.iter().copied())
            .collect();
        if toks.len() > width {
            toks.truncate(width);
            truncated += 1;
        }
        if row.len() + toks.len() > width {
            flush(&mut row, &mut rows);
        }
        row.extend(toks);
    }
    flush(&mut row, &mut rows);
    (rows, truncated)
}

/// How many of `examples` (at least 2) the validation split takes: the last
/// `val_fraction` of them, at least one and never all.
pub fn validation_examples(examples: usize, val_fraction: f64) -> usize {
    ((examples as f64 * val_fraction).round() as usize).clamp(1, examples.saturating_sub(1).max(1))
}

/// Where a fine-tune's validation examples come from.
#[derive(Debug, Clone, Copy)]
pub enum Holdout<'a> {
    /// The last share of the data file's examples ([`validation_examples`]).
    Fraction(f64),
    /// A second file of the same format (`data.val_corpus`); every example of the data
    /// file trains.
    File(&'a Path),
}

/// The examples of a file, read and tokenised.
fn read_examples(
    path: &Path,
    format: SftFormat,
    tok: &SftTokenizer,
) -> Result<Vec<SftExample>, DataError> {
    let text = std::fs::read_to_string(path).map_err(|e| DataError::File {
        path: path.to_path_buf(),
        reason: format!("cannot be read ({e})"),
    })?;
    examples(path, &text, format, tok)
}

/// A fine-tuning file's examples as training and validation examples, by `holdout`.
pub fn split_examples(
    path: &Path,
    format: SftFormat,
    tok: &SftTokenizer,
    holdout: Holdout,
) -> Result<(Vec<SftExample>, Vec<SftExample>), DataError> {
    let mut all = read_examples(path, format, tok)?;
    match holdout {
        Holdout::Fraction(val_fraction) => {
            if all.len() < 2 {
                return Err(DataError::File {
                    path: path.to_path_buf(),
                    reason: format!(
                        "holds {} example(s); fine-tuning needs at least 2 (one for validation)",
                        all.len()
                    ),
                });
            }
            let n_val = validation_examples(all.len(), val_fraction);
            let val = all.split_off(all.len() - n_val);
            Ok((all, val))
        }
        Holdout::File(val_path) => {
            let val = read_examples(val_path, format, tok)?;
            for (file, n) in [(path, all.len()), (val_path, val.len())] {
                if n == 0 {
                    return Err(DataError::File {
                        path: file.to_path_buf(),
                        reason: "holds no examples; give at least one".into(),
                    });
                }
            }
            Ok((all, val))
        }
    }
}

/// Reads, tokenises, splits and packs a fine-tuning file (and its validation file).
pub fn load(
    path: &Path,
    format: SftFormat,
    tok: &SftTokenizer,
    seq: usize,
    holdout: Holdout,
) -> Result<SftSplits, DataError> {
    let (train_ex, val_ex) = split_examples(path, format, tok, holdout)?;
    let pad = tok.eos().unwrap_or(0);
    let (train, t1) = pack(&train_ex, seq, pad);
    let (val, t2) = pack(&val_ex, seq, pad);
    let stats = SftStats {
        examples: train_ex.len(),
        val_examples: val_ex.len(),
        truncated: t1 + t2,
        train_trained_tokens: train.trained_tokens(),
        val_trained_tokens: val.trained_tokens(),
    };
    let val_path = match holdout {
        Holdout::File(p) => p,
        Holdout::Fraction(_) => path,
    };
    for (split, n, file) in [
        ("training", stats.train_trained_tokens, path),
        ("validation", stats.val_trained_tokens, val_path),
    ] {
        if n == 0 {
            return Err(DataError::File {
                path: file.to_path_buf(),
                reason: format!(
                    "its {split} examples have no trainable tokens after masking (only completion or assistant tokens are trained, and examples are cut to train.seq_len + 1 tokens); give non-empty completions or raise train.seq_len"
                ),
            });
        }
    }
    Ok(SftSplits { train, val, stats })
}

/// Rows `rows` of micro-batch `micro` of `step`: each a training row chosen by the counter
/// of its position, as training windows are.
pub fn train_rows(
    data: &SftRows,
    seed: u64,
    step: u64,
    micro: u64,
    rows: std::ops::Range<usize>,
) -> Batch {
    let n = data.len() as u64;
    let mut b = Batch {
        inputs: Vec::with_capacity(rows.len() * data.seq),
        targets: Vec::with_capacity(rows.len() * data.seq),
        batch: 0,
        seq: data.seq,
    };
    for row in rows {
        let r = hash3(seed, stream::DATA, window_counter(step, micro, row as u64));
        data.push_row(&mut b, (r % n) as usize);
    }
    b
}

/// Every validation row once, in batches of up to `micro_batch` rows (at most `n_batches`
/// batches; evenly spaced rows when there are more).
pub fn val_batches(data: &SftRows, n_batches: usize, micro_batch: usize) -> Vec<Batch> {
    let n = data.len();
    let want = (n_batches * micro_batch).min(n).max(1);
    let picks: Vec<usize> = (0..want).map(|i| i * n / want).collect();
    picks
        .chunks(micro_batch)
        .map(|chunk| {
            let mut b = Batch {
                inputs: Vec::new(),
                targets: Vec::new(),
                batch: 0,
                seq: data.seq,
            };
            for &r in chunk {
                data.push_row(&mut b, r);
            }
            b
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::ByteTokenizer;

    fn tok() -> ByteTokenizer {
        ByteTokenizer
    }

    #[test]
    fn only_completions_are_trained_and_examples_pack_whole() {
        let t = tok();
        let tk = SftTokenizer::Plain(&t);
        let text = "{\"prompt\": \"ab\", \"completion\": \"cd\"}\n\n{\"prompt\": \"e\", \"completion\": \"fgh\"}\n";
        let ex = examples(Path::new("x.jsonl"), text, SftFormat::PromptCompletion, &tk).unwrap();
        assert_eq!(ex.len(), 2);
        assert_eq!(ex[0].trained, vec![false, false, true, true]);
        // Rows of 6 tokens: both examples (4 + 4) do not fit one row, so two rows.
        let (rows, cut) = pack(&ex, 5, 0);
        assert_eq!((rows.len(), cut), (2, 0));
        let b = |c: char| c as u32;
        assert_eq!(&rows.inputs[..5], &[b('a'), b('b'), b('c'), b('d'), 0]);
        let i = IGNORE_TARGET;
        // Targets are the next tokens where those are trained.
        assert_eq!(&rows.targets[..5], &[i, b('c'), b('d'), i, i]);
        assert_eq!(&rows.targets[5..], &[b('f'), b('g'), b('h'), i, i]);
        assert_eq!(rows.trained_tokens(), 5);
        // Rows of 9 tokens hold both; a row of 3 cuts both.
        assert_eq!(pack(&ex, 8, 0).0.len(), 1);
        assert_eq!(pack(&ex, 2, 0).1, 2);
    }

    /// A validation file: every example of the data file trains and the file's examples
    /// validate; a validation file with nothing to train is refused by its own name.
    #[test]
    fn a_validation_file_holds_out_its_own_examples() {
        let t = tok();
        let tk = SftTokenizer::Plain(&t);
        let dir = tempfile::tempdir().unwrap();
        let (data, val) = (dir.path().join("train.jsonl"), dir.path().join("val.jsonl"));
        let line = |p: &str, c: &str| format!("{{\"prompt\": \"{p}\", \"completion\": \"{c}\"}}\n");
        std::fs::write(
            &data,
            line("ab", "cd") + &line("e", "fgh") + &line("i", "jk"),
        )
        .unwrap();
        std::fs::write(&val, line("x", "yz")).unwrap();
        let f = SftFormat::PromptCompletion;
        let s = load(&data, f, &tk, 8, Holdout::File(&val)).unwrap();
        assert_eq!((s.stats.examples, s.stats.val_examples), (3, 1));
        assert_eq!(s.stats.val_trained_tokens, 2);
        let held = load(&data, f, &tk, 8, Holdout::Fraction(0.3)).unwrap();
        assert_eq!((held.stats.examples, held.stats.val_examples), (2, 1));
        std::fs::write(&val, line("x", "")).unwrap();
        let e = load(&data, f, &tk, 8, Holdout::File(&val))
            .unwrap_err()
            .to_string();
        assert!(e.contains("val.jsonl") && e.contains("validation"), "{e}");
    }

    #[test]
    fn bad_lines_are_named() {
        let t = tok();
        let tk = SftTokenizer::Plain(&t);
        let p = Path::new("d.jsonl");
        let e = examples(
            p,
            "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"a\"}\n",
            SftFormat::PromptCompletion,
            &tk,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("line 2") && e.contains("completion"), "{e}");
        let e = examples(p, "not json\n", SftFormat::PromptCompletion, &tk)
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1") && e.contains("not valid JSON"), "{e}");
        let e = examples(p, "{\"messages\": []}\n", SftFormat::Chat, &tk)
            .unwrap_err()
            .to_string();
        assert!(e.contains("chat template"), "{e}");
    }

    #[test]
    fn rows_are_a_function_of_their_counter() {
        let ex: Vec<SftExample> = (0..20)
            .map(|i| SftExample {
                tokens: vec![i, i + 1, i + 2],
                trained: vec![false, true, true],
            })
            .collect();
        let (rows, _) = pack(&ex, 5, 0);
        let whole = train_rows(&rows, 7, 3, 1, 0..4);
        let parts = [
            train_rows(&rows, 7, 3, 1, 0..1),
            train_rows(&rows, 7, 3, 1, 1..4),
        ];
        assert_eq!(
            whole.inputs,
            [parts[0].inputs.clone(), parts[1].inputs.clone()].concat()
        );
        assert_eq!(whole.batch, 4);
        let val = val_batches(&rows, 2, 3);
        assert_eq!(
            val.iter().map(|b| b.batch).sum::<usize>(),
            rows.len().min(6)
        );
    }
}
