// What the stage-boundary programs share: the buffer size, error checks, and the grid barrier
// of a persistent kernel (an arrival counter and a generation word in global memory).
#pragma once
#include <cstdio>
#include <cuda_runtime.h>
#define S (64 * 1024)
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); return 1; } } while (0)

__device__ unsigned int bar_count = 0;
__device__ unsigned int bar_gen = 0;

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
__device__ __forceinline__ void st_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void grid_barrier(unsigned& gen) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    unsigned old = atomicAdd(&bar_count, 1u);
    if (old == gridDim.x - 1) { atomicExch(&bar_count, 0u); __threadfence(); atomicAdd(&bar_gen, 1u); }
    else { while (ld_acquire(&bar_gen) == gen) {} }
    gen++;
  }
  __syncthreads();
}
