// Shared by every kiln kernel (prepended to each program's source): element storage and
// block-wide reductions. No CUDA headers are included, so NVRTC needs no include path.

// bf16 as its raw bits: converting by hand matches the CPU's rounding (round to nearest even,
// NaN stays NaN) bit for bit, and avoids depending on cuda_bf16.h being available to NVRTC.
#define KILN_NEG_INF __int_as_float(0xff800000)
#define KILN_NAN __int_as_float(0x7fc00000)

__device__ __forceinline__ bool is_finite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

struct bf16 {
    unsigned short bits;
};

// IEEE half as its raw bits, converted with the hardware's cvt (round to nearest even,
// overflow to inf), which is what the CPU's `half::f16::from_f32` does too.
struct f16 {
    unsigned short bits;
};

__device__ __forceinline__ float load(float x) { return x; }
__device__ __forceinline__ float load(bf16 x) { return __uint_as_float(((unsigned int)x.bits) << 16); }
__device__ __forceinline__ float load(f16 x) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x.bits));
    return r;
}

template <typename T> __device__ __forceinline__ T store(float x);
template <> __device__ __forceinline__ float store<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 store<bf16>(float x) {
    unsigned int u = __float_as_uint(x);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (unsigned short)(u >> 16);
    return r;
}
template <> __device__ __forceinline__ f16 store<f16>(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

// Four consecutive elements in one access (16 bytes of f32, 8 of bf16 or f16): elementwise kernels
// move several times the bytes per instruction this way. `aligned4` says whether a pointer
// allows it; kernels fall back to single elements when one does not.
template <typename T> __device__ __forceinline__ bool aligned4(const T* p) {
    return ((unsigned long long)p % (4 * sizeof(T))) == 0;
}

// A group of 4 elements as loaded (load_raw4), not yet widened to f32 (unpack4); load4 does
// both at once. The pipelined norm backwards load the next rows' groups raw and widen them
// only when they use them, so that no instruction waits on the loads while the current rows
// are worked on.
template <typename T> struct Raw4 { uint2 q; };  // bf16, f16: 8 bytes
template <> struct Raw4<float> { float4 q; };
template <typename T> __device__ __forceinline__ void load_raw4(const T* p, Raw4<T>& r) {
    r.q = *reinterpret_cast<const decltype(r.q)*>(p);
}
__device__ __forceinline__ void unpack4(const Raw4<float>& r, float v[4]) {
    v[0] = r.q.x; v[1] = r.q.y; v[2] = r.q.z; v[3] = r.q.w;
}
__device__ __forceinline__ void unpack4(const Raw4<bf16>& r, float v[4]) {
    v[0] = __uint_as_float(r.q.x << 16); v[1] = __uint_as_float(r.q.x & 0xffff0000u);
    v[2] = __uint_as_float(r.q.y << 16); v[3] = __uint_as_float(r.q.y & 0xffff0000u);
}
__device__ __forceinline__ void unpack4(const Raw4<f16>& r, float v[4]) {
    f16 h[4];
    h[0].bits = (unsigned short)(r.q.x & 0xffffu); h[1].bits = (unsigned short)(r.q.x >> 16);
    h[2].bits = (unsigned short)(r.q.y & 0xffffu); h[3].bits = (unsigned short)(r.q.y >> 16);
    for (int k = 0; k < 4; ++k) v[k] = load(h[k]);
}

// Four elements, widened to f32 as they arrive.
template <typename T> __device__ __forceinline__ void load4(const T* p, float v[4]) {
    Raw4<T> r;
    load_raw4(p, r);
    unpack4(r, v);
}

// A 16-byte piece of a vector as f32: 8 elements of bf16 or f16, 4 of f32.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4 u, float* x) {
    if constexpr (sizeof(T) == 4) {
        x[0] = __uint_as_float(u.x);
        x[1] = __uint_as_float(u.y);
        x[2] = __uint_as_float(u.z);
        x[3] = __uint_as_float(u.w);
    } else {
        unpack4(Raw4<T>{make_uint2(u.x, u.y)}, x);
        unpack4(Raw4<T>{make_uint2(u.z, u.w)}, x + 4);
    }
}

