// Causal multi-head attention, forward and backward, without ever storing the T x T matrix.
//
// Layout matches the CPU kernel (engine/cpu/attention.rs): qkv is [B, T, 3C] with Q, K, V side
// by side and head h in columns h*HS .. (h+1)*HS of each; out is [B, T, C]. The forward keeps
// one log-sum-exp per row (lse, [B, NH, T]); the backward recomputes the probabilities from it.
//
// Scheme (FlashAttention's online softmax, one query row per thread): a block owns BR query rows
// of one (batch, head); it streams K and V through shared memory in tiles of BC rows, keeping
// the row's running max, running sum and output accumulator in registers. Every thread of a
// warp reads the same shared K/V element at once, which the hardware broadcasts.
//
// The backward is deterministic: no floating-point atomics. dQ comes from a query-parallel
// kernel; dK and dV from a key-parallel kernel whose thread owns one key row. Each recomputes
// the probabilities it needs.
//
// The head size HS is a template parameter (the per-thread rows live in registers); the
// extern "C" entry points at the end instantiate the sizes kiln supports.
//
// A sliding window W > 0 limits query i to keys j with i - W < j <= i (W = 0: none). Key tiles
// wholly before a block's first window are never loaded; within a tile each row skips the keys
// outside its own window. Without a window, or with one at least T long, every loop runs as
// without the window, so the results are the same bit for bit.

#define BR 64
#define BC 32
#define KR 32  // key rows per block in the dK/dV kernel

// The first key row `row` attends to under the window W (0: none).
__device__ __forceinline__ int window_first_key(int row, int W) {
    return W > 0 ? max(0, row - W + 1) : 0;
}

template <int HS, typename E>
__device__ void attention_forward_impl(const E* __restrict__ qkv, E* __restrict__ out,
                                             float* __restrict__ lse, int T, int C, int NH, int W) {
    __shared__ float ks[BC][HS];
    __shared__ float vs[BC][HS];
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int row = blockIdx.x * BR + threadIdx.x;
    const bool active = row < T;
    const float scale = rsqrtf((float)HS);
    const size_t stride = 3 * (size_t)C;
    const E* base = qkv + (size_t)b * T * stride + h * HS;

    float q[HS], o[HS];
    float m = KILN_NEG_INF, l = 0.0f;
    #pragma unroll
    for (int i = 0; i < HS; i++) {
        q[i] = active ? load(base[row * stride + i]) * scale : 0.0f;
        o[i] = 0.0f;
    }
    const int last = min(T - 1, (int)(blockIdx.x * BR + BR - 1));
    const int lo = window_first_key(row, W);
    // The first tile holding a key of the block's first row's window.
    const int first = window_first_key(blockIdx.x * BR, W) / BC * BC;
    for (int k0 = first; k0 <= last; k0 += BC) {
        for (int idx = threadIdx.x; idx < BC * HS; idx += BR) {
            int r = idx / HS, c = idx % HS, kr = k0 + r;
            ks[r][c] = kr < T ? load(base[kr * stride + C + c]) : 0.0f;
            vs[r][c] = kr < T ? load(base[kr * stride + 2 * C + c]) : 0.0f;
        }
        __syncthreads();
        // A row computes on a tile only if one of its keys is in the row's window, so the
        // tile's max is finite.
        if (active && k0 <= row && k0 + BC > lo) {
            const int n = min(BC, row - k0 + 1);
            const int j0 = max(0, lo - k0);
            float s[BC];
            float tile_max = KILN_NEG_INF;
            #pragma unroll
            for (int j = 0; j < BC; j++) {
                float dot = 0.0f;
                if (j >= j0 && j < n) {
                    #pragma unroll
                    for (int i = 0; i < HS; i++) dot += q[i] * ks[j][i];
                    tile_max = fmaxf(tile_max, dot);
                }
                s[j] = dot;
            }
            const float m_new = fmaxf(m, tile_max);
            const float corr = __expf(m - m_new);
            l *= corr;
            #pragma unroll
            for (int i = 0; i < HS; i++) o[i] *= corr;
            #pragma unroll
            for (int j = 0; j < BC; j++) {
                if (j >= j0 && j < n) {
                    const float p = __expf(s[j] - m_new);
                    l += p;
                    #pragma unroll
                    for (int i = 0; i < HS; i++) o[i] += p * vs[j][i];
                }
            }
            m = m_new;
        }
        __syncthreads();
    }
    if (active) {
        const float inv = 1.0f / l;
        E* dst = out + ((size_t)b * T + row) * C + h * HS;
        #pragma unroll
        for (int i = 0; i < HS; i++) dst[i] = store<E>(o[i] * inv);
        lse[((size_t)b * NH + h) * T + row] = m + __logf(l);
    }
}

