//! The CUDA backend for one GPU: context and stream, device properties, kernels compiled at
//! run time with NVRTC (cached on disk), and GEMMs through cuBLASLt.
//!
//! Everything CUDA is loaded when first used ([`loader`]), so a machine with no driver or no
//! toolkit gets an error that names the missing library, never a crash. The kernels live in
//! `.cu` files next to the Rust that launches them, one operation per file, each with the same
//! semantics as its CPU reference in `engine/cpu/` (`kiln selftest` compares them). Buffers are
//! cudarc's `CudaSlice<T>` with `T` an [`Elem`] (f32, [`Bf16`] or [`F16`]); wiring them into
//! [`crate::engine::Tensor`] is the job of `engine::ops`.

mod adamw;
mod add;
pub(crate) mod attention;
mod attention_masked;
mod attention_unfused;
mod bk_core;
mod cross_entropy;
mod diversity;
mod dropout;
pub mod embedding;
mod few_rows;
mod gelu;
mod gemm;
mod kernels;
mod kv_cache;
mod layernorm;
pub mod loader;
mod nf4;
pub mod nvrtc;
mod overlap;
pub mod pinned;
pub(crate) mod reduce;
mod rmsnorm;
mod rope;
mod rows;
pub mod sampling;
mod swiglu;

pub use adamw::{ADAMW_TABLE_BYTES_PER_TENSOR, AdamWSlices, AdamWStep};
pub use bk_core::BkWork;
pub use cross_entropy::LogitRows;
pub use cudarc::driver::CudaEvent;
pub use few_rows::few_rows_pay;
pub use gemm::{
    GemmAlgorithms, GemmMath, WORKSPACE_BYTES as GEMM_WORKSPACE_BYTES, gelu_epilogue_fits,
};
pub use kv_cache::{AttnPlan, attention_plan};
pub use nf4::Nf4Device;
pub use overlap::{OVERLAP_ENV, Overlapped};

use crate::engine::DType;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError,
    sys::{CUdevice_attribute, CUevent_flags, cudaError_enum},
};
use kernels::{ELEM_DTYPES, ElemKernel, Kernel, elem_index};
use loader::{CudaLibrary, ensure_loaded, guarded};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Why a CUDA operation could not run.
#[derive(Debug, Clone, Error)]
pub enum CudaError {
    #[error(
        "{library} not found (tried {tried}; searched {searched}); {remedy}, or run on the CPU"
    )]
    LibraryMissing {
        library: String,
        tried: String,
        searched: String,
        remedy: &'static str,
    },
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    /// The driver ran out of memory somewhere other than a sized allocation (module load,
    /// a library's internal buffer).
    #[error("out of GPU memory: {0}")]
    OutOfMemory(String),
    /// The driver refused an allocation of `requested` bytes.
    #[error(
        "out of GPU memory on cuda:{ordinal}: asked for {requested} bytes with {free} of {total} bytes free"
    )]
    AllocFailed {
        ordinal: usize,
        requested: usize,
        free: usize,
        total: usize,
    },
    #[error("CUDA: {0}")]
    Driver(String),
    #[error("cuBLASLt: {0}")]
    Blas(String),
    #[error("NVRTC could not compile {program}.cu: {log}")]
    Compile { program: String, log: String },
    #[error("{op}: {detail}")]
    Shape { op: &'static str, detail: String },
}

