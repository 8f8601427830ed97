// Hopper forward (sm_90a): bf16 or f16 activations, head size 64 or 128, on warpgroup MMA
// (`wgmma.mma_async`). On sm_90 it takes the place of attention_tc.cu's mma.sync forward, whose
// helpers it shares (this file follows attention_tc.cu in its program); the backward kernels
// stay there.
//
// A block is one warpgroup (4 warps, 128 threads) that owns 64 queries: wgmma's M is 64, and
// warp w of the group holds rows 16w .. 16w + 15 in the same fragment layouts as mma.sync's
// m16n8k16 (attention_tc.cu's header): an f32 accumulator chunk of 8 columns is rows g and
// g + 8, columns 2t and 2t + 1 of lane 4g + t, and the A operand of k-chunk k is the
// accumulator's columns 16k .. 16k + 15 packed in pairs. So the online softmax, its row
// reductions over 4 lanes and the masks are the mma.sync forward's, and P goes from the
// score accumulators to the next product's A operand without a shuffle. Small blocks let
// several share an SM (three at head size 64, two at 128; registers and shared memory allow
// no more): while one block works through its softmax, the others' products keep the tensor
// cores busy.
//
// Both products take A from registers and B from shared memory through matrix descriptors:
// - S = Q K^T: Q's fragments are read from global memory once into registers (16 or 32 per
//   thread); K is the B operand in its natural layout, head dimension contiguous ("K-major");
// - O += P V: P comes from the score registers, rounded to the operand type; V is the B
//   operand with the key (reduction) dimension strided, head dimension contiguous, which
//   wgmma reads transposed ("MN-major").
// Each tile of K or V lies in shared memory in the 128-byte swizzle that wgmma reads without
// bank conflicts: a row of 64 elements is 128 bytes, and 16-byte chunk c of row r sits at
// chunk c ^ (r % 8) of its row, in 1024-byte aligned groups of 8 rows. At head size 128 a row
// is split into two 64-column halves, each half of the tile a separate swizzled sub-tile. The
// descriptors: for K, one k-step (16 columns, 32 bytes) advances the start address by 32 bytes
// inside the swizzled row, and groups of 8 rows are 1024 bytes apart (the stride offset); for
// V, one k-step (16 keys) advances it by 2048 bytes (two groups of 8 rows, again 1024 bytes
// apart), and the two 64-column halves at head size 128 are one sub-tile apart (the leading
// offset).
//
// Tiles arrive by `cp.async` into three stages of K and V; every thread waits for its own
// copies, makes them visible to the tensor cores' (asynchronous) proxy with
// `fence.proxy.async`, and a barrier then publishes the tile to the block. The loop overlaps
// the products with the softmax: at key tile j the block issues S_j = Q K_j^T and
// O += P_{j-1} V_{j-1} back to back, waits only for S_j, computes P_j while the second product
// runs, then waits for it and rescales O. Tile j + 1 is copied during step j into the stage
// that held tile j - 2, whose last reader (the product of step j - 1) every thread has waited
// for before the barrier that opens step j.
//
// The arithmetic is the mma.sync forward's: base-2 scores with `ex2.approx.ftz`, the causal mask
// and the window W applied per score on the tiles that straddle them only (tiles wholly
// outside every window of the block are never loaded), rows at or past T read zeros and are
// not written, P rounded once to the operand type. In f16, P is scaled by 2^12 before rounding
// (as there) by subtracting 12 from the exponent, so that the row sums, also of scaled P,
// cancel the scale when O is divided by them; the log-sum-exp removes it again. Every sum is
// in a fixed order (the tensor cores' within a product, the lanes' and the tiles' as written):
// results are deterministic.
//
// The output is staged through shared memory so that each row is written with 16-byte stores.

#define WG_THREADS 128  // one warpgroup
#define WG_ROWS 64      // the queries of a block: wgmma's M

// Key tile rows (wgmma's N of S = Q K^T) and the shared memory layout at one head size:
// three stages of [K | V], each tile HS / 64 sub-tiles of 64 columns (128-byte rows).
template <int HS, int N> struct WgShape {
    static constexpr int sub = N * 128;           // bytes of one 64-column sub-tile
    static constexpr int tile = (HS / 64) * sub;  // bytes of a K or V tile
    static constexpr int stages = 3;
    // The stages, and 1024 bytes of slack to align their base (the swizzle's period).
    static constexpr int bytes = 2 * stages * tile + 1024;
    static constexpr int out_pitch = 2 * HS + 16;  // output staging row, bytes (see below)
    static_assert(4 * 16 * out_pitch <= 2 * stages * tile, "the output staging fits the stages");
};

