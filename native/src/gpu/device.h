// The one GPU a process works with, as the background thread sees it: the core's own
// stream, an event to wait for it with, and the buffers that device tensors pass through
// (pinned host memory for staging, a device-side fusion buffer for NCCL).
//
// Background thread only. Nothing here is created before the first device tensor.
//
// Ordering with the framework: the adapter records an event on the stream that produced
// a tensor (after allocating any output); the core's stream waits on that event
// (WaitFor) before reading, so no device-wide synchronize is ever made. The core's stream
// is synchronized (Finish: a short poll, then a blocking event) before an op's handle
// completes, so a result is ready for every stream once the handle says done.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/common.h"
#include "gpu/cuda_api.h"

namespace hvdlite {
namespace gpu {

class Device {
 public:
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // Makes `ordinal` this thread's device and creates the stream, once. A later call with
  // another ordinal is refused: one GPU per process, as in Horovod.
  Status Use(int ordinal);
  bool ready() const { return cuda_ != nullptr; }
  int ordinal() const { return ordinal_; }
  const CudaApi& cuda() const { return *cuda_; }
  Stream stream() const { return stream_; }
  // "hostname/0000:1b:00.0": equal for two processes on the same GPU.
  const std::string& identity() const { return identity_; }

  // The core's stream waits for the framework's event (null: nothing to wait for).
  Status WaitFor(const void* event);
  // Copies on the core's stream, in any direction.
  Status Copy(void* dst, const void* src, int64_t bytes);
  // Copies between device buffers of this GPU on the core's stream (a fusion buffer's
  // pack or unpack: hundreds of small copies), by the first of these that works: the
  // core's copy kernel (copy_kernel.h; one launch after the table of copies is copied
  // up), one cudaMemcpyBatchAsync (CUDA 12.8 and later), one cudaMemcpyAsync each.
  // HVDLITE_GPU_PACK=kernel|batch|copies starts lower in that list. The copies must not
  // overlap each other.
  struct Span {
    void* dst;
    const void* src;
    int64_t bytes;
  };
  Status CopyOnDevice(const std::vector<Span>& copies);
  // How CopyOnDevice copies now: "the core's copy kernel", ... (for logs).
  const char* PackMethod() const;
  // Waits until the core's stream has done all it was given: polls for up to
  // kFinishPollUs where allowed, then sleeps on the event.
  Status Finish();
  // A mark in the stream (one of kMarks, reused), and a wait until the stream has done
  // what it was given before that mark (polled and slept on as in Finish): the staged
  // path's pipeline reads a piece in host memory once its copy down has landed, while
  // later copies still run.
  static constexpr int kMarks = 3;
  Status Mark(int mark);
  Status WaitForMark(int mark);
  // Whether Finish may poll (Core: not where this host's ranks outnumber its cores).
  void set_may_poll(bool may) { may_poll_ = may; }
  static constexpr std::chrono::microseconds kFinishPollUs{100};

  // Grow-only buffers, reused from op to op; their old contents are not kept.
  Status Pinned(int64_t bytes, uint8_t** out) { return Grow(&pinned_, bytes, true, out); }
  Status Scratch(int64_t bytes, uint8_t** out) { return Grow(&scratch_, bytes, false, out); }

  // Frees the stream, event and buffers (the background loop's end). Never from a
  // destructor: at exit the CUDA runtime may be gone first.
  void Release();

  // A CUDA status as a Status (ok for 0), naming what was being done.
  Status Check(int code, const char* what) const;

 private:
  bool may_poll_ = false;
  struct Buffer {
    uint8_t* data = nullptr;
    int64_t bytes = 0;
  };
  Status Grow(Buffer* buffer, int64_t bytes, bool pinned, uint8_t** out);
  enum class Pack { kKernel, kBatch, kCopies };
  // Loads the copy kernel into the current context; false (with the reason logged) if
  // the driver or the kernel cannot be had.
  bool LoadKernel();
  Status CopyWithKernel(const std::vector<const Span*>& copies);
  // Waits for an event recorded on the stream: polled for up to kFinishPollUs where
  // allowed, then slept on.
  Status Await(Event event);
  // One cudaMemcpyBatchAsync; false (and one by one from now on) where it is refused.
  bool CopyWithBatch(const std::vector<const Span*>& copies);

  const CudaApi* cuda_ = nullptr;
  int ordinal_ = -1;
  Stream stream_ = nullptr;
  Pack pack_ = Pack::kCopies;  // lowered for good when a way fails
  const DriverApi* driver_ = nullptr;
  void* module_ = nullptr;   // CUmodule of the copy kernel
  void* copy_fn_ = nullptr;  // CUfunction
  // The copy kernel's tables: written into pinned memory, copied up on the stream, read
  // by the kernel; each batch takes the next part, all free again after Finish.
  Buffer table_host_, table_device_;
  int64_t table_used_ = 0;
  Event done_ = nullptr;
  Event marks_[kMarks] = {};
  std::string identity_;
  Buffer pinned_;   // host memory the staged path copies through
  Buffer scratch_;  // device memory: NCCL's fusion buffer
};

}  // namespace gpu
}  // namespace hvdlite
