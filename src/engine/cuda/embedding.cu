// Token plus position embedding; reference: engine/cpu/embedding.rs.
// The backward is deterministic without float atomics: the host lists the positions of each
// hit token in position order, and one block per hit row of dwte adds those gradient rows in
// that order, which is exactly the CPU's order, so the result matches it bit for bit in fp32.

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

// dwte[row, :] += dout[i, :] for every i with tokens[i] == row, i ascending. The host's plan
// lists the hit rows (rows[u], `unique` of them), where each row's positions start in
// `positions` (starts[u] .. starts[u + 1]) and the positions, sorted by token and, within a
// token, ascending. Block u owns row rows[u]: each thread keeps its columns of the row in
// registers while it adds the row's gradient rows, EMB_BATCH loaded at a time so their
// latencies overlap (the sums stay in position order). Work is proportional to the tokens,
// not to the vocabulary times the tokens as when every block scanned the token list for
// its own rows (0.76 ms a step at SmolLM2-135M's 49152 x 16384).
#define EMB_BATCH 16

template <typename T>
__device__ void embedding_backward_rows(float* dwte, const T* dout, const unsigned int* plan,
                                        int unique, int c) {
    const unsigned int* rows = plan;
    const unsigned int* starts = plan + unique;
    const unsigned int* positions = plan + 2 * unique + 1;
    const unsigned int begin = starts[blockIdx.x], end = starts[blockIdx.x + 1];
    float* const dst = dwte + (long long)rows[blockIdx.x] * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) {
        float acc = dst[j];
        for (unsigned int k = begin; k < end; k += EMB_BATCH) {
            float g[EMB_BATCH];
#pragma unroll
            for (int u = 0; u < EMB_BATCH; ++u)
                if (k + u < end) g[u] = load(dout[(long long)positions[k + u] * c + j]);
#pragma unroll
            for (int u = 0; u < EMB_BATCH; ++u)
                if (k + u < end) acc += g[u];
        }
        dst[j] = acc;
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
    extern "C" __global__ void embedding_backward_rows_##SUFFIX(                             \
        float* dwte, const T* dout, const unsigned int* plan, int unique, int c) {            \
        embedding_backward_rows<T>(dwte, dout, plan, unique, c);                              \
    }                                                                                         \
    extern "C" __global__ void embedding_backward_wpe_##SUFFIX(float* dwpe, const T* dout,   \
                                                               int n, int seq, int c) {       \
        embedding_backward_wpe<T>(dwpe, dout, n, seq, c);                                     \
    }

EMBEDDING_KERNELS(float, f32)
EMBEDDING_KERNELS(bf16, bf16)
EMBEDDING_KERNELS(f16, f16)
