// BK-Core on the GPU: diag((H - zI)^-1) of B tridiagonal systems of size N, and its exact
// gradient, in f32 complex arithmetic; reference: engine/cpu/bk_core.rs (same recurrences,
// same adjoint; the module doc there derives them).
//
// Parallel over the sequence as well as the batch: each sequence is cut into chunks of
// consecutive positions, one thread per chunk, so B = 1 still spreads over many threads. The
// pivot recurrence r_i = s_i - p_{i-1} / r_{i-1} is a Moebius map of r_{i-1}, i.e. the 2x2
// matrix [[s, -p], [1, 0]] acting on r as a projective pair (num, den), so a chunk's effect
// composes into one matrix (normalised by a power of two, which is exact and keeps the
// product in range). The same holds for q from the right, and the adjoint recurrences are
// affine maps x -> A x + B. A scan of the chunk maps gives each chunk the values entering
// it, from which the thread re-runs the plain recurrences.
//
// Four implementations:
// - Warp (bk_forward_warp*, bk_backward_warp*; "Warp kernels" at the end), for small calls
//   (up to 2^17 positions) of N = 128, 256 or 512 with unit off-diagonals: one warp per
//   sequence, everything in registers.
// - Long-chunk (bk_forward_long*, bk_backward_long*; "Long-chunk kernels" below), for calls of
//   more than 2^17 positions with unit off-diagonals and N a multiple of 32 chunks: 16 to 64
//   positions per thread and one composition for both sweeps.
// - Fused (bk_forward_fused, bk_backward_fused; after the multi-launch kernels), one launch each: a
//   team of warps per sequence stages it in shared memory with coalesced accesses and scans
//   the chunk maps across the team, so DRAM sees only the inputs and outputs (forward: v in,
//   G out, 12 bytes per position; backward: v and dL/dG in, dv out, 20 bytes). Used while
//   the sequence fits (shared memory; at most BKF_CHUNK positions per thread backward).
// - Multi-launch, BK_CHUNK positions per thread, for longer sequences. Forward:
//     bk_chunk_maps   one thread per chunk: its r and q matrices
//     bk_scan_maps    one warp per sequence: scan of the chunk matrices -> each chunk's
//                     entering r (from the left) and q (from the right), as projective pairs
//     bk_forward      one thread per chunk: re-runs the plain recurrences from those values
//   Backward: the two first kernels, then
//     bk_backward_local  pivots into scratch, dbar, and each chunk's affine adjoint maps
//     bk_scan_affine     one warp per sequence: entering adjoint carries
//     bk_backward_final  the adjoint sweeps: dv, and per-chunk / per-position partial sums
//                        of the z and off-diagonal gradients (reduced in a fixed order after)

#define BK_CHUNK 32

struct cx { float x, y; };
__device__ __forceinline__ cx mk(float x, float y) { cx r; r.x = x; r.y = y; return r; }
__device__ __forceinline__ cx add(cx a, cx b) { return mk(a.x + b.x, a.y + b.y); }
__device__ __forceinline__ cx sub(cx a, cx b) { return mk(a.x - b.x, a.y - b.y); }
__device__ __forceinline__ cx mul(cx a, cx b) { return mk(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x); }
__device__ __forceinline__ cx scl(cx a, float k) { return mk(a.x * k, a.y * k); }
// conj / |.|^2 as on the CPU: a zero divisor gives NaN (0 * inf), never a silent zero. One
// hardware reciprocal (about 1 ulp) instead of two IEEE divisions: the sweeps are chains of
// these, and the division's longer instruction sequence set their speed.
__device__ __forceinline__ cx rcp(cx a) {
    const float inv = __fdividef(1.0f, a.x * a.x + a.y * a.y);
    return mk(a.x * inv, -a.y * inv);
}
__device__ __forceinline__ cx cdiv(cx a, cx b) { return mul(a, rcp(b)); }
__device__ __forceinline__ cx ld2(const float* p) { return mk(p[0], p[1]); }
__device__ __forceinline__ void st2(float* p, cx a) { p[0] = a.x; p[1] = a.y; }

// 2^-e for the binary exponent e of m > 0: exact scaling that brings m near 1.
__device__ __forceinline__ float pow2_inv(float m) {
    int e = (__float_as_int(m) >> 23) & 0xff;
    e = max(1, min(e, 253));
    return __int_as_float((254 - e) << 23);
}
__device__ __forceinline__ float mag(cx a) { return fmaxf(fabsf(a.x), fabsf(a.y)); }

// A Moebius map as [[a, b], [c, d]] acting on (num, den).
struct Mob { cx a, b, c, d; };
__device__ __forceinline__ Mob mob_id() { Mob m; m.a = mk(1, 0); m.b = mk(0, 0); m.c = mk(0, 0); m.d = mk(1, 0); return m; }
__device__ __forceinline__ Mob normalised(Mob m) {
    const float k = pow2_inv(fmaxf(fmaxf(mag(m.a), mag(m.b)), fmaxf(mag(m.c), mag(m.d))));
    m.a = scl(m.a, k); m.b = scl(m.b, k); m.c = scl(m.c, k); m.d = scl(m.d, k);
    return m;
}
// later o earlier (apply `e` first).
__device__ __forceinline__ Mob combine(Mob l, Mob e) {
    Mob m;
    m.a = add(mul(l.a, e.a), mul(l.b, e.c));
    m.b = add(mul(l.a, e.b), mul(l.b, e.d));
    m.c = add(mul(l.c, e.a), mul(l.d, e.c));
    m.d = add(mul(l.c, e.b), mul(l.d, e.d));
    return normalised(m);
}
// [[s, -p], [1, 0]] o m: one step x -> s - p / x after `m`. Normalised on every second step
// and at the chunk's end (`renorm`): a normalised map's entries are at most 2 and one step
// multiplies them by at most |s| + |p|, so two steps stay finite while |s| + |p| < 1e19,
// which every pivot the reciprocal can invert (|x|^2 finite) already needs.
__device__ __forceinline__ Mob step(Mob m, cx s, float p, bool renorm) {
    Mob r;
    r.a = sub(mul(s, m.a), scl(m.c, p));
    r.b = sub(mul(s, m.b), scl(m.d, p));
    r.c = m.a;
    r.d = m.b;
    return renorm ? normalised(r) : r;
}
__device__ __forceinline__ Mob identity_of(Mob) { return mob_id(); }

// An affine map x -> A x + B.
struct Aff { cx A, B; };
__device__ __forceinline__ Aff combine(Aff l, Aff e) {
    Aff r;
    r.A = mul(l.A, e.A);
    r.B = add(mul(l.A, e.B), l.B);
    return r;
}
__device__ __forceinline__ Aff identity_of(Aff) { Aff r; r.A = mk(1, 0); r.B = mk(0, 0); return r; }

__device__ __forceinline__ cx shfl(cx a, int d, bool rev) {
    return rev ? mk(__shfl_down_sync(0xffffffffu, a.x, d), __shfl_down_sync(0xffffffffu, a.y, d))
               : mk(__shfl_up_sync(0xffffffffu, a.x, d), __shfl_up_sync(0xffffffffu, a.y, d));
}
__device__ __forceinline__ Mob shfl(Mob m, int d, bool rev) {
    m.a = shfl(m.a, d, rev); m.b = shfl(m.b, d, rev); m.c = shfl(m.c, d, rev); m.d = shfl(m.d, d, rev);
    return m;
}
__device__ __forceinline__ Aff shfl(Aff m, int d, bool rev) {
    m.A = shfl(m.A, d, rev); m.B = shfl(m.B, d, rev);
    return m;
}

// Lane `src`'s value, in every lane.
__device__ __forceinline__ cx shfl_from(cx a, int src) {
    return mk(__shfl_sync(0xffffffffu, a.x, src), __shfl_sync(0xffffffffu, a.y, src));
}
__device__ __forceinline__ Mob shfl_from(Mob m, int src) {
    m.a = shfl_from(m.a, src); m.b = shfl_from(m.b, src); m.c = shfl_from(m.c, src); m.d = shfl_from(m.d, src);
    return m;
}
__device__ __forceinline__ Aff shfl_from(Aff m, int src) {
    m.A = shfl_from(m.A, src); m.B = shfl_from(m.B, src);
    return m;
}

// Inclusive warp scan: lane k gets the composition of itself and the lanes before it (after
// it when `rev`), the nearest applied last, over the first `width` lanes (a power of two; the
// lanes past it must hold identities when `rev`). Every lane of the warp must call it.
template <typename T> __device__ T warp_scan_incl(T x, int lane, bool rev, int width = 32) {
    for (int d = 1; d < width; d <<= 1) {
        const T y = shfl(x, d, rev);
        if (rev ? lane + d < 32 : lane >= d) x = combine(x, y);
    }
    return x;
}

// The exclusive form of an inclusive scan over the first `width` lanes: each lane takes its
// predecessor's value.
template <typename T> __device__ T warp_excl_of(T incl, int lane, bool rev, int width = 32) {
    const T e = shfl(incl, 1, rev);
    return (rev ? lane == width - 1 : lane == 0) ? identity_of(incl) : e;
}

template <typename T> __device__ T warp_scan_excl(T x, int lane, bool rev) {
    return warp_excl_of(warp_scan_incl(x, lane, rev), lane, rev);
}

// The coefficients of one call.
struct Coef {
    const float* v;
    float zr, zi;
    const float* b;
    const float* c;
    int has_off, n;
    // s_i of the sequence starting at v + base.
    __device__ __forceinline__ cx s(long long base, int i) const { return mk(-2.0f + v[base + i] - zr, -zi); }
    // p_i = b_i c_i for 0 <= i < n - 1; zero outside (no neighbour).
    __device__ __forceinline__ float p(int i) const {
        if (i < 0 || i >= n - 1) return 0.0f;
        return has_off ? b[i] * c[i] : 1.0f;
    }
};

__device__ __forceinline__ Coef coef(const float* v, const float* z, const float* b, const float* c, int has_off, int n) {
    Coef k;
    k.v = v; k.zr = z[0]; k.zi = z[1]; k.b = b; k.c = c; k.has_off = has_off; k.n = n;
    return k;
}

