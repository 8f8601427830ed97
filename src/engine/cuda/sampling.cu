// One token drawn per row of logits; reference: engine/cpu/sampling.rs, whose module comment
// states the rules this kernel follows (penalty, greedy, integer weights, top-k / top-p / min-p
// as thresholds on an order key, the inverse-CDF walk in id order).
//
// Each row is split over `chunks` blocks (grid: chunks x rows), so that a single row at batch 1
// still spreads over the GPU. A draw runs in up to four stages, one launch each; in every
// stage each block reads its chunk of the vocabulary and writes a partial result, and the
// last block of the row to finish (an arrival counter per row, behind a memory fence) combines
// the partials and prepares the next stage:
//
//   1. sample_max: the penalised maximum (first index among ties) and the raw log-sum-exp.
//      Greedy rows (and rows with nothing to sample) are drawn here and marked done.
//   2. sample_histogram (top-k or top-p only): each positive integer weight goes to a 256-bin
//      histogram by distance below the maximum in units of T/8 (counts and weights, summed
//      exactly over the chunks). From the row's histogram the last block finds the value bin
//      that holds the top-k threshold and the bins that may hold the top-p one (top-p's total
//      depends on where top-k cuts inside its bin, so it is bounded from both sides).
//   3. sample_select (top-k or top-p only): tokens of those bins are collected as candidates;
//      the last block narrows the exact thresholds among the candidates only (the other bins
//      enter as whole sums), with key-range histograms as before, and stores the row's floor.
//   4. sample_draw: each block sums the kept weights of its chunk; the last block scans the
//      chunk sums, finds the chunk where the inverse-CDF target falls and walks it in id order.
//
// Tokens of zero weight (more than about 27.7 T below the maximum) never change a weighted sum
// and are never drawn, and they rank below every token of positive weight, so a top-k that
// reaches into them keeps every positive weight: the histograms skip them. Every sum is of
// integers, so no result depends on how the vocabulary is chunked or on the order of atomics,
// and the GPU draws the token the CPU reference draws.
//
// Each row reads logits row src_row[r] (or r) and the state of slot slot[r] (or r): its
// presence mask, seed and draw counter; it writes the slot's token, log-probability and
// presence bit, advances its position (to at most max_len - 1) and counter. Rows must name
// distinct slots; a row naming a logits row or slot outside the buffers does nothing. The
// scratch (SampleScratch) is allocated once with the slots; its arrival counters start at
// zero and every stage leaves them at zero.

#define SAMPLE_THREADS 512
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
    int chunks;      // blocks per row in this call
    int chunk_len;   // ids per block (the last block's run may be shorter)
    int max_chunks;  // partials per row in the scratch
};

// What the stages of one row pass to each other.
struct RowState {
    u64 best;     // packed (order key, ~index) of the penalised maximum
    u64 above_k;  // positive-weight tokens in the value bins before bin_k
    float max;    // the penalised maximum
    float lse;    // log-sum-exp of the raw logits
    unsigned int done;        // the row's token is drawn already
    unsigned int arrivals;    // blocks of the running stage that are through their chunk
    unsigned int candidates;  // tokens collected by sample_select
    unsigned int floor_key;   // tokens with a smaller key are not kept
    int bin_k;                // value bin of the top-k threshold; -1: top-k keeps all
    int bin_p_lo, bin_p_hi;   // value bins that may hold the top-p threshold; -1: no top-p
    int unused;
};
static_assert(sizeof(RowState) == 56, "RowState is 7 words (SAMPLE_ROW_WORDS in sampling.rs)");

