// Rotary position embeddings on a grouped-query projection, expanding the key/value heads to
// one per query head; reference: engine/cpu/rope.rs (Hugging Face's rotate_half convention:
// within the first `rot` dimensions of a head, dimension i pairs with i + rot/2).
//
// One thread per output element, grid-stride: consecutive threads write consecutive
// dimensions of a head and read consecutive elements of its source (and of the partner half,
// rot/2 further), so both sides are coalesced. The cos/sin tables are f32 [positions, rot/2];
// a position past the table gives NaN rather than an out-of-bounds read.

struct RopeDims {
    int heads, kv_heads, head_dim, rot_dim;
    unsigned int positions;  // rows of the cos/sin tables
};

// Element i of head `x` turned by position p: sign +1 forward, -1 back (the transpose).
// Dimensions at or past rot pass through.
template <typename F>
__device__ __forceinline__ float rotate_elem(F x, int i, unsigned int p, const float* cos_t,
                                             const float* sin_t, const RopeDims& d, float sign) {
    if (i >= d.rot_dim) return x(i);
    if (p >= d.positions) return KILN_NAN;
    const int half = d.rot_dim / 2;
    const int j = i < half ? i : i - half;
    const float c = cos_t[(long long)p * half + j], s = sign * sin_t[(long long)p * half + j];
    // y[j] = a c - b s, y[j + half] = b c + a s with a = x[j], b = x[j + half].
    return i < half ? x(i) * c - x(i + half) * s : x(i) * c + x(i - half) * s;
}

// packed[row] = [rot(q) | rot(k) repeated per group | v repeated per group], 3 H D per row.
template <typename T>
__device__ void rope_expand_forward(T* packed, const T* qkv, const unsigned int* pos,
                                    const float* cos_t, const float* sin_t, long long total,
                                    RopeDims d) {
    const int D = d.head_dim, H = d.heads, K = d.kv_heads, g = H / K;
    const long long hd = (long long)H * D, width = 3 * hd, in_width = (long long)(H + 2 * K) * D;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        const long long row = e / width;
        const long long rem = e - row * width;
        const int slot = (int)(rem / hd);  // 0 q, 1 k, 2 v
        const int within = (int)(rem - slot * hd);
        const int hq = within / D, i = within - hq * D;
        const int src_head = slot == 0 ? hq : slot == 1 ? H + hq / g : H + K + hq / g;
        const T* src = qkv + row * in_width + (long long)src_head * D;
        auto x = [&](int k) { return load(src[k]); };
        const float y = slot == 2 ? x(i) : rotate_elem(x, i, pos[row], cos_t, sin_t, d, 1.0f);
        packed[e] = store<T>(y);
    }
}

// dqkv[row] from dpacked[row]: query heads rotate back; each key/value head sums its group's
// query-head gradients in head order (keys then rotate back), as the CPU does.
template <typename T>
__device__ void rope_expand_backward(T* dqkv, const T* dpacked, const unsigned int* pos,
                                     const float* cos_t, const float* sin_t, long long total,
                                     RopeDims d) {
    const int D = d.head_dim, H = d.heads, K = d.kv_heads, g = H / K;
    const long long width = (long long)(H + 2 * K) * D, packed_width = 3LL * H * D;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        const long long row = e / width;
        const int rem = (int)(e - row * width);
        const int head = rem / D, i = rem - head * D;
        const T* src = dpacked + row * packed_width;
        float y;
        if (head < H) {
            const T* q = src + (long long)head * D;
            auto x = [&](int k) { return load(q[k]); };
            y = rotate_elem(x, i, pos[row], cos_t, sin_t, d, -1.0f);
        } else {
            const bool key = head < H + K;
            const int j = key ? head - H : head - H - K;
            // The group's heads in the packed row: slot 1 (keys) or 2 (values), heads j g ...
            const T* grp = src + (long long)((key ? H : 2 * H) + j * g) * D;
            auto x = [&](int k) {
                float acc = 0.f;
                for (int r = 0; r < g; ++r) acc += load(grp[(long long)r * D + k]);
                return acc;
            };
            y = key ? rotate_elem(x, i, pos[row], cos_t, sin_t, d, -1.0f) : x(i);
        }
        dqkv[e] = store<T>(y);
    }
}

#define ROPE_KERNELS(T, SUFFIX)                                                                  \
    extern "C" __global__ void rope_expand_forward_##SUFFIX(                                   \
        T* packed, const T* qkv, const unsigned int* pos, const float* cos_t, const float* sin_t,  \
        long long total, RopeDims d) {                                                           \
        rope_expand_forward<T>(packed, qkv, pos, cos_t, sin_t, total, d);                           \
    }                                                                                            \
    extern "C" __global__ void rope_expand_backward_##SUFFIX(                                  \
        T* dqkv, const T* dpacked, const unsigned int* pos, const float* cos_t,                   \
        const float* sin_t, long long total, RopeDims d) {                                         \
        rope_expand_backward<T>(dqkv, dpacked, pos, cos_t, sin_t, total, d);                        \
    }

ROPE_KERNELS(float, f32)
ROPE_KERNELS(bf16, bf16)
ROPE_KERNELS(f16, f16)
