//! Trainer behaviour on real (tiny) runs: exact accumulation, bit-exact resume, the fp16 loss
//! scaler, mixed-precision compute copies, divergence handling, out-of-memory recovery and
//! the recomputation setting, and the unfused kernel path against the fused one.

mod common;

use kiln::config::ResolvedConfig;
use kiln::data::{self, Batch, Corpus, Tokenizer};
use kiln::engine::{DType, Device, MemoryPool};
use kiln::error::KilnError;
use kiln::models::Recompute;
use kiln::train::{self, Precision, RunOptions, Trainer};

fn config(extra: &[&str]) -> kiln::config::Config {
    ResolvedConfig::resolve(None, &common::with(extra))
        .unwrap()
        .config
}

fn corpus_tokens() -> Vec<u32> {
    let c = Corpus::load(None).unwrap();
    data::ByteTokenizer.encode(&c.text[..200_000])
}

fn grads(t: &Trainer) -> Vec<Vec<f32>> {
    t.model
        .params()
        .iter()
        .map(|p| p.grad.to_vec().unwrap())
        .collect()
}

#[test]
fn k_micro_batches_give_the_gradient_of_one_batch_k_times_larger() {
    let cfg = config(&["train.micro_batch=8"]);
    let tokens = corpus_tokens();
    let whole = data::train_batch(&tokens, 5, 3, 0, 8, 32);
    let quarters: Vec<Batch> = (0..4)
        .map(|i| data::train_rows(&tokens, 5, 3, 0, i * 2..i * 2 + 2, 32))
        .collect();

    let mut one = Trainer::new(&cfg, 256, &MemoryPool::new(Device::Cpu), Precision::Fp32).unwrap();
    let loss_one = one.accumulate(std::slice::from_ref(&whole)).unwrap();
    let mut four = Trainer::new(&cfg, 256, &MemoryPool::new(Device::Cpu), Precision::Fp32).unwrap();
    let loss_four = four.accumulate(&quarters).unwrap();

    assert!(
        (loss_one - loss_four).abs() < 1e-9 * loss_one.abs(),
        "{loss_one} vs {loss_four}"
    );
    let mut max_rel = 0.0f32;
    for (a, b) in grads(&one).iter().zip(grads(&four).iter()) {
        let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-12);
        for (x, y) in a.iter().zip(b) {
            max_rel = max_rel.max((x - y).abs() / scale);
        }
    }
    // Only the summation order differs between the two.
    assert!(max_rel < 1e-5, "max relative gradient difference {max_rel}");
}

/// Each step's gradient clear is left to the first writer of each gradient (a product
/// overwrites it); a writer that added into the previous step's values instead would make a
/// second accumulation of the same batch differ from the first.
#[test]
fn a_steps_gradients_owe_nothing_to_the_previous_steps() {
    let tokens = corpus_tokens();
    let a = data::train_batch(&tokens, 5, 3, 0, 4, 32);
    let b = data::train_batch(&tokens, 5, 3, 1, 4, 32);
    let families: [&[&str]; 5] = [
        &[],
        &["model.tied_head=false"],
        &["model.kind=resnet_bk"],
        &[
            "model.kind=llama",
            "model.n_kv_heads=2",
            "model.ffn_hidden=64",
        ],
        &[
            "model.kind=llama",
            "model.n_kv_heads=2",
            "model.ffn_hidden=64",
            "model.tied_head=false",
        ],
    ];
    for extra in families {
        let cfg = config(extra);
        let mut t =
            Trainer::new(&cfg, 256, &MemoryPool::new(Device::Cpu), Precision::Fp32).unwrap();
        t.step(std::slice::from_ref(&a)).unwrap();
        let stale = grads(&t);
        assert!(stale.iter().flatten().any(|&g| g != 0.0), "{extra:?}");
        t.accumulate(std::slice::from_ref(&b)).unwrap();
        let first = grads(&t);
        t.accumulate(std::slice::from_ref(&b)).unwrap();
        let second = grads(&t);
        assert!(first.iter().flatten().all(|g| g.is_finite()), "{extra:?}");
        assert_eq!(
            first, second,
            "{extra:?}: a gradient kept the previous step's values"
        );
        assert_ne!(first, stale, "{extra:?}");
    }
}

