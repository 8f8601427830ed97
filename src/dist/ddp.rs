//! Data parallelism inside the trainer: one [`DataParallel`] per rank joins the job, reduces
//! the gradients of every step in buckets (on a GPU through NCCL, launched from inside the
//! backward pass as soon as a bucket's gradients are final; on the CPU through the control
//! plane), and under ZeRO keeps each parameter's optimizer moments on one owner rank only,
//! broadcasting the owners' updated weights after the step.
//!
//! Gradients are summed, not averaged: every rank already scales its token losses by
//! `1 / tokens in the global batch` (the global count is agreed before the step), so the sum
//! is the gradient of the global batch's mean loss, exactly what one process accumulating the
//! whole global batch computes, up to the order of the additions.

use super::control::{Control, Member, OnPeerFailure, Rendezvous, bytes_f32, f32_bytes};
use super::launch::World;
use super::nccl::{Collective, Nccl, RawTensor};
use super::shard::{self, ZeroStage};
use crate::engine::{DType, Device, MemoryPool, Tensor};
use crate::models::GradReady;
use crate::nn::Param;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Settings of the data-parallel run (`[dist]`).
#[derive(Debug, Clone, Copy)]
pub struct DistSettings {
    pub stage: ZeroStage,
    /// Bytes of gradient per bucket.
    pub bucket_bytes: usize,
    pub timeout: Duration,
    pub on_failure: OnPeerFailure,
}

/// The gradient collectives of one step, bucket by bucket, and how many are on their way.
struct Reducer {
    nccl: Arc<Nccl>,
    buckets: Vec<Range<usize>>,
    /// Per bucket, the collectives of its gradients (filled at the start of each step, since
    /// a released gradient comes back at another address).
    ops: Vec<Vec<(RawTensor, Collective)>>,
    launched: usize,
    error: Option<String>,
}

impl Reducer {
    /// Launches every bucket ready once the parameters from `first_final` on are final.
    fn launch_ready(&mut self, first_final: usize) {
        let ready = shard::ready_buckets(&self.buckets, first_final);
        while self.launched < ready {
            if let Err(e) = self.nccl.launch(&self.ops[self.launched]) {
                self.error.get_or_insert(e);
            }
            self.launched += 1;
        }
    }
}

pub struct DataParallel {
    pub world: World,
    pub control: Control,
    pub stage: ZeroStage,
    pub nccl: Option<Arc<Nccl>>,
    /// Owner rank of each trainable parameter's optimizer state.
    pub owners: Vec<usize>,
    pub buckets: Vec<Range<usize>>,
    reducer: Option<Arc<Mutex<Reducer>>>,
    /// The dtype of each parameter's gradient (to bring a released one back).
    grad_dtypes: Vec<DType>,
}

impl DataParallel {
    /// Joins the job as `world.rank` with the trainable parameters `params` on `pool`.
    pub fn start(
        world: World,
        pool: &Arc<MemoryPool>,
        params: &[&Param],
        settings: DistSettings,
    ) -> Result<DataParallel, String> {
        let gpu = pool.cuda().ok().cloned();
        let (device, memory) = match (&gpu, pool.device()) {
            (Some(g), _) => (g.info().to_string(), g.memory().map_or(0, |m| m.1)),
            (None, d) => (d.to_string(), 0),
        };
        let me = Member {
            rank: world.rank,
            world_size: world.world_size,
            host: hostname(),
            pid: std::process::id(),
            device,
            device_memory: memory,
        };
        let id = match (&gpu, world.rank) {
            (Some(_), 0) => super::nccl::unique_id()?,
            _ => Vec::new(),
        };
        let rdv = Rendezvous {
            addr: world.master_addr.clone(),
            port: world.master_port,
            timeout: settings.timeout,
            on_failure: settings.on_failure,
        };
        let (control, id) = rdv.join(me, &id)?;
        let devices: Vec<bool> = control
            .members
            .iter()
            .map(|m| m.device_memory > 0)
            .collect();
        if devices.iter().any(|&g| g) && devices.iter().any(|&g| !g) {
            return Err("some ranks train on a GPU and others on the CPU; give every rank a GPU (or run every rank on the CPU)".into());
        }
        let nccl = match &gpu {
            Some(g) => Some(Arc::new(Nccl::new(g, world.rank, world.world_size, &id)?)),
            None => None,
        };
        let elements: Vec<usize> = params.iter().map(|p| p.value.len()).collect();
        let grad_bytes: Vec<usize> = params.iter().map(|p| p.grad.bytes()).collect();
        let owners = shard::owners(&elements, world.world_size);
        let buckets = shard::buckets(&grad_bytes, settings.bucket_bytes);
        let reducer = nccl.as_ref().map(|n| {
            Arc::new(Mutex::new(Reducer {
                nccl: n.clone(),
                buckets: buckets.clone(),
                ops: Vec::new(),
                launched: 0,
                error: None,
            }))
        });
        Ok(DataParallel {
            world,
            control,
            stage: settings.stage,
            nccl,
            owners,
            buckets,
            reducer,
            grad_dtypes: params.iter().map(|p| p.grad.dtype()).collect(),
        })
    }

