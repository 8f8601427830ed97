//! The planner against real steps: on the CPU the pool books every tensor, so a planned
//! peak must equal the measured one byte for byte.

use super::*;
use crate::config::Config;
use crate::data::Batch;
use crate::engine::MemoryPool;
use crate::train::{Precision, Trainer};

mod resnet_bk;

struct Case {
    d_model: usize,
    n_layers: usize,
    n_heads: usize,
    tied: bool,
    vocab: usize,
    seq: usize,
    precision: Precision,
}

/// A default config with the shape and step keys every planner test sets.
fn sized(d_model: usize, n_layers: usize, tied: bool, seq: usize, micro_batch: usize) -> Config {
    let mut cfg = Config::default();
    cfg.model.d_model = d_model;
    cfg.model.n_layers = n_layers;
    cfg.model.context = seq + 3;
    cfg.model.tied_head = tied;
    cfg.train.seq_len = seq;
    cfg.train.micro_batch = micro_batch;
    cfg
}

/// The plan request for `cfg` on the CPU.
fn cpu_request(cfg: &Config, vocab: usize, precision: Precision) -> PlanRequest {
    let dtype = precision.compute_dtype().unwrap_or(DType::F32);
    PlanRequest::for_config(cfg, vocab, dtype, Device::Cpu)
}

fn config(c: &Case, micro_batch: usize) -> Config {
    let mut cfg = sized(c.d_model, c.n_layers, c.tied, c.seq, micro_batch);
    cfg.model.n_heads = c.n_heads;
    cfg
}

fn request(c: &Case, micro_batch: usize) -> PlanRequest {
    cpu_request(&config(c, micro_batch), c.vocab, c.precision)
}

fn batch(vocab: usize, b: usize, t: usize, salt: usize) -> Batch {
    let ids = |k: usize| -> Vec<u32> {
        (0..b * t)
            .map(|i| ((i * 7 + k * 13 + salt) % vocab) as u32)
            .collect()
    };
    Batch {
        inputs: ids(1),
        targets: ids(2),
        batch: b,
        seq: t,
    }
}

/// Builds a real trainer, runs one optimizer step over `accum` micro-batches, and returns
/// the pool's peak (construction included).
fn measured_peak(c: &Case, b: usize, accum: usize) -> usize {
    measured_peak_with(c, config(c, b), accum)
}

/// [`measured_peak`] for a config with recomputation or offload set.
fn measured_peak_with(c: &Case, cfg: Config, accum: usize) -> usize {
    let b = cfg.train.micro_batch;
    let pool = MemoryPool::new(Device::Cpu);
    let mut trainer = Trainer::new(&cfg, c.vocab, &pool, c.precision).unwrap();
    let rows = trainer.model.params()[0].value.shape()[0];
    assert_eq!(
        rows,
        padded_vocab(c.vocab),
        "the plan's vocabulary is the model's (token table rows)"
    );
    let micro: Vec<Batch> = (0..accum).map(|k| batch(c.vocab, b, c.seq, k)).collect();
    trainer.step(&micro).unwrap();
    let real: Vec<usize> = trainer
        .model
        .trainable_params()
        .iter()
        .map(|p| p.value.len())
        .collect();
    let mut r = request(c, b);
    r.recompute = cfg.train.recompute == "blocks";
    r.offload_optimizer = cfg.train.offload_optimizer;
    r.config = std::sync::Arc::new(cfg);
    assert_eq!(
        plan(&r).unwrap().trainable_elements,
        real,
        "the plan's parameters are the model's"
    );
    pool.stats().peak
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            d_model: 16,
            n_layers: 1,
            n_heads: 2,
            tied: true,
            vocab: 37,
            seq: 8,
            precision: Precision::Fp32,
        },
        Case {
            d_model: 32,
            n_layers: 2,
            n_heads: 4,
            tied: false,
            vocab: 61,
            seq: 12,
            precision: Precision::Fp32,
        },
        Case {
            d_model: 24,
            n_layers: 3,
            n_heads: 3,
            tied: true,
            vocab: 50,
            seq: 16,
            precision: Precision::Bf16Mixed,
        },
        Case {
            d_model: 40,
            n_layers: 2,
            n_heads: 5,
            tied: false,
            vocab: 256,
            seq: 10,
            precision: Precision::Bf16Mixed,
        },
        Case {
            d_model: 8,
            n_layers: 4,
            n_heads: 1,
            tied: false,
            vocab: 300,
            seq: 5,
            precision: Precision::Fp16Mixed,
        },
    ]
}

