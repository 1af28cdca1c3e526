// See mpi_fault_guard.h. Everything the handler does is async-signal-safe: it reads a
// thread-local pointer, writes to fd 2, and sleeps in pause() or jumps to the thread's
// armed escape.
#include "transport/mpi_fault_guard.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>

namespace hvdlite {
namespace {

thread_local const char* t_mpi_call = nullptr;
thread_local sigjmp_buf* t_escape = nullptr;
std::atomic<bool> g_faulted{false};
std::atomic<bool> g_parked{false};
std::atomic<bool> g_lost_peers{false};
std::mutex g_notice_mutex;
std::string g_notice;  // guarded by g_notice_mutex
std::atomic<bool> g_escaped{false};
std::atomic<bool> g_test_fault{false}, g_test_fault_armed{false};
std::atomic<int64_t> g_test_fault_delay_us{0};
// Read through a volatile so that the compiler cannot see the null: a real SIGSEGV.
volatile std::uintptr_t g_null_address = 0;
struct sigaction g_previous_segv, g_previous_bus;

// Leaves the armed thread's cycle (see CycleEscape). Async-signal-safe.
[[noreturn]] void Escape() {
  sigjmp_buf* to = t_escape;
  t_escape = nullptr;
  t_mpi_call = nullptr;
  g_escaped.store(true);
  siglongjmp(*to, 1);
}

void WriteAll(const char* text) {
  size_t left = std::strlen(text);
  while (left > 0) {
    ssize_t n = write(STDERR_FILENO, text, left);
    if (n <= 0) return;
    text += n;
    left -= static_cast<size_t>(n);
  }
}

void OnFault(int sig, siginfo_t* info, void*) {
  const char* what = t_mpi_call;
  if (what == nullptr) {
    // Not ours: the previous handler gets the fault (returning re-runs the faulting
    // instruction; a fault sent by kill or raise has to be sent again).
    sigaction(sig, sig == SIGBUS ? &g_previous_bus : &g_previous_segv, nullptr);
    if (info == nullptr || info->si_code <= 0) raise(sig);
    return;
  }
  g_faulted.store(true);
  WriteAll("hvdlite: ");
  WriteAll(sig == SIGBUS ? "SIGBUS" : "SIGSEGV");
  WriteAll(" inside ");
  WriteAll(what);
  WriteAll(t_escape ? " in a blocking call's cycle" : " in the background thread");
  WriteAll(": MPI failed on its error path (a peer was lost?). "
           "The thread's cycles are stopped; pending collectives will not complete, and the job "
           "must end (hvdliterun tells the other ranks which peer was lost)\n");
  if (t_escape) Escape();
  g_parked.store(true);
  while (true) pause();
}

}  // namespace

void InstallMpiFaultGuard() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_sigaction = OnFault;
    // On the alternate stack where the thread has one (Python's faulthandler gives the main
    // thread one), so that a stack overflow still reaches the previous handler.
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, &g_previous_segv);
    sigaction(SIGBUS, &action, &g_previous_bus);
  });
}

InMpiCall::InMpiCall(const char* what) : outer_(t_mpi_call) {
  EscapeIfPeersLost();
  t_mpi_call = what;
  std::atomic<bool>& test_fault = t_escape ? g_test_fault_armed : g_test_fault;
  if (test_fault.load(std::memory_order_relaxed) && test_fault.exchange(false)) {
    const int64_t delay_us = g_test_fault_delay_us.exchange(0);
    if (delay_us > 0) usleep(static_cast<useconds_t>(delay_us));
    *reinterpret_cast<volatile int*>(g_null_address) = 0;
  }
}

InMpiCall::~InMpiCall() { t_mpi_call = outer_; }

bool MpiFaulted() { return g_faulted.load(); }

bool MpiThreadParked() { return g_parked.load(); }

CycleEscape::CycleEscape(sigjmp_buf* to) { t_escape = to; }

CycleEscape::~CycleEscape() { t_escape = nullptr; }

void LeftByEscape() {
  sigset_t faults;
  sigemptyset(&faults);
  sigaddset(&faults, SIGSEGV);
  sigaddset(&faults, SIGBUS);
  pthread_sigmask(SIG_UNBLOCK, &faults, nullptr);
}

void NoteLostPeers(const char* notice) {
  {
    std::lock_guard<std::mutex> lock(g_notice_mutex);
    if (g_notice.empty() && notice) g_notice = notice;
  }
  g_lost_peers.store(true);
}

bool PeersLost() { return g_lost_peers.load(); }

std::string LostPeersNotice() {
  std::lock_guard<std::mutex> lock(g_notice_mutex);
  return g_notice;
}

void EscapeIfPeersLost() {
  if (t_escape && g_lost_peers.load(std::memory_order_relaxed)) Escape();
}

bool CycleEscaped() { return g_escaped.load(); }

void RequestFaultInMpiForTest(bool in_caller_cycle, double delay_s) {
  g_test_fault_delay_us.store(static_cast<int64_t>(delay_s * 1e6));
  (in_caller_cycle ? g_test_fault_armed : g_test_fault).store(true);
}

}  // namespace hvdlite
