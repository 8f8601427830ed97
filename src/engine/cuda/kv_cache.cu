// The key/value cache of generation; reference: engine/cpu/kv_cache.rs. A layer's cache is
// k, v: [slots, K, max_len, D] in the activation type; each row of a call names its slot and
// position. Rotation is Hugging Face's rotate_half over the first `rot` dimensions of a head,
// as in rope.cu; the cos/sin tables are f32 [positions, rot/2].
//
// Slots and positions come from the device, so every kernel bounds them itself: a row whose
// slot or position lies outside the cache writes nothing to it (and NaN to its outputs), so a
// bad call can never write or read outside the buffers.

struct AppendDims {
    int heads, kv_heads, head_dim, rot_dim;
    unsigned int positions;  // rows of the cos/sin tables
    int slots, max_len;
};

// Element i of head `src` turned by position p (dimensions at or past rot pass through).
template <typename T>
__device__ __forceinline__ float rotated(const T* src, int i, unsigned int p, const float* cos_t,
                                         const float* sin_t, const AppendDims& d) {
    if (i >= d.rot_dim) return load(src[i]);
    if (p >= d.positions) return KILN_NAN;
    const int half = d.rot_dim / 2;
    const int j = i < half ? i : i - half;
    const float c = cos_t[(long long)p * half + j], s = sin_t[(long long)p * half + j];
    return i < half ? load(src[i]) * c - load(src[i + half]) * s
                    : load(src[i]) * c + load(src[i - half]) * s;
}

// Element `rem` of row `row` of qkv[rows, (H + 2K) D], times `scale` and plus `bias` (a
// (H + 2K) D vector, or null for none): a query element rotates into q[rows, H D], a key
// element rotates and a value element copies into the cache at (slot[row], pos[row]). The
// rotation is linear, so the scaled projection and the bias rotate apart.
template <typename T>
__device__ __forceinline__ void append_element(T* q, T* k_cache, T* v_cache, const T* qkv,
                                               const T* bias, const unsigned int* slot,
                                               const unsigned int* pos, const float* cos_t,
                                               const float* sin_t, long long row, int rem,
                                               float scale, const AppendDims& d) {
    const int D = d.head_dim, H = d.heads, K = d.kv_heads;
    const long long width = (long long)(H + 2 * K) * D;
    const int head = rem / D, i = rem - head * D;
    const T* src = qkv + row * width + (long long)head * D;
    const unsigned int p = pos[row], s = slot[row];
    const bool inside = p < (unsigned int)d.max_len && s < (unsigned int)d.slots;
    auto turned = [&]() {
        const float y = scale * rotated(src, i, p, cos_t, sin_t, d);
        return bias ? y + rotated(bias + (long long)head * D, i, p, cos_t, sin_t, d) : y;
    };
    if (head < H) {
        q[(row * H + head) * D + i] = store<T>(inside ? turned() : KILN_NAN);
    } else if (inside) {
        const bool key = head < H + K;
        const int j = key ? head - H : head - H - K;
        const long long at = (((long long)s * K + j) * d.max_len + p) * D + i;
        if (key) {
            k_cache[at] = store<T>(turned());
        } else if (scale == 1.f && !bias) {
            v_cache[at] = src[i];
        } else {
            const float y = scale * load(src[i]);
            v_cache[at] = store<T>(bias ? y + load(bias[(long long)head * D + i]) : y);
        }
    }
}

// One thread per element of qkv[rows, (H + 2K) D]: query heads rotate into q[rows, H D], key
// heads rotate and value heads copy into the cache at (slot[row], pos[row]).
template <typename T>
__device__ void kv_append(T* q, T* k_cache, T* v_cache, const T* qkv, const unsigned int* slot,
                          const unsigned int* pos, const float* cos_t, const float* sin_t,
                          long long total, AppendDims d) {
    const long long width = (long long)(d.heads + 2 * d.kv_heads) * d.head_dim;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        const long long row = e / width;
        append_element(q, k_cache, v_cache, qkv, (const T*)nullptr, slot, pos, cos_t, sin_t, row,
                       (int)(e - row * width), 1.f, d);
    }
}

// kv_append of the projection of an unnormalised stream x[rows, c]: each row's elements are
// first scaled by the row's RMSNorm factor (the norm's gain is folded into the projection's
// weight) and then given the projection's bias (null for none), so the decode step needs no
// norm kernel before its projection. Grid (parts, rows): each block takes the factor of its
// row itself (c values from L2) and then its share of the row's elements.
template <typename T>
__device__ void kv_append_normed(T* q, T* k_cache, T* v_cache, const T* qkv, const T* x, int c,
                                 float eps, const T* bias, const unsigned int* slot,
                                 const unsigned int* pos, const float* cos_t, const float* sin_t,
                                 AppendDims d) {
    __shared__ float scratch[32];
    const long long row = blockIdx.y;
    const float scale = row_rstd(x + row * c, c, eps, scratch);
    const int width = (d.heads + 2 * d.kv_heads) * d.head_dim;
    for (int rem = blockIdx.x * blockDim.x + threadIdx.x; rem < width; rem += gridDim.x * blockDim.x)
        append_element(q, k_cache, v_cache, qkv, bias, slot, pos, cos_t, sin_t, row, rem, scale, d);
}

// Eight elements of a head: one 16-byte access in bf16 and f16, two in f32.
template <typename T> struct Piece {
    T v[8];
};
template <typename T> __device__ __forceinline__ Piece<T> load_piece(const T* p) {
    Piece<T> out;
    *(uint4*)out.v = *(const uint4*)p;
    if constexpr (sizeof(T) == 4) *(uint4*)(out.v + 4) = *(const uint4*)(p + 4);
    return out;
}
template <typename T> __device__ __forceinline__ void store_piece(T* p, const float (&y)[8]) {
    Piece<T> out;
#pragma unroll
    for (int e = 0; e < 8; ++e) out.v[e] = store<T>(y[e]);
    *(uint4*)p = *(const uint4*)out.v;
    if constexpr (sizeof(T) == 4) *(uint4*)(p + 4) = *(const uint4*)(out.v + 4);
}

