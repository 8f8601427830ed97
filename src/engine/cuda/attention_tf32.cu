// Tensor-core kernels for f32 activations (the tf32 and fp32 precision policies): head size 64
// or 128, sm_80 and newer (`mma.sync.m16n8k8` on tf32 operands, f32 accumulators).
//
// The same three kernels and schedule as attention_tc.cu (whose helpers this program shares:
// copies, masks, row reductions, exp2): a block owns 64 rows, each of its 4 warps 16; the
// other side streams through two shared-memory buffers filled by cp.async. Tiles hold f32; the
// forward streams 64 rows at head size 64 and 32 at 128, as there, the backward half as many
// (TfShape).
//
// Two kinds of product, chosen per entry point:
// - tf32 (`X3` false): each operand rounded once to tf32 (10 explicit mantissa bits, round to
//   nearest), the precision of the tf32 policy's GEMMs;
// - 3xtf32 (`X3` true): each operand split into hi (x truncated to tf32) and lo (x - hi
//   rounded to tf32), and a b = lo_a hi_b + hi_a lo_b + hi_a hi_b (the dropped lo_a lo_b and
//   lo's rounding stay within 2^-20 of a b): close to f32's accuracy at three times the
//   tensor-core work, which is still several times the speed of f32 on the CUDA cores.
//   PyTorch's memory-efficient attention computes f32 inputs this way on sm_80+ (CUTLASS's
//   "fast f32" operator), so the fp32 policy uses it.
// Probabilities P and score gradients dS enter their second product the same way: f32 has the
// exponent range, so nothing is scaled (attention_tc.cu's f16 scaling does not apply).
//
// Fragment layouts (PTX ISA, m16n8k8 .tf32): lane = 4 g + t. A (16 x 8) is a[4]: a[0] row g,
// column t; a[1] row g + 8, column t; a[2] row g, column t + 4; a[3] row g + 8, column t + 4.
// B (8 x 8) is b[2]: b[0] row t, b[1] row t + 4, both column g. The accumulator (16 x 8) is
// c[4]: c[0], c[1] row g, columns 2t, 2t + 1; c[2], c[3] the same in row g + 8.
// An accumulator does not have the A layout (its lane holds columns 2t and 2t + 1, where A
// wants t and t + 4), but a product sums over its k index in any order: a score tile used as
// A takes its columns 2t and 2t + 1 as k = t and t + 4, and the B operand reads the matching
// rows 2t and 2t + 1 of the other tile. No shuffles.
//
// Tile rows have a pitch of HS + 4 floats: the ldmatrix reads of the K side (8 rows of 16
// bytes) and the B reads of P V (lanes reading rows 2t, columns g) then fall in 32 distinct
// banks.
//
// Every sum is in a fixed order (no atomics), so results are deterministic.

#define TF_ROWS 64  // rows (queries or keys) a block owns: 4 warps of 16

// Rows of the streamed tiles and the shared memory layouts (attention.rs's byte counts follow).
// The backward streams shorter tiles than the forward (32 rows at head size 64, 16 at 128):
// its warps hold two score tiles (S and dP) beside two f32 operands and an accumulator, and
// longer tiles spill registers (checked with ptxas for sm_80 and sm_90).
template <int HS> struct TfShape {
    static constexpr int stream = HS == 64 ? 64 : 32;
    static constexpr int back = HS == 64 ? 32 : 16;
    static constexpr int ld = HS + 4;  // tile row pitch in floats
    // Forward: [K0 | V0 | K1 | V1]; the block's queries go to registers from global memory.
    static constexpr int forward_bytes = 4 * stream * ld * 4;
    // dQ: the same with the backward's tiles.
    static constexpr int dq_bytes = 4 * back * ld * 4;
    // dK/dV: [Q0 | dO0 | Q1 | dO1], each query row's lse in its Q row's first padding float
    // and its d in its dO row's, then at head size 128 the block's K and V (64 rows each, read
    // per product: their registers go to the two accumulators): 99 KiB there, what sm_86 and
    // sm_89 allow a block.
    static constexpr int dkv_bytes = (4 * back * ld + (HS == 64 ? 0 : 2 * TF_ROWS * ld)) * 4;
};

