//! Pretrained models end to end: SmolLM2-135M-Instruct from its GGUF file answers a chat
//! prompt through `kiln generate`, a Llama exported as a Hugging Face directory imports back
//! to the same logits, and every kind of broken checkpoint is refused before work starts.

mod common;

use common::fixtures::{minilm_dir, smollm2_gguf};
use kiln::config::{FamilySettings, ResolvedConfig};
use kiln::engine::{Device, MemoryPool};
use kiln::models::import::pretrained;
use kiln::models::{self, export};
use std::path::Path;
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("kiln runs")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// Greedy decoding of the published model through its own chat template gives the answer
/// transformers gives for the same file (Q4_1 weights dequantised on load).
#[test]
fn smollm2_gguf_answers_a_chat_prompt() {
    let (out, err) = capital_of_france(&smollm2_gguf());
    assert_eq!(
        out.trim(),
        "The capital of France is Paris.",
        "stderr: {err}"
    );
    assert!(err.contains("decode"), "a throughput summary: {err}");
}

/// `--system` puts a system message before the user's in place of the template's default
/// one: the prompt prefilled is exactly the template rendered with both messages; without
/// `--chat` the flag is refused.
#[test]
fn a_system_message_goes_before_the_prompt() {
    use kiln::data::{ChatMessage, HfTokenizer, render_chat};
    let gguf = smollm2_gguf();
    let tok =
        HfTokenizer::from_gguf(&kiln::models::import::GgufFile::open(&gguf).unwrap()).unwrap();
    let template = tok.chat_template().unwrap();
    let prefill = |messages: &[ChatMessage]| {
        let text = render_chat(template, messages, true, tok.bos_token(), tok.eos_token()).unwrap();
        format!("prefill {} tokens", tok.encode(&text).len())
    };
    let user = ChatMessage::new("user", "What is the capital of France?");
    let system = ChatMessage::new("system", "Answer in one word.");
    let with = prefill(&[system.clone(), user.clone()]);
    assert_ne!(with, prefill(std::slice::from_ref(&user)));
    let args = |chat: bool| {
        let mut v = vec![
            "generate",
            "--init-from",
            gguf.to_str().unwrap(),
            "--system",
            "Answer in one word.",
            "--prompt",
            "What is the capital of France?",
            "--temperature",
            "0",
            "--tokens",
            "4",
        ];
        if chat {
            v.push("--chat");
        }
        kiln(&v)
    };
    let o = args(true);
    let (_, err) = text(&o);
    assert!(
        o.status.success() && err.contains(&with),
        "want '{with}': {err}"
    );
    let o = args(false);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--chat"), "{err}");
}

/// `--interactive` answers each line of standard input as a chat turn, the first as a lone
/// `--chat` prompt is answered; `/reset` and `/exit` are commands, not turns, and `/reset`
/// forgets the key/value cache with the conversation.
#[test]
fn an_interactive_conversation_answers_each_line() {
    let o = common::kiln_with_stdin(
        &[
            "generate",
            "--init-from",
            smollm2_gguf().to_str().unwrap(),
            "-i",
            "--temperature",
            "0",
            "--tokens",
            "16",
        ],
        "What is the capital of France?\n/reset\nAnd of Italy?\n/exit\nnever read\n",
    );
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(
        out.lines().next(),
        Some("The capital of France is Paris."),
        "{err}"
    );
    assert!(
        err.contains("conversation is forgotten") && err.contains("2 turns;"),
        "{err}"
    );
    // `/reset` forgot the cache too: the second turn ran its whole prompt.
    assert!(!err.contains("read from the conversation's cache"), "{err}");
}

