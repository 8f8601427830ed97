// A LoRA adapter's two backward products from one read of the output gradient dy:
//   dH[:, k0 .. k0 + R] = s * dy[:, block] @ B                    (rows x R, stored in T)
//   dB = beta * dB + s * dy[:, block]^T @ H[:, k0 .. k0 + R]      (cols x R, f32)
// with B [cols, R] and H = x A^T. Reference: engine/cpu/gemm.rs (sgemm_strided, one call per
// product). Needs attention_tc.cu's TcBf16 / TcF16 (mma), tc_ldsm, tc_ldsm_trans and the
// cp.async group helpers before it; sm_80 or newer (elsewhere the bodies compile to nothing
// and the launcher never runs them).
//
// Why: as two GEMMs each product reads all of dy (rows x cols of 16-bit values) for a rank of
// 8 to 64, so both are memory-bound; here dy is read from DRAM once and feeds both products
// from shared memory.
//
// Work. The grid is (column chunk q, row stripe p). A block owns `chunk` columns of the block
// (at most LoraShape::chunk) and `stripe_rows` rows (a multiple of LORA_TR), and streams its dy
// tile through shared memory in sub-tiles of LORA_TR x chunk, with H's rows of the sub-tile
// beside it, LORA_STAGES buffers deep (cp.async), so later sub-tiles load while one is used.
// For each sub-tile:
// - product 1: the sub-tile's partial dH over the chunk's columns (LORA_TR x R), each of the
//   8 warps taking 16 rows (wr = warp / 4) and a quarter of the chunk's 16-column k tiles
//   (wc = warp % 4: tiles wc, wc + 4, ...), with its fragments of B held in registers for the
//   whole block (B's rows do not change from one sub-tile to the next). The four column groups'
//   sums meet in shared memory and are added in group order, then stored to the workspace;
// - product 2: the chunk's partial dB over the sub-tile's rows, accumulated in registers over
//   the whole stripe, each warp owning the chunk's 16-column m tiles warp, warp + 8, ...
// At the end of the stripe each warp stores its dB partial to the workspace. A second kernel
// (lora_grads_finish) adds the partials of each output in chunk / stripe order, scales by s,
// adds beta * dB and rounds dH to T. No atomics: every sum has a fixed order, so the same
// inputs give the same bits on every run.
//
// Workspace (f32): dH partials [chunks][rows][R], then dB partials [stripes][cols][R].
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with 16-bit operands; lane = 4 g + t):
// - A (16 x 16, row): a[0] = (row g, cols 2t, 2t+1), a[1] = (row g + 8, cols 2t, 2t+1),
//   a[2] = (row g, cols 2t+8, 2t+9), a[3] = (row g + 8, cols 2t+8, 2t+9); lower column in the
//   low half.
// - B (16 x 8, col): b[0] = (rows 2t, 2t+1, col g), b[1] = (rows 2t+8, 2t+9, col g).
// - C (16 x 8, f32): c[0], c[1] = (row g, cols 2t, 2t+1), c[2], c[3] = (row g + 8, same cols).
// ldmatrix x4 loads four 8x8 matrices, matrix m's 8 row addresses from lanes 8m .. 8m + 7, and
// gives lane (g, t) of matrix m register m: without .trans the elements (row g, cols 2t, 2t+1),
// with .trans (rows 2t, 2t+1, col g).
// - Product 1's A is the dy sub-tile D [i][c] itself (rows i, k = columns c): lanes 0-15 point
//   at rows 0-15, column 0, lanes 16-31 at rows 0-15, column 8 (tc_ldsm's pattern).
// - Product 2's A is D^T (rows c, k = i), read from D with .trans: register m must be
//   A's (rows 8 (m & 1) .., k 8 (m >> 1) ..), i.e. D's rows i = 8 (m >> 1) .. and columns
//   c = 8 (m & 1) ..; so lane l points at D row (l & 7) + 8 (l >> 4), column 8 ((l >> 3) & 1).
// - Both B operands (B [c][j] for product 1, H [i][j] for product 2) are row-major k x n tiles,
//   read with .trans: lane l points at row (l & 7) + 8 ((l >> 3) & 1), column 8 (l >> 4), so
//   registers 0, 1 are b[0], b[1] of n columns 0-7 and registers 2, 3 those of columns 8-15
//   (attention_tc.cu's tc_mma_x_tile pattern); rank 8 takes the x2 form (registers 0, 1).
//
// Shared memory rows are padded by 8 elements (16 bytes), so the 8 rows of an ldmatrix matrix
// fall in distinct banks. Tiles past the end of dy (rows past `rows`, columns past `cols`) and of
// B and H are zeros, so the mma tiles need no masks; only the stores check bounds. Operands are
// copied 16 bytes at a time where their rows allow it (16-byte aligned, row stride a multiple of
// 8 elements), else element by element: column blocks of any offset and stride work.