// The key tile the forward uses: 64 keys at both head sizes. At head size 64 three stages
// take 49 KiB and 155 registers a thread, so three blocks share an SM (128 keys would halve
// the tiles but allow only two blocks, and measured 10% slower at T = 1024); at 128, S is 32
// registers a thread beside O's 64 and three stages take 97 KiB, two blocks an SM (128 keys
// would spill).
template <int HS> struct WgForward {
    static constexpr int keys = 64;
};

// One wgmma of 64 rows x N columns x 16: d (f32, the accumulator layout above) += a (the
// warp's 16 rows of A, 4 registers of pairs) * B (16 x N, from the descriptor); B transposed
// when TRANS_B (V), and d overwritten rather than added to when SCALE_D is 0.
#define WG_MMA_RS_N64(NAME, TY)                                                            \
    template <int TRANS_B, int SCALE_D>                                                      \
    __device__ __forceinline__ void NAME(float (&d)[8][4], const unsigned (&a)[4],          \
                                         unsigned long long desc) {                          \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"                                 \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " "             \
                     "{" \
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
                     "}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"                                 \
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                       "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                       "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                       "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TRANS_B), "n"(SCALE_D)); \
    }

#define WG_MMA_RS_N128(NAME, TY)                                                            \
    template <int TRANS_B, int SCALE_D>                                                      \
    __device__ __forceinline__ void NAME(float (&d)[16][4], const unsigned (&a)[4],          \
                                         unsigned long long desc) {                          \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"                                 \
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " "             \
                     "{" \
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
                     "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
                     "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                     "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
                     "}, {%64, %65, %66, %67}, %68, p, 1, 1, %69;\n}\n"                                 \
                     : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
                       "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
                       "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
                       "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
                       "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
                       "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
                       "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
                       "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TRANS_B), "n"(SCALE_D)); \
    }


WG_MMA_RS_N64(wg_mma_bf16_n64, "bf16")
WG_MMA_RS_N128(wg_mma_bf16_n128, "bf16")
WG_MMA_RS_N64(wg_mma_f16_n64, "f16")
WG_MMA_RS_N128(wg_mma_f16_n128, "f16")

// The element types: attention_tc.cu's conversions, the wgmma variant, and P's scale as a
// power of two (log2).
struct WgBf16 : TcBf16 {
    static constexpr float p_log2 = 0.0f;
    template <int N, int TRANS_B, int SCALE_D>
    static __device__ __forceinline__ void mma(float (&d)[N / 8][4], const unsigned (&a)[4], unsigned long long desc) {
        if constexpr (N == 64) wg_mma_bf16_n64<TRANS_B, SCALE_D>(d, a, desc);
        else wg_mma_bf16_n128<TRANS_B, SCALE_D>(d, a, desc);
    }
};
struct WgF16 : TcF16 {
    static constexpr float p_log2 = 12.0f;  // TcF16::p_scale() = 2^12
    template <int N, int TRANS_B, int SCALE_D>
    static __device__ __forceinline__ void mma(float (&d)[N / 8][4], const unsigned (&a)[4], unsigned long long desc) {
        if constexpr (N == 64) wg_mma_f16_n64<TRANS_B, SCALE_D>(d, a, desc);
        else wg_mma_f16_n128<TRANS_B, SCALE_D>(d, a, desc);
    }
};

// wgmma's ordering: `fence` before the first wgmma that reads registers written by other
// instructions (the accumulators, P); `commit` closes a group of issued wgmmas; `wait<N>`
// returns once at most the newest N groups are still running.
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// Pins an accumulator array to this point of the program: the compiler does not move reads
// or writes of its registers across it, so none crosses the wait before it.
template <int A> __device__ __forceinline__ void wg_pin(float (&d)[A][4]) {
    #pragma unroll
    for (int i = 0; i < A; i++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[i][e]) :: "memory");
    }
}

// cp.async writes through the generic proxy; wgmma reads shared memory through the async
// proxy, which sees those writes only after this fence (then a barrier for other threads').
__device__ __forceinline__ void wg_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// A matrix descriptor with the 128-byte swizzle: start address, leading and stride byte
// offsets (each in 16-byte units, 14 bits), layout type 1 in bits 62-63.
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr, unsigned lead, unsigned stride) {
    return (unsigned long long)((addr >> 4) & 0x3fffu) | (unsigned long long)((lead >> 4) & 0x3fffu) << 16 |
           (unsigned long long)((stride >> 4) & 0x3fffu) << 32 | 1ull << 62;
}

// Starts copying rows r0 .. r0 + N - 1 of K or V (HS elements each, `stride` elements apart)
// into the swizzled tile at shared address `dst`; rows at or past T become zeros (so that
// masked probabilities, exact zeros, meet finite values).
template <int HS, int N, typename E>
__device__ __forceinline__ void wg_tile_copy(unsigned dst, const E* src, size_t stride, int r0, int T) {
    constexpr int chunks = HS / 8;  // 16-byte chunks of a row
    static_assert(N * chunks % WG_THREADS == 0, "every thread copies the same number of chunks");
    #pragma unroll
    for (int j = 0; j < N * chunks / WG_THREADS; j++) {
        const int i = threadIdx.x + WG_THREADS * j;
        const int r = i / chunks, c = i % chunks;
        const bool in = r0 + r < T;
        const unsigned at = dst + (c >> 3) * (N * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(at), "l"(src + (size_t)(in ? r0 + r : 0) * stride + c * 8), "r"(in ? 16 : 0));
    }
}

// The online softmax of one tile of scores s (64 rows x N keys from k0, this lane's rows
// row0 and row0 + 8 of the warp's warp_row0 .. warp_row0 + 15): masks the scores the causal
// mask or the window hides (on tiles that straddle them), updates the running maximum m (base
// 2) and the lane's partial row sums l, turns s into P times 2^Ops::p_log2, and returns each
// row's correction corr = 2^(m_old - m_new) for the output accumulators.
template <class Ops, int N>
__device__ __forceinline__ void wg_softmax(float (&s)[N / 8][4], float (&m)[2], float (&l)[2], float (&corr)[2],
                                           int k0, int warp_row0, int row0, int t, float c, int W, int T) {
    // Scores stay unscaled until the exponential: c > 0, so the largest raw score times c is
    // the largest scaled one, and s * c - m is one fused multiply-add.
    if (!tc_all_see(warp_row0, warp_row0 + 15, k0, k0 + N - 1, W, T)) {
        #pragma unroll
        for (int n = 0; n < N / 8; n++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                // Keys past the row are masked; that includes keys >= T for rows < T.
                const int key = k0 + n * 8 + 2 * t + (e & 1);
                if (!tc_sees(row0 + 8 * (e >> 1), key, W)) s[n][e] = KILN_NEG_INF;
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        float mx = KILN_NEG_INF;
        #pragma unroll
        for (int n = 0; n < N / 8; n++) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        // A row that has seen no key yet and finds every key of this tile masked keeps a max
        // of -inf: it then subtracts 0, so its masked scores give 0, never NaN.
        const float m_new = fmaxf(m[r], tc_row_max(mx) * c);
        const float m_sub = m_new == KILN_NEG_INF ? 0.0f : m_new;
        corr[r] = tc_exp2(m[r] - m_sub);
        const float shift = m_sub - Ops::p_log2;  // P times 2^p_log2
        float sum = 0.0f;  // this lane's share of the row, in column order
        #pragma unroll
        for (int n = 0; n < N / 8; n++) {
            #pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                s[n][e] = tc_exp2(fmaf(s[n][e], c, -shift));
                sum += s[n][e];
            }
        }
        l[r] = l[r] * corr[r] + sum;  // a per-lane partial sum until the end
        m[r] = m_new;
    }
}

// The forward: a block owns 64 queries and streams the key tiles up to its last query's
// (from the first its window reaches) with the online softmax. Shared memory: WgShape::bytes.
template <class Ops, int HS, int N>
__device__ __forceinline__ void wg_forward(const typename Ops::elem* __restrict__ qkv,
                                           typename Ops::elem* __restrict__ out,
                                           float* __restrict__ lse, int T, int C, int NH, int W) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef WgShape<HS, N> S;
    typedef typename Ops::elem E;
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    tc_need_shared(S::bytes);
    const unsigned smem0 = (tc_smem_addr(wg_smem) + 1023u) & ~1023u;
    auto ks = [&](int i) { return smem0 + 2 * i * S::tile; };
    auto vs = [&](int i) { return smem0 + (2 * i + 1) * S::tile; };
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    // Under the causal mask the last query tiles see the most keys: start those first.
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const size_t stride = 3 * (size_t)C;
    const E* base = qkv + (size_t)b * T * stride + h * HS;
    const int q0 = qt * WG_ROWS;
    const int warp_row0 = q0 + warp * 16;
    const int row0 = warp_row0 + g;  // this lane's rows: row0 and row0 + 8
    const float c = tc_scale<HS>() * TC_LOG2E;
    const int kt0 = tc_first_key_tile(q0, W, N);
    const int tiles = min(q0 + WG_ROWS - 1, T - 1) / N - kt0 + 1;

    auto copy_tile = [&](int kt, int stage) {
        wg_tile_copy<HS, N>(ks(stage), base + C, stride, kt * N, T);
        wg_tile_copy<HS, N>(vs(stage), base + 2 * C, stride, kt * N, T);
    };
    copy_tile(kt0, 0);
    tc_commit();

    // Q as the A operand of every k-chunk: register kk][r + 2h] holds row row0 + 8r, columns
    // 16kk + 8h + 2t and the next; rows at or past T are zeros.
    unsigned qf[HS / 16][4];
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const bool in = row0 + 8 * r < T;
        const unsigned* src = reinterpret_cast<const unsigned*>(base + (size_t)(in ? row0 + 8 * r : 0) * stride) + t;
        #pragma unroll
        for (int kk = 0; kk < HS / 16; kk++) {
            qf[kk][r] = in ? src[8 * kk] : 0u;
            qf[kk][r + 2] = in ? src[8 * kk + 4] : 0u;
        }
    }

    float o[HS / 8][4], s[N / 8][4];
    #pragma unroll
    for (int n = 0; n < HS / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    #pragma unroll
    for (int n = 0; n < N / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    unsigned p[N / 16][4];  // P of the last tile as the A operand of O += P V
    float m[2] = {KILN_NEG_INF, KILN_NEG_INF}, l[2] = {0.0f, 0.0f}, corr[2];
    // Waits for tile j's copies and starts tile j + 1's into the stage after `stage`.
    auto next_tile = [&](int j, int stage) {
        tc_wait<0>();  // this thread's copies of tile j
        wg_fence_proxy();
        // Every thread's copies of tile j are in; every thread has finished step j - 1, whose
        // product read the stage of tile j - 2, which tile j + 1 now fills.
        __syncthreads();
        if (j + 1 < tiles) copy_tile(kt0 + j + 1, stage == 2 ? 0 : stage + 1);
        tc_commit();
    };
    // Issues S = Q K^T from the K tile of `stage`.
    auto issue_s = [&](int stage) {
        const unsigned long long kd = wg_desc(ks(stage), 16, 1024);
        Ops::template mma<N, 0, 0>(s, qf[0], kd);
        #pragma unroll
        for (int kk = 1; kk < HS / 16; kk++)
            Ops::template mma<N, 0, 1>(s, qf[kk], kd + (((kk >> 2) * S::sub + (kk & 3) * 32) >> 4));
        wg_commit();
    };
    // Issues O += P V from the V tile of `stage`.
    auto issue_pv = [&](int stage) {
        const unsigned long long vd = wg_desc(vs(stage), S::sub, 1024);
        #pragma unroll
        for (int kk = 0; kk < N / 16; kk++) Ops::template mma<HS, 1, 1>(o, p[kk], vd + ((kk * 2048) >> 4));
        wg_commit();
    };
    // P as the A operand of the next O += P V, rounded once to the operand type.
    auto pack_p = [&]() {
        #pragma unroll
        for (int kk = 0; kk < N / 16; kk++) {
            p[kk][0] = Ops::pack(s[2 * kk][0], s[2 * kk][1]);
            p[kk][1] = Ops::pack(s[2 * kk][2], s[2 * kk][3]);
            p[kk][2] = Ops::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            p[kk][3] = Ops::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
    };

    // Step 0: S_0 and its softmax (O is still zero).
    next_tile(0, 0);
    wg_fence();
    issue_s(0);
    wg_wait<0>();
    wg_pin(s);
    wg_softmax<Ops, N>(s, m, l, corr, kt0 * N, warp_row0, row0, t, c, W, T);
    pack_p();
    // Steps 1 ..: S_j and O += P_{j-1} V_{j-1} issued together; P_j computed while the
    // second runs. The waits are unconditional, so that the compiler sees every register
    // of a running product untouched until its wait.
    int prev = 0;  // the stage of tile j - 1
    for (int it = 1; it < tiles; it++) {
        const int stage = prev == 2 ? 0 : prev + 1;
        next_tile(it, stage);
        wg_fence();
        issue_s(stage);
        issue_pv(prev);
        wg_wait<1>();  // S_j is done
        wg_pin(s);
        wg_softmax<Ops, N>(s, m, l, corr, (kt0 + it) * N, warp_row0, row0, t, c, W, T);
        wg_wait<0>();  // O += P_{j-1} V_{j-1} is done
        wg_pin(o);
        #pragma unroll
        for (int n = 0; n < HS / 8; n++) {
            o[n][0] *= corr[0];
            o[n][1] *= corr[0];
            o[n][2] *= corr[1];
            o[n][3] *= corr[1];
        }
        pack_p();
        prev = stage;
    }
    // The last tile's O += P V.
    wg_fence();
    issue_pv(prev);
    wg_wait<0>();
    wg_pin(o);

    // Each warp stages its 16 rows (row pitch HS * 2 + 16 bytes: lane 4g + t's 4-byte writes
    // fall in banks 4g + t) and writes them back in 16-byte pieces, 8 or 16 lanes a row.
    __syncthreads();  // every product has read its stage
    unsigned char* const stage_out = wg_smem + (smem0 - tc_smem_addr(wg_smem)) + warp * 16 * S::out_pitch;
    float inv[2];
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const float sum = tc_row_sum(l[r]);
        inv[r] = 1.0f / sum;  // rows < T saw their own key: sum > 0
        const int row = row0 + 8 * r;
        // Natural log-sum-exp of the scaled scores: m is in base-2 units, sum carries P's scale.
        if (t == 0 && row < T)
            lse[((size_t)b * NH + h) * T + row] = (m[r] - Ops::p_log2) * 0.6931471805599453f + logf(sum);
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        unsigned* dst = reinterpret_cast<unsigned*>(stage_out + (g + 8 * r) * S::out_pitch) + t;
        #pragma unroll
        for (int n = 0; n < HS / 8; n++) dst[4 * n] = Ops::pack(o[n][2 * r] * inv[r], o[n][2 * r + 1] * inv[r]);
    }
    __syncwarp();
    constexpr int chunks = HS / 8;  // 16-byte pieces of an output row
    #pragma unroll
    for (int j = 0; j < 16 * chunks / 32; j++) {
        const int i = lane + 32 * j, r = i / chunks, ch = i % chunks;
        const int row = warp_row0 + r;
        if (row < T) {
            const uint4 v = *reinterpret_cast<const uint4*>(stage_out + r * S::out_pitch + ch * 16);
            *reinterpret_cast<uint4*>(out + ((size_t)b * T + row) * C + h * HS + ch * 8) = v;
        }
    }
#elif defined(__CUDA_ARCH__)
    __trap();  // compiled for a target without wgmma: a launch fails rather than writing nothing
#endif
}

// Entry points, one per element type and head size (the key tile of WgForward); attention.rs
// appends the instantiations. At least two blocks an SM: at most 255 registers a thread.
#define WG_ENTRY_POINT(HS, N, OPS, NAME)                                                                   \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, 2)                                           \
        NAME(const OPS::elem* qkv, OPS::elem* out, float* lse, int T, int C, int NH, int W) {              \
        wg_forward<OPS, HS, N>(qkv, out, lse, T, C, NH, W);                                                \
    }
#define WG_ENTRY_POINTS(HS, OPS, SUFFIX) \
    WG_ENTRY_POINT(HS, WgForward<HS>::keys, OPS, attention_forward_##SUFFIX##_hs##HS##_wgmma)
