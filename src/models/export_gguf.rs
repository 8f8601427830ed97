//! Export to GGUF: a Llama-family model written as the single file llama.cpp (and Ollama, LM
//! Studio, kiln itself) runs, with its tokenizer and chat template in the metadata.
//!
//! The inverse of `import::pretrained`'s GGUF reading, in llama.cpp's converter's layout:
//! `general.architecture` llama, qwen2 (query/key/value biases), qwen3 (per-head query/key
//! norms) or phi3 (Phi-3's fused projections, LongRoPE's factors as `rope_factors_long` and
//! `rope_factors_short`); llama's query and key rows interleaved for its pairwise rotation; Llama 3's
//! frequency scaling as `rope_freqs.weight` divisors; matrices in F32, F16, BF16, Q8_0, Q4_0 or Q4_K and
//! vectors in F32, as the converter writes them.

use crate::config::ModelConfig;
use crate::data::HfTokenizer;
use crate::data::gguf::writer::{Tensor, gguf_bytes};
use crate::data::gguf::{GgufFile, GgufValue as V};
use crate::engine::cpu::rope::inverse_frequencies;
use crate::error::{KilnError, Result};
use crate::models::Model;
use crate::models::export::hf_tensors;
use crate::models::import::pretrained::{ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT, ROPE_FREQS};
use crate::models::llama::LlamaConfig;
use std::path::Path;

/// How the matrices are stored (the converter's `--outtype`); vectors are always F32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GgufType {
    F32,
    F16,
    Bf16,
    /// 8-bit blocks of 32 values with one f16 scale each (llama.cpp's Q8_0).
    #[value(name = "q8_0")]
    Q8_0,
    /// 4-bit blocks of 32 values with one f16 scale each (llama.cpp's Q4_0); the embedding and
    /// the head stay in Q8_0.
    #[value(name = "q4_0")]
    Q4_0,
    /// 4-bit super-blocks of 256 values in 8 sub-blocks with 6-bit scales and minimums
    /// (llama.cpp's Q4_K); the embedding and the head stay in Q8_0, and matrices whose rows
    /// are not whole super-blocks take Q8_0 too.
    #[value(name = "q4_k")]
    Q4K,
}

impl GgufType {
    /// ggml's tensor type id.
    fn ggml(self) -> u32 {
        match self {
            GgufType::F32 => 0,
            GgufType::F16 => 1,
            GgufType::Q8_0 => 8,
            GgufType::Q4_0 => 2,
            GgufType::Q4K => 12,
            GgufType::Bf16 => 30,
        }
    }

    /// Values a block holds (1 for the plain types).
    fn block(self) -> usize {
        match self {
            GgufType::Q8_0 | GgufType::Q4_0 => 32,
            GgufType::Q4K => 256,
            _ => 1,
        }
    }

    /// `general.file_type` (llama.cpp's LLAMA_FTYPE of the file's main type).
    fn file_type(self) -> u32 {
        match self {
            GgufType::F32 => 0,
            GgufType::F16 => 1,
            GgufType::Q8_0 => 7,
            GgufType::Q4_0 => 2,
            GgufType::Q4K => 14,
            GgufType::Bf16 => 32,
        }
    }

    fn encode(self, data: &[f32]) -> Vec<u8> {
        match self {
            GgufType::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
            GgufType::F16 => data
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            GgufType::Bf16 => data
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            GgufType::Q8_0 => q8_0(data),
            GgufType::Q4_0 => q4_0(data),
            GgufType::Q4K => q4_k(data),
        }
    }
}

/// Q4_0 blocks: the value of largest magnitude `m` sets `d = m / -8` (f16), and each value is
/// stored as `round(x / d) + 8` in 4 bits: value `i` in byte `i`'s low nibble, value `i + 16`
/// in its high nibble.
fn q4_0(data: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() / 32 * 18);
    for block in data.chunks(32) {
        let m = block
            .iter()
            .copied()
            .fold(0.0f32, |m, v| if v.abs() > m.abs() { v } else { m });
        let d = half::f16::from_f32(m / -8.0);
        let df = d.to_f32();
        let inv = if df != 0.0 { 1.0 / df } else { 0.0 };
        let q = |v: f32| ((v * inv).round() + 8.0).clamp(0.0, 15.0) as u8;
        out.extend(d.to_le_bytes());
        out.extend((0..16).map(|i| q(block[i]) | (q(block[i + 16]) << 4)));
    }
    out
}

