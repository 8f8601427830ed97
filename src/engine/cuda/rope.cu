// Rotary position embeddings on a grouped-query projection, expanding the key/value heads to
// one per query head; reference: engine/cpu/rope.rs (Hugging Face's rotate_half convention:
// within the first `rot` dimensions of a head, dimension i pairs with i + rot/2).
//
// threadIdx.x walks a head's dimensions (VW consecutive ones per thread) and threadIdx.y the
// block's rows, one row per thread (see for_each_row). With VW = 4 (head size a multiple of
// 4, rot a multiple of 8, aligned buffers) a thread moves 4 elements per access; its 4
// dimensions then lie on one side of rot/2 and of rot. The cos/sin tables are
// f32 [positions, rot/2]; a position past the table gives NaN rather than an out-of-bounds read.

// Heads a thread loads before it turns and stores any of them.
#define ROPE_BATCH 4

struct RopeDims {
    int heads, kv_heads, head_dim, rot_dim;
    unsigned int positions;  // rows of the cos/sin tables
    int vec4;                // 4 dimensions a thread (see the kernels' macro)
};

__device__ __forceinline__ void load_vec(const float* p, float (&v)[1]) { v[0] = p[0]; }
__device__ __forceinline__ void load_vec(const bf16* p, float (&v)[1]) { v[0] = load(p[0]); }
__device__ __forceinline__ void load_vec(const f16* p, float (&v)[1]) { v[0] = load(p[0]); }
template <typename T> __device__ __forceinline__ void load_vec(const T* p, float (&v)[4]) {
    load4(p, v);
}
template <typename T> __device__ __forceinline__ void store_vec(T* p, const float (&v)[1]) {
    p[0] = store<T>(v[0]);
}
template <typename T> __device__ __forceinline__ void store_vec(T* p, const float (&v)[4]) {
    store4(p, v);
}

// The cos and sin (times `sign`) of dimensions i .. i + VW - 1 at position p, when they rotate.
template <int VW>
__device__ __forceinline__ void row_angles(float (&c)[VW], float (&s)[VW], int i, unsigned int p,
                                           const float* cos_t, const float* sin_t,
                                           const RopeDims& d, float sign) {
    const int half = d.rot_dim / 2;
    const int j = i < half ? i : i - half;
    for (int k = 0; k < VW; ++k) {
        const bool live = i + k < d.rot_dim && p < d.positions;
        c[k] = live ? cos_t[(long long)p * half + j + k] : KILN_NAN;
        s[k] = live ? sign * sin_t[(long long)p * half + j + k] : KILN_NAN;
    }
}

// a (dimensions i ..) turned with partner b (dimensions i +- rot/2 ..): y[j] = a c - b s below
// rot/2, y[j + half] = b' c + a' s above it (s already carries the direction's sign).
template <int VW>
__device__ __forceinline__ void turn(float (&a)[VW], const float (&b)[VW], const float (&c)[VW],
                                     const float (&s)[VW], bool lower) {
    for (int k = 0; k < VW; ++k) a[k] = lower ? a[k] * c[k] - b[k] * s[k] : a[k] * c[k] + b[k] * s[k];
}

// Each thread loads ROPE_BATCH heads before it turns and stores any (the buffers never
// overlap, and say so with restrict): one head's load, turn and store at a time left a
// thread one load in flight, and the forward at 37% of memory speed (40% batched).
//
// A thread takes dimensions i .. i + VW - 1 of every head of one row (threadIdx.x over the
// head's dimensions, threadIdx.y over the block's rows, rows grid-strided): the position and
// the row's cos/sin are read once for all its heads, and heads are walked by loops, with no
// index divided per head. (Spreading a row's heads over threads made the kernels bound by
// the instructions that found each thread's head and angles, at a third of memory speed.)
template <typename F>
__device__ __forceinline__ void for_each_row(long long rows, F f) {
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y; row < rows;
         row += (long long)gridDim.x * blockDim.y)
        f(row);
}

// packed[row] = [rot(q) | rot(k) repeated per group | v repeated per group], 3 H D per row.
template <typename T, int VW>
__device__ void rope_expand_forward(T* __restrict__ packed, const T* __restrict__ qkv,
                                    const unsigned int* __restrict__ pos,
                                    const float* __restrict__ cos_t, const float* __restrict__ sin_t, long long rows,
                                    RopeDims d) {
    const int D = d.head_dim, H = d.heads, K = d.kv_heads, g = H / K, half = d.rot_dim / 2;
    const int i = threadIdx.x * VW;
    if (i >= D) return;
    const bool rotates = i < d.rot_dim, lower = i < half;
    const int partner = lower ? i + half : i - half;
    const long long in_width = (long long)(H + 2 * K) * D, width = 3LL * H * D;
    for_each_row(rows, [&](long long row) {
        const T* src = qkv + row * in_width;
        T* dst = packed + row * width;
        float c[VW], s[VW];
        if (rotates) row_angles<VW>(c, s, i, pos[row], cos_t, sin_t, d, 1.0f);
        // Queries, then keys (each written once per head of its group): turned. A batch of
        // heads' loads go out before any of them is used.
        for (int h0 = 0; h0 < H + K; h0 += ROPE_BATCH) {
            float a[ROPE_BATCH][VW], b[ROPE_BATCH][VW];
#pragma unroll
            for (int j = 0; j < ROPE_BATCH; ++j) {
                const int h = h0 + j;
                if (h >= H + K) break;
                load_vec(src + (long long)h * D + i, a[j]);
                if (rotates) load_vec(src + (long long)h * D + partner, b[j]);
            }
#pragma unroll
            for (int j = 0; j < ROPE_BATCH; ++j) {
                const int h = h0 + j;
                if (h >= H + K) break;
                if (rotates) turn<VW>(a[j], b[j], c, s, lower);
                if (h < H) {
                    store_vec(dst + (long long)h * D + i, a[j]);
                } else {
                    T* out = dst + (long long)(H + (h - H) * g) * D + i;
                    for (int r = 0; r < g; ++r) store_vec(out + (long long)r * D, a[j]);
                }
            }
        }
        // Values, copied once per head of their group.
        for (int k0 = 0; k0 < K; k0 += ROPE_BATCH) {
            float a[ROPE_BATCH][VW];
#pragma unroll
            for (int j = 0; j < ROPE_BATCH; ++j)
                if (k0 + j < K) load_vec(src + (long long)(H + K + k0 + j) * D + i, a[j]);
#pragma unroll
            for (int j = 0; j < ROPE_BATCH; ++j) {
                if (k0 + j >= K) break;
                T* out = dst + (long long)(2 * H + (k0 + j) * g) * D + i;
                for (int r = 0; r < g; ++r) store_vec(out + (long long)r * D, a[j]);
            }
        }
    });
}

