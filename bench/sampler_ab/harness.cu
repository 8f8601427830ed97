// Old vs new sampling.cu (bench/sampler_ab/run.sh): bit-for-bit comparison of every output and of the row state, and
// per-stage timings. Build: nvcc -O3 -std=c++17 -arch=sm_90 harness.cu -o harness
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <string>
#include <random>
#include <cmath>
#include <algorithm>
#include <array>

#include <cuda.h>
#include <nvrtc.h>
#include <fstream>
#include <sstream>

namespace newk {
struct SampleParams { float temperature; unsigned int top_k; float top_p, min_p, repetition_penalty; };
struct SampleDims { long long stride; int vocab, words; unsigned int max_len, logit_rows, slots; int chunks, chunk_len, max_chunks; };
struct RowState;
struct SampleScratch { RowState* rows; unsigned long long* part; unsigned long long* hist; unsigned int* cand; };
}

static std::string slurp(const char* p) { std::ifstream f(p); std::stringstream ss; ss << f.rdbuf(); return ss.str(); }

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)

enum DT { F32 = 0, BF16 = 1, F16 = 2 };
static const char* dt_name[] = {"f32", "bf16", "f16"};

// [impl][dtype][stage]; impl 0 is the old kernel, 1.. the variants of the new one
static const int MAX_IMPL = 8;
static CUfunction kern[MAX_IMPL][3][4];
static int n_impl = 0;
static std::vector<std::string> impl_name;

#define CU(x) do { CUresult e = (x); if (e != CUDA_SUCCESS) { const char* m; cuGetErrorString(e, &m); printf("CU %s at %d: %s\n", #x, __LINE__, m); exit(1);} } while (0)

static void add_impl(const std::string& name, const std::string& path, const std::vector<std::string>& defines) {
    std::string src = slurp("common.cuh") + "\n" + slurp(path.c_str());
    nvrtcProgram prog;
    nvrtcCreateProgram(&prog, src.c_str(), "sampling.cu", 0, nullptr, nullptr);
    std::vector<std::string> opts = {"--std=c++17", "--gpu-architecture=sm_90"};
    for (auto& d : defines) opts.push_back(d);
    std::vector<const char*> o;
    for (auto& x : opts) o.push_back(x.c_str());
    nvrtcResult r = nvrtcCompileProgram(prog, (int)o.size(), o.data());
    size_t ls;
    nvrtcGetProgramLogSize(prog, &ls);
    std::string log(ls, '\0');
    nvrtcGetProgramLog(prog, &log[0]);
    if (r != NVRTC_SUCCESS) { printf("NVRTC %s: %s\n", name.c_str(), log.c_str()); exit(1); }
    size_t n;
    nvrtcGetCUBINSize(prog, &n);
    std::vector<char> cubin(n);
    nvrtcGetCUBIN(prog, cubin.data());
    CUmodule mod;
    CU(cuModuleLoadData(&mod, cubin.data()));
    const char* st[] = {"sample_max", "sample_histogram", "sample_select", "sample_draw"};
    const char* sf[] = {"f32", "bf16", "f16"};
    for (int d = 0; d < 3; ++d)
        for (int k = 0; k < 4; ++k) {
            std::string fn = std::string(st[k]) + "_" + sf[d];
            CU(cuModuleGetFunction(&kern[n_impl][d][k], mod, fn.c_str()));
        }
    impl_name.push_back(name);
    ++n_impl;
}

static uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

struct Case {
    std::string dist;
    int dtype;
    int vocab, rows, per_call;
    bool mapped;
    newk::SampleParams p;
    std::string pname;
};

static int sms = 132;

static int max_chunks(int vocab) { return std::max(1, (vocab + 2047) / 2048); }
static int chunks_per_row(int rows, int vocab) {
    int c = (4 * sms + rows - 1) / std::max(rows, 1);
    return std::min(std::max(c, 1), max_chunks(vocab));
}

