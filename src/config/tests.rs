use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::error::edit_distance;
use super::*;

/// A file under the temp dir, removed on drop, named uniquely per process
/// and per call so parallel tests never collide.
struct TempFile(PathBuf);

impl TempFile {
    fn new(contents: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("kiln_config_test_{}_{n}.toml", std::process::id()));
        std::fs::write(&path, contents).expect("write temp config");
        Self(path)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn ov(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn resolve_err(file: Option<&Path>, overrides: &[&str]) -> String {
    match ResolvedConfig::resolve(file, &ov(overrides)) {
        Ok(r) => panic!("expected an error, got {:?}", r.config),
        Err(e) => e.to_string(),
    }
}

fn override_err(overrides: &[&str]) -> String {
    resolve_err(None, overrides)
}

/// Validates the defaults with one tweak and returns the error message.
fn validate_err(tweak: impl FnOnce(&mut Config)) -> String {
    let mut c = Config::default();
    tweak(&mut c);
    match c.validate() {
        Ok(()) => panic!("expected validation to fail for {c:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn defaults_resolve_and_validate() {
    let r = ResolvedConfig::resolve(None, &[]).expect("defaults resolve");
    assert_eq!(r.config, Config::default());
    Config::default().validate().expect("defaults validate");
    assert_eq!(r.config.train.micro_batch, 16);
    assert_eq!(r.config.optim.lr, 3e-3);
    assert_eq!(r.config.train.loss_scale_init, 65536.0);
    // Every key but the other families' (GPT has none of its own).
    assert_eq!(
        r.sources.len(),
        all_keys().len() - model::family_keys().len()
    );
    assert!(r.sources.values().all(|s| *s == Source::Default));
}

#[test]
fn key_table_matches_structs() {
    let from_structs: Vec<String> = default_flat().expect("flatten").into_keys().collect();
    let mut listed: Vec<String> = all_keys().iter().map(|k| k.to_string()).collect();
    listed.sort();
    assert_eq!(listed, from_structs);
    assert_eq!(all_keys()[0], "model.kind");
    assert_eq!(all_keys().last(), Some(&"polychromic.embedder"));
    for key in all_keys() {
        let help = key_help(key).expect("every key has help");
        assert!(!help.is_empty() && help.len() <= 60, "{key}: {help}");
    }
    assert_eq!(key_help("train.nope"), None);
}

#[test]
fn file_then_override_precedence_and_sources() {
    let f = TempFile::new(
        "[train]\nsteps = 50\nmicro_batch = 8\n\n[optim]\nlr = 1e-3\n\n[model]\ntied_head = false\n",
    );
    let r = ResolvedConfig::resolve(
        Some(f.path()),
        &ov(&["train.steps=70", "data.tokenizer=gpt2"]),
    )
    .expect("resolves");
    let file_src = Source::File(f.path().to_path_buf());

    assert_eq!(r.config.train.steps, 70);
    assert_eq!(r.sources["train.steps"], Source::Override);
    assert_eq!(r.config.train.micro_batch, 8);
    assert_eq!(r.sources["train.micro_batch"], file_src);
    assert_eq!(r.config.optim.lr, 1e-3);
    assert_eq!(r.sources["optim.lr"], file_src);
    assert!(!r.config.model.tied_head);
    assert_eq!(r.config.data.tokenizer, "gpt2");
    assert_eq!(r.sources["data.tokenizer"], Source::Override);
    assert_eq!(r.config.train.seq_len, 128);
    assert_eq!(r.sources["train.seq_len"], Source::Default);

    let rendered = r.render();
    let line = rendered
        .lines()
        .find(|l| l.starts_with("train.steps "))
        .expect("steps line");
    assert!(
        line.contains("= 70") && line.ends_with("# override"),
        "{line}"
    );
    let line = rendered
        .lines()
        .find(|l| l.starts_with("train.micro_batch "))
        .expect("micro_batch line");
    assert!(
        line.ends_with(&format!("# {}", f.path().display())),
        "{line}"
    );
}

#[test]
fn later_override_wins() {
    let r = ResolvedConfig::resolve(None, &ov(&["train.steps=5", "train.steps=9"])).expect("ok");
    assert_eq!(r.config.train.steps, 9);
}

#[test]
fn render_is_aligned_and_in_key_order() {
    let r = ResolvedConfig::resolve(None, &[]).expect("ok");
    let text = r.render();
    let lines: Vec<&str> = text.lines().collect();
    // The keys of the chosen kind only (GPT has none of its own).
    let keys: Vec<&str> = all_keys()
        .into_iter()
        .filter(|k| model::family_of_key(k).is_none())
        .collect();
    assert_eq!(lines.len(), keys.len());
    for (line, key) in lines.iter().zip(keys) {
        assert!(line.starts_with(key), "{line} should start with {key}");
        assert!(line.ends_with("# default"), "{line}");
    }
    let eq_cols: Vec<usize> = lines.iter().filter_map(|l| l.find(" = ")).collect();
    let hash_cols: Vec<usize> = lines.iter().filter_map(|l| l.find("  # ")).collect();
    assert_eq!(eq_cols.len(), lines.len());
    assert!(eq_cols.windows(2).all(|w| w[0] == w[1]), "{text}");
    assert!(hash_cols.windows(2).all(|w| w[0] == w[1]), "{text}");
    assert!(text.contains("train.micro_batch"));
    assert!(text.contains("\"gpt\""), "strings are shown quoted: {text}");
}

#[test]
fn unknown_key_in_override_suggests() {
    let msg = override_err(&["train.micro_bach=3"]);
    assert!(
        msg.contains("unknown config key 'train.micro_bach'"),
        "{msg}"
    );
    assert!(msg.contains("did you mean 'train.micro_batch'?"), "{msg}");
    assert!(msg.contains("override"), "{msg}");
}

#[test]
fn unknown_key_in_file_suggests_and_names_file() {
    let f = TempFile::new("[model]\ndmodel = 64\n");
    let msg = resolve_err(Some(f.path()), &[]);
    assert!(msg.contains("'model.dmodel'"), "{msg}");
    assert!(msg.contains("did you mean 'model.d_model'"), "{msg}");
    assert!(msg.contains(&f.path().display().to_string()), "{msg}");
}

#[test]
fn unknown_section_in_file_suggests() {
    let f = TempFile::new("[modle]\nd_model = 64\n");
    let msg = resolve_err(Some(f.path()), &[]);
    assert!(msg.contains("did you mean 'model.d_model'"), "{msg}");
}

#[test]
fn field_in_wrong_section_is_suggested() {
    let msg = override_err(&["train.lr=0.1"]);
    assert!(msg.contains("'optim.lr'"), "{msg}");
    let msg = override_err(&["train.batch=4"]);
    assert!(msg.contains("did you mean 'train.micro_batch'"), "{msg}");
    let msg = override_err(&["steps=10"]);
    assert!(msg.contains("'train.steps'"), "{msg}");
}

#[test]
fn unknown_key_without_close_match_lists_section() {
    let msg = override_err(&["optim.nesterov_dampening=0.1"]);
    assert!(msg.contains("valid keys in [optim]"), "{msg}");
    assert!(msg.contains("optim.warmup_steps"), "{msg}");
    let msg = override_err(&["optim.lr_schedule=linear"]);
    assert!(msg.contains("'optim.schedule'"), "{msg}");
    let msg = override_err(&["zzzzzzzz.qqqqqqqqqq=1"]);
    assert!(msg.contains("model, data, train, optim"), "{msg}");
}

#[test]
fn suggestions_are_capped_at_three() {
    let hint = error::unknown_key_hint("train.every", &all_keys());
    assert!(hint.starts_with("did you mean"), "{hint}");
    assert!(hint.matches('\'').count() <= 6, "{hint}");
}

#[test]
fn edit_distance_basics() {
    assert_eq!(edit_distance("", ""), 0);
    assert_eq!(edit_distance("abc", ""), 3);
    assert_eq!(edit_distance("kitten", "sitting"), 3);
    assert_eq!(edit_distance("micro_bach", "micro_batch"), 1);
    assert_eq!(edit_distance("flaw", "lawn"), 2);
}

#[test]
fn override_without_equals() {
    let msg = override_err(&["train.steps"]);
    assert!(msg.contains("KEY=VALUE"), "{msg}");
    assert!(msg.contains("train.steps=100"), "{msg}");
    let msg = override_err(&["=5"]);
    assert!(msg.contains("KEY=VALUE"), "{msg}");
}

#[test]
fn wrong_type_names_key_expected_and_given() {
    let msg = override_err(&["train.steps=abc"]);
    assert!(
        msg.starts_with("train.steps expects a non-negative integer, got \"abc\" (string)"),
        "{msg}"
    );
    let msg = override_err(&["train.steps=-5"]);
    assert!(msg.contains("got -5 (integer)"), "{msg}");
    let msg = override_err(&["model.tied_head=yes"]);
    assert!(
        msg.contains("model.tied_head expects true or false"),
        "{msg}"
    );
    let msg = override_err(&["optim.lr=fast"]);
    assert!(msg.contains("optim.lr expects a number"), "{msg}");
    let msg = override_err(&["train.steps=1.5"]);
    assert!(msg.contains("(float)"), "{msg}");

    let f = TempFile::new("[train]\nseed = \"x\"\n");
    let msg = resolve_err(Some(f.path()), &[]);
    assert!(msg.contains("train.seed expects"), "{msg}");
    assert!(msg.contains(&f.path().display().to_string()), "{msg}");
    let f = TempFile::new("[data]\ncorpus = 5\n");
    let msg = resolve_err(Some(f.path()), &[]);
    assert!(msg.contains("data.corpus expects a string"), "{msg}");
}

#[test]
fn int_for_float_is_accepted() {
    let r = ResolvedConfig::resolve(None, &ov(&["optim.lr=1", "optim.grad_clip=0"])).expect("ok");
    assert_eq!(r.config.optim.lr, 1.0);
    assert_eq!(r.config.optim.grad_clip, 0.0);
    let f = TempFile::new("[train]\nloss_scale_init = 1024\n");
    let r = ResolvedConfig::resolve(Some(f.path()), &[]).expect("ok");
    assert_eq!(r.config.train.loss_scale_init, 1024.0);
}

#[test]
fn literal_and_bare_string_overrides() {
    let r = ResolvedConfig::resolve(
        None,
        &ov(&[
            "train.precision=bf16-mixed",
            "data.corpus=/tmp/x.txt",
            "train.device = cuda:1",
            "optim.lr=1e-3",
            "model.tied_head=false",
        ]),
    )
    .expect("ok");
    assert_eq!(r.config.train.precision, "bf16-mixed");
    assert_eq!(r.config.data.corpus, "/tmp/x.txt");
    assert_eq!(r.config.train.device, "cuda:1");
    assert_eq!(r.config.optim.lr, 1e-3);
    assert!(!r.config.model.tied_head);

    let r = ResolvedConfig::resolve(
        None,
        &ov(&["train.precision=\"fp16-mixed\"", "data.corpus=2024-01-01"]),
    )
    .expect("ok");
    assert_eq!(r.config.train.precision, "fp16-mixed");
    assert_eq!(r.config.data.corpus, "2024-01-01");
}

#[test]
fn to_toml_round_trips() {
    let r = ResolvedConfig::resolve(
        None,
        &ov(&[
            "optim.lr=1e-4",
            "optim.min_lr=1e-5",
            "optim.eps=1e-12",
            "data.corpus=C:\\data\\\"quoted\" file.txt",
            "train.precision=fp16-mixed",
            "train.seed=18446744",
            "model.tied_head=false",
        ]),
    )
    .expect("ok");
    let text = r.to_toml();
    assert!(text.contains("[optim]"), "{text}");
    let f = TempFile::new(&text);
    let back = ResolvedConfig::resolve(Some(f.path()), &[]).expect("reads back");
    assert_eq!(back.config, r.config);
    assert!(
        back.sources
            .values()
            .all(|s| *s == Source::File(f.path().to_path_buf())),
        "every key is written out"
    );
}

#[test]
fn config_survives_json() {
    let c = Config::default();
    let json = serde_json::to_string(&c).expect("serialize");
    let back: Config = serde_json::from_str(&json).expect("deserialize");
    assert_eq!(back, c);
    assert!(serde_json::from_str::<Config>(r#"{"model":{"typo":1}}"#).is_err());
}

#[test]
fn missing_file_names_path() {
    let path = std::env::temp_dir().join(format!(
        "kiln_config_test_missing_{}.toml",
        std::process::id()
    ));
    let msg = resolve_err(Some(&path), &[]);
    assert!(msg.contains("cannot read config file"), "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
}

#[test]
fn bad_toml_names_path_and_error() {
    let f = TempFile::new("[train]\nsteps = = 3\n");
    let msg = resolve_err(Some(f.path()), &[]);
    assert!(msg.contains("is not valid TOML"), "{msg}");
    assert!(msg.contains(&f.path().display().to_string()), "{msg}");
    assert!(msg.contains("line 2"), "{msg}");
}

#[test]
fn section_and_value_mixups() {
    let msg = override_err(&["model=3"]);
    assert!(
        msg.contains("'model'") && msg.contains("is a section"),
        "{msg}"
    );
    let msg = override_err(&["train.steps.max=3"]);
    assert!(
        msg.contains("'train.steps'") && msg.contains("not a section"),
        "{msg}"
    );

    let f = TempFile::new("model = 3\n");
    let msg = resolve_err(Some(f.path()), &[]);
    assert!(msg.contains("is a section"), "{msg}");
    let f = TempFile::new("[train.steps]\nmax = 3\n");
    let msg = resolve_err(Some(f.path()), &[]);
    assert!(
        msg.contains("'train.steps'") && msg.contains("not a section"),
        "{msg}"
    );
}

#[test]
fn non_finite_floats_rejected() {
    let msg = override_err(&["optim.lr=nan"]);
    assert!(msg.contains("optim.lr") && msg.contains("finite"), "{msg}");
    let msg = validate_err(|c| c.optim.beta2 = f64::INFINITY);
    assert!(
        msg.contains("optim.beta2") && msg.contains("finite"),
        "{msg}"
    );
}

#[test]
fn validate_positive_sizes() {
    type Tweak = fn(&mut Config);
    let cases: [(&str, Tweak); 12] = [
        ("model.d_model", |c| c.model.d_model = 0),
        ("model.n_layers", |c| c.model.n_layers = 0),
        ("model.n_heads", |c| c.model.n_heads = 0),
        ("model.context", |c| c.model.context = 0),
        ("data.prefetch", |c| c.data.prefetch = 0),
        ("train.seq_len", |c| c.train.seq_len = 0),
        ("train.micro_batch", |c| c.train.micro_batch = 0),
        ("train.grad_accum", |c| c.train.grad_accum = 0),
        ("train.steps", |c| c.train.steps = 0),
        ("train.eval_batches", |c| c.train.eval_batches = 0),
        ("train.log_every", |c| c.train.log_every = 0),
        ("train.loss_scale_growth_interval", |c| {
            c.train.loss_scale_growth_interval = 0
        }),
    ];
    for (key, tweak) in cases {
        let msg = validate_err(tweak);
        assert!(msg.starts_with(key), "{key}: {msg}");
        assert!(msg.contains("at least 1"), "{key}: {msg}");
    }
}

#[test]
fn validate_zero_intervals_mean_only_at_end() {
    let mut c = Config::default();
    c.train.eval_every = 0;
    c.train.checkpoint_every = 0;
    c.optim.grad_clip = 0.0;
    c.optim.weight_decay = 0.0;
    c.optim.min_lr = 0.0;
    c.validate()
        .expect("zero intervals and disabled extras are valid");
}

#[test]
fn validate_heads_divide_width() {
    let msg = validate_err(|c| c.model.d_model = 130);
    assert_eq!(
        msg,
        "model.d_model 130 is not divisible by model.n_heads 4; pick d_model as a multiple of n_heads"
    );
}

#[test]
fn validate_seq_len_within_context() {
    let msg = validate_err(|c| c.train.seq_len = 256);
    assert_eq!(
        msg,
        "train.seq_len 256 is longer than the model's context model.context 128; lower train.seq_len or raise model.context"
    );
    let r = ResolvedConfig::resolve(None, &ov(&["train.seq_len=256", "model.context=256"]))
        .expect("raising both is fine");
    assert_eq!(r.config.train.seq_len, 256);
}

#[test]
fn validate_val_fraction() {
    for bad in [0.0, 0.5, 0.7, -0.1] {
        let msg = validate_err(|c| c.data.val_fraction = bad);
        assert!(msg.starts_with("data.val_fraction"), "{msg}");
        assert!(msg.contains("less than 0.5"), "{msg}");
    }
}

#[test]
fn validate_learning_rates() {
    let msg = validate_err(|c| c.optim.lr = 0.0);
    assert!(
        msg.starts_with("optim.lr") && msg.contains("greater than 0"),
        "{msg}"
    );
    let msg = validate_err(|c| c.optim.min_lr = 0.01);
    assert!(msg.starts_with("optim.min_lr"), "{msg}");
    assert!(msg.contains("optim.lr (0.003)"), "{msg}");
    let msg = validate_err(|c| c.optim.min_lr = -1e-5);
    assert!(msg.starts_with("optim.min_lr"), "{msg}");
}

#[test]
fn validate_adam_terms() {
    let msg = validate_err(|c| c.optim.beta1 = 1.0);
    assert!(
        msg.starts_with("optim.beta1") && msg.contains("less than 1"),
        "{msg}"
    );
    let msg = validate_err(|c| c.optim.beta2 = -0.1);
    assert!(msg.starts_with("optim.beta2"), "{msg}");
    let msg = validate_err(|c| c.optim.eps = 0.0);
    assert!(msg.starts_with("optim.eps"), "{msg}");
    let msg = validate_err(|c| c.optim.weight_decay = -0.1);
    assert!(msg.starts_with("optim.weight_decay"), "{msg}");
    let msg = validate_err(|c| c.optim.grad_clip = -1.0);
    assert!(msg.starts_with("optim.grad_clip"), "{msg}");
}

#[test]
fn validate_loss_scale_power_of_two() {
    for bad in [0.0, -1024.0, 1000.0, 3.0] {
        let msg = validate_err(|c| c.train.loss_scale_init = bad);
        assert!(msg.starts_with("train.loss_scale_init"), "{msg}");
        assert!(msg.contains("power of two"), "{msg}");
    }
    for good in [1.0, 2.0, 1024.0, 65536.0, 0.5, 2f64.powi(24)] {
        let mut c = Config::default();
        c.train.loss_scale_init = good;
        c.validate().expect("power of two is valid");
    }
}

#[test]
fn validate_choices() {
    let msg = validate_err(|c| c.train.precision = "fp8".into());
    assert!(msg.starts_with("train.precision"), "{msg}");
    assert!(msg.contains("fp32, tf32, bf16-mixed, fp16-mixed"), "{msg}");
    let msg = validate_err(|c| c.data.tokenizer = "sentencepiece".into());
    assert!(
        msg.starts_with("data.tokenizer") && msg.contains("byte, gpt2"),
        "{msg}"
    );
    let msg = override_err(&["model.kind=mamba"]);
    assert!(
        msg.starts_with("model.kind") && msg.contains("gpt, resnet_bk, llama"),
        "{msg}"
    );
}

#[test]
fn validate_device() {
    for bad in ["gpu", "cuda:", "cuda:x", "cuda:+1", "CUDA", "cpu:0", ""] {
        let msg = validate_err(|c| c.train.device = bad.into());
        assert!(msg.starts_with("train.device"), "{bad}: {msg}");
        assert!(msg.contains("cuda:N"), "{msg}");
    }
    for good in ["auto", "cpu", "cuda", "cuda:0", "cuda:7"] {
        let mut c = Config::default();
        c.train.device = good.into();
        c.validate().expect("device is valid");
    }
}

#[test]
fn validation_runs_after_all_layers() {
    let msg = override_err(&["model.d_model=130"]);
    assert!(msg.contains("not divisible"), "{msg}");
}

#[test]
fn source_display() {
    assert_eq!(Source::Default.to_string(), "default");
    assert_eq!(Source::Override.to_string(), "override");
    assert_eq!(
        Source::File(PathBuf::from("/tmp/run.toml")).to_string(),
        "/tmp/run.toml"
    );
}

#[test]
fn memory_limit_parses_units_and_rejects_nonsense() {
    use super::parse_bytes;
    assert_eq!(parse_bytes(""), Ok(None));
    assert_eq!(parse_bytes("4096"), Ok(Some(4096)));
    assert_eq!(parse_bytes("2KiB"), Ok(Some(2048)));
    assert_eq!(parse_bytes("1.5 GiB"), Ok(Some(1610612736)));
    assert_eq!(parse_bytes("800MB"), Ok(Some(800_000_000)));
    assert!(
        parse_bytes("12 parsecs")
            .unwrap_err()
            .contains("unknown unit")
    );
    assert!(parse_bytes("-3GB").is_err());
    let err = ResolvedConfig::resolve(None, &["train.memory_limit=lots".into()]).unwrap_err();
    assert!(err.to_string().contains("train.memory_limit"), "{err}");
    let err = ResolvedConfig::resolve(None, &["train.recompute=sometimes".into()]).unwrap_err();
    assert!(err.to_string().contains("none, blocks, auto"), "{err}");
}

#[test]
fn a_preset_fills_the_model_keys_left_at_their_defaults() {
    let r = ResolvedConfig::resolve(
        None,
        &ov(&[
            "model.kind=resnet_bk",
            "model.preset=small",
            "model.n_layers=6",
        ]),
    )
    .unwrap();
    let m = &r.config.model;
    let moe = m.resnet_bk().unwrap();
    assert_eq!((m.d_model, m.n_layers, moe.moe_experts), (128, 6, 4));
    assert_eq!((moe.moe_top_k, moe.moe_hidden), (2, 256));
    assert_eq!(r.sources["model.d_model"], Source::Preset("small"));
    assert_eq!(r.sources["model.n_layers"], Source::Override);
    assert!(r.render().contains("# preset small"));
    // The saved config reads back to the same model, with the preset applying to nothing.
    let f = TempFile::new(&r.to_toml());
    let again = ResolvedConfig::resolve(Some(f.path()), &[]).unwrap();
    assert_eq!(again.config, r.config);
}

#[test]
fn an_unknown_preset_lists_the_known_ones() {
    let err = ResolvedConfig::resolve(None, &ov(&["model.kind=resnet_bk", "model.preset=huge"]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.preset") && err.contains("huge") && err.contains("tiny, small, base"),
        "{err}"
    );
    let err = ResolvedConfig::resolve(None, &ov(&["model.preset=small"]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"gpt\" has no presets"), "{err}");
}

#[test]
fn moe_settings_are_checked() {
    for (arg, want) in [
        ("model.moe_top_k=3", "1 or 2"),
        ("model.moe_capacity_factor=0", "greater than 0"),
        ("model.moe_aux_coef=-1", "0 or more"),
        ("model.moe_experts=0", "at least 1"),
    ] {
        let err = ResolvedConfig::resolve(None, &ov(&["model.kind=resnet_bk", arg]))
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "{arg}: {err}");
    }
}

#[test]
fn validate_sliding_window() {
    let ok = ResolvedConfig::resolve(
        None,
        &ov(&[
            "model.kind=llama",
            "model.n_layers=4",
            "model.sliding_window=64",
            "model.full_attention_layers=2",
        ]),
    )
    .unwrap();
    assert_eq!(ok.config.model.llama().unwrap().sliding_window, 64);
    let e = resolve_err(None, &["model.sliding_window=16"]);
    assert!(e.contains("is a setting of model.kind = \"llama\""), "{e}");
    let e = resolve_err(None, &["model.kind=llama", "model.sliding_window=-3"]);
    assert!(e.contains("model.sliding_window"), "{e}");
    let e = resolve_err(None, &["model.kind=llama", "model.sliding_window=99999999"]);
    assert!(e.contains("a window is 1 to 16777216 positions"), "{e}");
    let e = resolve_err(None, &["model.kind=llama", "model.full_attention_layers=1"]);
    assert!(e.contains("needs a window"), "{e}");
    let e = resolve_err(
        None,
        &[
            "model.kind=llama",
            "model.n_layers=4",
            "model.sliding_window=8",
            "model.full_attention_layers=5",
        ],
    );
    assert!(e.contains("at most model.n_layers"), "{e}");
}

/// The `[model]` section of a saved config, as `to_toml` wrote it before the section was per
/// family: every family's keys, whatever the kind (from a run of this build's parent).
const SAVED_BEFORE_FAMILIES: &str = "# kiln run configuration

[model]
# model family: \"gpt\", \"resnet_bk\" or \"llama\"
kind = \"gpt\"
d_model = 64
n_layers = 2
n_heads = 2
context = 64
tied_head = true
preset = \"\"
moe_experts = 4
moe_top_k = 2
moe_hidden = 0
moe_capacity_factor = 1.25
moe_aux_coef = 0.01
vocab = 0
n_kv_heads = 0
head_dim = 0
ffn_hidden = 0
rope_theta = 10000.0
rot_dim = 0
rope_scaling_factor = 0.0
rope_low_freq_factor = 1.0
rope_high_freq_factor = 4.0
rope_original_context = 8192
norm_eps = 1e-5
qkv_bias = false
qk_norm = false
sliding_window = 0
full_attention_layers = 0

[train]
seq_len = 64
steps = 20
";

#[test]
fn a_key_of_another_family_is_refused_naming_key_family_and_kind() {
    for (args, key, family, kind) in [
        (
            &["model.moe_experts=4"][..],
            "model.moe_experts",
            "resnet_bk",
            "gpt",
        ),
        (
            &["model.kind=resnet_bk", "model.rope_theta=500000"],
            "model.rope_theta",
            "llama",
            "resnet_bk",
        ),
        (
            &["model.moe_top_k=1", "model.kind=llama"],
            "model.moe_top_k",
            "resnet_bk",
            "llama",
        ),
    ] {
        let e = override_err(args);
        assert!(
            e.starts_with(key)
                && e.contains("(from override)")
                && e.contains(&format!("model.kind = \"{family}\""))
                && e.contains(&format!("model.kind is \"{kind}\""))
                && e.contains(&format!("set model.kind={family}")),
            "{args:?}: {e}"
        );
    }
    // From a file, the file is named.
    let f = TempFile::new("[model]\nkind = \"gpt\"\nn_kv_heads = 2\n");
    let e = resolve_err(Some(f.path()), &[]);
    assert!(
        e.starts_with("model.n_kv_heads") && e.contains(&f.path().display().to_string()),
        "{e}"
    );
    // A key set to its default still counts: it was asked for.
    let e = override_err(&["model.kind=llama", "model.moe_capacity_factor=1.25"]);
    assert!(e.starts_with("model.moe_capacity_factor"), "{e}");
}

#[test]
fn a_family_key_may_come_before_or_after_its_kind() {
    let spellings: [&[&str]; 2] = [
        &["model.kind=resnet_bk", "model.moe_top_k=1"],
        &["model.moe_top_k=1", "model.kind=resnet_bk"],
    ];
    for args in spellings {
        let r = ResolvedConfig::resolve(None, &ov(args)).unwrap();
        assert_eq!(r.config.model.resnet_bk().unwrap().moe_top_k, 1, "{args:?}");
    }
    // The kind from an override, the keys from the file, and the other way round.
    let llama_keys = TempFile::new("[model]\nn_kv_heads = 2\n");
    let r = ResolvedConfig::resolve(Some(llama_keys.path()), &ov(&["model.kind=llama"])).unwrap();
    assert_eq!(r.config.model.llama().unwrap().n_kv_heads, 2);
    let llama = TempFile::new("[model]\nkind = \"llama\"\nn_kv_heads = 2\n");
    let r = ResolvedConfig::resolve(Some(llama.path()), &ov(&["model.rope_theta=1e5"])).unwrap();
    let l = r.config.model.llama().unwrap();
    assert_eq!((l.n_kv_heads, l.rope_theta), (2, 1e5));
    assert_eq!(r.sources["model.rope_theta"], Source::Override);
    // A later override that changes the kind strands the file's key of the first kind.
    let e = resolve_err(Some(llama.path()), &["model.kind=gpt"]);
    assert!(e.starts_with("model.n_kv_heads"), "{e}");
}

#[test]
fn a_config_saved_before_families_still_loads() {
    let f = TempFile::new(SAVED_BEFORE_FAMILIES);
    let r = ResolvedConfig::resolve(Some(f.path()), &[]).unwrap();
    assert_eq!(r.config.model.family, FamilySettings::Gpt);
    assert_eq!((r.config.model.d_model, r.config.train.steps), (64, 20));
    assert!(r.sources.keys().all(|k| model::family_of_key(k).is_none()));
    // Resumed with another kind, its keys of that kind are the values it holds.
    let r = ResolvedConfig::resolve(Some(f.path()), &ov(&["model.kind=resnet_bk"])).unwrap();
    assert_eq!(
        r.config.model.resnet_bk(),
        Some(&ResnetBkSettings::default())
    );
    // Written again, it lists the kind's keys only, and reads back equal.
    let again = TempFile::new(&r.to_toml());
    let text = std::fs::read_to_string(again.path()).unwrap();
    assert!(
        text.contains("moe_experts") && !text.contains("rope_theta"),
        "{text}"
    );
    assert_eq!(
        ResolvedConfig::resolve(Some(again.path()), &[])
            .unwrap()
            .config,
        r.config
    );
    // Without the header kiln wrote, the same keys are a person's, and refused.
    let edited = TempFile::new(&SAVED_BEFORE_FAMILIES.replacen("# kiln run configuration", "", 1));
    let e = resolve_err(Some(edited.path()), &[]);
    assert!(e.contains("is a setting of model.kind"), "{e}");
}

#[test]
fn a_checkpoint_model_written_before_families_still_loads() {
    // `CheckpointMeta::model` in trainer.json: the flat object with every family's keys.
    let json = r#"{"kind":"resnet_bk","d_model":64,"n_layers":2,"n_heads":4,"context":64,
        "tied_head":true,"preset":"","moe_experts":3,"moe_top_k":1,"moe_hidden":0,
        "moe_capacity_factor":1.0,"moe_aux_coef":0.01,"vocab":0,"n_kv_heads":0,"head_dim":0,
        "ffn_hidden":0,"rope_theta":10000.0,"rot_dim":0,"rope_scaling_factor":0.0,
        "rope_low_freq_factor":1.0,"rope_high_freq_factor":4.0,"rope_original_context":8192,
        "norm_eps":1e-5,"qkv_bias":false,"qk_norm":false,"sliding_window":0,
        "full_attention_layers":0}"#;
    let m: ModelConfig = serde_json::from_str(json).unwrap();
    let moe = m.resnet_bk().unwrap();
    assert_eq!((m.d_model, moe.moe_experts, moe.moe_top_k), (64, 3, 1));
    assert_eq!(moe.moe_capacity_factor, 1.0);
    // Written now, it holds the shared keys and its kind's, in the same flat object that
    // builds before families read (their missing keys default).
    let out = serde_json::to_value(&m).unwrap();
    let keys: Vec<&str> = out
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    assert!(
        keys.contains(&"kind") && keys.contains(&"moe_experts"),
        "{keys:?}"
    );
    assert!(!keys.contains(&"rope_theta"), "{keys:?}");
    assert_eq!(serde_json::from_value::<ModelConfig>(out).unwrap(), m);
}

/// LongRoPE's factor lists are lists of numbers on the command line (integers widened), one
/// a rotated pair, and both or neither.
#[test]
fn longrope_factor_lists_resolve_and_are_checked() {
    let base = [
        "model.kind=llama",
        "model.d_model=64",
        "model.n_heads=4",
        "model.rot_dim=8",
    ];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        base.iter().chain(extra).copied().collect()
    }
    let r = ResolvedConfig::resolve(
        None,
        &ov(&with(
            &base,
            &[
                "model.rope_short_factors=[1, 1.5, 2.0, 2.5]",
                "model.rope_long_factors=[2.0, 3.0, 4.0, 5.0]",
                "model.rope_attention_factor=1.2",
            ],
        )),
    )
    .expect("factor lists resolve");
    let l = r.config.model.llama().unwrap();
    assert_eq!(l.rope_short_factors, vec![1.0, 1.5, 2.0, 2.5]);
    assert_eq!(l.rope_long_factors, vec![2.0, 3.0, 4.0, 5.0]);
    r.config.validate().expect("valid LongRoPE settings");
    let e = override_err(&with(&base, &["model.rope_short_factors=[1.0, 2.0]"]));
    assert!(e.contains("model.rope_short_factors"), "{e}");
    let mut c = r.config.clone();
    if let FamilySettings::Llama(l) = &mut c.model.family {
        l.rope_long_factors = vec![1.0, 2.0];
    }
    let e = c.validate().unwrap_err().to_string();
    assert!(
        e.contains("model.rope_long_factors") && e.contains("4 rotated dimension pairs"),
        "{e}"
    );
    if let FamilySettings::Llama(l) = &mut c.model.family {
        l.rope_long_factors = vec![1.0, 2.0, 0.0, 1.0];
    }
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("positive"), "{e}");
    let e = override_err(&with(&base, &["model.rope_short_factors=true"]));
    assert!(e.contains("a list of numbers"), "{e}");
    let e = override_err(&with(&base, &["model.checkpoint_arch=gemma"]));
    assert!(e.contains("phi3"), "{e}");
}

/// Early stopping counts evaluations, so it needs periodic ones; its threshold is a fall of
/// the loss, never negative, and a number.
#[test]
fn validate_early_stopping() {
    let msg = validate_err(|c| {
        c.train.early_stop_patience = 3;
        c.train.eval_every = 0;
    });
    assert!(
        msg.starts_with("train.early_stop_patience") && msg.contains("train.eval_every=50"),
        "{msg}"
    );
    let msg = validate_err(|c| {
        c.train.keep_best = true;
        c.train.eval_every = 0;
    });
    assert!(msg.starts_with("train.keep_best"), "{msg}");
    let msg = validate_err(|c| c.train.early_stop_min_delta = -0.1);
    assert!(msg.starts_with("train.early_stop_min_delta"), "{msg}");
    let msg = validate_err(|c| c.train.early_stop_min_delta = f64::NAN);
    assert!(msg.contains("train.early_stop_min_delta"), "{msg}");
    let mut c = Config::default();
    c.train.early_stop_patience = 3;
    c.validate().unwrap();
}
