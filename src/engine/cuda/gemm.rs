//! Matrix multiplies through cuBLASLt, row-major like [`crate::engine::cpu::gemm`].
//!
//! cuBLASLt is column-major. A row-major `C[m, n] = op(A) @ op(B)` is the column-major
//! `C^T[n, m] = op(B)^T @ op(A)^T`, and a row-major buffer read column-major is its own
//! transpose, so the product is issued with the operands swapped and no data moves.
//! Precision: f32 operands use fp32 math or TF32 tensor cores ([`GemmMath`]); bf16 and f16
//! operands always accumulate in fp32. The output may be f32 while the operands are 16-bit,
//! which is how weight gradients accumulate into fp32 buffers.

use super::{CudaBackend, CudaError, Elem, Result, check_len, raw_ptr};
use crate::engine::DType;
use crate::engine::{GemmShape, MatrixView};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// The loaded cuBLASLt's version number.
fn cublaslt_version() -> usize {
    // SAFETY: a plain query with no arguments; the library is loaded before any backend
    // exists.
    unsafe { sys::cublasLtGetVersion() }
}

/// How f32 operands are multiplied (16-bit operands ignore this: fp32 accumulation always).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmMath {
    /// Full fp32 products and sums.
    Fp32,
    /// Operands rounded to TF32 (10-bit mantissa) on the tensor cores, fp32 accumulation.
    Tf32,
}

/// Heuristic candidates timed for a product, and for a skinny one (see `pick_algo`).
const CANDIDATES: usize = 8;
const SKINNY_CANDIDATES: usize = 32;
/// Output rows up to which a single product counts as skinny (a decode step's batch).
const SKINNY_ROWS: usize = 256;
/// The most memory the operand copies of a skinny product's timing may take.
const ROTATION_BYTES: usize = 256 << 20;

/// Copies of a product's operands (A and B device addresses), and the buffers holding them.
struct OperandCopies {
    operands: Vec<(u64, u64)>,
    _buffers: Vec<CudaSlice<u8>>,
}

/// NVIDIA's recommended workspace for Hopper (32 MiB); older GPUs use less of it.
pub const WORKSPACE_BYTES: usize = 32 << 20;

fn blas_err(what: &str) -> impl Fn(lt::CublasError) -> CudaError + '_ {
    move |e| match e.0 {
        // cuBLASLt could not allocate its own scratch: memory ran out like anywhere else.
        sys::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED => {
            CudaError::OutOfMemory(format!("cuBLASLt {what}: {:?}", e.0))
        }
        _ => CudaError::Blas(format!("{what}: {:?}", e.0)),
    }
}

/// What a product's kernel does to its output before storing it (cuBLASLt's epilogues).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum EpilogueKind {
    /// The product as it is.
    None,
    /// `+ bias[n]` on every row.
    Bias,
    /// `gelu(product)` (GELU's tanh form), its argument stored in the auxiliary matrix.
    GeluAux,
    /// `gelu(product + bias)`, its argument stored in the auxiliary matrix.
    GeluAuxBias,
    /// `product * gelu'(aux)`: the gradient through a GELU whose argument is the auxiliary
    /// matrix.
    DGelu,
}

/// An epilogue and its vectors: the bias and the auxiliary matrix (`[m, n]` row-major,
/// packed, the output's element type), as device addresses (0 where the kind has none).
#[derive(Debug, Clone, Copy)]
struct Epilogue {
    kind: EpilogueKind,
    bias: u64,
    aux: u64,
}

impl Epilogue {
    const NONE: Epilogue = Epilogue {
        kind: EpilogueKind::None,
        bias: 0,
        aux: 0,
    };
}

/// Whether cuBLASLt's GELU epilogues take an auxiliary matrix of `cols` columns: its leading
/// dimension must be a multiple of 8 (the shapes they refuse take the separate kernels).
pub const fn gelu_epilogue_fits(cols: usize) -> bool {
    cols.is_multiple_of(8)
}