// The product of one k-chunk: acc (16 x 8) += a (16 x 8) b (8 x 8), operands given as f32
// and rounded (tf32) or split (3xtf32) here.
template <bool X3> struct TfOperand {
    unsigned hi[4], lo[4];
    __device__ __forceinline__ void set(const float a[4]) {
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            if (X3) {
                split(a[i], hi[i], lo[i]);
            } else {
                hi[i] = tf_round(a[i]);
            }
        }
    }
    // 3xtf32's halves as CUTLASS's fast-f32 operator (PyTorch's f32 SDPA) makes them: hi is x
    // with the 13 bits cleared that the tensor core ignores, lo = x - hi exactly (at most 2^-10
    // of x), and lo's bits get half a tf32 ulp added so that the tensor core's truncation
    // rounds it to nearest (an error of at most 2^-21 of x). A NaN or infinite x keeps a NaN
    // or infinite hi. Three integer and f32 instructions where two tf32 conversions made the
    // 3xtf32 kernels a third slower: forward + backward 5161.7 -> 3417.5 us at head size 128
    // (B 8, T 1024, one H100). `volatile` as tf_round, for the same reason.
    static __device__ __forceinline__ void split(float x, unsigned& h, unsigned& l) {
        asm volatile("and.b32 %0, %1, 0xffffe000;" : "=r"(h) : "r"(__float_as_uint(x)));
        const float rest = x - __uint_as_float(h);
        asm volatile("add.u32 %0, %1, 0x1000;" : "=r"(l) : "r"(__float_as_uint(rest)));
    }
    // `volatile`: the rounding happens where it is written. Otherwise the compiler hoists the
    // loop-invariant roundings of a warp's own rows out of the key loop and keeps them (and, for
    // 3xtf32, their low halves) live beside the raw rows, which spills.
    static __device__ __forceinline__ unsigned tf_round(float x) {
        unsigned r;
        asm volatile("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
        return r;
    }
    static __device__ __forceinline__ void mma1(float acc[4], const unsigned a[4], unsigned b0, unsigned b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
            "{%8, %9}, {%0, %1, %2, %3};"
            : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // acc += this * (b0, b1): the small terms first, so that they are not lost under the big
    // one's rounding.
    __device__ __forceinline__ void mma(float acc[4], float b0, float b1) const {
        if (X3) {
            unsigned h0, h1, l0, l1;
            split(b0, h0, l0);
            split(b1, h1, l1);
            mma1(acc, lo, h0, h1);
            mma1(acc, hi, l0, l1);
            mma1(acc, hi, h0, h1);
        } else {
            mma1(acc, hi, tf_round(b0), tf_round(b1));
        }
    }
};

// Starts copying rows r0 .. r0 + ROWS - 1 (HS floats each, `stride` apart) into a padded tile,
// 16 bytes per copy; rows at or past T become zeros.
template <int HS, int ROWS>
__device__ __forceinline__ void tf_tile_copy(float* tile, const float* src, size_t stride, int r0, int T) {
    constexpr int chunks = HS / 4;
    for (int i = threadIdx.x; i < ROWS * chunks; i += blockDim.x) {
        const int r = i / chunks, c = (i % chunks) * 4;
        const bool in = r0 + r < T;
        copy_async16(tile + r * TfShape<HS>::ld + c, src + (size_t)(in ? r0 + r : 0) * stride + c, in);
    }
}

// The key tiles the forward and dQ blocks stream: KC keys of K and of V in each of two buffers,
// [K0 | V0 | K1 | V1], one computed on while the next is copied in.
template <int HS, int KC> struct TfKeyTiles {
    float* smem;
    const float* base;  // the batch and head's first Q element: K is C floats on, V 2C
    size_t stride;
    int C, T;
    __device__ __forceinline__ float* k(int buf) const { return smem + 2 * buf * KC * TfShape<HS>::ld; }
    __device__ __forceinline__ float* v(int buf) const { return smem + (2 * buf + 1) * KC * TfShape<HS>::ld; }
    // Starts copying key tile kt into buffer `buf`.
    __device__ __forceinline__ void start(int kt, int buf) const {
        tf_tile_copy<HS, KC>(k(buf), base + C, stride, kt * KC, T);
        tf_tile_copy<HS, KC>(v(buf), base + 2 * C, stride, kt * KC, T);
        tc_commit();
    }
    // Makes tile kt (in buffer `buf`) ready for every thread, having started tile kt + 1 in the
    // other buffer unless kt is the last.
    __device__ __forceinline__ void wait(int kt, int kt_last, int buf) const {
        if (kt < kt_last) {
            start(kt + 1, buf ^ 1);
            tc_wait<1>();
        } else {
            tc_wait<0>();
        }
        __syncthreads();
    }
};

// A warp's 16 rows x HS as the A operand of its products, in f32 (rounded or split per use).
// In registers, loaded once from global memory (rows at or past T are zeros)...
template <int HS> struct TfRowsInRegisters {
    float a[HS / 8][4];
    __device__ __forceinline__ void load(const float* src, size_t stride, int r0, int T) {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        #pragma unroll
        for (int k = 0; k < HS / 8; k++) {
            #pragma unroll
            for (int i = 0; i < 4; i++) {
                const int row = r0 + g + 8 * (i & 1), col = 8 * k + t + 4 * (i >> 1);
                a[k][i] = row < T ? src[(size_t)row * stride + col] : 0.0f;
            }
        }
    }
    __device__ __forceinline__ void chunk(int k, float out[4]) const {
        #pragma unroll
        for (int i = 0; i < 4; i++) out[i] = a[k][i];
    }
};

// ... or left in a shared tile (its first row at `tile`) and read per product, where the
// accumulators need the registers (dK/dV at head size 128). One ldmatrix reads the chunk: on
// 32-bit data, an 8 x 8 matrix of 16-bit pairs is 8 rows x 4 floats and lane 4 g + t receives
// float (g, t) of it, so the four matrices (rows 0-7 and 8-15, columns 0-3 and 4-7 of the
// chunk) are a[0] to a[3].
template <int HS> struct TfRowsInShared {
    const float* tile;
    __device__ __forceinline__ void chunk(int k, float out[4]) const {
        const int lane = threadIdx.x & 31;
        unsigned r[4];
        tc_ldsm(r, tc_smem_addr(tile + ((lane & 7) + 8 * ((lane >> 3) & 1)) * TfShape<HS>::ld + 8 * k +
                                4 * (lane >> 4)));
        #pragma unroll
        for (int i = 0; i < 4; i++) out[i] = __uint_as_float(r[i]);
    }
};

// acc (16 x N) += rows (16 x HS) * tile^T, the tile's first N rows being the output columns
// (S = Q K^T with the K tile, dP = dO V^T with the V tile; S^T = K Q^T in dK/dV). One
// ldmatrix reads the B operands of two k-chunks for 8 output columns (lane 4 g + t gets the
// tile's row g, columns t and t + 4 of each chunk); each accumulator still sums its chunks in
// order.
template <int HS, int N, bool X3, class Rows>
__device__ __forceinline__ void tf_mma_rows_tile_t(float acc[N / 8][4], const Rows& rows, const float* tile) {
    const int lane = threadIdx.x & 31;
    const float* lane_row = tile + (lane & 7) * TfShape<HS>::ld + 4 * (lane >> 3);
    #pragma unroll
    for (int k = 0; k < HS / 8; k += 2) {
        TfOperand<X3> a[2];
        #pragma unroll
        for (int i = 0; i < 2; i++) {
            float x[4];
            rows.chunk(k + i, x);
            a[i].set(x);
        }
        #pragma unroll
        for (int n = 0; n < N / 8; n++) {
            unsigned b[4];
            tc_ldsm(b, tc_smem_addr(lane_row + n * 8 * TfShape<HS>::ld + 8 * k));
            a[0].mma(acc[n], __uint_as_float(b[0]), __uint_as_float(b[1]));
            a[1].mma(acc[n], __uint_as_float(b[2]), __uint_as_float(b[3]));
        }
    }
}

// acc (16 x HS) += x (16 x K, f32 in the accumulator layout) * tile (K rows x HS): O += P V,
// dQ += dS K, dV += P^T dO, dK += dS^T Q. x's columns 2t and 2t + 1 of chunk j are the
// product's k = t and t + 4, so B reads the tile's rows 8j + 2t and 8j + 2t + 1.
template <int HS, int K, bool X3>
__device__ __forceinline__ void tf_mma_x_tile(float acc[HS / 8][4], const float x[K / 8][4], const float* tile) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    #pragma unroll
    for (int j = 0; j < K / 8; j++) {
        const float v[4] = {x[j][0], x[j][2], x[j][1], x[j][3]};
        TfOperand<X3> a;
        a.set(v);
        const float* b = tile + (8 * j + 2 * t) * TfShape<HS>::ld + g;
        #pragma unroll
        for (int n = 0; n < HS / 8; n++) a.mma(acc[n], b[8 * n], b[8 * n + TfShape<HS>::ld]);
    }
}

