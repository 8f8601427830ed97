//! Pretrained models' own tokenizers, through Hugging Face's `tokenizers` crate (the
//! implementation behind transformers' fast tokenizers, so ids match Python's).
//!
//! Two sources: a Hugging Face directory (`tokenizer.json` with the `tokenizer_config.json`,
//! `special_tokens_map.json`, `generation_config.json` and `chat_template.jinja` beside it),
//! and the vocabulary inside a GGUF file, which is turned into the `tokenizer.json` that
//! describes the same byte-level BPE and loaded the same way.

use super::gguf::GgufFile;
use super::{DataError, Tokenizer};
use serde_json::{Value as Json, json};
use std::path::Path;

/// A pretrained model's tokenizer with its special tokens and chat template.
///
/// [`Tokenizer`]'s chunking contract (`encode(a + b) == encode(a) + encode(b)` when `a` ends
/// in non-whitespace and `b` starts with whitespace) holds for GPT-2-style byte-level BPE
/// (GGUF pre-tokenizers `gpt2`, `default`, `smollm`, `starcoder`, `refact`) and for BERT's
/// WordPiece, and is checked on load: [`HfTokenizer::is_chunk_safe`] says whether this one
/// meets it. It does not hold for Llama-3 and Qwen2 regexes, which join punctuation with the
/// line breaks after it (`".\n"` is one token), nor for SentencePiece-style tokenizers that
/// prepend "▁" to each text; encode such corpora whole.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    name: String,
    vocab_size: usize,
    bos: Option<(u32, String)>,
    eos: Option<(u32, String)>,
    eos_ids: Vec<u32>,
    pad: Option<u32>,
    adds_bos: bool,
    adds_eos: bool,
    chat_template: Option<String>,
    chunk_safe: bool,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("name", &self.name)
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.bos)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

/// Special tokens and template read from the files beside a tokenizer.json.
#[derive(Default)]
struct DirConfig {
    bos_token: Option<String>,
    eos_token: Option<String>,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    pad_token: Option<String>,
    pad_id: Option<u32>,
    add_bos: Option<bool>,
    add_eos: Option<bool>,
    chat_template: Option<String>,
}

fn file_error(path: &Path, reason: impl Into<String>) -> DataError {
    DataError::TokenizerFile {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Reads a JSON file that may be absent (`Ok(None)`), naming the file when it does not parse.
fn read_json(path: &Path) -> Result<Option<Json>, DataError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(file_error(path, format!("cannot read it: {e}"))),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| file_error(path, format!("is not valid JSON: {e}")))
}

/// The tokenizer.json transformers builds for a SentencePiece BPE vocabulary (its Llama
/// converter): pieces as the BPE vocabulary, merges recovered from the pieces and their scores,
/// a space in front of the text (`add_space_prefix`) and spaces as "\u{2581}", byte fallback;
/// unknown, control and user-defined pieces as added tokens. `unk` is the unknown piece's id.
fn sentencepiece_bpe_json(
    tokens: &[&str],
    scores: &[f32],
    types: &[i64],
    unk: Option<usize>,
    add_space_prefix: bool,
    byte_fallback: bool,
) -> Json {
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut ids: std::collections::HashMap<&str, usize> =
        std::collections::HashMap::with_capacity(tokens.len());
    for (id, &tok) in tokens.iter().enumerate() {
        vocab.entry(tok).or_insert(json!(id));
        ids.entry(tok).or_insert(id);
    }
    // transformers' SentencePiece extraction: for each piece in id order, its splits into
    // two pieces (ordered by the parts' ids), then all of them by the piece's score,
    // highest first, keeping that order among equal scores.
    let mut merges: Vec<(&str, &str, f32)> = Vec::new();
    for (id, &piece) in tokens.iter().enumerate() {
        let mut local: Vec<(usize, usize, &str, &str)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = piece.split_at(at);
                Some((*ids.get(l)?, *ids.get(r)?, l, r))
            })
            .collect();
        local.sort_by_key(|&(a, b, _, _)| (a, b));
        merges.extend(local.into_iter().map(|(_, _, l, r)| (l, r, scores[id])));
    }
    merges.sort_by(|a, b| b.2.total_cmp(&a.2));
    let merges: Vec<Json> = merges.iter().map(|(l, r, _)| json!([l, r])).collect();
    let unk = unk.and_then(|id| tokens.get(id)).map(|t| t.to_string());
    let added: Vec<Json> = types
        .iter()
        .enumerate()
        .filter(|(_, t)| **t == 2 || **t == 3 || **t == 4)
        .map(|(id, t)| {
            json!({
                "id": id, "content": tokens[id], "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": *t != 4,
            })
        })
        .collect();
    let mut normalizers = vec![];
    if add_space_prefix {
        normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
    }
    normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}));
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": byte_fallback, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    })
}

/// A special token as tokenizer_config.json writes it: a string, or an object with "content".
fn token_text(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(String::from),
        _ => None,
    }
}

fn id_list(v: &Json) -> Vec<u32> {
    match v {
        Json::Number(n) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        Json::Array(a) => a.iter().flat_map(id_list).collect(),
        _ => vec![],
    }
}

impl DirConfig {
    fn read(dir: &Path) -> Result<DirConfig, DataError> {
        let mut c = DirConfig::default();
        // special_tokens_map.json first: tokenizer_config.json overrides it, as in transformers.
        for file in ["special_tokens_map.json", "tokenizer_config.json"] {
            let Some(j) = read_json(&dir.join(file))? else {
                continue;
            };
            if let Some(t) = j.get("bos_token").and_then(token_text) {
                c.bos_token = Some(t);
            }
            if let Some(t) = j.get("eos_token").and_then(token_text) {
                c.eos_token = Some(t);
            }
            if let Some(t) = j.get("pad_token").and_then(token_text) {
                c.pad_token = Some(t);
            }
            if let Some(b) = j.get("add_bos_token").and_then(Json::as_bool) {
                c.add_bos = Some(b);
            }
            if let Some(b) = j.get("add_eos_token").and_then(Json::as_bool) {
                c.add_eos = Some(b);
            }
            match j.get("chat_template") {
                Some(Json::String(t)) => c.chat_template = Some(t.clone()),
                // Several named templates: transformers uses the one called "default".
                Some(Json::Array(list)) => {
                    c.chat_template = list
                        .iter()
                        .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                        .and_then(|t| t.get("template")?.as_str().map(String::from));
                }
                _ => {}
            }
        }
        // Newer transformers save the template as its own file, which takes precedence.
        let jinja = dir.join("chat_template.jinja");
        match std::fs::read_to_string(&jinja) {
            Ok(t) => c.chat_template = Some(t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(file_error(&jinja, format!("cannot read it: {e}"))),
        }
        if let Some(g) = read_json(&dir.join("generation_config.json"))? {
            c.bos_id = g
                .get("bos_token_id")
                .and_then(|v| id_list(v).first().copied());
            c.eos_ids = g.get("eos_token_id").map(id_list).unwrap_or_default();
            c.pad_id = g
                .get("pad_token_id")
                .and_then(|v| id_list(v).first().copied());
        }
        Ok(c)
    }
}

impl HfTokenizer {
    /// Loads a `tokenizer.json`, with the special tokens and chat template of the
    /// configuration files in the same directory where present.
    pub fn from_file(path: &Path) -> Result<HfTokenizer, DataError> {
        let json = read_json(path)?.ok_or_else(|| {
            file_error(
                path,
                "does not exist; a Hugging Face model directory has its tokenizer in tokenizer.json",
            )
        })?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut config = DirConfig::read(dir)?;
        // transformers (5.x) takes BOS and EOS from tokenizer.json's post-processor whatever
        // tokenizer_config.json's add_bos_token and add_eos_token say, for every tokenizer
        // class (bench/add_eos_parity.py); the flags count only where there is no
        // tokenizer.json (a SentencePiece tokenizer.model, a GGUF file).
        config.add_bos = None;
        config.add_eos = None;
        Self::build(json, path, path.display().to_string(), config, None)
    }

