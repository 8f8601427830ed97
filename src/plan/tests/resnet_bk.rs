//! ResNet-BK plans against real CPU steps: the meta step books the experts at their
//! worst-case loads, exact where routing cannot vary and an upper bound where it can.

use super::super::*;
use crate::nn::moe::MoeConfig;

/// The worst-case loads of one layer of `m` for `tokens` tokens.
fn worst_case_loads(m: &MoeConfig, tokens: usize) -> Vec<usize> {
    crate::nn::moe::worst_case_loads(tokens, m.experts, m.top_k, m.capacity(tokens))
}
use crate::config::{Config, FamilySettings, ResnetBkSettings};
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
    let mut cfg = super::sized(c.d_model, c.n_layers, c.tied, c.seq, micro_batch);
    cfg.model.family = FamilySettings::ResnetBk(ResnetBkSettings {
        moe_experts: c.experts,
        moe_top_k: c.top_k,
        moe_hidden: c.hidden,
        ..ResnetBkSettings::default()
    });
    cfg
}

fn request(c: &Case, micro_batch: usize) -> PlanRequest {
    super::cpu_request(&config(c, micro_batch), c.vocab, c.precision)
}

/// Runs one real optimizer step of one micro-batch: the pool's peak (construction
/// included).
fn measured(c: &Case, b: usize, offload: bool, recompute: bool) -> usize {
    let mut cfg = config(c, b);
    cfg.train.offload_optimizer = offload;
    cfg.train.recompute = if recompute { "blocks" } else { "none" }.into();
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
    trainer.step(&[batch]).unwrap();
    pool.stats().peak
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

#[test]
fn resnet_bk_plans_bound_real_cpu_steps_and_equal_them_where_routing_is_fixed() {
    // Steps whose routing left the plan's worst case above the real peak: the cases must
    // put the expert activations at the peak, or the bound would test nothing.
    let mut bounded = 0;
    for (i, c) in cases().iter().enumerate() {
        for b in 1..=4 {
            for (offload, recompute) in [(false, false), (true, false), (false, true)] {
                let mut r = request(c, b);
                r.offload_optimizer = offload;
                r.recompute = recompute;
                let peak = measured(c, b, offload, recompute);
                // With no more experts than the top-k every token goes to every expert, so the
                // worst case is the only case.
                let fixed = c.experts <= c.top_k;
                let planned = plan(&r).unwrap();
                if fixed {
                    assert_eq!(
                        planned.pool_peak, peak,
                        "case {i} batch {b} offload {offload} recompute {recompute}"
                    );
                }
                assert!(
                    planned.pool_peak >= peak,
                    "case {i} batch {b} offload {offload} recompute {recompute}: planned {} below measured {peak}",
                    planned.pool_peak
                );
                let over = (planned.pool_peak - peak) as f64 / peak as f64;
                assert!(
                    over < 0.05,
                    "case {i} batch {b} offload {offload} recompute {recompute}: planned {} is {:.1}% over measured {peak}",
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
