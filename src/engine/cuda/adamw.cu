// Fused AdamW; reference: engine/cpu/adamw.rs. One pass per element: unscale and clip the
// gradient (grad_scale), update both moments, update the fp32 master weight and write the
// compute copy. The arithmetic follows the CPU line by line; bias corrections come from the
// host, computed there exactly as the CPU does.

struct AdamW {
    float lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale;
};

template <typename TC, bool WRITE_COMPUTE>
__device__ void adamw(float* param, const float* grad, float* m, float* v, TC* compute,
                      long long n, AdamW h) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = grad[i] * h.grad_scale;
        const float mi = h.beta1 * m[i] + (1.0f - h.beta1) * g;
        const float vi = h.beta2 * v[i] + (1.0f - h.beta2) * g * g;
        const float m_hat = mi / h.bc1;
        const float v_hat = vi / h.bc2;
        float p = param[i];
        p -= h.lr * (m_hat / (sqrtf(v_hat) + h.eps) + h.weight_decay * p);
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
