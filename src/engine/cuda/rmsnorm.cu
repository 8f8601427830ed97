// Root-mean-square normalisation with the residual add fused in; reference:
// engine/cpu/rmsnorm.rs. One block per row, f32 accumulation. Where the row's width is a
// multiple of 4, at most 8 elements a thread and every buffer 4-element aligned (the common
// case: 576 channels over 96 threads), a thread moves 4 elements per access and keeps its
// elements in registers between the two passes (`held_row`); otherwise the row is read
// twice, the second read hitting L1/L2.
//
// Row strides: `ldo` is the stride of the forward's `out` rows and `ldd` of the backward's
// `dout` rows, each at least c (a multiple of 4 where the held paths run). A layer whose
// low-rank adapters are folded into its product reads its input `c + R` wide, the adapters'
// `x A^T` in the last R columns (nn/lora.rs): the norm writes the first c of each row and
// zeros in the rest, and its backward reads the first c of that product's input gradient.

// Up to two 4-element groups of a row per thread (group v = threadIdx.x + k * blockDim.x).
#define HELD 2
template <typename T> __device__ __forceinline__ bool held_row(const T* p, int c) {
    return c % 4 == 0 && c <= 4 * HELD * (int)blockDim.x && aligned4(p);
}

// Zeros in the columns c .. ldo of this block's row of out (a folded adapter layer's input
// fills them afterwards by adding into them).
template <typename T> __device__ __forceinline__ void zero_padding(T* out, int c, int ldo) {
    T* row = out + (long long)blockIdx.x * ldo;
    for (int i = c + threadIdx.x; i < ldo; i += blockDim.x) row[i] = store<T>(0.f);
}

template <typename T, bool RESIDUAL>
__device__ void rmsnorm_forward_held(T* sum, T* out, float* rstd, const T* x, const T* delta,
                                     const T* gamma, int c, int ldo, float eps) {
    __shared__ float scratch[32];
    const long long off = (long long)blockIdx.x * c;
    const long long out_off = (long long)blockIdx.x * ldo;
    const int groups = c / 4;
    float v[HELD][4];
    float acc = 0.f;
    for (int k = 0; k < HELD; ++k) {
        const int g = threadIdx.x + k * blockDim.x;
        if (g >= groups) continue;
        load4_residual<T, RESIDUAL>(v[k], x, delta, sum, off + 4 * g);
        for (int j = 0; j < 4; ++j) acc += v[k][j] * v[k][j];
    }
    const float r = 1.0f / sqrtf(block_sum(acc, scratch) / c + eps);
    for (int k = 0; k < HELD; ++k) {
        const int g = threadIdx.x + k * blockDim.x;
        if (g >= groups) continue;
        float w[4];
        load4(gamma + 4 * g, w);
        for (int j = 0; j < 4; ++j) w[j] = v[k][j] * r * w[j];
        store4(out + out_off + 4 * g, w);
    }
    zero_padding(out, c, ldo);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

template <typename T, bool RESIDUAL>
__device__ void rmsnorm_forward(T* sum, T* out, float* rstd, const T* x, const T* delta,
                                const T* gamma, int c, int ldo, float eps) {
    if (held_row(x, c) && held_row(out, c) && ldo % 4 == 0 && held_row(gamma, c) &&
        (!RESIDUAL || (held_row(sum, c) && held_row(delta, c)))) {
        rmsnorm_forward_held<T, RESIDUAL>(sum, out, rstd, x, delta, gamma, c, ldo, eps);
        return;
    }
    __shared__ float scratch[32];
    const long long off = (long long)blockIdx.x * c;
    float acc = 0.f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        float s = load(x[off + i]);
        if (RESIDUAL) {
            // The stored sum is what the next layer and the backward read; normalise that
            // (rounded) value, so forward and backward agree in bf16 and f16.
            const T stored = store<T>(s + load(delta[off + i]));
            sum[off + i] = stored;
            s = load(stored);
        }
        acc += s * s;
    }
    const T* src = RESIDUAL ? sum : x;
    const float r = 1.0f / sqrtf(block_sum(acc, scratch) / c + eps);
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        out[(long long)blockIdx.x * ldo + i] = store<T>(load(src[off + i]) * r * load(gamma[i]));
    }
    zero_padding(out, c, ldo);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// dx += r * (g*dy - x*r * mean(g*dy*x*r)); one block per row, the row read twice. The host
