//! Datasets made from the bundled corpus, for testing classifiers and fine-tuning without a
//! download.
//!
//! `play-pairs`: pairs (speech, play title) labelled 1 when the speech comes from that play
//! and 0 when the title is another play's, each speech once with each label (so the labels
//! are balanced), grouped by the scene the speech comes from. Both records of a speech share
//! its group, and so do the other speeches of the scene: a split that ignores groups puts
//! the same speech on both sides of a fold.
//!
//! `cue-reply`: prompt/completion pairs for fine-tuning, a cue (the end of one character's
//! speech) and the reply that follows it in the scene, spoken by another character, grouped
//! by scene in play and scene order (so the tail a validation split takes is whole scenes,
//! and a split by `group` holds scenes out).

use crate::data::Corpus;
use crate::error::Result;
use std::collections::BTreeMap;

/// One speech of a play.
#[derive(Debug, Clone, PartialEq)]
pub struct Speech {
    pub play: String,
    /// The name as the speaker line gives it, without its full stop ("HAMLET", "Ber").
    pub speaker: String,
    /// `"PLAY / scene N"`, N counting the play's scenes from 1.
    pub scene: String,
    pub text: String,
}

/// Whether `line` is a scene heading ("SCENE 2.", "Scene IV. A room.", "ACT IV. SCENE I.").
fn is_scene_heading(line: &str) -> bool {
    let l = line.trim().to_ascii_uppercase();
    let rest = match l.find("SCENE ") {
        Some(0) => &l[6..],
        Some(i) if l.starts_with("ACT ") => &l[i + 6..],
        _ => return false,
    };
    let numeral: String = rest
        .chars()
        .take_while(|c| !matches!(c, '.' | ' '))
        .collect();
    !numeral.is_empty()
        && numeral.chars().all(|c| "IVXLC0123456789".contains(c))
        && rest[numeral.len()..].starts_with('.')
}

/// Whether `line` names a speaker ("HELENA.", "Ber.", "FIRST LORD."): short, ends in a full
/// stop, starts with a capital, letters and a few marks only.
fn is_speaker(line: &str) -> bool {
    let l = line.trim();
    let Some(name) = l.strip_suffix('.') else {
        return false;
    };
    !name.is_empty()
        && name.len() <= 40
        && name.split_whitespace().count() <= 4
        && name.chars().next().is_some_and(|c| c.is_ascii_uppercase())
        && name
            .chars()
            .all(|c| c.is_ascii_alphabetic() || " '&-".contains(c))
}

/// A title in title case ("THE TRAGEDY OF KING LEAR" -> "The Tragedy Of King Lear").
fn title_case(s: &str) -> String {
    s.split_whitespace()
        .map(|w| {
            let lower = w.to_lowercase();
            let mut c = lower.chars();
            c.next()
                .map(|f| f.to_uppercase().chain(c).collect::<String>())
                .unwrap_or_default()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Every speech of every play in `text` (works without scenes, the poems, give none).
pub fn speeches(text: &str) -> Vec<Speech> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let (mut play, mut scene) = (String::new(), 0usize);
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if line.trim() == "by William Shakespeare" {
            if let Some(t) = lines[..i].iter().rev().find(|l| !l.trim().is_empty()) {
                play = title_case(t.trim());
            }
            scene = 0;
        } else if is_scene_heading(line) {
            scene += 1;
        } else if scene > 0
            && is_speaker(line)
            && (i == 0 || lines[i - 1].trim().is_empty())
            && lines.get(i + 1).is_some_and(|n| !n.trim().is_empty())
        {
            let mut words = Vec::new();
            let mut j = i + 1;
            while j < lines.len() && !lines[j].trim().is_empty() {
                if !lines[j].trim_start().starts_with('[') {
                    words.extend(lines[j].split_whitespace());
                }
                j += 1;
            }
            if !words.is_empty() {
                out.push(Speech {
                    play: play.clone(),
                    speaker: line.trim().trim_end_matches('.').to_string(),
                    scene: format!("{play} / scene {scene}"),
                    text: words.join(" "),
                });
            }
            i = j;
            continue;
        }
        i += 1;
    }
    out
}

/// Settings of `play-pairs`.
#[derive(Debug, Clone)]
pub struct PlayPairs {
    /// How many plays (chosen at random with `seed`); 0 takes every play.
    pub plays: usize,
    /// Speeches taken from each scene at most.
    pub per_scene: usize,
    /// Speeches shorter than this many words are skipped; longer ones are cut to `max_words`.
    pub min_words: usize,
    pub max_words: usize,
    pub seed: u64,
}

/// One labelled record as `kiln classify` reads it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PairRecord {
    pub text: String,
    pub text_pair: String,
    pub label: u8,
    pub group: String,
}

