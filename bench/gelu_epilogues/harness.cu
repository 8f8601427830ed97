// cuBLASLt's candidates for GPT-2 small's MLP products under each GELU epilogue, timed on the
// GPU: which epilogues the library offers fast kernels for at these shapes. The engine's MLP
// (engine/cuda/gemm.rs) takes the fc product with GELU_AUX_BIAS and proj's input gradient with
// DGELU; this asks what DGELU_BGRAD (the fc bias gradient from the same product) and the plain
// product cost beside them. Row-major terms: fc: H[M, 4C] = X[M, C] W1^T + b1; proj's input
// gradient: dH[M, 4C] = dY[M, C] W2 with W2 [C, 4C]; as the engine does, each is issued in
// cuBLASLt's column-major view (D^T = B^T A^T).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/gelu_epilogues harness.cu -lcublasLt && /tmp/gelu_epilogues
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#define LT(x) do { cublasStatus_t s = (x); if (s != CUBLAS_STATUS_SUCCESS) { printf("cuBLASLt status %d at %d\n", (int)s, __LINE__); exit(1); } } while (0)

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
        p[i] = __float2bfloat16(((h & 0xffff) / 32768.0f - 1.0f) * 0.5f);
    }
}

struct Case {
    const char* name;
    cublasLtEpilogue_t epi;
    bool forward;   // fc (X W1^T, K = C) or proj's input gradient (dY W2, K = C as well)
    bool aux, bias, bias_f32;
};

int main() {
    const int C = 768, F = 4 * C;
    cublasLtHandle_t lt;
    LT(cublasLtCreate(&lt));
    size_t ws_bytes = 64u << 20;
    void* ws;
    CK(cudaMalloc(&ws, ws_bytes));
    const Case cases[] = {
        {"fc: default", CUBLASLT_EPILOGUE_DEFAULT, true, false, false, false},
        {"fc: bias", CUBLASLT_EPILOGUE_BIAS, true, false, true, false},
        {"fc: gelu_aux_bias (engine)", CUBLASLT_EPILOGUE_GELU_AUX_BIAS, true, true, true, false},
        {"dH: default", CUBLASLT_EPILOGUE_DEFAULT, false, false, false, false},
        {"dH: dgelu (engine)", CUBLASLT_EPILOGUE_DGELU, false, true, false, false},
        {"dH: dgelu_bgrad, bf16 bias", CUBLASLT_EPILOGUE_DGELU_BGRAD, false, true, true, false},
        {"dH: dgelu_bgrad, f32 bias", CUBLASLT_EPILOGUE_DGELU_BGRAD, false, true, true, true},
    };
    for (int M : {8192, 16384}) {
        __nv_bfloat16 *a, *w, *d, *aux;
        float* bias;
        CK(cudaMalloc(&a, (size_t)M * C * 2));
        CK(cudaMalloc(&w, (size_t)F * C * 2));
        CK(cudaMalloc(&d, (size_t)M * F * 2));
        CK(cudaMalloc(&aux, (size_t)M * F * 2));
        CK(cudaMalloc(&bias, F * 4));
        fill<<<1024, 256>>>(a, (size_t)M * C, 1);
        fill<<<1024, 256>>>(w, (size_t)F * C, 2);
        fill<<<1024, 256>>>(aux, (size_t)M * F, 3);
        CK(cudaMemset(bias, 0, F * 4));
        const double flop = 2.0 * M * C * F;
        for (const Case& c : cases) {
            cublasLtMatmulDesc_t op;
            LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
            // Column-major: D^T [F, M] = first [F, C] x second [C, M].
            // fc: first = W1 (row-major [F, C] = col-major [C, F]) transposed; second = X
            // (row-major [M, C] = col-major [C, M]) as is. dH: first = W2 (row-major [C, F] =
            // col-major [F, C]) as is; second = dY (col-major [C, M]) as is.
            cublasOperation_t ta = c.forward ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
            LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
            LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
            LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &c.epi, sizeof(c.epi)));
            if (c.bias) {
                void* bp = bias;
                LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
                cudaDataType_t bt = c.bias_f32 ? CUDA_R_32F : CUDA_R_16BF;
                LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
            }
            if (c.aux) {
                void* ap = aux;
                int64_t ld = F;
                LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ap, sizeof(ap)));
                LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
            }
            cublasLtMatrixLayout_t la, lb, ld;
            if (c.forward) LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, C, F, C));
            else LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, F, C, F));
            LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, C, M, C));
            LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, F, M, F));
            cublasLtMatmulPreference_t pref;
            LT(cublasLtMatmulPreferenceCreate(&pref));
            LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
            cublasLtMatmulHeuristicResult_t res[32];
            int found = 0;
            cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 32, res, &found);
            if (hs != CUBLAS_STATUS_SUCCESS || found == 0) {
                printf("M %5d  %-30s  no algorithm (status %d)\n", M, c.name, (int)hs);
                continue;
            }
            const __nv_bfloat16* first = w;
            const __nv_bfloat16* second = a;
            float alpha = 1.0f, beta = 0.0f;
            std::vector<float> best_each;
            float best = 1e30f, first_choice = 0.0f;
            cudaEvent_t e0, e1;
            CK(cudaEventCreate(&e0));
            CK(cudaEventCreate(&e1));
            for (int i = 0; i < found; i++) {
                if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
                auto launch = [&]() {
                    return cublasLtMatmul(lt, op, &alpha, first, la, second, lb, &beta, d, ld, d, ld, &res[i].algo, ws,
                                          ws_bytes, 0);
                };
                if (launch() != CUBLAS_STATUS_SUCCESS) continue;
                CK(cudaDeviceSynchronize());
                std::vector<float> ts;
                for (int r = 0; r < 7; r++) {
                    CK(cudaEventRecord(e0));
                    for (int k = 0; k < 5; k++) launch();
                    CK(cudaEventRecord(e1));
                    CK(cudaEventSynchronize(e1));
                    float ms;
                    CK(cudaEventElapsedTime(&ms, e0, e1));
                    ts.push_back(ms / 5);
                }
                std::sort(ts.begin(), ts.end());
                if (i == 0) first_choice = ts[3];
                best = std::min(best, ts[3]);
            }
            printf("M %5d  %-30s  %2d candidates  best %7.1f us (%4.0f TFLOP/s)  heuristic's first %7.1f us\n", M,
                   c.name, found, best * 1e3, flop / (best * 1e-3) / 1e12, first_choice * 1e3);
            cublasLtMatmulPreferenceDestroy(pref);
            cublasLtMatrixLayoutDestroy(la);
            cublasLtMatrixLayoutDestroy(lb);
            cublasLtMatrixLayoutDestroy(ld);
            cublasLtMatmulDescDestroy(op);
        }
        cudaFree(a); cudaFree(w); cudaFree(d); cudaFree(aux); cudaFree(bias);
    }
    return 0;
}
