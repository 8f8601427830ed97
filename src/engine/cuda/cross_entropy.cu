// Softmax cross-entropy over the vocabulary, backward fused in place; reference:
// engine/cpu/cross_entropy.rs. One block per row: each thread keeps a running (max, sum of
// exp) over its share of the row (an online softmax, so the row is read once before the
// write pass), then the block combines them. No fp32 copy of the logits is made in memory.
//
// The STAGED kernel (cross_entropy_staged below) copies the row into shared memory as it
// reads it, so the logits cross device memory once each way. It needs v * sizeof(T) bytes of
// shared memory (a 50k vocabulary fits in f32 on Hopper); wider rows use the unstaged kernel.
//
// A row holds v logits of which the first `valid` are the vocabulary; the rest pad the
// vocabulary to a tensor-core-friendly width. Padded logits count as minus infinity: they
// add nothing to the softmax and get a zero gradient.
//
// A target of KILN_IGNORE (0xffffffff) marks a position that is not trained: loss zero,
// gradient row zero.

#define KILN_IGNORE 0xffffffffu

extern __shared__ __align__(16) unsigned char ce_row_cache[];

// Folds x into the running (m, s) = (max, sum of exp(x - max)).
__device__ __forceinline__ void online_add(float x, float& m, float& s) {
    if (x > m) {
        s = s * expf(m - x) + 1.f;
        m = x;
    } else if (x != KILN_NEG_INF) {  // a masked logit adds nothing (and -inf - -inf is NaN)
        s += expf(x - m);  // a NaN logit lands here and poisons the sum, as it should
    }
}

// Padding columns read as minus infinity.
__device__ __forceinline__ float masked(float x, int col, int valid) {
    return col < valid ? x : KILN_NEG_INF;
}

template <typename T, bool WRITE_GRAD>
__device__ void cross_entropy(float* losses, T* logits, const unsigned int* targets, int v,
                              int valid, float grad_scale) {
    __shared__ float scratch[32];
    T* row = logits + (long long)blockIdx.x * v;
    const unsigned int t = targets[blockIdx.x];
    if (t == KILN_IGNORE) {  // uniform over the block: one block per row
        if (threadIdx.x == 0) losses[blockIdx.x] = 0.f;
        if (WRITE_GRAD)
            for (int i = threadIdx.x; i < v; i += blockDim.x) row[i] = store<T>(0.f);
        return;
    }
    // Read before any thread overwrites the row (the reductions below are barriers).
    const float target_logit =
        (threadIdx.x == 0 && t < (unsigned int)valid) ? load(row[t]) : 0.f;
    // Four logits per access where the row allows (the whole block sees the same row, so
    // the choice is uniform); the tail and misaligned rows go one at a time.
    const int v4 = aligned4(row) ? v / 4 : 0;
    float m = KILN_NEG_INF, s = 0.f;
    for (int i = threadIdx.x; i < v4; i += blockDim.x) {
        float x[4];
        load4(row + 4 * i, x);
        for (int k = 0; k < 4; ++k) online_add(masked(x[k], 4 * i + k, valid), m, s);
    }
    for (int i = 4 * v4 + threadIdx.x; i < v; i += blockDim.x) {
        online_add(masked(load(row[i]), i, valid), m, s);
    }
    const float row_max = block_max(m, scratch);
    // A thread that saw no finite value contributes nothing (and must not form -inf - -inf).
    const float total = block_sum(m == KILN_NEG_INF ? 0.f : s * expf(m - row_max), scratch);
    const float lse = row_max + logf(total);
    if (threadIdx.x == 0) {
        // An out-of-range target has no loss to give; NaN makes the bad input visible.
        losses[blockIdx.x] = t < (unsigned int)valid ? lse - target_logit : KILN_NAN;
    }
    if (WRITE_GRAD) {
        const T* src = row;
        for (int i = threadIdx.x; i < v4; i += blockDim.x) {
            float x[4];
            load4(src + 4 * i, x);
            for (int k = 0; k < 4; ++k) {
                const float p = expf(masked(x[k], 4 * i + k, valid) - lse) * grad_scale;
                x[k] = (unsigned int)(4 * i + k) == t ? p - grad_scale : p;
            }
            store4(row + 4 * i, x);
        }
        for (int i = 4 * v4 + threadIdx.x; i < v; i += blockDim.x) {
            const float p = expf(masked(load(src[i]), i, valid) - lse) * grad_scale;
            row[i] = store<T>((unsigned int)i == t ? p - grad_scale : p);
        }
    }
}

