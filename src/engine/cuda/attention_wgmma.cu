// Hopper attention (sm_90a): bf16 or f16 activations, head size 64 or 128, on warpgroup MMA
// (`wgmma.mma_async`). On sm_90 its forward and backward take the place of attention_tc.cu's
// mma.sync kernels, whose helpers they share (this file follows attention_tc.cu in its
// program). The forward is described first; the backward ("The backward on warpgroup MMA"
// below) streams its tiles the same way.
//
// A warpgroup (4 warps, 128 threads) owns 64 queries: wgmma's M is 64, and warp w of the group
// holds rows 16w .. 16w + 15 in the same fragment layouts as mma.sync's m16n8k16
// (attention_tc.cu's header): an f32 accumulator chunk of 8 columns is rows g and g + 8,
// columns 2t and 2t + 1 of lane 4g + t, and the A operand of k-chunk k is the accumulator's
// columns 16k .. 16k + 15 packed in pairs. So the online softmax, its row reductions over 4
// lanes and the masks are the mma.sync forward's, and P goes from the score accumulators to the
// next product's A operand without a shuffle.
//
// A block is G warpgroups (WgShape: one or two) over 64 G consecutive queries that share every
// K and V tile in shared memory: each tile is copied once and read by the tensor cores once per
// warpgroup, so two warpgroups halve the copies of K and V per query (their global and L2 reads,
// shared-memory writes, copy instructions and barriers); the tensor cores' reads per query stay
// the same. The warpgroups run the same steps in lockstep (one barrier a tile) and each issues the
// products of every tile of the block, as wgmma needs control flow the compiler can see is
// uniform over a warpgroup: the tiles that one warpgroup's rows do not see at all are masked
// whole and add exact zeros, so each row's sums are those of a one-warpgroup block with the same
// key tile, in the same order. Several blocks share an SM where registers and shared memory
// allow: while one block works through its softmax, the others' products keep the tensor cores
// busy. The engine's configurations and their occupancy are listed at WgForward.
//
// Both products take B from shared memory through matrix descriptors:
// - S = Q K^T: Q's fragments are either read from global memory once into registers (16 or 32
//   per thread) and are the A operand from there, or copied once into shared memory in K's
//   layout below and read through a descriptor as well (QS), which frees those registers for
//   larger key tiles; K is the B operand in its natural layout, head dimension contiguous
//   ("K-major");
// - O += P V: P comes from the score registers, rounded to the operand type; V is the B
//   operand with the key (reduction) dimension strided, head dimension contiguous, which
//   wgmma reads transposed ("MN-major").
// Each tile of K, V or Q lies in shared memory in the 128-byte swizzle that wgmma reads without
// bank conflicts: a row of 64 elements is 128 bytes, and 16-byte chunk c of row r sits at
// chunk c ^ (r % 8) of its row, in 1024-byte aligned groups of 8 rows. At head size 128 a row
// is split into two 64-column halves, each half of the tile a separate swizzled sub-tile. The
// descriptors: for K (and Q), one k-step (16 columns, 32 bytes) advances the start address by
// 32 bytes inside the swizzled row, the fifth k-step starts the second sub-tile, and groups of
// 8 rows are 1024 bytes apart (the stride offset); warpgroup w's 64 rows of Q start 64 rows
// (8 KiB) into each sub-tile. For V, one k-step (16 keys) advances it by 2048 bytes (two groups
// of 8 rows, again 1024 bytes apart), and the two 64-column halves at head size 128 are one
// sub-tile apart (the leading offset).
//
// Tiles arrive by `cp.async` into three stages of K and V, the copies spread over all the
// block's threads (Q's, when in shared memory, go with the first tile's); every thread waits
// for its own copies, makes them visible to the tensor cores' (asynchronous) proxy with
// `fence.proxy.async`, and a barrier then publishes the tile to the block. The loop overlaps
// the products with the softmax: at key tile j the block issues S_j = Q K_j^T and
// O += P_{j-1} V_{j-1} back to back, waits only for S_j, computes P_j while the second product
// runs, then waits for it and rescales O. Tile j + 1 is copied during step j (its copies issued
// before the products with one warpgroup, after them with two) into the stage that held tile
// j - 2, whose last reader (the product of step j - 1) every thread has waited
// for before the barrier that opens step j.
//
// The arithmetic is the mma.sync forward's: base-2 scores with `ex2.approx.ftz`, the causal mask
// and the window W applied per score on the tiles that straddle them only (tiles wholly
// outside every window of the block are never loaded), rows at or past T read zeros and are
// not written, P rounded once to the operand type. In f16, P is scaled by 2^12 before rounding
// (as there) by subtracting 12 from the exponent, so that the row sums, also of scaled P,
// cancel the scale when O is divided by them; the log-sum-exp removes it again. Every sum is
// in a fixed order (the tensor cores' within a product, the lanes' and the tiles' as written):
// results are deterministic.
//
// The output is staged through shared memory so that each row is written with 16-byte stores.

#define WG_THREADS 128  // one warpgroup
#define WG_ROWS 64      // the queries of a warpgroup: wgmma's M

// A configuration of the forward: head size HS, key tile rows N (wgmma's N of S = Q K^T), G
// warpgroups a block (64 G queries, 128 G threads) that share every K and V tile, and whether Q
// is read by the tensor cores from shared memory (QS) rather than held in registers. The
// shared memory: Q's tile when QS (HS / 64 sub-tiles of 64 G rows), then STAGES stages of
// [K | V] (three; two only with one warpgroup, see wg_forward: a configuration the harness
// measures, not the engine's), each tile HS / 64 sub-tiles of 64 columns (128-byte rows).
template <int HS, int N, int G = 1, bool QS = false, int STAGES = 3> struct WgShape {
    static_assert(STAGES == 3 || (STAGES == 2 && G == 1), "two stages with one warpgroup only");
    static constexpr int threads = G * WG_THREADS;
    static constexpr int rows = G * WG_ROWS;
    static constexpr int sub = N * 128;           // bytes of one 64-column sub-tile of K or V
    static constexpr int tile = (HS / 64) * sub;  // bytes of a K or V tile
    static constexpr int q_sub = rows * 128;      // bytes of one 64-column sub-tile of Q
    static constexpr int q_bytes = QS ? (HS / 64) * q_sub : 0;
    static constexpr int stages = STAGES;
    // Q, the stages, and 1024 bytes of slack to align their base (the swizzle's period).
    static constexpr int bytes = q_bytes + 2 * stages * tile + 1024;
    static constexpr int out_pitch = 2 * HS + 16;  // output staging row, bytes (see below)
    static_assert(4 * G * 16 * out_pitch <= 2 * stages * tile, "the output staging fits the stages");
    static_assert(bytes <= 227 * 1024, "a block's shared memory fits an SM");
    // The blocks an SM the registers are budgeted for (the launch bound): at least two of one
    // warpgroup (at most 255 registers a thread); two of two warpgroups (at most 128) only at
    // head size 64 with 64-key tiles and Q in shared memory, which fits them without spilling;
    // otherwise one (at most 255).
    // Two stages (K_{j+1} and V_j copied together, see wg_forward) leave room for a third
    // block of one warpgroup, which the bound then budgets for (at most 168 registers).
    static constexpr int min_blocks = G == 1 ? (STAGES == 2 ? 3 : 2) : (HS == 64 && N == 64 && QS ? 2 : 1);
};

// The configuration the engine launches at each head size (attention.rs mirrors it).
// - Head size 64: one warpgroup, 64 keys. Three stages take 49 KiB and 155 registers a
//   thread, so three blocks (12 warps) share an SM (128 keys would halve the tiles but allow
//   only two blocks, and measured 10% slower at T = 1024). Two warpgroups with 64 keys and Q
//   in shared memory fit 126 registers and 65 KiB, two blocks (16 warps) an SM; with 128 keys,
//   220 registers and 113 KiB, one block.
// - Head size 128: one warpgroup, 64 keys, Q in registers (244 registers, 97 KiB, two blocks
//   an SM). Two warpgroups sharing each K/V tile, Q in shared memory and 128-key tiles (218
//   registers, 225 KiB, one block an SM) copy each tile once for 128 queries and take one
//   barrier per 128 keys, but measured slower on an H100 (B 8, causal: 136.5 against 123.9 us
//   at T 1024, 1483 against 1368 at T 4096, bf16): with one block an SM and one barrier a
//   tile, the two warpgroups run in step and nothing hides their softmax. Two warpgroups with
//   64 keys and Q in shared memory were 4% faster at head size 64 and T 4096 (576 against 599
//   us) but 2% slower at T 1024, so the engine keeps one there too. bench/wgmma_attention
//   checks and times every configuration.
// With the TMA forms (sm_90's default) the engine runs the persistent warp-specialised
// forward instead (wg_forward_persist: 128-key tiles, two stages, the consumers' products in
// turn; two consumers at head size 128, three at 64), 14-16% and 12% faster on an H200.
template <int HS> struct WgForward {
    static constexpr int keys = 64;
    static constexpr int groups = 1;
    static constexpr bool q_shared = false;
};

// The accumulator operands of a wgmma of N columns (N / 2 registers a thread), as inline
// assembly lists them: d[n][e] in order, read and written; and their places in the
// instruction's text (%0 .. %(N / 2 - 1)).
#define WG_ACC4(d, n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define WG_ACC_N32(d) WG_ACC4(d, 0), WG_ACC4(d, 1), WG_ACC4(d, 2), WG_ACC4(d, 3)
#define WG_ACC_N64(d) WG_ACC_N32(d), WG_ACC4(d, 4), WG_ACC4(d, 5), WG_ACC4(d, 6), WG_ACC4(d, 7)
#define WG_ACC_N128(d)                                                                         \
    WG_ACC_N64(d), WG_ACC4(d, 8), WG_ACC4(d, 9), WG_ACC4(d, 10), WG_ACC4(d, 11), WG_ACC4(d, 12), \
        WG_ACC4(d, 13), WG_ACC4(d, 14), WG_ACC4(d, 15)
#define WG_REGS_N32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WG_REGS_N64 WG_REGS_N32 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_REGS_N128                                                                            \
    WG_REGS_N64 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
                "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// One wgmma of 64 rows x N columns x 16: d (f32, the accumulator layout above) += a (the
// warp's 16 rows of A, 4 registers of pairs) * B (16 x N, from the descriptor); B transposed
// when TRANS_B (V), and d overwritten rather than added to when SCALE_D is 0. The operands
// after the accumulators are numbered from N / 2: A's registers, the descriptor, TRANS_B and
// SCALE_D (A0 .. SD, as text).
#define WG_MMA_RS(NAME, TY, N, A0, A1, A2, A3, DESC, TB, SD)                                     \
    template <int TRANS_B, int SCALE_D>                                                          \
    __device__ __forceinline__ void NAME(float (&d)[N / 8][4], const unsigned (&a)[4],          \
                                         unsigned long long desc) {                              \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SD ", 0;\n"                              \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "             \
                     "{" WG_REGS_N##N "}, {%" A0 ", %" A1 ", %" A2 ", %" A3 "}, %" DESC            \
                     ", p, 1, 1, %" TB ";\n}\n"                                                  \
                     : WG_ACC_N##N(d)                                                            \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TRANS_B),      \
                       "n"(SCALE_D));                                                            \
    }

// The same with A from shared memory through a descriptor too (K-major: A not transposed):
// S = Q K^T with Q in shared memory, and the backward's S and dP. Operands after the
// accumulators: A's descriptor, B's, SCALE_D.
#define WG_MMA_SS(NAME, TY, N, DA, DB, SD)                                                       \
    template <int SCALE_D>                                                                       \
    __device__ __forceinline__ void NAME(float (&d)[N / 8][4], unsigned long long desc_a,        \
                                         unsigned long long desc) {                              \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" SD ", 0;\n"                              \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "             \
                     "{" WG_REGS_N##N "}, %" DA ", %" DB ", p, 1, 1, 0, 0;\n}\n"                 \
                     : WG_ACC_N##N(d)                                                            \
                     : "l"(desc_a), "l"(desc), "n"(SCALE_D));                                    \
    }