static std::vector<float> make_logits(const std::string& dist, int n_rows, int stride, int vocab, std::mt19937_64& rng) {
    std::vector<float> l((size_t)n_rows * stride, 0.f);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::uniform_real_distribution<float> ud(-1.f, 1.f);
    for (int r = 0; r < n_rows; ++r) {
        for (int i = 0; i < vocab; ++i) {
            float v = 0.f;
            if (dist == "flat005") v = 0.05f * nd(rng);
            else if (dist == "flat03") v = 0.3f * ud(rng);
            else if (dist == "unif6") v = 6.f * ud(rng);
            else if (dist == "normal3") v = 3.f * nd(rng) + 1.f;
            else if (dist == "peaked") v = 2.f * nd(rng) + ((i * 2654435761u) % 997 == 3 ? 15.f : 0.f);
            else if (dist == "ints") v = (float)((int)(rng() % 7) - 3);
            else if (dist == "zeros") v = 0.f;
            else if (dist == "nasty") {
                uint64_t q = rng() % 100;
                v = q == 0 ? NAN : q == 1 ? -INFINITY : q == 2 ? -0.f : 0.02f * nd(rng);
            } else if (dist == "allneginf") v = (r % 2 == 0) ? -INFINITY : 0.1f * nd(rng);
            else { printf("bad dist\n"); exit(1); }
            l[(size_t)r * stride + i] = v;
        }
    }
    return l;
}

struct Dev {
    void* logits;
    unsigned *src, *slot, *tokens, *pos, *presence;
    float* logprobs;
    unsigned long long *seeds, *counters;
    unsigned long long *rows, *part, *hist;
    unsigned* cand;
};

struct Host {
    std::vector<unsigned> tokens, pos, presence;
    std::vector<float> logprobs;
    std::vector<unsigned long long> seeds, counters, rows;
};

static void upload_state(Dev& d, const Host& h) {
    CK(cudaMemcpy(d.tokens, h.tokens.data(), h.tokens.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.pos, h.pos.data(), h.pos.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.presence, h.presence.data(), h.presence.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.logprobs, h.logprobs.data(), h.logprobs.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.seeds, h.seeds.data(), h.seeds.size() * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.counters, h.counters.data(), h.counters.size() * 8, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.rows, h.rows.data(), h.rows.size() * 8, cudaMemcpyHostToDevice));
}
static void download_state(const Dev& d, Host& h) {
    CK(cudaMemcpy(h.tokens.data(), d.tokens, h.tokens.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h.pos.data(), d.pos, h.pos.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h.presence.data(), d.presence, h.presence.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h.logprobs.data(), d.logprobs, h.logprobs.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h.counters.data(), d.counters, h.counters.size() * 8, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h.rows.data(), d.rows, h.rows.size() * 8, cudaMemcpyDeviceToHost));
}

struct Setup {
    Case c;
    int stride, slots, words, logit_rows;
    Dev d;
    Host init;
    std::vector<unsigned> src, slot;
};