/// What determines the algorithm cuBLASLt picks for a product.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ShapeKey {
    trans_a: bool,
    trans_b: bool,
    m: usize,
    n: usize,
    k: usize,
    operands: DType,
    output: DType,
    math: GemmMath,
    epilogue: EpilogueKind,
    /// Products in one strided-batched call (1 for a plain product).
    batch: usize,
    /// Row strides of A, B and C as stored (their row lengths when packed).
    ld: [usize; 3],
    /// The largest power of two up to 16 dividing every operand's byte address: an algorithm
    /// chosen for aligned operands may not run on a column block that starts mid-vector.
    align: u32,
}

/// One product's descriptors and operands, as `launch` needs them.
#[derive(Clone, Copy)]
struct Product<'a> {
    desc: &'a Desc,
    first: &'a Layout,
    second: &'a Layout,
    out: &'a Layout,
    alpha: f32,
    beta: f32,
    /// Device pointers of A and B as stored (row-major).
    a: u64,
    b: u64,
}

/// The cuBLASLt handle, its workspace, and the algorithm chosen for each shape: choosing
/// means timing several candidates, so it happens once per shape.
pub(super) struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    algos: Mutex<HashMap<ShapeKey, sys::cublasLtMatmulAlgo_t>>,
    /// Algorithms adopted from a checkpoint ([`CudaBackend::adopt_gemm_algorithms`]), by the
    /// shape's description: used in place of timing when their shape comes up.
    adopted: Mutex<HashMap<String, sys::cublasLtMatmulAlgo_t>>,
}

/// The algorithm chosen for each product shape so far, on which GPU and cuBLASLt.
///
/// The choice is timed (the fastest of several candidates), so two processes may choose
/// differently, and algorithms that split a sum differently round differently. A checkpoint
/// keeps this table and a resumed run adopts it, so it multiplies as the run before it did
/// and continues bit for bit.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GemmAlgorithms {
    pub gpu: String,
    pub cublaslt: usize,
    /// `(shape, algorithm)`: the shape as kiln describes it, the algorithm as cuBLASLt's
    /// opaque words.
    pub table: Vec<(String, [u64; 8])>,
}

// SAFETY: the handle is used only through `&CudaBackend` on its one stream; cuBLASLt handles
// may be used from any thread as long as calls do not overlap, which the stream serialises.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Blas {
    pub(super) fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let handle = lt::create_handle().map_err(blas_err("create handle"))?;
        // SAFETY: the workspace is scratch space for cuBLASLt only; never read by kiln.
        let workspace = match unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: the handle was just created and is not used again.
                let _ = unsafe { lt::destroy_handle(handle) };
                return Err(e.into());
            }
        };
        Ok(Blas {
            handle,
            workspace,
            algos: Mutex::new(HashMap::new()),
            adopted: Mutex::new(HashMap::new()),
        })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once here.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// Destroys a cuBLASLt descriptor when the product returns, whichever way it returns.
