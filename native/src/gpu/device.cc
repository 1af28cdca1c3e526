#include "gpu/device.h"

#include "common/thread_sched.h"
#include "gpu/copy_kernel.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>

namespace hvdlite {
namespace gpu {

Status Device::Check(int code, const char* what) const {
  if (code == 0) return Status::OK();
  return Status(HVDLITE_ERR_INTERNAL, std::string("CUDA: ") + what + " on GPU " + std::to_string(ordinal_) +
                                          " failed: " + cuda_->GetErrorString(code) + " (error " +
                                          std::to_string(code) + ")");
}

Status Device::Use(int ordinal) {
  if (cuda_) {
    if (ordinal == ordinal_) return Status::OK();
    return InvalidArgument("a tensor on GPU " + std::to_string(ordinal) + " after tensors on GPU " +
                           std::to_string(ordinal_) +
                           ": hvdlite works with one GPU per process (pin it with torch.cuda.set_device"
                           "(hvd.local_rank()))");
  }
  const char* pack = std::getenv("HVDLITE_GPU_PACK");
  const std::string asked = pack && *pack ? pack : "kernel";
  if (asked != "kernel" && asked != "batch" && asked != "copies") {
    return InvalidArgument("HVDLITE_GPU_PACK=" + asked + ": expected kernel, batch or copies");
  }
  std::string error;
  const CudaApi* cuda = Cuda(&error);
  if (!cuda) return Status(HVDLITE_ERR_INVALID_ARGUMENT, "a tensor on GPU " + std::to_string(ordinal) + ": " + error);
  cuda_ = cuda;
  ordinal_ = ordinal;
  Status s = Check(cuda_->SetDevice(ordinal), "cudaSetDevice");
  if (s.ok()) s = Check(cuda_->StreamCreateWithFlags(&stream_, kStreamNonBlocking), "cudaStreamCreateWithFlags");
  if (s.ok()) s = Check(cuda_->EventCreateWithFlags(&done_, kEventBlockingNoTiming), "cudaEventCreateWithFlags");
  char bus[64] = {0};
  if (s.ok()) s = Check(cuda_->DeviceGetPCIBusId(bus, sizeof(bus), ordinal), "cudaDeviceGetPCIBusId");
  if (!s.ok()) {
    cuda_ = nullptr;
    return s;
  }
  const bool batch = cuda_->MemcpyBatchAsync12 || cuda_->MemcpyBatchAsync13;
  pack_ = asked == "copies" ? Pack::kCopies : batch ? Pack::kBatch : Pack::kCopies;
  if (asked == "kernel" && LoadKernel()) pack_ = Pack::kKernel;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  identity_ = std::string(host) + "/" + bus;
  return Status::OK();
}

Status Device::WaitFor(const void* event) {
  if (!event) return Status::OK();
  return Check(cuda_->StreamWaitEvent(stream_, const_cast<void*>(event), 0), "cudaStreamWaitEvent");
}

Status Device::Copy(void* dst, const void* src, int64_t bytes) {
  if (bytes <= 0 || dst == src) return Status::OK();
  return Check(cuda_->MemcpyAsync(dst, src, static_cast<size_t>(bytes), kMemcpyDefault, stream_), "cudaMemcpyAsync");
}

bool Device::LoadKernel() {
  std::string error;
  driver_ = Driver(&error);
  int code = 0;
  for (const char* header : kCopyBatchHeaders) {
    if (!driver_) break;
    code = driver_->ModuleLoadData(&module_, (std::string(header) + kCopyBatchPtx).c_str());
    if (code == 0) break;
    module_ = nullptr;
  }
  if (driver_ && code == 0) code = driver_->ModuleGetFunction(&copy_fn_, module_, kCopyBatchEntry);
  if (driver_ && code != 0) error = "the driver refused the copy kernel (CUresult " + std::to_string(code) + ")";
  if (error.empty()) return true;
  if (module_) driver_->ModuleUnload(module_);
  module_ = copy_fn_ = nullptr;
  HVDLITE_LOG(INFO) << "GPU " << ordinal_ << ": fused tensors are packed without the core's copy kernel: " << error;
  return false;
}

const char* Device::PackMethod() const {
  switch (pack_) {
    case Pack::kKernel: return "the core's copy kernel";
    case Pack::kBatch: return "cudaMemcpyBatchAsync";
    case Pack::kCopies: return "one cudaMemcpyAsync per tensor";
  }
  return "";
}

Status Device::CopyOnDevice(const std::vector<Span>& copies) {
  std::vector<const Span*> todo;
  for (const Span& c : copies) {
    if (c.bytes > 0 && c.dst != c.src) todo.push_back(&c);
  }
  if (todo.size() > 1 && pack_ == Pack::kKernel) return CopyWithKernel(todo);
  if (todo.size() > 1 && pack_ == Pack::kBatch && CopyWithBatch(todo)) return Status::OK();
  for (const Span* c : todo) {
    Status s = Copy(c->dst, c->src, c->bytes);
    if (!s.ok()) return s;
  }
  return Status::OK();
}

Status Device::CopyWithKernel(const std::vector<const Span*>& copies) {
  const int64_t bytes = static_cast<int64_t>(copies.size()) * 3 * sizeof(uint64_t);
  const int64_t need = (bytes + 255) / 256 * 256;
  if (table_used_ + need > table_host_.bytes || table_used_ + need > table_device_.bytes) {
    // Growing frees the old tables, which queued work may still read: drain it first.
    if (table_used_ > 0) {
      Status s = Finish();
      if (!s.ok()) return s;
    }
    uint8_t* unused = nullptr;
    Status s = Grow(&table_host_, need, true, &unused);
    if (s.ok()) s = Grow(&table_device_, need, false, &unused);
    if (!s.ok()) return s;
  }
  auto* host = reinterpret_cast<uint64_t*>(table_host_.data + table_used_);
  uint8_t* device = table_device_.data + table_used_;
  table_used_ += need;
  for (size_t k = 0; k < copies.size(); ++k) {
    host[3 * k] = reinterpret_cast<uintptr_t>(copies[k]->dst);
    host[3 * k + 1] = reinterpret_cast<uintptr_t>(copies[k]->src);
    host[3 * k + 2] = static_cast<uint64_t>(copies[k]->bytes);
  }
  Status s = Copy(device, host, bytes);
  if (!s.ok()) return s;
  uint64_t table = reinterpret_cast<uintptr_t>(device);
  auto count = static_cast<uint32_t>(copies.size());
  void* params[] = {&table, &count};
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>(copies.size(), kCopyBatchMaxBlocks));
  const int code = driver_->LaunchKernel(copy_fn_, blocks, 1, 1, kCopyBatchThreads, 1, 1, 0, stream_, params, nullptr);
  if (code != 0) {
    return Status(HVDLITE_ERR_INTERNAL, "CUDA: launching the copy kernel on GPU " + std::to_string(ordinal_) +
                                            " failed (CUresult " + std::to_string(code) + ")");
  }
  return Status::OK();
}

bool Device::CopyWithBatch(const std::vector<const Span*>& copies) {
  std::vector<const void*> dsts, srcs;
  std::vector<size_t> sizes;
  for (const Span* c : copies) {
    dsts.push_back(c->dst);
    srcs.push_back(c->src);
    sizes.push_back(static_cast<size_t>(c->bytes));
  }
  MemLocation here{kMemLocationTypeDevice, ordinal_};
  MemcpyAttributes attrs{kMemcpySrcAccessOrderStream, here, here, 0};
  size_t first = 0;
  int code;
  if (cuda_->MemcpyBatchAsync13) {
    code = cuda_->MemcpyBatchAsync13(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attrs, &first, 1, stream_);
  } else {
    size_t failed = 0;
    code = cuda_->MemcpyBatchAsync12(const_cast<void**>(dsts.data()), const_cast<void**>(srcs.data()), sizes.data(),
                                     dsts.size(), &attrs, &first, 1, &failed, stream_);
  }
  // Refused (a driver older than the runtime, say): the caller copies one by one, from
  // now on (copying again what a failed batch may have copied is harmless).
  if (code != 0) pack_ = Pack::kCopies;
  return code == 0;
}

Status Device::Await(Event event) {
  // The stream's work for a few small tensors ends within tens of microseconds, and a
  // sleeping wait adds the wake-up of an interrupt: polled first, briefly.
  int code = kErrorNotReady;
  if (may_poll_ && cuda_->EventQuery) {
    PollUntil(kFinishPollUs, [&] { return (code = cuda_->EventQuery(event)) != kErrorNotReady; });
  }
  if (code != kErrorNotReady) return Check(code, "cudaEventQuery");
  return Check(cuda_->EventSynchronize(event), "cudaEventSynchronize");
}

Status Device::Finish() {
  Status s = Check(cuda_->EventRecord(done_, stream_), "cudaEventRecord");
  if (s.ok()) s = Await(done_);
  if (s.ok()) table_used_ = 0;
  return s;
}

Status Device::Mark(int mark) {
  Event& event = marks_[mark];
  if (!event) {
    Status s = Check(cuda_->EventCreateWithFlags(&event, kEventBlockingNoTiming), "cudaEventCreateWithFlags");
    if (!s.ok()) {
      event = nullptr;
      return s;
    }
  }
  return Check(cuda_->EventRecord(event, stream_), "cudaEventRecord");
}

Status Device::WaitForMark(int mark) { return Await(marks_[mark]); }

Status Device::Grow(Buffer* buffer, int64_t bytes, bool pinned, uint8_t** out) {
  if (bytes > buffer->bytes) {
    // Whatever the stream still does with the old buffer ends first: cudaFree and
    // cudaFreeHost wait for the device.
    if (buffer->data) pinned ? cuda_->FreeHost(buffer->data) : cuda_->Free(buffer->data);
    *buffer = Buffer();
    // To a power of two (1 MiB at least): a size that creeps up reallocates rarely.
    int64_t size = 1 << 20;
    while (size < bytes) size *= 2;
    void* p = nullptr;
    Status s = pinned ? Check(cuda_->HostAlloc(&p, static_cast<size_t>(size), 0), "cudaHostAlloc")
                      : Check(cuda_->Malloc(&p, static_cast<size_t>(size)), "cudaMalloc");
    if (!s.ok()) return s;
    *buffer = Buffer{static_cast<uint8_t*>(p), size};
  }
  *out = buffer->data;
  return Status::OK();
}

void Device::Release() {
  if (!cuda_) return;
  if (pinned_.data) cuda_->FreeHost(pinned_.data);
  if (scratch_.data) cuda_->Free(scratch_.data);
  if (table_host_.data) cuda_->FreeHost(table_host_.data);
  if (table_device_.data) cuda_->Free(table_device_.data);
  if (module_) driver_->ModuleUnload(module_);
  module_ = copy_fn_ = nullptr;
  table_host_ = table_device_ = Buffer();
  table_used_ = 0;
  if (done_) cuda_->EventDestroy(done_);
  for (Event& mark : marks_) {
    if (mark) cuda_->EventDestroy(mark);
    mark = nullptr;
  }
  if (stream_) cuda_->StreamDestroy(stream_);
  pinned_ = scratch_ = Buffer();
  done_ = stream_ = nullptr;
  cuda_ = nullptr;
}

}  // namespace gpu
}  // namespace hvdlite