struct SampleScratch {
    RowState* rows;       // [slots]
    u64* part;            // [slots, max_chunks, 2]: a chunk's partial result
    u64* hist;            // [slots, 2, SAMPLE_BINS]: counts, then weights
    unsigned int* cand;   // [slots, vocab]: candidate token ids
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

// `ceil(top_p x total)`, at most `total`: cpu::sampling::top_p_need.
__device__ __forceinline__ u64 top_p_need(float top_p, u64 total) {
    const u64 need = (u64)ceil((double)top_p * (double)total);
    return need < total ? need : total;
}

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
    // Bins of T/8 below the maximum (0 holds the maximum; 255 everything past 32 T, which
    // weighs nothing).
    __device__ __forceinline__ int value_bin(float l) const {
        if (order_key(l) == order_key(max)) return 0;
        const float z = (max - l) / p.temperature * 8.f;
        return z < 255.f ? (int)z : 255;
    }
    // Kept by the floor and min-p: the weight the walk counts.
    __device__ __forceinline__ u64 kept_weight(int i, unsigned int floor_key) const {
        const float l = penalised(i);
        if (order_key(l) < floor_key) return 0;
        const float e = relative(l);
        if (p.min_p > 0.f && !(e >= p.min_p)) return 0;
        return (u64)(e * WEIGHT_ONE);
    }
};

// Everything a stage reads and writes; `open` places block (chunk, row) on its row.
template <typename T>
struct Sampler {
    const T* logits;
    const unsigned int* src_row;
    const unsigned int* slot_of;
    unsigned int* tokens;
    unsigned int* pos;
    float* logprobs;
    const u64* seeds;
    u64* counters;
    unsigned int* presence;
    SampleDims d;
    SampleParams p;
    SampleScratch sc;

    SampleRow<T> row;
    unsigned int slot;
    RowState* state;
    int i0, i1;  // this block's ids

    // False when the row names a logits row or slot outside the buffers (it draws nothing).
    __device__ bool open() {
        const unsigned int r = blockIdx.y;
        const long long src = src_row ? src_row[r] : r;
        slot = slot_of ? slot_of[r] : r;
        if (src >= d.logit_rows || slot >= d.slots) return false;
        row = SampleRow<T>{logits + src * d.stride, presence + (long long)slot * d.words, p, 0.f};
        state = sc.rows + r;
        i0 = min(d.vocab, (int)blockIdx.x * d.chunk_len);
        i1 = min(d.vocab, i0 + d.chunk_len);
        return true;
    }
    __device__ u64* part(int chunk) const {
        return sc.part + ((long long)blockIdx.y * d.max_chunks + chunk) * 2;
    }
    __device__ u64* hist_counts() const { return sc.hist + (long long)blockIdx.y * 2 * SAMPLE_BINS; }
    __device__ u64* hist_weights() const { return hist_counts() + SAMPLE_BINS; }
    __device__ unsigned int* candidates() const { return sc.cand + (long long)blockIdx.y * d.vocab; }

    // The slot's draw (thread 0): token, log-probability, position, counter, presence bit.
    __device__ void record(int token, float lse) const {
        tokens[slot] = (unsigned int)token;
        logprobs[slot] = row.raw(token) - lse;
        const unsigned int next = pos[slot] + 1;
        pos[slot] = d.max_len == 0 ? 0 : min(next, d.max_len - 1);
        counters[slot] += 1;
        presence[(long long)slot * d.words + (token >> 5)] |= 1u << (token & 31);
    }
};

// Called by every block of a row once its partial results are written: true in the last
// block to arrive, which then sees the others' writes (read them with __ldcg, past the L1).
// The last block resets the counter for the next stage.
__device__ bool last_to_arrive(unsigned int* arrivals, int blocks) {
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(arrivals, 1u) == (unsigned int)blocks - 1;
        if (last) *arrivals = 0;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, v, o);
        v = other > v ? other : v;
    }
    return v;
}

__device__ u64 block_max_u64(u64 v, u64* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max_u64(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max_u64(lane < SAMPLE_WARPS ? scratch[lane] : 0ull);
}

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

// Warp 0 walks the bins of `hist` in the given order (ascending: bin 0 first) and finds the
// first at which `above` plus the running sum reaches `need`; returns the bin to every thread
// and stores the sum of the bins walked before it (plus `above`) in *before.
__device__ int bin_reaching(const u64* hist, bool descending, u64 above, u64 need, u64* before) {
    __shared__ u64 found[2];
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
            found[0] = descending ? SAMPLE_BINS - 1 - q : q;
            found[1] = cum;
        }
    }
    __syncthreads();
    *before = found[1];
    const int bin = (int)found[0];
    __syncthreads();
    return bin;
}