/// Q4_K super-blocks of 256: each sub-block of 32 gets a scale `(max - min) / 15` and a
/// minimum `-min(min, 0)`; those are stored as 6-bit multiples of the super-block's f16 `d`
/// and `dmin`, and each value as `round((x + dmin * m) / (d * s))` in 4 bits. The packing is
/// the one `data::gguf` reads (scales of sub-blocks 4-7 split across the 12 scale bytes).
fn q4_k(data: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() / 256 * 144);
    for sb in data.chunks(256) {
        let mut scale = [0.0f32; 8];
        let mut min = [0.0f32; 8];
        for (j, sub) in sb.chunks(32).enumerate() {
            let lo = sub.iter().copied().fold(0.0f32, f32::min);
            let hi = sub.iter().copied().fold(f32::MIN, f32::max).max(lo);
            scale[j] = (hi - lo) / 15.0;
            min[j] = -lo;
        }
        let d = half::f16::from_f32(scale.iter().copied().fold(0.0, f32::max) / 63.0);
        let dmin = half::f16::from_f32(min.iter().copied().fold(0.0, f32::max) / 63.0);
        let (df, dminf) = (d.to_f32(), dmin.to_f32());
        let code = |v: f32, unit: f32| {
            if unit > 0.0 {
                (v / unit).round().clamp(0.0, 63.0) as u8
            } else {
                0
            }
        };
        // A scale code rounds up when rounding down would clip the sub-block's top values.
        let sc: Vec<u8> = (0..8)
            .map(|j| {
                let c = code(scale[j], df);
                if c < 63 && f32::from(c) * df * 15.0 < scale[j] * 15.0 - 0.5 * df {
                    c + 1
                } else {
                    c
                }
            })
            .collect();
        let mc: Vec<u8> = (0..8).map(|j| code(min[j], dminf)).collect();
        let mut scales = [0u8; 12];
        for j in 0..8 {
            if j < 4 {
                scales[j] = sc[j];
                scales[j + 4] = mc[j];
            } else {
                scales[j + 4] = (sc[j] & 0x0f) | ((mc[j] & 0x0f) << 4);
                scales[j - 4] |= (sc[j] >> 4) << 6;
                scales[j] |= (mc[j] >> 4) << 6;
            }
        }
        let q = |j: usize, v: f32| {
            let step = df * f32::from(sc[j]);
            if step > 0.0 {
                ((v + dminf * f32::from(mc[j])) / step)
                    .round()
                    .clamp(0.0, 15.0) as u8
            } else {
                0
            }
        };
        out.extend(d.to_le_bytes());
        out.extend(dmin.to_le_bytes());
        out.extend(scales);
        for g in 0..4 {
            let (lo, hi) = (&sb[64 * g..64 * g + 32], &sb[64 * g + 32..64 * g + 64]);
            out.extend((0..32).map(|l| q(2 * g, lo[l]) | (q(2 * g + 1, hi[l]) << 4)));
        }
    }
    out
}

/// Q8_0 blocks: `d = max|x| / 127` as f16, then `round(x / d)` as i8, 32 values a block.
fn q8_0(data: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() / 32 * 34);
    for block in data.chunks(32) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_le_bytes());
        out.extend(
            block
                .iter()
                .map(|v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8),
        );
    }
    out
}

/// llama.cpp's name of a Hugging Face Llama tensor.
pub(crate) fn gguf_name(hf: &str) -> Option<String> {
    let rest = hf.strip_prefix("model.").unwrap_or(hf);
    if let Some(layer) = rest.strip_prefix("layers.") {
        let (l, part) = layer.split_once('.')?;
        let (module, kind) = part.rsplit_once('.')?;
        let to = match module {
            "input_layernorm" => "attn_norm",
            "post_attention_layernorm" => "ffn_norm",
            "self_attn.q_proj" => "attn_q",
            "self_attn.k_proj" => "attn_k",
            "self_attn.v_proj" => "attn_v",
            "self_attn.qkv_proj" => "attn_qkv",
            "self_attn.o_proj" => "attn_output",
            "self_attn.q_norm" => "attn_q_norm",
            "self_attn.k_norm" => "attn_k_norm",
            "mlp.gate_proj" => "ffn_gate",
            "mlp.up_proj" => "ffn_up",
            // Phi-3's gate and up rows in one matrix, gate first, as llama.cpp's phi3 reads it.
            "mlp.gate_up_proj" => "ffn_up",
            "mlp.down_proj" => "ffn_down",
            _ => return None,
        };
        return Some(format!("blk.{l}.{to}.{kind}"));
    }
    Some(
        match rest {
            "embed_tokens.weight" => "token_embd.weight",
            "norm.weight" => "output_norm.weight",
            "lm_head.weight" => "output.weight",
            _ => return None,
        }
        .into(),
    )
}

/// Moves row `i + D/2` of each head next to row `i` (llama's rotation pairs neighbours; the
/// importer's `unpermute_rotary_rows` puts them back).
fn interleave_rotary_rows(data: &[f32], rows: usize, cols: usize, heads: usize) -> Vec<f32> {
    let d = rows / heads;
    let half = d / 2;
    let mut out = vec![0.0; data.len()];
    for h in 0..heads {
        for i in 0..half {
            for (src, dst) in [(i, 2 * i), (i + half, 2 * i + 1)] {
                let (s, t) = ((h * d + src) * cols, (h * d + dst) * cols);
                out[t..t + cols].copy_from_slice(&data[s..s + cols]);
            }
        }
    }
    out
}

