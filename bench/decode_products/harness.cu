// The fused decode products of decode_product.cu, decode_product_mc.cu and decode_layer.cu
// (beside this file), outside the engine: checked against a CPU reference in double precision,
// then timed inside CUDA graphs (as decode steps run) beside cuBLASLt's products of the same
// shapes and the engine's own norm and SwiGLU kernels. The sources are included as an engine
// program would compile them (common.cuh and attention_tc.cu's helpers first).
//
//   bash bench/decode_products/run.sh            checks, then the chosen configurations' times
//   /tmp/decode_products sweep                   every configuration of the SmolLM2 products
//   /tmp/decode_products chain                   30 layers' dependent products, every design
//   /tmp/decode_products floor                   a persistent layer kernel's barriers and copies
//   /tmp/decode_products layer                   the persistent layer kernel, checked and timed
//   /tmp/decode_products lanes                   the engine's unfused layers, the batch split into parallel lanes
//
// Exits non-zero when a check exceeds its bound (bf16 1e-2, f16 2e-3 of the output's largest
// value) or a launch fails.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <cmath>
#include <vector>
#include <random>
#include <string>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cublasLt.h>

#include "../../src/engine/cuda/common.cuh"
#include "../../src/engine/cuda/attention_tc.cu"
#include "../../src/engine/cuda/rmsnorm.cu"
#include "../../src/engine/cuda/swiglu.cu"
#include "decode_product.cu"
#include "decode_product_mc.cu"
#include "decode_layer.cu"

DP_ENTRY_POINTS(TcBf16, bf16)
DP_ENTRY_POINTS(TcF16, f16)
MC_ENTRY_POINTS(TcBf16, bf16)
MC_ENTRY_POINTS(TcF16, f16)

#define CK(x)                                                                          \
    do {                                                                               \
        cudaError_t e_ = (x);                                                          \
        if (e_ != cudaSuccess) {                                                       \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(2);                                                                   \
        }                                                                              \
    } while (0)
#define CL(x)                                                                          \
    do {                                                                               \
        cublasStatus_t s_ = (x);                                                       \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                             \
            fprintf(stderr, "%s:%d %s: status %d\n", __FILE__, __LINE__, #x, (int)s_); \
            exit(2);                                                                   \
        }                                                                              \
    } while (0)

typedef void (*Kernel)(DecodeProductArgs);

// The engine's residual RMSNorm and SwiGLU waiting on their predecessor as programmatic
// dependents (griddepcontrol.wait first, so they may be launched before it ends).
extern "C" __global__ void pdl_residual_rmsnorm_bf16(bf16* sum, bf16* out, float* rstd, const bf16* x,
                                                     const bf16* delta, const bf16* gamma, int c, float eps) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    rmsnorm_forward<bf16, true>(sum, out, rstd, x, delta, gamma, c, eps);
}
extern "C" __global__ void pdl_swiglu_bf16(bf16* h, const bf16* gu, long long n, int f) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    swiglu_forward<bf16>(h, gu, n, f);
}
// One launch through cudaLaunchKernelEx: in clusters of `cluster` CTAs when given, and as a
// programmatic dependent of the previous kernel on the stream when `pdl`.
template <typename... A>
static void launch_ex(void (*f)(A...), dim3 grid, int block, int shared, const dim3* cluster, bool pdl,
                      cudaStream_t st, A... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = shared;
    cfg.stream = st;
    cudaLaunchAttribute attr[2];
    int n = 0;
    if (cluster) {
        attr[n].id = cudaLaunchAttributeClusterDimension;
        attr[n].val.clusterDim.x = cluster->x;
        attr[n].val.clusterDim.y = cluster->y;
        attr[n].val.clusterDim.z = cluster->z;
        ++n;
    }
    if (pdl) {
        attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[n].val.programmaticStreamSerializationAllowed = 1;
        ++n;
    }
    cfg.attrs = attr;
    cfg.numAttrs = n;
    CK(cudaLaunchKernelEx(&cfg, f, args...));
}
template <typename... A>
static void launch_pdl(void (*f)(A...), int grid, int block, cudaStream_t st, A... args) {
    launch_ex(f, dim3(grid), block, 0, nullptr, true, st, args...);
}

// How many clusters of `f` (`ctas` CTAs of `block` threads and `shared` bytes, in its
// compiled cluster shape) can be resident at once: a grid barrier needs them all.
static int resident_clusters(const void* f, int ctas, int block, int shared) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(ctas);
    cfg.blockDim = dim3(block);
    cfg.dynamicSmemBytes = shared;
    int clusters = 0;
    CK(cudaOccupancyMaxActiveClusters(&clusters, f, &cfg));
    return clusters;
}

// The floor of a persistent layer kernel (one launch a layer, its four products as phases
// separated by grid-wide barriers): each phase only waits at the barrier, then the CTAs that
// own a tile of the phase copy the phase's whole X (64 rows; K 576, or 1536 for down) from
// L2 with cp.async and write one value; no products. `counter` is zeroed before each launch.
extern "C" __global__ void __launch_bounds__(256) layer_floor(const unsigned short* x576, const unsigned short* x1536,
                                                              unsigned short* out, unsigned* counter, int copy) {
    extern __shared__ __align__(16) unsigned short fl_smem[];
    const int owners[4] = {120, 72, 132, 72};  // CTAs with a tile: q/k/v, o, gate/up, down
    for (int p = 0; p < 4; ++p) {
        if (p) dp_grid_barrier(counter, p * gridDim.x);
        if ((int)blockIdx.x >= owners[p] || !copy) continue;
        const int k = p == 3 ? 1536 : 576, chunks = k / 8;
        const unsigned short* x = p == 3 ? x1536 : x576;
        for (int i = threadIdx.x; i < 64 * chunks; i += 256) {
            const int r = i / chunks, c = (i - r * chunks) * 8;
            tc_copy_async(fl_smem + r * (k + 8) + c, x + (size_t)r * k + c, true);
        }
        tc_commit();
        tc_wait<0>();
        __syncthreads();
        if (threadIdx.x == 0) out[blockIdx.x * 4 + p] = fl_smem[threadIdx.x * 8];
    }
}

