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
        dp_init_barrier(bar);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");  // my barrier is ready
    if (threadIdx.x == 0) {
        const unsigned bytes = (xrows + wrows) * K * 2 + (KIND == DP_RESID ? xrows * valid * 2 : K * 2);
        dp_expect(bar, bytes);
    }
    const int i = threadIdx.x;
    // The weights first: they do not depend on the previous kernel.
    if (i < wrows) {
        const int row = KIND == DP_SWIGLU ? (i < valid ? tile * oc + i : a.n + tile * oc + i - valid) : tile * NB + i;
        unsigned short* dst = ws + (KIND == DP_SWIGLU && i >= valid ? i - valid + oc : i) * ld;
        dp_copy(dst, w + (size_t)row * K, K * 2, bar);
    } else if (i == MC_THREADS - 1 && KIND != DP_RESID) {
        dp_copy(gs, a.gamma, K * 2, bar);
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // every CTA's barrier is ready
    if (i < mine) {
        const int r = (int)rank * per + i;
        dp_multicast(xs + r * ld, x + (size_t)(m0 + r) * a.ldx, K * 2, bar, (unsigned short)((1u << C) - 1u));
    }
    if (KIND == DP_RESID && i >= 128 && i - 128 < xrows && valid > 0) {
        const int r = i - 128;
        dp_copy(rs + r * oc, (const T*)a.resid + (size_t)(m0 + r) * a.ldo + tile * oc, valid * 2, bar);
    }
    dp_wait(bar);

    const int chunks = K / 8;
    if (KIND != DP_RESID) {
        const float sq = dp_row_squares<T>(xs, ld, chunks);
        if ((threadIdx.x & 3) == 0) ss[threadIdx.x >> 2] = sq;
        dp_gamma_rows<T>(ws, ld, NB, chunks, gs);
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
        const float rstd = KIND == DP_RESID ? 1.0f : 1.0f / sqrtf(ss[r] / K + a.eps);
        dp_finish<T, KIND>(v, u, rstd, rs + r * oc + c, (T*)a.out + (size_t)(m0 + r) * a.ldo + col);
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
