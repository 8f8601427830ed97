// A decode step's products for up to 64 rows a block (sm_90): out = epilogue(norm(X) W^T), with
// the RMSNorm before the product and the residual add or SwiGLU after it fused in. An
// experiment measured outside the engine (harness.cu beside this file, README.md for the
// results): it was slower than cuBLAS plus the separate kernels, so the engine does not use it.
// It compiles as an engine program would (common.cuh and attention_tc.cu's helpers first).
//
// Why it was tried: a decode step multiplies a few rows by each weight once. cuBLAS runs such a
// product on 12 to 16 blocks, and the norm, SwiGLU and residual kernels around it are 3 to 4 us
// each of launch and latency. Here a product is spread over the whole GPU by splitting K as
// well as N: the CTAs of one thread-block cluster share an output tile (64 rows x NB columns),
// each owning K / S of the reduction, and add their partial tiles through distributed shared
// memory. Every CTA copies its slices of X and W with one bulk (TMA) copy a row, all completing
// on one barrier, multiplies on mma.sync, and the cluster's CTAs then each finish a share of
// the tile's rows: the S partial sums in rank order (deterministic), the norm's scale, the
// epilogue, the store.
//
// The norm: y = rstd * ((x * gamma) W^T), rstd = 1 / sqrt(mean(x^2) + eps) from the partial sums
// of squares of every CTA's slice; x * gamma is rounded to the operand type before the product
// (the engine's unfused path rounds x * rstd * gamma: the two differ by that rounding only).
// Epilogues, each rounding as the engine's unfused kernels do: none (the product in the operand
// type); SwiGLU (W's rows [gate: F | up: F], a tile's columns the matching halves; silu(g) * u
// of the rounded g and u); residual (resid + the rounded product, rounded).
//
// Launch (harness.cu): grid (tiles, S, ceil(M / 64)), cluster (1, S, 1), 256 threads, the
// dynamic shared memory of dp_shared_bytes; K a multiple of 16 S; output columns a multiple of 8;
// X, W, gamma, resid and out 16-byte aligned, their row strides multiples of 8 elements.
// SKIP_NORM, SKIP_MMA and SKIP_REDUCE (diag.sh) leave a phase out, to time the others.

#define DP_ROWS 64
#define DP_THREADS 256
#define DP_NORM 0
#define DP_SWIGLU 1
#define DP_RESID 2

struct DecodeProductArgs {
    const void* x;      // [m, k], row stride ldx
    const void* w;      // [rows of W, k], contiguous
    const void* gamma;  // [k] (DP_NORM, DP_SWIGLU)
    const void* resid;  // [m, n], row stride ldo (DP_RESID; may be `out`)
    void* out;          // [m, n], row stride ldo
    int m, k, n;        // n: output columns (SwiGLU: F, also the offset of W's up rows)
    int ldx, ldo;
    float eps;
};

// Shared memory: X's and W's slices (pitch ks + 8 elements, so ldmatrix's row reads fall in
// distinct banks), reused for the f32 partial tile once the products are done; then the rows'
// partial sums of squares (64 f32), the residual rows this CTA finishes (64 x 64 elements at
// most), gamma's slice (ks elements), all copied with the operands so that no step after the
// copies waits on global memory, and the copies' barrier.
__host__ __device__ __forceinline__ int dp_tile_bytes(int nb, int ks) {
    const int operands = (DP_ROWS + nb) * (ks + 8) * 2;
    const int partial = DP_ROWS * (nb + 4) * 4;
    return operands > partial ? operands : partial;
}
#define DP_RESID_STAGE (DP_ROWS * 64 * 2)
__host__ __device__ __forceinline__ int dp_base_bytes(int nb, int ks) {
    return dp_tile_bytes(nb, ks) + DP_ROWS * 4 + DP_RESID_STAGE + ks * 2 + 16;  // + the barrier
}
// Then (unless DP_PULL) the slots the cluster's CTAs push their partial rows into: for each
// rank q, this CTA's rows' partial sums [q][row here][nb + 4] and sums of squares [q][row here]
// (at most 64 + S - 1 rows in all).
__host__ __device__ __forceinline__ int dp_shared_bytes(int nb, int ks) {
    return dp_base_bytes(nb, ks) + 72 * (nb + 4) * 4 + 72 * 4;
}

