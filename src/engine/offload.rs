//! Optimizer state held in host memory: the AdamW step runs on the host, chunk by chunk,
//! with the gradient and compute-copy transfers overlapped with it.
//!
//! The device keeps each parameter's compute copy and its f32 gradient; the fp32 master and
//! both moments live in a host pool ([`MemoryPool::host_for`]), page-locked beside a GPU.
//! A step walks the parameters in chunks of at most `chunk` elements through a ring of
//! [`SLOTS`] staging slots: the gradient of chunk `i + AHEAD` is on its way down and the new
//! compute values of chunks `i - 1`, `i - 2`, ... on their way up while the host runs the
//! fused AdamW pass ([`cpu::adamw`]) on chunk `i`. A step therefore costs about the larger of
//! the transfer time and the host update time rather than their sum.
//!
//! The schedule is the same on every device; only the transfers differ ([`Copies`]). On the
//! CPU they are plain copies through the same slots, so the chunking, the slot rotation and
//! the kernel calls are what CI tests, and the result is bit-identical to the in-place AdamW.

use super::cpu;
use super::cpu::adamw::AdamWStep;
use super::cuda::pinned::CopyPipeline;
use super::cuda::{Bf16, Elem, F16};
use super::{DType, Device, EngineError, MemoryPool, MemoryStats, Result, Tensor};
use std::ops::Range;
use std::sync::Arc;

/// Staging slots in the ring.
pub const SLOTS: usize = 4;
/// How many chunks ahead of the host update the gradient downloads run (less than [`SLOTS`],
/// so a download never lands in the slot the host is reading).
const AHEAD: usize = 2;

/// One parameter's tensors as the offloaded step uses them.
pub struct OffloadedParam<'a> {
    /// fp32 master, in the host pool.
    pub master: &'a mut Tensor,
    pub m: &'a mut Tensor,
    pub v: &'a mut Tensor,
    /// f32 gradient, on the device.
    pub grad: &'a Tensor,
    /// The copy the device computes with (f32, bf16 or f16), rewritten by the step.
    pub compute: &'a mut Tensor,
    pub step: AdamWStep,
}

/// The transfers: host copies through `Vec` slots on the CPU, pinned slots and copy streams
/// on a GPU.
enum Copies {
    Host(Vec<HostSlot>),
    Gpu(CopyPipeline),
}

/// A CPU staging slot: the gradient chunk and the compute chunk (f32 values rounded to the
/// compute dtype, the CPU's form of every dtype).
struct HostSlot {
    grad: Vec<f32>,
    out: Vec<f32>,
}

/// The host side of an offloaded optimizer: its host pool, staging and copy schedule.
pub struct HostOffload {
    /// Where the gradients and compute copies live.
    device: Device,
    host: Arc<MemoryPool>,
    copies: Copies,
    chunk: usize,
    staging_bytes: usize,
}

/// A chunk of one parameter: its index and element range.
type Piece = (usize, Range<usize>);

impl HostOffload {
    /// Staging for chunks of at most `chunk` elements (no larger than `largest`, the biggest
    /// parameter) beside `device`; the masters and moments go in [`host_pool`](Self::host_pool).
    pub fn new(device: &Arc<MemoryPool>, largest: usize, chunk: usize) -> Result<HostOffload> {
        let chunk = chunk.min(largest).max(1);
        let host = MemoryPool::host_for(device);
        let staging_bytes = SLOTS * 2 * chunk * size_of::<f32>();
        host.reserve(staging_bytes)?;
        let copies = match device.cuda() {
            // A meta pool books the staging and copies nothing.
            _ if device.is_meta() => Ok(Copies::Host(Vec::new())),
            Ok(gpu) => CopyPipeline::new(gpu, SLOTS, chunk).map(Copies::Gpu),
            Err(_) => Ok(Copies::Host(
                (0..SLOTS)
                    .map(|_| HostSlot {
                        grad: vec![0.0; chunk],
                        out: vec![0.0; chunk],
                    })
                    .collect(),
            )),
        };
        let copies = copies.map_err(|e| {
            host.release(staging_bytes);
            EngineError::from(e)
        })?;
        Ok(HostOffload {
            device: device.device(),
            host,
            copies,
            chunk,
            staging_bytes,
        })
    }

    /// The pool the masters and moments belong in.
    pub fn host_pool(&self) -> &Arc<MemoryPool> {
        &self.host
    }

    /// The host pool's books: masters, moments and staging.
    pub fn host_stats(&self) -> MemoryStats {
        self.host.stats()
    }

