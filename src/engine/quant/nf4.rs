//! 4-bit NormalFloat (NF4) weights with double-quantised scales, the frozen base weights of
//! QLoRA, laid out as bitsandbytes lays them out.
//!
//! # Layout
//! A `[rows, cols]` weight is read row-major as `n = rows * cols` values and cut into blocks
//! of 64 consecutive values; the last block is padded with zeros when `n` is not a multiple
//! of 64 (a row may span blocks, and a block rows). The weight holds:
//!
//! | part | type, length | meaning | bitsandbytes (`quantize_4bit(quant_type="nf4", blocksize=64, compress_statistics=True)`) |
//! |---|---|---|---|
//! | packed codes | u8, `32 * blocks` | value `i` is code `packed[i / 2] >> 4` for even `i`, `packed[i / 2] & 15` for odd `i`, an index into the 16 NF4 values | the packed `uint8` tensor: its `ceil(n / 2)` bytes are kiln's first `ceil(n / 2)`; kiln keeps the padding of the last block so every block is 32 bytes |
//! | absmax codes | u8, `blocks` | block `b`'s absmax, less the offset, over its group's scale, as an index into the dynamic 8-bit map | `QuantState.absmax` (`weight.absmax` in a saved state dict) |
//! | absmax scales | f32, `ceil(blocks / 256)` | per group of 256 blocks, the largest `|absmax - offset|` | `state2.absmax` (`nested_absmax`) |
//! | offset | f32 | the mean of all blocks' absmax values | `QuantState.offset` (`nested_offset`) |
//! | NF4 values | 16 f32 | [`cpu::nf4::NF4_CODE`] | `QuantState.code` (`quant_map`), the same values |
//! | dynamic map | 256 f32 | [`cpu::nf4::dynamic_map`] | `state2.code` (`nested_quant_map`): the same construction; an entry may differ in its last bit from a given installation's (see there) |
//!
//! Block sizes are fixed: 64 values per absmax (`blocksize`), 256 absmax codes per scale
//! (`nested_blocksize`).
//!
//! # Arithmetic
//! Quantising block `b`: `absmax = max |v|`, each value's code the nearest NF4 value to
//! `v * (1 / absmax)` (a tie, a value exactly on the f32 midpoint bitsandbytes' decision tree
//! compares against, goes to the lower code). The absmax values are then centred on their mean
//! and coded per group of 256 with bitsandbytes' bisection of the dynamic map. Restoring:
//! `absmax' = map[code] * scale + offset` (two f32 roundings, as `dequantize_blockwise` then
//! `absmax += offset`), and each value is `NF4[code] * absmax'` in f32, rounded once to the
//! output type. The CUDA kernel computes exactly this, so its output equals the CPU
//! reference's bit for bit; bitsandbytes' `dequantize_4bit` of the same parts computes the
//! same products.
//!
//! Where kiln departs from bitsandbytes: a block of zeros gets the zero code (bitsandbytes'
//! `0 * (1 / 0)` is NaN, which its tree sends to code 0, -1.0), and a group of absmax values
//! all equal to the offset gets code 127 (0.0) where bitsandbytes' gets code 0; both decode
//! the same way in either library. The offset is the mean accumulated in f64 (PyTorch's f32
//! mean may differ in the last bit, and then an absmax code on a midpoint may differ by one).
//! Non-finite input is refused rather than coded.
//!
//! An exporter writing bitsandbytes' tensors takes the parts above as they are, with
//! `quant_type "nf4"`, `blocksize 64`, `nested_blocksize 256`, `shape [rows, cols]`.

use crate::engine::bytes::PooledBytes;
use crate::engine::cpu;
use crate::engine::cpu::nf4::{Nf4Parts, Nf4View};
use crate::engine::{DType, Device, EngineError, MemoryPool, Result, Tensor, ops};
use rayon::prelude::*;
use std::sync::Arc;

/// Bytes an NF4 `[rows, cols]` weight holds in a pool on `device`: [`Nf4Weight::bytes`]
/// before it exists, for plans.
pub fn stored_bytes(rows: usize, cols: usize, device: Device) -> usize {
    let blocks = cpu::nf4::blocks(rows * cols);
    let tables = match device {
        Device::Cpu => 0,
        Device::Cuda(_) => (cpu::nf4::NF4_CODE.len() + 256) * 4,
    };
    blocks * cpu::nf4::BLOCK_BYTES + blocks + blocks.div_ceil(cpu::nf4::ABSMAX_BLOCK) * 4 + tables
}

/// A frozen `[rows, cols]` weight in NF4 on one device, its bytes booked in that device's
/// pool. [`Nf4Weight::dequantize_into`] expands it into a workspace of the compute type.
pub struct Nf4Weight {
    name: String,
    rows: usize,
    cols: usize,
    packed: PooledBytes,
    absmax_codes: PooledBytes,
    absmax_scales: Tensor,
    offset: f32,
    /// On a GPU: the 16 NF4 values then the 256 entries of the dynamic map, which the kernel
    /// reads (the CPU reads the constants).
    code_tables: Option<Tensor>,
}

