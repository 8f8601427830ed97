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
//   2. sample_histogram (top-k or top-p only): each positive integer weight goes to a histogram
//      by distance below the maximum (counts and weights, summed exactly over the chunks): 256
//      bins of T/64 down to 4 T below the maximum, then bins of T/8 (see value_bin). From the
//      row's histogram the last block finds the value bin
//      that holds the top-k threshold and the bins that may hold the top-p one (top-p's total
//      depends on where top-k cuts inside its bin, so it is bounded from both sides).
//   3. sample_select (top-k or top-p only): the order keys of those bins' tokens are collected
//      as candidates; the last block narrows the exact thresholds among the candidates only
//      (the other bins enter as whole sums) and stores the row's floor. A threshold's value
//      bin is split into 256 value steps, the chosen step's keys into 256 ranges, and so on
//      until one key is left. Where only one of top-k and top-p cuts, its bin is known
//      already: the blocks sum the candidates by step as they collect them, and the last
//      block reads only the keys of one step.
//   4. sample_draw: each block sums the kept weights of its chunk; the last block scans the
//      chunk sums, finds the chunk where the inverse-CDF target falls and walks it in id order.
//      Where stage 3 runs, a row has at most SAMPLE_MERGE_CHUNKS blocks and the call has rows
//      enough (the host's choice, SampleDims::select_draws), stage 3 draws instead and stage
//      4 is not launched: its blocks also sum their chunk's kept weight of
//      the value bins before every threshold's bin (kept whatever the thresholds) and note each
//      candidate's chunk, and its last block adds the candidates at or above the floor to
//      their chunks' sums and walks as stage 4's would.
//
// Tokens of zero weight (more than about 27.7 T below the maximum) never change a weighted sum
// and are never drawn, and they rank below every token of positive weight, so a top-k that
// reaches into them keeps every positive weight: the histograms skip them. Every sum is of
// integers, so no result depends on how the vocabulary is chunked or on the order of atomics,
// and the GPU draws the token the CPU reference draws. The one floating-point sum, stage 1's
// log-sum-exp, is added in a fixed order: each thread takes runs of 8 ids, i0 + 8t .. i0 + 8t +
// 7, then the same 4096 ids further on, and so on (see Sampler::load_batch), then the block
// and the chunks combine theirs in a fixed order.
//
// Each row reads logits row src_row[r] (or r) and the state of slot slot[r] (or r): its
// presence mask, seed and draw counter; it writes the slot's token, log-probability and
// presence bit, advances its position (to at most max_len - 1) and counter. Rows must name
// distinct slots; a row naming a logits row or slot outside the buffers does nothing. The
// scratch (SampleScratch) is allocated once with the slots; its arrival counters start at
// zero and every stage leaves them at zero.

#define SAMPLE_THREADS 512  // blockDim.x of every stage
#define SAMPLE_BINS 256  // value steps of a bin, and key ranges, of sample_select's narrowing
// The value bins of stage 2's histograms: SAMPLE_FINE_BINS of T/64 (4 T), then bins of T/8
// from 4 T to 31.875 T below the maximum, and one for everything further (which weighs
// nothing). Fine bins near the maximum keep the bin of a threshold small where the logits are
// nearly flat (a model's untrained head): with bins of T/8 there, stage 3 took nearly half a
// row's tokens as candidates.
#define SAMPLE_FINE_BINS 256
#define SAMPLE_VALUE_BINS (SAMPLE_FINE_BINS - 32 + 256)
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
// Ids (or candidates) a thread loads before it uses the first of them: see Sampler::load_batch.
#define SAMPLE_BATCH 8
#define SAMPLE_IDS_PER_BATCH (SAMPLE_BATCH * SAMPLE_THREADS)
#define SAMPLE_FULL 0xffffffffu

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
    int select_draws;  // 1: sample_select draws the token (the host chose it; see sampling.rs)
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
    u64 above_p, need_p;  // where top-p cuts alone: the weight above its bin, and its need
};
static_assert(sizeof(RowState) == 72, "RowState is 9 words (ROW_WORDS in sampling.rs)");

// Where only one of top-k and top-p cuts, sample_select reuses `hist` for its bin's sums by
// value step and their keys (see sample_histogram).
struct SampleScratch {
    RowState* rows;              // [slots]
    u64* part;                   // [slots, max_chunks, 2]: a chunk's partial result
    u64* hist;                   // [slots, 2, SAMPLE_VALUE_BINS]: counts, then weights
    unsigned int* cand;          // [slots, vocab]: order keys of sample_select's candidates
    unsigned char* cand_chunk;   // [slots, vocab]: the chunk of each candidate
};

// Calls of at most this many blocks a row may draw in sample_select's last block (a
// candidate's chunk fits a byte); larger ones launch sample_draw (MERGE_CHUNKS in sampling.rs).
#define SAMPLE_MERGE_CHUNKS 255