/// The records of `play-pairs` from the bundled corpus.
pub fn play_pairs(o: &PlayPairs) -> Result<Vec<PairRecord>> {
    let corpus = Corpus::load(None)?;
    let mut by_play: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    for s in speeches(&corpus.text) {
        let n = s.text.split_whitespace().count();
        if n < o.min_words {
            continue;
        }
        let text = s
            .text
            .split_whitespace()
            .take(o.max_words)
            .collect::<Vec<_>>()
            .join(" ");
        by_play
            .entry(s.play)
            .or_default()
            .entry(s.scene)
            .or_default()
            .push(text);
    }
    let mut titles: Vec<String> = by_play.keys().cloned().collect();
    if o.plays > 0 && o.plays < titles.len() {
        let order = super::folds::shuffled(titles.len(), o.seed);
        let mut keep: Vec<String> = order[..o.plays]
            .iter()
            .map(|&i| titles[i].clone())
            .collect();
        keep.sort();
        titles = keep;
    }
    let mut rng = crate::engine::rng::Rng::new(o.seed, crate::engine::rng::stream::SAMPLE);
    let mut out = Vec::new();
    for (p, title) in titles.iter().enumerate() {
        for (scene, texts) in &by_play[title] {
            let order = super::folds::shuffled(texts.len(), o.seed ^ out.len() as u64);
            for &t in order.iter().take(o.per_scene) {
                // Another play's title, uniformly among the others.
                let r = (rng.next_f32() as f64 * (titles.len() - 1) as f64) as usize;
                let other = &titles[if r >= p {
                    (r + 1).min(titles.len() - 1)
                } else {
                    r
                }];
                for (label, pair) in [(1, title), (0, other)] {
                    out.push(PairRecord {
                        text: texts[t].clone(),
                        text_pair: pair.clone(),
                        label,
                        group: scene.clone(),
                    });
                }
            }
        }
    }
    Ok(out)
}

/// Settings of `cue-reply`.
#[derive(Debug, Clone)]
pub struct CueReplies {
    /// How many plays (chosen at random with `seed`); 0 takes every play.
    pub plays: usize,
    /// Pairs taken from each scene at most (in the order they are spoken).
    pub per_scene: usize,
    /// Cues and replies shorter than this many words are skipped.
    pub min_words: usize,
    /// A cue keeps its last `max_words` words (what the next speaker answers), a reply its
    /// first `max_words`.
    pub max_words: usize,
    pub seed: u64,
}

/// One fine-tuning example as `kiln finetune` (`data.format=prompt_completion`) reads it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CueReplyRecord {
    /// `"CUE SPEAKER: cue\nREPLY SPEAKER:"`, so the model knows who answers.
    pub prompt: String,
    /// `" reply"`: the leading space joins it to the prompt as the text would.
    pub completion: String,
    /// The scene, `"PLAY / scene N"`.
    pub group: String,
}

fn words(text: &str) -> Vec<&str> {
    text.split_whitespace().collect()
}

/// The pairs of `cue-reply` from consecutive speeches of `speeches` (in text order): the
/// same scene, a different speaker, both at least `min_words` long.
pub fn cue_replies_from(speeches: &[Speech], o: &CueReplies) -> Vec<CueReplyRecord> {
    let mut out = Vec::new();
    let mut taken = 0;
    for (i, pair) in speeches.windows(2).enumerate() {
        let (cue, reply) = (&pair[0], &pair[1]);
        if i > 0 && speeches[i - 1].scene != cue.scene {
            taken = 0;
        }
        if cue.scene != reply.scene || cue.speaker == reply.speaker || taken >= o.per_scene {
            continue;
        }
        let (c, r) = (words(&cue.text), words(&reply.text));
        if c.len() < o.min_words || r.len() < o.min_words {
            continue;
        }
        let c = &c[c.len().saturating_sub(o.max_words)..];
        let r = &r[..r.len().min(o.max_words)];
        out.push(CueReplyRecord {
            prompt: format!("{}: {}\n{}:", cue.speaker, c.join(" "), reply.speaker),
            completion: format!(" {}", r.join(" ")),
            group: cue.scene.clone(),
        });
        taken += 1;
    }
    out
}

