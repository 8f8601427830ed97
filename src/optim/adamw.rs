//! AdamW over a model's parameters, with fp32 moments kept beside each parameter, or (with
//! `train.offload_optimizer`) kept in host memory together with the fp32 masters.
//!
//! Both forms run the same fused update per element: on the device through `ops`, or on the
//! host through [`HostOffload`], which streams gradients down and compute copies back up while
//! it works. The moments are `m` and `v` in either case, in the model's parameter order, so a
//! checkpoint does not depend on where they live.
//!
//! With [`Kernels::Unfused`] (`train.fused_kernels=false`) the on-device update runs as the
//! five whole-tensor passes of a non-fused AdamW instead of one ([`ops::adamw_update_unfused`]).

use crate::engine::cpu::adamw::AdamWStep;
use crate::engine::offload::{HostOffload, OffloadedParam};
use crate::engine::{DType, EngineError, MemoryPool, MemoryStats, Result, Tensor, ops};
use crate::nn::{Kernels, Param};
use std::sync::Arc;

#[derive(Debug, Clone, Copy)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

/// Elements the offloaded step moves and updates at a time: 4 MiB of f32 gradient, large
/// enough for a copy to run near bus speed and for the host pass to spread over every core,
/// small enough that the transfers of the first and last chunk (not overlapped) stay short.
pub const OFFLOAD_CHUNK: usize = 1 << 20;

/// First and second moments per parameter, in the model's parameter order.
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Updates applied so far (bias correction uses it; skipped steps do not count).
    pub t: u64,
    /// Present when the masters and moments live in host memory.
    offload: Option<HostOffload>,
    kernels: Kernels,
    /// Under ZeRO: which parameters this rank updates (the others' moments are empty here
    /// and their new values come from their owners).
    owned: Option<Vec<bool>>,
    /// Moments of parameters another rank owns, gathered for a checkpoint (empty otherwise).
    pub gathered: Vec<Option<(Tensor, Tensor)>>,
}

impl AdamW {
    /// Moments on the device, beside the parameters.
    pub fn new(cfg: AdamWConfig, params: &[&Param]) -> Result<AdamW> {
        let zeros = |p: &&Param| Tensor::zeros(p.value.pool(), p.value.shape(), DType::F32);
        Ok(AdamW {
            cfg,
            m: params.iter().map(zeros).collect::<Result<_>>()?,
            v: params.iter().map(zeros).collect::<Result<_>>()?,
            t: 0,
            offload: None,
            kernels: Kernels::Fused,
            owned: None,
            gathered: Vec::new(),
        })
    }

    /// Moments for the parameters `owned` marks only (ZeRO-1/2); the others get empty ones.
    pub fn sharded(cfg: AdamWConfig, params: &[&Param], owned: Vec<bool>) -> Result<AdamW> {
        let zeros = |(p, own): (&&Param, &bool)| {
            let shape: &[usize] = if *own { p.value.shape() } else { &[0] };
            Tensor::zeros(p.value.pool(), shape, DType::F32)
        };
        Ok(AdamW {
            cfg,
            m: params
                .iter()
                .zip(&owned)
                .map(zeros)
                .collect::<Result<_>>()?,
            v: params
                .iter()
                .zip(&owned)
                .map(zeros)
                .collect::<Result<_>>()?,
            t: 0,
            offload: None,
            kernels: Kernels::Fused,
            owned: Some(owned),
            gathered: Vec::new(),
        })
    }

    /// Whether this optimizer updates parameter `i` (always, unless sharded).
    pub fn owns(&self, i: usize) -> bool {
        self.owned.as_ref().is_none_or(|o| o[i])
    }

    /// The moments of parameter `i` for a checkpoint: its own, or those gathered from the
    /// rank that owns it.
    pub fn moments_of(&self, i: usize) -> (&Tensor, &Tensor) {
        match self.gathered.get(i) {
            Some(Some((m, v))) if !self.owns(i) => (m, v),
            _ => (&self.m[i], &self.v[i]),
        }
    }