#define LORA_TR 32      // rows of a sub-tile: two 16-row mma tiles
#define LORA_WARPS 8
#define LORA_WC 4       // product 1's column groups (and 2 row halves: 8 warps)
#define LORA_STAGES 3   // sub-tile buffers

template <int R> struct LoraShape {
    static_assert(R == 8 || R == 16 || R == 32 || R == 64, "ranks 8, 16, 32 and 64");
    // Columns a block owns at most: its dB accumulators (chunk x R / 256 a thread: 32 or 64
    // registers) and B fragments (the same count) stay in registers.
    static constexpr int chunk = R == 64 ? 256 : 512;
    static constexpr int nt = R / 8;                        // 8-column n tiles of the rank
    static constexpr int ks1 = chunk / 16 / LORA_WC;        // product 1's k tiles a warp
    static constexpr int mt2 = chunk / 16 / LORA_WARPS;     // product 2's m tiles a warp
    static constexpr int dpitch = chunk + 8;                // dy sub-tile row pitch (elements)
    static constexpr int rpitch = R + 8;                    // H sub-tile and staged B row pitch
    static constexpr int stage = LORA_TR * (dpitch + rpitch);  // one buffer: [D | H], elements
    static constexpr int scratch = LORA_WC * LORA_TR * R;   // product 1's group sums (floats)
    // Dynamic shared memory (lora.rs's shared_bytes follows this).
    static constexpr int bytes = LORA_STAGES * stage * 2 + scratch * 4;
    static_assert(chunk * rpitch <= LORA_STAGES * stage, "B is staged in the sub-tile buffers");
};

__device__ __forceinline__ bool lora_aligned16(const void* p) { return ((unsigned long long)p & 15ull) == 0; }

__device__ __forceinline__ void lora_ldsm_x2_trans(unsigned r[2], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr));
}

// The B operands of k rows k0 .. k0 + 15 of a row-major tile of R columns (`pitch` elements
// apart), for every n tile: b[n] covers columns 8n .. 8n + 7 (layouts above).
template <int R>
__device__ __forceinline__ void lora_load_b(unsigned (&b)[R / 8][2], const unsigned short* tile, int pitch, int k0) {
    const int lane = threadIdx.x & 31;
    const unsigned short* row = tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * pitch;
    if constexpr (R == 8) {
        lora_ldsm_x2_trans(b[0], tc_smem_addr(row));
    } else {
#pragma unroll
        for (int n = 0; n < R / 16; n++) {
            unsigned r[4];
            tc_ldsm_trans(r, tc_smem_addr(row + 16 * n + (lane >> 4) * 8));
            b[2 * n][0] = r[0];
            b[2 * n][1] = r[1];
            b[2 * n + 1][0] = r[2];
            b[2 * n + 1][1] = r[3];
        }
    }
}