// One piece (eight elements i0..i0+7 of head `head`) of a row's projection, with what its
// rotation needs: the partner piece rot/2 away, the angles, and the bias's two pieces.
template <typename T> struct AppendPiece {
    Piece<T> own, partner, b_own, b_partner;
    float c[8], s[8];
    int head, i0;
    bool turns, first_half, has_angles;

    // Every load of the piece, issued before any is used.
    __device__ __forceinline__ void fetch(const T* src_row, const T* bias, int piece, unsigned int p,
                                          const float* cos_t, const float* sin_t,
                                          const AppendDims& d) {
        const int e0 = piece * 8;
        head = e0 / d.head_dim;
        i0 = e0 - head * d.head_dim;
        const int half = d.rot_dim / 2;
        // Values never turn; key and query dimensions below rot do.
        turns = head < d.heads + d.kv_heads && i0 < d.rot_dim;
        first_half = i0 < half;
        has_angles = p < d.positions;
        own = load_piece(src_row + e0);
        if (bias) b_own = load_piece(bias + e0);
        if (turns) {
            const int other = first_half ? e0 + half : e0 - half;
            partner = load_piece(src_row + other);
            if (bias) b_partner = load_piece(bias + other);
            if (has_angles) {
                const int j = first_half ? i0 : i0 - half;
                const float* ct = cos_t + (long long)p * half + j;
                const float* st = sin_t + (long long)p * half + j;
                *(float4*)c = *(const float4*)ct;
                *(float4*)(c + 4) = *(const float4*)(ct + 4);
                *(float4*)s = *(const float4*)st;
                *(float4*)(s + 4) = *(const float4*)(st + 4);
            }
        }
    }

    // Element e as append_element's rotated() gives it for `src` (own, partner).
    __device__ __forceinline__ float turned(const Piece<T>& a, const Piece<T>& b, int e) const {
        if (!turns) return load(a.v[e]);
        if (!has_angles) return KILN_NAN;
        return first_half ? load(a.v[e]) * c[e] - load(b.v[e]) * s[e]
                          : load(a.v[e]) * c[e] + load(b.v[e]) * s[e];
    }
};

// kv_append (NORMED false, `x` and `bias` unused) or kv_append_normed with a row's elements
// taken eight at a time: one block per row, each thread a piece of eight, 16-byte loads and
// stores. For head sizes and rotary halves that are multiples of eight and buffers on 16-byte
// boundaries (the caller checks); the same arithmetic as append_element. A block's first
// pieces are loaded before the row's norm factor is reduced, so the two latencies overlap.
template <typename T, bool NORMED>
__device__ void kv_append_rows(T* q, T* k_cache, T* v_cache, const T* qkv, const T* x, int c,
                               float eps, const T* bias, const unsigned int* slot,
                               const unsigned int* pos, const float* cos_t, const float* sin_t,
                               AppendDims d) {
    const long long row = blockIdx.x;
    const int D = d.head_dim, H = d.heads, K = d.kv_heads;
    const int width = (H + 2 * K) * D, pieces = width / 8;
    const T* src_row = qkv + row * width;
    const unsigned int p = pos[row], s = slot[row];
    const bool inside = p < (unsigned int)d.max_len && s < (unsigned int)d.slots;
    AppendPiece<T> a;
    int piece = threadIdx.x;
    if (piece < pieces) a.fetch(src_row, bias, piece, p, cos_t, sin_t, d);
    float scale = 1.f;
    if constexpr (NORMED) {
        __shared__ float scratch[32];
        scale = row_rstd(x + row * c, c, eps, scratch);
    }
    for (; piece < pieces; piece += blockDim.x) {
        if (piece != (int)threadIdx.x) a.fetch(src_row, bias, piece, p, cos_t, sin_t, d);
        float y[8];
        if (a.head < H + K) {
            // Queries and keys: scale times the rotated projection, plus the rotated bias.
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                y[e] = scale * a.turned(a.own, a.partner, e);
                if (bias) y[e] = y[e] + a.turned(a.b_own, a.b_partner, e);
            }
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                y[e] = scale * load(a.own.v[e]);
                if (bias) y[e] = y[e] + load(a.b_own.v[e]);
            }
        }
        if (a.head < H) {
            if (!inside) {
#pragma unroll
                for (int e = 0; e < 8; ++e) y[e] = KILN_NAN;
            }
            store_piece<T>(q + (row * H + a.head) * D + a.i0, y);
        } else if (inside) {
            const bool key = a.head < H + K;
            const int j = key ? a.head - H : a.head - H - K;
            const long long at = (((long long)s * K + j) * d.max_len + p) * D + a.i0;
            store_piece<T>((key ? k_cache : v_cache) + at, y);
        }
    }
}

// Copies positions 0..len of every key/value head from one slot to another: `from` and `to`
// are the offsets of the slots' first vectors, `head_stride` = max_len D, `run` = len D.
template <typename T>
__device__ void copy_cache_slot(T* cache, long long from, long long to, long long head_stride,
                                long long run, long long total) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        const long long head = e / run, off = head * head_stride + (e - head * run);
        cache[to + off] = cache[from + off];
    }
}

// Lays a prefill's rows out for the training attention (`attention.cu`'s fused `qkv[B, T, 3C]`,
// C = heads D): `runs` holds (slot, first row, length) per run of rows, a run being one
// sequence's positions 0..length in order. packed[r, t] = [the queries of row first + t | every
// query head's key at position t of the slot | its value], and zeros past the run's length:
// the causal mask keeps those keys from every real query, and zeros (unlike whatever the
// cache holds there) add nothing to a masked product.
template <typename T>
__device__ void prefill_pack(T* packed, const T* q, const T* k_cache, const T* v_cache,
                             const unsigned int* runs, int tmax, int heads, int kv_heads, int d,
                             int max_len, int vec) {
    // One block per packed row: its run, slot and position are found once, and the row is
    // copied in 16-byte pieces where the caller found the buffers and head size aligned (`vec`; a
    // piece never straddles a head).
    const int row = blockIdx.x;
    const int r = row / tmax, t = row - r * tmax;
    const unsigned int slot = runs[3 * r], first = runs[3 * r + 1], len = runs[3 * r + 2];
    const int ch = heads * d, group = heads / kv_heads;
    T* dst = packed + (long long)row * 3 * ch;
    constexpr int V = 16 / sizeof(T);
    const int step = vec ? V : 1;
    for (int col = threadIdx.x * step; col < 3 * ch; col += blockDim.x * step) {
        const T* src = nullptr;
        if ((unsigned int)t < len) {
            const int part = col / ch, within = col - part * ch;
            if (part == 0) {
                src = q + ((long long)first + t) * ch + within;
            } else {
                const int h = within / d, i = within - h * d;
                src = (part == 1 ? k_cache : v_cache) +
                      (((long long)slot * kv_heads + h / group) * max_len + t) * d + i;
            }
        }
        if (vec) {
            *(uint4*)(dst + col) = src ? *(const uint4*)src : make_uint4(0, 0, 0, 0);
        } else {
            dst[col] = src ? *src : store<T>(0.0f);
        }
    }
}