__device__ __forceinline__ unsigned int order_key(float x) {
    const unsigned int b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// floor(v) for 0 <= v < 2^23 without a conversion instruction (conversions issue at a fraction
// of the rate of adds): v + 2^23 rounded down is 2^23 + floor(v), whose low bits are floor(v).
__device__ __forceinline__ int floor_small(float v) {
    return __float_as_int(__fadd_rd(v, 8388608.f)) - 0x4b000000;
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

// What a row is drawn from: its logits, its presence mask and the settings. A token's logit l
// (penalised) and order key k give x = (l - max) / T, its relative probability e = exp(x)
// (exactly 1 for the maximum itself) and its weight floor(e x 2^40); one division serves the
// weight and the bins.
template <typename T>
struct SampleRow {
    const T* logits;
    const unsigned int* mask;
    SampleParams p;
    float max;             // largest penalised logit
    unsigned int max_key;  // its order key

    __device__ __forceinline__ void set_max(float m) {
        max = m;
        max_key = order_key(m);
    }
    __device__ __forceinline__ float raw(int i) const {
        const float l = load(logits[i]);
        return l != l ? KILN_NEG_INF : l;
    }
    // The presence-mask word of id i, read only when the penalty is on.
    __device__ __forceinline__ unsigned int mask_word(int i) const {
        return p.repetition_penalty != 1.f ? mask[i >> 5] : 0u;
    }
    __device__ __forceinline__ float penalise(int i, float l, unsigned int word) const {
        if (p.repetition_penalty != 1.f && ((word >> (i & 31)) & 1u)) {
            return l > 0.f ? l / p.repetition_penalty : l * p.repetition_penalty;
        }
        return l;
    }
    __device__ __forceinline__ float penalised(int i) const {
        return penalise(i, raw(i), mask_word(i));
    }
    __device__ __forceinline__ float exponent(float l) const { return (l - max) / p.temperature; }
    __device__ __forceinline__ u64 weight(unsigned int k, float x) const {
        if (k == max_key) return (u64)WEIGHT_ONE;
        // exp(-28.5) is less than half of 2^-40, far beyond expf's error: the weight is 0.
        if (x < -28.5f) return 0;
        return (u64)(expf(x) * WEIGHT_ONE);
    }
    // weight(k, x) > 0, with no exponential where it is plain: exp(-27.5) is above 2^-40 by
    // far more than expf's error.
    __device__ __forceinline__ bool positive(unsigned int k, float x) const {
        return k == max_key || x >= -27.5f || weight(k, x) > 0;
    }
    // Value bins below the maximum (0 holds the maximum): bin floor(u) for u = (max - l) / T x
    // 64 below 256, then SAMPLE_FINE_BINS - 32 + floor(z) for z = u / 8 below 255, then the
    // last bin (past 31.875 T: weighs nothing). u and z are -64x and -8x bit for bit (a
    // rounded difference or quotient only changes sign when its operands are swapped or
    // negated; powers of two scale exactly), so the bins never decrease as the key decreases.
    // x = 0 gives bin 0 whether or not the token is the maximum.
    __device__ __forceinline__ int value_bin(unsigned int k, float x) const {
        if (k == max_key) return 0;
        const float u = -x * 64.f;
        if (u < (float)SAMPLE_FINE_BINS) return floor_small(u);
        const float z = -x * 8.f;
        return z < 255.f ? SAMPLE_FINE_BINS - 32 + floor_small(z) : SAMPLE_VALUE_BINS - 1;
    }
    // 256 equal value steps inside value bin `bin` (0 nearest the maximum) for a token of that
    // bin. u - bin (or z - floor(z)) is exact (Sterbenz: b <= v < b + 1 <= 2 b, or b is 0), so
    // the steps split the bin exactly and, like the bins, never decrease as the key decreases.
    __device__ __forceinline__ int value_step(unsigned int k, float x, int bin) const {
        if (k == max_key) return 0;
        const float inside = bin < SAMPLE_FINE_BINS ? -x * 64.f - (float)bin
                                                    : -x * 8.f - (float)(bin - SAMPLE_FINE_BINS + 32);
        return floor_small(fminf(inside * 256.f, 255.f));
    }
    // kept_weight of a token known to lie above the floor (key k, exponent x).
    __device__ __forceinline__ u64 kept_above_floor(unsigned int k, float x) const {
        float e = 1.f;
        if (k != max_key) {
            if (x < -28.5f) return 0;  // weighs nothing, whatever min-p says (see weight)
            e = expf(x);
        }
        if (p.min_p > 0.f && !(e >= p.min_p)) return 0;
        return (u64)(e * WEIGHT_ONE);
    }
    // Kept by the floor and min-p: the weight the walk counts.
    __device__ __forceinline__ u64 kept_weight(float l, unsigned int floor_key) const {
        const unsigned int k = order_key(l);
        return k < floor_key ? 0 : kept_above_floor(k, exponent(l));
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
        row = SampleRow<T>{logits + src * d.stride, presence + (long long)slot * d.words, p, 0.f,
                           0u};
        state = sc.rows + r;
        i0 = min(d.vocab, (int)blockIdx.x * d.chunk_len);
        i1 = min(d.vocab, i0 + d.chunk_len);
        return true;
    }
    __device__ u64* part(int chunk) const {
        return sc.part + ((long long)blockIdx.y * d.max_chunks + chunk) * 2;
    }
    __device__ u64* hist_counts() const { return sc.hist + (long long)blockIdx.y * 2 * SAMPLE_VALUE_BINS; }
    __device__ u64* hist_weights() const { return hist_counts() + SAMPLE_VALUE_BINS; }
    __device__ unsigned int* candidates() const { return sc.cand + (long long)blockIdx.y * d.vocab; }
    __device__ unsigned char* candidate_chunks() const {
        return sc.cand_chunk + (long long)blockIdx.y * d.vocab;
    }
    // sample_select draws the token itself (sample_draw is not launched). The host decides
    // (SampleDims::select_draws); the chunk bound keeps the last block's per-chunk sums in
    // their shared arrays whatever it passes.
    __device__ bool select_draws() const { return d.select_draws != 0 && d.chunks <= SAMPLE_MERGE_CHUNKS; }

    // The block reads its ids in batches of SAMPLE_BATCH (8) a thread: at `start` (i0, then
    // every SAMPLE_IDS_PER_BATCH ids, the same for the whole block) thread t takes the run
    // start + 8t + j for j < 8, those below i1: one 16-byte load in bf16 and f16 (two in f32)
    // where the run is whole and aligned (the host makes chunks multiples of 8 ids), else one
    // load an id. Ids past i1 read -inf.
    __device__ __forceinline__ int batch_id(int start, int j) const {
        return start + (int)threadIdx.x * SAMPLE_BATCH + j;
    }
    // The raw logits of the run at `start` (NaN as -inf; ids past i1 as -inf).
    __device__ __forceinline__ void load_raw(int start, float (&v)[SAMPLE_BATCH]) const {
        const int i = batch_id(start, 0);
        const T* p = row.logits + i;
        if (i + SAMPLE_BATCH <= i1 && ((unsigned long long)p & 15) == 0) {
            load8_at(p, true, v);
#pragma unroll
            for (int j = 0; j < SAMPLE_BATCH; ++j) v[j] = v[j] != v[j] ? KILN_NEG_INF : v[j];
        } else {
#pragma unroll
            for (int j = 0; j < SAMPLE_BATCH; ++j) v[j] = i + j < i1 ? row.raw(i + j) : KILN_NEG_INF;
        }
    }
    // The presence-mask word of the run's first id, and whether the run's ids all lie in it
    // (runs start at multiples of 8 where chunks do); mask_word_at then reads id i's word.
    __device__ __forceinline__ unsigned int run_word(int start, bool& one_word) const {
        const int i = batch_id(start, 0);
        one_word = (i & 31) <= 32 - SAMPLE_BATCH;
        return i < i1 ? row.mask_word(i) : 0u;
    }
    __device__ __forceinline__ unsigned int mask_word_at(int i, unsigned int word, bool one_word) const {
        return one_word ? word : (i < i1 ? row.mask_word(i) : 0u);
    }
    // The run's penalised logits (the stages after the first use only these).
    __device__ __forceinline__ void load_batch(int start, float (&pen)[SAMPLE_BATCH]) const {
        load_raw(start, pen);
        bool one_word;
        const unsigned int word = run_word(start, one_word);
        const int i = batch_id(start, 0);
#pragma unroll
        for (int j = 0; j < SAMPLE_BATCH; ++j) {
            pen[j] = row.penalise(i + j, pen[j], mask_word_at(i + j, word, one_word));
        }
    }

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
// The last block resets the counter for the next stage. As in cooperative groups' grid
// barrier, one thread fences for the block: the barrier orders the other threads' writes
// before its fence and atomic, and its fence after the atomic before their reads.
__device__ bool last_to_arrive(unsigned int* arrivals, int blocks) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(arrivals, 1u) == (unsigned int)blocks - 1;
        if (last) {
            *arrivals = 0;
            __threadfence();
        }
    }
    __syncthreads();
    return last;
}

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(SAMPLE_FULL, v, o);
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
        const u64 n = __shfl_up_sync(SAMPLE_FULL, v, o);
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

// Warp 0 walks the N bins of `hist` (N a multiple of 32) in the given order (ascending: bin 0
// first) and finds the first at which `above` plus the running sum reaches `need`; returns the
// bin to every thread and stores the sum of the bins walked before it (plus `above`) in
// *before.
template <int N>
__device__ int bin_reaching(const u64* hist, bool descending, u64 above, u64 need, u64* before) {
    static_assert(N % 32 == 0, "whole bins a lane");
    __shared__ u64 found[2];
    __syncthreads();
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int per = N / 32;
        u64 local = 0;
        for (int j = 0; j < per; ++j) {
            const int q = lane * per + j;
            local += hist[descending ? N - 1 - q : q];
        }
        const u64 inc = warp_inclusive(local);
        const unsigned int hit = __ballot_sync(SAMPLE_FULL, above + inc >= need);
        // No bin reaches `need` only if the caller's sums disagree; the last bin then.
        const int first = hit ? __ffs(hit) - 1 : 31;
        if (lane == first) {
            u64 cum = above + inc - local;
            int q = lane * per;
            for (int j = 0; j < per; ++j, ++q) {
                const u64 h = hist[descending ? N - 1 - q : q];
                if (cum + h >= need || j == per - 1) break;
                cum += h;
            }
            found[0] = descending ? N - 1 - q : q;
            found[1] = cum;
        }
    }
    __syncthreads();
    *before = found[1];
    const int bin = (int)found[0];
    __syncthreads();
    return bin;
}

