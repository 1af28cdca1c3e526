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
#pragma once

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

// Whether a fault inside MPI parked the background thread (it never ends: not joinable).
bool MpiFaulted();

// For tests (hvdlite_test_fault_in_mpi): the next InMpiCall faults as MPICH does.
void RequestFaultInMpiForTest();

}  // namespace hvdlite
