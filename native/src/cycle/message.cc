#include "cycle/message.h"

#include <algorithm>
#include <cstring>

namespace hvdlite {
namespace {

// Limits that keep a corrupted length from asking for absurd allocations.
constexpr uint64_t kMaxCount = 1u << 24;
constexpr uint64_t kMaxString = 1u << 20;

class Writer {
 public:
  explicit Writer(std::vector<uint8_t>* out) : out_(out) {}
  template <typename T>
  void Put(T v) {
    Raw(&v, sizeof(T));
  }
  void Str(const std::string& s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    Raw(s.data(), s.size());
  }
  void Ints(const std::vector<int64_t>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    Raw(v.data(), v.size() * sizeof(int64_t));
  }
  void Bytes(const std::vector<uint8_t>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    Raw(v.data(), v.size());
  }

 private:
  // Appends bytes (a message is hundreds of small fields: a resize and a copy each,
  // inlined, rather than a range insert).
  void Raw(const void* data, size_t n) {
    if (n == 0) return;
    const size_t at = out_->size();
    if (out_->capacity() < at + n) out_->reserve(std::max(2 * out_->capacity(), at + n));
    out_->resize(at + n);
    std::memcpy(out_->data() + at, data, n);
  }

  std::vector<uint8_t>* out_;
};

class Reader {
 public:
  Reader(const uint8_t* data, size_t len) : p_(data), end_(data + len) {}
  bool ok() const { return ok_; }
  bool done() const { return p_ == end_; }
  template <typename T>
  T Get() {
    T v{};
    if (!ok_ || static_cast<size_t>(end_ - p_) < sizeof(T)) {
      ok_ = false;
      return v;
    }
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string Str() {
    uint32_t n = Get<uint32_t>();
    if (!ok_ || n > kMaxString || static_cast<size_t>(end_ - p_) < n) {
      ok_ = false;
      return {};
    }
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  std::vector<int64_t> Ints() {
    uint32_t n = Get<uint32_t>();
    if (!ok_ || n > kMaxCount || static_cast<size_t>(end_ - p_) / 8 < n) {
      ok_ = false;
      return {};
    }
    std::vector<int64_t> v(n);
    for (auto& x : v) x = Get<int64_t>();
    return v;
  }
  std::vector<uint8_t> Bytes() {
    uint32_t n = Get<uint32_t>();
    if (!ok_ || n > kMaxCount || static_cast<size_t>(end_ - p_) < n) {
      ok_ = false;
      return {};
    }
    std::vector<uint8_t> v(p_, p_ + n);
    p_ += n;
    return v;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
  bool ok_ = true;
};

Status Corrupt(const char* what) {
  return Status(HVDLITE_ERR_INTERNAL, std::string("corrupted or truncated ") + what + " message");
}

Status ReadHeader(Reader* r, uint64_t* count, const char* what) {
  uint8_t version = r->Get<uint8_t>();
  if (!r->ok()) return Corrupt(what);
  if (version != kWireVersion) {
    return Status(HVDLITE_ERR_INTERNAL, std::string(what) + " message has wire version " +
                                            std::to_string(version) + ", expected " +
                                            std::to_string(kWireVersion));
  }
  *count = r->Get<uint32_t>();
  if (!r->ok() || *count > kMaxCount) return Corrupt(what);
  return Status::OK();
}

}  // namespace

bool Request::SameParams(const Request& o) const {
  return name == o.name && op == o.op && dtype == o.dtype && shape == o.shape &&
         reduce_op == o.reduce_op && SameFactor(prescale, o.prescale) &&
         SameFactor(postscale, o.postscale) &&
         root_rank == o.root_rank && splits == o.splits && process_set == o.process_set &&
         device == o.device && group == o.group && group_size == o.group_size;
}

void SerializeRequests(const std::vector<Request>& requests, std::vector<uint8_t>* out) {
  out->clear();
  Writer w(out);
  w.Put<uint8_t>(kWireVersion);
  w.Put<uint32_t>(static_cast<uint32_t>(requests.size()));
  for (const Request& q : requests) {
    w.Put<int32_t>(q.rank);
    w.Str(q.name);
    w.Put<int32_t>(q.op);
    w.Put<int32_t>(q.dtype);
    w.Ints(q.shape);
    w.Put<int32_t>(q.reduce_op);
    w.Put<double>(q.prescale);
    w.Put<double>(q.postscale);
    w.Put<int32_t>(q.root_rank);
    w.Ints(q.splits);
    w.Put<int32_t>(q.process_set);
    w.Put<int32_t>(q.device);
    w.Str(q.group);
    w.Put<int32_t>(q.group_size);
    w.Put<int64_t>(q.wait_ms);
    w.Str(q.refusal);
  }
}

Status ParseRequests(const uint8_t* data, size_t len, std::vector<Request>* out) {
  Reader r(data, len);
  uint64_t count = 0;
  Status s = ReadHeader(&r, &count, "request");
  if (!s.ok()) return s;
  out->clear();
  out->reserve(std::min<uint64_t>(count, len / 64));  // a request takes more than 64 bytes
  for (uint64_t i = 0; i < count && r.ok(); ++i) {
    Request q;
    q.rank = r.Get<int32_t>();
    q.name = r.Str();
    q.op = r.Get<int32_t>();
    q.dtype = r.Get<int32_t>();
    q.shape = r.Ints();
    q.reduce_op = r.Get<int32_t>();
    q.prescale = r.Get<double>();
    q.postscale = r.Get<double>();
    q.root_rank = r.Get<int32_t>();
    q.splits = r.Ints();
    q.process_set = r.Get<int32_t>();
    q.device = r.Get<int32_t>();
    q.group = r.Str();
    q.group_size = r.Get<int32_t>();
    q.wait_ms = r.Get<int64_t>();
    q.refusal = r.Str();
    if (r.ok() && (!ValidOp(q.op) || !ValidDtype(q.dtype))) return Corrupt("request");
    out->push_back(std::move(q));
  }
  if (!r.ok() || !r.done()) return Corrupt("request");
  return Status::OK();
}

void SerializeResponses(const std::vector<Response>& responses, std::vector<uint8_t>* out) {
  out->clear();
  Writer w(out);
  w.Put<uint8_t>(kWireVersion);
  w.Put<uint32_t>(static_cast<uint32_t>(responses.size()));
  for (const Response& p : responses) {
    w.Put<int32_t>(p.op);
    w.Str(p.name);
    w.Str(p.error);
    w.Put<int32_t>(p.error_code);
    w.Put<int32_t>(p.dtype);
    w.Put<uint8_t>(p.on_device ? 1 : 0);
    w.Ints(p.shape);
    w.Put<int32_t>(p.reduce_op);
    w.Put<double>(p.prescale);
    w.Put<double>(p.postscale);
    w.Put<int32_t>(p.root_rank);
    w.Put<int32_t>(p.contributors);
    w.Put<int32_t>(p.last_joined_rank);
    w.Put<uint8_t>(p.cacheable ? 1 : 0);
    w.Str(p.group);
    w.Ints(p.first_dims);
    w.Ints(p.splits);
    w.Bytes(p.joined);
    w.Bytes(p.targets);
  }
}

Status ParseResponses(const uint8_t* data, size_t len, std::vector<Response>* out) {
  Reader r(data, len);
  uint64_t count = 0;
  Status s = ReadHeader(&r, &count, "response");
  if (!s.ok()) return s;
  out->clear();
  out->reserve(std::min<uint64_t>(count, len / 64));  // a response takes more than 64 bytes
  for (uint64_t i = 0; i < count && r.ok(); ++i) {
    Response p;
    p.op = r.Get<int32_t>();
    p.name = r.Str();
    p.error = r.Str();
    p.error_code = r.Get<int32_t>();
    p.dtype = r.Get<int32_t>();
    p.on_device = r.Get<uint8_t>() != 0;
    p.shape = r.Ints();
    p.reduce_op = r.Get<int32_t>();
    p.prescale = r.Get<double>();
    p.postscale = r.Get<double>();
    p.root_rank = r.Get<int32_t>();
    p.contributors = r.Get<int32_t>();
    p.last_joined_rank = r.Get<int32_t>();
    p.cacheable = r.Get<uint8_t>() != 0;
    p.group = r.Str();
    p.first_dims = r.Ints();
    p.splits = r.Ints();
    p.joined = r.Bytes();
    p.targets = r.Bytes();
    if (r.ok() && (!ValidOp(p.op) || !ValidDtype(p.dtype))) return Corrupt("response");
    out->push_back(std::move(p));
  }
  if (!r.ok() || !r.done()) return Corrupt("response");
  return Status::OK();
}

}  // namespace hvdlite
