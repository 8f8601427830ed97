// Tensor-core kernels: bf16 or f16 activations, head size 64, 96 or 128, sm_80 and newer
// (mma.sync on 16-bit operands). Head size 96 (Phi-3-mini) takes the 128 layouts' shapes
// (32-row streamed tiles, K and V of dK/dV in shared memory) with six k-chunks a row; it has
// no Hopper (wgmma) or f32 form, so it runs these kernels on every sm_80+ GPU.
//
// The same three kernels as attention.cu's CUDA-core ones (forward; dQ and the row term d;
// dK/dV), but a block owns 64 rows and each of its 4 warps owns 16 of them (the forward at head
// size 64: 128 and 32, see TcForward), computing on tiles with `mma.sync.m16n8k16` (16-bit
// operands, f32 accumulators). Fragments are read from shared memory
// with `ldmatrix`; tiles arrive by `cp.async` into two buffers, so the next tile's copy overlaps
// the current tile's arithmetic. All inline PTX, so NVRTC needs no CUDA headers.
//
// One template per kernel, instantiated at the end for each element type and head size (the
// `extern "C"` entry points keep plain kernel names). The element type only changes the operand
// conversions and the mma variant (`TcBf16`, `TcF16`: bf16 and f16 share the fragment layouts).
//
// Fragment layouts (PTX ISA, m16n8k16): in a warp, lane = 4 * g + t. An f32 accumulator tile of
// 16 rows x N columns is `float acc[N / 8][4]`: acc[n][e] is row g + 8 * (e >> 1), column
// 8 * n + 2 * t + (e & 1). An A operand of 16 rows x HS (the k dimension) is
// `unsigned a[HS / 16][4]`, one 16-bit pair per register. An accumulator can be reused as an A
// operand without shuffles, because its layout for columns 16k .. 16k + 15 matches the A layout
// of k-chunk k.
//
// Probabilities P and score gradients dS are f32 values that feed a second product: they are
// rounded once to the operand type (8 bits of mantissa in bf16, 11 in f16), as FlashAttention
// and PyTorch's SDPA do; a split into hi + lo halves would keep ~16 bits but doubles those
// products, and costed the backward 1.7x. The products of stored 16-bit values (Q K^T, dO V^T)
// are exact in the f32 accumulators.
//
// The backward's row term d_i = sum_j P_ij dP_ij equals dO_i . O_i; the dQ kernel takes it from
// the forward's stored output O (one dot product per row) rather than from a second pass over
// the keys, again as FlashAttention does: its error is O's rounding, within the bounds above.
//
// f16 has 5 exponent bits (normal from 2^-14, largest 65504), which P and dS need scaled into:
// - P is in [0, 1]: it is multiplied by 2^12 before rounding (and the result divided by it),
//   so that a P down to 2^-26 is still a normal f16 and only smaller ones lose low bits
//   (an absolute error under 2^-37 per P, far below the f32 rounding of the sums);
// - dS = P (dP - d) has no bound (dO carries the loss scale of fp16-mixed), so each
//   accumulator row keeps its own power-of-two scale, the smallest that any tile so far
//   needed to put the row's largest |dS| in [2^14, 2^15); a tile that needs a smaller one
//   rescales the row's accumulator first, as the online softmax does with its maximum. Every
//   scaled dS is then below 2^15 and keeps 11 bits relative to the row's largest, with no
//   overflow. The scales are powers of two: exact in f32.
// bf16 shares f32's exponent range and needs neither.
//
// Tile shapes. A block is 4 warps of 16 rows (64 queries, or 64 keys in dK/dV; the forward at
// head size 64 has two row tiles a warp, 128 queries a block, staged the same way). At head size 64
// the streamed tiles (keys, or queries in dK/dV) are 64 rows and every operand a warp keeps
// (its rows' Q, dO, or K and V) sits in registers. At head size 128 each row is twice as long:
// - streamed tiles are 32 rows, so that their double buffers stay at 4 x 32 x 136 x 2 B = 34 KiB
//   and the per-tile score fragments at 16 registers, leaving room for the 64-register output
//   accumulators (the forward and dQ stay under 48 KiB of shared memory with their own rows in
//   registers: Q and dO, 32 registers each);
// - the dK/dV kernel holds two 16 x 128 f32 accumulators (128 registers), so its K and V rows
//   stay in shared memory (2 x 64 x 136 x 2 B = 34 KiB more) and are read per product: 68.5 KiB
//   in all, which sm_80 (163 KiB), sm_86/89 (99 KiB) and sm_90 (227 KiB) allow a block once the
//   kernel opts in (the launcher does), and two blocks fit an SM's registers at up to 255
//   registers a thread.
// Tile rows have a pitch of HS + 8 elements (16 bytes over), so ldmatrix's 8 row reads of 16
// bytes fall in distinct banks. Shared memory is dynamic; the launcher's byte counts
// (attention.rs) follow the layouts below, and each kernel traps if given fewer.
//
// Every sum is in a fixed order (no atomics), so results are deterministic.
//
// A sliding window W > 0 limits query i to keys j with i - W < j <= i (W = 0: none): tiles
// wholly outside every window of a block are skipped, a warp skips the tiles wholly outside
// its rows' windows, and scores outside a row's window are masked like those past the
// diagonal.

#define TC_ROWS 64  // rows (queries or keys) a block owns: 4 warps of 16
#define TC_LOG2E 1.4426950408889634f