// ---- Block histograms: exact 64-bit sums from 32-bit shared atomics ----
//
// A 64-bit shared atomicAdd compiles to a compare-and-swap loop (ATOMS.CAST.SPIN.64), in which
// the lanes that add to one address retry one after another: on nearly flat logits, where most
// of a block's tokens share a bin, those loops took longer than the rest of the stage. Here
// every 64-bit sum is kept as two words, each added with a native 32-bit atomic, which serves
// colliding lanes in turn without retries. (On an H100 this also beat summing a bin's lanes
// across the warp first, by a loop over the warp's bins or by __match_any_sync and reductions:
// their extra instructions cost more than the collisions, even on flat logits.) The sums are
// of integers, so the order of the adds changes no result.

// Per bin of N: tokens, weight (two 32-bit words: see add_split) and, with KEYS, the smallest
// and largest key.
template <int N, bool KEYS>
struct Bins {
    unsigned int count[N];
    unsigned int w_lo[N], w_hi[N];
    unsigned int key_min[KEYS ? N : 1], key_max[KEYS ? N : 1];
};
typedef Bins<SAMPLE_BINS, true> BinSums;              // sample_select's value steps and key ranges
typedef Bins<SAMPLE_VALUE_BINS, false> ValueBins;     // sample_histogram's value bins

