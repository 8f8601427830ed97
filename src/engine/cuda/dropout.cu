// Inverted dropout; reference: engine/cpu/dropout.rs (the same SplitMix64 integers, so both
// devices drop the same elements). Elementwise, grid-stride.

__device__ __forceinline__ unsigned long long dropout_mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

template <typename T>
__device__ void dropout(T* out, const T* x, long long n, unsigned long long seed, unsigned threshold, float scale) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned long long h = dropout_mix(seed + ((unsigned long long)i + 1ull) * 0x9E3779B97F4A7C15ull);
        const bool keep = (unsigned)(h >> 32) >= threshold;
        out[i] = store<T>(keep ? load(x[i]) * scale : 0.0f);
    }
}

extern "C" __global__ void dropout_f32(float* out, const float* x, long long n, unsigned long long seed, unsigned threshold, float scale) {
    dropout(out, x, n, seed, threshold, scale);
}
extern "C" __global__ void dropout_bf16(bf16* out, const bf16* x, long long n, unsigned long long seed, unsigned threshold, float scale) {
    dropout(out, x, n, seed, threshold, scale);
}
extern "C" __global__ void dropout_f16(f16* out, const f16* x, long long n, unsigned long long seed, unsigned threshold, float scale) {
    dropout(out, x, n, seed, threshold, scale);
}