// Sixteen bytes of a row in one access: 4 f32 or 8 bf16/f16 values (unpack16 in common.cuh
// reads them).
template <typename T> struct Wide {
    static constexpr int N = 16 / sizeof(T);
};
template <typename T> __device__ __forceinline__ uint4 pack16(const float* x) {
    uint4 q;
    T* e = reinterpret_cast<T*>(&q);
    for (int k = 0; k < Wide<T>::N; ++k) e[k] = store<T>(x[k]);
    return q;
}

#define CE_LOG2E 1.4426950408889634f

// The staged fused kernel: three passes over the row, only the first and last in device
// memory. (1) copy the row into shared memory in 16-byte accesses, keeping the maximum;
// (2) sum exp(x - max) from shared memory; (3) write the gradient from shared memory. Each
// exponential is one multiply-add and one exp2, and the first pass has none, so the kernel
// stays bound by memory instead of the exponentials of an online softmax (two per logit).
// A NaN logit escapes the maximum but poisons the sum, so the loss is NaN as it should be.
template <typename T>
__device__ void cross_entropy_staged(float* losses, T* logits, const unsigned int* targets,
                                     int v, int valid, float grad_scale) {
    constexpr int W = Wide<T>::N;
    __shared__ float scratch[32];
    T* row = logits + (long long)blockIdx.x * v;
    T* cache = reinterpret_cast<T*>(ce_row_cache);
    const unsigned int t = targets[blockIdx.x];
    if (t == KILN_IGNORE) {  // uniform over the block: one block per row
        if (threadIdx.x == 0) losses[blockIdx.x] = 0.f;
        for (int i = threadIdx.x; i < v; i += blockDim.x) row[i] = store<T>(0.f);
        return;
    }
    const float target_logit =
        (threadIdx.x == 0 && t < (unsigned int)valid) ? load(row[t]) : 0.f;
    // Whole 16-byte pieces where the row is aligned to them (uniform over the block); the
    // tail and misaligned rows go one value at a time.
    const int nw = ((unsigned long long)row % 16 == 0) ? v / W : 0;
    const uint4* wide_row = reinterpret_cast<const uint4*>(row);
    uint4* wide_cache = reinterpret_cast<uint4*>(cache);
    float m = KILN_NEG_INF;
#pragma unroll 4
    for (int i = threadIdx.x; i < nw; i += blockDim.x) {
        const uint4 q = wide_row[i];
        wide_cache[i] = q;
        float x[W];
        unpack16<T>(q, x);
        for (int k = 0; k < W; ++k) m = fmaxf(m, masked(x[k], W * i + k, valid));
    }
    for (int i = W * nw + threadIdx.x; i < v; i += blockDim.x) {
        cache[i] = row[i];
        m = fmaxf(m, masked(load(cache[i]), i, valid));
    }
    // The reduction is a barrier: the cache is complete after it.
    const float row_max = block_max(m, scratch);
    // A row with no finite logit keeps a zero shift (its sum is then 0, inf or NaN).
    const float shift = is_finite(row_max) ? row_max * CE_LOG2E : 0.f;
    float s = 0.f;
    for (int i = threadIdx.x; i < nw; i += blockDim.x) {
        float x[W];
        unpack16<T>(wide_cache[i], x);
        for (int k = 0; k < W; ++k) s += exp2f(fmaf(masked(x[k], W * i + k, valid), CE_LOG2E, -shift));
    }
    for (int i = W * nw + threadIdx.x; i < v; i += blockDim.x)
        s += exp2f(fmaf(masked(load(cache[i]), i, valid), CE_LOG2E, -shift));
    const float total = block_sum(s, scratch);
    const float lse = shift / CE_LOG2E + logf(total);
    if (threadIdx.x == 0) losses[blockIdx.x] = t < (unsigned int)valid ? lse - target_logit : KILN_NAN;
    const float lse2 = lse * CE_LOG2E;
    uint4* wide_out = reinterpret_cast<uint4*>(row);
    for (int i = threadIdx.x; i < nw; i += blockDim.x) {
        float x[W];
        unpack16<T>(wide_cache[i], x);
        for (int k = 0; k < W; ++k) {
            const int col = W * i + k;
            const float p = exp2f(fmaf(masked(x[k], col, valid), CE_LOG2E, -lse2)) * grad_scale;
            x[k] = (unsigned int)col == t ? p - grad_scale : p;
        }
        wide_out[i] = pack16<T>(x);
    }
    for (int i = W * nw + threadIdx.x; i < v; i += blockDim.x) {
        const float p = exp2f(fmaf(masked(load(cache[i]), i, valid), CE_LOG2E, -lse2)) * grad_scale;
        row[i] = store<T>((unsigned int)i == t ? p - grad_scale : p);
    }
}

