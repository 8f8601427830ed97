//! Precision policies: which dtype the forward and backward compute in, and whether the loss
//! is scaled.
//!
//! Master weights and optimizer state are fp32 under every policy. The mixed policies keep a
//! rounded compute copy of each weight that the AdamW pass refreshes; fp16 adds dynamic loss
//! scaling because its narrow exponent range turns small gradients into zeros and large ones
//! into infinities. On the CPU the narrow types are emulated by rounding, which reproduces
//! their values and their overflow, so the whole machinery runs and is tested without a GPU.

use crate::engine::{DType, Device};
use crate::error::{KilnError, Result};
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    Fp32,
    Tf32,
    Bf16Mixed,
    Fp16Mixed,
}

impl Precision {
    pub fn parse(s: &str) -> Result<Precision> {
        Ok(match s {
            "fp32" => Precision::Fp32,
            "tf32" => Precision::Tf32,
            "bf16-mixed" => Precision::Bf16Mixed,
            "fp16-mixed" => Precision::Fp16Mixed,
            _ => {
                return Err(KilnError::Setting(format!(
                    "unknown precision '{s}'; use fp32, tf32, bf16-mixed or fp16-mixed"
                )));
            }
        })
    }

    /// Checks the policy can run on `device` and returns the one that will run, with a note
    /// when it runs emulated or differs from the one asked for. `compute_capability` is the
    /// GPU's, when `device` is one.
    pub fn check_device(
        self,
        device: Device,
        compute_capability: Option<(u32, u32)>,
    ) -> Result<(Precision, Option<String>)> {
        match (self, device) {
            (Precision::Tf32, Device::Cpu) => Err(KilnError::Setting(
                "train.precision=tf32 uses the tensor cores of an NVIDIA GPU and has no CPU form; use train.precision=fp32 on the CPU"
                    .into(),
            )),
            (Precision::Bf16Mixed | Precision::Fp16Mixed, Device::Cpu) => Ok((self, Some(format!(
                "{self} on the CPU is emulated: weights and output gradients are rounded to {}, arithmetic stays f32",
                if self == Precision::Bf16Mixed { "bf16" } else { "fp16" }
            )))),
            (Precision::Bf16Mixed, Device::Cuda(_)) => match compute_capability {
                Some((major, minor)) if major < 8 => Ok((Precision::Fp16Mixed, Some(format!(
                    "this GPU (compute capability {major}.{minor}) has no bf16 arithmetic; training in fp16-mixed (with dynamic loss scaling) instead of bf16-mixed"
                )))),
                _ => Ok((self, None)),
            },
            _ => Ok((self, None)),
        }
    }

    /// The dtype of the weight copies compute reads, if not the fp32 masters.
    pub fn compute_dtype(self) -> Option<DType> {
        match self {
            Precision::Fp32 | Precision::Tf32 => None,
            Precision::Bf16Mixed => Some(DType::BF16),
            Precision::Fp16Mixed => Some(DType::F16),
        }
    }

    /// The dtype the loss gradient is stored in during the backward.
    pub fn grad_dtype(self) -> DType {
        self.compute_dtype().unwrap_or(DType::F32)
    }

    pub fn uses_loss_scaling(self) -> bool {
        self == Precision::Fp16Mixed
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16Mixed => "bf16-mixed",
            Precision::Fp16Mixed => "fp16-mixed",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_without_bf16_fall_back_to_fp16_and_say_so() {
        let gpu = Device::Cuda(0);
        let (p, note) = Precision::Bf16Mixed
            .check_device(gpu, Some((7, 5)))
            .unwrap();
        assert_eq!(p, Precision::Fp16Mixed);
        assert!(note.unwrap().contains("fp16-mixed"));
        assert_eq!(
            Precision::Bf16Mixed
                .check_device(gpu, Some((9, 0)))
                .unwrap(),
            (Precision::Bf16Mixed, None)
        );
        assert_eq!(
            Precision::Fp16Mixed
                .check_device(gpu, Some((7, 0)))
                .unwrap(),
            (Precision::Fp16Mixed, None)
        );
        let (p, note) = Precision::Fp16Mixed
            .check_device(Device::Cpu, None)
            .unwrap();
        assert_eq!(p, Precision::Fp16Mixed);
        assert!(note.unwrap().contains("emulated"));
        assert!(Precision::Tf32.check_device(Device::Cpu, None).is_err());
    }
}
