// A persistent kernel for one decoder layer's products at decode time (sm_90), SmolLM2-135M's
// shapes (width 576, 3 x 192-wide key/value heads beside 576 of queries: q/k/v 960 columns,
// SwiGLU hidden 1536), up to 64 rows: one launch runs the layer's four products as phases,
// separated by grid-wide barriers, instead of nine kernels (four cuBLAS products, two residual
// RMSNorms, SwiGLU, and the attention's two, which stay outside this prototype):
//   P0  qkv = rmsnorm(h; g1) Wq^T
//   P1  h  += att Wo^T                      (att: the attention's output)
//   P2  act = swiglu(rmsnorm(h; g2) Wgu^T)  (Wgu's rows [gate: 1536 | up: 1536])
//   P3  h  += act Wd^T                      (K 1536, in two halves of 768)
// The roundings are decode_product.cu's. A grid of 120 CTAs in clusters of 8 (all resident at
// once: the occupancy query says at most 15 such clusters); each phase's X reaches a cluster by
// one bulk multicast copy a row (each CTA copies 8 rows for all 8), each CTA owns 8-column
// tiles of the phase's W (a tile = 8 gate and 8 up rows in P2), whose copies are issued as soon
// as their buffer is free, ahead of the phase; 8 warps split K and add their partial tiles in
// shared memory. Every mbarrier is used once a launch (parity 0).

#define DL_D 576
#define DL_QKV 960
#define DL_F 1536
#define DL_CTAS 120
#define DL_XLD (768 + 8)  // X's row pitch: K 576, or a 768 half of down's K
#define DL_WROWS_MAX 32   // two P2 tiles of 16 rows
#define DL_WBUF_ELEMS (DL_WROWS_MAX * (DL_D + 8))  // a W buffer (down's 8 rows of 1544 fit too)
// Shared memory: X [64][DL_XLD] (then the warps' partial tiles), two W buffers, g1 | g2, the
// residual rows [64][8], the rows' sums of squares, 10 barriers.
#define DL_SHARED (64 * DL_XLD * 2 + 2 * DL_WBUF_ELEMS * 2 + 2 * DL_D * 2 + 64 * 8 * 2 + 64 * 4 + 10 * 8)

struct LayerArgs {
    bf16* h;          // [m, 576], the residual stream: read, and written by P1 and P3
    const bf16* att;  // [m, 576]
    bf16* qkv;        // [m, 960]
    bf16* act;        // [m, 1536]
    const bf16 *wq, *wo, *wgu, *wd, *g1, *g2;
    unsigned* counter;  // zero before each launch
    int m;
    float eps;
};

// The W rows of a phase's tiles for CTA c: P0 tile c (8 rows of Wq), P1 and P3 tile c < 72,
// P2 tiles c and c + 120 < 192 (8 gate rows, then their 8 up rows, each).
__device__ __forceinline__ int dl_tiles(int phase, int c) {
    switch (phase) {
        case 0: return 1;
        case 2: return c + DL_CTAS < DL_F / 8 ? 2 : 1;
        default: return c < DL_D / 8 ? 1 : 0;
    }
}
__device__ __forceinline__ void dl_issue_w(int phase, int c, const LayerArgs& a, unsigned short* buf,
                                               unsigned bar) {
    const int tiles = dl_tiles(phase, c);
    const int k = phase == 3 ? DL_F : DL_D, ld = k + 8;
    const int rows = phase == 2 ? 16 * tiles : 8 * tiles;
    if (threadIdx.x == 0) dp_expect(bar, rows * k * 2);
    const int r = threadIdx.x;
    if (r < rows) {
        const bf16* src;
        if (phase == 0) src = a.wq + (size_t)(8 * c + r) * k;
        else if (phase == 1) src = a.wo + (size_t)(8 * c + r) * k;
        else if (phase == 3) src = a.wd + (size_t)(8 * c + r) * k;
        else {
            const int t = r / 16, q = r % 16, j = 8 * (c + t * DL_CTAS) + (q % 8);
            src = a.wgu + (size_t)(q < 8 ? j : DL_F + j) * k;
        }
        dp_copy(buf + r * ld, src, k * 2, bar);
    }
}

extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(256) decode_layer_bf16(LayerArgs a) {
#if __CUDA_ARCH__ >= 900
    typedef TcBf16 Ops;
    extern __shared__ __align__(16) unsigned char dl_smem[];
    unsigned short* xs = (unsigned short*)dl_smem;                  // [64][DL_XLD]
    float* part = (float*)dl_smem;                                  // [8 warps][64][20], after the products
    unsigned short* wbuf[2] = {xs + 64 * DL_XLD, xs + 64 * DL_XLD + DL_WBUF_ELEMS};
    unsigned short* gs = wbuf[1] + DL_WBUF_ELEMS;                   // g1 | g2
    unsigned short* rs = gs + 2 * DL_D;                             // [64][8] residual rows
    float* ss = (float*)(rs + 64 * 8);                              // [64]
    unsigned long long* bars = (unsigned long long*)(ss + 64);      // 5 X loads, 4 W loads, gammas
    auto bar = [&](int i) { return tc_smem_addr(bars + i); };
    unsigned rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const int c = blockIdx.x, m = a.m, xrows = min(64, m);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    if (threadIdx.x == 0) {
        for (int i = 0; i < 10; ++i) dp_init_barrier(bar(i));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Weights first (they depend on nothing): P0's and P1's tiles, both gammas.
    dl_issue_w(0, c, a, wbuf[0], bar(5));
    dl_issue_w(1, c, a, wbuf[1], bar(6));
    if (threadIdx.x == 0) dp_expect(bar(9), 2 * DL_D * 2);
    if (threadIdx.x == 255) {
        dp_copy(gs, a.g1, DL_D * 2, bar(9));
        dp_copy(gs + DL_D, a.g2, DL_D * 2, bar(9));
    }
    dp_cluster_sync();  // every CTA's barriers are initialised before any multicast

    for (int phase = 0; phase < 4; ++phase) {
        if (phase) {
            dp_grid_barrier(a.counter, phase * gridDim.x);
            // X's next copies are read by the async proxy: order them after what the barrier
            // acquired.
            asm volatile("fence.proxy.async.global;" ::: "memory");
        }
        const int tiles = dl_tiles(phase, c);
        const int k = phase == 3 ? DL_F : DL_D;
        const bool norm = phase == 0 || phase == 2;
        unsigned short* w = wbuf[phase & 1];
        const int wld = k + 8;
        const int nb = phase == 2 ? 16 : 8;  // W rows a tile
        float acc[2][4][2][4];  // [tile][m16][n8][frag]
        #pragma unroll
        for (int t = 0; t < 2; ++t)
            #pragma unroll
            for (int mt = 0; mt < 4; ++mt)
                #pragma unroll
                for (int j = 0; j < 2; ++j) acc[t][mt][j][0] = acc[t][mt][j][1] = acc[t][mt][j][2] = acc[t][mt][j][3] = 0.f;
        const int halves = phase == 3 ? 2 : 1;
        for (int half = 0; half < halves; ++half) {
            const int kc = phase == 3 ? 768 : DL_D, k0 = half * 768;
            const unsigned xb = bar(phase == 3 ? 3 + half : phase);
            const bf16* src = phase == 1 ? a.att : phase == 3 ? a.act : a.h;
            const int sld = phase == 3 ? DL_F : DL_D;
            if (half) dp_cluster_sync();  // every CTA of the cluster is done with the first half
            if (threadIdx.x == 0) {
                int bytes = xrows * kc * 2;
                if ((phase == 1 || phase == 3) && half == 0 && tiles) bytes += xrows * 16;
                dp_expect(xb, bytes);
            }
            const int r = rank * 8 + threadIdx.x;
            if (threadIdx.x < 8 && r < xrows)
                dp_multicast(xs + r * DL_XLD, src + (size_t)r * sld + k0, kc * 2, xb, 0xff);
            if ((phase == 1 || phase == 3) && half == 0 && tiles && threadIdx.x >= 64 && threadIdx.x < 64 + xrows) {
                const int rr = threadIdx.x - 64;
                dp_copy(rs + rr * 8, a.h + (size_t)rr * DL_D + 8 * c, 16, xb);
            }
            dp_wait(xb);
            if (half == 0) dp_wait(bar(5 + phase));
            if (phase == 0 && half == 0) dp_wait(bar(9));
            if (norm) {
                const float sq = dp_row_squares<bf16>(xs, DL_XLD, DL_D / 8);
                if ((threadIdx.x & 3) == 0) ss[threadIdx.x >> 2] = sq;
                dp_gamma_rows<bf16>(w, wld, tiles * nb, DL_D / 8, gs + (phase == 2 ? DL_D : 0));
                __syncthreads();
            }
            // Warp w: k-steps [w S / 8, (w + 1) S / 8) of this half, all 64 rows, every tile.
            const int steps = kc / 16, lo = warp * steps / 8, hi = (warp + 1) * steps / 8;
            for (int kk = lo; kk < hi; ++kk) {
                unsigned af[4][4];
                #pragma unroll
                for (int mt = 0; mt < 4; ++mt)
                    tc_ldsm(af[mt], tc_smem_addr(xs + (mt * 16 + (lane & 15)) * DL_XLD + kk * 16 + (lane >> 4) * 8));
                #pragma unroll
                for (int t = 0; t < 2; ++t) {
                    if (t >= tiles) break;
                    unsigned b[2][2];
                    const int kw = k0 + kk * 16;
                    if (nb == 16) {
                        unsigned q4[4];
                        tc_ldsm(q4, tc_smem_addr(w + (t * 16 + (lane & 7) + ((lane >> 4) << 3)) * wld + kw + ((lane >> 3) & 1) * 8));
                        b[0][0] = q4[0], b[0][1] = q4[1], b[1][0] = q4[2], b[1][1] = q4[3];
                    } else {
                        mc_ldsm2(b[0], tc_smem_addr(w + (t * 8 + (lane & 7)) * wld + kw + ((lane >> 3) & 1) * 8));
                    }
                    #pragma unroll
                    for (int mt = 0; mt < 4; ++mt) {
                        Ops::mma(acc[t][mt][0], af[mt], b[0][0], b[0][1]);
                        if (nb == 16) Ops::mma(acc[t][mt][1], af[mt], b[1][0], b[1][1]);
                    }
                }
            }
            if (half + 1 < halves) __syncthreads();
        }
        __syncthreads();  // done with X and this phase's W
        // The next use of this W buffer (two phases on) can start copying now.
        if (phase < 2) dl_issue_w(phase + 2, c, a, w, bar(7 + phase));
        #pragma unroll
        for (int t = 0; t < 2; ++t) {
            if (t >= tiles) break;
            {  // the warps' partial tiles
                const int g = lane >> 2, tt = lane & 3;
                float* mine = part + warp * 64 * 20;
                #pragma unroll
                for (int mt = 0; mt < 4; ++mt)
                    #pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        if (j * 8 >= nb) break;
                        float* p = mine + (mt * 16 + g) * 20 + j * 8 + 2 * tt;
                        *(float2*)p = make_float2(acc[t][mt][j][0], acc[t][mt][j][1]);
                        *(float2*)(p + 8 * 20) = make_float2(acc[t][mt][j][2], acc[t][mt][j][3]);
                    }
            }
            __syncthreads();
            // 64 rows x 8 outputs: two groups of four a row.
            if (threadIdx.x < 128) {
                const int row = threadIdx.x >> 1, c4 = (threadIdx.x & 1) * 4;
                if (row < xrows) {
                    float v[4] = {0.f, 0.f, 0.f, 0.f}, u[4] = {0.f, 0.f, 0.f, 0.f};
                    #pragma unroll
                    for (int q = 0; q < 8; ++q) {
                        const float* pr = part + (q * 64 + row) * 20;
                        const float4 p = *(const float4*)(pr + c4);
                        v[0] += p.x, v[1] += p.y, v[2] += p.z, v[3] += p.w;
                        if (phase == 2) {
                            const float4 pu = *(const float4*)(pr + 8 + c4);
                            u[0] += pu.x, u[1] += pu.y, u[2] += pu.z, u[3] += pu.w;
                        }
                    }
                    const float rstd = norm ? 1.0f / sqrtf(ss[row] / DL_D + a.eps) : 1.0f;
                    if (phase == 0)
                        dp_finish<bf16, DP_NORM>(v, u, rstd, nullptr, a.qkv + (size_t)row * DL_QKV + 8 * c + c4);
                    else if (phase == 2)
                        dp_finish<bf16, DP_SWIGLU>(v, u, rstd, nullptr,
                                                   a.act + (size_t)row * DL_F + 8 * (c + t * DL_CTAS) + c4);
                    else
                        dp_finish<bf16, DP_RESID>(v, u, rstd, rs + row * 8 + c4, a.h + (size_t)row * DL_D + 8 * c + c4);
                }
            }
            __syncthreads();
        }
    }
#else
    __trap();
#endif
}
