// Products of a few rows on tensor cores: a decode step's `y[m, n] = x[m, k] . w[n, k]` for
// m <= 64 (written or added into y), and the gate/up product fused with the row's RMSNorm
// factor and SwiGLU. References: engine/cpu/gemm.rs, cpu/rmsnorm.rs (normed_rows) and
// cpu/swiglu.rs. Needs attention_tc.cu's TcBf16 / TcF16 (mma and conversions) before it.
//
// Why: a decode step's products have 1 to 64 rows against weights of hundreds of thousands to
// millions of values, a few microseconds of bytes or less; general GEMM tiles spend 4-6 us on
// each. Here every weight value is read once, by one lane, in 16-byte loads, and the rows come
// from L2.
//
// Layout of the work. The weight is the mma's A operand (16 output features a tile) and the
// rows its B operand (8 rows a tile, XT of them: 1 or 2), so one row costs an 8-row tile, not a
// 16-row one. A block owns 16 output features (the fused form: 16 gate features and the 16 up
// features of the same columns) for 8 XT rows; more rows take more blocks, which read the same
// weight tile (from L2 after the first) rather than more rows a block: rows held by one block
// are loaded by every warp of it, and 64 of them held one chunk's loads a warp (measured 20-36%
// slower than cuBLAS at batch 64 on an H200). The block's warps split k into chunks of 32, warp
// w taking chunks w, w + WARPS, ... Each lane loads, for every operand row it covers, the 16 bytes of
// eight consecutive k values: the mma sums over k, so any order of k works as long as both
// operands use the same one, and lane t's values 8t .. 8t + 7 of a chunk stand for its k pairs
// of two m16n8k16 steps (step s: positions {2t, 2t + 1} are 8t + 4s + {0, 1}, positions
// {2t + 8, 2t + 9} are 8t + 4s + {2, 3}). No shared memory holds operands; each warp issues the
// loads of FewRowsShape::unroll chunks before their products, which keeps enough bytes in flight.
// A block has 8 warps, or more where k would take 8 warps more than one round of those loads:
// 16 (the `_w16` kernels) where the grid fits one block an SM, 12 (`_x2_w12`, products of 16-row
// blocks) where it fits two (few_rows.rs, block_warps); gate/up calls of 16-row blocks that
// 16 warps do not take have 6 warps of 3 chunks a round where that takes k in one round and 8
// warps of 2 would not (`_grouped6`).
//
// The warps' partial tiles are summed in shared memory in warp order (no atomics: the result
// does not depend on scheduling), then the epilogue writes, adds into y, or (fused) scales gate
// and up by the row's factor 1 / sqrt(mean(x_row^2) + eps) from the same loads of x and writes
// silu(gate) * up, with no 16-bit rounding of gate and up in between.
//
// Needs sm_80 (mma.sync on 16-bit operands; elsewhere the body compiles to nothing and is never
// launched), k a multiple of 32, the output features a multiple of 16 and 16-byte aligned
// buffers (the launcher checks; the callers fall back to the general product otherwise).

#define FR_CHUNK 32

template <int XT, int WT, int W = 8, int UNROLL = 0> struct FewRowsShape {
    // Each lane's 16-byte loads a chunk: two weight rows (g, g + 8) a weight tile, one row a
    // row tile.
    static constexpr int loads = 2 * WT + XT;
    // Chunks whose loads are in flight together: about 64 registers of them, or UNROLL.
    static constexpr int unroll =
        UNROLL > 0 ? UNROLL : (16 / loads >= 4 ? 4 : (16 / loads >= 1 ? 16 / loads : 1));
    static constexpr int warps = W;
};