// The same floor with X reaching each cluster of 8 CTAs by one bulk multicast copy a row (each
// CTA copies 8 of the 64 rows for all 8), one mbarrier a phase.
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(256)
    layer_floor_mc(const unsigned short* x576, const unsigned short* x1536, unsigned short* out, unsigned* counter) {
    extern __shared__ __align__(16) unsigned short fl_smem[];
    unsigned rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const unsigned bar0 = tc_smem_addr(fl_smem + 64 * (1536 + 8));
    if (threadIdx.x == 0) {
        for (int p = 0; p < 4; ++p) dp_init_barrier(bar0 + 8 * p);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    dp_cluster_sync();
    for (int p = 0; p < 4; ++p) {
        if (p) dp_grid_barrier(counter, p * gridDim.x);
        asm volatile("fence.proxy.async.global;" ::: "memory");
        const int k = p == 3 ? 1536 : 576;
        const unsigned short* x = p == 3 ? x1536 : x576;
        const unsigned bar = bar0 + 8 * p;
        if (threadIdx.x == 0) dp_expect(bar, 64 * k * 2);
        if (threadIdx.x < 8) {
            const int r = rank * 8 + threadIdx.x;
            dp_multicast(fl_smem + r * (k + 8), x + (size_t)r * k, k * 2, bar, 0xff);
        }
        dp_wait(bar);
        if (threadIdx.x == 0) out[blockIdx.x * 4 + p] = fl_smem[8 * p];
    }
    // No CTA leaves while a multicast into another may still be in flight from it.
    dp_cluster_sync();
}

// An empty kernel: the launch cost of a graph node, with and without a cluster.
extern "C" __global__ void dp_empty(DecodeProductArgs) {}

static unsigned short to_bits(float v, bool half) {
    if (half) {
        __half h = __float2half_rn(v);
        return *(unsigned short*)&h;
    }
    unsigned u;
    memcpy(&u, &v, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
static float from_bits(unsigned short b, bool half) {
    if (half) {
        __half h;
        *(unsigned short*)&h = b;
        return __half2float(h);
    }
    unsigned u = (unsigned)b << 16;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

struct Shape {
    const char* name;
    int kind;  // DP_NORM, DP_SWIGLU, DP_RESID
    int n, k;  // output columns (SwiGLU: F) and reduction
    int wrows() const { return kind == DP_SWIGLU ? 2 * n : n; }
};

struct Config {
    int nb, s, tiles;
};

// The configuration a product runs in: 64-column tiles unless they leave the GPU less
// than half covered; then the largest cluster (at most 8 CTAs, K a multiple of 16 S, the
// slices within 200 KiB of shared memory) that keeps the CTAs within 1.1 waves of one a
// multiprocessor, or the smallest that fits when none does. nb 0: no configuration fits.
static Config choose_nb(const Shape& sh, int sms, int nb) {
    const int oc = sh.kind == DP_SWIGLU ? nb / 2 : nb;
    const int tiles = (sh.n + oc - 1) / oc;
    int fit = 0, within = 0;
    for (int s = 1; s <= 8; ++s) {
        if (sh.k % (16 * s) != 0 || dp_shared_bytes(nb, sh.k / s) > 200 * 1024) continue;
        if (!fit) fit = s;
        if (tiles * s <= sms * 11 / 10) within = s;
    }
    const int s = within ? within : fit;
    return Config{s ? nb : 0, s, tiles};
}
static Config choose(const Shape& sh, int sms) {
    const Config wide = choose_nb(sh, sms, 64);
    if (sh.kind == DP_SWIGLU || (wide.nb && wide.tiles * wide.s >= sms / 2)) return wide;
    const Config narrow = choose_nb(sh, sms, 32);
    return narrow.nb ? narrow : wide;
}

static Kernel kernel_for(const Shape& sh, int nb, bool half) {
    if (half) {
        if (sh.kind == DP_NORM) return nb == 64 ? decode_product_norm_nb64_f16 : decode_product_norm_nb32_f16;
        if (sh.kind == DP_SWIGLU) return decode_product_swiglu_nb64_f16;
        return nb == 64 ? decode_product_resid_nb64_f16 : decode_product_resid_nb32_f16;
    }
    if (sh.kind == DP_NORM) return nb == 64 ? decode_product_norm_nb64_bf16 : decode_product_norm_nb32_bf16;
    if (sh.kind == DP_SWIGLU) return decode_product_swiglu_nb64_bf16;
    return nb == 64 ? decode_product_resid_nb64_bf16 : decode_product_resid_nb32_bf16;
}

static bool g_pdl = false;  // launch as programmatic dependents of the previous kernel

static void launch(const Shape& sh, const Config& c, bool half, const DecodeProductArgs& a,
                   cudaStream_t st) {
    Kernel f = kernel_for(sh, c.nb, half);
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
    const dim3 cluster(1, c.s, 1);
    launch_ex(f, dim3(c.tiles, c.s, (a.m + DP_ROWS - 1) / DP_ROWS), DP_THREADS, dp_shared_bytes(c.nb, sh.k / c.s),
              &cluster, g_pdl, st, a);
}

// The multicast design (decode_product_mc.cu): 16 columns a CTA (SwiGLU 16 outputs of 32 W
// rows; 8 above K 1024, so that X fits), clusters of 8 along N.
static bool g_mc = false;
static const int MC_CLUSTER = 8;
static int mc_nb(const Shape& sh) { return sh.kind == DP_SWIGLU ? 32 : sh.k > 1024 ? 8 : 16; }
static void launch_mc(const Shape& sh, bool half, const DecodeProductArgs& a, cudaStream_t st) {
    const int nb = mc_nb(sh);
    Kernel f;
    if (half) f = sh.kind == DP_NORM ? decode_product_mc_norm_nb16_f16 : sh.kind == DP_SWIGLU ? decode_product_mc_swiglu_nb32_f16
                  : nb == 16 ? decode_product_mc_resid_nb16_f16 : decode_product_mc_resid_nb8_f16;
    else f = sh.kind == DP_NORM ? decode_product_mc_norm_nb16_bf16 : sh.kind == DP_SWIGLU ? decode_product_mc_swiglu_nb32_bf16
             : nb == 16 ? decode_product_mc_resid_nb16_bf16 : decode_product_mc_resid_nb8_bf16;
    const int bytes = mc_shared_bytes(nb, sh.k);
    CK(cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    const int oc = sh.kind == DP_SWIGLU ? nb / 2 : nb;
    const int tiles = (sh.n + oc - 1) / oc;
    const dim3 cluster(MC_CLUSTER, 1, 1);
    launch_ex(f, dim3((tiles + MC_CLUSTER - 1) / MC_CLUSTER * MC_CLUSTER, 1, (a.m + DP_ROWS - 1) / DP_ROWS), MC_THREADS,
              bytes, &cluster, g_pdl, st, a);
}

struct Dev {
    void* p = nullptr;
    explicit Dev(size_t bytes) { CK(cudaMalloc(&p, bytes)); }
    ~Dev() { cudaFree(p); }
};

// Zero-filled device buffers that live as long as the arena.
struct Zeros {
    std::vector<Dev*> keep;
    void* operator()(size_t bytes) {
        keep.push_back(new Dev(bytes));
        CK(cudaMemset(keep.back()->p, 0, bytes));
        return keep.back()->p;
    }
    ~Zeros() {
        for (Dev* d : keep) delete d;
    }
};

// Zeroed operands of `layers` products of shape `sh` at m rows, each on its own weights (so that
// a graph of them reads the weights from memory, as a decode step of the whole model does).
struct Products {
    Zeros z;
    std::vector<void*> w;
    void *x, *gamma, *out;
    Products(const Shape& sh, int m, int layers) {
        for (int l = 0; l < layers; ++l) w.push_back(z((size_t)sh.wrows() * sh.k * 2));
        x = z((size_t)m * sh.k * 2);
        gamma = z(sh.k * 2);
        out = z((size_t)m * sh.wrows() * 2);
    }
    // Layer l's product, its output written over the residual it reads (DP_RESID).
    DecodeProductArgs args(const Shape& sh, int m, int l) const {
        return DecodeProductArgs{x, w[l], gamma, out, out, m, sh.k, sh.n, sh.k, sh.n, 1e-5f};
    }
};

static std::vector<unsigned short> random_bits(size_t n, float scale, bool half, std::mt19937& g,
                                               float offset = 0.f) {
    std::normal_distribution<float> d(0.f, 1.f);
    std::vector<unsigned short> v(n);
    for (auto& e : v) e = to_bits(offset + scale * d(g), half);
    return v;
}

// One product on random inputs against the CPU in double; returns the error over the largest
// reference value.
static double check(const Shape& sh, int m, bool half, int sms, std::mt19937& g) {
    const int k = sh.k, n = sh.n, wr = sh.wrows();
    const float eps = 1e-5f;
    auto x = random_bits((size_t)m * k, 1.5f, half, g);
    auto w = random_bits((size_t)wr * k, 1.0f / sqrtf((float)k), half, g);
    auto gamma = random_bits(k, 0.3f, half, g, 1.0f);
    auto resid = random_bits((size_t)m * n, 1.0f, half, g);
    Dev dx(x.size() * 2), dw(w.size() * 2), dg(gamma.size() * 2), dr(resid.size() * 2), dout((size_t)m * n * 2);
    CK(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dg.p, gamma.data(), gamma.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dr.p, resid.data(), resid.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemset(dout.p, 0xff, (size_t)m * n * 2));
    DecodeProductArgs a{dx.p, dw.p, dg.p, dr.p, dout.p, m, k, n, k, n, eps};
    Config c = choose(sh, sms);
    if (g_mc) launch_mc(sh, half, a, 0);
    else launch(sh, c, half, a, 0);
    CK(cudaDeviceSynchronize());
    std::vector<unsigned short> out((size_t)m * n);
    CK(cudaMemcpy(out.data(), dout.p, out.size() * 2, cudaMemcpyDeviceToHost));
    double worst = 0, largest = 0;
    for (int i = 0; i < m; ++i) {
        double rstd = 1.0;
        if (sh.kind != DP_RESID) {
            double s = 0;
            for (int j = 0; j < k; ++j) {
                const double v = from_bits(x[(size_t)i * k + j], half);
                s += v * v;
            }
            rstd = 1.0 / sqrt(s / k + eps);
        }
        for (int col = 0; col < n; ++col) {
            auto dot = [&](int row) {
                double s = 0;
                for (int j = 0; j < k; ++j) {
                    double v = from_bits(x[(size_t)i * k + j], half);
                    if (sh.kind != DP_RESID) v *= rstd * from_bits(gamma[j], half);
                    s += v * from_bits(w[(size_t)row * k + j], half);
                }
                return s;
            };
            double ref;
            if (sh.kind == DP_NORM) ref = dot(col);
            else if (sh.kind == DP_SWIGLU) {
                const double gt = dot(col), up = dot(n + col);
                ref = gt / (1.0 + exp(-gt)) * up;
            } else ref = from_bits(resid[(size_t)i * n + col], half) + dot(col);
            const double got = from_bits(out[(size_t)i * n + col], half);
            worst = std::max(worst, std::isfinite(got) ? fabs(got - ref) : 1e30);
            largest = std::max(largest, fabs(ref));
        }
    }
    return worst / largest;
}

// cuBLASLt's product Y[m, n] = X[m, k] W[n, k]^T in bf16 (its heuristic's first algorithm).
struct LtProduct {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulAlgo_t algo;
    LtProduct(cublasLtHandle_t h, int m, int n, int k, void* ws, size_t wsb) {
        CL(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t t = CUBLAS_OP_T;
        CL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
        CL(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, n, k));
        CL(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, m, k));
        CL(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, n, m, n));
        cublasLtMatmulPreference_t pref;
        CL(cublasLtMatmulPreferenceCreate(&pref));
        CL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
        cublasLtMatmulHeuristicResult_t r;
        int found = 0;
        CL(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, &r, &found));
        if (!found) { fprintf(stderr, "no cuBLASLt algorithm\n"); exit(2); }
        algo = r.algo;
    }
    void run(cublasLtHandle_t h, const void* w, const void* x, void* y, void* ws, size_t wsb, cudaStream_t st) {
        const float one = 1.f, zero = 0.f;
        CL(cublasLtMatmul(h, desc, &one, w, la, x, lb, &zero, y, ld, y, ld, &algo, ws, wsb, st));
    }
};

// Microseconds per replay of a graph captured from `body`, median of 7 timings of 20 replays.
template <class F> static double time_graph(cudaStream_t st, F body) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    body();
    CK(cudaStreamEndCapture(st, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, st));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::vector<double> t;
    for (int r = 0; r < 7; ++r) {
        CK(cudaEventRecord(e0, st));
        for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(exec, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1000.0 / 20);
    }
    std::sort(t.begin(), t.end());
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
    return t[3];
}

int main(int argc, char** argv) {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::mt19937 g(7);
    // SmolLM2-135M's products (d 576, F 1536, q/k/v 576 + 2 x 192), and a 1B-like width (2048).
    const std::vector<Shape> shapes = {
        {"qkv (norm)", DP_NORM, 960, 576},    {"o (+resid)", DP_RESID, 576, 576},
        {"gate_up (norm, swiglu)", DP_SWIGLU, 1536, 576}, {"down (+resid)", DP_RESID, 576, 1536},
        {"2048 qkv (norm)", DP_NORM, 3072, 2048}, {"2048 o (+resid)", DP_RESID, 2048, 2048},
    };
    int failed = 0;
    const bool mode = argc > 1;
    if (!mode) printf("checks (error over the largest reference value; bounds bf16 1e-2, f16 2e-3)\n");
    for (bool mc : {false, true}) {
        g_mc = mc;
        for (const auto& sh : mode ? std::vector<Shape>{} : shapes) {
            const Config c = choose(sh, sms);
            if (mc && mc_shared_bytes(mc_nb(sh), sh.k) > 227 * 1024) continue;
            for (int m : {1, 5, 64, 100}) {
                for (bool half : {false, true}) {
                    const double e = check(sh, m, half, sms, g);
                    const bool ok = e <= (half ? 2e-3 : 1e-2);
                    failed += !ok;
                    if (mc)
                        printf("  multicast %-24s m %3d %s  nb %d: %.2e %s\n", sh.name, m, half ? "f16 " : "bf16",
                               mc_nb(sh), e, ok ? "ok" : "FAIL");
                    else
                        printf("  %-24s m %3d %s  nb %d s %d tiles %d: %.2e %s\n", sh.name, m, half ? "f16 " : "bf16",
                               c.nb, c.s, c.tiles, e, ok ? "ok" : "FAIL");
                }
            }
        }
    }
    g_mc = false;

    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const int layers = 30;
    cublasLtHandle_t lt;
    CL(cublasLtCreate(&lt));
    const size_t wsb = 32 << 20;
    Dev ws(wsb);
    if (argc > 1 && std::string(argv[1]) == "sweep") {
        for (int cl : {0, 1, 6}) {
            const dim3 cluster(1, cl, 1);
            const double t = time_graph(st, [&] {
                for (int l = 0; l < layers; ++l)
                    launch_ex(dp_empty, dim3(15, 6, 1), DP_THREADS, 0, cl ? &cluster : nullptr, false, st,
                              DecodeProductArgs{});
            }) / layers;
            printf("empty kernel, 90 CTAs, cluster %d: %.2f us a launch\n", cl, t);
        }
        // Every configuration of the four SmolLM2 products at m 64 (us a product, graph-timed).
        const int m = 64;
        for (int si = 0; si < 4; ++si) {
            const Shape& sh = shapes[si];
            const Products bufs(sh, m, layers);
            printf("sweep %s:", sh.name);
            for (int nb : {64, 32}) {
                if (sh.kind == DP_SWIGLU && nb == 32) continue;
                for (int s = 1; s <= 8; ++s) {
                    if (sh.k % (16 * s) || dp_shared_bytes(nb, sh.k / s) > 200 * 1024) continue;
                    const int oc = sh.kind == DP_SWIGLU ? nb / 2 : nb;
                    const Config c{nb, s, (sh.n + oc - 1) / oc};
                    const double t = time_graph(st, [&] {
                        for (int l = 0; l < layers; ++l) launch(sh, c, false, bufs.args(sh, m, l), st);
                    }) / layers;
                    printf("  nb%d s%d %.2f", nb, s, t);
                }
            }
            printf("\n");
        }
        return 0;
    }
    if (argc > 1 && std::string(argv[1]) == "layer") {
        // The persistent layer kernel (decode_layer.cu): one layer on random values against the
        // CPU, then 30 layers' launches in a graph, beside the engine's unfused layer.
        CK(cudaFuncSetAttribute(decode_layer_bf16, cudaFuncAttributeMaxDynamicSharedMemorySize, DL_SHARED));
        {
            const int clusters = resident_clusters((const void*)decode_layer_bf16, DL_CTAS, 256, DL_SHARED);
            printf("decode_layer: %d bytes of shared memory, clusters of 8 resident at once: %d (needs %d)\n",
                   DL_SHARED, clusters, DL_CTAS / 8);
            fflush(stdout);
            if (clusters < DL_CTAS / 8) return 3;
        }
        int failed = 0;
        for (int m : {1, 5, 64}) {
            auto hv = random_bits((size_t)m * 576, 1.5f, false, g);
            auto attv = random_bits((size_t)m * 576, 1.0f, false, g);
            auto wq = random_bits((size_t)960 * 576, 1.0f / 24, false, g);
            auto wo = random_bits((size_t)576 * 576, 1.0f / 24, false, g);
            auto wgu = random_bits((size_t)3072 * 576, 1.0f / 24, false, g);
            auto wd = random_bits((size_t)576 * 1536, 1.0f / 39, false, g);
            auto g1 = random_bits(576, 0.3f, false, g, 1.0f), g2 = random_bits(576, 0.3f, false, g, 1.0f);
            auto up = [&](const std::vector<unsigned short>& v) {
                Dev* d = new Dev(v.size() * 2);
                CK(cudaMemcpy(d->p, v.data(), v.size() * 2, cudaMemcpyHostToDevice));
                return d;
            };
            Dev *dh = up(hv), *datt = up(attv), *dwq = up(wq), *dwo = up(wo), *dwgu = up(wgu), *dwd = up(wd), *dg1 = up(g1),
                *dg2 = up(g2);
            Dev dqkv((size_t)m * 960 * 2), dact((size_t)m * 1536 * 2), dcount(4);
            CK(cudaMemset(dcount.p, 0, 4));
            LayerArgs la{(bf16*)dh->p, (const bf16*)datt->p, (bf16*)dqkv.p, (bf16*)dact.p, (const bf16*)dwq->p,
                         (const bf16*)dwo->p, (const bf16*)dwgu->p, (const bf16*)dwd->p, (const bf16*)dg1->p,
                         (const bf16*)dg2->p, (unsigned*)dcount.p, m, 1e-5f};
            decode_layer_bf16<<<DL_CTAS, 256, DL_SHARED>>>(la);
            CK(cudaDeviceSynchronize());
            std::vector<unsigned short> qkv_out((size_t)m * 960), act_out((size_t)m * 1536), h_out((size_t)m * 576);
            CK(cudaMemcpy(qkv_out.data(), dqkv.p, qkv_out.size() * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(act_out.data(), dact.p, act_out.size() * 2, cudaMemcpyDeviceToHost));
            CK(cudaMemcpy(h_out.data(), dh->p, h_out.size() * 2, cudaMemcpyDeviceToHost));
            // The reference: double precision, rounded to bf16 where the engine's kernels store.
            auto f = [&](unsigned short b) { return (double)from_bits(b, false); };
            auto rb = [&](double v) { return (double)from_bits(to_bits((float)v, false), false); };
            double e_qkv = 0, m_qkv = 0, e_act = 0, m_act = 0, e_h = 0, m_h = 0;
            for (int i = 0; i < m; ++i) {
                std::vector<double> h0(576), h1(576), act(1536);
                for (int j = 0; j < 576; ++j) h0[j] = f(hv[(size_t)i * 576 + j]);
                auto rstd = [&](const std::vector<double>& x) {
                    double s2 = 0;
                    for (double v : x) s2 += v * v;
                    return 1.0 / sqrt(s2 / 576 + 1e-5);
                };
                const double r0 = rstd(h0);
                for (int n = 0; n < 960; ++n) {
                    double s2 = 0;
                    for (int k = 0; k < 576; ++k) s2 += h0[k] * r0 * f(g1[k]) * f(wq[(size_t)n * 576 + k]);
                    e_qkv = std::max(e_qkv, fabs(f(qkv_out[(size_t)i * 960 + n]) - s2));
                    m_qkv = std::max(m_qkv, fabs(s2));
                }
                for (int n = 0; n < 576; ++n) {
                    double s2 = 0;
                    for (int k = 0; k < 576; ++k) s2 += f(attv[(size_t)i * 576 + k]) * f(wo[(size_t)n * 576 + k]);
                    h1[n] = rb(h0[n] + rb(s2));
                }
                const double r1 = rstd(h1);
                for (int n = 0; n < 1536; ++n) {
                    double gt = 0, u = 0;
                    for (int k = 0; k < 576; ++k) {
                        const double x = h1[k] * r1 * f(g2[k]);
                        gt += x * f(wgu[(size_t)n * 576 + k]);
                        u += x * f(wgu[(size_t)(1536 + n) * 576 + k]);
                    }
                    gt = rb(gt), u = rb(u);
                    act[n] = rb(gt / (1 + exp(-gt)) * u);
                    e_act = std::max(e_act, fabs(f(act_out[(size_t)i * 1536 + n]) - act[n]));
                    m_act = std::max(m_act, fabs(act[n]));
                }
                for (int n = 0; n < 576; ++n) {
                    double s2 = 0;
                    for (int k = 0; k < 1536; ++k) s2 += act[k] * f(wd[(size_t)n * 1536 + k]);
                    const double ref = rb(h1[n] + rb(s2));
                    e_h = std::max(e_h, fabs(f(h_out[(size_t)i * 576 + n]) - ref));
                    m_h = std::max(m_h, fabs(ref));
                }
            }
            const double eq = e_qkv / m_qkv, ea = e_act / m_act, eh = e_h / m_h;
            const bool ok = eq <= 1e-2 && ea <= 1e-2 && eh <= 1e-2;
            failed += !ok;
            printf("decode_layer m %d: q/k/v %.2e, SwiGLU output %.2e, residual stream %.2e (bound 1e-2) %s\n", m, eq, ea,
                   eh, ok ? "ok" : "FAIL");
            for (Dev* d : {dh, datt, dwq, dwo, dwgu, dwd, dg1, dg2}) delete d;
        }
        // Timing: 30 layers on their own (zero) weights, each launch with its own counter.
        for (int m : {1, 64}) {
            Zeros zeros;
            void* h = zeros((size_t)m * 576 * 2);
            void* att = zeros((size_t)m * 576 * 2);
            void* qkv = zeros((size_t)m * 960 * 2);
            void* act = zeros((size_t)m * 1536 * 2);
            void* counters = zeros(layers * 4);
            std::vector<LayerArgs> args;
            for (int l = 0; l < layers; ++l)
                args.push_back(LayerArgs{(bf16*)h, (const bf16*)att, (bf16*)qkv, (bf16*)act,
                                         (const bf16*)zeros((size_t)960 * 576 * 2), (const bf16*)zeros((size_t)576 * 576 * 2),
                                         (const bf16*)zeros((size_t)3072 * 576 * 2), (const bf16*)zeros((size_t)576 * 1536 * 2),
                                         (const bf16*)zeros(576 * 2), (const bf16*)zeros(576 * 2), (unsigned*)counters + l, m,
                                         1e-5f});
            const double t = time_graph(st, [&] {
                CK(cudaMemsetAsync(counters, 0, layers * 4, st));
                for (int l = 0; l < layers; ++l) decode_layer_bf16<<<DL_CTAS, 256, DL_SHARED, st>>>(args[l]);
            }) / layers;
            printf("decode_layer m %d: %.2f us a layer (its four products, norms, SwiGLU and residual adds)\n", m, t);
            fflush(stdout);
        }
        return failed ? 1 : 0;
    }
    if (argc > 1 && std::string(argv[1]) == "floor") {
        Dev x576(64 * 576 * 2), x1536(64 * 1536 * 2), out(4096 * 2), counters(layers * 4);
        CK(cudaMemset(x576.p, 0, 64 * 576 * 2));
        CK(cudaMemset(x1536.p, 0, 64 * 1536 * 2));
        const int bytes = 64 * (1536 + 8) * 2;
        CK(cudaFuncSetAttribute(layer_floor, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        for (int copy : {0, 1})
            for (int grid : {120, 132}) {
                const double t = time_graph(st, [&] {
                    CK(cudaMemsetAsync(counters.p, 0, layers * 4, st));
                    for (int l = 0; l < layers; ++l)
                        layer_floor<<<grid, 256, bytes, st>>>((const unsigned short*)x576.p, (const unsigned short*)x1536.p,
                                                              (unsigned short*)out.p, (unsigned*)counters.p + l, copy);
                }) / layers;
                printf("persistent layer floor (%s), %d CTAs: %.2f us a layer\n",
                       copy ? "three barriers and the four phases' X copies" : "three barriers only", grid, t);
                fflush(stdout);
            }
        const int mc_bytes = 64 * (1536 + 8) * 2 + 64;
        CK(cudaFuncSetAttribute(layer_floor_mc, cudaFuncAttributeMaxDynamicSharedMemorySize, mc_bytes));
        // A grid barrier needs every CTA resident: at most this many clusters of 8 are.
        const int clusters = resident_clusters((const void*)layer_floor_mc, 128, 256, mc_bytes);
        printf("clusters of 8 that can be resident at once: %d\n", clusters);
        fflush(stdout);
        for (int grid : {64, 8 * std::min(clusters, 16)}) {
            const double t = time_graph(st, [&] {
                CK(cudaMemsetAsync(counters.p, 0, layers * 4, st));
                for (int l = 0; l < layers; ++l)
                    layer_floor_mc<<<grid, 256, mc_bytes, st>>>((const unsigned short*)x576.p, (const unsigned short*)x1536.p,
                                                                (unsigned short*)out.p, (unsigned*)counters.p + l);
            }) / layers;
            printf("persistent layer floor (three barriers, X multicast to clusters of 8), %d CTAs: %.2f us a layer\n", grid, t);
        }
        return 0;
    }
    if (argc > 1 && std::string(argv[1]) == "lanes") {
        // The engine's unfused SmolLM2 layer without its attention (four cuBLASLt products, two
        // residual RMSNorms, SwiGLU) for 30 layers, the batch split into `lanes` independent
        // groups of rows: each lane's layers run on their own stream, forked from the capturing
        // stream and joined back, so one graph holds the lanes as parallel branches. The
        // weights are shared; each lane has its own activations and cuBLASLt workspace.
        Zeros zeros;
        std::vector<void*> wq, wo, wg, wd, gq, gg;
        for (int l = 0; l < layers; ++l) {
            wq.push_back(zeros((size_t)960 * 576 * 2));
            wo.push_back(zeros((size_t)576 * 576 * 2));
            wg.push_back(zeros((size_t)3072 * 576 * 2));
            wd.push_back(zeros((size_t)576 * 1536 * 2));
            gq.push_back(zeros(576 * 2));
            gg.push_back(zeros(576 * 2));
        }
        struct Lane {
            cudaStream_t s;
            cudaEvent_t done;
            void *h, *qkv, *att, *o_out, *mid, *ln, *rstd, *gu_out, *act, *d_out, *ws;
            LtProduct *pq, *po, *pg, *pd;
        };
        cudaEvent_t fork;
        CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
        for (int total : {64, 128, 256}) {
            double one = 0;
            for (int lanes : {1, 2, 4, 8}) {
                const int m = total / lanes;
                std::vector<Lane> ls(lanes);
                for (auto& x : ls) {
                    CK(cudaStreamCreateWithFlags(&x.s, cudaStreamNonBlocking));
                    CK(cudaEventCreateWithFlags(&x.done, cudaEventDisableTiming));
                    x.h = zeros((size_t)m * 576 * 2);
                    x.qkv = zeros((size_t)m * 960 * 2);
                    x.att = zeros((size_t)m * 576 * 2);
                    x.o_out = zeros((size_t)m * 576 * 2);
                    x.mid = zeros((size_t)m * 576 * 2);
                    x.ln = zeros((size_t)m * 576 * 2);
                    x.rstd = zeros((size_t)m * 4);
                    x.gu_out = zeros((size_t)m * 3072 * 2);
                    x.act = zeros((size_t)m * 1536 * 2);
                    x.d_out = zeros((size_t)m * 576 * 2);
                    x.ws = zeros(wsb);
                    x.pq = new LtProduct(lt, m, 960, 576, x.ws, wsb);
                    x.po = new LtProduct(lt, m, 576, 576, x.ws, wsb);
                    x.pg = new LtProduct(lt, m, 3072, 576, x.ws, wsb);
                    x.pd = new LtProduct(lt, m, 576, 1536, x.ws, wsb);
                }
                const int norm_threads = std::min(512, std::max(32, (576 / 8 + 31) / 32 * 32));
                const long long sw_n = (long long)m * 1536;
                const int sw_blocks = (int)std::min<long long>(65535, (sw_n / 4 + 255) / 256);
                const double step = time_graph(st, [&] {
                    CK(cudaEventRecord(fork, st));
                    for (auto& x : ls) {
                        CK(cudaStreamWaitEvent(x.s, fork, 0));
                        for (int l = 0; l < layers; ++l) {
                            x.pq->run(lt, wq[l], x.ln, x.qkv, x.ws, wsb, x.s);
                            x.po->run(lt, wo[l], x.att, x.o_out, x.ws, wsb, x.s);
                            residual_rmsnorm_forward_bf16<<<m, norm_threads, 0, x.s>>>(
                                (bf16*)x.mid, (bf16*)x.ln, (float*)x.rstd, (const bf16*)x.h, (const bf16*)x.o_out,
                                (const bf16*)gq[l], 576, 1e-5f);
                            x.pg->run(lt, wg[l], x.ln, x.gu_out, x.ws, wsb, x.s);
                            swiglu_forward_bf16<<<sw_blocks, 256, 0, x.s>>>((bf16*)x.act, (const bf16*)x.gu_out, sw_n, 1536);
                            x.pd->run(lt, wd[l], x.act, x.d_out, x.ws, wsb, x.s);
                            residual_rmsnorm_forward_bf16<<<m, norm_threads, 0, x.s>>>(
                                (bf16*)x.h, (bf16*)x.ln, (float*)x.rstd, (const bf16*)x.mid, (const bf16*)x.d_out,
                                (const bf16*)gg[l], 576, 1e-5f);
                        }
                        CK(cudaEventRecord(x.done, x.s));
                        CK(cudaStreamWaitEvent(st, x.done, 0));
                    }
                });
                if (lanes == 1) one = step;
                printf("lanes: %3d rows as %d lane(s) of %3d: %7.1f us a step of 30 layers (%.2f us a layer), "
                       "%.2fx the rows a second of one lane\n", total, lanes, m, step, step / layers, one / step);
                for (auto& x : ls) {
                    delete x.pq; delete x.po; delete x.pg; delete x.pd;
                    CK(cudaStreamDestroy(x.s));
                    CK(cudaEventDestroy(x.done));
                }
            }
        }
        return 0;
    }
    if (argc > 1 && std::string(argv[1]) == "chain") {
        // SmolLM2's four products of each of 30 layers, each reading what the previous wrote
        // (q/k/v from the residual stream, o from q's columns back into the stream, gate/up
        // from it, down back into it), as in a decode step without its attention; then the
        // same with each launched as a programmatic dependent of the one before; then
        // cuBLASLt's four products alone in the same order.
        for (int m : {1, 64}) {
            const Shape& q = shapes[0];
            const Shape& o = shapes[1];
            const Shape& gu = shapes[2];
            const Shape& dn = shapes[3];
            Zeros zeros;
            std::vector<void*> wq, wo, wg, wd, gq, gg;
            for (int l = 0; l < layers; ++l) {
                wq.push_back(zeros((size_t)q.wrows() * q.k * 2));
                wo.push_back(zeros((size_t)o.wrows() * o.k * 2));
                wg.push_back(zeros((size_t)gu.wrows() * gu.k * 2));
                wd.push_back(zeros((size_t)dn.wrows() * dn.k * 2));
                gq.push_back(zeros(q.k * 2));
                gg.push_back(zeros(gu.k * 2));
            }
            void* h = zeros((size_t)m * 576 * 2);
            void* qkv = zeros((size_t)m * 960 * 2);
            void* act = zeros((size_t)m * 1536 * 2);
            const Config cq = choose(q, sms), co = choose(o, sms), cg = choose(gu, sms), cd = choose(dn, sms);
            auto body = [&] {
                for (int l = 0; l < layers; ++l) {
                    launch(q, cq, false, DecodeProductArgs{h, wq[l], gq[l], nullptr, qkv, m, 576, 960, 576, 960, 1e-5f}, st);
                    launch(o, co, false, DecodeProductArgs{qkv, wo[l], nullptr, h, h, m, 576, 576, 960, 576, 1e-5f}, st);
                    launch(gu, cg, false, DecodeProductArgs{h, wg[l], gg[l], nullptr, act, m, 576, 1536, 576, 1536, 1e-5f}, st);
                    launch(dn, cd, false, DecodeProductArgs{act, wd[l], nullptr, h, h, m, 1536, 576, 1536, 576, 1e-5f}, st);
                }
            };
            auto body_mc = [&] {
                for (int l = 0; l < layers; ++l) {
                    launch_mc(q, false, DecodeProductArgs{h, wq[l], gq[l], nullptr, qkv, m, 576, 960, 576, 960, 1e-5f}, st);
                    launch_mc(o, false, DecodeProductArgs{qkv, wo[l], nullptr, h, h, m, 576, 576, 960, 576, 1e-5f}, st);
                    launch_mc(gu, false, DecodeProductArgs{h, wg[l], gg[l], nullptr, act, m, 576, 1536, 576, 1536, 1e-5f}, st);
                    launch_mc(dn, false, DecodeProductArgs{act, wd[l], nullptr, h, h, m, 1536, 576, 1536, 576, 1e-5f}, st);
                }
            };
            g_pdl = false;
            const double mc_plain = time_graph(st, body_mc) / layers;
            g_pdl = true;
            const double mc_pdl = time_graph(st, body_mc) / layers;
            g_pdl = false;
            printf("chain m %d, multicast design: a layer's four %.2f us, as programmatic dependents %.2f us\n", m,
                   mc_plain, mc_pdl);
            const double plain = time_graph(st, body) / layers;
            g_pdl = true;
            const double pdl = time_graph(st, body) / layers;
            g_pdl = false;
            LtProduct pq(lt, m, 960, 576, ws.p, wsb), po(lt, m, 576, 576, ws.p, wsb);
            LtProduct pg(lt, m, 3072, 576, ws.p, wsb), pd(lt, m, 576, 1536, ws.p, wsb);
            void* gu_out = zeros((size_t)m * 3072 * 2);
            const double blas = time_graph(st, [&] {
                for (int l = 0; l < layers; ++l) {
                    pq.run(lt, wq[l], h, qkv, ws.p, wsb, st);
                    po.run(lt, wo[l], qkv, h, ws.p, wsb, st);
                    pg.run(lt, wg[l], h, gu_out, ws.p, wsb, st);
                    pd.run(lt, wd[l], act, h, ws.p, wsb, st);
                }
            }) / layers;
            // The engine's unfused layer without its attention: the four cuBLASLt products, two
            // residual RMSNorms and SwiGLU, launched as the engine launches them.
            void* att = zeros((size_t)m * 576 * 2);
            void* o_out = zeros((size_t)m * 576 * 2);
            void* d_out = zeros((size_t)m * 576 * 2);
            void* mid = zeros((size_t)m * 576 * 2);
            void* ln = zeros((size_t)m * 576 * 2);
            void* rstd = zeros((size_t)m * 4);
            const int norm_threads = std::min(512, std::max(32, (576 / 8 + 31) / 32 * 32));
            const long long sw_n = (long long)m * 1536;
            const int sw_blocks = (int)std::min<long long>(65535, (sw_n / 4 + 255) / 256);
            const double unfused = time_graph(st, [&] {
                for (int l = 0; l < layers; ++l) {
                    pq.run(lt, wq[l], ln, qkv, ws.p, wsb, st);
                    po.run(lt, wo[l], att, o_out, ws.p, wsb, st);
                    residual_rmsnorm_forward_bf16<<<m, norm_threads, 0, st>>>(
                        (bf16*)mid, (bf16*)ln, (float*)rstd, (const bf16*)h, (const bf16*)o_out, (const bf16*)gq[l], 576, 1e-5f);
                    pg.run(lt, wg[l], ln, gu_out, ws.p, wsb, st);
                    swiglu_forward_bf16<<<sw_blocks, 256, 0, st>>>((bf16*)act, (const bf16*)gu_out, sw_n, 1536);
                    pd.run(lt, wd[l], act, d_out, ws.p, wsb, st);
                    residual_rmsnorm_forward_bf16<<<m, norm_threads, 0, st>>>(
                        (bf16*)h, (bf16*)ln, (float*)rstd, (const bf16*)mid, (const bf16*)d_out, (const bf16*)gg[l], 576, 1e-5f);
                }
            }) / layers;
            const double unfused_pdl = time_graph(st, [&] {
                for (int l = 0; l < layers; ++l) {
                    pq.run(lt, wq[l], ln, qkv, ws.p, wsb, st);
                    po.run(lt, wo[l], att, o_out, ws.p, wsb, st);
                    launch_pdl(pdl_residual_rmsnorm_bf16, m, norm_threads, st, (bf16*)mid, (bf16*)ln, (float*)rstd,
                               (const bf16*)h, (const bf16*)o_out, (const bf16*)gq[l], 576, 1e-5f);
                    pg.run(lt, wg[l], ln, gu_out, ws.p, wsb, st);
                    launch_pdl(pdl_swiglu_bf16, sw_blocks, 256, st, (bf16*)act, (const bf16*)gu_out, sw_n, 1536);
                    pd.run(lt, wd[l], act, d_out, ws.p, wsb, st);
                    launch_pdl(pdl_residual_rmsnorm_bf16, m, norm_threads, st, (bf16*)h, (bf16*)ln, (float*)rstd,
                               (const bf16*)mid, (const bf16*)d_out, (const bf16*)gg[l], 576, 1e-5f);
                }
            }) / layers;
            printf("chain m %d: the engine's unfused layer with its norms and SwiGLU as programmatic dependents "
                   "of the products %.2f us\n", m, unfused_pdl);
            printf("chain m %d: a layer's four fused products %.2f us, as programmatic dependents %.2f us; "
                   "cuBLASLt's four products alone %.2f us; the engine's unfused layer (products, two residual "
                   "RMSNorms, SwiGLU) %.2f us\n", m, plain, pdl, blas, unfused);
        }
        return 0;
    }
    if (argc > 1 && std::string(argv[1]) == "once") {
        // One launch of each SmolLM2 product at m 64, for a profiler.
        for (int si = 0; si < 4; ++si) {
            const Shape& sh = shapes[si];
            const int m = 64;
            const Products bufs(sh, m, 1);
            launch(sh, choose(sh, sms), false, bufs.args(sh, m, 0), st);
            CK(cudaStreamSynchronize(st));
        }
        return 0;
    }
    // Timing: 30 layers' products, each on its own weights (so they come from memory, as in a
    // decode step of the whole model), m rows.
    for (int m : {1, 16, 64}) {
        printf("timing, m %d, bf16, %d products of each shape in one graph (us a product)\n", m, layers);
        double fused_layer = 0, lt_layer = 0;
        for (int si = 0; si < 4; ++si) {
            const Shape& sh = shapes[si];
            const Config c = choose(sh, sms);
            const Products bufs(sh, m, layers);
            const double fused = time_graph(st, [&] {
                for (int l = 0; l < layers; ++l) launch(sh, c, false, bufs.args(sh, m, l), st);
            }) / layers;
            LtProduct p(lt, m, sh.wrows(), sh.k, ws.p, wsb);
            const double blas = time_graph(st, [&] {
                for (int l = 0; l < layers; ++l) p.run(lt, bufs.w[l], bufs.x, bufs.out, ws.p, wsb, st);
            }) / layers;
            fused_layer += fused;
            lt_layer += blas;
            printf("  %-24s fused %6.2f  (nb %d, s %d, %d CTAs)   cuBLASLt product alone %6.2f\n", sh.name, fused,
                   c.nb, c.s, c.tiles * c.s * ((m + 63) / 64), blas);
        }
        printf("  a layer's four: fused %.2f us, cuBLASLt products alone %.2f us (the unfused path adds two norms and SwiGLU)\n",
               fused_layer, lt_layer);
    }
    printf("%s\n", failed ? "SOME CHECKS FAILED" : "all checks within bounds");
    return failed ? 1 : 0;
}
