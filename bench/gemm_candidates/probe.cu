// How much does a wider search of cuBLASLt's algorithms give the training step's products?
//
// The engine (engine/cuda/gemm.rs, pick_algo) times the heuristic's 8 best candidates for each
// product shape and keeps the fastest. This program times, for every product of a GPT-2 small
// step (16 x 1024 rows) and a Llama-3.2-1B-shaped step (8 x 1024 rows), bf16 operands with
// f32 accumulation as the engine issues them:
// - the heuristic's first choice, the best of its first 8 (the engine's rule), the best of
//   its first 64;
// - every configuration cuBLASLt's algorithm enumeration offers (each algorithm id's tiles,
//   stages and the first 12 cluster shape ids, no split of K, within the engine's workspace), best of them.
// (at most 3000 configurations a shape). Each timing is the median of 5 runs of 3 back-to-back products after a warm-up, on operands
// larger than the L2. The totals weigh each shape by its count in one step.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/gemm_candidates probe.cu -lcublasLt && /tmp/gemm_candidates
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t ck_ = (x); if (ck_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(ck_), __LINE__); exit(1); } } while (0)
#define LT(x) do { cublasStatus_t lt_ = (x); if (lt_ != CUBLAS_STATUS_SUCCESS) { printf("cuBLASLt status %d at %d\n", (int)lt_, __LINE__); exit(1); } } while (0)

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        p[i] = __float2bfloat16(((h & 0xffff) / 32768.0f - 1.0f) * 0.5f);
    }
}

static cublasLtHandle_t lt;
static void* ws;
static const size_t ws_bytes = 32u << 20;  // the engine's workspace

// A product in row-major terms, as the engine states it: forward Y[M,N] = X[M,K] W[N,K]^T,
// input gradient dX[M,K] = dY[M,N] W[N,K], weight gradient dW[N,K] = dY^T X (f32 out).
enum Kind { FWD, DX, DW };
struct Shape {
    const char* name;
    Kind kind;
    long M, N, K;
    int count;  // in one step
};

struct Problem {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t a, b, d;
    void *A, *B, *D;
    double flop;
};

static Problem make(const Shape& s, void* x, void* w, void* y) {
    Problem p;
    int m, n, k, lda, ldb;
    bool ta, tb, f32 = s.kind == DW;
    // cuBLASLt's column-major view (D^T = B^T A^T) of each row-major product.
    if (s.kind == FWD) { m = s.N; n = s.M; k = s.K; ta = true; tb = false; lda = s.K; ldb = s.K; }
    else if (s.kind == DX) { m = s.K; n = s.M; k = s.N; ta = false; tb = false; lda = s.K; ldb = s.N; }
    else { m = s.K; n = s.N; k = s.M; ta = false; tb = true; lda = s.K; ldb = s.N; }
    p.A = w; p.B = x; p.D = y;
    if (s.kind == DW) { p.A = x; p.B = w; }
    LT(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t oa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, ob = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof(oa)));
    LT(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof(ob)));
    LT(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, ta ? k : m, ta ? m : k, lda));
    LT(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, tb ? n : k, tb ? k : n, ldb));
    LT(cublasLtMatrixLayoutCreate(&p.d, f32 ? CUDA_R_32F : CUDA_R_16BF, m, n, m));
    p.flop = 2.0 * s.M * s.N * s.K;
    return p;
}

static cudaEvent_t e0, e1;

// Median time of one product with `algo` (ms), or a negative number if it fails.
static float time_algo(const Problem& p, const cublasLtMatmulAlgo_t& algo, int reps = 5) {
    const float one = 1.0f, zero = 0.0f;
    if (cublasLtMatmul(lt, p.desc, &one, p.A, p.a, p.B, p.b, &zero, p.D, p.d, p.D, p.d, &algo, ws, ws_bytes, 0) !=
        CUBLAS_STATUS_SUCCESS)
        return -1;
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(e0));
        for (int i = 0; i < 3; ++i)
            cublasLtMatmul(lt, p.desc, &one, p.A, p.a, p.B, p.b, &zero, p.D, p.d, p.D, p.d, &algo, ws, ws_bytes, 0);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms / 3);
    }
    if (cudaGetLastError() != cudaSuccess) return -1;
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