// Rows of the streamed tiles (see "Tile shapes" above) and the shared memory layouts' sizes
// (the launcher's byte counts in attention.rs follow them).
template <int HS> struct TcShape {
    static constexpr int stream = HS == 64 ? 64 : 32;
    static constexpr int ld = HS + 8;  // tile row pitch in elements
    static constexpr int tile = stream * ld;
    // Forward: [K0 | V0 | K1 | V1].
    static constexpr int forward_bytes = 4 * tile * 2;
    // dQ: [K0 | V0 | K1 | V1], with the Q and dO tiles (64 rows each) staged from K1 on: at
    // head size 64 in K1 and V1 themselves, at 128 reaching two tiles past V1.
    static constexpr int dq_bytes = (2 * tile + 2 * TC_ROWS * ld > 4 * tile ? 2 * tile + 2 * TC_ROWS * ld : 4 * tile) * 2;
    // dK/dV: the query tiles [Q0 | dO0 | Q1 | dO1], then at head size 128 the block's K and V
    // tiles (64 rows each; at 64 they are staged in Q1 and dO1 and kept in registers), then
    // two buffers of the query rows' lse and d (f32).
    static constexpr int dkv_elems = 4 * tile + (HS == 64 ? 0 : 2 * TC_ROWS * ld);
    static constexpr int dkv_bytes = dkv_elems * 2 + 4 * stream * 4;
};

// 1 / sqrt(HS), the softmax's score scale (head size 96: Phi-3-mini's).
template <int HS> __device__ __forceinline__ float tc_scale() {
    static_assert(HS == 64 || HS == 96 || HS == 128, "a head size with a score scale");
    return HS == 64 ? 0.125f : HS == 96 ? 0.10206207261596575f : 0.08838834764831845f;
}

__device__ __forceinline__ unsigned tc_smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// The dynamic shared memory this block has: a launch with fewer bytes than a kernel's layout
// needs traps (a launch error) rather than reading past its shared memory.
__device__ __forceinline__ void tc_need_shared(unsigned bytes) {
    unsigned have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < bytes) __trap();
}

// Operand conversions and the mma of bf16.
struct TcBf16 {
    typedef bf16 elem;
    static constexpr bool scaled = false;  // no P or dS scaling (f32's exponent range)
    static __device__ __forceinline__ float p_scale() { return 1.0f; }
    // Two f32 as a pair (round to nearest even), `lo` in the low half as mma operands expect.
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float low(unsigned p) { return __uint_as_float(p << 16); }
    static __device__ __forceinline__ float high(unsigned p) { return __uint_as_float(p & 0xffff0000u); }
    // acc (16 x 8) += a (16 x 16) * b (16 x 8).
    static __device__ __forceinline__ void mma(float acc[4], const unsigned a[4], unsigned b0, unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};"
            : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// Operand conversions and the mma of f16 (IEEE half: round to nearest even, overflow to inf,
// as common.cuh's store<f16>).
struct TcF16 {
    typedef f16 elem;
    static constexpr bool scaled = true;  // P times 2^12, dS by a power of two per row
    static __device__ __forceinline__ float p_scale() { return 4096.0f; }
    static __device__ __forceinline__ unsigned pack(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
    static __device__ __forceinline__ float low(unsigned p) {
        float r;
        asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"((unsigned short)(p & 0xffffu)));
        return r;
    }
    static __device__ __forceinline__ float high(unsigned p) {
        float r;
        asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"((unsigned short)(p >> 16)));
        return r;
    }
    static __device__ __forceinline__ void mma(float acc[4], const unsigned a[4], unsigned b0, unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};"
            : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

// Global to shared memory copies run asynchronously (cp.async: copy_async16 in common.cuh for
// 16 bytes), so a block loads its next tile while it computes on the current one. A copy whose
// source lies past the end (`in` false) fills zeros and reads nothing (source size 0; the
// address stays a valid one).
__device__ __forceinline__ void tc_copy_async4(void* dst, const void* src, bool in) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                 :: "r"(tc_smem_addr(dst)), "l"(src), "r"(in ? 4 : 0));
}
// Ends the group of copies issued so far; waiting for "all but the newest N groups" then lets
// the next tile's copies stay in flight.
__device__ __forceinline__ void tc_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void tc_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// Starts copying rows r0 .. r0 + ROWS - 1 (HS 16-bit elements each, `stride` elements apart)
// into a padded tile, 16 bytes per copy; rows at or past T become zeros. Needs 16-byte aligned
// rows (checked by the launcher).
template <int HS, int ROWS, typename E>
__device__ __forceinline__ void tc_tile_copy(unsigned short* tile, const E* src, size_t stride,
                                             int r0, int T) {
    constexpr int chunks = HS / 8;
    for (int i = threadIdx.x; i < ROWS * chunks; i += blockDim.x) {
        const int r = i / chunks, c = (i % chunks) * 8;
        const bool in = r0 + r < T;
        copy_async16(tile + r * TcShape<HS>::ld + c, src + (size_t)(in ? r0 + r : 0) * stride + c, in);
    }
}

__device__ __forceinline__ void tc_ldsm(unsigned r[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void tc_ldsm_trans(unsigned r[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// k-chunk k (columns 16k .. 16k + 15) of the A operand for tile rows r0 .. r0 + 15.
template <int HS>
__device__ __forceinline__ void tc_load_a_chunk(unsigned a[4], const unsigned short* tile, int r0, int k) {
    const int lane = threadIdx.x & 31;
    tc_ldsm(a, tc_smem_addr(tile + (r0 + (lane & 15)) * TcShape<HS>::ld + k * 16 + (lane >> 4) * 8));
}

// The B operand of k-chunk k for output columns 16n .. 16n + 15 from rows 16n .. 16n + 15 of
// `tile`, transposed: b[0], b[1] for columns 16n .. 16n + 7, b[2], b[3] for the next 8.
template <int HS>
__device__ __forceinline__ void tc_load_b_t(unsigned b[4], const unsigned short* tile, int n, int k) {
    const int lane = threadIdx.x & 31;
    tc_ldsm(b, tc_smem_addr(tile + (n * 16 + (lane & 7) + ((lane >> 4) << 3)) * TcShape<HS>::ld +
                            k * 16 + ((lane >> 3) & 1) * 8));
}

// A warp's MT x 16 rows x HS as the A operand of products with tiles, kept in registers:
// loaded once, read by every product. Each B fragment read from shared memory feeds all MT
// row tiles, so MT = 2 halves the shared-memory reads per product (the forward at head size
// 64, where the registers allow it).
template <class Ops, int HS, int MT = 1> struct TcRowsInRegisters {
    unsigned a[MT][HS / 16][4];
    __device__ __forceinline__ void load(const unsigned short* tile, int r0) {
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            #pragma unroll
            for (int k = 0; k < HS / 16; k++) tc_load_a_chunk<HS>(a[mt][k], tile, r0 + 16 * mt, k);
        }
    }
    // acc[mt] (16 x N) += rows of tile mt * tile^T: the tile's N rows are the output columns
    // (S = Q K^T with the K tile; dP = dO V^T with the V tile).
    template <int N>
    __device__ __forceinline__ void mma_tile_t(float (*acc)[N / 8][4], const unsigned short* tile) const {
        #pragma unroll
        for (int n = 0; n < N / 16; n++) {
            #pragma unroll
            for (int k = 0; k < HS / 16; k++) {
                unsigned b[4];
                tc_load_b_t<HS>(b, tile, n, k);
                #pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    Ops::mma(acc[mt][2 * n], a[mt][k], b[0], b[1]);
                    Ops::mma(acc[mt][2 * n + 1], a[mt][k], b[2], b[3]);
                }
            }
        }
    }
};

// The same operand (one row tile) left in its shared tile and read chunk by chunk per
// product: for the dK/dV kernel at head size 128, whose accumulators need the registers.
template <class Ops, int HS> struct TcRowsInShared {
    const unsigned short* tile;
    int r0;
    __device__ __forceinline__ void load(const unsigned short* t, int row0) {
        tile = t;
        r0 = row0;
    }
    // The same sums as TcRowsInRegisters::mma_tile_t, in the same order per output element.
    template <int N>
    __device__ __forceinline__ void mma_tile_t(float (*acc)[N / 8][4], const unsigned short* other) const {
        #pragma unroll
        for (int k = 0; k < HS / 16; k++) {
            unsigned a[4];
            tc_load_a_chunk<HS>(a, tile, r0, k);
            #pragma unroll
            for (int n = 0; n < N / 16; n++) {
                unsigned b[4];
                tc_load_b_t<HS>(b, other, n, k);
                Ops::mma(acc[0][2 * n], a, b[0], b[1]);
                Ops::mma(acc[0][2 * n + 1], a, b[2], b[3]);
            }
        }
    }
};

// acc[mt] (16 x HS) += x[mt] (16 x K, f32 in the accumulator layout, times `scale[mt][r]` in
// row g + 8r) * tile (K rows x HS), with the scaled x rounded to the operand type (O += P V,
// dQ += dS K, dV += P^T dO, dK += dS^T Q); each B fragment feeds all MT row tiles.
template <class Ops, int HS, int K, int MT = 1>
__device__ __forceinline__ void tc_mma_x_tile(float (*acc)[HS / 8][4], float (*x)[K / 8][4],
                                              const unsigned short* tile, float (*scale)[2]) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int k = 0; k < K / 16; k++) {
        unsigned a[MT][4];
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            a[mt][0] = Ops::pack(x[mt][2 * k][0] * scale[mt][0], x[mt][2 * k][1] * scale[mt][0]);
            a[mt][1] = Ops::pack(x[mt][2 * k][2] * scale[mt][1], x[mt][2 * k][3] * scale[mt][1]);
            a[mt][2] = Ops::pack(x[mt][2 * k + 1][0] * scale[mt][0], x[mt][2 * k + 1][1] * scale[mt][0]);
            a[mt][3] = Ops::pack(x[mt][2 * k + 1][2] * scale[mt][1], x[mt][2 * k + 1][3] * scale[mt][1]);
        }
        #pragma unroll
        for (int n = 0; n < HS / 16; n++) {
            unsigned b[4];
            tc_ldsm_trans(b, tc_smem_addr(tile + (k * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) *
                                                     TcShape<HS>::ld + n * 16 + (lane >> 4) * 8));
            #pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                Ops::mma(acc[mt][2 * n], a[mt], b[0], b[1]);
                Ops::mma(acc[mt][2 * n + 1], a[mt], b[2], b[3]);
            }
        }
    }
}

