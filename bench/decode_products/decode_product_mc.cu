// A second design of the fused decode product (see decode_product.cu for the products, the
// epilogues and their roundings): no split over K across CTAs, so no reduction between them.
// Each CTA owns NB columns of W over the whole of K, its 8 warps split K among themselves and
// add their partial tiles in shared memory. X (up to 64 rows) is shared by the CTAs of a
// cluster laid along N: each CTA copies 64 / C of its rows once and multicasts them to all C,
// so X leaves L2 once a cluster. The weights' copies start before the previous kernel ends
// (programmatic dependent launch); X waits for it. The norm's gamma multiplies the CTA's
// slice of W (rounded to the operand type) instead of X: NB x K products, not 64 x K.
//
// Launch: grid (tiles rounded up to C, 1, ceil(M / 64)), cluster (C, 1, 1), C dividing 64,
// 256 threads, dynamic shared memory of mc_shared_bytes.

#define MC_THREADS 256
#define MC_WARPS 8

__host__ __device__ __forceinline__ int mc_ops_bytes(int nb, int k) { return (DP_ROWS + nb) * (k + 8) * 2; }
__host__ __device__ __forceinline__ int mc_shared_bytes(int nb, int k) {
    // operands (the warps' partial tiles reuse them), sums of squares, residual rows, gamma,
    // the barrier
    return mc_ops_bytes(nb, k) + DP_ROWS * 4 + DP_ROWS * nb * 2 + k * 2 + 16;
}