// Which chunk a thread owns: sequence, base offset, [lo, hi). False past the last chunk.
struct Chunk { int seq, lo, hi; long long base, id; };
__device__ __forceinline__ bool my_chunk(int batch, int n, Chunk& ch) {
    const int cps = (n + BK_CHUNK - 1) / BK_CHUNK;
    ch.id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (ch.id >= (long long)batch * cps) return false;
    ch.seq = (int)(ch.id / cps);
    ch.lo = (int)(ch.id % cps) * BK_CHUNK;
    ch.hi = min(ch.lo + BK_CHUNK, n);
    ch.base = (long long)ch.seq * n;
    return true;
}

// maps[id*16 .. +8]: the chunk's r map (left to right); [+8 .. +16]: its q map (right to left).
extern "C" __global__ void bk_chunk_maps(float* maps, const float* v, const float* z, const float* b,
                                         const float* c, int has_off, int batch, int n, int causal) {
    Chunk ch;
    if (!my_chunk(batch, n, ch)) return;
    const Coef k = coef(v, z, b, c, has_off, n);
    Mob r = mob_id();
    for (int i = ch.lo; i < ch.hi; ++i) r = step(r, k.s(ch.base, i), k.p(i - 1), ((i - ch.lo) & 1) || i + 1 == ch.hi);
    Mob q = mob_id();
    if (!causal)
        for (int i = ch.hi - 1; i >= ch.lo; --i) q = step(q, k.s(ch.base, i), k.p(i), ((ch.hi - 1 - i) & 1) || i == ch.lo);
    float* o = maps + ch.id * 16;
    st2(o + 0, r.a); st2(o + 2, r.b); st2(o + 4, r.c); st2(o + 6, r.d);
    st2(o + 8, q.a); st2(o + 10, q.b); st2(o + 12, q.c); st2(o + 14, q.d);
}

__device__ __forceinline__ Mob load_mob(const float* p) {
    Mob m; m.a = ld2(p); m.b = ld2(p + 2); m.c = ld2(p + 4); m.d = ld2(p + 6);
    return m;
}
// m applied to (num, den), renormalised.
__device__ __forceinline__ void apply(const Mob& m, cx& num, cx& den) {
    const cx a = add(mul(m.a, num), mul(m.b, den));
    const cx c = add(mul(m.c, num), mul(m.d, den));
    const float k = pow2_inv(fmaxf(mag(a), mag(c)));
    num = scl(a, k);
    den = scl(c, k);
}