// ---- Attention of new queries against the cache (decode and prefill) ----
//
// One block of THREADS threads (128, or 256 for few blocks: see the kernels' instances) per
// (row, key/value head, chunk of G query heads, split of the row's positions). The block's threads form groups of L lanes; a group holds one
// cached vector, eight elements per lane (L = 8, 16, 32 for D up to 64, 128, 256), so each key
// and value loaded serves all G query heads of the chunk. Each group runs its own online
// softmax over positions grp, grp + groups, ... of the split: a decode row's positions are a
// chain of dependent loads per group, so the more groups a block has, the shorter the chain.
// The groups then merge in shared memory (in a wide block, first by shuffles within a warp). With one split
// the result is the output; with several, each split writes its unnormalised output, max and
// sum (base 2) and `cache_attention_combine` merges them. A sliding window (`window` > 0)
// limits a row to its `window` latest positions, which the splits then divide among
// themselves.
//
// The appending variant (APPEND, wide blocks only) is the folded decode step's key/value append and attention
// in one launch: it reads the row's query, key and value from the projection qkv[rows, (H +
// 2K) D] of the unnormalised stream x[rows, c], applies the row's RMSNorm factor, the bias and
// the rotation as kv_append_normed does (rounding through T as its stores do), writes
// the key and value at the row's position and then attends. Every block whose split holds
// that position writes it and reads it back after a barrier, so no block waits on another;
// chunks of one key/value head write the same bits to the same place. It requires one row
// per slot (a decode step): a row cannot see another row's append of the same call. Before
// its wait for the QKV product it copies the split's cached keys and values before the row's
// position (up to about 40 KiB) into shared memory, so that, launched overlapped, their
// loads leave the chain of each group's positions.

#define ATT_EPL 8  // elements of a vector per lane

struct AttnDims {
    int heads, kv_heads, head_dim, max_len, slots;
    int chunks;  // chunks of G query heads per key/value head
    int splits;  // splits of each row's positions
    float scale_log2;  // 1/sqrt(D) * log2(e): scores in base 2
    int window;  // the sliding window in positions; 0: none
};

// Where the appending variant takes its rows from (unused by the plain one).
template <typename T>
struct AppendSrc {
    const T* qkv;   // [rows, (H + 2K) D], the projection of the unnormalised stream
    const T* x;     // [rows, c], the stream, for each row's RMSNorm factor
    const T* bias;  // [(H + 2K) D] or null
    const float* cos_t;
    const float* sin_t;
    int c;
    float eps;
    AppendDims ad;
};

// Eight elements base..base+7 of a vector of length D (zeros past D).
template <typename T>
__device__ __forceinline__ void load8(const T* v, int base, int D, bool vec, float x[ATT_EPL]) {
    if (vec && base + ATT_EPL <= D) {
        load4(v + base, x);
        load4(v + base + 4, x + 4);
    } else {
#pragma unroll
        for (int j = 0; j < ATT_EPL; ++j) x[j] = base + j < D ? load(v[base + j]) : 0.f;
    }
}

// Element i of head `head` of a row's projection `src` as kv_append_normed leaves it: the
// row factor `scale` times the rotated projection plus the rotated bias.
template <typename T>
__device__ __forceinline__ float appended(const T* src, const T* bias, int head, int i,
                                          unsigned int p, float scale, const AppendSrc<T>& a) {
    const int D = a.ad.head_dim;
    const float y = scale * rotated(src + (long long)head * D, i, p, a.cos_t, a.sin_t, a.ad);
    return bias ? y + rotated(bias + (long long)head * D, i, p, a.cos_t, a.sin_t, a.ad) : y;
}

// What a block of either attention layout works on: its row, key/value head, chunk of query
// heads (h0.., nh of them) and split, the row's slot and position (read past the L1 where
// `past_l1`: the appending kernels read them before their wait, see copy_async16), and the
// split's positions t0..t1 of lo..=p, lo the first of the window (`head_dim` is d.head_dim,
// a constant where the kernel has one).
struct AttnBlock {
    long long row, head_base;
    int kvh, split, h0, nh, t0, t1;
    unsigned int p;
    bool inside;
};

template <int G>
__device__ __forceinline__ AttnBlock attn_block(const unsigned int* slot, const unsigned int* pos,
                                                const AttnDims& d, int head_dim, bool past_l1) {
    AttnBlock b;
    b.row = blockIdx.x;
    b.kvh = blockIdx.y / d.chunks;
    const int chunk = blockIdx.y - b.kvh * d.chunks, g = d.heads / d.kv_heads;
    b.split = blockIdx.z;
    b.h0 = b.kvh * g + chunk * G;
    b.nh = min(G, g - chunk * G);
    b.p = past_l1 ? __ldcg(pos + b.row) : pos[b.row];
    const unsigned int s = past_l1 ? __ldcg(slot + b.row) : slot[b.row];
    b.inside = b.p < (unsigned int)d.max_len && s < (unsigned int)d.slots;
    const int end = b.inside ? (int)b.p + 1 : 0;
    const int lo = d.window > 0 ? max(0, end - d.window) : 0;
    const int per = (end - lo + d.splits - 1) / d.splits;
    b.t0 = lo + b.split * per;
    b.t1 = min(end, b.t0 + per);
    b.head_base = b.inside ? ((long long)s * d.kv_heads + b.kvh) * d.max_len * head_dim : 0;
    return b;
}

