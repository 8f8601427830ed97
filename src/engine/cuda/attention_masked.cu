// Bidirectional attention with a key padding mask, forward only; reference:
// engine/cpu/attention_masked.rs (same qkv[B, T, 3C] layout and results).
//
// lens[b] is the number of real tokens of sequence b (right padding after them). Every query
// row, padded ones included, attends to keys 0 .. lens[b]; no causal mask. The scheme is
// attention.cu's forward (online softmax, one query row per thread, K and V streamed
// through shared memory in tiles of MBC rows), with the key range cut at lens[b] instead of at
// the query's own position, and nothing saved for a backward.

#define MBR 64
#define MBC 32

template <int HS, typename E>
__device__ void masked_attention_forward_impl(const E* __restrict__ qkv, const int* __restrict__ lens,
                                              E* __restrict__ out, int T, int C, int NH) {
    __shared__ float ks[MBC][HS];
    __shared__ float vs[MBC][HS];
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int row = blockIdx.x * MBR + threadIdx.x;
    const bool active = row < T;
    const int len = lens[b];
    const float scale = rsqrtf((float)HS);
    const size_t stride = 3 * (size_t)C;
    const E* base = qkv + (size_t)b * T * stride + h * HS;

    float q[HS], o[HS];
    float m = KILN_NEG_INF, l = 0.0f;
    #pragma unroll
    for (int i = 0; i < HS; i++) {
        q[i] = active ? load(base[row * stride + i]) * scale : 0.0f;
        o[i] = 0.0f;
    }
    for (int k0 = 0; k0 < len; k0 += MBC) {
        for (int idx = threadIdx.x; idx < MBC * HS; idx += MBR) {
            int r = idx / HS, c = idx % HS, kr = k0 + r;
            ks[r][c] = kr < len ? load(base[kr * stride + C + c]) : 0.0f;
            vs[r][c] = kr < len ? load(base[kr * stride + 2 * C + c]) : 0.0f;
        }
        __syncthreads();
        if (active) {
            const int n = min(MBC, len - k0);
            float s[MBC];
            float tile_max = KILN_NEG_INF;
            #pragma unroll
            for (int j = 0; j < MBC; j++) {
                float dot = 0.0f;
                if (j < n) {
                    #pragma unroll
                    for (int i = 0; i < HS; i++) dot += q[i] * ks[j][i];
                    tile_max = fmaxf(tile_max, dot);
                }
                s[j] = dot;
            }
            const float m_new = fmaxf(m, tile_max);
            const float corr = __expf(m - m_new);
            l *= corr;
            #pragma unroll
            for (int i = 0; i < HS; i++) o[i] *= corr;
            #pragma unroll
            for (int j = 0; j < MBC; j++) {
                if (j < n) {
                    const float p = __expf(s[j] - m_new);
                    l += p;
                    #pragma unroll
                    for (int i = 0; i < HS; i++) o[i] += p * vs[j][i];
                }
            }
            m = m_new;
        }
        __syncthreads();
    }
    if (active) {
        const float inv = 1.0f / l;
        E* dst = out + ((size_t)b * T + row) * C + h * HS;
        #pragma unroll
        for (int i = 0; i < HS; i++) dst[i] = store<E>(o[i] * inv);
    }
}

#define MASKED_ATTENTION_ENTRY(HS, E, SUFFIX)                                                    \
    extern "C" __global__ void __launch_bounds__(MBR)                                            \
        masked_attention_forward_##SUFFIX##_hs##HS(const E* qkv, const int* lens, E* out, int T, \
                                                   int C, int NH) {                              \
        masked_attention_forward_impl<HS, E>(qkv, lens, out, T, C, NH);                          \
    }

MASKED_ATTENTION_ENTRY(16, float, f32)
MASKED_ATTENTION_ENTRY(32, float, f32)
MASKED_ATTENTION_ENTRY(64, float, f32)
MASKED_ATTENTION_ENTRY(16, bf16, bf16)
MASKED_ATTENTION_ENTRY(32, bf16, bf16)
MASKED_ATTENTION_ENTRY(64, bf16, bf16)
MASKED_ATTENTION_ENTRY(16, f16, f16)
MASKED_ATTENTION_ENTRY(32, f16, f16)
MASKED_ATTENTION_ENTRY(64, f16, f16)

// The unfused route an encoder trains through; reference: padded_softmax and softmax_backward
// in engine/cpu/attention_masked.rs. Rows of scores[B, H, T, T]: row r belongs to sequence
// r / (H * T) and sees its keys 0 .. lens[b]. One warp per row (blockDim.x = 32 * warps); a
// warp past the last row leaves at once, and no block-wide barrier follows.
template <typename T>
__device__ void padded_softmax(T* probs, const T* scores, const int* lens, long long rows,
                               int seq, int heads) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const int seen = lens[r / ((long long)heads * seq)];
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

// dS = P * (dP - sum(P * dP)) over whole rows: masked entries have P = 0 and get 0.
template <typename T>
__device__ void softmax_backward_rows(T* dscores, const T* probs, const T* dprobs, long long rows,
                                      int seq) {
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;
    const T* p = probs + r * seq;
    const T* dp = dprobs + r * seq;
    T* ds = dscores + r * seq;
    float dot = 0.0f;
    for (int j = lane; j < seq; j += 32) dot += load(p[j]) * load(dp[j]);
    dot = warp_sum(dot);
    for (int j = lane; j < seq; j += 32) ds[j] = store<T>(load(p[j]) * (load(dp[j]) - dot));
}

#define PADDED_SOFTMAX_KERNELS(T, SUFFIX)                                                      \
    extern "C" __global__ void padded_softmax_##SUFFIX(T* probs, const T* scores,             \
                                                       const int* lens, long long rows,       \
                                                       int seq, int heads) {                  \
        padded_softmax<T>(probs, scores, lens, rows, seq, heads);                              \
    }                                                                                          \
    extern "C" __global__ void softmax_backward_rows_##SUFFIX(                                 \
        T* dscores, const T* probs, const T* dprobs, long long rows, int seq) {                \
        softmax_backward_rows<T>(dscores, probs, dprobs, rows, seq);                           \
    }

PADDED_SOFTMAX_KERNELS(float, f32)
PADDED_SOFTMAX_KERNELS(bf16, bf16)
PADDED_SOFTMAX_KERNELS(f16, f16)