// Whether query `query` sees key `key` under the causal mask and the window W (0: none).
__device__ __forceinline__ bool tc_sees(int query, int key, int W) {
    return key <= query && (W == 0 || query - key < W);
}

// Whether every query in q_lo .. q_hi (all < T) sees every key in k_lo .. k_hi: such tiles
// (all but the diagonal ones and a window's edges) skip the per-score mask.
__device__ __forceinline__ bool tc_all_see(int q_lo, int q_hi, int k_lo, int k_hi, int W, int T) {
    return k_hi <= q_lo && q_hi < T && (W == 0 || q_hi - k_lo < W);
}

// Runs `tile(masked)`: masked = false where every query of the tile sees every key (all_see),
// true on the tiles that straddle the causal mask, a window's edge or T. The two calls are
// separate copies of the tile's code: a test of the mask inside one copy is compiled into
// selects evaluated on every tile, a few instructions a score on the unmasked tiles that are
// nearly all of them.
template <class F> __device__ __forceinline__ void tc_masked_or_not(bool all_see, F&& tile) {
    if (all_see) tile(false);
    else tile(true);
}

// 2^x on the special-function unit, subnormal results flushed to 0 (a probability under
// 2^-126 of its row's largest adds nothing an f32 sum keeps): one instruction, where exp2f
// adds range fix-ups around it. 2^-inf = 0.
__device__ __forceinline__ float tc_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Whether any query in q_lo .. q_hi sees any key in k_lo .. k_hi: a warp skips the products of
// a tile otherwise (they would add exact zeros).
__device__ __forceinline__ bool tc_any_sees(int q_lo, int q_hi, int k_lo, int k_hi, int W) {
    return k_lo <= q_hi && (W == 0 || q_lo - k_hi < W);
}