fn run_to(
    dir: &std::path::Path,
    extra: &[&str],
    resume: bool,
    stop_after: Option<u64>,
) -> Result<train::Summary, KilnError> {
    let file = resume.then(|| dir.join("config.toml"));
    let overrides = if resume {
        extra.iter().map(|s| s.to_string()).collect()
    } else {
        common::with(extra)
    };
    let config = ResolvedConfig::resolve(file.as_deref(), &overrides)?;
    train::run(RunOptions {
        config,
        run_dir: dir.to_path_buf(),
        resume,
        checkpoint: None,
        stop_after,
        quiet: true,
        trace: None,
        profile_steps: None,
        init: None,
        world: None,
    })
}

fn final_weights(dir: &std::path::Path) -> Vec<u8> {
    let ckpt = train::checkpoint::latest(dir).unwrap().unwrap();
    std::fs::read(ckpt.join("model.safetensors")).unwrap()
}

#[test]
fn resumed_run_is_bit_identical_to_an_uninterrupted_one() {
    for precision in ["fp32", "fp16-mixed"] {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        let p = format!("train.precision={precision}");
        let args = [
            "train.steps=8",
            "train.checkpoint_every=4",
            "train.eval_every=0",
            "train.grad_accum=2",
            &p,
        ];
        let full = run_to(&a, &args, false, None).unwrap();
        run_to(&b, &args, false, Some(4)).unwrap();
        let resumed = run_to(&b, &[], true, None).unwrap();
        assert_eq!(resumed.steps, 8);
        assert_eq!(
            final_weights(&a),
            final_weights(&b),
            "{precision}: weights differ after resume"
        );
        assert_eq!(
            full.train_loss.to_bits(),
            resumed.train_loss.to_bits(),
            "{precision}: last loss differs"
        );
        let opt = |d: &std::path::Path| {
            std::fs::read(
                train::checkpoint::latest(d)
                    .unwrap()
                    .unwrap()
                    .join("optimizer.safetensors"),
            )
            .unwrap()
        };
        assert_eq!(opt(&a), opt(&b), "{precision}: optimizer state differs");
    }
}

#[test]
fn fp16_scaler_skips_overflowing_steps_without_advancing_the_schedule() {
    // 2^40 makes the scaled fp16 gradients overflow; the scaler must halve until they fit.
    let cfg = config(&[
        "train.precision=fp16-mixed",
        "train.loss_scale_init=1099511627776",
        "train.steps=20",
    ]);
    let tokens = corpus_tokens();
    let mut t = Trainer::new(
        &cfg,
        256,
        &MemoryPool::new(Device::Cpu),
        Precision::Fp16Mixed,
    )
    .unwrap();
    let before: Vec<f32> = t.model.params()[0].value.to_vec().unwrap();
    let first = t
        .step(&[data::train_batch(&tokens, 1, 0, 0, 4, 32)])
        .unwrap();
    assert!(first.skipped, "a 2^40 loss scale must overflow fp16");
    assert_eq!(
        t.state.step, 0,
        "a skipped step does not advance the schedule"
    );
    assert_eq!(
        t.model.params()[0].value.to_vec().unwrap(),
        before,
        "a skipped step does not update"
    );
    assert_eq!(t.loss_scale(), 549755813888.0);
    let mut skipped = 1;
    for i in 1..40u64 {
        if t.step(&[data::train_batch(&tokens, 1, i, 0, 4, 32)])
            .unwrap()
            .skipped
        {
            skipped += 1;
        }
        if t.state.step >= 5 {
            break;
        }
    }
    assert!(t.state.step >= 5, "training resumes once the scale fits");
    assert_eq!(t.state.scaler.unwrap().skipped, skipped);
    // The output gradient is scale / 128 tokens x (p - 1) per target logit: it fits fp16
    // (max 65504) from 2^23 down, so that is where the backoff must stop.
    let s = t.loss_scale();
    assert!(
        (4194304.0..=8388608.0).contains(&s),
        "scale backed off to {s}"
    );
    assert_eq!(
        t.state.data_step,
        t.state.step + skipped,
        "skipped steps consume their batch"
    );
}

