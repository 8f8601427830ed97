// A stage boundary as per-block dependency flags inside one persistent kernel, against kernel
// boundaries (a CUDA graph, with and without programmatic dependent launch) and a grid barrier.
// Each of 150 stages: every block reads the chunks that its producers (itself and three other
// blocks, as an output-product tile depends on a few attention blocks) wrote in the stage
// before and writes its own chunk. With flags a block waits only for its producers' flags of
// the previous stage, not for the whole grid. (The ping-pong buffers are not protected
// against a fast block overwriting a chunk a slow one still reads: this measures time only.)
//   nvcc -O3 -arch=sm_90 -o tile_flags tile_flags.cu && ./tile_flags
#include "boundaries.cuh"
#define PRODUCERS 4

__device__ __forceinline__ int producer(int b, int k, int nblk) {
  const int step[PRODUCERS] = {0, 1, 7, 33};
  return (b + step[k]) % nblk;
}
// Block b's chunk of `out` from its producers' chunks of `in`, `rep` times over.
__device__ __forceinline__ void work(const float* in, float* out, int b, int nblk, int rep) {
  const int chunk = S / nblk;
  for (int r = 0; r < rep; r++)
    for (int i = threadIdx.x; i < chunk; i += blockDim.x) {
      float v = 0.f;
      for (int k = 0; k < PRODUCERS; k++) v += in[producer(b, k, nblk) * chunk + ((i * 7919 + r) % chunk)];
      out[b * chunk + i] = v * 0.25f + 1.f;
    }
}
__global__ void stage(const float* in, float* out, int rep, int pdl) {
  if (pdl) { asm volatile("griddepcontrol.wait;" ::: "memory"); asm volatile("griddepcontrol.launch_dependents;"); }
  work(in, out, blockIdx.x, gridDim.x, rep);
}
__global__ void persistent_barrier(float* a, float* b, int stages, int rep) {
  unsigned gen = 0;
  if (threadIdx.x == 0) gen = ld_acquire(&bar_gen);
  for (int s = 0; s < stages; s++) {
    const float* in = (s & 1) ? b : a; float* out = (s & 1) ? a : b;
    work(in, out, blockIdx.x, gridDim.x, rep);
    if (s + 1 < stages) grid_barrier(gen);
  }
}
// flags[b] = the last stage block b finished, counted from `base` (a launch's first stage).
__global__ void persistent_flags(float* a, float* b, unsigned* flags, unsigned base, int stages, int rep) {
  for (int s = 0; s < stages; s++) {
    if (s > 0 && threadIdx.x < PRODUCERS) {
      const unsigned* f = flags + producer(blockIdx.x, threadIdx.x, gridDim.x);
      while (ld_acquire(f) < base + s) {}
    }
    __syncthreads();
    const float* in = (s & 1) ? b : a; float* out = (s & 1) ? a : b;
    work(in, out, blockIdx.x, gridDim.x, rep);
    __syncthreads();
    if (threadIdx.x == 0) { __threadfence(); st_release(flags + blockIdx.x, base + s + 1); }
  }
}
int main() {
  float *a, *b; unsigned* flags;
  CK(cudaMalloc(&a, S * 4)); CK(cudaMalloc(&b, S * 4)); CK(cudaMalloc(&flags, 4096 * 4));
  cudaMemset(a, 0, S * 4); cudaMemset(b, 0, S * 4); cudaMemset(flags, 0, 4096 * 4);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaStream_t st; cudaStreamCreate(&st);
  const int STAGES = 150, REPS = 50;
  unsigned base = 0;
  for (int rep = 1; rep <= 4; rep *= 4)
  for (int grid_mul = 1; grid_mul <= 2; grid_mul++) {
    const int grid = sms * grid_mul;
    for (int mode = 0; mode < 4; mode++) {
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      float ms = 0.f;
      if (mode < 3) {
        cudaGraph_t g; cudaGraphExec_t ge;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        const int launches = mode == 2 ? 1 : STAGES;
        for (int s = 0; s < launches; s++) {
          cudaLaunchConfig_t cfg = {}; cfg.gridDim = grid; cfg.blockDim = 256; cfg.stream = st;
          cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
          at[0].val.programmaticStreamSerializationAllowed = 1;
          cfg.attrs = at; cfg.numAttrs = mode == 1 ? 1 : 0;
          if (mode == 2) { CK(cudaLaunchKernelEx(&cfg, persistent_barrier, a, b, STAGES, rep)); }
          else { const float* in = (s & 1) ? b : a; float* out = (s & 1) ? a : b; CK(cudaLaunchKernelEx(&cfg, stage, in, out, rep, mode)); }
        }
        CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
        for (int w = 0; w < 5; w++) CK(cudaGraphLaunch(ge, st));
        CK(cudaStreamSynchronize(st));
        cudaEventRecord(e0, st);
        for (int i = 0; i < REPS; i++) CK(cudaGraphLaunch(ge, st));
        cudaEventRecord(e1, st);
      } else {
        for (int w = 0; w < 5; w++) { persistent_flags<<<grid, 256, 0, st>>>(a, b, flags, base, STAGES, rep); base += STAGES; }
        CK(cudaStreamSynchronize(st));
        cudaEventRecord(e0, st);
        for (int i = 0; i < REPS; i++) { persistent_flags<<<grid, 256, 0, st>>>(a, b, flags, base, STAGES, rep); base += STAGES; }
        cudaEventRecord(e1, st);
      }
      CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
      cudaEventElapsedTime(&ms, e0, e1);
      const char* name[4] = {"kernels (graph)", "kernels (graph, PDL)", "persistent + barrier", "persistent + flags"};
      printf("rep %d grid %d %-22s %.3f us per stage\n", rep, grid, name[mode], ms * 1000.f / REPS / STAGES);
    }
  }
  return 0;
}