static void setup(Setup& s, const Case& c, uint64_t seed) {
    s.c = c;
    std::mt19937_64 rng(seed);
    s.stride = (c.vocab + 63) / 64 * 64;
    s.logit_rows = c.mapped ? std::max(c.rows / 2, 1) : c.rows;
    s.slots = c.rows + 3;
    s.words = (c.vocab + 31) / 32;
    std::vector<float> lf = make_logits(c.dist, s.logit_rows, s.stride, c.vocab, rng);
    size_t n = lf.size();
    size_t esz = c.dtype == F32 ? 4 : 2;
    std::vector<uint8_t> bytes(n * esz);
    for (size_t i = 0; i < n; ++i) {
        if (c.dtype == F32) memcpy(&bytes[i * 4], &lf[i], 4);
        else if (c.dtype == BF16) { uint16_t b = f2bf(lf[i]); memcpy(&bytes[i * 2], &b, 2); }
        else { __half h = __float2half_rn(lf[i]); memcpy(&bytes[i * 2], &h, 2); }
    }
    Dev& d = s.d;
    CK(cudaMalloc(&d.logits, n * esz));
    CK(cudaMemcpy(d.logits, bytes.data(), n * esz, cudaMemcpyHostToDevice));
    int mc = max_chunks(c.vocab);
    CK(cudaMalloc(&d.tokens, s.slots * 4));
    CK(cudaMalloc(&d.pos, s.slots * 4));
    CK(cudaMalloc(&d.logprobs, s.slots * 4));
    CK(cudaMalloc(&d.seeds, s.slots * 8));
    CK(cudaMalloc(&d.counters, s.slots * 8));
    CK(cudaMalloc(&d.presence, (size_t)s.slots * s.words * 4));
    CK(cudaMalloc(&d.rows, (size_t)s.slots * 7 * 8));
    CK(cudaMalloc(&d.part, (size_t)s.slots * mc * 2 * 8));
    CK(cudaMalloc(&d.hist, (size_t)s.slots * 2 * 256 * 8));
    CK(cudaMalloc(&d.cand, (size_t)s.slots * c.vocab * 4));
    CK(cudaMalloc(&d.src, c.rows * 4));
    CK(cudaMalloc(&d.slot, c.rows * 4));
    Host& h = s.init;
    h.tokens.assign(s.slots, 0);
    h.pos.resize(s.slots);
    for (int i = 0; i < s.slots; ++i) h.pos[i] = i % 50;
    h.presence.assign((size_t)s.slots * s.words, 0);
    for (int sl = 0; sl < s.slots; ++sl)
        for (int t = 0; t < 40; ++t) {
            unsigned tok = t % 2 == 0 ? (unsigned)(rng() % 16) * 3 : (unsigned)(rng() % c.vocab);
            h.presence[(size_t)sl * s.words + tok / 32] |= 1u << (tok % 32);
        }
    h.logprobs.assign(s.slots, 0.f);
    h.seeds.resize(s.slots);
    for (auto& x : h.seeds) x = rng();
    h.counters.resize(s.slots);
    for (int i = 0; i < s.slots; ++i) h.counters[i] = (unsigned long long)i * 7;
    h.rows.assign((size_t)s.slots * 7, 0);
    s.src.resize(c.rows);
    s.slot.resize(c.rows);
    for (int r = 0; r < c.rows; ++r) {
        s.src[r] = c.mapped ? r / 2 : r;
        s.slot[r] = c.mapped ? (c.rows + 2) - r : r;
    }
    CK(cudaMemcpy(d.src, s.src.data(), c.rows * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.slot, s.slot.data(), c.rows * 4, cudaMemcpyHostToDevice));
}

// One draw of every row, in calls of per_call rows, with implementation `impl`.
static void draw(Setup& s, int impl, cudaStream_t st, cudaEvent_t* ev = nullptr, float* stage_ms = nullptr) {
    const Case& c = s.c;
    Dev& d = s.d;
    bool greedy = c.p.temperature == 0.f;
    bool thresholds = c.p.top_p < 1.f || (c.p.top_k > 0 && (int)c.p.top_k < c.vocab);
    int stages[4], ns = 0;
    if (greedy) stages[ns++] = 0;
    else if (!thresholds) { stages[ns++] = 0; stages[ns++] = 3; }
    else { for (int i = 0; i < 4; ++i) stages[ns++] = i; }
    for (int r0 = 0; r0 < c.rows; r0 += c.per_call) {
        int rows = std::min(c.per_call, c.rows - r0);
        int chunks = chunks_per_row(rows, c.vocab);
        newk::SampleDims dims;
        dims.stride = s.stride;
        dims.vocab = c.vocab;
        dims.words = s.words;
        dims.max_len = 50;
        dims.logit_rows = s.logit_rows;
        dims.slots = s.slots;
        dims.chunks = chunks;
        dims.chunk_len = (c.vocab + chunks - 1) / chunks;
        dims.max_chunks = max_chunks(c.vocab);
        newk::SampleScratch sc{(newk::RowState*)d.rows, d.part, d.hist, d.cand};
        bool use_map = c.mapped || c.per_call < c.rows;
        const unsigned* src = use_map ? d.src + r0 : nullptr;
        const unsigned* slot = use_map ? d.slot + r0 : nullptr;
        dim3 grid(chunks, rows);
        for (int k = 0; k < ns; ++k) {
            if (ev) CK(cudaEventRecord(ev[0], st));
            newk::SampleParams p = c.p;
            void* args[] = {&d.logits, (void*)&src, (void*)&slot, &d.tokens, &d.pos, &d.logprobs, &d.seeds, &d.counters, &d.presence, &dims, &p, &sc};
            CU(cuLaunchKernel(kern[impl][c.dtype][stages[k]], grid.x, grid.y, 1, 512, 1, 1, 0, (CUstream)st, args, nullptr));
            if (ev) {
                CK(cudaEventRecord(ev[1], st));
                CK(cudaEventSynchronize(ev[1]));
                float ms;
                CK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
                stage_ms[stages[k]] += ms;
            }
        }
    }
    CK(cudaGetLastError());
}