#[test]
fn mixed_precision_computes_with_rounded_copies_of_fp32_masters() {
    let cfg = config(&["train.precision=bf16-mixed"]);
    let tokens = corpus_tokens();
    let mut t = Trainer::new(
        &cfg,
        256,
        &MemoryPool::new(Device::Cpu),
        Precision::Bf16Mixed,
    )
    .unwrap();
    let mut losses = Vec::new();
    for i in 0..12 {
        losses.push(
            t.step(&[data::train_batch(&tokens, 2, i, 0, 4, 32)])
                .unwrap()
                .loss,
        );
    }
    assert!(
        losses[11] < losses[0] - 0.5,
        "bf16-mixed learns: {losses:?}"
    );
    for p in t.model.params() {
        let c = p
            .compute
            .as_ref()
            .expect("mixed precision keeps a compute copy");
        assert_eq!(c.dtype(), DType::BF16);
        let master = p.value.to_vec().unwrap();
        let rounded: Vec<f32> = master.iter().map(|&x| DType::BF16.round(x)).collect();
        assert_eq!(
            c.to_vec().unwrap(),
            rounded,
            "{}: compute copy is the rounded master",
            p.name
        );
        assert!(
            master.iter().zip(&rounded).any(|(a, b)| a != b),
            "{}: masters keep full precision",
            p.name
        );
    }
}

#[test]
fn a_nan_loss_stops_training_naming_the_step() {
    let cfg = config(&[]);
    let tokens = corpus_tokens();
    let mut t = Trainer::new(&cfg, 256, &MemoryPool::new(Device::Cpu), Precision::Fp32).unwrap();
    t.step(&[data::train_batch(&tokens, 1, 0, 0, 4, 32)])
        .unwrap();
    t.model.params_mut()[3].value.host_mut()[0] = f32::NAN;
    let err = t
        .step(&[data::train_batch(&tokens, 1, 1, 0, 4, 32)])
        .unwrap_err();
    assert!(matches!(err, KilnError::NonFinite { step: 2, .. }), "{err}");
    assert_eq!(t.state.step, 1, "the failed step changed nothing");
}

#[test]
fn a_divergent_run_keeps_its_last_good_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let err = run_to(
        &dir,
        &[
            "optim.lr=1e30",
            "optim.warmup_steps=0",
            "optim.grad_clip=0",
            "train.checkpoint_every=1",
            "train.steps=50",
        ],
        false,
        None,
    )
    .unwrap_err();
    let KilnError::NonFinite { step, .. } = err else {
        panic!("expected divergence, got {err}")
    };
    let msg = err.to_string();
    let kept = train::checkpoint::latest(&dir)
        .unwrap()
        .expect("a checkpoint from before the divergence");
    assert!(
        kept.ends_with(format!("step_{:07}", step - 1)),
        "{kept:?} for divergence at {step}"
    );
    assert!(msg.contains(&kept.display().to_string()), "{msg}");
    let weights = std::fs::read(kept.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&weights).unwrap();
    assert!(!st.tensors().is_empty());
}

fn records(dir: &std::path::Path, kind: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["kind"] == kind)
        .collect()
}

