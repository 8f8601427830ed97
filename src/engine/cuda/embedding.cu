// Token plus position embedding; reference: engine/cpu/embedding.rs.
// The backward is deterministic without sorting or float atomics: a block owns a range of
// vocabulary rows of dwte and adds the gradient rows of the positions holding those tokens in
// position order, which is exactly the CPU's order, so the result matches it bit for bit in
// fp32.

// out[i, :] = wte[tokens[i], :] + wpe[i % seq, :]; one block per token.
template <typename T>
__device__ void embedding_forward(T* out, const unsigned int* tokens, const T* wte, const T* wpe,
                                  int seq, int c, unsigned int vocab) {
    const long long i = blockIdx.x;
    const unsigned int tok = tokens[i];
    T* o = out + i * c;
    const T* pe = wpe + (i % seq) * (long long)c;
    if (tok >= vocab) {  // bad input shows as NaN rather than reading out of bounds
        for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = store<T>(KILN_NAN);
        return;
    }
    const T* te = wte + (long long)tok * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = store<T>(load(te[j]) + load(pe[j]));
}

// dwte[row, :] += dout[i, :] for every i with tokens[i] == row, i ascending. Block b owns
// the `rows` vocabulary rows from b * rows. It reads the tokens a tile at a time; a ballot per
// warp marks the positions whose token the block owns, and every thread walks the marks in
// position order, adding that gradient row into the columns the thread owns. So each element
// of dwte has one writer, which adds in the CPU's order. Owning a range of rows (not one)
// keeps the token reads to vocab / rows passes over the token list.
//
// STAGED: the block's hit rows live in shared memory while it adds (read from dwte first,
// written back at the end; same order, same sums). Text is skewed -- a newline or a comma
// can be a tenth of a batch -- and every hit of a hot row is a read-modify-write after the
// last; in global memory each waits out a memory latency, which made this the slowest op of
// a GPT-2 small step on real text.
#define EMB_MAX_BLOCK 1024
#define EMB_HITS 4

// dst[r * c + j] = src[r * c + j] for the rows r < owned whose bit is set in `row_hit` (the
// staged backward's way in and out of shared memory).
__device__ __forceinline__ void copy_hit_rows(float* dst, const float* src, const unsigned int* row_hit,
                                              unsigned int owned, int c) {
    for (unsigned int r = 0; r < owned; ++r)
        if ((row_hit[r >> 5] >> (r & 31)) & 1u)
            for (int j = threadIdx.x; j < c; j += blockDim.x)
                dst[(long long)r * c + j] = src[(long long)r * c + j];
}

template <typename T, bool STAGED>
__device__ void embedding_backward_wte(float* dwte, const T* dout, const unsigned int* tokens,
                                       int n, int c, unsigned int vocab, unsigned int rows) {
    extern __shared__ float emb_staged[];
    __shared__ unsigned int hit_masks[EMB_MAX_BLOCK / 32];
    __shared__ unsigned int tile_tokens[EMB_MAX_BLOCK];
    const unsigned int first = blockIdx.x * rows;
    const unsigned int owned = min(rows, vocab - first);  // the grid keeps first < vocab
    float* const base = dwte + (long long)first * c;
    // STAGED: which owned rows any token hits (rows <= 64); only those are read into shared
    // memory and written back, so a cold row costs nothing, as in the unstaged kernel.
    __shared__ unsigned int row_hit[2];
    if (STAGED) {
        if (threadIdx.x < 2) row_hit[threadIdx.x] = 0u;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const unsigned int r = tokens[i] - first;
            if (r < owned) atomicOr(&row_hit[r >> 5], 1u << (r & 31));
        }
        __syncthreads();
        copy_hit_rows(emb_staged, base, row_hit, owned, c);
    }
    float* const acc = STAGED ? emb_staged : base;
    const int warps = blockDim.x >> 5;
    for (int tile = 0; tile < n; tile += blockDim.x) {
        const int i = tile + threadIdx.x;
        const unsigned int tok = i < n ? tokens[i] : 0xffffffffu;
        // Unsigned wrap-around makes this first <= tok < first + owned.
        const bool mine = tok - first < owned;
        const unsigned int mask = __ballot_sync(0xffffffffu, mine);
        __syncthreads();  // every thread is done with the previous tile (and the staging)
        if ((threadIdx.x & 31) == 0) hit_masks[threadIdx.x >> 5] = mask;
        tile_tokens[threadIdx.x] = tok;
        __syncthreads();
        for (int w = 0; w < warps; ++w) {
            unsigned int hits = hit_masks[w];
            while (hits) {
                // Up to EMB_HITS hits at once: their gradient rows are loaded together, then
                // added in position order, so the loads' latencies overlap and the sums (and
                // their order per element, even when two hits share a row) do not change.
                int ks[EMB_HITS];
                int count = 0;
                while (hits && count < EMB_HITS) {
                    ks[count++] = w * 32 + __ffs(hits) - 1;
                    hits &= hits - 1;
                }
                for (int j = threadIdx.x; j < c; j += blockDim.x) {
                    float g[EMB_HITS];
#pragma unroll
                    for (int u = 0; u < EMB_HITS; ++u)
                        if (u < count) g[u] = load(dout[(long long)(tile + ks[u]) * c + j]);
#pragma unroll
                    for (int u = 0; u < EMB_HITS; ++u)
                        if (u < count) acc[(long long)(tile_tokens[ks[u]] - first) * c + j] += g[u];
                }
            }
        }
    }
    if (STAGED) {
        __syncthreads();
        copy_hit_rows(base, emb_staged, row_hit, owned, c);
    }
}

// dwpe[p, j] += dout[i, j] for i = p, p + seq, ... < n; one thread per (p, j).
template <typename T>
__device__ void embedding_backward_wpe(float* dwpe, const T* dout, int n, int seq, int c) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const int p = blockIdx.y;
    if (j >= c) return;
    float acc = dwpe[(long long)p * c + j];
    for (long long i = p; i < n; i += seq) acc += load(dout[i * c + j]);
    dwpe[(long long)p * c + j] = acc;
}

#define EMBEDDING_KERNELS(T, SUFFIX)                                                          \
    extern "C" __global__ void embedding_forward_##SUFFIX(T* out, const unsigned int* tokens, \
                                                          const T* wte, const T* wpe, int seq, \
                                                          int c, unsigned int vocab) {         \
        embedding_forward<T>(out, tokens, wte, wpe, seq, c, vocab);                           \
    }                                                                                         \
    extern "C" __global__ void embedding_backward_wte_##SUFFIX(                              \
        float* dwte, const T* dout, const unsigned int* tokens, int n, int c,                 \
        unsigned int vocab, unsigned int rows) {                                              \
        embedding_backward_wte<T, false>(dwte, dout, tokens, n, c, vocab, rows);              \
    }                                                                                         \
    extern "C" __global__ void embedding_backward_wte_staged_##SUFFIX(                       \
        float* dwte, const T* dout, const unsigned int* tokens, int n, int c,                 \
        unsigned int vocab, unsigned int rows) {                                              \
        embedding_backward_wte<T, true>(dwte, dout, tokens, n, c, vocab, rows);               \
    }                                                                                         \
    extern "C" __global__ void embedding_backward_wpe_##SUFFIX(float* dwpe, const T* dout,   \
                                                               int n, int seq, int c) {       \
        embedding_backward_wpe<T>(dwpe, dout, n, seq, c);                                     \
    }

EMBEDDING_KERNELS(float, f32)
EMBEDDING_KERNELS(bf16, bf16)
EMBEDDING_KERNELS(f16, f16)