/// The greedy 16-token reply of `model` to a chat prompt (stdout, stderr); it must succeed.
fn capital_of_france(model: &Path) -> (String, String) {
    let o = kiln(&[
        "generate",
        "--init-from",
        model.to_str().unwrap(),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--temperature",
        "0",
        "--tokens",
        "16",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{}: {err}", model.display());
    (out, err)
}

/// SmolLM2 from its GGUF file, written back as GGUF: in f32 the re-imported model has the
/// same weights and tokenizer (its chat prompt answered the same way), in q8_0 the file is a
/// quarter of that and in q4_0 smaller again, and both still load and answer; a GPT run is refused with what to do instead.
#[test]
fn smollm2_exports_to_gguf_and_imports_back() {
    let gguf = smollm2_gguf();
    let dir = tempfile::tempdir().unwrap();
    let answer = |model: &Path| capital_of_france(model).0.trim().to_string();
    let mut sizes = vec![];
    for outtype in ["f32", "q8_0", "q4_0"] {
        let to = dir.path().join(format!("smol-{outtype}.gguf"));
        let o = kiln(&[
            "export",
            "--init-from",
            gguf.to_str().unwrap(),
            "--to",
            to.to_str().unwrap(),
            "--outtype",
            outtype,
        ]);
        assert!(o.status.success(), "{}", text(&o).1);
        sizes.push(std::fs::metadata(&to).unwrap().len());
        let (a, b) = (
            pretrained::open(&gguf).unwrap(),
            pretrained::open(&to).unwrap(),
        );
        assert_eq!(a.model.n_layers, b.model.n_layers);
        assert_eq!(a.tokenizer.chat_template(), b.tokenizer.chat_template());
        let text = "Hello world, it's 2026! <|im_start|>user";
        assert_eq!(
            a.tokenizer.encode_with_special(text, true),
            b.tokenizer.encode_with_special(text, true)
        );
        if outtype == "f32" {
            for (name, w) in &a.weights {
                assert_eq!(w.data, b.weights[name].data, "{name}");
            }
            assert_eq!(answer(&to), "The capital of France is Paris.");
        } else {
            assert!(!answer(&to).is_empty());
        }
    }
    assert!(
        sizes[1] * 3 < sizes[0],
        "q8_0 {} against f32 {}",
        sizes[1],
        sizes[0]
    );
    assert!(
        sizes[2] < sizes[1],
        "q4_0 {} against q8_0 {}",
        sizes[2],
        sizes[1]
    );
    // --outtype belongs to GGUF targets: with a directory it is refused before anything runs.
    let dir_target = dir.path().join("not-gguf");
    let o = kiln(&[
        "export",
        "--init-from",
        gguf.to_str().unwrap(),
        "--to",
        dir_target.to_str().unwrap(),
        "--outtype",
        "q8_0",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    assert!(text(&o).1.contains("--to FILE.gguf"), "{}", text(&o).1);
    assert!(!dir_target.exists());
    // A GPT has no GGUF layout here: the error says so and names the way that works.
    let run = dir.path().join("gpt");
    let o = kiln(&[
        "train",
        "--device",
        "cpu",
        "-q",
        "--out",
        run.to_str().unwrap(),
        "train.steps=1",
        "model.n_layers=1",
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    let o = kiln(&[
        "export",
        "--run",
        run.to_str().unwrap(),
        "--to",
        dir.path().join("gpt.gguf").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    assert!(
        text(&o).1.contains("Hugging Face directory"),
        "{}",
        text(&o).1
    );
}

/// A tiny random Llama (grouped-query heads, untied head, QKV biases, MiniLM's tokenizer
/// files) exported as a Hugging Face directory and imported back has the same parameters and
/// gives bit-identical logits.
#[test]
fn exported_llama_imports_back_to_the_same_logits() {
    let tok_dir = minilm_dir();
    let tok = tok_dir.to_str().unwrap();
    let cfg = ResolvedConfig::resolve(
        None,
        &[
            "model.kind=llama".into(),
            "model.d_model=32".into(),
            "model.n_layers=2".into(),
            "model.n_heads=4".into(),
            "model.n_kv_heads=2".into(),
            "model.ffn_hidden=48".into(),
            "model.context=64".into(),
            "train.seq_len=64".into(),
            "model.tied_head=false".into(),
            "model.qkv_bias=true".into(),
            "model.rope_theta=500.0".into(),
            format!("data.tokenizer={tok}"),
        ],
    )
    .unwrap()
    .config;
    let vocab = kiln::train::model_vocab(&cfg).unwrap();
    assert_eq!(vocab, 30522);
    let pool = MemoryPool::new(Device::Cpu);
    let original = models::build(&cfg.model, vocab, &pool, 5).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("hf");
    export::export_hf(original.as_ref(), &cfg.model, vocab, tok, &out).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(out.join(f).is_file(), "{f} written");
    }
    let p = pretrained::open(&out).unwrap();
    assert_eq!(p.source.architecture, "LlamaForCausalLM");
    assert_eq!(p.vocab, vocab);
    let back = p.build(&pool).unwrap();
    let ids: Vec<u32> = (0..20).map(|i| (i * 977 + 13) % 30522).collect();
    let a = original.next_logits(&ids).unwrap();
    let b = back.next_logits(&ids).unwrap();
    assert_eq!(a, b, "the same logits after export and import");

    // transformers 5 writes the rotary settings as one `rope_parameters` object.
    edit_config(&out, |v| {
        let theta = v.as_object_mut().unwrap().remove("rope_theta").unwrap();
        v["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": theta});
    });
    let p = pretrained::open(&out).unwrap();
    assert_eq!(p.model.llama().unwrap().rope_theta, 500.0);
    let v5 = p.build(&pool).unwrap();
    assert_eq!(a, v5.next_logits(&ids).unwrap(), "rope_parameters read");
}

fn write_tiny_llama(dir: &Path) {
    write_tiny_llama_with(dir, &[], 1);
}

/// A tiny Llama-family model (width 16, one layer, two heads, context 16, MiniLM's
/// tokenizer) with `extra` settings on top, initialised from `seed`, exported as a Hugging
/// Face directory in `dir`; returns the model.
fn write_tiny_llama_with(dir: &Path, extra: &[&str], seed: u64) -> Box<dyn models::Model> {
    let mut overrides: Vec<String> = [
        "model.kind=llama",
        "model.d_model=16",
        "model.n_layers=1",
        "model.n_heads=2",
        "model.context=16",
        "train.seq_len=16",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    overrides.push(format!("data.tokenizer={}", minilm_dir().display()));
    let cfg = ResolvedConfig::resolve(None, &overrides).unwrap().config;
    let vocab = kiln::train::model_vocab(&cfg).unwrap();
    let model = models::build(&cfg.model, vocab, &MemoryPool::new(Device::Cpu), seed).unwrap();
    export::export_hf(
        model.as_ref(),
        &cfg.model,
        vocab,
        &minilm_dir().display().to_string(),
        dir,
    )
    .unwrap();
    model
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&path, v.to_string()).unwrap();
}

/// Each broken checkpoint is an error naming what is wrong, exit code 4, before anything is
/// written; a model setting that contradicts the import is exit code 2.
#[test]
fn broken_checkpoints_are_refused_with_what_is_wrong() {
    type Damage = fn(&Path);
    let cases: &[(&str, Damage, &str)] = &[
        (
            "unsupported architecture",
            |d| {
                edit_config(d, |v| {
                    v["architectures"] = serde_json::json!(["FalconForCausalLM"])
                })
            },
            "FalconForCausalLM",
        ),
        (
            "shape disagrees with config.json",
            |d| edit_config(d, |v| v["intermediate_size"] = serde_json::json!(40)),
            "model.layers.0.mlp.gate_proj.weight has shape [64, 16] but the configuration implies [40, 16]",
        ),
        (
            "missing shard",
            |d| {
                std::fs::remove_file(d.join("model.safetensors")).unwrap();
                std::fs::write(
                    d.join("model.safetensors.index.json"),
                    r#"{"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}"#,
                )
                .unwrap();
            },
            "model-00001-of-00002.safetensors which does not exist",
        ),
        (
            "truncated weights",
            |d| {
                let p = d.join("model.safetensors");
                let bytes = std::fs::read(&p).unwrap();
                std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
            },
            "may be truncated",
        ),
        (
            "missing tokenizer",
            |d| std::fs::remove_file(d.join("tokenizer.json")).unwrap(),
            "tokenizer",
        ),
        (
            "window of 0 with the flag on",
            |d| {
                edit_config(d, |v| {
                    v["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
                    v["use_sliding_window"] = serde_json::json!(true);
                    v["sliding_window"] = serde_json::json!(0);
                })
            },
            "turns sliding-window attention on but its \"sliding_window\" is 0",
        ),
        (
            "negative window",
            |d| {
                edit_config(d, |v| {
                    v["architectures"] = serde_json::json!(["MistralForCausalLM"]);
                    v["sliding_window"] = serde_json::json!(-4);
                })
            },
            "\"sliding_window\" is -4; it must be a whole number of positions, at least 1",
        ),
        (
            "absurd window",
            |d| {
                edit_config(d, |v| {
                    v["architectures"] = serde_json::json!(["MistralForCausalLM"]);
                    v["sliding_window"] = serde_json::json!(1u64 << 40);
                })
            },
            "past the 16777216 positions kiln takes",
        ),
        (
            "layers alternating between full and windowed attention",
            |d| {
                edit_config(d, |v| {
                    v["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
                    v["num_hidden_layers"] = serde_json::json!(1);
                    v["use_sliding_window"] = serde_json::json!(true);
                    v["sliding_window"] = serde_json::json!(4);
                    v["layer_types"] = serde_json::json!(["chunked_attention"]);
                })
            },
            "full attention followed by sliding-window ones",
        ),
    ];
    for (what, damage, phrase) in cases {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("m");
        write_tiny_llama(&m);
        damage(&m);
        let out = dir.path().join("run");
        let o = kiln(&[
            "train",
            "--init-from",
            m.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "train.steps=1",
        ]);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(4), "{what}: {err}");
        assert!(err.contains(phrase), "{what}: {err}");
        assert!(!out.exists(), "{what}: nothing written");
    }
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m");
    write_tiny_llama(&m);
    let o = kiln(&[
        "train",
        "--init-from",
        m.to_str().unwrap(),
        "model.d_model=64",
    ]);
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("contradicts --init-from"), "{err}");
}

/// `kiln train --init-from` a Hugging Face directory trains from its weights on the bundled
/// corpus with its tokenizer, records where they came from, and `kiln export` writes the
/// result back out.
#[test]
fn train_from_an_imported_model_then_export() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m");
    write_tiny_llama(&m);
    let run = dir.path().join("run");
    let o = kiln(&[
        "train",
        "--init-from",
        m.to_str().unwrap(),
        "--out",
        run.to_str().unwrap(),
        "train.steps=2",
        "train.seq_len=16",
        "train.micro_batch=2",
        "train.eval_batches=1",
        "data.val_fraction=0.01",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("initialised from"), "{out}");
    let init: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("init_from.json")).unwrap())
            .unwrap();
    assert_eq!(init["format"], "hf");
    assert_eq!(
        init["sha256"]["model.safetensors"].as_str().unwrap().len(),
        64
    );
    let hf = dir.path().join("hf");
    let o = kiln(&[
        "export",
        "--run",
        run.to_str().unwrap(),
        "--to",
        hf.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    let p = pretrained::open(&hf).unwrap();
    assert_eq!(p.model.d_model, 16);
}

/// A GPT trained on each built-in tokenizer exports with a tokenizer.json (byte-level BPE
/// giving the same ids), so the exported directory imports back: evaluated on the same
/// held-out tokens it gives the run's loss exactly.
#[test]
fn runs_on_built_in_tokenizers_export_a_tokenizer_and_import_back() {
    let dir = tempfile::tempdir().unwrap();
    for tokenizer in ["byte", "gpt2"] {
        let run = dir.path().join(format!("run-{tokenizer}"));
        let hf = dir.path().join(format!("hf-{tokenizer}"));
        let o = kiln(&[
            "train",
            "--quiet",
            "--out",
            run.to_str().unwrap(),
            "model.d_model=32",
            "model.n_layers=1",
            "model.n_heads=2",
            "model.context=32",
            "train.seq_len=32",
            // The default micro-batch, which `eval --init-from` evaluates with too.
            "train.micro_batch=16",
            "train.steps=2",
            "train.eval_every=0",
            &format!("data.tokenizer={tokenizer}"),
        ]);
        assert!(o.status.success(), "{tokenizer}: {}", text(&o).1);
        let o = kiln(&[
            "export",
            "--run",
            run.to_str().unwrap(),
            "--to",
            hf.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{tokenizer}: {}", text(&o).1);
        assert!(hf.join("tokenizer.json").exists(), "{tokenizer}");
        let eval = |source: &[&str]| {
            let o = kiln(&[&["eval", "--batches", "2", "--seq-len", "32"][..], source].concat());
            let (out, err) = text(&o);
            assert!(o.status.success(), "{tokenizer}: {err}");
            out.lines()
                .find(|l| l.starts_with("val loss"))
                .unwrap()
                .to_string()
        };
        assert_eq!(
            eval(&["--run", run.to_str().unwrap()]),
            eval(&["--init-from", hf.to_str().unwrap()]),
            "{tokenizer}"
        );
    }
}

/// `--prompts` with several samples each writes one JSON line per prompt with its samples'
/// texts, token ids and log-probabilities; a seed reproduces them; bad generation arguments
/// and prompt files are refused with what to fix.
#[test]
fn generate_many_prompts_and_refuse_bad_ones() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m");
    write_tiny_llama(&m);
    let prompts = dir.path().join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"hello world\"}\n\n{\"prompt\": \"the king\"}\n",
    )
    .unwrap();
    let out = dir.path().join("o.jsonl");
    let args = |out: &Path| {
        vec![
            "generate".to_string(),
            "--init-from".into(),
            m.display().to_string(),
            "--prompts".into(),
            prompts.display().to_string(),
            "--num-samples".into(),
            "3".into(),
            "--tokens".into(),
            "5".into(),
            "--top-p".into(),
            "0.9".into(),
            "--device".into(),
            "cpu".into(),
            "--out".into(),
            out.display().to_string(),
        ]
    };
    let run = |a: Vec<String>| {
        Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(&a)
            .output()
            .unwrap()
    };
    let o = run(args(&out));
    assert!(o.status.success(), "{}", text(&o).1);
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    for l in &lines {
        let samples = l["samples"].as_array().unwrap();
        assert_eq!(samples.len(), 3);
        for s in samples {
            let n = s["tokens"].as_array().unwrap().len();
            assert_eq!(s["logprobs"].as_array().unwrap().len(), n);
            assert!(n <= 5);
        }
    }
    let again = dir.path().join("o2.jsonl");
    assert!(run(args(&again)).status.success());
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(&again).unwrap(),
        "seeded"
    );

    let bad_file = dir.path().join("bad.jsonl");
    std::fs::write(&bad_file, "{\"prompt\": \"ok\"}\nnot json\n").unwrap();
    let mp = m.display().to_string();
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (vec!["--top-p", "0"], 2, "--top-p"),
        (vec!["--top-p", "1.5"], 2, "--top-p"),
        (vec!["--min-p", "-0.1"], 2, "--min-p"),
        (vec!["--num-samples", "0"], 2, "--num-samples"),
        (vec!["--repetition-penalty", "0"], 2, "--repetition-penalty"),
        (vec!["--chat"], 2, "chat template"),
        (vec!["--stop", ""], 2, "--stop"),
        (vec!["--precision", "fp16"], 2, "--precision"),
        (vec!["--prompts", bad_file.to_str().unwrap()], 3, "line 2"),
    ];
    for (extra, code, phrase) in cases {
        let mut a = vec!["generate", "--init-from", mp.as_str(), "--device", "cpu"];
        a.extend(&extra);
        let o = kiln(&a);
        let (_, err) = text(&o);
        assert_eq!(o.status.code(), Some(code), "{extra:?}: {err}");
        assert!(err.contains(phrase), "{extra:?}: {err}");
    }
}

#[test]
fn an_exported_qwen3_with_query_key_norms_imports_back_to_the_same_logits() {
    let tok_dir = minilm_dir();
    let tok = tok_dir.to_str().unwrap();
    let cfg = ResolvedConfig::resolve(
        None,
        &[
            "model.kind=llama".into(),
            "model.d_model=32".into(),
            "model.n_layers=2".into(),
            "model.n_heads=4".into(),
            "model.n_kv_heads=2".into(),
            "model.head_dim=16".into(),
            "model.ffn_hidden=48".into(),
            "model.context=64".into(),
            "train.seq_len=64".into(),
            "model.qk_norm=true".into(),
            format!("data.tokenizer={tok}"),
        ],
    )
    .unwrap()
    .config;
    let vocab = kiln::train::model_vocab(&cfg).unwrap();
    let pool = MemoryPool::new(Device::Cpu);
    let mut original = models::build(&cfg.model, vocab, &pool, 5).unwrap();
    // Gains away from one, so a norm lost on the way would change the logits.
    let mut norms = 0;
    for p in original.params_mut() {
        if p.name.contains("_norm") {
            let v: Vec<f32> = (0..p.value.len())
                .map(|i| 0.5 + (i % 7) as f32 * 0.2)
                .collect();
            p.value.copy_from_host(&v).unwrap();
            norms += 1;
        }
    }
    assert_eq!(norms, 4, "a query and a key norm per layer");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("hf");
    export::export_hf(original.as_ref(), &cfg.model, vocab, tok, &out).unwrap();
    let p = pretrained::open(&out).unwrap();
    assert_eq!(p.source.architecture, "Qwen3ForCausalLM");
    assert!(p.model.llama().unwrap().qk_norm);
    let back = p.build(&pool).unwrap();
    let ids: Vec<u32> = (0..20).map(|i| (i * 977 + 13) % 30522).collect();
    let a = original.next_logits(&ids).unwrap();
    assert_eq!(a, back.next_logits(&ids).unwrap());
    // Without the norms the model computes something else.
    let mut plain_cfg = cfg.model.clone();
    if let FamilySettings::Llama(l) = &mut plain_cfg.family {
        l.qk_norm = false;
    }
    let plain = models::build(&plain_cfg, vocab, &pool, 5).unwrap();
    assert_ne!(a, plain.next_logits(&ids).unwrap());
    // And it trains from the directory (the import's settings carry the norms).
    let run = dir.path().join("run");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "train",
            "--profile",
            "none",
            "--device",
            "cpu",
            "-q",
            "--init-from",
        ])
        .arg(&out)
        .arg("--out")
        .arg(&run)
        .args([
            "train.steps=2",
            "train.seq_len=32",
            "train.micro_batch=2",
            "train.eval_batches=1",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(run.join("summary.json").is_file());
}

/// A model attending within a window exports as the architecture transformers reads it in
/// (Mistral: every layer windowed; Qwen2: first layers full, or biased projections), imports
/// back with its window and the same logits, which differ from full attention's; a Mistral
/// with `"sliding_window": null` and a Qwen2 whose window flag is off import without one.
#[test]
fn windowed_models_export_and_import_back_to_the_same_logits() {
    let tok_dir = minilm_dir();
    let tok = tok_dir.to_str().unwrap();
    let pool = MemoryPool::new(Device::Cpu);
    let ids: Vec<u32> = (0..40).map(|i| (i * 977 + 13) % 30522).collect();
    for (extra, arch, full_layers) in [
        (vec![], "MistralForCausalLM", 0),
        (vec!["model.full_attention_layers=1"], "Qwen2ForCausalLM", 1),
        (vec!["model.qkv_bias=true"], "Qwen2ForCausalLM", 0),
    ] {
        let mut settings: Vec<String> = [
            "model.kind=llama",
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.ffn_hidden=48",
            "model.context=64",
            "train.seq_len=64",
            "model.sliding_window=8",
        ]
        .iter()
        .chain(&extra)
        .map(|s| s.to_string())
        .collect();
        settings.push(format!("data.tokenizer={tok}"));
        let cfg = ResolvedConfig::resolve(None, &settings).unwrap().config;
        let vocab = kiln::train::model_vocab(&cfg).unwrap();
        let original = models::build(&cfg.model, vocab, &pool, 5).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("hf");
        export::export_hf(original.as_ref(), &cfg.model, vocab, tok, &out).unwrap();
        let p = pretrained::open(&out).unwrap();
        assert_eq!(p.source.architecture, arch, "{extra:?}");
        assert_eq!(
            {
                let l = p.model.llama().unwrap();
                (l.sliding_window, l.full_attention_layers)
            },
            (8, full_layers),
            "{extra:?}"
        );
        let back = p.build(&pool).unwrap();
        let a = original.next_logits(&ids).unwrap();
        assert_eq!(a, back.next_logits(&ids).unwrap(), "{extra:?}");
        let mut full = cfg.model.clone();
        if let FamilySettings::Llama(l) = &mut full.family {
            (l.sliding_window, l.full_attention_layers) = (0, 0);
        }
        let full = models::build(&full, vocab, &pool, 5).unwrap();
        assert_ne!(
            a,
            full.next_logits(&ids).unwrap(),
            "{extra:?}: the window matters"
        );
        // The window off, as transformers writes it, imports as full attention.
        edit_config(&out, |v| {
            if arch == "MistralForCausalLM" {
                v["sliding_window"] = serde_json::Value::Null;
            } else {
                v["use_sliding_window"] = serde_json::json!(false);
            }
        });
        assert_eq!(
            pretrained::open(&out)
                .unwrap()
                .model
                .llama()
                .unwrap()
                .sliding_window,
            0
        );
    }
}

/// A Phi-3 checkpoint (fused projections, LongRoPE, a window) trains from `--init-from`, may
/// take a context up to the one its long factors were made for (and no more), and exports
/// back to Phi-3's layout with its rotary settings.
#[test]
fn phi3_checkpoints_train_and_export_back_with_their_layout() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("phi3");
    let model = write_tiny_llama_with(
        &m,
        &[
            "model.rot_dim=4",
            "model.rope_original_context=16",
            "model.rope_short_factors=[1.0, 1.5]",
            "model.rope_long_factors=[2.0, 3.0]",
            "model.rope_attention_factor=1.1",
            "model.sliding_window=6",
            "model.checkpoint_arch=phi3",
        ],
        3,
    );
    let pool = MemoryPool::new(Device::Cpu);
    edit_config(&m, |v| {
        assert_eq!(v["architectures"][0], "Phi3ForCausalLM");
        assert_eq!(v["sliding_window"], 6);
        assert_eq!(v["rope_scaling"]["rope_type"], "longrope");
        v["max_position_embeddings"] = serde_json::json!(64);
    });
    let p = pretrained::open(&m).unwrap();
    assert_eq!((p.model.context, p.longest_context), (16, 64));
    let ids: Vec<u32> = (0..12).map(|i| (i * 977 + 13) % 30522).collect();
    let want = model.next_logits(&ids).unwrap();
    assert_eq!(p.build(&pool).unwrap().next_logits(&ids).unwrap(), want);

    let run = dir.path().join("run");
    let train = |run: &Path, context: &str| {
        kiln(&[
            "train",
            "--init-from",
            m.to_str().unwrap(),
            "--out",
            run.to_str().unwrap(),
            "train.steps=2",
            &format!("model.context={context}"),
            &format!("train.seq_len={context}"),
            "train.micro_batch=2",
            "train.eval_batches=1",
            "data.val_fraction=0.01",
        ])
    };
    let o = train(&run, "32");
    assert!(o.status.success(), "{}", text(&o).1);
    let o = train(&dir.path().join("too-long"), "128");
    assert_eq!(o.status.code(), Some(2), "{}", text(&o).1);
    assert!(text(&o).1.contains("at most 64"), "{}", text(&o).1);
    assert!(!dir.path().join("too-long").exists(), "nothing written");

    let hf = dir.path().join("hf");
    let o = kiln(&[
        "export",
        "--run",
        run.to_str().unwrap(),
        "--to",
        hf.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o).1);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "Phi3ForCausalLM");
    assert_eq!(
        config["rope_scaling"]["long_factor"],
        serde_json::json!([2.0, 3.0])
    );
    let back = pretrained::open(&hf).unwrap();
    let l = back.model.llama().unwrap();
    assert_eq!(l.rope_short_factors, vec![1.0, 1.5]);
    assert!((l.rope_attention_factor - 1.1).abs() < 1e-12);
    assert_eq!((l.sliding_window, l.rot_dim), (6, 4));
}