// The row split over a cluster of CS blocks (Hopper's thread-block clusters), each staging
// its share of the row in its own shared memory: rows too wide for one block's shared memory
// (Llama 3's 128256 logits, 250 KiB in bf16) are still read from device memory once, and
// narrower ones run as several smaller blocks an SM instead of one or two large ones, so one
// block's reductions overlap another's copies. The passes are the staged kernel's; the
// blocks exchange their maxima and then their sums through distributed shared memory (each
// reads every block's value, in rank order, so the row's total is the same in every block and
// on every run). A row needs 16-byte pieces: v a multiple of 16 / sizeof(T), the logits
// aligned (the host checks).
#if __CUDA_ARCH__ >= 900
#define KILN_CLUSTER_DIMS(n) __cluster_dims__(n, 1, 1)
__device__ __forceinline__ unsigned int cluster_rank() {
    unsigned int r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Every thread of every block of the cluster arrives, then waits (release/acquire: shared
// memory written before is visible to the other blocks after).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
// `*p` in the shared memory of the cluster's block `rank`.
__device__ __forceinline__ float cluster_load(const float* p, unsigned int rank) {
    const unsigned int local = (unsigned int)__cvta_generic_to_shared(p);
    unsigned int remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
#else
#define KILN_CLUSTER_DIMS(n)
#endif

template <typename T, int CS>
__device__ void cross_entropy_cluster(float* losses, T* logits, const unsigned int* targets, int v,
                                      int valid, float grad_scale) {
#if __CUDA_ARCH__ >= 900
    constexpr int W = Wide<T>::N;
    __shared__ float scratch[32];
    // This block's maximum, then its sum, for the cluster's other blocks to read.
    __shared__ float stat[2];
    const unsigned int rank = cluster_rank();
    const long long r = blockIdx.x / CS;
    T* row = logits + r * v;
    const int nw = v / W, per = (nw + CS - 1) / CS;
    const int w0 = min(nw, (int)rank * per), w1 = min(nw, w0 + per);
    const unsigned int t = targets[r];
    uint4* wide_out = reinterpret_cast<uint4*>(row);
    if (t == KILN_IGNORE) {  // uniform over the cluster: no block waits on another
        if (rank == 0 && threadIdx.x == 0) losses[r] = 0.f;
        for (int i = w0 + threadIdx.x; i < w1; i += blockDim.x) wide_out[i] = make_uint4(0, 0, 0, 0);
        return;
    }
    const uint4* wide_row = reinterpret_cast<const uint4*>(row);
    uint4* cache = reinterpret_cast<uint4*>(ce_row_cache);
    float m = KILN_NEG_INF;
#pragma unroll 4
    for (int i = w0 + threadIdx.x; i < w1; i += blockDim.x) {
        const uint4 q = wide_row[i];
        cache[i - w0] = q;
        float x[W];
        unpack16<T>(q, x);
        for (int k = 0; k < W; ++k) m = fmaxf(m, masked(x[k], W * i + k, valid));
    }
    m = block_max(m, scratch);
    if (threadIdx.x == 0) stat[0] = m;
    cluster_sync();
    float row_max = KILN_NEG_INF;
    for (int b = 0; b < CS; ++b) row_max = fmaxf(row_max, cluster_load(&stat[0], b));
    const float shift = is_finite(row_max) ? row_max * CE_LOG2E : 0.f;
    float s = 0.f;
    for (int i = w0 + threadIdx.x; i < w1; i += blockDim.x) {
        float x[W];
        unpack16<T>(cache[i - w0], x);
        for (int k = 0; k < W; ++k) s += exp2f(fmaf(masked(x[k], W * i + k, valid), CE_LOG2E, -shift));
    }
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) stat[1] = s;
    cluster_sync();
    float total = 0.f;
    for (int b = 0; b < CS; ++b) total += cluster_load(&stat[1], b);
    const float lse = shift / CE_LOG2E + logf(total);
    if (threadIdx.x == 0) {
        // An out-of-range target has no loss to give; NaN makes the bad input visible.
        const int piece = (int)(t / W);
        if (t >= (unsigned int)valid) {
            if (rank == 0) losses[r] = KILN_NAN;
        } else if (piece >= w0 && piece < w1) {
            float x[W];
            unpack16<T>(cache[piece - w0], x);
            losses[r] = lse - x[t % W];
        }
    }
    const float lse2 = lse * CE_LOG2E;
    for (int i = w0 + threadIdx.x; i < w1; i += blockDim.x) {
        float x[W];
        unpack16<T>(cache[i - w0], x);
        for (int k = 0; k < W; ++k) {
            const int col = W * i + k;
            const float p = exp2f(fmaf(masked(x[k], col, valid), CE_LOG2E, -lse2)) * grad_scale;
            x[k] = (unsigned int)col == t ? p - grad_scale : p;
        }
        wide_out[i] = pack16<T>(x);
    }
    // No block leaves while another may still read its sums.
    cluster_sync();
#endif
}

#define CROSS_ENTROPY_CLUSTER(T, SUFFIX, CS)                                                   \
    extern "C" __global__ void KILN_CLUSTER_DIMS(CS) cross_entropy_fused_c##CS##_##SUFFIX(      \
        float* losses, T* logits, const unsigned int* targets, int v, int valid,              \
        float grad_scale) {                                                                    \
        cross_entropy_cluster<T, CS>(losses, logits, targets, v, valid, grad_scale);          \
    }

#define CROSS_ENTROPY_KERNELS(T, SUFFIX)                                                       \
    extern "C" __global__ void cross_entropy_forward_##SUFFIX(                               \
        float* losses, const T* logits, const unsigned int* targets, int v, int valid) {      \
        cross_entropy<T, false>(losses, const_cast<T*>(logits), targets, v, valid, 0.f);     \
    }                                                                                          \
    extern "C" __global__ void cross_entropy_fused_##SUFFIX(                                 \
        float* losses, T* logits, const unsigned int* targets, int v, int valid,              \
        float grad_scale) {                                                                    \
        cross_entropy<T, true>(losses, logits, targets, v, valid, grad_scale);                \
    }                                                                                          \
    extern "C" __global__ void cross_entropy_fused_staged_##SUFFIX(                          \
        float* losses, T* logits, const unsigned int* targets, int v, int valid,              \
        float grad_scale) {                                                                    \
        cross_entropy_staged<T>(losses, logits, targets, v, valid, grad_scale);               \
    }                                                                                          \
    CROSS_ENTROPY_CLUSTER(T, SUFFIX, 2)                                                        \
    CROSS_ENTROPY_CLUSTER(T, SUFFIX, 4)                                                        \
    CROSS_ENTROPY_CLUSTER(T, SUFFIX, 8)