__device__ __forceinline__ unsigned dp_remote(const void* p, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(tc_smem_addr(p)), "r"(rank));
    return r;
}
__device__ __forceinline__ float4 dp_remote4(unsigned addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void dp_store2(unsigned addr, float x, float y) {
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" :: "r"(addr), "f"(x), "f"(y) : "memory");
}
__device__ __forceinline__ void dp_store1(unsigned addr, float x) {
    asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(addr), "f"(x) : "memory");
}
__device__ __forceinline__ float dp_remote1(unsigned addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
// Every thread of every CTA of the cluster arrives; shared-memory writes before it are visible
// to the cluster's reads after it.
__device__ __forceinline__ void dp_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

template <typename T> __device__ __forceinline__ T dp_elem(unsigned short bits) {
    T t;
    t.bits = bits;
    return t;
}

// Bulk (TMA) copies that complete on an mbarrier, and the waits on it; every kernel here (and
// the harness's floor kernels) uses these. A wait that never ends (a copy that never arrives)
// says so and traps instead of hanging the GPU.
__device__ __forceinline__ void dp_init_barrier(unsigned bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
}
__device__ __forceinline__ void dp_expect(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void dp_copy(void* dst, const void* src, int bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(tc_smem_addr(dst)), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// The same rows into the same place of every CTA of the cluster in `mask`.
__device__ __forceinline__ void dp_multicast(void* dst, const void* src, int bytes, unsigned bar,
                                             unsigned short mask) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
        :: "r"(tc_smem_addr(dst)), "l"(src), "r"(bytes), "r"(bar), "h"(mask) : "memory");
}
__device__ __forceinline__ void dp_wait(unsigned bar) {
    unsigned done = 0;
    for (long long spin = 0; !done; ++spin) {
        asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], 0; selp.u32 %0, 1, 0, q; }"
                     : "=r"(done) : "r"(bar) : "memory");
        if (spin > (1ll << 24)) {
            if (threadIdx.x == 0) printf("CTA %d: copies never completed\n", blockIdx.x);
            __trap();
        }
    }
}
// Every CTA of the grid arrives (its writes released) and waits for `target` arrivals on
// `counter`, which starts at zero each launch; a barrier that never completes (CTAs that cannot
// all be resident) says so and traps.
__device__ __forceinline__ void dp_grid_barrier(unsigned* counter, unsigned target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counter, 1u);
        unsigned v;
        long long spin = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
            if (++spin > (1ll << 26)) {
                printf("CTA %d: grid barrier stuck at %u of %u\n", blockIdx.x, v, target);
                __trap();
            }
        } while (v < target);
    }
    __syncthreads();
}

// Four threads a row (256 threads, 64 rows): row threadIdx.x / 4's sum of squares over its
// `chunks` 16-byte pieces, the same on all four threads.
template <typename T>
__device__ __forceinline__ float dp_row_squares(const unsigned short* xs, int ld, int chunks) {
    const int r = threadIdx.x >> 2, q = threadIdx.x & 3;
    float acc = 0.f;
    for (int c = q; c < chunks; c += 4) {
        const uint4 raw = *(const uint4*)(xs + r * ld + c * 8);
        const unsigned* e = (const unsigned*)&raw;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float v0 = load(dp_elem<T>(e[j] & 0xffffu)), v1 = load(dp_elem<T>(e[j] >> 16));
            acc += v0 * v0 + v1 * v1;
        }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    return acc + __shfl_xor_sync(0xffffffffu, acc, 2);
}

// gamma (`gs`, `chunks` 16-byte pieces) into `rows` rows of W in shared memory, rounded: the
// norm's gain on the CTA's slice of W instead of on X (rows x K products, not 64 x K).
template <typename T>
__device__ __forceinline__ void dp_gamma_rows(unsigned short* w, int ld, int rows, int chunks,
                                              const unsigned short* gs) {
    for (int e = threadIdx.x; e < rows * chunks; e += blockDim.x) {
        const int r = e / chunks, c = (e - r * chunks) * 8;
        uint4 raw = *(const uint4*)(w + r * ld + c);
        const uint4 graw = *(const uint4*)(gs + c);
        unsigned* v = (unsigned*)&raw;
        const unsigned* g = (const unsigned*)&graw;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float w0 = load(dp_elem<T>(v[j] & 0xffffu)) * load(dp_elem<T>(g[j] & 0xffffu));
            const float w1 = load(dp_elem<T>(v[j] >> 16)) * load(dp_elem<T>(g[j] >> 16));
            v[j] = (unsigned)store<T>(w0).bits | ((unsigned)store<T>(w1).bits << 16);
        }
        *(uint4*)(w + r * ld + c) = raw;
    }
}

