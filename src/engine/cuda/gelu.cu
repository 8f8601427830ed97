// GELU, tanh form; reference: engine/cpu/gelu.rs. Elementwise, grid-stride.

#define GELU_SQRT_2_OVER_PI 0.7978846f
#define GELU_COEF 0.044715f

template <typename T> __device__ void gelu_forward(T* out, const T* inp, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float x = load(inp[i]);
        out[i] = store<T>(0.5f * x * (1.0f + tanhf(GELU_SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x))));
    }
}

// Overwrites dinp with dout * gelu'(inp).
template <typename T> __device__ void gelu_backward(T* dinp, const T* inp, const T* dout, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float x = load(inp[i]);
        const float t = tanhf(GELU_SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x));
        const float sech2 = 1.0f - t * t;
        const float grad = 0.5f * (1.0f + t) +
                           0.5f * x * sech2 * GELU_SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_COEF * x * x);
        dinp[i] = store<T>(load(dout[i]) * grad);
    }
}

extern "C" __global__ void gelu_forward_f32(float* out, const float* inp, long long n) { gelu_forward(out, inp, n); }
extern "C" __global__ void gelu_forward_bf16(bf16* out, const bf16* inp, long long n) { gelu_forward(out, inp, n); }
extern "C" __global__ void gelu_backward_f32(float* dinp, const float* inp, const float* dout, long long n) {
    gelu_backward(dinp, inp, dout, n);
}
extern "C" __global__ void gelu_backward_bf16(bf16* dinp, const bf16* inp, const bf16* dout, long long n) {
    gelu_backward(dinp, inp, dout, n);
}