/// Writes `model` (settings `m`, `vocab` embedding rows) as a GGUF file at `to`, its
/// matrices in `ty`, with the tokenizer of `tokenizer` (a data.tokenizer value). Returns notes
/// for the user.
pub fn export_gguf(
    model: &dyn Model,
    m: &ModelConfig,
    vocab: usize,
    tokenizer: &str,
    to: &Path,
    ty: GgufType,
) -> Result<Vec<String>> {
    let l = LlamaConfig::from_model(m, vocab).ok_or_else(|| {
        KilnError::Setting(format!(
            "GGUF export writes Llama-family models; model.kind = \"{}\" exports as a Hugging Face directory (give --to a directory)",
            m.kind()
        ))
    })?;
    let settings = m.llama().cloned().unwrap_or_default();
    let longrope = !settings.rope_short_factors.is_empty();
    // Phi-3 layouts and LongRoPE go out as llama.cpp's phi3 architecture, as its converter
    // writes Phi3ForCausalLM: fused projections, rotary halves as they are, and LongRoPE's
    // factors as two tensors beside its trained context and attention factor.
    let phi3 = longrope || settings.checkpoint_arch == "phi3";
    let arch = match (phi3, l.qkv_bias, l.qk_norm) {
        (true, false, false) => "phi3",
        (true, _, _) => {
            return Err(KilnError::Setting(
                "the model has LongRoPE factors or Phi-3's layout together with query/key/value biases or query/key norms, which llama.cpp's phi3 architecture does not have; export it as a Hugging Face directory".into(),
            ));
        }
        (false, false, false) => "llama",
        (false, true, false) => "qwen2",
        (false, false, true) => "qwen3",
        (false, true, true) => {
            return Err(KilnError::Setting(
                "the model has both query/key/value biases and query/key norms, which no GGUF architecture llama.cpp runs has; export it as a Hugging Face directory".into(),
            ));
        }
    };
    let mut layout = m.clone();
    if let crate::config::FamilySettings::Llama(s) = &mut layout.family {
        s.checkpoint_arch = if phi3 { "phi3".into() } else { String::new() };
    }
    let m = &layout;
    let mut notes = Vec::new();
    if l.sliding_window > 0 {
        notes.push(if phi3 {
            format!(
                "the sliding window of {} positions is stored, but llama.cpp runs phi3 GGUF files with full attention (it turns Phi's window off), and kiln imports them so",
                l.sliding_window
            )
        } else {
            format!(
                "the sliding window of {} positions is not stored: llama.cpp runs {arch} GGUF files with full attention",
                l.sliding_window
            )
        });
    }
    let (hf, _) = hf_tensors(model, m, vocab)?;
    let mut tensors = Vec::with_capacity(hf.len() + 1);
    let mut fallbacks = 0;
    for (name, t) in &hf {
        let gname = gguf_name(name).ok_or_else(|| {
            KilnError::Setting(format!("internal: no GGUF name for tensor {name}"))
        })?;
        let cols: usize = t.shape[1..].iter().product();
        let rows = t.shape[0];
        let heads = if gname.ends_with("attn_q.weight") {
            Some(l.n_heads)
        } else if gname.ends_with("attn_k.weight") {
            Some(l.n_kv_heads)
        } else {
            None
        };
        let data = match heads {
            Some(h) if arch == "llama" => interleave_rotary_rows(&t.data, rows, cols, h),
            _ => t.data.clone(),
        };
        // Vectors stay F32, and Q8_0 needs rows of whole 32-value blocks (else F16, as the
        // converter falls back).
        let embedding_or_head = gname == "token_embd.weight" || gname == "output.weight";
        let mut this = match (t.shape.len(), ty) {
            (1, _) => GgufType::F32,
            (_, GgufType::Q4_0 | GgufType::Q4K) if embedding_or_head => GgufType::Q8_0,
            _ => ty,
        };
        if !cols.is_multiple_of(this.block()) {
            this = if cols.is_multiple_of(32) {
                GgufType::Q8_0
            } else {
                GgufType::F16
            };
            fallbacks += 1;
        }
        tensors.push(Tensor {
            name: gname,
            // ggml lists the fastest-varying dimension first.
            dims: t.shape.iter().rev().map(|&n| n as u64).collect(),
            ggml_type: this.ggml(),
            data: this.encode(&data),
        });
    }
    if fallbacks > 0 {
        notes.push(format!(
            "{fallbacks} matrices whose rows are not whole {} blocks of {} values were written in Q8_0 (or F16)",
            crate::data::gguf::GgmlType(ty.ggml()).name(),
            ty.block()
        ));
    }
    if let Some(s) = l.rope_scaling {
        let base = inverse_frequencies(l.rope_theta, l.rot_dim, None);
        let scaled = inverse_frequencies(l.rope_theta, l.rot_dim, Some(s));
        let divisors: Vec<f32> = base.iter().zip(&scaled).map(|(b, s)| b / s).collect();
        tensors.push(Tensor {
            name: ROPE_FREQS.into(),
            dims: vec![divisors.len() as u64],
            ggml_type: 0,
            data: GgufType::F32.encode(&divisors),
        });
    }

    if longrope {
        for (name, factors) in [
            (ROPE_FACTORS_LONG, &settings.rope_long_factors),
            (ROPE_FACTORS_SHORT, &settings.rope_short_factors),
        ] {
            let v: Vec<f32> = factors.iter().map(|&f| f as f32).collect();
            tensors.push(Tensor {
                name: name.into(),
                dims: vec![v.len() as u64],
                ggml_type: 0,
                data: GgufType::F32.encode(&v),
            });
        }
    }

    let key = |k: &str| format!("{arch}.{k}");
    let u = |v: usize| V::U32(v as u32);
    let mut meta: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        ("general.name".into(), V::String(model_name(to))),
        ("general.file_type".into(), V::U32(ty.file_type())),
        (
            key("context_length"),
            u(if longrope {
                settings.stated_positions(l.context)
            } else {
                l.context
            }),
        ),
        (key("embedding_length"), u(l.d_model)),
        (key("block_count"), u(l.n_layers)),
        (key("feed_forward_length"), u(l.ffn_hidden)),
        (key("attention.head_count"), u(l.n_heads)),
        (key("attention.head_count_kv"), u(l.n_kv_heads)),
        (key("attention.key_length"), u(l.head_dim)),
        (key("attention.value_length"), u(l.head_dim)),
        (key("rope.dimension_count"), u(l.rot_dim)),
        (key("rope.freq_base"), V::F32(l.rope_theta)),
        (key("attention.layer_norm_rms_epsilon"), V::F32(l.norm_eps)),
        (key("vocab_size"), u(vocab)),
    ];
    if phi3 {
        // llama.cpp's phi3 reads its window here (0: none), and LongRoPE's trained context
        // beside the longest stated above.
        meta.push((key("attention.sliding_window"), u(l.sliding_window)));
        if longrope {
            let original = settings.rope_original_context;
            meta.push((key("rope.scaling.original_context_length"), u(original)));
            meta.push((
                key("rope.scaling.attn_factor"),
                V::F32(settings.rope_attention_factor as f32),
            ));
        }
    }
    meta.extend(tokenizer_metadata(tokenizer, vocab)?);
    if let Some(note) = keep_clear_of_phi3_vocab_rules(&mut meta) {
        notes.push(note);
    }
    let refs: Vec<(&str, V)> = meta.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    if let Some(dir) = to.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| KilnError::output(dir, e))?;
    }
    std::fs::write(to, gguf_bytes(&refs, &tensors)).map_err(|e| KilnError::output(to, e))?;
    Ok(notes)
}