// Element i of head h of a block's output: o / sum with one split (NaN for a row outside the
// cache), else the split's unnormalised o and its (max, sum) for cache_attention_combine.
// `D` is d.head_dim, a constant where the kernel has one.
template <typename T>
__device__ __forceinline__ void write_head_output(T* out, float* part_o, float* part_ml,
                                                  const AttnDims& d, int D, const AttnBlock& b,
                                                  int h, int i, float o, float sum, float mx) {
    const long long oh = b.row * d.heads + b.h0 + h;
    if (d.splits == 1) {
        out[oh * D + i] = store<T>(b.inside ? o / sum : KILN_NAN);
    } else {
        part_o[(oh * d.splits + b.split) * D + i] = o;
        if (i == 0) {
            part_ml[2 * (oh * d.splits + b.split)] = mx;
            part_ml[2 * (oh * d.splits + b.split) + 1] = sum;
        }
    }
}

// The appending variant's start, shared by its two layouts. Before the wait for the previous
// kernel (the QKV product) the block starts copying the row's cached keys and values before
// position p (of the split's t0..t1) into `buf` (keys, then as many values), where `may_copy`
// and the buffers' alignment allow: earlier steps wrote them, so they are in place, and
// launched overlapped the copies run while the product finishes. What the product writes (qkv)
// and position p wait. Then the block forms its queries (heads h0..h0 + nh, times scale_log2,
// rounded through T as kv_append_normed's stores round) and hands each element to
// put_q(h, i, value); the split that holds p writes its key and value meanwhile. With
// `swizzle_keys` each key's 16-byte pieces are stored with their index XORed with the
// position's low three bits (a key needs 8 pieces or more). Returns the positions copied; on
// return the copies and every put_q are complete (a barrier). Every thread of the block must
// call it.
template <typename T, int THREADS, typename PutQ>
__device__ __forceinline__ int append_prologue(unsigned char* buf, int buf_bytes, T* k_cache,
                                               T* v_cache, const AttnBlock& b, bool may_copy,
                                               bool swizzle_keys, const AttnDims& d,
                                               const AppendSrc<T>& a, PutQ put_q) {
    __shared__ float scratch[32];
    const int D = d.head_dim, H = d.heads;
    const long long row = b.row, head_base = b.head_base;
    const int t0 = b.t0, t1 = b.t1, kvh = b.kvh, h0 = b.h0, nh = b.nh;
    const unsigned int p = b.p;
    const bool inside = b.inside;
    int preloaded = 0;
    const bool copies = may_copy && D % (16 / (int)sizeof(T)) == 0 &&
                        ((unsigned long long)k_cache % 16) == 0 &&
                        ((unsigned long long)v_cache % 16) == 0;
    if (copies) {
        const int vector_bytes = D * (int)sizeof(T);
        preloaded = max(0, min(min(t1, (int)p) - t0, buf_bytes / (2 * vector_bytes)));
        const int per_vector = vector_bytes / 16;
        const int pieces = preloaded * per_vector;  // of keys, and as many of values
        const char* k_from = reinterpret_cast<const char*>(k_cache + head_base + (long long)t0 * D);
        const char* v_from = reinterpret_cast<const char*>(v_cache + head_base + (long long)t0 * D);
        for (int e = threadIdx.x; e < pieces; e += THREADS) {
            const int to = swizzle_keys ? e ^ (e / per_vector & 7) : e;
            copy_async16(buf + 16 * to, k_from + 16 * e);
            copy_async16(buf + (long long)preloaded * vector_bytes + 16 * e, v_from + 16 * e);
        }
        // The rest of the cached range (past what fits) is fetched into L2 meanwhile: read
        // later in the block's chain, it then costs an L2 trip, not a DRAM one.
        const int rest = max(0, min(t1, (int)p) - t0 - preloaded);
        if (threadIdx.x == 0 && rest > 0) {
            const long long from = head_base + (long long)(t0 + preloaded) * D;
            prefetch_l2(k_cache + from, (unsigned int)(rest * vector_bytes));
            prefetch_l2(v_cache + from, (unsigned int)(rest * vector_bytes));
        }
    }
    grid_chain();
    const float scale = row_rstd(a.x + row * a.c, a.c, a.eps, scratch);

    const int width = (H + 2 * d.kv_heads) * D;
    const T* src = a.qkv + row * width;
    const bool writer = inside && t0 <= (int)p && (int)p < t1;
    const int queries = nh * D, work = queries + (writer ? 2 * D : 0);
    const long long at = head_base + (long long)p * D;
    for (int e = threadIdx.x; e < work; e += THREADS) {
        if (e < queries) {
            const int h = e / D, i = e - h * D;
            const float y = inside ? appended(src, a.bias, h0 + h, i, p, scale, a) : 0.f;
            put_q(h, i, load(store<T>(y)) * d.scale_log2);
        } else if (e < queries + D) {
            const int i = e - queries;
            k_cache[at + i] = store<T>(appended(src, a.bias, H + kvh, i, p, scale, a));
        } else {
            const int i = e - queries - D, head = H + d.kv_heads + kvh;
            const float y = scale * load(src[(long long)head * D + i]);
            v_cache[at + i] = store<T>(a.bias ? y + load(a.bias[(long long)head * D + i]) : y);
        }
    }
    copy_async_wait_all();
    __syncthreads();
    return preloaded;
}