#[test]
fn planned_peak_equals_a_real_cpu_step_byte_for_byte() {
    for (i, c) in cases().iter().enumerate() {
        for b in [1, 2, 3, 8] {
            let planned = plan(&request(c, b)).unwrap();
            let measured = measured_peak(c, b, 1);
            assert_eq!(
                planned.pool_peak, measured,
                "case {i} batch {b}: planned {} vs measured {}",
                planned.pool_peak, measured
            );
            // On the CPU nothing lives outside the pool.
            assert_eq!(planned.device_peak, planned.pool_peak);
            let sum = planned.breakdown;
            assert!(sum.master_weights > 0 && sum.gradients > 0 && sum.optimizer_state > 0);
            assert!(sum.saved_activations > 0 && sum.transient > 0, "{sum:?}");
            assert_eq!(
                sum.master_weights
                    + sum.compute_copies
                    + sum.gradients
                    + sum.optimizer_state
                    + sum.saved_activations
                    + sum.transient
                    + sum.outside_pool,
                planned.device_peak
            );
        }
    }
    // Accumulation reuses the activations: two micro-batches peak like one.
    let c = &cases()[1];
    assert_eq!(
        measured_peak(c, 3, 2),
        plan(&request(c, 3)).unwrap().pool_peak
    );
}

/// The same exactness with block recomputation and with the optimizer offloaded: the
/// meta step runs those code paths too (on the CPU offload moves the masters and moments to
/// the host pool, which the device pool no longer books).
#[test]
fn recompute_and_offload_plans_equal_real_cpu_steps() {
    for (i, c) in cases().iter().enumerate() {
        for (recompute, offload) in [(true, false), (false, true), (true, true)] {
            for b in [1, 3] {
                let mut r = request(c, b);
                r.recompute = recompute;
                r.offload_optimizer = offload;
                let mut cfg = config(c, b);
                cfg.train.recompute = if recompute { "blocks" } else { "none" }.into();
                cfg.train.offload_optimizer = offload;
                let planned = plan(&r).unwrap().pool_peak;
                let measured = measured_peak_with(c, cfg, 1);
                assert_eq!(
                    planned, measured,
                    "case {i} batch {b} recompute {recompute} offload {offload}"
                );
            }
        }
    }
}

#[test]
fn saved_activations_match_the_layers_costs() {
    // What the forward keeps for the backward (its live bytes when the backward begins) is
    // what the layers' costs say they keep, on the CPU (probabilities, f32) and on a GPU
    // (log-sum-exp, compute dtype), with and without recomputation.
    for c in cases() {
        for device in [Device::Cpu, Device::Cuda(0)] {
            for recompute in [false, true] {
                let r = PlanRequest {
                    device,
                    recompute,
                    ..request(&c, 3)
                };
                let from_costs: usize = layer_table(&r)
                    .iter()
                    .map(|l| {
                        l.count
                            * if recompute {
                                l.saved_bytes_recompute
                            } else {
                                l.saved_bytes
                            }
                    })
                    .sum();
                let meta =
                    meta::meta_step(&r.step_config(), c.vocab, device, r.precision()).unwrap();
                assert_eq!(
                    meta.saved_by_forward, from_costs,
                    "{device} recompute {recompute}"
                );
            }
        }
    }
}

#[test]
fn largest_micro_batch_grows_with_memory_and_sits_on_the_boundary() {
    let c = &cases()[1];
    let r = request(c, 1);
    let mut last = 0;
    for mib in [1usize, 2, 3, 5, 8, 13, 21, 34] {
        let budget = Budget::cpu(1 << 40).with_pool_limit(mib << 20);
        let Some(b) = largest_micro_batch(&r, &budget).unwrap() else {
            assert_eq!(last, 0, "a larger budget never fits less");
            continue;
        };
        assert!(b >= last, "{mib} MiB: {b} < {last}");
        assert!(budget.fits(&plan(&r.with_batch(b)).unwrap()));
        assert!(!budget.fits(&plan(&r.with_batch(b + 1)).unwrap()));
        last = b;
    }
    assert!(last > 1);
    // Recomputation and offload never need more than the plain step on a GPU.
    let gpu = PlanRequest {
        device: Device::Cuda(0),
        compute: DType::BF16,
        ..request(c, 4)
    };
    let budget = Budget::gpu("test".into(), 1 << 30, Some(0), (9, 0));
    let by_variant = largest_by_variant(&gpu, &budget).unwrap();
    let plain = by_variant[0].1.unwrap();
    assert!(
        by_variant.iter().all(|v| v.1.unwrap() >= plain),
        "{by_variant:?}"
    );
}

