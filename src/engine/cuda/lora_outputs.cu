// Low-rank adapters' outputs on tensor cores: for every adapter a of a layer, in one launch,
// y[:, block_a] = beta * y[:, block_a] + s_a * H[:, k_a] B_a^T, where H = x [A_1; A_2; ...]^T
// holds the adapters' rank-r projections side by side. Reference: the adapters' products in
// nn/lora.rs (add_outputs, one GEMM an adapter), engine/cpu/gemm.rs. Needs attention_tc.cu's
// TcBf16 / TcF16 (mma and conversions) before it.
//
// Why: with k = r (8 to 64) these products are all output bytes. cuBLASLt wrote them at about
// 2.5 TB/s on an H200 (the gate and up outputs of the Llama-3.2-1B shape, 128 MiB each, 52 us)
// and took a launch and a ramp an adapter (q, k and v one each). Here one launch writes every
// adapter's columns, each block walking many row tiles with its B tile held in shared memory,
// and the outputs staged through shared memory so that each store instruction writes whole
// 128-byte rows.
//
// Layout of the work. A block owns LO_COLS = 128 columns of one adapter (grid x: the
// adapters' column tiles in turn) and walks row tiles of LO_ROWS = 64 (grid y strides over
// them), warp w taking rows 16w .. 16w + 15 of each. The block's B tile (128 rows of r values)
// is loaded into shared memory once, so a row tile reads from global memory only its rows of
// H and, with beta 1, the old outputs. H's rows are the mma's A operand (m16n8k16: a[0] row g,
// k 2t..2t+1; a[1] row g + 8; a[2] row g, k 2t + 8..2t + 9; a[3] row g + 8, k 2t + 8..) and
// B's rows its B operand (b0 = B[n = g][k 2t..2t+1], b1 = B[g][2t + 8..]: B is [cols, r]
// row-major, so B^T's column n is B's row n), sixteen 8-column tiles a warp, r / 16 steps. The
// accumulators (c0, c1 at row g, columns 2t, 2t + 1; c2, c3 at row g + 8) go to the warp's
// slice of shared memory in f32, half a tile (64 columns) at a time; each lane then takes
// pieces of four columns of a row (a row's 16 pieces are 16 adjacent lanes, so a warp's store
// covers two rows' 128 bytes each), adds the old values it loaded before the products (beta
// 1), scales, rounds and stores. The sums are the mma's, in a fixed order: the same inputs
// give the same bits.
//
// The launcher checks what the layout needs: rank a multiple of 16 up to 64, every adapter's
// first column and width and y's row stride multiples of 4, H's row stride even, at most
// LO_MAX_ADAPTERS adapters, sm_80 or newer (elsewhere the body compiles to nothing and is never
// launched).

#define LO_MAX_ADAPTERS 8
#define LO_ROWS 64
#define LO_COLS 128
#define LO_HALF (LO_COLS / 2)
#define LO_WARPS (LO_ROWS / 16)
#define LO_MAX_RANK 64
// Row strides in shared memory, padded so that the mma's operand reads (B: rows g, words t;
// 36 words a row) and the accumulators' 8-byte stores (rows g, columns 8j + 2t; 72 floats a
// row) fall in distinct banks.
#define LO_B_STRIDE (LO_MAX_RANK + 8)
#define LO_STAGE_STRIDE (LO_HALF + 8)

struct LoraOutAdapter {
    const void* b;   // [cols, rank]
    int col0, cols;  // its columns of y
    int k0, rank;    // its columns of H
    int first_tile;  // its first column tile (grid x)
    float scale;
};

struct LoraOutDims {
    void* y;
    const void* h;
    int rows, ld_y, ld_h, count, accumulate, pad;
    LoraOutAdapter a[LO_MAX_ADAPTERS];
};