template <typename T, int L, int G, int THREADS, bool APPEND>
__device__ void cache_attention(T* out, float* part_o, float* part_ml, const T* q, T* k_cache,
                                T* v_cache, const unsigned int* slot, const unsigned int* pos,
                                AttnDims d, AppendSrc<T> a) {
    constexpr int DP = L * ATT_EPL;  // padded head size
    constexpr int GROUPS = THREADS / L;
    // A narrow block's groups each leave their state in shared memory (as many floats as the
    // block has lanes, for each of G heads); a wide block's would not fit, so the groups of a
    // warp merge first and each warp leaves one.
    constexpr bool WARP_MERGE = THREADS > 128;
    constexpr int STATES = WARP_MERGE ? THREADS / 32 : GROUPS;
    // The groups' final states (sm_o) are written only after the loop over positions, so in
    // the appending variant the same shared memory first holds the keys and values it loads
    // before its wait (see below): as many as fit in about 40 KiB.
    constexpr int O_BYTES = STATES * G * DP * (int)sizeof(float);
    constexpr int BUF_BYTES = APPEND && O_BYTES < 40 * 1024 ? 40 * 1024 : O_BYTES;
    __shared__ float sm_m[STATES][G], sm_l[STATES][G];
    __shared__ __align__(16) unsigned char sm_buf[BUF_BYTES];
    float (*sm_o)[G][DP] = reinterpret_cast<float (*)[G][DP]>(sm_buf);

    const AttnBlock b = attn_block<G>(slot, pos, d, d.head_dim, APPEND);
    const long long row = b.row;
    const int D = d.head_dim, H = d.heads;
    const int h0 = b.h0, nh = b.nh;  // heads of this chunk; the rest repeat the last
    const int t0 = b.t0, t1 = b.t1;
    const long long head_base = b.head_base;
    const int lane = threadIdx.x % L, grp = threadIdx.x / L;
    const int base = lane * ATT_EPL;
    // Every vector starts at a multiple of D elements: four-element accesses need D % 8 == 0
    // and aligned buffers.
    const bool vec = D % ATT_EPL == 0 && aligned4(q) && aligned4(k_cache) && aligned4(v_cache);

    float qr[G][ATT_EPL];
    // Positions t0..t0 + preloaded come from shared memory (the appending variant's early
    // loads), the rest from the cache.
    int preloaded = 0;
    const T* pre_k = reinterpret_cast<const T*>(sm_buf);
    const T* pre_v = pre_k;
    if constexpr (APPEND) {
        __shared__ float sm_q[G][DP];
        preloaded = append_prologue<T, THREADS>(sm_buf, BUF_BYTES, k_cache, v_cache, b, vec, false,
                                                d, a, [&](int h, int i, float y) { sm_q[h][i] = y; });
        pre_v = pre_k + (long long)preloaded * D;
#pragma unroll
        for (int h = 0; h < G; ++h) {
#pragma unroll
            for (int j = 0; j < ATT_EPL; ++j)
                qr[h][j] = base + j < D ? sm_q[min(h, nh - 1)][base + j] : 0.f;
        }
    } else {
#pragma unroll
        for (int h = 0; h < G; ++h) {
            const T* qh = q + (row * H + h0 + min(h, nh - 1)) * D;
            load8(qh, base, D, vec, qr[h]);
#pragma unroll
            for (int j = 0; j < ATT_EPL; ++j) qr[h][j] *= d.scale_log2;
        }
    }

    float m[G], l[G], acc[G][ATT_EPL];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        m[h] = KILN_NEG_INF;
        l[h] = 0.f;
#pragma unroll
        for (int j = 0; j < ATT_EPL; ++j) acc[h][j] = 0.f;
    }
    const T* kp = k_cache + head_base;
    const T* vp = v_cache + head_base;
    // Every group runs the same number of steps (the last ones partly past the split), so
    // the shuffles of a warp always see all of its lanes.
#pragma unroll 2
    for (int tb = t0; tb < t1; tb += GROUPS) {
        const int t = tb + grp;
        const bool valid = t < t1;
        float kx[ATT_EPL], vx[ATT_EPL];
        const int at = valid ? t : t0;
        if (at - t0 < preloaded) {
            load8(pre_k + (long long)(at - t0) * D, base, D, true, kx);
            load8(pre_v + (long long)(at - t0) * D, base, D, true, vx);
        } else {
            load8(kp + (long long)at * D, base, D, vec, kx);
            load8(vp + (long long)at * D, base, D, vec, vx);
        }
#pragma unroll
        for (int h = 0; h < G; ++h) {
            float sc = 0.f;
#pragma unroll
            for (int j = 0; j < ATT_EPL; ++j) sc = fmaf(qr[h][j], kx[j], sc);
#pragma unroll
            for (int o = L / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
            if (valid) {
                const float mn = fmaxf(m[h], sc);
                const float corr = exp2f(m[h] - mn), w = exp2f(sc - mn);
                l[h] = l[h] * corr + w;
#pragma unroll
                for (int j = 0; j < ATT_EPL; ++j) acc[h][j] = fmaf(w, vx[j], acc[h][j] * corr);
                m[h] = mn;
            }
        }
    }

    // In a wide block the groups of a warp merge pairwise by shuffles (lane i of a group with
    // lane i of the group `o / L` away), a group that saw no position weighing nothing.
    if constexpr (WARP_MERGE) {
#pragma unroll
        for (int o = L; o < 32; o <<= 1) {
#pragma unroll
            for (int h = 0; h < G; ++h) {
                const float mo = __shfl_xor_sync(0xffffffffu, m[h], o);
                const float lo_ = __shfl_xor_sync(0xffffffffu, l[h], o);
                const float mn = fmaxf(m[h], mo);
                const float ws = mn == KILN_NEG_INF ? 0.f : exp2f(m[h] - mn);
                const float wo = mn == KILN_NEG_INF ? 0.f : exp2f(mo - mn);
                l[h] = fmaf(l[h], ws, lo_ * wo);
#pragma unroll
                for (int j = 0; j < ATT_EPL; ++j) {
                    const float ao = __shfl_xor_sync(0xffffffffu, acc[h][j], o);
                    acc[h][j] = fmaf(acc[h][j], ws, ao * wo);
                }
                m[h] = mn;
            }
        }
    }
    const int state = WARP_MERGE ? (int)threadIdx.x / 32 : grp;
    if constexpr (APPEND) __syncthreads();  // every group is through the keys and values sm_o replaces
    if (!WARP_MERGE || (int)threadIdx.x % 32 < L) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
            if (lane == 0) {
                sm_m[state][h] = m[h];
                sm_l[state][h] = l[h];
            }
#pragma unroll
            for (int j = 0; j < ATT_EPL; ++j) sm_o[state][h][base + j] = acc[h][j];
        }
    }
    __syncthreads();

    for (int e = threadIdx.x; e < nh * D; e += THREADS) {
        const int h = e / D, i = e - h * D;
        float mx = KILN_NEG_INF;
        for (int r = 0; r < STATES; ++r) mx = fmaxf(mx, sm_m[r][h]);
        float sum = 0.f, o = 0.f;
        if (mx != KILN_NEG_INF) {
            for (int r = 0; r < STATES; ++r) {
                const float w = exp2f(sm_m[r][h] - mx);
                sum = fmaf(sm_l[r][h], w, sum);
                o = fmaf(sm_o[r][h][i], w, o);
            }
        }
        write_head_output(out, part_o, part_ml, d, D, b, h, i, o, sum, mx);
    }
}

