//! Quick measurements of the two ceilings a training step runs into: the matrix-multiply
//! rate and the memory bandwidth, on the device a pool belongs to, in a few seconds.
//!
//! On a GPU: square GEMMs through cuBLASLt (bf16 operands, fp32 and TF32 on f32 operands),
//! timed with device events after warm-up, and a device-to-device copy. On the CPU: the f32
//! GEMM the CPU kernels use, and a host memory copy. Copy bandwidth counts the bytes read
//! plus the bytes written. Inputs are random (zeros would flatter the tensor cores' power
//! draw and so their clocks). These are the roofline the planner and `kiln bench` compare
//! against; they are measured, not taken from a datasheet.

use crate::engine::cpu::gemm::sgemm;
use crate::engine::cuda::{Bf16, CudaBackend, CudaError, Elem, GemmMath};
use crate::engine::rng::{Rng, stream};
use crate::engine::{EngineError, MemoryPool};
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProbeResult {
    /// The device measured (`cuda:0`, `cpu`).
    pub device: String,
    pub gemm: Vec<GemmRate>,
    pub copy: CopyRate,
    /// Wall time the whole probe took.
    pub elapsed_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GemmRate {
    /// `bf16` (fp32 accumulation), `tf32` or `fp32`.
    pub math: &'static str,
    /// The product is n x n times n x n.
    pub n: usize,
    pub tflops: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CopyRate {
    /// Bytes of the copied buffer (each copy reads and writes this many).
    pub bytes: usize,
    /// (read + written bytes) / time, in GB/s (1e9 bytes).
    pub gbs: f64,
}

impl ProbeResult {
    /// The measured rate of a math mode, in FLOP/s.
    pub fn gemm_flops(&self, math: &str) -> Option<f64> {
        self.gemm
            .iter()
            .find(|g| g.math == math)
            .map(|g| g.tflops * 1e12)
    }
}

/// Sizes of one probe: GEMM sides and the copied bytes.
struct Sizes {
    gemm_16bit: usize,
    gemm_f32: usize,
    copy_bytes: usize,
}

/// GPU sizes: large enough to reach the full rate on a Hopper, small enough to take well
/// under a second each (fp32 at 8192^3 would be 22 ms a product on an H100).
const GPU: Sizes = Sizes {
    gemm_16bit: 8192,
    gemm_f32: 4096,
    copy_bytes: 1 << 30,
};

/// CPU sizes: past the caches, about a second in all on a few cores.
const CPU: Sizes = Sizes {
    gemm_16bit: 0,
    gemm_f32: 1024,
    copy_bytes: 256 << 20,
};

/// Measures the device `pool` belongs to. Its buffers bypass the pool's books (they live for
/// the probe only).
pub fn run(pool: &MemoryPool) -> Result<ProbeResult, EngineError> {
    let start = Instant::now();
    let (gemm, copy) = match pool.cuda() {
        Ok(gpu) => gpu_rates(gpu, &GPU)?,
        Err(_) => cpu_rates(&CPU),
    };
    Ok(ProbeResult {
        device: pool.device().to_string(),
        gemm,
        copy,
        elapsed_s: start.elapsed().as_secs_f64(),
    })
}

fn gpu_rates(gpu: &CudaBackend, s: &Sizes) -> Result<(Vec<GemmRate>, CopyRate), CudaError> {
    let gemm = vec![
        GemmRate {
            math: "bf16",
            n: s.gemm_16bit,
            tflops: gpu_gemm_tflops::<Bf16>(gpu, s.gemm_16bit, GemmMath::Fp32)?,
        },
        GemmRate {
            math: "tf32",
            n: s.gemm_16bit,
            tflops: gpu_gemm_tflops::<f32>(gpu, s.gemm_16bit, GemmMath::Tf32)?,
        },
        GemmRate {
            math: "fp32",
            n: s.gemm_f32,
            tflops: gpu_gemm_tflops::<f32>(gpu, s.gemm_f32, GemmMath::Fp32)?,
        },
    ];
    let copy = CopyRate {
        bytes: s.copy_bytes,
        gbs: gpu_copy_gbs(gpu, s.copy_bytes)?,
    };
    Ok((gemm, copy))
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed, stream::INIT);
    (0..n).map(|_| rng.next_f32() * 2.0 - 1.0).collect()
}

/// TFLOP/s of one `n x n x n` product with `T` operands, the median of 10 after 2 warm-ups.
pub fn gpu_gemm_tflops<T: Elem>(
    gpu: &CudaBackend,
    n: usize,
    math: GemmMath,
) -> Result<f64, CudaError> {
    let a = gpu.upload_as::<T>(&random(n * n, 1))?;
    let b = gpu.upload_as::<T>(&random(n * n, 2))?;
    let mut c = gpu.alloc::<T>(n * n)?;
    let ms = gpu.time_median_ms(2, 10, || {
        gpu.matmul(false, true, n, n, n, 1.0, &a, &b, 0.0, &mut c, None, math)
    })?;
    Ok(2.0 * (n as f64).powi(3) / (ms * 1e-3) / 1e12)
}

/// Device-to-device copy rate of a `bytes` buffer in GB/s, counting reads and writes.
pub fn gpu_copy_gbs(gpu: &CudaBackend, bytes: usize) -> Result<f64, CudaError> {
    let n = bytes / 4;
    let src = gpu.alloc::<f32>(n)?;
    let mut dst = gpu.alloc::<f32>(n)?;
    let stream = gpu.stream().clone();
    let ms = gpu.time_median_ms(2, 10, || Ok(stream.memcpy_dtod(&src, &mut dst)?))?;
    Ok(2.0 * (n * 4) as f64 / (ms * 1e-3) / 1e9)
}

/// Median seconds of `reps` runs of `work` after one warm-up.
fn median_secs(reps: usize, mut work: impl FnMut()) -> f64 {
    work();
    let mut t: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t0 = Instant::now();
            work();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn cpu_rates(s: &Sizes) -> (Vec<GemmRate>, CopyRate) {
    let n = s.gemm_f32;
    let a = random(n * n, 1);
    let b = random(n * n, 2);
    let mut c = vec![0.0f32; n * n];
    let secs = median_secs(5, || sgemm(false, true, n, n, n, 1.0, &a, &b, 0.0, &mut c));
    let gemm = vec![GemmRate {
        math: "fp32",
        n,
        tflops: 2.0 * (n as f64).powi(3) / secs / 1e12,
    }];
    let src = random(s.copy_bytes / 4, 3);
    let mut dst = vec![0.0f32; src.len()];
    let secs = median_secs(5, || dst.copy_from_slice(&src));
    // Keeps the copy observable so it cannot be optimised away.
    std::hint::black_box(&dst);
    let copy = CopyRate {
        bytes: src.len() * 4,
        gbs: 2.0 * (src.len() * 4) as f64 / secs / 1e9,
    };
    (gemm, copy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Device;

    #[test]
    fn cpu_rates_are_positive_and_finite() {
        let (gemm, copy) = cpu_rates(&Sizes {
            gemm_16bit: 0,
            gemm_f32: 128,
            copy_bytes: 1 << 20,
        });
        assert_eq!((gemm[0].math, gemm[0].n), ("fp32", 128));
        assert!(gemm[0].tflops.is_finite() && gemm[0].tflops > 0.0);
        assert!(copy.gbs.is_finite() && copy.gbs > 0.0 && copy.bytes == 1 << 20);
    }

    #[test]
    fn probe_of_a_cpu_pool_measures_the_cpu() {
        let r = run(&MemoryPool::new(Device::Cpu)).unwrap();
        assert_eq!(r.device, "cpu");
        let flops = r.gemm_flops("fp32").unwrap();
        // Any CPU this runs on does more than 100 MFLOP/s and less than 100 TFLOP/s in f32.
        assert!(flops > 1e8 && flops < 1e14, "{flops}");
        assert_eq!(r.gemm_flops("bf16"), None);
    }
}