// Starts copying `tile_rows` rows x `width` columns (a multiple of 8) of a 16-bit matrix at
// `src` (rows `ld` elements apart) into a shared tile (rows `pitch` elements apart); elements at
// or past row `row_end` or column `col_end` become zeros. 16-byte pieces go by cp.async where
// `vec` (src 16-byte aligned, ld a multiple of 8) and the piece lies inside, the rest element by
// element (plain shared stores, visible after the caller's __syncthreads like the copies).
__device__ __forceinline__ void lora_stage(unsigned short* tile, int pitch, const unsigned short* src, long long ld,
                                           int tile_rows, int width, int row_end, int col_end, bool vec) {
    const int pieces = width >> 3;
    for (int i = threadIdx.x; i < tile_rows * pieces; i += blockDim.x) {
        const int r = i / pieces, c = (i - r * pieces) * 8;
        unsigned short* dst = tile + r * pitch + c;
        if (vec && r < row_end && c + 8 <= col_end) {
            copy_async16(dst, src + r * ld + c);
        } else {
            unsigned e[8];
#pragma unroll
            for (int j = 0; j < 8; j++) e[j] = r < row_end && c + j < col_end ? src[r * ld + c + j] : 0u;
            *reinterpret_cast<uint4*>(dst) =
                make_uint4(e[0] | (e[1] << 16), e[2] | (e[3] << 16), e[4] | (e[5] << 16), e[6] | (e[7] << 16));
        }
    }
}