// The first tile of `rows` keys that queries from q0 on read under the window W.
__device__ __forceinline__ int tc_first_key_tile(int q0, int W, int rows) {
    return W > 0 ? max(0, q0 - W + 1) / rows : 0;
}

// Reductions over the 4 lanes (t = 0..3) that share an accumulator row.
__device__ __forceinline__ float tc_row_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float tc_row_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Masks the scores of one warp's 16-row tile s (this lane's rows row0 and row0 + 8, N keys
// from k0) that the causal mask or the window W hides. Keys past the row are masked; that
// includes keys >= T for rows < T. Callers skip it on tiles every row sees whole.
template <int N>
__device__ __forceinline__ void tc_mask_tile(float (&s)[N / 8][4], int k0, int row0, int t, int W) {
    #pragma unroll
    for (int n = 0; n < N / 8; n++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = k0 + n * 8 + 2 * t + (e & 1);
            if (!tc_sees(row0 + 8 * (e >> 1), key, W)) s[n][e] = KILN_NEG_INF;
        }
    }
}

// The online softmax's new running maximum of accumulator row r (0: row0, 1: row0 + 8) after
// the tile s, in base-2 units (raw scores times c), and in m_sub the value its scores
// subtract: a row that has seen no key yet and finds every key of this tile masked keeps a
// maximum of -inf and subtracts 0, so its masked scores give 0, never NaN.
template <int N>
__device__ __forceinline__ float tc_tile_max(const float (&s)[N / 8][4], int r, float m, float c, float& m_sub) {
    float mx = KILN_NEG_INF;
    #pragma unroll
    for (int n = 0; n < N / 8; n++) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
    const float m_new = fmaxf(m, tc_row_max(mx) * c);
    m_sub = m_new == KILN_NEG_INF ? 0.0f : m_new;
    return m_new;
}

// The backward's P = 2^(S c - lse) and dS = P (dP - d) of one warp's 16-row tile, shared by
// the mma.sync and tf32 kernels (masked only when `masked`: tc_masked_or_not).
// dQ: rows are queries (this lane's row0 and row0 + 8, their lse in base 2 and row terms d),
// KC keys from k0; dS replaces dP.
template <int KC>
__device__ __forceinline__ void tc_dq_p_ds(const float (&s)[KC / 8][4], float (&dp)[KC / 8][4], int k0, int row0,
                                           int t, float c, const float (&lse2)[2], const float (&rowd)[2], int W,
                                           bool masked) {
    #pragma unroll
    for (int n = 0; n < KC / 8; n++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = e >> 1;
            const int key = k0 + n * 8 + 2 * t + (e & 1);
            float p = tc_exp2(fmaf(s[n][e], c, -lse2[r]));
            if (masked && !tc_sees(row0 + 8 * r, key, W)) p = 0.0f;
            dp[n][e] = p * (dp[n][e] - rowd[r]);
        }
    }
}

// dK/dV: rows are keys (key0 and key0 + 8), QC queries from q0 whose lse (natural) and row
// terms d are read at lse[qi * stride] and d[qi * stride]; P replaces S, dS replaces dP.
template <int QC>
__device__ __forceinline__ void tc_dkv_p_ds(float (&s)[QC / 8][4], float (&dp)[QC / 8][4], int q0, int key0, int t,
                                            float c, const float* lse, const float* d, int stride, int W, int T,
                                            bool masked) {
    #pragma unroll
    for (int n = 0; n < QC / 8; n++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) {
            const int qi = n * 8 + 2 * t + (e & 1), query = q0 + qi;
            float p = tc_exp2(fmaf(s[n][e], c, -lse[qi * stride] * TC_LOG2E));
            if (masked && !(tc_sees(query, key0 + 8 * (e >> 1), W) && query < T)) p = 0.0f;
            s[n][e] = p;
            dp[n][e] = p * (dp[n][e] - d[qi * stride]);
        }
    }
}

// The largest scale a row of dS ever takes: 2^64 keeps every scaled sum far inside f32.
#define TC_DS_SCALE_MAX_EXP 64

// The power of two that puts `largest` (a row's largest |dS| in a tile, > 0) in
// [2^14, 2^15), at most 2^TC_DS_SCALE_MAX_EXP; inf and NaN get 2^-114 and stay what they are.
__device__ __forceinline__ float tc_ds_scale(float largest) {
    const int biased = (int)((__float_as_uint(largest) >> 23) & 0xffu);
    const int e = min(141 - biased, TC_DS_SCALE_MAX_EXP);  // 14 - (biased - 127)
    return __uint_as_float((unsigned)(e + 127) << 23);
}

// The scale a row's dS accumulator starts with (then only ever lowered).
__device__ __forceinline__ float tc_ds_scale_start() {
    return __uint_as_float((unsigned)(TC_DS_SCALE_MAX_EXP + 127) << 23);
}

// For element types that need it (f16), lowers the scale of each of this lane's two
// accumulator rows to what the tile's dS needs (the smallest any tile so far needed, see
// tc_ds_scale), rescaling the row's accumulator to match; the caller multiplies dS by the
// scale afterwards. A lane first compares its own |dS| with the limit each row may reach
// (2^15 scaled) and the warp votes; only a warp in which some row needs a smaller scale (its
// first tile, then rarely) takes the row maxima over the lanes and lowers the scales.
template <class Ops, int HS, int K>
__device__ __forceinline__ void tc_fit_ds_scales(float (&acc)[HS / 8][4], const float (&ds)[K / 8][4],
                                                 float (&scale)[2]) {
    if constexpr (Ops::scaled) {
        float mine[2];
        bool over = false;
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            mine[r] = 0.0f;
            #pragma unroll
            for (int n = 0; n < K / 8; n++) mine[r] = fmaxf(mine[r], fmaxf(fabsf(ds[n][2 * r]), fabsf(ds[n][2 * r + 1])));
            over |= mine[r] >= 32768.0f / scale[r];
        }
        if (!__any_sync(0xffffffffu, over)) return;
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            const float largest = tc_row_max(mine[r]);
            if (largest == 0.0f) continue;  // no dS in this row: constrains nothing
            // The power of two that brings the row to [2^14, 2^15): below 1 only when the row
            // reaches 2^15 under its scale (the scaled maximum's scale is the unscaled one's
            // divided by the row's scale: powers of two, and the cap of 2^64 binds only above 1).
            const float ratio = tc_ds_scale(largest) / scale[r];
            if (ratio < 1.0f) {
                #pragma unroll
                for (int n = 0; n < HS / 8; n++) {
                    acc[n][2 * r] *= ratio;
                    acc[n][2 * r + 1] *= ratio;
                }
                scale[r] *= ratio;
            }
        }
    }
}

