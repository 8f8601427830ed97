// one stream of wide kernels vs four streams of narrow kernels (graph, PDL)
#include "boundaries.cuh"
#define W (1 << 22)  // weight floats (16 MiB), read-only
// A product-like block: 256 threads each load 8 x 16 B of "weights" and 2 x 16 B of the
// previous kernel's output, reduce in shared memory, write 16 floats.
__global__ void stage(const float4* __restrict__ w, const float* in, float* out, int off) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
  __shared__ float red[256];
  const int b = blockIdx.x + off, t = threadIdx.x;
  float s = 0.f;
  float4 v[8];
#pragma unroll
  for (int i = 0; i < 8; i++) v[i] = w[((b * 8 + i) * 256 + t) & (W / 4 - 1)];
  float x0 = in[(b * 16 + (t & 15)) & 65535], x1 = in[(b * 16 + 7 * t) & 65535];
#pragma unroll
  for (int i = 0; i < 8; i++) s += (v[i].x + v[i].y + v[i].z + v[i].w) * x0 + x1;
  red[t] = s; __syncthreads();
  for (int o = 128; o > 0; o >>= 1) { if (t < o) red[t] += red[t + o]; __syncthreads(); }
  if (t < 16) out[(b * 16 + t) & 65535] = red[0] * 1e-9f + in[(b * 16 + t) & 65535];
}
int main() {
  float4* w; float *a, *b;
  CK(cudaMalloc(&w, W * 4)); CK(cudaMalloc(&a, 65536 * 4)); CK(cudaMalloc(&b, 65536 * 4));
  cudaMemset(w, 0, W * 4); cudaMemset(a, 0, 65536 * 4); cudaMemset(b, 0, 65536 * 4);
  cudaStream_t st[4]; for (int i = 0; i < 4; i++) cudaStreamCreateWithFlags(&st[i], cudaStreamNonBlocking);
  cudaEvent_t fork, join[4]; cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
  for (int i = 0; i < 4; i++) cudaEventCreateWithFlags(&join[i], cudaEventDisableTiming);
  const int STAGES = 150, REPS = 30;
  for (int blocks = 36; blocks <= 240; blocks = blocks == 36 ? 96 : blocks == 96 ? 144 : 1000) {
    // mode 0: one stream of 4*blocks; 1: four streams of blocks each; 2: one stream of blocks
    for (int mode = 0; mode < 3; mode++) {
      int ns = mode == 1 ? 4 : 1, grid = mode == 0 ? 4 * blocks : blocks;
      cudaGraph_t g; cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(st[0], cudaStreamCaptureModeThreadLocal));
      CK(cudaEventRecord(fork, st[0]));
      for (int i = 1; i < ns; i++) CK(cudaStreamWaitEvent(st[i], fork, 0));
      for (int s = 0; s < STAGES; s++)
        for (int i = 0; i < ns; i++) {
          cudaLaunchConfig_t cfg = {}; cfg.gridDim = grid; cfg.blockDim = 256; cfg.stream = st[i];
          cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
          at[0].val.programmaticStreamSerializationAllowed = 1; cfg.attrs = at; cfg.numAttrs = 1;
          const float* in = (s & 1) ? b : a; float* out = (s & 1) ? a : b;
          CK(cudaLaunchKernelEx(&cfg, stage, (const float4*)w, in, out, i * blocks));
        }
      for (int i = 1; i < ns; i++) { CK(cudaEventRecord(join[i], st[i])); CK(cudaStreamWaitEvent(st[0], join[i], 0)); }
      CK(cudaStreamEndCapture(st[0], &g)); CK(cudaGraphInstantiate(&ge, g, 0));
      for (int r = 0; r < 3; r++) CK(cudaGraphLaunch(ge, st[0]));
      CK(cudaStreamSynchronize(st[0]));
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      cudaEventRecord(e0, st[0]);
      for (int r = 0; r < REPS; r++) CK(cudaGraphLaunch(ge, st[0]));
      cudaEventRecord(e1, st[0]); CK(cudaStreamSynchronize(st[0]));
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      const char* name = mode == 0 ? "one stream, 4x blocks" : mode == 1 ? "four streams" : "one stream, 1x blocks";
      printf("blocks %3d  %-24s %.3f us a stage\n", blocks, name, ms * 1000.f / REPS / STAGES);
    }
  }
  return 0;
}