#[test]
fn one_sequence_advice_names_what_helps() {
    let c = &cases()[0];
    let r = request(c, 1);
    let need = plan(&r).unwrap().device_peak;
    let advise = |limit| one_sequence_advice(&r, &Budget::cpu(1 << 40).with_pool_limit(limit));
    assert!(advise(need).unwrap().is_none());
    let msg = advise(need - 1).unwrap().unwrap();
    assert!(msg.contains("for one sequence of 8 tokens"), "{msg}");
    assert!(msg.contains("train.recompute=blocks (saves"), "{msg}");
    assert!(msg.contains("train.precision=bf16-mixed"), "{msg}");
    assert!(msg.contains("train.seq_len (at most 7 fits"), "{msg}");
}

#[test]
fn misaligned_dimensions_are_flagged_with_their_padding() {
    let c = Case {
        d_model: 36,
        n_layers: 1,
        n_heads: 3,
        tied: true,
        vocab: 50257,
        seq: 10,
        precision: Precision::Bf16Mixed,
    };
    let r = request(&c, 3);
    let dims: Vec<(String, usize)> = misaligned_dimensions(&r, 50257, 2)
        .into_iter()
        .map(|m| (m.dimension, m.padded))
        .collect();
    assert_eq!(
        dims,
        vec![
            ("d_model".to_string(), 40),
            ("3 x d_model (qkv)".to_string(), 112),
            ("head size (d_model / n_heads)".to_string(), 16),
            ("tokens per micro-batch".to_string(), 32),
        ]
    );
    // The model pads GPT-2's 50257 tokens to 50304 itself, so the vocabulary is not flagged.
    assert_eq!(r.model.padded_vocab(), 50304);
    assert_eq!(misaligned_dimensions(&r, 50257, 1)[0].multiple, 16);
}

/// The meta device books what a real CPU step books, byte for byte, for every case, batch,
/// recomputation and offload setting above, and for the unfused kernels.
#[test]
fn a_meta_step_books_the_real_cpu_peak() {
    for (i, c) in cases().iter().enumerate() {
        for b in [1, 3] {
            for (recompute, offload, fused) in [
                (false, false, true),
                (true, false, true),
                (false, true, true),
                (true, true, true),
                (true, false, false),
                (false, false, false),
            ] {
                let mut cfg = config(c, b);
                cfg.train.recompute = if recompute { "blocks" } else { "none" }.into();
                cfg.train.offload_optimizer = offload;
                cfg.train.fused_kernels = fused;
                let meta = meta::meta_step(&cfg, c.vocab, Device::Cpu, c.precision).unwrap();
                let measured = measured_peak_with(c, cfg, 1);
                assert_eq!(
                    meta.pool_peak, measured,
                    "case {i} batch {b} recompute {recompute} offload {offload} fused {fused}"
                );
                assert_eq!(
                    meta.device_peak, meta.pool_peak,
                    "nothing outside on the CPU"
                );
            }
        }
    }
}

/// A real CPU step's pool peak for `cfg` (construction included).
fn measured_cfg_peak(cfg: &Config, vocab: usize, precision: Precision) -> usize {
    let pool = MemoryPool::new(Device::Cpu);
    let mut trainer = if cfg.lora.enabled {
        Trainer::over_initialised_base(cfg, vocab, &pool, precision).unwrap()
    } else {
        Trainer::new(cfg, vocab, &pool, precision).unwrap()
    };
    let micro = [batch(vocab, cfg.train.micro_batch, cfg.train.seq_len, 0)];
    trainer.step(&micro).unwrap();
    pool.stats().peak
}