/// A run that split its passes after running out of memory keeps that split across a
/// checkpoint: resumed under the same cap it does not run out again and ends bit-identical to
/// the uninterrupted run; resumed under a larger cap it starts unsplit again.
#[test]
fn a_learned_split_is_kept_on_resume_under_the_same_cap_only() {
    let peak8 = common::step_peak(&["train.micro_batch=8", "train.grad_accum=2"]);
    let peak4 = common::step_peak(&["train.micro_batch=4", "train.grad_accum=2"]);
    let cap = format!("train.memory_limit={}", (peak4 + peak8) / 2);
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("c"),
    );
    let args = [
        "train.micro_batch=8",
        "train.grad_accum=2",
        "train.steps=4",
        "train.checkpoint_every=2",
        "train.eval_every=0",
        cap.as_str(),
    ];
    let full = run_to(&a, &args, false, None).unwrap();
    run_to(&b, &args, false, Some(2)).unwrap();
    let resumed = run_to(&b, &[], true, None).unwrap();
    assert_eq!(resumed.steps, 4);
    assert_eq!(resumed.effective_micro_batch, 4);
    assert_eq!(
        records(&b, "oom").len(),
        1,
        "the resumed run ran out of memory again"
    );
    assert_eq!(
        final_weights(&a),
        final_weights(&b),
        "weights differ after resume"
    );
    assert_eq!(full.train_loss.to_bits(), resumed.train_loss.to_bits());

    run_to(&c, &args, false, Some(2)).unwrap();
    let larger = format!("train.memory_limit={}", 4 * peak8);
    let raised = run_to(&c, &[larger.as_str()], true, None).unwrap();
    assert_eq!(raised.effective_micro_batch, 8);
    assert_eq!(records(&c, "oom").len(), 1);
}

fn tensors(dir: &std::path::Path) -> Vec<(String, Vec<f32>)> {
    let bytes = final_weights(dir);
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, values)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// A memory cap between the peaks of micro-batch 4 and 8 makes the run split its passes to 4
/// sequences in the first step, say so once, and otherwise train exactly as an uncapped run:
/// the same tokens weighted by the same global count, summed in another order, so losses and
/// weights agree to within float rounding.
#[test]
fn a_micro_batch_that_runs_out_of_memory_is_split_and_trains_the_same() {
    let peak8 = common::step_peak(&["train.micro_batch=8", "train.grad_accum=2"]);
    let peak4 = common::step_peak(&["train.micro_batch=4", "train.grad_accum=2"]);
    assert!(peak4 < peak8, "{peak4} vs {peak8}");
    let cap = format!("train.memory_limit={}", (peak4 + peak8) / 2);
    let tmp = tempfile::tempdir().unwrap();
    let (plain_dir, capped_dir) = (tmp.path().join("plain"), tmp.path().join("capped"));
    let args = [
        "train.micro_batch=8",
        "train.grad_accum=2",
        "train.steps=6",
        "train.eval_every=0",
    ];
    let plain = run_to(&plain_dir, &args, false, None).unwrap();
    let capped = run_to(
        &capped_dir,
        &[&args[..], &[cap.as_str()]].concat(),
        false,
        None,
    )
    .unwrap();
    assert_eq!(plain.effective_micro_batch, 8);
    assert_eq!(capped.effective_micro_batch, 4);
    assert!(records(&plain_dir, "oom").is_empty());
    let oom = records(&capped_dir, "oom");
    assert_eq!(oom.len(), 1, "the split is logged once: {oom:?}");
    assert_eq!(
        (
            &oom[0]["step"],
            &oom[0]["micro_batch_from"],
            &oom[0]["micro_batch_to"]
        ),
        (&1.into(), &8.into(), &4.into())
    );

    let losses = |d| -> Vec<f64> {
        records(d, "train")
            .iter()
            .map(|r| r["loss"].as_f64().unwrap())
            .collect()
    };
    let (a, b) = (losses(&plain_dir), losses(&capped_dir));
    assert_eq!(a.len(), 6);
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-6 * x.abs(),
            "step {}: loss {x} vs {y}",
            step + 1
        );
    }
    // Weights, by each tensor's relative error in norm. One slice is left out: the key
    // bias, whose gradient is zero in exact arithmetic (softmax ignores a shift shared by all
    // keys), so in both runs it holds rounding noise that Adam turns into steps of random sign.
    let (wa, wb) = (tensors(&plain_dir), tensors(&capped_dir));
    assert_eq!(wa.len(), wb.len());
    let c = 32;
    for ((name, x), (_, y)) in wa.iter().zip(&wb) {
        let keep = |i: &usize| !(name.ends_with("attn.qkv.bias") && (c..2 * c).contains(i));
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for i in (0..x.len()).filter(keep) {
            diff += ((x[i] - y[i]) as f64).powi(2);
            norm += (x[i] as f64).powi(2);
        }
        let rel = (diff / norm).sqrt();
        assert!(rel <= 1e-6, "{name}: relative difference {rel:e}");
    }
}

