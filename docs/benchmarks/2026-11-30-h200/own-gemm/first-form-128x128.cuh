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
// Shape of a block: 128 x 128 output tile, two consumer warpgroups of 64 rows each
// (m64n128k16 wgmma, both operands from shared memory) and one producer warp whose first lane
// issues the TMA copies of 64-deep k-tiles into a ring of STAGES stages (128-byte swizzle),
// full and empty mbarriers between them. With three stages (96 KiB) two blocks share an SM,
// so one block's epilogue runs while the other's products hold the tensor cores.
//
// No CUDA headers: compiled by nvcc in the harness, and by NVRTC for a compile check.

#define GM_BM 128
#define GM_BN 128
#define GM_BK 64
#define GM_CONSUMERS 256        // two warpgroups
#define GM_THREADS (GM_CONSUMERS + 32)
#define GM_TILE_BYTES (GM_BM * GM_BK * 2)  // one operand's k-tile: 16 KiB (A; B the same)

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

// d (64 x 128, f32) (+)= A (64 x 16, descriptor) * B (16 x 128, descriptor; transposed when
// TRANS_B, i.e. stored N-contiguous), bf16 operands.
template <int TRANS_B>
__device__ __forceinline__ void gm_mma(float (&d)[16][4], unsigned long long da, unsigned long long db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, 0, %67;\n}\n"
        : GM_ACC16(0), GM_ACC16(4), GM_ACC16(8), GM_ACC16(12)
        : "l"(da), "l"(db), "r"(scale_d), "n"(TRANS_B));
}
__device__ __forceinline__ void gm_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void gm_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void gm_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
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

template <int STAGES, int EPI, int TRANS_B>
__device__ __forceinline__ void gm_gemm(const GmTensorMap* map_a, const GmTensorMap* map_b, const float* bias,
                                        unsigned* out, unsigned* aux, int M, int N, int K) {
    extern __shared__ unsigned char gm_dyn[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];  // full, then empty
    const unsigned base = (gm_smem(gm_dyn) + 1023u) & ~1023u;    // the swizzle's 1024-byte atoms
    const unsigned full0 = gm_smem(bars), empty0 = full0 + 8 * STAGES;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int m0 = blockIdx.y * GM_BM, n0 = blockIdx.x * GM_BN;
    const int kt_count = K / GM_BK;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            gm_mbar_init(full0 + 8 * s, 1);
            gm_mbar_init(empty0 + 8 * s, GM_CONSUMERS / 32);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto a_tile = [&](int s) { return base + s * 2 * GM_TILE_BYTES; };
    auto b_tile = [&](int s) { return base + s * 2 * GM_TILE_BYTES + GM_TILE_BYTES; };

    if (warp == GM_CONSUMERS / 32) {
        // Producer: one lane keeps the ring full.
        if (lane == 0) {
            for (int kt = 0; kt < kt_count; kt++) {
                const int s = kt % STAGES;
                if (kt >= STAGES) gm_mbar_wait(empty0 + 8 * s, ((kt / STAGES) - 1) & 1);
                const unsigned full = full0 + 8 * s;
                gm_mbar_expect_tx(full, 2 * GM_TILE_BYTES);
                gm_tma_2d(a_tile(s), map_a, kt * GM_BK, m0, full);
                if (TRANS_B) {
                    // [64 k-rows x 128 n] as two 64-column sub-tiles of 8 KiB.
                    gm_tma_2d(b_tile(s), map_b, n0, kt * GM_BK, full);
                    gm_tma_2d(b_tile(s) + GM_TILE_BYTES / 2, map_b, n0 + 64, kt * GM_BK, full);
                } else {
                    gm_tma_2d(b_tile(s), map_b, kt * GM_BK, n0, full);
                }
            }
        }
        return;
    }

    const int group = warp >> 2;  // consumer warpgroup: rows 64 group ..
    float d[16][4];
    #pragma unroll
    for (int j = 0; j < 16; j++) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.0f;
    for (int kt = 0; kt < kt_count; kt++) {
        const int s = kt % STAGES;
        gm_mbar_wait(full0 + 8 * s, (kt / STAGES) & 1);
        gm_fence();
        const unsigned long long da = gm_desc(a_tile(s) + group * 64 * 128, 16, 1024);
        const unsigned long long db =
            TRANS_B ? gm_desc(b_tile(s), GM_TILE_BYTES / 2, 1024) : gm_desc(b_tile(s), 16, 1024);
        #pragma unroll
        for (int kk = 0; kk < GM_BK / 16; kk++) {
            // A k-step of 16: 32 bytes along a swizzled K-major row; 16 rows (2048 bytes) of
            // an N-contiguous B.
            const unsigned long long db_k = TRANS_B ? db + ((kk * 2048) >> 4) : db + ((kk * 32) >> 4);
            gm_mma<TRANS_B>(d, da + ((kk * 32) >> 4), db_k, (kt | kk) != 0);
        }
        gm_commit();
        gm_wait<1>();
        if (kt > 0 && lane == 0) gm_mbar_arrive(empty0 + 8 * ((kt - 1) % STAGES));
    }
    gm_wait<0>();

    // Epilogue straight from the accumulators: d[j][0..1] is row r, columns c, c + 1 and
    // d[j][2..3] row r + 8, c = 8 j + 2 (lane % 4), r = 16 (warp % 4) + lane / 4.
    const int r = m0 + group * 64 + (warp & 3) * 16 + (lane >> 2);
    #pragma unroll
    for (int j = 0; j < 16; j++) {
        const int c = n0 + 8 * j + 2 * (lane & 3);
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            const size_t at = ((size_t)(r + 8 * h) * N + c) >> 1;  // in bf16 pairs
            float v0 = d[j][2 * h], v1 = d[j][2 * h + 1];
            if (EPI == 1) {
                v0 += bias[c];
                v1 += bias[c + 1];
                // The backward reads the stored (rounded) pre-activation; so does this GELU,
                // as a separate GELU over the stored aux would.
                const unsigned q = gm_pack(v0, v1);
                aux[at] = q;
                out[at] = gm_pack(gm_gelu(gm_lo(q)), gm_gelu(gm_hi(q)));
            } else if (EPI == 2) {
                const unsigned x = aux[at];
                out[at] = gm_pack(v0 * gm_gelu_grad(gm_lo(x)), v1 * gm_gelu_grad(gm_hi(x)));
            } else {
                out[at] = gm_pack(v0, v1);
            }
        }
    }
}

#define GM_ENTRY(STAGES, EPI, TRANS_B, NAME)                                                                     \
    extern "C" __global__ void __maxnreg__(STAGES <= 3 ? 112 : 168)                                              \
        NAME(const __grid_constant__ GmTensorMap map_a, const __grid_constant__ GmTensorMap map_b,               \
             const float* bias, unsigned* out, unsigned* aux, int M, int N, int K) {                             \
        gm_gemm<STAGES, EPI, TRANS_B>(&map_a, &map_b, bias, out, aux, M, N, K);                                   \
    }

GM_ENTRY(3, 0, 0, gemm_tn_plain_s3)
GM_ENTRY(4, 0, 0, gemm_tn_plain_s4)
GM_ENTRY(3, 1, 0, gemm_tn_gelu_s3)
GM_ENTRY(4, 1, 0, gemm_tn_gelu_s4)
GM_ENTRY(3, 0, 1, gemm_nn_plain_s3)
GM_ENTRY(3, 2, 1, gemm_nn_dgelu_s3)
GM_ENTRY(4, 2, 1, gemm_nn_dgelu_s4)