// Every variant the kernels use, for one element type.
#define WG_MMA_VARIANTS(TY)                                                                      \
    WG_MMA_RS(wg_mma_##TY##_n32, #TY, 32, "16", "17", "18", "19", "20", "21", "22")             \
    WG_MMA_RS(wg_mma_##TY##_n64, #TY, 64, "32", "33", "34", "35", "36", "37", "38")             \
    WG_MMA_RS(wg_mma_##TY##_n128, #TY, 128, "64", "65", "66", "67", "68", "69", "70")           \
    WG_MMA_SS(wg_mma_ss_##TY##_n32, #TY, 32, "16", "17", "18")                                  \
    WG_MMA_SS(wg_mma_ss_##TY##_n64, #TY, 64, "32", "33", "34")                                  \
    WG_MMA_SS(wg_mma_ss_##TY##_n128, #TY, 128, "64", "65", "66")
WG_MMA_VARIANTS(bf16)
WG_MMA_VARIANTS(f16)

// The element types: attention_tc.cu's conversions, the wgmma variants (A from registers, or
// from shared memory: `mma_ss`), and P's scale as a power of two (log2; f16's 2^12 is
// TcF16::p_scale()).
#define WG_ELEM(NAME, BASE, TY, P_LOG2)                                                          \
    struct NAME : BASE {                                                                         \
        static constexpr float p_log2 = P_LOG2;                                                  \
        template <int N, int TRANS_B, int SCALE_D>                                               \
        static __device__ __forceinline__ void mma(float (&d)[N / 8][4], const unsigned (&a)[4], \
                                                   unsigned long long desc) {                    \
            if constexpr (N == 32) wg_mma_##TY##_n32<TRANS_B, SCALE_D>(d, a, desc);              \
            else if constexpr (N == 64) wg_mma_##TY##_n64<TRANS_B, SCALE_D>(d, a, desc);         \
            else wg_mma_##TY##_n128<TRANS_B, SCALE_D>(d, a, desc);                               \
        }                                                                                        \
        template <int N, int SCALE_D>                                                            \
        static __device__ __forceinline__ void mma_ss(float (&d)[N / 8][4],                      \
                                                      unsigned long long desc_a,                 \
                                                      unsigned long long desc) {                 \
            if constexpr (N == 32) wg_mma_ss_##TY##_n32<SCALE_D>(d, desc_a, desc);               \
            else if constexpr (N == 64) wg_mma_ss_##TY##_n64<SCALE_D>(d, desc_a, desc);          \
            else wg_mma_ss_##TY##_n128<SCALE_D>(d, desc_a, desc);                                \
        }                                                                                        \
    };
WG_ELEM(WgBf16, TcBf16, bf16, 0.0f)
WG_ELEM(WgF16, TcF16, f16, 12.0f)

// wgmma's ordering: `fence` before the first wgmma that reads registers written by other
// instructions (the accumulators, P); `commit` closes a group of issued wgmmas; `wait<N>`
// returns once at most the newest N groups are still running.
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// Pins an accumulator array to this point of the program: the compiler does not move reads
// or writes of its registers across it, so none crosses the wait before it.
template <int A> __device__ __forceinline__ void wg_pin(float (&d)[A][4]) {
    #pragma unroll
    for (int i = 0; i < A; i++) {
        #pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+f"(d[i][e]) :: "memory");
    }
}

// cp.async writes through the generic proxy; wgmma reads shared memory through the async
// proxy, which sees those writes only after this fence (then a barrier for other threads').
__device__ __forceinline__ void wg_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// mbarrier operations on a barrier at a shared address: init (one thread, before a block
// barrier), arrive (release), a wait for the completion of the phase of parity `parity`, and an
// arrival that also expects the bytes of asynchronous copies.
__device__ __forceinline__ void wg_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void wg_mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void wg_mbar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }
}
// This thread's arrival on `bar`, expecting `bytes` more of copies before its phase completes.
__device__ __forceinline__ void wg_mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

// Named barriers of the consumers' turns (PP), a ring of CONS consumers: a consumer waits on
// its own (3 + group) before issuing a step's products and arrives on the next one's
// (3 + (group + 1) % CONS) once they are issued, so the consumers' products go to the tensor
// cores in turn and each one's softmax runs while another's products do (FlashAttention-3's
// ping-pong schedule). Each barrier counts its waiter and the consumer before it. 1 and 2 are
// the consumers' Q barriers, 0 the block's.
// Two consumers name their barriers as immediates; three take the number from a register,
// which makes ptxas reserve all sixteen (no cost at one block an SM) but measured no spills
// where the immediates' branches cost the 128-register consumers 20 bytes.
template <int CONS> __device__ __forceinline__ void wg_turn_wait(int group) {
    static_assert(CONS == 2 || CONS == 3, "two or three consumers");
    if constexpr (CONS == 2) {
        if (group == 0) asm volatile("bar.sync 3, %0;" :: "n"(2 * WG_THREADS) : "memory");
        else asm volatile("bar.sync 4, %0;" :: "n"(2 * WG_THREADS) : "memory");
    } else {
        asm volatile("bar.sync %0, %1;" :: "r"(3 + group), "n"(2 * WG_THREADS) : "memory");
    }
}
template <int CONS> __device__ __forceinline__ void wg_turn_pass(int group) {
    if constexpr (CONS == 2) {
        if (group == 0) asm volatile("bar.arrive 4, %0;" :: "n"(2 * WG_THREADS) : "memory");
        else asm volatile("bar.arrive 3, %0;" :: "n"(2 * WG_THREADS) : "memory");
    } else {
        asm volatile("bar.arrive %0, %1;" :: "r"(group + 1 == CONS ? 3 : 4 + group), "n"(2 * WG_THREADS)
                     : "memory");
    }
}

// A TMA tensor map as the driver encodes it (CUtensorMap: 128 bytes; the copies need 64-byte
// alignment, CUDA 13 declares 128), passed to a kernel by value (__grid_constant__) and read
// only by the copy instructions.
struct alignas(128) WgTensorMap {
    unsigned long long opaque[16];
};

// A tile of a 3-D tensor map copied by the TMA unit into shared memory at `dst` (its swizzle as
// the map says), from coordinates {c0, c1, c2} (innermost first), counted on the mbarrier `bar`
// as bytes completed. Elements outside the tensor arrive as zeros and count too.
__device__ __forceinline__ void wg_tma_load_3d(unsigned dst, const WgTensorMap* map, int c0, int c1, int c2,
                                               unsigned bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        :: "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}

// Thread 0's TMA copies of two tiles of HS columns, from row r of batch b: into dst1 from
// column col1 of map1 and into dst2 from col2 of map2, HS / 64 sub-tiles of `sub` bytes each,
// counted on the stage's barrier `bar`, which this arrival tells to expect their `bytes`.
template <int HS>
__device__ __forceinline__ void wg_tma_tile_pair(unsigned bar, unsigned bytes, int sub, int r, int b, unsigned dst1,
                                                 const WgTensorMap* map1, int col1, unsigned dst2,
                                                 const WgTensorMap* map2, int col2) {
    wg_mbar_expect_tx(bar, bytes);
    #pragma unroll
    for (int i = 0; i < HS / 64; i++) {
        wg_tma_load_3d(dst1 + i * sub, map1, col1 + 64 * i, r, b, bar);
        wg_tma_load_3d(dst2 + i * sub, map2, col2 + 64 * i, r, b, bar);
    }
}

// The three full barriers of a TMA-fed pipeline, one a stage, each completed by one arrival
// (thread 0's, with the stage's bytes) and the copies' bytes: initialised by thread 0 before a
// block barrier; returns the first's shared address (the others follow 8 bytes apart).
__device__ __forceinline__ unsigned wg_tma_full_barriers() {
    __shared__ __align__(8) unsigned long long wg_tma_full[3];
    const unsigned full0 = tc_smem_addr(wg_tma_full);
    if (threadIdx.x == 0) {
        for (int i = 0; i < 3; i++) wg_mbar_init(full0 + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    return full0;
}

// A matrix descriptor with the 128-byte swizzle: start address, leading and stride byte
// offsets (each in 16-byte units, 14 bits), layout type 1 in bits 62-63.
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr, unsigned lead, unsigned stride) {
    return (unsigned long long)((addr >> 4) & 0x3fffu) | (unsigned long long)((lead >> 4) & 0x3fffu) << 16 |
           (unsigned long long)((stride >> 4) & 0x3fffu) << 32 | 1ull << 62;
}

// Starts copying rows r0 .. r0 + N - 1 of K, V or Q (HS elements each, `stride` elements
// apart) into the swizzled tile at shared address `dst`, the copies spread over the block's
// THREADS threads; rows at or past T become zeros (so that masked probabilities, exact zeros,
// meet finite values). Thread x copies chunk x % (HS / 8) of rows x / (HS / 8) + R j, R =
// THREADS / (HS / 8) rows a pass: a multiple of 8, so every pass has the thread's swizzle and
// its addresses are the first pass's plus j passes' (one multiply by the stride a tile). A tile
// wholly before T (all but a sequence's last) takes a copy of the loop without the row test:
// no predicate or selects a copy, its source one 64-bit add from the last. `tid` is the
// thread's index among the THREADS that copy (all of the block's, or a producer's).
template <int HS, int N, int THREADS, int UNROLL = N * HS / 8 / THREADS, typename E>
__device__ __forceinline__ void wg_tile_copy(unsigned dst, const E* src, size_t stride, int r0, int T,
                                             int tid = threadIdx.x) {
    constexpr int chunks = HS / 8;  // 16-byte chunks of a row
    constexpr int pass = THREADS / chunks;
    static_assert(N * chunks % THREADS == 0, "every thread copies the same number of chunks");
    static_assert(THREADS % chunks == 0 && pass % 8 == 0, "a pass keeps each thread's swizzle");
    const int r = tid / chunks, c = tid % chunks;
    const unsigned at = dst + (c >> 3) * (N * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
    const E* from = src + (size_t)(r0 + r) * stride + c * 8;
    const size_t step = (size_t)pass * stride;
    if (r0 + N <= T) {
        #pragma unroll UNROLL
        for (int j = 0; j < N * chunks / THREADS; j++) {
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(at + pass * j * 128), "l"(from));
            from += step;
        }
        return;
    }
    #pragma unroll UNROLL
    for (int j = 0; j < N * chunks / THREADS; j++) {
        const bool in = r0 + r + pass * j < T;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                     :: "r"(at + pass * j * 128), "l"(in ? from + j * step : src), "r"(in ? 16 : 0));
    }
}

// The online softmax of a tile of scores s whose mask is already applied: updates the running
// maximum m (base 2) and the lane's partial row sums l, turns s into P times 2^Ops::p_log2,
// and returns each row's correction corr = 2^(m_old - m_new) for the output accumulators.
template <class Ops, int N>
__device__ __forceinline__ void wg_softmax_rows(float (&s)[N / 8][4], float (&m)[2], float (&l)[2],
                                                float (&corr)[2], float c) {
    // Scores stay unscaled until the exponential: c > 0, so the largest raw score times c is
    // the largest scaled one, and s * c - m is one fused multiply-add.
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        float m_sub;
        const float m_new = tc_tile_max<N>(s, r, m[r], c, m_sub);
        corr[r] = tc_exp2(m[r] - m_sub);
        const float shift = m_sub - Ops::p_log2;  // P times 2^p_log2
        float sum = 0.0f;  // this lane's share of the row, in column order
        #pragma unroll
        for (int n = 0; n < N / 8; n++) {
            #pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                s[n][e] = tc_exp2(fmaf(s[n][e], c, -shift));
                sum += s[n][e];
            }
        }
        l[r] = l[r] * corr[r] + sum;  // a per-lane partial sum until the end
        m[r] = m_new;
    }
}

// The online softmax of one tile of scores s (64 rows x N keys from k0, this lane's rows
// row0 and row0 + 8 of the warp's warp_row0 .. warp_row0 + 15): masks the scores the causal
// mask or the window hides on the tiles that straddle them (their own copy of the code,
// tc_masked_or_not), then wg_softmax_rows.
template <class Ops, int N>
__device__ __forceinline__ void wg_softmax(float (&s)[N / 8][4], float (&m)[2], float (&l)[2], float (&corr)[2],
                                           int k0, int warp_row0, int row0, int t, float c, int W, int T) {
    tc_masked_or_not(tc_all_see(warp_row0, warp_row0 + 15, k0, k0 + N - 1, W, T), [&](bool masked) {
        if (masked) tc_mask_tile<N>(s, k0, row0, t, W);
        wg_softmax_rows<Ops, N>(s, m, l, corr, c);
    });
}

// The forward's steps, shared by wg_forward and wg_forward_persist (one warpgroup's view: its
// warp's 16 rows, this lane's rows row0 and row0 + 8).

// Q as the A operand of every k-chunk, read once from global memory into registers: register
// [kk][r + 2h] holds row row0 + 8r, columns 16kk + 8h + 2t and the next; rows at or past T are
// zeros.
template <int HS, typename E>
__device__ __forceinline__ void wg_load_q(unsigned (&qf)[HS / 16][4], const E* base, size_t stride, int row0, int t,
                                          int T) {
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const bool in = row0 + 8 * r < T;
        const unsigned* src = reinterpret_cast<const unsigned*>(base + (size_t)(in ? row0 + 8 * r : 0) * stride) + t;
        #pragma unroll
        for (int kk = 0; kk < HS / 16; kk++) {
            qf[kk][r] = in ? src[8 * kk] : 0u;
            qf[kk][r + 2] = in ? src[8 * kk + 4] : 0u;
        }
    }
}

// Issues S = Q K^T from the K tile at shared address `k_tile` (sub-tiles `sub` bytes apart), Q
// from registers or, with QS, from shared memory through the descriptor qd (sub-tiles `q_sub`
// apart). One k-step (16 columns) is 32 bytes along a swizzled row, four of them a sub-tile,
// for K and Q alike. wg_issue_products leaves their group open, for a caller that adds more
// products to it (the backward's S and dP); wg_issue_s closes it.
template <class Ops, int HS, int N, bool QS, int QF>
__device__ __forceinline__ void wg_issue_products(float (&s)[N / 8][4], const unsigned (&qf)[QF][4],
                                                  unsigned long long qd, int q_sub, unsigned k_tile, int sub) {
    const unsigned long long kd = wg_desc(k_tile, 16, 1024);
    #pragma unroll
    for (int kk = 0; kk < HS / 16; kk++) {
        const unsigned long long kstep = kd + (((kk >> 2) * sub + (kk & 3) * 32) >> 4);
        if constexpr (QS) {
            const unsigned long long qstep = qd + (((kk >> 2) * q_sub + (kk & 3) * 32) >> 4);
            if (kk == 0) Ops::template mma_ss<N, 0>(s, qstep, kstep);
            else Ops::template mma_ss<N, 1>(s, qstep, kstep);
        } else {
            if (kk == 0) Ops::template mma<N, 0, 0>(s, qf[0], kstep);
            else Ops::template mma<N, 0, 1>(s, qf[kk], kstep);
        }
    }
}
template <class Ops, int HS, int N, bool QS, int QF>
__device__ __forceinline__ void wg_issue_s(float (&s)[N / 8][4], const unsigned (&qf)[QF][4], unsigned long long qd,
                                           int q_sub, unsigned k_tile, int sub) {
    wg_issue_products<Ops, HS, N, QS>(s, qf, qd, q_sub, k_tile, sub);
    wg_commit();
}

// Issues O += P V from the V tile at shared address `v_tile` (64-column halves `sub` bytes
// apart; a k-step of 16 keys is 2048 bytes).
template <class Ops, int HS, int N>
__device__ __forceinline__ void wg_issue_pv(float (&o)[HS / 8][4], const unsigned (&p)[N / 16][4], unsigned v_tile,
                                            int sub) {
    const unsigned long long vd = wg_desc(v_tile, sub, 1024);
    #pragma unroll
    for (int kk = 0; kk < N / 16; kk++) Ops::template mma<HS, 1, 1>(o, p[kk], vd + ((kk * 2048) >> 4));
    wg_commit();
}

// P as the A operand of the next O += P V, rounded once to the operand type.
template <class Ops, int N>
__device__ __forceinline__ void wg_pack_p(unsigned (&p)[N / 16][4], const float (&s)[N / 8][4]) {
    #pragma unroll
    for (int kk = 0; kk < N / 16; kk++) {
        p[kk][0] = Ops::pack(s[2 * kk][0], s[2 * kk][1]);
        p[kk][1] = Ops::pack(s[2 * kk][2], s[2 * kk][3]);
        p[kk][2] = Ops::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        p[kk][3] = Ops::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
}

// O's rows times the online softmax's corrections.
template <int HS>
__device__ __forceinline__ void wg_rescale_o(float (&o)[HS / 8][4], const float (&corr)[2]) {
    #pragma unroll
    for (int n = 0; n < HS / 8; n++) {
        o[n][0] *= corr[0];
        o[n][1] *= corr[0];
        o[n][2] *= corr[1];
        o[n][3] *= corr[1];
    }
}

// The end of the forward for one warp: the lse of its rows, and O divided by the row sums,
// staged in `stage_out` (the warp's 16 rows, `pitch` bytes apart: lane 4g + t's 4-byte writes
// fall in banks 4g + t) and written back in 16-byte pieces, 8 or 16 lanes a row.
template <class Ops, int HS>
__device__ __forceinline__ void wg_store_output(const float (&o)[HS / 8][4], const float (&l)[2], const float (&m)[2],
                                                unsigned char* stage_out, int pitch, typename Ops::elem* out,
                                                float* lse, int b, int h, int NH, int warp_row0, int row0, int T,
                                                int C) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float inv[2];
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const float sum = tc_row_sum(l[r]);
        inv[r] = 1.0f / sum;  // rows < T saw their own key: sum > 0
        const int row = row0 + 8 * r;
        // Natural log-sum-exp of the scaled scores: m is in base-2 units, sum carries P's scale.
        if (t == 0 && row < T)
            lse[((size_t)b * NH + h) * T + row] = (m[r] - Ops::p_log2) * 0.6931471805599453f + logf(sum);
    }
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        unsigned* dst = reinterpret_cast<unsigned*>(stage_out + (g + 8 * r) * pitch) + t;
        #pragma unroll
        for (int n = 0; n < HS / 8; n++) dst[4 * n] = Ops::pack(o[n][2 * r] * inv[r], o[n][2 * r + 1] * inv[r]);
    }
    __syncwarp();
    constexpr int chunks = HS / 8;  // 16-byte pieces of an output row
    #pragma unroll
    for (int j = 0; j < 16 * chunks / 32; j++) {
        const int i = lane + 32 * j, r = i / chunks, ch = i % chunks;
        const int row = warp_row0 + r;
        if (row < T) {
            const uint4 v = *reinterpret_cast<const uint4*>(stage_out + r * pitch + ch * 16);
            *reinterpret_cast<uint4*>(out + ((size_t)b * T + row) * C + h * HS + ch * 8) = v;
        }
    }
}