// Eight elements of a vector at p into f32: one 16-byte access in bf16 and f16, two in f32
// (`wide`: p is 16-byte aligned), else one element at a time.
template <typename T>
__device__ __forceinline__ void load8_at(const T* p, bool wide, float x[8]) {
    if (wide) {
        constexpr int PER = 16 / (int)sizeof(T);  // elements a piece
#pragma unroll
        for (int k = 0; k < 8 / PER; ++k) unpack16<T>(reinterpret_cast<const uint4*>(p)[k], x + k * PER);
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) x[j] = load(p[j]);
    }
}

__device__ __forceinline__ void store4(float* p, const float v[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store4(bf16* p, const float v[4]) {
    uint2 q;
    q.x = (unsigned int)store<bf16>(v[0]).bits | ((unsigned int)store<bf16>(v[1]).bits << 16);
    q.y = (unsigned int)store<bf16>(v[2]).bits | ((unsigned int)store<bf16>(v[3]).bits << 16);
    *reinterpret_cast<uint2*>(p) = q;
}
__device__ __forceinline__ void store4(f16* p, const float v[4]) {
    uint2 q;
    q.x = (unsigned int)store<f16>(v[0]).bits | ((unsigned int)store<f16>(v[1]).bits << 16);
    q.y = (unsigned int)store<f16>(v[2]).bits | ((unsigned int)store<f16>(v[3]).bits << 16);
    *reinterpret_cast<uint2*>(p) = q;
}

// The register cap of the fused norm backwards on 16-bit rows: at 80 registers a thread two
// blocks of 384 threads (4 rows of GPT-2's 768 or SmolLM2's 576 channels) share an SM, which
// their pipelined rows need to keep enough loads in flight. f32 rows (twice the registers a
// group) keep the compiler's choice.
#define LN_BWD_REGS __maxnreg__(80)

// The pipelined norm backwards' next round: this thread's groups of row `row` of dout and x,
// as loaded, and the row's rstd, where the row is one of the block's (below `end`).
template <typename T, int GROUPS>
__device__ __forceinline__ void norm_fetch_row(const T* dout, const T* x, const float* rstd, int row,
                                               int end, int c, int ldd, Raw4<T> (&nd)[GROUPS],
                                               Raw4<T> (&nx)[GROUPS], float& nr) {
    if (row >= end) return;
    const long long off = (long long)row * c;
    nr = rstd[row];
    for (int k = 0; k < GROUPS; ++k) {
        const int g = threadIdx.x + k * blockDim.x;
        if (g >= c / 4) continue;
        load_raw4(dout + (long long)row * ldd + 4 * g, nd[k]);
        load_raw4(x + off + 4 * g, nx[k]);
    }
}

// The 4 elements of a norm's input row at `at`: x's, or with RESIDUAL x + delta rounded to T
// and stored into `sum` (the rounded sum is what the norm normalises and the backward reads,
// so forward and backward agree in bf16 and f16).
template <typename T, bool RESIDUAL>
__device__ __forceinline__ void load4_residual(float v[4], const T* x, const T* delta, T* sum,
                                               long long at) {
    load4(x + at, v);
    if (RESIDUAL) {
        float d[4];
        load4(delta + at, d);
        for (int j = 0; j < 4; ++j) v[j] = load(store<T>(v[j] + d[j]));
        store4(sum + at, v);
    }
}

template <typename F> __device__ __forceinline__ F warp_sum(F v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block, returned to every thread. blockDim.x must be a multiple of 32.
// `scratch` holds 32 values; the leading barrier lets one scratch serve consecutive calls.
template <typename F> __device__ F block_sum(F v, F* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? scratch[lane] : F(0));
}

// 1 / sqrt(mean(x^2) + eps) over a row of c values (RMSNorm's scale), computed by the whole
// block: every thread must call it. The decode step's consumers of an unnormalised stream
// (the cache append, SwiGLU) take it themselves instead of a norm kernel before them.
template <typename T> __device__ float row_rstd(const T* x, int c, float eps, float* scratch) {
    float acc = 0.f;
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float v = load(x[i]);
        acc = fmaf(v, v, acc);
    }
    return 1.0f / sqrtf(block_sum(acc, scratch) / c + eps);
}

__device__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? scratch[lane] : KILN_NEG_INF);
}