template <int N, bool KEYS>
__device__ void clear_bins(Bins<N, KEYS>& h) {
    for (int b = threadIdx.x; b < N; b += blockDim.x) {
        h.count[b] = 0;
        h.w_lo[b] = 0;
        h.w_hi[b] = 0;
        if (KEYS) {
            h.key_min[b] = 0xffffffffu;
            h.key_max[b] = 0;
        }
    }
}

template <int N, bool KEYS>
__device__ __forceinline__ u64 bin_weight(const Bins<N, KEYS>& h, int b) {
    return ((u64)h.w_hi[b] << 32) + h.w_lo[b];
}

// Adds v to the 64-bit sum held as words *lo and *hi: the low word's atomic returns the old
// word, and a wrap-around carries into the high word.
__device__ __forceinline__ void add_split(unsigned int* lo, unsigned int* hi, u64 v) {
    const unsigned int v_lo = (unsigned int)v;
    const unsigned int carry = atomicAdd(lo, v_lo) > 0xffffffffu - v_lo ? 1u : 0u;
    const unsigned int up = (unsigned int)(v >> 32) + carry;
    if (up) atomicAdd(hi, up);
}

// Adds a token of weight w (WEIGHTS) and key k (KEYS) to bin b.
template <bool WEIGHTS, bool KEYS, int N, bool HAS_KEYS>
__device__ __forceinline__ void add_to_bin(Bins<N, HAS_KEYS>& h, int b, u64 w, unsigned int k) {
    static_assert(HAS_KEYS || !KEYS, "these bins keep no keys");
    atomicAdd(&h.count[b], 1u);
    if (WEIGHTS) add_split(&h.w_lo[b], &h.w_hi[b], w);
    if (KEYS) {
        atomicMin(&h.key_min[b], k);
        atomicMax(&h.key_max[b], k);
    }
}

// ---- Stage 1: the maximum and the log-sum-exp ----

template <typename T>
__device__ void sample_max(Sampler<T>& S) {
    __shared__ u64 u_scratch[32];
    __shared__ float f_scratch[32];
    if (!S.open()) return;
    // This thread's first id of the largest penalised key (key 0 is no id's: NaN reads as
    // -inf, so 0 marks a thread without ids), and its raw maximum m with the sum s of
    // exp(raw - m): each run's ids are added in id order after the run's maximum has rescaled
    // the sum (once a run), one exponential an id.
    unsigned int first_k = 0;
    int first_i = 0;
    float m = KILN_NEG_INF, s = 0.f;
    for (int start = S.i0; start < S.i1; start += SAMPLE_IDS_PER_BATCH) {
        float raw[SAMPLE_BATCH];
        S.load_raw(start, raw);
        bool one_word;
        const unsigned int word = S.run_word(start, one_word);
        float run_max = m;
#pragma unroll
        for (int j = 0; j < SAMPLE_BATCH; ++j) {
            const int i = S.batch_id(start, j);
            const float pen = S.row.penalise(i, raw[j], S.mask_word_at(i, word, one_word));
            const unsigned int k = i < S.i1 ? order_key(pen) : 0u;
            if (k > first_k) {
                first_k = k;
                first_i = i;
            }
            run_max = fmaxf(run_max, raw[j]);
        }
        if (run_max > m) {
            s *= expf(m - run_max);
            m = run_max;
        }
        if (m != KILN_NEG_INF) {
#pragma unroll
            for (int j = 0; j < SAMPLE_BATCH; ++j) s += expf(raw[j] - m);
        }
    }
    u64 best = first_k ? ((u64)first_k << 32) | (0xffffffffu - (unsigned int)first_i) : 0ull;
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
    for (int b = threadIdx.x; b < 2 * SAMPLE_VALUE_BINS; b += blockDim.x) hist[b] = 0;
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
    __shared__ ValueBins h;
    __shared__ u64 counts[SAMPLE_VALUE_BINS], weights[SAMPLE_VALUE_BINS];
    __shared__ u64 u_scratch[32];
    if (!S.open() || S.state->done) return;
    S.row.set_max(S.state->max);
    clear_bins(h);
    __syncthreads();
    for (int start = S.i0; start < S.i1; start += SAMPLE_IDS_PER_BATCH) {
        float pen[SAMPLE_BATCH];
        S.load_batch(start, pen);
#pragma unroll
        for (int j = 0; j < SAMPLE_BATCH; ++j) {
            if (S.batch_id(start, j) >= S.i1) break;
            const unsigned int k = order_key(pen[j]);
            const float x = S.row.exponent(pen[j]);
            const u64 w = S.row.weight(k, x);
            if (w > 0) add_to_bin<true, false>(h, S.row.value_bin(k, x), w, 0u);
        }
    }
    __syncthreads();
    u64* g_counts = S.hist_counts();
    u64* g_weights = S.hist_weights();
    for (int b = threadIdx.x; b < SAMPLE_VALUE_BINS; b += blockDim.x) {
        if (h.count[b] == 0) continue;
        atomicAdd(&g_counts[b], (u64)h.count[b]);
        atomicAdd(&g_weights[b], bin_weight(h, b));
    }
    if (!last_to_arrive(&S.state->arrivals, S.d.chunks)) return;

    for (int b = threadIdx.x; b < SAMPLE_VALUE_BINS; b += blockDim.x) {
        counts[b] = __ldcg(g_counts + b);
        weights[b] = __ldcg(g_weights + b);
    }
    u64 n_local = 0, w_local = 0;
    for (int b = threadIdx.x; b < SAMPLE_VALUE_BINS; b += blockDim.x) {
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
        bin_k = bin_reaching<SAMPLE_VALUE_BINS>(counts, false, 0, (u64)S.p.top_k, &above_k);
        u64 before = 0;
        for (int b = threadIdx.x; b < bin_k; b += blockDim.x) before += weights[b];
        w_lo = block_sum(before, u_scratch);
        w_hi = w_lo + weights[bin_k];
    }
    // top-p's total lies in [w_lo, w_hi], so its threshold lies between these bins.
    int p_lo = -1, p_hi = -1;
    const bool top_p = S.p.top_p < 1.f;
    const u64 need_p = top_p_need(S.p.top_p, w_lo);
    u64 above_p = 0, unused;
    if (top_p) {
        p_lo = bin_reaching<SAMPLE_VALUE_BINS>(weights, false, 0, need_p, &above_p);
        p_hi = w_hi == w_lo ? p_lo
                            : bin_reaching<SAMPLE_VALUE_BINS>(weights, false, 0, top_p_need(S.p.top_p, w_hi), &unused);
    }
    if (threadIdx.x == 0) {
        RowState* st = S.state;
        st->bin_k = bin_k;
        st->above_k = above_k;
        st->bin_p_lo = p_lo;
        st->bin_p_hi = p_hi;
    }
    // Where only one of top-k and top-p cuts, sample_select sums its bin by value step into this
    // row's histogram scratch (every read of it above is behind a barrier by now); top-p's need
    // and the weight above its bin wait in the row's state.
    if (bin_k >= 0 ? !top_p : top_p) {
        unsigned int* keys = (unsigned int*)g_weights;
        for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
            g_counts[b] = 0;
            keys[b] = 0xffffffffu;
            keys[SAMPLE_BINS + b] = 0;
        }
        if (threadIdx.x == 0 && bin_k < 0) {
            S.state->above_p = above_p;
            S.state->need_p = need_p;
        }
    }
}

