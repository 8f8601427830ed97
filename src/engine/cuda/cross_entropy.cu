// Softmax cross-entropy over the vocabulary, backward fused in place; reference:
// engine/cpu/cross_entropy.rs. One block per row: each thread keeps a running (max, sum of
// exp) over its strided share of the row (an online softmax, so the row is read once before
// the write pass), then the block combines them. No copy of the logits is made.

template <typename T, bool WRITE_GRAD>
__device__ void cross_entropy(float* losses, T* logits, const unsigned int* targets, int v,
                              float grad_scale) {
    __shared__ float scratch[32];
    T* row = logits + (long long)blockIdx.x * v;
    const unsigned int t = targets[blockIdx.x];
    // Read before any thread overwrites the row (the reductions below are barriers).
    const float target_logit = (threadIdx.x == 0 && t < (unsigned int)v) ? load(row[t]) : 0.f;
    float m = KILN_NEG_INF, s = 0.f;
    for (int i = threadIdx.x; i < v; i += blockDim.x) {
        const float x = load(row[i]);
        if (x > m) {
            s = s * expf(m - x) + 1.f;
            m = x;
        } else if (x != KILN_NEG_INF) {  // a masked logit adds nothing (and -inf - -inf is NaN)
            s += expf(x - m);  // a NaN logit lands here and poisons the sum, as it should
        }
    }
    const float row_max = block_max(m, scratch);
    // A thread that saw no finite value contributes nothing (and must not form -inf - -inf).
    const float total = block_sum(m == KILN_NEG_INF ? 0.f : s * expf(m - row_max), scratch);
    const float lse = row_max + logf(total);
    if (threadIdx.x == 0) {
        // An out-of-range target has no loss to give; NaN makes the bad input visible.
        losses[blockIdx.x] = t < (unsigned int)v ? lse - target_logit : KILN_NAN;
    }
    if (WRITE_GRAD) {
        for (int i = threadIdx.x; i < v; i += blockDim.x) {
            const float p = expf(load(row[i]) - lse) * grad_scale;
            row[i] = store<T>((unsigned int)i == t ? p - grad_scale : p);
        }
    }
}

extern "C" __global__ void cross_entropy_forward_f32(float* losses, const float* logits,
                                                     const unsigned int* targets, int v) {
    cross_entropy<float, false>(losses, const_cast<float*>(logits), targets, v, 0.f);
}
extern "C" __global__ void cross_entropy_forward_bf16(float* losses, const bf16* logits,
                                                      const unsigned int* targets, int v) {
    cross_entropy<bf16, false>(losses, const_cast<bf16*>(logits), targets, v, 0.f);
}
extern "C" __global__ void cross_entropy_fused_f32(float* losses, float* logits,
                                                   const unsigned int* targets, int v, float grad_scale) {
    cross_entropy<float, true>(losses, logits, targets, v, grad_scale);
}
extern "C" __global__ void cross_entropy_fused_bf16(float* losses, bf16* logits,
                                                    const unsigned int* targets, int v, float grad_scale) {
    cross_entropy<bf16, true>(losses, logits, targets, v, grad_scale);
}
