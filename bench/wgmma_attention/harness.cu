// Checks and times the Hopper (wgmma) attention forward against the mma.sync forward and a
// CPU reference, outside the engine: the kernels' sources are included as the engine's
// program compiles them (common.cuh first), with their entry points instantiated here.
//
// Correctness: small shapes (T not a multiple of any tile, windows 0, 1, 37, 64 and 300), each
// head vector's largest |error| over its own largest |value| (the selftest's per-head measure),
// and the log-sum-exp's absolute error; each two-warpgroup configuration is also compared bit for
// bit with the one-warpgroup one of its key tile. Timing: cudaEvent around single launches,
// median of many. Exits with 2 when a check exceeds its bound or a configuration spills.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
#include <algorithm>
#include <random>
#include <string>

#ifdef KILN_HARNESS_TMA
#include <cuda.h>  // cuTensorMapEncodeTiled (link with -lcuda)
#endif
#include "../../src/engine/cuda/common.cuh"
#include "../../src/engine/cuda/attention_tc.cu"
#include "../../src/engine/cuda/attention_wgmma.cu"

TC_ENTRY_POINTS(64, TcBf16, bf16)
TC_ENTRY_POINTS(64, TcF16, f16)
TC_ENTRY_POINTS(128, TcBf16, bf16)
TC_ENTRY_POINTS(128, TcF16, f16)
// Configurations of the Hopper forward (WgShape: head size, key tile, warpgroups a block, Q in
// shared memory). The engine's (WgForward) are marked in the table below; 128 keys with one
// warpgroup and Q in registers at head size 128 would spill.
WG_ENTRY_POINT(64, 64, 1, false, WgBf16, wg_bf16_hs64_n64)
WG_ENTRY_POINT(64, 64, 1, false, WgF16, wg_f16_hs64_n64)
WG_ENTRY_POINT(64, 128, 1, false, WgBf16, wg_bf16_hs64_n128)
WG_ENTRY_POINT(64, 128, 1, false, WgF16, wg_f16_hs64_n128)
WG_ENTRY_POINT(64, 64, 2, true, WgBf16, wg_bf16_hs64_n64_g2q)
WG_ENTRY_POINT(64, 64, 2, true, WgF16, wg_f16_hs64_n64_g2q)
WG_ENTRY_POINT(64, 128, 2, true, WgBf16, wg_bf16_hs64_n128_g2q)
WG_ENTRY_POINT(64, 128, 2, true, WgF16, wg_f16_hs64_n128_g2q)
WG_ENTRY_POINT(128, 64, 1, false, WgBf16, wg_bf16_hs128_n64)
WG_ENTRY_POINT(128, 64, 1, false, WgF16, wg_f16_hs128_n64)
WG_ENTRY_POINT(128, 64, 2, false, WgBf16, wg_bf16_hs128_n64_g2)
WG_ENTRY_POINT(128, 64, 2, false, WgF16, wg_f16_hs128_n64_g2)
WG_ENTRY_POINT(128, 64, 2, true, WgBf16, wg_bf16_hs128_n64_g2q)
WG_ENTRY_POINT(128, 64, 2, true, WgF16, wg_f16_hs128_n64_g2q)
WG_ENTRY_POINT(128, 128, 2, true, WgBf16, wg_bf16_hs128_n128_g2q)
WG_ENTRY_POINT(128, 128, 2, true, WgF16, wg_f16_hs128_n128_g2q)
// Two stages (K_{j+1} and V_j copied in step j), so that three one-warpgroup blocks fit an SM.
WG_STAGES_ENTRY_POINT(64, 64, 1, false, 2, WgBf16, wg_bf16_hs64_n64_s2)
WG_STAGES_ENTRY_POINT(64, 64, 1, false, 2, WgF16, wg_f16_hs64_n64_s2)
WG_STAGES_ENTRY_POINT(128, 64, 1, false, 2, WgBf16, wg_bf16_hs128_n64_s2)
WG_STAGES_ENTRY_POINT(128, 64, 1, false, 2, WgF16, wg_f16_hs128_n64_s2)
WG_STAGES_ENTRY_POINT(128, 64, 1, true, 2, WgBf16, wg_bf16_hs128_n64_s2q)
WG_STAGES_ENTRY_POINT(128, 64, 1, true, 2, WgF16, wg_f16_hs128_n64_s2q)
#ifdef KILN_HARNESS_TMA
// The one-warpgroup forward with its K and V tiles copied by the TMA unit (wg_forward's TMA).
WG_TMA_ENTRY_POINT(64, 64, WgBf16, wg_bf16_hs64_n64_tma)
WG_TMA_ENTRY_POINT(64, 64, WgF16, wg_f16_hs64_n64_tma)
WG_TMA_ENTRY_POINT(128, 64, WgBf16, wg_bf16_hs128_n64_tma)
WG_TMA_ENTRY_POINT(128, 64, WgF16, wg_f16_hs128_n64_tma)
// The persistent warp-specialised forward (WgPersistShape: head size, key tile, stages; pp:
// the consumers' products in turn; c3: three consumer warpgroups, 192 queries), one block an
// SM.
WG_PERSIST_ENTRY_POINT(128, 128, 2, true, 2, WgBf16, wp_bf16_hs128_n128_s2_pp)
WG_PERSIST_ENTRY_POINT(128, 128, 2, true, 2, WgF16, wp_f16_hs128_n128_s2_pp)
WG_PERSIST_ENTRY_POINT(128, 128, 2, false, 2, WgBf16, wp_bf16_hs128_n128_s2)
WG_PERSIST_ENTRY_POINT(64, 128, 3, true, 2, WgBf16, wp_bf16_hs64_n128_s3_pp)
WG_PERSIST_ENTRY_POINT(64, 128, 2, true, 3, WgBf16, wp_bf16_hs64_n128_s2_pp_c3)
WG_PERSIST_ENTRY_POINT(64, 128, 2, true, 3, WgF16, wp_f16_hs64_n128_s2_pp_c3)
WG_PERSIST_ENTRY_POINT(64, 128, 3, true, 3, WgBf16, wp_bf16_hs64_n128_s3_pp_c3)
WG_PERSIST_ENTRY_POINT(64, 128, 2, false, 3, WgBf16, wp_bf16_hs64_n128_s2_c3)
WG_PERSIST_ENTRY_POINT(64, 64, 4, true, 3, WgBf16, wp_bf16_hs64_n64_s4_pp_c3)
WG_PERSIST_ENTRY_POINT(128, 64, 2, true, 3, WgBf16, wp_bf16_hs128_n64_s2_pp_c3)
WG_PERSIST_ENTRY_POINT(128, 64, 3, true, 3, WgBf16, wp_bf16_hs128_n64_s3_pp_c3)
WG_PERSIST_ENTRY_POINT(128, 64, 3, true, 3, WgF16, wp_f16_hs128_n64_s3_pp_c3)
// The engine's persistent forwards with the other work orders (WG_ORDER_*: `_snake`, `_sec`).
WG_PERSIST_ORDER_ENTRY_POINT(64, 128, 2, true, 3, WG_ORDER_SNAKE, WgBf16, wp_bf16_hs64_n128_s2_pp_c3_snake)
WG_PERSIST_ORDER_ENTRY_POINT(64, 128, 2, true, 3, WG_ORDER_SNAKE, WgF16, wp_f16_hs64_n128_s2_pp_c3_snake)
WG_PERSIST_ORDER_ENTRY_POINT(64, 128, 2, true, 3, WG_ORDER_SECTIONS, WgBf16, wp_bf16_hs64_n128_s2_pp_c3_sec)
WG_PERSIST_ORDER_ENTRY_POINT(128, 128, 2, true, 2, WG_ORDER_SNAKE, WgBf16, wp_bf16_hs128_n128_s2_pp_snake)
WG_PERSIST_ORDER_ENTRY_POINT(128, 128, 2, true, 2, WG_ORDER_SNAKE, WgF16, wp_f16_hs128_n128_s2_pp_snake)
WG_PERSIST_ORDER_ENTRY_POINT(128, 128, 2, true, 2, WG_ORDER_SECTIONS, WgBf16, wp_bf16_hs128_n128_s2_pp_sec)
#endif
// The configurations marked [engine] below are WgForward's.
static_assert(WgForward<64>::keys == 64 && WgForward<64>::groups == 1 && !WgForward<64>::q_shared, "engine hs 64");
static_assert(WgForward<128>::keys == 64 && WgForward<128>::groups == 1 && !WgForward<128>::q_shared, "engine hs 128");

