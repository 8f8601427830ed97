// Pairwise cosine diversity of sets of embeddings and its gradient; reference:
// engine/cpu/diversity.rs. The Gram matrix is never formed: the upper triangle of U U^T sums
// to (|s|^2 - q) / 2 with s the sum of the normalised rows and q the sum of their squared
// norms, so the forward is one read of the embeddings (norms, then the scaled column sums of
// the same rows from L1/L2) and two small kernels over the partial sums. f32 accumulation;
// |s|^2 and D in f64, where the cancellation of nearly identical rows would cost f32 digits.
// No float atomics: partial sums are added in a fixed order, so a run repeats bit for bit.

#define DIVERSITY_MAX_ROWS 64
#define DIVERSITY_NORM_EPS 1e-12f

// Block (chunk, set): rows [chunk * rows_per_chunk, ...) of one set. Each warp takes rows in
// turn and writes rnorm = 1 / max(|e_i|, eps); then each thread sums its columns of
// e_i * rnorm_i over the chunk into partial[set, chunk, col], and thread 0 writes the chunk's
// sum of |u_i|^2 into q_partial[set, chunk].
template <typename T>
__device__ void diversity_partial(float* partial, float* q_partial, float* rnorm, const T* e,
                                  int n, int d, int rows_per_chunk) {
    __shared__ float row_rnorm[DIVERSITY_MAX_ROWS];
    __shared__ float warp_q[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int chunk = blockIdx.x, set = blockIdx.y, chunks = gridDim.x;
    const int begin = chunk * rows_per_chunk;
    const int rows = min(n, begin + rows_per_chunk) - begin;
    const long long set_row0 = (long long)set * n;
    float q = 0.f;
    for (int r = warp; r < rows; r += warps) {
        const T* row = e + (set_row0 + begin + r) * d;
        float ss = 0.f;
        for (int k = lane; k < d; k += 32) {
            const float v = load(row[k]);
            ss += v * v;
        }
        ss = warp_sum(ss);
        const float norm = sqrtf(ss);
        const float inv = 1.0f / fmaxf(norm, DIVERSITY_NORM_EPS);
        if (lane == 0) {
            row_rnorm[r] = inv;
            rnorm[set_row0 + begin + r] = inv;
            q += (norm * inv) * (norm * inv);
        }
    }
    if (lane == 0) warp_q[warp] = q;
    __syncthreads();
    const long long out = ((long long)set * chunks + chunk) * d;
    for (int col = threadIdx.x; col < d; col += blockDim.x) {
        float acc = 0.f;
        for (int r = 0; r < rows; ++r) {
            acc += load(e[(set_row0 + begin + r) * d + col]) * row_rnorm[r];
        }
        partial[out + col] = acc;
    }
    if (threadIdx.x == 0) {
        float total = 0.f;
        for (int w = 0; w < warps; ++w) total += warp_q[w];
        q_partial[(long long)set * chunks + chunk] = total;
    }
}

// Block (column block, set): s[set, col] = sum over chunks (in order) of the partials, and the
// block's share of |s|^2 in f64 into ss_partial[set, column block].
extern "C" __global__ void diversity_column_sums(float* s, double* ss_partial,
                                                 const float* partial, int d, int chunks) {
    __shared__ double scratch[32];
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    const int set = blockIdx.y;
    double ss = 0.0;
    if (col < d) {
        float acc = 0.f;
        for (int c = 0; c < chunks; ++c) acc += partial[((long long)set * chunks + c) * d + col];
        s[(long long)set * d + col] = acc;
        ss = (double)acc * (double)acc;
    }
    ss = block_sum(ss, scratch);
    if (threadIdx.x == 0) ss_partial[(long long)set * gridDim.x + blockIdx.x] = ss;
}

// One thread per set: D = 1 - (|s|^2 - q) / (n (n - 1)), the partials added in order.
extern "C" __global__ void diversity_value(float* value, const double* ss_partial,
                                           const float* q_partial, int sets, int n,
                                           int col_blocks, int chunks) {
    const int set = blockIdx.x * blockDim.x + threadIdx.x;
    if (set >= sets) return;
    double ss = 0.0, q = 0.0;
    for (int b = 0; b < col_blocks; ++b) ss += ss_partial[(long long)set * col_blocks + b];
    for (int c = 0; c < chunks; ++c) q += q_partial[(long long)set * chunks + c];
    value[set] = (float)(1.0 - (ss - q) / ((double)n * (double)(n - 1)));
}

// One block per row: de_i = dd[set] * scale * rnorm_i * (t - u (u . t)), t = s - u, with the
// projection only for rows that were normalised (norm above eps).
template <typename T>
__device__ void diversity_backward(T* de, const float* dd, const T* e, const float* s,
                                   const float* rnorm, int n, int d, float scale) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const int set = (int)(row / n);
    const T* x = e + row * d;
    const float* sv = s + (long long)set * d;
    const float inv = rnorm[row];
    // A clamped row's rnorm is exactly 1 / eps; any normalised row's is smaller.
    const bool normalised = inv < 1.0f / DIVERSITY_NORM_EPS;
    float ut = 0.f;
    if (normalised) {
        for (int k = threadIdx.x; k < d; k += blockDim.x) {
            const float u = load(x[k]) * inv;
            ut += u * (sv[k] - u);
        }
        ut = block_sum(ut, scratch);
    }
    const float g = dd[set] * scale * inv;
    for (int k = threadIdx.x; k < d; k += blockDim.x) {
        const float u = load(x[k]) * inv;
        de[row * d + k] = store<T>(g * ((sv[k] - u) - u * ut));
    }
}

#define DIVERSITY_KERNELS(T, SUFFIX)                                                            \
    extern "C" __global__ void diversity_partial_##SUFFIX(float* partial, float* q_partial,     \
                                                          float* rnorm, const T* e, int n,       \
                                                          int d, int rows_per_chunk) {           \
        diversity_partial<T>(partial, q_partial, rnorm, e, n, d, rows_per_chunk);               \
    }                                                                                           \
    extern "C" __global__ void diversity_backward_##SUFFIX(T* de, const float* dd, const T* e,  \
                                                           const float* s, const float* rnorm,  \
                                                           int n, int d, float scale) {         \
        diversity_backward<T>(de, dd, e, s, rnorm, n, d, scale);                                \
    }

DIVERSITY_KERNELS(float, f32)
DIVERSITY_KERNELS(bf16, bf16)
DIVERSITY_KERNELS(f16, f16)