// The forward: a block owns 64 G queries (warpgroup w of them rows 64w .. 64w + 63) and streams
// the key tiles up to its last query's (from the first its window reaches) with the online
// softmax. Shared memory: WgShape::bytes.
// With STAGES 2 (one warpgroup) the step of tile j copies K_{j+1} and V_j, in place of K_{j-1}
// and V_{j-2}, both done by then: every copy still has a whole step ahead of the product that
// reads it (as tile j + 1's have with three stages), in two thirds of the shared memory.
// With TMA (one warpgroup, three stages) thread 0 has the TMA unit copy each K and V tile
// (`map`: qkv as [B][T][3C], boxes of 64 columns by N rows, the 128-byte swizzle) and every
// thread waits on the stage's mbarrier, in place of each thread's cp.async copies and their
// address arithmetic (the engine's on sm_90 unless KILN_ATTENTION_TMA=0; the same bits).
template <class Ops, int HS, int N, int G, bool QS, int STAGES = 3, bool TMA = false>
__device__ __forceinline__ void wg_forward(const typename Ops::elem* __restrict__ qkv,
                                           typename Ops::elem* __restrict__ out,
                                           float* __restrict__ lse, int T, int C, int NH, int W,
                                           const WgTensorMap* map = nullptr) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(!TMA || (G == 1 && STAGES == 3 && !QS), "TMA copies with one warpgroup and three stages");
    typedef WgShape<HS, N, G, QS, STAGES> S;
    typedef typename Ops::elem E;
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    tc_need_shared(S::bytes);
    // A launch with other than the configuration's threads (attention.rs mirrors WgForward)
    // traps rather than leaving queries unwritten.
    if (blockDim.x != S::threads) __trap();
    const unsigned smem0 = (tc_smem_addr(wg_smem) + 1023u) & ~1023u;
    const unsigned qs = smem0;  // Q's tile (QS)
    auto ks = [&](int i) { return smem0 + S::q_bytes + 2 * i * S::tile; };
    auto vs = [&](int i) { return smem0 + S::q_bytes + (2 * i + 1) * S::tile; };
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    // Under the causal mask the last query tiles see the most keys: start those first.
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int group = warp >> 2;  // this thread's warpgroup
    const size_t stride = 3 * (size_t)C;
    const E* base = qkv + (size_t)b * T * stride + h * HS;
    const int q0 = qt * S::rows;
    const int warp_row0 = q0 + warp * 16;
    const int row0 = warp_row0 + g;  // this lane's rows: row0 and row0 + 8
    const float c = tc_scale<HS>() * TC_LOG2E;
    // The block's key tiles. Every warpgroup issues the products of every tile: whether a
    // warpgroup's rows see a tile depends on the thread index, and a wgmma under a branch the
    // compiler cannot prove uniform over the warpgroup gets serialized with the others. The
    // tiles a warpgroup's rows do not see at all (with two warpgroups and 64-key tiles, the
    // first's last tile under the causal mask; a window's first tile for the second) are masked
    // whole and add exact zeros (a correction of exactly 1 or, before a row's first key, 0).
    const int kt0 = tc_first_key_tile(q0, W, N);
    const int tiles = min(q0 + S::rows - 1, T - 1) / N - kt0 + 1;

    // Tile copies are issued at once with one warpgroup (other blocks keep the tensor cores
    // busy meanwhile) and after the step's products are issued with two (one block an SM: the
    // tensor cores would wait for the copies' issue otherwise). There the copy loop is
    // unrolled only 4 times, so that it needs few registers beside the running products' (fully
    // unrolled, it spilled at head size 128 with 128-key tiles).
    constexpr bool copy_after_issue = G > 1;
    constexpr int copy_unroll = copy_after_issue || STAGES == 2 ? 4 : N * HS / 8 / S::threads;
    auto copy_k = [&](int kt, int stage) {
        wg_tile_copy<HS, N, S::threads, copy_unroll>(ks(stage), base + C, stride, kt * N, T);
    };
    auto copy_v = [&](int kt, int stage) {
        wg_tile_copy<HS, N, S::threads, copy_unroll>(vs(stage), base + 2 * C, stride, kt * N, T);
    };
    auto copy_tile = [&](int kt, int stage) {
        copy_k(kt, stage);
        copy_v(kt, stage);
    };
    constexpr bool two = STAGES == 2;
    // The stage after `stage`, in turn over the stages.
    auto next_stage = [](int stage) { return two ? stage ^ 1 : (stage == 2 ? 0 : stage + 1); };
    // TMA: a full barrier a stage (one arrival, thread 0's, with the tile's bytes).
    unsigned full0 = 0;
    if constexpr (TMA) full0 = wg_tma_full_barriers();
    auto tma_tile = [&](int kt, int stage) {
        wg_tma_tile_pair<HS>(full0 + 8 * stage, 2 * S::tile, S::sub, kt * N, b, ks(stage), map, C + h * HS,
                             vs(stage), map, 2 * C + h * HS);
    };
    if constexpr (QS) wg_tile_copy<HS, S::rows, S::threads>(qs, base, stride, q0, T);
    if constexpr (TMA) {
        if (threadIdx.x == 0) tma_tile(kt0, 0);
    } else {
        if constexpr (two) copy_k(kt0, 0);
        else copy_tile(kt0, 0);
        tc_commit();
    }

    // Q as the A operand of every k-chunk: in registers (wg_load_q), or in shared memory, K's
    // layout with 64 G rows, this warpgroup's 64 of them 64 rows (8 KiB) in.
    unsigned qf[QS ? 1 : HS / 16][4];
    if constexpr (!QS) wg_load_q<HS>(qf, base, stride, row0, t, T);
    const unsigned long long qd = wg_desc(qs + group * WG_ROWS * 128, 16, 1024);

    float o[HS / 8][4], s[N / 8][4];
    #pragma unroll
    for (int n = 0; n < HS / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    #pragma unroll
    for (int n = 0; n < N / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
    unsigned p[N / 16][4];  // P of the last tile as the A operand of O += P V
    float m[2] = {KILN_NEG_INF, KILN_NEG_INF}, l[2] = {0.0f, 0.0f}, corr[2];
    // Waits for tile j's copies, and starts tile j + 1's into the stage after `stage`.
    auto wait_tile = [&](int j, int stage) {
        if constexpr (TMA) {
            wg_mbar_wait(full0 + 8 * stage, (j / 3) & 1);  // the TMA unit's copies of tile j
        } else {
            tc_wait<0>();  // this thread's copies of tile j
            wg_fence_proxy();
        }
        // Every thread's copies of tile j are in; every thread has finished step j - 1, whose
        // products read the stage of tile j - 2 at the latest, which tile j + 1 now fills.
        __syncthreads();
    };
    auto start_copy = [&](int j, int stage) {
        if constexpr (TMA) {
            if (threadIdx.x == 0 && j + 1 < tiles) tma_tile(kt0 + j + 1, next_stage(stage));
            return;
        }
        if constexpr (two) {
            // K_{j+1} over K_{j-1} (S_{j-1} is done), V_j over V_{j-2} (O += P_{j-2} V_{j-2} is).
            if (j + 1 < tiles) copy_k(kt0 + j + 1, next_stage(stage));
            copy_v(kt0 + j, stage);
        } else {
            if (j + 1 < tiles) copy_tile(kt0 + j + 1, next_stage(stage));
        }
        tc_commit();
    };
    auto issue_s = [&](int stage) { wg_issue_s<Ops, HS, N, QS>(s, qf, qd, S::q_sub, ks(stage), S::sub); };
    auto issue_pv = [&](int stage) { wg_issue_pv<Ops, HS, N>(o, p, vs(stage), S::sub); };
    auto pack_p = [&]() { wg_pack_p<Ops, N>(p, s); };

    // Step 0: S_0 and its softmax (O is still zero).
    wait_tile(0, 0);
    if constexpr (!copy_after_issue) start_copy(0, 0);
    wg_fence();
    issue_s(0);
    if constexpr (copy_after_issue) start_copy(0, 0);
    wg_wait<0>();
    wg_pin(s);
    wg_softmax<Ops, N>(s, m, l, corr, kt0 * N, warp_row0, row0, t, c, W, T);
    pack_p();
    // Steps 1 ..: S_j and O += P_{j-1} V_{j-1} issued together; P_j computed while the second
    // runs. The waits are unconditional, so that the compiler sees every register of a running
    // product untouched until its wait.
    int prev = 0;  // the stage of tile j - 1
    for (int it = 1; it < tiles; it++) {
        const int stage = next_stage(prev);
        wait_tile(it, stage);
        if constexpr (!copy_after_issue) start_copy(it, stage);
        wg_fence();
        issue_s(stage);
        issue_pv(prev);
        if constexpr (copy_after_issue) start_copy(it, stage);
        wg_wait<1>();  // S_j is done
        wg_pin(s);
        wg_softmax<Ops, N>(s, m, l, corr, (kt0 + it) * N, warp_row0, row0, t, c, W, T);
        wg_wait<0>();  // O += P_{j-1} V_{j-1} is done
        wg_pin(o);
        wg_rescale_o<HS>(o, corr);
        pack_p();
        prev = stage;
    }
    // The last tile's O += P V (with two stages, after its V's copies).
    if constexpr (two) wait_tile(tiles, prev);
    wg_fence();
    issue_pv(prev);
    wg_wait<0>();
    wg_pin(o);

    // Each warp stages its 16 rows (row pitch HS * 2 + 16 bytes) in the stages' memory.
    __syncthreads();  // every product has read its stage
    if constexpr (TMA) wg_fence_proxy();  // the stages were last written by the TMA unit
    unsigned char* const stage_out = wg_smem + (smem0 - tc_smem_addr(wg_smem)) + S::q_bytes + warp * 16 * S::out_pitch;
    wg_store_output<Ops, HS>(o, l, m, stage_out, S::out_pitch, out, lse, b, h, NH, warp_row0, row0, T, C);
#elif defined(__CUDA_ARCH__)
    __trap();  // compiled for a target without wgmma: a launch fails rather than writing nothing
#endif
}

// The persistent warp-specialised forward fed by TMA (sm_90a), the engine's forward with the
// TMA forms (attention.rs; bench/wgmma_attention checks and times it as `wp_*`). A
// block is CONS consumer warpgroups of 64 queries each (two at head size 128; three, as
// FlashAttention-3's 192-query tile, at 64), which share every K and V tile (read from L2 once
// per 64 CONS queries), and a producer warpgroup of which one thread issues every copy and the
// rest exit; the producer gives its registers to the consumers (`setmaxnreg`; with three,
// ptxas still allocates for 512 threads, 128 registers). One block an SM stays resident and
// walks the work tiles (64 CONS queries of one head each, in the order ORDER gives), and
// its producer runs ahead into the next work tile while the consumers finish the last, so
// that a block's start (Q's load, the first tile's wait) and end (the output's store) do not
// leave the SM idle. (A non-persistent form, a block a work tile with 128 threads' cp.async
// copies, measured level with the one-warpgroup forward and was removed; docs/perf-log.md.)
// Each consumer runs wg_forward's steps for its rows on its own (S_j beside O += P_{j-1}
// V_{j-1}, the softmax while the second runs), waiting on the stages' mbarriers; with PP they
// take turns to issue their products (FlashAttention-3's ping-pong), so that one's softmax
// runs while another's products do.
// - Q: the block's 64 CONS rows in shared memory (HS / 64 sub-tiles, consumer w's rows 64 w
//   on), copied by the TMA unit once every consumer has issued its last S of the tile before
//   (`empty_q`), counted on `full_q`;
// - K_j and V_j: their own full barriers, so that S_j waits for K_j alone and O += P_{j-1}
//   V_{j-1} for V_{j-1}, and their own empty barriers: K_j is released once S_j is done, V_j
//   once the product reading it is, so that two stages suffice (the producer's V_j waits for
//   V_{j-2}, released in step j - 1, which needs only K_{j-1} and V_{j-2}, both copied before
//   it). The stage and phase of a tile follow a running count over all the block's work
//   tiles, which producer and consumers keep alike.
// With PP the consumers' turns run on across work tiles (each takes tiles + 1 turns a work
// tile), so the first pass and the last wait are the kernel's, not a tile's.
// The consumers' arithmetic is wg_forward's with Q from shared memory: the same results, bit
// for bit, as the one-warpgroup block of the same key tile.
template <int HS, int N, int STAGES, int CONS = 2> struct WgPersistShape {
    static_assert(STAGES >= 2 && (CONS == 2 || CONS == 3), "stages; two or three consumers");
    static constexpr int consumers = CONS;
    static constexpr int threads = (consumers + 1) * WG_THREADS;
    static constexpr int rows = consumers * WG_ROWS;
    // Q's rows are copied in boxes of N rows (the tensor map's, shared with K and V): box r at
    // row min(r N, rows - N), so that with 192 rows and 128-key boxes the second box overlaps
    // the first by 64 rows, which both copy with the same bytes.
    static_assert(rows >= N && N % 64 == 0, "Q's rows in boxes of N");
    static constexpr int q_boxes = (rows + N - 1) / N;
    static constexpr int sub = N * 128;           // bytes of a 64-column sub-tile of K or V
    static constexpr int tile = (HS / 64) * sub;  // bytes of a K or V tile
    static constexpr int q_sub = rows * 128;      // bytes of a 64-column sub-tile of the block's Q
    static constexpr int q_bytes = (HS / 64) * q_sub;
    static constexpr int out_pitch = 2 * HS + 16;
    static constexpr int staging = 4 * consumers * 16 * out_pitch;
    // Q, the stages, the staging, the barriers: full_k, full_v, empty_k, empty_v a stage,
    // full_q, empty_q.
    static constexpr int bytes = 1024 + q_bytes + 2 * STAGES * tile + staging + (4 * STAGES + 2) * 8;
    static_assert(bytes <= 227 * 1024, "a block's shared memory fits an SM");
    // 128 x 24 + 256 x 240 <= 64K with two consumers, 128 x 24 + 384 x 160 with three.
    static constexpr int producer_regs = 24, consumer_regs = CONS == 2 ? 240 : 160;
};

// The order of the work tiles among the blocks (ORDER; the harness compares them, the engine
// runs WG_ORDER_COUNTER_SECTIONS, measured 1-2% faster than the snake at T 4096 and 7-8% at
// head size 128, T 8192, the snake 1-6% faster than the heads' order: perf-log.md):
// - WG_ORDER_HEADS: tile w is query tile qtiles - 1 - w / BNH of head w % BNH (every head's
//   longest first) and block i takes tiles i, i + G, i + 2 G, ... (G blocks);
// - WG_ORDER_SNAKE: the same tiles, block i taking position i of round k (tiles k G .. k G +
//   G - 1) for even k and G - 1 - i for odd k, so that a block drawing a long tile in one round
//   draws a short one in the next (the kernel ends with its busiest block, whose key tiles run
//   10% past the mean with the heads' order at B 4, 12 heads of 64, T 4096, 0.3% with the
//   snake: bench/wgmma_attention/work_balance.py);
// - WG_ORDER_SECTIONS: the snake over sections of heads whose K and V (T HS 4 bytes a head)
//   fill about 24 MiB of L2, each section's query tiles the longest first, its heads
//   alternating, so that the blocks at work together read a few heads' K and V from DRAM
//   about once (with the heads' order, at head size 128, B 8, T 4096, the forward read 3.7
//   TB/s from DRAM with 28% L2 hits; sections measured 7-9% faster at head size 128, B 4, T
//   8192, but without the snake they unbalanced the blocks elsewhere, and with it their
//   boundaries still do at some shapes: work_balance.py);
// - WG_ORDER_COUNTER and WG_ORDER_COUNTER_SECTIONS: the heads' or the sections' tiles, block i
//   taking tile i first and then whichever tile a counter in global memory gives next, so that
//   the block that comes free first takes the next tile (balanced whatever the sections'
//   boundaries: work_balance.py's dyn-* orders). The producer thread fetches each next tile
//   one work tile ahead and hands it to the consumers in shared memory beside Q's barrier; the
//   last block to finish resets the counter for the next launch, so launches of these kernels
//   must not run concurrently with each other (a kiln backend loads its own modules and
//   launches on one stream).
enum {
    WG_ORDER_HEADS = 0,
    WG_ORDER_SNAKE = 1,
    WG_ORDER_SECTIONS = 2,
    WG_ORDER_COUNTER = 3,
    WG_ORDER_COUNTER_SECTIONS = 4
};

// Heads a section holds (the sectioned orders here and WG_BACKWARD_ORDER 2): as many as fill
// about 24 MiB of L2 with T HS 4 bytes each (a head's K and V, or its streamed tiles).
template <int HS>
__device__ __forceinline__ int wg_section_heads(int T) {
    return max(1, (int)((24ll << 20) / ((long long)T * HS * 4)));
}

// Entry e of a sectioned order over `tiles` tiles a head of BNH heads, s heads a section:
// each section's heads alternate within each of its tiles in turn (fewer heads in the last).
__device__ __forceinline__ void wg_section_entry(int e, int tiles, int BNH, int s, int& bh, int& tile) {
    const int sec = e / (tiles * s), heads = min(s, BNH - sec * s), r = e - sec * tiles * s;
    bh = sec * s + r % heads;
    tile = r / heads;
}

// The counter orders' next tile (beyond the grid's first) and their finished blocks, zero
// between launches.
__device__ unsigned wg_persist_counter[2];

template <class Ops, int HS, int N, int STAGES, bool PP, int CONS, int ORDER = WG_ORDER_HEADS>
__device__ __forceinline__ void wg_forward_persist(const typename Ops::elem* __restrict__ qkv,
                                                   typename Ops::elem* __restrict__ out,
                                                   float* __restrict__ lse, int T, int C, int NH, int W, int BNH,
                                                   const WgTensorMap* map) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef WgPersistShape<HS, N, STAGES, CONS> S;
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    tc_need_shared(S::bytes);
    if (blockDim.x != S::threads) __trap();
    const unsigned smem0 = (tc_smem_addr(wg_smem) + 1023u) & ~1023u;
    const unsigned qs = smem0;
    auto ks = [&](int i) { return smem0 + S::q_bytes + 2 * i * S::tile; };
    auto vs = [&](int i) { return smem0 + S::q_bytes + (2 * i + 1) * S::tile; };
    const unsigned staging = smem0 + S::q_bytes + 2 * STAGES * S::tile;
    const unsigned bars = staging + S::staging;
    auto full_k = [&](int i) { return bars + 8 * i; };
    auto full_v = [&](int i) { return bars + 8 * (STAGES + i); };
    auto empty_k = [&](int i) { return bars + 8 * (2 * STAGES + i); };
    auto empty_v = [&](int i) { return bars + 8 * (3 * STAGES + i); };
    const unsigned full_q = bars + 8 * 4 * STAGES, empty_q = full_q + 8;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int group = __shfl_sync(0xffffffffu, warp >> 2, 0);  // below CONS: consumers; CONS: the producer
    const int qtiles = (T + S::rows - 1) / S::rows;
    const int work = qtiles * BNH;
    // Work tile w's head and query tile (ORDER above); `section` is read by the sections order
    // only (BNH heads, one section, would give the heads' order).
    constexpr bool sections = ORDER == WG_ORDER_SECTIONS || ORDER == WG_ORDER_COUNTER_SECTIONS;
    constexpr bool counter = ORDER == WG_ORDER_COUNTER || ORDER == WG_ORDER_COUNTER_SECTIONS;
    const int section = sections ? wg_section_heads<HS>(T) : BNH;
    // The counter orders' tile of the current work tile, written by the producer before Q's
    // barrier arrival and read by the consumers after its wait (work or more: no more tiles).
    __shared__ int handed_tile;
    auto decode = [&](int w, int& b, int& h, int& q0, int& kt0, int& tiles) {
        int bh;
        if constexpr (sections) {
            int tile;
            wg_section_entry(w, qtiles, BNH, section, bh, tile);
            q0 = (qtiles - 1 - tile) * S::rows;
        } else {
            bh = w % BNH;
            q0 = (qtiles - 1 - w / BNH) * S::rows;
        }
        b = bh / NH;
        h = bh % NH;
        kt0 = tc_first_key_tile(q0, W, N);
        tiles = min(q0 + S::rows - 1, T - 1) / N - kt0 + 1;
    };
    // This block's tile in round k, after its tile `w` of round k - 1. Only the last round
    // holds tiles at or past `work`, so the first such tile ends the block's walk.
    auto next_tile = [&](int w, int k) {
        if constexpr (ORDER == WG_ORDER_HEADS || counter) return w + (int)gridDim.x;
        else return k * (int)gridDim.x + ((k & 1) ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x);
    };
    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; i++) {
            wg_mbar_init(full_k(i), 1);  // the producer's arrival with the tile's bytes
            wg_mbar_init(full_v(i), 1);
            wg_mbar_init(empty_k(i), 4 * S::consumers);  // lane 0 of every consumer warp
            wg_mbar_init(empty_v(i), 4 * S::consumers);
        }
        wg_mbar_init(full_q, 1);
        wg_mbar_init(empty_q, 4 * S::consumers);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (group == S::consumers) {
        // The producer: one thread issues every copy.
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(S::producer_regs));
        if (threadIdx.x != S::consumers * WG_THREADS) return;
        int j = 0;  // tiles copied so far, over all work tiles
        int n = 0;  // work tiles begun
        for (int w = blockIdx.x, k = 0;; n++) {
            // The next tile, fetched now so that its round trip hides behind this tile's copies.
            int next = work;
            if constexpr (counter) {
                if (w < work) next = (int)gridDim.x + (int)atomicAdd(&wg_persist_counter[0], 1u);
            } else {
                next = next_tile(w, ++k);
            }
            if constexpr (!counter) {
                if (w >= work) break;
            }
            if (n > 0) wg_mbar_wait(empty_q, (n - 1) & 1);
            if constexpr (counter) {
                // The consumers have read the last tile's number (before releasing Q).
                *(volatile int*)&handed_tile = w;
                if (w >= work) {
                    wg_mbar_expect_tx(full_q, 0);  // no Q: the consumers read the end and stop
                    break;
                }
            }
            int b, h, q0, kt0, tiles;
            decode(w, b, h, q0, kt0, tiles);
            // Boxes of N rows wholly past T are not copied: only a consumer without rows
            // would read them, and it issues no products.
            auto box_row = [&](int r) { return min(r * N, S::rows - N); };
            int boxes = 0;
            #pragma unroll
            for (int r = 0; r < S::q_boxes; r++) boxes += q0 + box_row(r) < T;
            wg_mbar_expect_tx(full_q, boxes * (HS / 64) * S::sub);
            #pragma unroll
            for (int i = 0; i < HS / 64; i++) {
                #pragma unroll
                for (int r = 0; r < S::q_boxes; r++) {
                    if (q0 + box_row(r) < T)
                        wg_tma_load_3d(qs + i * S::q_sub + box_row(r) * 128, map, h * HS + 64 * i, q0 + box_row(r), b,
                                       full_q);
                }
            }
            for (int it = 0; it < tiles; it++, j++) {
                const int stage = j % STAGES, use = j / STAGES;
                const int k0 = (kt0 + it) * N;
                if (use > 0) wg_mbar_wait(empty_k(stage), (use - 1) & 1);
                wg_mbar_expect_tx(full_k(stage), S::tile);
                #pragma unroll
                for (int i = 0; i < HS / 64; i++)
                    wg_tma_load_3d(ks(stage) + i * S::sub, map, C + h * HS + 64 * i, k0, b, full_k(stage));
                if (use > 0) wg_mbar_wait(empty_v(stage), (use - 1) & 1);
                wg_mbar_expect_tx(full_v(stage), S::tile);
                #pragma unroll
                for (int i = 0; i < HS / 64; i++)
                    wg_tma_load_3d(vs(stage) + i * S::sub, map, 2 * C + h * HS + 64 * i, k0, b, full_v(stage));
            }
            w = next;
        }
        if constexpr (counter) {
            // Every block's last fetch comes before its count here, so the last block to count
            // resets both for the next launch.
            __threadfence();
            if (atomicAdd(&wg_persist_counter[1], 1u) == gridDim.x - 1) {
                atomicExch(&wg_persist_counter[0], 0u);
                atomicExch(&wg_persist_counter[1], 0u);
            }
        }
        return;
    }

    // A consumer: warpgroup `group`, rows 64 group .. 64 group + 63 of each work tile.
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(S::consumer_regs));
    const float c = tc_scale<HS>() * TC_LOG2E;
    const unsigned long long qd = wg_desc(qs + group * WG_ROWS * 128, 16, 1024);
    const unsigned qf[1][4] = {{0u, 0u, 0u, 0u}};  // unused: Q is read from shared memory
    unsigned char* const stage_out = wg_smem + (staging - tc_smem_addr(wg_smem)) + warp * 16 * S::out_pitch;
    auto release = [&](unsigned bar) {
        if (lane == 0) wg_mbar_arrive(bar);
    };
    auto wait_k = [&](int j) { wg_mbar_wait(full_k(j % STAGES), (j / STAGES) & 1); };
    auto wait_v = [&](int j) { wg_mbar_wait(full_v(j % STAGES), (j / STAGES) & 1); };
    auto turn_wait = [&]() {
        if constexpr (PP) wg_turn_wait<CONS>(group);
    };
    auto turn_pass = [&]() {
        if constexpr (PP) wg_turn_pass<CONS>(group);
    };
    if constexpr (PP) {
        if (group == CONS - 1) wg_turn_pass<CONS>(group);  // consumer 0 takes the first turn
    }
    int j0 = 0;  // the running count of this work tile's first key tile
    int n = 0;
    for (int w = blockIdx.x, k = 0;; w = next_tile(w, ++k), n++) {
        if constexpr (counter) {
            wg_mbar_wait(full_q, n & 1);
            w = *(volatile int*)&handed_tile;
        }
        if (w >= work) break;
        int b, h, q0, kt0, tiles;
        decode(w, b, h, q0, kt0, tiles);
        const int warp_row0 = q0 + warp * 16;
        const int row0 = warp_row0 + g;
        const int wg_q0 = q0 + WG_ROWS * group;
        float o[HS / 8][4], s[N / 8][4];
        #pragma unroll
        for (int i = 0; i < HS / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
        #pragma unroll
        for (int i = 0; i < N / 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
        unsigned p[N / 16][4];
        float m[2] = {KILN_NEG_INF, KILN_NEG_INF}, l[2] = {0.0f, 0.0f}, corr[2];
        auto issue_s = [&](int stage) { wg_issue_s<Ops, HS, N, true>(s, qf, qd, S::q_sub, ks(stage), S::sub); };
        auto issue_pv = [&](int stage) { wg_issue_pv<Ops, HS, N>(o, p, vs(stage), S::sub); };
        const int first = wg_q0 < T ? tc_first_key_tile(wg_q0, W, N) - kt0 : tiles;
        const int last = wg_q0 < T ? min(wg_q0 + WG_ROWS - 1, T - 1) / N - kt0 : tiles - 1;
        // A tile this warpgroup's rows do not see: waited for, its turn taken and released,
        // so that barrier phases and turns stay in step with the other consumers'.
        auto pass_tile = [&](int j) {
            wait_k(j);
            wait_v(j);
            turn_wait();
            turn_pass();
            release(empty_k(j % STAGES));
            release(empty_v(j % STAGES));
        };
        for (int it = 0; it < first; it++) pass_tile(j0 + it);
        if (first <= last) {
            wg_mbar_wait(full_q, n & 1);
            wait_k(j0 + first);
            turn_wait();
            wg_fence();
            issue_s((j0 + first) % STAGES);
            turn_pass();
            wg_wait<0>();
            wg_pin(s);
            release(empty_k((j0 + first) % STAGES));
            if (first == last) release(empty_q);
            wg_softmax<Ops, N>(s, m, l, corr, (kt0 + first) * N, warp_row0, row0, t, c, W, T);
            wg_pack_p<Ops, N>(p, s);
            for (int it = first + 1; it <= last; it++) {
                const int stage = (j0 + it) % STAGES, prev = (j0 + it - 1) % STAGES;
                wait_k(j0 + it);
                wait_v(j0 + it - 1);
                turn_wait();
                wg_fence();
                issue_s(stage);
                issue_pv(prev);
                turn_pass();
                wg_wait<1>();  // S_j is done: K_j's buffer (and, for the last, Q) is free
                wg_pin(s);
                release(empty_k(stage));
                if (it == last) release(empty_q);
                wg_softmax<Ops, N>(s, m, l, corr, (kt0 + it) * N, warp_row0, row0, t, c, W, T);
                wg_wait<0>();  // O += P_{j-1} V_{j-1} is done: V_{j-1}'s buffer is free
                wg_pin(o);
                release(empty_v(prev));
                wg_rescale_o<HS>(o, corr);
                wg_pack_p<Ops, N>(p, s);
            }
            wait_v(j0 + last);
            turn_wait();
            wg_fence();
            issue_pv((j0 + last) % STAGES);
            turn_pass();
            wg_wait<0>();
            wg_pin(o);
            release(empty_v((j0 + last) % STAGES));
        } else {
            // No rows before T: Q's phase is still waited for, so that the release counts in it.
            wg_mbar_wait(full_q, n & 1);
            release(empty_q);
            turn_wait();
            turn_pass();
        }
        for (int it = last + 1; it < tiles; it++) pass_tile(j0 + it);
        if (first <= last)
            wg_store_output<Ops, HS>(o, l, m, stage_out, S::out_pitch, out, lse, b, h, NH, warp_row0, row0, T, C);
        j0 += tiles;
    }
    if constexpr (PP) {
        if (group == 0) wg_turn_wait<CONS>(group);  // the last consumer's last pass
    }
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}

// An entry point of the persistent forward (bench/wgmma_attention instantiates them): as many
// blocks as SMs (at most the work tiles), one each; BNH = batch x heads.
#define WG_PERSIST_ORDER_ENTRY_POINT(HS, N, STAGES, PP, CONS, ORDER, OPS, NAME)                        \
    extern "C" __global__ void __launch_bounds__(WgPersistShape<HS, N, STAGES, CONS>::threads, 1)      \
        NAME(const OPS::elem* qkv, OPS::elem* out, float* lse, int T, int C, int NH, int W,             \
             const __grid_constant__ WgTensorMap map, int BNH) {                                        \
        wg_forward_persist<OPS, HS, N, STAGES, PP, CONS, ORDER>(qkv, out, lse, T, C, NH, W, BNH, &map); \
    }
#define WG_PERSIST_ENTRY_POINT(HS, N, STAGES, PP, CONS, OPS, NAME) \
    WG_PERSIST_ORDER_ENTRY_POINT(HS, N, STAGES, PP, CONS, WG_ORDER_HEADS, OPS, NAME)

// The backward on warpgroup MMA: attention_tc.cu's two kernels (dQ with the row term d; dK and
// dV) with their sums, masks and f16 scaling, each products' operands read by the tensor cores
// from shared memory. A block is one warpgroup that owns 64 rows, whose two tiles (dQ: Q and dO;
// dK/dV: K and V) stay in shared memory, and streams the other side's tiles of N rows (dQ: K
// and V; dK/dV: Q, dO and the queries' lse and d) through three stages, as the forward streams
// K and V:
// - dQ: S = Q K^T and dP = dO V^T (A and B both from shared memory, K-major), then
//   P = exp(S / sqrt(HS) - lse), dS = P (dP - d) per query row, and dQ += dS K (dS from
//   registers, K read transposed like the forward's V);
// - dK/dV: S^T = K Q^T and dP^T = V dO^T, so that each key's P and dS sit in its own rows, then
//   dV += P^T dO and dK += dS^T Q.
// Step j issues S_j and dP_j, then the accumulating products of tile j - 1, waits for the
// first two only and computes P_j and dS_j while the others run; so tile j + 1's copies go into
// the stage of tile j - 2, as in the forward.
//
// P and dS are rounded once to the operand type, P times TcF16::p_scale() and each row's dS
// times a power of two in f16, as attention_tc.cu's header describes, at less work a tile
// than the mma.sync kernels: both kernels fix their scales before the loop from a bound on
// |dS| (wg_backward; the heads' largest |V_j|, |dO_i| and |d_i| in `bounds`, three f32 bit
// patterns a head, zeroed before attention_value_bound and the dQ kernel record them), so
// that no tile takes tc_fit_ds_scales's vote and maxima; dQ takes its row's scale inside
// P (dP - d) as P fma(dP, scale, -d scale) (exact for a power of two); dK/dV's P takes 2^12 inside its
// exponent (within a rounding of the exponent's argument of the mma.sync kernels' P), and
// dS = P (dP - d) then carries 2^12 as well, which the output removes, and the head's one
// scale, taken in as dQ's rows take theirs. Every sum is in a fixed order and the bounds are
// maxima, whatever order the blocks record them in: results are deterministic.

// The L2 norms of this lane's two accumulator rows, row0 and row0 + 8, of a [T, stride] matrix
// of 16-bit values (0 for rows at or past T): the four lanes of a row each sum the squares of
// a quarter of it, then add their sums.
template <class Ops, int HS>
__device__ __forceinline__ void wg_row_norms(const typename Ops::elem* __restrict__ rows, size_t stride, int row0,
                                             int t, int T, float (&norm)[2]) {
    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        float sum = 0.0f;
        if (row < T) {
            const uint4* q = reinterpret_cast<const uint4*>(rows + (size_t)row * stride + t * (HS / 4));
            #pragma unroll
            for (int i = 0; i < HS / 32; i++) {
                const uint4 v = q[i];
                const unsigned w[4] = {v.x, v.y, v.z, v.w};
                #pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float lo = Ops::low(w[j]), hi = Ops::high(w[j]);
                    sum = fmaf(lo, lo, fmaf(hi, hi, sum));
                }
            }
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        norm[r] = sqrtf(sum);
    }
}