    /// Masters and moments in host memory beside `device` (page-locked beside a GPU): moves
    /// each parameter's master there, so the device keeps its compute copy and gradient only.
    /// The step streams chunks of at most `chunk` elements ([`OFFLOAD_CHUNK`] in training).
    pub fn offloaded(
        cfg: AdamWConfig,
        params: &mut [&mut Param],
        device: &Arc<MemoryPool>,
        compute: Option<DType>,
        chunk: usize,
    ) -> Result<AdamW> {
        let largest = params.iter().map(|p| p.value.len()).max().unwrap_or(0);
        let offload = HostOffload::new(device, largest, chunk)?;
        let host = offload.host_pool().clone();
        // One parameter at a time: its compute copy is made on the device and its master
        // leaves right after, so the device never holds every master and every compute
        // copy at once (the offload exists for models that would not fit that way).
        for p in params.iter_mut() {
            p.set_compute_dtype(compute)?;
            p.offload_master(&host)?;
        }
        let zeros = |p: &&mut Param| Tensor::zeros(&host, p.value.shape(), DType::F32);
        Ok(AdamW {
            cfg,
            m: params.iter().map(zeros).collect::<Result<_>>()?,
            v: params.iter().map(zeros).collect::<Result<_>>()?,
            t: 0,
            offload: Some(offload),
            kernels: Kernels::Fused,
            owned: None,
            gathered: Vec::new(),
        })
    }

    /// Chooses the fused update or its unfused passes. The offloaded step has one host pass
    /// and no unfused form, so it accepts only [`Kernels::Fused`].
    pub fn set_kernels(&mut self, kernels: Kernels) -> std::result::Result<(), String> {
        if kernels == Kernels::Unfused && self.offload.is_some() {
            return Err("the offloaded optimizer has no unfused form; set train.fused_kernels=true or train.offload_optimizer=false".into());
        }
        self.kernels = kernels;
        Ok(())
    }

    /// The host memory books (masters, moments and staging) when offloaded.
    pub fn host_memory(&self) -> Option<MemoryStats> {
        self.offload.as_ref().map(HostOffload::host_stats)
    }

