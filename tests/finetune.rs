//! Fine-tuning end to end on the CPU: low-rank adapters over a frozen tiny Llama (exported as a
//! Hugging Face directory with SmolLM2's tokenizer and chat template), chat data masked to the
//! assistant turns, adapters in PEFT's format, bit-exact resume, and the SCU penalty reaching
//! the adapters.

mod common;

use common::fixtures::smollm2_gguf;
use kiln::config::ResolvedConfig;
use kiln::engine::{Device, MemoryPool};
use kiln::models::{self, export};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("kiln runs")
}

fn ok(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "kiln failed: {err}");
    String::from_utf8_lossy(&o.stdout).into_owned() + &err
}

/// `kiln export --run RUN --to TO`, which must succeed.
fn export_run(run: &Path, to: &Path) {
    ok(&kiln(&[
        "export",
        "--run",
        run.to_str().unwrap(),
        "--to",
        to.to_str().unwrap(),
    ]));
}

/// A tiny random Llama with SmolLM2's tokenizer and chat template, as a Hugging Face
/// directory `dir/base`.
fn tiny_llama(dir: &Path) -> PathBuf {
    let family = [
        "model.kind=llama",
        "model.n_kv_heads=2",
        "model.ffn_hidden=64",
    ];
    random_base(&dir.join("base"), &family, 3, |_| {})
}

/// `kiln generate -i` on the CPU over `base`, with a system message and greedy replies of
/// 4 tokens, reading `input` as the user's lines.
fn converse(base: &Path, input: &str) -> Output {
    let args = [
        "generate",
        "--init-from",
        base.to_str().unwrap(),
        "--device",
        "cpu",
        "-i",
        "--system",
        "Be brief.",
        "--tokens",
        "4",
        "--temperature",
        "0",
    ];
    common::kiln_with_stdin(&args, input)
}

/// [`tiny_llama`] and chat data from the bundled corpus.
fn fixture(dir: &Path) -> (PathBuf, PathBuf) {
    let base = tiny_llama(dir);
    let text = kiln::data::Corpus::load(None).unwrap().text;
    let speeches: Vec<&str> = text
        .split("\n\n")
        .map(str::trim)
        .filter(|s| s.len() > 20 && s.len() < 120 && !s.contains('['))
        .take(120)
        .collect();
    let mut lines = String::new();
    for w in speeches.windows(2) {
        let msgs = serde_json::json!({"messages": [
            {"role": "user", "content": w[0]},
            {"role": "assistant", "content": w[1]},
        ]});
        lines.push_str(&format!("{msgs}\n"));
    }
    let data = dir.join("chat.jsonl");
    std::fs::write(&data, lines).unwrap();
    (base, data)
}

const COMMON: &[&str] = &[
    "--device",
    "cpu",
    "-q",
    "train.micro_batch=4",
    "train.seq_len=64",
    "train.eval_batches=2",
    "train.log_every=1",
    "train.eval_every=0",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
    "lora.rank=4",
];

fn finetune(base: &Path, data: &Path, out: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "finetune",
        "--init-from",
        base.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(COMMON);
    args.extend_from_slice(extra);
    ok(&kiln(&args))
}

fn tensors(path: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(k, t)| (k, t.data().to_vec()))
        .collect();
    v.sort();
    v
}

fn last_ckpt(run: &Path) -> PathBuf {
    let dir = run.join("checkpoints");
    let mut steps: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("step_")
        })
        .collect();
    steps.sort_by_key(|p| {
        p.file_name().unwrap().to_string_lossy()[5..]
            .parse::<u64>()
            .unwrap()
    });
    steps.pop().unwrap()
}

