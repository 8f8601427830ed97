//! Trainer behaviour on real (tiny) runs: exact accumulation, bit-exact resume, the fp16 loss
//! scaler, mixed-precision compute copies, divergence handling and typed out-of-memory.

mod common;

use kiln::config::ResolvedConfig;
use kiln::data::{self, Batch, Corpus, Tokenizer};
use kiln::engine::{DType, Device, EngineError, MemoryPool};
use kiln::error::KilnError;
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
        stop_after,
        quiet: true,
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

#[test]
fn out_of_memory_is_a_typed_error_and_the_pool_stays_usable() {
    let cfg = config(&[]);
    let tokens = corpus_tokens();
    let mut t = Trainer::new(&cfg, 256, &MemoryPool::new(Device::Cpu), Precision::Fp32).unwrap();
    let in_use = t.pool.stats().current;
    t.pool.set_limit(in_use + 64 * 1024);
    let err = t
        .step(&[data::train_batch(&tokens, 1, 0, 0, 4, 32)])
        .unwrap_err();
    assert!(
        matches!(err, KilnError::Engine(EngineError::OutOfMemory { .. })),
        "{err}"
    );
    assert_eq!(
        t.pool.stats().current,
        in_use,
        "the failed step released its activations"
    );
    t.pool.set_limit(0);
    t.step(&[data::train_batch(&tokens, 1, 0, 0, 4, 32)])
        .unwrap();
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