    pub fn is_root(&self) -> bool {
        self.world.rank == 0
    }

    /// Whether this rank keeps the optimizer state of trainable parameter `i`.
    pub fn owns(&self, i: usize) -> bool {
        self.stage == ZeroStage::Zero0 || self.owners[i] == self.world.rank
    }

    /// Which trainable parameters this rank keeps optimizer state for.
    pub fn owned_mask(&self) -> Vec<bool> {
        (0..self.owners.len()).map(|i| self.owns(i)).collect()
    }

    fn reduce_op(&self, i: usize) -> Collective {
        match self.stage {
            ZeroStage::Zero2 => Collective::ReduceSum {
                root: self.owners[i],
            },
            _ => Collective::AllReduceSum,
        }
    }

    /// Brings back the gradients a ZeRO-2 step released, so the next accumulation has them.
    pub fn restore_grads(&self, params: &mut [&mut Param]) -> crate::engine::Result<()> {
        for (i, p) in params.iter_mut().enumerate() {
            if p.grad.len() != p.value.len() {
                p.grad = Tensor::zeros(p.value.pool(), p.value.shape(), self.grad_dtypes[i])?;
            }
        }
        Ok(())
    }

    /// Readies the step's reduction: records where every gradient lives now. Call after the
    /// gradients are zeroed and before the backward passes.
    pub fn prepare(&mut self, params: &[&Param]) {
        let Some(r) = &self.reducer else { return };
        let ops: Vec<Vec<(RawTensor, Collective)>> = self
            .buckets
            .iter()
            .map(|b| {
                b.clone()
                    .filter_map(|i| {
                        params[i]
                            .grad
                            .cuda_raw()
                            .map(|raw| (raw, self.reduce_op(i)))
                    })
                    .collect()
            })
            .collect();
        let mut r = r.lock().unwrap();
        r.ops = ops;
        r.launched = 0;
        r.error = None;
    }

    /// The hook the model calls during the last backward pass of the step (GPU only): it
    /// sends each bucket as soon as backward has passed below it.
    pub fn grad_ready_hook(&self) -> Option<GradReady> {
        let r = self.reducer.clone()?;
        Some(Box::new(move |first_final: usize| {
            r.lock().unwrap().launch_ready(first_final);
        }))
    }

    /// Finishes the reduction: launches the buckets the backward did not (all of them when the
    /// model has no hook, or after a failed pass, so every rank issues the same collectives)
    /// and orders the compute stream after them. On the CPU the gradients are summed here
    /// through the control plane, bucket by bucket in the same order.
    pub fn finish_reduce(&mut self, params: &mut [&mut Param]) -> Result<(), String> {
        if let Some(r) = &self.reducer {
            let mut r = r.lock().unwrap();
            r.launch_ready(0);
            if let Some(e) = r.error.take() {
                return Err(e);
            }
            return r.nccl.compute_waits();
        }
        if self.world.world_size == 1 {
            return Ok(());
        }
        for b in self.buckets.clone() {
            for i in b {
                let g = &mut params[i].grad;
                if g.device() != Device::Cpu {
                    return Err("gradient on a GPU without an NCCL communicator".into());
                }
                self.control
                    .all_reduce_sum_f32(g.host_mut(), "the gradient all-reduce")?;
            }
        }
        Ok(())
    }

