// AdamW; reference: engine/cpu/adamw.rs. The fused kernel makes one pass per element: unscale
// and clip the gradient (grad_scale), update both moments, update the fp32 master weight and
// write the compute copy. The arithmetic follows the CPU line by line; bias corrections come
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

#define GRID_STRIDE(i, n)                                                                      \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n);             \
         i += (long long)gridDim.x * blockDim.x)

template <typename TC, bool WRITE_COMPUTE>
__device__ void adamw(float* param, const float* grad, float* m, float* v, TC* compute,
                      long long n, AdamW h) {
    GRID_STRIDE(i, n) {
        const float g = grad[i] * h.grad_scale;
        const float mi = first_moment(m[i], g, h);
        const float vi = second_moment(v[i], g, h);
        const float p = apply_step(param[i], mi, vi, h);
        m[i] = mi;
        v[i] = vi;
        param[i] = p;
        if (WRITE_COMPUTE) compute[i] = store<TC>(p);
    }
}

extern "C" __global__ void adamw_master_only(float* param, const float* grad, float* m, float* v,
                                             long long n, AdamW h) {
    adamw<float, false>(param, grad, m, v, nullptr, n, h);
}
extern "C" __global__ void adamw_compute_f32(float* param, const float* grad, float* m, float* v,
                                             float* compute, long long n, AdamW h) {
    adamw<float, true>(param, grad, m, v, compute, n, h);
}
extern "C" __global__ void adamw_compute_bf16(float* param, const float* grad, float* m, float* v,
                                              bf16* compute, long long n, AdamW h) {
    adamw<bf16, true>(param, grad, m, v, compute, n, h);
}
extern "C" __global__ void adamw_compute_f16(float* param, const float* grad, float* m, float* v,
                                             f16* compute, long long n, AdamW h) {
    adamw<f16, true>(param, grad, m, v, compute, n, h);
}

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