__device__ __forceinline__ unsigned lo_load32(const void* p) {
    unsigned v;
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

template <class Ops> __device__ __forceinline__ void lora_outputs(const LoraOutDims& d) {
#if __CUDA_ARCH__ >= 800
    typedef typename Ops::elem T;
    __shared__ __align__(16) T bs[LO_COLS][LO_B_STRIDE];
    __shared__ __align__(16) float stage[LO_WARPS][16][LO_STAGE_STRIDE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

    // This block's adapter: the last whose first tile is at or before it. Fields are picked
    // one by one (a dynamic index into the parameters would copy them to local memory).
    const void* bp = d.a[0].b;
    int col0 = d.a[0].col0, cols = d.a[0].cols, k0 = d.a[0].k0, rank = d.a[0].rank, first = 0;
    float scale = d.a[0].scale;
#pragma unroll
    for (int i = 1; i < LO_MAX_ADAPTERS; i++) {
        if (i < d.count && (int)blockIdx.x >= d.a[i].first_tile) {
            bp = d.a[i].b;
            col0 = d.a[i].col0;
            cols = d.a[i].cols;
            k0 = d.a[i].k0;
            rank = d.a[i].rank;
            first = d.a[i].first_tile;
            scale = d.a[i].scale;
        }
    }
    const int c0 = ((int)blockIdx.x - first) * LO_COLS;  // the tile's first column in the block
    const int tile_cols = min(LO_COLS, cols - c0);
    const T* h = (const T*)d.h;
    T* y = (T*)d.y + col0 + c0;

    // The B tile, its rows past the block's columns zero.
    {
        const T* b = (const T*)bp + (size_t)c0 * rank;
        const int pairs = rank / 2;
        for (int i = threadIdx.x; i < LO_COLS * pairs; i += blockDim.x) {
            const int n = i / pairs, kp = i - n * pairs;
            const unsigned v = n < tile_cols ? lo_load32(b + (size_t)n * rank + 2 * kp) : 0u;
            *(unsigned*)&bs[n][2 * kp] = v;
        }
    }
    __syncthreads();  // the only block-wide barrier: warps past the last rows may leave after it

    float(*st)[LO_STAGE_STRIDE] = stage[warp];
    const int row_tiles = (d.rows + LO_ROWS - 1) / LO_ROWS;
    for (int rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
        const int row0 = rt * LO_ROWS + warp * 16;
        if (row0 >= d.rows) break;

        // The old values of the pieces this lane stores (beta 1): a half tile is 16 rows of 16
        // pieces of four columns; piece p = lane + 32 i of half `i / 8` is row p / 16 of the
        // warp's 16 and columns 4 (p % 16) .. + 3 of the half. Loaded first, so that their
        // trips overlap the products.
        uint2 prior[16];
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int p = lane + 32 * (i % 8), r = row0 + p / 16;
            const int col = (i / 8) * LO_HALF + 4 * (p % 16);
            prior[i] = make_uint2(0u, 0u);
            if (d.accumulate && r < d.rows && col < tile_cols)
                prior[i] = *(const uint2*)(y + (size_t)r * d.ld_y + col);
        }

        float acc[LO_COLS / 8][4];
#pragma unroll
        for (int j = 0; j < LO_COLS / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[j][e] = 0.f;
        const int ra = row0 + g, rb = row0 + g + 8;
        const bool ina = ra < d.rows, inb = rb < d.rows;
        const T* ha = h + (size_t)(ina ? ra : row0) * d.ld_h + k0 + 2 * t;
        const T* hb = h + (size_t)(inb ? rb : row0) * d.ld_h + k0 + 2 * t;
        for (int ks = 0; ks < rank; ks += 16) {
            unsigned a[4];
            a[0] = ina ? lo_load32(ha + ks) : 0u;
            a[1] = inb ? lo_load32(hb + ks) : 0u;
            a[2] = ina ? lo_load32(ha + ks + 8) : 0u;
            a[3] = inb ? lo_load32(hb + ks + 8) : 0u;
#pragma unroll
            for (int j = 0; j < LO_COLS / 8; j++) {
                const unsigned b0 = *(const unsigned*)&bs[8 * j + g][ks + 2 * t];
                const unsigned b1 = *(const unsigned*)&bs[8 * j + g][ks + 2 * t + 8];
                Ops::mma(acc[j], a, b0, b1);
            }
        }

#pragma unroll
        for (int half = 0; half < 2; half++) {
#pragma unroll
            for (int j = 0; j < LO_HALF / 8; j++) {
                const float* c = acc[half * (LO_HALF / 8) + j];
                *(float2*)&st[g][8 * j + 2 * t] = make_float2(c[0], c[1]);
                *(float2*)&st[g + 8][8 * j + 2 * t] = make_float2(c[2], c[3]);
            }
            __syncwarp();
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const int p = lane + 32 * i, rr = p / 16, cc = 4 * (p % 16), r = row0 + rr;
                const int col = half * LO_HALF + cc;
                if (r >= d.rows || col >= tile_cols) continue;
                const float4 v = *(const float4*)&st[rr][cc];
                const uint2 old = prior[half * 8 + i];
                float v0 = scale * v.x, v1 = scale * v.y, v2 = scale * v.z, v3 = scale * v.w;
                if (d.accumulate) {
                    v0 += Ops::low(old.x);
                    v1 += Ops::high(old.x);
                    v2 += Ops::low(old.y);
                    v3 += Ops::high(old.y);
                }
                *(uint2*)(y + (size_t)r * d.ld_y + col) = make_uint2(Ops::pack(v0, v1), Ops::pack(v2, v3));
            }
            __syncwarp();
        }
    }
#endif
}

#define LORA_OUTPUTS_ENTRY_POINT(OPS, SUFFIX)                                                    \
    extern "C" __global__ void __launch_bounds__(LO_WARPS * 32, 3)                                  \
        lora_outputs_##SUFFIX(const LoraOutDims d) {                                              \
        lora_outputs<OPS>(d);                                                                     \
    }
