// The background loop.
//
// Why cycles run one at a time: collectives must run in the same order on every rank,
// and the order is decided here, cycle by cycle, from one response list that is
// identical everywhere. Whoever runs a cycle holds the cycle token (cycle_mutex_), so
// the cycles of a rank are a sequence whichever thread ran each, and no collective is
// ever issued outside one. Which thread runs a cycle changes nothing on the other ranks:
// a round pairs with the peers' rounds of the same number.
//
// Who calls MPI: the background thread, and a framework thread that runs its own
// blocking call's cycle (RunCallerCycle; why: two task switches less per call). That
// thread is one blocked on its one op in flight, a small one on host memory, and every
// set of its rank lets it (MpiBackend::CallerCycleBytes): on one host, where the round,
// the negotiation and the collectives of host tensors all go through shared memory (no
// MPI call), or across hosts where the round is an exchange of records and MPI takes
// calls from any thread (MPI_THREAD_MULTIPLE; the cycle token keeps our calls one at a
// time). Its waits last until the peers' round of that number, which an idle peer joins
// within kIdleCycle; the shared-memory waits notice a dead peer, and a wait on MPI, or a
// fault inside MPI, leaves the cycle by its escape once the launcher reports lost peers
// (transport/mpi_fault_guard.h: the fault guard parks only the background thread). If
// its op is not done after that one cycle, the background thread goes on with it while
// the caller waits as for any op. NCCL stays the background thread's.
//
// One cycle pops the new requests and hands each to its process set (Core::RunCycle);
// then every set this rank belongs to runs its round, in id order (ProcessSetState::
// RunCycle; process_set.h says why that order cannot deadlock):
//  1. sort the set's new requests: each is a response-cache hit (its slot's bit will be
//     set), a changed cache entry (its slot is invalidated everywhere), or uncached;
//  2. one AND over [flags | hit bits | invalid bits] (through shared memory on one host;
//     across up to 8 hosts one exchange of records, after the host's AND through shared
//     memory where hosts have several ranks; else an MPI_Iallreduce(BAND)) tells every
//     rank which cached tensors are ready everywhere, which slots to drop, and whether
//     anyone has uncached requests, has joined, asked to shut down, or has ops in flight
//     in another set (RoundFlags); except with the MPI_Iallreduce, a small cached
//     allreduce or broadcast that is its rank's only request carries its data with it
//     (ProcessSetState::Carry, MpiBackend::AndBits), and runs from those copies in step
//     4 where every member's came;
//  3. only if someone has uncached requests: gather them on the set's rank 0, whose
//     Controller checks them across ranks and broadcasts the new responses;
//  4. execute cached-ready responses (slot order) then new ones (broadcast order),
//     fusing consecutive compatible allreduces up to the fusion threshold;
//  5. complete the handles.
// Steps 1-3 are in cycle/negotiation.cc, 4-5 in cycle/execution.cc.
#include "core/core.h"

#include <setjmp.h>

#include <algorithm>
#include <limits>

#include "common/thread_sched.h"
#include "transport/mpi_fault_guard.h"