/// Only adapters train and are saved; the base stays bit-identical; PEFT's names and config
/// come out; the merged export changes the base exactly where adapters are.
#[test]
fn lora_trains_adapters_only_and_writes_peft_format() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let run = tmp.path().join("run");
    let out = finetune(&base, &data, &run, &["train.steps=4"]);
    assert!(out.contains("14 modules in PEFT's format"), "{out}");
    let saved = tensors(&last_ckpt(&run).join("model.safetensors"));
    assert!(!saved.is_empty());
    assert!(
        saved.iter().all(|(k, _)| k.contains(".lora.")),
        "only adapters saved"
    );
    // 2 layers x 7 projections x (A, B).
    assert_eq!(saved.len(), 28);
    let adapter = run.join("adapter");
    let peft = tensors(&adapter.join("adapter_model.safetensors"));
    assert_eq!(peft.len(), 28);
    assert!(
        peft.iter()
            .any(|(k, _)| k == "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight")
    );
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["r"], 4);
    // Adapters moved away from their zero start.
    let (_, b) = peft
        .iter()
        .find(|(k, _)| k.ends_with("q_proj.lora_B.weight"))
        .unwrap();
    assert!(b.iter().any(|&x| x != 0));

    // The frozen base inside the trained run equals the base on disk, bit for bit.
    let loaded = kiln::train::load_run(&run, None).unwrap();
    let p = kiln::models::import::pretrained::open(&base).unwrap();
    for param in loaded.model.params().iter().filter(|p| p.frozen) {
        let want = &p.weights[&param.name].data;
        assert_eq!(
            &param.value.to_vec().unwrap(),
            want,
            "{} unchanged",
            param.name
        );
    }
    // The base with the PEFT adapter samples what the run samples.
    let greedy = |args: &[&str]| {
        let mut v = vec![
            "generate",
            "--prompt",
            "ROMEO:",
            "--temperature",
            "0",
            "--tokens",
            "12",
        ];
        v.extend_from_slice(args);
        let o = kiln(&v);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    // The run keeps its base's tokenizer, so it stops on the same end-of-turn ids and renders
    // the same chat template.
    for chat in [&[][..], &["--chat"][..]] {
        let from_run = greedy(&[&["--run", run.to_str().unwrap()][..], chat].concat());
        let from_adapter = greedy(
            &[
                &[
                    "--init-from",
                    base.to_str().unwrap(),
                    "--adapter",
                    adapter.to_str().unwrap(),
                ][..],
                chat,
            ]
            .concat(),
        );
        assert_eq!(
            from_run, from_adapter,
            "base + PEFT adapter decodes as the run ({chat:?})"
        );
        assert!(from_run.len() > 6, "{chat:?}: {from_run:?}");
    }
    // Merged export: the base plus scale * B A.
    let merged = tmp.path().join("merged");
    export_run(&run, &merged);
    let m = kiln::models::import::pretrained::open(&merged).unwrap();
    let q = "layers.0.attn.qkv.weight";
    assert_ne!(
        m.weights[q].data, p.weights[q].data,
        "adapters merged into q/k/v"
    );
    assert_eq!(
        m.weights["embed.weight"].data,
        p.weights["embed.weight"].data
    );
    // `kiln merge` writes what the merged export wrote, from the run or from the base on disk
    // with the PEFT adapter.
    let from_run = tmp.path().join("merge-run");
    let said = ok(&kiln(&[
        "merge",
        "--run",
        run.to_str().unwrap(),
        "--to",
        from_run.to_str().unwrap(),
    ]));
    assert!(!said.contains("note: the run trained"), "{said}");
    let from_adapter = tmp.path().join("merge-adapter");
    ok(&kiln(&[
        "merge",
        "--init-from",
        base.to_str().unwrap(),
        "--adapter",
        adapter.to_str().unwrap(),
        "--to",
        from_adapter.to_str().unwrap(),
    ]));
    let exported = tensors(&merged.join("model.safetensors"));
    assert_eq!(tensors(&from_run.join("model.safetensors")), exported);
    assert_eq!(tensors(&from_adapter.join("model.safetensors")), exported);
}

/// `kiln merge` needs adapters: a run that trained every weight, or a base without
/// `--adapter`, is refused before anything is written.
#[test]
fn merge_refuses_a_model_without_adapters() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let run = tmp.path().join("full");
    finetune(&base, &data, &run, &["--full", "train.steps=1"]);
    let to = tmp.path().join("merged");
    let refused = |args: &[&str], phrase: &str| {
        let o = kiln(args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(phrase), "{args:?}: wanted {phrase:?} in {err}");
    };
    let t = to.to_str().unwrap();
    refused(
        &["merge", "--run", run.to_str().unwrap(), "--to", t],
        "no adapters to merge; kiln export",
    );
    refused(
        &["merge", "--init-from", base.to_str().unwrap(), "--to", t],
        "--adapter",
    );
    assert!(!to.exists(), "nothing written");
}

/// A tiny random model of `family` (2 layers of 32, 4 heads, context 64, seeded by `seed`,
/// its parameters then changed by `adjust`) with SmolLM2's tokenizer and chat template,
/// exported as a Hugging Face directory at `dir`.
fn random_base(
    dir: &Path,
    family: &[&str],
    seed: u64,
    adjust: impl FnOnce(&mut dyn models::Model),
) -> PathBuf {
    let tok = smollm2_gguf().display().to_string();
    let mut overrides: Vec<String> = family.iter().map(|s| s.to_string()).collect();
    overrides.extend([
        "model.d_model=32".into(),
        "model.n_layers=2".into(),
        "model.n_heads=4".into(),
        "model.context=64".into(),
        "train.seq_len=64".into(),
        format!("data.tokenizer={tok}"),
    ]);
    let cfg = ResolvedConfig::resolve(None, &overrides).unwrap().config;
    let vocab = kiln::train::model_vocab(&cfg).unwrap();
    let mut model = models::build(&cfg.model, vocab, &MemoryPool::new(Device::Cpu), seed).unwrap();
    adjust(model.as_mut());
    export::export_hf(model.as_ref(), &cfg.model, vocab, &tok, dir).unwrap();
    dir.to_path_buf()
}

/// A tiny random GPT exported as GPT2LMHeadModel (SmolLM2's tokenizer, as the Llama fixture).
fn gpt_base(dir: &Path) -> PathBuf {
    random_base(&dir.join("gpt2"), &["model.kind=gpt"], 5, |model| {
        // The tied head at GPT-2's init (std 0.02) keeps every logit within about 0.6 of the
        // others, which adapters on a frozen base can barely move; a wider table lets them.
        for p in model.params_mut() {
            if p.name == "wte.weight" {
                let v: Vec<f32> = p.value.to_vec().unwrap().iter().map(|x| x * 25.0).collect();
                p.value.copy_from_host(&v).unwrap();
            }
        }
    })
}