// ---- The appending decode attention a position a thread (head sizes 64 and 128) ----
//
// The same call as cache_attention's appending variant (one block of 256 threads per row, key/
// value head, chunk of G query heads and split; the same prologue), laid out for short chains
// of dependent instructions per thread instead of a group of lanes per cached vector. The
// split's positions go in rounds of TILE = 256 / (D / 32), each in two steps:
//   1. Each thread takes 32 dimensions of one position's key (D / 32 threads a position) and
//      forms the partial scores of all G heads, added across the position's threads by
//      shuffles; each warp also leaves its largest score of each head.
//   2. Each thread takes 8 dimensions of the value vectors (D / 8 threads a position) at
//      every (256 / (D / 8))-th position of the round. From the warps' maxima every thread
//      forms the same running maximum of each head, rescales its sums by its change, and adds
//      2^(score - max) times the value, and the weight into its own sum of weights.
// The threads of a dimension range then add their sums (shuffles within a warp, then shared
// memory across warps) and the block writes the output, or the split's partial state, as
// cache_attention does; only the order of additions differs. The copied keys are stored with
// each 16-byte piece's index XORed with the position's low three bits, so that the threads of
// step 1 (a position 128 or 256 bytes after the last) read them without bank conflicts.
template <typename T, int D, int G>
__device__ void cache_attention_positions(T* out, float* part_o, float* part_ml, T* k_cache,
                                          T* v_cache, const unsigned int* slot,
                                          const unsigned int* pos, AttnDims d, AppendSrc<T> a) {
    constexpr int THREADS = 256, WARPS = THREADS / 32;
    constexpr int TPP = D / 32;              // threads a position in the scores
    constexpr int TILE = THREADS / TPP;      // positions a round: 128 at D 64, 64 at D 128
    constexpr int PIECES = 32 * (int)sizeof(T) / 16;  // 16-byte pieces of a thread's 32 dims
    constexpr int QS = 36;                   // floats between a query's 32-dimension parts
    constexpr int GP = (G + 3) / 4 * 4;      // a position's scores, padded to 16 bytes
    constexpr int COLS = D / 8;              // threads a position in the values
    constexpr int STRIPES = THREADS / COLS;  // the positions of a round a value thread takes:
    constexpr int PER = TILE / STRIPES;      // every STRIPES-th, PER of them
    constexpr int BUF_BYTES = 38 * 1024;
    static_assert(D == 64 || D == 128, "head sizes 64 and 128");
    static_assert(WARPS * G * (D + 1) * 4 <= BUF_BYTES, "the warps' sums fit the buffer");
    __shared__ __align__(16) unsigned char sm_buf[BUF_BYTES];  // copied keys and values, then sums
    __shared__ __align__(16) float sm_q[G][TPP][QS];
    __shared__ __align__(16) float sm_s[TILE][GP];  // a round's scores
    __shared__ float sm_wmax[WARPS][G];             // each warp's largest score of the round

    const AttnBlock b = attn_block<G>(slot, pos, d, D, true);
    const int nh = b.nh, t0 = b.t0, t1 = b.t1;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const bool wide = ((unsigned long long)k_cache % 16) == 0 && ((unsigned long long)v_cache % 16) == 0;

    // Heads past the chunk's (a chunk of fewer than G) score zeros; their outputs are dropped.
    for (int e = tid; e < (G - nh) * TPP * QS; e += THREADS) (&sm_q[nh][0][0])[e] = 0.f;
    const int preloaded = append_prologue<T, THREADS>(
        sm_buf, BUF_BYTES, k_cache, v_cache, b, true, true, d, a,
        [&](int h, int i, float y) { sm_q[h][i / 32][i % 32] = y; });
    const uint4* pre_k = reinterpret_cast<const uint4*>(sm_buf);
    const T* pre_v = reinterpret_cast<const T*>(sm_buf) + (long long)preloaded * D;
    const T* kp = k_cache + b.head_base;
    const T* vp = v_cache + b.head_base;

    const int part = tid % TPP, at_score = tid / TPP;  // scores: this thread's part and position
    const int col = tid % COLS, stripe = tid / COLS;   // values: its dimensions and positions
    float acc[G][8], lsum[G], m_run[G];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        m_run[h] = KILN_NEG_INF;
        lsum[h] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[h][j] = 0.f;
    }

    for (int tb = t0; tb < t1; tb += TILE) {
        const int n = min(TILE, t1 - tb);
        {
            const int i = at_score < n ? at_score : 0;
            const int q = tb + i - t0;  // the position's index among the copied ones
            float kx[32];
            if (q < preloaded) {
                const uint4* key = pre_k + (long long)q * (D * (int)sizeof(T) / 16);
#pragma unroll
                for (int k = 0; k < PIECES; ++k)
                    unpack16<T>(key[(part * PIECES + k) ^ (q & 7)], kx + k * (16 / (int)sizeof(T)));
            } else {
                const T* key = kp + (long long)(tb + i) * D + part * 32;
#pragma unroll
                for (int j = 0; j < 32; j += 8) load8_at(key + j, wide, kx + j);
            }
#pragma unroll
            for (int h = 0; h < G; ++h) {
                float s4[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < 32; j += 4) {
                    const float4 qv = *reinterpret_cast<const float4*>(&sm_q[h][part][j]);
                    s4[0] = fmaf(qv.x, kx[j], s4[0]);
                    s4[1] = fmaf(qv.y, kx[j + 1], s4[1]);
                    s4[2] = fmaf(qv.z, kx[j + 2], s4[2]);
                    s4[3] = fmaf(qv.w, kx[j + 3], s4[3]);
                }
                float sc = (s4[0] + s4[1]) + (s4[2] + s4[3]);
#pragma unroll
                for (int o = TPP / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
                sc = at_score < n ? sc : KILN_NEG_INF;
                if (part == 0) sm_s[at_score][h] = sc;
                float mx = sc;
#pragma unroll
                for (int o = TPP; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                if (lane == 0) sm_wmax[warp][h] = mx;
            }
        }
        __syncthreads();
        // Every thread forms the same running maximum (the same values, the same order).
        float m_new[G];
#pragma unroll
        for (int h = 0; h < G; ++h) {
            float mx = m_run[h];
#pragma unroll
            for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_wmax[w][h]);
            m_new[h] = mx;
            const float corr = exp2f(m_run[h] - mx);
            lsum[h] *= corr;
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[h][j] *= corr;
            m_run[h] = mx;
        }
#pragma unroll
        for (int k = 0; k < PER; ++k) {
            const int i = stripe + k * STRIPES;
            if (i < n) {
                const bool copied = tb + i - t0 < preloaded;
                const T* val = (copied ? pre_v + (long long)(tb + i - t0) * D
                                       : vp + (long long)(tb + i) * D) +
                               col * 8;
                float vx[8];
                load8_at(val, wide || copied, vx);
                float w[GP];
#pragma unroll
                for (int h = 0; h < GP; h += 4) {
                    const float4 s4 = *reinterpret_cast<const float4*>(&sm_s[i][h]);
                    w[h] = s4.x;
                    w[h + 1] = s4.y;
                    w[h + 2] = s4.z;
                    w[h + 3] = s4.w;
                }
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    const float wh = exp2f(w[h] - m_new[h]);
                    lsum[h] += wh;
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[h][j] = fmaf(wh, vx[j], acc[h][j]);
                }
            }
        }
        __syncthreads();  // the next round's scores and maxima replace these
    }

    // The sums of a dimension range: across the warp's stripes by shuffles, then across warps
    // (each thread's sum of weights is its stripe's, the same for every dimension range).
    float* sums = reinterpret_cast<float*>(sm_buf);  // [WARPS][G][D], the copies used up
    float* wsums = sums + WARPS * G * D;             // [WARPS][G]
