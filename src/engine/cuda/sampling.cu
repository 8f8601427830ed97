// One token drawn per row of logits; reference: engine/cpu/sampling.rs, whose module comment
// states the rules this kernel follows (penalty, greedy, integer weights, top-k / top-p / min-p
// as thresholds on an order key, the inverse-CDF walk in id order).
//
// One block of SAMPLE_THREADS per row. No sort: a threshold "the largest key v at which the
// entries with key >= v reach `need`" (top-k counts, top-p weights) is found by narrowing a
// key range with 256-bin histograms. The first round bins by distance below the maximum in
// units of T/8 (keys' top bits would crowd nearly every logit into two or three bins and
// serialise the shared atomics); each later round splits the remaining key range 256 ways,
// so at most four more rounds reach a single key. Weights are integers, so the histograms'
// atomic sums are exact and the result does not depend on the order threads add.
//
// Each row reads logits row src_row[r] (or r) and the state of slot slot[r] (or r): its
// presence mask, seed and draw counter; it writes the slot's token, log-probability and
// presence bit, advances its position (to at most max_len - 1) and counter. Rows must name
// distinct slots; a row naming a logits row or slot outside the buffers does nothing.

#define SAMPLE_THREADS 1024
#define SAMPLE_BINS 256
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)

typedef unsigned long long u64;

struct SampleParams {
    float temperature;
    unsigned int top_k;
    float top_p;
    float min_p;
    float repetition_penalty;
};

struct SampleDims {
    long long stride;  // elements between logits rows
    int vocab;
    int words;  // presence mask words per slot
    unsigned int max_len;
    unsigned int logit_rows;  // rows of `logits`
    unsigned int slots;
};

__device__ __forceinline__ unsigned int order_key(float x) {
    const unsigned int b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// SplitMix64's finaliser and engine/rng.rs's hash3.
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 hash3(u64 seed, u64 stream, u64 counter) {
    const u64 a = mix64(seed ^ 0x9e3779b97f4a7c15ull);
    const u64 b = mix64(a ^ (stream * 0xd6e8feb86659fd93ull));
    return mix64(b ^ (counter * 0xa0761d6478bd642full));
}

#define SAMPLE_STREAM 3ull
#define WEIGHT_ONE 1099511627776.0f  // 2^40

// What a row is drawn from: its logits, its presence mask and the settings.
template <typename T>
struct SampleRow {
    const T* logits;
    const unsigned int* mask;
    SampleParams p;
    float max;  // largest penalised logit

    __device__ __forceinline__ float raw(int i) const {
        const float l = load(logits[i]);
        return l != l ? KILN_NEG_INF : l;
    }
    __device__ __forceinline__ float penalised(int i) const {
        const float l = raw(i);
        if (p.repetition_penalty != 1.f && ((mask[i >> 5] >> (i & 31)) & 1u)) {
            return l > 0.f ? l / p.repetition_penalty : l * p.repetition_penalty;
        }
        return l;
    }
    __device__ __forceinline__ float relative(float l) const {
        return order_key(l) == order_key(max) ? 1.f : expf((l - max) / p.temperature);
    }
    __device__ __forceinline__ u64 weight(float l) const {
        return (u64)(relative(l) * WEIGHT_ONE);
    }
    // Bins of T/8 below the maximum (0 holds the maximum; 255 everything past 32 T).
    __device__ __forceinline__ int value_bin(float l) const {
        if (order_key(l) == order_key(max)) return 0;
        const float z = (max - l) / p.temperature * 8.f;
        return z < 255.f ? (int)z : 255;
    }
};

// Inclusive prefix sum over a warp.
__device__ __forceinline__ u64 warp_inclusive(u64 v) {
    const int lane = threadIdx.x & 31;
    for (int o = 1; o < 32; o <<= 1) {
        const u64 n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    return v;
}

// Exclusive prefix sum over the block (thread order); `total` gets the block's sum.
__device__ u64 block_exclusive(u64 v, u64* scratch, u64* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 inc = warp_inclusive(v);
    __syncthreads();
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        const u64 w = warp_inclusive(lane < SAMPLE_WARPS ? scratch[lane] : 0ull);
        __syncwarp();
        if (lane < SAMPLE_WARPS) scratch[lane] = w;
    }
    __syncthreads();
    *total = scratch[SAMPLE_WARPS - 1];
    return (warp > 0 ? scratch[warp - 1] : 0ull) + inc - v;
}

// Warp 0 walks the bins in the given order (ascending: bin 0 first) and finds the first at
// which `above` plus the running sum reaches `need`; stores the bin and the sum of the bins
// walked before it (plus `above`) into out[0], out[1]. The whole block calls it.
__device__ void find_bin(const u64* hist, bool descending, u64 above, u64 need, u64* out) {
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int per = SAMPLE_BINS / 32;
        u64 local = 0;
        for (int j = 0; j < per; ++j) {
            const int q = lane * per + j;
            local += hist[descending ? SAMPLE_BINS - 1 - q : q];
        }
        const u64 inc = warp_inclusive(local);
        const unsigned int hit = __ballot_sync(0xffffffffu, above + inc >= need);
        // No bin reaches `need` only if the caller's sums disagree; the last bin then.
        const int first = hit ? __ffs(hit) - 1 : 31;
        if (lane == first) {
            u64 cum = above + inc - local;
            int q = lane * per;
            for (int j = 0; j < per; ++j, ++q) {
                const u64 h = hist[descending ? SAMPLE_BINS - 1 - q : q];
                if (cum + h >= need || j == per - 1) break;
                cum += h;
            }
            out[0] = descending ? SAMPLE_BINS - 1 - q : q;
            out[1] = cum;
        }
    }
    __syncthreads();
}