// Forward: a block owns 64 queries, streams the keys up to the diagonal with an online softmax
// (base 2), as tc_forward does. Shared memory: TfShape::forward_bytes.
template <int HS, bool X3>
__device__ __forceinline__ void tf_forward(const float* __restrict__ qkv, float* __restrict__ out,
                                           float* __restrict__ lse, int T, int C, int NH, int W) {
#if __CUDA_ARCH__ >= 800
    typedef TfShape<HS> S;
    constexpr int KC = S::stream;
    extern __shared__ __align__(16) float tf_smem[];
    tc_need_shared(S::forward_bytes);
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int qt = gridDim.x - 1 - blockIdx.x;  // the most keys first
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const size_t stride = 3 * (size_t)C;
    const float* base = qkv + (size_t)b * T * stride + h * HS;
    const int q0 = qt * TF_ROWS;
    const int warp_row0 = q0 + warp * 16;
    const int row0 = warp_row0 + (lane >> 2);  // this lane's rows: row0 and row0 + 8
    const float c = tc_scale<HS>() * TC_LOG2E;
    const int kt0 = tc_first_key_tile(q0, W, KC);
    const int kt_last = min(q0 + TF_ROWS - 1, T - 1) / KC;

    const TfKeyTiles<HS, KC> tiles = {tf_smem, base, stride, C, T};
    tiles.start(kt0, 0);
    TfRowsInRegisters<HS> qf;
    qf.load(base, stride, warp_row0, T);

    float o[HS / 8][4] = {}, m[2] = {KILN_NEG_INF, KILN_NEG_INF}, l[2] = {0.0f, 0.0f};
    for (int kt = kt0; kt <= kt_last; kt++) {
        const int k0 = kt * KC, buf = (kt - kt0) & 1;
        tiles.wait(kt, kt_last, buf);
        if (tc_any_sees(warp_row0, warp_row0 + 15, k0, k0 + KC - 1, W)) {
            float s[KC / 8][4] = {};
            tf_mma_rows_tile_t<HS, KC, X3>(s, qf, tiles.k(buf));
            tc_masked_or_not(tc_all_see(warp_row0, warp_row0 + 15, k0, k0 + KC - 1, W, T), [&](bool masked) {
                if (masked) tc_mask_tile<KC>(s, k0, row0, t, W);
                #pragma unroll
                for (int r = 0; r < 2; r++) {
                    float m_sub;
                    const float m_new = tc_tile_max<KC>(s, r, m[r], c, m_sub);
                    const float corr = tc_exp2(m[r] - m_sub);
                    l[r] *= corr;
                    #pragma unroll
                    for (int n = 0; n < KC / 8; n++) {
                        #pragma unroll
                        for (int e = 2 * r; e < 2 * r + 2; e++) {
                            s[n][e] = tc_exp2(fmaf(s[n][e], c, -m_sub));
                            l[r] += s[n][e];
                        }
                    }
                    #pragma unroll
                    for (int n = 0; n < HS / 8; n++) {
                        o[n][2 * r] *= corr;
                        o[n][2 * r + 1] *= corr;
                    }
                    m[r] = m_new;
                }
            });
            tf_mma_x_tile<HS, KC, X3>(o, s, tiles.v(buf));
        }
        __syncthreads();  // buffer `buf` is refilled next
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        const float sum = tc_row_sum(l[r]);
        if (row >= T) continue;
        const float inv = 1.0f / sum;
        float2* dst = reinterpret_cast<float2*>(out + ((size_t)b * T + row) * C + h * HS + 2 * t);
        #pragma unroll
        for (int n = 0; n < HS / 8; n++) dst[n * 4] = make_float2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        if (t == 0) lse[((size_t)b * NH + h) * T + row] = m[r] * 0.6931471805599453f + logf(sum);
    }
#endif
}