#pragma unroll
    for (int o = COLS; o < 32; o <<= 1) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
            lsum[h] += __shfl_xor_sync(0xffffffffu, lsum[h], o);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[h][j] += __shfl_xor_sync(0xffffffffu, acc[h][j], o);
        }
    }
    if (lane < COLS) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
#pragma unroll
            for (int j = 0; j < 8; j += 4)
                *reinterpret_cast<float4*>(&sums[(warp * G + h) * D + col * 8 + j]) =
                    make_float4(acc[h][j], acc[h][j + 1], acc[h][j + 2], acc[h][j + 3]);
            if (lane == 0) wsums[warp * G + h] = lsum[h];
        }
    }
    if (tid == 0) {
#pragma unroll
        for (int h = 0; h < G; ++h) sm_wmax[0][h] = m_run[h];  // indexed below by a variable head
    }
    __syncthreads();
    for (int e = tid; e < nh * D; e += THREADS) {
        const int h = e / D, i = e - h * D;
        float o = 0.f, sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            o += sums[(w * G + h) * D + i];
            sum += wsums[w * G + h];
        }
        write_head_output(out, part_o, part_ml, d, D, b, h, i, o, sum, sm_wmax[0][h]);
    }
}

// Merges the splits of one (row, query head) per block: out = sum_s o_s 2^(m_s - M) / sum_s
// l_s 2^(m_s - M). A split with no positions has m = -inf and weighs nothing; a row outside
// the cache has no positions at all and gives NaN.
template <typename T>
__device__ void cache_attention_combine(T* out, const float* part_o, const float* part_ml,
                                        AttnDims d) {
    const long long oh = blockIdx.x;
    const int D = d.head_dim, S = d.splits;
    const float* ml = part_ml + 2 * oh * S;
    float mx = KILN_NEG_INF;
    for (int s = 0; s < S; ++s) mx = fmaxf(mx, ml[2 * s]);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float sum = 0.f, o = 0.f;
        if (mx != KILN_NEG_INF) {
            for (int s = 0; s < S; ++s) {
                const float w = exp2f(ml[2 * s] - mx);
                sum = fmaf(ml[2 * s + 1], w, sum);
                o = fmaf(part_o[(oh * S + s) * D + i], w, o);
            }
        }
        out[oh * D + i] = store<T>(mx != KILN_NEG_INF ? o / sum : KILN_NAN);
    }
}

// Each layout comes as a block of 128 threads (many blocks: prefill, large decode batches)
// and, for head sizes up to 128, a wide block of 256 (few blocks, where the chain of positions
// per group sets the time), which also comes appending: with many blocks, the appending
// block's prologue (every block of a row taking the row's norm factor) costs more than the
// separate append's launch saves.
#define ATTN_KERNEL_T(T, SUFFIX, L, G, WIDE, THREADS)                                          \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        cache_attention##WIDE##_##SUFFIX##_l##L##_g##G(                                        \
            T* out, float* part_o, float* part_ml, const T* q, const T* k_cache,               \
            const T* v_cache, const unsigned int* slot, const unsigned int* pos, AttnDims d) { \
        grid_chain();                                                                          \
        cache_attention<T, L, G, THREADS, false>(out, part_o, part_ml, q, (T*)k_cache,         \
                                                 (T*)v_cache, slot, pos, d, AppendSrc<T>{});   \
    }

#define ATTN_APPEND_KERNEL(T, SUFFIX, L, G)                                                    \
    ATTN_KERNEL_T(T, SUFFIX, L, G, _wide, 256)                                                 \
    extern "C" __global__ void __launch_bounds__(256) cache_attention_append_##SUFFIX##_l##L##_g##G( \
        T* out, float* part_o, float* part_ml, T* k_cache, T* v_cache,                         \
        const unsigned int* slot, const unsigned int* pos, AttnDims d, const T* qkv,           \
        const T* x, const T* bias, const float* cos_t, const float* sin_t, int c, float eps,   \
        AppendDims ad) {                                                                       \
        cache_attention<T, L, G, 256, true>(out, part_o, part_ml, (const T*)nullptr, k_cache,  \
                                            v_cache, slot, pos, d,                             \
                                            AppendSrc<T>{qkv, x, bias, cos_t, sin_t, c, eps, ad}); \
    }

