//! Device dispatch: the one place that decides which kernel runs for which device.
//!
//! Every function checks that its tensors share a device, allocates its outputs from that
//! device's pool (so out-of-memory surfaces here as a typed error) and calls the CPU kernel or
//! the CUDA kernel with the same semantics. Layers call these and stay device-agnostic.
//!
//! This module holds what every operation shares (the device of a call, output checks, row
//! ids); the operations live by kind in `linear` (products), `elementwise`, `norms`, `rope`,
//! `attention`, `loss`, `rows` (embeddings, gathers, scatters), `optim`, `bk`, `kv_cache`,
//! `sampling` and `diversity`, all re-exported here, so callers name them `ops::name`.

use super::AttnShape;
use super::GemmShape;
use super::MatrixView;
use super::cpu;
use super::cpu::adamw::AdamWStep;
pub use super::cpu::cross_entropy::IGNORE_TARGET;
pub use super::cpu::diversity::SetShape;
use super::cpu::kv_cache::CacheShape;
use super::cpu::rope::RopeShape;
use super::cpu::sampling::{HostSlots, SampleParams};
use super::cuda::sampling::DeviceSlots;
use super::cuda::{AdamWSlices, Bf16, CudaBackend, F16, LogitRows};
use super::pool::MemoryPool;
use super::profile;
use super::quant::Nf4Weight;
use super::tensor::DeviceElem;
use super::{DType, Device, EngineError, Result, Tensor};
use cudarc::driver::CudaSlice;
use std::sync::Arc;

/// Runs `$body` with `$T` the GPU element type of `$dtype` (f32, bf16 or f16).
macro_rules! with_elem {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::BF16 => {
                type $T = Bf16;
                $body
            }
            DType::F16 => {
                type $T = F16;
                $body
            }
        }
    };
}

mod attention;
mod bk;
mod diversity;
mod elementwise;
mod kv_cache;
mod linear;
mod loss;
mod norms;
mod optim;
mod rope;
mod rows;
mod sampling;
pub use attention::*;
pub use bk::*;
pub use diversity::*;
pub use elementwise::*;
pub use kv_cache::*;
pub use linear::*;
pub use loss::*;
pub use norms::*;
pub use optim::*;
pub use rope::*;
pub use rows::*;
pub use sampling::*;

/// The dtype of an activation computed on `device` from inputs of `dtype`: the CPU computes
/// and stores f32 whatever the policy (its narrow types are emulated by rounding weights); a
/// GPU keeps the type. Public so the memory planner books activations as the kernels do.
pub fn activation_dtype(device: Device, dtype: DType) -> DType {
    match device {
        Device::Cpu => DType::F32,
        Device::Cuda(_) => dtype,
    }
}

fn act_dtype(t: &Tensor) -> DType {
    activation_dtype(t.device(), t.dtype())
}

/// An error unless `out` holds the activation dtype that `input` computes in: the check of an
/// op writing into a caller's buffer.
fn expect_act_output(op: &'static str, out: &Tensor, input: &Tensor) -> Result<()> {
    if out.dtype() == act_dtype(input) {
        return Ok(());
    }
    Err(EngineError::Shape {
        op,
        detail: format!(
            "an output of {:?} for an input computing in {:?}",
            out.dtype(),
            act_dtype(input)
        ),
    })
}

/// Shape of the f32 softmax statistics attention keeps for its backward on `device`: the
/// probabilities `[B, H, T, T]` on the CPU, one log-sum-exp per row `[B, H, T]` on a GPU.
pub fn attention_stats_shape(device: Device, s: AttnShape) -> Vec<usize> {
    match device {
        Device::Cpu => vec![s.batch, s.heads, s.seq, s.seq],
        Device::Cuda(_) => vec![s.batch, s.heads, s.seq],
    }
}

/// Where an op runs: the CPU, a GPU with its backend, or nowhere: tensors of a meta pool,
/// whose outputs are booked (by the same allocations as on the device the pool stands for)
/// and never computed.
enum On {
    Cpu,
    Gpu(Arc<CudaBackend>),
    Meta,
}

/// The common device of `ts`, or an error naming the op.
fn device_of(op: &'static str, ts: &[&Tensor]) -> Result<On> {
    let d = ts[0].device();
    if ts[0].is_meta() {
        return Ok(On::Meta);
    }
    for t in &ts[1..] {
        if t.device() != d {
            return Err(EngineError::DeviceMismatch {
                op,
                a: d,
                b: t.device(),
            });
        }
    }
    match d {
        Device::Cpu => Ok(On::Cpu),
        Device::Cuda(_) => Ok(On::Gpu(ts[0].pool().cuda()?.clone())),
    }
}

/// On a meta pool standing in for a GPU, books `bytes` the GPU kernel of an op would take
/// from the driver outside the pool while it runs (uploaded ids, partial sums).
fn meta_scratch(t: &Tensor, bytes: usize) {
    if matches!(t.device(), Device::Cuda(_)) {
        t.pool().book_outside(bytes);
    }
}

