// NF4 dequantisation; reference: engine/cpu/nf4.rs, layout: engine/quant/nf4.rs.
// out[i] = NF4[code_i] * absmax'_b for the 64-value block b holding i, where
// absmax'_b = map[absmax_codes[b]] * absmax_scales[b / 256] + offset, rounded after the
// multiply and after the add (no fused multiply-add: the CPU rounds twice too).
//
// Memory-bound: 4 bits read per value, 2 or 4 bytes written. Each thread expands one 32-bit
// word of packed codes (8 values) at a time, so a warp reads 128 contiguous bytes and writes
// 512 (bf16, f16: one 16-byte store per thread) or 1024 (f32: two); the grid is a few blocks
// per SM and every thread walks the words grid-stride, two words in flight at a time. The 16
// NF4 values and the 256-entry map sit in shared memory (lookups by code).

#define NF4_TABLES (16 + 256)

template <typename T> __device__ __forceinline__ void store8(T* p, const float v[8]);
template <> __device__ __forceinline__ void store8<float>(float* p, const float v[8]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
template <typename T> __device__ __forceinline__ void store8_16bit(T* p, const float v[8]) {
    unsigned int w[4];
    for (int k = 0; k < 4; ++k)
        w[k] = (unsigned int)store<T>(v[2 * k]).bits | ((unsigned int)store<T>(v[2 * k + 1]).bits << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}
template <> __device__ __forceinline__ void store8<bf16>(bf16* p, const float v[8]) { store8_16bit(p, v); }
template <> __device__ __forceinline__ void store8<f16>(f16* p, const float v[8]) { store8_16bit(p, v); }

// The 8 values of packed word w (bytes 4w..4w+3, little-endian; the high nibble of a byte is
// the even value) into out[8w..], the last word of the tensor only up to n.
template <typename T>
__device__ __forceinline__ void nf4_expand_word(T* out, long long w, unsigned int word, float absmax,
                                                const float* nf4, long long n, bool vec) {
    float v[8];
    for (int k = 0; k < 4; ++k) {
        const unsigned int byte = (word >> (8 * k)) & 0xffu;
        v[2 * k] = __fmul_rn(nf4[byte >> 4], absmax);
        v[2 * k + 1] = __fmul_rn(nf4[byte & 0xfu], absmax);
    }
    const long long e = 8 * w;
    if (vec && e + 8 <= n) {
        store8<T>(out + e, v);
    } else {
        for (int k = 0; k < 8; ++k)
            if (e + k < n) out[e + k] = store<T>(v[k]);
    }
}

template <typename T>
__device__ void nf4_dequantize(T* out, const unsigned int* packed, const unsigned char* absmax_codes,
                               const float* absmax_scales, const float* tables, float offset, long long n) {
    __shared__ float smem[NF4_TABLES];
    for (int i = threadIdx.x; i < NF4_TABLES; i += blockDim.x) smem[i] = tables[i];
    __syncthreads();
    const float* nf4 = smem;
    const float* map = smem + 16;
    const long long words = (n + 7) / 8;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const bool vec = ((unsigned long long)out % 16) == 0;
    // A block of 64 values is 8 words; a group of 256 blocks shares one scale.
    auto block_absmax = [&](long long w) {
        const long long b = w >> 3;
        return __fadd_rn(__fmul_rn(map[absmax_codes[b]], absmax_scales[b >> 8]), offset);
    };
    for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < words; w += 2 * stride) {
        const long long w2 = w + stride;
        const bool second = w2 < words;
        const unsigned int q = packed[w];
        const unsigned int q2 = second ? packed[w2] : 0u;
        nf4_expand_word(out, w, q, block_absmax(w), nf4, n, vec);
        if (second) nf4_expand_word(out, w2, q2, block_absmax(w2), nf4, n, vec);
    }
}

#define NF4_KERNEL(T, SUFFIX)                                                                      \
    extern "C" __global__ void nf4_dequantize_##SUFFIX(T* out, const unsigned int* packed,         \
                                                       const unsigned char* absmax_codes,          \
                                                       const float* absmax_scales,                 \
                                                       const float* tables, float offset,          \
                                                       long long n) {                              \
        nf4_dequantize<T>(out, packed, absmax_codes, absmax_scales, tables, offset, n);            \
    }

NF4_KERNEL(float, f32)
NF4_KERNEL(bf16, bf16)
NF4_KERNEL(f16, f16)
