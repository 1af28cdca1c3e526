#include "common/thread_sched.h"

#include <dirent.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace hvdlite {
namespace {

// The kernel's struct sched_attr (glibc before 2.41 does not declare it).
struct SchedAttr {
  uint32_t size;
  uint32_t sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime;
  uint64_t sched_deadline;
  uint64_t sched_period;
};

}  // namespace

bool RequestShortSlice(long slice_ns) {
#ifdef SYS_sched_setattr
  if (sched_getscheduler(0) != SCHED_OTHER) return false;  // leave a real-time policy alone
  errno = 0;
  const int nice = getpriority(PRIO_PROCESS, 0);
  if (errno != 0) return false;
  SchedAttr attr = {};
  attr.size = sizeof(attr);
  attr.sched_policy = SCHED_OTHER;
  attr.sched_nice = nice;
  attr.sched_runtime = static_cast<uint64_t>(slice_ns);
  return syscall(SYS_sched_setattr, 0, &attr, 0) == 0;
#else
  (void)slice_ns;
  return false;
#endif
}

namespace {

// The cores this process could use before it bound anything: a later init (elastic
// training starts the core again) shares out the same cores, not its own share.
std::vector<int> CoresAtStart(std::string* why) {
  static const std::vector<int> cores = [] {
    std::vector<int> all;
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) return all;
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &allowed)) all.push_back(c);
    }
    return all;
  }();
  if (cores.empty()) *why = "cannot read which cores this process may use";
  return cores;
}

}  // namespace

namespace {

// Whether this thread is real-time now (RequestRealtime, not lowered by a scope).
thread_local bool t_realtime = false;

bool SetRealtime() {
  sched_param param = {};
  param.sched_priority = sched_get_priority_min(SCHED_FIFO);
  t_realtime = sched_setscheduler(0, SCHED_FIFO | SCHED_RESET_ON_FORK, &param) == 0;
  return t_realtime;
}

void SetNormal() {
  sched_param param = {};
  sched_setscheduler(0, SCHED_OTHER, &param);
  RequestShortSlice(kBackgroundSliceNs);
  t_realtime = false;
}

}  // namespace

CorePlace ThisCorePlace() {
  CorePlace place = {};
  // One id per boot of the kernel, read alike in every container and network namespace.
  FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r");
  const size_t n = f ? std::fread(place.kernel, 1, sizeof(place.kernel) - 1, f) : 0;
  if (f) std::fclose(f);
  if (n == 0) gethostname(place.kernel, sizeof(place.kernel) - 1);  // as a host name groups
  std::string why;
  for (int c : CoresAtStart(&why)) {
    if (c < 1024) place.cores[c / 64] |= uint64_t{1} << (c % 64);
  }
  return place;
}

CoreSharing CountSharing(const CorePlace& mine, const std::vector<CorePlace>& all) {
  CoreSharing sharing;
  sharing.ranks = 0;
  uint64_t cores[16] = {};
  for (const CorePlace& p : all) {
    if (std::memcmp(p.kernel, mine.kernel, sizeof(mine.kernel)) != 0) continue;
    bool meet = false;
    for (int w = 0; w < 16; ++w) meet = meet || (p.cores[w] & mine.cores[w]) != 0;
    if (!meet) continue;
    sharing.ranks++;
    for (int w = 0; w < 16; ++w) cores[w] |= p.cores[w];
  }
  for (uint64_t w : cores) sharing.cores += __builtin_popcountll(w);
  sharing.ranks = std::max(sharing.ranks, 1);
  return sharing;
}

int CoresAtStartCount() {
  std::string why;
  return static_cast<int>(CoresAtStart(&why).size());
}

bool PlaceThread(int tid, int cpu) {
  if (tid <= 0) return false;  // 0 would be the calling thread
  cpu_set_t set;
  CPU_ZERO(&set);
  if (cpu >= 0) {
    CPU_SET(cpu, &set);
  } else {
    std::string why;
    for (int c : CoresAtStart(&why)) CPU_SET(c, &set);
    if (CPU_COUNT(&set) == 0) return false;
  }
  return sched_setaffinity(tid, sizeof(set), &set) == 0;
}

bool RequestRealtime(const CoreSharing& sharing, std::string* why) {
  if (sharing.cores == 0) {
    *why = "cannot read which cores this process may use";
    return false;
  }
  if (sharing.crowded()) {
    *why = std::to_string(sharing.ranks) + " ranks share " + std::to_string(sharing.cores) +
           (sharing.cores == 1 ? " core" : " cores") +
           " (the ranks on this machine whose cores meet this one's, whatever their host names): "
           "real-time threads of equal priority do not share a core";
    return false;
  }
  if (!SetRealtime()) {
    *why = errno == EPERM ? "the kernel refused it (EPERM): it takes CAP_SYS_NICE or an RLIMIT_RTPRIO "
                            "of at least 1 (ulimit -r)"
                          : std::string("sched_setscheduler failed: ") + std::strerror(errno);
    return false;
  }
  return true;
}

void LeaveRealtime() {
  if (t_realtime) SetNormal();
}

NormalPriorityScope::NormalPriorityScope() : lowered_(t_realtime) {
  if (lowered_) SetNormal();
}

NormalPriorityScope::~NormalPriorityScope() {
  if (lowered_) SetRealtime();
}

std::vector<int> BindToCoreShare(int local_rank, int local_size, std::string* why) {
  const std::vector<int> cores = CoresAtStart(why);
  if (cores.empty()) return {};
  const int share = local_size > 0 ? static_cast<int>(cores.size()) / local_size : 0;
  const bool fits = share > 0 && local_rank >= 0 && local_rank < local_size;
  // When it does not fit, every thread goes back to all the cores (an earlier init of an
  // elastic job may have bound them to a share of fewer ranks).
  const std::vector<int> mine = fits ? std::vector<int>(cores.begin() + local_rank * share,
                                                         cores.begin() + (local_rank + 1) * share)
                                     : cores;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : mine) CPU_SET(c, &set);
  DIR* dir = opendir("/proc/self/task");
  if (!dir) {
    *why = std::string("cannot list this process's threads: ") + std::strerror(errno);
    return {};
  }
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    const pid_t tid = static_cast<pid_t>(std::atoi(entry->d_name));
    // A thread that ended meanwhile (ESRCH) needs no binding.
    if (sched_setaffinity(tid, sizeof(set), &set) != 0 && errno != ESRCH) {
      *why = "sched_setaffinity of thread " + std::to_string(tid) + " failed: " + std::strerror(errno);
      closedir(dir);
      return {};
    }
  }
  closedir(dir);
  if (!fits) {
    *why = std::to_string(local_size) + " ranks on this host and " + std::to_string(cores.size()) +
           " cores to share among them";
    return {};
  }
  return mine;
}

}  // namespace hvdlite
