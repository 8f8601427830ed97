//! The buffer frozen quantised weights are expanded into right before their GEMM: one per
//! model and device, in the compute dtype, as large as the largest weight. A quantised base
//! then costs its 4-bit bytes plus one layer's worth of compute-dtype values, whatever its
//! depth; every forward and backward GEMM of a quantised layer expands its weight again.

use super::Nf4Weight;
use crate::engine::{DType, EngineError, MemoryPool, Result, Tensor};
use std::sync::{Arc, Mutex};

pub struct DequantWorkspace {
    buffer: Mutex<Tensor>,
    elements: usize,
    dtype: DType,
}

impl DequantWorkspace {
    /// A workspace of `elements` values of `dtype`, booked in `pool`.
    pub fn new(pool: &Arc<MemoryPool>, elements: usize, dtype: DType) -> Result<DequantWorkspace> {
        Ok(DequantWorkspace {
            buffer: Mutex::new(Tensor::uninit(pool, &[elements], dtype)?),
            elements,
            dtype,
        })
    }

    /// Bytes the workspace holds in its pool.
    pub fn bytes(&self) -> usize {
        self.elements * self.dtype.size_bytes()
    }

    pub fn elements(&self) -> usize {
        self.elements
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Expands `w` into the workspace as a `[rows, cols]` tensor and runs `f` with it (the
    /// GEMM that reads the weight). The workspace stays locked while `f` runs, so no other
    /// layer overwrites values a GEMM still reads; on a GPU the expansion and the GEMM are
    /// queued in order on the one stream, so the next expansion waits for the GEMM there.
    pub fn with_weight<R>(&self, w: &Nf4Weight, f: impl FnOnce(&Tensor) -> Result<R>) -> Result<R> {
        let mut buffer = self.buffer.lock().map_err(|_| EngineError::Shape {
            op: "dequant workspace",
            detail: format!(
                "{}: the workspace was left mid-use by a failed thread",
                w.name()
            ),
        })?;
        buffer.reshape_within(&[w.rows(), w.cols()])?;
        w.dequantize_into(&mut buffer)?;
        f(&buffer)
    }
}

impl std::fmt::Debug for DequantWorkspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DequantWorkspace({} x {:?})", self.elements, self.dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Device;
    use crate::engine::rng::{Rng, stream};

    fn normal(n: usize, seed: u64) -> Vec<f32> {
        let mut r = Rng::new(seed, stream::INIT);
        (0..n).map(|_| r.normal() * 0.05).collect()
    }

    /// Weights of different sizes take turns in one buffer: each use sees exactly its own
    /// dequantised values, and the pool books the buffer once.
    #[test]
    fn weights_of_different_sizes_share_one_buffer() {
        let pool = MemoryPool::new(Device::Cpu);
        let big = Nf4Weight::quantize(&pool, "big", &normal(96 * 40, 1), 96, 40).unwrap();
        let small = Nf4Weight::quantize(&pool, "small", &normal(7 * 13, 2), 7, 13).unwrap();
        let before = pool.stats().current;
        let ws = DequantWorkspace::new(&pool, big.len(), DType::BF16).unwrap();
        assert_eq!(pool.stats().current - before, 96 * 40 * 2);
        assert_eq!(ws.bytes(), 96 * 40 * 2);
        for w in [&big, &small, &big] {
            let want: Vec<f32> = w
                .to_host_f32()
                .unwrap()
                .iter()
                .map(|&v| DType::BF16.round(v))
                .collect();
            let got = ws
                .with_weight(w, |t| {
                    assert_eq!(
                        (t.shape(), t.dtype()),
                        (&[w.rows(), w.cols()][..], DType::BF16)
                    );
                    t.to_vec()
                })
                .unwrap();
            assert_eq!(got, want, "{}", w.name());
        }
        assert_eq!(pool.stats().current - before, 96 * 40 * 2);
        let too_big = Nf4Weight::quantize(&pool, "huge", &normal(97 * 40, 3), 97, 40).unwrap();
        let e = ws
            .with_weight(&too_big, |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("3880 elements") && e.contains("3840"), "{e}");
    }
}
