//! Reading real published models: SmolLM2-135M-Instruct as GGUF (metadata, Q8_0 and Q4_1
//! tensors, its byte-level BPE vocabulary and ChatML template) and the all-MiniLM-L6-v2
//! directory's tokenizer.json. The files come from `scripts/fetch-fixtures.sh`.

mod common;

use common::fixtures::{minilm_dir, smollm2_gguf};
use kiln::data::{ChatMessage, Corpus, HfTokenizer, Tokenizer, encode_chunked, render_chat};
use kiln::models::import::GgufFile;

/// Mean and largest magnitude of `v`, with every value checked to be finite.
fn magnitudes(name: &str, v: &[f32]) -> (f64, f32) {
    assert!(v.iter().all(|x| x.is_finite()), "{name} has inf/NaN");
    let mean = v.iter().map(|x| f64::from(x.abs())).sum::<f64>() / v.len() as f64;
    (mean, v.iter().fold(0f32, |m, x| m.max(x.abs())))
}

#[test]
fn smollm2_metadata_describes_its_llama_architecture() {
    let g = GgufFile::open(&smollm2_gguf()).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), 32);
    assert_eq!(g.architecture(), Some("llama"));
    let u = |k: &str| g.require_u64(k).unwrap();
    assert_eq!(u("llama.block_count"), 30);
    assert_eq!(u("llama.embedding_length"), 576);
    assert_eq!(u("llama.attention.head_count"), 9);
    assert_eq!(u("llama.attention.head_count_kv"), 3);
    assert_eq!(u("llama.feed_forward_length"), 1536);
    assert_eq!(u("llama.vocab_size"), 49152);
    assert_eq!(g.require_f64("llama.rope.freq_base").unwrap(), 1e5);
    let eps = g
        .require_f64("llama.attention.layer_norm_rms_epsilon")
        .unwrap();
    assert!((eps - 1e-5).abs() < 1e-9, "{eps}");
    assert_eq!(
        g.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        49152
    );
    assert_eq!(g.get_i64_array("tokenizer.ggml.token_type").unwrap()[1], 3);
    // 30 blocks of 9 tensors, the embedding and the final norm; the head is tied.
    assert_eq!(g.tensors().len(), 30 * 9 + 2);
    assert!(g.tensor_info("output.weight").is_none());
    let types = |ty: &str| g.tensors().iter().filter(|t| t.type_name() == ty).count();
    assert_eq!((types("Q8_0"), types("Q4_1"), types("F32")), (1, 210, 61));
}

#[test]
fn smollm2_tensors_dequantise_with_pytorch_shapes() {
    let g = GgufFile::open(&smollm2_gguf()).unwrap();
    let info = g.tensor_info("token_embd.weight").unwrap();
    assert_eq!(info.dims, vec![576, 49152]);
    let (shape, emb) = g.tensor_f32("token_embd.weight").unwrap();
    assert_eq!(shape, vec![49152, 576]);
    let (mean, max) = magnitudes("token_embd.weight", &emb);
    assert!(
        (0.005..0.5).contains(&mean) && max < 20.0,
        "mean {mean}, max {max}"
    );
    // Rows are tokens: two different tokens have different embeddings.
    assert_ne!(emb[..576], emb[576 * 1000..576 * 1001]);

    for (name, want) in [
        ("blk.0.attn_q.weight", [576, 576]),
        ("blk.0.attn_k.weight", [192, 576]),
        ("blk.29.ffn_gate.weight", [1536, 576]),
        ("blk.29.ffn_down.weight", [576, 1536]),
    ] {
        assert_eq!(g.tensor_info(name).unwrap().type_name(), "Q4_1", "{name}");
        let (shape, w) = g.tensor_f32(name).unwrap();
        assert_eq!(shape, want, "{name}");
        let (mean, max) = magnitudes(name, &w);
        assert!(
            (0.001..1.0).contains(&mean) && max < 50.0,
            "{name}: mean {mean}, max {max}"
        );
    }
    let (shape, norm) = g.tensor_f32("output_norm.weight").unwrap();
    assert_eq!(shape, vec![576]);
    let (mean, _) = magnitudes("output_norm.weight", &norm);
    assert!((0.05..20.0).contains(&mean), "output_norm mean {mean}");
}