// dQ's row term d_i = dO_i . O_i (tc_row_term's sums, bit for bit) and, for f16's dS scales,
// the L2 norm of dO_i, from one read of the rows (tc_row_term_pieces' lanes and pieces; reading
// dO again for its norms cost f16's dQ a second round of global loads before its loop).
// Returned for the lane's accumulator rows, row0 and row0 + 8.
template <class Ops, int HS>
__device__ __forceinline__ void wg_row_term_norms(const typename Ops::elem* __restrict__ out,
                                                  const typename Ops::elem* __restrict__ dout, size_t first,
                                                  int warp_row0, int T, int C, float rowd[2], float norm[2]) {
    float squares = 0.0f;
    tc_row_term_pieces<uint4, HS>(out, dout, first, warp_row0, T, C, rowd, [&](float& sum, uint4 ov, uint4 gv) {
        const unsigned ow[4] = {ov.x, ov.y, ov.z, ov.w}, gw[4] = {gv.x, gv.y, gv.z, gv.w};
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const float glo = Ops::low(gw[j]), ghi = Ops::high(gw[j]);
            sum += Ops::low(ow[j]) * glo + Ops::high(ow[j]) * ghi;
            squares = fmaf(glo, glo, fmaf(ghi, ghi, squares));
        }
    });
    tc_row_term_to_rows(squares, norm);
    norm[0] = sqrtf(norm[0]);
    norm[1] = sqrtf(norm[1]);
}

