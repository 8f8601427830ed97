// GELU, tanh form; reference: engine/cpu/gelu.rs. Elementwise, grid-stride, four elements
// per access where the buffers allow it (a tail and misaligned buffers go one at a time).

#define GELU_SQRT_2_OVER_PI 0.7978846f
#define GELU_COEF 0.044715f

__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.0f + tanhf(GELU_SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x)));
}

__device__ __forceinline__ float gelu_grad(float x) {
    const float t = tanhf(GELU_SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x));
    const float sech2 = 1.0f - t * t;
    return 0.5f * (1.0f + t) + 0.5f * x * sech2 * GELU_SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_COEF * x * x);
}

template <typename T> __device__ void gelu_forward(T* out, const T* inp, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n4 = (aligned4(out) && aligned4(inp)) ? n / 4 : 0;
    for (long long i = tid; i < n4; i += stride) {
        float v[4];
        load4(inp + 4 * i, v);
        for (int k = 0; k < 4; ++k) v[k] = gelu(v[k]);
        store4(out + 4 * i, v);
    }
    for (long long i = 4 * n4 + tid; i < n; i += stride) out[i] = store<T>(gelu(load(inp[i])));
}

// Overwrites dinp with dout * gelu'(inp).
template <typename T> __device__ void gelu_backward(T* dinp, const T* inp, const T* dout, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n4 = (aligned4(dinp) && aligned4(inp) && aligned4(dout)) ? n / 4 : 0;
    for (long long i = tid; i < n4; i += stride) {
        float x[4], dy[4];
        load4(inp + 4 * i, x);
        load4(dout + 4 * i, dy);
        for (int k = 0; k < 4; ++k) x[k] = dy[k] * gelu_grad(x[k]);
        store4(dinp + 4 * i, x);
    }
    for (long long i = 4 * n4 + tid; i < n; i += stride) dinp[i] = store<T>(load(dout[i]) * gelu_grad(load(inp[i])));
}

extern "C" __global__ void gelu_forward_f32(float* out, const float* inp, long long n) { gelu_forward(out, inp, n); }
extern "C" __global__ void gelu_forward_bf16(bf16* out, const bf16* inp, long long n) { gelu_forward(out, inp, n); }
extern "C" __global__ void gelu_forward_f16(f16* out, const f16* inp, long long n) { gelu_forward(out, inp, n); }
extern "C" __global__ void gelu_backward_f32(float* dinp, const float* inp, const float* dout, long long n) {
    gelu_backward(dinp, inp, dout, n);
}
extern "C" __global__ void gelu_backward_bf16(bf16* dinp, const bf16* inp, const bf16* dout, long long n) {
    gelu_backward(dinp, inp, dout, n);
}
extern "C" __global__ void gelu_backward_f16(f16* dinp, const f16* inp, const f16* dout, long long n) {
    gelu_backward(dinp, inp, dout, n);
}