/// llama.cpp gives a model whose `general.name` contains "phi-3" or "phi3" Phi-3's
/// special-token rules, which look up `</s>`, `<unk>`, `<s>` and `<|endoftext|>` and fail to
/// load the file when the vocabulary lacks one (Phi-4's and GPT-2's do). Where that would
/// happen the name is written with "phi_3" instead; returns the note that says so.
fn keep_clear_of_phi3_vocab_rules(meta: &mut [(String, V)]) -> Option<String> {
    let has_all = meta.iter().any(|(k, v)| {
        k == "tokenizer.ggml.tokens"
            && matches!(v, V::Array(tokens) if ["</s>", "<unk>", "<s>", "<|endoftext|>"]
                .iter()
                .all(|want| tokens.iter().any(|t| matches!(t, V::String(s) if s == want))))
    });
    let (_, name) = meta.iter_mut().find(|(k, _)| k == "general.name")?;
    let V::String(text) = name else { return None };
    let lower = text.to_lowercase();
    if has_all || !(lower.contains("phi-3") || lower.contains("phi3")) {
        return None;
    }
    let safe = lower.replace("phi-3", "phi_3").replace("phi3", "phi_3");
    let note = format!(
        "general.name is \"{safe}\", not \"{text}\": llama.cpp applies Phi-3's special-token rules to models named phi-3 or phi3, and they need </s>, <unk>, <s> and <|endoftext|>, which this vocabulary lacks"
    );
    *text = safe;
    Some(note)
}

/// `general.name`: the file's stem.
fn model_name(to: &Path) -> String {
    to.file_stem()
        .map_or_else(|| "kiln".into(), |s| s.to_string_lossy().into_owned())
}

/// The `tokenizer.*` keys of `tokenizer`: copied from a GGUF file as they are, or built from
/// a byte-level BPE tokenizer.json (tokens by id, merges, token types, special ids, chat
/// template) whose pre-tokenizer is one llama.cpp names. Tokens are padded to `vocab`.
fn tokenizer_metadata(tokenizer: &str, vocab: usize) -> Result<Vec<(String, V)>> {
    let path = Path::new(tokenizer);
    if crate::data::is_tokenizer_path(tokenizer) && path.extension().is_some_and(|e| e == "gguf") {
        let g = GgufFile::open(path)?;
        let n = g
            .get_str_array("tokenizer.ggml.tokens")
            .map_or(0, |t| t.len());
        if n != vocab {
            return Err(KilnError::Setting(format!(
                "the tokenizer of {} has {n} tokens and the model {vocab} embedding rows; llama.cpp needs them equal",
                path.display()
            )));
        }
        return Ok(g
            .metadata()
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect());
    }
    let tok = if crate::data::is_tokenizer_path(tokenizer) {
        crate::data::tokenizer_from_path(path)?
    } else {
        HfTokenizer::from_builtin(tokenizer)?
    };
    // A SentencePiece model (a tokenizer.model, or a directory with one) goes in as
    // SentencePiece pieces and scores, as llama.cpp's converter writes Llama 2's.
    let model_file = if path.is_dir() {
        Some(path.join("tokenizer.model")).filter(|m| m.exists())
    } else {
        Some(path.to_path_buf()).filter(|p| p.extension().is_some_and(|e| e == "model"))
    };
    if let Some(m) = model_file {
        return from_sentencepiece_model(&m, &tok, vocab);
    }
    from_tokenizer_json(&tok, vocab).map_err(|why| {
        KilnError::Setting(format!(
            "the tokenizer {tokenizer} cannot be written into GGUF: {why}; export a Hugging Face directory instead (give --to a directory)"
        ))
    })
}