// ---- The inverse-CDF walk in id order (stage 4, or stage 3's last block) ----

// The last block of the row's stage, once every chunk's kept weight is known (in `sums`, in
// shared memory, or else in the chunks' first partials): finds the chunk where the row's target
// falls, walks it in id order and records the drawn token.
template <typename T>
__device__ void walk_and_record(Sampler<T>& S, unsigned int floor_key, const u64* sums) {
    __shared__ u64 u_scratch[32];
    __shared__ int chosen;
    __shared__ int chosen_chunk;
    __shared__ u64 chunk_before;
    __shared__ int run_from, run_to;  // the run of ids where the target falls
    __shared__ u64 run_before;
    auto chunk_sum = [&](int c) { return sums ? sums[c] : __ldcg(S.part(c)); };
    // The chunk where the target falls, from the chunks' sums in id order.
    u64 sum = 0;
    for (int c = threadIdx.x; c < S.d.chunks; c += blockDim.x) sum += chunk_sum(c);
    const u64 total = block_sum(sum, u_scratch);
    const u64 bits = hash3(S.seeds[S.slot], SAMPLE_STREAM, S.counters[S.slot]);
    const u64 target = __umul64hi(bits, total);
    const int best_i = (int)(0xffffffffu - (unsigned int)(S.state->best & 0xffffffffu));
    if (threadIdx.x == 0) {
        chosen = best_i;
        chosen_chunk = -1;
        chunk_before = 0;
        run_from = 0;
        run_to = 0;
        run_before = 0;
    }
    u64 running = 0;
    for (int base = 0; base < S.d.chunks; base += blockDim.x) {
        const int c = base + threadIdx.x;
        const u64 v = c < S.d.chunks ? chunk_sum(c) : 0ull;
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
        for (int i = j0; i < j1; i += SAMPLE_BATCH) {
            float pen[SAMPLE_BATCH];
#pragma unroll
            for (int q = 0; q < SAMPLE_BATCH; ++q) pen[q] = i + q < j1 ? S.row.penalised(i + q) : 0.f;
#pragma unroll
            for (int q = 0; q < SAMPLE_BATCH; ++q) {
                if (i + q < j1) mine += S.row.kept_weight(pen[q], floor_key);
            }
        }
        u64 chunk_total;
        const u64 before = chunk_before + block_exclusive(mine, u_scratch, &chunk_total);
        if (mine > 0 && before <= target && target < before + mine) {
            run_from = j0;
            run_to = j1;
            run_before = before;
        }
        __syncthreads();
        // Warp 0 walks that run 32 ids at a time: the first id whose running sum passes the
        // target.
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            u64 cum = run_before;
            for (int from = run_from; from < run_to; from += 32) {
                const int i = from + lane;
                const u64 w = i < run_to ? S.row.kept_weight(S.row.penalised(i), floor_key) : 0ull;
                const u64 inc = cum + warp_inclusive(w);
                const unsigned int hit = __ballot_sync(SAMPLE_FULL, inc > target);
                if (hit) {
                    if (lane == __ffs(hit) - 1) chosen = i;
                    break;
                }
                cum = __shfl_sync(SAMPLE_FULL, inc, 31);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) S.record(chosen, S.state->lse);
}

// ---- Stage 3: candidates of the threshold bins, and the exact thresholds among them ----
//
// Where only one of top-k and top-p cuts, the value bin of its threshold is known before this
// stage (top-p's total is then the whole weight), and every block also sums the candidates by
// value step into the row's histogram scratch: per step the count (top-k) or the weight
// (top-p) in the counts' words, the smallest and largest key in the weights'. The last block
// then takes the step where the threshold falls and narrows among that step's keys only.
// Where both cut, top-p's bin depends on top-k's threshold, and the last block splits both
// bins by value step itself, over all the candidates.

#define SAMPLE_LIST 2048  // keys the last block keeps in shared memory while it narrows

// Shared memory of sample_select.
struct SelectScratch {
    BinSums bins;
    u64 crit[SAMPLE_BINS];  // per bin, what the threshold counts: tokens or weight
    u64 sum[32];
    unsigned int list[SAMPLE_LIST];  // the keys between the bounds of a narrowing pass
    unsigned int listed;
};

// Copies the candidates' keys in [lo, hi] to s.list (the first SAMPLE_LIST of them; s.listed
// counts them all), reading 16 bytes at a time where the row's candidates are aligned to them.
__device__ void gather_keys(const unsigned int* cand, unsigned int n, unsigned int lo,
                            unsigned int hi, SelectScratch& s) {
    const int lane = threadIdx.x & 31;
    if (threadIdx.x == 0) s.listed = 0;
    __syncthreads();
    const bool quads = ((unsigned long long)cand & 15) == 0;
    const unsigned int n4 = quads ? n / 4 : 0;  // keys [0, 4 n4) are read 4 at a time
    // Reads q < n4 are quads, the n - 4 n4 after them single keys.
    for (unsigned int start = 0; start < n - 3 * n4; start += 4 * SAMPLE_THREADS) {
        unsigned int key[16];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned int q = start + threadIdx.x + j * SAMPLE_THREADS;
            if (q < n4) {
                const uint4 v = __ldcg(reinterpret_cast<const uint4*>(cand) + q);
                key[4 * j] = v.x;
                key[4 * j + 1] = v.y;
                key[4 * j + 2] = v.z;
                key[4 * j + 3] = v.w;
            } else {
                const unsigned int c = 3 * n4 + q;
                key[4 * j] = c < n ? __ldcg(cand + c) : 0u;
                key[4 * j + 1] = key[4 * j + 2] = key[4 * j + 3] = 0u;
            }
        }
        // Key 0 (a NaN) is no candidate's and lies below every lo.
        unsigned int mine = 0;
#pragma unroll
        for (int j = 0; j < 16; ++j) mine += key[j] - lo <= hi - lo ? 1u : 0u;
        if (__ballot_sync(SAMPLE_FULL, mine != 0) == 0) continue;
        unsigned int inc = mine;
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned int v = __shfl_up_sync(SAMPLE_FULL, inc, o);
            if (lane >= o) inc += v;
        }
        unsigned int at = 0;
        if (lane == 31) at = atomicAdd(&s.listed, inc);
        at = __shfl_sync(SAMPLE_FULL, at, 31) + inc - mine;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            if (key[j] - lo <= hi - lo) {
                if (at < SAMPLE_LIST) s.list[at] = key[j];
                ++at;
            }
        }
    }
    __syncthreads();
}