// dQ: one query row per thread; writes the Q third of dqkv, and d (one value per row) for the
// dK/dV kernel. d_i = sum_j P_ij dP_ij is the softmax backward's row term. It equals
// dO_i . O_i, but computing it from a bf16-rounded O cancels badly in dP - d, so a first pass
// over the keys computes it exactly from the recomputed probabilities.
template <int HS, typename E>
__device__ void attention_backward_dq_impl(const E* __restrict__ qkv, const E* __restrict__ dout,
                                                 const float* __restrict__ lse, float* __restrict__ d,
                                                 E* __restrict__ dqkv, int T, int C, int NH, int W) {
    __shared__ float ks[BC][HS];
    __shared__ float vs[BC][HS];
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int row = blockIdx.x * BR + threadIdx.x;
    const bool active = row < T;
    const float scale = rsqrtf((float)HS);
    const size_t stride = 3 * (size_t)C;
    const E* base = qkv + (size_t)b * T * stride + h * HS;
    const E* dy = dout + ((size_t)b * T + row) * C + h * HS;

    float q[HS], g[HS], dq[HS];
    #pragma unroll
    for (int i = 0; i < HS; i++) {
        q[i] = active ? load(base[row * stride + i]) * scale : 0.0f;
        g[i] = active ? load(dy[i]) : 0.0f;
        dq[i] = 0.0f;
    }
    const size_t r = ((size_t)b * NH + h) * T + row;
    const float row_lse = active ? lse[r] : 0.0f;
    float row_d = 0.0f;
    const int last = min(T - 1, (int)(blockIdx.x * BR + BR - 1));
    const int lo = window_first_key(row, W);
    const int first = window_first_key(blockIdx.x * BR, W) / BC * BC;
    for (int pass = 0; pass < 2; pass++) {
        float d_acc = 0.0f;
        for (int k0 = first; k0 <= last; k0 += BC) {
            for (int idx = threadIdx.x; idx < BC * HS; idx += BR) {
                int rr = idx / HS, c = idx % HS, kr = k0 + rr;
                ks[rr][c] = kr < T ? load(base[kr * stride + C + c]) : 0.0f;
                vs[rr][c] = kr < T ? load(base[kr * stride + 2 * C + c]) : 0.0f;
            }
            __syncthreads();
            if (active && k0 <= row) {
                const int n = min(BC, row - k0 + 1);
                for (int j = max(0, lo - k0); j < n; j++) {
                    float s = 0.0f, dp = 0.0f;
                    #pragma unroll
                    for (int i = 0; i < HS; i++) {
                        s += q[i] * ks[j][i];
                        dp += g[i] * vs[j][i];
                    }
                    const float p = __expf(s - row_lse);
                    if (pass == 0) {
                        d_acc += p * dp;
                    } else {
                        const float ds = p * (dp - row_d);
                        #pragma unroll
                        for (int i = 0; i < HS; i++) dq[i] += ds * ks[j][i];
                    }
                }
            }
            __syncthreads();
        }
        if (pass == 0) row_d = d_acc;
    }
    if (active) {
        d[r] = row_d;
        E* dst = dqkv + ((size_t)b * T + row) * stride + h * HS;
        #pragma unroll
        for (int i = 0; i < HS; i++) dst[i] = store<E>(dq[i] * scale);
    }
}