// Row tiles of 16 a forward warp owns, and the queries of a forward block (4 warps): at head
// size 64 two tiles, so that every K and V fragment read from shared memory feeds two
// products (the registers allow it: 64 for the output accumulators, 64 for the scores, 32 for
// Q); at 128 the accumulators alone take 64 registers a tile, so one.
template <int HS> struct TcForward {
    static constexpr int mt = HS == 64 ? 2 : 1;
    static constexpr int rows = 4 * 16 * mt;
};

// Forward: a block owns TcForward::rows queries, streams the keys up to the diagonal in tiles
// with an online softmax (scores in base 2: exp2 is the hardware's exponential).
//
// Shared memory: [K0 | V0 | K1 | V1], TcShape::stream rows each; the Q tile is first staged
// from K1 on, which the pipeline fills only after Q is in registers.
template <class Ops, int HS>
__device__ __forceinline__ void tc_forward(const typename Ops::elem* __restrict__ qkv,
                                           typename Ops::elem* __restrict__ out,
                                           float* __restrict__ lse, int T, int C, int NH, int W) {
#if __CUDA_ARCH__ >= 800
    typedef TcShape<HS> S;
    constexpr int KC = S::stream, MT = TcForward<HS>::mt, ROWS = TcForward<HS>::rows;
    static_assert(ROWS <= 2 * KC, "the Q tile is staged in two key tiles");
    extern __shared__ __align__(16) unsigned short tc_smem[];
    tc_need_shared(S::forward_bytes);
    // Buffer i (one computed on, one being filled) is K at tc_smem + 2i tiles, V after it.
    auto ks = [&](int i) { return tc_smem + 2 * i * S::tile; };
    auto vs = [&](int i) { return tc_smem + (2 * i + 1) * S::tile; };
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    // Under the causal mask the last query tiles see the most keys: start those first.
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const size_t stride = 3 * (size_t)C;
    const typename Ops::elem* base = qkv + (size_t)b * T * stride + h * HS;
    const int q0 = qt * ROWS;
    const int warp_row0 = q0 + warp * 16 * MT;
    // This lane's rows: row0 + 16 mt + 8 r.
    const int row0 = warp_row0 + (lane >> 2);
    const float c = tc_scale<HS>() * TC_LOG2E;
    const int kt0 = tc_first_key_tile(q0, W, KC);
    // The last key tile: the block's last query's, or the one holding key T - 1.
    const int kt_last = min(q0 + ROWS - 1, T - 1) / KC;

    tc_tile_copy<HS, ROWS>(ks(1), base, stride, q0, T);
    tc_commit();
    tc_tile_copy<HS, KC>(ks(0), base + C, stride, kt0 * KC, T);
    tc_tile_copy<HS, KC>(vs(0), base + 2 * C, stride, kt0 * KC, T);
    tc_commit();
    tc_wait<1>();
    __syncthreads();
    TcRowsInRegisters<Ops, HS, MT> qf;
    qf.load(ks(1), warp * 16 * MT);
    __syncthreads();  // the second buffers are free for the pipeline

    float p_scale[MT][2];
    float o[MT][HS / 8][4] = {}, m[MT][2], l[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            p_scale[mt][r] = Ops::p_scale();
            m[mt][r] = KILN_NEG_INF;
            l[mt][r] = 0.0f;
        }
    }
    for (int kt = kt0; kt <= kt_last; kt++) {
        const int k0 = kt * KC, buf = (kt - kt0) & 1;
        if (kt < kt_last) {
            tc_tile_copy<HS, KC>(ks(buf ^ 1), base + C, stride, k0 + KC, T);
            tc_tile_copy<HS, KC>(vs(buf ^ 1), base + 2 * C, stride, k0 + KC, T);
            tc_commit();
            tc_wait<1>();
        } else {
            tc_wait<0>();
        }
        __syncthreads();  // tile kt is in shared memory for every thread
        if (tc_any_sees(warp_row0, warp_row0 + 16 * MT - 1, k0, k0 + KC - 1, W)) {
            float s[MT][KC / 8][4] = {};
            qf.template mma_tile_t<KC>(s, ks(buf));
            // Scores stay unscaled until the exponential: c > 0, so the largest raw score
            // times c is the largest scaled one, and s * c - m is one fused multiply-add.
            tc_masked_or_not(tc_all_see(warp_row0, warp_row0 + 16 * MT - 1, k0, k0 + KC - 1, W, T), [&](bool masked) {
                if (masked) {
                    #pragma unroll
                    for (int mt = 0; mt < MT; mt++) tc_mask_tile<KC>(s[mt], k0, row0 + 16 * mt, t, W);
                }
                #pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    #pragma unroll
                    for (int r = 0; r < 2; r++) {
                        float m_sub;
                        const float m_new = tc_tile_max<KC>(s[mt], r, m[mt][r], c, m_sub);
                        const float corr = tc_exp2(m[mt][r] - m_sub);
                        l[mt][r] *= corr;  // a per-lane partial sum until the end
                        #pragma unroll
                        for (int n = 0; n < KC / 8; n++) {
                            #pragma unroll
                            for (int e = 2 * r; e < 2 * r + 2; e++) {
                                s[mt][n][e] = tc_exp2(fmaf(s[mt][n][e], c, -m_sub));
                                l[mt][r] += s[mt][n][e];
                            }
                        }
                        #pragma unroll
                        for (int n = 0; n < HS / 8; n++) {
                            o[mt][n][2 * r] *= corr;
                            o[mt][n][2 * r + 1] *= corr;
                        }
                        m[mt][r] = m_new;
                    }
                }
            });
            tc_mma_x_tile<Ops, HS, KC, MT>(o, s, vs(buf), p_scale);
        }
        __syncthreads();  // buffer `buf` is no longer read: the next iteration refills it
    }
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = row0 + 16 * mt + 8 * r;
            const float sum = tc_row_sum(l[mt][r]);
            if (row >= T) continue;
            const float inv = 1.0f / (sum * Ops::p_scale());
            unsigned* dst = reinterpret_cast<unsigned*>(out + ((size_t)b * T + row) * C + h * HS + 2 * t);
            #pragma unroll
            for (int n = 0; n < HS / 8; n++) dst[n * 4] = Ops::pack(o[mt][n][2 * r] * inv, o[mt][n][2 * r + 1] * inv);
            // Natural log-sum-exp of the scaled scores: m is in base-2 units.
            if (t == 0) lse[((size_t)b * NH + h) * T + row] = m[mt][r] * 0.6931471805599453f + logf(sum);
        }
    }
