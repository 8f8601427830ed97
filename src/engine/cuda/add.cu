// Elementwise addition; reference: engine/cpu/add.rs. The residual add of the unfused path
// (train.fused_kernels=false) and the meeting of two gradients. Grid-stride, four elements per
// access where every buffer allows it (a tail and misaligned buffers go one at a time); the
// in-place form passes the destination as both `out` and `a`.

template <typename T> __device__ void add(T* out, const T* a, const T* b, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n4 = (aligned4(out) && aligned4(a) && aligned4(b)) ? n / 4 : 0;
    for (long long i = tid; i < n4; i += stride) {
        float x[4], y[4];
        load4(a + 4 * i, x);
        load4(b + 4 * i, y);
        for (int k = 0; k < 4; ++k) x[k] += y[k];
        store4(out + 4 * i, x);
    }
    for (long long i = 4 * n4 + tid; i < n; i += stride) out[i] = store<T>(load(a[i]) + load(b[i]));
}

#define ADD_KERNELS(T, SUFFIX)                                                                  \
    extern "C" __global__ void add_##SUFFIX(T* out, const T* a, const T* b, long long n) {      \
        add<T>(out, a, b, n);                                                                   \
    }                                                                                          \
    extern "C" __global__ void add_assign_##SUFFIX(T* dst, const T* src, long long n) {         \
        add<T>(dst, dst, src, n);                                                               \
    }

ADD_KERNELS(float, f32)
ADD_KERNELS(bf16, bf16)
ADD_KERNELS(f16, f16)

// Column blocks of row-major matrices (a low-rank adapter inside a fused projection):
// add_cols_scaled adds alpha * src[N, c] into columns col0.. of dst[N, row]; cols_scaled
// copies alpha * src[.., col0 .. col0 + c] out. One thread per element of the [N, c] block.
template <typename T>
__device__ void add_cols_scaled(T* dst, const T* src, long long n, int row, int col0, int c,
                                float alpha) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n * c; i += stride) {
        const long long r = i / c;
        const int j = (int)(i - r * c);
        T* d = dst + r * row + col0 + j;
        *d = store<T>(load(*d) + alpha * load(src[i]));
    }
}

template <typename T>
__device__ void cols_scaled(T* out, const T* src, long long n, int row, int col0, int c,
                            float alpha) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n * c; i += stride) {
        const long long r = i / c;
        const int j = (int)(i - r * c);
        out[i] = store<T>(alpha * load(src[r * row + col0 + j]));
    }
}

// set_block copies src[n, c] into rows row0.. and columns col0.. of dst[.., row]: a low-rank
// adapter's B into its block of the widened frozen weight (nn/lora.rs, FoldedWeight).
template <typename T>
__device__ void set_block(T* dst, const T* src, long long n, int row, long long row0, int col0,
                          int c) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n * c; i += stride) {
        const long long r = i / c;
        const int j = (int)(i - r * c);
        dst[(row0 + r) * row + col0 + j] = src[i];
    }
}

#define COLS_KERNELS(T, SUFFIX)                                                                 \
    extern "C" __global__ void add_cols_scaled_##SUFFIX(T* dst, const T* src, long long n,      \
                                                        int row, int col0, int c, float alpha) { \
        add_cols_scaled<T>(dst, src, n, row, col0, c, alpha);                                   \
    }                                                                                          \
    extern "C" __global__ void cols_scaled_##SUFFIX(T* out, const T* src, long long n, int row, \
                                                    int col0, int c, float alpha) {             \
        cols_scaled<T>(out, src, n, row, col0, c, alpha);                                       \
    }                                                                                          \
    extern "C" __global__ void set_block_##SUFFIX(T* dst, const T* src, long long n, int row,   \
                                                  long long row0, int col0, int c) {            \
        set_block<T>(dst, src, n, row, row0, col0, c);                                          \
    }

COLS_KERNELS(float, f32)
COLS_KERNELS(bf16, bf16)
COLS_KERNELS(f16, f16)