// One warp per sequence. enter[id*8 .. +4]: (num, den) of r_{lo-1}; [+4 .. +8]: of q_hi.
// A sequence's end is (1, 0), "infinity", which the boundary's zero p ignores.
extern "C" __global__ void bk_scan_maps(float* enter, const float* maps, int batch, int n, int causal) {
    const int lane = threadIdx.x & 31;
    const int seq = (int)(((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    if (seq >= batch) return;  // whole warps only: blockDim is a multiple of 32
    const int cps = (n + BK_CHUNK - 1) / BK_CHUNK;
    const int per = (cps + 31) / 32;
    const int a = min(lane * per, cps), e = min(a + per, cps);
    const long long first = (long long)seq * cps;
    Mob r = mob_id(), q = mob_id();
    for (int j = a; j < e; ++j) r = combine(load_mob(maps + (first + j) * 16), r);
    if (!causal)
        for (int j = e - 1; j >= a; --j) q = combine(load_mob(maps + (first + j) * 16 + 8), q);
    r = warp_scan_excl(r, lane, false);
    cx num = r.a, den = r.c;
    for (int j = a; j < e; ++j) {
        float* o = enter + (first + j) * 8;
        st2(o, num); st2(o + 2, den);
        apply(load_mob(maps + (first + j) * 16), num, den);
    }
    if (causal) return;
    q = warp_scan_excl(q, lane, true);
    num = q.a; den = q.c;
    for (int j = e - 1; j >= a; --j) {
        float* o = enter + (first + j) * 8 + 4;
        st2(o, num); st2(o + 2, den);
        apply(load_mob(maps + (first + j) * 16 + 8), num, den);
    }
}

// The first pivot of a chunk from the entering pair (num, den) of its neighbour:
// s - p * den / num.
__device__ __forceinline__ cx enter_pivot(cx s, float p, cx num, cx den) {
    return sub(s, scl(cdiv(den, num), p));
}
__device__ __forceinline__ cx first_pivot(cx s, float p, const float* pair) {
    return enter_pivot(s, p, ld2(pair), ld2(pair + 2));
}

// out[(seq*n + i)*2 + {0,1}] = G_ii. The r pivots pass through `out` (the thread's own
// positions) before G overwrites them. Sets *nonfinite when any G is inf or NaN.
extern "C" __global__ void bk_forward(float* out, unsigned int* nonfinite, const float* v, const float* enter,
                                      const float* z, const float* b, const float* c, int has_off, int batch,
                                      int n, int causal) {
    Chunk ch;
    if (!my_chunk(batch, n, ch)) return;
    const Coef k = coef(v, z, b, c, has_off, n);
    const float* en = enter + ch.id * 8;
    bool bad = false;
    cx r = first_pivot(k.s(ch.base, ch.lo), k.p(ch.lo - 1), en);
    for (int i = ch.lo; i < ch.hi; ++i) {
        if (i > ch.lo) r = sub(k.s(ch.base, i), scl(rcp(r), k.p(i - 1)));
        if (causal) {
            const cx g = rcp(r);
            bad |= !(is_finite(g.x) && is_finite(g.y));
            st2(out + 2 * (ch.base + i), g);
        } else {
            st2(out + 2 * (ch.base + i), r);
        }
    }
    if (!causal) {
        cx q = first_pivot(k.s(ch.base, ch.hi - 1), k.p(ch.hi - 1), en + 4);
        for (int i = ch.hi - 1; i >= ch.lo; --i) {
            const cx s = k.s(ch.base, i);
            if (i < ch.hi - 1) q = sub(s, scl(rcp(q), k.p(i)));
            float* o = out + 2 * (ch.base + i);
            const cx g = rcp(sub(add(ld2(o), q), s));
            bad |= !(is_finite(g.x) && is_finite(g.y));
            st2(o, g);
        }
    }
    if (bad) atomicOr(nonfinite, 1u);
}

// dbar_i = -gbar_i G_i^2 with gbar = dL/dRe G - i dL/dIm G.
__device__ __forceinline__ cx dbar_of(cx g, const float* dout) {
    const cx gbar = mk(dout[0], -dout[1]);
    return scl(mul(gbar, mul(g, g)), -1.0f);
}

// Pivots into rs/qs (f32 pairs per position) and aff[id*8]: the chunk's rbar map
// (rbar_lo as a function of rbar_hi) then its qbar map (qbar_{hi-1} of qbar_{lo-1}).
extern "C" __global__ void bk_backward_local(float* rs, float* qs, float* aff, const float* v, const float* dout,
                                             const float* enter, const float* z, const float* b, const float* c,
                                             int has_off, int batch, int n, int causal) {
    Chunk ch;
    if (!my_chunk(batch, n, ch)) return;
    const Coef k = coef(v, z, b, c, has_off, n);
    const float* en = enter + ch.id * 8;
    cx r = first_pivot(k.s(ch.base, ch.lo), k.p(ch.lo - 1), en);
    for (int i = ch.lo; i < ch.hi; ++i) {
        if (i > ch.lo) r = sub(k.s(ch.base, i), scl(rcp(r), k.p(i - 1)));
        st2(rs + 2 * (ch.base + i), r);
    }
    Aff mr = identity_of(Aff()), mq = identity_of(Aff());
    cx q = mk(0, 0);
    if (!causal) q = first_pivot(k.s(ch.base, ch.hi - 1), k.p(ch.hi - 1), en + 4);
    for (int i = ch.hi - 1; i >= ch.lo; --i) {
        const cx s = k.s(ch.base, i);
        const cx ri = ld2(rs + 2 * (ch.base + i));
        cx d = ri;
        if (!causal) {
            if (i < ch.hi - 1) q = sub(s, scl(rcp(q), k.p(i)));
            st2(qs + 2 * (ch.base + i), q);
            d = sub(add(ri, q), s);
        }
        const cx db = dbar_of(rcp(d), dout + 2 * (ch.base + i));
        const cx rinv = rcp(ri);
        Aff m;  // rbar_i = dbar_i + (p_i / r_i^2) rbar_{i+1}, applied after the maps to the right
        m.A = scl(mul(rinv, rinv), k.p(i));
        m.B = db;
        mr = combine(m, mr);
        if (!causal) {
            const cx qinv = rcp(q);  // qbar_i = dbar_i + (p_{i-1} / q_i^2) qbar_{i-1}, applied first
            m.A = scl(mul(qinv, qinv), k.p(i - 1));
            m.B = db;
            mq = combine(mq, m);
        }
    }
    float* o = aff + ch.id * 8;
    st2(o, mr.A); st2(o + 2, mr.B); st2(o + 4, mq.A); st2(o + 6, mq.B);
}

__device__ __forceinline__ Aff load_aff(const float* p) { Aff m; m.A = ld2(p); m.B = ld2(p + 2); return m; }

// One warp per sequence. carry[id*4 .. +2]: rbar at the chunk's hi (zero past the end);
// [+2 .. +4]: qbar at lo - 1 (zero before the start).
extern "C" __global__ void bk_scan_affine(float* carry, const float* aff, int batch, int n, int causal) {
    const int lane = threadIdx.x & 31;
    const int seq = (int)(((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    if (seq >= batch) return;
    const int cps = (n + BK_CHUNK - 1) / BK_CHUNK;
    const int per = (cps + 31) / 32;
    const int a = min(lane * per, cps), e = min(a + per, cps);
    const long long first = (long long)seq * cps;
    Aff r = identity_of(Aff()), q = identity_of(Aff());
    for (int j = e - 1; j >= a; --j) r = combine(load_aff(aff + (first + j) * 8), r);
    for (int j = a; j < e; ++j) q = combine(load_aff(aff + (first + j) * 8 + 4), q);
    r = warp_scan_excl(r, lane, true);
    cx x = r.B;
    for (int j = e - 1; j >= a; --j) {
        st2(carry + (first + j) * 4, x);
        const Aff m = load_aff(aff + (first + j) * 8);
        x = add(mul(m.A, x), m.B);
    }
    q = warp_scan_excl(q, lane, false);
    x = causal ? mk(0, 0) : q.B;
    for (int j = a; j < e; ++j) {
        st2(carry + (first + j) * 4 + 2, x);
        const Aff m = load_aff(aff + (first + j) * 8 + 4);
        x = add(mul(m.A, x), m.B);
    }
}

// dv (overwritten), zpart[id*2] = (-Re, Im) of the chunk's sum of sbar (its dL/dz share),
// and when learn_off, bpart/cpart[seq*(n-1) + i] = Re(pbar_i) c_i and Re(pbar_i) b_i.
extern "C" __global__ void bk_backward_final(float* dv, float* zpart, float* bpart, float* cpart, int learn_off,
                                             const float* rs, const float* qs, const float* v, const float* dout,
                                             const float* carry, const float* z, const float* b, const float* c,
                                             int has_off, int batch, int n, int causal) {
    Chunk ch;
    if (!my_chunk(batch, n, ch)) return;
    const Coef k = coef(v, z, b, c, has_off, n);
    const long long prow = (long long)ch.seq * (n - 1);
    cx sum = mk(0, 0);
    cx next = ld2(carry + ch.id * 4);  // rbar_{i+1}
    for (int i = ch.hi - 1; i >= ch.lo; --i) {
        const cx ri = ld2(rs + 2 * (ch.base + i));
        const cx s = k.s(ch.base, i);
        const cx d = causal ? ri : sub(add(ri, ld2(qs + 2 * (ch.base + i))), s);
        const cx db = dbar_of(rcp(d), dout + 2 * (ch.base + i));
        const cx rinv = rcp(ri);
        const float p = k.p(i);
        const cx rb = add(db, scl(mul(mul(rinv, rinv), next), p));
        const cx part = causal ? rb : sub(rb, db);
        dv[ch.base + i] = part.x;
        sum = add(sum, part);
        if (learn_off && i < n - 1) {
            const float pbar = -mul(next, rinv).x;
            if (causal) {
                bpart[prow + i] = pbar * c[i];
                cpart[prow + i] = pbar * b[i];
            } else {
                bpart[prow + i] = pbar;  // the q part is added below
            }
        }
        next = rb;
    }
    if (!causal) {
        cx prev = ld2(carry + ch.id * 4 + 2);  // qbar_{i-1}
        for (int i = ch.lo; i < ch.hi; ++i) {
            const cx qi = ld2(qs + 2 * (ch.base + i));
            const cx s = k.s(ch.base, i);
            const cx d = sub(add(ld2(rs + 2 * (ch.base + i)), qi), s);
            const cx db = dbar_of(rcp(d), dout + 2 * (ch.base + i));
            const cx qinv = rcp(qi);
            const cx qb = add(db, scl(mul(mul(qinv, qinv), prev), k.p(i - 1)));
            dv[ch.base + i] += qb.x;
            sum = add(sum, qb);
            if (learn_off && i < n - 1) {
                const float pbar = bpart[prow + i] - cdiv(qb, ld2(qs + 2 * (ch.base + i + 1))).x;
                bpart[prow + i] = pbar * c[i];
                cpart[prow + i] = pbar * b[i];
            }
            prev = qb;
        }
    }
    zpart[ch.id * 2] = -sum.x;
    zpart[ch.id * 2 + 1] = sum.y;
}


// ---- Fused forward: one launch, 12 bytes of DRAM traffic per position ----
//
// A team of `tw` warps owns one sequence (several teams per block when N is small). The team
// stages v (and the block the products p = b c) in shared memory with coalesced loads; each
// thread takes `chunk` consecutive positions, builds its chunk's r and q Moebius maps, a
// team-wide scan gives every chunk its entering pivots, the sweeps write G into shared memory
// and the team stores it with coalesced 8-byte stores. Shared arrays are indexed through
// `pad`, one spare slot per 32, so the threads of a warp walking their chunks in step hit
// distinct banks.

__device__ __forceinline__ int pad(int i) { return i + (i >> 5); }

// A map to and from shared memory (at most 16 floats).
__device__ __forceinline__ void store_val(float* p, const Mob& m) {
    st2(p, m.a); st2(p + 2, m.b); st2(p + 4, m.c); st2(p + 6, m.d);
}
__device__ __forceinline__ void load_val(const float* p, Mob& m) { m = load_mob(p); }
__device__ __forceinline__ void store_val(float* p, const Aff& m) { st2(p, m.A); st2(p + 2, m.B); }
__device__ __forceinline__ void load_val(const float* p, Aff& m) { m = load_aff(p); }

// Exclusive scan across the `tw` warps of a team (lane order, reversed when `rev`), the
// nearest map applied last. Holds two barriers: every thread of the block must call it the
// same number of times. `tot` holds 16 floats per warp of the block.
template <typename T> __device__ T team_scan_excl(T x, int lane, int warp, int tw, float* tot, bool rev) {
    const T incl = warp_scan_incl(x, lane, rev);
    if (lane == (rev ? 0 : 31)) store_val(tot + warp * 16, incl);
    __syncthreads();
    // Every warp scans its team's warp totals across its first `tw` lanes (log2(tw) steps
    // rather than a serial walk over up to tw - 1 totals) and takes its own exclusive prefix.
    const int first = warp - warp % tw;
    T y = identity_of(x);
    if (lane < tw) load_val(tot + (first + lane) * 16, y);
    const T pre = shfl_from(warp_excl_of(warp_scan_incl(y, lane, rev, tw), lane, rev, tw), warp - first);
    __syncthreads();  // `tot` is free again for the next scan
    return combine(warp_excl_of(incl, lane, rev), pre);
}

// Where a thread of a fused kernel stands: its team (one sequence) and its chunk [lo, hi).
struct Team {
    int tw, team_threads, teams, team, t, lane, warp, seq, lo, hi;
    bool active;
    long long base;
};
__device__ __forceinline__ Team team_of(int batch, int n, int tw, int chunk) {
    Team m;
    m.tw = tw;
    m.team_threads = 32 * tw;
    m.teams = blockDim.x / m.team_threads;
    m.team = threadIdx.x / m.team_threads;
    m.t = threadIdx.x % m.team_threads;
    m.lane = threadIdx.x & 31;
    m.warp = threadIdx.x >> 5;
    m.seq = blockIdx.x * m.teams + m.team;
    m.active = m.seq < batch;
    m.base = (long long)m.seq * n;
    // Teams past the batch keep empty chunks: identity maps, no memory touched.
    m.lo = m.active ? min(m.t * chunk, n) : 0;
    m.hi = m.active ? min(m.lo + chunk, n) : 0;
    return m;
}

// The shared coefficients of a fused kernel: s_i from the staged v, p_i from the staged
// products (zero outside [0, n - 1): no neighbour).
struct SharedCoef {
    const float* sv;
    const float* sp;
    float zr, zi;
    int has_off, n;
    __device__ __forceinline__ cx s(int i) const { return mk(-2.0f + sv[pad(i)] - zr, -zi); }
    __device__ __forceinline__ float p(int i) const {
        if (i < 0 || i >= n - 1) return 0.0f;
        return has_off ? sp[pad(i)] : 1.0f;
    }
};

// Copies src[i] to dst[pad(i)] for i = t, t + stride, ... < n (coalesced on the global side),
// with COPY_BATCH loads in flight per thread: a plain loop waits out one full DRAM latency per
// element, which was most of the fused kernels' time at every size.
#define COPY_BATCH 8
template <typename T> __device__ __forceinline__ void copy_in(T* dst, const T* src, int n, int t, int stride) {
    for (int i0 = t; i0 < n; i0 += COPY_BATCH * stride) {
        T tmp[COPY_BATCH];
#pragma unroll
        for (int u = 0; u < COPY_BATCH; ++u) {
            const int i = i0 + u * stride;
            if (i < n) tmp[u] = src[i];
        }
#pragma unroll
        for (int u = 0; u < COPY_BATCH; ++u) {
            const int i = i0 + u * stride;
            if (i < n) dst[pad(i)] = tmp[u];
        }
    }
}
// dst[i] = src[pad(i)], the way back (stores do not wait, but the shared loads are batched too).
template <typename T> __device__ __forceinline__ void copy_out(T* dst, const T* src, int n, int t, int stride) {
#pragma unroll COPY_BATCH
    for (int i = t; i < n; i += stride) dst[i] = src[pad(i)];
}

// Stages the team's v and the block's p (coalesced); ends with a barrier.
__device__ __forceinline__ void stage(const Team& m, float* sv, float* sp, const float* v, const float* b,
                                      const float* c, int has_off, int n) {
    if (m.active)
        copy_in(sv, v + m.base, n, m.t, m.team_threads);
    if (has_off)
        for (int i0 = threadIdx.x; i0 < n - 1; i0 += COPY_BATCH * blockDim.x) {
            float bb[COPY_BATCH], cc[COPY_BATCH];
#pragma unroll
            for (int u = 0; u < COPY_BATCH; ++u) {
                const int i = i0 + u * blockDim.x;
                if (i < n - 1) { bb[u] = b[i]; cc[u] = c[i]; }
            }
#pragma unroll
            for (int u = 0; u < COPY_BATCH; ++u) {
                const int i = i0 + u * blockDim.x;
                if (i < n - 1) sp[pad(i)] = bb[u] * cc[u];
            }
        }
    __syncthreads();
}

// Each chunk's entering pivot pairs: r_{lo-1} in (er.a, er.c), q_hi in (eq.a, eq.c)
// (`eq` is the identity in causal mode). Barriers inside: call from every thread.
__device__ __forceinline__ void enter_pairs(const Team& m, const SharedCoef& k, int causal, float* tot, Mob& er,
                                            Mob& eq) {
    er = mob_id();
    for (int i = m.lo; i < m.hi; ++i) er = step(er, k.s(i), k.p(i - 1), ((i - m.lo) & 1) || i + 1 == m.hi);
    er = team_scan_excl(er, m.lane, m.warp, m.tw, tot, false);
    eq = mob_id();
    if (!causal) {
        for (int i = m.hi - 1; i >= m.lo; --i) eq = step(eq, k.s(i), k.p(i), ((m.hi - 1 - i) & 1) || i == m.lo);
        eq = team_scan_excl(eq, m.lane, m.warp, m.tw, tot, true);
    }
}

// out[(seq*n + i)*2 + {0,1}] = G_ii as bk_forward, in one launch. blockDim.x is a multiple
// of 32 * tw; chunk * 32 * tw >= n. Dynamic shared memory (bytes): teams * P * 12
// + (has_off ? P * 4 : 0) + (blockDim.x / 32) * 64, with P = pad(n - 1) + 1.
extern "C" __global__ void __launch_bounds__(512)
bk_forward_fused(float* out, unsigned int* nonfinite, const float* v, const float* z, const float* b,
                 const float* c, int has_off, int batch, int n, int causal, int tw, int chunk) {
    extern __shared__ float2 bk_smem[];
    const int P = pad(n - 1) + 1;
    const Team m = team_of(batch, n, tw, chunk);
    float2* sr = bk_smem + m.team * P;
    float* sv = (float*)(bk_smem + m.teams * P) + m.team * P;
    float* sp = (float*)(bk_smem + m.teams * P) + m.teams * P;
    float* tot = sp + (has_off ? P : 0);
    stage(m, sv, sp, v, b, c, has_off, n);
    SharedCoef k;
    k.sv = sv; k.sp = sp; k.zr = z[0]; k.zi = z[1]; k.has_off = has_off; k.n = n;
    Mob er, eq;
    enter_pairs(m, k, causal, tot, er, eq);

    const int lo = m.lo, hi = m.hi;
    bool bad = false;
    if (lo < hi) {
        cx rr = enter_pivot(k.s(lo), k.p(lo - 1), er.a, er.c);
        for (int i = lo; i < hi; ++i) {
            if (i > lo) rr = sub(k.s(i), scl(rcp(rr), k.p(i - 1)));
            const cx g = causal ? rcp(rr) : rr;  // full mode: r, until the q sweep below
            if (causal) bad |= !(is_finite(g.x) && is_finite(g.y));
            sr[pad(i)] = make_float2(g.x, g.y);
        }
        if (!causal) {
            cx qq = enter_pivot(k.s(hi - 1), k.p(hi - 1), eq.a, eq.c);
            for (int i = hi - 1; i >= lo; --i) {
                const cx si = k.s(i);
                if (i < hi - 1) qq = sub(si, scl(rcp(qq), k.p(i)));
                const float2 ri = sr[pad(i)];
                const cx g = rcp(sub(add(mk(ri.x, ri.y), qq), si));
                bad |= !(is_finite(g.x) && is_finite(g.y));
                sr[pad(i)] = make_float2(g.x, g.y);
            }
        }
    }
    if (bad) atomicOr(nonfinite, 1u);
    __syncthreads();
    if (m.active) {
        float2* o = (float2*)out + m.base;
        copy_out(o, sr, n, m.t, m.team_threads);
    }
}

// ---- Fused backward: one launch, 20 bytes of DRAM traffic per position ----
//
// Same teams and staging as the forward, plus dL/dG staged in shared memory; each thread
// keeps its chunk's r and q (at most BKF_CHUNK positions) in registers. The pivots and dbar
// come from the same sweeps as the forward; the chunk's affine adjoint maps are scanned
// across the team like the Moebius maps; the adjoint sweeps write dv into the slots of v
// and the off-diagonal partials into the slots of dL/dG, both stored coalesced. The z
// gradient of each sequence is a fixed-order team reduction (zpart[seq*2]); the caller sums
// zpart and the per-sequence partials over the batch in a fixed order.
#define BKF_CHUNK 16

// dv[seq*n + i] (overwritten); zpart[seq*2] = (-Re, Im) of the sequence's sum of sbar; when
// learn_off, bpart/cpart[seq*(n-1) + i] = Re(pbar_i) c_i and Re(pbar_i) b_i. chunk <=
// BKF_CHUNK. Dynamic shared memory (bytes): teams * P * 12 + blockDim.x * 8
// + (has_off ? P * 4 : 0) + (blockDim.x / 32) * 64, with P = pad(n - 1) + 1.
extern "C" __global__ void __launch_bounds__(512)
bk_backward_fused(float* dv, float* zpart, float* bpart, float* cpart, int learn_off, const float* v,
                  const float* dout, const float* z, const float* b, const float* c, int has_off, int batch,
                  int n, int causal, int tw, int chunk) {
    extern __shared__ float2 bk_smem[];
    const int P = pad(n - 1) + 1;
    const Team m = team_of(batch, n, tw, chunk);
    float2* sg = bk_smem + m.team * P;                  // dL/dG, then dbar, then (db, dc) parts
    float2* qfirst = bk_smem + m.teams * P;             // each thread's first q
    float* sv = (float*)(qfirst + blockDim.x) + m.team * P;  // v, then dv
    float* sp = (float*)(qfirst + blockDim.x) + m.teams * P;
    float* tot = sp + (has_off ? P : 0);
    if (m.active)
        copy_in(sg, (const float2*)dout + m.base, n, m.t, m.team_threads);
    stage(m, sv, sp, v, b, c, has_off, n);
    SharedCoef k;
    k.sv = sv; k.sp = sp; k.zr = z[0]; k.zi = z[1]; k.has_off = has_off; k.n = n;
    Mob er, eq;
    enter_pairs(m, k, causal, tot, er, eq);

    const int lo = m.lo, hi = m.hi;
    cx rr[BKF_CHUNK], qq[BKF_CHUNK];
    float pb[BKF_CHUNK];
    // Pivots, dbar (into sg), and the chunk's adjoint maps: mr gives rbar_lo from rbar_hi,
    // mq gives qbar_{hi-1} from qbar_{lo-1}.
    Aff mr = identity_of(Aff()), mq = identity_of(Aff());
    if (lo < hi) {
        cx x = enter_pivot(k.s(lo), k.p(lo - 1), er.a, er.c);
#pragma unroll
        for (int j = 0; j < BKF_CHUNK; ++j) {
            const int i = lo + j;
            if (i < hi) {
                if (j > 0) x = sub(k.s(i), scl(rcp(x), k.p(i - 1)));
                rr[j] = x;
            }
        }
        cx y = enter_pivot(k.s(hi - 1), k.p(hi - 1), eq.a, eq.c);
#pragma unroll
        for (int j = BKF_CHUNK - 1; j >= 0; --j) {
            const int i = lo + j;
            if (i < hi) {
                const cx si = k.s(i);
                cx d = rr[j];
                if (!causal) {
                    if (i < hi - 1) y = sub(si, scl(rcp(y), k.p(i)));
                    qq[j] = y;
                    d = sub(add(rr[j], y), si);
                }
                const float2 go = sg[pad(i)];
                const cx g = rcp(d);
                const cx db = scl(mul(mk(go.x, -go.y), mul(g, g)), -1.0f);
                sg[pad(i)] = make_float2(db.x, db.y);
                const cx rinv = rcp(rr[j]);
                Aff a;
                a.A = scl(mul(rinv, rinv), k.p(i));
                a.B = db;
                mr = combine(a, mr);
                if (!causal) {
                    const cx qinv = rcp(y);
                    a.A = scl(mul(qinv, qinv), k.p(i - 1));
                    mq = combine(mq, a);
                }
            }
        }
        if (!causal) qfirst[threadIdx.x] = make_float2(qq[0].x, qq[0].y);
    }
    // Entering adjoints: rbar at hi (zero past the end), qbar at lo - 1 (zero before the
    // start). The scans' barriers also publish qfirst.
    mr = team_scan_excl(mr, m.lane, m.warp, m.tw, tot, true);
    cx prev = mk(0, 0);
    if (!causal) prev = team_scan_excl(mq, m.lane, m.warp, m.tw, tot, false).B;
    cx sum = mk(0, 0);
    if (lo < hi) {
        cx next = mr.B;
#pragma unroll
        for (int j = BKF_CHUNK - 1; j >= 0; --j) {
            const int i = lo + j;
            if (i < hi) {
                const float2 dbf = sg[pad(i)];
                const cx db = mk(dbf.x, dbf.y);
                const cx rinv = rcp(rr[j]);
                const cx rb = add(db, scl(mul(mul(rinv, rinv), next), k.p(i)));
                const cx part = causal ? rb : sub(rb, db);
                sv[pad(i)] = part.x;
                sum = add(sum, part);
                pb[j] = -mul(next, rinv).x;
                next = rb;
            }
        }
        if (!causal) {
#pragma unroll
            for (int j = 0; j < BKF_CHUNK; ++j) {
                const int i = lo + j;
                if (i < hi) {
                    const float2 dbf = sg[pad(i)];
                    const cx qinv = rcp(qq[j]);
                    const cx qb = add(mk(dbf.x, dbf.y), scl(mul(mul(qinv, qinv), prev), k.p(i - 1)));
                    sv[pad(i)] += qb.x;
                    sum = add(sum, qb);
                    if (i < n - 1) {
                        // q_{i+1}: the next position of this chunk, or the next thread's first.
                        cx qn;
                        if (j + 1 < BKF_CHUNK && i + 1 < hi) {
                            qn = qq[(j + 1) % BKF_CHUNK];  // the modulo only keeps the index in range
                        } else {
                            const float2 f = qfirst[threadIdx.x + 1];
                            qn = mk(f.x, f.y);
                        }
                        pb[j] -= cdiv(qb, qn).x;
                    }
                    prev = qb;
                }
            }
        }
        if (learn_off) {
#pragma unroll
            for (int j = 0; j < BKF_CHUNK; ++j) {
                const int i = lo + j;
                if (i < hi && i < n - 1) sg[pad(i)] = make_float2(pb[j] * c[i], pb[j] * b[i]);
            }
        }
    }
    // dL/dz of the sequence: lanes, then the team's warps, in a fixed order.
    for (int d = 16; d > 0; d >>= 1) {
        sum.x += __shfl_down_sync(0xffffffffu, sum.x, d);
        sum.y += __shfl_down_sync(0xffffffffu, sum.y, d);
    }
    if (m.lane == 0) st2(tot + m.warp * 16, sum);
    __syncthreads();
    if (m.active && m.t == 0) {
        cx total = mk(0, 0);
        for (int j = m.warp; j < m.warp + m.tw; ++j) total = add(total, ld2(tot + j * 16));
        zpart[m.seq * 2] = -total.x;
        zpart[m.seq * 2 + 1] = total.y;
    }
    if (m.active) {
        copy_out(dv + m.base, sv, n, m.t, m.team_threads);
        if (learn_off) {
            const long long row = (long long)m.seq * (n - 1);
            for (int i = m.t; i < n - 1; i += m.team_threads) {
                const float2 pc = sg[pad(i)];
                bpart[row + i] = pc.x;
                cpart[row + i] = pc.y;
            }
        }
    }
}


// ---- Long-chunk kernels: unit off-diagonals, large calls ----
//
// The fused kernels spend most of their instructions on the chunk scan and on shared-memory
// traffic (about 320 per position forward on sm_90, where 12 bytes of DRAM traffic leave
// room for about 100). Here each thread owns L = 16, 32 or 64 consecutive positions, which
// spreads the scan's fixed cost over more of them, and with every b_i c_i = 1 the
// recurrences simplify:
// - Every step is the same matrix F_i = [[s_i, -1], [1, 0]] from both sides (the sequence's
//   ends enter as (1, 0), "infinity", which the zero p at a boundary would also give). Since
//   F^T = J F J with J = diag(1, -1), a chunk's q map is J R^T J of its r map R, so one
//   composition serves both sweeps.
// - Im s_i = -Im z everywhere, so a composition step is 8 fused multiply-adds.
// - v is staged once, as x_i = v_i - 2 - Re z, one thread's chunk per row of shared words
//   (L + 20 forward: x, 16 words through which G is stored, 4 spare; L + 4 backward). The
//   row lengths are an odd number of 16-byte units, so the lanes' 16-byte accesses at one
//   offset of their rows hit distinct banks.
// Sweeps run a segment of BKL_SEG positions at a time from values kept at the segments'
// starts, so a thread never holds its whole chunk: where two sweeps run in opposite
// directions (r and q, or the two adjoints), one keeps a checkpoint per segment and is
// re-run within the segment that the other has reached.
#define BKL_SEG 8
#define BKL_MAX_BLOCK 256
#define BKL_MAX_BLOCK_BACK 512

// 1 / a as one MUFU.RCP: __fdividef's reciprocal also rescues denormal divisors, three more
// instructions on every step of a sweep. Here a denormal |a|^2 counts as zero (the result
// is non-finite and flagged): |r_i| and |q_i| are at least Im z, so only a z within 1e-19 of
// the real axis, which already warns that G may be singular, can come near it.
__device__ __forceinline__ cx rcp_ftz(cx a) {
    float inv;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(a.x * a.x + a.y * a.y));
    return mk(a.x * inv, -a.y * inv);
}

// 2^-e for the binary exponent e of m >= 0, clamped to a normal scale (m = 0 gives 2^127;
// inf and NaN stay inf and NaN after scaling).
__device__ __forceinline__ float scale_of(float m) {
    const int bits = min(__float_as_int(m) & 0x7f800000, 0x7e800000);
    return __int_as_float(0x7f000000 - bits);
}

// One composition step M <- F M for s = (x, -zi): the new top row is s * top - bottom.
__device__ __forceinline__ void long_step(cx& a, cx& b, cx& c, cx& d, float x, float zi) {
    const cx na = mk(fmaf(x, a.x, fmaf(zi, a.y, -c.x)), fmaf(x, a.y, fmaf(-zi, a.x, -c.y)));
    const cx nb = mk(fmaf(x, b.x, fmaf(zi, b.y, -d.x)), fmaf(x, b.y, fmaf(-zi, b.x, -d.y)));
    c = a; d = b; a = na; b = nb;
}
// Two steps stay finite from a normalised map (entries below 2) while |s| < 1e18.
__device__ __forceinline__ void long_renorm(cx& a, cx& b, cx& c, cx& d) {
    const float m = fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(b.x), fabsf(b.y))),
                          fmaxf(fmaxf(fabsf(c.x), fabsf(c.y)), fmaxf(fabsf(d.x), fabsf(d.y))));
    const float k = scale_of(m);
    a = scl(a, k); b = scl(b, k); c = scl(c, k); d = scl(d, k);
}

// A Moebius map applied to the projective pair (num, den), renormalised.
__device__ __forceinline__ void long_apply(const Mob& m, cx& num, cx& den) {
    const cx a = add(mul(m.a, num), mul(m.b, den));
    const cx c = add(mul(m.c, num), mul(m.d, den));
    const float k = scale_of(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(c.x), fabsf(c.y))));
    num = scl(a, k);
    den = scl(c, k);
}
__device__ __forceinline__ cx long_apply(const Aff& m, cx y) { return add(mul(m.A, y), m.B); }

