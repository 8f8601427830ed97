// Softmax cross-entropy over the vocabulary, backward fused in place; reference:
// engine/cpu/cross_entropy.rs. One block per row: each thread keeps a running (max, sum of
// exp) over its share of the row (an online softmax, so the row is read once before the
// write pass), then the block combines them. No fp32 copy of the logits is made in memory.
//
// The STAGED variant also copies the row into shared memory during that read, so the write
// pass reads shared memory instead of the row a second time: two passes over the logits in
// device memory instead of three. It needs v * sizeof(T) bytes of shared memory (a 50k
// vocabulary fits in f32 on Hopper); wider rows use the unstaged kernel.
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

template <typename T, bool WRITE_GRAD, bool STAGED>
__device__ void cross_entropy(float* losses, T* logits, const unsigned int* targets, int v,
                              int valid, float grad_scale) {
    __shared__ float scratch[32];
    T* row = logits + (long long)blockIdx.x * v;
    T* cache = reinterpret_cast<T*>(ce_row_cache);
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
        if (STAGED) store4(cache + 4 * i, x);
        for (int k = 0; k < 4; ++k) online_add(masked(x[k], 4 * i + k, valid), m, s);
    }
    for (int i = 4 * v4 + threadIdx.x; i < v; i += blockDim.x) {
        if (STAGED) cache[i] = row[i];
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
        // The block reductions above were barriers, so the cache is complete.
        const T* src = STAGED ? cache : row;
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

#define CROSS_ENTROPY_KERNELS(T, SUFFIX)                                                       \
    extern "C" __global__ void cross_entropy_forward_##SUFFIX(                               \
        float* losses, const T* logits, const unsigned int* targets, int v, int valid) {      \
        cross_entropy<T, false, false>(losses, const_cast<T*>(logits), targets, v, valid,    \
                                       0.f);                                                  \
    }                                                                                          \
    extern "C" __global__ void cross_entropy_fused_##SUFFIX(                                 \
        float* losses, T* logits, const unsigned int* targets, int v, int valid,              \
        float grad_scale) {                                                                    \
        cross_entropy<T, true, false>(losses, logits, targets, v, valid, grad_scale);         \
    }                                                                                          \
    extern "C" __global__ void cross_entropy_fused_staged_##SUFFIX(                          \
        float* losses, T* logits, const unsigned int* targets, int v, int valid,              \
        float grad_scale) {                                                                    \
        cross_entropy<T, true, true>(losses, logits, targets, v, valid, grad_scale);          \
    }

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