/// The gradient of a step that split is the unsplit one up to summation order, every
/// parameter included, compared against each tensor's largest gradient.
#[test]
fn a_split_step_accumulates_the_same_gradient() {
    let cfg = config(&["train.micro_batch=8", "train.grad_accum=2"]);
    let tokens = corpus_tokens();
    let micro: Vec<Batch> = (0..2)
        .map(|m| data::train_batch(&tokens, 4, 0, m, 8, 32))
        .collect();
    let pool = MemoryPool::new(Device::Cpu);
    let mut whole = Trainer::new(&cfg, 256, &pool, Precision::Fp32).unwrap();
    let loss_whole = whole.accumulate(&micro).unwrap();
    let mut split =
        Trainer::new(&cfg, 256, &MemoryPool::new(Device::Cpu), Precision::Fp32).unwrap();
    let peak8 = common::step_peak(&["train.micro_batch=8", "train.grad_accum=2"]);
    let peak4 = common::step_peak(&["train.micro_batch=4", "train.grad_accum=2"]);
    split.pool.set_limit((peak4 + peak8) / 2);
    let loss_split = split.accumulate(&micro).unwrap();
    assert_eq!(split.passes.learned(), Some(4));
    assert!(
        (loss_whole - loss_split).abs() <= 1e-9 * loss_whole.abs(),
        "{loss_whole} vs {loss_split}"
    );
    for (p, (a, b)) in whole
        .model
        .params()
        .iter()
        .zip(grads(&whole).iter().zip(&grads(&split)))
    {
        let scale = a.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-12);
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / scale)
            .fold(0.0f32, f32::max);
        assert!(worst <= 1e-6, "{}: gradient differs by {worst:e}", p.name);
    }
}

/// Out of memory even at one sequence per pass: a clear error with the numbers and the
/// settings that would help, exit code 6, and the pool back where it was before the step,
/// so the trainer keeps working once memory allows; a split step leaves nothing behind either.
#[test]
fn one_sequence_that_does_not_fit_stops_with_what_to_change_and_the_pool_stays_usable() {
    let cfg = config(&[]);
    let tokens = corpus_tokens();
    let batch = |step| [data::train_batch(&tokens, 1, step, 0, 4, 32)];
    let mut t = Trainer::new(&cfg, 256, &MemoryPool::new(Device::Cpu), Precision::Fp32).unwrap();
    let in_use = t.pool.stats().current;

    // Enough for two sequences per pass but not four: the step splits and succeeds.
    let peak4 = common::step_peak(&[]);
    let peak2 = common::step_peak(&["train.micro_batch=2"]);
    t.pool.set_limit((peak2 + peak4) / 2);
    t.step(&batch(0)).unwrap();
    assert_eq!(t.passes.learned(), Some(2));
    assert_eq!(
        t.pool.stats().current,
        in_use,
        "a split step holds nothing afterwards"
    );

    t.pool.set_limit(in_use + 64 * 1024);
    let err = t.step(&batch(1)).unwrap_err();
    assert_eq!(err.exit_code(), 6);
    assert!(matches!(err, KilnError::DoesNotFit(_)), "{err}");
    let msg = err.to_string();
    for needle in [
        "one sequence of 32 tokens does not fit on cpu",
        "asked for",
        "the train.memory_limit cap has",
        "train.recompute=blocks",
        "train.offload_optimizer=true",
        "train.precision=bf16-mixed",
        "a shorter train.seq_len (now 32)",
        "model.d_model=32, model.n_layers=2",
    ] {
        assert!(msg.contains(needle), "expected {needle:?} in: {msg}");
    }
    assert_eq!(t.passes.learned(), Some(1));
    assert_eq!(t.state.step, 1, "the failed step changed nothing");
    assert_eq!(
        t.pool.stats().current,
        in_use,
        "the failed step released its activations"
    );
    t.pool.set_limit(0);
    t.step(&batch(1)).unwrap();
    assert_eq!(t.pool.stats().current, in_use);
}