// d_i = dO_i . O_i for this warp's 16 rows (rows at or past T give 0), returned for the lane's
// rows row0 and row0 + 8: lane L sums half of row L / 2, its neighbour the other half.
//
// With single tf32 products (`X3` false) dO is rounded to tf32 here as dP = dO V^T rounds it:
// dS = P (dP - d) subtracts two nearly equal terms, and sum_j P_ij dP_ij = tf32(dO_i) . O_i
// (O made from the same rounded V), so the same rounding on both sides leaves dS an error of
// tf32's rounding of the difference. With exact dO in d the difference would carry dO's
// rounding in full: measured 1e-2 to 3e-2 of each head's largest gradient against 1e-3.
template <int HS, bool X3>
__device__ __forceinline__ void tf_row_term(const float* __restrict__ out, const float* __restrict__ dout,
                                            size_t first, int warp_row0, int T, int C, float rowd[2]) {
    tc_row_term_pieces<float4, HS>(out, dout, first, warp_row0, T, C, rowd, [](float& sum, float4 ov, float4 gv) {
        const float gw[4] = {gv.x, gv.y, gv.z, gv.w}, ow[4] = {ov.x, ov.y, ov.z, ov.w};
        #pragma unroll
        for (int j = 0; j < 4; j++) sum += ow[j] * (X3 ? gw[j] : __uint_as_float(TfOperand<false>::tf_round(gw[j])));
    });
}

