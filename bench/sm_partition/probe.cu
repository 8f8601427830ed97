// Can memory-bound work hide under cuBLASLt's products if the products leave it some SMs?
//
// The Llama-3.2-1B training step is 77 ms of cuBLASLt products at 79% of the bf16 peak and
// about 30 ms of memory-bound kernels (AdamW 9.2, SwiGLU 4.9, RMSNorm 3.1, rotary 2.5, ...),
// run one after the other. An earlier probe (bench/optimizer_overlap_probe.py) put AdamW on a
// second stream under the next forward's products and hid 0.8 of 12.3 ms: a product kernel
// holds each SM whole, so the other stream's blocks only run between products. cuBLASLt can
// be told to plan a product for fewer SMs (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), leaving c
// SMs to a concurrent stream. Whether that pays depends on two rates this program measures:
// how much slower the products get on 132 - c SMs, and how much of the memory's bandwidth a
// streaming kernel reaches from c SMs.
//
// Shapes: the 1B shape's layer at 8 x 1024 rows (width 2048, 32 query and 8 key/value heads of
// 64, MLP 8192), bf16 products with f32 accumulation, as the engine issues them.
// - Forward: per layer the QKV, output, gate/up and down products; beside them AdamW over the
//   layer's 60.8M parameters (f32 value, gradient and two moments read; value, moments and a
//   bf16 copy written: 30 bytes a parameter), the update of layer l before the products of
//   layer l (an event a layer), as an optimizer overlapped with the next step's forward runs.
// - Backward: per layer the four weight-gradient products (f32 outputs), off the critical
//   path, beside a SwiGLU-backward-like stream (three M x 8192 bf16 inputs, two outputs).
// Every configuration runs 16 layers; times are the median of 7 runs after 2 warm-ups.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/sm_partition probe.cu -lcublasLt && /tmp/sm_partition
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#define CK(x) do { cudaError_t ck_ = (x); if (ck_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(ck_), __LINE__); exit(1); } } while (0)
#define LT(x) do { cublasStatus_t lt_ = (x); if (lt_ != CUBLAS_STATUS_SUCCESS) { printf("cuBLASLt status %d at %d\n", (int)lt_, __LINE__); exit(1); } } while (0)

typedef __nv_bfloat16 bf16;

__global__ void fill_bf16(bf16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        p[i] = __float2bfloat16(((h & 0xffff) / 32768.0f - 1.0f) * 0.5f);
    }
}

__global__ void fill_f32(float* p, size_t n, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        p[i] = ((h & 0xffff) / 32768.0f - 1.0f) * scale;
    }
}

// AdamW over n parameters (n a multiple of 4), four at a time, grid-strided; the value's bf16
// copy written as the engine's update does.
__global__ void __launch_bounds__(1024) adamw(float* __restrict__ p, const float* __restrict__ g,
                                              float* __restrict__ m, float* __restrict__ v,
                                              bf16* __restrict__ copy, size_t n4) {
    const float lr = 1e-4f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, c1 = 0.1f, c2 = 0.05f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
        float4 pp = reinterpret_cast<float4*>(p)[i];
        float4 gg = reinterpret_cast<const float4*>(g)[i];
        float4 mm = reinterpret_cast<float4*>(m)[i];
        float4 vv = reinterpret_cast<float4*>(v)[i];
        float* P = &pp.x; const float* G = &gg.x; float* M = &mm.x; float* V = &vv.x;
        __nv_bfloat162 out[2];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            M[k] = b1 * M[k] + (1 - b1) * G[k];
            V[k] = b2 * V[k] + (1 - b2) * G[k] * G[k];
            P[k] = P[k] * (1 - lr * wd) - lr * (M[k] / c1) / (sqrtf(V[k] / c2) + eps);
        }
        out[0] = __floats2bfloat162_rn(P[0], P[1]);
        out[1] = __floats2bfloat162_rn(P[2], P[3]);
        reinterpret_cast<float4*>(p)[i] = pp;
        reinterpret_cast<float4*>(m)[i] = mm;
        reinterpret_cast<float4*>(v)[i] = vv;
        reinterpret_cast<uint2*>(copy)[i] = *reinterpret_cast<uint2*>(out);
    }
}