// Where a thread of a long-chunk kernel stands.
struct LongPos {
    int T, t, lane, warp, wfirst, wi, nw, seq;
    bool active;
};
__device__ __forceinline__ LongPos long_pos(int n, int L, int batch) {
    LongPos p;
    p.T = n / L;  // threads per sequence, a multiple of 32
    const int spb = blockDim.x / p.T;
    p.t = threadIdx.x % p.T;
    p.seq = blockIdx.x * spb + threadIdx.x / p.T;
    p.active = p.seq < batch;
    p.lane = threadIdx.x & 31;
    p.warp = threadIdx.x >> 5;
    p.wi = p.t / 32;
    p.wfirst = p.warp - p.wi;
    p.nw = p.T / 32;
    return p;
}

// Copies the block's blockDim.x * RUN consecutive floats of src, starting at `first` (zeros
// at and past `total`), into rows: thread j's run of RUN floats to rows + j * stride, each
// value plus `add`. Coalesced 16-byte loads, all in flight before the first store. Ends
// with a barrier.
template <int RUN>
__device__ __forceinline__ void long_stage(float* rows, int stride, const float* src, long long first, long long total,
                                           float add) {
    constexpr int U = RUN / 4;
    float4 tmp[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const long long gi = first / 4 + threadIdx.x + u * blockDim.x;
        tmp[u] = 4 * gi < total ? ((const float4*)src)[gi] : make_float4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int g = threadIdx.x + u * blockDim.x;
        const float4 x = make_float4(tmp[u].x + add, tmp[u].y + add, tmp[u].z + add, tmp[u].w + add);
        *(float4*)(rows + (g / U) * stride + 4 * (g % U)) = x;
    }
    __syncthreads();
}