// dqkv[row] from dpacked[row]: query heads rotate back; each key/value head sums its group's
// query-head gradients in head order (keys then rotate back), as the CPU does.
template <typename T, int VW>
__device__ void rope_expand_backward(T* __restrict__ dqkv, const T* __restrict__ dpacked,
                                     const unsigned int* __restrict__ pos,
                                     const float* __restrict__ cos_t, const float* __restrict__ sin_t, long long rows,
                                     RopeDims d) {
    const int D = d.head_dim, H = d.heads, K = d.kv_heads, g = H / K, half = d.rot_dim / 2;
    const int i = threadIdx.x * VW;
    if (i >= D) return;
    const bool rotates = i < d.rot_dim, lower = i < half;
    const int partner = lower ? i + half : i - half;
    const long long width = (long long)(H + 2 * K) * D, packed_width = 3LL * H * D;
    for_each_row(rows, [&](long long row) {
        const T* src = dpacked + row * packed_width;
        T* dst = dqkv + row * width;
        float c[VW], s[VW];
        if (rotates) row_angles<VW>(c, s, i, pos[row], cos_t, sin_t, d, -1.0f);
        for (int h0 = 0; h0 < H; h0 += ROPE_BATCH) {
            float a[ROPE_BATCH][VW], b[ROPE_BATCH][VW];
#pragma unroll
            for (int j = 0; j < ROPE_BATCH; ++j) {
                if (h0 + j >= H) break;
                load_vec(src + (long long)(h0 + j) * D + i, a[j]);
                if (rotates) load_vec(src + (long long)(h0 + j) * D + partner, b[j]);
            }
#pragma unroll
            for (int j = 0; j < ROPE_BATCH; ++j) {
                if (h0 + j >= H) break;
                if (rotates) turn<VW>(a[j], b[j], c, s, lower);
                store_vec(dst + (long long)(h0 + j) * D + i, a[j]);
            }
        }
        // Key heads (j < K) and value heads (j >= K): their group's heads in the packed row,
        // slot 1 (keys) or 2 (values), heads j g ...
        for (int j = 0; j < 2 * K; ++j) {
            const bool key = j < K;
            const T* grp = src + (long long)((key ? H : 2 * H) + (key ? j : j - K) * g) * D;
            const bool turns = key && rotates;
            float a[VW], b[VW];
            for (int k = 0; k < VW; ++k) a[k] = b[k] = 0.f;
            for (int r = 0; r < g; ++r) {
                float t[VW];
                load_vec(grp + (long long)r * D + i, t);
                for (int k = 0; k < VW; ++k) a[k] += t[k];
                if (turns) {
                    load_vec(grp + (long long)r * D + partner, t);
                    for (int k = 0; k < VW; ++k) b[k] += t[k];
                }
            }
            if (turns) turn<VW>(a, b, c, s, lower);
            store_vec(dst + (long long)(H + j) * D + i, a);
        }
    });
}

// `vec4` (uniform over the launch) picks 4 dimensions a thread; the host sets it, and the
// block's width, only where the shape and the buffers' alignment allow it.
#define ROPE_KERNELS(T, SUFFIX)                                                                  \
    extern "C" __global__ void rope_expand_forward_##SUFFIX(                                   \
        T* packed, const T* qkv, const unsigned int* pos, const float* cos_t, const float* sin_t,  \
        long long rows, RopeDims d) {                                                            \
        if (d.vec4)                                                                              \
            rope_expand_forward<T, 4>(packed, qkv, pos, cos_t, sin_t, rows, d);                  \
        else                                                                                     \
            rope_expand_forward<T, 1>(packed, qkv, pos, cos_t, sin_t, rows, d);                  \
    }                                                                                            \
    extern "C" __global__ void rope_expand_backward_##SUFFIX(                                  \
        T* dqkv, const T* dpacked, const unsigned int* pos, const float* cos_t,                   \
        const float* sin_t, long long rows, RopeDims d) {                                          \
        if (d.vec4)                                                                              \
            rope_expand_backward<T, 4>(dqkv, dpacked, pos, cos_t, sin_t, rows, d);               \
        else                                                                                     \
            rope_expand_backward<T, 1>(dqkv, dpacked, pos, cos_t, sin_t, rows, d);               \
    }

ROPE_KERNELS(float, f32)
ROPE_KERNELS(bf16, bf16)
ROPE_KERNELS(f16, f16)