/// `train.recompute` reaches the model: blocks recomputes, none and auto (until the planner
/// decides) do not.
#[test]
fn train_recompute_sets_the_models_policy() {
    for (value, policy) in [
        ("none", Recompute::None),
        ("auto", Recompute::None),
        ("blocks", Recompute::Blocks),
    ] {
        let cfg = config(&[&format!("train.recompute={value}")]);
        let mut t =
            Trainer::new(&cfg, 256, &MemoryPool::new(Device::Cpu), Precision::Fp32).unwrap();
        assert_eq!(t.model.recompute(), policy, "{value}");
        t.set_recompute(Recompute::Blocks).unwrap();
        assert_eq!(t.model.recompute(), Recompute::Blocks);
    }
}

/// `train.fused_kernels=false` trains the same model: six fp32 steps (with and without block
/// recomputation) give the fused run's losses within 1e-6 relative, and the unfused run's peak
/// memory shows its extra buffers. The unfused path covers the loss, the residual adds with
/// their norms, AdamW and attention (batched GEMMs around a causal softmax that keeps P). Its
/// chains differ from the fused kernels in rounding only: the target logit's gradient,
/// `(p - 1) s` against `p s - s`; the stream gradient, added after the norm's gradient is
/// rounded instead of inside the norm's kernel; and attention's sums over the head dimension
/// and the keys, taken in the GEMM's blocked order rather than the fused kernel's running
/// order, about 1e-7 relative each. The bound leaves room for Adam's normalisation turning a
/// last-bit difference on a noise-level gradient into an update on a few elements.
#[test]
fn unfused_kernels_train_like_the_fused_ones() {
    let tokens = corpus_tokens();
    for recompute in ["none", "blocks"] {
        let run = |fused: bool| -> (Vec<f64>, usize) {
            let cfg = config(&[
                &format!("train.fused_kernels={fused}"),
                &format!("train.recompute={recompute}"),
                "optim.lr=3e-3",
            ]);
            let pool = MemoryPool::new(Device::Cpu);
            let mut t = Trainer::new(&cfg, 256, &pool, Precision::Fp32).unwrap();
            let losses = (0..6)
                .map(|step| {
                    let batch = data::train_batch(&tokens, 11, step, 0, 4, 32);
                    t.step(&[batch]).unwrap().loss
                })
                .collect();
            (losses, pool.stats().peak)
        };
        let ((fused, fused_peak), (unfused, unfused_peak)) = (run(true), run(false));
        for (step, (a, b)) in fused.iter().zip(&unfused).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * a.abs(),
                "recompute {recompute}, step {}: fused loss {a}, unfused {b}",
                step + 1
            );
        }
        assert!(
            fused[5] < fused[0],
            "the run learned nothing: {fused:?} (the comparison would be vacuous)"
        );
        // Without recomputation the peak is at the loss: 4 x 32 rows of 256 f32
        // log-probabilities and a gradient buffer beside the logits. With it, the peak lies in
        // a block, where the unfused attention holds T x T matrices the fused kernel does not
        // (S beside P in the forward, dP beside dS in the backward); the fused run's own peak
        // sits elsewhere in the block (the block frees each gradient as soon as it is used),
        // so only "more" is certain there.
        let extra = if recompute == "none" {
            4 * 32 * 256 * 4
        } else {
            1
        };
        assert!(
            unfused_peak >= fused_peak + extra,
            "recompute {recompute}: unfused peak {unfused_peak} vs fused {fused_peak} + {extra}"
        );
    }
}