// One narrowing pass over n keys (in shared memory, or the candidates in global memory). A
// pass `by_value` puts the keys of value bin `bin` that are >= min_key into its value steps;
// another puts the keys in [lo, hi] into ranges of 2^shift keys. value_bin and value_step
// never decrease as the key decreases, so every key between two keys of one step is of that
// step: a range of keys needs no other test.
template <bool WEIGHTS, bool SHARED, typename T>
__device__ void narrow_pass(const SampleRow<T>& row, const unsigned int* keys, unsigned int n,
                            bool by_value, int bin, unsigned int min_key, unsigned int lo,
                            unsigned int hi, int shift, SelectScratch& s) {
    for (unsigned int start = 0; start < n; start += SAMPLE_IDS_PER_BATCH) {
        unsigned int key[SAMPLE_BATCH];
#pragma unroll
        for (int j = 0; j < SAMPLE_BATCH; ++j) {
            const unsigned int c = start + threadIdx.x + j * SAMPLE_THREADS;
            // Key 0 (a NaN) pads the last batch: every candidate weighs something.
            key[j] = c < n ? (SHARED ? keys[c] : __ldcg(keys + c)) : 0u;
        }
#pragma unroll
        for (int j = 0; j < SAMPLE_BATCH; ++j) {
            const unsigned int k = key[j];
            if (by_value) {
                if (k == 0 || k < min_key) continue;
                const float x = row.exponent(key_value(k));
                if (row.value_bin(k, x) != bin) continue;
                add_to_bin<WEIGHTS, true>(s.bins, row.value_step(k, x, bin),
                                          WEIGHTS ? row.weight(k, x) : 0ull, k);
            } else if (lo <= k && k <= hi) {
                add_to_bin<WEIGHTS, true>(s.bins, (int)((k - lo) >> shift),
                                          WEIGHTS ? row.weight(k, row.exponent(key_value(k))) : 0ull, k);
            }
        }
    }
}