// dQ and the row term d: a block owns 64 queries; d_i = dO_i . O_i from the stored output, then
// the keys stream once: dQ += dS K with dS = P (dP - d). Shared memory: TfShape::dq_bytes.
template <int HS, bool X3>
__device__ __forceinline__ void tf_backward_dq(const float* __restrict__ qkv, const float* __restrict__ out,
                                               const float* __restrict__ dout, const float* __restrict__ lse,
                                               float* __restrict__ d, float* __restrict__ dqkv, int T, int C,
                                               int NH, int W) {
#if __CUDA_ARCH__ >= 800
    typedef TfShape<HS> S;
    constexpr int KC = S::back;
    extern __shared__ __align__(16) float tf_smem[];
    tc_need_shared(S::dq_bytes);
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const size_t stride = 3 * (size_t)C;
    const float* base = qkv + (size_t)b * T * stride + h * HS;
    const int q0 = qt * TF_ROWS;
    const int warp_row0 = q0 + warp * 16;
    const int row0 = warp_row0 + (lane >> 2);
    const float c = tc_scale<HS>() * TC_LOG2E;
    const size_t lse_row = ((size_t)b * NH + h) * T;
    const int kt0 = tc_first_key_tile(q0, W, KC);
    const int kt_last = min(q0 + TF_ROWS - 1, T - 1) / KC;

    const TfKeyTiles<HS, KC> tiles = {tf_smem, base, stride, C, T};
    tiles.start(kt0, 0);
    float rowd[2];
    tf_row_term<HS, X3>(out, dout, (size_t)b * T * C + h * HS, warp_row0, T, C, rowd);
    TfRowsInRegisters<HS> qf, gf;
    qf.load(base, stride, warp_row0, T);
    gf.load(dout + (size_t)b * T * C + h * HS, C, warp_row0, T);
    float lse2[2];
    #pragma unroll
    for (int r = 0; r < 2; r++) lse2[r] = row0 + 8 * r < T ? lse[lse_row + row0 + 8 * r] * TC_LOG2E : 0.0f;

    float dq[HS / 8][4] = {};
    for (int kt = kt0; kt <= kt_last; kt++) {
        const int k0 = kt * KC, buf = (kt - kt0) & 1;
        tiles.wait(kt, kt_last, buf);
        if (tc_any_sees(warp_row0, warp_row0 + 15, k0, k0 + KC - 1, W)) {
            float s[KC / 8][4] = {}, dp[KC / 8][4] = {};
            tf_mma_rows_tile_t<HS, KC, X3>(s, qf, tiles.k(buf));
            tf_mma_rows_tile_t<HS, KC, X3>(dp, gf, tiles.v(buf));
            tc_masked_or_not(tc_all_see(warp_row0, warp_row0 + 15, k0, k0 + KC - 1, W, T), [&](bool masked) {
                tc_dq_p_ds<KC>(s, dp, k0, row0, t, c, lse2, rowd, W, masked);
            });
            tf_mma_x_tile<HS, KC, X3>(dq, dp, tiles.k(buf));
        }
        __syncthreads();
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        if (row >= T) continue;
        const float k = tc_scale<HS>();
        float2* dst = reinterpret_cast<float2*>(dqkv + ((size_t)b * T + row) * stride + h * HS + 2 * t);
        #pragma unroll
        for (int n = 0; n < HS / 8; n++) dst[n * 4] = make_float2(dq[n][2 * r] * k, dq[n][2 * r + 1] * k);
        if (t == 0) d[lse_row + row] = rowd[r];
    }
#endif
}