/// The unfused path exists for GPT with the optimizer on the device; anything else is refused
/// with the setting to change.
#[test]
fn fused_kernels_false_is_refused_where_there_is_no_unfused_path() {
    for extra in [
        ["train.fused_kernels=false", "model.kind=resnet_bk"],
        ["train.fused_kernels=false", "train.offload_optimizer=true"],
    ] {
        let err = ResolvedConfig::resolve(None, &common::with(&extra))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train.fused_kernels") && err.contains("train.fused_kernels=true"),
            "{extra:?}: {err}"
        );
    }
}

/// A NaN potential reaching a BK-Core stops training with an error that names the layer and
/// the step (exit code 5), and the routing statistics of a good step reach the report.
#[test]
fn resnet_bk_nan_potential_names_the_layer_and_the_step() {
    let cfg = config(&["model.kind=resnet_bk", "model.moe_experts=2"]);
    let pool = MemoryPool::new(Device::Cpu);
    let mut t = Trainer::new(&cfg, 256, &pool, Precision::Fp32).unwrap();
    let tokens = corpus_tokens();
    let batch = |i| [data::train_batch(&tokens, 1, i, 0, 4, 32)];
    let report = t.step(&batch(0)).unwrap();
    let routing = report.routing.expect("resnet_bk reports routing");
    assert_eq!(routing.slots, 2 * 4 * 32 * 2);
    assert_eq!(routing.load.len(), 2);

    let mut params = t.model.params_mut();
    let bias = params
        .iter_mut()
        .find(|p| p.name == "blocks.1.v_proj.bias")
        .expect("the potential projection has a bias");
    bias.value.copy_from_host(&[f32::INFINITY]).unwrap();
    drop(params);
    let err = t.step(&batch(1)).unwrap_err();
    assert_eq!(err.exit_code(), 5);
    let msg = err.to_string();
    assert!(
        msg.contains("step 2") && msg.contains("blocks.1.bk") && msg.contains("potential"),
        "{msg}"
    );
}

/// `train.eval_at_start` adds one evaluation before the first step (the untrained model's
/// loss, above the trained one) and changes nothing the run computes; a resumed run does not
/// evaluate its start again.
#[test]
fn eval_at_start_reports_the_untrained_loss_and_changes_no_weight() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let args = [
        "train.steps=6",
        "train.eval_every=0",
        "train.checkpoint_every=3",
    ];
    run_to(&a, &args, false, None).unwrap();
    let with: Vec<&str> = args
        .iter()
        .copied()
        .chain(["train.eval_at_start=true"])
        .collect();
    run_to(&b, &with, false, Some(3)).unwrap();
    run_to(&b, &[], true, None).unwrap();
    assert_eq!(final_weights(&a), final_weights(&b));
    let evals = records(&b, "eval");
    assert_eq!(evals[0]["step"], 0, "{evals:?}");
    assert_eq!(
        evals.iter().filter(|r| r["step"] == 0).count(),
        1,
        "{evals:?}"
    );
    let last = evals.last().unwrap()["val_loss"].as_f64().unwrap();
    assert!(evals[0]["val_loss"].as_f64().unwrap() > last, "{evals:?}");
    assert!(records(&a, "eval").iter().all(|r| r["step"] != 0));
}

/// `train.early_stop_patience`: a run whose validation loss stops improving (here no fall
/// counts, with a threshold of 100) ends at the evaluation that uses up its patience, with a
/// checkpoint there and the best evaluation in its summary; resumed, it rebuilds the count
/// from its metrics (so it stops at the next evaluation, not two later); a run that keeps
/// improving runs to `train.steps`.
#[test]
fn early_stopping_ends_a_run_that_stopped_improving_and_survives_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let args = [
        "train.steps=20",
        "train.eval_every=2",
        "train.checkpoint_every=0",
        "train.early_stop_patience=2",
        "train.early_stop_min_delta=100",
    ];
    let s = run_to(&a, &args, false, None).unwrap();
    assert_eq!(s.steps, 6);
    let e = s.early_stop.as_ref().expect("an early-stop report");
    assert!(e.stopped);
    assert_eq!(e.best_step, 2);
    let ckpt = s.checkpoint.clone().expect("a checkpoint at the stop");
    assert!(ckpt.ends_with(&train::checkpoint::step_name(6)), "{ckpt}");
    let evals: Vec<u64> = records(&a, "eval")
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evals, [2, 4, 6]);
    let resumed = run_to(&a, &[], true, None).unwrap();
    assert_eq!(resumed.steps, 8);
    assert!(resumed.early_stop.unwrap().stopped);
    // No best checkpoint was asked for.
    assert!(train::checkpoint::best(&a).is_none());

    let improving = [
        "train.steps=6",
        "train.eval_every=2",
        "train.early_stop_patience=1",
    ];
    let s = run_to(&b, &improving, false, None).unwrap();
    assert_eq!(s.steps, 6);
    let e = s.early_stop.expect("an early-stop report");
    assert!(!e.stopped);
    assert_eq!(e.best_step, 6);
}