// The largest key v such that the entries with key >= floor_key and key >= v add up to at
// least `need`, counting each entry as 1 (by_weight false) or its weight.
template <typename T>
__device__ unsigned int select_key(const SampleRow<T>& row, int V, unsigned int floor_key,
                                   bool by_weight, u64 need, u64* hist, u64* found,
                                   unsigned int* range) {
    for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float l = row.penalised(i);
        if (order_key(l) < floor_key) continue;
        atomicAdd(&hist[row.value_bin(l)], by_weight ? row.weight(l) : 1ull);
    }
    find_bin(hist, false, 0, need, found);
    const int bin = (int)found[0];
    u64 above = found[1];

    // The key range of the chosen value bin.
    if (threadIdx.x == 0) {
        range[0] = 0xffffffffu;
        range[1] = 0;
    }
    __syncthreads();
    unsigned int lo = 0xffffffffu, hi = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float l = row.penalised(i);
        const unsigned int k = order_key(l);
        if (k < floor_key || row.value_bin(l) != bin) continue;
        lo = min(lo, k);
        hi = max(hi, k);
    }
    lo = __reduce_min_sync(0xffffffffu, lo);
    hi = __reduce_max_sync(0xffffffffu, hi);
    if ((threadIdx.x & 31) == 0) {
        atomicMin(&range[0], lo);
        atomicMax(&range[1], hi);
    }
    __syncthreads();
    lo = range[0];
    hi = range[1];

    while (lo < hi) {
        const unsigned int width = (hi - lo) / SAMPLE_BINS + 1;
        for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float l = row.penalised(i);
            const unsigned int k = order_key(l);
            if (k < lo || k > hi) continue;
            atomicAdd(&hist[(k - lo) / width], by_weight ? row.weight(l) : 1ull);
        }
        find_bin(hist, true, above, need, found);
        const unsigned int b = (unsigned int)found[0];
        above = found[1];
        const unsigned int new_lo = lo + b * width;
        hi = min(hi, new_lo + (width - 1));
        lo = new_lo;
    }
    return lo;
}

