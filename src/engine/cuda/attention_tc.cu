// Tensor-core kernels: bf16 activations, head size 64, sm_80 and newer (mma.sync on bf16).
//
// The same three kernels as attention.cu's CUDA-core ones (forward; dQ with the exact row term d; dK/dV), but a block
// owns 64 rows and each of its 4 warps owns 16 of them, computing on 64 x 64 tiles with
// `mma.sync.m16n8k16` (bf16 operands, f32 accumulators). Fragments are read from shared memory
// with `ldmatrix`; tiles arrive by `cp.async` into two buffers, so the next tile's copy overlaps
// the current tile's arithmetic. All inline PTX, so NVRTC needs no CUDA headers.
//
// Fragment layouts (PTX ISA, m16n8k16): in a warp, lane = 4 * g + t. An f32 accumulator tile of
// 16 rows x 64 columns is `float acc[8][4]`: acc[n][e] is row g + 8 * (e >> 1), column
// 8 * n + 2 * t + (e & 1). An A operand of 16 rows x 64 (the k dimension) is `unsigned a[4][4]`,
// one bf16 pair per register. An accumulator can be reused as an A operand without shuffles,
// because its layout for columns 16k .. 16k + 15 matches the A layout of k-chunk k.
//
// Probabilities P and score gradients dS are f32 values that feed a second product. Rounding
// them to bf16 would cost 8 bits where the row's result cancels (O near 0, dK near 0), so they
// are split as hi + lo bf16 and multiplied twice: ~16 bits, close to the f32 kernels of attention.cu.
// The products of stored bf16 values (Q K^T, dO V^T) are exact in the f32 accumulators.
//
// Every sum is in a fixed order (no atomics), so results are deterministic.
//
// A sliding window W > 0 limits query i to keys j with i - W < j <= i (W = 0: none): tiles
// wholly outside every window of a block are skipped, and scores outside a row's window are
// masked like those past the diagonal.

#define TC_ROWS 64  // rows (queries or keys) per block, and per shared tile
#define TC_LD 72    // tile row pitch in bf16: 64 + 8, so ldmatrix's 8 row reads hit distinct banks
#define TC_LOG2E 1.4426950408889634f
#define TC_SCALE 0.125f  // 1 / sqrt(64)

__device__ __forceinline__ unsigned tc_smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// Global to shared memory copies run asynchronously (cp.async), so a block loads its next tile
// while it computes on the current one. A copy (16 or 4 bytes) whose source lies past the end
// (`in` false) fills zeros and reads nothing (source size 0; the address stays a valid one).
__device__ __forceinline__ void tc_copy_async(void* dst, const void* src, bool in) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(tc_smem_addr(dst)), "l"(src), "r"(in ? 16 : 0));
}
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

// Starts copying rows r0 .. r0 + 63 (64 bf16 each, `stride` elements apart) into a padded
// tile, 16 bytes per copy; rows at or past T become zeros. Needs 16-byte aligned rows
// (checked by the launcher).
__device__ __forceinline__ void tc_tile_copy(unsigned short* tile, const bf16* src, size_t stride,
                                             int r0, int T) {
    for (int i = threadIdx.x; i < TC_ROWS * 8; i += blockDim.x) {
        const int r = i >> 3, c = (i & 7) * 8;
        const bool in = r0 + r < T;
        tc_copy_async(tile + r * TC_LD + c, src + (size_t)(in ? r0 + r : 0) * stride + c, in);
    }
}