// runs it only for rows rmsnorm_backward_fused cannot hold (see rmsnorm.rs).
template <typename T>
__device__ void rmsnorm_backward_input(T* dx, const T* dout, const T* x, const T* gamma,
                                       const float* rstd, int c, int ldd) {
    __shared__ float scratch[32];
    const long long off = (long long)blockIdx.x * c;
    const long long d_off = (long long)blockIdx.x * ldd;
    const float r = rstd[blockIdx.x];
    float dot = 0.f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        dot += load(dout[d_off + i]) * load(gamma[i]) * load(x[off + i]);
    }
    const float mean_dot = block_sum(dot, scratch) * r / c;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float gdy = load(gamma[i]) * load(dout[d_off + i]);
        const float xhat = load(x[off + i]) * r;
        dx[off + i] = store<T>(load(dx[off + i]) + r * (gdy - xhat * mean_dot));
    }
}

// The backward with the gain gradient fused in, for rows the held path takes: block x owns
// rows [x * rows_per_chunk, ...) and works through them blockDim.y (at most RMS_BWD_LANES)
// at a time, one row per threadIdx.y lane (threadIdx.x over the row, whole warps). Each row
// is read once for both gradients: dx as in rmsnorm_backward_input, and each thread sums
// dout * x * rstd for its columns over its lane's rows; the lanes' sums are then added in
// lane order into partial[x, col] (accumulate_partials finishes, as for the unfused
// kernels); a null `partial` (a frozen gain) writes none. The separate gain-gradient pass
// read dout and x a second time.
#define RMS_BWD_LANES 4
template <typename T>
__device__ void rmsnorm_backward_fused(T* dx, float* partial, const T* dout, const T* x,
                                       const T* gamma, const float* rstd, int n, int c, int ldd,
                                       int rows_per_chunk) {
    __shared__ float lane_dot[RMS_BWD_LANES][32];
    extern __shared__ float chunk_dg[];  // c values: the lanes' gain gradients, added in turn
    const int lane = threadIdx.y, groups = c / 4;
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float w[HELD][4], dg[HELD][4];
    for (int k = 0; k < HELD; ++k) {
        const int g = threadIdx.x + k * blockDim.x;
        for (int j = 0; j < 4; ++j) dg[k][j] = 0.f;
        if (g < groups) load4(gamma + 4 * g, w[k]);
    }
    const int begin = blockIdx.x * rows_per_chunk, end = min(n, begin + rows_per_chunk);
    // The rows are pipelined: the next round's dout and x (and rstd) are loaded while this
    // round's are reduced and written, so each block waits on memory once, not once a round.
    Raw4<T> nd[HELD], nx[HELD];
    float nr = 0.f;
    auto fetch = [&](int base) { norm_fetch_row<T, HELD>(dout, x, rstd, base + lane, end, c, ldd, nd, nx, nr); };
    fetch(begin);
    for (int base = begin; base < end; base += blockDim.y) {  // uniform over the block
        const int row = base + lane;
        const bool live = row < end;
        const long long off = (long long)row * c;
        const float r = live ? nr : 0.f;
        // dx is read now and used after the reductions, which its load overlaps.
        float xs[HELD][4], d[HELD][4];
        Raw4<T> ro[HELD];
        for (int k = 0; k < HELD; ++k) {
            if (!live || threadIdx.x + k * blockDim.x >= groups) continue;
            unpack4(nd[k], d[k]);
            unpack4(nx[k], xs[k]);
            load_raw4(dx + off + 4 * k * blockDim.x + 4 * threadIdx.x, ro[k]);
        }
        if (base + (int)blockDim.y < end) fetch(base + blockDim.y);
        float dot = 0.f;
        for (int k = 0; k < HELD; ++k) {
            if (!live || threadIdx.x + k * blockDim.x >= groups) continue;
            for (int j = 0; j < 4; ++j) dot += w[k][j] * d[k][j] * xs[k][j];
        }
        dot = warp_sum(dot);
        if ((threadIdx.x & 31) == 0) lane_dot[lane][warp] = dot;
        __syncthreads();
        float total = 0.f;
        for (int i = 0; i < warps; ++i) total += lane_dot[lane][i];
        __syncthreads();  // lane_dot is written again next round
        if (!live) continue;
        const float mean_dot = total * r / c;
        for (int k = 0; k < HELD; ++k) {
            const int g = threadIdx.x + k * blockDim.x;
            if (g >= groups) continue;
            float o[4];
            unpack4(ro[k], o);
            for (int j = 0; j < 4; ++j) {
                o[j] += r * (w[k][j] * d[k][j] - xs[k][j] * r * mean_dot);
                dg[k][j] += d[k][j] * xs[k][j] * r;
            }
            store4(dx + off + 4 * g, o);
        }
    }
    // A frozen gain (under adapters) takes no gradient: no partial row to write.
    if (partial != nullptr) add_lanes_in_order(chunk_dg, dg, c, partial + (long long)blockIdx.x * c);
}

