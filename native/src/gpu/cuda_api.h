// The CUDA runtime and NCCL, opened at run time with dlopen: nothing CUDA is needed to
// build the core, and a process that never hands it a device tensor never opens them.
//
// Only the functions the core calls are declared, with the plain types of their C ABI
// (streams, events and communicators are opaque pointers; status codes are ints).
// Where the libraries come from, first found wins:
//   CUDA runtime: $HVDLITE_CUDART_LIB, then libcudart.so.13 / .12 / libcudart.so by
//                 soname (the one a CUDA build of PyTorch already loaded is found so);
//   NCCL:         $HVDLITE_NCCL_LIB, then libnccl.so.2 / libnccl.so likewise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace hvdlite {
namespace gpu {

// cudaStream_t, cudaEvent_t, ncclComm_t: handles the core never looks into.
using Stream = void*;
using Event = void*;
using NcclCommHandle = void*;

struct CudaApi {
  int (*SetDevice)(int);
  int (*StreamCreateWithFlags)(Stream*, unsigned);
  int (*StreamDestroy)(Stream);
  int (*StreamWaitEvent)(Stream, Event, unsigned);
  int (*EventCreateWithFlags)(Event*, unsigned);
  int (*EventDestroy)(Event);
  int (*EventRecord)(Event, Stream);
  int (*EventSynchronize)(Event);
  int (*MemcpyAsync)(void*, const void*, size_t, int, Stream);
  int (*HostAlloc)(void**, size_t, unsigned);
  int (*FreeHost)(void*);
  int (*Malloc)(void**, size_t);
  int (*Free)(void*);
  int (*DeviceGetPCIBusId)(char*, int, int);
  int (*RuntimeGetVersion)(int*);
  const char* (*GetErrorString)(int);
  int (*EventQuery)(Event) = nullptr;  // optional: Device::Finish polls with it first
  // cudaMemcpyBatchAsync, where the runtime has it (12.8 and later); its C signature
  // differs between 12.x (a failIdx out-parameter before the stream) and 13.x, so each
  // has its own pointer and at most one is set (by the runtime's version).
  int (*MemcpyBatchAsync12)(void**, void**, size_t*, size_t, void*, size_t*, size_t, size_t*, Stream) = nullptr;
  int (*MemcpyBatchAsync13)(const void**, const void**, const size_t*, size_t, void*, size_t*, size_t, Stream) = nullptr;
  int version = 0;  // cudaRuntimeGetVersion: major*1000 + minor*10
  std::string path;  // what was opened
};

// cudaMemcpyAttributes (CUDA 12.8+): the order in which a batched copy's sources are
// read, and location hints (used for managed memory only).
struct MemLocation {
  int type;  // cudaMemLocationType: 1 = a device
  int id;
};
struct MemcpyAttributes {
  int src_access_order;  // cudaMemcpySrcAccessOrder: 1 = in stream order
  MemLocation src_hint;
  MemLocation dst_hint;
  unsigned flags;
};
constexpr int kMemcpySrcAccessOrderStream = 1;
constexpr int kMemLocationTypeDevice = 1;

// cudaMemcpyDefault: the direction follows from the pointers (unified addressing).
constexpr int kMemcpyDefault = 4;
constexpr unsigned kStreamNonBlocking = 0x01;
// cudaEventBlockingSync | cudaEventDisableTiming: a wait on it sleeps, never spins.
constexpr unsigned kEventBlockingNoTiming = 0x01 | 0x02;
// cudaErrorNotReady: cudaEventQuery's answer while the work before the event runs.
constexpr int kErrorNotReady = 600;

struct NcclUniqueId {
  char internal[128];
};

struct NcclApi {
  int (*GetVersion)(int*);
  int (*GetUniqueId)(NcclUniqueId*);
  int (*CommInitRank)(NcclCommHandle*, int, NcclUniqueId, int);
  int (*CommDestroy)(NcclCommHandle);
  int (*AllReduce)(const void*, void*, size_t, int, int, NcclCommHandle, Stream);
  int (*Broadcast)(const void*, void*, size_t, int, int, NcclCommHandle, Stream);
  int (*Reduce)(const void*, void*, size_t, int, int, int, NcclCommHandle, Stream);
  int (*Send)(const void*, size_t, int, int, NcclCommHandle, Stream);
  int (*Recv)(void*, size_t, int, int, NcclCommHandle, Stream);
  int (*GroupStart)();
  int (*GroupEnd)();
  // ncclRedOpCreatePreMulSum: a sum whose inputs are first multiplied by a scalar.
  int (*RedOpCreatePreMulSum)(int*, void*, int, int, NcclCommHandle);
  int (*RedOpDestroy)(int, NcclCommHandle);
  const char* (*GetErrorString)(int);
  std::string path;
  int version = 0;  // major*10000 + minor*100 + patch
};

// NCCL's enums (nccl.h, stable since 2.10).
enum NcclType { kNcclInt8 = 0, kNcclUint8 = 1, kNcclInt32 = 2, kNcclInt64 = 4, kNcclFloat16 = 6,
                kNcclFloat32 = 7, kNcclFloat64 = 8, kNcclBfloat16 = 9 };
enum NcclOp { kNcclSum = 0, kNcclProd = 1, kNcclMax = 2, kNcclMin = 3 };
constexpr int kNcclScalarHostImmediate = 1;

// The few driver-API calls that load and launch the core's own kernels (PTX text, see
// copy_kernel.h): libcuda.so.1, opened on first use like the runtime ($HVDLITE_CUDA_LIB
// names another file). CUmodule, CUfunction and CUstream are opaque pointers here.
struct DriverApi {
  int (*ModuleLoadData)(void**, const void*);
  int (*ModuleGetFunction)(void**, void*, const char*);
  int (*ModuleUnload)(void*);
  int (*LaunchKernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                      Stream, void**, void**);
  std::string path;
};

// Opened once per process, on first use; null with *error saying what was tried.
const CudaApi* Cuda(std::string* error);
const DriverApi* Driver(std::string* error);
const NcclApi* Nccl(std::string* error);

// "NCCL 2.27.3 (/path/libnccl.so.2)" and the like, for logs.
std::string Describe(const NcclApi& nccl);

}  // namespace gpu
}  // namespace hvdlite