template <class T> static std::vector<T> cap_list(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
    size_t bytes = 0;
    if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS || bytes == 0)
        return {};
    std::vector<T> v(bytes / sizeof(T));
    if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, v.data(), bytes, &bytes) != CUBLAS_STATUS_SUCCESS) return {};
    return v;
}

int main() {
    const Shape shapes[] = {
        // GPT-2 small, 16 x 1024 rows, width 768, padded vocabulary 50304 (12 layers)
        {"gpt2 qkv fwd", FWD, 16384, 2304, 768, 12},
        {"gpt2 proj fwd", FWD, 16384, 768, 768, 12},
        {"gpt2 fc fwd", FWD, 16384, 3072, 768, 12},
        {"gpt2 mproj fwd", FWD, 16384, 768, 3072, 12},
        {"gpt2 head fwd", FWD, 16384, 50304, 768, 1},
        {"gpt2 qkv dx", DX, 16384, 2304, 768, 12},
        {"gpt2 proj dx", DX, 16384, 768, 768, 12},
        {"gpt2 fc dx", DX, 16384, 3072, 768, 12},
        {"gpt2 mproj dx", DX, 16384, 768, 3072, 12},
        {"gpt2 head dx", DX, 16384, 50304, 768, 1},
        {"gpt2 qkv dw", DW, 16384, 2304, 768, 12},
        {"gpt2 proj dw", DW, 16384, 768, 768, 12},
        {"gpt2 fc dw", DW, 16384, 3072, 768, 12},
        {"gpt2 mproj dw", DW, 16384, 768, 3072, 12},
        {"gpt2 head dw", DW, 16384, 50304, 768, 1},
        // Llama-3.2-1B shape, 8 x 1024 rows (16 layers; tied head of 128256)
        {"1b qkv fwd", FWD, 8192, 3072, 2048, 16},
        {"1b o fwd", FWD, 8192, 2048, 2048, 16},
        {"1b gate/up fwd", FWD, 8192, 16384, 2048, 16},
        {"1b down fwd", FWD, 8192, 2048, 8192, 16},
        {"1b head fwd", FWD, 8192, 128256, 2048, 1},
        {"1b qkv dx", DX, 8192, 3072, 2048, 16},
        {"1b o dx", DX, 8192, 2048, 2048, 16},
        {"1b gate/up dx", DX, 8192, 16384, 2048, 16},
        {"1b down dx", DX, 8192, 2048, 8192, 16},
        {"1b head dx", DX, 8192, 128256, 2048, 1},
        {"1b qkv dw", DW, 8192, 3072, 2048, 16},
        {"1b o dw", DW, 8192, 2048, 2048, 16},
        {"1b gate/up dw", DW, 8192, 16384, 2048, 16},
        {"1b down dw", DW, 8192, 2048, 8192, 16},
        {"1b head dw", DW, 8192, 128256, 2048, 1},
    };
    LT(cublasLtCreate(&lt));
    CK(cudaMalloc(&ws, ws_bytes));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, cuBLASLt %zu\n\n", prop.name, cublasLtGetVersion());
    const size_t big = (size_t)8192 * 128256;  // the largest operand or output, in elements
    void *x, *w, *y;
    CK(cudaMalloc(&x, big * 2));
    CK(cudaMalloc(&w, big * 2));
    CK(cudaMalloc(&y, big * 4));
    fill<<<2048, 256>>>((__nv_bfloat16*)x, big, 1);
    fill<<<2048, 256>>>((__nv_bfloat16*)w, big, 2);
    CK(cudaDeviceSynchronize());

    printf("| product | M x N x K | heuristic 1st | best of 8 (engine) | best of 64 | enumerated: tried, best | best / engine |\n");
    printf("|---|---|---|---|---|---|---|\n");
    double tot[2][4] = {};  // [gpt2, 1b][first, best8, best64, best overall]
    for (const Shape& s : shapes) {
        Problem p = make(s, x, w, y);
        cublasLtMatmulPreference_t pref;
        LT(cublasLtMatmulPreferenceCreate(&pref));
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
        cublasLtMatmulHeuristicResult_t res[64];
        int found = 0;
        LT(cublasLtMatmulAlgoGetHeuristic(lt, p.desc, p.a, p.b, p.d, p.d, pref, 64, res, &found));
        float first = -1, best8 = 1e30f, best64 = 1e30f;
        for (int i = 0; i < found; ++i) {
            if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
            float t = time_algo(p, res[i].algo);
            if (t < 0) continue;
            if (first < 0) first = t;
            if (i < 8) best8 = std::min(best8, t);
            best64 = std::min(best64, t);
        }
        // The enumeration: every algorithm id for these types, each tile, stage count and
        // cluster shape it offers, K unsplit.
        int ids[512], nids = 0;
        cudaDataType_t dt = s.kind == DW ? CUDA_R_32F : CUDA_R_16BF;
        LT(cublasLtMatmulAlgoGetIds(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, dt, dt, 512, ids, &nids));
        int tried = 0;
        float bestE = 1e30f;
        for (int a = 0; a < nids; ++a) {
            cublasLtMatmulAlgo_t algo;
            if (cublasLtMatmulAlgoInit(lt, CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, dt, dt, ids[a], &algo) !=
                CUBLAS_STATUS_SUCCESS)
                continue;
            auto tiles = cap_list<uint32_t>(algo, CUBLASLT_ALGO_CAP_TILE_IDS);
            auto stages = cap_list<uint32_t>(algo, CUBLASLT_ALGO_CAP_STAGES_IDS);
            // No capability lists the cluster shapes: the first ids of cublasLtClusterShape_t
            // are tried, and AlgoCheck refuses the ones an algorithm does not take.
            std::vector<uint32_t> clusters;
            for (uint32_t c = 0; c < 12; ++c) clusters.push_back(c);
            if (tiles.empty()) tiles.push_back(CUBLASLT_MATMUL_TILE_UNDEFINED);
            if (stages.empty()) stages.push_back(CUBLASLT_MATMUL_STAGES_UNDEFINED);
            for (uint32_t t : tiles)
                for (uint32_t st : stages)
                    for (uint32_t cl : clusters) {
                        if (tried >= 3000) continue;
                        int splitk = 1;
                        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &t, sizeof(t));
                        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &st, sizeof(st));
                        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cl, sizeof(cl));
                        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk));
                        cublasLtMatmulHeuristicResult_t chk;
                        if (cublasLtMatmulAlgoCheck(lt, p.desc, p.a, p.b, p.d, p.d, &algo, &chk) != CUBLAS_STATUS_SUCCESS)
                            continue;
                        if (chk.workspaceSize > ws_bytes) continue;
                        // One quick run first; only configurations within 15% of the best so far
                        // are timed properly.
                        float q = time_algo(p, algo, 1);
                        if (q < 0) continue;
                        ++tried;
                        if (q < bestE * 1.15f) bestE = std::min(bestE, time_algo(p, algo));
                    }
        }
        cudaGetLastError();
        float best = std::min(best64, bestE);
        printf("| %s | %ld x %ld x %ld | %.1f us | %.1f us (%.0f TFLOP/s) | %.1f us | %d, %.1f us | %.3f |\n", s.name, s.M,
               s.N, s.K, first * 1e3, best8 * 1e3, p.flop / best8 / 1e9, best64 * 1e3, tried, bestE < 1e29f ? bestE * 1e3 : 0.0,
               best8 / best);
        fflush(stdout);
        int g = s.name[0] == 'g' ? 0 : 1;
        tot[g][0] += first * s.count;
        tot[g][1] += best8 * s.count;
        tot[g][2] += best64 * s.count;
        tot[g][3] += best * s.count;
        cublasLtMatmulPreferenceDestroy(pref);
    }
    for (int g = 0; g < 2; ++g)
        printf("\n%s step's products: heuristic 1st %.2f ms, best of 8 (engine) %.2f ms, best of 64 %.2f ms, best found %.2f ms (%.1f%% under the engine's rule)\n",
               g ? "Llama-3.2-1B" : "GPT-2 small", tot[g][0], tot[g][1], tot[g][2], tot[g][3], (1 - tot[g][3] / tot[g][1]) * 100);
    return 0;
}