static void free_setup(Setup& s) {
    Dev& d = s.d;
    cudaFree(d.logits); cudaFree(d.tokens); cudaFree(d.pos); cudaFree(d.logprobs); cudaFree(d.seeds);
    cudaFree(d.counters); cudaFree(d.presence); cudaFree(d.rows); cudaFree(d.part); cudaFree(d.hist);
    cudaFree(d.cand); cudaFree(d.src); cudaFree(d.slot);
}

// Runs `steps` draws with every implementation from the same state; returns the number of
// variants that differ from the old kernel anywhere (tokens, log-probabilities bit for bit,
// positions, counters, presence, row state).
static int compare_case(Setup& s, int steps, long* n_rows_checked, double* mean_cands, std::string* why) {
    const Case& c = s.c;
    std::vector<Host> out(n_impl);
    std::vector<std::vector<std::vector<unsigned>>> toks(n_impl);
    for (int impl = 0; impl < n_impl; ++impl) {
        upload_state(s.d, s.init);
        out[impl] = s.init;
        for (int step = 0; step < steps; ++step) {
            draw(s, impl, 0);
            CK(cudaDeviceSynchronize());
            download_state(s.d, out[impl]);
            toks[impl].push_back(out[impl].tokens);
        }
    }
    int bad = 0;
    for (int v = 1; v < n_impl; ++v) {
        std::string w;
        for (int step = 0; step < steps; ++step)
            if (toks[0][step] != toks[v][step]) w += " tokens@" + std::to_string(step);
        if (memcmp(out[0].logprobs.data(), out[v].logprobs.data(), out[0].logprobs.size() * 4)) w += " logprobs";
        if (out[0].pos != out[v].pos) w += " pos";
        if (out[0].counters != out[v].counters) w += " counters";
        if (out[0].presence != out[v].presence) w += " presence";
        for (size_t r = 0; r < out[0].rows.size() / 7; ++r)
            if (memcmp(&out[0].rows[r * 7], &out[v].rows[r * 7], 56)) {
                const unsigned* a = (const unsigned*)&out[0].rows[r * 7];
                const unsigned* b = (const unsigned*)&out[v].rows[r * 7];
                char buf[256];
                snprintf(buf, sizeof buf, " rowstate[%zu] floor %08x/%08x bins %d,%d,%d/%d,%d,%d", r, a[9], b[9], (int)a[10], (int)a[11], (int)a[12], (int)b[10], (int)b[11], (int)b[12]);
                w += buf;
                break;
            }
        if (!w.empty()) { ++bad; *why += " [" + impl_name[v] + ":" + w + "]"; }
    }
    double cands = 0;
    int per_call_rows = std::min(c.per_call, c.rows);
    for (int r = 0; r < per_call_rows; ++r) cands += (double)((const unsigned*)&out[0].rows[r * 7])[8];
    *mean_cands = cands / per_call_rows;
    *n_rows_checked += (long)c.rows * steps;
    return bad;
}

static newk::SampleParams P(float t, unsigned k, float p, float minp, float pen) {
    newk::SampleParams q;
    q.temperature = t; q.top_k = k; q.top_p = p; q.min_p = minp; q.repetition_penalty = pen;
    return q;
}

