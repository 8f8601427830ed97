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
// token, ascending. Block u owns row rows[u]: each thread keeps one column of the row in a
// register while it adds the row's gradient rows in position order. Work is proportional to
// the tokens, not to the vocabulary times the tokens as when every block scanned the token
// list for its own rows (0.76 ms a step at SmolLM2-135M's 49152 x 16384).
//
// A frequent token's block is the kernel's tail (GPT-2's newline has about 2000 of 16384
// positions in the bundled corpus): its threads walk every position one after the other, so
// their loads must overlap. The block stages EMB_STAGE positions at a time in shared memory
// (a position read from the plan and then the gradient row it names were two latencies in a
// row) and each thread loads EMB_BATCH gradient values before adding any; the sums keep
// position order, so the result is the same.
#define EMB_BATCH 32
#define EMB_STAGE 1024

template <typename T>
__device__ void embedding_backward_rows(float* dwte, const T* dout, const unsigned int* plan,
                                        int unique, int c) {
    __shared__ unsigned int staged[EMB_STAGE];
    const unsigned int* rows = plan;
    const unsigned int* starts = plan + unique;
    const unsigned int* positions = plan + 2 * unique + 1;
    const unsigned int begin = starts[blockIdx.x], end = starts[blockIdx.x + 1];
    float* const dst = dwte + (long long)rows[blockIdx.x] * c;
    // Every thread runs every pass (some without a column), so the barriers are uniform.
    const int passes = (c + blockDim.x - 1) / blockDim.x;
    for (int pass = 0; pass < passes; ++pass) {
        const int j = pass * blockDim.x + threadIdx.x;
        const bool active = j < c;
        float acc = active ? dst[j] : 0.f;
        for (unsigned int k0 = begin; k0 < end; k0 += EMB_STAGE) {
            const int n = (int)min(end - k0, (unsigned int)EMB_STAGE);
            __syncthreads();  // the previous round's positions are read
            for (int i = threadIdx.x; i < n; i += blockDim.x) staged[i] = positions[k0 + i];
            __syncthreads();
            if (!active) continue;
            for (int k = 0; k < n; k += EMB_BATCH) {
                float g[EMB_BATCH];
#pragma unroll
                for (int u = 0; u < EMB_BATCH; ++u)
                    if (k + u < n) g[u] = load(dout[(long long)staged[k + u] * c + j]);
#pragma unroll
                for (int u = 0; u < EMB_BATCH; ++u)
                    if (k + u < n) acc += g[u];
            }
        }
        if (active) dst[j] = acc;
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