#endif
}

// The row term's last step, shared by the tensor-core kernels: lane L holds its half of row
// L / 2 of the warp's 16 (`sum`); adds the two halves and hands each lane the terms of its
// accumulator rows g and g + 8 (lane 4 g + t), in rowd.
__device__ __forceinline__ void tc_row_term_to_rows(float sum, float rowd[2]) {
    const int g = (threadIdx.x & 31) >> 2;
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    rowd[0] = __shfl_sync(0xffffffffu, sum, 2 * g);
    rowd[1] = __shfl_sync(0xffffffffu, sum, 2 * g + 16);
}

// d_i = dO_i . O_i for this warp's 16 rows from global memory (rows at or past T give 0): lane
// L reads half of row L / 2 in 16-byte pieces V (uint4 or float4), its neighbour the other
// half; dot(sum, o, g) adds one piece's products into the lane's sum in order. Returned for
// the lane's accumulator rows, row0 and row0 + 8, in rowd. Shared by the tensor-core
// programs, which differ only in how a piece's products are formed.
template <class V, int HS, class E, class Dot>
__device__ __forceinline__ void tc_row_term_pieces(const E* __restrict__ out, const E* __restrict__ dout,
                                                   size_t first, int warp_row0, int T, int C, float rowd[2],
                                                   Dot dot) {
    const int lane = threadIdx.x & 31, row = warp_row0 + (lane >> 1);
    float sum = 0.0f;
    if (row < T) {
        const size_t at = first + (size_t)row * C + (lane & 1) * (HS / 2);
        const V* o = reinterpret_cast<const V*>(out + at);
        const V* g = reinterpret_cast<const V*>(dout + at);
        #pragma unroll
        for (int i = 0; i < HS / 2 * (int)sizeof(E) / 16; i++) dot(sum, o[i], g[i]);
    }
    tc_row_term_to_rows(sum, rowd);
}

// The row term of 16-bit activations: each 32-bit word holds two values.
template <class Ops, int HS>
__device__ __forceinline__ void tc_row_term(const typename Ops::elem* __restrict__ out,
                                            const typename Ops::elem* __restrict__ dout,
                                            size_t first, int warp_row0, int T, int C, float rowd[2]) {
    tc_row_term_pieces<uint4, HS>(out, dout, first, warp_row0, T, C, rowd, [](float& sum, uint4 ov, uint4 gv) {
        const unsigned ow[4] = {ov.x, ov.y, ov.z, ov.w}, gw[4] = {gv.x, gv.y, gv.z, gv.w};
        #pragma unroll
        for (int j = 0; j < 4; j++)
            sum += Ops::low(ow[j]) * Ops::low(gw[j]) + Ops::high(ow[j]) * Ops::high(gw[j]);
    });
}