// The entry of `table` (n entries, first_block ascending) that block b works for: the last
// whose first_block is at or before b. The one-launch kernels over many tensors (AdamW, the
// gradient norm) list their tensors this way, each with the blocks from its first_block on.
template <typename E> __device__ __forceinline__ E table_entry(const E* table, int n, long long b) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (table[mid].first_block <= b) lo = mid; else hi = mid - 1;
    }
    return table[lo];
}

// The last step of a fused norm backward (rmsnorm.cu, layernorm.cu): each threadIdx.y lane's
// threads hold sums for their columns (group g = threadIdx.x + k * blockDim.x, 4 columns a
// group, c / 4 groups); the lanes add them into `chunk` (c floats of shared memory) in lane
// order, so the result is the same on every run, and the block writes the total to dst[0, c).
template <int GROUPS>
__device__ void add_lanes_in_order(float* chunk, const float (&v)[GROUPS][4], int c, float* dst) {
    const int groups = c / 4;
    for (int l = 0; l < (int)blockDim.y; ++l) {
        if ((int)threadIdx.y == l) {
            for (int k = 0; k < GROUPS; ++k) {
                const int g = threadIdx.x + k * blockDim.x;
                if (g >= groups) continue;
                for (int j = 0; j < 4; ++j)
                    chunk[4 * g + j] = l == 0 ? v[k][j] : chunk[4 * g + j] + v[k][j];
            }
        }
        __syncthreads();
    }
    for (int i = threadIdx.x + threadIdx.y * blockDim.x; i < c; i += blockDim.x * blockDim.y)
        dst[i] = chunk[i];
}

// Overlapped launches (programmatic dependent launch, sm_90). A decode step is a chain of
// small kernels, each needing the one before; launched overlapped (CudaBackend's
// launch_overlapped), a kernel's blocks may start while the previous kernel still runs, fetch
// their weights into L2 (L2 is where every SM's writes land, so a fetch there is never
// stale) and then wait here. Every kernel that can be launched so calls grid_wait_for_previous
// before it reads an input or writes anything; launched plainly, the wait returns at once.
// Its blocks then let the next overlapped kernel start, only after the wait, so the previous
// kernel's own predecessor has finished before anything after it starts.
__device__ __forceinline__ void grid_wait_for_previous() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_let_next_start() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
// Both, in order: a kernel with nothing to do before its inputs are ready.
__device__ __forceinline__ void grid_chain() {
    grid_wait_for_previous();
    grid_let_next_start();
}
// 16 bytes from global `src` to shared `dst` (both 16-byte aligned), asynchronously and past
// the L1 (cp.async.cg). Before grid_wait_for_previous it may read what the previous kernel does
// not write: the kernels before that one have finished by then (see above) and their writes
// are in L2, though an SM's L1 may still hold older copies. Wait for a block's copies with
// copy_async_wait_all (or a committed group's) and then __syncthreads.
__device__ __forceinline__ void copy_async16(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
    const unsigned int at = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(at), "l"(src) : "memory");
#else
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}
// The same copy, or with `in` false zeros that read nothing (source size 0; the address must
// still be a valid one): rows past the end of a tile.
__device__ __forceinline__ void copy_async16(void* dst, const void* src, bool in) {
#if __CUDA_ARCH__ >= 800
    const unsigned int at = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(at), "l"(src), "r"(in ? 16 : 0));
#else
    *reinterpret_cast<uint4*>(dst) = in ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
#endif
}
__device__ __forceinline__ void copy_async_wait_all() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
// `bytes` (a multiple of 16) from `p` (16-byte aligned) fetched into L2, not waited for.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned int bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}
