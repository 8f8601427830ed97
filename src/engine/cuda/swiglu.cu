// SwiGLU, h = silu(gate) * up over rows [gate: F | up: F]; reference: engine/cpu/swiglu.rs.
// Rows come from the grid (y, strided) and a row's columns from x, so no index is divided.
// Four columns an access where F is a multiple of four and the buffers are aligned (the four
// then never straddle two rows), otherwise one; each thread issues the loads of
// SWIGLU_GROUPS accesses before it uses any (the pointers are restrict-qualified, so the
// compiler may), which keeps enough bytes in flight to run at memory speed.

#define SWIGLU_GROUPS 2

// The logistic function. In bf16 and f16 the fast exponential and division (a few ulp of f32)
// vanish in the output's rounding; f32 keeps the exact forms the CPU reference uses.
template <typename T> __device__ __forceinline__ float swiglu_sigmoid(float x) {
    if constexpr (sizeof(T) == 2) {
        return __fdividef(1.0f, 1.0f + __expf(-x));
    } else {
        return 1.0f / (1.0f + expf(-x));
    }
}

// The `W` columns (1 or 4) from `p`, widened to f32.
template <int W, typename T> __device__ __forceinline__ void swiglu_load(const T* p, float (&v)[W]) {
    if constexpr (W == 4) {
        load4(p, v);
    } else {
        v[0] = load(p[0]);
    }
}
template <int W, typename T> __device__ __forceinline__ void swiglu_store(T* p, const float (&v)[W]) {
    if constexpr (W == 4) {
        store4(p, v);
    } else {
        p[0] = store<T>(v[0]);
    }
}

// h[row, col] = silu(gu[row, col]) * gu[row, F + col]. With NORMED, gu is the projection of
// an unnormalised stream x[rows, c] (the norm's gain folded into the weight) and both halves
// are first scaled by the row's RMSNorm factor, which each block takes itself (see
// kv_cache.cu's kv_append_normed): the decode step needs no norm kernel before gate/up.
template <typename T, int W, bool NORMED = false>
__device__ __forceinline__ void swiglu_forward_rows(T* __restrict__ h, const T* __restrict__ gu, int rows, int f,
                                                    const T* __restrict__ x = nullptr, int c = 0,
                                                    float eps = 0.f) {
    __shared__ float scratch[NORMED ? 32 : 1];
    const int groups = f / W, stride = gridDim.x * blockDim.x;
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        float scale = 1.f;
        if constexpr (NORMED) scale = row_rstd(x + (long long)row * c, c, eps, scratch);
        const T* gate = gu + 2LL * row * f;
        const T* up = gate + f;
        T* out = h + (long long)row * f;
        for (int g0 = blockIdx.x * blockDim.x + threadIdx.x; g0 < groups; g0 += SWIGLU_GROUPS * stride) {
            float a[SWIGLU_GROUPS][W], u[SWIGLU_GROUPS][W];
#pragma unroll
            for (int k = 0; k < SWIGLU_GROUPS; ++k) {
                const int g = g0 + k * stride;
                if (g < groups) {
                    swiglu_load<W>(gate + W * g, a[k]);
                    swiglu_load<W>(up + W * g, u[k]);
                }
            }
#pragma unroll
            for (int k = 0; k < SWIGLU_GROUPS; ++k) {
                const int g = g0 + k * stride;
                if (g >= groups) continue;
#pragma unroll
                for (int e = 0; e < W; ++e) {
                    if constexpr (NORMED) {
                        a[k][e] *= scale;
                        u[k][e] *= scale;
                    }
                    a[k][e] = a[k][e] * swiglu_sigmoid<T>(a[k][e]) * u[k][e];
                }
                swiglu_store<W>(out + W * g, a[k]);
            }
        }
    }
}

