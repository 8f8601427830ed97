// A Hopper product with its MLP epilogue fused: the question is whether a product of kiln's
// own, fed by the TMA unit into warpgroup MMAs, can run as fast as cuBLASLt's while the GELU
// (forward) or the GELU's derivative (backward) rides in its epilogue for free, where
// cuBLASLt's GELU epilogues cost 45-55 us a layer over its plain products at GPT-2 small's
// MLP shapes (docs/perf-log.md, "cuBLASLt's GELU epilogues").
//
// D[M, N] = A[M, K] B^T, bf16 operands, f32 accumulation, bf16 results, row-major:
//   - B_MN = false: B is [N, K] (a weight as the forward's fc product reads it);
//   - B_MN = true:  B is [K, N] (proj's weight as its input gradient reads it: dH = dY W2).
// Epilogues (EPI): 0 plain; 1 GELU forward: aux = D + bias (the pre-activation, kept for the
// backward) and out = gelu(aux); 2 GELU backward: out = D * gelu'(aux).
//
// Shape of a block: 128 x 256 output tile, two consumer warpgroups of 64 rows each
// (m64n256k16 wgmma, both operands from shared memory) and one producer warp whose first lane
// issues the TMA copies of 64-deep k-tiles into a ring of STAGES stages (128-byte swizzle),
// full and empty mbarriers between them. Blocks pair up in clusters of two along M: they need
// the same B tile, and each copies half of it into both (TMA multicast), which halves B's
// traffic through L2 (a first form with 128 x 128 tiles and no cluster ran at half cuBLASLt's
// rate, about what L2 can feed it). The epilogue stages the tile in the freed ring and stores
// whole rows.
//
// No CUDA headers: compiled by nvcc in the harness, and by NVRTC for a compile check.

#define GM_BM 128
#define GM_BN 256
#define GM_BK 64
#define GM_CONSUMERS 256        // two warpgroups
#define GM_THREADS (GM_CONSUMERS + 32)
#define GM_A_BYTES (GM_BM * GM_BK * 2)  // A's k-tile: 16 KiB
#define GM_B_BYTES (GM_BN * GM_BK * 2)  // B's: 32 KiB
#define GM_STAGE_BYTES (GM_A_BYTES + GM_B_BYTES)

struct alignas(64) GmTensorMap {
    unsigned long long opaque[16];
};

