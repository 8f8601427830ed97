// gemm.cuh's fused-epilogue products against cuBLASLt at GPT-2 small's MLP shapes, in one
// program: each of ours checked against a CPU reference on sampled rows and against
// cuBLASLt's result over the whole output, then both timed (the best of cuBLASLt's heuristic
// candidates, as the engine picks), alternating, after an idle settle.
//
//   fc:  H[M, F] = X[M, C] W1^T (+ b1, GELU)      W1 [F, C]   (ours: gemm_tn_*)
//   dH:  dH[M, F] = dY[M, C] W2 (* gelu'(aux))    W2 [C, F]   (ours: gemm_nn_*)
//
//   bash bench/wgmma_gemm/run.sh
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "gemm.cuh"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
#define LT(x) do { cublasStatus_t s = (x); if (s != CUBLAS_STATUS_SUCCESS) { printf("cuBLASLt status %d at %d\n", (int)s, __LINE__); exit(1); } } while (0)
#define CU(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { printf("driver error %d at %d\n", (int)r, __LINE__); exit(1); } } while (0)

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed * 0x9e3779b9u;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
        p[i] = __float2bfloat16(((h & 0xffff) / 32768.0f - 1.0f) * scale);
    }
}

static float bf(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t to_bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
static double gelu(double x) { return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
static double gelu_grad(double x) {
    const double t = tanh(0.7978845608028654 * (x + 0.044715 * x * x * x));
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * x * x);
}

// A row-major [rows, cols] bf16 matrix as a 2-D map with boxes of 64 columns x box_rows rows,
// 128-byte swizzle.
static CUtensorMap tensor_map(const void* p, int rows, int cols, int box_rows) {
    CUtensorMap m;
    cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
    cuuint32_t box[2] = {64, (cuuint32_t)box_rows};
    cuuint32_t elem[2] = {1, 1};
    CU(cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(p), dims, strides, box, elem,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    return m;
}

typedef void (*Kernel)(const GmTensorMap, const GmTensorMap, const float*, unsigned*, unsigned*, int, int, int);

typedef void (*PersistentKernel)(const GmTensorMap, const GmTensorMap, const GmTensorMap, const GmTensorMap,
                                 const float*, int, int, int);

struct Ours {
    const char* name;
    Kernel k;
    int stages, epi, trans_b;
    PersistentKernel pk = nullptr;  // the persistent form: `stages` ring stages, `bufs` staging buffers
    int bufs = 0;
};

static float time_ms(const std::function<void()>& launch) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    launch();
    CK(cudaDeviceSynchronize());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::vector<float> ts;
    for (int r = 0; r < 7; r++) {
        CK(cudaEventRecord(e0));
        for (int k = 0; k < 10; k++) launch();
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        ts.push_back(ms / 10);
    }
    std::sort(ts.begin(), ts.end());
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return ts[3];
}

struct Lt {
    cublasLtHandle_t lt;
    void* ws;
    size_t ws_bytes = 64u << 20;
    Lt() { LT(cublasLtCreate(&lt)); CK(cudaMalloc(&ws, ws_bytes)); }
    // The best of the heuristic's candidates for D^T [F, M] (column-major) = first x second,
    // as the engine issues row-major products; returns a launcher.
    std::function<void()> plan(bool forward, cublasLtEpilogue_t epi, int M, int C, int F, const void* w, const void* x,
                               void* d, void* aux, const void* bias_bf16, float* best_ms, int* found_out) {
        cublasLtMatmulDesc_t op;
        LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t ta = forward ? CUBLAS_OP_T : CUBLAS_OP_N, tb = CUBLAS_OP_N;
        LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
        LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
        LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
        if (epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS) {
            LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_bf16, sizeof(bias_bf16)));
            cudaDataType_t bt = CUDA_R_16BF;
            LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
        }
        if (aux) {
            int64_t ld = F;
            LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
            LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
        }
        cublasLtMatrixLayout_t la, lb, ld;
        if (forward) LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, C, F, C));
        else LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, F, C, F));
        LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, C, M, C));
        LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, F, M, F));
        cublasLtMatmulPreference_t pref;
        LT(cublasLtMatmulPreferenceCreate(&pref));
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                sizeof(ws_bytes)));
        static cublasLtMatmulHeuristicResult_t res[8];
        int found = 0;
        LT(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 8, res, &found));
        *found_out = found;
        static float alpha = 1.0f, beta = 0.0f;
        int best_i = -1;
        *best_ms = 1e30f;
        for (int i = 0; i < found; i++) {
            if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
            cublasLtMatmulAlgo_t algo = res[i].algo;
            auto launch = [=]() {
                cublasLtMatmul(lt, op, &alpha, w, la, x, lb, &beta, d, ld, d, ld, &algo, ws, ws_bytes, 0);
            };
            if (cublasLtMatmul(lt, op, &alpha, w, la, x, lb, &beta, d, ld, d, ld, &algo, ws, ws_bytes, 0) !=
                CUBLAS_STATUS_SUCCESS)
                continue;
            float t = time_ms(launch);
            if (t < *best_ms) { *best_ms = t; best_i = i; }
        }
        cublasLtMatmulAlgo_t algo = res[best_i].algo;
        return [=]() { cublasLtMatmul(lt, op, &alpha, w, la, x, lb, &beta, d, ld, d, ld, &algo, ws, ws_bytes, 0); };
    }
};