/// `train.keep_best`: every evaluation that sets a new best is checkpointed and the newest of
/// those outlives pruning (`checkpoints/best` names it, `--checkpoint best` resolves to it);
/// with early stopping, the run's last checkpoint is the stop and the best one is older.
#[test]
fn the_best_checkpoint_outlives_pruning() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let args = [
        "train.steps=20",
        "train.eval_every=2",
        "train.checkpoint_every=1",
        "train.early_stop_patience=3",
        "train.early_stop_min_delta=100",
        "train.keep_best=true",
    ];
    let s = run_to(&a, &args, false, None).unwrap();
    assert_eq!(s.steps, 8);
    let best = train::checkpoint::resolve(&a, Some("best")).unwrap();
    assert!(best.ends_with(train::checkpoint::step_name(2)), "{best:?}");
    let names: Vec<String> = train::checkpoint::list(&a)
        .iter()
        .map(|c| c.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    // A checkpoint every step, the newest two kept, and the best.
    assert_eq!(names, [8, 7, 2].map(train::checkpoint::step_name));
    let weights = |c: &std::path::Path| std::fs::read(c.join("model.safetensors")).unwrap();
    assert_ne!(weights(&best), final_weights(&a));

    // Improving from eval to eval with frequent checkpoints: the best follows the loss and
    // survives the pruning of the other checkpoints.
    let improving = [
        "train.steps=12",
        "train.eval_every=4",
        "train.checkpoint_every=1",
        "train.keep_best=true",
    ];
    let s = run_to(&b, &improving, false, None).unwrap();
    let e = s.early_stop.expect("a best evaluation");
    let best = train::checkpoint::resolve(&b, Some("best")).unwrap();
    assert!(
        best.ends_with(train::checkpoint::step_name(e.best_step)),
        "{best:?} {e:?}"
    );
    assert!(train::checkpoint::list(&b).len() <= 3);
    // A run without it has no best to read.
    let err = train::checkpoint::resolve(&a.with_file_name("none"), Some("best")).unwrap_err();
    assert!(err.to_string().contains("train.keep_best=true"), "{err}");
}

/// `train.epochs` decides the steps: enough to draw that many times the training rows (here
/// windows of 32 tokens of a small corpus, 4 a step), whatever `train.steps` says.
#[test]
fn epochs_decide_the_number_of_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = tmp.path().join("corpus.txt");
    let text = kiln::data::Corpus::load(None).unwrap().text;
    std::fs::write(&corpus, &text[..8000]).unwrap();
    let data = format!("data.corpus={}", corpus.display());
    let args = [
        data.as_str(),
        "train.epochs=0.5",
        "train.steps=1000",
        "train.eval_every=0",
    ];
    let s = run_to(&tmp.path().join("run"), &args, false, None).unwrap();
    // 95% of 8000 bytes trains: 7600 tokens, 237 windows of 32; half of them, 4 a step.
    assert_eq!(s.steps, 30);
    let bad = run_to(&tmp.path().join("bad"), &["train.epochs=-1"], false, None).unwrap_err();
    assert!(bad.to_string().contains("train.epochs"), "{bad}");
}