// dQ and the row term d: a block owns 64 queries; d_i = dO_i . O_i comes from the stored
// output, then the keys stream once, accumulating dQ += dS K with dS = P (dP - d).
// Shared memory: TcShape::dq_bytes.
template <class Ops, int HS>
__device__ __forceinline__ void tc_backward_dq(const typename Ops::elem* __restrict__ qkv,
                                               const typename Ops::elem* __restrict__ out,
                                               const typename Ops::elem* __restrict__ dout,
                                               const float* __restrict__ lse, float* __restrict__ d,
                                               typename Ops::elem* __restrict__ dqkv, int T, int C,
                                               int NH, int W) {
#if __CUDA_ARCH__ >= 800
    typedef TcShape<HS> S;
    constexpr int KC = S::stream;
    extern __shared__ __align__(16) unsigned short tc_smem[];
    tc_need_shared(S::dq_bytes);
    auto ks = [&](int i) { return tc_smem + 2 * i * S::tile; };  // as in the forward
    auto vs = [&](int i) { return tc_smem + (2 * i + 1) * S::tile; };
    unsigned short* q_stage = tc_smem + 2 * S::tile;
    unsigned short* g_stage = q_stage + TC_ROWS * S::ld;
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int qt = gridDim.x - 1 - blockIdx.x;  // most keys first, as in the forward
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const size_t stride = 3 * (size_t)C;
    const typename Ops::elem* base = qkv + (size_t)b * T * stride + h * HS;
    const int q0 = qt * TC_ROWS;
    const int warp_row0 = q0 + warp * 16;
    const int row0 = warp_row0 + (lane >> 2);
    const float c = tc_scale<HS>() * TC_LOG2E;
    const size_t lse_row = ((size_t)b * NH + h) * T;
    const int kt0 = tc_first_key_tile(q0, W, KC);
    const int kt_last = min(q0 + TC_ROWS - 1, T - 1) / KC;

    // Q and dO rows reach registers through the staging tiles, while the first K/V tile loads.
    tc_tile_copy<HS, TC_ROWS>(q_stage, base, stride, q0, T);
    tc_tile_copy<HS, TC_ROWS>(g_stage, dout + (size_t)b * T * C + h * HS, C, q0, T);
    tc_commit();
    tc_tile_copy<HS, KC>(ks(0), base + C, stride, kt0 * KC, T);
    tc_tile_copy<HS, KC>(vs(0), base + 2 * C, stride, kt0 * KC, T);
    tc_commit();
    float rowd[2];
    tc_row_term<Ops, HS>(out, dout, (size_t)b * T * C + h * HS, warp_row0, T, C, rowd);
    tc_wait<1>();
    __syncthreads();
    TcRowsInRegisters<Ops, HS> qf, gf;
    qf.load(q_stage, warp * 16);
    gf.load(g_stage, warp * 16);
    __syncthreads();  // the second buffers are free for the pipeline
    float lse2[2];
    #pragma unroll
    for (int r = 0; r < 2; r++) lse2[r] = row0 + 8 * r < T ? lse[lse_row + row0 + 8 * r] * TC_LOG2E : 0.0f;

    float dq[HS / 8][4] = {};
    float ds_scale[2] = {1.0f, 1.0f};
    if (Ops::scaled) ds_scale[0] = ds_scale[1] = tc_ds_scale_start();
    for (int kt = kt0; kt <= kt_last; kt++) {
        const int k0 = kt * KC, buf = (kt - kt0) & 1;
        if (kt < kt_last) {
            tc_tile_copy<HS, KC>(ks(buf ^ 1), base + C, stride, k0 + KC, T);
            tc_tile_copy<HS, KC>(vs(buf ^ 1), base + 2 * C, stride, k0 + KC, T);
            tc_commit();
            tc_wait<1>();
        } else {
            tc_wait<0>();
        }
        __syncthreads();
        if (tc_any_sees(warp_row0, warp_row0 + 15, k0, k0 + KC - 1, W)) {
            float s[KC / 8][4] = {}, dp[KC / 8][4] = {};
            qf.template mma_tile_t<KC>(&s, ks(buf));
            gf.template mma_tile_t<KC>(&dp, vs(buf));
            tc_masked_or_not(tc_all_see(warp_row0, warp_row0 + 15, k0, k0 + KC - 1, W, T), [&](bool masked) {
                tc_dq_p_ds<KC>(s, dp, k0, row0, t, c, lse2, rowd, W, masked);
            });
            tc_fit_ds_scales<Ops, HS, KC>(dq, dp, ds_scale);
            tc_mma_x_tile<Ops, HS, KC>(&dq, &dp, ks(buf), &ds_scale);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        if (row >= T) continue;
        const float k = tc_scale<HS>() / ds_scale[r];  // a power of two at head size 64
        unsigned* dst = reinterpret_cast<unsigned*>(dqkv + ((size_t)b * T + row) * stride + h * HS + 2 * t);
        #pragma unroll
        for (int n = 0; n < HS / 8; n++) dst[n * 4] = Ops::pack(dq[n][2 * r] * k, dq[n][2 * r + 1] * k);
        if (t == 0) d[lse_row + row] = rowd[r];
    }
#endif
}

// Selects between two types at compile time (NVRTC has no <type_traits> without headers).
template <bool First, class A, class B> struct TcPick { typedef A type; };
template <class A, class B> struct TcPick<false, A, B> { typedef B type; };

// dK and dV: a block owns 64 keys (a warp 16) and streams the queries from the diagonal on.
// The warp computes S^T = K Q^T and dP^T = V dO^T, so each key's P and dS sit in its own
// accumulator rows: dV += P^T dO and dK += dS^T Q need no exchange between warps.
// Shared memory: TcShape::dkv_bytes.
template <class Ops, int HS>
__device__ __forceinline__ void tc_backward_dkv(const typename Ops::elem* __restrict__ qkv,
                                                const typename Ops::elem* __restrict__ dout,
                                                const float* __restrict__ lse,
                                                const float* __restrict__ d,
                                                typename Ops::elem* __restrict__ dqkv, int T, int C,
                                                int NH, int W) {
#if __CUDA_ARCH__ >= 800
    typedef TcShape<HS> S;
    constexpr int QC = S::stream;
    constexpr bool kv_in_registers = HS == 64;
    static_assert(!kv_in_registers || TC_ROWS <= QC, "K and V are staged in one query tile each");
    typedef typename TcPick<kv_in_registers, TcRowsInRegisters<Ops, HS>, TcRowsInShared<Ops, HS>>::type Rows;
    extern __shared__ __align__(16) unsigned short tc_smem[];
    tc_need_shared(S::dkv_bytes);
    // Buffer i is Q at tc_smem + 2i tiles, dO after it; its rows' lse and d in f32 after all.
    auto qs = [&](int i) { return tc_smem + 2 * i * S::tile; };
    auto gs = [&](int i) { return tc_smem + (2 * i + 1) * S::tile; };
    float* const lse_d = reinterpret_cast<float*>(tc_smem + S::dkv_elems);
    auto lses = [&](int i) { return lse_d + i * QC; };
    auto ds = [&](int i) { return lse_d + (2 + i) * QC; };
    unsigned short* k_tile = kv_in_registers ? qs(1) : tc_smem + 4 * S::tile;
    unsigned short* v_tile = kv_in_registers ? gs(1) : k_tile + TC_ROWS * S::ld;
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int kt = blockIdx.x;  // the first key tiles see the most queries and start first
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const size_t stride = 3 * (size_t)C;
    const typename Ops::elem* base = qkv + (size_t)b * T * stride + h * HS;
    const typename Ops::elem* gbase = dout + (size_t)b * T * C + h * HS;
    const int k0 = kt * TC_ROWS;
    const int warp_key0 = k0 + warp * 16;
    const int key0 = warp_key0 + (lane >> 2);  // this lane's keys: key0 and key0 + 8
    const float c = tc_scale<HS>() * TC_LOG2E;
    const size_t lse_row = ((size_t)b * NH + h) * T;

    // Starts copying query tile qt (Q, dO, and its rows' lse and d) into buffer `buf`.
    auto copy_query_tile = [&](int qt, int buf) {
        const int q0 = qt * QC;
        tc_tile_copy<HS, QC>(qs(buf), base, stride, q0, T);
        tc_tile_copy<HS, QC>(gs(buf), gbase, C, q0, T);
        for (int i = threadIdx.x; i < QC; i += blockDim.x) {
            const bool in = q0 + i < T;
            const size_t at = lse_row + (in ? q0 + i : 0);
            tc_copy_async4(&lses(buf)[i], lse + at, in);
            tc_copy_async4(&ds(buf)[i], d + at, in);
        }
        tc_commit();
    };

    // The block's K and V rows (through Q1 and dO1 into registers at head size 64) load while
    // the first query tile does.
    const int qt0 = k0 / QC;  // the tile holding query k0, the first that sees key k0
    tc_tile_copy<HS, TC_ROWS>(k_tile, base + C, stride, k0, T);
    tc_tile_copy<HS, TC_ROWS>(v_tile, base + 2 * C, stride, k0, T);
    tc_commit();
    copy_query_tile(qt0, 0);
    tc_wait<1>();
    __syncthreads();
    Rows kf, vf;
    kf.load(k_tile, warp * 16);
    vf.load(v_tile, warp * 16);
    if (kv_in_registers) __syncthreads();  // the second buffers are free for the pipeline

    float p_scale[2] = {Ops::p_scale(), Ops::p_scale()};
    float dk[HS / 8][4] = {}, dv[HS / 8][4] = {};
    float ds_scale[2] = {1.0f, 1.0f};
    if (Ops::scaled) ds_scale[0] = ds_scale[1] = tc_ds_scale_start();
    // Query tiles up to the one holding the last query that sees the block's last key.
    const int all_tiles = (T + QC - 1) / QC;
    const int tiles = W > 0 ? min(all_tiles, (k0 + TC_ROWS - 1 + W - 1) / QC + 1) : all_tiles;
    for (int qt = qt0; qt < tiles; qt++) {
        const int q0 = qt * QC, buf = (qt - qt0) & 1;
        if (qt + 1 < tiles) {
            copy_query_tile(qt + 1, buf ^ 1);
            tc_wait<1>();
        } else {
            tc_wait<0>();
        }
        __syncthreads();
        if (tc_any_sees(q0, q0 + QC - 1, warp_key0, warp_key0 + 15, W)) {
            float s[QC / 8][4] = {}, dp[QC / 8][4] = {};
            kf.template mma_tile_t<QC>(&s, qs(buf));
            vf.template mma_tile_t<QC>(&dp, gs(buf));
            tc_masked_or_not(tc_all_see(q0, q0 + QC - 1, warp_key0, warp_key0 + 15, W, T), [&](bool masked) {
                tc_dkv_p_ds<QC>(s, dp, q0, key0, t, c, lses(buf), ds(buf), 1, W, T, masked);
            });
            tc_mma_x_tile<Ops, HS, QC>(&dv, &s, gs(buf), &p_scale);
            tc_fit_ds_scales<Ops, HS, QC>(dk, dp, ds_scale);
            tc_mma_x_tile<Ops, HS, QC>(&dk, &dp, qs(buf), &ds_scale);
        }
        __syncthreads();
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const int key = key0 + 8 * r;
        if (key >= T) continue;
        const float kk = tc_scale<HS>() / ds_scale[r], kv = 1.0f / Ops::p_scale();
        typename Ops::elem* row = dqkv + ((size_t)b * T + key) * stride + h * HS + 2 * t;
        unsigned* dst_k = reinterpret_cast<unsigned*>(row + C);
        unsigned* dst_v = reinterpret_cast<unsigned*>(row + 2 * C);
        #pragma unroll
        for (int n = 0; n < HS / 8; n++) {
            dst_k[n * 4] = Ops::pack(dk[n][2 * r] * kk, dk[n][2 * r + 1] * kk);
            dst_v[n * 4] = Ops::pack(dv[n][2 * r] * kv, dv[n][2 * r + 1] * kv);
        }
    }
#endif
}

// Entry points, one per element type and head size; attention.rs appends the instantiations.
#define TC_ENTRY_POINTS(HS, OPS, SUFFIX)                                                                   \
    extern "C" __global__ void __launch_bounds__(128) attention_forward_##SUFFIX##_hs##HS##_tc(            \
        const OPS::elem* qkv, OPS::elem* out, float* lse, int T, int C, int NH, int W) {                   \
        tc_forward<OPS, HS>(qkv, out, lse, T, C, NH, W);                                                   \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) attention_backward_dq_##SUFFIX##_hs##HS##_tc(        \
        const OPS::elem* qkv, const OPS::elem* out, const OPS::elem* dout, const float* lse, float* d,     \
        OPS::elem* dqkv, int T, int C, int NH, int W) {                                                    \
        tc_backward_dq<OPS, HS>(qkv, out, dout, lse, d, dqkv, T, C, NH, W);                                \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) attention_backward_dkv_##SUFFIX##_hs##HS##_tc(       \
        const OPS::elem* qkv, const OPS::elem* dout, const float* lse, const float* d, OPS::elem* dqkv,    \
        int T, int C, int NH, int W) {                                                                     \
        tc_backward_dkv<OPS, HS>(qkv, dout, lse, d, dqkv, T, C, NH, W);                                    \
    }