namespace hvdlite {
namespace {

// A burst of requests is gathered until none arrived for this long (a submitting
// thread adds one every few microseconds, but may lose its core for a while on a
// busy machine), a thread waits for a result, or a cycle time after the first.
constexpr std::chrono::microseconds kQuiet(200);
// How often a rank with nothing in flight still joins the coordination.
constexpr std::chrono::milliseconds kIdleCycle(20);
// How often the background thread, waiting for the cycle token, checks whether a
// caller's cycle was left by its escape (and keeps the token for good).
constexpr std::chrono::milliseconds kTokenCheck(100);
// How long a rank keeps the cycle time after it last heard of ops in flight in another
// set (RoundFlags::elsewhere): a loop of ops in a set leaves the queues of its members
// empty for a moment between two ops, and an outside rank that went idle then would
// hold back the next op's round of set 0 by up to kIdleCycle.
constexpr std::chrono::milliseconds kElsewhereLinger(200);

}  // namespace

void Core::TakeRefusals() {
  std::vector<Request> taken;
  {
    std::lock_guard<std::mutex> lock(refusals_mutex_);
    taken.swap(refusals_);
  }
  for (Request& q : taken) {
    // A set removed since the refusal has no op of that name left to fail.
    ProcessSetState* set = sets_.Find(q.process_set);
    if (!set || !set->included()) continue;
    if (q.op == HVDLITE_OP_JOIN) {
      set->LeaveJoin(std::move(q));
    } else {
      set->Refuse(std::move(q));
    }
  }
}

void Core::EndLoop(const Status& s) {
  std::lock_guard<std::mutex> lock(end_mutex_);
  end_status_ = s;
}

void Core::FailEverything(const Status& s) {
  for (hvdlite_handle_t h : queue_.TakeAll()) handles_.Complete(h, s);
}

void Core::Loop() {
  Status end = Status(HVDLITE_ERR_SHUTDOWN, "hvdlite was shut down");
  last_cycle_.store(Clock::now());
  // With nothing in flight on this rank there is nothing to negotiate, so the loop
  // waits for this rank's next request (which wakes it at once) and joins the
  // coordination only every kIdleCycle, to hear of a peer's shutdown. Idle cycles at
  // the cycle time would cost CPU and, worse, a peer whose first request meets our
  // idle coordination round (its bit set, ours not yet) would wait a whole cycle.
  while (true) {
    Clock::duration cycle, idle_cycle;
    bool idle;
    Clock::time_point last;
    {
      // What the cycles left (a caller's may run meanwhile): read with the token.
      std::unique_lock<std::timed_mutex> token(cycle_mutex_, std::defer_lock);
      if (!TakeCycleToken(&token)) {
        end = CyclesStopped(nullptr);
        break;
      }
      // The cycle time in force (autotune may change it between cycles).
      cycle = std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double, std::milli>(autotune_.knobs().cycle_time_ms));
      idle_cycle = std::max<Clock::duration>(cycle, kIdleCycle);
      idle = queue_.Size() == 0 && !HasRefusals() && Clock::now() - elsewhere_heard_ > kElsewhereLinger;
      for (ProcessSetState* set = sets_.NextMember(-1); set && idle; set = sets_.NextMember(set->id())) {
        idle = !set->Busy();
      }
      last = last_cycle_.load();
    }
    bool woken = false;
    const bool work = queue_.WaitForWork(last + (idle ? idle_cycle : cycle), &woken);
    if (work && cycle.count() > 0) {
      // Requests arrived: the rest of a burst (a training step's gradients, a loop of
      // submissions) joins them, so that one cycle negotiates and fuses them all
      // instead of a cycle starting for the first alone while the others queue.
      // HVDLITE_CYCLE_TIME=0 asks for no waiting at all.
      queue_.WaitForQuiet(kQuiet, Clock::now() + cycle, handles_.blocked());
    }
    std::unique_lock<std::timed_mutex> token(cycle_mutex_, std::defer_lock);
    if (!TakeCycleToken(&token)) {
      end = CyclesStopped(nullptr);
      break;
    }
    // A caller's cycle ran meanwhile and left nothing for this one (it ran its own op,
    // perhaps the one that woke this wait): the idle time counts from that cycle.
    if (!woken && !cycles_ended_ && last_cycle_.load() != last && queue_.Size() == 0) continue;
    Status s;
    bool go_on = false;
    if (cycles_ended_) {
      s = cycles_end_;  // a caller's cycle ended the loop
    } else {
      go_on = RunCycle(true, &s);
    }
    if (!s.ok()) {
      HVDLITE_LOG(ERROR) << s.message();
      end = s;
      break;
    }
    if (!go_on) break;
  }
  bool transport_ok = end.code() == HVDLITE_ERR_SHUTDOWN;
  {
    std::lock_guard<std::mutex> lock(end_mutex_);
    end_status_ = end;
    loop_ended_ = true;
    FailEverything(end);
  }
  // Closing may wait in MPI for peers that are still training.
  LeaveRealtime();
  // After an escape the sets and the GPU stay as that cycle left them (MPI requests
  // pending on their buffers, perhaps): the process is to end, and nothing runs on them
  // again. (The ops' own buffers are the application's: it must not call MPI again.)
  if (CycleEscaped()) return;
  sets_.Clear(transport_ok);  // NCCL communicators first, then the GPU they ran on
  gpu_.Release();
}

bool Core::RunCycle(bool pop, Status* s) {
  last_cycle_.store(Clock::now());
  bool go_on = false;
  try {
    go_on = RunCycleUnguarded(pop);
  } catch (const std::exception& ex) {
    *s = Status(HVDLITE_ERR_INTERNAL, std::string("internal error in the background loop: ") + ex.what());
  }
  if (!go_on) {
    std::lock_guard<std::mutex> lock(end_mutex_);
    if (s->ok() && !end_status_.ok()) *s = end_status_;
    cycles_ended_ = true;
    cycles_end_ = *s;
  }
  return go_on && s->ok();
}