// A SwiGLU-backward-like stream: dg, du from g, u, dh (n bf16 each, n a multiple of 8).
__global__ void __launch_bounds__(1024) swiglu_bwd(const bf16* __restrict__ g, const bf16* __restrict__ u,
                                                   const bf16* __restrict__ dh, bf16* __restrict__ dg,
                                                   bf16* __restrict__ du, size_t n8) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        uint4 G = reinterpret_cast<const uint4*>(g)[i];
        uint4 U = reinterpret_cast<const uint4*>(u)[i];
        uint4 D = reinterpret_cast<const uint4*>(dh)[i];
        uint4 OG, OU;
        const bf16* gs = reinterpret_cast<const bf16*>(&G);
        const bf16* us = reinterpret_cast<const bf16*>(&U);
        const bf16* ds = reinterpret_cast<const bf16*>(&D);
        bf16* og = reinterpret_cast<bf16*>(&OG);
        bf16* ou = reinterpret_cast<bf16*>(&OU);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            float x = __bfloat162float(gs[k]), y = __bfloat162float(us[k]), d = __bfloat162float(ds[k]);
            float s = 1.0f / (1.0f + __expf(-x));
            og[k] = __float2bfloat16(d * y * s * (1.0f + x * (1.0f - s)));
            ou[k] = __float2bfloat16(d * x * s);
        }
        reinterpret_cast<uint4*>(dg)[i] = OG;
        reinterpret_cast<uint4*>(du)[i] = OU;
    }
}

// One product as the engine issues it, in cuBLASLt's column-major view, planned for `sms`
// SMs (0: the device's count).
struct Gemm {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
    const void *A, *B;
    void* D;
};

static cublasLtHandle_t lt;
static void* ws;
static const size_t ws_bytes = 64u << 20;

// D (m x n, col-major, ldd m) = op(A) op(B); A, B bf16; D bf16 or f32.
static Gemm make_gemm(bool ta, bool tb, int m, int n, int k, const void* A, int lda, const void* B, int ldb,
                      void* D, bool d_f32, int sms) {
    Gemm gm;
    gm.A = A; gm.B = B; gm.D = D;
    LT(cublasLtMatmulDescCreate(&gm.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t oa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(gm.desc, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof(oa)));
    LT(cublasLtMatmulDescSetAttribute(gm.desc, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof(ob)));
    if (sms > 0) {
        int32_t t = sms;
        LT(cublasLtMatmulDescSetAttribute(gm.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &t, sizeof(t)));
    }
    LT(cublasLtMatrixLayoutCreate(&gm.a, CUDA_R_16BF, ta ? k : m, ta ? m : k, lda));
    LT(cublasLtMatrixLayoutCreate(&gm.b, CUDA_R_16BF, tb ? n : k, tb ? k : n, ldb));
    LT(cublasLtMatrixLayoutCreate(&gm.d, d_f32 ? CUDA_R_32F : CUDA_R_16BF, m, n, m));
    cublasLtMatmulPreference_t pref;
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
    // Every layer's product of a shape takes the algorithm picked for the first.
    static std::map<std::string, cublasLtMatmulAlgo_t> picked;
    char key[96];
    snprintf(key, sizeof key, "%d %d %d %d %d %d %d", ta, tb, m, n, k, d_f32, sms);
    auto hit = picked.find(key);
    if (hit != picked.end()) {
        gm.algo = hit->second;
        cublasLtMatmulPreferenceDestroy(pref);
        return gm;
    }
    cublasLtMatmulHeuristicResult_t res[8];
    int found = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(lt, gm.desc, gm.a, gm.b, gm.d, gm.d, pref, 8, res, &found));
    if (found == 0) { printf("no algorithm for %d x %d x %d\n", m, n, k); exit(1); }
    // The fastest of the candidates, each timed alone (as the engine picks).
    float best = 1e30f;
    int pick = 0;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    const float one = 1.0f, zero = 0.0f;
    for (int i = 0; i < found; ++i) {
        if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
        bool ok = true;
        for (int w = 0; w < 2 && ok; ++w)
            ok = cublasLtMatmul(lt, gm.desc, &one, A, gm.a, B, gm.b, &zero, D, gm.d, D, gm.d, &res[i].algo, ws, ws_bytes, 0) == CUBLAS_STATUS_SUCCESS;
        if (!ok) continue;
        CK(cudaEventRecord(e0));
        for (int r = 0; r < 5; ++r)
            LT(cublasLtMatmul(lt, gm.desc, &one, A, gm.a, B, gm.b, &zero, D, gm.d, D, gm.d, &res[i].algo, ws, ws_bytes, 0));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (ms < best) { best = ms; pick = i; }
    }
    gm.algo = res[pick].algo;
    picked[key] = gm.algo;
    cublasLtMatmulPreferenceDestroy(pref);
    return gm;
}

