//! `kiln tokenize` on the real SmolLM2 GGUF vocabulary and MiniLM's tokenizer.json: the ids
//! are the ones Hugging Face's tokenizers give for the same text (established with
//! bench/tokenizer_parity.py, which compares thousands of lines).

mod common;

use common::fixtures::{minilm_dir, smollm2_gguf};
use std::process::Output;

fn tokenize(args: &[&str], stdin: impl AsRef<[u8]>) -> Output {
    let all: Vec<&str> = std::iter::once("tokenize")
        .chain(args.iter().copied())
        .collect();
    common::kiln_with_stdin(&all, stdin)
}

/// The ids of each output line, checking that the command succeeded.
fn ids(o: &Output) -> Vec<Vec<u32>> {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{}: {err}", o.status);
    String::from_utf8(o.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect()
}

#[test]
fn smollm2_gguf_ids_match_hugging_face() {
    let gguf = smollm2_gguf();
    let gguf = gguf.to_str().unwrap();
    // ChatML control tokens are single ids; digits are split one by one after a whitespace
    // run, as SmolLM2's own tokenizer.json does; an empty line is an empty array; \r\n ends
    // a line like \n.
    let input = "Hello world\n<|im_start|>user\nhi<|im_end|>\n  42 caf\u{e9} \u{1f980}\r\n\n";
    let expected: Vec<Vec<u32>> = vec![
        vec![19556, 905],
        vec![1, 4093],
        vec![6004, 2],
        vec![256, 36, 34, 37366, 15107, 116, 218],
        vec![],
    ];
    assert_eq!(ids(&tokenize(&["--tokenizer", gguf], input)), expected);
    // The GGUF file says add_bos_token = false: --special adds nothing to these lines.
    assert_eq!(
        ids(&tokenize(&["--tokenizer", gguf, "--special"], input)),
        expected
    );

    // --input reads a file; a last line without a line break counts.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("lines.txt");
    std::fs::write(&file, "Hello world\nhi<|im_end|>").unwrap();
    let o = tokenize(
        &["--tokenizer", gguf, "--input", file.to_str().unwrap()],
        "ignored",
    );
    assert_eq!(ids(&o), vec![vec![19556, 905], vec![6004, 2]]);
}

#[test]
fn minilm_special_tokens_surround_each_line() {
    let dir = minilm_dir();
    let dir = dir.to_str().unwrap();
    let input = "Hello world\nCaf\u{e9} costs 42 euros!\n\n";
    assert_eq!(
        ids(&tokenize(&["--special", "--tokenizer", dir], input)),
        vec![
            vec![101, 7592, 2088, 102],
            vec![101, 7668, 5366, 4413, 19329, 999, 102],
            vec![101, 102],
        ]
    );
    assert_eq!(
        ids(&tokenize(&["--tokenizer", dir], input)),
        vec![vec![7592, 2088], vec![7668, 5366, 4413, 19329, 999], vec![]]
    );
}

#[test]
fn built_in_tokenizers_and_bad_arguments() {
    assert_eq!(
        ids(&tokenize(&["--tokenizer", "byte"], "hi\n")),
        vec![vec![104, 105]]
    );
    assert_eq!(
        ids(&tokenize(&["--tokenizer", "gpt2"], "Hello world\n")),
        vec![vec![15496, 995]]
    );

    let fails = |args: &[&str], stdin: &str, code: i32, needles: &[&str]| {
        let o = tokenize(args, stdin);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(code), "{args:?}: {err}");
        for n in needles {
            assert!(err.contains(n), "{args:?}: {n:?} not in {err}");
        }
        assert!(o.stdout.is_empty(), "{args:?}");
    };
    // Settings: exit 2; data and tokenizer files: exit 3.
    fails(
        &["--tokenizer", "gpt2", "--special"],
        "hi\n",
        2,
        &["--special", "gpt2"],
    );
    fails(
        &["--tokenizer", "no/such/model.gguf"],
        "hi\n",
        3,
        &["no/such/model.gguf"],
    );
    fails(
        &["--tokenizer", "no/such/dir/"],
        "hi\n",
        3,
        &["tokenizer.json"],
    );
    fails(
        &["--tokenizer", "wordpiece"],
        "hi\n",
        3,
        &["unknown tokenizer", "byte, gpt2"],
    );
    fails(
        &["--tokenizer", "byte", "--input", "no/such/lines.txt"],
        "",
        3,
        &["no/such/lines.txt"],
    );
    let o = tokenize(&["--tokenizer", "byte"], b"ok\nbad \xff\n");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("line 2") && err.contains("UTF-8"), "{err}");
}