/// LoRA and QLoRA over a GPT-2 base: the default targets adapt every projection under
/// GPT2LMHeadModel's module names, PEFT's config records its Conv1D layout, the base stays
/// bit-identical, base + adapter decodes as the run, and the merged export moves c_attn.
#[test]
fn gpt2_lora_and_qlora_write_peft_adapters_under_gpt2_names() {
    let tmp = tempfile::tempdir().unwrap();
    let (_, data) = fixture(tmp.path());
    let base = gpt_base(tmp.path());
    let run = tmp.path().join("run");
    let out = finetune(&base, &data, &run, &["train.steps=6"]);
    assert!(out.contains("8 modules in PEFT's format"), "{out}");
    let adapter = run.join("adapter");
    let peft = tensors(&adapter.join("adapter_model.safetensors"));
    assert_eq!(peft.len(), 16, "2 blocks x 4 projections x (A, B)");
    for m in ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"] {
        let k = format!("base_model.model.transformer.h.1.{m}.lora_B.weight");
        let (_, b) = peft.iter().find(|(name, _)| *name == k).expect(&k);
        assert!(b.iter().any(|&x| x != 0), "{k} trained");
    }
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["fan_in_fan_out"], true);
    assert_eq!(
        cfg["target_modules"],
        serde_json::json!(["c_attn", "c_proj", "c_fc"])
    );
    let loaded = kiln::train::load_run(&run, None).unwrap();
    let p = kiln::models::import::pretrained::open(&base).unwrap();
    let frozen: Vec<_> = loaded
        .model
        .params()
        .into_iter()
        .filter(|p| p.frozen)
        .collect();
    assert_eq!(
        frozen.len(),
        2 + 2 * 12 + 2,
        "embeddings, blocks, final norm"
    );
    for param in frozen {
        assert_eq!(
            &param.value.to_vec().unwrap(),
            &p.weights[&param.name].data,
            "{} unchanged",
            param.name
        );
    }
    let stdout = |args: &[&str]| {
        let o = kiln(args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let (base_s, adapter_s) = (base.to_str().unwrap(), adapter.to_str().unwrap());
    let greedy = |source: &[&str]| {
        let mut v = vec!["generate", "--prompt", "ROMEO:", "--temperature", "0"];
        v.extend_from_slice(&["--tokens", "12"]);
        v.extend_from_slice(source);
        stdout(&v)
    };
    let from_run = greedy(&["--run", run.to_str().unwrap()]);
    let with_adapter = greedy(&["--init-from", base_s, "--adapter", adapter_s]);
    assert_eq!(
        from_run, with_adapter,
        "base + PEFT adapter decodes as the run"
    );
    let merged = tmp.path().join("merged");
    export_run(&run, &merged);
    // The held-out loss of base + adapter is the merged model's, and not the base's.
    let eval = |source: &[&str]| {
        let out = stdout(&[&["eval", "--batches", "2"][..], source].concat());
        out.lines()
            .find(|l| l.starts_with("val loss"))
            .unwrap()
            .to_string()
    };
    let adapted = eval(&["--init-from", base_s, "--adapter", adapter_s]);
    assert_eq!(adapted, eval(&["--init-from", merged.to_str().unwrap()]));
    assert_ne!(adapted, eval(&["--init-from", base_s]));
    let m = kiln::models::import::pretrained::open(&merged).unwrap();
    let (qkv, wte) = ("blocks.0.attn.qkv.weight", "wte.weight");
    assert_ne!(
        m.weights[qkv].data, p.weights[qkv].data,
        "merged into c_attn"
    );
    assert_eq!(m.weights[wte].data, p.weights[wte].data);

    // QLoRA: the projections in NF4 under the same adapters; the held-out loss falls below
    // the base's (the same evaluation batches, so no sampling noise).
    let qrun = tmp.path().join("qlora");
    let out = finetune(
        &base,
        &data,
        &qrun,
        &["--qlora", "train.steps=24", "optim.lr=2e-2"],
    );
    assert!(out.contains("8 modules in PEFT's format"), "{out}");
    let loss = |line: &str| -> f64 { line.split_whitespace().nth(2).unwrap().parse().unwrap() };
    let (tuned, plain) = (
        loss(&eval(&["--run", qrun.to_str().unwrap()])),
        loss(&eval(&["--init-from", base_s])),
    );
    assert!(
        tuned < plain - 0.02,
        "QLoRA held-out loss {tuned} against the base's {plain}"
    );
}

/// Resuming a fine-tune gives the adapters and optimizer state of an uninterrupted run, bit
/// for bit, with the SCU controller's state carried along.
#[test]
fn lora_resume_with_scu_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let scu = ["scu.enabled=true", "scu.target=0.05", "train.steps=6"];
    let whole = tmp.path().join("whole");
    finetune(&base, &data, &whole, &scu);
    let parts = tmp.path().join("parts");
    let mut first = scu.to_vec();
    first.extend(["--stop-after", "3"]);
    finetune(&base, &data, &parts, &first);
    let mut args = vec!["finetune", "--resume", parts.to_str().unwrap()];
    args.extend_from_slice(COMMON);
    args.extend_from_slice(&scu);
    ok(&kiln(&args));
    for f in ["model.safetensors", "optimizer.safetensors"] {
        assert_eq!(
            tensors(&last_ckpt(&whole).join(f)),
            tensors(&last_ckpt(&parts).join(f)),
            "{f} after resume"
        );
    }
    let hist = |r: &Path| std::fs::read_to_string(r.join("scu_history.jsonl")).unwrap();
    assert_eq!(hist(&whole).lines().count(), 6);
    assert_eq!(hist(&whole).lines().last(), hist(&parts).lines().last());
}