// The partial products of block (chunk blockIdx.x, stripe blockIdx.y) into the workspace
// (layout above). dy and h point at the adapter's first column (element (0, col0) of dy,
// (0, k0) of H); b is B [cols, R] packed. ws_b null: no dB (a frozen B), H is not read.
template <class Ops, int R>
__device__ __forceinline__ void lora_grads_partial(float* __restrict__ ws_h, float* __restrict__ ws_b,
                                                   const unsigned short* __restrict__ dy, int ldy,
                                                   const unsigned short* __restrict__ b,
                                                   const unsigned short* __restrict__ h, int ldh, int rows,
                                                   int cols, int stripe_rows, int chunk) {
#if __CUDA_ARCH__ >= 800
    typedef LoraShape<R> S;
    extern __shared__ __align__(16) unsigned short tc_smem[];
    tc_need_shared(S::bytes);
    if (blockDim.x != LORA_WARPS * 32 || chunk > S::chunk || chunk % 16 != 0 || stripe_rows % LORA_TR != 0) __trap();
    float* scratch = reinterpret_cast<float*>(tc_smem + LORA_STAGES * S::stage);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wr = warp / LORA_WC, wc = warp % LORA_WC;
    const bool want_db = ws_b != nullptr;

    const int c0 = blockIdx.x * chunk;           // the chunk's first column (of the block)
    const int width = min(chunk, cols - c0);     // its columns
    const int tiles = (width + 15) / 16;         // its 16-column tiles (zeros past `width`)
    const int r0 = blockIdx.y * stripe_rows;
    const int stripe_end = min(rows, r0 + stripe_rows);
    const int subtiles = (stripe_end - r0 + LORA_TR - 1) / LORA_TR;
    dy += c0;
    const bool dy_vec = lora_aligned16(dy) && ldy % 8 == 0;
    const bool h_vec = lora_aligned16(h) && ldh % 8 == 0;

    // B's rows of the chunk, staged once in the sub-tile buffers; each warp keeps the fragments
    // of its k tiles (tiles past the chunk are zeros, never used).
    lora_stage(tc_smem, S::rpitch, b + (long long)c0 * R, R, 16 * tiles, R, width, R,
               lora_aligned16(b + (long long)c0 * R));
    copy_async_wait_all();
    __syncthreads();
    unsigned bf[S::ks1][S::nt][2];
#pragma unroll
    for (int u = 0; u < S::ks1; u++) {
        const int kt = wc + LORA_WC * u;
        if (kt < tiles) {
            lora_load_b<R>(bf[u], tc_smem, S::rpitch, 16 * kt);
        } else {
#pragma unroll
            for (int n = 0; n < S::nt; n++) bf[u][n][0] = bf[u][n][1] = 0u;
        }
    }
    __syncthreads();  // every warp has its B before the buffers take sub-tiles

    // Sub-tile s: LORA_TR rows of dy from row r0 + s * LORA_TR, and H's rows beside them.
    auto load = [&](int s) {
        unsigned short* buf = tc_smem + (s % LORA_STAGES) * S::stage;
        const int row = r0 + s * LORA_TR;
        lora_stage(buf, S::dpitch, dy + (long long)row * ldy, ldy, LORA_TR, 16 * tiles, stripe_end - row, width,
                   dy_vec);
        if (want_db)
            lora_stage(buf + LORA_TR * S::dpitch, S::rpitch, h + (long long)row * ldh, ldh, LORA_TR, R,
                       stripe_end - row, R, h_vec);
    };
#pragma unroll
    for (int s = 0; s < LORA_STAGES - 1; s++) {
        if (s < subtiles) load(s);
        tc_commit();  // one group per sub-tile, empty past the last, so the waits count right
    }

    float acc2[S::mt2][S::nt][4];
#pragma unroll
    for (int v = 0; v < S::mt2; v++)
#pragma unroll
        for (int n = 0; n < S::nt; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc2[v][n][e] = 0.f;

    for (int s = 0; s < subtiles; s++) {
        // Sub-tile s has landed (only the newest LORA_STAGES - 2 groups may still be in flight)
        // and every warp is done with sub-tile s - 1, whose buffer the next copy reuses.
        tc_wait<LORA_STAGES - 2>();
        __syncthreads();
        if (s + LORA_STAGES - 1 < subtiles) load(s + LORA_STAGES - 1);
        tc_commit();
        const unsigned short* d = tc_smem + (s % LORA_STAGES) * S::stage;
        const unsigned short* ht = d + LORA_TR * S::dpitch;
        const int row = r0 + s * LORA_TR;

        // Product 1: rows 16 wr .. 16 wr + 15 of the sub-tile times B over this warp's k tiles.
        float acc1[S::nt][4];
#pragma unroll
        for (int n = 0; n < S::nt; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc1[n][e] = 0.f;
#pragma unroll
        for (int u = 0; u < S::ks1; u++) {
            const int kt = wc + LORA_WC * u;
            if (kt >= tiles) continue;
            unsigned a[4];
            tc_ldsm(a, tc_smem_addr(d + (16 * wr + (lane & 15)) * S::dpitch + 16 * kt + (lane >> 4) * 8));
#pragma unroll
            for (int n = 0; n < S::nt; n++) Ops::mma(acc1[n], a, bf[u][n][0], bf[u][n][1]);
        }
        // acc1[n][e]: sub-tile row 16 wr + g + 8 (e >> 1), rank column 8n + 2t + (e & 1).
#pragma unroll
        for (int n = 0; n < S::nt; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                scratch[(wc * LORA_TR + 16 * wr + g + 8 * (e >> 1)) * R + 8 * n + 2 * t + (e & 1)] = acc1[n][e];

        // Product 2: this warp's m tiles (chunk columns) of D^T times the sub-tile's H.
        if (want_db) {
#pragma unroll
            for (int kk = 0; kk < LORA_TR / 16; kk++) {
                unsigned hb[S::nt][2];
                lora_load_b<R>(hb, ht, S::rpitch, 16 * kk);
#pragma unroll
                for (int v = 0; v < S::mt2; v++) {
                    const int mt = warp + LORA_WARPS * v;
                    if (mt >= tiles) continue;
                    unsigned a[4];
                    tc_ldsm_trans(a, tc_smem_addr(d + (16 * kk + (lane & 7) + (lane >> 4) * 8) * S::dpitch + 16 * mt +
                                                  ((lane >> 3) & 1) * 8));
#pragma unroll
                    for (int n = 0; n < S::nt; n++) Ops::mma(acc2[v][n], a, hb[n][0], hb[n][1]);
                }
            }
        }
        __syncthreads();
        // The sub-tile's dH partial: the column groups' sums added in group order.
        for (int o = threadIdx.x; o < LORA_TR * R; o += blockDim.x) {
            const int i = o / R, j = o % R;
            if (row + i >= stripe_end) break;  // o ascends with i
            float v = scratch[i * R + j];
#pragma unroll
            for (int w = 1; w < LORA_WC; w++) v += scratch[(w * LORA_TR + i) * R + j];
            ws_h[((long long)blockIdx.x * rows + row + i) * R + j] = v;
        }
    }

    // acc2[v][n][e]: chunk column 16 (warp + 8v) + g + 8 (e >> 1), rank column 8n + 2t + (e & 1).
    if (want_db) {
#pragma unroll
        for (int v = 0; v < S::mt2; v++) {
            const int mt = warp + LORA_WARPS * v;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int c = 16 * mt + g + 8 * (e >> 1);
                if (mt >= tiles || c >= width) continue;
                float* out = ws_b + ((long long)blockIdx.y * cols + c0 + c) * R + 2 * t + (e & 1);
#pragma unroll
                for (int n = 0; n < S::nt; n++) out[8 * n] = acc2[v][n][e];
            }
        }
    }
#endif
}

// dH[i, j] = store(s * sum over chunks of the partials), dB = s * sum over stripes (+ dB when
// `add`; db null: none). One thread an output, the partials added in order.
template <typename T>
__device__ __forceinline__ void lora_grads_finish(T* __restrict__ dh, int ldh, float* __restrict__ db,
                                                  const float* __restrict__ ws, int rows, int cols, int rank,
                                                  int chunks, int stripes, float scale, int add) {
    const long long n_h = (long long)rows * rank, n_b = db != nullptr ? (long long)cols * rank : 0;
    const float* ws_b = ws + chunks * n_h;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_h + n_b; i += stride) {
        if (i < n_h) {
            float v = 0.f;
            for (int q = 0; q < chunks; q++) v += ws[q * n_h + i];
            dh[(i / rank) * ldh + i % rank] = store<T>(scale * v);
        } else {
            const long long e = i - n_h;
            float v = 0.f;
            for (int p = 0; p < stripes; p++) v += ws_b[p * n_b + e];
            db[e] = add ? db[e] + scale * v : scale * v;
        }
    }
}

// One element type's entry points: a partial kernel per rank (one block an SM is what the grid
// plans for; the bound lets ptxas keep the fragments and accumulators in registers) and the
// finishing kernel.
#define LORA_PARTIAL_ENTRY_POINT(OPS, SUFFIX, R)                                                           \
    extern "C" __global__ void __launch_bounds__(LORA_WARPS * 32, 1) lora_grads_partial_##SUFFIX##_r##R(   \
        float* ws_h, float* ws_b, const OPS::elem* dy, int ldy, const OPS::elem* b, const OPS::elem* h,      \
        int ldh, int rows, int cols, int stripe_rows, int chunk) {                                          \
        lora_grads_partial<OPS, R>(ws_h, ws_b, reinterpret_cast<const unsigned short*>(dy), ldy,            \
                                   reinterpret_cast<const unsigned short*>(b),                              \
                                   reinterpret_cast<const unsigned short*>(h), ldh, rows, cols, stripe_rows, \
                                   chunk);                                                                  \
    }

#define LORA_ENTRY_POINTS(OPS, SUFFIX)                                                                     \
    LORA_PARTIAL_ENTRY_POINT(OPS, SUFFIX, 8)                                                               \
    LORA_PARTIAL_ENTRY_POINT(OPS, SUFFIX, 16)                                                              \
    LORA_PARTIAL_ENTRY_POINT(OPS, SUFFIX, 32)                                                              \
    LORA_PARTIAL_ENTRY_POINT(OPS, SUFFIX, 64)                                                              \
    extern "C" __global__ void lora_grads_finish_##SUFFIX(OPS::elem* dh, int ldh, float* db, const float* ws, \
                                                          int rows, int cols, int rank, int chunks,         \
                                                          int stripes, float scale, int add) {              \
        lora_grads_finish<OPS::elem>(dh, ldh, db, ws, rows, cols, rank, chunks, stripes, scale, add);       \
    }

LORA_ENTRY_POINTS(TcBf16, bf16)
LORA_ENTRY_POINTS(TcF16, f16)