__device__ __forceinline__ unsigned gm_smem(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void gm_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void gm_mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void gm_mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void gm_mbar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}
__device__ __forceinline__ void gm_tma_2d(unsigned dst, const GmTensorMap* map, int c0, int c1, unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// A shared-memory matrix descriptor with the 128-byte swizzle (layout type 1): start address,
// leading and stride byte offsets, each in 16-byte units.
__device__ __forceinline__ unsigned long long gm_desc(unsigned addr, unsigned lead, unsigned stride) {
    return (unsigned long long)((addr >> 4) & 0x3fffu) | (unsigned long long)((lead >> 4) & 0x3fffu) << 16 |
           (unsigned long long)((stride >> 4) & 0x3fffu) << 32 | 1ull << 62;
}

#define GM_ACC4(n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define GM_ACC16(n) GM_ACC4(n), GM_ACC4(n + 1), GM_ACC4(n + 2), GM_ACC4(n + 3)
#define GM_ACC64(n) GM_ACC16(n), GM_ACC16(n + 4), GM_ACC16(n + 8), GM_ACC16(n + 12)
#define GM_R10(a) "%" #a "0, %" #a "1, %" #a "2, %" #a "3, %" #a "4, %" #a "5, %" #a "6, %" #a "7, " \
    "%" #a "8, %" #a "9, "
#define GM_REGS_0_127                                                                                 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, " GM_R10(1) GM_R10(2) GM_R10(3) GM_R10(4) GM_R10(5)       \
    GM_R10(6) GM_R10(7) GM_R10(8) GM_R10(9) GM_R10(10) GM_R10(11)                                      \
    "%120, %121, %122, %123, %124, %125, %126, %127"

// d (64 x 256, f32) (+)= A (64 x 16, descriptor) * B (16 x 256, descriptor; transposed when
// TRANS_B, i.e. stored N-contiguous), bf16 operands.
template <int TRANS_B>
__device__ __forceinline__ void gm_mma(float (&d)[32][4], unsigned long long da, unsigned long long db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" GM_REGS_0_127 "}, "
        "%128, %129, p, 1, 1, 0, %131;\n}\n"
        : GM_ACC64(0), GM_ACC64(16)
        : "l"(da), "l"(db), "r"(scale_d), "n"(TRANS_B));
}
// Pins the accumulators here: no read of them is moved above the wait before this (ptxas
// otherwise serializes the wgmmas, C7514).
__device__ __forceinline__ void gm_pin(float (&d)[32][4]) {
    #pragma unroll
    for (int i = 0; i < 32; i++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[i][e]) :: "memory");
    }
}
__device__ __forceinline__ void gm_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void gm_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void gm_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// The cluster: this block's rank, an arrival on the mbarrier at the same shared offset in
// block `cta` of the cluster, a TMA copy written to every block of `mask` at the same offset
// (each block's barrier at `bar`'s offset counting its bytes), and the cluster-wide barrier.
__device__ __forceinline__ unsigned gm_cta_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void gm_mbar_arrive_in(unsigned bar, unsigned cta) {
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(cta));
    // The default semantics (release at CTA scope): the releasing warps have only read the
    // stage through wgmma, whose wait already ordered those reads; a release at cluster scope
    // fences every earlier memory access of the warp and stalled the consumers (Nsight
    // Compute: 47% of their cycles waiting on a memory barrier).
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(remote) : "memory");
}
__device__ __forceinline__ void gm_tma_2d_multicast(unsigned dst, const GmTensorMap* map, int c0, int c1,
                                                    unsigned bar, unsigned short mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
        : "memory");
}
__device__ __forceinline__ void gm_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void gm_bar(int id, int threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ unsigned gm_pack(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ float gm_lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float gm_hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }

// GELU's tanh form as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): one exponential and
// one division (tanh(u) = 2 sigmoid(2u) - 1).
#define GM_K0 0.7978845608028654f
#define GM_K1 0.044715f
__device__ __forceinline__ float gm_gelu(float x) {
    const float u2 = 2.0f * GM_K0 * x * fmaf(GM_K1 * x, x, 1.0f);
    return __fdividef(x, 1.0f + __expf(-u2));
}
__device__ __forceinline__ float gm_gelu_grad(float x) {
    const float x2 = x * x;
    const float s = __fdividef(1.0f, 1.0f + __expf(-2.0f * GM_K0 * x * fmaf(GM_K1, x2, 1.0f)));
    // d/dx [x s(2u)] = s + x * 2 s (1 - s) u', u' = K0 (1 + 3 K1 x^2)
    return fmaf(2.0f * x * s * (1.0f - s), GM_K0 * fmaf(3.0f * GM_K1, x2, 1.0f), s);
}

// Staged rows of the epilogue: bf16 rows of 256 (512 bytes) padded by 16 so that a warp's
// accumulator pairs (8 rows x 4 pairs) fall in 32 different banks; f32 rows padded likewise.
#define GM_ROW16 (GM_BN * 2 + 16)
#define GM_ROW32 (GM_BN * 4 + 16)

template <int STAGES, int EPI, int TRANS_B>
__device__ __forceinline__ void gm_gemm(const GmTensorMap* map_a, const GmTensorMap* map_b, const float* bias,
                                        unsigned* out, unsigned* aux, int M, int N, int K) {
    extern __shared__ unsigned char gm_dyn[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];  // full, then empty
    const unsigned base = (gm_smem(gm_dyn) + 1023u) & ~1023u;    // the swizzle's 1024-byte atoms
    unsigned char* const base_ptr = gm_dyn + (base - gm_smem(gm_dyn));
    const unsigned full0 = gm_smem(bars), empty0 = full0 + 8 * STAGES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned rank = gm_cta_rank();
    const int m0 = blockIdx.y * GM_BM, n0 = blockIdx.x * GM_BN;
    const int kt_count = K / GM_BK;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            gm_mbar_init(full0 + 8 * s, 1);
            // Both blocks' consumer warps release a stage: the peer's producer writes half of
            // B into this block's stage too.
            gm_mbar_init(empty0 + 8 * s, 2 * GM_CONSUMERS / 32);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    gm_cluster_sync();
    auto a_tile = [&](int s) { return base + s * GM_STAGE_BYTES; };
    auto b_tile = [&](int s) { return base + s * GM_STAGE_BYTES + GM_A_BYTES; };

    if (warp == GM_CONSUMERS / 32) {
        // Producer: one lane keeps the ring full: its block's A, and its half of B (the same
        // for both blocks of the cluster) multicast to both.
        if (lane == 0) {
            for (int kt = 0; kt < kt_count; kt++) {
                const int s = kt % STAGES;
                if (kt >= STAGES) gm_mbar_wait(empty0 + 8 * s, ((kt / STAGES) - 1) & 1);
                const unsigned full = full0 + 8 * s;
                gm_mbar_expect_tx(full, GM_STAGE_BYTES);
                gm_tma_2d(a_tile(s), map_a, kt * GM_BK, m0, full);
                if (TRANS_B) {
                    // [64 k-rows x 256 n] as four 64-column sub-tiles of 8 KiB; this block's
                    // half is two of them.
                    #pragma unroll
                    for (int i = 0; i < 2; i++) {
                        const int sub = 2 * rank + i;
                        gm_tma_2d_multicast(b_tile(s) + sub * 8192, map_b, n0 + 64 * sub, kt * GM_BK, full, 3);
                    }
                } else {
                    gm_tma_2d_multicast(b_tile(s) + rank * (GM_B_BYTES / 2), map_b, kt * GM_BK,
                                        n0 + rank * (GM_BN / 2), full, 3);
                }
            }
        }
        __syncwarp();
        gm_cluster_sync();
        return;
    }

    const int group = warp >> 2;  // consumer warpgroup: rows 64 group ..
    float d[32][4];  // the first product overwrites it (scale_d 0)
    for (int kt = 0; kt < kt_count; kt++) {
        const int s = kt % STAGES;
        gm_mbar_wait(full0 + 8 * s, (kt / STAGES) & 1);
        gm_fence();
        const unsigned long long da = gm_desc(a_tile(s) + group * 64 * 128, 16, 1024);
        const unsigned long long db =
            TRANS_B ? gm_desc(b_tile(s), 8192, 1024) : gm_desc(b_tile(s), 16, 1024);
        #pragma unroll
        for (int kk = 0; kk < GM_BK / 16; kk++) {
            // A k-step of 16: 32 bytes along a swizzled K-major row; 16 rows (2048 bytes) of
            // an N-contiguous B.
            const unsigned long long db_k = TRANS_B ? db + ((kk * 2048) >> 4) : db + ((kk * 32) >> 4);
            gm_mma<TRANS_B>(d, da + ((kk * 32) >> 4), db_k, (kt | kk) != 0);
        }
        gm_commit();
        gm_wait<1>();
        if (kt > 0 && lane == 0) {
            const unsigned e = empty0 + 8 * ((kt - 1) % STAGES);
            gm_mbar_arrive_in(e, 0);
            gm_mbar_arrive_in(e, 1);
        }
    }
    gm_wait<0>();
    gm_pin(d);
    // Every stage's copies have landed and been read by both warpgroups: the ring is free for
    // the epilogue's staging.
    gm_bar(1, GM_CONSUMERS);

    // Accumulator layout: d[j][0..1] is row rr, columns c, c + 1 and d[j][2..3] row rr + 8,
    // c = 8 j + 2 (lane % 4), rr = 16 (warp % 4) + lane / 4, within the warpgroup's 64 rows.
    const int rr = (warp & 3) * 16 + (lane >> 2);
    const int tid = threadIdx.x & 127;
    const int row0 = m0 + group * 64;
    if (EPI == 2) {
        // The product staged in f32, then out = D * gelu'(aux) by rows of 8 columns a thread.
        unsigned char* st = base_ptr + group * 64 * GM_ROW32;
        #pragma unroll
        for (int j = 0; j < 32; j++) {
            const int c = 8 * j + 2 * (lane & 3);
            #pragma unroll
            for (int h = 0; h < 2; h++)
                *reinterpret_cast<float2*>(st + (rr + 8 * h) * GM_ROW32 + c * 4) =
                    make_float2(d[j][2 * h], d[j][2 * h + 1]);
        }
        gm_bar(2 + group, 128);
        #pragma unroll 4
        for (int it = 0; it < 16; it++) {
            const int r = it * 4 + (tid >> 5), c = (tid & 31) * 8;
            const float4 v0 = *reinterpret_cast<const float4*>(st + r * GM_ROW32 + c * 4);
            const float4 v1 = *reinterpret_cast<const float4*>(st + r * GM_ROW32 + c * 4 + 16);
            const size_t at = ((size_t)(row0 + r) * N + n0 + c) >> 1;
            const uint4 x = *reinterpret_cast<const uint4*>(aux + at);
            uint4 o;
            o.x = gm_pack(v0.x * gm_gelu_grad(gm_lo(x.x)), v0.y * gm_gelu_grad(gm_hi(x.x)));
            o.y = gm_pack(v0.z * gm_gelu_grad(gm_lo(x.y)), v0.w * gm_gelu_grad(gm_hi(x.y)));
            o.z = gm_pack(v1.x * gm_gelu_grad(gm_lo(x.z)), v1.y * gm_gelu_grad(gm_hi(x.z)));
            o.w = gm_pack(v1.z * gm_gelu_grad(gm_lo(x.w)), v1.w * gm_gelu_grad(gm_hi(x.w)));
            *reinterpret_cast<uint4*>(out + at) = o;
        }
    } else {
        // bf16 results staged (the pre-activation in `aux`'s staging, the GELU in `out`'s),
        // then stored a row of 512 bytes a warp.
        unsigned char* st_out = base_ptr + group * 64 * GM_ROW16;
        unsigned char* st_aux = base_ptr + (2 + group) * 64 * GM_ROW16;
        #pragma unroll
        for (int j = 0; j < 32; j++) {
            const int c = 8 * j + 2 * (lane & 3);
            float b0 = 0.0f, b1 = 0.0f;
            if (EPI == 1) {
                b0 = bias[n0 + c];
                b1 = bias[n0 + c + 1];
            }
            #pragma unroll
            for (int h = 0; h < 2; h++) {
                const unsigned q = gm_pack(d[j][2 * h] + b0, d[j][2 * h + 1] + b1);
                const int off = (rr + 8 * h) * GM_ROW16 + c * 2;
                if (EPI == 1) {
                    // The GELU of the stored (rounded) pre-activation, which the backward reads.
                    *reinterpret_cast<unsigned*>(st_aux + off) = q;
                    *reinterpret_cast<unsigned*>(st_out + off) = gm_pack(gm_gelu(gm_lo(q)), gm_gelu(gm_hi(q)));
                } else {
                    *reinterpret_cast<unsigned*>(st_out + off) = q;
                }
            }
        }
        gm_bar(2 + group, 128);
        #pragma unroll 4
        for (int it = 0; it < 16; it++) {
            const int r = it * 4 + (tid >> 5), c = (tid & 31) * 8;
            const size_t at = ((size_t)(row0 + r) * N + n0 + c) >> 1;
            *reinterpret_cast<uint4*>(out + at) = *reinterpret_cast<const uint4*>(st_out + r * GM_ROW16 + c * 2);
            if (EPI == 1)
                *reinterpret_cast<uint4*>(aux + at) = *reinterpret_cast<const uint4*>(st_aux + r * GM_ROW16 + c * 2);
        }
    }
    gm_cluster_sync();
}

#define GM_ENTRY(STAGES, EPI, TRANS_B, NAME)                                                                     \
    extern "C" __global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(GM_THREADS, 1)                        \
        NAME(const __grid_constant__ GmTensorMap map_a, const __grid_constant__ GmTensorMap map_b,               \
             const float* bias, unsigned* out, unsigned* aux, int M, int N, int K) {                             \
        gm_gemm<STAGES, EPI, TRANS_B>(&map_a, &map_b, bias, out, aux, M, N, K);                                   \
    }

// ---------------------------------------------------------------------------------------------
// The persistent form: one cluster of two blocks an SM pair for the whole product, walking its
// share of the tile pairs; the producer runs on into the next tile while the consumers finish
// the last one, and the results leave through TMA stores issued by a store warp, so that a
// tile's output traffic overlaps the next tile's products. The staging (64 KiB: a 128 x 256
// bf16 tile as four 64-column sub-tiles in the 128-byte swizzle that the TMA store reads) sits
// beside a ring of three stages. EPI 1 stages twice a tile (aux, then out); EPI 2 has the store
// warp load the tile's aux into the staging (during the tile's products), and the consumers
// overwrite it in place with the results.

#define GP_STAGING (GM_BM * GM_BN * 2)  // one staged output tile: 64 KiB
// Consumers, then a service warpgroup: the producer warp, the store warp and two idle warps
// (a whole warpgroup, so that setmaxnreg can move its registers to the consumers).
#define GP_THREADS (GM_CONSUMERS + 128)

__device__ __forceinline__ void gm_tma_store_2d(const GmTensorMap* map, int c0, int c1, unsigned src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 :: "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(src) : "memory");
}
__device__ __forceinline__ void gm_bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void gm_bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
__device__ __forceinline__ void gm_bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Byte offset of element (row, col) of a staged 128 x 256 tile: sub-tile col / 64, then the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)).
__device__ __forceinline__ unsigned gp_staged(int row, int col) {
    const int cc = col & 63;
    return (col >> 6) * (GM_BM * 128) + row * 128 + ((((cc >> 3) ^ (row & 7))) << 4) + (cc & 7) * 2;
}

