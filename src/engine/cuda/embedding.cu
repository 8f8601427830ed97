// Token plus position embedding; reference: engine/cpu/embedding.rs.
// The backward is deterministic without sorting or float atomics: a block owns one vocabulary
// row of dwte and adds the gradient rows of the positions holding that token in position
// order, which is exactly the CPU's order, so the result matches it bit for bit in fp32.

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

// dwte[row, :] += dout[i, :] for every i with tokens[i] == row, i ascending. One block per
// vocabulary row; every warp scans the tokens 32 at a time (the same ballot in each warp),
// then each thread updates the columns it owns.
template <typename T>
__device__ void embedding_backward_wte(float* dwte, const T* dout, const unsigned int* tokens,
                                       int n, int c) {
    const unsigned int row = blockIdx.x;
    const int lane = threadIdx.x & 31;
    float* dst = dwte + (long long)row * c;
    for (int base = 0; base < n; base += 32) {
        const int i = base + lane;
        unsigned int hits = __ballot_sync(0xffffffffu, i < n && tokens[i] == row);
        while (hits) {
            const int pos = base + __ffs(hits) - 1;
            hits &= hits - 1;
            const T* src = dout + (long long)pos * c;
            for (int j = threadIdx.x; j < c; j += blockDim.x) dst[j] += load(src[j]);
        }
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
        float* dwte, const T* dout, const unsigned int* tokens, int n, int c) {               \
        embedding_backward_wte<T>(dwte, dout, tokens, n, c);                                  \
    }                                                                                         \
    extern "C" __global__ void embedding_backward_wpe_##SUFFIX(float* dwpe, const T* dout,   \
                                                               int n, int seq, int c) {       \
        embedding_backward_wpe<T>(dwpe, dout, n, seq, c);                                     \
    }

EMBEDDING_KERNELS(float, f32)
EMBEDDING_KERNELS(bf16, bf16)