// The appending kernels a position a thread, for head sizes 64 and 128 (kv_cache.rs takes
// them where they exist; the kernels of a group of lanes a vector serve the other sizes).
#define ATTN_POSITIONS_KERNEL(T, SUFFIX, D, G)                                                 \
    extern "C" __global__ void __launch_bounds__(256) cache_attention_append_##SUFFIX##_d##D##_g##G( \
        T* out, float* part_o, float* part_ml, T* k_cache, T* v_cache,                         \
        const unsigned int* slot, const unsigned int* pos, AttnDims d, const T* qkv,           \
        const T* x, const T* bias, const float* cos_t, const float* sin_t, int c, float eps,   \
        AppendDims ad) {                                                                       \
        cache_attention_positions<T, D, G>(out, part_o, part_ml, k_cache, v_cache, slot, pos, d, \
                                           AppendSrc<T>{qkv, x, bias, cos_t, sin_t, c, eps, ad}); \
    }

// G = 2 serves multi-head attention too (the second head repeats the first): one kernel less
// to compile for a kernel that waits on memory anyway.
#define ATTN_KERNELS_L(T, SUFFIX, L)             \
    ATTN_KERNEL_T(T, SUFFIX, L, 2, , 128)        \
    ATTN_KERNEL_T(T, SUFFIX, L, 4, , 128)        \
    ATTN_KERNEL_T(T, SUFFIX, L, 8, , 128)
#define ATTN_WIDE_KERNELS_L(T, SUFFIX, L) \
    ATTN_APPEND_KERNEL(T, SUFFIX, L, 2)   \
    ATTN_APPEND_KERNEL(T, SUFFIX, L, 4)   \
    ATTN_APPEND_KERNEL(T, SUFFIX, L, 8)
// Three query heads a key/value head (SmolLM2) in wide blocks of head size 64: as four, a
// repeated fourth head would cost a quarter more work a position and 127 registers (80).

#define KV_KERNELS(T, SUFFIX)                                                                  \
    extern "C" __global__ void kv_append_##SUFFIX(                                             \
        T* q, T* k_cache, T* v_cache, const T* qkv, const unsigned int* slot,                   \
        const unsigned int* pos, const float* cos_t, const float* sin_t, long long total,       \
        AppendDims d) {                                                                          \
        grid_chain();                                                                           \
        kv_append<T>(q, k_cache, v_cache, qkv, slot, pos, cos_t, sin_t, total, d);              \
    }                                                                                            \
    extern "C" __global__ void kv_append_normed_##SUFFIX(                                      \
        T* q, T* k_cache, T* v_cache, const T* qkv, const T* x, int c, float eps,               \
        const T* bias, const unsigned int* slot, const unsigned int* pos, const float* cos_t,   \
        const float* sin_t, AppendDims d) {                                                      \
        grid_chain();                                                                           \
        kv_append_normed<T>(q, k_cache, v_cache, qkv, x, c, eps, bias, slot, pos, cos_t, sin_t, \
                            d);                                                                  \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) kv_append_rows_##SUFFIX(                  \
        T* q, T* k_cache, T* v_cache, const T* qkv, const unsigned int* slot,                   \
        const unsigned int* pos, const float* cos_t, const float* sin_t, AppendDims d) {         \
        grid_chain();                                                                           \
        kv_append_rows<T, false>(q, k_cache, v_cache, qkv, (const T*)nullptr, 0, 0.f,           \
                                 (const T*)nullptr, slot, pos, cos_t, sin_t, d);                 \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) kv_append_normed_rows_##SUFFIX(           \
        T* q, T* k_cache, T* v_cache, const T* qkv, const T* x, int c, float eps,               \
        const T* bias, const unsigned int* slot, const unsigned int* pos, const float* cos_t,   \
        const float* sin_t, AppendDims d) {                                                      \
        grid_chain();                                                                           \
        kv_append_rows<T, true>(q, k_cache, v_cache, qkv, x, c, eps, bias, slot, pos, cos_t,    \
                                sin_t, d);                                                       \
    }                                                                                            \
    extern "C" __global__ void copy_cache_slot_##SUFFIX(T* cache, long long from, long long to, \
                                                        long long head_stride, long long run,    \
                                                        long long total) {                       \
        copy_cache_slot<T>(cache, from, to, head_stride, run, total);                            \
    }                                                                                            \
    extern "C" __global__ void prefill_pack_##SUFFIX(                                          \
        T* packed, const T* q, const T* k_cache, const T* v_cache, const unsigned int* runs,    \
        int tmax, int heads, int kv_heads, int d, int max_len, int vec) {                        \
        prefill_pack<T>(packed, q, k_cache, v_cache, runs, tmax, heads, kv_heads, d, max_len,   \
                        vec);                                                                    \
    }                                                                                            \
    extern "C" __global__ void cache_attention_combine_##SUFFIX(                               \
        T* out, const float* part_o, const float* part_ml, AttnDims d) {                         \
        grid_chain();                                                                            \
        cache_attention_combine<T>(out, part_o, part_ml, d);                                     \
    }                                                                                            \
    ATTN_KERNELS_L(T, SUFFIX, 8)                                                                 \
    ATTN_KERNELS_L(T, SUFFIX, 16)                                                                \
    ATTN_KERNELS_L(T, SUFFIX, 32)                                                                \
    ATTN_WIDE_KERNELS_L(T, SUFFIX, 8)                                                            \
    ATTN_WIDE_KERNELS_L(T, SUFFIX, 16)                                                           \
    ATTN_APPEND_KERNEL(T, SUFFIX, 8, 3)                                                          \
    ATTN_POSITIONS_KERNEL(T, SUFFIX, 64, 2)                                                      \
    ATTN_POSITIONS_KERNEL(T, SUFFIX, 64, 3)                                                      \
    ATTN_POSITIONS_KERNEL(T, SUFFIX, 64, 4)                                                      \
    ATTN_POSITIONS_KERNEL(T, SUFFIX, 64, 8)                                                      \
    ATTN_POSITIONS_KERNEL(T, SUFFIX, 128, 2)                                                     \
    ATTN_POSITIONS_KERNEL(T, SUFFIX, 128, 4)                                                     \
    ATTN_POSITIONS_KERNEL(T, SUFFIX, 128, 8)

// Instantiated by each element type's program (kv_cache.rs): KV_KERNELS(float, f32) etc.