// dgu[row] = [dh * up * silu'(gate) | dh * silu(gate)], every element written.
template <typename T, int W>
__device__ __forceinline__ void swiglu_backward_rows(T* __restrict__ dgu, const T* __restrict__ gu,
                                                     const T* __restrict__ dh, int rows, int f) {
    const int groups = f / W, stride = gridDim.x * blockDim.x;
    for (int row = blockIdx.y; row < rows; row += gridDim.y) {
        const long long at = 2LL * row * f;
        const T* d_row = dh + (long long)row * f;
        for (int g0 = blockIdx.x * blockDim.x + threadIdx.x; g0 < groups; g0 += SWIGLU_GROUPS * stride) {
            float a[SWIGLU_GROUPS][W], u[SWIGLU_GROUPS][W], d[SWIGLU_GROUPS][W];
#pragma unroll
            for (int k = 0; k < SWIGLU_GROUPS; ++k) {
                const int g = g0 + k * stride;
                if (g < groups) {
                    swiglu_load<W>(gu + at + W * g, a[k]);
                    swiglu_load<W>(gu + at + f + W * g, u[k]);
                    swiglu_load<W>(d_row + W * g, d[k]);
                }
            }
#pragma unroll
            for (int k = 0; k < SWIGLU_GROUPS; ++k) {
                const int g = g0 + k * stride;
                if (g >= groups) continue;
#pragma unroll
                for (int e = 0; e < W; ++e) {
                    const float s = swiglu_sigmoid<T>(a[k][e]);
                    const float dgate = d[k][e] * u[k][e] * s * (1.0f + a[k][e] * (1.0f - s));
                    u[k][e] = d[k][e] * a[k][e] * s;  // dup
                    a[k][e] = dgate;
                }
                swiglu_store<W>(dgu + at + W * g, a[k]);
                swiglu_store<W>(dgu + at + f + W * g, u[k]);
            }
        }
    }
}

template <typename T> __device__ void swiglu_forward(T* h, const T* gu, int rows, int f) {
    if (f % 4 == 0 && aligned4(h) && aligned4(gu))
        swiglu_forward_rows<T, 4>(h, gu, rows, f);
    else
        swiglu_forward_rows<T, 1>(h, gu, rows, f);
}

template <typename T>
__device__ void swiglu_forward_normed(T* h, const T* gu, int rows, int f, const T* x, int c, float eps) {
    if (f % 4 == 0 && aligned4(h) && aligned4(gu))
        swiglu_forward_rows<T, 4, true>(h, gu, rows, f, x, c, eps);
    else
        swiglu_forward_rows<T, 1, true>(h, gu, rows, f, x, c, eps);
}

template <typename T> __device__ void swiglu_backward(T* dgu, const T* gu, const T* dh, int rows, int f) {
    if (f % 4 == 0 && aligned4(dgu) && aligned4(gu) && aligned4(dh))
        swiglu_backward_rows<T, 4>(dgu, gu, dh, rows, f);
    else
        swiglu_backward_rows<T, 1>(dgu, gu, dh, rows, f);
}

#define SWIGLU_KERNELS(T, SUFFIX)                                                                \
    extern "C" __global__ void swiglu_forward_##SUFFIX(T* h, const T* gu, int rows, int f) {     \
        swiglu_forward<T>(h, gu, rows, f);                                                       \
    }                                                                                             \
    extern "C" __global__ void swiglu_forward_normed_##SUFFIX(T* h, const T* gu, int rows, int f, \
                                                              const T* x, int c, float eps) {     \
        swiglu_forward_normed<T>(h, gu, rows, f, x, c, eps);                                     \
    }                                                                                             \
    extern "C" __global__ void swiglu_backward_##SUFFIX(T* dgu, const T* gu, const T* dh,        \
                                                        int rows, int f) {                       \
        swiglu_backward<T>(dgu, gu, dh, rows, f);                                                \
    }

SWIGLU_KERNELS(float, f32)
SWIGLU_KERNELS(bf16, bf16)
SWIGLU_KERNELS(f16, f16)
