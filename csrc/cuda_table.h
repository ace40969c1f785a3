/* cuda_table.h — the CUDA runtime entry points pymem uses, reached through a table filled at run
 * time (dlopen of libcudart), never linked. Tests fill it with fakes and run the CUDA library's
 * logic on a machine without a GPU. Plain C: it is also the ABI of libpymem_cuda.so.
 *
 * Every function returns a cudaError_t as int: 0 is success; kCudaErrorNotReady (600) from
 * event_query means "recorded work not finished yet". Streams and events are opaque pointers. */
#ifndef PYMEM_CUDA_TABLE_H
#define PYMEM_CUDA_TABLE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PYMEM_CUDA_ERROR_NOT_READY 600
#define PYMEM_CUDA_MEMCPY_DEVICE_TO_DEVICE 3

typedef struct pymem_cuda_table {
  int (*malloc)(void** ptr, size_t bytes);                 /* cudaMalloc */
  int (*free)(void* ptr);                                  /* cudaFree */
  int (*get_device)(int* device);                          /* cudaGetDevice */
  int (*set_device)(int device);                           /* cudaSetDevice */
  int (*event_create)(void** event, unsigned flags);       /* cudaEventCreateWithFlags */
  int (*event_destroy)(void* event);                       /* cudaEventDestroy */
  int (*event_record)(void* event, void* stream);          /* cudaEventRecord */
  int (*event_query)(void* event);                         /* cudaEventQuery */
  int (*event_synchronize)(void* event);                   /* cudaEventSynchronize */
  int (*stream_wait_event)(void* stream, void* event, unsigned flags); /* cudaStreamWaitEvent */
  int (*host_alloc)(void** ptr, size_t bytes, unsigned flags); /* cudaHostAlloc: the host pool's chunks */
  int (*free_host)(void* ptr);                             /* cudaFreeHost */
  /* cudaMemcpyAsync; kind as cudaMemcpyKind (PYMEM_CUDA_MEMCPY_DEVICE_TO_DEVICE for compaction).
   * Its ranges must not overlap: CUDA leaves that undefined. */
  int (*memcpy_async)(void* dst, const void* src, size_t bytes, int kind, void* stream);
} pymem_cuda_table;

#ifdef __cplusplus
}
#endif

#endif /* PYMEM_CUDA_TABLE_H */