int main(int argc, char** argv) {
    CK(cudaFree(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    sms = prop.multiProcessorCount;
    printf("device %s, %d SMs\n", prop.name, sms);
    // argv[1]: mode; argv[2..]: variants of the new kernel as "name:-DA=1,-DB=2" (none: defaults)
    std::string mode = argc > 1 ? argv[1] : "all";
    add_impl("old", "orig.cu", {});
    if (argc <= 2) add_impl("new", "new.cu", {});
    for (int a = 2; a < argc; ++a) {
        std::string spec = argv[a];
        size_t colon = spec.find(':');
        std::vector<std::string> defs;
        std::string rest = colon == std::string::npos ? "" : spec.substr(colon + 1);
        size_t p = 0;
        while (p < rest.size()) {
            size_t q = rest.find(',', p);
            if (q == std::string::npos) q = rest.size();
            defs.push_back(rest.substr(p, q - p));
            p = q + 1;
        }
        add_impl(spec.substr(0, colon), "new.cu", defs);
    }
    const char* names[] = {"max", "histogram", "select", "draw"};
    for (int impl = 0; impl < n_impl; ++impl) {
        printf("%-8s", impl_name[impl].c_str());
        for (int st = 0; st < 4; ++st) {
            int regs, local, smem, blocks;
            CU(cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, kern[impl][BF16][st]));
            CU(cuFuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, kern[impl][BF16][st]));
            CU(cuFuncGetAttribute(&smem, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, kern[impl][BF16][st]));
            CU(cuOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kern[impl][BF16][st], 512, 0));
            printf(" | %s %d regs %d local %d smem %d/SM", names[st], regs, local, smem, blocks);
        }
        printf("\n");
    }
    if (mode == "all" || mode == "check") {
        std::vector<std::pair<std::string, newk::SampleParams>> params = {
            {"greedy pen1.3", P(0.f, 0, 1.f, 0.f, 1.3f)},
            {"T0.9 p0.9", P(0.9f, 0, 0.9f, 0.f, 1.f)},
            {"T0.7 k50 minp0.05 pen1.2", P(0.7f, 50, 1.f, 0.05f, 1.2f)},
            {"T1 plain", P(1.f, 0, 1.f, 0.f, 1.f)},
            {"T0.9 k50 p0.9", P(0.9f, 50, 0.9f, 0.f, 1.f)},
            {"T0.9 k2000 p0.95 pen1.1", P(0.9f, 2000, 0.95f, 0.f, 1.1f)},
            {"T1.3 p0.5 minp0.01", P(1.3f, 0, 0.5f, 0.01f, 1.f)},
            {"T0.5 k1", P(0.5f, 1, 1.f, 0.f, 1.f)},
            {"T0.9 k20000 p0.99", P(0.9f, 20000, 0.99f, 0.f, 1.f)},
            {"T0.9 k5000", P(0.9f, 5000, 1.f, 0.f, 1.f)},
            {"T2 p0.999 pen0.8", P(2.f, 0, 0.999f, 0.f, 0.8f)},
        };
        std::vector<std::string> dists = {"flat005", "flat03", "unif6", "normal3", "peaked", "ints", "zeros", "nasty", "allneginf"};
        struct Shape { int vocab, rows, per_call; bool mapped; };
        std::vector<Shape> shapes = {{49152, 64, 64, false}, {49152, 96, 96, true}, {128256, 16, 1, false}, {1001, 96, 96, false}, {49152, 4, 4, false}, {50257, 7, 7, true}};
        int fails = 0, total = 0;
        long rows_checked = 0;
        uint64_t seed = 1;
        for (auto& sh : shapes)
            for (int dt = 0; dt < 3; ++dt)
                for (auto& dist : dists) {
                    if (dt == F16 && !(dist == "flat005" || dist == "unif6" || dist == "ints")) continue;
                    if (sh.vocab == 128256 && !(dist == "flat005" || dist == "unif6" || dist == "nasty" || dist == "normal3")) continue;
                    Setup s;
                    Case c0{dist, dt, sh.vocab, sh.rows, sh.per_call, sh.mapped, params[0].second, params[0].first};
                    setup(s, c0, seed++);
                    for (auto& pp : params) {
                        s.c.p = pp.second;
                        s.c.pname = pp.first;
                        double mc = 0;
                        std::string why;
                        int bad = compare_case(s, 3, &rows_checked, &mc, &why);
                        ++total;
                        if (bad) {
                            ++fails;
                            printf("FAIL V%d R%d/%d%s %s %s %s:%s\n", sh.vocab, sh.rows, sh.per_call, sh.mapped ? " mapped" : "", dt_name[dt], dist.c_str(), pp.first.c_str(), why.c_str());
                        } else if (sh.vocab == 49152 && sh.rows == 64 && dt == BF16 && (pp.first == "T0.9 p0.9" || pp.first == "T0.9 k50 p0.9")) {
                            printf("ok   V%d R%d %-4s %-9s %-22s mean candidates %.0f\n", sh.vocab, sh.rows, dt_name[dt], dist.c_str(), pp.first.c_str(), mc);
                        }
                    }
                    free_setup(s);
                }
        printf("checked %d cases (%ld row draws per implementation) against %d variant(s): %d failed\n", total, rows_checked, n_impl - 1, fails);
    }
    if (mode == "all" || mode == "time") {
        struct TC { std::string dist; int dtype; newk::SampleParams p; const char* pname; int vocab, rows; };
        std::vector<TC> tcs = {
            {"flat005", BF16, P(0.9f, 0, 0.9f, 0.f, 1.f), "T0.9 p0.9", 49152, 64},
            {"flat03", BF16, P(0.9f, 0, 0.9f, 0.f, 1.f), "T0.9 p0.9", 49152, 64},
            {"normal3", BF16, P(0.9f, 0, 0.9f, 0.f, 1.f), "T0.9 p0.9", 49152, 64},
            {"unif6", BF16, P(0.9f, 0, 0.9f, 0.f, 1.f), "T0.9 p0.9", 49152, 64},
            {"flat005", BF16, P(0.9f, 50, 0.9f, 0.f, 1.f), "T0.9 k50 p0.9", 49152, 64},
            {"flat005", F32, P(0.9f, 0, 0.9f, 0.f, 1.f), "T0.9 p0.9", 49152, 64},
            {"flat005", BF16, P(0.7f, 50, 1.f, 0.05f, 1.2f), "T0.7 k50 minp pen", 49152, 64},
            {"flat005", BF16, P(0.9f, 0, 0.9f, 0.f, 1.f), "T0.9 p0.9", 128256, 1},
            {"flat005", BF16, P(1.f, 0, 1.f, 0.f, 1.f), "T1 plain", 49152, 64},
        };
        cudaStream_t st;
        CK(cudaStreamCreate(&st));
        cudaEvent_t ev[2];
        CK(cudaEventCreate(&ev[0]));
        CK(cudaEventCreate(&ev[1]));
        for (auto& t : tcs) {
            Case c{t.dist, t.dtype, t.vocab, t.rows, t.rows, false, t.p, t.pname};
            Setup s;
            setup(s, c, 42);
            upload_state(s.d, s.init);
            std::vector<std::array<float, 4>> ms(n_impl);
            const int iters = 30;
            for (int it = 0; it < iters + 3; ++it) {
                if (it == 3) for (auto& m : ms) m = {0, 0, 0, 0};
                for (int impl = 0; impl < n_impl; ++impl) draw(s, impl, st, ev, ms[impl].data());
            }
            printf("time %-8s %-4s V%d R%d %-17s (chunks %d):\n", t.dist.c_str(), dt_name[t.dtype], t.vocab, t.rows, t.pname, chunks_per_row(t.rows, t.vocab));
            for (int impl = 0; impl < n_impl; ++impl) {
                float tot = 0;
                printf("   %-8s", impl_name[impl].c_str());
                for (int k = 0; k < 4; ++k) { printf(" %s %6.1f", names[k], 1000 * ms[impl][k] / iters); tot += ms[impl][k]; }
                printf(" | total %6.1f us\n", 1000 * tot / iters);
            }
            free_setup(s);
        }
    }
    if (mode == "ncu") {
        Case c{getenv("DIST") ? getenv("DIST") : "flat03", BF16, 49152, 64, 64, false, P(0.9f, 0, 0.9f, 0.f, 1.f), "T0.9 p0.9"};
        Setup s;
        setup(s, c, 42);
        upload_state(s.d, s.init);
        for (int it = 0; it < 3; ++it)
            for (int impl = 0; impl < n_impl; ++impl) draw(s, impl, 0);
        CK(cudaDeviceSynchronize());
    }
    return 0;
}