// Two f32 as a bf16 pair (round to nearest even), `lo` in the low half as mma operands expect.
__device__ __forceinline__ unsigned tc_pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// x0, x1 as a bf16 pair `hi` plus the pair of what rounding left over, `lo`.
__device__ __forceinline__ void tc_split(float x0, float x1, unsigned& hi, unsigned& lo) {
    hi = tc_pack(x0, x1);
    lo = tc_pack(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
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

// acc (16 x 8) += a (16 x 16) * b (16 x 8).
__device__ __forceinline__ void tc_mma(float acc[4], const unsigned a[4], unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A operand for tile rows r0 .. r0 + 15 (all 64 columns).
__device__ __forceinline__ void tc_load_a(unsigned a[4][4], const unsigned short* tile, int r0) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int k = 0; k < 4; k++)
        tc_ldsm(a[k], tc_smem_addr(tile + (r0 + (lane & 15)) * TC_LD + k * 16 + (lane >> 4) * 8));
}

// acc (16 x 64) += a (16 x 64) * tile^T: the tile's rows are the 64 output columns (S = Q K^T,
// with the K tile; dP = dO V^T, with the V tile).
__device__ __forceinline__ void tc_mma_a_tile_t(float acc[8][4], const unsigned a[4][4],
                                                const unsigned short* tile) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int n = 0; n < 4; n++) {
        #pragma unroll
        for (int k = 0; k < 4; k++) {
            unsigned b[4];
            tc_ldsm(b, tc_smem_addr(tile + (n * 16 + (lane & 7) + ((lane >> 4) << 3)) * TC_LD +
                                    k * 16 + ((lane >> 3) & 1) * 8));
            tc_mma(acc[2 * n], a[k], b[0], b[1]);
            tc_mma(acc[2 * n + 1], a[k], b[2], b[3]);
        }
    }
}

// acc (16 x 64) += x (16 x 64, f32 in the accumulator layout) * tile, with x split as hi + lo
// bf16 (O += P V, dQ += dS K, dV += P^T dO, dK += dS^T Q).
__device__ __forceinline__ void tc_mma_x_tile(float acc[8][4], const float x[8][4],
                                              const unsigned short* tile) {
    const int lane = threadIdx.x & 31;
    #pragma unroll
    for (int k = 0; k < 4; k++) {
        unsigned hi[4], lo[4];
        tc_split(x[2 * k][0], x[2 * k][1], hi[0], lo[0]);
        tc_split(x[2 * k][2], x[2 * k][3], hi[1], lo[1]);
        tc_split(x[2 * k + 1][0], x[2 * k + 1][1], hi[2], lo[2]);
        tc_split(x[2 * k + 1][2], x[2 * k + 1][3], hi[3], lo[3]);
        #pragma unroll
        for (int n = 0; n < 4; n++) {
            unsigned b[4];
            tc_ldsm_trans(b, tc_smem_addr(tile + (k * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) *
                                                     TC_LD + n * 16 + (lane >> 4) * 8));
            tc_mma(acc[2 * n], hi, b[0], b[1]);
            tc_mma(acc[2 * n], lo, b[0], b[1]);
            tc_mma(acc[2 * n + 1], hi, b[2], b[3]);
            tc_mma(acc[2 * n + 1], lo, b[2], b[3]);
        }
    }
}

// Whether query `query` sees key `key` under the causal mask and the window W (0: none).
__device__ __forceinline__ bool tc_sees(int query, int key, int W) {
    return key <= query && (W == 0 || query - key < W);
}