impl From<DriverError> for CudaError {
    fn from(e: DriverError) -> Self {
        match e.0 {
            cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY => CudaError::OutOfMemory(format!("{e:?}")),
            cudaError_enum::CUDA_ERROR_NO_DEVICE => CudaError::NoDevice(format!("{e:?}")),
            _ => {
                // A driver error names no kernel; with RUST_BACKTRACE=1 the message carries
                // the call stack that reached it (the capture costs nothing otherwise).
                let trace = std::backtrace::Backtrace::capture();
                if trace.status() == std::backtrace::BacktraceStatus::Captured {
                    CudaError::Driver(format!("{e:?}\n{trace}"))
                } else {
                    CudaError::Driver(format!("{e:?} (RUST_BACKTRACE=1 shows where)"))
                }
            }
        }
    }
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// bf16 as its raw bits on the device (the kernels convert by hand; see `common.cuh`).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Bf16(pub u16);

// SAFETY: a plain 16-bit value with no padding or pointers.
unsafe impl DeviceRepr for Bf16 {}
// SAFETY: all-zero bits are bf16 +0.0.
unsafe impl cudarc::driver::ValidAsZeroBits for Bf16 {}

/// IEEE half as its raw bits on the device (the kernels convert with `cvt`; see `common.cuh`).
#[repr(transparent)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct F16(pub u16);

// SAFETY: a plain 16-bit value with no padding or pointers.
unsafe impl DeviceRepr for F16 {}
// SAFETY: all-zero bits are f16 +0.0.
unsafe impl cudarc::driver::ValidAsZeroBits for F16 {}

/// An activation element type the kernels are instantiated for.
pub trait Elem: DeviceRepr + Copy + Default + Unpin + Send + Sync + 'static {
    /// Suffix of the kernel names for this type (`gelu_forward_f32`, `gelu_forward_bf16`).
    const SUFFIX: &'static str;
    const DTYPE: DType;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    const SUFFIX: &'static str = "f32";
    const DTYPE: DType = DType::F32;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for Bf16 {
    const SUFFIX: &'static str = "bf16";
    const DTYPE: DType = DType::BF16;
    fn from_f32(x: f32) -> Self {
        Bf16(half::bf16::from_f32(x).to_bits())
    }
    fn to_f32(self) -> f32 {
        half::bf16::from_bits(self.0).to_f32()
    }
}

impl Elem for F16 {
    const SUFFIX: &'static str = "f16";
    const DTYPE: DType = DType::F16;
    fn from_f32(x: f32) -> Self {
        F16(half::f16::from_f32(x).to_bits())
    }
    fn to_f32(self) -> f32 {
        half::f16::from_bits(self.0).to_f32()
    }
}

/// What a GPU is, as far as planning needs to know.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability (major, minor): (9, 0) is Hopper.
    pub compute_capability: (u32, u32),
    pub total_memory: usize,
    pub sm_count: u32,
    /// Shared memory one block may use when its kernel opts in (bytes).
    pub shared_memory_per_block_optin: usize,
    /// Size of the L2 cache (bytes): benchmarks cycle through more input than this so that
    /// their timings read DRAM, not the cache.
    pub l2_cache_bytes: usize,
}

impl GpuInfo {
    /// The `sm_XX` number NVRTC compiles for.
    pub fn arch(&self) -> u32 {
        self.compute_capability.0 * 10 + self.compute_capability.1
    }
}

impl std::fmt::Display for GpuInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cuda:{} {} (sm_{}, {} SMs, {:.1} GiB)",
            self.ordinal,
            self.name,
            self.arch(),
            self.sm_count,
            self.total_memory as f64 / (1u64 << 30) as f64
        )
    }
}