// The barriers of the persistent form: full[S], empty[S], then staged[B], free[B] (EPI 0, 1)
// or aux_full[B] (EPI 2) for the B staging buffers.
struct GpBars {
    unsigned full0, empty0, staged0, free0;
};

// The staged rounds: EPI 1 stages two a tile (aux, then out), the others one. Round r uses
// buffer r % NBUF, for the (r / NBUF)-th time.
template <int EPI> __device__ __forceinline__ int gp_rounds() { return EPI == 1 ? 2 : 1; }

// The service warpgroup's roles (its registers given up to the consumers first): warp 0 the
// producer, warp 1 the store warp, the others idle until the cluster's last barrier.
template <int EPI, int TRANS_B, int STAGES, int NBUF>
__device__ __noinline__ void gp_service(const GmTensorMap* map_a, const GmTensorMap* map_b,
                                        const GmTensorMap* map_out, const GmTensorMap* map_aux, int role, int lane,
                                        unsigned rank, int cluster, int clusters, int pairs, int n_tiles,
                                        int kt_count, unsigned base, unsigned staging, GpBars bars) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    auto tile_of = [&](int p, int& m0, int& n0) {
        n0 = (p % n_tiles) * GM_BN;
        m0 = ((p / n_tiles) * 2 + rank) * GM_BM;
    };
    if (role == 0 && lane == 0) {
        // Producer: its block's A, and its half of B (the same for both blocks of the
        // cluster) multicast to both, tile after tile through one ring.
        int g = 0;
        for (int p = cluster; p < pairs; p += clusters) {
            int m0, n0;
            tile_of(p, m0, n0);
            for (int kt = 0; kt < kt_count; kt++, g++) {
                const int s = g % STAGES;
                if (g >= STAGES) gm_mbar_wait(bars.empty0 + 8 * s, ((g / STAGES) - 1) & 1);
                const unsigned full = bars.full0 + 8 * s;
                const unsigned a_tile = base + s * GM_STAGE_BYTES, b_tile = a_tile + GM_A_BYTES;
                gm_mbar_expect_tx(full, GM_STAGE_BYTES);
                gm_tma_2d(a_tile, map_a, kt * GM_BK, m0, full);
                if (TRANS_B) {
                    #pragma unroll
                    for (int i = 0; i < 2; i++) {
                        const int sub = 2 * rank + i;
                        gm_tma_2d_multicast(b_tile + sub * 8192, map_b, n0 + 64 * sub, kt * GM_BK, full, 3);
                    }
                } else {
                    gm_tma_2d_multicast(b_tile + rank * (GM_B_BYTES / 2), map_b, kt * GM_BK, n0 + rank * (GM_BN / 2),
                                        full, 3);
                }
            }
        }
    }
    if (role == 1 && lane == 0) {
        // Store warp: each staged round out through the TMA unit. A buffer is handed back once
        // its copy has read it (for EPI 2: refilled with the aux of the tile that uses it next),
        // with NBUF - 1 newer copies still allowed to run.
        auto load_aux = [&](int p, int b) {
            int m0, n0;
            tile_of(p, m0, n0);
            const unsigned bar = bars.free0 + 8 * b;
            gm_mbar_expect_tx(bar, GP_STAGING);
            #pragma unroll
            for (int i = 0; i < GM_BN / 64; i++)
                gm_tma_2d(staging + b * GP_STAGING + i * (GM_BM * 128), map_aux, n0 + 64 * i, m0, bar);
        };
        for (int b = 0; b < NBUF; b++) {
            if (EPI == 2) {
                if (cluster + b * clusters < pairs) load_aux(cluster + b * clusters, b);
            } else {
                gm_mbar_arrive(bars.free0 + 8 * b);
            }
        }
        int round = 0;
        for (int p = cluster; p < pairs; p += clusters) {
            int m0, n0;
            tile_of(p, m0, n0);
            for (int r = 0; r < gp_rounds<EPI>(); r++, round++) {
                const int b = round % NBUF;
                gm_mbar_wait(bars.staged0 + 8 * b, (round / NBUF) & 1);
                const GmTensorMap* map = (EPI == 1 && r == 0) ? map_aux : map_out;
                #pragma unroll
                for (int i = 0; i < GM_BN / 64; i++)
                    gm_tma_store_2d(map, n0 + 64 * i, m0, staging + b * GP_STAGING + i * (GM_BM * 128));
                gm_bulk_commit();
                // The oldest buffer still being read: round + 1 - NBUF's.
                gm_bulk_wait_read<NBUF - 1>();
                const int done = round + 1 - NBUF;
                if (done >= 0) {
                    const int db = done % NBUF;
                    if (EPI == 2) {
                        // Buffer db next serves tile (done + NBUF) of this cluster.
                        const int next = cluster + (done + NBUF) * clusters;
                        if (next < pairs) load_aux(next, db);
                    } else {
                        gm_mbar_arrive(bars.free0 + 8 * db);
                    }
                }
            }
        }
        gm_bulk_wait();
    }
    __syncwarp();
    gm_cluster_sync();
}