// Four outputs from their summed products `v` (SwiGLU: `u`, the up half's): the norm's
// `rstd` (norm kinds), the epilogue with the unfused kernels' roundings, the store. `res`:
// the residual's four elements (DP_RESID).
template <typename T, int KIND>
__device__ __forceinline__ void dp_finish(float v[4], float u[4], float rstd, const unsigned short* res, T* out) {
    float y[4];
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        if (KIND == DP_NORM) {
            y[j] = v[j] * rstd;
        } else if (KIND == DP_SWIGLU) {
            const float gt = load(store<T>(v[j] * rstd)), up = load(store<T>(u[j] * rstd));
            y[j] = gt * (1.0f / (1.0f + expf(-gt))) * up;
        } else {
            y[j] = load(dp_elem<T>(res[j])) + load(store<T>(v[j]));
        }
    }
    store4(out, y);
}

template <class Ops, int NB, int KIND>
__device__ __forceinline__ void decode_product(const DecodeProductArgs& a) {
#if __CUDA_ARCH__ >= 900
    typedef typename Ops::elem T;
    extern __shared__ __align__(16) unsigned char dp_smem[];
    unsigned rank, S;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(S));
    const int ks = a.k / (int)S, k0 = (int)rank * ks, ld = ks + 8;
    const int m0 = blockIdx.z * DP_ROWS, tile = blockIdx.x;
    const int oc = KIND == DP_SWIGLU ? NB / 2 : NB;  // output columns of a tile
    unsigned short* xs = (unsigned short*)dp_smem;
    unsigned short* ws = xs + DP_ROWS * ld;
#ifdef DP_PULL
    float* part = (float*)dp_smem;  // the partial tile, once the products are done