// Rows of the tiles the backward streams: 64, except dK/dV's 32 at head size 128 in its threads'
// copies, where its two 64 x 128 f32 accumulators take 128 registers a thread and 32-row tiles
// keep the scores at 16 registers each, so that two blocks share an SM (attention.rs mirrors
// this). dK/dV's TMA form streams 64 rows at both head sizes (dkv_tma_*).
template <int HS> struct WgBackward {
    static constexpr int dq_stream = 64;
    static constexpr int dkv_stream = HS == 64 ? 64 : 32;
    // The block's own tiles whose A operands (of S and dP) the products read from registers
    // rather than shared memory (wg_backward's RA), as measured on an H200 (B 4, T 4096;
    // docs/perf-log.md): at head size 128 both of dQ's (Q, dO) and dK/dV's K (V's 32
    // registers more would not fit beside dK and dV), 5-7% off the backward; at 64 dK/dV's
    // two only, as dQ's made that kernel slower.
    static constexpr int dq_regs = HS == 64 ? 0 : 3;
    static constexpr int dkv_regs = HS == 64 ? 3 : 1;
    // Warpgroups a block (wg_backward's G), as measured on an H200 (B 4, T 4096): two in dK/dV's
    // TMA form, sharing each streamed tile (3-4% off the backward at head size 64; at 128 see
    // dkv_tma_stream); 1% slower in its threads' copies; dQ at 64 (three one-warpgroup blocks
    // an SM, where two warpgroups' blocks fit one) and both thread-copy kernels at 128 slower
    // with two.
    static constexpr int dq_groups = 1;
    static constexpr int dkv_groups = 1;
    static constexpr int dkv_tma_groups = 2;
    // dK/dV's TMA form at head size 128: two warpgroups sharing 64-row tiles, K and V read from
    // shared memory (dK's and dV's accumulators leave no registers for them; 255 registers, one
    // block of eight warps an SM in 162.5 KiB). Against 32-row tiles with K in registers in two
    // one-warpgroup blocks (the threads' copies), half the tiles and barriers a key block and
    // no per-thread copy arithmetic: 10% off the bf16 backward at T 4096, 12% at 8192 on an
    // H200 (docs/perf-log.md).
    static constexpr int dkv_tma_stream = 64;
    static constexpr int dkv_tma_regs = HS == 64 ? 3 : 0;
    // dK/dV's streamed rows, register operands and warpgroups in its threads' copies or its
    // TMA form.
    template <bool TMA> struct Dkv {
        static constexpr int stream = TMA ? dkv_tma_stream : dkv_stream;
        static constexpr int regs = TMA ? dkv_tma_regs : dkv_regs;
        static constexpr int groups = TMA ? dkv_tma_groups : dkv_groups;
    };
};