template <typename T>
__device__ void sample_rows(const T* logits, const unsigned int* src_row,
                            const unsigned int* slot_of, unsigned int* tokens, unsigned int* pos,
                            float* logprobs, const u64* seeds, u64* counters,
                            unsigned int* presence, SampleDims d, SampleParams p) {
    __shared__ u64 hist[SAMPLE_BINS];
    __shared__ u64 scratch[32];
    __shared__ u64 found[2];
    __shared__ unsigned int range[2];
    __shared__ float f_scratch[32];
    __shared__ int chosen;

    const int r = blockIdx.x;
    const long long src = src_row ? src_row[r] : r;
    const unsigned int s = slot_of ? slot_of[r] : (unsigned int)r;
    // A row naming a logits row or slot outside the buffers draws nothing.
    if (src >= d.logit_rows || s >= d.slots) return;
    const int V = d.vocab;
    SampleRow<T> row{logits + src * d.stride, presence + (long long)s * d.words, p, 0.f};

    // The penalised maximum (first index among ties) and the raw log-sum-exp.
    u64 best = 0;
    float m_raw = KILN_NEG_INF, s_raw = 0.f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const u64 packed = ((u64)order_key(row.penalised(i)) << 32) | (0xffffffffu - (unsigned)i);
        best = packed > best ? packed : best;
        const float x = row.raw(i);
        if (x == KILN_NEG_INF) continue;
        if (x > m_raw) {
            s_raw = s_raw * expf(m_raw - x) + 1.f;
            m_raw = x;
        } else {
            s_raw += expf(x - m_raw);
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x < 32) {
        u64 v = threadIdx.x < SAMPLE_WARPS ? scratch[threadIdx.x] : 0ull;
        for (int o = 16; o > 0; o >>= 1) {
            const u64 other = __shfl_xor_sync(0xffffffffu, v, o);
            v = other > v ? other : v;
        }
        if (threadIdx.x == 0) found[0] = v;
    }
    const float M_raw = block_max(m_raw, f_scratch);
    const float S_raw =
        block_sum(m_raw == KILN_NEG_INF ? 0.f : s_raw * expf(m_raw - M_raw), f_scratch);
    best = found[0];
    const int best_i = (int)(0xffffffffu - (unsigned int)(best & 0xffffffffu));
    row.max = key_value((unsigned int)(best >> 32));

    const u64 bits = hash3(seeds[s], SAMPLE_STREAM, counters[s]);
    int token = best_i;
    if (p.temperature > 0.f && row.max != KILN_NEG_INF) {
        unsigned int floor_key = 0;
        if (p.top_k > 0 && p.top_k < (unsigned int)V) {
            floor_key = select_key(row, V, 0u, false, (u64)p.top_k, hist, found, range);
        }
        if (p.top_p < 1.f) {
            u64 kept = 0;
            for (int i = threadIdx.x; i < V; i += blockDim.x) {
                const float l = row.penalised(i);
                if (order_key(l) >= floor_key) kept += row.weight(l);
            }
            u64 total;
            block_exclusive(kept, scratch, &total);
            const u64 need = min((u64)ceil((double)p.top_p * (double)total), total);
            const unsigned int k = select_key(row, V, floor_key, true, need, hist, found, range);
            floor_key = max(floor_key, k);
        }
        // The inverse-CDF walk in id order: each thread owns a contiguous run of ids.
        const int per = (V + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
        const int i0 = min(V, (int)threadIdx.x * per), i1 = min(V, i0 + per);
        u64 local = 0;
        for (int i = i0; i < i1; ++i) {
            const float l = row.penalised(i);
            if (order_key(l) < floor_key) continue;
            const float e = row.relative(l);
            if (p.min_p > 0.f && !(e >= p.min_p)) continue;
            local += (u64)(e * WEIGHT_ONE);
        }
        u64 total;
        const u64 before = block_exclusive(local, scratch, &total);
        const u64 target = __umul64hi(bits, total);
        if (threadIdx.x == 0) chosen = best_i;
        __syncthreads();
        if (local > 0 && before <= target && target < before + local) {
            u64 cum = before;
            for (int i = i0; i < i1; ++i) {
                const float l = row.penalised(i);
                if (order_key(l) < floor_key) continue;
                const float e = row.relative(l);
                if (p.min_p > 0.f && !(e >= p.min_p)) continue;
                cum += (u64)(e * WEIGHT_ONE);
                if (cum > target) {
                    chosen = i;
                    break;
                }
            }
        }
        __syncthreads();
        token = chosen;
    }
    if (threadIdx.x == 0) {
        tokens[s] = (unsigned int)token;
        logprobs[s] = row.raw(token) - (M_raw + logf(S_raw));
        const unsigned int next = pos[s] + 1;
        pos[s] = d.max_len == 0 ? 0 : min(next, d.max_len - 1);
        counters[s] += 1;
        presence[(long long)s * d.words + (token >> 5)] |= 1u << (token & 31);
    }
}

#define SAMPLE_KERNEL(T, SUFFIX)                                                                \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows_##SUFFIX(         \
        const T* logits, const unsigned int* src_row, const unsigned int* slot_of,             \
        unsigned int* tokens, unsigned int* pos, float* logprobs, const u64* seeds,            \
        u64* counters, unsigned int* presence, SampleDims d, SampleParams p) {                 \
        sample_rows<T>(logits, src_row, slot_of, tokens, pos, logprobs, seeds, counters,       \
                       presence, d, p);                                                        \
    }

SAMPLE_KERNEL(float, f32)
SAMPLE_KERNEL(bf16, bf16)
SAMPLE_KERNEL(f16, f16)
