// Layer normalisation with the residual add fused in; reference: engine/cpu/layernorm.rs.
// One block per row. Mean and variance are two passes over the row (as on the CPU), which
// keeps fp32 accuracy for rows with a large mean: over registers where the row is held
// (layernorm_forward_held), else a second read that hits L1/L2.

// eps is an argument: GPT-2 uses 1e-5, BERT-family encoders 1e-12.

// Up to LN_FWD_HELD 4-element groups of a row per thread (group v = threadIdx.x + k *
// blockDim.x), held in registers between the passes, where the row's width is a multiple of 4,
// fits them and every buffer is 4-element aligned (GPT-2's 768 channels over 96 threads):
// each access moves 4 elements, and the row is read from memory once.
#define LN_FWD_HELD 2
template <typename T> __device__ __forceinline__ bool ln_held_row(const T* p, int c) {
    return c % 4 == 0 && c <= 4 * LN_FWD_HELD * (int)blockDim.x && aligned4(p);
}

// The forward on a held row: the same two passes (mean, then the squared deviations), over
// registers.
template <typename T, bool RESIDUAL>
__device__ void layernorm_forward_held(T* sum, T* out, float* mean, float* rstd, const T* x,
                                       const T* delta, const T* gamma, const T* beta, int c,
                                       float eps) {
    __shared__ float scratch[32];
    const long long off = (long long)blockIdx.x * c;
    const int groups = c / 4;
    float v[LN_FWD_HELD][4];
    float acc = 0.f;
    for (int k = 0; k < LN_FWD_HELD; ++k) {
        const int g = threadIdx.x + k * blockDim.x;
        if (g >= groups) continue;
        load4_residual<T, RESIDUAL>(v[k], x, delta, sum, off + 4 * g);
        for (int j = 0; j < 4; ++j) acc += v[k][j];
    }
    const float mu = block_sum(acc, scratch) / c;
    float var = 0.f;
    for (int k = 0; k < LN_FWD_HELD; ++k) {
        if (threadIdx.x + k * blockDim.x >= groups) continue;
        for (int j = 0; j < 4; ++j) {
            const float d = v[k][j] - mu;
            var += d * d;
        }
    }
    const float r = 1.0f / sqrtf(block_sum(var, scratch) / c + eps);
    for (int k = 0; k < LN_FWD_HELD; ++k) {
        const int g = threadIdx.x + k * blockDim.x;
        if (g >= groups) continue;
        float w[4], b[4];
        load4(gamma + 4 * g, w);
        load4(beta + 4 * g, b);
        for (int j = 0; j < 4; ++j) w[j] = (v[k][j] - mu) * r * w[j] + b[j];
        store4(out + off + 4 * g, w);
    }
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = mu;
        rstd[blockIdx.x] = r;
    }
}

