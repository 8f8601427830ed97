// Layer normalisation with the residual add fused in; reference: engine/cpu/layernorm.rs.
// One block per row. Mean and variance are two passes over the row (as on the CPU), which
// keeps fp32 accuracy for rows with a large mean; the second pass hits L1/L2.

// eps is an argument: GPT-2 uses 1e-5, BERT-family encoders 1e-12.

template <typename T, bool RESIDUAL>
__device__ void layernorm_forward(T* sum, T* out, float* mean, float* rstd, const T* x,
                                  const T* delta, const T* gamma, const T* beta, int c, float eps) {
    __shared__ float scratch[32];
    const long long off = (long long)blockIdx.x * c;
    float acc = 0.f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        float s = load(x[off + i]);
        if (RESIDUAL) {
            // The stored sum is what the next layer and the backward read; normalise that
            // (rounded) value, so forward and backward agree in bf16.
            const T stored = store<T>(s + load(delta[off + i]));
            sum[off + i] = stored;
            s = load(stored);
        }
        acc += s;
    }
    const T* src = RESIDUAL ? sum : x;
    const float mu = block_sum(acc, scratch) / c;
    float var = 0.f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float d = load(src[off + i]) - mu;
        var += d * d;
    }
    const float r = 1.0f / sqrtf(block_sum(var, scratch) / c + eps);
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        out[off + i] = store<T>((load(src[off + i]) - mu) * r * load(gamma[i]) + load(beta[i]));
    }
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = mu;
        rstd[blockIdx.x] = r;
    }
}

// dinp += rstd * (g*dy - mean(g*dy) - xhat * mean(g*dy*xhat)); one block per row.
template <typename T>
__device__ void layernorm_backward_input(T* dinp, const T* dout, const T* inp, const T* gamma,
                                         const float* mean, const float* rstd, int c) {
    __shared__ float scratch[32];
    const long long off = (long long)blockIdx.x * c;
    const float m = mean[blockIdx.x], r = rstd[blockIdx.x];
    float sum_gdy = 0.f, sum_gdy_xhat = 0.f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float gdy = load(gamma[i]) * load(dout[off + i]);
        sum_gdy += gdy;
        sum_gdy_xhat += gdy * (load(inp[off + i]) - m) * r;
    }
    const float mean_gdy = block_sum(sum_gdy, scratch) / c;
    const float mean_gdy_xhat = block_sum(sum_gdy_xhat, scratch) / c;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float xhat = (load(inp[off + i]) - m) * r;
        const float gdy = load(gamma[i]) * load(dout[off + i]);
        dinp[off + i] = store<T>(load(dinp[off + i]) + r * (gdy - mean_gdy - xhat * mean_gdy_xhat));
    }
}

// Parameter gradients, first stage: block (x, y) sums columns [x*blockDim, ...) over the rows
// of chunk y into partial_gamma/partial_beta[y, col]. reduce.cu's accumulate_partials adds
// the chunks in order, so the result does not depend on scheduling.
template <typename T>
__device__ void layernorm_param_grad_partial(float* partial_gamma, float* partial_beta,
                                             const T* dout, const T* inp, const float* mean,
                                             const float* rstd, int n, int c, int rows_per_chunk) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= c) return;
    const int begin = blockIdx.y * rows_per_chunk;
    const int end = min(n, begin + rows_per_chunk);
    float dg = 0.f, db = 0.f;
    for (int row = begin; row < end; ++row) {
        const long long i = (long long)row * c + col;
        const float dy = load(dout[i]);
        dg += dy * (load(inp[i]) - mean[row]) * rstd[row];
        db += dy;
    }
    partial_gamma[(long long)blockIdx.y * c + col] = dg;
    partial_beta[(long long)blockIdx.y * c + col] = db;
}

#define LAYERNORM_KERNELS(T, SUFFIX)                                                             \
    extern "C" __global__ void layernorm_forward_##SUFFIX(                                     \
        T* out, float* mean, float* rstd, const T* x, const T* gamma, const T* beta, int c,    \
        float eps) {                                                                             \
        layernorm_forward<T, false>(nullptr, out, mean, rstd, x, nullptr, gamma, beta, c, eps);\
    }                                                                                            \
    extern "C" __global__ void residual_layernorm_forward_##SUFFIX(                            \
        T* sum, T* out, float* mean, float* rstd, const T* x, const T* delta, const T* gamma,  \
        const T* beta, int c, float eps) {                                                       \
        layernorm_forward<T, true>(sum, out, mean, rstd, x, delta, gamma, beta, c, eps);       \
    }                                                                                            \
    extern "C" __global__ void layernorm_backward_input_##SUFFIX(                              \
        T* dinp, const T* dout, const T* inp, const T* gamma, const float* mean,               \
        const float* rstd, int c) {                                                             \
        layernorm_backward_input<T>(dinp, dout, inp, gamma, mean, rstd, c);                     \
    }                                                                                            \
    extern "C" __global__ void layernorm_param_grad_partial_##SUFFIX(                          \
        float* partial_gamma, float* partial_beta, const T* dout, const T* inp,                 \
        const float* mean, const float* rstd, int n, int c, int rows_per_chunk) {               \
        layernorm_param_grad_partial<T>(partial_gamma, partial_beta, dout, inp, mean, rstd, n,  \
                                        c, rows_per_chunk);                                     \
    }

LAYERNORM_KERNELS(float, f32)
LAYERNORM_KERNELS(bf16, bf16)
LAYERNORM_KERNELS(f16, f16)
