// Name+parameters -> a slot holding the negotiated Response, so that later steps
// negotiate the tensor with one bit (its slot) in the coordination allreduce.
//
// Every rank must hold the same names in the same slots: the cache is only changed
// by Put (in the order of the broadcast response list), Touch (in slot order) and
// Erase (in slot order), identically on every rank. The cycle's thread only (core/loop.cc).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "cycle/message.h"

namespace hvdlite {

class ResponseCache {
 public:
  enum class Lookup { kMiss, kHit, kChanged };

  explicit ResponseCache(int64_t capacity) : slots_(capacity) {}
  int64_t capacity() const { return static_cast<int64_t>(slots_.size()); }
  // kChanged: the name is cached but this request's parameters differ.
  Lookup Find(const Request& request, int64_t* slot) const;
  const Response& Get(int64_t slot) const { return slots_[slot].response; }
  bool Has(int64_t slot) const { return slots_[slot].used; }
  // Stores this rank's request with the shared response in `slot`, which must be
  // SlotFor(the response's name) (the caller looks at the slot first: Negotiate).
  void Put(int64_t slot, const Request& local, const Response& response);
  // The slot Put would store `name` in: the first free one (the name's own counts as
  // free), else the least recently used, evicted; -1 without slots.
  int64_t SlotFor(const std::string& name) const;
  void Touch(int64_t slot) { slots_[slot].last_use = ++clock_; }
  void Erase(int64_t slot);

 private:
  struct Slot {
    bool used = false;
    uint64_t last_use = 0;
    Request request;
    Response response;
  };
  std::vector<Slot> slots_;
  std::unordered_map<std::string, int64_t> by_name_;
  uint64_t clock_ = 0;
};

}  // namespace hvdlite
