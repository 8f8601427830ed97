// A stage boundary as a thread-block-cluster barrier (on chip) inside one persistent kernel,
// against kernel boundaries (a CUDA graph, with and without programmatic dependent launch). A
// decode step split by rows into independent slices, one cluster a slice, would need only
// cluster barriers between its stages. Each of 150 stages: every block reads the chunks that
// four blocks of its own cluster wrote in the stage before and writes its own chunk. (The
// ping-pong buffers are not protected against a fast block overwriting a chunk a slow one
// still reads in the plain kernels' case: this measures time only.)
//   nvcc -O3 -arch=sm_90 -o cluster_barrier cluster_barrier.cu && ./cluster_barrier
#include "boundaries.cuh"
#define PRODUCERS 4

// The k-th producer of block b: blocks of b's own group of `cl` consecutive blocks.
__device__ __forceinline__ int producer(int b, int k, int cl) {
  const int step[PRODUCERS] = {0, 1, 3, 5};
  return b - b % cl + (b % cl + step[k]) % cl;
}
__device__ __forceinline__ void work(const float* in, float* out, int b, int nblk, int cl, int rep) {
  const int chunk = S / nblk;
  for (int r = 0; r < rep; r++)
    for (int i = threadIdx.x; i < chunk; i += blockDim.x) {
      float v = 0.f;
      for (int k = 0; k < PRODUCERS; k++) v += in[producer(b, k, cl) * chunk + ((i * 7919 + r) % chunk)];
      out[b * chunk + i] = v * 0.25f + 1.f;
    }
}
__global__ void stage(const float* in, float* out, int cl, int rep, int pdl) {
  if (pdl) { asm volatile("griddepcontrol.wait;" ::: "memory"); asm volatile("griddepcontrol.launch_dependents;"); }
  work(in, out, blockIdx.x, gridDim.x, cl, rep);
}
__global__ void persistent_cluster(float* a, float* b, int cl, int stages, int rep) {
  for (int s = 0; s < stages; s++) {
    const float* in = (s & 1) ? b : a; float* out = (s & 1) ? a : b;
    work(in, out, blockIdx.x, gridDim.x, cl, rep);
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  }
}
int main() {
  float *a, *b;
  CK(cudaMalloc(&a, S * 4)); CK(cudaMalloc(&b, S * 4)); cudaMemset(a, 0, S * 4); cudaMemset(b, 0, S * 4);
  CK(cudaFuncSetAttribute(persistent_cluster, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaStream_t st; cudaStreamCreate(&st);
  const int STAGES = 150, REPS = 50;
  const int shapes[3][2] = {{8, 128}, {16, 112}, {4, 132}};  // cluster size, grid
  for (int rep = 1; rep <= 4; rep *= 4)
  for (int sh = 0; sh < 3; sh++) {
    const int cl = shapes[sh][0], grid = shapes[sh][1];
    int max_clusters = 0;
    {
      cudaLaunchConfig_t cfg = {}; cfg.gridDim = grid; cfg.blockDim = 256;
      cudaLaunchAttribute at[1]; at[0].id = cudaLaunchAttributeClusterDimension;
      at[0].val.clusterDim.x = cl; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
      cfg.attrs = at; cfg.numAttrs = 1;
      CK(cudaOccupancyMaxActiveClusters(&max_clusters, persistent_cluster, &cfg));
    }
    if (max_clusters * cl < grid) { printf("cluster %d grid %d: only %d clusters fit at once, skipped\n", cl, grid, max_clusters); continue; }
    for (int mode = 0; mode < 3; mode++) {
      cudaGraph_t g; cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      const int launches = mode == 2 ? 1 : STAGES;
      for (int s = 0; s < launches; s++) {
        cudaLaunchConfig_t cfg = {}; cfg.gridDim = grid; cfg.blockDim = 256; cfg.stream = st;
        cudaLaunchAttribute at[1];
        if (mode == 2) {
          at[0].id = cudaLaunchAttributeClusterDimension;
          at[0].val.clusterDim.x = cl; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
        } else {
          at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
          at[0].val.programmaticStreamSerializationAllowed = 1;
        }
        cfg.attrs = at; cfg.numAttrs = mode >= 1 ? 1 : 0;
        if (mode == 2) { CK(cudaLaunchKernelEx(&cfg, persistent_cluster, a, b, cl, STAGES, rep)); }
        else { const float* in = (s & 1) ? b : a; float* out = (s & 1) ? a : b; CK(cudaLaunchKernelEx(&cfg, stage, in, out, cl, rep, mode)); }
      }
      CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
      for (int w = 0; w < 5; w++) CK(cudaGraphLaunch(ge, st));
      CK(cudaStreamSynchronize(st));
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      cudaEventRecord(e0, st);
      for (int i = 0; i < REPS; i++) CK(cudaGraphLaunch(ge, st));
      cudaEventRecord(e1, st); CK(cudaStreamSynchronize(st)); CK(cudaGetLastError());
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      const char* name[3] = {"kernels (graph)", "kernels (graph, PDL)", "persistent + cluster barrier"};
      printf("rep %d cluster %2d grid %d %-30s %.3f us per stage\n", rep, cl, grid, name[mode], ms * 1000.f / REPS / STAGES);
    }
  }
  return 0;
}
