// How cuBLASLt's products at the training step's shapes take a reduction or output width a
// little past a power of two: the frozen product of a layer whose low-rank adapters are folded
// into it (nn/lora.rs) reads its input R columns wider (K = in + R) and writes its input
// gradient as wide (N = in + R). For each shape given as M,N,K[,kind] (kind fwd: Y = X W^T,
// dx: dX = dY W, as the engine issues them), the best of the heuristic's first 8 candidates
// (the engine's rule), median of 5 runs of 3 back-to-back products.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/widths widths.cu -lcublasLt && /tmp/widths 8192,16384,2048,fwd ...
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x) do { cudaError_t ck_ = (x); if (ck_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(ck_), __LINE__); exit(1); } } while (0)
#define LT(x) do { cublasStatus_t lt_ = (x); if (lt_ != CUBLAS_STATUS_SUCCESS) { printf("cuBLASLt status %d at %d\n", (int)lt_, __LINE__); exit(1); } } while (0)

__global__ void fill(__nv_bfloat16* p, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(((unsigned)(i * 2654435761u) >> 16) / 65536.0f - 0.5f);
}

int main(int argc, char** argv) {
    cublasLtHandle_t lt;
    LT(cublasLtCreate(&lt));
    const size_t ws_bytes = 32u << 20;
    void* ws;
    CK(cudaMalloc(&ws, ws_bytes));
    const size_t big = (size_t)1 << 28;
    __nv_bfloat16 *x, *w, *y;
    CK(cudaMalloc(&x, big * 2)); CK(cudaMalloc(&w, big * 2)); CK(cudaMalloc(&y, big * 2));
    fill<<<2048, 256>>>(x, big); fill<<<2048, 256>>>(w, big);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    printf("| shape (M, N, K) | kind | best of 8 | TFLOP/s |\n|---|---|---|---|\n");
    for (int a = 1; a < argc; ++a) {
        long M, N, K;
        char kind[8] = "fwd";
        if (sscanf(argv[a], "%ld,%ld,%ld,%7s", &M, &N, &K, kind) < 3) continue;
        bool fwd = strcmp(kind, "fwd") == 0;
        // Row-major forward Y[M,N] = X[M,K] W[N,K]^T; input gradient dX[M,N] = dY[M,K] W[K,N]
        // (here N is the gradient's width and K the output's): column-major views.
        int m = N, n = M, k = K, lda = fwd ? K : N, ldb = K;
        cublasOperation_t oa = fwd ? CUBLAS_OP_T : CUBLAS_OP_N, ob = CUBLAS_OP_N;
        cublasLtMatmulDesc_t desc;
        LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof(oa)));
        LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof(ob)));
        cublasLtMatrixLayout_t la, lb, ld;
        LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, fwd ? k : m, fwd ? m : k, lda));
        LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, ldb));
        LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, m, n, m));
        cublasLtMatmulPreference_t pref;
        LT(cublasLtMatmulPreferenceCreate(&pref));
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
        cublasLtMatmulHeuristicResult_t res[8];
        int found = 0;
        LT(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 8, res, &found));
        const float one = 1.0f, zero = 0.0f;
        float best = 1e30f;
        for (int i = 0; i < found; ++i) {
            if (cublasLtMatmul(lt, desc, &one, w, la, x, lb, &zero, y, ld, y, ld, &res[i].algo, ws, ws_bytes, 0) != CUBLAS_STATUS_SUCCESS) continue;
            std::vector<float> t;
            for (int r = 0; r < 5; ++r) {
                CK(cudaEventRecord(e0));
                for (int j = 0; j < 3; ++j)
                    cublasLtMatmul(lt, desc, &one, w, la, x, lb, &zero, y, ld, y, ld, &res[i].algo, ws, ws_bytes, 0);
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                t.push_back(ms / 3);
            }
            std::sort(t.begin(), t.end());
            best = std::min(best, t[2]);
        }
        printf("| %ld, %ld, %ld | %s | %.1f us | %.0f |\n", M, N, K, kind, best * 1e3, 2.0 * M * N * K / best / 1e9);
        fflush(stdout);
    }
    return 0;
}
