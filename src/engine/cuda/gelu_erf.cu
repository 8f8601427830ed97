// GELU, exact form x * Phi(x); reference: engine/cpu/gelu_erf.rs. normcdff is CUDA's normal
// CDF (erfc-based, a few ulp). Elementwise, grid-stride, four elements per access where the
// buffers allow it, as gelu.cu.

#define GELU_INV_SQRT_2PI 0.3989422804014327f

__device__ __forceinline__ float gelu_erf(float x) { return x * normcdff(x); }

__device__ __forceinline__ float gelu_erf_grad(float x) {
    return normcdff(x) + x * GELU_INV_SQRT_2PI * __expf(-0.5f * x * x);
}

template <typename T> __device__ void gelu_erf_forward(T* out, const T* inp, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n4 = (aligned4(out) && aligned4(inp)) ? n / 4 : 0;
    for (long long i = tid; i < n4; i += stride) {
        float v[4];
        load4(inp + 4 * i, v);
        for (int k = 0; k < 4; ++k) v[k] = gelu_erf(v[k]);
        store4(out + 4 * i, v);
    }
    for (long long i = 4 * n4 + tid; i < n; i += stride) out[i] = store<T>(gelu_erf(load(inp[i])));
}

// Overwrites dinp with dout * gelu_erf'(inp).
template <typename T>
__device__ void gelu_erf_backward(T* dinp, const T* inp, const T* dout, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n4 = (aligned4(dinp) && aligned4(inp) && aligned4(dout)) ? n / 4 : 0;
    for (long long i = tid; i < n4; i += stride) {
        float x[4], dy[4];
        load4(inp + 4 * i, x);
        load4(dout + 4 * i, dy);
        for (int k = 0; k < 4; ++k) x[k] = dy[k] * gelu_erf_grad(x[k]);
        store4(dinp + 4 * i, x);
    }
    for (long long i = 4 * n4 + tid; i < n; i += stride)
        dinp[i] = store<T>(load(dout[i]) * gelu_erf_grad(load(inp[i])));
}

#define GELU_ERF_KERNELS(T, SUFFIX)                                                              \
    extern "C" __global__ void gelu_erf_forward_##SUFFIX(T* out, const T* inp, long long n) {   \
        gelu_erf_forward(out, inp, n);                                                           \
    }                                                                                            \
    extern "C" __global__ void gelu_erf_backward_##SUFFIX(T* dinp, const T* inp, const T* dout, \
                                                          long long n) {                         \
        gelu_erf_backward(dinp, inp, dout, n);                                                   \
    }

GELU_ERF_KERNELS(float, f32)
GELU_ERF_KERNELS(bf16, bf16)
GELU_ERF_KERNELS(f16, f16)
