//! Where generation runs: the pool and compute dtype a device and precision choice give,
//! and a model built on the CPU (imported or loaded) moved there.

use crate::engine::device::DeviceRequest;
use crate::engine::{DType, Device, MemoryPool};
use crate::error::{KilnError, Result};
use crate::models::Model;
use std::sync::Arc;

/// The pool of `device` and the compute dtype generation uses there (bf16 on a GPU unless
/// fp32 is asked for; the CPU runs fp32), with a note naming both. Where `auto` falls back to
/// the CPU, why goes to standard error (as `kiln train` says it): a GPU whose backend does not
/// start would otherwise look like a slow run.
pub fn open_for_generation(
    device: &str,
    precision: Option<&str>,
) -> Result<(Arc<MemoryPool>, Option<DType>, String)> {
    let request: DeviceRequest = device.parse().map_err(KilnError::Setting)?;
    let (pool, why) = crate::engine::open(request)?;
    if pool.device() == Device::Cpu
        && let Some(why) = why
    {
        eprintln!("note: {why}");
    }
    let dtype = generation_dtype(pool.device(), precision)?;
    let note = format!(
        "{} in {}",
        pool.device(),
        if dtype.is_some() { "bf16" } else { "fp32" }
    );
    Ok((pool, dtype, note))
}

/// The compute dtype generation uses on `device` for `--precision`: bf16 on a GPU unless fp32
/// is asked for; the CPU runs fp32 (`None`).
pub fn generation_dtype(device: Device, precision: Option<&str>) -> Result<Option<DType>> {
    match (device, precision) {
        (Device::Cpu, None | Some("fp32")) => Ok(None),
        (Device::Cpu, Some(p)) => Err(KilnError::Setting(format!(
            "--precision {p} needs a GPU; the CPU generates in fp32"
        ))),
        (_, Some("fp32")) => Ok(None),
        (_, None | Some("bf16")) => Ok(Some(DType::BF16)),
        (_, Some(p)) => Err(KilnError::Setting(format!(
            "--precision {p} is not one kiln generates in; use fp32 or bf16"
        ))),
    }
}

/// Moves a model built on the CPU to `device` (a fresh pool, also on the CPU), frozen and
/// held in bf16 on a GPU unless fp32 is asked for. Returns the model and a note naming the
/// device and precision.
pub fn to_device(
    model: Box<dyn Model>,
    cfg: &crate::config::ModelConfig,
    vocab: usize,
    device: &str,
    precision: Option<&str>,
) -> Result<(Box<dyn Model>, String)> {
    let (pool, dtype, note) = open_for_generation(device, precision)?;
    // Norm gains folded on the host, in f32, as the device would fold them before converting
    // (folding the converted matrices would round them twice); the device's own fold below
    // then meets gains of one and changes no value.
    let mut model = model;
    model.fold_norm_gains()?;
    // The host model's values by name, each released as it is read (host memory stays at
    // one copy), then the device model built from them frozen: no initialisation, no
    // gradient buffers, each matrix converted to the generation dtype as it arrives, so the
    // device holds one matrix in f32 at most.
    let mut weights = std::collections::BTreeMap::new();
    for p in model.params_mut() {
        let t = crate::nn::builder::HostTensor {
            shape: p.value.shape().to_vec(),
            data: p.value.to_vec()?,
        };
        p.value = crate::engine::Tensor::zeros(p.value.pool(), &[0], DType::F32)?;
        weights.insert(p.name.clone(), t);
    }
    drop(model);
    let origin = std::path::Path::new("the model built on the host");
    let mut on = crate::models::load_for(
        cfg,
        vocab,
        &pool,
        &weights,
        origin,
        crate::models::Role::Run(dtype),
    )?;
    drop(weights);
    ready_for_generation(on.as_mut(), dtype)?;
    Ok((on, note))
}

/// Readies a model holding its weights for generation: norm gains folded into the
/// projections after them where that makes decoding faster ([`Model::fold_norm_gains`]),
/// every parameter frozen (no gradient buffer, which generation never writes) and held only in `dtype` (`None`: fp32), with no
/// f32 master beside a bf16 copy: 2 bytes a parameter in bf16 where training keeps 10.
/// Parameters a layer reads as f32 masters (the BK-Core's) stay f32. `kiln plan --generate`
/// runs the same on a meta device.
pub fn ready_for_generation(model: &mut dyn Model, dtype: Option<DType>) -> Result<()> {
    model.fold_norm_gains()?;
    for p in model.params_mut() {
        p.freeze()?;
        p.set_compute_dtype(dtype)?;
    }
    Ok(())
}

pub fn load_pretrained_on_cpu(
    path: &std::path::Path,
) -> Result<(Box<dyn Model>, crate::config::ModelConfig, usize)> {
    let p = crate::models::import::pretrained::open(path)?;
    Ok((p.build_on_cpu()?, p.model, p.vocab))
}
