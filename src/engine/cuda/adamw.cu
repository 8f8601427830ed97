// AdamW; reference: engine/cpu/adamw.rs. The fused kernel makes one pass per element: unscale
// and clip the gradient (grad_scale), update both moments, update the fp32 master weight and
// write the compute copy, for every tensor of a step in one launch. The arithmetic follows the CPU line by line; bias corrections come
// from the host, computed there exactly as the CPU does.
//
// The unfused kernels below it are the same update as five whole-tensor passes (the baseline
// of train.fused_kernels=false); both forms share the per-element functions.

struct AdamW {
    float lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale;
};

__device__ __forceinline__ float first_moment(float m, float g, const AdamW& h) {
    return h.beta1 * m + (1.0f - h.beta1) * g;
}
__device__ __forceinline__ float second_moment(float v, float g, const AdamW& h) {
    return h.beta2 * v + (1.0f - h.beta2) * g * g;
}
__device__ __forceinline__ float apply_step(float p, float m, float v, const AdamW& h) {
    const float m_hat = m / h.bc1;
    const float v_hat = v / h.bc2;
    return p - h.lr * (m_hat / (sqrtf(v_hat) + h.eps) + h.weight_decay * p);
}

// The fused step over many tensors in one launch. The host lists the tensors in a table in
// device memory; each owns ADAMW_CHUNK-element pieces, one block a piece, numbered from its
// first_block. A block finds its tensor by bisecting the table, then updates its piece: four
// elements an access where every pointer allows, one at a time otherwise. The per-element
// arithmetic is the single-tensor update's, so a parameter gets the same bits whatever else
// shares its launch.
#define ADAMW_CHUNK 16384

struct AdamWTensor {
    float* param;
    const float* grad;
    float* m;
    float* v;
    void* compute;  // the compute copy's elements (TC), or null
    long long n;
    long long first_block;
    float weight_decay;
    int pad;
};

__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v,
                                              const AdamW& h) {
    g *= h.grad_scale;
    m = first_moment(m, g, h);
    v = second_moment(v, g, h);
    p = apply_step(p, m, v, h);
}

template <typename TC, bool WRITE_COMPUTE>
__device__ void adamw_many(const AdamWTensor* table, int tensors, AdamW h) {
    const long long b = blockIdx.x;
    const AdamWTensor t = table_entry(table, tensors, b);
    h.weight_decay = t.weight_decay;
    TC* compute = reinterpret_cast<TC*>(t.compute);
    const long long start = (b - t.first_block) * ADAMW_CHUNK;
    const long long end = min(start + ADAMW_CHUNK, t.n);
    const bool wide = aligned4(t.param) && aligned4(t.grad) && aligned4(t.m) && aligned4(t.v) &&
                      (!WRITE_COMPUTE || aligned4(compute));
    // Pieces start at multiples of four, so whole groups of four run up to `wide_end`.
    const long long wide_end = wide ? start + ((end - start) & ~3LL) : start;
    for (long long i = start + 4 * threadIdx.x; i < wide_end; i += 4 * blockDim.x) {
        float p[4], g[4], m[4], v[4];
        load4(t.param + i, p);
        load4(t.grad + i, g);
        load4(t.m + i, m);
        load4(t.v + i, v);
        for (int k = 0; k < 4; ++k) adamw_element(p[k], g[k], m[k], v[k], h);
        store4(t.m + i, m);
        store4(t.v + i, v);
        store4(t.param + i, p);
        if (WRITE_COMPUTE) store4(compute + i, p);
    }
    for (long long i = wide_end + threadIdx.x; i < end; i += blockDim.x) {
        float p = t.param[i], m = t.m[i], v = t.v[i];
        adamw_element(p, t.grad[i], m, v, h);
        t.m[i] = m;
        t.v[i] = v;
        t.param[i] = p;
        if (WRITE_COMPUTE) compute[i] = store<TC>(p);
    }
}

extern "C" __global__ void adamw_many_master_only(const AdamWTensor* table, int tensors,
                                                  AdamW h) {
    adamw_many<float, false>(table, tensors, h);
}
extern "C" __global__ void adamw_many_compute_f32(const AdamWTensor* table, int tensors, AdamW h) {
    adamw_many<float, true>(table, tensors, h);
}
extern "C" __global__ void adamw_many_compute_bf16(const AdamWTensor* table, int tensors,
                                                   AdamW h) {
    adamw_many<bf16, true>(table, tensors, h);
}
extern "C" __global__ void adamw_many_compute_f16(const AdamWTensor* table, int tensors, AdamW h) {
    adamw_many<f16, true>(table, tensors, h);
}

#define GRID_STRIDE(i, n)                                                                      \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);             \
         i += (long long)gridDim.x * blockDim.x)

// The unfused passes, in the order the host launches them.
extern "C" __global__ void adamw_scale_grad(float* scaled, const float* grad, long long n,
                                            AdamW h) {
    GRID_STRIDE(i, n) scaled[i] = grad[i] * h.grad_scale;
}
extern "C" __global__ void adamw_first_moment(float* m, const float* scaled, long long n,
                                              AdamW h) {
    GRID_STRIDE(i, n) m[i] = first_moment(m[i], scaled[i], h);
}
extern "C" __global__ void adamw_second_moment(float* v, const float* scaled, long long n,
                                               AdamW h) {
    GRID_STRIDE(i, n) v[i] = second_moment(v[i], scaled[i], h);
}
extern "C" __global__ void adamw_apply(float* param, const float* m, const float* v,
                                       long long n, AdamW h) {
    GRID_STRIDE(i, n) param[i] = apply_step(param[i], m[i], v[i], h);
}
template <typename TC> __device__ void round_compute(TC* compute, const float* param, long long n) {
    GRID_STRIDE(i, n) compute[i] = store<TC>(param[i]);
}
extern "C" __global__ void adamw_round_compute_f32(float* c, const float* p, long long n) {
    round_compute<float>(c, p, n);
}
extern "C" __global__ void adamw_round_compute_bf16(bf16* c, const float* p, long long n) {
    round_compute<bf16>(c, p, n);
}
extern "C" __global__ void adamw_round_compute_f16(f16* c, const float* p, long long n) {
    round_compute<f16>(c, p, n);
}
