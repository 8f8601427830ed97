// The pieces of unfused attention (train.fused_kernels=false); reference:
// engine/cpu/attention_unfused.rs. Head moves between token rows and [B, H, T, hs] blocks, and
// the causal softmax and its backward over a stored [B*H*T, T] matrix, one warp per row.
// The products between them are cuBLASLt batched GEMMs (gemm.rs).

// Offset in rows of width `row` (heads from column `col0`) of element `i` of a [B, H, T, hs]
// block: the map of head_to_row_index in the CPU reference.
__device__ __forceinline__ long long head_to_row(long long i, int seq, int heads, int hs,
                                                 long long row, long long col0) {
    const long long d = i % hs;
    long long rest = i / hs;
    const long long t = rest % seq;
    rest /= seq;
    const long long h = rest % heads, b = rest / heads;
    return (b * seq + t) * row + col0 + h * hs + d;
}

// Grid-stride over the n = B*H*T*hs elements of the block.
template <typename T>
__device__ void heads_from_rows(T* dst, const T* src, long long n, int seq, int heads, int hs,
                                long long row, long long col0) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[i] = src[head_to_row(i, seq, heads, hs, row, col0)];
}

template <typename T>
__device__ void heads_to_rows(T* dst, const T* src, long long n, int seq, int heads, int hs,
                              long long row, long long col0) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dst[head_to_row(i, seq, heads, hs, row, col0)] = src[i];
}

// Rows of [rows, seq]; row r is query position r % seq and sees keys 0..=r % seq. Each warp
// owns one row (blockDim.x = 32 * warps); a warp past the last row leaves at once, and no
// block-wide barrier follows, so that is safe.
template <typename T>
__device__ void causal_softmax(T* probs, const T* scores, long long rows, int seq) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const int seen = (int)(r % seq) + 1;
    const T* s = scores + r * seq;
    T* p = probs + r * seq;
    float m = KILN_NEG_INF;
    for (int j = lane; j < seen; j += 32) m = fmaxf(m, load(s[j]));
    m = warp_max(m);
    float sum = 0.0f;
    for (int j = lane; j < seen; j += 32) sum += expf(load(s[j]) - m);
    const float inv = 1.0f / warp_sum(sum);
    for (int j = lane; j < seq; j += 32)
        p[j] = store<T>(j < seen ? expf(load(s[j]) - m) * inv : 0.0f);
}

// dS = P * (dP - sum(P * dP)) over the row's causal prefix; masked entries zero.
template <typename T>
__device__ void causal_softmax_backward(T* dscores, const T* probs, const T* dprobs,
                                        long long rows, int seq) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const int seen = (int)(r % seq) + 1;
    const T* p = probs + r * seq;
    const T* dp = dprobs + r * seq;
    T* ds = dscores + r * seq;
    float dot = 0.0f;
    for (int j = lane; j < seen; j += 32) dot += load(p[j]) * load(dp[j]);
    dot = warp_sum(dot);
    for (int j = lane; j < seq; j += 32)
        ds[j] = store<T>(j < seen ? load(p[j]) * (load(dp[j]) - dot) : 0.0f);
}

#define UNFUSED_ATTENTION_KERNELS(T, SUFFIX)                                                   \
    extern "C" __global__ void heads_from_rows_##SUFFIX(T* dst, const T* src, long long n,    \
                                                        int seq, int heads, int hs,           \
                                                        long long row, long long col0) {      \
        heads_from_rows<T>(dst, src, n, seq, heads, hs, row, col0);                            \
    }                                                                                          \
    extern "C" __global__ void heads_to_rows_##SUFFIX(T* dst, const T* src, long long n,      \
                                                      int seq, int heads, int hs,             \
                                                      long long row, long long col0) {        \
        heads_to_rows<T>(dst, src, n, seq, heads, hs, row, col0);                              \
    }                                                                                          \
    extern "C" __global__ void causal_softmax_##SUFFIX(T* probs, const T* scores,             \
                                                       long long rows, int seq) {             \
        causal_softmax<T>(probs, scores, rows, seq);                                           \
    }                                                                                          \
    extern "C" __global__ void causal_softmax_backward_##SUFFIX(                               \
        T* dscores, const T* probs, const T* dprobs, long long rows, int seq) {                \
        causal_softmax_backward<T>(dscores, probs, dprobs, rows, seq);                         \
    }

UNFUSED_ATTENTION_KERNELS(float, f32)
UNFUSED_ATTENTION_KERNELS(bf16, bf16)
UNFUSED_ATTENTION_KERNELS(f16, f16)
