//! `kiln make-dataset`: labelled and fine-tuning datasets made from the bundled corpus.

use crate::classify::dataset::{self, CueReplies, PlayPairs};
use crate::error::{KilnError, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;

#[derive(Subcommand, Debug)]
pub enum DatasetCommand {
    /// Pairs (speech, play title) labelled 1 when the speech is from that play, 0 when the
    /// title is another play's; balanced, grouped by scene.
    #[command(after_help = "EXAMPLES:
  kiln make-dataset play-pairs --out pairs.jsonl
  kiln make-dataset play-pairs --plays 6 --per-scene 2 --out small.jsonl

Each speech appears twice, once with its own play's title (label 1) and once with another
play's (label 0), and both records carry the scene as their group, so a split that ignores
groups would put the same speech on both sides of a fold.")]
    PlayPairs(PlayPairsArgs),
    /// Prompt/completion pairs for `kiln finetune`: a cue (the end of one character's
    /// speech) and the reply that follows it, spoken by another character; grouped by scene.
    #[command(after_help = "EXAMPLES:
  kiln make-dataset cue-reply --out cues.jsonl
  kiln make-dataset cue-reply --plays 4 --per-scene 3 --max-words 30 --out small.jsonl
  kiln finetune --init-from SmolLM2-135M-Instruct.Q4_1.gguf --data cues.jsonl data.format=prompt_completion

Each line is {\"prompt\": \"SPEAKER: cue\\nREPLIER:\", \"completion\": \" reply\", \"group\":
\"PLAY / scene N\"}. Records follow the plays (in title order) scene by scene, so the tail
that fine-tuning holds out for validation is whole scenes; split by group for other folds.
The prompts also serve `kiln generate --prompts`.")]
    CueReply(CueReplyArgs),
}

#[derive(Args, Debug)]
pub struct CueReplyArgs {
    /// Where the JSON lines go.
    #[arg(long, value_name = "FILE.jsonl")]
    pub out: PathBuf,
    /// How many plays, chosen at random (0: every play).
    #[arg(long, default_value_t = 0)]
    pub plays: usize,
    /// Pairs taken from each scene at most, in the order they are spoken.
    #[arg(long, default_value_t = 4)]
    pub per_scene: usize,
    /// Shortest cue and reply kept, in words.
    #[arg(long, default_value_t = 6)]
    pub min_words: usize,
    /// A cue keeps its last this many words, a reply its first.
    #[arg(long, default_value_t = 40)]
    pub max_words: usize,
    /// Seed of the choice of plays.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Args, Debug)]
pub struct PlayPairsArgs {
    /// Where the JSON lines go.
    #[arg(long, value_name = "FILE.jsonl")]
    pub out: PathBuf,
    /// How many plays, chosen at random (0: every play).
    #[arg(long, default_value_t = 0)]
    pub plays: usize,
    /// Speeches taken from each scene at most.
    #[arg(long, default_value_t = 2)]
    pub per_scene: usize,
    /// Shortest speech kept, in words.
    #[arg(long, default_value_t = 12)]
    pub min_words: usize,
    /// Longer speeches are cut to this many words.
    #[arg(long, default_value_t = 60)]
    pub max_words: usize,
    /// Seed of the choices.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Writes `records` as JSON lines to `out`.
fn write_json_lines<R: serde::Serialize>(out: &std::path::Path, records: &[R]) -> Result<()> {
    let mut body = String::new();
    for r in records {
        body += &serde_json::to_string(r).map_err(|e| KilnError::output(out, e))?;
        body.push('\n');
    }
    std::fs::write(out, body).map_err(|e| KilnError::output(out, e))
}

pub fn run(c: DatasetCommand) -> Result<()> {
    match c {
        DatasetCommand::CueReply(a) => {
            if a.per_scene == 0 || a.max_words == 0 || a.min_words > a.max_words {
                return Err(KilnError::Setting(format!(
                    "--per-scene {} --min-words {} --max-words {}: give at least one pair per scene, and min-words at most max-words",
                    a.per_scene, a.min_words, a.max_words
                )));
            }
            let records = dataset::cue_replies(&CueReplies {
                plays: a.plays,
                per_scene: a.per_scene,
                min_words: a.min_words,
                max_words: a.max_words,
                seed: a.seed,
            })?;
            if records.is_empty() {
                return Err(KilnError::Setting(format!(
                    "no cue and reply of {} words or more was found; lower --min-words",
                    a.min_words
                )));
            }
            write_json_lines(&a.out, &records)?;
            let groups: std::collections::BTreeSet<&str> =
                records.iter().map(|r| r.group.as_str()).collect();
            let plays: std::collections::BTreeSet<&str> = groups
                .iter()
                .filter_map(|g| g.split(" / ").next())
                .collect();
            println!(
                "wrote {} prompt/completion pairs ({} plays, {} scenes as groups) to {}",
                records.len(),
                plays.len(),
                groups.len(),
                a.out.display()
            );
            Ok(())
        }
        DatasetCommand::PlayPairs(a) => {
            if a.plays == 1 || a.per_scene == 0 || a.max_words == 0 || a.min_words > a.max_words {
                return Err(KilnError::Setting(format!(
                    "--plays {} --per-scene {} --min-words {} --max-words {}: pairs need 0 (all) or at least 2 plays, at least one speech per scene, and min-words at most max-words",
                    a.plays, a.per_scene, a.min_words, a.max_words
                )));
            }
            let records = dataset::play_pairs(&PlayPairs {
                plays: a.plays,
                per_scene: a.per_scene,
                min_words: a.min_words,
                max_words: a.max_words,
                seed: a.seed,
            })?;
            write_json_lines(&a.out, &records)?;
            let groups: std::collections::BTreeSet<&str> =
                records.iter().map(|r| r.group.as_str()).collect();
            let plays: std::collections::BTreeSet<&str> =
                records.iter().map(|r| r.text_pair.as_str()).collect();
            println!(
                "wrote {} records ({} plays, {} scenes as groups, half labelled 1) to {}",
                records.len(),
                plays.len(),
                groups.len(),
                a.out.display()
            );
            Ok(())
        }
    }
}