// The way back: dst[first + ...] from the rows, for the block's sequences below the batch.
// Call after a barrier.
template <int RUN>
__device__ __forceinline__ void long_unstage(float* dst, const float* rows, int stride, long long first,
                                             long long total) {
    constexpr int U = RUN / 4;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int g = threadIdx.x + u * blockDim.x;
        const long long gi = first / 4 + g;
        if (4 * gi < total) ((float4*)dst)[gi] = *(const float4*)(rows + (g / U) * stride + 4 * (g % U));
    }
}

// A warp_scan_incl of Moebius maps that renormalises after the second, fourth and fifth
// levels only: from normalised maps (entries below 2) one unnormalised level stays below 16.
__device__ __forceinline__ Mob long_scan_incl(Mob x, int lane, bool rev) {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const Mob y = shfl(x, d, rev);
        if (rev ? lane + d < 32 : lane >= d) {
            Mob m;
            m.a = add(mul(x.a, y.a), mul(x.b, y.c));
            m.b = add(mul(x.a, y.b), mul(x.b, y.d));
            m.c = add(mul(x.c, y.a), mul(x.d, y.c));
            m.d = add(mul(x.c, y.b), mul(x.d, y.d));
            x = m;
        }
        if (d != 1 && d != 4) x = normalised(x);
    }
    return x;
}

// Entering pairs from the chunk's r map: (rn, rd) of r_{lo-1} ((1, 0) for the first chunk)
// and, unless causal, (qn, qd) of q_hi ((1, 0) for the last). Warp scans, then the
// sequence's earlier (later) warp totals applied to (1, 0) in order. Barriers inside: call
// from every thread.
__device__ __forceinline__ Mob jtj(const Mob& R) {  // J R^T J: the q map of an r map
    Mob Q; Q.a = R.a; Q.b = mk(-R.c.x, -R.c.y); Q.c = mk(-R.b.x, -R.b.y); Q.d = R.d;
    return Q;
}
__device__ __forceinline__ void long_enter_pairs(const LongPos& p, const Mob& R, int causal, float* tot, cx& rn,
                                                 cx& rd, cx& qn, cx& qd) {
    const Mob Rin = long_scan_incl(R, p.lane, false);
    Mob Qin = mob_id();
    if (!causal) Qin = long_scan_incl(jtj(R), p.lane, true);
    if (p.lane == 31) store_val(tot + p.warp * 16, Rin);
    if (p.lane == 0) store_val(tot + p.warp * 16 + 8, Qin);
    __syncthreads();
    rn = mk(1, 0); rd = mk(0, 0);
    for (int j = 0; j < p.wi; ++j) long_apply(load_mob(tot + (p.wfirst + j) * 16), rn, rd);
    long_apply(warp_excl_of(Rin, p.lane, false), rn, rd);
    qn = mk(1, 0); qd = mk(0, 0);
    if (!causal) {
        for (int j = p.nw - 1; j > p.wi; --j) long_apply(load_mob(tot + (p.wfirst + j) * 16 + 8), qn, qd);
        long_apply(warp_excl_of(Qin, p.lane, true), qn, qd);
    }
    __syncthreads();  // `tot` is free again
}
// The same as w = 1 / r_{lo-1} and u = 1 / q_hi (zero at the sequence's ends).
__device__ __forceinline__ void long_enter(const LongPos& p, const Mob& R, int causal, float* tot, cx& w, cx& u) {
    cx rn, rd, qn, qd;
    long_enter_pairs(p, R, causal, tot, rn, rd, qn, qd);
    w = cdiv(rd, rn);
    u = cdiv(qd, qn);
}

// Stores the lane's eight G values of one segment as 64-byte runs, four lanes to a run
// (round r stores lanes 8r .. 8r + 7): each lane first writes them to 16 free words of its
// own row (at `off`), the warp then reads them across. `seg0` is the segment's first
// position in lane 0's chunk; rows are `stride` words apart.
template <int L>
__device__ __forceinline__ void long_store_segment(float* out, long long seg0, const cx (&g)[BKL_SEG], float* xrow,
                                                   const float* row0, int stride, int off, int lane) {
#pragma unroll
    for (int j = 0; j < BKL_SEG; j += 2)
        *(float4*)(xrow + off + 2 * j) = make_float4(g[j].x, g[j].y, g[j + 1].x, g[j + 1].y);
    __syncwarp();
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        // A quarter-warp (one pass of 16-byte accesses) reads rows src and src + 4, whose
        // columns lie 4 (L + 4) words apart, i.e. on the other half of the banks, and stores
        // two whole runs (two lines rather than eight per pass).
        const int src = 8 * r + (lane >> 3) + 4 * ((lane >> 2) & 1), part = lane & 3;
        const float4 val = *(const float4*)(row0 + src * stride + off + 4 * part);
        *(float4*)(out + 2 * (seg0 + (long long)src * L) + 4 * part) = val;
    }
    __syncwarp();
}