// ---- Stage 1: the maximum and the log-sum-exp ----

template <typename T>
__device__ void sample_max(Sampler<T>& S) {
    __shared__ u64 u_scratch[32];
    __shared__ float f_scratch[32];
    if (!S.open()) return;
    u64 best = 0;
    float m = KILN_NEG_INF, s = 0.f;
    for (int i = S.i0 + threadIdx.x; i < S.i1; i += blockDim.x) {
        const u64 packed =
            ((u64)order_key(S.row.penalised(i)) << 32) | (0xffffffffu - (unsigned int)i);
        best = packed > best ? packed : best;
        const float x = S.row.raw(i);
        if (x == KILN_NEG_INF) continue;
        if (x > m) {
            s = s * expf(m - x) + 1.f;
            m = x;
        } else {
            s += expf(x - m);
        }
    }
    best = block_max_u64(best, u_scratch);
    float M = block_max(m, f_scratch);
    float sum = block_sum(m == KILN_NEG_INF ? 0.f : s * expf(m - M), f_scratch);
    if (threadIdx.x == 0) {
        u64* part = S.part(blockIdx.x);
        part[0] = best;
        part[1] = ((u64)__float_as_uint(sum) << 32) | __float_as_uint(M);
    }
    if (!last_to_arrive(&S.state->arrivals, S.d.chunks)) return;

    // Combine the chunks: the packed maximum, and (max, sum) pairs of the log-sum-exp.
    best = 0;
    m = KILN_NEG_INF;
    s = 0.f;
    for (int c = threadIdx.x; c < S.d.chunks; c += blockDim.x) {
        const u64* part = S.part(c);
        const u64 b = __ldcg(part), ms = __ldcg(part + 1);
        best = b > best ? b : best;
        const float pm = __uint_as_float((unsigned int)ms), ps = __uint_as_float((unsigned int)(ms >> 32));
        if (pm == KILN_NEG_INF) continue;
        if (pm > m) {
            s = s * expf(m - pm) + ps;
            m = pm;
        } else {
            s += ps * expf(pm - m);
        }
    }
    best = block_max_u64(best, u_scratch);
    M = block_max(m, f_scratch);
    sum = block_sum(m == KILN_NEG_INF ? 0.f : s * expf(m - M), f_scratch);
    const int best_i = (int)(0xffffffffu - (unsigned int)(best & 0xffffffffu));
    const float max = key_value((unsigned int)(best >> 32));
    const float lse = M + logf(sum);
    // The histograms of stage 2 start from zero.
    u64* hist = S.hist_counts();
    for (int b = threadIdx.x; b < 2 * SAMPLE_BINS; b += blockDim.x) hist[b] = 0;
    if (threadIdx.x == 0) {
        RowState* st = S.state;
        st->best = best;
        st->max = max;
        st->lse = lse;
        st->candidates = 0;
        st->floor_key = 0;
        st->bin_k = -1;
        st->bin_p_lo = -1;
        st->bin_p_hi = -1;
        st->above_k = 0;
        const bool greedy = S.p.temperature == 0.f || max == KILN_NEG_INF;
        st->done = greedy ? 1u : 0u;
        if (greedy) S.record(best_i, lse);
    }
}

// ---- Stage 2: histograms of positive weights by distance below the maximum ----