// The first key tile a block of queries from q0 on reads under the window W.
__device__ __forceinline__ int tc_first_key_tile(int q0, int W) {
    return W > 0 ? max(0, q0 - W + 1) / TC_ROWS : 0;
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

// Forward: a block owns 64 queries, streams the keys up to the diagonal in 64-row tiles with
// an online softmax (scores in base 2: exp2 is the hardware's exponential).
extern "C" __global__ void __launch_bounds__(128) attention_forward_bf16_hs64_tc(
    const bf16* __restrict__ qkv, bf16* __restrict__ out, float* __restrict__ lse, int T, int C,
    int NH, int W) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) unsigned short qs[TC_ROWS * TC_LD];
    __shared__ __align__(16) unsigned short ks[2][TC_ROWS * TC_LD];  // two buffers: one computed
    __shared__ __align__(16) unsigned short vs[2][TC_ROWS * TC_LD];  // on, one being filled
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    // Under the causal mask the last query tiles see the most keys: start those first.
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const size_t stride = 3 * (size_t)C;
    const bf16* base = qkv + (size_t)b * T * stride + h * 64;
    const int q0 = qt * TC_ROWS;
    const int row0 = q0 + warp * 16 + (lane >> 2);  // this lane's rows: row0 and row0 + 8
    const float c = TC_SCALE * TC_LOG2E;
    const int kt0 = tc_first_key_tile(q0, W);

    tc_tile_copy(qs, base, stride, q0, T);
    tc_commit();
    tc_tile_copy(ks[0], base + C, stride, kt0 * TC_ROWS, T);
    tc_tile_copy(vs[0], base + 2 * C, stride, kt0 * TC_ROWS, T);
    tc_commit();
    tc_wait<1>();
    __syncthreads();
    unsigned qf[4][4];
    tc_load_a(qf, qs, warp * 16);

    float o[8][4] = {}, m[2] = {KILN_NEG_INF, KILN_NEG_INF}, l[2] = {0.0f, 0.0f};
    for (int kt = kt0; kt <= qt; kt++) {
        const int k0 = kt * TC_ROWS, buf = (kt - kt0) & 1;
        if (kt < qt) {
            tc_tile_copy(ks[buf ^ 1], base + C, stride, k0 + TC_ROWS, T);
            tc_tile_copy(vs[buf ^ 1], base + 2 * C, stride, k0 + TC_ROWS, T);
            tc_commit();
            tc_wait<1>();
        } else {
            tc_wait<0>();
        }
        __syncthreads();  // tile kt is in shared memory for every thread
        float s[8][4] = {};
        tc_mma_a_tile_t(s, qf, ks[buf]);
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = row0 + 8 * r;
            float mx = KILN_NEG_INF;
            #pragma unroll
            for (int n = 0; n < 8; n++) {
                #pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    // Keys past the row are masked; that includes keys >= T for rows < T.
                    const int key = k0 + n * 8 + 2 * t + (e & 1);
                    const float v = tc_sees(row, key, W) ? s[n][e] * c : KILN_NEG_INF;
                    s[n][e] = v;
                    mx = fmaxf(mx, v);
                }
            }
            // Without a window key k0 <= row is never masked, so the new max is finite; a
            // window can mask a whole tile of a row that has seen no key yet, whose max stays
            // -inf: it then subtracts 0, so its masked scores give 0, never NaN.
            const float m_new = fmaxf(m[r], tc_row_max(mx));
            const float m_sub = m_new == KILN_NEG_INF ? 0.0f : m_new;
            const float corr = exp2f(m[r] - m_sub);
            l[r] *= corr;  // a per-lane partial sum until the end
            #pragma unroll
            for (int n = 0; n < 8; n++) {
                o[n][2 * r] *= corr;
                o[n][2 * r + 1] *= corr;
                #pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    s[n][e] = exp2f(s[n][e] - m_sub);
                    l[r] += s[n][e];
                }
            }
            m[r] = m_new;
        }
        tc_mma_x_tile(o, s, vs[buf]);
        __syncthreads();  // buffer `buf` is no longer read: the next iteration refills it
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        const float sum = tc_row_sum(l[r]);
        if (row >= T) continue;
        const float inv = 1.0f / sum;
        unsigned* dst = reinterpret_cast<unsigned*>(out + ((size_t)b * T + row) * C + h * 64 + 2 * t);
        #pragma unroll
        for (int n = 0; n < 8; n++) dst[n * 4] = tc_pack(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        // Natural log-sum-exp of the scaled scores: m is in base-2 units.
        if (t == 0) lse[((size_t)b * NH + h) * T + row] = m[r] * 0.6931471805599453f + logf(sum);
    }
#endif
}