/// The model families beside the GPT (Llama with grouped-query heads, q/k norms, biases,
/// untied heads, recomputation, offload, LoRA and QLoRA;
/// ResNet-BK with its experts): the meta step books the real CPU step's peak byte for byte.
#[test]
fn a_meta_step_books_every_family_exactly() {
    let llama = |extra: &[&str]| {
        let mut v: Vec<String> = [
            "model.kind=llama",
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.ffn_hidden=48",
            "model.context=24",
            "train.seq_len=16",
            "train.micro_batch=3",
            "data.tokenizer=byte",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let cases: Vec<(Vec<String>, Precision)> = vec![
        (llama(&[]), Precision::Fp32),
        (
            llama(&["model.qk_norm=true", "model.tied_head=false"]),
            Precision::Bf16Mixed,
        ),
        (
            llama(&["model.qkv_bias=true", "train.recompute=blocks"]),
            Precision::Fp32,
        ),
        (
            llama(&["train.offload_optimizer=true"]),
            Precision::Bf16Mixed,
        ),
        (
            llama(&["lora.enabled=true", "lora.rank=4", "lora.base=labels-only"]),
            Precision::Bf16Mixed,
        ),
        (
            llama(&[
                "lora.enabled=true",
                "lora.rank=4",
                "lora.quantize=nf4",
                "lora.base=labels-only",
                "model.d_model=64",
            ]),
            Precision::Bf16Mixed,
        ),
        (
            [
                "model.kind=resnet_bk",
                "model.d_model=16",
                "model.n_layers=2",
                "model.context=16",
                "model.moe_experts=4",
                "model.moe_top_k=2",
                "train.seq_len=12",
                "train.micro_batch=2",
                "data.tokenizer=byte",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            Precision::Fp32,
        ),
    ];
    for (overrides, precision) in cases {
        let cfg = crate::config::ResolvedConfig::resolve(None, &overrides)
            .unwrap()
            .config;
        let vocab = crate::train::model_vocab(&cfg).unwrap();
        let meta = meta::meta_step(&cfg, vocab, Device::Cpu, precision).unwrap();
        let measured = measured_cfg_peak(&cfg, vocab, precision);
        if cfg.model.kind() == "resnet_bk" {
            // Routing is data-dependent: the meta step books its worst case, which bounds the
            // real step from above.
            assert!(meta.pool_peak >= measured, "{overrides:?}");
        } else {
            assert_eq!(meta.pool_peak, measured, "{overrides:?} {precision:?}");
        }
        assert!(meta.params > 0 && meta.trainable <= meta.params);
    }
}

/// Standing in for a GPU, the meta step runs without one, keeps activations in the compute
/// dtype (so bf16 books less than on the CPU) and books the GEMM workspace and kernel scratch
/// outside the pool; a 1.5B-parameter GPT plans in well under a second.
#[test]
fn a_meta_step_for_a_gpu_needs_no_gpu_and_plans_a_large_model_fast() {
    let c = &cases()[2];
    let cfg = config(c, 4);
    let cpu = meta::meta_step(&cfg, c.vocab, Device::Cpu, c.precision).unwrap();
    let gpu = meta::meta_step(&cfg, c.vocab, Device::Cuda(0), c.precision).unwrap();
    assert!(gpu.pool_peak < cpu.pool_peak, "{gpu:?} vs {cpu:?}");
    assert!(
        gpu.device_peak >= gpu.pool_peak + crate::engine::cuda::GEMM_WORKSPACE_BYTES,
        "{gpu:?}"
    );
    let mut xl = Config::default();
    xl.model.d_model = 1600;
    xl.model.n_layers = 48;
    xl.model.n_heads = 25;
    xl.model.context = 1024;
    xl.train.seq_len = 1024;
    xl.train.micro_batch = 4;
    let p = meta::meta_step(&xl, 50257, Device::Cuda(0), Precision::Bf16Mixed).unwrap();
    assert!(p.params > 1_500_000_000, "{p:?}");
    assert!(p.seconds < 1.0, "planning took {} s", p.seconds);
}

/// A plan for a configuration the real step refuses fails with the real step's message
/// before anything is booked.
#[test]
fn a_plan_the_model_refuses_fails_with_the_real_message() {
    let c = &cases()[0];
    let mut cfg = config(c, 2);
    cfg.train.seq_len = cfg.model.context + 5;
    let r = PlanRequest::for_config(&cfg, c.vocab, DType::F32, Device::Cpu);
    let planned = plan(&r).unwrap_err().to_string();
    let pool = MemoryPool::new(Device::Cpu);
    let mut trainer = Trainer::new(&cfg, c.vocab, &pool, c.precision).unwrap();
    let real = trainer
        .step(&[batch(c.vocab, 2, cfg.train.seq_len, 0)])
        .unwrap_err()
        .to_string();
    assert_eq!(planned, real);
    assert!(
        planned.contains("longer than the model's context"),
        "{planned}"
    );
}

/// On a GPU the plan's device peak adds what the allocator rounds: every live buffer to
/// 512 bytes and the total to 2 MiB granules.
#[test]
fn a_gpu_plan_rounds_buffers_and_granules() {
    let c = &cases()[3];
    let r = PlanRequest {
        device: Device::Cuda(0),
        ..request(c, 4)
    };
    let p = plan(&r).unwrap();
    assert!(p.allocator_rounding > 0);
    assert_eq!(p.device_peak % POOL_GRANULE, 0, "{p:?}");
    let b = p.breakdown;
    assert_eq!(
        b.master_weights
            + b.compute_copies
            + b.gradients
            + b.optimizer_state
            + b.saved_activations
            + b.transient
            + b.outside_pool
            + p.allocator_rounding,
        p.device_peak
    );
    assert!(b.outside_pool >= crate::engine::cuda::GEMM_WORKSPACE_BYTES);
    assert!(
        !p.peak_at.is_empty() && !p.largest_at_peak.is_empty(),
        "{p:?}"
    );
}