// Shared memory of the backward at head size HS with N-row streamed tiles and G warpgroups a
// block: each warpgroup's own tiles of 64 rows that RA leaves in shared memory, three stages of
// two streamed tiles (128-byte swizzled rows, HS / 64 sub-tiles each) that the warpgroups
// share, for dK/dV three stages of the queries' lse and d (f32), and 1024 bytes to align the
// tiles.
template <int HS, int N, bool DKV, int RA = 0, int G = 1> struct WgBackShape {
    static constexpr int own_sub = WG_ROWS * 128;  // bytes of one 64-column sub-tile of an owned tile
    static constexpr int own = (HS / 64) * own_sub;
    static constexpr int owned = (RA & 1 ? 0 : 1) + (RA & 2 ? 0 : 1);  // owned tiles in shared memory
    static constexpr int sub = N * 128;            // the same for a streamed tile
    static constexpr int tile = (HS / 64) * sub;
    static constexpr int stages = 3;
    static constexpr int row_terms = DKV ? 2 * N * 4 : 0;  // a stage's lse and d, bytes
    static constexpr int bytes = G * owned * own + stages * (2 * tile + row_terms) + 1024;
    static_assert(bytes <= (G == 1 ? 113 : 227) * 1024, "two warpgroups' blocks fit an SM's shared memory");
};

// The backward's blocks (a grid of gridDim.x row tiles by gridDim.y = B NH heads): which head
// and tile block (blockIdx.x, blockIdx.y) takes. The GPU starts blocks in the order of their
// linear index blockIdx.y gridDim.x + blockIdx.x as room frees, so that order decides what
// runs at the end. WG_BACKWARD_ORDER 0: the grid's own (each head's tiles, the longest
// first, one head after another); 1: every head's longest tile, then every head's next; 2: 1
// within sections of heads whose streamed tiles (T HS 4 bytes a head) fill about 24 MiB.
// The engine runs 2: 2-7% off the backward at T 4096, 15-17% at head size 64, T 1024 (H200,
// docs/benchmarks/2026-12-03-h200/counter-order).
#ifndef WG_BACKWARD_ORDER
#define WG_BACKWARD_ORDER 2
#endif
template <int HS>
__device__ __forceinline__ void wg_backward_tile(int T, int& bh, int& xt) {
#if WG_BACKWARD_ORDER == 0
    bh = blockIdx.y;
    xt = blockIdx.x;
#else
    const int X = gridDim.x, BNH = gridDim.y, L = blockIdx.y * X + blockIdx.x;
#if WG_BACKWARD_ORDER == 1
    xt = L / BNH;
    bh = L % BNH;
#else
    wg_section_entry(L, X, BNH, wg_section_heads<HS>(T), bh, xt);
#endif
#endif
}