// The largest key v such that `above` plus the candidates counted with key >= v reach `need`,
// counting each as 1 (by_weight false) or its weight. Counted are the candidates of value bin
// `bin` with key >= min_key where `by_value` (the first pass then splits the bin by value
// step), else those with key in [lo, hi] (lo < hi, all of one step). Each pass bins what is
// left of them and keeps the bin where `need` is reached, down to its smallest and largest key,
// until one key is left. Where `kept` is given it gets the weight of the counted candidates
// with key >= v.
template <typename T>
__device__ unsigned int narrow(const SampleRow<T>& row, const unsigned int* cand, unsigned int n,
                               bool by_value, int bin, unsigned int min_key, unsigned int lo,
                               unsigned int hi, bool by_weight, u64 above, u64 need,
                               SelectScratch& s, u64* kept) {
    const bool weights = by_weight || kept != nullptr;
    u64 kept_above = 0;  // weight of the steps and ranges above the chosen ones
    // Before the first pass over a range of keys, its keys are copied to s.list, and the
    // passes read them there; where they don't fit, once the range holds few enough.
    bool listed = false, try_list = true;
    unsigned int m = 0;
    for (;; by_value = false) {
        if (!by_value && !listed && try_list) {
            __syncthreads();  // the last pass's readers of s are done
            gather_keys(cand, n, lo, hi, s);
            m = s.listed;
            listed = m <= SAMPLE_LIST;
            try_list = false;
        }
        // Ranges of 2^shift keys: the 256th reaches past hi.
        const int shift = by_value ? 0 : max(0, 24 - __clz(hi - lo));
        __syncthreads();  // the last pass's readers of s are done
        clear_bins(s.bins);
        __syncthreads();
        if (listed) {
            if (weights) {
                narrow_pass<true, true>(row, s.list, m, false, bin, min_key, lo, hi, shift, s);
            } else {
                narrow_pass<false, true>(row, s.list, m, false, bin, min_key, lo, hi, shift, s);
            }
        } else if (weights) {
            narrow_pass<true, false>(row, cand, n, by_value, bin, min_key, lo, hi, shift, s);
        } else {
            narrow_pass<false, false>(row, cand, n, by_value, bin, min_key, lo, hi, shift, s);
        }
        __syncthreads();
        for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
            s.crit[b] = by_weight ? bin_weight(s.bins, b) : (u64)s.bins.count[b];
        }
        // From the largest keys down: value steps ascend, key ranges descend.
        u64 before;
        const int b = bin_reaching<SAMPLE_BINS>(s.crit, !by_value, above, need, &before);
        if (kept) {
            u64 w = 0;
            for (int q = threadIdx.x; q < SAMPLE_BINS; q += blockDim.x) {
                if (by_value ? q < b : q > b) w += bin_weight(s.bins, q);
            }
            kept_above += block_sum(w, s.sum);
        }
        above = before;
        lo = s.bins.key_min[b];
        hi = s.bins.key_max[b];
        try_list = s.bins.count[b] <= SAMPLE_LIST;
        // One key left (or, only if the sums disagreed, none).
        if (lo >= hi) {
            if (kept) *kept = kept_above + bin_weight(s.bins, b);
            return lo;
        }
    }
}