// dQ and the row term d: a block owns 64 queries and streams the keys twice, first summing
// d_i = sum_j P_ij dP_ij exactly in f32, then accumulating dQ += dS K with dS = P (dP - d).
extern "C" __global__ void __launch_bounds__(128) attention_backward_dq_bf16_hs64_tc(
    const bf16* __restrict__ qkv, const bf16* __restrict__ dout, const float* __restrict__ lse,
    float* __restrict__ d, bf16* __restrict__ dqkv, int T, int C, int NH, int W) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) unsigned short ks[2][TC_ROWS * TC_LD];  // double-buffered as in
    __shared__ __align__(16) unsigned short vs[2][TC_ROWS * TC_LD];  // the forward
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int qt = gridDim.x - 1 - blockIdx.x;  // most keys first, as in the forward
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const size_t stride = 3 * (size_t)C;
    const bf16* base = qkv + (size_t)b * T * stride + h * 64;
    const int q0 = qt * TC_ROWS;
    const int row0 = q0 + warp * 16 + (lane >> 2);
    const float c = TC_SCALE * TC_LOG2E;
    const size_t lse_row = ((size_t)b * NH + h) * T;
    const int kt0 = tc_first_key_tile(q0, W);

    // Q and dO rows reach registers through the second buffers, while the first K/V tile loads.
    tc_tile_copy(ks[1], base, stride, q0, T);
    tc_tile_copy(vs[1], dout + (size_t)b * T * C + h * 64, C, q0, T);
    tc_commit();
    tc_tile_copy(ks[0], base + C, stride, kt0 * TC_ROWS, T);
    tc_tile_copy(vs[0], base + 2 * C, stride, kt0 * TC_ROWS, T);
    tc_commit();
    tc_wait<1>();
    __syncthreads();
    unsigned qf[4][4], gf[4][4];
    tc_load_a(qf, ks[1], warp * 16);
    tc_load_a(gf, vs[1], warp * 16);
    __syncthreads();  // the second buffers are free for the pipeline
    float lse2[2], rowd[2] = {0.0f, 0.0f};
    #pragma unroll
    for (int r = 0; r < 2; r++) lse2[r] = row0 + 8 * r < T ? lse[lse_row + row0 + 8 * r] * TC_LOG2E : 0.0f;

    // Two passes over the key tiles kt0 .. qt, as one sequence of 2 n steps so that the copy
    // of the first tile of the second pass overlaps the last of the first.
    const int n_tiles = qt - kt0 + 1;
    float dq[8][4] = {}, dsum[2] = {0.0f, 0.0f};
    for (int step = 0; step < 2 * n_tiles; step++) {
        const int pass = step < n_tiles ? 0 : 1, buf = step & 1;
        const int k0 = (kt0 + step - pass * n_tiles) * TC_ROWS;
        if (step + 1 < 2 * n_tiles) {
            const int next = kt0 + (step + 1 < n_tiles ? step + 1 : step + 1 - n_tiles);
            tc_tile_copy(ks[buf ^ 1], base + C, stride, next * TC_ROWS, T);
            tc_tile_copy(vs[buf ^ 1], base + 2 * C, stride, next * TC_ROWS, T);
            tc_commit();
            tc_wait<1>();
        } else {
            tc_wait<0>();
        }
        __syncthreads();
        if (step == n_tiles) {
            rowd[0] = tc_row_sum(dsum[0]);
            rowd[1] = tc_row_sum(dsum[1]);
        }
        float s[8][4] = {}, dp[8][4] = {};
        tc_mma_a_tile_t(s, qf, ks[buf]);
        tc_mma_a_tile_t(dp, gf, vs[buf]);
        #pragma unroll
        for (int n = 0; n < 8; n++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e >> 1;
                const int key = k0 + n * 8 + 2 * t + (e & 1);
                const float p = tc_sees(row0 + 8 * r, key, W) ? exp2f(s[n][e] * c - lse2[r]) : 0.0f;
                if (pass == 0) dsum[r] += p * dp[n][e];
                else dp[n][e] = p * (dp[n][e] - rowd[r]);
            }
        }
        if (pass == 1) tc_mma_x_tile(dq, dp, ks[buf]);
        __syncthreads();
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        if (row >= T) continue;
        unsigned* dst = reinterpret_cast<unsigned*>(dqkv + ((size_t)b * T + row) * stride + h * 64 + 2 * t);
        #pragma unroll
        for (int n = 0; n < 8; n++)
            dst[n * 4] = tc_pack(dq[n][2 * r] * TC_SCALE, dq[n][2 * r + 1] * TC_SCALE);
        if (t == 0) d[lse_row + row] = rowd[r];
    }
#endif
}