// Gain gradient, first stage: block (x, y) sums columns [x*blockDim, ...) of dout * x * rstd
// over the rows of chunk y into partial[y, col]; reduce.cu's accumulate_partials adds the
// chunks in order, so the result does not depend on scheduling.
template <typename T>
__device__ void rmsnorm_param_grad_partial(float* partial, const T* dout, const T* x,
                                           const float* rstd, int n, int c, int ldd,
                                           int rows_per_chunk) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= c) return;
    const int begin = blockIdx.y * rows_per_chunk;
    const int end = min(n, begin + rows_per_chunk);
    float dg = 0.f;
    for (int row = begin; row < end; ++row) {
        const long long i = (long long)row * c + col;
        dg += load(dout[(long long)row * ldd + col]) * load(x[i]) * rstd[row];
    }
    partial[(long long)blockIdx.y * c + col] = dg;
}

#define RMSNORM_KERNELS(T, SUFFIX, BWD_REGS)                                                   \
    extern "C" __global__ void rmsnorm_forward_##SUFFIX(T* out, float* rstd, const T* x,       \
                                                        const T* gamma, int c, int ldo,        \
                                                        float eps) {                            \
        rmsnorm_forward<T, false>(nullptr, out, rstd, x, nullptr, gamma, c, ldo, eps);         \
    }                                                                                           \
    extern "C" __global__ void residual_rmsnorm_forward_##SUFFIX(                              \
        T* sum, T* out, float* rstd, const T* x, const T* delta, const T* gamma, int c,        \
        int ldo, float eps) {                                                                   \
        rmsnorm_forward<T, true>(sum, out, rstd, x, delta, gamma, c, ldo, eps);                \
    }                                                                                           \
    extern "C" __global__ void rmsnorm_backward_input_##SUFFIX(                                \
        T* dx, const T* dout, const T* x, const T* gamma, const float* rstd, int c, int ldd) { \
        rmsnorm_backward_input<T>(dx, dout, x, gamma, rstd, c, ldd);                           \
    }                                                                                           \
    extern "C" __global__ void BWD_REGS rmsnorm_backward_fused_##SUFFIX(                        \
        T* dx, float* partial, const T* dout, const T* x, const T* gamma, const float* rstd,   \
        int n, int c, int ldd, int rows_per_chunk) {                                            \
        rmsnorm_backward_fused<T>(dx, partial, dout, x, gamma, rstd, n, c, ldd,                \
                                  rows_per_chunk);                                              \
    }                                                                                           \
    extern "C" __global__ void rmsnorm_param_grad_partial_##SUFFIX(                            \
        float* partial, const T* dout, const T* x, const float* rstd, int n, int c, int ldd,   \
        int rows_per_chunk) {                                                                   \
        rmsnorm_param_grad_partial<T>(partial, dout, x, rstd, n, c, ldd, rows_per_chunk);      \
    }

RMSNORM_KERNELS(float, f32, )
RMSNORM_KERNELS(bf16, bf16, LN_BWD_REGS)
RMSNORM_KERNELS(f16, f16, LN_BWD_REGS)