// With TMA thread 0 has the TMA unit copy each streamed tile (`map_y`: qkv as [B][T][3C], for
// dQ K and V, for dK/dV Q; `map_g`: dout as [B][T][C], dK/dV's dO; boxes of 64 columns by N
// rows, the 128-byte swizzle), and every thread waits on the stage's mbarrier; dK/dV's lse and
// d and the block's own tiles stay cp.async copies.
// RA's bits choose the block's tiles that S's and dP's products take from registers (bit 0 x1,
// bit 1 x2; the fragments read once from global memory, wg_load_q) rather than from shared
// memory: a product of N = 32 columns with both operands in shared memory reads 3 KiB a
// 64 x 32 x 16 step, more than the 128 bytes a cycle shared memory gives the tensor cores'
// rate; with A in registers, 1 KiB.
// G warpgroups a block (1 or 2) each own 64 consecutive rows and share the streamed tiles, so a
// tile's copy and its waits serve G times the products (WgBackward says where that pays).
template <class Ops, int HS, int N, bool DKV, bool TMA = false, int RA = 0, int G = 1>
__device__ __forceinline__ void wg_backward(const typename Ops::elem* __restrict__ qkv,
                                            const typename Ops::elem* __restrict__ out,
                                            const typename Ops::elem* __restrict__ dout,
                                            const float* __restrict__ lse, float* __restrict__ d,
                                            unsigned* __restrict__ bounds,
                                            typename Ops::elem* __restrict__ dqkv, int T, int C,
                                            int NH, int W, const WgTensorMap* map_y = nullptr,
                                            const WgTensorMap* map_g = nullptr) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef WgBackShape<HS, N, DKV, RA, G> S;
    typedef typename Ops::elem E;
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    tc_need_shared(S::bytes);
    if (blockDim.x != G * WG_THREADS) __trap();
    // This thread's warpgroup and its index there.
    const int wg = G == 1 ? 0 : threadIdx.x / WG_THREADS, wtid = G == 1 ? threadIdx.x : threadIdx.x % WG_THREADS;
    const unsigned smem0 = (tc_smem_addr(wg_smem) + 1023u) & ~1023u;
    // The warpgroup's tiles x1 (dQ: Q; dK/dV: K) and x2 (dO; V); stage i's streamed tiles y1
    // (K; Q) and y2 (V; dO), and for dK/dV its queries' lse and d.
    const unsigned x1 = smem0 + wg * S::owned * S::own, x2 = x1 + (RA & 1 ? 0 : S::own);
    auto y1 = [&](int i) { return smem0 + G * S::owned * S::own + 2 * i * S::tile; };
    auto y2 = [&](int i) { return y1(i) + S::tile; };
    float* const row_terms = reinterpret_cast<float*>(wg_smem + (smem0 - tc_smem_addr(wg_smem)) +
                                                      G * S::owned * S::own + S::stages * 2 * S::tile);
    auto lses = [&](int i) { return row_terms + 2 * i * N; };
    auto ds = [&](int i) { return row_terms + (2 * i + 1) * N; };
    int bh, xt;
    wg_backward_tile<HS>(T, bh, xt);
    const int b = bh / NH, h = bh % NH;
    const int warp = wtid >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const size_t stride = 3 * (size_t)C;
    const E* base = qkv + (size_t)b * T * stride + h * HS;
    const E* gbase = dout + (size_t)b * T * C + h * HS;
    const size_t lse_row = ((size_t)b * NH + h) * T;
    const float c = tc_scale<HS>() * TC_LOG2E;
    // The block's G x 64 rows from rb: keys (the first key tiles see the most queries) or
    // queries (the last see the most keys); each starts the longest first. The warpgroup's 64
    // from r0.
    const int rb = (DKV ? xt : gridDim.x - 1 - xt) * G * WG_ROWS, last = rb + G * WG_ROWS - 1;
    const int r0 = rb + wg * WG_ROWS;
    const int warp_row0 = r0 + warp * 16;
    const int row0 = warp_row0 + g;  // this lane's rows: row0 and row0 + 8
    // The streamed tiles: dK/dV from the tile holding query rb (the first that sees key rb) to
    // the last query that sees the block's last key; dQ from the first key its window reaches
    // to its last query's. With G = 2, the tiles one warpgroup's rows do not reach are masked
    // whole for it.
    int first, tiles;
    if constexpr (DKV) {
        first = rb / N;
        const int all = (T + N - 1) / N;
        tiles = (W > 0 ? min(all, (last + W - 1) / N + 1) : all) - first;
    } else {
        first = tc_first_key_tile(rb, W, N);
        tiles = min(last, T - 1) / N - first + 1;
    }

    // The block's own tiles: x1 (dQ: Q; dK/dV: K) and x2 (dO; V), in shared memory or, by RA,
    // as A fragments in registers.
    const E* const x1_src = DKV ? base + C : base;
    const E* const x2_src = DKV ? base + 2 * C : gbase;
    const size_t x2_stride = DKV ? stride : (size_t)C;
    if constexpr (!(RA & 1)) wg_tile_copy<HS, WG_ROWS, WG_THREADS>(x1, x1_src, stride, r0, T, wtid);
    if constexpr (!(RA & 2)) wg_tile_copy<HS, WG_ROWS, WG_THREADS>(x2, x2_src, x2_stride, r0, T, wtid);
    unsigned xf1[RA & 1 ? HS / 16 : 1][4], xf2[RA & 2 ? HS / 16 : 1][4];
    if constexpr (RA & 1) wg_load_q<HS>(xf1, x1_src, stride, row0, t, T);
    if constexpr (RA & 2) wg_load_q<HS>(xf2, x2_src, x2_stride, row0, t, T);
    // dK/dV: the lse and d of tile j's queries.
    auto copy_row_terms = [&](int j, int stage) {
        const int s0 = (first + j) * N;
        for (int i = threadIdx.x; i < N; i += G * WG_THREADS) {
            const bool in = s0 + i < T;
            const size_t at = lse_row + (in ? s0 + i : 0);
            tc_copy_async4(lses(stage) + i, lse + at, in);
            tc_copy_async4(ds(stage) + i, d + at, in);
        }
    };
    auto copy_tile = [&](int j, int stage) {
        const int s0 = (first + j) * N;
        if constexpr (DKV) {
            wg_tile_copy<HS, N, G * WG_THREADS>(y1(stage), base, stride, s0, T);
            wg_tile_copy<HS, N, G * WG_THREADS>(y2(stage), gbase, C, s0, T);
            copy_row_terms(j, stage);
        } else {
            wg_tile_copy<HS, N, G * WG_THREADS>(y1(stage), base + C, stride, s0, T);
            wg_tile_copy<HS, N, G * WG_THREADS>(y2(stage), base + 2 * C, stride, s0, T);
        }
    };
    // TMA: a full barrier a stage (one arrival, thread 0's, with the tile's bytes).
    unsigned full0 = 0;
    if constexpr (TMA) full0 = wg_tma_full_barriers();
    // TMA: thread 0's copies of tile j's two streamed tiles into `stage`.
    auto tma_tile = [&](int j, int stage) {
        const int s0 = (first + j) * N, col = h * HS;
        const unsigned bar = full0 + 8 * stage;
        if constexpr (DKV) {
            wg_tma_tile_pair<HS>(bar, 2 * S::tile, S::sub, s0, b, y1(stage), map_y, col, y2(stage), map_g, col);
        } else {
            wg_tma_tile_pair<HS>(bar, 2 * S::tile, S::sub, s0, b, y1(stage), map_y, C + col, y2(stage), map_y,
                                 2 * C + col);
        }
    };
    if constexpr (TMA) {
        if (threadIdx.x == 0) tma_tile(0, 0);
        if constexpr (DKV) copy_row_terms(0, 0);
    } else {
        copy_tile(0, 0);
    }
    tc_commit();

    // dQ: the row term d_i = dO_i . O_i (from the stored output) and lse, per query row.
    // f16 also takes the norms of its dO rows (dout_norm) for its dS scales below.
    float rowd[2] = {0.0f, 0.0f}, lse2[2] = {0.0f, 0.0f}, dout_norm[2] = {0.0f, 0.0f};
    if constexpr (!DKV) {
        if constexpr (Ops::scaled) {
            wg_row_term_norms<Ops, HS>(out, dout, (size_t)b * T * C + h * HS, warp_row0, T, C, rowd, dout_norm);
        } else {
            tc_row_term<Ops, HS>(out, dout, (size_t)b * T * C + h * HS, warp_row0, T, C, rowd);
        }
        #pragma unroll
        for (int r = 0; r < 2; r++) lse2[r] = row0 + 8 * r < T ? lse[lse_row + row0 + 8 * r] * TC_LOG2E : 0.0f;
    }

    float acc[HS / 8][4];             // dQ or dK
    float dv[DKV ? HS / 8 : 1][4];    // dV
    #pragma unroll
    for (int n = 0; n < HS / 8; n++) {
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
        if constexpr (DKV) dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;
    }
    float s[N / 8][4], dp[N / 8][4];  // S then P, and dP then dS, of the current tile
    unsigned pa[DKV ? N / 16 : 1][4], dsa[N / 16][4];  // P and dS of the last tile as A operands
    // f16's per-row dS scales k (fixed below), taken into dS as it is computed: dQ's rows by
    // dd_scaled (the row term d times k), dK/dV's one scale by its column pairs' d (p_ds). As k
    // is a power of two, P fma(dP, k, -k d) rounds to exactly k times P (dP - d).
    float ds_scale[2] = {1.0f, 1.0f}, dd_scaled[2] = {0.0f, 0.0f};
    unsigned* const head_bounds = bounds + 3 * ((size_t)b * NH + h);
    // f16 fixes each row's dS scale before the loop from a bound on the row's |dS|: |dS_ij| =
    // P_ij |dP_ij - d_i| <= |dO_i| |V_j| + |d_i| (P <= 1, Cauchy-Schwarz for dP = dO_i . V_j),
    // times P's scale in dK/dV. The power of two that puts the bound in [2^14, 2^15)
    // (tc_ds_scale) keeps every scaled dS under f16's largest value with room for the sums'
    // rounding and leaves 28 binades below it before dS turns subnormal, so no tile needs its
    // scales refitted (tc_fit_ds_scales, which the mma.sync kernels keep). The head's largest
    // |V_j| comes from attention_value_bound (launched first), its largest |dO_i| and |d_i|
    // from the dQ kernel for dK/dV's: as float bits, which order as unsigned integers for
    // values >= 0.
    if constexpr (Ops::scaled && !DKV) {
        const float v_max = __uint_as_float(head_bounds[2]);
        #pragma unroll
        for (int r = 0; r < 2; r++) {
            ds_scale[r] = tc_ds_scale(fmaf(dout_norm[r], v_max, fabsf(rowd[r])));
            dd_scaled[r] = rowd[r] * ds_scale[r];
        }
        const float norm_max = warp_max(fmaxf(dout_norm[0], dout_norm[1]));
        const float d_max = warp_max(fmaxf(fabsf(rowd[0]), fabsf(rowd[1])));
        if (lane == 0) {
            atomicMax(head_bounds, __float_as_uint(norm_max));
            atomicMax(head_bounds + 1, __float_as_uint(d_max));
        }
    }
    if constexpr (Ops::scaled && DKV) {
        // One scale for the head's rows, from its largest |V_j|, |dO_i| and |d_i|.
        const float dout_max = __uint_as_float(head_bounds[0]), d_max = __uint_as_float(head_bounds[1]);
        const float v_max = __uint_as_float(head_bounds[2]);
        ds_scale[0] = ds_scale[1] = tc_ds_scale(Ops::p_scale() * fmaf(v_max, dout_max, d_max));
    }

    // Waits for tile j's copies (in `stage`), and for the block's own tiles at j = 0.
    auto wait_tile = [&](int j, int stage) {
        tc_wait<0>();  // this thread's cp.async copies
        if constexpr (TMA) wg_mbar_wait(full0 + 8 * stage, (j / 3) & 1);  // the TMA unit's
        wg_fence_proxy();
        // Every thread's copies of tile j are in; every thread has finished step j - 1, whose
        // products read the stage of tile j - 2 at the latest, which tile j + 1 now fills.
        __syncthreads();
    };
    auto start_copy = [&](int j, int stage) {
        const int next = stage == 2 ? 0 : stage + 1;
        if constexpr (TMA) {
            if (threadIdx.x == 0 && j + 1 < tiles) tma_tile(j + 1, next);
            if constexpr (DKV) {
                if (j + 1 < tiles) copy_row_terms(j + 1, next);
            }
        } else if (j + 1 < tiles) {
            copy_tile(j + 1, next);
        }
        tc_commit();
    };
    // Issues S = x1 y1^T and dP = x2 y2^T from `stage` in one group, x1 and x2 from registers
    // or shared memory by RA (wg_issue_s's steps).
    auto issue_s_dp = [&](int stage) {
        const unsigned long long a1 = wg_desc(x1, 16, 1024), a2 = wg_desc(x2, 16, 1024);
        wg_issue_products<Ops, HS, N, !(RA & 1)>(s, xf1, a1, S::own_sub, y1(stage), S::sub);
        wg_issue_products<Ops, HS, N, !(RA & 2)>(dp, xf2, a2, S::own_sub, y2(stage), S::sub);
        wg_commit();
    };
    // Issues dV += P^T dO (dK/dV) and dQ += dS K or dK += dS^T Q from `stage`, the streamed
    // tiles read transposed: a k-step is 16 rows (2048 bytes), the 64-column halves at head
    // size 128 a sub-tile apart.
    auto issue_grads = [&](int stage) {
        const unsigned long long b1 = wg_desc(y1(stage), S::sub, 1024), b2 = wg_desc(y2(stage), S::sub, 1024);
        #pragma unroll
        for (int kk = 0; kk < N / 16; kk++) {
            if constexpr (DKV) Ops::template mma<HS, 1, 1>(dv, pa[kk], b2 + ((kk * 2048) >> 4));
            Ops::template mma<HS, 1, 1>(acc, dsa[kk], b1 + ((kk * 2048) >> 4));
        }
        wg_commit();
    };
    // P and dS of tile j from its S and dP, the per-score mask (causal, window, T) applied
    // only when `mask` (tc_masked_or_not: on the tiles that straddle it).
    auto p_ds = [&](int j, int stage, bool mask) {
        const int s0 = (first + j) * N;
        #pragma unroll
        for (int n = 0; n < N / 8; n++) {
            // dK/dV: the lse and d of this lane's two query columns, one 8-byte read each.
            float2 lse_pair = {0.0f, 0.0f}, d_pair = {0.0f, 0.0f};
            if constexpr (DKV) {
                lse_pair = *reinterpret_cast<const float2*>(lses(stage) + n * 8 + 2 * t);
                d_pair = *reinterpret_cast<const float2*>(ds(stage) + n * 8 + 2 * t);
                // f16: the head's one dS scale goes in here, two products a column pair, so
                // that each dS is k (dP - d) P by one fma and one product as in bf16, not
                // multiplied again when packed.
                if constexpr (Ops::scaled) d_pair = {d_pair.x * ds_scale[0], d_pair.y * ds_scale[0]};
            }
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e >> 1, col = n * 8 + 2 * t + (e & 1);
                const int query = DKV ? s0 + col : row0 + 8 * r, key = DKV ? row0 + 8 * r : s0 + col;
                // dK/dV's P times 2^p_log2 (f16's operand scale), folded into the exponent.
                const float neg_l2 = DKV ? fmaf(e & 1 ? lse_pair.y : lse_pair.x, -TC_LOG2E, Ops::p_log2) : -lse2[r];
                // f16's d carries its row's scale already (dd_scaled, or d_pair above).
                const float dd = DKV ? (e & 1 ? d_pair.y : d_pair.x) : Ops::scaled ? dd_scaled[r] : rowd[r];
                float p = tc_exp2(fmaf(s[n][e], c, neg_l2));
                if (mask && !(tc_sees(query, key, W) && query < T)) p = 0.0f;
                s[n][e] = p;
                if constexpr (Ops::scaled) dp[n][e] = p * fmaf(dp[n][e], ds_scale[r], -dd);
                else dp[n][e] = p * (dp[n][e] - dd);
            }
        }
    };
    auto p_ds_tile = [&](int j, int stage) {
        const int s0 = (first + j) * N;
        const bool all_see = DKV ? tc_all_see(s0, s0 + N - 1, warp_row0, warp_row0 + 15, W, T)
                                 : tc_all_see(warp_row0, warp_row0 + 15, s0, s0 + N - 1, W, T);
        tc_masked_or_not(all_see, [&](bool masked) { p_ds(j, stage, masked); });
    };
    // P (already times its scale) and dS (times its row's) as the next products' A operands.
    auto pack = [&]() {
        // dS carries its scale already (and bf16's is 1).
        #pragma unroll
        for (int kk = 0; kk < N / 16; kk++) {
            if constexpr (DKV) {
                pa[kk][0] = Ops::pack(s[2 * kk][0], s[2 * kk][1]);
                pa[kk][1] = Ops::pack(s[2 * kk][2], s[2 * kk][3]);
                pa[kk][2] = Ops::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[kk][3] = Ops::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
            dsa[kk][0] = Ops::pack(dp[2 * kk][0], dp[2 * kk][1]);
            dsa[kk][1] = Ops::pack(dp[2 * kk][2], dp[2 * kk][3]);
            dsa[kk][2] = Ops::pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
            dsa[kk][3] = Ops::pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
        }
    };
    auto pin_grads = [&]() {
        wg_pin(acc);
        if constexpr (DKV) wg_pin(dv);
    };

    // Step 0: S_0, dP_0 and their P and dS (the accumulators are still zero).
    wait_tile(0, 0);
    start_copy(0, 0);
    wg_fence();
    issue_s_dp(0);
    wg_wait<0>();
    wg_pin(s);
    wg_pin(dp);
    p_ds_tile(0, 0);
    pack();
    int prev = 0;  // the stage of tile j - 1
    for (int it = 1; it < tiles; it++) {
        const int stage = prev == 2 ? 0 : prev + 1;
        wait_tile(it, stage);
        start_copy(it, stage);
        wg_fence();
        issue_s_dp(stage);
        issue_grads(prev);
        wg_wait<1>();  // S_j and dP_j are done
        wg_pin(s);
        wg_pin(dp);
        p_ds_tile(it, stage);
        wg_wait<0>();  // the products of tile j - 1 are done
        pin_grads();
        pack();
        prev = stage;
    }
    wg_fence();
    issue_grads(prev);
    wg_wait<0>();
    pin_grads();

    #pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        if (row >= T) continue;
        // dS's scale (in dK/dV times P's, which dS = P (dP - d) carries) and the score scale.
        const float k = tc_scale<HS>() / (DKV ? ds_scale[r] * Ops::p_scale() : ds_scale[r]);
        E* const dst_row = dqkv + ((size_t)b * T + row) * stride + h * HS + 2 * t;
        unsigned* dst = reinterpret_cast<unsigned*>(dst_row + (DKV ? C : 0));
        #pragma unroll
        for (int n = 0; n < HS / 8; n++) dst[n * 4] = Ops::pack(acc[n][2 * r] * k, acc[n][2 * r + 1] * k);
        if constexpr (DKV) {
            const float kv = 1.0f / Ops::p_scale();
            unsigned* dst_v = reinterpret_cast<unsigned*>(dst_row + 2 * C);
            #pragma unroll
            for (int n = 0; n < HS / 8; n++) dst_v[n * 4] = Ops::pack(dv[n][2 * r] * kv, dv[n][2 * r + 1] * kv);
        } else if (t == 0) {
            d[lse_row + row] = rowd[r];
        }
    }