template <typename T, bool RESIDUAL>
__device__ void layernorm_forward(T* sum, T* out, float* mean, float* rstd, const T* x,
                                  const T* delta, const T* gamma, const T* beta, int c, float eps) {
    if (ln_held_row(x, c) && ln_held_row(out, c) && ln_held_row(gamma, c) && ln_held_row(beta, c) &&
        (!RESIDUAL || (ln_held_row(sum, c) && ln_held_row(delta, c)))) {
        layernorm_forward_held<T, RESIDUAL>(sum, out, mean, rstd, x, delta, gamma, beta, c, eps);
        return;
    }
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

// The backward with the parameter gradients fused in, for rows a block can hold in registers
// (c a multiple of 4, at most 8 values a thread, aligned buffers: the host checks): block x
// owns rows [x * rows_per_chunk, ...) and works through them blockDim.y (at most
// LN_BWD_LANES) at a time, one row per threadIdx.y lane (threadIdx.x over the row, whole
// warps). Each row is read once for dinp and for the thread's sums of dgamma and dbeta over
// its lane's rows; the lanes' sums are added in lane order into partial_gamma/partial_beta
// [x, col] (accumulate_partials finishes, as for the unfused kernels, which read dout and
// inp a second time).
#define LN_BWD_LANES 4
#define LN_HELD 2
template <typename T>
__device__ void layernorm_backward_fused(T* dinp, float* partial_gamma, float* partial_beta,
                                         const T* dout, const T* inp, const T* gamma,
                                         const float* mean, const float* rstd, int n, int c,
                                         int rows_per_chunk) {
    __shared__ float lane_sums[LN_BWD_LANES][2][32];
    extern __shared__ float chunk_sums[];  // 2c values: dgamma then dbeta, lanes added in turn
    const int lane = threadIdx.y, groups = c / 4;
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float w[LN_HELD][4], dg[LN_HELD][4], db[LN_HELD][4];
    for (int k = 0; k < LN_HELD; ++k) {
        const int g = threadIdx.x + k * blockDim.x;
        for (int j = 0; j < 4; ++j) dg[k][j] = db[k][j] = 0.f;
        if (g < groups) load4(gamma + 4 * g, w[k]);
    }
    const int begin = blockIdx.x * rows_per_chunk, end = min(n, begin + rows_per_chunk);
    // The rows are pipelined: the next round's dout and inp (and rstd) are loaded while this
    // round's are reduced and written, so each block waits on memory once, not once a round.
    Raw4<T> nd[LN_HELD], nx[LN_HELD];
    float nr = 0.f;
    auto fetch = [&](int base) { norm_fetch_row<T, LN_HELD>(dout, inp, rstd, base + lane, end, c, c, nd, nx, nr); };
    fetch(begin);
    for (int base = begin; base < end; base += blockDim.y) {  // uniform over the block
        const int row = base + lane;
        const bool live = row < end;
        const long long off = (long long)row * c;
        const float m = live ? mean[row] : 0.f, r = live ? nr : 0.f;
        // dinp is read now and used after the reductions, which its load overlaps.
        float xs[LN_HELD][4], d[LN_HELD][4];
        Raw4<T> ro[LN_HELD];
        for (int k = 0; k < LN_HELD; ++k) {
            if (!live || threadIdx.x + k * blockDim.x >= groups) continue;
            unpack4(nd[k], d[k]);
            unpack4(nx[k], xs[k]);
            load_raw4(dinp + off + 4 * k * blockDim.x + 4 * threadIdx.x, ro[k]);
        }
        if (base + (int)blockDim.y < end) fetch(base + blockDim.y);
        float sum_gdy = 0.f, sum_gdy_xhat = 0.f;
        for (int k = 0; k < LN_HELD; ++k) {
            if (!live || threadIdx.x + k * blockDim.x >= groups) continue;
            for (int j = 0; j < 4; ++j) {
                const float gdy = w[k][j] * d[k][j];
                sum_gdy += gdy;
                sum_gdy_xhat += gdy * (xs[k][j] - m) * r;
            }
        }
        sum_gdy = warp_sum(sum_gdy);
        sum_gdy_xhat = warp_sum(sum_gdy_xhat);
        if ((threadIdx.x & 31) == 0) {
            lane_sums[lane][0][warp] = sum_gdy;
            lane_sums[lane][1][warp] = sum_gdy_xhat;
        }
        __syncthreads();
        float total_gdy = 0.f, total_gdy_xhat = 0.f;
        for (int i = 0; i < warps; ++i) {
            total_gdy += lane_sums[lane][0][i];
            total_gdy_xhat += lane_sums[lane][1][i];
        }
        __syncthreads();  // lane_sums is written again next round
        if (!live) continue;
        const float mean_gdy = total_gdy / c, mean_gdy_xhat = total_gdy_xhat / c;
        for (int k = 0; k < LN_HELD; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (g >= groups) continue;
            float o[4];
            unpack4(ro[k], o);
            for (int j = 0; j < 4; ++j) {
                const float xhat = (xs[k][j] - m) * r;
                o[j] += r * (w[k][j] * d[k][j] - mean_gdy - xhat * mean_gdy_xhat);
                dg[k][j] += d[k][j] * (xs[k][j] - m) * r;
                db[k][j] += d[k][j];
            }
            store4(dinp + off + 4 * g, o);
        }
    }
    add_lanes_in_order(chunk_sums, dg, c, partial_gamma + (long long)blockIdx.x * c);
    add_lanes_in_order(chunk_sums + c, db, c, partial_beta + (long long)blockIdx.x * c);
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

#define LAYERNORM_KERNELS(T, SUFFIX, BWD_REGS)                                                             \
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
    extern "C" __global__ void BWD_REGS layernorm_backward_fused_##SUFFIX(              \
        T* dinp, float* partial_gamma, float* partial_beta, const T* dout, const T* inp,        \
        const T* gamma, const float* mean, const float* rstd, int n, int c,                     \
        int rows_per_chunk) {                                                                    \
        layernorm_backward_fused<T>(dinp, partial_gamma, partial_beta, dout, inp, gamma, mean,   \
                                    rstd, n, c, rows_per_chunk);                                 \
    }                                                                                            \
    extern "C" __global__ void layernorm_param_grad_partial_##SUFFIX(                          \
        float* partial_gamma, float* partial_beta, const T* dout, const T* inp,                 \
        const float* mean, const float* rstd, int n, int c, int rows_per_chunk) {               \
        layernorm_param_grad_partial<T>(partial_gamma, partial_beta, dout, inp, mean, rstd, n,  \
                                        c, rows_per_chunk);                                     \
    }

LAYERNORM_KERNELS(float, f32, )
LAYERNORM_KERNELS(bf16, bf16, LN_BWD_REGS)
LAYERNORM_KERNELS(f16, f16, LN_BWD_REGS)