#[test]
fn smollm2_vocabulary_round_trips_text_and_knows_its_special_tokens() {
    let g = GgufFile::open(&smollm2_gguf()).unwrap();
    let tok = HfTokenizer::from_gguf(&g).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(Tokenizer::vocab_size(&tok), 49152);
    assert_eq!(tok.encode("<|im_start|>"), vec![1]);
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.bos_token(), "<|im_start|>");
    assert_eq!(tok.eos_token(), "<|im_end|>");
    assert_eq!(tok.pad_id(), Some(2));
    assert!(tok.eos_ids().contains(&2));
    assert!(!tok.adds_bos());
    assert!(tok.is_chunk_safe());
    for text in [
        "Hello, world!",
        "The year 2024 had 366 days; π ≈ 3.14159.",
        "  leading spaces, trailing tabs\t\t\nand\r\nCRLF lines\n\n\n",
        "unicode: naïve café, 日本語のテキスト, emoji 🦀🚀, Ελληνικά",
        "code: fn main() { println!(\"{}\", 1 + 2); }",
        "<|im_start|>user\nHi there<|im_end|>\n",
    ] {
        let ids = tok.encode(text);
        assert_eq!(tok.decode(&ids), text, "ids {ids:?}");
    }
    // SmolLM2 splits numbers into single digits.
    let digits: Vec<u32> = "2024"
        .chars()
        .map(|c| tok.token_to_id(&c.to_string()).unwrap())
        .collect();
    assert_eq!(tok.encode("2024"), digits);
    // Common English words are single tokens (GPT-2's "Ġ" marks the leading space).
    let the = tok.token_to_id("Ġthe").unwrap();
    assert_eq!(tok.encode(" the"), vec![the]);
    assert_eq!(tok.encode_with_special("hi", true)[0], 1);
    assert_eq!(
        tok.decode_skip_special(&tok.encode("<|im_start|>hi<|im_end|>")),
        "hi"
    );
}

#[test]
fn smollm2_vocabulary_meets_the_chunked_encoding_contract() {
    let tok = HfTokenizer::from_gguf(&GgufFile::open(&smollm2_gguf()).unwrap()).unwrap();
    let text = Corpus::load(None).unwrap().text;
    let mut end = 400_000;
    while !text.is_char_boundary(end) {
        end += 1;
    }
    let text = &text[..end];
    let cancel = std::sync::atomic::AtomicBool::new(false);
    let chunked = encode_chunked(&tok, text, &cancel, 2).unwrap();
    assert_eq!(chunked, tok.encode(text));
}

#[test]
fn smollm2_chat_template_renders_chatml() {
    let g = GgufFile::open(&smollm2_gguf()).unwrap();
    let tok = HfTokenizer::from_gguf(&g).unwrap();
    let template = tok
        .chat_template()
        .expect("the file carries a chat template");
    let msgs = [ChatMessage::new("user", "What is the capital of France?")];
    let text = render_chat(template, &msgs, true, tok.bos_token(), tok.eos_token()).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = tok.encode(&text);
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2);
    assert_eq!(tok.decode(&ids), text);
}

#[test]
fn minilm_tokenizer_json_adds_cls_and_sep() {
    let tok = HfTokenizer::from_dir(&minilm_dir()).unwrap();
    assert_eq!(tok.vocab_size(), 30522);
    // BERT uncased: lower-cased WordPiece, "hello" 7592, "world" 2088.
    assert_eq!(tok.encode("Hello world"), vec![7592, 2088]);
    let ids = tok.encode_with_special("Hello world", true);
    assert_eq!(ids, vec![101, 7592, 2088, 102]);
    assert_eq!(tok.encode_with_special("Hello world", false), ids);
    assert_eq!(tok.decode_skip_special(&ids), "hello world");
    assert!(tok.chat_template().is_none());
}