#endif
    float* ss = (float*)(dp_smem + dp_tile_bytes(NB, ks));
    unsigned short* rs = (unsigned short*)(ss + DP_ROWS);  // [rows finished here][oc]
    unsigned short* gs = rs + DP_ROWS * 64;                // gamma[k0 .. k0 + ks)
    tc_need_shared(dp_shared_bytes(NB, ks));
    const int per_row = oc / 4;
    const int mine = (DP_ROWS - (int)rank + (int)S - 1) / (int)S;  // rows rank, rank + S, ...
    const int srows = (DP_ROWS + (int)S - 1) / (int)S;
    float* slots = (float*)(dp_smem + dp_base_bytes(NB, ks));
    float* sslots = slots + S * srows * (NB + 4);

    // Every copy of the block's slices at once, one bulk (TMA) copy a row, all completing on
    // one barrier: a decode product waits on memory, and per-element copy instructions would
    // cost more issue slots than the products. Rows of X past M and of W past N are not copied:
    // their (stale) shared memory only reaches output rows and columns that are not stored.
    const T* x = (const T*)a.x;
    const T* w = (const T*)a.w;
    const int xrows = min(DP_ROWS, a.m - m0);
    const int wrows = KIND == DP_SWIGLU ? 2 * max(0, min(oc, a.n - tile * oc)) : max(0, min(NB, a.n - tile * NB));
    const int rrows = KIND == DP_RESID ? (xrows - (int)rank + (int)S - 1) / (int)S : 0;
    const int rcols = max(0, min(oc, a.n - tile * oc));
    const unsigned bar = tc_smem_addr(gs + ks);
    if (threadIdx.x == 0) {
        dp_init_barrier(bar);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
#ifndef DP_PULL
    // Says this CTA has started; waited for before the first remote store.
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
    if (threadIdx.x == 0) {
        const unsigned bytes = (xrows + wrows) * ks * 2 + (KIND == DP_RESID ? rrows * rcols * 2 : ks * 2);
        dp_expect(bar, bytes);
    }
    // Copies of weights (W, gamma) start before the previous kernel has finished, when this
    // one is launched as its programmatic dependent: they read nothing it writes. X and the
    // residual wait for it (griddepcontrol.wait; a no-op in an ordinary launch).
    {
        const int i = threadIdx.x;
        const bool weight = (i >= DP_ROWS && i < DP_ROWS + wrows) || (i == DP_ROWS + NB && KIND != DP_RESID);
        const void* src = nullptr;
        void* dst = nullptr;
        int size = ks * 2;
        if (i < xrows) {
            src = x + (size_t)(m0 + i) * a.ldx + k0;
            dst = xs + i * ld;
        } else if (i >= DP_ROWS && i < DP_ROWS + wrows) {
            const int r = i - DP_ROWS;
            const int row = KIND == DP_SWIGLU ? (r < wrows / 2 ? tile * oc + r : a.n + tile * oc + r - wrows / 2)
                                              : tile * NB + r;
            src = w + (size_t)row * a.k + k0;
            dst = ws + (KIND == DP_SWIGLU && r >= wrows / 2 ? r - wrows / 2 + oc : r) * ld;
        } else if (i == DP_ROWS + NB && KIND != DP_RESID) {
            src = (const T*)a.gamma + k0;
            dst = gs;
        } else if (i > DP_ROWS + NB && i <= DP_ROWS + NB + rrows && rcols > 0) {
            const int rl = i - DP_ROWS - NB - 1;
            src = (const T*)a.resid + (size_t)(m0 + (int)rank + rl * (int)S) * a.ldo + tile * oc;
            dst = rs + rl * oc;
            size = rcols * 2;
        }
        if (src && weight) dp_copy(dst, src, size, bar);
        asm volatile("griddepcontrol.wait;" ::: "memory");
        // The next kernel may start now and fetch its own weights while this one works.
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
        if (src && !weight) dp_copy(dst, src, size, bar);
    }
    dp_wait(bar);

    const int chunks = ks / 8;  // 16-byte pieces of a row's slice
#ifndef SKIP_NORM
    if (KIND != DP_RESID) {
        // Four threads a row: the slice's sum of squares, and x * gamma in place.
        const int r = threadIdx.x >> 2, q = threadIdx.x & 3;
        unsigned short* row = xs + r * ld;
        float acc = 0.f;
        for (int c = q; c < chunks; c += 4) {
            uint4 raw = *(const uint4*)(row + c * 8);
            const uint4 graw = *(const uint4*)(gs + c * 8);
            unsigned* e = (unsigned*)&raw;
            const unsigned* ge = (const unsigned*)&graw;
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float v0 = load(dp_elem<T>(e[j] & 0xffffu)), v1 = load(dp_elem<T>(e[j] >> 16));
                acc += v0 * v0 + v1 * v1;
                const float g0 = load(dp_elem<T>(ge[j] & 0xffffu)), g1 = load(dp_elem<T>(ge[j] >> 16));
                e[j] = (unsigned)store<T>(v0 * g0).bits | ((unsigned)store<T>(v1 * g1).bits << 16);
            }
            *(uint4*)(row + c * 8) = raw;
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        acc += __shfl_xor_sync(0xffffffffu, acc, 2);
        if (!q) ss[r] = acc;
        __syncthreads();
    }
#endif

    // Warp w: rows 16 (w % 4) .. + 15 against columns (w / 4) NB / 2 .. + NB / 2.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wr = (warp & 3) * 16, wc = (warp >> 2) * (NB / 2);
    float acc[NB / 16][4];
    #pragma unroll
    for (int j = 0; j < NB / 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#ifndef SKIP_MMA
    for (int kk = 0; kk < ks / 16; ++kk) {
        unsigned af[4];
        tc_ldsm(af, tc_smem_addr(xs + (wr + (lane & 15)) * ld + kk * 16 + (lane >> 4) * 8));
        #pragma unroll
        for (int n = 0; n < NB / 32; ++n) {
            unsigned b[4];
            tc_ldsm(b, tc_smem_addr(ws + (wc + n * 16 + (lane & 7) + ((lane >> 4) << 3)) * ld + kk * 16 +
                                    ((lane >> 3) & 1) * 8));
            Ops::mma(acc[2 * n], af, b[0], b[1]);
            Ops::mma(acc[2 * n + 1], af, b[2], b[3]);
        }
    }
#endif
#ifdef DP_PULL
    __syncthreads();  // every warp is done with xs and ws, which the partial tile reuses
    {
        const int g = lane >> 2, t = lane & 3;
        #pragma unroll
        for (int j = 0; j < NB / 16; ++j) {
            float* p = part + (wr + g) * (NB + 4) + wc + j * 8 + 2 * t;
            *(float2*)p = make_float2(acc[j][0], acc[j][1]);
            *(float2*)(p + 8 * (NB + 4)) = make_float2(acc[j][2], acc[j][3]);
        }
    }
#ifdef SKIP_REDUCE
    return;
#endif
    dp_cluster_sync();
#else
    // Each partial row goes straight to the CTA that finishes it (row r to rank r % S), into
    // this CTA's slot there: fire-and-forget stores, then one barrier.
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    {
        const int g = lane >> 2, t = lane & 3;
        #pragma unroll
        for (int j = 0; j < NB / 16; ++j) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = wr + g + 8 * h;
                const float* p = slots + ((int)rank * srows + r / (int)S) * (NB + 4) + wc + j * 8 + 2 * t;
                dp_store2(dp_remote(p, r % S), acc[j][2 * h], acc[j][2 * h + 1]);
            }
        }
        if (KIND != DP_RESID && threadIdx.x < DP_ROWS) {
            const int r = threadIdx.x;
            dp_store1(dp_remote(sslots + (int)rank * srows + r / (int)S, r % S), ss[r]);
        }
    }