// ws[j] = 1 / r_{i-1} at each position i of a segment, from the value at its start, and
// ws[BKL_SEG] = 1 / r of its last position (a caller that does not read it pays nothing: the
// compiler drops the last reciprocal).
__device__ __forceinline__ void rerun_segment(cx w, const float (&x)[BKL_SEG], float zi, cx (&ws)[BKL_SEG + 1]) {
    ws[0] = w;
#pragma unroll
    for (int j = 0; j < BKL_SEG; ++j) ws[j + 1] = rcp_ftz(mk(x[j] - ws[j].x, -zi - ws[j].y));
}

__device__ __forceinline__ void load_seg(const float* p, float (&x)[BKL_SEG]) {
    const float4 a = *(const float4*)p, b = *(const float4*)(p + 4);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

// The r maps of a chunk's H sub-chunks, composed side by side (H independent chains),
// renormalised every second step, or every fourth (FAST) when every |s_i| < 1e9: four steps
// from a normalised map then stay below 3e36.
template <int L, int H, bool FAST>
__device__ __forceinline__ void long_compose_parts(const float* xrow, float zi, Mob (&R)[H]) {
    constexpr int SUB = L / H;
    cx a[H], b[H], c[H], d[H];
#pragma unroll
    for (int h = 0; h < H; ++h) { a[h] = mk(1, 0); b[h] = mk(0, 0); c[h] = mk(0, 0); d[h] = mk(1, 0); }
#pragma unroll
    for (int j = 0; j < SUB; j += 4) {
#pragma unroll
        for (int h = 0; h < H; ++h) {
            const float4 x = *(const float4*)(xrow + h * SUB + j);
            long_step(a[h], b[h], c[h], d[h], x.x, zi);
            long_step(a[h], b[h], c[h], d[h], x.y, zi);
            if (!FAST) long_renorm(a[h], b[h], c[h], d[h]);
            long_step(a[h], b[h], c[h], d[h], x.z, zi);
            long_step(a[h], b[h], c[h], d[h], x.w, zi);
            long_renorm(a[h], b[h], c[h], d[h]);
        }
    }
#pragma unroll
    for (int h = 0; h < H; ++h) { R[h].a = a[h]; R[h].b = b[h]; R[h].c = c[h]; R[h].d = d[h]; }
}

// Stages the warp's 32 chunks (contiguous in v from `first`; zeros at and past `total`) into
// their rows, plus `add`: coalesced 16-byte loads, all in flight before the first store, and
// only the warp waits for them, so a warp whose data is in starts composing while the
// others' loads are still on their way. Returns the largest |x| of the warp's chunks (NaN
// when there is a NaN: its bits order above every number's).
template <int L>
__device__ __forceinline__ float long_stage_warp(float* row0, int stride, const float* v, long long first,
                                                 long long total, float add, int lane) {
    constexpr int U = L / 4;  // 16-byte pieces per chunk
    float4 tmp[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const long long gi = first / 4 + lane + 32 * u;
        tmp[u] = 4 * gi < total ? ((const float4*)v)[gi] : make_float4(0, 0, 0, 0);
    }
    unsigned big = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int g = lane + 32 * u;
        const float4 x = make_float4(tmp[u].x + add, tmp[u].y + add, tmp[u].z + add, tmp[u].w + add);
        *(float4*)(row0 + (g / U) * stride + 4 * (g % U)) = x;
        big = max(big, max(max(__float_as_uint(fabsf(x.x)), __float_as_uint(fabsf(x.y))),
                           max(__float_as_uint(fabsf(x.z)), __float_as_uint(fabsf(x.w)))));
    }
    __syncwarp();
    return __uint_as_float(__reduce_max_sync(0xffffffffu, big));
}

// The forward sweep of one sub-chunk: w = 1 / r_{i-1} at each segment's start.
template <int SS>
__device__ __forceinline__ void long_sweep_r(const float* xsub, cx w, float zi, cx (&cp)[SS]) {
#pragma unroll
    for (int k = 0; k < SS; ++k) {
        cp[k] = w;
        float x[BKL_SEG];
        load_seg(xsub + BKL_SEG * k, x);
#pragma unroll
        for (int j = 0; j < BKL_SEG; ++j) w = rcp_ftz(mk(x[j] - w.x, -zi - w.y));
    }
}

// out[(seq*n + i)*2 + {0,1}] = G_ii. n is a multiple of 32 L; blockDim.x = spb * n / L for
// spb sequences per block. Dynamic shared memory (bytes): blockDim.x * (L + 20) * 4
// + (blockDim.x / 32) * 64.
//
// A call of 2^22 positions is about 16 warps per SM, all resident at once, and a sweep is a
// chain of dependent reciprocals. Each warp stages its own chunks and composes as soon as
// they are in (the block first meets at the scan). Each thread splits its chunk into H
// sub-chunks: their maps
// are composed side by side (H chains), the chunk's map (their product) is scanned, and each
// sub-chunk's entering values follow from its neighbours' maps. Causal: G_i = 1 / r_i, which
// is also the next w, the sub-chunks side by side. Full mode: a forward sweep keeps
// w = 1 / r_{i-1} at each segment's start, and a backward sweep re-runs r within the segment
// it has reached and meets q there (d_i = s_i - w_i - u_i with u_i = 1 / q_{i+1}); the
// sub-chunks go one after another, each one's backward sweep beside the next one's forward
// sweep (two chains), so that the stores of G spread over the whole sweep phase rather than
// crowd its end. G leaves a segment at a time (`long_store_segment`) through 16 words past the
// chunk's x in the row.
template <int L>
__device__ __forceinline__ void forward_long(float* out, unsigned int* nonfinite, const float* v, const float* z,
                                             int batch, int n, int causal) {
    constexpr int H = L / 16 > 2 ? L / 16 : 2, SUB = L / H, SS = SUB / BKL_SEG, STRIDE = L + 20;
    extern __shared__ float bkl_smem[];
    const LongPos p = long_pos(n, L, batch);
    const float zr = z[0], zi = z[1];
    float* rows = bkl_smem;
    float* tot = bkl_smem + blockDim.x * STRIDE;  // 16 floats per warp
    const long long first = (long long)p.seq * n + (long long)p.t * L;  // this chunk
    const long long lane0 = first - (long long)p.lane * L;               // lane 0's chunk
    float* xrow = rows + threadIdx.x * STRIDE;
    float* row0 = rows + (threadIdx.x - p.lane) * STRIDE;
    const float xmax = long_stage_warp<L>(row0, STRIDE, v, lane0, (long long)batch * n, -2.0f - zr, p.lane);
    Mob Rh[H];
    if (xmax + fabsf(zi) < 1e9f)  // the same for the whole warp
        long_compose_parts<L, H, true>(xrow, zi, Rh);
    else
        long_compose_parts<L, H, false>(xrow, zi, Rh);
    Mob R = Rh[0];
#pragma unroll
    for (int h = 1; h < H; ++h) R = combine(Rh[h], R);
    cx rn, rd, qn, qd;
    long_enter_pairs(p, R, causal, tot, rn, rd, qn, qd);
    cx w[H], u[H];
    w[0] = cdiv(rd, rn);
#pragma unroll
    for (int h = 0; h + 1 < H; ++h) {
        long_apply(Rh[h], rn, rd);
        w[h + 1] = cdiv(rd, rn);
    }
    u[H - 1] = cdiv(qd, qn);
    if (!causal)
#pragma unroll
        for (int h = H - 1; h > 0; --h) {
            long_apply(jtj(Rh[h]), qn, qd);
            u[h - 1] = cdiv(qd, qn);
        }

    float acc = 0.0f;  // stays 0 unless some G is inf or NaN (0 * inf = NaN)
    if (causal) {
#pragma unroll
        for (int k = 0; k < SS; ++k) {
            float x[H][BKL_SEG];
            cx g[H][BKL_SEG];
#pragma unroll
            for (int h = 0; h < H; ++h) load_seg(xrow + h * SUB + BKL_SEG * k, x[h]);
#pragma unroll
            for (int j = 0; j < BKL_SEG; ++j)
#pragma unroll
                for (int h = 0; h < H; ++h) {
                    w[h] = rcp_ftz(mk(x[h][j] - w[h].x, -zi - w[h].y));
                    g[h][j] = w[h];
                    acc = fmaf(w[h].x, 0.0f, fmaf(w[h].y, 0.0f, acc));
                }
            if (p.active)  // whole warps: a warp never spans two sequences
#pragma unroll
                for (int h = 0; h < H; ++h)
                    long_store_segment<L>(out, lane0 + h * SUB + BKL_SEG * k, g[h], xrow, row0, STRIDE, L, p.lane);
        }
    } else {
        cx cp[H][SS];
        long_sweep_r<SS>(xrow, w[0], zi, cp[0]);
#pragma unroll
        for (int h = 0; h < H; ++h) {
            if (h + 1 < H) long_sweep_r<SS>(xrow + (h + 1) * SUB, w[h + 1], zi, cp[h + 1]);
            cx uh = u[h];
#pragma unroll
            for (int k = SS - 1; k >= 0; --k) {
                float x[BKL_SEG];
                cx ws[BKL_SEG + 1], g[BKL_SEG];
                load_seg(xrow + h * SUB + BKL_SEG * k, x);
                rerun_segment(cp[h][k], x, zi, ws);
#pragma unroll
                for (int j = BKL_SEG - 1; j >= 0; --j) {
                    const cx dd = mk(x[j] - ws[j].x - uh.x, -zi - ws[j].y - uh.y);
                    uh = rcp_ftz(mk(x[j] - uh.x, -zi - uh.y));
                    g[j] = rcp_ftz(dd);
                    acc = fmaf(g[j].x, 0.0f, fmaf(g[j].y, 0.0f, acc));
                }
                if (p.active)
                    long_store_segment<L>(out, lane0 + h * SUB + BKL_SEG * k, g, xrow, row0, STRIDE, L, p.lane);
            }
        }
    }
    if (p.active && !(acc == 0.0f)) atomicOr(nonfinite, 1u);
}