    /// Applies one update with `grad_scale` multiplying every stored gradient first, and
    /// refreshes each parameter's compute copy in the same pass.
    pub fn step(&mut self, params: &mut [&mut Param], lr: f32, grad_scale: f32) -> Result<()> {
        self.t += 1;
        let (cfg, t) = (self.cfg, self.t);
        let hyper = |p: &Param| AdamWStep {
            lr,
            beta1: cfg.beta1,
            beta2: cfg.beta2,
            eps: cfg.eps,
            weight_decay: if p.decay { cfg.weight_decay } else { 0.0 },
            t,
            grad_scale,
        };
        let owned = self.owned.clone();
        let state = params
            .iter_mut()
            .zip(&mut self.m)
            .zip(&mut self.v)
            .enumerate()
            .filter(|(i, _)| owned.as_ref().is_none_or(|o| o[*i]))
            .map(|(_, s)| s);
        match &mut self.offload {
            None => {
                let work: Vec<ops::AdamWParam> = state
                    .map(|((p, m), v)| {
                        let h = hyper(p);
                        let Param {
                            value,
                            grad,
                            compute,
                            ..
                        } = &mut **p;
                        ops::AdamWParam {
                            param: value,
                            grad,
                            m,
                            v,
                            compute: compute.as_mut(),
                            h,
                        }
                    })
                    .collect();
                match self.kernels {
                    Kernels::Fused => ops::adamw_update_many(work),
                    Kernels::Unfused => work.into_iter().try_for_each(|p| {
                        ops::adamw_update_unfused(p.param, p.grad, p.m, p.v, p.compute, p.h)
                    }),
                }
            }
            Some(offload) => {
                let mut work = state
                    .map(|((p, m), v)| {
                        let step = hyper(p);
                        let Param {
                            name,
                            value,
                            grad,
                            compute,
                            ..
                        } = &mut **p;
                        let compute = compute.as_mut().ok_or_else(|| EngineError::Shape {
                            op: "offloaded adamw",
                            detail: format!("parameter {name} has no compute copy on the device"),
                        })?;
                        Ok(OffloadedParam {
                            master: value,
                            m,
                            v,
                            grad,
                            compute,
                            step,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                offload.adamw(&mut work)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Device;
    use crate::engine::rng::{Rng, stream};
    use crate::nn::Init;

    const CFG: AdamWConfig = AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };

    /// Parameters of assorted sizes (a matrix that spans several chunks, a vector, a scalar),
    /// with compute copies of `dtype`.
    fn params(pool: &Arc<MemoryPool>, dtype: Option<DType>) -> Vec<Param> {
        let mut rng = Rng::new(3, stream::INIT);
        let shapes: [&[usize]; 3] = [&[37, 29], &[29], &[1]];
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut p = Param::initialised(
                    pool,
                    format!("p{i}"),
                    s,
                    Init::Normal(0.5),
                    &mut rng,
                    false,
                )
                .unwrap();
                p.set_compute_dtype(dtype).unwrap();
                p
            })
            .collect()
    }

    /// Writes the same pseudo-random gradient for step `t` into both sets of parameters.
    fn set_grads(a: &mut [Param], b: &mut [Param], t: u64) {
        let mut rng = Rng::new(100 + t, stream::INIT);
        for (pa, pb) in a.iter_mut().zip(b) {
            let g: Vec<f32> = (0..pa.grad.len()).map(|_| rng.normal() * 3.0).collect();
            pa.grad.copy_from_host(&g).unwrap();
            pb.grad.copy_from_host(&g).unwrap();
        }
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_vec().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn offloaded_adamw_is_bit_identical_to_the_in_place_one() {
        for dtype in [None, Some(DType::BF16), Some(DType::F16)] {
            let pool = MemoryPool::new(Device::Cpu);
            let mut plain = params(&pool, dtype);
            let mut moved = params(&pool, dtype);
            let mut a = AdamW::new(CFG, &plain.iter().collect::<Vec<_>>()).unwrap();
            // 100 elements a chunk: the 37 x 29 matrix spans 11 chunks, more than the ring's
            // slots, so every slot is reused and the last chunk is partial.
            let mut b = AdamW::offloaded(
                CFG,
                &mut moved.iter_mut().collect::<Vec<_>>(),
                &pool,
                dtype,
                100,
            )
            .unwrap();
            for t in 1..=4 {
                set_grads(&mut plain, &mut moved, t);
                // Clipping and unscaling folded into the scale, a different one every step.
                let scale = 0.5 / t as f32;
                a.step(&mut plain.iter_mut().collect::<Vec<_>>(), 1e-2, scale)
                    .unwrap();
                b.step(&mut moved.iter_mut().collect::<Vec<_>>(), 1e-2, scale)
                    .unwrap();
            }
            for (i, (p, q)) in plain.iter().zip(&moved).enumerate() {
                assert_eq!(bits(&p.value), bits(&q.value), "{dtype:?} master {i}");
                assert_eq!(bits(&a.m[i]), bits(&b.m[i]), "{dtype:?} m {i}");
                assert_eq!(bits(&a.v[i]), bits(&b.v[i]), "{dtype:?} v {i}");
                let q_compute = q
                    .compute
                    .as_ref()
                    .expect("an offloaded param computes on a copy");
                assert_eq!(bits(p.weight()), bits(q_compute), "{dtype:?} compute {i}");
                assert_eq!(q_compute.dtype(), dtype.unwrap_or(DType::F32));
                assert!(
                    p.value.host() != params(&pool, dtype)[i].value.host(),
                    "it trained"
                );
            }
        }
    }

    #[test]
    fn offloading_moves_masters_and_moments_off_the_device_books() {
        for (dtype, left) in [(None, 8), (Some(DType::BF16), 12)] {
            let device = MemoryPool::new(Device::Cpu);
            let mut ps = params(&device, dtype);
            let n: usize = ps.iter().map(|p| p.value.len()).sum();
            let before = device.stats().current;
            let with_moments = before + 8 * n;
            let opt = AdamW::offloaded(
                CFG,
                &mut ps.iter_mut().collect::<Vec<_>>(),
                &device,
                dtype,
                1 << 20,
            )
            .unwrap();
            // Without offload the device would hold masters, moments, gradients and copies;
            // now it holds gradients and one compute copy per parameter.
            assert_eq!(with_moments - device.stats().current, left * n, "{dtype:?}");
            let host = opt.host_memory().unwrap();
            let staging = crate::engine::offload::SLOTS * 2 * 4 * (37 * 29);
            assert_eq!(host.current, 12 * n + staging, "{dtype:?}");
            assert!(ps.iter().all(|p| p.value.pool().device() == Device::Cpu));
        }
    }
}