#[test]
fn stop_strings_a_model_cannot_write_are_refused() {
    use kiln::data::Tokenizer;
    let stops = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // Byte-level vocabularies write any text.
    let byte = kiln::data::ByteTokenizer;
    kiln::generate::check_stop_strings(&byte, &stops(&["\n\n", " User:", "☃"])).unwrap();
    let smol = kiln::data::tokenizer_from_path(&smollm2_gguf()).unwrap();
    kiln::generate::check_stop_strings(&smol, &stops(&["<|im_end|>", "\nUser:", "𝔘"])).unwrap();
    // MiniLM's uncased WordPiece vocabulary folds case and has no fraktur letters.
    let minilm = kiln::data::tokenizer_from_path(&minilm_dir().join("tokenizer.json")).unwrap();
    kiln::generate::check_stop_strings(&minilm, &stops(&["the end", " and"])).unwrap();
    for bad in ["User:", "𝔘"] {
        let e = kiln::generate::check_stop_strings(&minilm, &stops(&[bad]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--stop") && e.contains("cannot appear") && e.contains(minilm.name()),
            "{e}"
        );
    }
    assert!(kiln::generate::check_stop_strings(&byte, &stops(&[""])).is_err());
}

/// Generation checks stop strings on the text of a sequence's last tokens only
/// (`generate::stops`). On the real vocabularies (SmolLM2's byte-level BPE, MiniLM's WordPiece,
/// whose decoder joins `##` pieces and removes spaces before punctuation): at every token of
/// a text, a stop string that the whole text gains is in that window too.
#[test]
fn stop_string_windows_find_what_the_whole_text_gains() {
    use kiln::data::tokenizer_from_path;
    use kiln::generate::stops::tail_may_stop;
    let text = "Where the bee sucks, there suck I : in a cowslip's bell I lie — thère I couch \
        when owls do cry. On the bat's back I do fly after summer merrily. Merrily, merrily \
        shall I live now , under the blossom that hangs on the bough ! Ĉu vi parolas? 日本語 , \
        and bees , more bees , « quoted » text .";
    let stops = [
        " bees",
        "bees ,",
        " merrily",
        "Merrily, m",
        " ,",
        "!",
        "ère",
        "日本",
        "語 ,",
        "« quoted »",
        "the bough",
        "owls do",
        ". On",
        "merrily, m",
        "the bee",
        "s back",
    ];
    for path in [smollm2_gguf(), minilm_dir()] {
        let tok = tokenizer_from_path(&path).unwrap();
        let ids = tok.encode(text);
        let mut found = 0;
        for stop in stops {
            let mut before = 0;
            for n in 1..=ids.len() {
                let count = tok.decode(&ids[..n]).matches(stop).count();
                if count > before {
                    found += 1;
                    assert!(
                        tail_may_stop(&tok, &ids[..n], &[stop.to_string()], stop.len()),
                        "{}: {stop:?} appears at token {n} of {:?} but not in its window",
                        path.display(),
                        tok.decode(&ids[..n])
                    );
                }
                before = count;
            }
        }
        assert!(found >= 10, "{}: only {found} occurrences", path.display());
    }
}