/// A run that keeps no checkpoint trains, says the adapters were not written, and exits 0.
#[test]
fn a_run_without_checkpoints_ends_cleanly_without_adapters() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let run = tmp.path().join("run");
    let out = finetune(
        &base,
        &data,
        &run,
        &["train.steps=2", "train.save_final=false"],
    );
    assert!(out.contains("adapters: not written"), "{out}");
    assert!(!run.join("adapter").exists());
}

/// Adapter dropout: a run with `lora.dropout` trains other adapters than one without, resumes
/// bit for bit (the masks are a function of the seed, step and pass), and writes the
/// probability into PEFT's adapter_config.json.
#[test]
fn lora_dropout_changes_training_and_resumes_bit_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let plain = tmp.path().join("plain");
    finetune(&base, &data, &plain, &["train.steps=4"]);
    let drop = ["lora.dropout=0.3", "train.steps=4"];
    let whole = tmp.path().join("whole");
    finetune(&base, &data, &whole, &drop);
    let adapters = |r: &Path| tensors(&last_ckpt(r).join("model.safetensors"));
    assert_ne!(
        adapters(&plain),
        adapters(&whole),
        "dropout changes the adapters"
    );
    let parts = tmp.path().join("parts");
    let mut first = drop.to_vec();
    first.extend(["--stop-after", "2"]);
    finetune(&base, &data, &parts, &first);
    let mut args = vec!["finetune", "--resume", parts.to_str().unwrap()];
    args.extend_from_slice(COMMON);
    args.extend_from_slice(&drop);
    ok(&kiln(&args));
    assert_eq!(adapters(&whole), adapters(&parts), "resumed with dropout");
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(whole.join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert!(
        (cfg["lora_dropout"].as_f64().unwrap() - 0.3).abs() < 1e-9,
        "{cfg}"
    );
    // Out of range is refused with the setting's exit code.
    let o = kiln(&[
        "finetune",
        "--init-from",
        base.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--out",
        tmp.path().join("bad").to_str().unwrap(),
        "--device",
        "cpu",
        "lora.dropout=1",
    ]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("lora.dropout"));
}

/// lambda = 0 is plain LoRA bit for bit; a positive fixed lambda changes the adapters; with
/// the controller on, S moves toward S*.
#[test]
fn scu_penalty_reaches_the_adapters() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let run = |name: &str, extra: &[&str]| {
        let dir = tmp.path().join(name);
        // Weight decay off in all three: the SCU turns it off for the adapters.
        let mut e = vec!["train.steps=5", "optim.weight_decay=0"];
        e.extend_from_slice(extra);
        finetune(&base, &data, &dir, &e);
        tensors(&last_ckpt(&dir).join("model.safetensors"))
    };
    let plain = run("plain", &[]);
    let zero = run(
        "zero",
        &["scu.enabled=true", "scu.control=false", "scu.lambda_init=0"],
    );
    assert!(plain == zero, "lambda = 0 is plain LoRA, bit for bit");
    let fixed = run(
        "fixed",
        &[
            "scu.enabled=true",
            "scu.control=false",
            "scu.lambda_init=10",
            "scu.lambda_min=1e-4",
        ],
    );
    assert!(
        plain != fixed,
        "a positive lambda changes the adapter weights"
    );

    // The controller: S starts above a target of 0.1, so lambda rises and the penalty
    // shrinks the adapters; S_hat approaches S*. (At a large learning rate Adam's normalised
    // steps shrink A at full speed whatever lambda is, while B is still near zero and A gets
    // no data gradient: S then falls past S* faster than the controller can act.)
    let dir = tmp.path().join("ctl");
    finetune(
        &base,
        &data,
        &dir,
        &[
            "train.steps=30",
            "optim.lr=1e-3",
            "scu.enabled=true",
            "scu.target=0.1",
            "scu.sigma=0.05",
        ],
    );
    let hist: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("scu_history.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let gap = |r: &serde_json::Value| (r["S_hat"].as_f64().unwrap() - 0.1).abs();
    let (first, last) = (&hist[0], hist.last().unwrap());
    assert!(
        gap(last) < gap(first),
        "S_hat approaches S*: {first} -> {last}"
    );
    assert!(
        last["lambda"].as_f64().unwrap() != 1.0,
        "lambda moved: {last}"
    );
}