    /// One AdamW step over `params` (see the module doc for the schedule).
    pub fn adamw(&mut self, params: &mut [OffloadedParam<'_>]) -> Result<()> {
        for p in params.iter() {
            check(p, self.device)?;
        }
        if self.host.is_meta() {
            return Ok(());
        }
        let chunk = self.chunk;
        let pieces: Vec<Piece> = params
            .iter()
            .enumerate()
            .flat_map(|(i, p)| {
                let n = p.master.len();
                (0..n)
                    .step_by(chunk)
                    .map(move |s| (i, s..(s + chunk).min(n)))
            })
            .collect();
        if let Copies::Gpu(g) = &self.copies {
            g.begin()?;
        }
        for (j, (p, r)) in pieces.iter().enumerate().take(AHEAD) {
            self.download(j % SLOTS, params[*p].grad, r.clone())?;
        }
        for (i, (p, r)) in pieces.iter().enumerate() {
            if let Some((q, next)) = pieces.get(i + AHEAD) {
                self.download((i + AHEAD) % SLOTS, params[*q].grad, next.clone())?;
            }
            let slot = i % SLOTS;
            self.update(slot, &mut params[*p], r.clone())?;
            self.upload(slot, params[*p].compute, r.clone())?;
        }
        if let Copies::Gpu(g) = &self.copies {
            g.finish()?;
        }
        Ok(())
    }

    /// Starts moving `grad[range]` into `slot`.
    fn download(&mut self, slot: usize, grad: &Tensor, range: Range<usize>) -> Result<()> {
        match &mut self.copies {
            Copies::Host(slots) => {
                slots[slot].grad[..range.len()].copy_from_slice(&grad.host()[range]);
            }
            Copies::Gpu(g) => g.download(slot, grad.cuda::<f32>(), range)?,
        }
        Ok(())
    }

    /// Runs the fused AdamW pass on `range` of `p`, reading the gradient from `slot` and
    /// writing the compute values into it.
    fn update(
        &mut self,
        slot: usize,
        p: &mut OffloadedParam<'_>,
        range: Range<usize>,
    ) -> Result<()> {
        let len = range.len();
        let master = &mut p.master.host_mut()[range.clone()];
        let m = &mut p.m.host_mut()[range.clone()];
        let v = &mut p.v.host_mut()[range];
        let dtype = p.compute.dtype();
        match &mut self.copies {
            Copies::Host(slots) => {
                let HostSlot { grad, out } = &mut slots[slot];
                let out = Some((&mut out[..len], dtype));
                cpu::adamw::adamw_update(master, &grad[..len], m, v, out, p.step);
            }
            Copies::Gpu(g) => {
                fn run<C: Elem>(
                    g: &mut CopyPipeline,
                    slot: usize,
                    (master, m, v): (&mut [f32], &mut [f32], &mut [f32]),
                    h: AdamWStep,
                ) -> Result<()> {
                    let (grad, out) = g.host_slot::<C>(slot, master.len())?;
                    cpu::adamw::adamw_update(master, grad, m, v, Some((out, C::DTYPE)), h);
                    Ok(())
                }
                let state = (master, m, v);
                match dtype {
                    DType::F32 => run::<f32>(g, slot, state, p.step)?,
                    DType::BF16 => run::<Bf16>(g, slot, state, p.step)?,
                    DType::F16 => run::<F16>(g, slot, state, p.step)?,
                }
            }
        }
        Ok(())
    }

    /// Starts moving `slot`'s compute values into `compute[range]`.
    fn upload(&mut self, slot: usize, compute: &mut Tensor, range: Range<usize>) -> Result<()> {
        match &mut self.copies {
            Copies::Host(slots) => {
                let len = range.len();
                compute.host_mut()[range].copy_from_slice(&slots[slot].out[..len]);
            }
            Copies::Gpu(g) => match compute.dtype() {
                DType::F32 => g.upload(slot, compute.cuda_mut::<f32>(), range)?,
                DType::BF16 => g.upload(slot, compute.cuda_mut::<Bf16>(), range)?,
                DType::F16 => g.upload(slot, compute.cuda_mut::<F16>(), range)?,
            },
        }
        Ok(())
    }
}

impl Drop for HostOffload {
    fn drop(&mut self) {
        self.host.release(self.staging_bytes);
    }
}

/// The tensors of one parameter must agree in length and sit where the step expects them:
/// master and moments (f32) in host memory, gradient (f32) and compute copy on `device`.
fn check(p: &OffloadedParam<'_>, device: Device) -> Result<()> {
    const OP: &str = "offloaded adamw";
    let n = p.master.len();
    let places = [
        ("master", &*p.master, Device::Cpu),
        ("m", &*p.m, Device::Cpu),
        ("v", &*p.v, Device::Cpu),
        ("gradient", p.grad, device),
        ("compute copy", &*p.compute, device),
    ];
    for (what, t, want) in places {
        if t.len() != n {
            return Err(EngineError::Shape {
                op: OP,
                detail: format!("{what} has {} elements, the master {n}", t.len()),
            });
        }
        if t.device() != want {
            return Err(EngineError::DeviceMismatch {
                op: OP,
                a: t.device(),
                b: want,
            });
        }
        if what != "compute copy" && t.dtype() != DType::F32 {
            return Err(EngineError::Shape {
                op: OP,
                detail: format!("{what} is {:?}, the step keeps it in f32", t.dtype()),
            });
        }
    }
    Ok(())
}