// dK and dV: one key row per thread, accumulators in padded shared memory (a register file
// could not hold k, v, dk and dv together); writes the K and V thirds of dqkv.
template <int HS, typename E>
__device__ void attention_backward_dkv_impl(const E* __restrict__ qkv, const E* __restrict__ dout,
                                                  const float* __restrict__ lse, const float* __restrict__ d,
                                                  E* __restrict__ dqkv, int T, int C, int NH, int W) {
    __shared__ float qs[BC][HS];
    __shared__ float gs[BC][HS];
    __shared__ float lses[BC], ds_[BC];
    __shared__ float dk[KR][HS + 1];
    __shared__ float dv[KR][HS + 1];
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int key = blockIdx.x * KR + threadIdx.x;
    const bool active = key < T;
    const float scale = rsqrtf((float)HS);
    const size_t stride = 3 * (size_t)C;
    const E* base = qkv + (size_t)b * T * stride + h * HS;
    const E* gbase = dout + (size_t)b * T * C + h * HS;

    float k[HS], v[HS];
    #pragma unroll
    for (int i = 0; i < HS; i++) {
        k[i] = active ? load(base[key * stride + C + i]) * scale : 0.0f;
        v[i] = active ? load(base[key * stride + 2 * C + i]) : 0.0f;
        dk[threadIdx.x][i] = 0.0f;
        dv[threadIdx.x][i] = 0.0f;
    }
    const int first = blockIdx.x * KR;
    // Queries past the block's last key's window see none of its keys.
    const int end = W > 0 ? min(T, first + KR - 1 + W) : T;
    for (int q0 = (first / BC) * BC; q0 < end; q0 += BC) {
        for (int idx = threadIdx.x; idx < BC * HS; idx += KR) {
            int rr = idx / HS, c = idx % HS, qr = q0 + rr;
            qs[rr][c] = qr < T ? load(base[qr * stride + c]) : 0.0f;
            gs[rr][c] = qr < T ? load(gbase[qr * C + c]) : 0.0f;
        }
        for (int rr = threadIdx.x; rr < BC; rr += KR) {
            int qr = q0 + rr;
            size_t r = ((size_t)b * NH + h) * T + qr;
            lses[rr] = qr < T ? lse[r] : 0.0f;
            ds_[rr] = qr < T ? d[r] : 0.0f;
        }
        __syncthreads();
        if (active) {
            for (int j = 0; j < BC; j++) {
                const int qr = q0 + j;
                if (qr < key || qr >= T || (W > 0 && qr - key >= W)) continue;
                float s = 0.0f, dp = 0.0f;
                #pragma unroll
                for (int i = 0; i < HS; i++) {
                    s += qs[j][i] * k[i];
                    dp += gs[j][i] * v[i];
                }
                const float p = __expf(s - lses[j]);
                const float ds = p * (dp - ds_[j]);
                #pragma unroll
                for (int i = 0; i < HS; i++) {
                    dv[threadIdx.x][i] += p * gs[j][i];
                    dk[threadIdx.x][i] += ds * qs[j][i];
                }
            }
        }
        __syncthreads();
    }
    if (active) {
        E* dst = dqkv + ((size_t)b * T + key) * stride + h * HS;
        #pragma unroll
        for (int i = 0; i < HS; i++) {
            dst[C + i] = store<E>(dk[threadIdx.x][i] * scale);
            dst[2 * C + i] = store<E>(dv[threadIdx.x][i]);
        }
    }
}

// Entry points: one per element type and supported head size. Each element type is its own
// NVRTC program (see attention.rs), so a first start compiles them in parallel. 128 would need smaller tiles
// in the dK/dV kernel to stay inside 48 KiB of static shared memory.
#define ATTENTION_ENTRY_POINTS(HS, E, SUFFIX)                                                        \
    extern "C" __global__ void __launch_bounds__(BR) attention_forward_##SUFFIX##_hs##HS(            \
        const E* qkv, E* out, float* lse, int T, int C, int NH, int W) {                             \
        attention_forward_impl<HS, E>(qkv, out, lse, T, C, NH, W);                                   \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(BR) attention_backward_dq_##SUFFIX##_hs##HS(        \
        const E* qkv, const E* dout, const float* lse, float* d, E* dqkv, int T, int C,              \
        int NH, int W) {                                                                             \
        attention_backward_dq_impl<HS, E>(qkv, dout, lse, d, dqkv, T, C, NH, W);                     \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(KR) attention_backward_dkv_##SUFFIX##_hs##HS(       \
        const E* qkv, const E* dout, const float* lse, const float* d, E* dqkv, int T, int C,        \
        int NH, int W) {                                                                             \
        attention_backward_dkv_impl<HS, E>(qkv, dout, lse, d, dqkv, T, C, NH, W);                    \
    }