template <typename T>
__device__ void sample_histogram(Sampler<T>& S) {
    __shared__ u64 counts[SAMPLE_BINS], weights[SAMPLE_BINS];
    __shared__ u64 u_scratch[32];
    if (!S.open() || S.state->done) return;
    S.row.max = S.state->max;
    for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
        counts[b] = 0;
        weights[b] = 0;
    }
    __syncthreads();
    for (int i = S.i0 + threadIdx.x; i < S.i1; i += blockDim.x) {
        const float l = S.row.penalised(i);
        const u64 w = S.row.weight(l);
        if (w == 0) continue;
        const int b = S.row.value_bin(l);
        atomicAdd(&counts[b], 1ull);
        atomicAdd(&weights[b], w);
    }
    __syncthreads();
    u64* g_counts = S.hist_counts();
    u64* g_weights = S.hist_weights();
    for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
        if (counts[b] == 0) continue;
        atomicAdd(&g_counts[b], counts[b]);
        atomicAdd(&g_weights[b], weights[b]);
    }
    if (!last_to_arrive(&S.state->arrivals, S.d.chunks)) return;

    for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
        counts[b] = __ldcg(g_counts + b);
        weights[b] = __ldcg(g_weights + b);
    }
    u64 n_local = 0, w_local = 0;
    for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
        n_local += counts[b];
        w_local += weights[b];
    }
    const u64 positive = block_sum(n_local, u_scratch);
    const u64 total = block_sum(w_local, u_scratch);
    // top-k cuts only when fewer than all positive weights are asked for.
    int bin_k = -1;
    u64 above_k = 0, w_lo = total, w_hi = total;
    const bool top_k = S.p.top_k > 0 && S.p.top_k < (unsigned int)S.d.vocab;
    if (top_k && (u64)S.p.top_k < positive) {
        bin_k = bin_reaching(counts, false, 0, (u64)S.p.top_k, &above_k);
        u64 before = 0;
        for (int b = threadIdx.x; b < bin_k; b += blockDim.x) before += weights[b];
        w_lo = block_sum(before, u_scratch);
        w_hi = w_lo + weights[bin_k];
    }
    // top-p's total lies in [w_lo, w_hi], so its threshold lies between these bins.
    int p_lo = -1, p_hi = -1;
    if (S.p.top_p < 1.f) {
        u64 unused;
        p_lo = bin_reaching(weights, false, 0, top_p_need(S.p.top_p, w_lo), &unused);
        p_hi = bin_reaching(weights, false, 0, top_p_need(S.p.top_p, w_hi), &unused);
    }
    if (threadIdx.x == 0) {
        RowState* st = S.state;
        st->bin_k = bin_k;
        st->above_k = above_k;
        st->bin_p_lo = p_lo;
        st->bin_p_hi = p_hi;
    }
}

// ---- Stage 3: candidates of the threshold bins, and the exact thresholds among them ----

// The largest key v such that `above` plus the candidates of value bin `bin` with key >= v
// (and >= min_key) reach `need`, counting each as 1 (by_weight false) or its weight.
template <typename T>
__device__ unsigned int select_key(const SampleRow<T>& row, const unsigned int* cand,
                                   unsigned int n, int bin, unsigned int min_key, bool by_weight,
                                   u64 above, u64 need, u64* hist) {
    __shared__ unsigned int range[2];
    __syncthreads();  // the previous call's readers of `range` are done
    if (threadIdx.x == 0) {
        range[0] = 0xffffffffu;
        range[1] = 0;
    }
    __syncthreads();
    unsigned int lo = 0xffffffffu, hi = 0;
    for (unsigned int j = threadIdx.x; j < n; j += blockDim.x) {
        const float l = row.penalised((int)__ldcg(cand + j));
        const unsigned int k = order_key(l);
        if (k < min_key || row.value_bin(l) != bin) continue;
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
        for (unsigned int j = threadIdx.x; j < n; j += blockDim.x) {
            const float l = row.penalised((int)__ldcg(cand + j));
            const unsigned int k = order_key(l);
            if (k < lo || k > hi || k < min_key || row.value_bin(l) != bin) continue;
            atomicAdd(&hist[(k - lo) / width], by_weight ? row.weight(l) : 1ull);
        }
        const unsigned int b = (unsigned int)bin_reaching(hist, true, above, need, &above);
        const unsigned int new_lo = lo + b * width;
        hi = (unsigned int)min((u64)hi, (u64)new_lo + width - 1);
        lo = new_lo;
    }
    return lo;
}