struct Layout(sys::cublasLtMatrixLayout_t);
impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by `create_matrix_layout`, destroyed once here.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}
struct Desc(sys::cublasLtMatmulDesc_t);
impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_desc`, destroyed once here.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}
struct Pref(sys::cublasLtMatmulPreference_t);
impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by `create_matmul_pref`, destroyed once here.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

fn data_type(d: DType) -> Result<sys::cudaDataType> {
    match d {
        DType::F32 => Ok(sys::cudaDataType_t::CUDA_R_32F),
        DType::BF16 => Ok(sys::cudaDataType_t::CUDA_R_16BF),
        DType::F16 => Ok(sys::cudaDataType_t::CUDA_R_16F),
    }
}

/// A stored row-major matrix as cuBLASLt sees it: (rows, cols, ld) column-major.
fn layout(dtype: sys::cudaDataType, rows: usize, cols: usize, ld: usize) -> Result<Layout> {
    lt::create_matrix_layout(dtype, rows as u64, cols as u64, ld as i64)
        .map(Layout)
        .map_err(blas_err("matrix layout"))
}

/// Marks `l` as `batch` matrices `stride` elements apart (left alone for a single product).
fn set_batch(l: &Layout, batch: usize, stride: usize) -> Result<()> {
    if batch == 1 {
        return Ok(());
    }
    let count = i32::try_from(batch)
        .map_err(|_| CudaError::Blas(format!("batch of {batch} products exceeds i32")))?;
    let offset = stride as i64;
    use sys::cublasLtMatrixLayoutAttribute_t as Attr;
    // SAFETY: each value is live and of the type its attribute takes (int32, int64).
    unsafe {
        lt::set_matrix_layout_attribute(
            l.0,
            Attr::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
            (&count as *const i32).cast(),
            std::mem::size_of::<i32>(),
        )
        .and_then(|()| {
            lt::set_matrix_layout_attribute(
                l.0,
                Attr::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                (&offset as *const i64).cast(),
                std::mem::size_of::<i64>(),
            )
        })
    }
    .map_err(blas_err("batched matrix layout"))
}

fn set_desc<V>(desc: &Desc, attr: sys::cublasLtMatmulDescAttributes_t, value: &V) -> Result<()> {
    // SAFETY: `value` points to a live value of the size passed, the type the attribute takes.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc.0,
            attr,
            (value as *const V).cast(),
            std::mem::size_of::<V>(),
        )
    }
    .map_err(blas_err("matmul attribute"))
}

/// Packed views of a product's operands (see [`MatrixView`]).
fn packed_views(s: GemmShape) -> [MatrixView; 3] {
    [
        MatrixView::packed(if s.trans_a { s.m } else { s.k }),
        MatrixView::packed(if s.trans_b { s.k } else { s.n }),
        MatrixView::packed(s.n),
    ]
}

impl CudaBackend {
    /// Row-major `C[m, n] = alpha * op(A) @ op(B) + beta * C` (+ `bias[n]` on every row),
    /// `op(A)` is `m x k`, `op(B)` is `k x n`; the semantics of [`crate::engine::cpu::gemm::sgemm`].
    /// `beta = 0` ignores C's old contents.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul<TA: Elem, TC: Elem>(
        &self,
        trans_a: bool,
        trans_b: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: &CudaSlice<TA>,
        b: &CudaSlice<TA>,
        beta: f32,
        c: &mut CudaSlice<TC>,
        bias: Option<&CudaSlice<TC>>,
        math: GemmMath,
    ) -> Result<()> {
        let epilogue = match bias {
            Some(bias) => {
                check_len("matmul", "bias", bias, n)?;
                Epilogue {
                    kind: EpilogueKind::Bias,
                    bias: raw_ptr(bias, &self.stream),
                    aux: 0,
                }
            }
            None => Epilogue::NONE,
        };
        let shape = GemmShape::single(trans_a, trans_b, m, n, k);
        self.product(
            shape,
            packed_views(shape),
            alpha,
            a,
            b,
            beta,
            c,
            epilogue,
            math,
        )
    }

    /// Row-major `C = alpha * op(A) @ op(B) + beta * C` on matrices that lie inside larger
    /// buffers ([`MatrixView`]: row strides and first elements); the semantics of
    /// [`crate::engine::cpu::gemm::sgemm_strided`]. `shape.batch` must be 1.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_view<TA: Elem, TC: Elem>(
        &self,
        shape: GemmShape,
        views: [MatrixView; 3],
        alpha: f32,
        a: &CudaSlice<TA>,
        b: &CudaSlice<TA>,
        beta: f32,
        c: &mut CudaSlice<TC>,
        math: GemmMath,
    ) -> Result<()> {
        if shape.batch != 1 {
            return Err(CudaError::Shape {
                op: "matmul_view",
                detail: format!("{} products: views take one", shape.batch),
            });
        }
        self.product(shape, views, alpha, a, b, beta, c, Epilogue::NONE, math)
    }

    /// `batch` independent products `C_i = alpha * op(A_i) @ op(B_i) + beta * C_i`, each
    /// operand a row-major stack of `batch` matrices stored back to back (`A` is
    /// `[batch, m, k]`, or `[batch, k, m]` with `trans_a`), in one strided-batched cuBLASLt
    /// call; the semantics of [`crate::engine::cpu::gemm::sgemm_batched`].
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_batched<TA: Elem, TC: Elem>(
        &self,
        shape: GemmShape,
        alpha: f32,
        a: &CudaSlice<TA>,
        b: &CudaSlice<TA>,
        beta: f32,
        c: &mut CudaSlice<TC>,
        math: GemmMath,
    ) -> Result<()> {
        self.product(
            shape,
            packed_views(shape),
            alpha,
            a,
            b,
            beta,
            c,
            Epilogue::NONE,
            math,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn product<TA: Elem, TC: Elem>(
        &self,
        shape: GemmShape,
        views: [MatrixView; 3],
        alpha: f32,
        a: &CudaSlice<TA>,
        b: &CudaSlice<TA>,
        beta: f32,
        c: &mut CudaSlice<TC>,
        epilogue: Epilogue,
        math: GemmMath,
    ) -> Result<()> {
        const OP: &str = "matmul";
        let GemmShape {
            trans_a,
            trans_b,
            batch,
            m,
            n,
            k,
        } = shape;
        if m == 0 || n == 0 || batch == 0 {
            return Ok(());
        }
        if batch == 1 {
            shape
                .check_views(views, [a.len(), b.len(), c.len()])
                .map_err(|detail| CudaError::Shape { op: OP, detail })?;
        } else {
            check_len(OP, "A", a, batch * m * k)?;
            check_len(OP, "B", b, batch * k * n)?;
            check_len(OP, "C", c, batch * m * n)?;
        }
        let [a_stored, b_stored, _] = shape.stored();
        let [va, vb, vc] = views;
        let ab_type = data_type(TA::DTYPE)?;
        let c_type = data_type(TC::DTYPE)?;
        let compute = match (TA::DTYPE, math) {
            (DType::F32, GemmMath::Fp32) => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            (DType::F32, GemmMath::Tf32) => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        // Column-major view: D' = op'(B_stored) @ op'(A_stored), m' = n, n' = m.
        let first = layout(ab_type, b_stored.1, b_stored.0, vb.ld)?;
        let second = layout(ab_type, a_stored.1, a_stored.0, va.ld)?;
        let out = layout(c_type, n, m, vc.ld)?;
        set_batch(&first, batch, k * n)?;
        set_batch(&second, batch, m * k)?;
        set_batch(&out, batch, m * n)?;

        let desc = Desc(
            lt::create_matmul_desc(compute, sys::cudaDataType_t::CUDA_R_32F)
                .map_err(blas_err("matmul descriptor"))?,
        );
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        set_desc(&desc, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &(trans_b as i32))?;
        set_desc(&desc, Attr::CUBLASLT_MATMUL_DESC_TRANSB, &(trans_a as i32))?;
        if epilogue.kind != EpilogueKind::None {
            use sys::cublasLtEpilogue_t as E;
            let kind = match epilogue.kind {
                EpilogueKind::None => E::CUBLASLT_EPILOGUE_DEFAULT,
                EpilogueKind::Bias => E::CUBLASLT_EPILOGUE_BIAS,
                EpilogueKind::GeluAux => E::CUBLASLT_EPILOGUE_GELU_AUX,
                EpilogueKind::GeluAuxBias => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
                EpilogueKind::DGelu => E::CUBLASLT_EPILOGUE_DGELU,
            };
            set_desc(&desc, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE, &kind)?;
            if epilogue.bias != 0 {
                set_desc(
                    &desc,
                    Attr::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    &epilogue.bias,
                )?;
            }
            if epilogue.aux != 0 {
                // The auxiliary matrix has the output's column-major shape, packed.
                set_desc(
                    &desc,
                    Attr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                    &epilogue.aux,
                )?;
                set_desc(
                    &desc,
                    Attr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                    &(n as i64),
                )?;
            }
        }

        let a_ptr = raw_ptr(a, &self.stream) + (va.offset * std::mem::size_of::<TA>()) as u64;
        let b_ptr = raw_ptr(b, &self.stream) + (vb.offset * std::mem::size_of::<TA>()) as u64;
        let c_ptr = raw_ptr(c, &self.stream) + (vc.offset * std::mem::size_of::<TC>()) as u64;
        let align = [a_ptr, b_ptr, c_ptr, epilogue.aux]
            .iter()
            .filter(|&&p| p != 0)
            .map(|p| 1u32 << p.trailing_zeros().min(4))
            .min()
            .unwrap_or(16);
        let key = ShapeKey {
            trans_a,
            trans_b,
            m,
            n,
            k,
            operands: TA::DTYPE,
            output: TC::DTYPE,
            math,
            epilogue: epilogue.kind,
            batch,
            ld: [va.ld, vb.ld, vc.ld],
            align,
        };
        let product = Product {
            desc: &desc,
            first: &first,
            second: &second,
            out: &out,
            alpha,
            beta,
            a: a_ptr,
            b: b_ptr,
        };
        let cached = self
            .blas
            .algos
            .lock()
            .ok()
            .and_then(|c| c.get(&key).copied());
        let algo = match cached {
            Some(algo) => algo,
            None => {
                let adopted = self
                    .blas
                    .adopted
                    .lock()
                    .ok()
                    .and_then(|a| a.get(&format!("{key:?}")).copied());
                let algo = match adopted {
                    Some(algo) => algo,
                    None => self.pick_algo::<TC>(&product, key)?,
                };
                if let Ok(mut c) = self.blas.algos.lock() {
                    c.insert(key, algo);
                }
                algo
            }
        };
        self.launch(&product, c_ptr, &algo)
    }

    /// The algorithms chosen so far (see [`GemmAlgorithms`]), in a stable order.
    pub fn gemm_algorithms(&self) -> GemmAlgorithms {
        let mut table: Vec<(String, [u64; 8])> = self
            .blas
            .algos
            .lock()
            .map(|a| a.iter().map(|(k, v)| (format!("{k:?}"), v.data)).collect())
            .unwrap_or_default();
        table.sort();
        GemmAlgorithms {
            gpu: self.info.name.clone(),
            cublaslt: cublaslt_version(),
            table,
        }
    }

    /// Uses `saved`'s algorithm for each shape it lists from now on, instead of timing
    /// candidates. Refused, with the reason, when it was chosen on another GPU model or
    /// cuBLASLt version (where its algorithms may not exist); shapes already chosen here keep
    /// their algorithm.
    pub fn adopt_gemm_algorithms(&self, saved: &GemmAlgorithms) -> std::result::Result<(), String> {
        let here = (self.info.name.as_str(), cublaslt_version());
        if (saved.gpu.as_str(), saved.cublaslt) != here {
            return Err(format!(
                "chosen on {} with cuBLASLt {}, this is {} with cuBLASLt {}",
                saved.gpu, saved.cublaslt, here.0, here.1
            ));
        }
        if let Ok(mut a) = self.blas.adopted.lock() {
            a.extend(
                saved
                    .table
                    .iter()
                    .map(|(k, data)| (k.clone(), sys::cublasLtMatmulAlgo_t { data: *data })),
            );
        }
        Ok(())
    }

    /// Runs one product with `algo`, writing `c`.
    fn launch(&self, p: &Product, c: u64, algo: &sys::cublasLtMatmulAlgo_t) -> Result<()> {
        let ws = self.blas.workspace.len();
        let ws_ptr = raw_ptr(&self.blas.workspace, &self.stream);
        // SAFETY: the buffers hold the elements the layouts describe (checked by `matmul`),
        // the workspace is as large as the preference says, and all run on the backend's
        // stream.
        unsafe {
            lt::matmul(
                self.blas.handle,
                p.desc.0,
                (&p.alpha as *const f32).cast(),
                (&p.beta as *const f32).cast(),
                p.b as *const c_void,
                p.first.0,
                p.a as *const c_void,
                p.second.0,
                c as *const c_void,
                p.out.0,
                c as *mut c_void,
                p.out.0,
                algo,
                ws_ptr as *mut c_void,
                ws,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(blas_err("matmul"))
    }

    /// The fastest of the heuristic's best candidates for this product, timed on the real
    /// operands with a scratch output (the analogue of cudnn.benchmark); the heuristic's first
    /// choice when there is no memory for the scratch or only one candidate.
    ///
    /// Skinny products (at most [`SKINNY_ROWS`] output rows: decode steps, short prefills)
    /// are timed differently. In a decode step each of them streams its weights from memory
    /// once, between other kernels, inside a CUDA graph; timed back to back on one operand
    /// pair they find the weights in the L2 cache and pay the host's launch cost (a few
    /// microseconds, as long as the product itself), which favours algorithms that use few
    /// blocks and hides the ones that spread the weight read over every SM. So they are timed
    /// in a graph, cycling through copies of their operands that together exceed the L2, over
    /// more of the heuristic's candidates.
    fn pick_algo<TC: Elem>(&self, p: &Product, key: ShapeKey) -> Result<sys::cublasLtMatmulAlgo_t> {
        let pref = Pref(lt::create_matmul_pref().map_err(blas_err("matmul preference"))?);
        let ws = self.blas.workspace.len();
        // SAFETY: `ws` is a live usize, the attribute's type.
        unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const usize).cast(),
                std::mem::size_of::<usize>(),
            )
        }
        .map_err(blas_err("workspace preference"))?;
        use sys::cublasLtMatmulPreferenceAttributes_t as PrefAttr;
        for attr in [
            PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        ] {
            // SAFETY: `key.align` is a live u32, the attribute's type.
            unsafe {
                lt::set_matmul_pref_attribute(
                    pref.0,
                    attr,
                    (&key.align as *const u32).cast(),
                    std::mem::size_of::<u32>(),
                )
            }
            .map_err(blas_err("alignment preference"))?;
        }
        let skinny = key.batch == 1 && key.m <= SKINNY_ROWS;
        let wanted = if skinny {
            SKINNY_CANDIDATES
        } else {
            CANDIDATES
        };
        // SAFETY: an all-zero heuristic result is a valid value of this plain C struct.
        let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> =
            (0..wanted).map(|_| unsafe { std::mem::zeroed() }).collect();
        let mut found = 0i32;
        // SAFETY: every descriptor is live; `results` has room for `wanted` entries.
        unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.blas.handle,
                p.desc.0,
                p.first.0,
                p.second.0,
                p.out.0,
                p.out.0,
                pref.0,
                wanted as i32,
                results.as_mut_ptr(),
                &mut found,
            )
        }
        .result()
        .map_err(|e| CudaError::Blas(format!("heuristic for {key:?}: {:?}", e.0)))?;
        let candidates: Vec<sys::cublasLtMatmulAlgo_t> = results[..(found.max(0) as usize)]
            .iter()
            .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect();
        let Some(&first_choice) = candidates.first() else {
            return Err(CudaError::Blas(format!("no algorithm for {key:?}")));
        };
        if candidates.len() == 1 {
            return Ok(first_choice);
        }
        let c_len = match key.batch {
            1 => (key.m - 1) * key.ld[2] + key.n,
            b => b * key.m * key.n,
        };
        let Ok(scratch) = self.alloc::<TC>(c_len) else {
            return Ok(first_choice);
        };
        let c = raw_ptr(&scratch, &self.stream);
        // Copies of the operands for the skinny products' cold timing; without the memory
        // for them, the products are timed as the others.
        let rotation = if skinny {
            self.operand_copies(p, key).ok()
        } else {
            None
        };
        let mut best = (f64::INFINITY, first_choice);
        for algo in &candidates {
            // A candidate that fails to launch is simply not chosen.
            let time = match &rotation {
                Some(copies) => {
                    let mut i = 0;
                    self.time_graph_median_ms(1, 5, || {
                        let (a, b) = copies.operands[i % copies.operands.len()];
                        i += 1;
                        self.launch(&Product { a, b, ..*p }, c, algo)
                    })
                }
                None => self.time_median_ms(1, 3, || self.launch(p, c, algo)),
            };
            if let Ok(ms) = time
                && ms < best.0
            {
                best = (ms, *algo);
            }
        }
        self.synchronize()?;
        Ok(best.1)
    }

    /// Copies of a single product's A and B (their whole stored spans), enough that cycling
    /// through them finds each out of the L2 cache (see [`CudaBackend::rotation_copies`]).
    fn operand_copies(&self, p: &Product, key: ShapeKey) -> Result<OperandCopies> {
        let elem = key.operands.size_bytes();
        let [a_stored, b_stored, _] =
            GemmShape::single(key.trans_a, key.trans_b, key.m, key.n, key.k).stored();
        let span = |(rows, cols): (usize, usize), ld: usize| ((rows - 1) * ld + cols) * elem;
        let (a_bytes, b_bytes) = (span(a_stored, key.ld[0]), span(b_stored, key.ld[1]));
        // B starts on a 256-byte boundary after A, so both copies keep 16-byte alignment.
        let b_at = a_bytes.next_multiple_of(256);
        let bytes = b_at + b_bytes;
        let count = self.rotation_copies(bytes, ROTATION_BYTES);
        let mut buffers = Vec::with_capacity(count);
        let mut operands = Vec::with_capacity(count);
        for _ in 0..count {
            let buf = self.alloc::<u8>(bytes)?;
            let base = raw_ptr(&buf, &self.stream);
            for (dst, src, len) in [(base, p.a, a_bytes), (base + b_at as u64, p.b, b_bytes)] {
                // SAFETY: both ranges lie inside live device allocations (the operands' spans
                // as the product reads them; the copy's buffer of `bytes`), on the
                // backend's stream.
                unsafe {
                    cudarc::driver::sys::cuMemcpyDtoDAsync_v2(
                        dst,
                        src,
                        len,
                        self.stream.cu_stream(),
                    )
                }
                .result()?;
            }
            operands.push((base, base + b_at as u64));
            buffers.push(buf);
        }
        Ok(OperandCopies {
            operands,
            _buffers: buffers,
        })
    }

    /// `out[n, c_out] = inp[n, c_in] @ weight[c_out, c_in]^T + bias`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_forward<T: Elem>(
        &self,
        out: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        weight: &CudaSlice<T>,
        bias: Option<&CudaSlice<T>>,
        n: usize,
        c_in: usize,
        c_out: usize,
        math: GemmMath,
    ) -> Result<()> {
        self.matmul(
            false, true, n, c_out, c_in, 1.0, inp, weight, 0.0, out, bias, math,
        )
    }

    /// `dinp = dout @ weight` alone, for a frozen weight; reference:
    /// [`crate::engine::cpu::gemm::linear_backward_input`].
    #[allow(clippy::too_many_arguments)]
    pub fn linear_backward_input<T: Elem>(
        &self,
        dinp: &mut CudaSlice<T>,
        dout: &CudaSlice<T>,
        weight: &CudaSlice<T>,
        n: usize,
        c_in: usize,
        c_out: usize,
        math: GemmMath,
    ) -> Result<()> {
        self.matmul(
            false, false, n, c_in, c_out, 1.0, dout, weight, 0.0, dinp, None, math,
        )
    }

    /// Backward of [`Self::linear_forward`]: overwrites `dinp`, accumulates into the f32
    /// `dweight` (or overwrites it, without reading it, when `dweight_overwrite`) and `dbias`.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_backward<T: Elem>(
        &self,
        dinp: &mut CudaSlice<T>,
        dweight: &mut CudaSlice<f32>,
        dweight_overwrite: bool,
        dbias: Option<&mut CudaSlice<f32>>,
        dout: &CudaSlice<T>,
        inp: &CudaSlice<T>,
        weight: &CudaSlice<T>,
        n: usize,
        c_in: usize,
        c_out: usize,
        math: GemmMath,
    ) -> Result<()> {
        self.matmul(
            false, false, n, c_in, c_out, 1.0, dout, weight, 0.0, dinp, None, math,
        )?;
        self.accumulate_weight_grads(
            dweight,
            dweight_overwrite,
            dbias,
            dout,
            inp,
            n,
            c_in,
            c_out,
            math,
        )
    }

    /// The parameter gradients of [`Self::linear_forward`]: `dweight += dout^T @ inp` (`=`
    /// when `overwrite`: the product's `beta = 0` does not read the buffer) and `dbias` += the
    /// column sums of `dout` (both f32).
    #[allow(clippy::too_many_arguments)]
    fn accumulate_weight_grads<T: Elem>(
        &self,
        dweight: &mut CudaSlice<f32>,
        overwrite: bool,
        dbias: Option<&mut CudaSlice<f32>>,
        dout: &CudaSlice<T>,
        inp: &CudaSlice<T>,
        n: usize,
        c_in: usize,
        c_out: usize,
        math: GemmMath,
    ) -> Result<()> {
        self.matmul(
            true,
            false,
            c_out,
            c_in,
            n,
            1.0,
            dout,
            inp,
            if overwrite { 0.0 } else { 1.0 },
            dweight,
            None,
            math,
        )?;
        if let Some(dbias) = dbias {
            self.column_sum_accumulate(dbias, dout, n, c_out)?;
        }
        Ok(())
    }

    /// `act = gelu(inp @ weight^T + bias)` (GELU's tanh form) with the GELU's argument kept in
    /// `pre`, both `[n, c_out]`: one product whose epilogue applies the GELU and stores its
    /// argument (cuBLASLt's GELU_AUX_BIAS), where the epilogue takes `c_out`
    /// ([`gelu_epilogue_fits`]); else the product, then the GELU kernel. Reference:
    /// [`crate::engine::cpu::gemm::linear_forward`], then
    /// [`crate::engine::cpu::gelu::gelu_forward`].
    #[allow(clippy::too_many_arguments)]
    pub fn linear_gelu_forward<T: Elem>(
        &self,
        pre: &mut CudaSlice<T>,
        act: &mut CudaSlice<T>,
        inp: &CudaSlice<T>,
        weight: &CudaSlice<T>,
        bias: Option<&CudaSlice<T>>,
        n: usize,
        c_in: usize,
        c_out: usize,
        math: GemmMath,
    ) -> Result<()> {
        check_len("linear_gelu", "pre", pre, n * c_out)?;
        if gelu_epilogue_fits(c_out) {
            let kind = match bias {
                Some(b) => {
                    check_len("linear_gelu", "bias", b, c_out)?;
                    EpilogueKind::GeluAuxBias
                }
                None => EpilogueKind::GeluAux,
            };
            let epilogue = Epilogue {
                kind,
                bias: bias.map_or(0, |b| raw_ptr(b, &self.stream)),
                aux: raw_ptr(pre, &self.stream),
            };
            let shape = GemmShape::single(false, true, n, c_out, c_in);
            let views = packed_views(shape);
            return self.product(shape, views, 1.0, inp, weight, 0.0, act, epilogue, math);
        }
        self.linear_forward(pre, inp, weight, bias, n, c_in, c_out, math)?;
        self.gelu_forward(act, pre, n * c_out)
    }

    /// The backward of `linear_forward(act, weight, bias)` where `act = gelu(pre)`, carried
    /// through the GELU: overwrites `dpre = (dout @ weight) * gelu'(pre)` (`[n, c_in]`) and,
    /// for a trained weight, accumulates `dweight += dout^T @ act` and `dbias`. `dpre` is one
    /// product whose epilogue applies the GELU's derivative (cuBLASLt's DGELU) where the
    /// epilogue takes `c_in`; else the product into scratch, then the GELU backward kernel.
    /// Reference: [`crate::engine::cpu::gemm::linear_backward`], then
    /// [`crate::engine::cpu::gelu::gelu_backward`].
    #[allow(clippy::too_many_arguments)]
    pub fn linear_gelu_backward<T: Elem>(
        &self,
        dpre: &mut CudaSlice<T>,
        dweight: Option<&mut CudaSlice<f32>>,
        dweight_overwrite: bool,
        dbias: Option<&mut CudaSlice<f32>>,
        dout: &CudaSlice<T>,
        act: &CudaSlice<T>,
        pre: &CudaSlice<T>,
        weight: &CudaSlice<T>,
        n: usize,
        c_in: usize,
        c_out: usize,
        math: GemmMath,
    ) -> Result<()> {
        check_len("linear_gelu_backward", "pre", pre, n * c_in)?;
        if gelu_epilogue_fits(c_in) {
            let epilogue = Epilogue {
                kind: EpilogueKind::DGelu,
                bias: 0,
                aux: raw_ptr(pre, &self.stream),
            };
            let shape = GemmShape::single(false, false, n, c_in, c_out);
            let views = packed_views(shape);
            self.product(shape, views, 1.0, dout, weight, 0.0, dpre, epilogue, math)?;
        } else {
            let mut dact = self.alloc::<T>(n * c_in)?;
            self.linear_backward_input(&mut dact, dout, weight, n, c_in, c_out, math)?;
            self.gelu_backward(dpre, pre, &dact, n * c_in)?;
        }
        match dweight {
            Some(dweight) => self.accumulate_weight_grads(
                dweight,
                dweight_overwrite,
                dbias,
                dout,
                act,
                n,
                c_in,
                c_out,
                math,
            ),
            None => Ok(()),
        }
    }
}