// dK and dV: a block owns 64 keys (a warp 16) and streams the queries from the diagonal on,
// computing S^T = K Q^T and dP^T = V dO^T so that each key's P and dS sit in its own
// accumulator rows. Shared memory: TfShape::dkv_bytes.
template <int HS, bool X3>
__device__ __forceinline__ void tf_backward_dkv(const float* __restrict__ qkv, const float* __restrict__ dout,
                                                const float* __restrict__ lse, const float* __restrict__ d,
                                                float* __restrict__ dqkv, int T, int C, int NH, int W) {
#if __CUDA_ARCH__ >= 800
    typedef TfShape<HS> S;
    constexpr int QC = S::back;
    constexpr bool kv_in_registers = HS == 64;
    typedef typename TcPick<kv_in_registers, TfRowsInRegisters<HS>, TfRowsInShared<HS>>::type Rows;
    extern __shared__ __align__(16) float tf_smem[];
    tc_need_shared(S::dkv_bytes);
    constexpr int tile = QC * S::ld;
    auto qs = [&](int i) { return tf_smem + 2 * i * tile; };
    auto gs = [&](int i) { return tf_smem + (2 * i + 1) * tile; };
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int kt = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const size_t stride = 3 * (size_t)C;
    const float* base = qkv + (size_t)b * T * stride + h * HS;
    const float* gbase = dout + (size_t)b * T * C + h * HS;
    const int k0 = kt * TF_ROWS;
    const int warp_key0 = k0 + warp * 16;
    const int key0 = warp_key0 + (lane >> 2);  // this lane's keys: key0 and key0 + 8
    const float c = tc_scale<HS>() * TC_LOG2E;
    const size_t lse_row = ((size_t)b * NH + h) * T;

    auto copy_query_tile = [&](int qt, int buf) {
        const int q0 = qt * QC;
        tf_tile_copy<HS, QC>(qs(buf), base, stride, q0, T);
        tf_tile_copy<HS, QC>(gs(buf), gbase, C, q0, T);
        for (int i = threadIdx.x; i < QC; i += blockDim.x) {
            const bool in = q0 + i < T;
            const size_t at = lse_row + (in ? q0 + i : 0);
            tc_copy_async4(qs(buf) + i * S::ld + HS, lse + at, in);
            tc_copy_async4(gs(buf) + i * S::ld + HS, d + at, in);
        }
        tc_commit();
    };

    const int qt0 = k0 / QC;  // the tile holding query k0, the first that sees key k0
    Rows kf, vf;
    if constexpr (kv_in_registers) {
        copy_query_tile(qt0, 0);
        kf.load(base + C, stride, warp_key0, T);
        vf.load(base + 2 * C, stride, warp_key0, T);
    } else {
        float* k_tile = tf_smem + 4 * tile;
        float* v_tile = k_tile + TF_ROWS * S::ld;
        tf_tile_copy<HS, TF_ROWS>(k_tile, base + C, stride, k0, T);
        tf_tile_copy<HS, TF_ROWS>(v_tile, base + 2 * C, stride, k0, T);
        tc_commit();
        copy_query_tile(qt0, 0);
        kf.tile = k_tile + warp * 16 * S::ld;
        vf.tile = v_tile + warp * 16 * S::ld;
    }

    float dk[HS / 8][4] = {}, dv[HS / 8][4] = {};
    const int all_tiles = (T + QC - 1) / QC;
    const int tiles = W > 0 ? min(all_tiles, (k0 + TF_ROWS - 1 + W - 1) / QC + 1) : all_tiles;
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
            tf_mma_rows_tile_t<HS, QC, X3>(s, kf, qs(buf));
            tf_mma_rows_tile_t<HS, QC, X3>(dp, vf, gs(buf));
            tc_masked_or_not(tc_all_see(q0, q0 + QC - 1, warp_key0, warp_key0 + 15, W, T), [&](bool masked) {
                // Each query's lse and d sit in the padding column of its Q and dO rows.
                tc_dkv_p_ds<QC>(s, dp, q0, key0, t, c, qs(buf) + HS, gs(buf) + HS, S::ld, W, T, masked);
            });
            tf_mma_x_tile<HS, QC, X3>(dv, s, gs(buf));
            tf_mma_x_tile<HS, QC, X3>(dk, dp, qs(buf));
        }
        __syncthreads();
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const int key = key0 + 8 * r;
        if (key >= T) continue;
        const float kk = tc_scale<HS>();
        float* row = dqkv + ((size_t)b * T + key) * stride + h * HS + 2 * t;
        float2* dst_k = reinterpret_cast<float2*>(row + C);
        float2* dst_v = reinterpret_cast<float2*>(row + 2 * C);
        #pragma unroll
        for (int n = 0; n < HS / 8; n++) {
            dst_k[n * 4] = make_float2(dk[n][2 * r] * kk, dk[n][2 * r + 1] * kk);
            dst_v[n * 4] = make_float2(dv[n][2 * r], dv[n][2 * r + 1]);
        }
    }
#endif
}

// Entry points, one per head size and product kind; attention.rs appends the instantiations.
#define TF_ENTRY_POINTS(HS, X3, SUFFIX)                                                                    \
    extern "C" __global__ void __launch_bounds__(128) attention_forward_f32_hs##HS##_##SUFFIX(            \
        const float* qkv, float* out, float* lse, int T, int C, int NH, int W) {                           \
        tf_forward<HS, X3>(qkv, out, lse, T, C, NH, W);                                                    \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) attention_backward_dq_f32_hs##HS##_##SUFFIX(        \
        const float* qkv, const float* out, const float* dout, const float* lse, float* d, float* dqkv,    \
        int T, int C, int NH, int W) {                                                                     \
        tf_backward_dq<HS, X3>(qkv, out, dout, lse, d, dqkv, T, C, NH, W);                                 \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(128) attention_backward_dkv_f32_hs##HS##_##SUFFIX(       \
        const float* qkv, const float* dout, const float* lse, const float* d, float* dqkv, int T, int C,  \
        int NH, int W) {                                                                                   \
        tf_backward_dkv<HS, X3>(qkv, dout, lse, d, dqkv, T, C, NH, W);                                     \
    }