    /// Loads the tokenizer of a Hugging Face model directory (`tokenizer.json` and the
    /// configuration files beside it).
    pub fn from_dir(dir: &Path) -> Result<HfTokenizer, DataError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            let model = dir.join("tokenizer.model");
            if model.exists() {
                return Self::from_sentencepiece_model(&model);
            }
            return Err(file_error(
                &path,
                "does not exist, and neither does a SentencePiece tokenizer.model; a Hugging \
                 Face model directory needs one of them",
            ));
        }
        Self::from_file(&path)
    }

    /// Builds the tokenizer transformers builds from a SentencePiece BPE `tokenizer.model`
    /// (Llama 2, Mistral), with the special tokens and chat template of the configuration
    /// files beside it. Like transformers' converter it applies no normalizer beyond the
    /// space in front and spaces as "\u{2581}". A BOS goes in front of each text unless
    /// tokenizer_config.json says otherwise (LlamaTokenizer's default); its
    /// `added_tokens_decoder` entries past the pieces are added tokens.
    pub fn from_sentencepiece_model(path: &Path) -> Result<HfTokenizer, DataError> {
        let bytes =
            std::fs::read(path).map_err(|e| file_error(path, format!("cannot read it: {e}")))?;
        let m = super::sentencepiece_model::SentencePieceModel::parse(&bytes).map_err(|why| {
            file_error(
                path,
                format!("is not a SentencePiece model kiln reads: {why}"),
            )
        })?;
        if m.model_type != 2 {
            let kind = match m.model_type {
                1 => "unigram",
                3 => "word",
                4 => "char",
                _ => "an unknown kind of",
            };
            return Err(file_error(
                path,
                format!(
                    "is a SentencePiece {kind} model; kiln reads SentencePiece BPE models \
                     (Llama 2, Mistral) only: use the model's tokenizer.json"
                ),
            ));
        }
        let tokens: Vec<&str> = m.pieces.iter().map(|p| p.0.as_str()).collect();
        let scores: Vec<f32> = m.pieces.iter().map(|p| p.1).collect();
        let types: Vec<i64> = m.pieces.iter().map(|p| p.2).collect();
        let mut json = sentencepiece_bpe_json(
            &tokens,
            &scores,
            &types,
            Some(m.unk_id as usize),
            m.add_dummy_prefix,
            m.byte_fallback,
        );
        let dir = path.parent().unwrap_or(Path::new("."));
        // Tokens the configuration adds past the pieces (Phi-3's <|user|>, <|end|> and the
        // rest at 32000 and up), as transformers adds them.
        if let Some(decoder) = read_json(&dir.join("tokenizer_config.json"))?
            .and_then(|c| c.get("added_tokens_decoder").cloned())
            .and_then(|d| d.as_object().cloned())
        {
            let added = json["added_tokens"].as_array_mut().expect("built above");
            for (id, t) in decoder {
                let (Ok(id), Some(content)) = (id.parse::<usize>(), t["content"].as_str()) else {
                    continue;
                };
                if id >= tokens.len() {
                    added.push(json!({
                        "id": id, "content": content, "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": false, "special": t["special"] == true,
                    }));
                }
            }
        }
        let mut config = DirConfig::read(dir)?;
        let piece = |id: i64| usize::try_from(id).ok().and_then(|i| tokens.get(i));
        if config.bos_token.is_none() && config.bos_id.is_none() {
            config.bos_token = piece(m.bos_id).map(|t| t.to_string());
        }
        if config.eos_token.is_none() && config.eos_ids.is_empty() {
            config.eos_token = piece(m.eos_id).map(|t| t.to_string());
        }
        config.add_bos.get_or_insert(true);
        let name = format!("{} (SentencePiece model)", path.display());
        Self::build(json, path, name, config, Some(tokens.len()))
    }

    /// Builds the tokenizer a GGUF file describes. Byte-level BPE vocabularies
    /// (`tokenizer.ggml.model = "gpt2"`) with the pre-tokenizers `default`, `gpt2`, `smollm`,
    /// `starcoder`, `refact`, `llama-bpe` and `qwen2` are supported; control tokens (type 3)
    /// become special added tokens, so "<|im_start|>" in text is one id.
    pub fn from_gguf(g: &GgufFile) -> Result<HfTokenizer, DataError> {
        let path = g.path();
        let err = |reason: String| file_error(path, reason);
        let model = g.get_str("tokenizer.ggml.model").ok_or_else(|| {
            err("has no tokenizer (tokenizer.ggml.model is missing); use the model's tokenizer.json".into())
        })?;
        if model == "llama" {
            return Self::from_gguf_sentencepiece(g);
        }
        if model != "gpt2" {
            let what = match model {
                "bert" => "a WordPiece vocabulary",
                _ => "a vocabulary kind",
            };
            return Err(err(format!(
                "tokenizer.ggml.model = {model:?} ({what}) cannot be built from GGUF yet, only \
                 byte-level BPE (\"gpt2\") and SentencePiece BPE (\"llama\"); use the model's \
                 Hugging Face tokenizer.json instead"
            )));
        }
        let tokens = g.get_str_array("tokenizer.ggml.tokens").ok_or_else(|| {
            err(
                "tokenizer.ggml.tokens is missing or not a list of strings; the file is damaged"
                    .into(),
            )
        })?;
        let merges = g.get_str_array("tokenizer.ggml.merges").ok_or_else(|| {
            err("tokenizer.ggml.merges is missing or not a list of strings; a BPE vocabulary needs its merges".into())
        })?;
        let types = g.get_i64_array("tokenizer.ggml.token_type");
        if types.as_ref().is_some_and(|t| t.len() != tokens.len()) {
            return Err(err(
                "tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length; the file is damaged".into(),
            ));
        }
        let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("default");
        let (pre_tokenizer, normalizer, ignore_merges) =
            gguf_pre_tokenizer(pre).ok_or_else(|| {
                err(format!(
                    "tokenizer.ggml.pre = {pre:?} is a pre-tokenizer kiln does not know (it knows \
                 llama.cpp's GPT-2, SmolLM/StarCoder, Llama 3, Qwen2, DeepSeek and Falcon \
                 families: default, gpt-2, mpt, smollm, starcoder, refact, command-r, llama-bpe, \
                 qwen2, qwen35, deepseek-llm, deepseek-coder, falcon and their aliases); \
                 use the model's tokenizer.json instead"
                ))
            })?;

        let mut vocab = serde_json::Map::with_capacity(tokens.len());
        let mut added = vec![];
        for (id, &tok) in tokens.iter().enumerate() {
            // A repeated string keeps its first id, as llama.cpp's lookup does.
            vocab.entry(tok).or_insert(json!(id));
            let ty = types.as_ref().map_or(1, |t| t[id]);
            // 3: control tokens (special, never split); 4: user-defined (matched as written).
            if ty == 3 || ty == 4 {
                added.push(json!({
                    "id": id, "content": tok, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": ty == 3,
                }));
            }
        }
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| json!([a, b]))
                    .ok_or_else(|| err(format!("merge {m:?} is not two tokens separated by a space; the file is damaged")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let byte_level = json!({
            "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true,
        });
        let json = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": byte_level,
            "decoder": byte_level,
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                "vocab": vocab, "merges": merges,
            },
        });

        let is_control = |id: usize| types.as_ref().is_some_and(|t| t[id] == 3);
        // llama.cpp's default for BPE vocabularies is no BOS.
        let config = gguf_special_tokens(g, &tokens, is_control, false);
        let name = format!("{} (GGUF vocabulary)", path.display());
        Self::build(json, path, name, config, Some(tokens.len()))
    }

    /// A GGUF SentencePiece BPE vocabulary (`tokenizer.ggml.model = "llama"`: Llama 2,
    /// Mistral 7B, TinyLlama) as the tokenizer.json transformers builds for it: pieces with
    /// `▁` for spaces, a `▁` put before the text (unless `add_space_prefix` is false), bytes
    /// the vocabulary lacks spelled as its `<0xNN>` tokens, and merges made from the scores
    /// (every split of a piece into two pieces, ranked by the whole piece's score).
    fn from_gguf_sentencepiece(g: &GgufFile) -> Result<HfTokenizer, DataError> {
        let path = g.path();
        let err = |reason: String| file_error(path, reason);
        let tokens = g.get_str_array("tokenizer.ggml.tokens").ok_or_else(|| {
            err(
                "tokenizer.ggml.tokens is missing or not a list of strings; the file is damaged"
                    .into(),
            )
        })?;
        let scores = g.get_f32_array("tokenizer.ggml.scores").ok_or_else(|| {
            err(
                "tokenizer.ggml.scores is missing; a SentencePiece vocabulary needs its scores"
                    .into(),
            )
        })?;
        let types = g
            .get_i64_array("tokenizer.ggml.token_type")
            .unwrap_or_else(|| vec![1; tokens.len()]);
        if scores.len() != tokens.len() || types.len() != tokens.len() {
            return Err(err(
                "tokenizer.ggml.scores, token_type and tokens differ in length; the file is damaged"
                    .into(),
            ));
        }
        let unk = g
            .get_u64("tokenizer.ggml.unknown_token_id")
            .map(|id| id as usize)
            .or_else(|| types.iter().position(|&t| t == 2));
        let add_space_prefix = g
            .get_bool("tokenizer.ggml.add_space_prefix")
            .unwrap_or(true);
        let json = sentencepiece_bpe_json(&tokens, &scores, &types, unk, add_space_prefix, true);
        // llama.cpp's default for SentencePiece vocabularies is a BOS.
        let config = gguf_special_tokens(g, &tokens, |id| types[id] == 3, true);
        let name = format!("{} (GGUF SentencePiece vocabulary)", path.display());
        Self::build(json, path, name, config, Some(tokens.len()))
    }

    /// A built-in tokenizer (`byte` or `gpt2`) as the byte-level BPE `tokenizer.json` that
    /// encodes every text to the same ids (see [`super::builtin_json`]), for exporting a model
    /// trained on it.
    pub fn from_builtin(name: &str) -> Result<HfTokenizer, DataError> {
        let origin = Path::new(name);
        let fail = |reason: String| DataError::TokenizerInit {
            name: name.to_string(),
            reason,
        };
        let (json, config) = match name {
            "byte" => (
                super::builtin_json::byte_tokenizer_json(),
                DirConfig::default(),
            ),
            "gpt2" => {
                let bpe = tiktoken_rs::r50k_base().map_err(|e| fail(e.to_string()))?;
                let end = Some("<|endoftext|>".to_string());
                let config = DirConfig {
                    bos_token: end.clone(),
                    eos_token: end,
                    add_bos: Some(false),
                    ..DirConfig::default()
                };
                (
                    super::builtin_json::gpt2_tokenizer_json(&bpe).map_err(fail)?,
                    config,
                )
            }
            other => return Err(fail(format!("{other} is not a built-in tokenizer"))),
        };
        let mut config = config;
        config.add_bos = Some(false);
        Self::build(json, origin, name.to_string(), config, None)
    }

    fn build(
        json: Json,
        path: &Path,
        name: String,
        config: DirConfig,
        n_tokens: Option<usize>,
    ) -> Result<HfTokenizer, DataError> {
        let chunk_safe = is_chunk_safe_json(&json);
        let mut inner: tokenizers::Tokenizer = serde_json::from_value(json).map_err(|e| {
            file_error(
                path,
                format!("is not a tokenizer this version of the tokenizers library reads: {e}"),
            )
        })?;
        // Padding and truncation saved in the file are batching settings (all-MiniLM-L6-v2
        // pads every text to 128); transformers turns them off unless a call asks, and so
        // does kiln, which batches by itself.
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| file_error(path, format!("cannot turn off truncation: {e}")))?;
        let lookup = |text: &Option<String>, id: Option<u32>| -> Option<(u32, String)> {
            match (text, id) {
                (Some(t), _) => inner.token_to_id(t).map(|i| (i, t.clone())),
                (None, Some(i)) => inner.id_to_token(i).map(|t| (i, t)),
                (None, None) => None,
            }
        };
        let bos = lookup(&config.bos_token, config.bos_id);
        let eos = lookup(&config.eos_token, config.eos_ids.first().copied());
        let pad = lookup(&config.pad_token, config.pad_id).map(|p| p.0);
        let mut eos_ids: Vec<u32> = eos.iter().map(|e| e.0).collect();
        for id in config.eos_ids {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let vocab_size = inner
            .get_vocab_size(true)
            .max(n_tokens.unwrap_or(0))
            .max(eos_ids.iter().map(|&i| i as usize + 1).max().unwrap_or(0));
        let mut tok = HfTokenizer {
            inner,
            name,
            vocab_size,
            bos,
            eos,
            eos_ids,
            pad,
            adds_bos: false,
            adds_eos: false,
            chat_template: config.chat_template,
            chunk_safe,
        };
        // Without a setting, the post-processor is the truth: does it put BOS in front, EOS
        // behind? (A setting wins, as in transformers' Llama-family tokenizers, which rebuild
        // the post-processor from add_bos_token and add_eos_token.)
        let (pp_bos, pp_eos) = tok.post_processor_adds().map_err(|e| file_error(path, e))?;
        tok.adds_bos = config.add_bos.unwrap_or(pp_bos);
        tok.adds_eos = config.add_eos.unwrap_or(pp_eos) && tok.eos.is_some();
        Ok(tok)
    }

    /// Whether the library's post-processor alone puts the BOS token in front of a text and
    /// the EOS token behind it.
    fn post_processor_adds(&self) -> Result<(bool, bool), String> {
        let plain = self.try_encode("a", false)?;
        let ids = self.try_encode("a", true)?;
        let eos = self.eos.as_ref().map(|e| e.0);
        let bos = self.bos_id().is_some() && ids.first().copied() == self.bos_id();
        let eos = eos.is_some() && ids.last().copied() == eos && plain.last().copied() != eos;
        Ok((bos, eos))
    }

    /// A `TemplateProcessing` post-processor that puts this tokenizer's BOS in front and its
    /// EOS behind each text as [`adds_bos`](Self::adds_bos) and [`adds_eos`](Self::adds_eos)
    /// say (a pair: both texts, each so wrapped, the second with type id 1).
    fn template_processing(&self) -> Json {
        let special =
            |b: &(u32, String), n: u32| json!({"SpecialToken": {"id": b.1, "type_id": n}});
        let seq = |ty: &str, n: u32| json!({"Sequence": {"id": ty, "type_id": n}});
        let bos = self.bos.as_ref().filter(|_| self.adds_bos);
        let eos = self.eos.as_ref().filter(|_| self.adds_eos);
        let wrap = |ty: &str, n: u32| -> Vec<Json> {
            let mut out: Vec<Json> = bos.map(|b| special(b, n)).into_iter().collect();
            out.push(seq(ty, n));
            out.extend(eos.map(|e| special(e, n)));
            out
        };
        let mut pair = wrap("A", 0);
        pair.extend(wrap("B", 1));
        let mut tokens = serde_json::Map::new();
        for (id, t) in bos.into_iter().chain(eos) {
            tokens.insert(t.clone(), json!({"id": t, "ids": [id], "tokens": [t]}));
        }
        json!({
            "type": "TemplateProcessing",
            "single": wrap("A", 0),
            "pair": pair,
            "special_tokens": tokens,
        })
    }

    fn try_encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String> {
        self.inner
            .encode_fast(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("cannot encode text: {e}"))
    }

    /// Token ids of `text` with no special tokens added; special tokens written in the text
    /// ("<|im_start|>") are recognised as single ids, as in Hugging Face. Encoding does not
    /// fail for byte-level BPE or WordPiece vocabularies (every byte, or [UNK], has an id);
    /// should another kind fail, the result is empty.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.try_encode(text, false).unwrap_or_default()
    }

    /// Token ids of `text` with the tokenizer's post-processing (Hugging Face's
    /// `add_special_tokens=True`: BERT's [CLS] ... [SEP], Llama's BOS), with the BOS token
    /// in front exactly when `add_bos` is true (for tokenizers that have one), and the EOS
    /// token behind exactly when the model's configuration asks for it
    /// ([`adds_eos`](Self::adds_eos)).
    pub fn encode_with_special(&self, text: &str, add_bos: bool) -> Vec<u32> {
        let mut ids = self.try_encode(text, true).unwrap_or_default();
        let plain = || self.encode(text);
        if let Some(bos) = self.bos_id() {
            let has = ids.first() == Some(&bos);
            if add_bos && !has {
                ids.insert(0, bos);
            } else if !add_bos && has && plain().first() != Some(&bos) {
                ids.remove(0);
            }
        }
        if let Some((eos, _)) = self.eos {
            let has = ids.last() == Some(&eos);
            if self.adds_eos && !has {
                ids.push(eos);
            } else if !self.adds_eos && has && plain().last() != Some(&eos) {
                ids.pop();
            }
        }
        ids
    }

    /// Whether the model's configuration asks for a BOS token in front of each text
    /// (`add_bos_token`), the usual second argument of [`encode_with_special`](Self::encode_with_special).
    pub fn adds_bos(&self) -> bool {
        self.adds_bos
    }

    /// Whether the model's configuration asks for the EOS token behind each text
    /// (`add_eos_token`, GGUF's `tokenizer.ggml.add_eos_token`; or the post-processor adds it).
    /// Generation prompts never take it: a prompt is continued, not ended.
    pub fn adds_eos(&self) -> bool {
        self.adds_eos
    }

    /// The text of `ids`, special tokens included, so that decoding undoes [`encode`](Self::encode).
    pub fn decode(&self, ids: &[u32]) -> String {
        self.decode_with(ids, false)
    }

    /// The text of `ids` without special tokens (for showing a model's answer).
    pub fn decode_skip_special(&self, ids: &[u32]) -> String {
        self.decode_with(ids, true)
    }

    /// Decodes runs of known ids; an id outside the vocabulary becomes U+FFFD rather than
    /// vanishing (the library drops it), so a sampling bug shows in the text.
    fn decode_with(&self, ids: &[u32], skip_special: bool) -> String {
        let mut out = String::new();
        for (i, run) in ids
            .split(|&id| self.inner.id_to_token(id).is_none())
            .enumerate()
        {
            if i > 0 {
                out.push('\u{fffd}');
            }
            if !run.is_empty() {
                match self.inner.decode(run, skip_special) {
                    Ok(s) => out.push_str(&s),
                    Err(_) => out.push('\u{fffd}'),
                }
            }
        }
        out
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos.as_ref().map(|b| b.0)
    }

    /// The padding id the model's configuration names, if any.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Every id that ends generation: the EOS token, then the other end-of-turn ids the
    /// model's configuration lists (generation_config.json's `eos_token_id`, GGUF's EOT/EOM
    /// and end-of-turn control tokens such as `<|im_end|>`).
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_ids.clone()
    }

    /// The BOS token's text for chat templates ("" when the model has none).
    pub fn bos_token(&self) -> &str {
        self.bos.as_ref().map_or("", |b| b.1.as_str())
    }

    /// The EOS token's text for chat templates ("" when the model has none).
    pub fn eos_token(&self) -> &str {
        self.eos.as_ref().map_or("", |e| e.1.as_str())
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Whether [`encode_chunked`](super::encode_chunked) gives the same ids as encoding
    /// the whole text (see the type's documentation).
    pub fn is_chunk_safe(&self) -> bool {
        self.chunk_safe
    }

    /// The library tokenizer, for what this type does not wrap (offsets, batches).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Writes `tokenizer.json`, `tokenizer_config.json` (special tokens, BOS handling, chat
    /// template) and `generation_config.json` (BOS and EOS ids) into `dir`, the files
    /// transformers reads beside a model.
    pub fn save_dir(&self, dir: &Path) -> Result<(), DataError> {
        let json = dir.join("tokenizer.json");
        let mut tokenizer: Json = self
            .inner
            .to_string(false)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .ok_or_else(|| {
                file_error(&json, "cannot be written: the tokenizer does not serialise")
            })?;
        // transformers' PreTrainedTokenizerFast adds special tokens through the post-processor
        // alone (it ignores add_bos_token and add_eos_token): where the post-processor does not
        // do what this tokenizer does (a SentencePiece vocabulary from GGUF or tokenizer.model
        // has none; a configuration may ask for EOS), it gets Llama's template with exactly
        // this tokenizer's BOS and EOS.
        let post_processor = self
            .post_processor_adds()
            .map_err(|e| file_error(&json, e))?;
        if post_processor != (self.adds_bos, self.adds_eos) {
            tokenizer["post_processor"] = self.template_processing();
        }
        std::fs::write(&json, serde_json::to_string(&tokenizer).unwrap_or_default())
            .map_err(|e| file_error(&json, format!("cannot be written: {e}")))?;
        let mut cfg = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.adds_bos,
            "add_eos_token": self.adds_eos,
            "clean_up_tokenization_spaces": false,
        });
        if let Some((_, t)) = &self.bos {
            cfg["bos_token"] = t.clone().into();
        }
        if let Some((_, t)) = &self.eos {
            cfg["eos_token"] = t.clone().into();
        }
        if let Some(t) = &self.chat_template {
            cfg["chat_template"] = t.clone().into();
        }
        let mut gen_cfg = serde_json::json!({ "eos_token_id": self.eos_ids });
        if let Some((id, _)) = &self.bos {
            gen_cfg["bos_token_id"] = (*id).into();
        }
        for (name, value) in [
            ("tokenizer_config.json", cfg),
            ("generation_config.json", gen_cfg),
        ] {
            let path = dir.join(name);
            std::fs::write(
                &path,
                serde_json::to_string_pretty(&value).unwrap_or_default(),
            )
            .map_err(|e| file_error(&path, format!("cannot be written: {e}")))?;
        }
        Ok(())
    }
}