/// Bad input: each refused with a message naming the problem, before training.
#[test]
fn finetune_refuses_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let fails = |extra: &[&str], data: &Path, phrase: &str, code: i32| {
        let out = tmp.path().join(format!("bad-{}", phrase.len()));
        let mut args = vec![
            "finetune",
            "--init-from",
            base.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--device",
            "cpu",
            "train.steps=1",
            "train.seq_len=64",
        ];
        args.extend_from_slice(extra);
        let o = kiln(&args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(code), "{extra:?}: {err}");
        assert!(
            err.contains(phrase),
            "{extra:?}: wanted {phrase:?} in {err}"
        );
    };
    fails(&["lora.rank=33"], &data, "lora.rank = 33 is larger", 2);
    fails(&["lora.targets=qkv_proj"], &data, "q_proj", 2);
    fails(
        &["scu.enabled=true", "scu.target=1.5"],
        &data,
        "scu.target",
        2,
    );
    let missing = tmp.path().join("missing.jsonl");
    std::fs::write(
        &missing,
        "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"c\"}\n",
    )
    .unwrap();
    fails(&[], &missing, "line 2", 3);
    let empty = tmp.path().join("empty.jsonl");
    // Prompts longer than a row: their completions are cut away entirely.
    let long = "so long a prompt ".repeat(40);
    let line = serde_json::json!({"prompt": long, "completion": "yes"});
    std::fs::write(&empty, format!("{line}\n{line}\n")).unwrap();
    fails(
        &["data.format=prompt_completion"],
        &empty,
        "no trainable tokens",
        3,
    );
}

/// The mean training loss of a run's first and last three steps (metrics.jsonl).
fn first_and_last_loss(run: &Path) -> (f64, f64) {
    let losses: Vec<f64> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|r| r["loss"].as_f64())
        .collect();
    assert!(losses.len() >= 6, "{losses:?}");
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    (mean(&losses[..3]), mean(&losses[losses.len() - 3..]))
}

/// QLoRA: the projections kept in NF4, the loss falls, only adapters are saved (in PEFT's
/// format), and the merged export is the dequantised base plus the adapters.
#[test]
fn qlora_trains_over_an_nf4_base_and_writes_peft_format() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let run = tmp.path().join("run");
    // No adapter on the down projection: every projection is frozen, so all are in NF4.
    let out = finetune(
        &base,
        &data,
        &run,
        &[
            "--qlora",
            "train.steps=16",
            "lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj",
        ],
    );
    assert!(out.contains("12 modules in PEFT's format"), "{out}");
    let (first, last) = first_and_last_loss(&run);
    assert!(last < first - 0.05, "loss falls: {first} -> {last}");
    let saved = tensors(&last_ckpt(&run).join("model.safetensors"));
    assert_eq!(saved.len(), 24);
    assert!(saved.iter().all(|(k, _)| k.contains(".lora.")));
    let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(config.contains("quantize = \"nf4\""), "{config}");
    let peft = tensors(&run.join("adapter").join("adapter_model.safetensors"));
    assert_eq!(peft.len(), 24);

    // The run reloads with its base re-quantised; merged, its projections are dense again:
    // the down projection, which has no adapter, differs from the base on disk by the NF4
    // error alone.
    let merged = tmp.path().join("merged");
    export_run(&run, &merged);
    let m = kiln::models::import::pretrained::open(&merged).unwrap();
    let p = kiln::models::import::pretrained::open(&base).unwrap();
    let q = "layers.1.mlp.down.weight";
    let (a, b) = (&m.weights[q].data, &p.weights[q].data);
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    // Half the widest gap of the NF4 code book (0.723 to 1) times a block's absmax, at most.
    assert!(
        worst > 0.0 && worst <= 0.15 * scale,
        "NF4 error: {worst} against weights up to {scale}"
    );
    assert_eq!(
        m.weights["embed.weight"].data, p.weights["embed.weight"].data,
        "the embedding stays in the compute dtype"
    );
}

/// Resuming a QLoRA fine-tune re-quantises the base to the same bits and continues to the
/// adapters and optimizer state of an uninterrupted run, bit for bit.
#[test]
fn qlora_resume_is_bit_exact() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let extra = ["--qlora", "train.steps=6"];
    let whole = tmp.path().join("whole");
    finetune(&base, &data, &whole, &extra);
    let parts = tmp.path().join("parts");
    let mut first = extra.to_vec();
    first.extend(["--stop-after", "3"]);
    finetune(&base, &data, &parts, &first);
    let mut args = vec!["finetune", "--resume", parts.to_str().unwrap()];
    args.extend_from_slice(COMMON);
    args.push("train.steps=6");
    ok(&kiln(&args));
    for f in ["model.safetensors", "optimizer.safetensors"] {
        assert_eq!(
            tensors(&last_ckpt(&whole).join(f)),
            tensors(&last_ckpt(&parts).join(f)),
            "{f} after resume"
        );
    }
    // --qlora only starts a fine-tune.
    let mut again = vec!["finetune", "--resume", parts.to_str().unwrap(), "--qlora"];
    again.extend_from_slice(COMMON);
    let o = kiln(&again);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("drop --qlora"));
}

