#include "gpu/device.h"

#include <unistd.h>

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
  const char* batch = std::getenv("HVDLITE_GPU_BATCH_COPY");
  batch_copies_ = (cuda_->MemcpyBatchAsync12 || cuda_->MemcpyBatchAsync13) && !(batch && std::string(batch) == "0");
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

Status Device::CopyOnDevice(const std::vector<Span>& copies) {
  if (batch_copies_ && copies.size() > 1) {
    std::vector<const void*> dsts, srcs;
    std::vector<size_t> sizes;
    for (const Span& c : copies) {
      if (c.bytes <= 0 || c.dst == c.src) continue;
      dsts.push_back(c.dst);
      srcs.push_back(c.src);
      sizes.push_back(static_cast<size_t>(c.bytes));
    }
    if (dsts.empty()) return Status::OK();
    MemLocation here{kMemLocationTypeDevice, ordinal_};
    MemcpyAttributes attrs{kMemcpySrcAccessOrderStream, here, here, 0};
    size_t first = 0;
    int code;
    if (cuda_->MemcpyBatchAsync13) {
      code = cuda_->MemcpyBatchAsync13(dsts.data(), srcs.data(), sizes.data(), dsts.size(), &attrs, &first, 1, stream_);
    } else {
      size_t failed = 0;
      code = cuda_->MemcpyBatchAsync12(const_cast<void**>(dsts.data()), const_cast<void**>(srcs.data()),
                                       sizes.data(), dsts.size(), &attrs, &first, 1, &failed, stream_);
    }
    if (code == 0) return Status::OK();
    // Refused (a driver older than the runtime, say): nothing was queued; from now on
    // the copies go one by one.
    batch_copies_ = false;
  }
  for (const Span& c : copies) {
    Status s = Copy(c.dst, c.src, c.bytes);
    if (!s.ok()) return s;
  }
  return Status::OK();
}

Status Device::Finish() {
  Status s = Check(cuda_->EventRecord(done_, stream_), "cudaEventRecord");
  return s.ok() ? Check(cuda_->EventSynchronize(done_), "cudaEventSynchronize") : s;
}

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
  if (done_) cuda_->EventDestroy(done_);
  if (stream_) cuda_->StreamDestroy(stream_);
  pinned_ = scratch_ = Buffer();
  done_ = stream_ = nullptr;
  cuda_ = nullptr;
}

}  // namespace gpu
}  // namespace hvdlite