template <int EPI, int TRANS_B, int STAGES, int NBUF>
__device__ __forceinline__ void gp_gemm(const GmTensorMap* map_a, const GmTensorMap* map_b, const GmTensorMap* map_out,
                                        const GmTensorMap* map_aux, const float* bias, int M, int N, int K) {
    extern __shared__ unsigned char gm_dyn[];
    __shared__ __align__(8) unsigned long long bar_words[2 * STAGES + 2 * NBUF];
    const unsigned base = (gm_smem(gm_dyn) + 1023u) & ~1023u;
    unsigned char* const base_ptr = gm_dyn + (base - gm_smem(gm_dyn));
    const unsigned staging = base + STAGES * GM_STAGE_BYTES;
    unsigned char* const staging_ptr = base_ptr + STAGES * GM_STAGE_BYTES;
    GpBars bars;
    bars.full0 = gm_smem(bar_words);
    bars.empty0 = bars.full0 + 8 * STAGES;
    bars.staged0 = bars.empty0 + 8 * STAGES;
    bars.free0 = bars.staged0 + 8 * NBUF;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned rank = gm_cta_rank();
    const int clusters = gridDim.y >> 1, cluster = blockIdx.y >> 1;
    const int n_tiles = N / GM_BN, pairs = n_tiles * (M / (2 * GM_BM));
    const int kt_count = K / GM_BK;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            gm_mbar_init(bars.full0 + 8 * s, 1);
            // Both blocks' consumer warps release a stage: the peer's producer writes half of
            // B into this block's stage too.
            gm_mbar_init(bars.empty0 + 8 * s, 2 * GM_CONSUMERS / 32);
        }
        for (int b = 0; b < NBUF; b++) {
            gm_mbar_init(bars.staged0 + 8 * b, GM_CONSUMERS / 32);
            gm_mbar_init(bars.free0 + 8 * b, 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    gm_cluster_sync();
    if (warp >= GM_CONSUMERS / 32) {
        gp_service<EPI, TRANS_B, STAGES, NBUF>(map_a, map_b, map_out, map_aux, warp - GM_CONSUMERS / 32, lane, rank,
                                               cluster, clusters, pairs, n_tiles, kt_count, base, staging, bars);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");

    const int group = warp >> 2;
    const int rr = (warp & 3) * 16 + (lane >> 2);
    int g = 0, round = 0;
    for (int p = cluster; p < pairs; p += clusters) {
        const int n0 = (p % n_tiles) * GM_BN;
        // Zeroed here rather than by the first product's scale-d: with a run-time scale-d
        // the accumulators stay live through the epilogue and ptxas spills them.
        float d[32][4];
        #pragma unroll
        for (int j = 0; j < 32; j++) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.0f;
        for (int kt = 0; kt < kt_count; kt++, g++) {
            const int s = g % STAGES;
            gm_mbar_wait(bars.full0 + 8 * s, (g / STAGES) & 1);
            gm_fence();
            const unsigned a_tile = base + s * GM_STAGE_BYTES, b_tile = a_tile + GM_A_BYTES;
            const unsigned long long da = gm_desc(a_tile + group * 64 * 128, 16, 1024);
            const unsigned long long db = TRANS_B ? gm_desc(b_tile, 8192, 1024) : gm_desc(b_tile, 16, 1024);
            #pragma unroll
            for (int kk = 0; kk < GM_BK / 16; kk++) {
                const unsigned long long db_k = TRANS_B ? db + ((kk * 2048) >> 4) : db + ((kk * 32) >> 4);
                gm_mma<TRANS_B>(d, da + ((kk * 32) >> 4), db_k, 1);
            }
            gm_commit();
            gm_wait<1>();
            if (kt > 0 && lane == 0) {
                const unsigned e = bars.empty0 + 8 * ((g - 1) % STAGES);
                gm_mbar_arrive_in(e, 0);
                gm_mbar_arrive_in(e, 1);
            }
        }
        gm_wait<0>();
        gm_pin(d);
        if (lane == 0) {
            const unsigned e = bars.empty0 + 8 * ((g - 1) % STAGES);
            gm_mbar_arrive_in(e, 0);
            gm_mbar_arrive_in(e, 1);
        }
        // Epilogue: d[j][0..1] is row rr, columns c, c + 1 and d[j][2..3] row rr + 8 of the
        // warpgroup's 64 rows, c = 8 j + 2 (lane % 4).
        for (int r = 0; r < gp_rounds<EPI>(); r++, round++) {
            const int b = round % NBUF;
            gm_mbar_wait(bars.free0 + 8 * b, (round / NBUF) & 1);
            unsigned char* const buf = staging_ptr + b * GP_STAGING;
            #pragma unroll
            for (int j = 0; j < 32; j++) {
                const int c = 8 * j + 2 * (lane & 3);
                float b0 = 0.0f, b1 = 0.0f;
                if (EPI == 1) {
                    b0 = bias[n0 + c];
                    b1 = bias[n0 + c + 1];
                }
                #pragma unroll
                for (int h = 0; h < 2; h++) {
                    unsigned* at = reinterpret_cast<unsigned*>(buf + gp_staged(group * 64 + rr + 8 * h, c));
                    if (EPI == 2) {
                        const unsigned x = *at;
                        *at = gm_pack(d[j][2 * h] * gm_gelu_grad(gm_lo(x)), d[j][2 * h + 1] * gm_gelu_grad(gm_hi(x)));
                    } else {
                        const unsigned q = gm_pack(d[j][2 * h] + b0, d[j][2 * h + 1] + b1);
                        *at = (EPI == 1 && r == 1) ? gm_pack(gm_gelu(gm_lo(q)), gm_gelu(gm_hi(q))) : q;
                    }
                }
            }
            // The staging's generic writes, seen by the TMA unit's reads; then this warp's
            // arrival (its lanes' writes ordered before it by the warp barrier).
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncwarp();
            if (lane == 0) gm_mbar_arrive(bars.staged0 + 8 * b);
        }
    }
    gm_cluster_sync();
}

#define GP_ENTRY(EPI, TRANS_B, STAGES, NBUF, NAME)                                                               \
    extern "C" __global__ void __cluster_dims__(1, 2, 1) __launch_bounds__(GP_THREADS, 1)                        \
        NAME(const __grid_constant__ GmTensorMap map_a, const __grid_constant__ GmTensorMap map_b,               \
             const __grid_constant__ GmTensorMap map_out, const __grid_constant__ GmTensorMap map_aux,           \
             const float* bias, int M, int N, int K) {                                                           \
        gp_gemm<EPI, TRANS_B, STAGES, NBUF>(&map_a, &map_b, &map_out, &map_aux, bias, M, N, K);                  \
    }
GP_ENTRY(0, 0, 3, 1, gemm_tn_plain_persistent)
GP_ENTRY(1, 0, 3, 1, gemm_tn_gelu_persistent)
GP_ENTRY(1, 0, 2, 2, gemm_tn_gelu_persistent_b2)
GP_ENTRY(0, 1, 3, 1, gemm_nn_plain_persistent)
GP_ENTRY(2, 1, 3, 1, gemm_nn_dgelu_persistent)
GP_ENTRY(2, 1, 2, 2, gemm_nn_dgelu_persistent_b2)

GM_ENTRY(4, 0, 0, gemm_tn_plain_s4)
GM_ENTRY(4, 1, 0, gemm_tn_gelu_s4)
GM_ENTRY(4, 0, 1, gemm_nn_plain_s4)
GM_ENTRY(4, 2, 1, gemm_nn_dgelu_s4)