impl Nf4Weight {
    /// Quantises `values` (`rows * cols`, row-major) on the host, in parallel over blocks,
    /// and moves the result to `pool`'s device once. `name` is the tensor's name, used in
    /// errors: a NaN or infinite value is refused naming the tensor and the element.
    pub fn quantize(
        pool: &Arc<MemoryPool>,
        name: &str,
        values: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Nf4Weight> {
        if rows == 0 || cols == 0 || values.len() != rows * cols {
            return Err(EngineError::Shape {
                op: "nf4 quantize",
                detail: format!(
                    "{name}: {} values for a [{rows}, {cols}] weight; NF4 needs rows * cols values, at least one",
                    values.len()
                ),
            });
        }
        // Scanned in chunks: per element, rayon's bookkeeping cost more than the check (half
        // of a QLoRA load's time went here).
        const CHUNK: usize = 1 << 16;
        let bad_chunk = values
            .par_chunks(CHUNK)
            .position_first(|c| c.iter().any(|v| !v.is_finite()));
        let first_bad = bad_chunk.and_then(|c| {
            let start = c * CHUNK;
            values[start..]
                .iter()
                .position(|v| !v.is_finite())
                .map(|i| start + i)
        });
        if let Some(i) = first_bad {
            return Err(EngineError::NonFinite {
                layer: name.to_string(),
                detail: format!(
                    "element {i} (row {}, column {}) is {}; NF4 quantisation needs finite weights, so check the checkpoint this tensor came from",
                    i / cols,
                    i % cols,
                    values[i]
                ),
            });
        }
        Nf4Weight::from_parts(pool, name, cpu::nf4::quantize(values), rows, cols)
    }

    /// A weight from parts already in kiln's layout (see the module doc).
    fn from_parts(
        pool: &Arc<MemoryPool>,
        name: &str,
        parts: Nf4Parts,
        rows: usize,
        cols: usize,
    ) -> Result<Nf4Weight> {
        let scales = parts.absmax_scales.len();
        let code_tables = match pool.device() {
            Device::Cpu => None,
            Device::Cuda(_) => {
                let tables: Vec<f32> = cpu::nf4::NF4_CODE
                    .iter()
                    .chain(cpu::nf4::dynamic_map())
                    .copied()
                    .collect();
                Some(Tensor::from_vec(pool, &[tables.len()], DType::F32, tables)?)
            }
        };
        Ok(Nf4Weight {
            name: name.to_string(),
            rows,
            cols,
            packed: PooledBytes::from_host(pool, parts.packed)?,
            absmax_codes: PooledBytes::from_host(pool, parts.absmax_codes)?,
            absmax_scales: Tensor::from_vec(pool, &[scales], DType::F32, parts.absmax_scales)?,
            offset: parts.offset,
            code_tables,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn device(&self) -> Device {
        self.packed.device()
    }

    pub fn pool(&self) -> &Arc<MemoryPool> {
        self.packed.pool()
    }

    /// Bytes this weight holds in its pool: about 0.52 bytes a value (4 bits, one byte per 64
    /// values, four per 16384), plus 1088 bytes of code tables on a GPU.
    pub fn bytes(&self) -> usize {
        self.packed.len()
            + self.absmax_codes.len()
            + self.absmax_scales.bytes()
            + self.code_tables.as_ref().map_or(0, Tensor::bytes)
    }

    /// The weight expanded to a new `[rows, cols]` tensor of `dtype` on its device.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let mut out = Tensor::uninit(self.pool(), &[self.rows, self.cols], dtype)?;
        self.dequantize_into(&mut out)?;
        Ok(out)
    }

    /// Expands the weight into `out` (`rows * cols` elements of any dtype, on the weight's
    /// device), overwriting all of it: the workspace a GEMM then reads.
    pub fn dequantize_into(&self, out: &mut Tensor) -> Result<()> {
        ops::nf4_dequantize_into(self, out)
    }

    /// The dequantised values as f32 on the host (the CPU reference on a copy of the parts).
    pub fn to_host_f32(&self) -> Result<Vec<f32>> {
        let parts = self.to_host_parts()?;
        let mut out = vec![0.0; self.len()];
        cpu::nf4::dequantize(parts.view(), &mut out, DType::F32);
        Ok(out)
    }

    /// A host copy of the quantised parts (waits for the device), for export and checks.
    pub fn to_host_parts(&self) -> Result<Nf4Parts> {
        Ok(Nf4Parts {
            packed: self.packed.to_vec()?,
            absmax_codes: self.absmax_codes.to_vec()?,
            absmax_scales: self.absmax_scales.to_vec()?,
            offset: self.offset,
        })
    }

    /// The parts of a CPU weight, for the CPU kernel (reached through `ops`).
    pub(crate) fn host_view(&self) -> Nf4View<'_> {
        Nf4View {
            packed: self.packed.host(),
            absmax_codes: self.absmax_codes.host(),
            absmax_scales: self.absmax_scales.host(),
            offset: self.offset,
        }
    }

    /// The device buffers of a GPU weight, for the CUDA kernel (reached through `ops`).
    pub(crate) fn cuda_parts(&self) -> Result<crate::engine::cuda::Nf4Device<'_>> {
        let tables = self.code_tables.as_ref().ok_or_else(|| {
            EngineError::Unavailable(
                self.device().to_string(),
                format!(
                    "{}: NF4 weight has no code tables on this device",
                    self.name
                ),
            )
        })?;
        Ok(crate::engine::cuda::Nf4Device {
            packed: self.packed.cuda(),
            absmax_codes: self.absmax_codes.cuda(),
            absmax_scales: self.absmax_scales.cuda(),
            code_tables: tables.cuda(),
            offset: self.offset,
        })
    }
}

impl std::fmt::Debug for Nf4Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Nf4Weight({}, [{}, {}], {})",
            self.name,
            self.rows,
            self.cols,
            self.device()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::rng::{Rng, stream};

