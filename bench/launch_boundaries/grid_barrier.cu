// kernel boundary (graph, with/without PDL) vs grid barrier inside one persistent kernel
#include "boundaries.cuh"

__device__ __forceinline__ void work(const float* in, float* out, int blk, int nblk, int rep) {
  for (int r = 0; r < rep; r++)
  for (int i = blk * blockDim.x + threadIdx.x; i < S; i += nblk * blockDim.x)
    out[i] = in[(i * 7919 + r) & (S - 1)] * 0.5f + 1.f;
}
__global__ void stage(const float* in, float* out, int rep, int pdl) {
  if (pdl) { asm volatile("griddepcontrol.wait;" ::: "memory"); asm volatile("griddepcontrol.launch_dependents;"); }
  work(in, out, blockIdx.x, gridDim.x, rep);
}
__global__ void persistent(float* a, float* b, int stages, int rep) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  unsigned gen = 0;
  if (threadIdx.x == 0) gen = ld_acquire(&bar_gen);
  for (int s = 0; s < stages; s++) {
    const float* in = (s & 1) ? b : a; float* out = (s & 1) ? a : b;
    work(in, out, blockIdx.x, gridDim.x, rep);
    if (s + 1 < stages) grid_barrier(gen);
  }
}
int main() {
  float *a, *b; CK(cudaMalloc(&a, S * 4)); CK(cudaMalloc(&b, S * 4)); cudaMemset(a, 0, S*4); cudaMemset(b, 0, S*4);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaStream_t st; cudaStreamCreate(&st);
  const int STAGES = 150, REPS = 50;
  for (int rep = 1; rep <= 4; rep *= 4)
  for (int grid_mul = 1; grid_mul <= 2; grid_mul++) {
    int grid = sms * grid_mul;
    for (int mode = 0; mode < 3; mode++) {
      cudaGraph_t g; cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      int launches = mode == 2 ? 3 : STAGES;
      for (int s = 0; s < launches; s++) {
        cudaLaunchConfig_t cfg = {}; cfg.gridDim = grid; cfg.blockDim = 256; cfg.stream = st;
        cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at; cfg.numAttrs = mode >= 1 ? 1 : 0;
        if (mode == 2) { CK(cudaLaunchKernelEx(&cfg, persistent, a, b, STAGES, rep)); }
        else { const float* in = (s & 1) ? b : a; float* out = (s & 1) ? a : b; CK(cudaLaunchKernelEx(&cfg, stage, in, out, rep, mode)); }
      }
      CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
      for (int w = 0; w < 5; w++) CK(cudaGraphLaunch(ge, st));
      CK(cudaStreamSynchronize(st));
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      cudaEventRecord(e0, st);
      for (int i = 0; i < REPS; i++) CK(cudaGraphLaunch(ge, st));
      cudaEventRecord(e1, st); CK(cudaStreamSynchronize(st));
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      int total_stages = mode == 2 ? 3 * STAGES : STAGES;
      printf("rep %d grid %d %-22s %.3f us per stage\n", rep, grid, mode == 0 ? "kernels (graph)" : mode == 1 ? "kernels (graph, PDL)" : "persistent + barrier", ms * 1000.f / REPS / total_stages);
    }
  }
  return 0;
}
