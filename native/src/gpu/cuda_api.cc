#include "gpu/cuda_api.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <mutex>
#include <vector>

namespace hvdlite {
namespace gpu {
namespace {

// Opens $env_var's file, or else the first soname that loads.
void* Open(const char* env_var, const std::vector<const char*>& sonames, std::string* path,
           std::string* tried) {
  // A path the user gave is the only one tried: another library found instead would
  // hide the mistake.
  std::vector<std::string> candidates;
  if (const char* p = std::getenv(env_var); p && *p) {
    candidates.push_back(p);
  } else {
    for (const char* s : sonames) candidates.push_back(s);
  }
  for (const std::string& c : candidates) {
    void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) {
      link_map* map = nullptr;
      *path = dlinfo(h, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name
                  ? map->l_name
                  : c;
      return h;
    }
    const char* e = dlerror();
    *tried += (tried->empty() ? "" : "; ") + c + ": " + (e ? e : "not found");
  }
  return nullptr;
}

// Fills every symbol or names the first one missing.
template <typename Fn>
bool Bind(void* lib, const char* name, Fn* fn, std::string* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (!*fn && missing->empty()) *missing = name;
  return *fn != nullptr;
}

}  // namespace

const CudaApi* Cuda(std::string* error) {
  static std::once_flag once;
  static CudaApi api;
  static std::string failure;
  static bool loaded = false;
  std::call_once(once, [] {
    std::string tried;
    void* lib = Open("HVDLITE_CUDART_LIB", {"libcudart.so.13", "libcudart.so.12", "libcudart.so"},
                     &api.path, &tried);
    if (!lib) {
      failure = "the CUDA runtime could not be opened (" + tried +
                "); set HVDLITE_CUDART_LIB to libcudart.so's path";
      return;
    }
    std::string missing;
    Bind(lib, "cudaSetDevice", &api.SetDevice, &missing);
    Bind(lib, "cudaStreamCreateWithFlags", &api.StreamCreateWithFlags, &missing);
    Bind(lib, "cudaStreamDestroy", &api.StreamDestroy, &missing);
    Bind(lib, "cudaStreamWaitEvent", &api.StreamWaitEvent, &missing);
    Bind(lib, "cudaEventCreateWithFlags", &api.EventCreateWithFlags, &missing);
    Bind(lib, "cudaEventDestroy", &api.EventDestroy, &missing);
    Bind(lib, "cudaEventRecord", &api.EventRecord, &missing);
    Bind(lib, "cudaEventSynchronize", &api.EventSynchronize, &missing);
    Bind(lib, "cudaMemcpyAsync", &api.MemcpyAsync, &missing);
    Bind(lib, "cudaHostAlloc", &api.HostAlloc, &missing);
    Bind(lib, "cudaFreeHost", &api.FreeHost, &missing);
    Bind(lib, "cudaMalloc", &api.Malloc, &missing);
    Bind(lib, "cudaFree", &api.Free, &missing);
    Bind(lib, "cudaDeviceGetPCIBusId", &api.DeviceGetPCIBusId, &missing);
    Bind(lib, "cudaRuntimeGetVersion", &api.RuntimeGetVersion, &missing);
    Bind(lib, "cudaGetErrorString", &api.GetErrorString, &missing);
    if (!missing.empty()) {
      failure = api.path + " lacks " + missing;
      return;
    }
    api.RuntimeGetVersion(&api.version);
    api.EventQuery = reinterpret_cast<decltype(api.EventQuery)>(dlsym(lib, "cudaEventQuery"));
    // Optional: without it, batches of copies are issued one by one.
    void* batch = dlsym(lib, "cudaMemcpyBatchAsync");
    if (batch && api.version >= 13000) {
      api.MemcpyBatchAsync13 = reinterpret_cast<decltype(api.MemcpyBatchAsync13)>(batch);
    } else if (batch && api.version >= 12080) {
      api.MemcpyBatchAsync12 = reinterpret_cast<decltype(api.MemcpyBatchAsync12)>(batch);
    }
    loaded = true;
  });
  if (!loaded) *error = failure;
  return loaded ? &api : nullptr;
}

const DriverApi* Driver(std::string* error) {
  static std::once_flag once;
  static DriverApi api;
  static std::string failure;
  static bool loaded = false;
  std::call_once(once, [] {
    std::string tried;
    void* lib = Open("HVDLITE_CUDA_LIB", {"libcuda.so.1", "libcuda.so"}, &api.path, &tried);
    if (!lib) {
      failure = "the CUDA driver could not be opened (" + tried + ")";
      return;
    }
    std::string missing;
    Bind(lib, "cuModuleLoadData", &api.ModuleLoadData, &missing);
    Bind(lib, "cuModuleGetFunction", &api.ModuleGetFunction, &missing);
    Bind(lib, "cuModuleUnload", &api.ModuleUnload, &missing);
    Bind(lib, "cuLaunchKernel", &api.LaunchKernel, &missing);
    if (!missing.empty()) {
      failure = api.path + " lacks " + missing;
      return;
    }
    loaded = true;
  });
  if (!loaded) *error = failure;
  return loaded ? &api : nullptr;
}

const NcclApi* Nccl(std::string* error) {
  static std::once_flag once;
  static NcclApi api;
  static std::string failure;
  static bool loaded = false;
  std::call_once(once, [] {
    std::string tried;
    void* lib = Open("HVDLITE_NCCL_LIB", {"libnccl.so.2", "libnccl.so"}, &api.path, &tried);
    if (!lib) {
      failure = "NCCL could not be opened (" + tried + "); set HVDLITE_NCCL_LIB to libnccl.so.2's path";
      return;
    }
    std::string missing;
    Bind(lib, "ncclGetVersion", &api.GetVersion, &missing);
    Bind(lib, "ncclGetUniqueId", &api.GetUniqueId, &missing);
    Bind(lib, "ncclCommInitRank", &api.CommInitRank, &missing);
    Bind(lib, "ncclCommDestroy", &api.CommDestroy, &missing);
    Bind(lib, "ncclAllReduce", &api.AllReduce, &missing);
    Bind(lib, "ncclBroadcast", &api.Broadcast, &missing);
    Bind(lib, "ncclReduce", &api.Reduce, &missing);
    Bind(lib, "ncclSend", &api.Send, &missing);
    Bind(lib, "ncclRecv", &api.Recv, &missing);
    Bind(lib, "ncclGroupStart", &api.GroupStart, &missing);
    Bind(lib, "ncclGroupEnd", &api.GroupEnd, &missing);
    Bind(lib, "ncclRedOpCreatePreMulSum", &api.RedOpCreatePreMulSum, &missing);
    Bind(lib, "ncclRedOpDestroy", &api.RedOpDestroy, &missing);
    Bind(lib, "ncclGetErrorString", &api.GetErrorString, &missing);
    if (!missing.empty()) {
      failure = api.path + " lacks " + missing + " (hvdlite needs NCCL 2.11 or later)";
      return;
    }
    api.GetVersion(&api.version);
    loaded = true;
  });
  if (!loaded) *error = failure;
  return loaded ? &api : nullptr;
}

std::string Describe(const NcclApi& nccl) {
  int v = nccl.version;
  return "NCCL " + std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100) + " (" + nccl.path + ")";
}

}  // namespace gpu
}  // namespace hvdlite
