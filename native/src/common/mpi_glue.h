// The glue between MPI and the core's types, for the two files that call MPI
// (backend/backend_mpi.cc, transport/topology_layers.cc). The only file that includes
// mpi.h, so the rest of the core compiles without it. Background thread.
#pragma once

#include <mpi.h>

#include <string>

#include "common/common.h"

namespace hvdlite {

// Communicators travel through the core's headers as void* (an MPI_Comm*).
inline MPI_Comm& Comm(void* p) { return *static_cast<MPI_Comm*>(p); }

// An MPI return code as a Status: OK, or HVDLITE_ERR_MPI with what failed and MPI's text.
inline Status Check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return Status::OK();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return Status(HVDLITE_ERR_MPI, std::string(what) + " failed: " + std::string(text, len));
}

}  // namespace hvdlite
