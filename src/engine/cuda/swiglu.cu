// SwiGLU, h = silu(gate) * up over rows [gate: F | up: F]; reference: engine/cpu/swiglu.rs.
// Elementwise and grid-stride over the elements of h, four per access when F is a multiple of
// four and the buffers are aligned (four consecutive columns then never straddle two rows);
// otherwise one at a time.

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// h[row, col] = silu(gu[row, col]) * gu[row, F + col]
template <typename T> __device__ void swiglu_forward(T* h, const T* gu, long long n, int f) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec = f % 4 == 0 && aligned4(h) && aligned4(gu);
    const long long n4 = vec ? n / 4 : 0;
    for (long long i = tid; i < n4; i += stride) {
        const long long e = 4 * i, row = e / f, col = e - row * f;
        const T* g = gu + 2 * row * f + col;
        float a[4], u[4];
        load4(g, a);
        load4(g + f, u);
        for (int k = 0; k < 4; ++k) a[k] = a[k] * sigmoid(a[k]) * u[k];
        store4(h + e, a);
    }
    for (long long e = 4 * n4 + tid; e < n; e += stride) {
        const long long row = e / f, col = e - row * f;
        const float a = load(gu[2 * row * f + col]), u = load(gu[2 * row * f + f + col]);
        h[e] = store<T>(a * sigmoid(a) * u);
    }
}

// dgu[row] = [dh * up * silu'(gate) | dh * silu(gate)], every element written.
template <typename T>
__device__ void swiglu_backward(T* dgu, const T* gu, const T* dh, long long n, int f) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool vec = f % 4 == 0 && aligned4(dgu) && aligned4(gu) && aligned4(dh);
    const long long n4 = vec ? n / 4 : 0;
    for (long long i = tid; i < n4; i += stride) {
        const long long e = 4 * i, row = e / f, col = e - row * f;
        const long long at = 2 * row * f + col;
        float a[4], u[4], d[4];
        load4(gu + at, a);
        load4(gu + at + f, u);
        load4(dh + e, d);
        for (int k = 0; k < 4; ++k) {
            const float s = sigmoid(a[k]);
            const float dgate = d[k] * u[k] * s * (1.0f + a[k] * (1.0f - s));
            u[k] = d[k] * a[k] * s;  // dup
            a[k] = dgate;
        }
        store4(dgu + at, a);
        store4(dgu + at + f, u);
    }
    for (long long e = 4 * n4 + tid; e < n; e += stride) {
        const long long row = e / f, col = e - row * f;
        const long long at = 2 * row * f + col;
        const float a = load(gu[at]), u = load(gu[at + f]), d = load(dh[e]);
        const float s = sigmoid(a);
        dgu[at] = store<T>(d * u * s * (1.0f + a * (1.0f - s)));
        dgu[at + f] = store<T>(d * a * s);
    }
}

#define SWIGLU_KERNELS(T, SUFFIX)                                                               \
    extern "C" __global__ void swiglu_forward_##SUFFIX(T* h, const T* gu, long long n, int f) { \
        swiglu_forward<T>(h, gu, n, f);                                                         \
    }                                                                                            \
    extern "C" __global__ void swiglu_backward_##SUFFIX(T* dgu, const T* gu, const T* dh,       \
                                                        long long n, int f) {                   \
        swiglu_backward<T>(dgu, gu, dh, n, f);                                                  \
    }

SWIGLU_KERNELS(float, f32)
SWIGLU_KERNELS(bf16, bf16)
SWIGLU_KERNELS(f16, f16)