static void run_gemm(const Gemm& gm, cudaStream_t s) {
    const float one = 1.0f, zero = 0.0f;
    LT(cublasLtMatmul(lt, gm.desc, &one, gm.A, gm.a, gm.B, gm.b, &zero, gm.D, gm.d, gm.D, gm.d, &gm.algo, ws, ws_bytes, s));
}

template <class F> static float timed(F f) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    for (int w = 0; w < 2; ++w) f();
    CK(cudaDeviceSynchronize());
    std::vector<float> t;
    for (int r = 0; r < 7; ++r) {
        CK(cudaEventRecord(e0));
        f();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    CK(cudaEventDestroy(e0)); CK(cudaEventDestroy(e1));
    return t[t.size() / 2];
}

int main() {
    const int D = 2048, F = 8192, QKV = 2048 + 2 * 512, ROWS = 8 * 1024, L = 16;
    int dev_sms;
    CK(cudaDeviceGetAttribute(&dev_sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs\n", prop.name, dev_sms);
    LT(cublasLtCreate(&lt));
    CK(cudaMalloc(&ws, ws_bytes));

    // Activations (shared by the layers: the bytes per layer are what matter) and the layers'
    // weights, so each layer's products read their own weights as in a step.
    bf16 *x, *qkv, *att, *gu, *h, *y, *dqkv, *dgu, *dy;
    size_t act = (size_t)ROWS * 2 * F;
    for (bf16** p : {&x, &qkv, &att, &gu, &h, &y, &dqkv, &dgu, &dy}) {
        CK(cudaMalloc(p, act * 2));
        fill_bf16<<<1024, 256>>>(*p, act, 7);
    }
    const size_t wq = (size_t)QKV * D, wo = (size_t)D * D, wgu = (size_t)2 * F * D, wd = (size_t)D * F;
    const size_t per_layer = wq + wo + wgu + wd;
    std::vector<bf16*> W(L);
    std::vector<float*> P(L), G(L), M(L), V(L), DW(L);
    for (int l = 0; l < L; ++l) {
        CK(cudaMalloc(&W[l], per_layer * 2));
        fill_bf16<<<1024, 256>>>(W[l], per_layer, l);
        for (float** p : {&P[l], &G[l], &M[l], &V[l], &DW[l]}) {
            CK(cudaMalloc(p, per_layer * 4));
            fill_f32<<<1024, 256>>>(*p, per_layer, 11 + l, 0.01f);
        }
        CK(cudaMemset(V[l], 0, per_layer * 4));
    }
    CK(cudaDeviceSynchronize());
    printf("per layer: %.1fM parameters, AdamW %.2f GB; SwiGLU-backward-like stream %.2f GB\n",
           per_layer / 1e6, per_layer * 30 / 1e9, (double)ROWS * F * 2 * 5 / 1e9);

    // A layer's forward products (row-major Y = X W^T: col-major Y^T = W^T^T X^T, m = out,
    // n = rows, k = in) and weight-gradient products (dW[out, in] = dY^T X: col-major dW^T =
    // X^T dY, m = in, n = out, k = rows, f32 output).
    auto forward = [&](int l, int sms) {
        bf16* w = W[l];
        std::vector<Gemm> g;
        g.push_back(make_gemm(true, false, QKV, ROWS, D, w, D, x, D, qkv, false, sms));
        g.push_back(make_gemm(true, false, D, ROWS, D, w + wq, D, att, D, y, false, sms));
        g.push_back(make_gemm(true, false, 2 * F, ROWS, D, w + wq + wo, D, x, D, gu, false, sms));
        g.push_back(make_gemm(true, false, D, ROWS, F, w + wq + wo + wgu, F, h, F, y, false, sms));
        return g;
    };
    auto wgrad = [&](int l, int sms) {
        float* d = DW[l];
        std::vector<Gemm> g;
        g.push_back(make_gemm(false, true, D, QKV, ROWS, x, D, dqkv, QKV, d, true, sms));
        g.push_back(make_gemm(false, true, D, D, ROWS, att, D, dy, D, d + wq, true, sms));
        g.push_back(make_gemm(false, true, D, 2 * F, ROWS, x, D, dgu, 2 * F, d + wq + wo, true, sms));
        g.push_back(make_gemm(false, true, F, D, ROWS, h, F, dy, D, d + wq + wo + wgu, true, sms));
        return g;
    };

    cudaStream_t sa, sb;
    CK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
    std::vector<cudaEvent_t> ev(L);
    for (auto& e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    cudaEvent_t start, join;
    CK(cudaEventCreateWithFlags(&start, cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));

    // The streaming kernels' grids: `blocks` of 1024 threads (two an SM at most by registers),
    // 0 for a full grid of 4 a multiprocessor's worth.
    auto update = [&](int l, int blocks, cudaStream_t s) {
        int grid = blocks > 0 ? blocks : 2 * dev_sms;
        adamw<<<grid, 1024, 0, s>>>(P[l], G[l], M[l], V[l], W[l], per_layer / 4);
    };
    auto stream_bwd = [&](int blocks, cudaStream_t s) {
        int grid = blocks > 0 ? blocks : 2 * dev_sms;
        size_t n = (size_t)ROWS * F;
        swiglu_bwd<<<grid, 1024, 0, s>>>(gu, gu + n, h, dgu, dgu + n, n / 8);
    };

    std::vector<std::vector<Gemm>> fwd0(L), bwd0(L);
    for (int l = 0; l < L; ++l) { fwd0[l] = forward(l, 0); bwd0[l] = wgrad(l, 0); }
    float f0 = timed([&] { for (int l = 0; l < L; ++l) for (auto& g : fwd0[l]) run_gemm(g, 0); });
    float b0 = timed([&] { for (int l = 0; l < L; ++l) for (auto& g : bwd0[l]) run_gemm(g, 0); });
    float u0 = timed([&] { for (int l = 0; l < L; ++l) update(l, 0, 0); });
    float s0 = timed([&] { for (int l = 0; l < L; ++l) stream_bwd(0, 0); });
    printf("\nall %d SMs, one stream: forward products %.2f ms, AdamW %.2f ms (%.2f TB/s), sum %.2f ms\n",
           dev_sms, f0, u0, L * per_layer * 30 / u0 / 1e9, f0 + u0);
    printf("  weight-gradient products %.2f ms, SwiGLU-backward-like %.2f ms (%.2f TB/s), sum %.2f ms\n",
           b0, s0, L * (double)ROWS * F * 10 / s0 / 1e9, b0 + s0);
    // Two streams, no carve-out (the earlier probe's schedule).
    auto overlap_fwd = [&](std::vector<std::vector<Gemm>>& fw, int blocks) {
        CK(cudaEventRecord(start, 0));
        CK(cudaStreamWaitEvent(sa, start)); CK(cudaStreamWaitEvent(sb, start));
        for (int l = 0; l < L; ++l) { update(l, blocks, sb); CK(cudaEventRecord(ev[l], sb)); }
        for (int l = 0; l < L; ++l) { CK(cudaStreamWaitEvent(sa, ev[l])); for (auto& g : fw[l]) run_gemm(g, sa); }
        CK(cudaEventRecord(join, sa)); CK(cudaStreamWaitEvent(0, join));
    };
    auto overlap_bwd = [&](std::vector<std::vector<Gemm>>& bw, int blocks) {
        CK(cudaEventRecord(start, 0));
        CK(cudaStreamWaitEvent(sa, start)); CK(cudaStreamWaitEvent(sb, start));
        for (int l = 0; l < L; ++l) { stream_bwd(blocks, sb); for (auto& g : bw[l]) run_gemm(g, sa); }
        CK(cudaEventRecord(join, sa)); CK(cudaStreamWaitEvent(0, join));
        CK(cudaEventRecord(join, sb)); CK(cudaStreamWaitEvent(0, join));
    };
    printf("  two streams, full grids: forward + AdamW %.2f ms, weight gradients + stream %.2f ms\n",
           timed([&] { overlap_fwd(fwd0, 0); }), timed([&] { overlap_bwd(bwd0, 0); }));

    // Carve-outs: the products planned for dev_sms - c SMs, the streaming kernel given c
    // blocks (one 1024-thread block an SM) or 2c (more than the SMs left, to see the cost).
    std::vector<std::string> frows, brows;
    for (int c : {8, 16, 24, 32, 48}) {
        int target = dev_sms - c;
        std::vector<std::vector<Gemm>> fw(L), bw(L);
        for (int l = 0; l < L; ++l) { fw[l] = forward(l, target); bw[l] = wgrad(l, target); }
        for (int per : {1, 2}) {
            int blocks = c * per;
            char line[320];
            float f = timed([&] { for (int l = 0; l < L; ++l) for (auto& g : fw[l]) run_gemm(g, 0); });
            float u = timed([&] { for (int l = 0; l < L; ++l) update(l, blocks, 0); });
            float o = timed([&] { overlap_fwd(fw, blocks); });
            snprintf(line, sizeof line, "| %d | %d | %d | %.2f | %.2f (%.2f TB/s) | %.2f | %.2f | %+.2f |", c, blocks, target,
                     f, u, L * per_layer * 30 / u / 1e9, o, f0 + u0, f0 + u0 - o);
            frows.push_back(line);
            float b = timed([&] { for (int l = 0; l < L; ++l) for (auto& g : bw[l]) run_gemm(g, 0); });
            float s = timed([&] { for (int l = 0; l < L; ++l) stream_bwd(blocks, 0); });
            float ob = timed([&] { overlap_bwd(bw, blocks); });
            snprintf(line, sizeof line, "| %d | %d | %d | %.2f | %.2f (%.2f TB/s) | %.2f | %.2f | %+.2f |", c, blocks, target,
                     b, s, L * (double)ROWS * F * 10 / s / 1e9, ob, b0 + s0, b0 + s0 - ob);
            brows.push_back(line);
        }
    }
    printf("\nForward products beside AdamW (update of layer l before the products of layer l), ms:\n\n");
    printf("| SMs left | stream blocks | products' SM target | products alone | AdamW alone | overlapped | serial, all SMs | saved |\n");
    printf("|---|---|---|---|---|---|---|---|\n");
    for (auto& r : frows) printf("%s\n", r.c_str());
    printf("\nWeight-gradient products beside the SwiGLU-backward-like stream (no dependencies), ms:\n\n");
    printf("| SMs left | stream blocks | products' SM target | products alone | stream alone | overlapped | serial, all SMs | saved |\n");
    printf("|---|---|---|---|---|---|---|---|\n");
    for (auto& r : brows) printf("%s\n", r.c_str());
    CK(cudaDeviceSynchronize());
    return 0;
}
