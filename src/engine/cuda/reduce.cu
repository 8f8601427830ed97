// Deterministic column sums over rows (bias and layernorm parameter gradients).
// Stage one writes one partial sum per (row chunk, column); stage two adds the chunks in a
// fixed order. No float atomics, so the result is the same on every run.

template <typename T>
__device__ void column_sum_partial(float* partial, const T* x, int n, int c, int rows_per_chunk) {
    const int col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= c) return;
    const int begin = blockIdx.y * rows_per_chunk;
    const int end = min(n, begin + rows_per_chunk);
    float acc = 0.f;
    for (int row = begin; row < end; ++row) acc += load(x[(long long)row * c + col]);
    partial[(long long)blockIdx.y * c + col] = acc;
}

extern "C" __global__ void column_sum_partial_f32(float* partial, const float* x, int n, int c,
                                                  int rows_per_chunk) {
    column_sum_partial<float>(partial, x, n, c, rows_per_chunk);
}

extern "C" __global__ void column_sum_partial_bf16(float* partial, const bf16* x, int n, int c,
                                                   int rows_per_chunk) {
    column_sum_partial<bf16>(partial, x, n, c, rows_per_chunk);
}

extern "C" __global__ void column_sum_partial_f16(float* partial, const f16* x, int n, int c,
                                                  int rows_per_chunk) {
    column_sum_partial<f16>(partial, x, n, c, rows_per_chunk);
}

// acc[col] += sum over chunks of partial[chunk, col]. A block of 32 x ACC_LANES threads takes
// 32 columns: lane y sums chunks y, y + ACC_LANES, ... in order, then one thread per column adds
// the lanes in order, so the sum is the same on every run (a fixed tree, not a sequential
// one: one thread per column walking every chunk waited on each load in turn).
#define ACC_LANES 32
extern "C" __global__ void accumulate_partials(float* acc, const float* partial, int chunks, int c) {
    __shared__ float lanes[ACC_LANES][33];
    const int col = blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    if (col < c)
        for (int k = threadIdx.y; k < chunks; k += ACC_LANES) s += partial[(long long)k * c + col];
    lanes[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < c) {
        float t = 0.f;
        for (int y = 0; y < ACC_LANES; ++y) t += lanes[y][threadIdx.x];
        acc[col] += t;
    }
}

// Sum of squares of a gradient in f64 (the global norm is a sum over ~1e8 squares), and a flag
// raised by any inf/NaN. Stage one: a fixed grid of blocks, each a fixed grid-stride pattern.
extern "C" __global__ void sum_squares_partial(double* partial, unsigned int* nonfinite,
                                               const float* x, long long n) {
    __shared__ double scratch[32];
    double acc = 0.0;
    bool bad = false;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = x[i];
        bad |= !is_finite(v);
        acc += (double)v * (double)v;
    }
    // Every writer stores the same value, so the race is benign.
    if (bad) *nonfinite = 1u;
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// Stage two: *acc += the sum of the partials, by one block: thread t adds partials t, t +
// blockDim.x, ... in order, then a fixed tree adds the threads. The order depends only on
// the partial count, so the result is the same on every run. (One thread walking the
// partials waited out a memory latency per partial: most of the gradient norm's time.)
extern "C" __global__ void sum_squares_finish(double* acc, const double* partial, int blocks) {
    __shared__ double scratch[32];
    double s = 0.0;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) s += partial[b];
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) *acc += s;
}
