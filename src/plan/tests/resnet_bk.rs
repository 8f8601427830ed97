//! The ResNet-BK walk against real CPU steps: exact for the expert loads the step routed,
//! and an upper bound at the worst-case loads a plan uses.

use super::super::resnet_bk::{param_shapes, walk_step, worst_case_loads};
use super::super::*;
use crate::config::Config;
use crate::data::Batch;
use crate::engine::MemoryPool;
use crate::train::{Precision, Trainer};

struct Case {
    d_model: usize,
    n_layers: usize,
    experts: usize,
    top_k: usize,
    hidden: usize,
    tied: bool,
    vocab: usize,
    seq: usize,
    precision: Precision,
}

fn config(c: &Case, micro_batch: usize) -> Config {
    let mut cfg = Config::default();
    cfg.model.kind = "resnet_bk".into();
    cfg.model.d_model = c.d_model;
    cfg.model.n_layers = c.n_layers;
    cfg.model.moe_experts = c.experts;
    cfg.model.moe_top_k = c.top_k;
    cfg.model.moe_hidden = c.hidden;
    cfg.model.context = c.seq + 2;
    cfg.model.tied_head = c.tied;
    cfg.train.seq_len = c.seq;
    cfg.train.micro_batch = micro_batch;
    cfg
}

fn request(c: &Case, micro_batch: usize) -> PlanRequest {
    let cfg = config(c, micro_batch);
    let m = &cfg.model;
    PlanRequest {
        arch: Arch::of(m),
        model: GptConfig {
            vocab: padded_vocab(c.vocab),
            d_model: m.d_model,
            n_layers: m.n_layers,
            n_heads: m.n_heads,
            context: m.context,
            tied_head: m.tied_head,
        },
        micro_batch,
        seq_len: c.seq,
        device: Device::Cpu,
        compute: c.precision.compute_dtype().unwrap_or(DType::F32),
        recompute: false,
        offload_optimizer: false,
    }
}

/// Runs one real optimizer step of one micro-batch: the pool's peak (construction
/// included) and the expert loads summed over the layers.
fn measured(c: &Case, b: usize, offload: bool) -> (usize, Vec<usize>) {
    let mut cfg = config(c, b);
    cfg.train.offload_optimizer = offload;
    let pool = MemoryPool::new(Device::Cpu);
    let mut trainer = Trainer::new(&cfg, c.vocab, &pool, c.precision).unwrap();
    let ids = |k: usize| -> Vec<u32> {
        (0..b * c.seq)
            .map(|i| ((i * 7 + k * 13 + i * i) % c.vocab) as u32)
            .collect()
    };
    let batch = Batch {
        inputs: ids(1),
        targets: ids(2),
        batch: b,
        seq: c.seq,
    };
    let report = trainer.step(&[batch]).unwrap();
    let real: Vec<(String, usize)> = trainer
        .model
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.value.len()))
        .collect();
    let cfg = request(c, b).resnet_bk().unwrap();
    assert_eq!(
        param_shapes(&cfg),
        real,
        "the planner's parameter list is the model's"
    );
    let load = report.routing.expect("ResNet-BK reports its routing").load;
    (pool.stats().peak, load)
}

fn cases() -> Vec<Case> {
    let case = |n_layers, experts, top_k, tied, precision| Case {
        d_model: 16,
        n_layers,
        experts,
        top_k,
        hidden: 96,
        tied,
        vocab: 41,
        seq: 6,
        precision,
    };
    vec![
        // One layer: the summed loads the step reports are the layer's own.
        case(1, 4, 1, true, Precision::Fp32),
        case(1, 4, 2, false, Precision::Bf16Mixed),
        case(1, 3, 2, true, Precision::Bf16Mixed),
        case(1, 5, 1, false, Precision::Fp32),
        // Routing fixed by the shape: one expert takes every token, or two experts both.
        case(2, 1, 1, false, Precision::Fp32),
        case(3, 2, 2, true, Precision::Bf16Mixed),
        // Several layers of data-dependent routing: only the bound can be checked.
        case(2, 4, 2, false, Precision::Fp32),
        case(2, 4, 1, true, Precision::Bf16Mixed),
    ]
}

fn spec(r: &PlanRequest) -> gpt::StepSpec {
    gpt::StepSpec {
        batch: r.micro_batch,
        seq: r.seq_len,
        layout: r.layout(),
        recompute: false,
        offload: r.offload_optimizer,
        gemm_workspace: 0,
    }
}

#[test]
fn resnet_bk_walk_equals_a_real_cpu_step_and_the_plan_bounds_it() {
    // Steps whose routing left the plan's worst case above the real peak: the cases must
    // put the expert activations at the peak, or the bound would test nothing.
    let mut bounded = 0;
    for (i, c) in cases().iter().enumerate() {
        for b in 1..=4 {
            for offload in [false, true] {
                let mut r = request(c, b);
                r.offload_optimizer = offload;
                let (peak, load) = measured(c, b, offload);
                let cfg = r.resnet_bk().unwrap();
                let worst = worst_case_loads(&cfg.moe, b * c.seq);
                let fixed = c.experts <= c.top_k;
                if c.n_layers == 1 || fixed {
                    let loads = if fixed {
                        vec![worst.clone(); c.n_layers]
                    } else {
                        vec![load.clone()]
                    };
                    let walked = walk_step(&cfg, spec(&r), &loads).pool_peak();
                    assert_eq!(
                        walked, peak,
                        "case {i} batch {b} offload {offload} loads {loads:?}: walked {walked} vs measured {peak}"
                    );
                }
                let planned = plan(&r);
                assert!(
                    planned.pool_peak >= peak,
                    "case {i} batch {b} offload {offload}: planned {} below measured {peak}",
                    planned.pool_peak
                );
                let over = (planned.pool_peak - peak) as f64 / peak as f64;
                assert!(
                    over < 0.05,
                    "case {i} batch {b} offload {offload}: planned {} is {:.1}% over measured {peak}",
                    planned.pool_peak,
                    100.0 * over
                );
                assert_eq!(planned.device_peak, planned.pool_peak);
                bounded += usize::from(planned.pool_peak > peak);
            }
        }
    }
    assert!(bounded >= 10, "only {bounded} steps peaked in the experts");
}

#[test]
fn worst_case_loads_fill_experts_to_capacity_and_keep_every_slot() {
    let cfg = config(
        &Case {
            d_model: 8,
            n_layers: 1,
            experts: 4,
            top_k: 2,
            hidden: 8,
            tied: true,
            vocab: 11,
            seq: 5,
            precision: Precision::Fp32,
        },
        2,
    );
    let Arch::ResnetBk { moe } = Arch::of(&cfg.model) else {
        panic!("a resnet_bk config plans as ResNet-BK");
    };
    // 10 tokens, 20 slots; capacity ceil(1.25 * 20 / 4) = 7 per expert.
    assert_eq!(worst_case_loads(&moe, 10), vec![7, 7, 6, 0]);
    // Two experts for top-2: each takes every token, never more.
    let two = MoeConfig { experts: 2, ..moe };
    assert_eq!(worst_case_loads(&two, 10), vec![10, 10]);
}