/// The `tokenizer.*` keys of a SentencePiece `tokenizer.model` (`tokenizer.ggml.model =
/// llama`): pieces, scores and types in id order (rows past them as `tok`'s added tokens, or
/// unused pieces where it has none), the space
/// in front, and the special ids and chat template of `tok`, the tokenizer kiln built from it.
fn from_sentencepiece_model(
    path: &Path,
    tok: &HfTokenizer,
    vocab: usize,
) -> Result<Vec<(String, V)>> {
    let bytes = std::fs::read(path)
        .map_err(|e| KilnError::Setting(format!("cannot read {}: {e}", path.display())))?;
    let m = crate::data::sentencepiece_model::SentencePieceModel::parse(&bytes).map_err(|why| {
        KilnError::Setting(format!(
            "{} is not a SentencePiece model: {why}",
            path.display()
        ))
    })?;
    if m.pieces.len() > vocab {
        return Err(KilnError::Setting(format!(
            "{} has {} pieces and the model {vocab} embedding rows; llama.cpp needs every piece to have a row",
            path.display(),
            m.pieces.len()
        )));
    }
    let mut tokens = Vec::with_capacity(vocab);
    let mut scores = Vec::with_capacity(vocab);
    let mut types = Vec::with_capacity(vocab);
    for id in 0..vocab {
        let (text, score, ty) = m
            .pieces
            .get(id)
            .cloned()
            // Rows no piece uses, as llama.cpp's converter names them (type 5: unused).
            .unwrap_or_else(|| (format!("[PAD{id}]"), -1000.0, 5));
        tokens.push(V::String(text));
        scores.push(V::F32(score));
        types.push(V::I32(ty as i32));
    }
    // Tokens added past the pieces (Phi-3's <|user|>, <|end|> and the rest at 32000 and up)
    // keep their text, as the converter writes them: control tokens (3) where special, else
    // user-defined (4), score -1000.
    for (id, t) in tok.inner().get_added_tokens_decoder() {
        let id = id as usize;
        if id >= m.pieces.len() && id < vocab {
            tokens[id] = V::String(t.content.clone());
            scores[id] = V::F32(-1000.0);
            types[id] = V::I32(if t.special { 3 } else { 4 });
        }
    }
    let mut meta = vec![
        (
            "tokenizer.ggml.model".to_string(),
            V::String("llama".into()),
        ),
        (
            "tokenizer.ggml.pre".to_string(),
            V::String("default".into()),
        ),
        ("tokenizer.ggml.tokens".to_string(), V::Array(tokens)),
        ("tokenizer.ggml.scores".to_string(), V::Array(scores)),
        ("tokenizer.ggml.token_type".to_string(), V::Array(types)),
        (
            "tokenizer.ggml.add_bos_token".to_string(),
            V::Bool(tok.adds_bos()),
        ),
        (
            "tokenizer.ggml.add_eos_token".to_string(),
            V::Bool(tok.adds_eos()),
        ),
        (
            "tokenizer.ggml.add_space_prefix".to_string(),
            V::Bool(m.add_dummy_prefix),
        ),
        (
            "tokenizer.ggml.unknown_token_id".to_string(),
            V::U32(m.unk_id as u32),
        ),
    ];
    meta.extend(special_metadata(tok));
    Ok(meta)
}

/// The special ids and the chat template of `tok`, as llama.cpp's keys.
fn special_metadata(tok: &HfTokenizer) -> Vec<(String, V)> {
    let ids = [
        ("tokenizer.ggml.bos_token_id", tok.bos_id()),
        (
            "tokenizer.ggml.eos_token_id",
            tok.eos_ids().first().copied(),
        ),
        ("tokenizer.ggml.padding_token_id", tok.pad_id()),
    ];
    ids.into_iter()
        .filter_map(|(k, id)| Some((k.to_string(), V::U32(id?))))
        .chain(
            tok.chat_template()
                .map(|t| ("tokenizer.chat_template".to_string(), V::String(t.into()))),
        )
        .collect()
}

