// Rotary position embeddings on a grouped-query projection, expanding the key/value heads to
// one per query head; reference: engine/cpu/rope.rs (Hugging Face's rotate_half convention:
// within the first `rot` dimensions of a head, dimension i pairs with i + rot/2).
//
// threadIdx.x walks a head's dimensions (VW consecutive ones per thread) and threadIdx.y the
// block's rows, one row per thread (see for_each_row). With VW = 4 (head size a multiple of
// 4, rot a multiple of 8, aligned buffers) a thread moves 4 elements per access; its 4
// dimensions then lie on one side of rot/2 and of rot. Where every dimension rotates and a
// head's threads are a power of two up to a warp (head sizes 16 to 128), a thread's partner
// dimensions i +- rot/2 belong to the thread rot/8 lanes away, which hands them over by a
// shuffle (the `_pairs` kernels) instead of a second load of the same cache lines. The
// cos/sin tables are f32 [positions, rot/2]; a position past the table gives NaN rather than
// an out-of-bounds read.
//
// Each block takes one part of a row's heads (head_part), so that the GPU holds more rows'
// loads at once than one thread a row's 16 dimensions allowed.

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

// The heads of a row a block takes: the row's H + 2K head units (queries, keys, values in
// that order) split into gridDim.y contiguous parts, part blockIdx.y.
__device__ __forceinline__ void head_part(int units, int& u0, int& u1) {
    const int per = (units + (int)gridDim.y - 1) / (int)gridDim.y;
    u0 = min(units, (int)blockIdx.y * per);
    u1 = min(units, u0 + per);
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
    int u0, u1;
    head_part(H + 2 * K, u0, u1);
    const int turned_end = min(u1, H + K), v_end = u1 - (H + K);
    for_each_row(rows, [&](long long row) {
        const T* src = qkv + row * in_width;
        T* dst = packed + row * width;
        float c[VW], s[VW];
        if (rotates && u0 < turned_end) row_angles<VW>(c, s, i, pos[row], cos_t, sin_t, d, 1.0f);
        // Queries, then keys (each written once per head of its group): turned. A batch of
        // heads' loads go out before any of them is used.
        for (int h0 = u0; h0 < turned_end; h0 += ROPE_BATCH) {
            float a[ROPE_BATCH][VW], b[ROPE_BATCH][VW];
#pragma unroll
            for (int j = 0; j < ROPE_BATCH; ++j) {
                const int h = h0 + j;
                if (h >= turned_end) break;
                load_vec(src + (long long)h * D + i, a[j]);
                if (rotates) load_vec(src + (long long)h * D + partner, b[j]);
            }
#pragma unroll
            for (int j = 0; j < ROPE_BATCH; ++j) {
                const int h = h0 + j;
                if (h >= turned_end) break;
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
        for (int k0 = max(u0, H + K) - (H + K); k0 < v_end; k0 += ROPE_BATCH) {
            float a[ROPE_BATCH][VW];
#pragma unroll
            for (int j = 0; j < ROPE_BATCH; ++j)
                if (k0 + j < v_end) load_vec(src + (long long)(H + K + k0 + j) * D + i, a[j]);
#pragma unroll
            for (int j = 0; j < ROPE_BATCH; ++j) {
                if (k0 + j >= v_end) break;
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
    int u0, u1;
    head_part(H + 2 * K, u0, u1);
    const int q_end = min(u1, H);
    for_each_row(rows, [&](long long row) {
        const T* src = dpacked + row * packed_width;
        T* dst = dqkv + row * width;
        float c[VW], s[VW];
        if (rotates && u0 < min(u1, H + K)) row_angles<VW>(c, s, i, pos[row], cos_t, sin_t, d, -1.0f);
        for (int h0 = u0; h0 < q_end; h0 += ROPE_BATCH) {
            float a[ROPE_BATCH][VW], b[ROPE_BATCH][VW];
#pragma unroll
            for (int j = 0; j < ROPE_BATCH; ++j) {
                if (h0 + j >= q_end) break;
                load_vec(src + (long long)(h0 + j) * D + i, a[j]);
                if (rotates) load_vec(src + (long long)(h0 + j) * D + partner, b[j]);
            }
#pragma unroll
            for (int j = 0; j < ROPE_BATCH; ++j) {
                if (h0 + j >= q_end) break;
                if (rotates) turn<VW>(a[j], b[j], c, s, lower);
                store_vec(dst + (long long)(h0 + j) * D + i, a[j]);
            }
        }
        // Key heads (j < K) and value heads (j >= K): their group's heads in the packed row,
        // slot 1 (keys) or 2 (values), heads j g ...
        for (int j = max(u0, H) - H; j < u1 - H; ++j) {
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

// The partner's 4 dimensions of the same head: lane ^ across holds them (a head's threads are
// a power-of-two segment of a warp, partners rot/8 lanes apart). Every lane of the warp
// takes part; rows past the end pass what they hold, which no live row reads (a row's lanes
// are all live or all not).
__device__ __forceinline__ void partner_raw(const Raw4<float>& r, Raw4<float>& o, int across) {
    o.q.x = __shfl_xor_sync(0xffffffffu, r.q.x, across);
    o.q.y = __shfl_xor_sync(0xffffffffu, r.q.y, across);
    o.q.z = __shfl_xor_sync(0xffffffffu, r.q.z, across);
    o.q.w = __shfl_xor_sync(0xffffffffu, r.q.w, across);
}
template <typename T>
__device__ __forceinline__ void partner_raw(const Raw4<T>& r, Raw4<T>& o, int across) {
    o.q.x = __shfl_xor_sync(0xffffffffu, r.q.x, across);
    o.q.y = __shfl_xor_sync(0xffffffffu, r.q.y, across);
}
__device__ __forceinline__ void partner_f32(const float (&a)[4], float (&b)[4], int across) {
    for (int k = 0; k < 4; ++k) b[k] = __shfl_xor_sync(0xffffffffu, a[k], across);
}

// Heads the pair kernels load before they turn and store any (raw, two registers a 16-bit
// head), as many as the 64 registers of ROPE_PAIR_REGS hold without spilling in the loops.
// The forward's and the backward's turning loops are written out in each kernel: one shared
// helper taking the store as a lambda compiled the 16-bit forward with twice the spills
// (52 bytes against 24 under ptxas), and the measured code is this one.
#define ROPE_PAIR_BATCH 4

// rope_expand_forward where every dimension rotates and partners come by shuffle (vec4 == 2):
// 4 dimensions a thread, rows walked uniformly over the block so every lane reaches each
// shuffle. The same arithmetic as the general kernel, element for element.
template <typename T>
__device__ void rope_expand_forward_pairs(T* __restrict__ packed, const T* __restrict__ qkv,
                                          const unsigned int* __restrict__ pos,
                                          const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, long long rows,
                                          RopeDims d) {
    const int D = d.head_dim, H = d.heads, K = d.kv_heads, g = H / K;
    const int i = threadIdx.x * 4, across = blockDim.x / 2;
    const bool lower = i < d.rot_dim / 2;
    const long long in_width = (long long)(H + 2 * K) * D, width = 3LL * H * D;
    int u0, u1;
    head_part(H + 2 * K, u0, u1);
    const int turned_end = min(u1, H + K), v_end = u1 - (H + K);
    const long long stride = (long long)gridDim.x * blockDim.y;
    for (long long base = (long long)blockIdx.x * blockDim.y; base < rows; base += stride) {
        const long long row = base + threadIdx.y;
        const bool live = row < rows;
        const T* src = qkv + (live ? row : 0) * in_width;
        T* dst = packed + row * width;
        float c[4], s[4];
        if (u0 < turned_end) row_angles<4>(c, s, i, live ? pos[row] : 0u, cos_t, sin_t, d, 1.0f);
        // Queries (one store each), then keys (one store per head of the group): the same
        // loop for both ranges, so neither carries the other's stores.
        for (int phase = 0; phase < 2; ++phase) {
            const int lo = phase == 0 ? u0 : max(u0, H), hi = phase == 0 ? min(turned_end, H) : turned_end;
            const int copies = phase == 0 ? 1 : g;
            for (int h0 = lo; h0 < hi; h0 += ROPE_PAIR_BATCH) {  // uniform over the block
                Raw4<T> ra[ROPE_PAIR_BATCH];
#pragma unroll
                for (int j = 0; j < ROPE_PAIR_BATCH; ++j)
                    if (live && h0 + j < hi) load_raw4(src + (long long)(h0 + j) * D + i, ra[j]);
#pragma unroll
                for (int j = 0; j < ROPE_PAIR_BATCH; ++j) {
                    const int h = h0 + j;
                    if (h >= hi) break;
                    Raw4<T> rb;
                    partner_raw(ra[j], rb, across);
                    if (!live) continue;
                    float a[4], b[4];
                    unpack4(ra[j], a);
                    unpack4(rb, b);
                    turn<4>(a, b, c, s, lower);
                    // Query h at head h; key h - H at heads H + (h - H) g ... of the group.
                    T* out = dst + (long long)(phase == 0 ? h : H + (h - H) * g) * D + i;
                    for (int r = 0; r < copies; ++r) store4(out + (long long)r * D, a);
                }
            }
        }
        if (!live) continue;
        for (int k0 = max(u0, H + K) - (H + K); k0 < v_end; k0 += ROPE_PAIR_BATCH) {
            Raw4<T> ra[ROPE_PAIR_BATCH];
#pragma unroll
            for (int j = 0; j < ROPE_PAIR_BATCH; ++j)
                if (k0 + j < v_end) load_raw4(src + (long long)(H + K + k0 + j) * D + i, ra[j]);
#pragma unroll
            for (int j = 0; j < ROPE_PAIR_BATCH; ++j) {
                if (k0 + j >= v_end) break;
                float a[4];
                unpack4(ra[j], a);
                T* out = dst + (long long)(2 * H + (k0 + j) * g) * D + i;
                for (int r = 0; r < g; ++r) store4(out + (long long)r * D, a);
            }
        }
    }
}

// rope_expand_backward with partners by shuffle (vec4 == 2). A key head's partner sum is the
// partner thread's own sum over the group, in the same head order, so every value matches
// the general kernel's.
template <typename T>
__device__ void rope_expand_backward_pairs(T* __restrict__ dqkv, const T* __restrict__ dpacked,
                                           const unsigned int* __restrict__ pos,
                                           const float* __restrict__ cos_t,
                                           const float* __restrict__ sin_t, long long rows,
                                           RopeDims d) {
    const int D = d.head_dim, H = d.heads, K = d.kv_heads, g = H / K;
    const int i = threadIdx.x * 4, across = blockDim.x / 2;
    const bool lower = i < d.rot_dim / 2;
    const long long width = (long long)(H + 2 * K) * D, packed_width = 3LL * H * D;
    int u0, u1;
    head_part(H + 2 * K, u0, u1);
    const int q_end = min(u1, H);
    const long long stride = (long long)gridDim.x * blockDim.y;
    for (long long base = (long long)blockIdx.x * blockDim.y; base < rows; base += stride) {
        const long long row = base + threadIdx.y;
        const bool live = row < rows;
        const T* src = dpacked + (live ? row : 0) * packed_width;
        T* dst = dqkv + row * width;
        float c[4], s[4];
        if (u0 < min(u1, H + K)) row_angles<4>(c, s, i, live ? pos[row] : 0u, cos_t, sin_t, d, -1.0f);
        for (int h0 = u0; h0 < q_end; h0 += ROPE_PAIR_BATCH) {  // uniform over the block
            Raw4<T> ra[ROPE_PAIR_BATCH];
#pragma unroll
            for (int j = 0; j < ROPE_PAIR_BATCH; ++j)
                if (live && h0 + j < q_end) load_raw4(src + (long long)(h0 + j) * D + i, ra[j]);
#pragma unroll
            for (int j = 0; j < ROPE_PAIR_BATCH; ++j) {
                if (h0 + j >= q_end) break;
                Raw4<T> rb;
                partner_raw(ra[j], rb, across);
                if (!live) continue;
                float a[4], b[4];
                unpack4(ra[j], a);
                unpack4(rb, b);
                turn<4>(a, b, c, s, lower);
                store4(dst + (long long)(h0 + j) * D + i, a);
            }
        }
        // Key heads (j < K) and value heads: their group's heads in the packed row, slot 1 or
        // 2, heads j g ..., loaded ROPE_PAIR_BATCH at a time and added in head order.
        for (int j = max(u0, H) - H; j < u1 - H; ++j) {  // uniform over the block
            const bool key = j < K;
            const T* grp = src + (long long)((key ? H : 2 * H) + (key ? j : j - K) * g) * D + i;
            float a[4] = {0.f, 0.f, 0.f, 0.f};
            for (int r0 = 0; r0 < g; r0 += ROPE_PAIR_BATCH) {
                Raw4<T> ra[ROPE_PAIR_BATCH];
#pragma unroll
                for (int r = 0; r < ROPE_PAIR_BATCH; ++r)
                    if (live && r0 + r < g) load_raw4(grp + (long long)(r0 + r) * D, ra[r]);
#pragma unroll
                for (int r = 0; r < ROPE_PAIR_BATCH; ++r) {
                    if (!live || r0 + r >= g) break;
                    float t[4];
                    unpack4(ra[r], t);
                    for (int k = 0; k < 4; ++k) a[k] += t[k];
                }
            }
            if (key) {
                float b[4];
                partner_f32(a, b, across);
                turn<4>(a, b, c, s, lower);
            }
            if (live) store4(dst + (long long)(H + j) * D + i, a);
        }
    }
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
    }                                                                                            \
    extern "C" __global__ void REGS rope_pairs_forward_##SUFFIX(                               \
        T* packed, const T* qkv, const unsigned int* pos, const float* cos_t, const float* sin_t,  \
        long long rows, RopeDims d) {                                                            \
        rope_expand_forward_pairs<T>(packed, qkv, pos, cos_t, sin_t, rows, d);                  \
    }                                                                                            \
    extern "C" __global__ void REGS rope_pairs_backward_##SUFFIX(                              \
        T* dqkv, const T* dpacked, const unsigned int* pos, const float* cos_t,                   \
        const float* sin_t, long long rows, RopeDims d) {                                          \
        rope_expand_backward_pairs<T>(dqkv, dpacked, pos, cos_t, sin_t, rows, d);               \
    }

// The pair kernels (every dimension rotating, partners by shuffle) on 16-bit rows are capped at
// 64 registers a thread: four blocks of 256 threads an SM, where the general kernels' 96
// registers allow two (a quarter of the SM's warps, and half the loads in flight). f32 rows,
// twice the registers a batch, keep the compiler's choice.
#define ROPE_PAIR_REGS __maxnreg__(64)
#define REGS
ROPE_KERNELS(float, f32)
#undef REGS
#define REGS ROPE_PAIR_REGS
ROPE_KERNELS(bf16, bf16)
ROPE_KERNELS(f16, f16)
#undef REGS