#define BK_FORWARD_LONG(L)                                                                              \
    extern "C" __global__ void __launch_bounds__(BKL_MAX_BLOCK)                                         \
        bk_forward_long##L(float* out, unsigned int* nonfinite, const float* v, const float* z, int batch, \
                           int n, int causal) {                                                         \
        forward_long<L>(out, nonfinite, v, z, batch, n, causal);                                        \
    }
BK_FORWARD_LONG(16)
BK_FORWARD_LONG(32)
BK_FORWARD_LONG(64)

// The segments of a chunk from the last to the first, each with its x and its r re-run
// (`rerun_segment` from the checkpoints `cpw`); the next segment's are loaded and re-run
// while the caller works on this one, two independent chains in flight.
template <int S> struct BackSegments {
    const float* xrow;
    const cx (&cpw)[S];
    float zi;
    float nx[BKL_SEG];
    cx nws[BKL_SEG + 1];
    __device__ __forceinline__ BackSegments(const float* xrow_, const cx (&cpw_)[S], float zi_)
        : xrow(xrow_), cpw(cpw_), zi(zi_) {
        load_seg(xrow + BKL_SEG * (S - 1), nx);
        rerun_segment(cpw[S - 1], nx, zi, nws);
    }
    // Segment k (called for k = S - 1 down to 0).
    __device__ __forceinline__ void take(int k, float (&x)[BKL_SEG], cx (&ws)[BKL_SEG + 1]) {
#pragma unroll
        for (int j = 0; j < BKL_SEG; ++j) x[j] = nx[j];
#pragma unroll
        for (int j = 0; j <= BKL_SEG; ++j) ws[j] = nws[j];
        if (k > 0) {
            load_seg(xrow + BKL_SEG * (k - 1), nx);
            rerun_segment(cpw[k - 1], nx, zi, nws);
        }
    }
};

// dv[seq*n + i] (overwritten) and zpart[seq*2] = (-Re, Im) of the sequence's sum of sbar, for
// unit off-diagonals. x rows of L + 4 words (no store area) plus a row of 2L + 4 words for
// dL/dG, which becomes dbar; dv leaves through the x rows. Dynamic shared memory (bytes):
// blockDim.x * (3L + 8) * 4 + (blockDim.x / 32) * 64.
//
// Passes over the chunk, segment by segment:
// 1. r forward from the entering w, keeping w at each segment's start.
// 2. Backward: r re-run within the segment, q continued; G, dbar (into the dL/dG row), the
//    chunk's rbar map (rbar_lo as a function of rbar_hi) and each segment's qbar map.
// 3. Scans of those affine maps: rbar entering at hi, qbar at lo - 1.
// 4. Backward again: r re-run, q continued; qbar forward within the segment from its start
//    (the segment maps applied to the entering qbar), rbar backward; dv and the z sum.
template <int L>
__device__ __forceinline__ void backward_long(float* dv, float* zpart, const float* v, const float* dout,
                                              const float* z, int batch, int n, int causal) {
    constexpr int S = L / BKL_SEG, XS = L + 4, GS = 2 * L + 4;
    extern __shared__ float bkl_smem[];
    const LongPos p = long_pos(n, L, batch);
    const float zr = z[0], zi = z[1];
    float* xrows = bkl_smem;
    float* grows = xrows + blockDim.x * XS;
    float* tot = grows + blockDim.x * GS;  // 16 floats per warp
    const long long block_first = (long long)blockIdx.x * (blockDim.x / p.T) * n;
    const long long total = (long long)batch * n;
    long_stage<2 * L>(grows, GS, dout, 2 * block_first, 2 * total, 0.0f);
    long_stage<L>(xrows, XS, v, block_first, total, -2.0f - zr);
    float* xrow = xrows + threadIdx.x * XS;
    float* grow = grows + threadIdx.x * GS;
    cx w0, u0;
    Mob R[1];
    long_compose_parts<L, 1, false>(xrow, zi, R);
    long_enter(p, R[0], causal, tot, w0, u0);

    // 1.
    cx cpw[S];
    long_sweep_r<S>(xrow, w0, zi, cpw);
    // 2. ws[j] = 1 / r_{i-1} and ws[j + 1] = 1 / r_i for position j of the segment; the next
    // segment's r re-run is issued beside this one's work, as in the forward.
    Aff F = identity_of(Aff()), segq[S];
    {
        cx u = u0;
        BackSegments<S> seg(xrow, cpw, zi);
#pragma unroll
        for (int k = S - 1; k >= 0; --k) {
            float x[BKL_SEG];
            cx ws[BKL_SEG + 1];
            seg.take(k, x, ws);
            float* gseg = grow + 2 * BKL_SEG * k;
            float go[2 * BKL_SEG], dbs[2 * BKL_SEG];
#pragma unroll
            for (int j = 0; j < 2 * BKL_SEG; j += 4) {
                const float4 g4 = *(const float4*)(gseg + j);
                go[j] = g4.x; go[j + 1] = g4.y; go[j + 2] = g4.z; go[j + 3] = g4.w;
            }
            Aff H = identity_of(Aff());
#pragma unroll
            for (int j = BKL_SEG - 1; j >= 0; --j) {
                cx G = ws[j + 1];
                if (!causal) {
                    const cx dd = mk(x[j] - ws[j].x - u.x, -zi - ws[j].y - u.y);
                    u = rcp_ftz(mk(x[j] - u.x, -zi - u.y));  // 1 / q_i
                    G = rcp_ftz(dd);
                }
                const cx db = scl(mul(mk(go[2 * j], -go[2 * j + 1]), mul(G, G)), -1.0f);
                dbs[2 * j] = db.x;
                dbs[2 * j + 1] = db.y;
                const cx A = mul(ws[j + 1], ws[j + 1]);  // 1 / r_i^2
                F.B = add(mul(A, F.B), db);
                F.A = mul(A, F.A);
                if (!causal) {
                    const cx B = mul(u, u);  // 1 / q_i^2
                    H.B = add(mul(H.A, db), H.B);
                    H.A = mul(H.A, B);
                }
            }
            segq[k] = H;
#pragma unroll
            for (int j = 0; j < 2 * BKL_SEG; j += 4)
                *(float4*)(gseg + j) = make_float4(dbs[j], dbs[j + 1], dbs[j + 2], dbs[j + 3]);
        }
    }
    Aff Hc = identity_of(Aff());  // the chunk's qbar map
#pragma unroll
    for (int k = 0; k < S; ++k) Hc = combine(segq[k], Hc);
    // 3.
    const Aff Fin = warp_scan_incl(F, p.lane, true);
    const Aff Hin = warp_scan_incl(Hc, p.lane, false);
    if (p.lane == 0) store_val(tot + p.warp * 16, Fin);
    if (p.lane == 31) store_val(tot + p.warp * 16 + 8, Hin);
    __syncthreads();
    cx rb = mk(0, 0), qb_in = mk(0, 0);
    for (int j = p.nw - 1; j > p.wi; --j) rb = long_apply(load_aff(tot + (p.wfirst + j) * 16), rb);
    rb = long_apply(warp_excl_of(Fin, p.lane, true), rb);  // rbar_hi
    for (int j = 0; j < p.wi; ++j) qb_in = long_apply(load_aff(tot + (p.wfirst + j) * 16 + 8), qb_in);
    qb_in = long_apply(warp_excl_of(Hin, p.lane, false), qb_in);  // qbar_{lo-1}
    cx cq[S];  // qbar before each segment
    cq[0] = causal ? mk(0, 0) : qb_in;
#pragma unroll
    for (int k = 0; k + 1 < S; ++k) cq[k + 1] = long_apply(segq[k], cq[k]);
    // 4.
    cx sum = mk(0, 0);
    {
        cx u = u0;
        BackSegments<S> seg(xrow, cpw, zi);
#pragma unroll
        for (int k = S - 1; k >= 0; --k) {
            float x[BKL_SEG];
            cx ws[BKL_SEG + 1];
            seg.take(k, x, ws);
            cx db[BKL_SEG];
#pragma unroll
            for (int j = 0; j < BKL_SEG; j += 2) {
                const float4 d4 = *(const float4*)(grow + 2 * (BKL_SEG * k + j));
                db[j] = mk(d4.x, d4.y);
                db[j + 1] = mk(d4.z, d4.w);
            }
            cx qb[BKL_SEG];
            if (!causal) {
                cx us[BKL_SEG];
#pragma unroll
                for (int j = BKL_SEG - 1; j >= 0; --j) {
                    u = rcp_ftz(mk(x[j] - u.x, -zi - u.y));
                    us[j] = u;
                }
                cx y = cq[k];
#pragma unroll
                for (int j = 0; j < BKL_SEG; ++j) {
                    y = add(db[j], mul(mul(us[j], us[j]), y));
                    qb[j] = y;
                }
            }
            float d8[BKL_SEG];
#pragma unroll
            for (int j = BKL_SEG - 1; j >= 0; --j) {
                rb = add(db[j], mul(mul(ws[j + 1], ws[j + 1]), rb));
                const cx part = causal ? rb : add(sub(rb, db[j]), qb[j]);
                d8[j] = part.x;
                sum = add(sum, part);
            }
            // x of this segment is no longer needed (the next one's is in nx): dv takes its words.
            *(float4*)(xrow + BKL_SEG * k) = make_float4(d8[0], d8[1], d8[2], d8[3]);
            *(float4*)(xrow + BKL_SEG * k + 4) = make_float4(d8[4], d8[5], d8[6], d8[7]);
        }
    }
    // dL/dz of the sequence: lanes, then the sequence's warps, in a fixed order.
    for (int d = 16; d > 0; d >>= 1) {
        sum.x += __shfl_down_sync(0xffffffffu, sum.x, d);
        sum.y += __shfl_down_sync(0xffffffffu, sum.y, d);
    }
    __syncthreads();  // every thread is past reading `tot`, and dv is in the rows
    if (p.lane == 0) st2(tot + p.warp * 16, sum);
    long_unstage<L>(dv, xrows, XS, block_first, total);
    __syncthreads();
    if (p.active && p.t == 0) {
        cx all = mk(0, 0);
        for (int j = 0; j < p.nw; ++j) all = add(all, ld2(tot + (p.wfirst + j) * 16));
        zpart[p.seq * 2] = -all.x;
        zpart[p.seq * 2 + 1] = all.y;
    }
}