CROSS_ENTROPY_KERNELS(float, f32)
CROSS_ENTROPY_KERNELS(bf16, bf16)
CROSS_ENTROPY_KERNELS(f16, f16)

// The unfused form, three single-purpose kernels with the fused kernel's mathematics (the
// baseline of train.fused_kernels=false): log_softmax writes every row's log-probabilities
// to an f32 buffer of its own (minus infinity in the padding), nll_loss gathers the losses
// from it, and log_softmax_nll_backward writes the gradient into a third buffer.

// One block per row, as the fused kernel: an online (max, sum) pass, then the write pass.
template <typename T>
__device__ void log_softmax(float* logp, const T* logits, int v, int valid) {
    __shared__ float scratch[32];
    const T* row = logits + (long long)blockIdx.x * v;
    float* out = logp + (long long)blockIdx.x * v;
    float m = KILN_NEG_INF, s = 0.f;
    for (int i = threadIdx.x; i < v; i += blockDim.x) online_add(masked(load(row[i]), i, valid), m, s);
    const float row_max = block_max(m, scratch);
    const float total = block_sum(m == KILN_NEG_INF ? 0.f : s * expf(m - row_max), scratch);
    const float lse = row_max + logf(total);
    for (int i = threadIdx.x; i < v; i += blockDim.x) out[i] = masked(load(row[i]), i, valid) - lse;
}