#elif defined(__CUDA_ARCH__)
    __trap();
#endif
}

// f16's backward: the head's largest |V_j| (an L2 norm over the head's columns) as float bits
// into bounds[3 (b NH + h) + 2], zeroed before, for both backward kernels' dS scales
// (wg_backward). A block of four warps takes 64 rows of one head, 16 a warp.
template <class Ops, int HS>
__device__ __forceinline__ void wg_value_bound(const typename Ops::elem* __restrict__ qkv,
                                               unsigned* __restrict__ bounds, int T, int C, int NH) {
    const int b = blockIdx.y / NH, h = blockIdx.y % NH;
    const int lane = threadIdx.x & 31;
    const int row0 = blockIdx.x * WG_ROWS + (threadIdx.x >> 5) * 16 + (lane >> 2);
    float norm[2];
    wg_row_norms<Ops, HS>(qkv + (size_t)b * T * 3 * C + 2 * C + h * HS, 3 * (size_t)C, row0, lane & 3, T, norm);
    const float largest = warp_max(fmaxf(norm[0], norm[1]));
    if (lane == 0) atomicMax(bounds + 3 * ((size_t)b * NH + h) + 2, __float_as_uint(largest));
}
#define WG_VALUE_BOUND_ENTRY_POINT(HS)                                                                     \
    extern "C" __global__ void __launch_bounds__(WG_THREADS) attention_value_bound_f16_hs##HS(              \
        const WgF16::elem* qkv, unsigned* bounds, int T, int C, int NH) {                                  \
        wg_value_bound<WgF16, HS>(qkv, bounds, T, C, NH);                                                  \
    }

// Entry points for a configuration (WgShape); attention.rs appends the engine's, those of
// WgForward, one per element type and head size.
#define WG_ENTRY_POINT(HS, N, G, QS, OPS, NAME) WG_STAGES_ENTRY_POINT(HS, N, G, QS, 3, OPS, NAME)
// The one-warpgroup forward fed by TMA (wg_forward's TMA), its tensor map an extra parameter.
#define WG_TMA_ENTRY_POINT(HS, N, OPS, NAME)                                                               \
    extern "C" __global__ void __launch_bounds__(WG_THREADS, (WgShape<HS, N, 1, false>::min_blocks))       \
        NAME(const OPS::elem* qkv, OPS::elem* out, float* lse, int T, int C, int NH, int W,                  \
             const __grid_constant__ WgTensorMap map) {                                                     \
        wg_forward<OPS, HS, N, 1, false, 3, true>(qkv, out, lse, T, C, NH, W, &map);                        \
    }
#define WG_STAGES_ENTRY_POINT(HS, N, G, QS, ST, OPS, NAME)                                                 \
    extern "C" __global__ void __launch_bounds__(G * WG_THREADS, (WgShape<HS, N, G, QS, ST>::min_blocks)) \
        NAME(const OPS::elem* qkv, OPS::elem* out, float* lse, int T, int C, int NH, int W) {              \
        wg_forward<OPS, HS, N, G, QS, ST>(qkv, out, lse, T, C, NH, W);                                    \
    }
// The backward's kernels: dQ and dK/dV at head size HS (WgBackward's tiles, register operands
// and warpgroups), with the threads' copies or (TMA) fed by the TMA unit, whose tensor maps
// are extra parameters: dQ's of qkv, dK/dV's of qkv and of dout.
#define WG_DQ_KERNEL(HS, TMA, OPS, NAME, MAP_PARAMS, MAPS)                                               \
    extern "C" __global__ void __launch_bounds__(WgBackward<HS>::dq_groups * WG_THREADS,                  \
                                                 WgBackward<HS>::dq_groups == 1 ? 2 : 1) NAME(            \
        const OPS::elem* qkv, const OPS::elem* out, const OPS::elem* dout, const float* lse, float* d,     \
        unsigned* bounds, OPS::elem* dqkv, int T, int C, int NH, int W MAP_PARAMS) {                      \
        wg_backward<OPS, HS, WgBackward<HS>::dq_stream, false, TMA, WgBackward<HS>::dq_regs,              \
                    WgBackward<HS>::dq_groups>(qkv, out, dout, lse, d, bounds, dqkv, T, C, NH, W MAPS);     \
    }
#define WG_DKV_KERNEL(HS, TMA, OPS, NAME, MAP_PARAMS, MAPS)                                              \
    extern "C" __global__ void __launch_bounds__(WgBackward<HS>::Dkv<TMA>::groups * WG_THREADS,           \
                                                 WgBackward<HS>::Dkv<TMA>::groups == 1 ? 2 : 1) NAME(     \
        const OPS::elem* qkv, const OPS::elem* dout, const float* lse, const float* d, unsigned* bounds,   \
        OPS::elem* dqkv, int T, int C, int NH, int W MAP_PARAMS) {                                        \
        wg_backward<OPS, HS, WgBackward<HS>::Dkv<TMA>::stream, true, TMA, WgBackward<HS>::Dkv<TMA>::regs,  \
                    WgBackward<HS>::Dkv<TMA>::groups>(qkv, nullptr, dout, lse, const_cast<float*>(d), bounds, \
                                                      dqkv, T, C, NH, W MAPS);                             \
    }
#define WG_NO_MAPS
#define WG_DQ_MAP_PARAMS , const __grid_constant__ WgTensorMap map_y
#define WG_DQ_MAPS , &map_y
#define WG_DKV_MAP_PARAMS , const __grid_constant__ WgTensorMap map_y, const __grid_constant__ WgTensorMap map_g
#define WG_DKV_MAPS , &map_y, &map_g
#define WG_ENTRY_POINTS(HS, OPS, SUFFIX)                                                                   \
    WG_ENTRY_POINT(HS, WgForward<HS>::keys, WgForward<HS>::groups, WgForward<HS>::q_shared, OPS,           \
                   attention_forward_##SUFFIX##_hs##HS##_wgmma)                                            \
    WG_DQ_KERNEL(HS, false, OPS, attention_backward_dq_##SUFFIX##_hs##HS##_wgmma, WG_NO_MAPS, WG_NO_MAPS)  \
    WG_DKV_KERNEL(HS, false, OPS, attention_backward_dkv_##SUFFIX##_hs##HS##_wgmma, WG_NO_MAPS, WG_NO_MAPS)
#define WG_TMA_DQ_ENTRY_POINT(HS, OPS, SUFFIX)                                                             \
    WG_DQ_KERNEL(HS, true, OPS, attention_backward_dq_##SUFFIX##_hs##HS##_wgmma_tma, WG_DQ_MAP_PARAMS, WG_DQ_MAPS)
#define WG_TMA_BACKWARD_ENTRY_POINTS(HS, OPS, SUFFIX)                                                      \
    WG_TMA_DQ_ENTRY_POINT(HS, OPS, SUFFIX)                                                                 \
    WG_DKV_KERNEL(HS, true, OPS, attention_backward_dkv_##SUFFIX##_hs##HS##_wgmma_tma, WG_DKV_MAP_PARAMS,  \
                  WG_DKV_MAPS)
