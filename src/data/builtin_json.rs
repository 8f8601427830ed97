//! The built-in tokenizers (`byte`, `gpt2`) written as the `tokenizer.json` that describes
//! them, so a model trained on one exports with a tokenizer transformers and kiln load.
//!
//! Both are byte-level BPE in the Hugging Face description: every byte is a vocabulary entry,
//! spelled through GPT-2's byte-to-character table. `byte` has no merges, so each byte is its
//! own token with its value as id. `gpt2` is tiktoken's `r50k_base`, which keeps only each
//! token's rank; the merges a BPE file lists are recovered from it: a token's merge is the
//! last step of running BPE on its bytes with the tokens ranked below it, and the merges are
//! listed in the order of the tokens they make, which is tiktoken's priority.

use serde_json::{Value as Json, json};
use std::collections::HashMap;

/// GPT-2's table from bytes to printable characters (the ones that are printable and not
/// whitespace map to themselves, the rest to characters from U+0100 on).
pub fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or('\u{FFFD}')
        };
    }
    table
}

fn spelled(bytes: &[u8], table: &[char; 256]) -> String {
    bytes.iter().map(|&b| table[b as usize]).collect()
}

/// The two tokens whose merge makes `token` (at `rank`): BPE on its bytes, merging the
/// lowest-ranked adjacent pair whose result ranks below `rank`, until two parts are left.
fn last_merge(
    token: &[u8],
    rank: u32,
    ranks: &HashMap<Vec<u8>, u32>,
) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut parts: Vec<Vec<u8>> = token.iter().map(|&b| vec![b]).collect();
    while parts.len() > 2 {
        let best = (0..parts.len() - 1)
            .filter_map(|i| {
                let joined = [parts[i].as_slice(), parts[i + 1].as_slice()].concat();
                ranks.get(&joined).filter(|&&r| r < rank).map(|&r| (r, i))
            })
            .min()?;
        let right = parts.remove(best.1 + 1);
        parts[best.1].extend(right);
    }
    (parts.len() == 2).then(|| (parts[0].clone(), parts[1].clone()))
}

/// The ByteLevel pieces every byte-level BPE file names, GPT-2's regex included.
fn byte_level() -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true})
}

fn bpe_json(vocab: serde_json::Map<String, Json>, merges: Vec<Json>, added: Vec<Json>) -> Json {
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level(),
        "post_processor": byte_level(),
        "decoder": byte_level(),
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    })
}

/// `byte`: 256 tokens, id = byte value, no merges.
pub fn byte_tokenizer_json() -> Json {
    let table = byte_chars();
    let vocab = (0..=255u8)
        .map(|b| (table[b as usize].to_string(), json!(b)))
        .collect();
    bpe_json(vocab, Vec::new(), Vec::new())
}

/// `gpt2`: the 50,256 BPE tokens of `bpe` (tiktoken's `r50k_base`, whose ranks are the ids)
/// with their merges, and `<|endoftext|>` (50256) as a special token.
pub fn gpt2_tokenizer_json(bpe: &tiktoken_rs::CoreBPE) -> Result<Json, String> {
    const END_OF_TEXT: u32 = 50_256;
    let table = byte_chars();
    let tokens: Vec<Vec<u8>> = (0..END_OF_TEXT)
        .map(|id| {
            bpe.decode_bytes(&[id])
                .map_err(|e| format!("token {id} has no bytes in r50k_base: {e:?}"))
        })
        .collect::<Result<_, _>>()?;
    let ranks: HashMap<Vec<u8>, u32> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect();
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut merges = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        vocab.insert(spelled(token, &table), json!(id));
        if token.len() >= 2 {
            let (a, b) = last_merge(token, id as u32, &ranks)
                .ok_or_else(|| format!("token {id} is not the merge of two lower-ranked tokens"))?;
            merges.push(json!([spelled(&a, &table), spelled(&b, &table)]));
        }
    }
    let added = vec![json!({
        "id": END_OF_TEXT, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": true, "special": true,
    })];
    Ok(bpe_json(vocab, merges, added))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection_onto_gpt2_characters() {
        let t = byte_chars();
        let mut seen: Vec<char> = t.to_vec();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        assert_eq!(
            (t[b'A' as usize], t[b' ' as usize], t[b'\n' as usize]),
            ('A', 'Ġ', 'Ċ')
        );
    }

    /// Text that exercises the pre-tokenizer: contractions, digits, punctuation runs, runs
    /// of spaces and line breaks, accents, CJK and emoji.
    fn varied() -> String {
        let mut text = crate::data::Corpus::load(None).unwrap().text;
        text.truncate(200_000);
        text.push_str(
            "\n\nI'm sure they'll've done it   twice.\t\tNumbers: 12345 3.14159 -7e10!!!\n\
             \u{a0}café naïve Ærø 東京タワー 👩‍👩‍👧 \u{0}\u{7f} trailing   \n \n",
        );
        text
    }

    /// The written tokenizer.json, loaded by the tokenizers library, gives the built-in
    /// tokenizers' ids on varied text (200 kB of the corpus and more) and decodes them back.
    #[test]
    fn written_tokenizers_encode_as_the_built_in_ones() {
        use crate::data::{HfTokenizer, tokenizer_by_name};
        let text = varied();
        for name in ["byte", "gpt2"] {
            let built_in = tokenizer_by_name(name).unwrap();
            let written = HfTokenizer::from_builtin(name).unwrap();
            assert_eq!(written.vocab_size(), built_in.vocab_size(), "{name}");
            let want = built_in.encode(&text);
            let got = written.encode(&text);
            assert_eq!(got.len(), want.len(), "{name}: token counts");
            if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
                panic!(
                    "{name}: first difference at token {i}: {} vs {}",
                    got[i], want[i]
                );
            }
            assert_eq!(
                written.decode(&got),
                built_in.decode(&want),
                "{name}: decode"
            );
        }
        // As in transformers' GPT-2 tokenizer, the written file reads a literal end-of-text
        // marker as the special token; kiln's built-in one spells it out as ordinary text.
        let gpt2 = HfTokenizer::from_builtin("gpt2").unwrap();
        assert_eq!(gpt2.eos_ids(), vec![50_256]);
        assert_eq!(gpt2.encode("a<|endoftext|>"), vec![64, 50_256]);
    }
}