#ifdef SKIP_REDUCE
    return;
#endif
    dp_cluster_sync();
#endif

    // This CTA finishes rows rank, rank + S, ...: the partial tiles added in rank order.
    for (int i = threadIdx.x; i < mine * per_row; i += DP_THREADS) {
        const int rl = i / per_row, r = (int)rank + rl * (int)S, c = (i % per_row) * 4;
        const int col = tile * oc + c;
        if (m0 + r >= a.m || col >= a.n) continue;
        float v[4] = {0.f, 0.f, 0.f, 0.f}, u[4] = {0.f, 0.f, 0.f, 0.f}, sq = 0.f;
        for (unsigned q = 0; q < S; ++q) {
#ifdef DP_PULL
            const float4 p = dp_remote4(dp_remote(part + r * (NB + 4) + c, q));
            const float4 pu = KIND == DP_SWIGLU ? dp_remote4(dp_remote(part + r * (NB + 4) + oc + c, q)) : p;
            if (KIND != DP_RESID) sq += dp_remote1(dp_remote(ss + r, q));
#else
            const float* row = slots + (q * srows + rl) * (NB + 4);
            const float4 p = *(const float4*)(row + c);
            const float4 pu = KIND == DP_SWIGLU ? *(const float4*)(row + oc + c) : p;
            if (KIND != DP_RESID) sq += sslots[q * srows + rl];
#endif
            v[0] += p.x, v[1] += p.y, v[2] += p.z, v[3] += p.w;
            if (KIND == DP_SWIGLU) u[0] += pu.x, u[1] += pu.y, u[2] += pu.z, u[3] += pu.w;
        }
        const float rstd = KIND == DP_RESID ? 1.0f : 1.0f / sqrtf(sq / a.k + a.eps);
        dp_finish<T, KIND>(v, u, rstd, rs + rl * oc + c, (T*)a.out + (size_t)(m0 + r) * a.ldo + col);
    }
#ifdef DP_PULL
    dp_cluster_sync();  // no CTA leaves while another still reads its shared memory
#endif
#else
    __trap();
#endif
}

#define DP_ENTRY(OPS, NB, KIND, NAME, SUFFIX)                                                          \
    extern "C" __global__ void __launch_bounds__(DP_THREADS) decode_product_##NAME##_nb##NB##_##SUFFIX( \
        DecodeProductArgs a) {                                                                     \
        decode_product<OPS, NB, KIND>(a);                                                          \
    }
#define DP_ENTRY_POINTS(OPS, SUFFIX)             \
    DP_ENTRY(OPS, 64, DP_NORM, norm, SUFFIX)     \
    DP_ENTRY(OPS, 32, DP_NORM, norm, SUFFIX)     \
    DP_ENTRY(OPS, 64, DP_SWIGLU, swiglu, SUFFIX) \
    DP_ENTRY(OPS, 64, DP_RESID, resid, SUFFIX)   \
    DP_ENTRY(OPS, 32, DP_RESID, resid, SUFFIX)