/// The records of `cue-reply` from the bundled corpus, plays in title order.
pub fn cue_replies(o: &CueReplies) -> Result<Vec<CueReplyRecord>> {
    let corpus = Corpus::load(None)?;
    let all = speeches(&corpus.text);
    let mut titles: Vec<&str> = all.iter().map(|s| s.play.as_str()).collect();
    titles.sort_unstable();
    titles.dedup();
    if o.plays > 0 && o.plays < titles.len() {
        let order = super::folds::shuffled(titles.len(), o.seed);
        let mut keep: Vec<&str> = order[..o.plays].iter().map(|&i| titles[i]).collect();
        keep.sort_unstable();
        titles = keep;
    }
    let mut out = Vec::new();
    for title in titles {
        let play: Vec<Speech> = all.iter().filter(|s| s.play == title).cloned().collect();
        out.extend(cue_replies_from(&play, o));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speeches_come_with_their_play_and_scene() {
        let text = "HAMLET, PRINCE OF DENMARK\n\nby William Shakespeare\n\nACT I.\n\nScene I. Elsinore.\n\nBer.\nWho's there?\n\nFran.\nNay, answer me:\n[Aside.]\nstand.\n\nSCENE II. A room.\n\nKING.\nThough yet of Hamlet\nour dear brother's death\n";
        let s = speeches(text);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].play, "Hamlet, Prince Of Denmark");
        assert_eq!(s[1].text, "Nay, answer me: stand.");
        assert_eq!(s[1].scene, "Hamlet, Prince Of Denmark / scene 1");
        assert_eq!(s[2].scene, "Hamlet, Prince Of Denmark / scene 2");
        assert!(is_scene_heading("ACT IV. SCENE I. CAESAR'S Camp"));
        assert!(!is_scene_heading("SCENE:  Partly in France"));
        assert!(!is_speaker("He said so, and more."));
    }

    #[test]
    fn cues_are_answered_by_another_speaker_in_the_same_scene() {
        let text = "HAMLET, PRINCE OF DENMARK\n\nby William Shakespeare\n\nSCENE I. Elsinore.\n\nBer.\nWho's there, I say, who?\n\nFran.\nNay, answer me: stand and unfold yourself.\n\nFran.\nI said so twice and more.\n\nBer.\nLong live the king, long live!\n\nSCENE II. A room.\n\nKING.\nThough yet of Hamlet our dear brother's death\n\nQUEEN.\nGood Hamlet, cast thy nighted colour off.\n";
        let s = speeches(text);
        assert_eq!(s[0].speaker, "Ber");
        let o = CueReplies {
            plays: 0,
            per_scene: 10,
            min_words: 5,
            max_words: 4,
            seed: 0,
        };
        let recs = cue_replies_from(&s, &o);
        // Fran. answering Fran. is no reply, and the last speech of scene 1 does not cue
        // the first of scene 2.
        assert_eq!(recs.len(), 3, "{recs:?}");
        assert_eq!(recs[0].prompt, "Ber: there, I say, who?\nFran:");
        assert_eq!(recs[0].completion, " Nay, answer me: stand");
        assert_eq!(recs[0].group, "Hamlet, Prince Of Denmark / scene 1");
        assert_eq!(recs[1].prompt, "Fran: so twice and more.\nBer:");
        assert_eq!(recs[2].prompt, "KING: our dear brother's death\nQUEEN:");
        assert_eq!(recs[2].group, "Hamlet, Prince Of Denmark / scene 2");
        let one = cue_replies_from(
            &s,
            &CueReplies {
                per_scene: 1,
                ..o.clone()
            },
        );
        assert_eq!(one.len(), 2, "one pair from each scene");
        assert_eq!((&one[0], &one[1]), (&recs[0], &recs[2]));
        let short = cue_replies_from(&s, &CueReplies { min_words: 7, ..o });
        assert_eq!(short.len(), 1, "only KING and QUEEN speak 7 words or more");
    }

    #[test]
    fn cue_replies_of_the_corpus_are_grouped_by_scene_in_order() {
        let o = CueReplies {
            plays: 3,
            per_scene: 3,
            min_words: 5,
            max_words: 30,
            seed: 1,
        };
        let recs = cue_replies(&o).unwrap();
        assert!(recs.len() > 100, "{}", recs.len());
        let mut seen: Vec<&str> = Vec::new();
        for r in &recs {
            if seen.last() != Some(&r.group.as_str()) {
                assert!(!seen.contains(&r.group.as_str()), "{} split", r.group);
                seen.push(&r.group);
            }
            assert!(r.prompt.ends_with(':') && r.completion.starts_with(' '));
            let n = r.completion.split_whitespace().count();
            assert!((5..=30).contains(&n), "{n} words");
        }
        let plays: std::collections::BTreeSet<&str> = recs
            .iter()
            .map(|r| r.group.split(" / ").next().unwrap())
            .collect();
        assert_eq!(plays.len(), 3);
        assert!(
            seen.iter()
                .all(|g| recs.iter().filter(|r| &r.group == g).count() <= 3)
        );
        assert_eq!(
            recs,
            cue_replies(&o).unwrap(),
            "the same seed gives the same file"
        );
    }

    #[test]
    fn play_pairs_are_balanced_and_grouped_by_scene() {
        let recs = play_pairs(&PlayPairs {
            plays: 4,
            per_scene: 1,
            min_words: 10,
            max_words: 40,
            seed: 2,
        })
        .unwrap();
        assert!(recs.len() > 100, "{}", recs.len());
        let pos = recs.iter().filter(|r| r.label == 1).count();
        assert_eq!(2 * pos, recs.len());
        let plays: std::collections::BTreeSet<&str> =
            recs.iter().map(|r| r.text_pair.as_str()).collect();
        assert_eq!(plays.len(), 4);
        for pair in recs.chunks(2) {
            assert_eq!(pair[0].text, pair[1].text);
            assert_eq!(pair[0].group, pair[1].group);
            assert!(pair[0].group.starts_with(&pair[0].text_pair));
            assert_ne!(pair[0].text_pair, pair[1].text_pair);
        }
    }
}