fn from_tokenizer_json(
    tok: &HfTokenizer,
    vocab: usize,
) -> std::result::Result<Vec<(String, V)>, String> {
    let json: serde_json::Value = serde_json::from_str(
        &tok.inner()
            .to_string(false)
            .map_err(|e| format!("it does not serialise ({e})"))?,
    )
    .map_err(|e| e.to_string())?;
    let model = &json["model"];
    if model["type"] != "BPE" {
        return Err(format!(
            "its model is {}, and kiln writes byte-level BPE vocabularies only",
            model["type"]
        ));
    }
    // The pre-tokenizer must be one llama.cpp knows by name; compare through the tokenizers
    // library's own serialisation so spelling differences in the file do not matter.
    let canon_pre = |v: &serde_json::Value| {
        serde_json::from_value::<tokenizers::PreTokenizerWrapper>(v.clone())
            .ok()
            .and_then(|p| serde_json::to_value(p).ok())
    };
    let canon_norm = |v: &serde_json::Value| {
        if v.is_null() {
            return Some(serde_json::Value::Null);
        }
        serde_json::from_value::<tokenizers::NormalizerWrapper>(v.clone())
            .ok()
            .and_then(|n| serde_json::to_value(n).ok())
    };
    let (have_pre, have_norm) = (
        canon_pre(&json["pre_tokenizer"]),
        canon_norm(&json["normalizer"]),
    );
    let pre = ["gpt-2", "smollm", "llama-bpe", "qwen2"]
        .into_iter()
        .find(|name| {
            crate::data::hf_tokenizer::gguf_pre_tokenizer(name).is_some_and(|(p, n, _)| {
                canon_pre(&p) == have_pre && canon_norm(&n) == have_norm
            })
        })
        .ok_or("its pre-tokenizer is none of the ones llama.cpp names (gpt-2, smollm, llama-bpe, qwen2)")?;
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab];
    let mut place = |id: u64, text: &str, ty: i32| -> std::result::Result<(), String> {
        let slot = tokens.get_mut(id as usize).ok_or(format!(
            "token id {id} is past the model's {vocab} embedding rows"
        ))?;
        *slot = Some((text.to_string(), ty));
        Ok(())
    };
    for (text, id) in model["vocab"].as_object().ok_or("it has no vocabulary")? {
        place(
            id.as_u64().ok_or("a vocabulary id is not a number")?,
            text,
            1,
        )?;
    }
    for a in json["added_tokens"].as_array().into_iter().flatten() {
        let (id, text) = (a["id"].as_u64(), a["content"].as_str());
        let (Some(id), Some(text)) = (id, text) else {
            return Err("an added token has no id or content".into());
        };
        // 3: control (special); 4: user-defined (matched as written).
        place(id, text, if a["special"] == true { 3 } else { 4 })?;
    }
    let (texts, types): (Vec<V>, Vec<V>) = tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| {
            // Rows no token uses, as llama.cpp's converter names them (type 5: unused).
            let (text, ty) = t.unwrap_or_else(|| (format!("[PAD{id}]"), 5));
            (V::String(text), V::I32(ty))
        })
        .unzip();
    let merges = model["merges"]
        .as_array()
        .ok_or("it has no merges")?
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Ok(V::String(s.clone())),
            serde_json::Value::Array(p) if p.len() == 2 => Ok(V::String(format!(
                "{} {}",
                p[0].as_str().unwrap_or_default(),
                p[1].as_str().unwrap_or_default()
            ))),
            _ => Err("a merge is neither \"a b\" nor [a, b]".to_string()),
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut meta = vec![
        ("tokenizer.ggml.model".to_string(), V::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), V::String(pre.into())),
        ("tokenizer.ggml.tokens".to_string(), V::Array(texts)),
        ("tokenizer.ggml.token_type".to_string(), V::Array(types)),
        ("tokenizer.ggml.merges".to_string(), V::Array(merges)),
        (
            "tokenizer.ggml.add_bos_token".to_string(),
            V::Bool(tok.adds_bos()),
        ),
        (
            "tokenizer.ggml.add_eos_token".to_string(),
            V::Bool(tok.adds_eos()),
        ),
    ];
    meta.extend(special_metadata(tok));
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_blocks_round_to_the_scale() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) * 0.37).collect();
        let b = q8_0(&x);
        assert_eq!(b.len(), 2 * 34);
        for (blk, vals) in b.chunks(34).zip(x.chunks(32)) {
            let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            for (q, v) in blk[2..].iter().zip(vals) {
                let back = *q as i8 as f32 * d;
                assert!(
                    (back - v).abs() <= 0.5 * d + 1e-3 * v.abs(),
                    "{back} vs {v}"
                );
            }
        }
    }

    /// A small Llama on GPT-2's vocabulary with `extra` settings, randomly initialised.
    fn gpt2_llama(extra: &[&str]) -> (crate::config::Config, usize, Box<dyn Model>) {
        use crate::config::ResolvedConfig;
        use crate::engine::{Device, MemoryPool};
        let o: Vec<String> = [
            "model.kind=llama",
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.context=64",
            "model.ffn_hidden=64",
            "train.seq_len=64",
            "data.tokenizer=gpt2",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
        let cfg = ResolvedConfig::resolve(None, &o).unwrap().config;
        let vocab = crate::train::model_vocab(&cfg).unwrap();
        let model =
            crate::models::build(&cfg.model, vocab, &MemoryPool::new(Device::Cpu), 11).unwrap();
        (cfg, vocab, model)
    }

    /// A Llama (with Llama 3's scaling), a Qwen2-style model (biases) and a Qwen3-style one
    /// (query/key norms), written as GGUF and read back by the importer, give the same logits;
    /// the file names its architecture and stores the scaling as divisors.
    #[test]
    fn exported_gguf_files_import_to_the_same_logits() {
        let cases: [(&[&str], &str); 3] = [
            (
                &["model.rope_scaling_factor=8", "model.n_kv_heads=2"],
                "llama",
            ),
            (&["model.qkv_bias=true"], "qwen2"),
            (&["model.qk_norm=true", "model.head_dim=16"], "qwen3"),
        ];
        let dir = tempfile::tempdir().unwrap();
        for (extra, arch) in cases {
            let (cfg, vocab, model) = gpt2_llama(extra);
            let path = dir.path().join(format!("{arch}.gguf"));
            export_gguf(
                model.as_ref(),
                &cfg.model,
                vocab,
                "gpt2",
                &path,
                GgufType::F32,
            )
            .unwrap();
            let g = GgufFile::open(&path).unwrap();
            assert_eq!(g.get_str("general.architecture"), Some(arch));
            assert_eq!(g.get_str("tokenizer.ggml.pre"), Some("gpt-2"));
            assert_eq!(g.tensor_names().any(|n| n == ROPE_FREQS), arch == "llama");
            let p = crate::models::import::pretrained::open(&path).unwrap();
            let l = p.model.llama().unwrap();
            assert_eq!(
                l.rope_scaling_factor,
                if arch == "llama" { 8.0 } else { 0.0 }
            );
            let back = p.build_on_cpu().unwrap();
            let ids = [464u32, 3290, 318, 257, 1332, 13, 50256, 11];
            let (want, got) = (
                model.next_logits(&ids).unwrap(),
                back.next_logits(&ids).unwrap(),
            );
            assert_eq!(want.len(), got.len());
            for (a, b) in want.iter().zip(&got) {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + a.abs()),
                    "{arch}: {a} vs {b}"
                );
            }
            // The same text gives the same ids through the file's own tokenizer.
            let text = "Hello world, it's 2026!";
            assert_eq!(
                p.tokenizer.encode(text),
                HfTokenizer::from_builtin("gpt2").unwrap().encode(text)
            );
        }
    }

    /// A file named like a Phi-3 whose vocabulary lacks Phi-3's special tokens gets a name
    /// llama.cpp does not take for Phi-3's (whose token rules would refuse the vocabulary),
    /// with a note; one whose name says nothing of Phi-3 keeps it.
    #[test]
    fn phi3_names_stay_clear_of_llama_cpp_vocab_rules() {
        let (cfg, vocab, model) = gpt2_llama(&[]);
        let dir = tempfile::tempdir().unwrap();
        for (file, name, noted) in [
            ("My-Phi3-ft.gguf", "my-phi_3-ft", true),
            ("phi-3-mini.gguf", "phi_3-mini", true),
            ("smol-ft.gguf", "smol-ft", false),
        ] {
            let path = dir.path().join(file);
            let notes = export_gguf(
                model.as_ref(),
                &cfg.model,
                vocab,
                "gpt2",
                &path,
                GgufType::F32,
            )
            .unwrap();
            let g = GgufFile::open(&path).unwrap();
            assert_eq!(g.get_str("general.name"), Some(name));
            assert_eq!(
                notes
                    .iter()
                    .any(|n| n.contains("Phi-3's special-token rules")),
                noted
            );
        }
    }

    /// Each block type written here reads back through the GGUF reader within its rounding:
    /// Q8_0 and Q4_0 within half a step of their block's scale, Q4_K within a few percent of
    /// the values' spread.
    #[test]
    fn quantised_blocks_read_back_through_the_reader() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut normal = || {
            // Box-Muller over a xorshift stream: weights look Gaussian.
            let mut u = || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ((seed >> 11) as f64 / (1u64 << 53) as f64).max(1e-12)
            };
            let (a, b) = (u(), u());
            ((-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()) as f32 * 0.02
        };
        let (rows, cols) = (8usize, 512usize);
        let x: Vec<f32> = (0..rows * cols).map(|_| normal()).collect();
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
        for ty in [
            GgufType::F16,
            GgufType::Bf16,
            GgufType::Q8_0,
            GgufType::Q4_0,
            GgufType::Q4K,
        ] {
            let t = Tensor {
                name: "w".into(),
                dims: vec![cols as u64, rows as u64],
                ggml_type: ty.ggml(),
                data: ty.encode(&x),
            };
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("w.gguf");
            std::fs::write(&path, gguf_bytes(&[], &[t])).unwrap();
            let (shape, back) = GgufFile::open(&path).unwrap().tensor_f32("w").unwrap();
            assert_eq!(shape, [rows, cols]);
            let err = (x
                .iter()
                .zip(&back)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>()
                / x.len() as f32)
                .sqrt()
                / rms;
            // Relative RMS error: 4-bit codes over a Gaussian block land near 0.1.
            let bound = match ty {
                GgufType::Q4_0 | GgufType::Q4K => 0.15,
                GgufType::Q8_0 => 0.01,
                _ => 0.005,
            };
            assert!(err < bound, "{ty:?}: relative RMS error {err}");
        }
    }

    /// A Llama with a SentencePiece vocabulary (Llama 2's kind; the fixture SentencePiece
    /// trained) goes through GGUF and back: its tokenizer keys are copied, and the model
    /// reads back with the same logits and the same ids.
    #[test]
    fn a_sentencepiece_llama_goes_through_gguf_and_back() {
        let (fixture, md) = crate::data::hf_tokenizer::spm_fixture_gguf_metadata();
        let dir = tempfile::tempdir().unwrap();
        let vocab_file = dir.path().join("spm.gguf");
        std::fs::write(&vocab_file, gguf_bytes(&md, &[])).unwrap();
        sentencepiece_llama_round_trip(&vocab_file, fixture["pieces"].as_array().unwrap().len());
    }

    /// The same vocabulary as a Hugging Face directory's `tokenizer.model`: written as
    /// SentencePiece pieces and scores (`tokenizer.ggml.model = llama`), read back the same.
    #[test]
    fn a_tokenizer_model_llama_goes_through_gguf_and_back() {
        let dir = tempfile::tempdir().unwrap();
        let hf = spm_model_dir(dir.path());
        let path = sentencepiece_llama_round_trip(&hf, 1200);
        let g = GgufFile::open(&path).unwrap();
        assert_eq!(g.get_str("tokenizer.ggml.model"), Some("llama"));
        assert_eq!(
            g.get_f32_array("tokenizer.ggml.scores").unwrap().len(),
            1200
        );
    }

    /// Tokens a directory's configuration adds past the SentencePiece pieces (as Phi-3's
    /// <|user|> and <|end|> follow its 32000 pieces) go into the file with their text, as
    /// control tokens, and read back as single ids.
    #[test]
    fn tokens_added_past_the_pieces_keep_their_text() {
        let dir = tempfile::tempdir().unwrap();
        let hf = spm_model_dir(dir.path());
        let config = serde_json::json!({
            "added_tokens_decoder": {
                "1200": {"content": "<|user|>", "special": true},
                "1201": {"content": "<|end|>", "special": true},
            }
        });
        std::fs::write(hf.join("tokenizer_config.json"), config.to_string()).unwrap();
        let path = sentencepiece_llama_round_trip(&hf, 1202);
        let g = GgufFile::open(&path).unwrap();
        let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
        assert_eq!((tokens[1200], tokens[1201]), ("<|user|>", "<|end|>"));
        let p = crate::models::import::pretrained::open(&path).unwrap();
        let ids = p.tokenizer.encode("<|user|>ROMEO<|end|>");
        assert_eq!((ids[0], *ids.last().unwrap()), (1200, 1201), "{ids:?}");
    }

    /// A Hugging Face directory `hf` under `root` holding only the SentencePiece fixture's
    /// `tokenizer.model`.
    fn spm_model_dir(root: &Path) -> std::path::PathBuf {
        let hf = root.join("hf");
        std::fs::create_dir(&hf).unwrap();
        std::fs::write(
            hf.join("tokenizer.model"),
            include_bytes!("../../tests/data/spm_bpe.model"),
        )
        .unwrap();
        hf
    }

    /// A Llama over the tokenizer at `vocab_file` (`n` pieces) through GGUF and back: the
    /// file's tokenizer gives the source's ids and asks for BOS; the logits move by f16's
    /// rounding only. Returns the GGUF file's path.
    fn sentencepiece_llama_round_trip(vocab_file: &Path, n: usize) -> std::path::PathBuf {
        use crate::config::ResolvedConfig;
        use crate::engine::{Device, MemoryPool};
        let dir = vocab_file.parent().unwrap();
        let tok = vocab_file.display().to_string();
        let o: Vec<String> = [
            "model.kind=llama",
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.context=64",
            "model.ffn_hidden=64",
            "train.seq_len=64",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("data.tokenizer={tok}")])
        .collect();
        let cfg = ResolvedConfig::resolve(None, &o).unwrap().config;
        let vocab = crate::train::model_vocab(&cfg).unwrap();
        assert_eq!(vocab, n);
        let model =
            crate::models::build(&cfg.model, vocab, &MemoryPool::new(Device::Cpu), 5).unwrap();
        let path = dir.join("llama2-like.gguf");
        export_gguf(
            model.as_ref(),
            &cfg.model,
            vocab,
            &tok,
            &path,
            GgufType::F16,
        )
        .unwrap();
        let p = crate::models::import::pretrained::open(&path).unwrap();
        let text = "ROMEO: Wherefore art thou, 12 times?";
        let ids = p.tokenizer.encode(text);
        assert_eq!(
            ids,
            crate::data::tokenizer_from_path(vocab_file)
                .unwrap()
                .encode(text)
        );
        assert!(p.tokenizer.adds_bos());
        let back = p.build_on_cpu().unwrap();
        let (want, got) = (
            model.next_logits(&ids).unwrap(),
            back.next_logits(&ids).unwrap(),
        );
        // F16 weights: the logits move by the rounding, not more.
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (a, b) in want.iter().zip(&got) {
            assert!((a - b).abs() <= 2e-2 * scale, "{a} vs {b}");
        }
        path
    }

    #[test]
    fn llama_names_map_to_llama_cpp_names() {
        assert_eq!(
            gguf_name("model.layers.3.self_attn.k_proj.weight").as_deref(),
            Some("blk.3.attn_k.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.self_attn.q_proj.bias").as_deref(),
            Some("blk.0.attn_q.bias")
        );
        assert_eq!(
            gguf_name("lm_head.weight").as_deref(),
            Some("output.weight")
        );
        assert_eq!(gguf_name("model.layers.0.mlp.other.weight"), None);
    }
}
