// A fault inside MPI is MPI's, not the process's: a guard for the background thread.
//
// MPICH (ch4:ucx, 5.0) dereferences a null pointer on the error path of a nonblocking
// collective whose send to a dead peer fails: MPI_Test faults with SIGSEGV on every rank
// that talked to the dead one, before the launcher's lost-peer notice can reach them,
// and those ranks die instead of raising RankFailedError. While the background thread is
// inside an MPI call (an InMpiCall lives on its stack), a SIGSEGV or SIGBUS there says
// so on stderr and parks the thread for good: its pending collectives never complete,
// the rest of the process goes on, and the waits raise the launcher's notice as for any
// peer that stops answering. A fault anywhere else goes to the handler that was there
// before (Python's faulthandler, or the default: a core dump).
//
// A framework thread may call MPI too: it runs its own blocking call's cycle across
// hosts (Core::RunCallerCycle). It must neither be parked nor wait for good inside a
// cycle, where Ctrl-C and the lost-peer notice cannot reach it. So it arms an escape
// (CycleEscape) before the cycle: a fault inside MPI on that thread, or an MPI call
// there after the launcher reported lost peers (NoteLostPeers; a dead peer's messages
// never come), returns it to the escape's sigsetjmp, abandoning the cycle's frames as
// they are. The caller then keeps the cycle token for good (no cycle runs again in this
// process, as when the background thread is parked); the background thread sees that
// and ends the loop, failing the ops with the launcher's notice (LostPeersNotice) or
// the fault (Core::TakeCycleToken).
#pragma once

#include <setjmp.h>

#include <string>

namespace hvdlite {

// Installs the SIGSEGV and SIGBUS handlers (once per process; later calls do nothing).
void InstallMpiFaultGuard();

// Marks the calling thread as inside `what` (an MPI call, a static string) while alive.
class InMpiCall {
 public:
  explicit InMpiCall(const char* what);
  ~InMpiCall();
  InMpiCall(const InMpiCall&) = delete;
  InMpiCall& operator=(const InMpiCall&) = delete;

 private:
  const char* outer_;
};

// Whether a fault inside MPI parked the background thread (it never ends: not joinable)
// or ended a framework thread's cycle (whose token is then never given back).
bool MpiFaulted();
// Whether a fault inside MPI parked the thread it hit (one with no escape armed: the
// background thread), which then never returns.
bool MpiThreadParked();

// While alive, the calling thread escapes to `to` (siglongjmp, value 1) from a fault
// inside MPI or from an MPI call made after NoteLostPeers. `to` must be the caller's
// own sigsetjmp(*to, 0), made before this is built, in a frame that outlives it, which
// calls LeftByEscape when it returns 1; the escape skips every destructor in between,
// this one's included (the jump disarms it).
class CycleEscape {
 public:
  explicit CycleEscape(sigjmp_buf* to);
  ~CycleEscape();
  CycleEscape(const CycleEscape&) = delete;
  CycleEscape& operator=(const CycleEscape&) = delete;
};

// After the jump: unblocks SIGSEGV and SIGBUS, which a jump out of the fault handler
// leaves blocked (the escape point saves no signal mask: a system call per cycle).
void LeftByEscape();

// The launcher reported lost peers (hvdlite_note_lost_peers, from the notice's reader):
// every armed thread leaves its cycle at its next MPI call, or at the next wake of a
// wait in shared memory (EscapeIfPeersLost: a peer on this host may itself wait for
// good on a lost one, alive all the while). notice: the launcher's words (which ranks
// and hosts were lost), kept for the errors that end the ops; the first one stays.
void NoteLostPeers(const char* notice);
// The notice NoteLostPeers kept ("" if none), and whether it came.
std::string LostPeersNotice();
bool PeersLost();
// Leaves the calling thread's cycle by its escape if it has one armed and lost peers
// were noted; returns otherwise.
void EscapeIfPeersLost();
// Whether a cycle was left by its escape (its token is never given back).
bool CycleEscaped();

// For tests (hvdlite_test_fault_in_mpi, hvdlite_test_fault_in_caller_cycle): the next
// InMpiCall (in_caller_cycle: the next of a thread with an escape armed) faults as
// MPICH does, delay_s after it began.
void RequestFaultInMpiForTest(bool in_caller_cycle, double delay_s = 0);

}  // namespace hvdlite