__device__ __forceinline__ void mc_ldsm2(unsigned r[2], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

template <class Ops, int NB, int KIND>
__device__ __forceinline__ void decode_product_mc(const DecodeProductArgs& a) {
#if __CUDA_ARCH__ >= 900
    typedef typename Ops::elem T;
    extern __shared__ __align__(16) unsigned char mc_smem[];
    unsigned rank, C;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(C));
    const int K = a.k, ld = K + 8;
    const int m0 = blockIdx.z * DP_ROWS, tile = blockIdx.x;
    const int oc = KIND == DP_SWIGLU ? NB / 2 : NB;
    unsigned short* xs = (unsigned short*)mc_smem;
    unsigned short* ws = xs + DP_ROWS * ld;
    float* part = (float*)mc_smem;  // [warp][64][NB + 4] once the products are done
    float* ss = (float*)(mc_smem + mc_ops_bytes(NB, K));
    unsigned short* rs = (unsigned short*)(ss + DP_ROWS);  // [64][oc]
    unsigned short* gs = rs + DP_ROWS * NB;
    const unsigned bar = tc_smem_addr(gs + K);
    tc_need_shared(mc_shared_bytes(NB, K));

    const T* x = (const T*)a.x;
    const T* w = (const T*)a.w;
    const int xrows = min(DP_ROWS, a.m - m0);
    const int valid = max(0, min(oc, a.n - tile * oc));  // output columns of this tile
    const int wrows = KIND == DP_SWIGLU ? 2 * valid : valid;
    const int per = DP_ROWS / (int)C;  // X rows this CTA copies for the cluster
    const int mine = max(0, min(per, xrows - (int)rank * per));
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bar));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");  // my barrier is ready
    if (threadIdx.x == 0) {
        const unsigned bytes = (xrows + wrows) * K * 2 + (KIND == DP_RESID ? xrows * valid * 2 : K * 2);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
    }
    const int i = threadIdx.x;
    // The weights first: they do not depend on the previous kernel.
    if (i < wrows) {
        const int row = KIND == DP_SWIGLU ? (i < valid ? tile * oc + i : a.n + tile * oc + i - valid) : tile * NB + i;
        unsigned short* dst = ws + (KIND == DP_SWIGLU && i >= valid ? i - valid + oc : i) * ld;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(tc_smem_addr(dst)), "l"(w + (size_t)row * K), "r"(K * 2), "r"(bar) : "memory");
    } else if (i == MC_THREADS - 1 && KIND != DP_RESID) {
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(tc_smem_addr(gs)), "l"((const T*)a.gamma), "r"(K * 2), "r"(bar) : "memory");
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // every CTA's barrier is ready
    if (i < mine) {
        const int r = (int)rank * per + i;
        const unsigned short mask = (unsigned short)((1u << C) - 1u);
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
            :: "r"(tc_smem_addr(xs + r * ld)), "l"(x + (size_t)(m0 + r) * a.ldx), "r"(K * 2), "r"(bar), "h"(mask)
            : "memory");
    }
    if (KIND == DP_RESID && i >= 128 && i - 128 < xrows && valid > 0) {
        const int r = i - 128;
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(tc_smem_addr(rs + r * oc)), "l"((const T*)a.resid + (size_t)(m0 + r) * a.ldo + tile * oc),
                        "r"(valid * 2), "r"(bar) : "memory");
    }
    {
        unsigned done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(bar) : "memory");
    }

    const int chunks = K / 8;
    if (KIND != DP_RESID) {
        {  // four threads a row: its sum of squares
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
            acc += __shfl_xor_sync(0xffffffffu, acc, 2);
            if (!q) ss[r] = acc;
        }
        // gamma into the CTA's rows of W, rounded
        for (int e = threadIdx.x; e < NB * chunks; e += MC_THREADS) {
            const int r = e / chunks, c = (e - r * chunks) * 8;
            uint4 raw = *(const uint4*)(ws + r * ld + c);
            const uint4 graw = *(const uint4*)(gs + c);
            unsigned* v = (unsigned*)&raw;
            const unsigned* g = (const unsigned*)&graw;
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float w0 = load(dp_elem<T>(v[j] & 0xffffu)) * load(dp_elem<T>(g[j] & 0xffffu));
                const float w1 = load(dp_elem<T>(v[j] >> 16)) * load(dp_elem<T>(g[j] >> 16));
                v[j] = (unsigned)store<T>(w0).bits | ((unsigned)store<T>(w1).bits << 16);
            }
            *(uint4*)(ws + r * ld + c) = raw;
        }
        __syncthreads();
    }

    // Warp w: k-steps [w S / 8, (w + 1) S / 8) of all 64 rows against the NB columns.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int steps = K / 16, k_lo = warp * steps / MC_WARPS, k_hi = (warp + 1) * steps / MC_WARPS;
    float acc[4][NB / 8][4];
    #pragma unroll
    for (int mt = 0; mt < 4; ++mt)
        #pragma unroll
        for (int j = 0; j < NB / 8; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.f;
    for (int kk = k_lo; kk < k_hi; ++kk) {
        // B: two 8-column tiles per ldmatrix.x4 (one per x2 at NB 8)
        unsigned b[NB / 8][2];
        if (NB == 8) {
            mc_ldsm2(b[0], tc_smem_addr(ws + (lane & 7) * ld + kk * 16 + ((lane >> 3) & 1) * 8));
        } else {
            #pragma unroll
            for (int n = 0; n < NB / 16; ++n) {
                unsigned q[4];
                tc_ldsm(q, tc_smem_addr(ws + (n * 16 + (lane & 7) + ((lane >> 4) << 3)) * ld + kk * 16 +
                                        ((lane >> 3) & 1) * 8));
                b[2 * n][0] = q[0], b[2 * n][1] = q[1], b[2 * n + 1][0] = q[2], b[2 * n + 1][1] = q[3];
            }
        }
        #pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
            unsigned af[4];
            tc_ldsm(af, tc_smem_addr(xs + (mt * 16 + (lane & 15)) * ld + kk * 16 + (lane >> 4) * 8));
            #pragma unroll
            for (int j = 0; j < NB / 8; ++j) Ops::mma(acc[mt][j], af, b[j][0], b[j][1]);
        }
    }
    __syncthreads();  // every warp is done with xs and ws: the partial tiles reuse them
    {
        const int g = lane >> 2, t = lane & 3;
        float* mine_part = part + warp * DP_ROWS * (NB + 4);
        #pragma unroll
        for (int mt = 0; mt < 4; ++mt)
            #pragma unroll
            for (int j = 0; j < NB / 8; ++j) {
                float* p = mine_part + (mt * 16 + g) * (NB + 4) + j * 8 + 2 * t;
                *(float2*)p = make_float2(acc[mt][j][0], acc[mt][j][1]);
                *(float2*)(p + 8 * (NB + 4)) = make_float2(acc[mt][j][2], acc[mt][j][3]);
            }
    }
    __syncthreads();

    // The tile's outputs, four columns a thread: the warps' partial sums in warp order.
    const int per_row = oc / 4;
    for (int it = threadIdx.x; it < DP_ROWS * per_row; it += MC_THREADS) {
        const int r = it / per_row, c = (it - r * per_row) * 4;
        const int col = tile * oc + c;
        if (r >= xrows || c >= valid) continue;
        float v[4] = {0.f, 0.f, 0.f, 0.f}, u[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int q = 0; q < MC_WARPS; ++q) {
            const float* row = part + (q * DP_ROWS + r) * (NB + 4);
            const float4 p = *(const float4*)(row + c);
            v[0] += p.x, v[1] += p.y, v[2] += p.z, v[3] += p.w;
            if (KIND == DP_SWIGLU) {
                const float4 pu = *(const float4*)(row + oc + c);
                u[0] += pu.x, u[1] += pu.y, u[2] += pu.z, u[3] += pu.w;
            }
        }
        if (KIND != DP_RESID) {
            const float rstd = 1.0f / sqrtf(ss[r] / K + a.eps);
            #pragma unroll
            for (int j = 0; j < 4; ++j) v[j] *= rstd, u[j] *= rstd;
        }
        float y[4];
        if (KIND == DP_NORM) {
            #pragma unroll
            for (int j = 0; j < 4; ++j) y[j] = v[j];
        } else if (KIND == DP_SWIGLU) {
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float gt = load(store<T>(v[j])), up = load(store<T>(u[j]));
                y[j] = gt * (1.0f / (1.0f + expf(-gt))) * up;
            }
        } else {
            const unsigned short* res = rs + r * oc + c;
            #pragma unroll
            for (int j = 0; j < 4; ++j) y[j] = load(dp_elem<T>(res[j])) + load(store<T>(v[j]));
        }
        store4((T*)a.out + (size_t)(m0 + r) * a.ldo + col, y);
    }
#else
    __trap();
#endif
}

#define MC_ENTRY(OPS, NB, KIND, NAME, SUFFIX)                                                          \
    extern "C" __global__ void __launch_bounds__(MC_THREADS) decode_product_mc_##NAME##_nb##NB##_##SUFFIX( \
        DecodeProductArgs a) {                                                                     \
        decode_product_mc<OPS, NB, KIND>(a);                                                       \
    }
#define MC_ENTRY_POINTS(OPS, SUFFIX)              \
    MC_ENTRY(OPS, 16, DP_NORM, norm, SUFFIX)      \
    MC_ENTRY(OPS, 32, DP_SWIGLU, swiglu, SUFFIX)  \
    MC_ENTRY(OPS, 16, DP_RESID, resid, SUFFIX)    \
    MC_ENTRY(OPS, 8, DP_RESID, resid, SUFFIX)