fn expect_len(op: &'static str, what: &str, t: &Tensor, len: usize) -> Result<()> {
    if t.len() == len {
        Ok(())
    } else {
        Err(EngineError::Shape {
            op,
            detail: format!("{what} has shape {:?}, expected {len} elements", t.shape()),
        })
    }
}

/// A tensor as `[rows, width]` (its last dimension the width), or a shape error naming `op`.
pub fn rows_cols(op: &'static str, t: &Tensor) -> Result<(usize, usize)> {
    match t.shape() {
        [.., c] if *c > 0 => Ok((t.len() / c, *c)),
        s => Err(EngineError::Shape {
            op,
            detail: format!("expected a non-empty last dimension, got {s:?}"),
        }),
    }
}

/// u32 indices a kernel reads (token ids, cache slots, positions).
#[derive(Clone, Copy)]
pub enum Ids<'a> {
    /// On the host: checked here, and uploaded for a GPU kernel.
    Host(&'a [u32]),
    /// Already in a GPU buffer, which a decode step replayed from a CUDA graph reads afresh
    /// at every replay. The host cannot see the values, so only their count is checked here;
    /// the kernels bound every index themselves (an index out of range gives a row of NaN,
    /// never an access outside a buffer).
    Device(&'a CudaSlice<u32>),
}

impl Ids<'_> {
    pub fn len(&self) -> usize {
        match self {
            Ids::Host(v) => v.len(),
            Ids::Device(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn host(&self) -> Option<&[u32]> {
        match self {
            Ids::Host(v) => Some(v),
            Ids::Device(_) => None,
        }
    }
}

/// Indices where a GPU kernel reads them: borrowed, or uploaded from the host.
enum GpuIds<'a> {
    Borrowed(&'a CudaSlice<u32>),
    Uploaded(CudaSlice<u32>),
}

impl GpuIds<'_> {
    fn get(&self) -> &CudaSlice<u32> {
        match self {
            GpuIds::Borrowed(d) => d,
            GpuIds::Uploaded(d) => d,
        }
    }
}

fn gpu_ids<'a>(g: &CudaBackend, ids: Ids<'a>) -> Result<GpuIds<'a>> {
    Ok(match ids {
        Ids::Host(v) => GpuIds::Uploaded(g.upload(v)?),
        Ids::Device(d) => GpuIds::Borrowed(d),
    })
}

/// The host values of indices for a CPU kernel; device indices cannot serve one.
fn cpu_ids<'a>(op: &'static str, ids: Ids<'a>) -> Result<&'a [u32]> {
    match ids {
        Ids::Host(v) => Ok(v),
        Ids::Device(_) => Err(EngineError::Shape {
            op,
            detail: "indices on a GPU for tensors on the CPU".into(),
        }),
    }
}

