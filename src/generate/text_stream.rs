//! Text of tokens that arrive one at a time, as a terminal prints it while a reply streams.
//!
//! Decoding each token alone is wrong for two kinds of tokenizer: SentencePiece decoders drop
//! the leading space of a sequence's first token (so every piece would lose its space), and
//! byte-level or byte-fallback vocabularies split one character over several tokens. Each new
//! piece is therefore the decoding of a short window (a few tokens already printed, as
//! context, then the new ones) minus the decoding of the context alone, and is printed only
//! once it ends in a whole character: the way transformers' and vLLM's streamers do it.

use crate::data::Tokenizer;

/// Tokens of context kept before the unprinted ones (the prompt's last ones at the start).
const CONTEXT: usize = 4;

/// A streamed reply's decoding state: `tokens[..read]` is the context, already printed, and
/// `tokens[read..]` the tokens not yet printed.
pub struct TextStream {
    tokens: Vec<u32>,
    read: usize,
}

impl TextStream {
    /// A stream whose first tokens follow `prompt` (its text is printed by the caller).
    pub fn new(tok: &dyn Tokenizer, prompt: &[u32]) -> TextStream {
        let mut s = TextStream {
            tokens: prompt.to_vec(),
            read: prompt.len(),
        };
        s.keep_context(tok);
        s
    }

    /// Drops printed tokens but the last few, starting the context where its text starts
    /// with a whole character: a byte-fallback decoder turns a run of byte tokens that begins
    /// inside a character into U+FFFD throughout, later whole characters too.
    fn keep_context(&mut self, tok: &dyn Tokenizer) {
        let n = self.tokens.len();
        if let Some(j) = (n.saturating_sub(CONTEXT)..n)
            .find(|&j| !tok.decode(&self.tokens[j..]).starts_with('\u{FFFD}'))
        {
            self.tokens.drain(..j);
        }
        self.read = self.tokens.len();
    }

    /// Adds `token`; returns the text it completes, if any.
    pub fn push(&mut self, tok: &dyn Tokenizer, token: u32) -> Option<String> {
        self.tokens.push(token);
        let piece = self.pending(tok);
        if piece.is_empty() || piece.ends_with('\u{FFFD}') {
            return None;
        }
        // Everything is printed now; the last few tokens stay as the next piece's context.
        self.keep_context(tok);
        Some(piece)
    }

    /// The text of the tokens not yet printed, whole characters or not (at the end).
    pub fn finish(&self, tok: &dyn Tokenizer) -> String {
        self.pending(tok)
    }

    /// The window's text past its context's.
    fn pending(&self, tok: &dyn Tokenizer) -> String {
        let before = tok.decode(&self.tokens[..self.read]);
        let now = tok.decode(&self.tokens);
        // The context's text is a prefix of the window's for every decoder kiln has; where it
        // is not, print from where the two part.
        let common = before
            .char_indices()
            .zip(now.chars())
            .find(|((_, a), b)| a != b)
            .map_or(before.len().min(now.len()), |((i, _), _)| i);
        now[common..].to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::tokenizer_by_name;
    use crate::generate::stops::tests::TEXT;

    /// Streams `ids[k..]` after the prompt `ids[..k]` and checks that the prompt's text and the
    /// printed pieces make the whole text, for every split that leaves the prompt's text whole.
    fn streams_the_whole_text(tok: &dyn Tokenizer) {
        let ids = tok.encode(TEXT);
        let whole = tok.decode(&ids);
        let mut checked = 0;
        for k in 1..ids.len() {
            let prompt = tok.decode(&ids[..k]);
            if prompt.ends_with('\u{FFFD}') {
                continue;
            }
            let mut s = TextStream::new(tok, &ids[..k]);
            let mut out = prompt;
            for &t in &ids[k..] {
                if let Some(p) = s.push(tok, t) {
                    assert!(
                        !p.contains('\u{FFFD}'),
                        "a split character was printed: {p:?}"
                    );
                    out.push_str(&p);
                }
            }
            out.push_str(&s.finish(tok));
            assert_eq!(out, whole, "prompt of {k} tokens");
            checked += 1;
        }
        assert!(checked > ids.len() / 2);
    }

    #[test]
    fn byte_level_bpe_streams_whole_characters() {
        streams_the_whole_text(tokenizer_by_name("gpt2").unwrap().as_ref());
    }

    /// SentencePiece (the GGUF fixture, Llama 2's kind): the spaces between pieces survive,
    /// which decoding each token alone loses.
    #[test]
    fn sentencepiece_streams_keep_their_spaces() {
        let tok = crate::data::hf_tokenizer::spm_fixture_tokenizer();
        let ids = tok.encode("ROMEO: Wherefore art thou");
        assert_eq!(
            tok.decode(&ids[ids.len() - 1..]),
            "thou",
            "the decoder drops the space"
        );
        streams_the_whole_text(&tok);
    }
}
