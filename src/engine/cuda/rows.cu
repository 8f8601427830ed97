// Row gather and scatter by index for mixture-of-experts routing; reference:
// engine/cpu/rows.rs. One block per indexed row, threads across its columns, arithmetic in
// f32. The rows a scatter names are distinct, so each destination element has one writer:
// no atomics, and the result is the same on every run. `scale` may be null (weight 1).

// out[s, :] = scale[s] * src[idx[s], :]; an index outside src gives a row of NaN rather
// than an out-of-bounds read.
template <typename T>
__device__ void gather_rows(T* out, const T* src, const unsigned int* idx, const float* scale,
                            int c, unsigned int src_rows) {
    const long long s = blockIdx.x;
    const unsigned int i = idx[s];
    T* o = out + s * c;
    if (i >= src_rows) {
        for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = store<T>(KILN_NAN);
        return;
    }
    const float k = scale ? scale[s] : 1.0f;
    const T* row = src + (long long)i * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) o[j] = store<T>(k * load(row[j]));
}

// dst[idx[s], :] += scale[s] * src[s, :]; indices outside dst are skipped.
template <typename T>
__device__ void scatter_add_rows(T* dst, const T* src, const unsigned int* idx, const float* scale,
                                 int c, unsigned int dst_rows) {
    const long long s = blockIdx.x;
    const unsigned int i = idx[s];
    if (i >= dst_rows) return;
    const float k = scale ? scale[s] : 1.0f;
    T* d = dst + (long long)i * c;
    const T* row = src + s * c;
    for (int j = threadIdx.x; j < c; j += blockDim.x) d[j] = store<T>(load(d[j]) + k * load(row[j]));
}

// out[s] = sum_j a[idx[s], j] * b[s, j] (the gradient of a gate weight); NaN for an index
// outside a.
template <typename T>
__device__ void gathered_row_dot(float* out, const T* a, const unsigned int* idx, const T* b, int c,
                                 unsigned int a_rows) {
    __shared__ float scratch[32];
    const long long s = blockIdx.x;
    const unsigned int i = idx[s];
    if (i >= a_rows) {
        if (threadIdx.x == 0) out[s] = KILN_NAN;
        return;
    }
    const T* ra = a + (long long)i * c;
    const T* rb = b + s * c;
    float acc = 0.f;
    for (int j = threadIdx.x; j < c; j += blockDim.x) acc += load(ra[j]) * load(rb[j]);
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) out[s] = acc;
}

#define ROWS_KERNELS(T, SUFFIX)                                                                   \
    extern "C" __global__ void gather_rows_##SUFFIX(T* out, const T* src, const unsigned int* idx, \
                                                    const float* scale, int c,                    \
                                                    unsigned int src_rows) {                      \
        gather_rows<T>(out, src, idx, scale, c, src_rows);                                        \
    }                                                                                             \
    extern "C" __global__ void scatter_add_rows_##SUFFIX(T* dst, const T* src,                    \
                                                         const unsigned int* idx,                 \
                                                         const float* scale, int c,               \
                                                         unsigned int dst_rows) {                 \
        scatter_add_rows<T>(dst, src, idx, scale, c, dst_rows);                                   \
    }                                                                                             \
    extern "C" __global__ void gathered_row_dot_##SUFFIX(float* out, const T* a,                  \
                                                         const unsigned int* idx, const T* b,     \
                                                         int c, unsigned int a_rows) {            \
        gathered_row_dot<T>(out, a, idx, b, c, a_rows);                                           \
    }

ROWS_KERNELS(float, f32)
ROWS_KERNELS(bf16, bf16)
ROWS_KERNELS(f16, f16)
