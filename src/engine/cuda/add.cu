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