template <typename T>
__device__ void sample_select(Sampler<T>& S) {
    __shared__ u64 counts[SAMPLE_BINS], weights[SAMPLE_BINS];
    __shared__ u64 u_scratch[32];
    if (!S.open() || S.state->done) return;
    S.row.max = S.state->max;
    const int bin_k = S.state->bin_k, p_lo = S.state->bin_p_lo, p_hi = S.state->bin_p_hi;
    unsigned int* cand = S.candidates();
    if (bin_k >= 0 || p_lo >= 0) {
        const int lane = threadIdx.x & 31;
        // Whole warps run every iteration, so the warp's candidates take one atomic.
        for (int base = S.i0; base < S.i1; base += blockDim.x) {
            const int i = base + threadIdx.x;
            bool take = false;
            if (i < S.i1) {
                const float l = S.row.penalised(i);
                if (S.row.weight(l) > 0) {
                    const int b = S.row.value_bin(l);
                    take = b == bin_k || (p_lo <= b && b <= p_hi);
                }
            }
            const unsigned int mask = __ballot_sync(0xffffffffu, take);
            if (mask == 0) continue;
            const int leader = __ffs(mask) - 1;
            unsigned int at = 0;
            if (lane == leader) at = atomicAdd(&S.state->candidates, (unsigned int)__popc(mask));
            at = __shfl_sync(0xffffffffu, at, leader);
            if (take) cand[at + __popc(mask & ((1u << lane) - 1u))] = (unsigned int)i;
        }
    }
    if (!last_to_arrive(&S.state->arrivals, S.d.chunks)) return;

    const unsigned int n = __ldcg(&S.state->candidates);
    const u64* g_weights = S.hist_weights();
    for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) weights[b] = __ldcg(g_weights + b);
    unsigned int floor_key = 0;
    if (bin_k >= 0) {
        floor_key = select_key(S.row, cand, n, bin_k, 0u, false, S.state->above_k,
                               (u64)S.p.top_k, counts);
    }
    if (S.p.top_p < 1.f) {
        u64 kept;
        if (bin_k >= 0) {
            // Top-k keeps the bins before bin_k whole and bin_k from its threshold up.
            u64 before = 0, inside = 0;
            for (int b = threadIdx.x; b < bin_k; b += blockDim.x) before += weights[b];
            for (unsigned int j = threadIdx.x; j < n; j += blockDim.x) {
                const float l = S.row.penalised((int)__ldcg(cand + j));
                if (S.row.value_bin(l) == bin_k && order_key(l) >= floor_key) {
                    inside += S.row.weight(l);
                }
            }
            before = block_sum(before, u_scratch);
            inside = block_sum(inside, u_scratch);
            kept = before + inside;
            for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
                if (b == bin_k) weights[b] = inside;
                if (b > bin_k) weights[b] = 0;
            }
        } else {
            u64 local = 0;
            for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) local += weights[b];
            kept = block_sum(local, u_scratch);
        }
        const u64 need = top_p_need(S.p.top_p, kept);
        u64 above;
        const int bin_p = bin_reaching(weights, false, 0, need, &above);
        const unsigned int k =
            select_key(S.row, cand, n, bin_p, floor_key, true, above, need, counts);
        floor_key = max(floor_key, k);
    }
    if (threadIdx.x == 0) S.state->floor_key = floor_key;
}

// ---- Stage 4: the inverse-CDF walk in id order ----