// One thread per row. An out-of-range target has no loss to give; NaN makes it visible.
extern "C" __global__ void nll_loss(float* losses, const float* logp,
                                    const unsigned int* targets, int n, int v, int valid) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= n) return;
    const unsigned int t = targets[r];
    losses[r] = t == KILN_IGNORE                ? 0.f
                : t < (unsigned int)valid ? -logp[(long long)r * v + t]
                                          : KILN_NAN;
}

// Grid (rows, column blocks): one thread per element, no index division.
template <typename T>
__device__ void log_softmax_nll_backward(T* dlogits, const float* logp,
                                         const unsigned int* targets, int v, int valid,
                                         float grad_scale) {
    const int col = blockIdx.y * blockDim.x + threadIdx.x;
    if (col >= v) return;
    const long long i = (long long)blockIdx.x * v + col;
    const unsigned int t = targets[blockIdx.x];
    const float onehot = (unsigned int)col == t ? 1.f : 0.f;
    dlogits[i] = store<T>(col < valid && t != KILN_IGNORE ? (expf(logp[i]) - onehot) * grad_scale
                                                          : 0.f);
}

#define CROSS_ENTROPY_UNFUSED_KERNELS(T, SUFFIX)                                               \
    extern "C" __global__ void log_softmax_##SUFFIX(float* logp, const T* logits, int v,       \
                                                    int valid) {                                \
        log_softmax<T>(logp, logits, v, valid);                                                \
    }                                                                                          \
    extern "C" __global__ void log_softmax_nll_backward_##SUFFIX(                             \
        T* dlogits, const float* logp, const unsigned int* targets, int v, int valid,         \
        float grad_scale) {                                                                    \
        log_softmax_nll_backward<T>(dlogits, logp, targets, v, valid, grad_scale);            \
    }

CROSS_ENTROPY_UNFUSED_KERNELS(float, f32)
CROSS_ENTROPY_UNFUSED_KERNELS(bf16, bf16)
CROSS_ENTROPY_UNFUSED_KERNELS(f16, f16)