template <typename T>
__device__ void sample_select(Sampler<T>& S) {
    __shared__ SelectScratch sel;
    __shared__ u64 weights[SAMPLE_VALUE_BINS];
    if (!S.open() || S.state->done) return;
    S.row.set_max(S.state->max);
    const int bin_k = S.state->bin_k, p_lo = S.state->bin_p_lo, p_hi = S.state->bin_p_hi;
    const bool top_p = S.p.top_p < 1.f;
    // The value bin of the only threshold: top-k's, or top-p's without top-k; -1 where both
    // cut or neither does.
    const int lone = bin_k >= 0 ? (top_p ? -1 : bin_k) : p_lo;
    const bool by_weight = bin_k < 0;  // the lone threshold is top-p's
    unsigned int* cand = S.candidates();
    u64* g_steps = S.hist_counts();
    unsigned int* g_key_min = (unsigned int*)S.hist_weights();
    unsigned int* g_key_max = g_key_min + SAMPLE_BINS;
    const bool draws = S.select_draws();
    // Tokens of the value bins before every threshold's bin are kept whatever the thresholds
    // turn out to be: where this stage draws, each block sums their kept weight for its chunk.
    const int kept_below = min(bin_k >= 0 ? bin_k : SAMPLE_VALUE_BINS, p_lo >= 0 ? p_lo : SAMPLE_VALUE_BINS);
    u64 kept = 0;
    if (bin_k >= 0 || p_lo >= 0 || draws) {
        if (lone >= 0) {
            clear_bins(sel.bins);
            __syncthreads();
        }
        unsigned char* cand_chunk = S.candidate_chunks();
        const int lane = threadIdx.x & 31;
        for (int start = S.i0; start < S.i1; start += SAMPLE_IDS_PER_BATCH) {
            float pen[SAMPLE_BATCH];
            S.load_batch(start, pen);
            unsigned int take = 0;  // bit j: the batch's id j is a candidate
#pragma unroll
            for (int j = 0; j < SAMPLE_BATCH; ++j) {
                if (S.batch_id(start, j) >= S.i1) break;
                const unsigned int k = order_key(pen[j]);
                const float x = S.row.exponent(pen[j]);
                const int b = S.row.value_bin(k, x);
                if (draws && b < kept_below) kept += S.row.kept_above_floor(k, x);
                if (!(b == bin_k || (p_lo <= b && b <= p_hi)) || !S.row.positive(k, x)) continue;
                take |= 1u << j;
                if (lone < 0) continue;
                const int step = S.row.value_step(k, x, b);
                if (by_weight) {
                    add_to_bin<true, true>(sel.bins, step, S.row.weight(k, x), k);
                } else {
                    add_to_bin<false, true>(sel.bins, step, 0, k);
                }
            }
            // Whole warps run every batch, so a warp's candidates of a batch take one atomic.
            const unsigned int mine = __popc(take);
            unsigned int inc = mine;
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned int v = __shfl_up_sync(SAMPLE_FULL, inc, o);
                if (lane >= o) inc += v;
            }
            const unsigned int total = __shfl_sync(SAMPLE_FULL, inc, 31);
            if (total == 0) continue;
            unsigned int at = 0;
            if (lane == 31) at = atomicAdd(&S.state->candidates, total);
            at = __shfl_sync(SAMPLE_FULL, at, 31) + inc - mine;
#pragma unroll
            for (int j = 0; j < SAMPLE_BATCH; ++j) {
                if ((take >> j) & 1u) {
                    if (draws) cand_chunk[at] = (unsigned char)blockIdx.x;
                    cand[at++] = order_key(pen[j]);
                }
            }
        }
        if (lone >= 0) {
            __syncthreads();
            for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) {
                if (sel.bins.count[b] == 0) continue;
                atomicAdd(&g_steps[b], by_weight ? bin_weight(sel.bins, b) : (u64)sel.bins.count[b]);
                atomicMin(&g_key_min[b], sel.bins.key_min[b]);
                atomicMax(&g_key_max[b], sel.bins.key_max[b]);
            }
        }
    }
    if (draws) {
        kept = block_sum(kept, sel.sum);
        if (threadIdx.x == 0) S.part(blockIdx.x)[0] = kept;
    }
    if (!last_to_arrive(&S.state->arrivals, S.d.chunks)) return;

    const unsigned int n = __ldcg(&S.state->candidates);
    unsigned int floor_key = 0;
    if (lone >= 0) {
        u64 above, need;
        if (by_weight) {
            above = __ldcg(&S.state->above_p);
            need = __ldcg(&S.state->need_p);
        } else {
            above = S.state->above_k;
            need = (u64)S.p.top_k;
        }
        for (int b = threadIdx.x; b < SAMPLE_BINS; b += blockDim.x) sel.crit[b] = __ldcg(g_steps + b);
        const int step = bin_reaching<SAMPLE_BINS>(sel.crit, false, above, need, &above);
        const unsigned int lo = __ldcg(g_key_min + step), hi = __ldcg(g_key_max + step);
        floor_key = lo < hi ? narrow(S.row, cand, n, false, lone, 0u, lo, hi, by_weight, above, need,
                                     sel, nullptr)
                            : lo;
    } else if (bin_k >= 0) {
        // Both cut: top-k's threshold, and the weight it keeps in bin_k.
        const u64* g_weights = S.hist_weights();
        for (int b = threadIdx.x; b < SAMPLE_VALUE_BINS; b += blockDim.x) weights[b] = __ldcg(g_weights + b);
        u64 inside;
        floor_key = narrow(S.row, cand, n, true, bin_k, 0u, 0u, 0u, false, S.state->above_k,
                           (u64)S.p.top_k, sel, &inside);
        // Top-k keeps the bins before bin_k whole and bin_k from its threshold up.
        u64 before = 0;
        for (int b = threadIdx.x; b < bin_k; b += blockDim.x) before += weights[b];
        const u64 kept = block_sum(before, sel.sum) + inside;
        for (int b = threadIdx.x; b < SAMPLE_VALUE_BINS; b += blockDim.x) {
            if (b == bin_k) weights[b] = inside;
            if (b > bin_k) weights[b] = 0;
        }
        const u64 need = top_p_need(S.p.top_p, kept);
        u64 above;
        const int bin_p = bin_reaching<SAMPLE_VALUE_BINS>(weights, false, 0, need, &above);
        const unsigned int k =
            narrow(S.row, cand, n, true, bin_p, floor_key, 0u, 0u, true, above, need, sel, nullptr);
        floor_key = max(floor_key, k);
    }
    if (!draws) {
        if (threadIdx.x == 0) S.state->floor_key = floor_key;
        return;
    }
    // Each chunk's kept weight: its blocks' sum of the bins before the thresholds', and its
    // candidates at or above the floor (each 64-bit sum as two 32-bit words: see add_split).
    __shared__ unsigned int chunk_lo[SAMPLE_MERGE_CHUNKS], chunk_hi[SAMPLE_MERGE_CHUNKS];
    __shared__ u64 chunk_kept[SAMPLE_MERGE_CHUNKS];
    const int chunks = S.d.chunks;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        const u64 v = __ldcg(S.part(c));
        chunk_lo[c] = (unsigned int)v;
        chunk_hi[c] = (unsigned int)(v >> 32);
    }
    __syncthreads();
    const unsigned char* cand_chunk = S.candidate_chunks();
    for (unsigned int q = threadIdx.x; q < n; q += blockDim.x) {
        const unsigned int k = __ldcg(cand + q);
        if (k < floor_key) continue;
        const int c = __ldcg(cand_chunk + q);
        add_split(&chunk_lo[c], &chunk_hi[c], S.row.kept_weight(key_value(k), floor_key));
    }
    __syncthreads();
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) chunk_kept[c] = ((u64)chunk_hi[c] << 32) + chunk_lo[c];
    __syncthreads();
    walk_and_record(S, floor_key, chunk_kept);
}

// ---- Stage 4: each chunk's kept weight, then the walk ----
//
// Launched where no threshold cuts (stage 3 did not run) or where a row has more blocks than
// sample_select draws for (SAMPLE_MERGE_CHUNKS).

template <typename T>
__device__ void sample_draw(Sampler<T>& S) {
    __shared__ u64 u_scratch[32];
    if (!S.open() || S.state->done) return;
    S.row.set_max(S.state->max);
    const unsigned int floor_key = S.state->floor_key;
    u64 local = 0;
    for (int start = S.i0; start < S.i1; start += SAMPLE_IDS_PER_BATCH) {
        float pen[SAMPLE_BATCH];
        S.load_batch(start, pen);
#pragma unroll
        for (int j = 0; j < SAMPLE_BATCH; ++j) {
            if (S.batch_id(start, j) < S.i1) local += S.row.kept_weight(pen[j], floor_key);
        }
    }
    local = block_sum(local, u_scratch);
    if (threadIdx.x == 0) S.part(blockIdx.x)[0] = local;
    if (!last_to_arrive(&S.state->arrivals, S.d.chunks)) return;
    walk_and_record(S, floor_key, nullptr);
}

// Blocks of a stage an SM holds at once (four of 512 threads fill it): __launch_bounds__ caps
// the registers per thread to fit them, at no spill.
#define sample_max_blocks 4
#define sample_histogram_blocks 4
#define sample_select_blocks 3
#define sample_draw_blocks 3

#define SAMPLE_STAGE(STAGE, T, SUFFIX)                                                          \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, STAGE##_blocks) STAGE##_##SUFFIX( \
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
