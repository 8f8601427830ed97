//! Low-rank adapters and the 4-bit base on a decoder's block projections, the same for every
//! family built on [`Lm`]: a family names its blocks' projections ([`Projections`]) and the
//! Hugging Face modules behind their output columns (`Linear::set_blocks`), and gets adapter
//! attachment, merging and NF4 quantisation from here.

use super::QuantizedBase;
use super::lm::{Block, Lm, TokenEmbedding};
use crate::engine::quant::DequantWorkspace;
use crate::engine::rng::{Rng, stream};
use crate::engine::{DType, EngineError, Result};
use crate::nn::builder::HostTensor;
use crate::nn::linear::Linear;
use crate::nn::lora::{Adapter, LoraSpec};
use crate::nn::{ParamBuilder, Params};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The projections of a block: the layers adapters wrap and a quantised base keeps in NF4.
pub trait Projections {
    /// The scope every block is built in, before its index (`layers` for `layers.3`).
    const SCOPE: &'static str;
    /// The projections' scopes inside the block (`attn.qkv`), in [`Projections::linears`]
    /// order.
    const NAMES: &'static [&'static str];

    fn linears(&self) -> Vec<&Linear>;
    fn linears_mut(&mut self) -> Vec<&mut Linear>;
}

/// Whether `name` is the weight of one of `B`'s projections (`layers.3.attn.qkv.weight`):
/// a family's [`super::family::Family::nf4_weights`].
pub fn is_projection_weight<B: Projections>(name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix(B::SCOPE)
        .and_then(|r| r.strip_prefix('.'))
    else {
        return false;
    };
    let Some((index, rest)) = rest.split_once('.') else {
        return false;
    };
    index.parse::<usize>().is_ok()
        && rest
            .strip_suffix(".weight")
            .is_some_and(|p| B::NAMES.contains(&p))
}

/// The adapter methods of [`super::Model`] for a family whose model keeps its skeleton in a
/// field `lm` with [`Projections`] blocks: each one [`Lm`]'s own.
macro_rules! adapters_on_lm {
    () => {
        fn attach_lora(
            &mut self,
            spec: &crate::nn::lora::LoraSpec,
            seed: u64,
        ) -> std::result::Result<Vec<String>, String> {
            self.lm.attach_lora(spec, seed)
        }

        fn lora_modules(&self) -> Vec<String> {
            self.lm.lora_modules()
        }

        fn adapters(&self) -> Vec<&crate::nn::lora::Adapter> {
            self.lm.adapters()
        }

        fn adapters_mut(&mut self) -> Vec<&mut crate::nn::lora::Adapter> {
            self.lm.adapters_mut()
        }

        fn merge_lora(&mut self) -> crate::engine::Result<()> {
            self.lm.merge_lora()
        }

        fn quantize_base_nf4(
            &mut self,
            compute: crate::engine::DType,
            host: Option<&crate::models::HostWeights>,
        ) -> crate::engine::Result<Option<crate::models::QuantizedBase>> {
            self.lm.quantize_base_nf4(compute, host).map(Some)
        }
    };
}
pub(crate) use adapters_on_lm;

impl<E: TokenEmbedding, B: Block + Projections> Lm<E, B> {
    /// Freezes every weight and adds an adapter on each projection block `spec` targets
    /// (named `{SCOPE}.{l}.{projection}.lora.{module}`); returns the adapted modules.
    pub fn attach_lora(
        &mut self,
        spec: &LoraSpec,
        seed: u64,
    ) -> std::result::Result<Vec<String>, String> {
        let fail = |e: crate::engine::EngineError| e.to_string();
        let pool = self.embed.table().value.pool().clone();
        for p in self.params_mut() {
            p.freeze().map_err(fail)?;
        }
        let mut rng = Rng::new(seed, stream::LORA);
        let mut b = ParamBuilder::init(&pool, &mut rng);
        let mut adapted = Vec::new();
        for (l, block) in self.blocks.iter_mut().enumerate() {
            let mut b = b.scope(format_args!("{}.{l}", B::SCOPE));
            for (name, lin) in B::NAMES.iter().zip(block.linears_mut()) {
                adapted.extend(lin.attach_lora(&mut b.scope(name), spec).map_err(fail)?);
            }
        }
        Ok(adapted)
    }

    /// The modules adapters can target (Hugging Face names).
    pub fn lora_modules(&self) -> Vec<String> {
        self.projections()
            .flat_map(|lin| lin.blocks.iter().map(|blk| blk.module.clone()))
            .collect()
    }

    pub fn adapters(&self) -> Vec<&Adapter> {
        self.projections()
            .flat_map(|lin| lin.adapters.iter())
            .collect()
    }

    pub fn adapters_mut(&mut self) -> Vec<&mut Adapter> {
        self.blocks
            .iter_mut()
            .flat_map(B::linears_mut)
            .flat_map(|lin| lin.adapters.iter_mut())
            .collect()
    }

    /// Folds the adapters into the projections (f32 masters) and removes them.
    pub fn merge_lora(&mut self) -> Result<()> {
        for lin in self.blocks.iter_mut().flat_map(B::linears_mut) {
            lin.merge_adapters()?;
        }
        Ok(())
    }

    /// Keeps every frozen projection only in NF4, quantised from the values it holds now,
    /// one at a time (each dense copy is freed before the next is quantised), all expanding
    /// into one workspace of `compute` values as large as the largest. A projection loaded
    /// as an empty placeholder (see [`crate::nn::builder::WeightSource::deferring`]) is
    /// quantised from its tensor in `host`.
    pub fn quantize_base_nf4(
        &mut self,
        compute: DType,
        host: Option<&BTreeMap<String, HostTensor>>,
    ) -> Result<QuantizedBase> {
        let pool = self.embed.table().value.pool().clone();
        let largest = self
            .projections()
            .map(|lin| lin.c_in * lin.c_out)
            .max()
            .unwrap_or(0);
        let workspace = Arc::new(DequantWorkspace::new(&pool, largest, compute)?);
        let mut q = QuantizedBase {
            weights: 0,
            values: 0,
            nf4_bytes: 0,
            workspace_bytes: workspace.bytes(),
        };
        for lin in self.blocks.iter_mut().flat_map(B::linears_mut) {
            let dense = match lin.weight.value.is_empty() {
                false => None,
                true => Some(
                    host.and_then(|h| h.get(&lin.weight.name))
                        .ok_or_else(|| EngineError::Shape {
                            op: "nf4 quantize",
                            detail: format!(
                                "{} was left on the host at load, but its tensor is not among the host weights",
                                lin.weight.name
                            ),
                        })?
                        .data
                        .as_slice(),
                ),
            };
            q.nf4_bytes += lin.quantize_nf4(&workspace, dense)?;
            q.weights += 1;
            q.values += lin.c_in * lin.c_out;
        }
        Ok(q)
    }

    fn projections(&self) -> impl Iterator<Item = &Linear> {
        self.blocks.iter().flat_map(B::linears)
    }
}
