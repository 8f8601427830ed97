// Deterministic column sums over rows (bias and layernorm parameter gradients).
// Stage one writes one partial sum per (row chunk, column); stage two adds the chunks in a
// fixed order. No float atomics, so the result is the same on every run.

// partial[chunk, col] = the sum over the chunk's rows of x[row, col], rows in order. A thread
// takes four neighbouring columns, one wide load a row where the rows are aligned to four
// values: one 2-byte load a row per thread kept too few bytes in flight (56% of DRAM peak
// on GPT-2's 768-wide bias gradients; common.cuh's load4). Each column's sum is the same as one
// thread a column.
template <typename T>
__device__ void column_sum_partial(float* partial, const T* x, int n, int c, int rows_per_chunk) {
    const int col = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (col >= c) return;
    const int begin = blockIdx.y * rows_per_chunk;
    const int end = min(n, begin + rows_per_chunk);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const bool wide = c % 4 == 0 && reinterpret_cast<size_t>(x) % (4 * sizeof(T)) == 0;
    if (wide) {
#pragma unroll 4
        for (int row = begin; row < end; ++row) {
            float v[4];
            load4(x + (long long)row * c + col, v);
            for (int i = 0; i < 4; ++i) acc[i] += v[i];
        }
    } else {
        const int cols = min(4, c - col);
#pragma unroll 4
        for (int row = begin; row < end; ++row)
            for (int i = 0; i < cols; ++i) acc[i] += load(x[(long long)row * c + col + i]);
    }
    for (int i = 0; i < 4 && col + i < c; ++i) partial[(long long)blockIdx.y * c + col + i] = acc[i];
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
// one: one thread per column walking every chunk waited on each load in turn). Blocks with
// blockIdx.y = 1 do the same for a second tensor (a layernorm's bias beside its gain: one
// launch for both, each a few microseconds of launch and latency for little data).
#define ACC_LANES 32
#define ACC_BATCH 32
extern "C" __global__ void accumulate_partials(float* acc0, const float* partial0, float* acc1,
                                               const float* partial1, int chunks, int c) {
    __shared__ float lanes[ACC_LANES][33];
    float* acc = blockIdx.y == 0 ? acc0 : acc1;
    const float* partial = blockIdx.y == 0 ? partial0 : partial1;
    const int col = blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    // Loads go out ACC_BATCH at a time and are added in chunk order, so the latencies
    // overlap and the sum does not change (1024 chunks were 32 waits in a row per lane).
    if (col < c) {
        for (int k0 = threadIdx.y; k0 < chunks; k0 += ACC_LANES * ACC_BATCH) {
            float v[ACC_BATCH];
#pragma unroll
            for (int u = 0; u < ACC_BATCH; ++u) {
                const int k = k0 + u * ACC_LANES;
                v[u] = k < chunks ? partial[(long long)k * c + col] : 0.f;
            }
#pragma unroll
            for (int u = 0; u < ACC_BATCH; ++u) s += v[u];
        }
    }
    lanes[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < c) {
        float t = 0.f;
        for (int y = 0; y < ACC_LANES; ++y) t += lanes[y][threadIdx.x];
        acc[col] += t;
    }
}

// Sum of squares of a gradient in f64 (the global norm is a sum over ~1e8 squares), and a flag
// raised by any inf/NaN. Stage one, over many tensors in one launch: the host lists them in a
// table; each owns a fixed number of blocks (from its size alone), numbered from its
// first_block, and its blocks walk it in a fixed grid-stride pattern. A block finds its
// tensor by bisecting the table. Partial b is block b's sum.
struct SumSquaresTensor {
    const float* x;
    long long n;
    long long first_block;
    long long blocks;
};

extern "C" __global__ void sum_squares_partial(double* partial, unsigned int* nonfinite,
                                               const SumSquaresTensor* table, int tensors) {
    __shared__ double scratch[32];
    const long long b = blockIdx.x;
    const SumSquaresTensor t = table_entry(table, tensors, b);
    double acc = 0.0;
    bool bad = false;
    // Four values an access where the tensor is 16-byte aligned (then the tail past the last
    // whole four goes one at a time), unrolled so that several accesses are in flight: one
    // 4-byte load at a time per thread left the reduction waiting on memory latency.
    const long long first = (b - t.first_block) * blockDim.x + threadIdx.x;
    const long long stride = t.blocks * blockDim.x;
    const long long n4 = aligned4(t.x) ? t.n / 4 : 0;
    const float4* x4 = reinterpret_cast<const float4*>(t.x);
#pragma unroll 4
    for (long long i = first; i < n4; i += stride) {
        const float4 q = x4[i];
        bad |= !(is_finite(q.x) && is_finite(q.y) && is_finite(q.z) && is_finite(q.w));
        acc += (double)q.x * (double)q.x;
        acc += (double)q.y * (double)q.y;
        acc += (double)q.z * (double)q.z;
        acc += (double)q.w * (double)q.w;
    }
    for (long long i = 4 * n4 + first; i < t.n; i += stride) {
        const float v = t.x[i];
        bad |= !is_finite(v);
        acc += (double)v * (double)v;
    }
    // Every writer stores the same value, so the race is benign.
    if (bad) *nonfinite = 1u;
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[b] = acc;
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
