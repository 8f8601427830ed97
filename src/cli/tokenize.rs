//! `kiln tokenize`: the token ids of each line of a text, one JSON array a line.

use crate::data::{self, DataError, HfTokenizer, Tokenizer};
use crate::error::{KilnError, Result};
use clap::Args;
use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
#[command(after_help = "EXAMPLES:
  echo 'Hello world' | kiln tokenize --tokenizer gpt2
  kiln tokenize --tokenizer model.gguf --input prompts.txt
  kiln tokenize --tokenizer all-MiniLM-L6-v2/ --special --input sentences.txt

Each input line (its \\n or \\r\\n removed) becomes one line of output, a JSON array of ids:
[15496, 995]. Special tokens written in the text of a pretrained tokenizer (<|im_start|>) are
single ids. --special adds the ids the model puts around a text ([CLS] ... [SEP], or BOS and
EOS where the model's tokenizer adds them), as Hugging Face's add_special_tokens=True does.")]
pub struct TokenizeArgs {
    /// Tokenizer: byte, gpt2, or the path of a pretrained model's tokenizer (a Hugging Face
    /// directory, a tokenizer.json, a tokenizer.model or a .gguf file), as in the setting
    /// data.tokenizer.
    #[arg(long, value_name = "NAME_OR_PATH")]
    pub tokenizer: String,
    /// Read lines from this file instead of standard input.
    #[arg(long, value_name = "FILE")]
    pub input: Option<PathBuf>,
    /// Add the model's special tokens (BOS and EOS as its files ask, [CLS]/[SEP]); pretrained
    /// tokenizers only.
    #[arg(long)]
    pub special: bool,
}

/// A built-in tokenizer, or a pretrained one (which alone has special tokens to add).
enum Loaded {
    Builtin(Box<dyn Tokenizer>),
    Pretrained(Box<HfTokenizer>),
}

fn load(name: &str) -> Result<Loaded> {
    // Any existing path counts here, also a directory named without a slash.
    let builtin = data::TOKENIZER_NAMES.contains(&name);
    if data::is_tokenizer_path(name) || (!builtin && Path::new(name).exists()) {
        let tok = data::tokenizer_from_path(Path::new(name))?;
        return Ok(Loaded::Pretrained(Box::new(tok)));
    }
    Ok(Loaded::Builtin(data::tokenizer_by_name(name)?))
}

pub fn run(a: TokenizeArgs) -> Result<()> {
    let tok = load(&a.tokenizer)?;
    if a.special && matches!(tok, Loaded::Builtin(_)) {
        return Err(KilnError::Setting(format!(
            "--special adds a pretrained model's special tokens, and the built-in tokenizer {:?} \
             has none; drop --special, or pass the path of a model's tokenizer",
            a.tokenizer
        )));
    }
    let encode = |line: &str| -> Vec<u32> {
        match &tok {
            Loaded::Builtin(t) => t.encode(line),
            Loaded::Pretrained(t) if a.special => t.encode_with_special(line, t.adds_bos()),
            Loaded::Pretrained(t) => t.encode(line),
        }
    };

    let (source, reader): (PathBuf, Box<dyn Read>) = match &a.input {
        Some(p) => {
            let f = std::fs::File::open(p).map_err(|e| DataError::File {
                path: p.clone(),
                reason: format!("cannot be read: {e}"),
            })?;
            (p.clone(), Box::new(f))
        }
        None => (PathBuf::from("<stdin>"), Box::new(std::io::stdin().lock())),
    };
    // Interactive use answers each line at once; a pipe or file is written in blocks.
    let interactive = a.input.is_none() && std::io::stdin().is_terminal();
    let mut reader = BufReader::new(reader);
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut buf = Vec::new();
    let mut out_line = String::new();
    for n in 1.. {
        buf.clear();
        let read = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| DataError::File {
                path: source.clone(),
                reason: format!("cannot be read at line {n}: {e}"),
            })?;
        if read == 0 {
            break;
        }
        if buf.last() == Some(&b'\n') {
            buf.pop();
            if buf.last() == Some(&b'\r') {
                buf.pop();
            }
        }
        let line = std::str::from_utf8(&buf).map_err(|e| DataError::File {
            path: source.clone(),
            reason: format!(
                "line {n} is not valid UTF-8 (first bad byte at column {}); convert the text \
                 to UTF-8, for example with `iconv -t UTF-8`",
                e.valid_up_to() + 1
            ),
        })?;
        format_ids(&encode(line), &mut out_line);
        let written = out
            .write_all(out_line.as_bytes())
            .and_then(|()| if interactive { out.flush() } else { Ok(()) });
        if let Err(e) = written {
            return stdout_error(e);
        }
    }
    out.flush().or_else(stdout_error)
}

/// `[1, 2, 3]` and a line break, into `s`.
fn format_ids(ids: &[u32], s: &mut String) {
    use std::fmt::Write as _;
    s.clear();
    s.push('[');
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{id}");
    }
    s.push_str("]\n");
}

/// A reader that stopped reading (`kiln tokenize ... | head`) ends the command quietly.
fn stdout_error(e: std::io::Error) -> Result<()> {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Ok(())
    } else {
        Err(KilnError::output("standard output", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_written_as_json_arrays() {
        let mut s = String::new();
        format_ids(&[], &mut s);
        assert_eq!(s, "[]\n");
        format_ids(&[15496, 995], &mut s);
        assert_eq!(s, "[15496, 995]\n");
        let parsed: Vec<u32> = serde_json::from_str(s.trim()).unwrap();
        assert_eq!(parsed, vec![15496, 995]);
    }
}