    fn normal(n: usize, seed: u64) -> Vec<f32> {
        let mut r = Rng::new(seed, stream::INIT);
        (0..n).map(|_| r.normal() * 0.05).collect()
    }

    #[test]
    fn a_weight_books_its_bytes_and_dequantises_on_the_cpu() {
        let pool = MemoryPool::new(Device::Cpu);
        let (rows, cols) = (130, 70); // 9100 values: 143 blocks, the last one padded
        let values = normal(rows * cols, 1);
        let w = Nf4Weight::quantize(&pool, "blocks.0.mlp.up", &values, rows, cols).unwrap();
        assert_eq!(w.bytes(), 143 * 32 + 143 + 4);
        assert_eq!(stored_bytes(rows, cols, Device::Cpu), w.bytes());
        assert_eq!(
            stored_bytes(rows, cols, Device::Cuda(0)),
            w.bytes() + 1088,
            "the code tables a GPU weight carries"
        );
        assert_eq!(pool.stats().current, w.bytes());
        let host = w.to_host_f32().unwrap();
        let parts = w.to_host_parts().unwrap();
        assert_eq!(parts, cpu::nf4::quantize(&values));
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let t = w.dequantize(dtype).unwrap();
            assert_eq!((t.shape(), t.dtype()), (&[rows, cols][..], dtype));
            let want: Vec<f32> = host.iter().map(|&v| dtype.round(v)).collect();
            assert_eq!(t.host(), &want[..], "{dtype:?}");
        }
        // Into a workspace of the same size, whatever its shape; poisoned first.
        let mut ws = Tensor::from_vec(
            &pool,
            &[rows * cols],
            DType::F32,
            vec![f32::NAN; rows * cols],
        )
        .unwrap();
        w.dequantize_into(&mut ws).unwrap();
        assert_eq!(ws.host(), &host[..]);
        // Far from the input only by the quantisation error.
        let worst = values
            .iter()
            .zip(&host)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst > 0.0 && worst < 0.05, "worst error {worst}");
        drop((w, ws));
        assert_eq!(pool.stats().current, 0);
    }

    #[test]
    fn non_finite_input_is_refused_naming_the_tensor_and_element() {
        let pool = MemoryPool::new(Device::Cpu);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut values = normal(4 * 50, 2);
            values[123] = bad;
            let e =
                Nf4Weight::quantize(&pool, "layers.3.q_proj.weight", &values, 4, 50).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, EngineError::NonFinite { .. }), "{msg}");
            assert!(
                msg.contains("layers.3.q_proj.weight")
                    && msg.contains("element 123 (row 2, column 23)"),
                "{msg}"
            );
        }
        // Past the scan's first chunks, the first bad element is the one named.
        let mut values = normal(4 * 50_000, 3);
        values[190_000] = f32::NAN;
        values[150_001] = f32::INFINITY;
        let msg = Nf4Weight::quantize(&pool, "w", &values, 4, 50_000)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("element 150001 (row 3, column 1)"), "{msg}");
        assert_eq!(pool.stats().current, 0);
    }

    #[test]
    fn bad_shapes_and_mismatched_workspaces_are_refused() {
        let pool = MemoryPool::new(Device::Cpu);
        let e = Nf4Weight::quantize(&pool, "w", &[1.0; 10], 3, 4).unwrap_err();
        assert!(
            e.to_string().contains("10 values for a [3, 4] weight"),
            "{e}"
        );
        assert!(Nf4Weight::quantize(&pool, "w", &[], 0, 4).is_err());
        let w = Nf4Weight::quantize(&pool, "w", &normal(12, 3), 3, 4).unwrap();
        let mut small = Tensor::zeros(&pool, &[11], DType::F32).unwrap();
        let e = w.dequantize_into(&mut small).unwrap_err().to_string();
        assert!(e.contains("w") && e.contains("12"), "{e}");
    }

    #[test]
    fn a_pool_limit_refuses_a_weight_and_books_nothing() {
        let pool = MemoryPool::new(Device::Cpu);
        pool.set_limit(1000);
        let e = Nf4Weight::quantize(&pool, "w", &normal(64 * 40, 4), 40, 64).unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
        assert_eq!(pool.stats().current, 0);
    }
}