__device__ __forceinline__ uint4 fr_load16(const void* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned fr_word(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// Output i of a block's epilogue (accumulator slot i / 32 of lane i % 32; element e = slot % 4
// of its tile): row tile j, row q within it, and its column past the block's first feature.
template <int XT>
struct FrOutput {
    int li, slot, j, q;
    __device__ __forceinline__ explicit FrOutput(int i)
        : li(i & 31), slot(i >> 5), j((slot >> 2) % XT), q(2 * (li & 3) + (slot & 1)) {}
    __device__ __forceinline__ int row() const { return 8 * j + q; }
    __device__ __forceinline__ int col(int n0) const { return n0 + (li >> 2) + 8 * ((slot & 3) >> 1); }
};

template <class Ops, int XT, int WT, bool SWIGLU, int W = 8, int UNROLL = 0>
__device__ __forceinline__ void few_rows(typename Ops::elem* __restrict__ y,
                                         const typename Ops::elem* __restrict__ x,
                                         const typename Ops::elem* __restrict__ w, int m, int n, int k,
                                         int accumulate, float eps, int prefetch) {
#if __CUDA_ARCH__ >= 800
    typedef typename Ops::elem T;
    typedef FewRowsShape<XT, WT, W, UNROLL> S;
    constexpr int WARPS = S::warps, U = S::unroll, SLOTS = WT * XT * 4;
    __shared__ float part[WARPS][SLOTS][32];
    __shared__ float sq_part[SWIGLU ? WARPS : 1][SWIGLU ? XT : 1][8];
    if (blockDim.x != WARPS * 32) __trap();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    // Blocks come in groups of one feature tile, a block per 8 XT rows, adjacent in launch
    // order so that the group reads the tile's weight from DRAM once and from L2 after.
    const int groups = (m + 8 * XT - 1) / (8 * XT);
    const int n0 = (blockIdx.x / groups) * 16, row0 = (blockIdx.x % groups) * 8 * XT;
    x += (size_t)row0 * k;
    y += (size_t)row0 * n;
    m = min(m - row0, 8 * XT);
    const int chunks = k / FR_CHUNK;
    // Launched overlapped (`prefetch`), the first block of each feature tile fetches the head of
    // its weight rows that the warps load first (their first round of chunks) into L2 while the
    // previous kernel finishes. Only the head, and only then: whole tiles fetched at every
    // launch, beside the warps' own loads of the same bytes, left Llama-3.2-1B's batch-1 decode
    // 1% faster than cuBLAS instead of about 10% (H200). Nothing else happens before the wait.
    if (prefetch && blockIdx.x % groups == 0 && threadIdx.x < 16 * WT) {
        const int r = threadIdx.x & 15, wt = threadIdx.x >> 4;
        const size_t row = n0 + r + (SWIGLU && wt == 1 ? n : 0);
        const int head = min(k, WARPS * U * FR_CHUNK);
        prefetch_l2(w + row * k, (unsigned)head * (unsigned)sizeof(T));
    }
    grid_wait_for_previous();
    grid_let_next_start();

    // This lane's operand rows, at its eight k values of chunk 0. Fused, weight tile 1 is the
    // up half: rows n .. 2n - 1 (n is then the width of each half).
    const T* wrow[WT][2];
#pragma unroll
    for (int wt = 0; wt < WT; wt++) {
        const int base = n0 + (SWIGLU && wt == 1 ? n : 0);
#pragma unroll
        for (int h = 0; h < 2; h++) wrow[wt][h] = w + (size_t)(base + g + 8 * h) * k + 8 * t;
    }
    const T* xrow[XT];
    bool xin[XT];
#pragma unroll
    for (int j = 0; j < XT; j++) {
        xin[j] = 8 * j + g < m;
        xrow[j] = x + (size_t)(xin[j] ? 8 * j + g : 0) * k + 8 * t;
    }

    // `accumulate` 2 (products of one row tile): the thread loads the old value of its output
    // (the epilogue gives each thread at most one) now, so that its L2 trip runs beside the
    // loop instead of after the block's reduction, at the end of the kernel's chain. After the
    // wait: the kernel just before may be the one that wrote y. (Compiled into the kernels of
    // two row tiles too, its registers made SmolLM2-135M's batch-64 decode 1.7% slower: there
    // it is not compiled.)
    constexpr int OUTS = (SWIGLU ? 1 : WT) * XT * 4 * 32;
    static_assert(SWIGLU || OUTS <= WARPS * 32, "the epilogue gives each thread at most one output");
    float prior = 0.f;
    if constexpr (!SWIGLU && XT == 1) {
        const FrOutput<XT> o(threadIdx.x);  // the output the epilogue gives this thread
        if (accumulate == 2 && threadIdx.x < OUTS && o.row() < m) prior = load(y[(size_t)o.row() * n + o.col(n0)]);
    }

    float acc[WT][XT][4];
    float sq[XT];
#pragma unroll
    for (int j = 0; j < XT; j++) {
        sq[j] = 0.f;
#pragma unroll
        for (int wt = 0; wt < WT; wt++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[wt][j][e] = 0.f;
    }

    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int c0 = warp; c0 < chunks; c0 += WARPS * U) {
        uint4 wv[U][WT][2], xv[U][XT];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int c = c0 + u * WARPS;
            const bool live = c < chunks;
            const size_t off = (size_t)(live ? c : 0) * FR_CHUNK;
            // Every address is a valid one (chunk 0, row 0 where out of range), so the loads
            // issue without branches, and the values out of range become zeros after.
#pragma unroll
            for (int wt = 0; wt < WT; wt++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    wv[u][wt][h] = fr_load16(wrow[wt][h] + off);
                    if (!live) wv[u][wt][h] = zero;
                }
#pragma unroll
            for (int j = 0; j < XT; j++) {
                xv[u][j] = fr_load16(xrow[j] + off);
                if (!(live && xin[j])) xv[u][j] = zero;
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if constexpr (SWIGLU) {
#pragma unroll
                for (int j = 0; j < XT; j++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const unsigned p = fr_word(xv[u][j], i);
                        const float lo = Ops::low(p), hi = Ops::high(p);
                        sq[j] = fmaf(lo, lo, sq[j]);
                        sq[j] = fmaf(hi, hi, sq[j]);
                    }
            }
#pragma unroll
            for (int s = 0; s < 2; s++) {
#pragma unroll
                for (int j = 0; j < XT; j++) {
                    const unsigned b0 = fr_word(xv[u][j], 2 * s), b1 = fr_word(xv[u][j], 2 * s + 1);
#pragma unroll
                    for (int wt = 0; wt < WT; wt++) {
                        const unsigned a[4] = {fr_word(wv[u][wt][0], 2 * s), fr_word(wv[u][wt][1], 2 * s),
                                               fr_word(wv[u][wt][0], 2 * s + 1),
                                               fr_word(wv[u][wt][1], 2 * s + 1)};
                        Ops::mma(acc[wt][j], a, b0, b1);
                    }
                }
            }
        }
    }

    // Accumulator element e of lane (g, t) in tiles (wt, j): feature g + 8 (e >> 1) of the
    // weight tile, row 8 j + 2 t + (e & 1).
#pragma unroll
    for (int wt = 0; wt < WT; wt++)
#pragma unroll
        for (int j = 0; j < XT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) part[warp][(wt * XT + j) * 4 + e][lane] = acc[wt][j][e];
    if constexpr (SWIGLU) {
        // Lanes g, t of row tile j hold squares of row 8 j + g: summed over t here, over the
        // warps below.
#pragma unroll
        for (int j = 0; j < XT; j++) {
            float v = sq[j];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if (t == 0) sq_part[warp][j][g] = v;
        }
    }
    __syncthreads();

    // Once a thread, but for the 6-warp gate/up blocks (256 outputs, 192 threads).
    for (int i = threadIdx.x; i < OUTS; i += blockDim.x) {
        const FrOutput<XT> o(i);
        const int li = o.li, slot = o.slot, j = o.j, q = o.q, row = o.row();
        if (row >= m) continue;
        const int col = o.col(n0);
        float v = 0.f;
#pragma unroll
        for (int p = 0; p < WARPS; p++) v += part[p][slot][li];
        if constexpr (SWIGLU) {
            float u = 0.f, ss = 0.f;
#pragma unroll
            for (int p = 0; p < WARPS; p++) {
                u += part[p][slot + XT * 4][li];
                ss += sq_part[p][j][q];
            }
            const float r = 1.0f / sqrtf(ss / k + eps);
            const float gate = v * r, up = u * r;
            // The fast exponential and division (a few ulp of f32) vanish in the 16-bit output,
            // as in swiglu.cu.
            const float sig = __fdividef(1.0f, 1.0f + __expf(-gate));
            y[(size_t)row * n + col] = store<T>(gate * sig * up);
        } else {
            const size_t at = (size_t)row * n + col;  // WT is 1: one weight tile
            if (accumulate) v += XT == 1 && accumulate == 2 ? prior : load(y[at]);
            y[at] = store<T>(v);
        }
    }
#endif
}

// Entry points for one element type and row-tile count: `few_rows_product` (y = or += x w^T,
// w of n rows) and `few_rows_swiglu` (w of 2 f rows [gate | up], y of f columns). One block an
// SM is enough for their grids; saying so lets ptxas keep every load of a group in flight (with
// the default bound it interleaved them with the products to save registers).
#define FEW_ROWS_ENTRY_POINTS(OPS, SUFFIX, XT)                                                       \
    extern "C" __global__ void __launch_bounds__(FewRowsShape<XT, 1>::warps * 32, 1)                     \
        few_rows_product_##SUFFIX##_x##XT(OPS::elem* y, const OPS::elem* x, const OPS::elem* w, int m, \
                                          int n, int k, int accumulate, int prefetch) {              \
        few_rows<OPS, XT, 1, false>(y, x, w, m, n, k, accumulate, 0.f, prefetch);                     \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(FewRowsShape<XT, 2>::warps * 32, 1)                     \
        few_rows_swiglu_##SUFFIX##_x##XT(OPS::elem* h, const OPS::elem* x, const OPS::elem* w, int m,  \
                                         int f, int k, float eps, int prefetch) {                    \
        few_rows<OPS, XT, 2, true>(h, x, w, m, f, k, 0, eps, prefetch);                               \
    }

// The fused gate/up form for calls of more than 16 rows (several 16-row blocks a feature tile),
// bounded to three blocks an SM: SmolLM2-135M's batch-64 gate/up product (96 feature tiles x 4
// row blocks = 384 blocks) then runs in one wave of 396 on 132 SMs instead of two of 264 (80
// registers a thread instead of 100, no spills). Measured on an H200: that decode step 6% faster;
// the same bound cost 4% on calls of one block a tile (Llama-3.2-1B's batch 16, 512 blocks of a
// 32 MiB weight) and 1% on calls that fit one wave anyway (SmolLM2's 32 rows), so those keep
// `few_rows_swiglu_*_x2` (few_rows.rs, kernel_form).
#define FEW_ROWS_GROUPED_ENTRY_POINT(OPS, SUFFIX)                                                     \
    extern "C" __global__ void __launch_bounds__(FewRowsShape<2, 2>::warps * 32, 3)                      \
        few_rows_swiglu_##SUFFIX##_grouped(OPS::elem* h, const OPS::elem* x, const OPS::elem* w, int m, \
                                           int f, int k, float eps, int prefetch) {                  \
        few_rows<OPS, 2, 2, true>(h, x, w, m, f, k, 0, eps, prefetch);                                \
    }