/// The trainer's own books: the NF4 base takes the bf16 projections' bytes less the NF4
/// bytes and the workspace, to the byte; the model with the NF4 base computes the loss of
/// the same model with its projections dequantised into dense weights, bit for bit.
#[test]
fn qlora_books_fewer_base_bytes_and_computes_as_its_dequantised_weights() {
    use kiln::train::{Precision, Trainer};
    let tmp = tempfile::tempdir().unwrap();
    let (base, _) = fixture(tmp.path());
    let p = kiln::models::import::pretrained::open(&base).unwrap();
    let config = |quantize: &str| {
        let mut o = p.overrides();
        o.extend([
            "lora.enabled=true".to_string(),
            format!("lora.base={}", base.display()),
            format!("lora.quantize={quantize}"),
            "train.seq_len=16".to_string(),
        ]);
        ResolvedConfig::resolve(None, &o).unwrap().config
    };
    let build = |quantize: &str, precision: Precision| {
        let pool = MemoryPool::new(Device::Cpu);
        let t = Trainer::with_base(&config(quantize), p.vocab, &pool, precision, Some(&p)).unwrap();
        (t, pool)
    };
    let (lora, lora_pool) = build("none", Precision::Bf16Mixed);
    let (qlora, qlora_pool) = build("nf4", Precision::Bf16Mixed);
    assert!(lora.quantized.is_none());
    let q = qlora.quantized.unwrap();
    // 2 blocks x (qkv [64, 32], out [32, 32], gate/up [128, 32], down [32, 64]).
    assert_eq!((q.weights, q.values), (8, 2 * (2048 + 1024 + 4096 + 2048)));
    assert_eq!(
        q.workspace_bytes,
        4096 * 2,
        "the largest projection in bf16"
    );
    assert!(qlora.base_weight_bytes() < lora.base_weight_bytes());
    assert_eq!(
        lora.base_weight_bytes() - qlora.base_weight_bytes(),
        2 * q.values - q.nf4_bytes
    );
    assert_eq!(
        lora_pool.stats().current - qlora_pool.stats().current,
        2 * q.values - q.nf4_bytes - q.workspace_bytes,
        "the pool books the NF4 base and its workspace in place of the bf16 projections"
    );

    let (mut qlora, _) = build("nf4", Precision::Fp32);
    let tokens: Vec<u32> = (0..2 * 17).map(|i| (i * 7919 % 300) as u32).collect();
    let (inputs, targets): (Vec<u32>, Vec<u32>) = (
        tokens.chunks(17).flat_map(|c| c[..16].to_vec()).collect(),
        tokens.chunks(17).flat_map(|c| c[1..].to_vec()).collect(),
    );
    let nf4_loss = qlora.model.loss(&inputs, &targets, 2, 16).unwrap();
    // Fresh adapters add exactly zero, so merging leaves the dequantised weights as they are.
    qlora.model.merge_lora().unwrap();
    let dense_loss = qlora.model.loss(&inputs, &targets, 2, 16).unwrap();
    assert_eq!(nf4_loss.to_bits(), dense_loss.to_bits());
    let (lora32, _) = build("none", Precision::Fp32);
    let exact = lora32.model.loss(&inputs, &targets, 2, 16).unwrap();
    assert!(
        nf4_loss != exact && (nf4_loss - exact).abs() < 0.05 * exact,
        "NF4 moves the loss a little: {nf4_loss} vs {exact}"
    );
}

/// `lora.quantize` is refused without adapters and for an unknown format, before training.
#[test]
fn qlora_refuses_bad_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let refuse = |args: &[&str], phrase: &str| {
        let o = kiln(args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(phrase), "{args:?}: wanted {phrase:?} in {err}");
    };
    let (b, d) = (base.to_str().unwrap(), data.to_str().unwrap());
    let out = tmp.path().join("bad");
    let o = out.to_str().unwrap();
    refuse(
        &[
            "finetune",
            "--init-from",
            b,
            "--data",
            d,
            "--out",
            o,
            "--full",
            "--device",
            "cpu",
            "lora.quantize=nf4",
        ],
        "needs lora.enabled=true",
    );
    refuse(
        &["train", "--device", "cpu", "--out", o, "lora.quantize=nf4"],
        "lora.quantize",
    );
    refuse(
        &[
            "finetune",
            "--init-from",
            b,
            "--data",
            d,
            "--out",
            o,
            "--device",
            "cpu",
            "lora.quantize=nf8",
        ],
        "nf4",
    );
    refuse(
        &[
            "finetune",
            "--init-from",
            b,
            "--data",
            d,
            "--out",
            o,
            "--full",
            "--qlora",
        ],
        "--full",
    );
    assert!(!out.exists(), "nothing written");
}