fn device_info(ctx: &Arc<CudaContext>) -> Result<GpuInfo> {
    let attr = |a| -> Result<u32> { Ok(ctx.attribute(a)?.max(0) as u32) };
    Ok(GpuInfo {
        ordinal: ctx.ordinal(),
        name: ctx.name()?,
        compute_capability: (
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        total_memory: ctx.total_mem()?,
        sm_count: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        shared_memory_per_block_optin: attr(
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as usize,
        l2_cache_bytes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)? as usize,
    })
}

/// Number of CUDA devices, or why there are none to use.
pub fn device_count() -> Result<usize> {
    ensure_loaded(CudaLibrary::Driver)?;
    guarded("cuInit", || {
        let n = CudaContext::device_count()?;
        if n <= 0 {
            return Err(CudaError::NoDevice(
                "the driver is loaded but reports no GPU".into(),
            ));
        }
        Ok(n as usize)
    })
}

/// Lists the GPUs, or says why there are none (no driver, no device, driver error).
pub fn probe() -> std::result::Result<Vec<GpuInfo>, String> {
    probe_devices().map_err(|e| e.to_string())
}

/// [`probe`] with the reason as a typed error, for callers that tell the reasons apart.
pub fn probe_devices() -> Result<Vec<GpuInfo>> {
    let n = device_count()?;
    (0..n)
        .map(|i| guarded("device query", || device_info(&CudaContext::new(i)?)))
        .collect()
}

/// Where GPU `ordinal` sits on the PCI bus, (domain, bus, device): the name NVML knows it by.
/// Needs no context, so it costs no GPU memory.
pub fn pci_location(ordinal: usize) -> Result<(u32, u32, u32)> {
    device_count()?;
    guarded("PCI location", || {
        use cudarc::driver::result::device;
        let dev = device::get(ordinal as i32)?;
        // SAFETY: `dev` came from cuDeviceGet.
        let attr =
            |a| -> Result<u32> { Ok(unsafe { device::get_attribute(dev, a) }?.max(0) as u32) };
        Ok((
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?,
        ))
    })
}

/// The CUDA driver API version the installed driver supports (13000 is 13.0).
pub fn driver_api_version() -> Result<i32> {
    ensure_loaded(CudaLibrary::Driver)?;
    guarded("cuDriverGetVersion", || {
        let mut v = 0;
        // SAFETY: writes one int; callable before cuInit.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }.result()?;
        Ok(v)
    })
}

/// Kernel sources prepended with the shared helpers, one NVRTC program each.
const COMMON: &str = include_str!("common.cuh");

struct Program {
    name: &'static str,
    source: &'static str,
    /// The kernels with one instance it defines.
    kernels: &'static [Kernel],
    /// The per-element-type kernels it defines, each for those of `dtypes` it comes in.
    elem_kernels: &'static [ElemKernel],
    dtypes: &'static [DType],
}

impl Program {
    fn full_source(&self) -> String {
        format!("{COMMON}\n{}", self.source)
    }

    /// Every kernel instance it defines: its slot in [`Functions`] and its name.
    fn entries(&self) -> impl Iterator<Item = (usize, &'static str)> + '_ {
        let plain = self.kernels.iter().map(|&k| (Functions::slot(k), k.name()));
        let typed = self.elem_kernels.iter().flat_map(move |&k| {
            self.dtypes
                .iter()
                .filter(move |d| k.dtypes().contains(d))
                .map(move |&d| (Functions::elem_slot(k, d), k.name(d)))
        });
        plain.chain(typed)
    }
}

/// The loaded kernels, one slot per [`Kernel`] and per ([`ElemKernel`], element type), so a
/// launch finds its function by index.
struct Functions(Vec<Option<CudaFunction>>);

impl Functions {
    const SLOTS: usize = Kernel::COUNT + ElemKernel::COUNT * ELEM_DTYPES.len();

    const fn slot(k: Kernel) -> usize {
        k as usize
    }

    const fn elem_slot(k: ElemKernel, dtype: DType) -> usize {
        Kernel::COUNT + k as usize * ELEM_DTYPES.len() + elem_index(dtype)
    }

    fn get(&self, slot: usize, name: &str) -> Result<&CudaFunction> {
        self.0.get(slot).and_then(Option::as_ref).ok_or_else(|| {
            CudaError::Driver(format!("kernel {name} is not part of any loaded program"))
        })
    }
}

const PROGRAMS: &[Program] = &[
    attention::PROGRAM_F32,
    attention::PROGRAM_BF16,
    attention::PROGRAM_F16,
    attention::PROGRAM_TC,
    attention::PROGRAM_TF32,
    attention_masked::PROGRAM,
    attention_unfused::PROGRAM,
    layernorm::PROGRAM,
    dropout::PROGRAM,
    gelu::PROGRAM,
    gelu::ERF_PROGRAM,
    cross_entropy::PROGRAM,
    embedding::PROGRAM,
    adamw::PROGRAM,
    add::PROGRAM,
    reduce::PROGRAM,
    rows::PROGRAM,
    bk_core::PROGRAM,
    rmsnorm::PROGRAM,
    rope::PROGRAM,
    kv_cache::PROGRAM_F32,
    kv_cache::PROGRAM_BF16,
    kv_cache::PROGRAM_F16,
    sampling::PROGRAM,
    swiglu::PROGRAM,
    nf4::PROGRAM,
    diversity::PROGRAM,
    few_rows::PROGRAM,
];

/// How the kernels were obtained at start-up.
#[derive(Debug, Clone, Copy)]
pub struct CompileReport {
    pub compiled: usize,
    pub from_cache: usize,
    /// Wall time to obtain and load every program (compiling or reading the cache).
    pub elapsed: Duration,
}

/// See [`CudaBackend::rotation_copies`]. A copy's lines are gone from the L2 once the other
/// copies used since its last call moved twice the L2's size, so a working set below that
/// needs ceil(2 L2 / bytes) others plus itself; one at or above it (or an unknown L2 size)
/// needs no copies at all.
pub fn rotation_copies(bytes: usize, l2_bytes: usize, max_bytes: usize) -> usize {
    if bytes == 0 || l2_bytes == 0 || bytes >= 2 * l2_bytes {
        return 1;
    }
    ((2 * l2_bytes).div_ceil(bytes) + 1)
        .min(max_bytes / bytes)
        .max(1)
}

/// The middle sample (the upper one of the middle two); `times` is not empty.
fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// How long one timed batch of [`CudaBackend::time_median_ms`] aims to last, in milliseconds.
pub const TIMED_BATCH_MS: f64 = 0.2;
/// The most calls in one timed batch (a lone call's time includes the launch latency, so the
/// batch of a tiny kernel is sized generously and then capped).
const MAX_TIMED_CALLS: usize = 200;

/// One GPU, ready to run kiln's kernels: a context, one stream, the loaded kernels and a
/// cuBLASLt handle.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: GpuInfo,
    functions: Functions,
    blas: gemm::Blas,
    compile: CompileReport,
    /// Whether launches that can overlap the previous kernel do now (see `overlap.rs`).
    overlap: std::sync::atomic::AtomicBool,
    /// Whether this process allows it at all.
    overlap_allowed: bool,
}

impl CudaBackend {
    /// Opens GPU `ordinal`, compiles (or loads from the cache) every kernel and creates the
    /// cuBLASLt handle. Fails with a message naming what is missing, never panics.
    pub fn new(ordinal: usize) -> Result<Self> {
        let n = device_count()?;
        if ordinal >= n {
            return Err(CudaError::NoDevice(format!(
                "asked for cuda:{ordinal} but this machine has {n} GPU(s)"
            )));
        }
        ensure_loaded(CudaLibrary::Nvrtc)?;
        ensure_loaded(CudaLibrary::CublasLt)?;
        guarded("CUDA backend start", || Self::start(ordinal))
    }

    fn start(ordinal: usize) -> Result<Self> {
        let ctx = CudaContext::new(ordinal)?;
        // One stream does all the work, so cudarc's per-buffer event tracking (for
        // cross-stream safety) would only add an event record to every launch.
        // SAFETY: no buffer exists yet and kiln uses a single stream per context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        keep_freed_memory(&ctx)?;
        let info = device_info(&ctx)?;
        let (functions, compile) = load_programs(&ctx, info.arch())?;
        let blas = gemm::Blas::new(&stream)?;
        Ok(CudaBackend {
            ctx,
            stream,
            info,
            functions,
            blas,
            compile,
            overlap: std::sync::atomic::AtomicBool::new(false),
            overlap_allowed: overlap::allowed_by_env(),
        })
    }

    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    pub fn compile_report(&self) -> CompileReport {
        self.compile
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// (free, total) device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// Bytes the driver's allocator holds for this device (in use plus cached), if it has one.
    pub fn reserved_bytes(&self) -> Option<usize> {
        use cudarc::driver::sys;
        if !self.ctx.has_async_alloc() {
            return None;
        }
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let mut reserved = 0u64;
        // SAFETY: `pool` receives the default pool handle; the attribute writes a u64.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device())
                .result()
                .ok()?;
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                (&mut reserved as *mut u64).cast(),
            )
            .result()
            .ok()?;
        }
        Some(reserved as usize)
    }

    /// An event recorded on the stream now, with timing on: [`CudaEvent::elapsed_ms`] between
    /// two of them is the device time of the work queued in between.
    pub fn timing_event(&self) -> Result<CudaEvent> {
        Ok(self
            .stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?)
    }

    /// Waits for all queued work; kernel faults surface here.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// Copies `host` into a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        self.stream
            .clone_htod(host)
            .map_err(|e| self.alloc_error(std::mem::size_of_val(host), e))
    }

    /// A failed allocation of `bytes`: an out-of-memory says how much was asked for and how
    /// much the device had, so the caller can act on it like on the pool's own limit.
    fn alloc_error(&self, bytes: usize, e: cudarc::driver::DriverError) -> CudaError {
        match CudaError::from(e) {
            CudaError::OutOfMemory(_) => {
                let (free, total) = self.memory().unwrap_or((0, self.info.total_memory));
                CudaError::AllocFailed {
                    ordinal: self.info.ordinal,
                    requested: bytes,
                    free,
                    total,
                }
            }
            other => other,
        }
    }

    /// Waits for queued work, then hands the memory the driver's allocator caches (freed by
    /// kiln, kept for reuse) back to the device, so a retry after an out-of-memory error
    /// starts from unfragmented memory.
    pub fn release_cached_memory(&self) -> Result<()> {
        use cudarc::driver::sys;
        self.synchronize()?;
        if !self.ctx.has_async_alloc() {
            return Ok(());
        }
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` receives the device's default pool handle; trimming frees only
        // memory no allocation holds.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()).result()?;
            sys::cuMemPoolTrimTo(pool, 0).result()?;
        }
        Ok(())
    }

    /// Starts (`on`) or stops the collection of an attached profiler (`cuProfilerStart` and
    /// `cuProfilerStop`): Nsight Systems with `--capture-range=cudaProfilerApi` and Nsight
    /// Compute with `--profile-from-start off` then record only what runs in between.
    /// Without a profiler both calls do nothing.
    pub fn profiler_collect(&self, on: bool) -> Result<()> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread()?;
        // SAFETY: both calls take no arguments and act on the context bound above.
        unsafe {
            if on {
                sys::cuProfilerStart().result()?;
            } else {
                sys::cuProfilerStop().result()?;
            }
        }
        Ok(())
    }

    /// Copies a device buffer back (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        Ok(self.stream.clone_dtoh(dev)?)
    }

    /// Uploads f32 values converted to the element type `T`.
    pub fn upload_as<T: Elem>(&self, host: &[f32]) -> Result<CudaSlice<T>> {
        let converted: Vec<T> = host.iter().map(|&x| T::from_f32(x)).collect();
        self.upload(&converted)
    }

    /// Downloads a buffer of `T` as f32 values.
    pub fn download_f32<T: Elem>(&self, dev: &CudaSlice<T>) -> Result<Vec<f32>> {
        Ok(self.download(dev)?.into_iter().map(T::to_f32).collect())
    }

    /// A new buffer of `len` elements with undefined contents, for outputs a kernel writes
    /// in full (the selftest fills such buffers with NaN first to prove that it does).
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: device memory with undefined contents is never read by the host before a
        // kernel or copy on this stream has written it.
        unsafe { self.stream.alloc::<T>(len) }
            .map_err(|e| self.alloc_error(len * std::mem::size_of::<T>(), e))
    }

    /// Median device time in milliseconds of one call of `work`, after `warmup` untimed calls
    /// (so module load and caches stay out of it).
    ///
    /// Each of the `reps` samples times a batch of calls issued back to back between two
    /// events and divides by the count, as the calls run inside a training step: the GPU then
    /// never idles waiting for the host to issue the next launch, and the time is the
    /// device's, not the launch latency's. Batches are sized from one lone call to last about
    /// [`TIMED_BATCH_MS`]. `work` must be callable any number of times; a caller that wants
    /// fresh inputs per call (larger than the cache) cycles through copies itself.
    pub fn time_median_ms(
        &self,
        warmup: usize,
        reps: usize,
        mut work: impl FnMut() -> Result<()>,
    ) -> Result<f64> {
        let calls = self.warm_up_and_size_batch(warmup, &mut work)?;
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            times.push(self.time_calls(calls, &mut work)? / calls as f64);
        }
        Ok(median(times))
    }

    /// Runs `warmup` untimed calls, then times one lone call and returns how many calls make
    /// a batch of about [`TIMED_BATCH_MS`].
    fn warm_up_and_size_batch(
        &self,
        warmup: usize,
        work: &mut impl FnMut() -> Result<()>,
    ) -> Result<usize> {
        for _ in 0..warmup {
            work()?;
        }
        let lone = self.time_calls(1, work)?;
        Ok(((TIMED_BATCH_MS / lone.max(1e-6)).ceil() as usize).clamp(1, MAX_TIMED_CALLS))
    }

    /// How many copies of a working set of `bytes` a benchmark should cycle through so that
    /// each call finds its inputs out of the L2 cache (one when a single set is already twice
    /// the L2's size), within `max_bytes` of memory in all.
    pub fn rotation_copies(&self, bytes: usize, max_bytes: usize) -> usize {
        rotation_copies(bytes, self.info.l2_cache_bytes, max_bytes)
    }

    /// Median device time in milliseconds of one call of `work` with the host's launch cost
    /// taken out: the batch of back-to-back calls that [`Self::time_median_ms`] would time is
    /// captured once into a CUDA graph, and each sample replays the graph between two events.
    ///
    /// A stream launch costs the host a few microseconds, so calls shorter than that (and, at
    /// a few microseconds more, every call) leave the GPU waiting for the next launch; a
    /// graph's kernels follow one another at the device's own pace (about 1 us apart on an
    /// H200). This is the time a kernel takes inside a longer stream of work. An error when
    /// the work cannot be captured (the stream is left usable).
    pub fn time_graph_median_ms(
        &self,
        warmup: usize,
        reps: usize,
        mut work: impl FnMut() -> Result<()>,
    ) -> Result<f64> {
        let calls = self.warm_up_and_size_batch(warmup, &mut work)?;
        let graph = self.capture(calls, &mut work)?;
        graph.upload()?;
        graph.launch()?;
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps.max(1) {
            let start = self.timing_event()?;
            graph.launch()?;
            let end = self.timing_event()?;
            times.push(start.elapsed_ms(&end)? as f64 / calls as f64);
        }
        Ok(median(times))
    }

    /// `calls` calls of `work` captured into a graph.
    fn capture(
        &self,
        calls: usize,
        work: &mut impl FnMut() -> Result<()>,
    ) -> Result<cudarc::driver::CudaGraph> {
        use cudarc::driver::sys;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        self.stream.begin_capture(mode)?;
        let captured = (0..calls).try_for_each(|_| work());
        // Always end the capture, so that a failed one leaves the stream usable.
        let graph = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        captured?;
        graph?.ok_or_else(|| CudaError::Driver("the captured work launched nothing".into()))
    }

    /// Device milliseconds between events around `calls` back-to-back calls of `work`.
    fn time_calls(&self, calls: usize, work: &mut impl FnMut() -> Result<()>) -> Result<f64> {
        let start = self.timing_event()?;
        for _ in 0..calls {
            work()?;
        }
        let end = self.timing_event()?;
        Ok(start.elapsed_ms(&end)? as f64)
    }

    fn function(&self, k: Kernel) -> Result<&CudaFunction> {
        self.functions.get(Functions::slot(k), k.name())
    }

    /// The instance of `k` for the element type `T`.
    fn elem_function<T: Elem>(&self, k: ElemKernel) -> Result<&CudaFunction> {
        self.functions
            .get(Functions::elem_slot(k, T::DTYPE), k.name(T::DTYPE))
    }
}

/// Tells the driver's stream-ordered allocator to keep freed memory for reuse.
///
/// Its default release threshold is zero: at every synchronisation (each step reads its loss)
/// the pool returns all free memory to the system, and the next step maps gigabytes of
/// activations afresh. Keeping it makes the pool a caching allocator, as PyTorch's is.
fn keep_freed_memory(ctx: &Arc<CudaContext>) -> Result<()> {
    use cudarc::driver::sys;
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: `pool` receives the device's default pool handle; the attribute takes a u64.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()?;
    }
    Ok(())
}

/// Compiles or reads from the cache every program, loads it and looks up its kernels.
fn load_programs(ctx: &Arc<CudaContext>, arch: u32) -> Result<(Functions, CompileReport)> {
    let start = Instant::now();
    let mut report = CompileReport {
        compiled: 0,
        from_cache: 0,
        elapsed: Duration::ZERO,
    };
    let mut functions = Functions((0..Functions::SLOTS).map(|_| None).collect());
    let cache = nvrtc::cache_dir();
    // NVRTC compiles one program per thread: a first start costs the slowest program, not
    // the sum (several seconds each for the attention and layernorm programs).
    let sources: Vec<String> = PROGRAMS.iter().map(Program::full_source).collect();
    note_first_start(&sources, arch, cache.as_deref());
    let compiled: Vec<Result<nvrtc::Compiled>> = std::thread::scope(|s| {
        let handles: Vec<_> = PROGRAMS
            .iter()
            .zip(&sources)
            .map(|(p, source)| {
                let cache = cache.as_deref();
                s.spawn(move || nvrtc::compile(p.name, source, arch, cache))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(CudaError::Driver("an NVRTC compile thread panicked".into()))
                })
            })
            .collect()
    });
    for ((p, source), compiled) in PROGRAMS.iter().zip(&sources).zip(compiled) {
        let source = source.as_str();
        let mut compiled = compiled?;
        let module = match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin)) {
            Ok(m) => m,
            // A cached CUBIN the driver refuses (truncated, or from another driver) is
            // recompiled once rather than failing the start.
            Err(_) if compiled.from_cache => {
                nvrtc::evict(cache.as_deref(), p.name, arch);
                compiled = nvrtc::compile(p.name, source, arch, cache.as_deref())?;
                ctx.load_module(cudarc::nvrtc::Ptx::from_binary(compiled.cubin))?
            }
            Err(e) => return Err(e.into()),
        };
        if compiled.from_cache {
            report.from_cache += 1;
        } else {
            report.compiled += 1;
        }
        for (slot, name) in p.entries() {
            functions.0[slot] = Some(module.load_function(name)?);
        }
    }
    report.elapsed = start.elapsed();
    Ok((functions, report))
}

/// Says on standard error, before a start that has programs to compile, that it will take a
/// while and why: the slowest program takes about a minute, which looks like a hang otherwise.
fn note_first_start(sources: &[String], arch: u32, cache: Option<&std::path::Path>) {
    let uncached = PROGRAMS
        .iter()
        .zip(sources)
        .filter(|(p, source)| !nvrtc::is_cached(p.name, source, arch, cache))
        .count();
    if uncached > 0 {
        let kept = cache.map_or_else(
            || " (no cache directory: every start compiles)".to_string(),
            |d| format!("; kept in {} for the next start", d.display()),
        );
        eprintln!(
            "note: compiling {uncached} of {} GPU kernel programs for sm_{arch}, as on the first \
             start with a new GPU, NVRTC or kiln build: about a minute{kept}",
            PROGRAMS.len()
        );
    }
}

/// Checks a buffer holds at least `want` elements; kernels index it blindly.
fn check_len<T>(op: &'static str, what: &str, buf: &CudaSlice<T>, want: usize) -> Result<()> {
    if buf.len() < want {
        return Err(CudaError::Shape {
            op,
            detail: format!("{what} has {} elements, needs {want}", buf.len()),
        });
    }
    Ok(())
}

/// A size as the kernels' `int`, or a shape error when it does not fit.
fn as_i32(op: &'static str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::Shape {
        op,
        detail: format!("{what} = {v} exceeds the kernel's 32-bit index"),
    })
}

/// Grid for a grid-stride elementwise kernel: enough blocks to fill the GPU a few times over,
/// no more (the stride loop covers the rest).
fn elementwise_grid(n: usize, block: u32) -> u32 {
    (n.div_ceil(block as usize)).clamp(1, 65_535) as u32
}

/// The device pointer of a buffer for APIs outside cudarc's launch builder (cuBLASLt).
fn raw_ptr<T>(buf: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    // With event tracking off the returned guard records nothing; dropping it is free.
    let (ptr, _guard) = buf.device_ptr(stream);
    ptr
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_takes_the_middle_sample_in_any_order() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 3.0);
        assert_eq!(median(vec![0.5]), 0.5);
    }

    #[test]
    fn rotation_covers_twice_the_cache_within_the_memory_bound() {
        const MIB: usize = 1 << 20;
        // 50 MiB of L2: a 4 MiB set needs 25 others and itself, a 100 MiB set no copies.
        assert_eq!(rotation_copies(4 * MIB, 50 * MIB, 1 << 30), 26);
        assert_eq!(rotation_copies(100 * MIB, 50 * MIB, 1 << 30), 1);
        assert_eq!(rotation_copies(4 * MIB, 0, 1 << 30), 1);
        // The memory bound wins over the cache, but one copy always exists.
        assert_eq!(rotation_copies(4 * MIB, 50 * MIB, 40 * MIB), 10);
        assert_eq!(rotation_copies(4 * MIB, 50 * MIB, MIB), 1);
        assert_eq!(rotation_copies(0, 50 * MIB, MIB), 1);
    }

    /// Compiles every program for the GPU generations kiln targets, with no GPU needed: only
    /// NVRTC (found through `CUDA_HOME` or the usual paths). Skips where NVRTC is absent.
    #[test]
    fn every_program_compiles_with_nvrtc() {
        if let Err(e) = ensure_loaded(CudaLibrary::Nvrtc) {
            eprintln!("skipped: {e}");
            return;
        }
        use rayon::prelude::*;
        let cache = tempfile::tempdir().unwrap();
        // One compile per core at a time (each program compiles on its own, as at start-up).
        let jobs: Vec<(u32, &Program)> = [80, 90]
            .into_iter()
            .flat_map(|arch| PROGRAMS.iter().map(move |p| (arch, p)))
            .collect();
        jobs.par_iter().for_each(|&(arch, p)| {
            let source = p.full_source();
            assert!(!nvrtc::is_cached(p.name, &source, arch, Some(cache.path())));
            let first = nvrtc::compile(p.name, &source, arch, Some(cache.path()))
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(!first.from_cache && !first.cubin.is_empty());
            assert!(nvrtc::is_cached(p.name, &source, arch, Some(cache.path())));
            let again = nvrtc::compile(p.name, &source, arch, Some(cache.path())).unwrap();
            assert!(again.from_cache && again.cubin == first.cubin);
        });
    }

    /// Every kernel handle names an entry point of the program that lists it, for each element
    /// type it comes in, and every entry point has a handle: each program compiled to PTX with
    /// NVRTC, no GPU needed (skipped where NVRTC is absent). Each handle instance comes from
    /// exactly one program, so a launch never finds a kernel missing.
    #[test]
    fn every_kernel_handle_is_an_entry_point_of_its_program() {
        use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
        use std::collections::BTreeSet;
        if let Err(e) = ensure_loaded(CudaLibrary::Nvrtc) {
            eprintln!("skipped: {e}");
            return;
        }
        let mut providers: Vec<Vec<&str>> = vec![Vec::new(); Functions::SLOTS];
        for p in PROGRAMS {
            let options = CompileOptions {
                arch: Some("compute_90"),
                options: vec!["--std=c++17".into()],
                name: Some(format!("{}.cu", p.name)),
                ..Default::default()
            };
            let ptx = compile_ptx_with_opts(p.full_source(), options)
                .unwrap_or_else(|e| panic!("{}: {e:?}", p.name))
                .to_src();
            let entries: BTreeSet<&str> = ptx
                .lines()
                .filter_map(|line| line.split(".entry ").nth(1))
                .map(|rest| rest.split('(').next().unwrap_or(rest).trim())
                .collect();
            let handles: BTreeSet<&str> = p.entries().map(|(_, name)| name).collect();
            assert_eq!(handles, entries, "{}.cu: handles vs .entry points", p.name);
            for (slot, _) in p.entries() {
                providers[slot].push(p.name);
            }
        }
        for &k in Kernel::ALL {
            assert_eq!(providers[Functions::slot(k)].len(), 1, "{}", k.name());
        }
        for &k in ElemKernel::ALL {
            for &d in ELEM_DTYPES {
                let want = usize::from(k.dtypes().contains(&d));
                let got = &providers[Functions::elem_slot(k, d)];
                assert_eq!(got.len(), want, "{} in {got:?}", k.name(d));
            }
        }
    }

    #[test]
    fn a_compile_error_carries_the_nvrtc_log() {
        if ensure_loaded(CudaLibrary::Nvrtc).is_err() {
            return;
        }
        let err = nvrtc::compile(
            "broken",
            "extern \"C\" __global__ void k() { nope; }",
            90,
            None,
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("broken.cu") && err.contains("nope"), "{err}");
    }

    #[test]
    fn probe_never_panics() {
        // With no GPU it returns the reason; with one, the list.
        match probe() {
            Ok(gpus) => assert!(!gpus.is_empty()),
            Err(why) => assert!(!why.is_empty()),
        }
    }
}