bool Core::RunCycleUnguarded(bool pop) {
  counters_.cycles++;
  timeline_.MarkCycle();
  const auto now = Clock::now();
  // One value for every set this cycle: all ranks then stop after the same cycle (each
  // hears of it in set 0's round at the latest). The ops in flight are counted before
  // the pop, like the idle test of Loop.
  RoundFlags mine;
  mine.shutdown = shutdown_requested_;
  queue_.CountBySet(&in_flight_, &in_flight_by_set_);
  if (pop) {
    TakeRefusals();  // ahead of this cycle's requests: a retry of the name comes after
    queue_.PopPending(&fresh_);
  }
  Distribute();
  RoundFlags heard;
  const int64_t bytes_before = counters_.bytes;
  for (ProcessSetState* set = sets_.NextMember(-1); set; set = sets_.NextMember(set->id())) {
    auto here = in_flight_by_set_.find(set->id());
    mine.elsewhere = in_flight_ > (here == in_flight_by_set_.end() ? 0 : here->second);
    if (!set->RunCycle(now, mine, &heard)) return false;
  }
  autotune_.EndCycle(Clock::now(), counters_.bytes - bytes_before);
  if (heard.elsewhere) elsewhere_heard_ = now;
  return !heard.shutdown;
}

int64_t Core::CallerCycleBytes() {
  // Refusals go to the coordinator ahead of later requests (TakeRefusals), which only
  // the background thread's cycle takes.
  if (cycles_ended_ || shutdown_requested_ || HasRefusals()) return 0;
  int64_t most = std::numeric_limits<int64_t>::max();
  for (ProcessSetState* set = sets_.NextMember(-1); set && most > 0; set = sets_.NextMember(set->id())) {
    most = std::min(most, set->CallerCycleBytes());
  }
  return most;
}

bool Core::TakeCycleToken(std::unique_lock<std::timed_mutex>* token) {
  // A caller holds it for the microseconds of its cycle; the check is for the escape.
  while (!token->try_lock_for(kTokenCheck)) {
    if (CycleEscaped()) return false;
  }
  return true;
}

Status Core::CyclesStopped(const char* doing) const {
  const std::string cannot = doing ? std::string("hvdlite ") + doing + ": " : "";
  const std::string notice = LostPeersNotice();
  const std::string lost = notice.empty() ? "" : notice + "; ";
  if (MpiFaulted()) {
    // The thread is parked in the fault handler for good, or a caller's faulted cycle
    // keeps the token: no cycle runs again on MPI in the state the fault left it.
    return Status(HVDLITE_ERR_MPI, cannot + lost + "a cycle faulted inside MPI (a lost peer?) "
                                                   "and no cycle can run again; end the process");
  }
  if (CycleEscaped()) {
    return Status(HVDLITE_ERR_RANK_FAILED,
                  cannot + lost +
                      "a blocking call's cycle was left inside MPI after peers were lost, and no "
                      "cycle can run again; end the process");
  }
  return Status::OK();
}

void Core::RunCallerCycle(std::unique_lock<std::timed_mutex>* token, hvdlite_handle_t h, bool popped) {
  bool done = false;
  if (popped) {
    counters_.caller_cycles++;
    sigjmp_buf escape;
    // The signal mask is not saved (that would be a system call per blocking call):
    // LeftByEscape unblocks what the fault handler's jump left blocked.
    if (sigsetjmp(escape, 0) != 0) {
      LeftByEscape();
      token->release();  // kept for good
      return;
    }
    {
      CycleEscape armed(&escape);
      Status s;
      RunCycle(false, &s);
    }
    bool ended = false;
    done = handles_.Poll(h, &ended).ok() && ended;
  }
  token->unlock();
  if (!done) queue_.Wake();
}

void Core::Distribute() {
  for (TensorEntry* e : fresh_) {
    ProcessSetState* set = sets_.Find(e->request.process_set);
    if (set && set->included()) {
      set->Accept(e);
      continue;
    }
    // Removed between its enqueue and this cycle.
    hvdlite_handle_t h = e->handle;
    std::string name = e->request.name;
    queue_.Remove(name);
    counters_.errors++;
    handles_.Complete(h, InvalidArgument("tensor '" + name + "': process set " +
                                         std::to_string(e->request.process_set) +
                                         " was removed before the op could run"));
  }
}

}  // namespace hvdlite