#define BK_BACKWARD_LONG(L)                                                                                   \
    extern "C" __global__ void __launch_bounds__(BKL_MAX_BLOCK_BACK)                                          \
        bk_backward_long##L(float* dv, float* zpart, const float* v, const float* dout, const float* z, int batch, \
                            int n, int causal) {                                                              \
        backward_long<L>(dv, zpart, v, dout, z, batch, n, causal);                                            \
    }
BK_BACKWARD_LONG(16)
BK_BACKWARD_LONG(32)

// ---- Warp kernels: one warp per sequence, small calls of short sequences ----
//
// A call of a few thousand positions cannot fill the GPU: its time is one warp's chain of
// dependent steps, and the fused kernel's general path (staging through shared memory,
// barriers, two compositions and two team scans) made that chain longer than cuSPARSE's
// solve. With unit off-diagonals and N = 32 L (L = 4, 8 or 16), each lane keeps its L
// positions in registers: no shared memory and no barrier, one composition for both maps
// (the q map is J R^T J of the r map, as in the long-chunk kernels), both warp scans in the
// same unrolled code, and G stored straight from registers.

// The lane's chunk of v as x = v - 2 - Re z (16-byte loads).
template <int L>
__device__ __forceinline__ void warp_load_x(const float* v, long long first, float zr, float (&x)[L]) {
#pragma unroll
    for (int j = 0; j < L; j += 4) {
        const float4 a = *(const float4*)(v + first + j);
        x[j] = a.x - 2.0f - zr; x[j + 1] = a.y - 2.0f - zr; x[j + 2] = a.z - 2.0f - zr; x[j + 3] = a.w - 2.0f - zr;
    }
}

// The lane's r map R, its warp scan and the forward sweep: ws[j] = 1 / r before position j
// of the chunk (ws[j + 1] = 1 / r_j).
template <int L>
__device__ __forceinline__ void warp_r_sweep(const float (&x)[L], float zi, int lane, Mob& R, cx (&ws)[L + 1]) {
    R = mob_id();
#pragma unroll
    for (int j = 0; j < L; ++j) {
        long_step(R.a, R.b, R.c, R.d, x[j], zi);
        if (j & 1) long_renorm(R.a, R.b, R.c, R.d);
    }
    const Mob Rin = long_scan_incl(R, lane, false);
    cx rn = mk(1, 0), rd = mk(0, 0);
    long_apply(warp_excl_of(Rin, lane, false), rn, rd);
    ws[0] = cdiv(rd, rn);
#pragma unroll
    for (int j = 0; j < L; ++j) ws[j + 1] = rcp_ftz(mk(x[j] - ws[j].x, -zi - ws[j].y));
}

// 1 / q after the lane's chunk, from the r maps' reversed warp scan (q map = J R^T J).
__device__ __forceinline__ cx warp_u_after(const Mob& R, int lane) {
    const Mob Qin = long_scan_incl(jtj(R), lane, true);
    cx qn = mk(1, 0), qd = mk(0, 0);
    long_apply(warp_excl_of(Qin, lane, true), qn, qd);
    return cdiv(qd, qn);
}

// out[(seq*n + i)*2 + {0,1}] = G_ii for n = 32 L; one warp per sequence, whole warps per block.
template <int L>
__device__ __forceinline__ void forward_warp(float* out, unsigned int* nonfinite, const float* v, const float* z,
                                             int batch, int n, int causal) {
    const int lane = threadIdx.x & 31;
    const int seq = (int)(((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    if (seq >= batch) return;  // the whole warp
    const float zr = z[0], zi = z[1];
    const long long first = (long long)seq * n + (long long)lane * L;
    float x[L];
    warp_load_x<L>(v, first, zr, x);
    Mob R;
    cx ws[L + 1];
    warp_r_sweep<L>(x, zi, lane, R, ws);
    cx g[L];
    if (causal) {
#pragma unroll
        for (int j = 0; j < L; ++j) g[j] = ws[j + 1];
    } else {
        cx u = warp_u_after(R, lane);
#pragma unroll
        for (int j = L - 1; j >= 0; --j) {
            const cx dd = mk(x[j] - ws[j].x - u.x, -zi - ws[j].y - u.y);
            u = rcp_ftz(mk(x[j] - u.x, -zi - u.y));
            g[j] = rcp_ftz(dd);
        }
    }
    float acc = 0.0f;  // stays 0 unless some G is inf or NaN
#pragma unroll
    for (int j = 0; j < L; j += 2) {
        acc = fmaf(g[j].x, 0.0f, fmaf(g[j].y, 0.0f, fmaf(g[j + 1].x, 0.0f, fmaf(g[j + 1].y, 0.0f, acc))));
        *(float4*)(out + 2 * (first + j)) = make_float4(g[j].x, g[j].y, g[j + 1].x, g[j + 1].y);
    }
    if (!(acc == 0.0f)) atomicOr(nonfinite, 1u);
}

#define BK_FORWARD_WARP(L)                                                                                \
    extern "C" __global__ void __launch_bounds__(32)                                                      \
        bk_forward_warp##L(float* out, unsigned int* nonfinite, const float* v, const float* z, int batch, \
                           int n, int causal) {                                                           \
        forward_warp<L>(out, nonfinite, v, z, batch, n, causal);                                          \
    }
BK_FORWARD_WARP(4)
BK_FORWARD_WARP(8)
BK_FORWARD_WARP(16)

// dv[seq*n + i] (overwritten) and zpart[seq*2] = (-Re, Im) of the sequence's sum of sbar,
// for n = 32 L, one warp per sequence: the fused backward's recurrences with every value of
// the lane's chunk in registers. dbar_i = -conj(dL/dG_i) G_i^2; rbar_i = dbar_i + rbar_{i+1} / r_i^2
// from the right, qbar_i = dbar_i + qbar_{i-1} / q_i^2 from the left (full mode only); the
// chunks' affine maps of both are scanned across the warp; sbar_i = rbar_i - dbar_i + qbar_i
// (rbar_i when causal) and dv_i = Re sbar_i.
template <int L>
__device__ __forceinline__ void backward_warp(float* dv, float* zpart, const float* v, const float* dout,
                                              const float* z, int batch, int n, int causal) {
    const int lane = threadIdx.x & 31;
    const int seq = (int)(((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    if (seq >= batch) return;  // the whole warp
    const float zr = z[0], zi = z[1];
    const long long first = (long long)seq * n + (long long)lane * L;
    float x[L];
    cx db[L];
    warp_load_x<L>(v, first, zr, x);
#pragma unroll
    for (int j = 0; j < L; j += 2) {
        const float4 g = *(const float4*)(dout + 2 * (first + j));
        db[j] = mk(g.x, g.y);
        db[j + 1] = mk(g.z, g.w);
    }
    Mob R;
    cx ws[L + 1];
    warp_r_sweep<L>(x, zi, lane, R, ws);
    cx uq[L];  // 1 / q_j^2 (full mode)
    if (causal) {
#pragma unroll
        for (int j = 0; j < L; ++j) {
            const cx g = ws[j + 1];
            db[j] = scl(mul(mk(db[j].x, -db[j].y), mul(g, g)), -1.0f);
        }
    } else {
        cx u = warp_u_after(R, lane);
#pragma unroll
        for (int j = L - 1; j >= 0; --j) {
            const cx g = rcp_ftz(mk(x[j] - ws[j].x - u.x, -zi - ws[j].y - u.y));
            u = rcp_ftz(mk(x[j] - u.x, -zi - u.y));  // 1 / q_j
            uq[j] = mul(u, u);
            db[j] = scl(mul(mk(db[j].x, -db[j].y), mul(g, g)), -1.0f);
        }
    }
    cx rq[L];  // 1 / r_j^2
#pragma unroll
    for (int j = 0; j < L; ++j) rq[j] = mul(ws[j + 1], ws[j + 1]);
    // The chunk's maps: rbar_lo from rbar_{hi+1}, qbar_hi from qbar_{lo-1}; then the warp's.
    Aff F = identity_of(Aff()), H = identity_of(Aff());
#pragma unroll
    for (int j = L - 1; j >= 0; --j) {
        F.B = add(mul(rq[j], F.B), db[j]);
        F.A = mul(rq[j], F.A);
    }
    cx rb = long_apply(warp_excl_of(warp_scan_incl(F, lane, true), lane, true), mk(0, 0));  // rbar_{hi+1}
    cx sum = mk(0, 0);
    float d[L];
    if (causal) {
#pragma unroll
        for (int j = L - 1; j >= 0; --j) {
            rb = add(db[j], mul(rq[j], rb));
            d[j] = rb.x;
            sum = add(sum, rb);
        }
    } else {
#pragma unroll
        for (int j = 0; j < L; ++j) {
            H.B = add(mul(uq[j], H.B), db[j]);
            H.A = mul(uq[j], H.A);
        }
        cx qb = long_apply(warp_excl_of(warp_scan_incl(H, lane, false), lane, false), mk(0, 0));  // qbar_{lo-1}
        cx qbs[L];
#pragma unroll
        for (int j = 0; j < L; ++j) {
            qb = add(db[j], mul(uq[j], qb));
            qbs[j] = qb;
        }
#pragma unroll
        for (int j = L - 1; j >= 0; --j) {
            rb = add(db[j], mul(rq[j], rb));
            const cx part = add(sub(rb, db[j]), qbs[j]);
            d[j] = part.x;
            sum = add(sum, part);
        }
    }
#pragma unroll
    for (int j = 0; j < L; j += 4) *(float4*)(dv + first + j) = make_float4(d[j], d[j + 1], d[j + 2], d[j + 3]);
    // dL/dz of the sequence: a fixed-order tree over the lanes.
    for (int k = 16; k > 0; k >>= 1) {
        sum.x += __shfl_down_sync(0xffffffffu, sum.x, k);
        sum.y += __shfl_down_sync(0xffffffffu, sum.y, k);
    }
    if (lane == 0) {
        zpart[seq * 2] = -sum.x;
        zpart[seq * 2 + 1] = sum.y;
    }
}

#define BK_BACKWARD_WARP(L)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32)                                                           \
        bk_backward_warp##L(float* dv, float* zpart, const float* v, const float* dout, const float* z, int batch, \
                            int n, int causal) {                                                               \
        backward_warp<L>(dv, zpart, v, dout, z, batch, n, causal);                                             \
    }
BK_BACKWARD_WARP(4)
BK_BACKWARD_WARP(8)
BK_BACKWARD_WARP(16)