/// `kiln plan` of a QLoRA run reads the base's shape and shows its NF4 bytes, the workspace
/// and the saving against the bf16 base.
#[test]
fn plan_shows_the_nf4_base_and_its_saving() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, _) = fixture(tmp.path());
    let lora_base = format!("lora.base={}", base.display());
    let out = ok(&kiln(&[
        "plan",
        "--gpu",
        "h100-80gb",
        "lora.enabled=true",
        &lora_base,
        "lora.quantize=nf4",
        "train.precision=bf16-mixed",
        "train.seq_len=64",
    ]));
    assert!(out.contains("18432 projection weights in NF4"), "{out}");
    assert!(out.contains("saving against bf16"), "{out}");
    assert!(out.contains("dequant workspace"), "{out}");
    // The whole step is planned on a meta device: adapters trained, the base not.
    assert!(
        out.contains("planned by running construction and one optimizer step"),
        "{out}"
    );
    assert!(out.contains("largest micro-batch that fits"), "{out}");
    // The peak by purpose: the frozen base is weights without gradients.
    assert!(out.contains("at the peak, by purpose:"), "{out}");
    assert!(out.contains("the frozen base as stored"), "{out}");
    assert!(out.contains("by the operation that booked them"), "{out}");
    let json = ok(&kiln(&[
        "plan",
        "--gpu",
        "h100-80gb",
        "--json",
        "lora.enabled=true",
        &lora_base,
        "lora.quantize=nf4",
        "train.precision=bf16-mixed",
        "train.seq_len=64",
    ]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let (params, trained) = (
        v["params"].as_u64().unwrap(),
        v["trainable_params"].as_u64().unwrap(),
    );
    assert!(trained > 0 && trained < params / 4, "{json}");
    assert!(
        v["device_peak"].as_u64() > v["pool_peak"].as_u64(),
        "{json}"
    );
    assert!(v["largest_micro_batch"].as_u64().unwrap() >= 1, "{json}");
    // The parts by purpose add up to the device peak, the rounding aside.
    let parts: u64 = v["breakdown"]
        .as_object()
        .unwrap()
        .values()
        .map(|x| x.as_u64().unwrap())
        .sum();
    assert_eq!(parts, v["device_peak"].as_u64().unwrap(), "{json}");
    assert!(
        v["breakdown"]["gradients"].as_u64() < v["breakdown"]["master_weights"].as_u64(),
        "only adapters have gradients: {json}"
    );
    // A Llama step without adapters plans too, every parameter trained.
    let json = ok(&kiln(&[
        "plan",
        "--gpu",
        "h100-80gb",
        "--json",
        "model.kind=llama",
        "model.d_model=64",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "train.seq_len=64",
        "model.context=64",
    ]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["params"], v["trainable_params"], "{json}");
    assert!(v["fits"].as_bool().unwrap(), "{json}");
    // Its per-layer table counts every parameter the meta step built.
    let layers = v["layers"].as_array().unwrap();
    let mlp = layers
        .iter()
        .find(|l| l["layer"] == "block.mlp (SwiGLU)")
        .unwrap();
    assert_eq!(mlp["count"], 2, "{json}");
    let counted: u64 = layers
        .iter()
        .map(|l| l["params"].as_u64().unwrap() * l["count"].as_u64().unwrap())
        .sum();
    assert_eq!(counted, v["params"].as_u64().unwrap(), "{json}");
}

#[test]
fn bench_scu_compares_the_controller_with_fixed_lambdas_over_seeds() {
    let dir = tempfile::tempdir().unwrap();
    let (base, data) = fixture(dir.path());
    let out = dir.path().join("scu");
    let o = kiln(&[
        "bench",
        "scu",
        "--init-from",
        base.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--device",
        "cpu",
        "--steps",
        "4",
        "--seeds",
        "1,2",
        "--lambdas",
        "0,1",
        "--out",
        out.to_str().unwrap(),
        "train.micro_batch=4",
        "train.seq_len=64",
        "train.eval_batches=2",
        "train.eval_every=0",
        "optim.lr=1e-2",
        "lora.rank=4",
        "scu.target=0.05",
    ]);
    let text = ok(&o);
    assert!(
        text.contains("The controller reached") || text.contains("The controller did not win"),
        "{text}"
    );
    let results: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    let configs = results["configs"].as_array().unwrap();
    assert_eq!(configs.len(), 3, "the controller and two fixed lambdas");
    for c in configs {
        let seeds = c["seeds"].as_array().unwrap();
        assert_eq!(seeds.len(), 2);
        for s in seeds {
            assert!(s["val_bits_per_token"].as_f64().unwrap().is_finite());
        }
    }
    // A fixed lambda stays fixed; the controller moves its lambda.
    let lambdas = |c: &serde_json::Value| -> Vec<f64> {
        c["seeds"][0]["history"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h[2].as_f64().unwrap())
            .collect()
    };
    assert!(lambdas(&configs[2]).iter().all(|&l| l == 1.0));
    assert!(
        lambdas(&configs[0])
            .iter()
            .any(|&l| l != lambdas(&configs[0])[0])
    );
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("held-out bits/token"), "{md}");
    // Bad input: a negative lambda.
    let bad = kiln(&[
        "bench",
        "scu",
        "--init-from",
        base.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--lambdas=-1",
    ]);
    assert_eq!(bad.status.code(), Some(2));
}

/// `kiln generate --interactive` over a model of context 64: every line is a turn answered
/// with the turns before it; when the conversation outgrows the context its oldest turns are
/// dropped, a message too long on its own is refused, and the conversation goes on. Turns
/// reuse the key/value cache of the turns before.
#[test]
fn a_conversation_drops_its_oldest_turns_to_fit_the_context() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_llama(tmp.path());
    let long = "word ".repeat(80);
    let input = format!(
        "Good morrow, sir.\nHow fares the king?\n\nAnd the queen?\nWhat news from Padua?\n{long}\nFarewell.\n"
    );
    let o = converse(&base, &input);
    let err = ok(&o);
    assert!(err.contains("oldest turns were dropped"), "{err}");
    assert!(err.contains("say it in fewer words"), "{err}");
    // Six messages, one refused, the blank line skipped.
    assert!(err.contains("5 turns;"), "{err}");
    // Later turns run only what the cache kept from the turns before lacks.
    assert!(
        err.contains("more read from the conversation's cache"),
        "{err}"
    );
}