// max |a - b| / max |b| over n bf16 values.
static double rel_diff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
    double md = 0, mb = 0;
    for (size_t i = 0; i < a.size(); i++) {
        md = std::max(md, (double)fabsf(bf(a[i]) - bf(b[i])));
        mb = std::max(mb, (double)fabsf(bf(b[i])));
    }
    return md / std::max(mb, 1e-30);
}

int main() {
    const int C = 768, F = 4 * C;
    CU(cuInit(0));
    Lt lt;
    int failures = 0;
    for (int M : {8192, 16384}) {
        __nv_bfloat16 *x, *w1, *w2, *d_ours, *d_lt, *aux_ours, *aux_lt, *bias_bf;
        float* bias;
        CK(cudaMalloc(&x, (size_t)M * C * 2));
        CK(cudaMalloc(&w1, (size_t)F * C * 2));
        CK(cudaMalloc(&w2, (size_t)F * C * 2));
        CK(cudaMalloc(&d_ours, (size_t)M * F * 2));
        CK(cudaMalloc(&d_lt, (size_t)M * F * 2));
        CK(cudaMalloc(&aux_ours, (size_t)M * F * 2));
        CK(cudaMalloc(&aux_lt, (size_t)M * F * 2));
        CK(cudaMalloc(&bias_bf, F * 2));
        CK(cudaMalloc(&bias, F * 4));
        fill<<<1024, 256>>>(x, (size_t)M * C, 1, 1.0f);
        fill<<<1024, 256>>>(w1, (size_t)F * C, 2, 0.08f);
        fill<<<1024, 256>>>(w2, (size_t)F * C, 3, 0.08f);
        fill<<<64, 256>>>(bias_bf, F, 4, 0.5f);
        std::vector<uint16_t> hb(F), hx((size_t)M * C), hw1((size_t)F * C), hw2((size_t)F * C);
        CK(cudaMemcpy(hb.data(), bias_bf, F * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hx.data(), x, hx.size() * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hw1.data(), w1, hw1.size() * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hw2.data(), w2, hw2.size() * 2, cudaMemcpyDeviceToHost));
        std::vector<float> hbf(F);
        for (int i = 0; i < F; i++) hbf[i] = bf(hb[i]);
        CK(cudaMemcpy(bias, hbf.data(), F * 4, cudaMemcpyHostToDevice));
        const CUtensorMap map_x = tensor_map(x, M, C, 128), map_w1 = tensor_map(w1, F, C, 128),
                          map_w2 = tensor_map(w2, C, F, 64);
        GmTensorMap gx, gw1, gw2;
        memcpy(&gx, &map_x, sizeof gx);
        memcpy(&gw1, &map_w1, sizeof gw1);
        memcpy(&gw2, &map_w2, sizeof gw2);
        const double flop = 2.0 * M * C * F;

        const CUtensorMap map_out = tensor_map(d_ours, M, F, 128), map_aux = tensor_map(aux_ours, M, F, 128);
        GmTensorMap gout, gaux;
        memcpy(&gout, &map_out, sizeof gout);
        memcpy(&gaux, &map_aux, sizeof gaux);
        int sms;
        CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        const Ours ours[] = {
            {"ours fc plain, persistent", nullptr, 3, 0, 0, gemm_tn_plain_persistent, 1},
            {"ours fc gelu+aux, persistent", nullptr, 3, 1, 0, gemm_tn_gelu_persistent, 1},
            {"ours fc gelu+aux, persistent 2+2", nullptr, 2, 1, 0, gemm_tn_gelu_persistent_b2, 2},
            {"ours dH plain, persistent", nullptr, 3, 0, 1, gemm_nn_plain_persistent, 1},
            {"ours dH dgelu, persistent", nullptr, 3, 2, 1, gemm_nn_dgelu_persistent, 1},
            {"ours dH dgelu, persistent 2+2", nullptr, 2, 2, 1, gemm_nn_dgelu_persistent_b2, 2},
            {"ours fc plain, 4 stages", gemm_tn_plain_s4, 4, 0, 0},
            {"ours fc gelu+aux, 4 stages", gemm_tn_gelu_s4, 4, 1, 0},
            {"ours dH plain, 4 stages", gemm_nn_plain_s4, 4, 0, 1},
            {"ours dH dgelu, 4 stages", gemm_nn_dgelu_s4, 4, 2, 1},
        };
        // cuBLASLt's results for the checks and its times.
        struct LtCase { const char* name; bool forward; cublasLtEpilogue_t epi; } lt_cases[] = {
            {"cuBLASLt fc plain", true, CUBLASLT_EPILOGUE_DEFAULT},
            {"cuBLASLt fc gelu_aux_bias (engine)", true, CUBLASLT_EPILOGUE_GELU_AUX_BIAS},
            {"cuBLASLt dH plain", false, CUBLASLT_EPILOGUE_DEFAULT},
            {"cuBLASLt dH dgelu (engine)", false, CUBLASLT_EPILOGUE_DGELU},
        };
        std::vector<std::function<void()>> lt_launch;
        std::vector<float> lt_ms;
        for (auto& c : lt_cases) {
            float best;
            int found;
            void* aux = c.epi == CUBLASLT_EPILOGUE_DEFAULT ? nullptr : (void*)aux_lt;
            // fc: first = W1, second = X; dH: first = W2, second = dY (x stands in for dY).
            lt_launch.push_back(lt.plan(c.forward, c.epi, M, C, F, c.forward ? (void*)w1 : (void*)w2, x, d_lt, aux,
                                        bias_bf, &best, &found));
            lt_ms.push_back(best);
        }
        for (const Ours& o : ours) {
            GmTensorMap gb = o.trans_b ? gw2 : gw1;
            std::function<void()> launch;
            if (o.pk) {
                const int smem = o.stages * GM_STAGE_BYTES + o.bufs * GP_STAGING + 1024;
                CK(cudaFuncSetAttribute(o.pk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                const int pairs = (F / GM_BN) * (M / (2 * GM_BM));
                const dim3 grid(1, 2 * std::min(pairs, sms / 2));
                launch = [&, o, gb, smem, grid]() {
                    o.pk<<<grid, GP_THREADS, smem>>>(gx, gb, gout, gaux, bias, M, F, C);
                };
            } else {
                const int smem = o.stages * GM_STAGE_BYTES + 1024;
                CK(cudaFuncSetAttribute(o.k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                const dim3 grid(F / GM_BN, M / GM_BM);
                launch = [&, o, gb, smem, grid]() {
                    o.k<<<grid, GM_THREADS, smem>>>(gx, gb, bias, (unsigned*)d_ours, (unsigned*)aux_ours, M, F, C);
                };
            }
            // The reference run: cuBLASLt's matching product. For dgelu both read the same
            // aux: the fc forward's pre-activation, written by cuBLASLt's gelu_aux_bias.
            if (o.epi == 2) {
                lt_launch[1]();
                CK(cudaMemcpy(aux_ours, aux_lt, (size_t)M * F * 2, cudaMemcpyDeviceToDevice));
            }
            const int lt_i = o.trans_b ? (o.epi == 2 ? 3 : 2) : (o.epi == 1 ? 1 : 0);
            lt_launch[lt_i]();
            launch();
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            std::vector<uint16_t> got((size_t)M * F), want((size_t)M * F), got_aux, aux_in;
            CK(cudaMemcpy(got.data(), d_ours, got.size() * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(want.data(), d_lt, want.size() * 2, cudaMemcpyDeviceToHost));
            if (o.epi == 1) {
                got_aux.resize((size_t)M * F);
                aux_in.resize((size_t)M * F);
                CK(cudaMemcpy(got_aux.data(), aux_ours, got_aux.size() * 2, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(aux_in.data(), aux_lt, aux_in.size() * 2, cudaMemcpyDeviceToHost));
            }
            if (o.epi == 2) {
                aux_in.resize((size_t)M * F);
                CK(cudaMemcpy(aux_in.data(), aux_ours, aux_in.size() * 2, cudaMemcpyDeviceToHost));
            }
            // CPU reference on sampled rows, in double: the product (and the bias), then the
            // epilogue applied to the bf16-rounded pre-activation as the kernel does.
            double worst = 0, scale = 0;
            for (int r : {0, 1, 127, 128, 4097, M - 1}) {
                for (int n = 0; n < F; n++) {
                    double acc = 0;
                    for (int k = 0; k < C; k++) {
                        const double b = o.trans_b ? bf(hw2[(size_t)k * F + n]) : bf(hw1[(size_t)n * C + k]);
                        acc += bf(hx[(size_t)r * C + k]) * b;
                    }
                    double ref;
                    if (o.epi == 1) {
                        const double pre = acc + hbf[n];
                        const double aux_got = bf(got_aux[(size_t)r * F + n]);
                        worst = std::max(worst, fabs(aux_got - pre) / 8.0);  // aux: a looser check
                        ref = gelu(bf(to_bf((float)pre)));
                    } else if (o.epi == 2) {
                        ref = acc * gelu_grad(bf(aux_in[(size_t)r * F + n]));
                    } else {
                        ref = acc;
                    }
                    worst = std::max(worst, fabs(bf(got[(size_t)r * F + n]) - ref));
                    scale = std::max(scale, fabs(ref));
                }
            }
            const double cpu_rel = worst / scale, lt_rel = rel_diff(got, want);
            const double aux_rel = o.epi == 1 ? rel_diff(got_aux, aux_in) : 0.0;
            // bf16 results: a few units of the last place of the largest value.
            const bool ok = cpu_rel < 1.6e-2 && lt_rel < 1.6e-2 && aux_rel < 1.6e-2;
            if (!ok) failures++;
            const float t = time_ms(launch), t_lt = time_ms(lt_launch[lt_i]);
            printf("M %5d  %-30s %8.1f us %4.0f TFLOP/s | %-36s %8.1f us %4.0f TFLOP/s | ours/lt %.3f "
                   "| vs CPU %.2e, vs cuBLASLt %.2e%s %s\n",
                   M, o.name, t * 1e3, flop / (t * 1e-3) / 1e12, lt_cases[lt_i].name, t_lt * 1e3,
                   flop / (t_lt * 1e-3) / 1e12, t_lt / t, cpu_rel, lt_rel,
                   o.epi == 1 ? (std::string(", aux ") + std::to_string(aux_rel)).c_str() : "", ok ? "ok" : "FAIL");
            fflush(stdout);
        }
        cudaFree(x); cudaFree(w1); cudaFree(w2); cudaFree(d_ours); cudaFree(d_lt); cudaFree(aux_ours);
        cudaFree(aux_lt); cudaFree(bias_bf); cudaFree(bias);
    }
    printf("%d failed\n", failures);
    return failures ? 1 : 0;
}