impl Tokenizer for HfTokenizer {
    fn name(&self) -> &str {
        &self.name
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        HfTokenizer::encode(self, text)
    }

    fn decode(&self, ids: &[u32]) -> String {
        HfTokenizer::decode(self, ids)
    }
}

/// End-of-turn tokens of common chat formats (ChatML, Llama 3, Gemma).
const END_OF_TURN: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
];

/// Llama 3's pre-tokenizer regex, as in its tokenizer.json.
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's: Llama 3's with single digits.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// DeepSeek LLM's pre-tokenizer: these expressions split in turn (llama.cpp's deepseek-llm).
const DEEPSEEK_LLM_REGEXES: &[&str] = &[
    "[\u{d}\u{a}]",
    "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+",
    "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+",
    "\\s+$",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}+",
];
/// DeepSeek Coder's (llama.cpp's deepseek-coder).
const DEEPSEEK_CODER_REGEXES: &[&str] = &[
    "[\u{d}\u{a}]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}",
];
/// Falcon's (llama.cpp's falcon): punctuation runs, GPT-2's expression, digits in threes.
const FALCON_REGEXES: &[&str] = &[
    "[\\p{P}\\$\\+<=>\\^~\\|`]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "[0-9][0-9][0-9]",
];
/// Qwen3.5's, as its tokenizer.json writes it (llama.cpp's qwen35).
const QWEN35_REGEX: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// The SentencePiece BPE fixture (`tests/data/spm_bpe.json`: pieces, scores and types that
/// SentencePiece trained, and the ids it gives a set of texts), and its vocabulary as the GGUF
/// `tokenizer.*` metadata llama.cpp's converter writes.
#[cfg(test)]
pub(crate) fn spm_fixture_gguf_metadata() -> (Json, Vec<(&'static str, super::gguf::GgufValue)>) {
    use super::gguf::GgufValue;
    let fixture: Json =
        serde_json::from_str(include_str!("../../tests/data/spm_bpe.json")).unwrap();
    let pieces = fixture["pieces"].as_array().unwrap();
    let col = |i: usize, f: &dyn Fn(&Json) -> GgufValue| {
        GgufValue::Array(pieces.iter().map(|p| f(&p[i])).collect())
    };
    let md = vec![
        ("tokenizer.ggml.model", GgufValue::String("llama".into())),
        (
            "tokenizer.ggml.tokens",
            col(0, &|v| GgufValue::String(v.as_str().unwrap().into())),
        ),
        (
            "tokenizer.ggml.scores",
            col(1, &|v| GgufValue::F32(v.as_f64().unwrap() as f32)),
        ),
        (
            "tokenizer.ggml.token_type",
            col(2, &|v| GgufValue::I32(v.as_i64().unwrap() as i32)),
        ),
        ("tokenizer.ggml.bos_token_id", GgufValue::U32(1)),
        ("tokenizer.ggml.eos_token_id", GgufValue::U32(2)),
        ("tokenizer.ggml.unknown_token_id", GgufValue::U32(0)),
    ];
    (fixture, md)
}

/// The fixture's tokenizer as kiln reads it from a GGUF file of that metadata.
#[cfg(test)]
pub(crate) fn spm_fixture_tokenizer() -> HfTokenizer {
    let (_, md) = spm_fixture_gguf_metadata();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("spm.gguf");
    std::fs::write(&path, super::gguf::writer::gguf_bytes(&md, &[])).unwrap();
    HfTokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap()
}

/// BOS, EOS, padding and the chat template from a GGUF file's `tokenizer.*` metadata, for
/// its vocabulary `tokens` (`is_control` tells its control tokens). Generation ends at EOS and
/// at the end-of-turn and end-of-message ids the file names, and, as llama.cpp does, at the
/// end-of-turn control tokens of the common chat formats, since many converted files name only
/// `<|endoftext|>` as EOS. `add_bos` applies when the file does not say.
fn gguf_special_tokens(
    g: &GgufFile,
    tokens: &[&str],
    is_control: impl Fn(usize) -> bool,
    add_bos: bool,
) -> DirConfig {
    let token = |key: &str| -> Option<(u32, String)> {
        let id = u32::try_from(g.get_u64(key)?).ok()?;
        Some((id, tokens.get(id as usize)?.to_string()))
    };
    let (bos, eos) = (
        token("tokenizer.ggml.bos_token_id"),
        token("tokenizer.ggml.eos_token_id"),
    );
    let mut eos_ids: Vec<u32> = Vec::new();
    let ends = [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ]
    .iter()
    .filter_map(|k| token(k).map(|t| t.0));
    let turns = (0..tokens.len())
        .filter(|&id| is_control(id) && END_OF_TURN.contains(&tokens[id]))
        .map(|id| id as u32);
    for id in ends.chain(turns) {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    }
    DirConfig {
        bos_token: bos.as_ref().map(|b| b.1.clone()),
        eos_token: eos.as_ref().map(|e| e.1.clone()),
        bos_id: bos.as_ref().map(|b| b.0),
        eos_ids,
        pad_token: None,
        pad_id: token("tokenizer.ggml.padding_token_id").map(|t| t.0),
        add_bos: Some(
            g.get_bool("tokenizer.ggml.add_bos_token")
                .unwrap_or(add_bos),
        ),
        add_eos: g.get_bool("tokenizer.ggml.add_eos_token"),
        chat_template: g.get_str("tokenizer.chat_template").map(String::from),
    }
}

/// (pre_tokenizer, normalizer, ignore_merges) of the tokenizer.json that the model behind a
/// GGUF `tokenizer.ggml.pre` name ships.
pub(crate) fn gguf_pre_tokenizer(pre: &str) -> Option<(Json, Json, bool)> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    // Expressions that split in turn, each match its own piece, then bytes to symbols.
    let splits = |regexes: &[&str]| {
        let mut seq: Vec<Json> = regexes
            .iter()
            .map(|r| json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false}))
            .collect();
        seq.push(byte_level(false));
        json!({"type": "Sequence", "pretokenizers": seq})
    };
    let split = |regex: &str| splits(&[regex]);
    Some(match pre {
        // GPT-2's regex alone: llama.cpp's names for it ("gpt2" is what kiln wrote before
        // it wrote llama.cpp's "gpt-2"; "default" is llama.cpp's fallback).
        "default" | "gpt2" | "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "trillion"
        | "jina-es" | "jina-de" | "jina-v2-es" | "jina-v2-de" | "gigachat" | "a.x-4.0"
        | "mellum" | "modern-bert" | "granite-docling" => (byte_level(true), Json::Null, false),
        // SmolLM2's tokenizer.json: single digits, then GPT-2's byte-level regex (llama.cpp
        // gives these names the same two expressions).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva"
        | "mellum2" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true),
            ]}),
            Json::Null,
            false,
        ),
        "llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => (split(LLAMA3_REGEX), Json::Null, true),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" => {
            (split(QWEN2_REGEX), json!({"type": "NFC"}), false)
        }
        // No normalizer: Qwen3.5 keeps combining marks as they come, unlike Qwen2.
        "qwen35" => (split(QWEN35_REGEX), Json::Null, false),
        "deepseek-llm" => (splits(DEEPSEEK_LLM_REGEXES), Json::Null, false),
        "deepseek-coder" => (splits(DEEPSEEK_CODER_REGEXES), Json::Null, false),
        "falcon" => (splits(FALCON_REGEXES), Json::Null, false),
        _ => return None,
    })
}