template <typename T>
__device__ void sample_draw(Sampler<T>& S) {
    __shared__ u64 u_scratch[32];
    __shared__ int chosen;
    __shared__ int chosen_chunk;
    __shared__ u64 chunk_before;
    if (!S.open() || S.state->done) return;
    S.row.max = S.state->max;
    const unsigned int floor_key = S.state->floor_key;
    u64 local = 0;
    for (int i = S.i0 + threadIdx.x; i < S.i1; i += blockDim.x) {
        local += S.row.kept_weight(i, floor_key);
    }
    local = block_sum(local, u_scratch);
    if (threadIdx.x == 0) S.part(blockIdx.x)[0] = local;
    if (!last_to_arrive(&S.state->arrivals, S.d.chunks)) return;

    // The chunk where the target falls, from the chunks' sums in id order.
    u64 sum = 0;
    for (int c = threadIdx.x; c < S.d.chunks; c += blockDim.x) sum += __ldcg(S.part(c));
    const u64 total = block_sum(sum, u_scratch);
    const u64 bits = hash3(S.seeds[S.slot], SAMPLE_STREAM, S.counters[S.slot]);
    const u64 target = __umul64hi(bits, total);
    const int best_i = (int)(0xffffffffu - (unsigned int)(S.state->best & 0xffffffffu));
    if (threadIdx.x == 0) {
        chosen = best_i;
        chosen_chunk = -1;
        chunk_before = 0;
    }
    u64 running = 0;
    for (int base = 0; base < S.d.chunks; base += blockDim.x) {
        const int c = base + threadIdx.x;
        const u64 v = c < S.d.chunks ? __ldcg(S.part(c)) : 0ull;
        u64 tile;
        const u64 before = running + block_exclusive(v, u_scratch, &tile);
        if (v > 0 && before <= target && target < before + v) {
            chosen_chunk = c;
            chunk_before = before;
        }
        running += tile;
    }
    __syncthreads();
    const int c = chosen_chunk;
    if (c >= 0) {
        // Each thread owns a contiguous run of the chunk's ids.
        const int c0 = min(S.d.vocab, c * S.d.chunk_len), c1 = min(S.d.vocab, c0 + S.d.chunk_len);
        const int per = (c1 - c0 + (int)blockDim.x - 1) / (int)blockDim.x;
        const int j0 = min(c1, c0 + (int)threadIdx.x * per), j1 = min(c1, j0 + per);
        u64 mine = 0;
        for (int i = j0; i < j1; ++i) mine += S.row.kept_weight(i, floor_key);
        u64 chunk_total;
        const u64 before = chunk_before + block_exclusive(mine, u_scratch, &chunk_total);
        if (mine > 0 && before <= target && target < before + mine) {
            u64 cum = before;
            for (int i = j0; i < j1; ++i) {
                cum += S.row.kept_weight(i, floor_key);
                if (cum > target) {
                    chosen = i;
                    break;
                }
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) S.record(chosen, S.state->lse);
}

#define SAMPLE_STAGE(STAGE, T, SUFFIX)                                                          \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) STAGE##_##SUFFIX(             \
        const T* logits, const unsigned int* src_row, const unsigned int* slot_of,             \
        unsigned int* tokens, unsigned int* pos, float* logprobs, const u64* seeds,            \
        u64* counters, unsigned int* presence, SampleDims d, SampleParams p,                   \
        SampleScratch sc) {                                                                    \
        Sampler<T> S{logits, src_row, slot_of, tokens, pos, logprobs, seeds, counters,         \
                     presence, d, p, sc};                                                      \
        STAGE<T>(S);                                                                           \
    }

#define SAMPLE_KERNELS(T, SUFFIX)             \
    SAMPLE_STAGE(sample_max, T, SUFFIX)       \
    SAMPLE_STAGE(sample_histogram, T, SUFFIX) \
    SAMPLE_STAGE(sample_select, T, SUFFIX)    \
    SAMPLE_STAGE(sample_draw, T, SUFFIX)

SAMPLE_KERNELS(float, f32)
SAMPLE_KERNELS(bf16, bf16)
SAMPLE_KERNELS(f16, f16)

// ---- The rows of a decode step over some of the slots ----
//
// row_tokens[i] = tokens[slot[i]] and row_pos[i] = pos[slot[i]]: the inputs of a step that
// runs only the live slots. A slot outside the state gives u32::MAX for both, which every
// kernel of the step treats as a row outside the cache. Reference: cpu::sampling's
// gather_slot_rows.
extern "C" __global__ void gather_slot_rows(const unsigned int* slot, const unsigned int* tokens,
                                            const unsigned int* pos, unsigned int* row_tokens,
                                            unsigned int* row_pos, unsigned int rows,
                                            unsigned int slots) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows) return;
    const unsigned int s = slot[i];
    row_tokens[i] = s < slots ? tokens[s] : 0xffffffffu;
    row_pos[i] = s < slots ? pos[s] : 0xffffffffu;
}
