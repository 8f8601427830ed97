//! Low-rank adapters' products fused across the adapters of a layer (see [`crate::nn::lora`]).
//! Each op answers `Ok(false)` where its fused kernel does not run (the CPU, f32, shapes off the
//! kernel's multiples) and writes nothing; the caller then runs the plain products, which are
//! the reference the selftest checks the kernel against.

use super::*;
pub use crate::engine::cuda::AdapterColumns;
use cudarc::driver::CudaSlice;

/// The fused adapter kernels, for [`adapter_kernel_on`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterKernel {
    /// [`lora_outputs`]: every adapter's output of a layer in one launch.
    Outputs,
    /// [`lora_grads`]: an adapter's two backward products from one read of dy.
    Grads,
}

/// Whether a fused adapter kernel may run. `KILN_LORA_KERNELS` picks them for measuring one
/// binary several ways: `0` takes the plain products everywhere, `outputs` or `grads` keeps
/// only that kernel; unset (or anything else), both run.
pub fn adapter_kernel_on(kernel: AdapterKernel) -> bool {
    static CHOICE: std::sync::OnceLock<Option<AdapterKernel>> = std::sync::OnceLock::new();
    static NONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let var = || std::env::var("KILN_LORA_KERNELS").unwrap_or_default();
    if *NONE.get_or_init(|| var() == "0") {
        return false;
    }
    let only = CHOICE.get_or_init(|| match var().as_str() {
        "outputs" => Some(AdapterKernel::Outputs),
        "grads" => Some(AdapterKernel::Grads),
        _ => None,
    });
    only.is_none_or(|k| k == kernel)
}

/// One adapter's `B` (`[cols, rank]`) and where its output goes, for [`lora_outputs`].
pub struct AdapterOutput<'a> {
    pub b: &'a Tensor,
    pub at: AdapterColumns,
}

/// Every adapter's `scale * H[:, k0..k0 + rank] B^T` into its columns `col0..col0 + cols` of
/// `y` (`[rows, ld_y]`), written over them (`beta` 0) or added to them (`beta` 1), in one GPU
/// launch; `h` is `[rows, ld_h]`. `Ok(false)`: not taken, nothing written.
pub fn lora_outputs(
    y: &mut Tensor,
    h: &Tensor,
    adapters: &[AdapterOutput],
    beta: f32,
) -> Result<bool> {
    const OP: &str = "lora_outputs";
    let mut all = vec![&*y, h];
    all.extend(adapters.iter().map(|a| a.b));
    let On::Gpu(g) = device_of(OP, &all)? else {
        return Ok(false);
    };
    if !adapter_kernel_on(AdapterKernel::Outputs)
        || !(beta == 0.0 || beta == 1.0)
        || all.iter().any(|t| t.dtype() != h.dtype())
        || h.dtype() == DType::F32
    {
        return Ok(false);
    }
    let (rows, ld_y) = rows_cols(OP, y)?;
    let (h_rows, ld_h) = rows_cols(OP, h)?;
    if h_rows != rows {
        return Err(EngineError::Shape {
            op: OP,
            detail: format!("{rows} output rows from {h_rows} rows of H"),
        });
    }
    let _prof = profile::scope(OP, h);
    let columns: Vec<AdapterColumns> = adapters.iter().map(|a| a.at).collect();
    let taken = with_elem!(h.dtype(), T => {
        let bs: Vec<&CudaSlice<T>> = adapters.iter().map(|a| a.b.cuda::<T>()).collect();
        g.lora_outputs::<T>(y.cuda_mut(), h.cuda(), &bs, &columns, (rows, ld_y, ld_h), beta == 1.0)
    })?;
    Ok(taken)
}
