#include "cycle/response_cache.h"

namespace hvdlite {

ResponseCache::Lookup ResponseCache::Find(const Request& request, int64_t* slot) const {
  auto it = by_name_.find(request.name);
  if (it == by_name_.end()) return Lookup::kMiss;
  *slot = it->second;
  return slots_[it->second].request.SameParams(request) ? Lookup::kHit : Lookup::kChanged;
}

int64_t ResponseCache::SlotFor(const std::string& name) const {
  if (slots_.empty()) return -1;
  auto existing = by_name_.find(name);
  const int64_t own = existing == by_name_.end() ? -1 : existing->second;
  for (int64_t i = 0; i < capacity(); ++i) {
    if (!slots_[i].used || i == own) return i;
  }
  int64_t target = 0;
  for (int64_t i = 1; i < capacity(); ++i) {
    if (slots_[i].last_use < slots_[target].last_use) target = i;
  }
  return target;
}

void ResponseCache::Put(int64_t target, const Request& local, const Response& response) {
  if (target < 0) return;
  auto existing = by_name_.find(response.name);
  if (existing != by_name_.end()) Erase(existing->second);
  Erase(target);
  Slot& s = slots_[target];
  s.used = true;
  s.request = local;
  s.response = response;
  s.last_use = ++clock_;
  by_name_[response.name] = target;
}

void ResponseCache::Erase(int64_t slot) {
  Slot& s = slots_[slot];
  if (!s.used) return;
  by_name_.erase(s.response.name);
  s = Slot();
}

}  // namespace hvdlite