/// `--val-data FILE`: every example of `--data` trains and the file's examples validate (the
/// run says so and its config keeps the file, and `kiln eval` scores it as the run did); with
/// `train.keep_best` the adapters come from the best checkpoint; a file of another shape is
/// refused before anything is written.
#[test]
fn a_validation_file_validates_and_all_of_the_data_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, data) = fixture(tmp.path());
    let lines: Vec<String> = std::fs::read_to_string(&data)
        .unwrap()
        .lines()
        .map(|l| format!("{l}\n"))
        .collect();
    let (train, val) = (tmp.path().join("train.jsonl"), tmp.path().join("val.jsonl"));
    std::fs::write(&train, lines[..lines.len() - 7].concat()).unwrap();
    std::fs::write(&val, lines[lines.len() - 7..].concat()).unwrap();
    let run = tmp.path().join("run");
    let mut args = vec![
        "finetune",
        "--init-from",
        base.to_str().unwrap(),
        "--data",
        train.to_str().unwrap(),
        "--val-data",
        val.to_str().unwrap(),
        "--out",
        run.to_str().unwrap(),
        "train.steps=2",
    ];
    // Not quiet: the data line is the check.
    args.extend(COMMON.iter().filter(|a| **a != "-q"));
    // The adapters come from the best checkpoint when one is kept.
    args.extend(["train.eval_every=1", "train.keep_best=true"]);
    let out = ok(&kiln(&args));
    assert!(out.contains("from the best checkpoint (step "), "{out}");
    assert!(out.contains("(--checkpoint best)"), "{out}");
    let want = format!(
        "fine-tuning data: {} training and 7 validation examples",
        lines.len() - 7
    );
    assert!(out.contains(&want), "{out}");
    let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
    assert!(
        config.contains("val_corpus") && config.contains("val.jsonl"),
        "{config}"
    );
    // `kiln eval` scores the run's validation examples as its training did: the assistant
    // tokens of the validation file, the run's own last loss.
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    let want = format!(
        "val loss {:.4} nats/token",
        summary["val_loss"].as_f64().unwrap()
    );
    let ev = ok(&kiln(&["eval", "--run", run.to_str().unwrap()]));
    assert!(ev.contains(&want), "{want} in {ev}");

    let text = tmp.path().join("val.txt");
    std::fs::write(&text, "plain text\n").unwrap();
    let other = tmp.path().join("other");
    let o = kiln(&[
        "finetune",
        "--init-from",
        base.to_str().unwrap(),
        "--data",
        train.to_str().unwrap(),
        "--val-data",
        text.to_str().unwrap(),
        "--out",
        other.to_str().unwrap(),
        "--device",
        "cpu",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("reads as text") && err.contains("chat"),
        "{err}"
    );
    assert!(!other.exists());
}

/// `/undo` takes back the last exchange and `/save FILE` appends the conversation as a line
/// of chat messages, which `kiln generate --prompts` reads back; saving nothing is refused
/// without ending the conversation.
#[test]
fn a_conversation_takes_back_an_exchange_and_saves_itself() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tiny_llama(tmp.path());
    let saved = tmp.path().join("chats.jsonl");
    let input = format!(
        "Good morrow, sir.\n/undo\n/save {f}\nHow fares the king?\nAnd the queen?\n/undo\n/save {f}\n",
        f = saved.display()
    );
    let err = ok(&converse(&base, &input));
    assert!(err.contains("last exchange is taken back"), "{err}");
    assert!(err.contains("3 turns;"), "{err}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&saved)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The first save held the system message alone; the second, after taking back "And the
    // queen?", the system message and one exchange.
    assert_eq!(lines.len(), 2, "{lines:?}");
    let roles = |v: &serde_json::Value| -> Vec<String> {
        v["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["role"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(roles(&lines[0]), ["system"]);
    assert_eq!(roles(&lines[1]), ["system", "user", "assistant"]);
    assert_eq!(lines[1]["messages"][1]["content"], "How fares the king?");
    // The saved file is a --prompts file.
    let out = tmp.path().join("replies.jsonl");
    let mut again = vec![
        "generate",
        "--init-from",
        base.to_str().unwrap(),
        "--device",
        "cpu",
        "--chat",
        "--prompts",
        saved.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ];
    again.extend(["--tokens", "2"]);
    ok(&kiln(&again));
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), 2);
}
