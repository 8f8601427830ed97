//! The parameters of a small model of each family, adapters included: names, shapes, whether
//! they train, and a hash of the values they start from, in order, as recorded in
//! `param_order.txt`. The order is what the optimizer, checkpoints, data-parallel buckets and
//! gradient-ready indices rely on, and the values are the initialisation's RNG draws: a change
//! to how layers declare or build their parameters must leave all of it as it was.

use super::Model;
use super::gpt::{Gpt, GptConfig};
use super::resnet_bk::{ResnetBk, ResnetBkConfig};
use crate::engine::{Device, MemoryPool};
use crate::nn::lora::LoraSpec;
use crate::nn::moe::MoeConfig;
use crate::nn::{Param, Params};
use std::fmt::Write;

fn describe(out: &mut String, family: &str, params: Vec<&Param>) {
    for p in params {
        let hash = p
            .value
            .to_vec()
            .unwrap()
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
                (h ^ v.to_bits() as u64).wrapping_mul(0x0100_0000_01b3)
            });
        let state = if p.frozen { "frozen" } else { "trains" };
        let shape = p.value.shape();
        writeln!(out, "{family} {} {shape:?} {state} {hash:016x}", p.name).unwrap();
    }
}

fn lora() -> LoraSpec {
    LoraSpec {
        rank: 2,
        alpha: 4.0,
        rslora: false,
        dropout: 0.0,
        targets: vec!["all-linear".into()],
    }
}

/// Tied with query/key norms, or untied with query/key/value biases.
/// One line per parameter of every model, in order.
fn all() -> String {
    let pool = MemoryPool::new(Device::Cpu);
    let mut out = String::new();
    for tied in [true, false] {
        let cfg = GptConfig {
            vocab: 50,
            d_model: 16,
            n_layers: 2,
            n_heads: 2,
            context: 8,
            tied_head: tied,
        };
        let m = Gpt::new(&pool, cfg, 1).unwrap();
        describe(&mut out, &format!("gpt tied={tied}"), m.params());
        let moe = MoeConfig {
            d_model: 16,
            hidden: 32,
            experts: 2,
            top_k: 1,
            capacity_factor: 1.25,
            aux_coef: 0.01,
        };
        let cfg = ResnetBkConfig {
            vocab: 50,
            d_model: 16,
            n_layers: 2,
            context: 8,
            tied_head: tied,
            moe,
        };
        let m = ResnetBk::new(&pool, cfg, 2).unwrap();
        describe(&mut out, &format!("resnet_bk tied={tied}"), m.params());
        let mut m = super::llama::tests::tiny(tied, 2);
        describe(&mut out, &format!("llama tied={tied}"), m.params());
        m.attach_lora(&lora(), 5).unwrap();
        describe(&mut out, &format!("llama+lora tied={tied}"), m.params());
    }
    let mut m = super::bert::tests::tiny();
    describe(&mut out, "bert", m.params());
    let bert_pool = m.params()[0].value.pool().clone();
    m.attach_lora(&bert_pool, &lora(), None, 9).unwrap();
    describe(&mut out, "bert+lora", m.params());
    out
}

#[test]
fn every_family_keeps_its_parameters_names_order_and_initial_values() {
    let recorded = include_str!("param_order.txt");
    let now = all();
    for (i, (a, b)) in recorded.lines().zip(now.lines()).enumerate() {
        assert_eq!(a, b, "line {} of param_order.txt", i + 1);
    }
    assert_eq!(recorded.lines().count(), now.lines().count());
}