    /// Under ZeRO-2, drops the gradients this rank does not own (reduced into their owners'
    /// copies; [`DataParallel::restore_grads`] brings them back zeroed for the next step).
    pub fn release_unowned_grads(&self, params: &mut [&mut Param]) -> Result<(), String> {
        if self.stage != ZeroStage::Zero2 {
            return Ok(());
        }
        if let Some(n) = &self.nccl {
            // The reduce reads them until it is done.
            n.synchronize()?;
        }
        for (i, p) in params.iter_mut().enumerate() {
            if self.owners[i] != self.world.rank {
                p.grad = Tensor::zeros(p.value.pool(), &[0], self.grad_dtypes[i])
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    /// After the optimizer step under ZeRO-1/2: every parameter's new value (and compute
    /// copy) from its owner to every rank.
    pub fn broadcast_updates(&mut self, params: &mut [&mut Param]) -> Result<(), String> {
        if self.stage == ZeroStage::Zero0 || self.world.world_size == 1 {
            return Ok(());
        }
        if let Some(n) = &self.nccl {
            let mut ops = Vec::new();
            for (i, p) in params.iter().enumerate() {
                let root = self.owners[i];
                for t in std::iter::once(&p.value).chain(p.compute.as_ref()) {
                    if let Some(raw) = t.cuda_raw() {
                        ops.push((raw, Collective::BroadcastFrom { root }));
                    }
                }
            }
            n.launch(&ops)?;
            return n.compute_waits();
        }
        for (i, p) in params.iter_mut().enumerate() {
            let root = self.owners[i];
            let got = self.control.broadcast(
                root,
                &f32_bytes(p.value.host()),
                "the ZeRO weight broadcast",
            )?;
            p.value.host_mut().copy_from_slice(&bytes_f32(&got));
        }
        Ok(())
    }

    /// Under ZeRO, rank 0 receives the moments of every parameter it does not own (host
    /// tensors, for a checkpoint); every rank must call it at the same step.
    pub fn gather_moments(
        &mut self,
        params: &[&Param],
        m: &[Tensor],
        v: &[Tensor],
    ) -> Result<Vec<Option<(Tensor, Tensor)>>, String> {
        let mut out: Vec<Option<(Tensor, Tensor)>> = (0..params.len()).map(|_| None).collect();
        if self.stage == ZeroStage::Zero0 || self.world.world_size == 1 {
            return Ok(out);
        }
        let host = MemoryPool::new(Device::Cpu);
        for i in 0..params.len() {
            let owner = self.owners[i];
            if owner == 0 {
                continue;
            }
            let mine = if owner == self.world.rank {
                let mut vals = m[i].to_vec().map_err(|e| e.to_string())?;
                vals.extend(v[i].to_vec().map_err(|e| e.to_string())?);
                f32_bytes(&vals)
            } else {
                Vec::new()
            };
            let got = self.control.gather(&mine, "gathering optimizer moments")?;
            if let Some(all) = got {
                let floats = bytes_f32(&all[owner]);
                let n = params[i].value.len();
                if floats.len() != 2 * n {
                    return Err(format!(
                        "rank {owner} sent {} moment values for {} (expected {})",
                        floats.len(),
                        params[i].name,
                        2 * n
                    ));
                }
                let shape = params[i].value.shape();
                let mk = |vals: &[f32]| {
                    Tensor::from_vec(&host, shape, DType::F32, vals.to_vec())
                        .map_err(|e| e.to_string())
                };
                out[i] = Some((mk(&floats[..n])?, mk(&floats[n..])?));
            }
        }
        Ok(out)
    }
}

/// This machine's name, for messages about ranks.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    if ok {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).to_string()
    } else {
        "unknown-host".into()
    }
}