/// Whether a tokenizer.json meets [`Tokenizer`]'s chunking contract: every normalizer acts
/// on characters one by one, every pre-tokenizer splits at whitespace without looking across
/// it or adding a prefix, and no added token has whitespace after a non-whitespace character.
fn is_chunk_safe_json(json: &Json) -> bool {
    fn all_of(v: &Json, list_key: &str, ok: &dyn Fn(&str, &Json) -> bool) -> bool {
        match v {
            Json::Null => true,
            Json::Object(o) => match o.get("type").and_then(Json::as_str) {
                Some("Sequence") => o
                    .get(list_key)
                    .and_then(Json::as_array)
                    .is_some_and(|items| items.iter().all(|i| all_of(i, list_key, ok))),
                Some(ty) => ok(ty, v),
                None => false,
            },
            _ => false,
        }
    }
    let normalizer_ok = all_of(&json["normalizer"], "normalizers", &|ty, _| {
        matches!(
            ty,
            "NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" | "StripAccents" | "BertNormalizer"
        )
    });
    let pre_ok = all_of(&json["pre_tokenizer"], "pretokenizers", &|ty, v| match ty {
        "ByteLevel" => {
            v["add_prefix_space"].as_bool() == Some(false)
                && v["use_regex"].as_bool() != Some(false)
        }
        "Digits" | "Whitespace" | "WhitespaceSplit" | "BertPreTokenizer" | "Punctuation" => true,
        _ => false,
    });
    let added_ok = json["added_tokens"].as_array().is_none_or(|tokens| {
        tokens.iter().all(|t| {
            let s = t["content"].as_str().unwrap_or("");
            let mut prev_non_ws = false;
            s.chars().all(|c| {
                let bad = prev_non_ws && c.is_whitespace();
                prev_non_ws = !c.is_whitespace();
                !bad
            })
        })
    });
    normalizer_ok && pre_ok && added_ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::gguf::GgufValue;
    use crate::data::gguf::writer::gguf_bytes;
    use std::path::PathBuf;

    /// The 256 byte-level symbols in GPT-2's order (printable bytes map to themselves, the
    /// rest to U+0100 onwards).
    fn byte_symbols() -> Vec<String> {
        let printable = |b: u32| {
            (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
        };
        let mut next = 256;
        (0..256u32)
            .map(|b| {
                let c = if printable(b) {
                    b
                } else {
                    next += 1;
                    next - 1
                };
                char::from_u32(c).unwrap().to_string()
            })
            .collect()
    }

    /// A tiny byte-level BPE vocabulary in GGUF: control tokens, the 256 bytes, a few merges.
    fn tiny_gguf(pre: &str) -> (tempfile::TempDir, PathBuf) {
        let mut tokens: Vec<String> = vec![
            "<|endoftext|>".into(),
            "<|im_start|>".into(),
            "<|im_end|>".into(),
        ];
        tokens.extend(byte_symbols());
        let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "Ġw o"];
        for m in merges {
            tokens.push(m.replace(' ', ""));
        }
        let mut types = vec![GgufValue::I32(3); 3];
        types.extend(std::iter::repeat_n(GgufValue::I32(1), tokens.len() - 3));
        let strings = |v: &[String]| {
            GgufValue::Array(v.iter().map(|s| GgufValue::String(s.clone())).collect())
        };
        let md = vec![
            ("tokenizer.ggml.model", GgufValue::String("gpt2".into())),
            ("tokenizer.ggml.pre", GgufValue::String(pre.into())),
            ("tokenizer.ggml.tokens", strings(&tokens)),
            ("tokenizer.ggml.merges", strings(&merges.map(String::from))),
            ("tokenizer.ggml.token_type", GgufValue::Array(types)),
            ("tokenizer.ggml.bos_token_id", GgufValue::U32(1)),
            ("tokenizer.ggml.eos_token_id", GgufValue::U32(0)),
            (
                "tokenizer.chat_template",
                GgufValue::String("{{ bos_token }}".into()),
            ),
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tok.gguf");
        std::fs::write(&path, gguf_bytes(&md, &[])).unwrap();
        (dir, path)
    }

    #[test]
    fn a_gguf_bpe_vocabulary_encodes_and_decodes_losslessly() {
        let (_dir, path) = tiny_gguf("smollm");
        let g = GgufFile::open(&path).unwrap();
        let tok = HfTokenizer::from_gguf(&g).unwrap();
        assert_eq!(tok.vocab_size(), 3 + 256 + 6);
        let hello = tok.token_to_id("hello").unwrap();
        let wo = tok.token_to_id("Ġwo").unwrap();
        let ids = tok.encode("hello wo");
        assert_eq!(ids, vec![hello, wo]);
        // Digits split one by one; control tokens are single ids, also mid-text.
        assert_eq!(tok.encode("42").len(), 2);
        assert_eq!(tok.encode("<|im_start|>hello<|im_end|>"), vec![1, hello, 2]);
        for text in [
            "hello wo",
            "héllo\n\n  wörld 123 ✓ 🦀\t!",
            "<|im_start|>user\nhi<|im_end|>\n",
            "",
        ] {
            assert_eq!(tok.decode(&tok.encode(text)), text);
        }
        assert_eq!(tok.decode_skip_special(&[1, hello, 2]), "hello");
        assert_eq!(tok.decode(&[hello, 100_000, hello]), "hello\u{fffd}hello");
        assert_eq!(tok.bos_id(), Some(1));
        assert_eq!(tok.bos_token(), "<|im_start|>");
        assert_eq!(tok.eos_token(), "<|endoftext|>");
        // <|im_end|> is a control token of ChatML: generation ends there too.
        assert_eq!(tok.eos_ids(), vec![0, 2]);
        assert_eq!(tok.encode_with_special("hello", true), vec![1, hello]);
        assert_eq!(tok.encode_with_special("hello", false), vec![hello]);
        assert!(!tok.adds_bos());
        assert_eq!(tok.chat_template(), Some("{{ bos_token }}"));
        assert!(tok.is_chunk_safe());
        let t: &dyn Tokenizer = &tok;
        assert_eq!(t.decode(&t.encode("hello wo")), "hello wo");
    }

    /// A SentencePiece BPE vocabulary (trained by sentencepiece itself on the bundled corpus,
    /// with byte fallback; `tests/data/spm_bpe.json`, made by scripts/make-spm-fixture.py) in
    /// a GGUF file encodes 314 texts to the ids sentencepiece gave, and decodes them back.
    #[test]
    fn a_gguf_sentencepiece_vocabulary_encodes_as_sentencepiece_does() {
        let (fixture, _) = spm_fixture_gguf_metadata();
        encodes_the_fixture_as_sentencepiece_does(&spm_fixture_tokenizer(), &fixture);
    }

    /// The same vocabulary as SentencePiece saves it (`tokenizer.model`,
    /// tests/data/spm_bpe.model), alone in a Hugging Face directory and as a file: the same
    /// ids, BOS and EOS from the model's own settings; tokenizer_config.json's settings win.
    #[test]
    fn a_sentencepiece_model_file_encodes_as_sentencepiece_does() {
        let fixture: Json =
            serde_json::from_str(include_str!("../../tests/data/spm_bpe.json")).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("tokenizer.model");
        std::fs::write(&model, include_bytes!("../../tests/data/spm_bpe.model")).unwrap();
        for tok in [
            HfTokenizer::from_dir(dir.path()).unwrap(),
            crate::data::tokenizer_from_path(&model).unwrap(),
        ] {
            encodes_the_fixture_as_sentencepiece_does(&tok, &fixture);
            assert_eq!(tok.eos_ids(), vec![2]);
        }
        // Saved as a Hugging Face directory, the tokenizer.json itself puts the BOS in front
        // (what transformers' fast tokenizer reads), once, and kiln reads it back the same.
        let saved = tempfile::tempdir().unwrap();
        HfTokenizer::from_dir(dir.path())
            .unwrap()
            .save_dir(saved.path())
            .unwrap();
        let raw = tokenizers::Tokenizer::from_file(saved.path().join("tokenizer.json")).unwrap();
        let plain = raw.encode("Hello world", false).unwrap().get_ids().to_vec();
        let special = raw.encode("Hello world", true).unwrap().get_ids().to_vec();
        assert_eq!(special[0], 1);
        assert_eq!(&special[1..], &plain[..]);
        let back = HfTokenizer::from_dir(saved.path()).unwrap();
        assert!(back.adds_bos());
        assert_eq!(back.encode_with_special("Hello world", true), special);
        encodes_the_fixture_as_sentencepiece_does(&back, &fixture);
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"add_bos_token": false, "eos_token": "<unk>"}"#,
        )
        .unwrap();
        let tok = HfTokenizer::from_dir(dir.path()).unwrap();
        assert!(!tok.adds_bos());
        assert_eq!(tok.eos_ids(), vec![0]);
        // A unigram model is refused by name; a file that is no model says so.
        let bytes = include_bytes!("../../tests/data/spm_bpe.model");
        let at = find_model_type(bytes);
        let mut unigram = bytes.to_vec();
        unigram[at] = 1;
        std::fs::write(&model, &unigram).unwrap();
        let e = HfTokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("unigram") && e.contains("tokenizer.json"), "{e}");
        std::fs::write(&model, b"not a model").unwrap();
        let e = HfTokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("not a SentencePiece model"), "{e}");
        std::fs::remove_file(&model).unwrap();
        let e = HfTokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(e.contains("tokenizer.model"), "{e}");
    }

    /// `add_eos_token` beside a SentencePiece model (GGUF's `tokenizer.ggml.add_eos_token`
    /// likewise) puts EOS behind each text encoded with special tokens, and only then; a saved
    /// directory's tokenizer.json does the same by itself (transformers reads no flag beside a
    /// tokenizer.json), its tokenizer_config.json says so, and the flags read back.
    #[test]
    fn add_eos_token_ends_each_text_and_survives_a_save() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer.model"),
            include_bytes!("../../tests/data/spm_bpe.model"),
        )
        .unwrap();
        let text = "Hello world";
        let plain = HfTokenizer::from_dir(dir.path()).unwrap();
        assert!(!plain.adds_eos());
        let (bos, eos) = (plain.bos_id().unwrap(), plain.eos_ids()[0]);
        let body = plain.encode(text);
        assert_eq!(
            plain.encode_with_special(text, true),
            [&[bos], &body[..]].concat()
        );
        for (bos_flag, eos_flag) in [(true, true), (false, true), (true, false)] {
            std::fs::write(
                dir.path().join("tokenizer_config.json"),
                format!(r#"{{"add_bos_token": {bos_flag}, "add_eos_token": {eos_flag}}}"#),
            )
            .unwrap();
            let tok = HfTokenizer::from_dir(dir.path()).unwrap();
            assert_eq!((tok.adds_bos(), tok.adds_eos()), (bos_flag, eos_flag));
            let mut want = body.clone();
            if bos_flag {
                want.insert(0, bos);
            }
            if eos_flag {
                want.push(eos);
            }
            assert_eq!(tok.encode_with_special(text, tok.adds_bos()), want);
            assert_eq!(
                tok.encode(text),
                body,
                "plain encoding takes no special token"
            );
            let saved = tempfile::tempdir().unwrap();
            tok.save_dir(saved.path()).unwrap();
            let raw =
                tokenizers::Tokenizer::from_file(saved.path().join("tokenizer.json")).unwrap();
            assert_eq!(raw.encode(text, true).unwrap().get_ids(), &want[..]);
            let cfg: Json = serde_json::from_str(
                &std::fs::read_to_string(saved.path().join("tokenizer_config.json")).unwrap(),
            )
            .unwrap();
            assert_eq!(cfg["add_eos_token"], Json::Bool(eos_flag));
            let back = HfTokenizer::from_dir(saved.path()).unwrap();
            assert_eq!((back.adds_bos(), back.adds_eos()), (bos_flag, eos_flag));
            assert_eq!(back.encode_with_special(text, back.adds_bos()), want);
            // Beside a tokenizer.json the flags are not read: its post-processor decides.
            std::fs::write(
                saved.path().join("tokenizer_config.json"),
                format!(
                    r#"{{"add_bos_token": {}, "add_eos_token": {}}}"#,
                    !bos_flag, !eos_flag
                ),
            )
            .unwrap();
            let back = HfTokenizer::from_dir(saved.path()).unwrap();
            assert_eq!((back.adds_bos(), back.adds_eos()), (bos_flag, eos_flag));
            assert_eq!(back.encode_with_special(text, back.adds_bos()), want);
        }
    }

    /// The byte offset of `TrainerSpec.model_type`'s value in a model file (field 2, then its
    /// field 3 as a one-byte varint).
    fn find_model_type(bytes: &[u8]) -> usize {
        let mut i = 0;
        let varint = |i: &mut usize| {
            let mut v = 0u64;
            let mut shift = 0;
            loop {
                let b = bytes[*i];
                *i += 1;
                v |= u64::from(b & 0x7f) << shift;
                shift += 7;
                if b & 0x80 == 0 {
                    return v;
                }
            }
        };
        loop {
            let key = varint(&mut i);
            let n = varint(&mut i) as usize; // every top-level field here is length-delimited
            if key >> 3 == 2 {
                let end = i + n;
                while i < end {
                    let k = varint(&mut i);
                    if k == (3 << 3) {
                        return i;
                    }
                    match k & 7 {
                        0 => {
                            varint(&mut i);
                        }
                        1 => i += 8,
                        2 => {
                            let m = varint(&mut i) as usize;
                            i += m;
                        }
                        5 => i += 4,
                        _ => unreachable!(),
                    }
                }
                panic!("no model_type");
            }
            i += n;
        }
    }

    fn encodes_the_fixture_as_sentencepiece_does(tok: &HfTokenizer, fixture: &Json) {
        assert!(tok.adds_bos());
        assert_eq!(tok.bos_id(), Some(1));
        let cases = fixture["cases"].as_array().unwrap();
        assert!(cases.len() > 300);
        let mut wrong = vec![];
        for c in cases {
            let text = c[0].as_str().unwrap();
            let want: Vec<u32> = c[1]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let got = tok.encode(text);
            if got != want {
                wrong.push(format!("{text:?}: {got:?} != {want:?}"));
            }
            assert_eq!(tok.decode(&want), text, "decodes back");
        }
        assert!(
            wrong.is_empty(),
            "{} of {}:\n{}",
            wrong.len(),
            cases.len(),
            wrong.join("\n")
        );
        assert_eq!(tok.encode_with_special("Hello", true)[0], 1);
    }

    #[test]
    fn gguf_pre_tokenizers_are_known_or_refused_by_name() {
        for pre in ["gpt2", "default", "llama-bpe", "qwen2"] {
            let (_dir, path) = tiny_gguf(pre);
            let tok = HfTokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
            let text = "hello, wo 2024!\n";
            assert_eq!(tok.decode(&tok.encode(text)), text, "{pre}");
            assert_eq!(
                tok.is_chunk_safe(),
                pre == "gpt2" || pre == "default",
                "{pre}"
            );
        }
        let (_dir, path) = tiny_gguf("tekken");
        let e = HfTokenizer::from_gguf(&GgufFile::open(&path).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("tekken") && e.contains("tokenizer.json"), "{e}");
    }

    #[test]
    fn a_directory_supplies_special_tokens_and_the_template() {
        let dir = tempfile::tempdir().unwrap();
        let vocab: serde_json::Map<String, Json> =
            ["[UNK]", "[CLS]", "[SEP]", "hello", "world", "<eot>"]
                .iter()
                .enumerate()
                .map(|(i, t)| (t.to_string(), json!(i)))
                .collect();
        let tj = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 5, "content": "<eot>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                           "strip_accents": null, "lowercase": true},
            "pre_tokenizer": {"type": "BertPreTokenizer"},
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                           {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [1], "tokens": ["[CLS]"]},
                                   "[SEP]": {"id": "[SEP]", "ids": [2], "tokens": ["[SEP]"]}}},
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
            "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                      "max_input_chars_per_word": 100, "vocab": vocab},
        });
        std::fs::write(dir.path().join("tokenizer.json"), tj.to_string()).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            json!({"eos_token": {"content": "[SEP]"}, "chat_template": "{{ eos_token }}"})
                .to_string(),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("generation_config.json"),
            json!({"eos_token_id": [2, 5]}).to_string(),
        )
        .unwrap();
        let tok = HfTokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.encode("Hello world"), vec![3, 4]);
        assert_eq!(
            tok.encode_with_special("Hello world", false),
            vec![1, 3, 4, 2]
        );
        assert_eq!(tok.eos_ids(), vec![2, 5]);
        assert_eq!(tok.eos_token(), "[SEP]");
        assert_eq!(tok.bos_id(), None);
        assert_eq!(tok.chat_template(), Some("{{ eos_token }}"));
        assert!(tok.is_chunk_safe());

        let e = HfTokenizer::from_dir(&dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer.json") && e.contains("does not exist"),
            "{e}"
        );
        std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
        let e = HfTokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("tokenizer.json") && e.contains("tokenizers library"),
            "{e}"
        );
    }
}
