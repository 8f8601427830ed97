//! Stop strings: whether a sequence's newest token may have completed one, at a cost that does
//! not grow with the text.
//!
//! Deciding where a stop string ends a reply needs the whole generated text (the text that is
//! kept is cut there), and decoding it every step costs time in its length: with SmolLM2's
//! tokenizer.json on one CPU core about 55 us at 512 tokens and 250 us at 2048, for each
//! sequence, every step, far more than a GPU's decode step at a large batch (the window below:
//! about 3 us at any length). So each step first decodes only the last
//! tokens, enough for at least the longest stop string and [`SLACK`] bytes more: a decoder
//! changes the text of tokens taken from the middle of a sequence only at its start (a
//! character split between tokens becomes U+FFFD, a leading space is stripped), so the last
//! bytes of that window are the last bytes of the whole text, and a stop string the newest
//! token completed lies within them. Only when the window holds a stop string does the caller
//! decode the whole text and decide.

/// Bytes of window text beyond the longest stop string: room for the distorted start.
pub const SLACK: usize = 16;

/// Whether the text of the last tokens of `generated` holds any of `stops` (`longest`: the
/// longest in bytes). False means that none ends in the newest token's text; true that the
/// whole text should be checked.
pub fn tail_may_stop(
    tok: &dyn crate::data::Tokenizer,
    generated: &[u32],
    stops: &[String],
    longest: usize,
) -> bool {
    let want = longest + SLACK;
    // Most tokens add at least a byte; where some add none, the window doubles until its text
    // is long enough or it is the whole sequence.
    let mut n = want.min(generated.len());
    loop {
        let text = tok.decode(&generated[generated.len() - n..]);
        if text.len() >= want || n == generated.len() {
            return stops.iter().any(|s| text.contains(s.as_str()));
        }
        n = (2 * n).min(generated.len());
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::data::{ByteTokenizer, HfTokenizer, Tokenizer, tokenizer_by_name};
    use crate::engine::rng::Rng;

    /// Text with multi-byte characters, punctuation after spaces and repeated words, so that
    /// stop strings span token boundaries and split characters.
    pub const TEXT: &str = "Where the bee sucks, there suck I: in a cowslip’s bell I lie — \
        thère I couch when owls do cry. On the bat’s back I do fly after summer merrily. \
        Merrily, merrily shall I live now under the blossom that hangs on the bough! \
        Ĉu vi parolas? 日本語のテキスト , and 🐝 bees 🐝 , more bees , « quoted » text .";

    /// Every step of `ids` (as a sequence growing by one token): wherever the whole text
    /// gains an occurrence of a stop string (so the newest token completed it), the window
    /// holds one too. The stop strings are pieces of the text at random places and lengths.
    pub fn window_finds_every_new_stop(tok: &dyn Tokenizer, ids: &[u32], seed: u64) {
        let full = tok.decode(ids);
        let chars: Vec<(usize, char)> = full.char_indices().collect();
        let mut rng = Rng::new(seed, 0);
        let mut stops: Vec<String> = (0..40)
            .map(|_| {
                let a = rng.below(chars.len() as u64) as usize;
                let len = 1 + rng.below(12) as usize;
                let b = (a + len).min(chars.len());
                let end = chars.get(b).map_or(full.len(), |c| c.0);
                full[chars[a].0..end].to_string()
            })
            .filter(|s| !s.trim().is_empty() && !s.contains('\u{fffd}'))
            .collect();
        stops.extend([" ,", "ère", "🐝", "bees"].map(String::from));
        let mut checked = 0;
        for stop in &stops {
            let longest = stop.len();
            let mut before = 0;
            for n in 1..=ids.len() {
                let count = tok.decode(&ids[..n]).matches(stop.as_str()).count();
                if count > before {
                    checked += 1;
                    assert!(
                        tail_may_stop(tok, &ids[..n], std::slice::from_ref(stop), longest),
                        "{}: {stop:?} appears at token {n} but not in the window",
                        tok.name()
                    );
                }
                before = count;
            }
        }
        assert!(checked > 20, "{}: only {checked} occurrences", tok.name());
    }

    #[test]
    fn the_window_finds_every_stop_the_newest_token_completes() {
        let gpt2 = tokenizer_by_name("gpt2").unwrap();
        let hf_gpt2 = HfTokenizer::from_builtin("gpt2").unwrap();
        let tokenizers: [&dyn Tokenizer; 3] = [&ByteTokenizer, gpt2.as_ref(), &hf_gpt2];
        for (i, tok) in tokenizers.into_iter().enumerate() {
            window_finds_every_new_stop(tok, &tok.encode(TEXT), i as u64);
        }
    }

    /// Id 0 decodes to nothing, any other id to one letter.
    struct Sparse;
    impl Tokenizer for Sparse {
        fn name(&self) -> &str {
            "sparse"
        }
        fn vocab_size(&self) -> usize {
            27
        }
        fn encode(&self, _: &str) -> Vec<u32> {
            Vec::new()
        }
        fn decode(&self, ids: &[u32]) -> String {
            ids.iter()
                .filter(|&&i| i > 0)
                .map(|&i| (b'a' + (i - 1) as u8) as char)
                .collect()
        }
    }

    #[test]
    fn the_window_grows_past_tokens_without_text() {
        // "xyz" then 100 tokens without text: the first window (1 + SLACK tokens) holds no
        // text at all, so it must grow to reach the stop string.
        let mut ids = vec![24, 25, 26];
        ids.extend(std::iter::repeat_n(0, 100));
        assert!(tail_may_stop(&Sparse, &ids, &["xyz".to_string()], 3));
        assert!(!tail_may_stop(&Sparse, &ids, &["q".to_string()], 1));
    }
}