#define CK(x)                                                                              \
    do {                                                                                   \
        cudaError_t e_ = (x);                                                              \
        if (e_ != cudaSuccess) {                                                           \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

typedef void (*Fwd)(const void*, void*, float*, int, int, int, int);

struct Kernel {
    const char* name;
    Fwd f;
    int hs, rows, shared;
    bool f16;
    int threads;  // 128 a warpgroup
    int keys;     // key tile (0: the mma.sync forward)
    bool engine;  // the configuration the engine launches on sm_90
    bool g1_variant = false;  // a one-warpgroup variant (two stages, TMA): compared with n<keys> g1 bit for bit
    bool tma = false;         // takes a tensor map of qkv as its last parameter (KILN_HARNESS_TMA)
    bool persistent = false;  // one block an SM walking the work tiles; B x NH after the map
};

// IEEE half by hand (round to nearest even, overflow to inf; the inputs here are small).
static float f16_to_f32(unsigned short h) {
    const unsigned sign = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) v = std::ldexp((float)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = std::ldexp((float)(m | 1024), (int)e - 25);
    return sign ? -v : v;
}
static unsigned short f32_to_f16(float x) {
    const unsigned short sign = std::signbit(x) ? 0x8000 : 0;
    const float a = std::fabs(x);
    if (a >= 65520.0f) return sign | 0x7c00;
    if (a < std::ldexp(1.0f, -14)) {  // subnormal: units of 2^-24
        return sign | (unsigned short)std::nearbyint(a * std::ldexp(1.0f, 24));
    }
    int e;
    std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1)
    const float unit = std::ldexp(1.0f, e - 11);  // 11 significant bits
    const float r = std::nearbyint(a / unit) * unit;  // ties to even (default rounding mode)
    int e2;
    const float f = std::frexp(r, &e2);
    const unsigned m = (unsigned)std::ldexp(f, 11) & 1023;
    return sign | (unsigned short)((e2 + 14) << 10) | m;
}
static unsigned short to_bits(float x, bool f16) {
    if (!f16) {
        unsigned u;
        memcpy(&u, &x, 4);
        return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return f32_to_f16(x);
}
static float from_bits(unsigned short b, bool f16) {
    if (!f16) {
        unsigned u = (unsigned)b << 16;
        float r;
        memcpy(&r, &u, 4);
        return r;
    }
    return f16_to_f32(b);
}

// Reference forward in double from the rounded inputs: out [B, T, C], lse [B*NH, T].
static void cpu_forward(const std::vector<float>& qkv, int B, int T, int NH, int HS, int W,
                        std::vector<float>& out, std::vector<float>& lse) {
    const int C = NH * HS;
    out.assign((size_t)B * T * C, 0.0f);
    lse.assign((size_t)B * NH * T, 0.0f);
    const double scale = 1.0 / std::sqrt((double)HS);
    std::vector<double> sc(T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int i = 0; i < T; i++) {
                const float* q = &qkv[((size_t)b * T + i) * 3 * C + h * HS];
                int j0 = W > 0 ? std::max(0, i - W + 1) : 0;
                double mx = -1e300;
                for (int j = j0; j <= i; j++) {
                    const float* k = &qkv[((size_t)b * T + j) * 3 * C + C + h * HS];
                    double d = 0;
                    for (int e = 0; e < HS; e++) d += (double)q[e] * k[e];
                    sc[j] = d * scale;
                    mx = std::max(mx, sc[j]);
                }
                double sum = 0;
                for (int j = j0; j <= i; j++) sum += std::exp(sc[j] - mx);
                float* o = &out[((size_t)b * T + i) * C + h * HS];
                std::vector<double> acc(HS, 0.0);
                for (int j = j0; j <= i; j++) {
                    const double p = std::exp(sc[j] - mx) / sum;
                    const float* v = &qkv[((size_t)b * T + j) * 3 * C + 2 * C + h * HS];
                    for (int e = 0; e < HS; e++) acc[e] += p * v[e];
                }
                for (int e = 0; e < HS; e++) o[e] = (float)acc[e];
                lse[((size_t)b * NH + h) * T + i] = (float)(mx + std::log(sum));
            }
}

// Largest per-head-vector error over the vector's largest |value| (floored at 1% of the
// buffer's largest), as the selftest measures 16-bit attention.
static double err_per_head(const std::vector<float>& got, const std::vector<float>& want, int HS) {
    double big = 0;
    for (float w : want) big = std::max(big, (double)std::fabs(w));
    double worst = 0;
    for (size_t v = 0; v < want.size(); v += HS) {
        double own = 0, e = 0;
        for (int i = 0; i < HS; i++) {
            own = std::max(own, (double)std::fabs(want[v + i]));
            const double d = std::fabs((double)got[v + i] - want[v + i]);
            e = std::max(e, std::isfinite(got[v + i]) ? d : INFINITY);
        }
        worst = std::max(worst, e / std::max(own, 0.01 * big));
    }
    return worst;
}
static double err_abs(const std::vector<float>& got, const std::vector<float>& want) {
    double worst = 0;
    for (size_t i = 0; i < want.size(); i++) {
        const double d = std::fabs((double)got[i] - want[i]);
        worst = std::max(worst, std::isfinite(got[i]) ? d : INFINITY);
    }
    return worst;
}

static int sm_count = 0;
static void launch(const Kernel& k, const void* qkv, void* out, float* lse, int B, int T, int NH, int W) {
    dim3 grid((T + k.rows - 1) / k.rows, B * NH);
    int C = NH * k.hs;
    int BNH = B * NH;
    if (k.persistent) grid = dim3(std::min(grid.x * grid.y, (unsigned)sm_count));
    WgTensorMap map;
    void* args[] = {(void*)&qkv, (void*)&out, (void*)&lse, (void*)&T, (void*)&C, (void*)&NH, (void*)&W, (void*)&map,
                    (void*)&BNH};
#ifdef KILN_HARNESS_TMA
    if (k.tma) {
        // qkv as [B][T][3C], boxes of 64 columns (128 bytes, the swizzle's span) by the key tile.
        static_assert(sizeof(CUtensorMap) == sizeof(WgTensorMap), "the driver's tensor map");
        CUtensorMap m;
        const cuuint64_t dims[3] = {(cuuint64_t)3 * C, (cuuint64_t)T, (cuuint64_t)B};
        const cuuint64_t strides[2] = {(cuuint64_t)3 * C * 2, (cuuint64_t)T * 3 * C * 2};
        const cuuint32_t box[3] = {64, (cuuint32_t)k.keys, 1};
        const cuuint32_t unit[3] = {1, 1, 1};
        const CUresult r = cuTensorMapEncodeTiled(
            &m, k.f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(qkv),
            dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
        if (r != CUDA_SUCCESS) {
            fprintf(stderr, "cuTensorMapEncodeTiled failed (%d) for %s\n", (int)r, k.name);
            exit(1);
        }
        memcpy(&map, &m, sizeof(map));
    }
#endif
    CK(cudaLaunchKernel((const void*)k.f, grid, dim3(k.threads), args, k.shared, 0));
}

struct Run {
    std::vector<float> out, lse;
};
static Run run_once(const Kernel& k, const std::vector<unsigned short>& bits, int B, int T, int NH, int W) {
    const int C = NH * k.hs;
    void *dq, *dout;
    float* dl;
    CK(cudaMalloc(&dq, bits.size() * 2));
    CK(cudaMalloc(&dout, (size_t)B * T * C * 2));
    CK(cudaMalloc(&dl, (size_t)B * NH * T * 4));
    CK(cudaMemcpy(dq, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemset(dout, 0xff, (size_t)B * T * C * 2));  // NaN where nothing is written
    CK(cudaMemset(dl, 0xff, (size_t)B * NH * T * 4));
    launch(k, dq, dout, dl, B, T, NH, W);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<unsigned short> ob((size_t)B * T * C);
    Run r;
    r.lse.resize((size_t)B * NH * T);
    CK(cudaMemcpy(ob.data(), dout, ob.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(r.lse.data(), dl, r.lse.size() * 4, cudaMemcpyDeviceToHost));
    r.out.resize(ob.size());
    for (size_t i = 0; i < ob.size(); i++) r.out[i] = from_bits(ob[i], k.f16);
    CK(cudaFree(dq));
    CK(cudaFree(dout));
    CK(cudaFree(dl));
    return r;
}

static float time_us(const Kernel& k, int B, int T, int NH, int reps) {
    const int C = NH * k.hs;
    const size_t n = (size_t)B * T * 3 * C;
    std::vector<unsigned short> bits(n);
    std::mt19937 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (size_t i = 0; i < n; i++) bits[i] = to_bits(nd(rng), k.f16);
    void *dq, *dout;
    float* dl;
    CK(cudaMalloc(&dq, n * 2));
    CK(cudaMalloc(&dout, (size_t)B * T * C * 2));
    CK(cudaMalloc(&dl, (size_t)B * NH * T * 4));
    CK(cudaMemcpy(dq, bits.data(), n * 2, cudaMemcpyHostToDevice));
    for (int i = 0; i < 5; i++) launch(k, dq, dout, dl, B, T, NH, 0);
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    std::vector<float> ts;
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a));
        launch(k, dq, dout, dl, B, T, NH, 0);
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms;
        CK(cudaEventElapsedTime(&ms, a, b));
        ts.push_back(ms * 1000.0f);
    }
    CK(cudaGetLastError());
    std::sort(ts.begin(), ts.end());
    CK(cudaFree(dq));
    CK(cudaFree(dout));
    CK(cudaFree(dl));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return ts[ts.size() / 2];
}

int main(int argc, char** argv) {
    const bool quick = argc > 1 && !strcmp(argv[1], "quick");
    // `profile NAME`: only NAME, launched 6 times at B 8, T 4096 (12 heads of 64 or 16 of 128),
    // no checks, for a profiler (ncu.sh takes the sixth launch).
    const char* profile = argc > 2 && !strcmp(argv[1], "profile") ? argv[2] : nullptr;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    sm_count = prop.multiProcessorCount;
#define WG(NAME, HS, N, G, QS, F16, ENGINE) \
    {#NAME, (Fwd)NAME, HS, G * 64, WgShape<HS, N, G, QS>::bytes, F16, G * 128, N, ENGINE}
#define WG2(NAME, HS, N, QS, F16) \
    {#NAME, (Fwd)NAME, HS, 64, WgShape<HS, N, 1, QS, 2>::bytes, F16, 128, N, false, true}
#define WGT(NAME, HS, N, F16) \
    {#NAME, (Fwd)NAME, HS, 64, WgShape<HS, N, 1, false>::bytes, F16, 128, N, false, true, true}
#define WP(NAME, HS, N, ST, CONS, F16)                                                                   \
    {#NAME, (Fwd)NAME, HS, WgPersistShape<HS, N, ST, CONS>::rows, WgPersistShape<HS, N, ST, CONS>::bytes, F16, \
     WgPersistShape<HS, N, ST, CONS>::threads, N, false, false, true, true}
    // Names: n<key tile>, g2 two warpgroups a block (128 queries), q Q in shared memory, s<stages>
    // of K and V, tma copied by the TMA unit; wp the persistent warp-specialised forward (pp:
    // the consumers' products issued in turn).
    Kernel all[] = {
        {"tc bf16 hs64", (Fwd)attention_forward_bf16_hs64_tc, 64, 128, 4 * 64 * 72 * 2, false, 128, 0, false},
        {"tc f16 hs64", (Fwd)attention_forward_f16_hs64_tc, 64, 128, 4 * 64 * 72 * 2, true, 128, 0, false},
        {"tc bf16 hs128", (Fwd)attention_forward_bf16_hs128_tc, 128, 64, 4 * 32 * 136 * 2, false, 128, 0, false},
        {"tc f16 hs128", (Fwd)attention_forward_f16_hs128_tc, 128, 64, 4 * 32 * 136 * 2, true, 128, 0, false},
        WG(wg_bf16_hs64_n64, 64, 64, 1, false, false, true),
        WG(wg_f16_hs64_n64, 64, 64, 1, false, true, true),
        WG(wg_bf16_hs64_n128, 64, 128, 1, false, false, false),
        WG(wg_f16_hs64_n128, 64, 128, 1, false, true, false),
        WG(wg_bf16_hs64_n64_g2q, 64, 64, 2, true, false, false),
        WG(wg_f16_hs64_n64_g2q, 64, 64, 2, true, true, false),
        WG(wg_bf16_hs64_n128_g2q, 64, 128, 2, true, false, false),
        WG(wg_f16_hs64_n128_g2q, 64, 128, 2, true, true, false),
        WG(wg_bf16_hs128_n64, 128, 64, 1, false, false, true),
        WG(wg_f16_hs128_n64, 128, 64, 1, false, true, true),
        WG(wg_bf16_hs128_n64_g2, 128, 64, 2, false, false, false),
        WG(wg_f16_hs128_n64_g2, 128, 64, 2, false, true, false),
        WG(wg_bf16_hs128_n64_g2q, 128, 64, 2, true, false, false),
        WG(wg_f16_hs128_n64_g2q, 128, 64, 2, true, true, false),
        WG(wg_bf16_hs128_n128_g2q, 128, 128, 2, true, false, false),
        WG(wg_f16_hs128_n128_g2q, 128, 128, 2, true, true, false),
        WG2(wg_bf16_hs64_n64_s2, 64, 64, false, false),
        WG2(wg_f16_hs64_n64_s2, 64, 64, false, true),
        WG2(wg_bf16_hs128_n64_s2, 128, 64, false, false),
        WG2(wg_f16_hs128_n64_s2, 128, 64, false, true),
        WG2(wg_bf16_hs128_n64_s2q, 128, 64, true, false),
        WG2(wg_f16_hs128_n64_s2q, 128, 64, true, true),
#ifdef KILN_HARNESS_TMA
        WGT(wg_bf16_hs64_n64_tma, 64, 64, false),
        WGT(wg_f16_hs64_n64_tma, 64, 64, true),
        WGT(wg_bf16_hs128_n64_tma, 128, 64, false),
        WGT(wg_f16_hs128_n64_tma, 128, 64, true),
        WP(wp_bf16_hs128_n128_s2_pp, 128, 128, 2, 2, false),
        WP(wp_f16_hs128_n128_s2_pp, 128, 128, 2, 2, true),
        WP(wp_bf16_hs128_n128_s2, 128, 128, 2, 2, false),
        WP(wp_bf16_hs64_n128_s3_pp, 64, 128, 3, 2, false),
        WP(wp_bf16_hs64_n128_s2_pp_c3, 64, 128, 2, 3, false),
        WP(wp_f16_hs64_n128_s2_pp_c3, 64, 128, 2, 3, true),
        WP(wp_bf16_hs64_n128_s3_pp_c3, 64, 128, 3, 3, false),
        WP(wp_bf16_hs64_n128_s2_c3, 64, 128, 2, 3, false),
        WP(wp_bf16_hs64_n64_s4_pp_c3, 64, 64, 4, 3, false),
        WP(wp_bf16_hs128_n64_s2_pp_c3, 128, 64, 2, 3, false),
        WP(wp_bf16_hs128_n64_s3_pp_c3, 128, 64, 3, 3, false),
        WP(wp_f16_hs128_n64_s3_pp_c3, 128, 64, 3, 3, true),
        WP(wp_bf16_hs64_n128_s2_pp_c3_snake, 64, 128, 2, 3, false),
        WP(wp_f16_hs64_n128_s2_pp_c3_snake, 64, 128, 2, 3, true),
        WP(wp_bf16_hs64_n128_s2_pp_c3_sec, 64, 128, 2, 3, false),
        WP(wp_bf16_hs128_n128_s2_pp_snake, 128, 128, 2, 2, false),
        WP(wp_f16_hs128_n128_s2_pp_snake, 128, 128, 2, 2, true),
        WP(wp_bf16_hs128_n128_s2_pp_sec, 128, 128, 2, 2, false),
#endif
    };
#undef WG
#undef WG2
#undef WGT
#undef WP
    // HARNESS_ONLY=NAME,NAME: only the configurations named (and the mma.sync forwards, the
    // checks' references), for a quick comparison of builds.
    std::vector<Kernel> kept;
    const char* only = getenv("HARNESS_ONLY");
    for (const Kernel& k : all) {
        bool keep = !only || k.name[0] == 't';
        for (const char* p = only; p && *p && !keep;) {
            const char* end = strchr(p, ',');
            const std::string part(p, end ? end - p : strlen(p));
            keep = part == k.name;
            p = end ? end + 1 : nullptr;
        }
        if (keep) kept.push_back(k);
    }
    Kernel* ks = kept.data();
    const int nk = (int)kept.size();
    if (profile) {
        for (int i = 0; i < nk; i++) {
            if (strcmp(ks[i].name, profile)) continue;
            const int NH = ks[i].hs == 64 ? 12 : 16;
            CK(cudaFuncSetAttribute((const void*)ks[i].f, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    ks[i].shared));
            printf("profile %s B 8 T 4096 NH %d: %.1f us\n", ks[i].name, NH, time_us(ks[i], 8, 4096, NH, 1));
            return 0;
        }
        printf("profile: no configuration named %s\n", profile);
        return 2;
    }
    bool ok_build = true;
    for (int i = 0; i < nk; i++) {
        CK(cudaFuncSetAttribute((const void*)ks[i].f, cudaFuncAttributeMaxDynamicSharedMemorySize, ks[i].shared));
        cudaFuncAttributes at;
        CK(cudaFuncGetAttributes(&at, (const void*)ks[i].f));
        int blocks = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, (const void*)ks[i].f, ks[i].threads,
                                                         ks[i].shared));
        printf("%-24s %3d threads, regs %3d, local %zu B, shared %6d B, %d blocks/SM (%2d warps)%s\n", ks[i].name,
               ks[i].threads, at.numRegs, at.localSizeBytes, ks[i].shared, blocks, blocks * ks[i].threads / 32,
               ks[i].engine ? "  [engine]" : "");
        // A spilling configuration is no candidate: the run fails (its times are still shown).
        if (at.localSizeBytes != 0) {
            printf("%s spills to local memory: FAIL\n", ks[i].name);
            ok_build = false;
        }
    }

    // Correctness: every wgmma kernel against the CPU and against the tc kernel of its type.
    struct Shape { int B, T, NH, W; };
    // T = 64 and 77 leave a 128-query block's second warpgroup without rows or with a few; W = 37
    // and 64 start its window a tile later than the first's.
    const Shape shapes[] = {{1, 200, 2, 0}, {1, 200, 2, 37}, {2, 77, 2, 0}, {1, 1000, 2, 0}, {1, 1000, 2, 300},
                            {1, 64, 1, 1}, {1, 513, 2, 64}};
    double worst_wg[2] = {0, 0}, worst_tc[2] = {0, 0};
    // Per kernel: worst output error vs the CPU, lse error vs the CPU, output and lse vs tc.
    std::vector<double> w_out(nk, 0), w_lse(nk, 0), w_dout(nk, 0), w_dlse(nk, 0);
    bool ok = true;
    for (const Shape& sh : shapes) {
        for (int hs : {64, 128}) {
            for (int f16 = 0; f16 < 2; f16++) {
                const int C = sh.NH * hs;
                const size_t n = (size_t)sh.B * sh.T * 3 * C;
                std::mt19937 rng(1234 + sh.T + hs + f16);
                std::uniform_real_distribution<float> ud(-2.0f, 2.0f);
                std::vector<unsigned short> bits(n);
                std::vector<float> vals(n);
                for (size_t i = 0; i < n; i++) {
                    bits[i] = to_bits(ud(rng), f16);
                    vals[i] = from_bits(bits[i], f16);
                }
                std::vector<float> ro, rl;
                cpu_forward(vals, sh.B, sh.T, sh.NH, hs, sh.W, ro, rl);
                const Kernel* tc = nullptr;
                for (int i = 0; i < nk; i++)
                    if (ks[i].hs == hs && ks[i].f16 == (bool)f16 && ks[i].name[0] == 't') tc = &ks[i];
                Run rt = run_once(*tc, bits, sh.B, sh.T, sh.NH, sh.W);
                const double et = err_per_head(rt.out, ro, hs), etl = err_abs(rt.lse, rl);
                worst_tc[f16] = std::max(worst_tc[f16], et);
                w_out[tc - ks] = std::max(w_out[tc - ks], et);
                w_lse[tc - ks] = std::max(w_lse[tc - ks], etl);
                printf("B %d T %4d NH %d W %3d %-24s out %.2e lse %.2e (vs cpu)\n", sh.B, sh.T, sh.NH, sh.W,
                       tc->name, et, etl);
                std::vector<Run> runs(nk);
                for (int i = 0; i < nk; i++) {
                    if (ks[i].hs != hs || ks[i].f16 != (bool)f16 || ks[i].name[0] != 'w') continue;
                    runs[i] = run_once(ks[i], bits, sh.B, sh.T, sh.NH, sh.W);
                    const Run& rw = runs[i];
                    const double e = err_per_head(rw.out, ro, hs), el = err_abs(rw.lse, rl);
                    const double d = err_per_head(rw.out, rt.out, hs), dl = err_abs(rw.lse, rt.lse);
                    worst_wg[f16] = std::max(worst_wg[f16], e);
                    w_out[i] = std::max(w_out[i], e);
                    w_lse[i] = std::max(w_lse[i], el);
                    w_dout[i] = std::max(w_dout[i], d);
                    w_dlse[i] = std::max(w_dlse[i], dl);
                    const double bound = f16 ? 2e-3 : 1e-2;
                    const bool good = e <= bound && el < 1e-3;
                    ok = ok && good;
                    // Two warpgroups with the key tile of a one-warpgroup configuration sum in the same
                    // order: their results should be that one's bit for bit (reported, not a bound).
                    std::string same;
                    for (int j = 0; j < i; j++) {
                        if (ks[j].hs != hs || ks[j].f16 != (bool)f16 || ks[j].keys != ks[i].keys ||
                            ks[j].threads != 128 || (ks[i].threads == 128 && !ks[i].g1_variant) ||
                            ks[j].g1_variant || runs[j].out.empty())
                            continue;
                        const bool eq = !memcmp(runs[j].out.data(), rw.out.data(), rw.out.size() * 4) &&
                                        !memcmp(runs[j].lse.data(), rw.lse.data(), rw.lse.size() * 4);
                        same = eq ? ", = n" + std::to_string(ks[j].keys) + " g1"
                                  : ", DIFFERS from n" + std::to_string(ks[j].keys) + " g1";
                    }
                    printf("B %d T %4d NH %d W %3d %-24s out %.2e lse %.2e (vs cpu), %.2e %.2e (vs tc)%s%s\n", sh.B,
                           sh.T, sh.NH, sh.W, ks[i].name, e, el, d, dl, same.c_str(), good ? "" : "  FAIL");
                }
            }
        }
    }
    printf("%-24s %9s %9s %9s %9s\n", "worst over shapes", "out/cpu", "lse/cpu", "out/tc", "lse/tc");
    for (int i = 0; i < nk; i++)
        printf("%-24s %9.2e %9.2e %9.2e %9.2e\n", ks[i].name, w_out[i], w_lse[i], w_dout[i], w_dlse[i]);
    printf("worst vs cpu: bf16 wg %.2e tc %.2e (bound 1e-2); f16 wg %.2e tc %.2e (bound 2e-3): %s\n", worst_wg[0],
           worst_tc[0], worst_wg[1], worst_tc[1], ok ? "PASS" : "FAIL");
    ok = ok && ok_build;

    // Timing: causal, no window.
    struct TShape { int B, T, NH, hs; };
    const TShape tshapes[] = {{8, 1024, 12, 64}, {8, 1024, 16, 128}, {8, 4096, 12, 64}, {8, 4096, 16, 128}};
    for (const TShape& sh : tshapes) {
        for (int i = 0; i < nk; i++) {
            if (ks[i].hs != sh.hs) continue;
            const int reps = quick ? 10 : (sh.T > 1024 ? 30 : 100);
            const float us = time_us(ks[i], sh.B, sh.T, sh.NH, reps);
            const double flops = 2.0 * 2.0 * sh.B * sh.NH * (double)sh.T * (sh.T + 1) / 2.0 * sh.hs;
            printf("time B %d T %d NH %2d hs %3d %-24s %8.1f us %6.1f TFLOP/s%s\n", sh.B, sh.T, sh.NH, sh.hs,
                   ks[i].name, us, flops / us * 1e-6, ks[i].engine ? "  [engine]" : "");
        }
    }
    printf("checks: %s\n", ok ? "PASS" : "FAIL");
    return ok ? 0 : 2;
}