// dK and dV: a block owns 64 keys (a warp 16, with their K and V rows in registers) and streams
// the queries from the diagonal on. The warp computes S^T = K Q^T and dP^T = V dO^T, so each
// key's P and dS sit in its own accumulator rows: dV += P^T dO and dK += dS^T Q need no
// exchange between warps.
extern "C" __global__ void __launch_bounds__(128) attention_backward_dkv_bf16_hs64_tc(
    const bf16* __restrict__ qkv, const bf16* __restrict__ dout, const float* __restrict__ lse,
    const float* __restrict__ d, bf16* __restrict__ dqkv, int T, int C, int NH, int W) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) unsigned short qs[2][TC_ROWS * TC_LD];  // double-buffered as in
    __shared__ __align__(16) unsigned short gs[2][TC_ROWS * TC_LD];  // the forward
    __shared__ __align__(16) float lses[2][TC_ROWS], ds[2][TC_ROWS];
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int kt = blockIdx.x;  // the first key tiles see the most queries and start first
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const size_t stride = 3 * (size_t)C;
    const bf16* base = qkv + (size_t)b * T * stride + h * 64;
    const bf16* gbase = dout + (size_t)b * T * C + h * 64;
    const int k0 = kt * TC_ROWS;
    const int key0 = k0 + warp * 16 + (lane >> 2);  // this lane's keys: key0 and key0 + 8
    const float c = TC_SCALE * TC_LOG2E;
    const size_t lse_row = ((size_t)b * NH + h) * T;

    // Starts copying query tile qt (Q, dO, and its rows' lse and d) into buffer `buf`.
    auto copy_query_tile = [&](int qt, int buf) {
        const int q0 = qt * TC_ROWS;
        tc_tile_copy(qs[buf], base, stride, q0, T);
        tc_tile_copy(gs[buf], gbase, C, q0, T);
        for (int i = threadIdx.x; i < TC_ROWS; i += blockDim.x) {
            const bool in = q0 + i < T;
            const size_t at = lse_row + (in ? q0 + i : 0);
            tc_copy_async4(&lses[buf][i], lse + at, in);
            tc_copy_async4(&ds[buf][i], d + at, in);
        }
        tc_commit();
    };

    // K and V rows reach registers through the second buffers, while the first query tile loads.
    tc_tile_copy(qs[1], base + C, stride, k0, T);
    tc_tile_copy(gs[1], base + 2 * C, stride, k0, T);
    tc_commit();
    copy_query_tile(kt, 0);
    tc_wait<1>();
    __syncthreads();
    unsigned kf[4][4], vf[4][4];
    tc_load_a(kf, qs[1], warp * 16);
    tc_load_a(vf, gs[1], warp * 16);
    __syncthreads();  // the second buffers are free for the pipeline

    float dk[8][4] = {}, dv[8][4] = {};
    // Query tiles up to the one holding the last query that sees the block's last key.
    const int all_tiles = (T + TC_ROWS - 1) / TC_ROWS;
    const int tiles = W > 0 ? min(all_tiles, (k0 + TC_ROWS - 1 + W - 1) / TC_ROWS + 1) : all_tiles;
    for (int qt = kt; qt < tiles; qt++) {
        const int q0 = qt * TC_ROWS, buf = (qt - kt) & 1;
        if (qt + 1 < tiles) {
            copy_query_tile(qt + 1, buf ^ 1);
            tc_wait<1>();
        } else {
            tc_wait<0>();
        }
        __syncthreads();
        float s[8][4] = {}, dp[8][4] = {};
        tc_mma_a_tile_t(s, kf, qs[buf]);
        tc_mma_a_tile_t(dp, vf, gs[buf]);
        #pragma unroll
        for (int n = 0; n < 8; n++) {
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const int qi = n * 8 + 2 * t + (e & 1), query = q0 + qi;
                const bool live = tc_sees(query, key0 + 8 * (e >> 1), W) && query < T;
                const float p = live ? exp2f(s[n][e] * c - lses[buf][qi] * TC_LOG2E) : 0.0f;
                s[n][e] = p;
                dp[n][e] = p * (dp[n][e] - ds[buf][qi]);
            }
        }
        tc_mma_x_tile(dv, s, gs[buf]);
        tc_mma_x_tile(dk, dp, qs[buf]);
        __syncthreads();
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const int key = key0 + 8 * r;
        if (key >= T) continue;
        bf16* row = dqkv + ((size_t)b * T + key) * stride + h * 64 + 2 * t;
        unsigned* dst_k = reinterpret_cast<unsigned*>(row + C);
        unsigned* dst_v = reinterpret_cast<unsigned*>(row + 2 * C);
        #pragma unroll
        for (int n = 0; n < 8; n++) {
            dst_k[n * 4] = tc_pack(dk[n][2 * r] * TC_SCALE, dk[n][2 * r + 1] * TC_SCALE);
            dst_v[n * 4] = tc_pack(dv[n][2 * r], dv[n][2 * r + 1]);
        }
    }
#endif
}
