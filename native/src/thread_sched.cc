#include "thread_sched.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

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

}  // namespace hvdlite