/// On the GPU both tensors must be stored in one type (the CPU stores f32 whatever the tag).
fn same_gpu_dtype(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.dtype() == b.dtype() {
        Ok(())
    } else {
        Err(EngineError::Shape {
            op,
            detail: format!(
                "{:?} and {:?} tensors; both must be one type",
                a.dtype(),
                b.dtype()
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `_into` forms of the decode step write what the allocating ones return, and refuse
    /// an output buffer of another dtype than the activations'.
    #[test]
    fn into_forms_match_the_allocating_ones_and_check_their_output() {
        let cpu = MemoryPool::new(Device::Cpu);
        let (rows, c, f) = (3, 8, 6);
        let values = |n: usize, k: usize| (0..n).map(move |i| ((i * k % 17) as f32 - 8.0) / 9.0);
        let x = Tensor::from_vec(&cpu, &[rows, c], DType::F32, values(rows * c, 5).collect());
        let w = Tensor::from_vec(
            &cpu,
            &[2 * f, c],
            DType::F32,
            values(2 * f * c, 7).collect(),
        );
        let (x, w) = (x.unwrap(), w.unwrap());
        let want = linear_swiglu_normed(&x, &w, 1e-5)
            .unwrap()
            .to_vec()
            .unwrap();
        let mut h = Tensor::uninit(&cpu, &[rows, f], DType::F32).unwrap();
        linear_swiglu_normed_into(&mut h, &x, &w, 1e-5).unwrap();
        assert_eq!(h.to_vec().unwrap(), want);
        let mut wrong = Tensor::uninit(&cpu, &[rows, f], DType::BF16).unwrap();
        let err = linear_swiglu_normed_into(&mut wrong, &x, &w, 1e-5).unwrap_err();
        assert!(err.to_string().contains("an output of BF16"), "{err}");
        let mut short = Tensor::uninit(&cpu, &[rows, f - 1], DType::F32).unwrap();
        assert!(linear_swiglu_normed_into(&mut short, &x, &w, 1e-5).is_err());
    }

    fn q_on(pool: &Arc<MemoryPool>, rows: usize) -> Tensor {
        Tensor::uninit(pool, &[rows, 8], DType::BF16).unwrap()
    }

    #[test]
    fn prefill_runs_take_prompts_from_position_zero_on_a_gpu_only() {
        let gpu = MemoryPool::meta(Device::Cuda(0));
        let lens = [37u32, 20, 29];
        let slot: Vec<u32> = lens
            .iter()
            .zip([2u32, 0, 3])
            .flat_map(|(&n, s)| std::iter::repeat_n(s, n as usize))
            .collect();
        let pos: Vec<u32> = lens.iter().flat_map(|&n| 0..n).collect();
        let q = q_on(&gpu, slot.len());
        let p = PrefillRuns::of(&q, Ids::Host(&slot), Ids::Host(&pos), 64).unwrap();
        assert_eq!(p.runs, [2, 0, 37, 0, 37, 20, 3, 57, 29]);
        assert_eq!(p.tmax, 37);
        assert_eq!(&p.padded_row[35..39], [35, 36, 37, 38]);
        assert_eq!(p.padded_row[57], 74);
        // The CPU keeps its cache attention.
        let cpu = MemoryPool::new(Device::Cpu);
        let q_cpu = q_on(&cpu, slot.len());
        assert!(PrefillRuns::of(&q_cpu, Ids::Host(&slot), Ids::Host(&pos), 64).is_none());
        // A head size the fused attention has no kernel for keeps the cache kernel; 16-bit
        // heads of 96 (Phi-3-mini's) have tensor-core kernels and take the runs.
        assert!(PrefillRuns::of(&q, Ids::Host(&slot), Ids::Host(&pos), 80).is_none());
        assert!(PrefillRuns::of(&q, Ids::Host(&slot), Ids::Host(&pos), 96).is_some());
        // A decode step's rows, a prompt continuing a cache, short prompts, and runs mostly
        // padding keep the cache kernel.
        let none = |slot: &[u32], pos: &[u32]| {
            PrefillRuns::of(&q_on(&gpu, slot.len()), Ids::Host(slot), Ids::Host(pos), 64).is_none()
        };
        assert!(none(&[0, 1, 2], &[40, 41, 42]));
        assert!(none(&[1; 20], &(5..25).collect::<Vec<_>>()));
        assert!(none(&[1; 15], &(0..15).collect::<Vec<_>>()));
        let mut slot = vec![0u32; 40];
        let mut pos: Vec<u32> = (0..40).collect();
        for s in 1..=30 {
            slot.push(s);
            pos.push(0);
        }
        assert!(none(&slot, &pos));
    }

    #[test]
    fn a_meta_prefill_standing_for_a_gpu_books_the_packed_runs() {
        let c = CacheShape {
            slots: 2,
            kv_heads: 2,
            max_len: 64,
            head_dim: 16,
        };
        let booked = |device: Device, slot: &[u32], pos: &[u32]| {
            let pool = MemoryPool::meta(device);
            let k = Tensor::uninit(&pool, &[c.len()], DType::BF16).unwrap();
            let v = Tensor::uninit(&pool, &[c.len()], DType::BF16).unwrap();
            let q = Tensor::uninit(&pool, &[slot.len(), 64], DType::BF16).unwrap();
            pool.reset_peak();
            let before = pool.stats().current;
            let rows = CacheRows::host(&q, slot, pos, c.head_dim).unwrap();
            let out = cache_attention_at(&q, &k, &v, &rows, 4, 0, 64, c).unwrap();
            assert_eq!(out.shape(), [slot.len(), 64]);
            pool.stats().peak - before
        };
        let (slot, pos) = (vec![1u32; 40], (0..40).collect::<Vec<u32>>());
        // The output alone on the CPU; on a GPU the packed [1, 40, 192] input besides.
        let (cpu, gpu) = (
            booked(Device::Cpu, &slot, &pos),
            booked(Device::Cuda(0), &slot, &pos),
        );
        assert!(
            cpu < 40 * 192 * 2 && gpu >= (40 * 192 + 40 * 64) * 2,
            "{cpu} {gpu}"
        );
    }

    /// The decode step's gate/up, norm and SwiGLU on a GPU's few rows is one kernel with no
    /// gate/up rows in memory; a meta pass standing for a GPU books the same, and one standing
    /// for the CPU (or for a GPU's f32, or too many rows) books the gate/up rows too.
    #[test]
    fn a_meta_pass_books_the_fused_gate_up_of_a_gpus_few_rows() {
        let (c, f) = (64, 96);
        let booked = |device: Device, rows: usize, dtype: DType| {
            let pool = MemoryPool::meta(device);
            let x = Tensor::uninit(&pool, &[rows, c], dtype).unwrap();
            let w = Tensor::uninit(&pool, &[2 * f, c], dtype).unwrap();
            pool.reset_peak();
            let before = pool.stats().current;
            let h = linear_swiglu_normed(&x, &w, 1e-5).unwrap();
            assert_eq!(h.shape(), [rows, f]);
            pool.stats().peak - before
        };
        let h_bytes = |rows: usize, size: usize| rows * f * size;
        assert_eq!(booked(Device::Cuda(0), 8, DType::BF16), h_bytes(8, 2));
        assert!(booked(Device::Cpu, 8, DType::BF16) >= h_bytes(8, 2) * 3);
        assert!(booked(Device::Cuda(0), 8, DType::F32) >= h_bytes(8, 4) * 3);
        assert!(booked(Device::Cuda(0), 65, DType::BF16) >= h_bytes(65, 2) * 3);
    }
}