// The gate/up form of 16-row blocks in blocks of 6 warps taking 3 chunks a round, bounded to
// three blocks an SM: where 8 warps of 2 chunks a round leave 2 of the 8 a second round (k of
// 544 or 576: SmolLM2-135M's 18 chunks, batches 17-64), the 6 warps take k in one (few_rows.rs,
// six_warps).
#define FEW_ROWS_GROUPED6_ENTRY_POINT(OPS, SUFFIX)                                                    \
    extern "C" __global__ void __launch_bounds__(FewRowsShape<2, 2, 6, 3>::warps * 32, 3)                \
        few_rows_swiglu_##SUFFIX##_grouped6(OPS::elem* h, const OPS::elem* x, const OPS::elem* w, int m,\
                                            int f, int k, float eps, int prefetch) {                  \
        few_rows<OPS, 2, 2, true, 6, 3>(h, x, w, m, f, k, 0, eps, prefetch);                          \
    }

// Blocks of 16 warps for calls whose k takes an 8-warp block's warps more than one round of
// loads (more than 8 unroll chunks: SmolLM2-135M's down product, k = 1536; every product of
// Llama-3.2-1B, k = 2048 and 8192): half the rounds, twice the bytes in flight an SM.
#define FEW_ROWS_WIDE_ENTRY_POINTS(OPS, SUFFIX, XT)                                                  \
    extern "C" __global__ void __launch_bounds__(FewRowsShape<XT, 1, 16>::warps * 32, 1)                \
        few_rows_product_##SUFFIX##_x##XT##_w16(OPS::elem* y, const OPS::elem* x, const OPS::elem* w,  \
                                                int m, int n, int k, int accumulate, int prefetch) {   \
        few_rows<OPS, XT, 1, false, 16>(y, x, w, m, n, k, accumulate, 0.f, prefetch);                 \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(FewRowsShape<XT, 2, 16>::warps * 32, 1)                \
        few_rows_swiglu_##SUFFIX##_x##XT##_w16(OPS::elem* h, const OPS::elem* x, const OPS::elem* w,   \
                                               int m, int f, int k, float eps, int prefetch) {         \
        few_rows<OPS, XT, 2, true, 16>(h, x, w, m, f, k, 0, eps, prefetch);                           \
    }

// Blocks of 12 warps and 16 rows, bounded to two an SM (80 registers), for products whose grid
// is too large for one 16-warp block an SM but fits two of these, with k in one round of their
// loads: SmolLM2-135M's batch-64 down product (k 1536: 48 chunks, 4 a warp; 144 blocks).
#define FEW_ROWS_W12_ENTRY_POINT(OPS, SUFFIX)                                                         \
    extern "C" __global__ void __launch_bounds__(FewRowsShape<2, 1, 12>::warps * 32, 2)                 \
        few_rows_product_##SUFFIX##_x2_w12(OPS::elem* y, const OPS::elem* x, const OPS::elem* w, int m,\
                                           int n, int k, int accumulate, int prefetch) {              \
        few_rows<OPS, 2, 1, false, 12>(y, x, w, m, n, k, accumulate, 0.f, prefetch);                  \
    }