/// The shapes fine-tuning data comes in (chat `messages`, ShareGPT `conversations`, TRL's
/// prompt/completion turn lists, Alpaca lines read as a chat) give the same tokens and the
/// same trained positions for the same conversation, through SmolLM2's chat template; TRL's
/// form trains only its completion; Alpaca's own format trains the output under Alpaca's
/// prompt; a speaker kiln does not know is named with its line.
#[test]
fn fine_tuning_data_shapes_render_and_mask_alike() {
    use kiln::data::sft::{SftFormat, SftTokenizer, alpaca_prompt, examples};
    let g = GgufFile::open(&smollm2_gguf()).unwrap();
    let tok = HfTokenizer::from_gguf(&g).unwrap();
    let st = SftTokenizer::Pretrained(&tok);
    let p = std::path::Path::new("data.jsonl");
    let lines = [
        r#"{"messages": [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "A friend to this ground."}]}"#,
        r#"{"conversations": [{"from": "human", "value": "Who art thou?"}, {"from": "gpt", "value": "A friend to this ground."}]}"#,
        r#"{"prompt": [{"role": "user", "content": "Who art thou?"}], "completion": [{"role": "assistant", "content": "A friend to this ground."}]}"#,
        r#"{"instruction": "Who art thou?", "input": "", "output": "A friend to this ground."}"#,
    ];
    let ex = examples(p, &lines.join("\n"), SftFormat::Chat, &st).unwrap();
    assert_eq!(ex.len(), 4);
    for e in &ex[1..] {
        assert_eq!(e, &ex[0]);
    }
    let trained: Vec<u32> = ex[0]
        .tokens
        .iter()
        .zip(&ex[0].trained)
        .filter(|(_, t)| **t)
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(tok.decode(&trained), "A friend to this ground.<|im_end|>\n");
    assert!(
        tok.decode(&ex[0].tokens)
            .contains("<|im_start|>user\nWho art thou?<|im_end|>")
    );

    // TRL's form trains the completion's turns only, not an assistant turn of its prompt.
    let trl = r#"{"prompt": [{"role": "user", "content": "Hail."}, {"role": "assistant", "content": "Hail to thee."}, {"role": "user", "content": "Whence?"}], "completion": [{"role": "assistant", "content": "From Padua."}]}"#;
    let all = trl
        .replace("], \"completion\": [", ", ")
        .replace("\"prompt\"", "\"messages\"");
    let ex = examples(p, &format!("{trl}\n{all}"), SftFormat::Chat, &st).unwrap();
    assert_eq!(ex[0].tokens, ex[1].tokens);
    let text = |e: &kiln::data::sft::SftExample| {
        let ids: Vec<u32> = e
            .tokens
            .iter()
            .zip(&e.trained)
            .filter(|(_, t)| **t)
            .map(|(i, _)| *i)
            .collect();
        tok.decode(&ids)
    };
    assert_eq!(text(&ex[0]), "From Padua.<|im_end|>\n");
    assert_eq!(
        text(&ex[1]),
        "Hail to thee.<|im_end|>\nFrom Padua.<|im_end|>\n"
    );

    // Alpaca's own format: its prompt text untrained, the output and EOS trained.
    let ex = examples(
        p,
        r#"{"instruction": "Name a play.", "input": "By Shakespeare.", "output": "Hamlet"}"#,
        SftFormat::Alpaca,
        &st,
    )
    .unwrap();
    let prompt = alpaca_prompt("Name a play.", "By Shakespeare.");
    assert!(prompt.contains("### Input:\nBy Shakespeare.\n\n### Response:\n"));
    let untrained: Vec<u32> = ex[0]
        .tokens
        .iter()
        .zip(&ex[0].trained)
        .filter(|(_, t)| !**t)
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(tok.decode(&untrained), prompt);
    assert_eq!(text(&ex[0]), "Hamlet<|im_end|>");

    // Bad lines are named, with what is wrong in them.
    let bad = [
        (
            r#"{"conversations": [{"from": "robot", "value": "Beep."}]}"#,
            "\"robot\"",
        ),
        (
            r#"{"conversations": [{"from": "human", "text": "Hi"}]}"#,
            "\"conversations\" turn 1",
        ),
        (
            r#"{"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "user", "content": "Hi"}]}"#,
            "no assistant turn in its \"completion\"",
        ),
        (r#"{"text": "plain"}"#, "has no conversation"),
        (r#"{"instruction": "Hi", "output": 3}"#, "\"output\""),
    ];
    for (line, want) in bad {
        let e = examples(p, &format!("{}\n{line}", lines[0]), SftFormat::Chat, &st)
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2") && e.contains(want), "{line}: {e}");
    }
    let e = examples(p, r#"{"instruction": "Hi"}"#, SftFormat::Alpaca, &st)
        .unwrap_err()
        .to_string();
    assert!(e.contains("line 1") && e.contains("\"output\""), "{e}");
}
