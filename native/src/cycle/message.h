// Request (rank -> coordinator) and Response (coordinator -> every rank), and their
// wire format: a version byte, then little-endian fields; every read is bounds-checked,
// so a truncated or corrupted buffer is an error, never a read past its end.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/common.h"

namespace hvdlite {

// The name every rank's join request goes by: one join per rank at a time, whatever the
// caller named it.
constexpr const char* kJoinName = "__join__";
// A JOIN request by this name tells the coordinator that the rank left its join (its
// caller gave up waiting): a full rank again (ProcessSetState::LeaveJoin).
constexpr const char* kLeaveJoinName = "__leave_join__";

// Scale factors are the same when their bits are: 0.0 and -0.0 compare equal, yet scale
// to zeros of different signs.
inline bool SameFactor(double a, double b) { return a == b && std::signbit(a) == std::signbit(b); }

// What one rank asks for one tensor. Everything but rank and wait_ms must agree
// across ranks (allgather/alltoall: all but the first dimension and the splits).
struct Request {
  int32_t rank = 0;
  std::string name;
  int32_t op = HVDLITE_OP_ALLREDUCE;
  int32_t dtype = HVDLITE_FLOAT32;
  std::vector<int64_t> shape;
  int32_t reduce_op = HVDLITE_SUM;
  double prescale = 1.0;
  double postscale = 1.0;
  int32_t root_rank = 0;
  std::vector<int64_t> splits;  // alltoall, as given (possibly derived from even split)
  int32_t process_set = 0;
  int32_t device = -1;
  std::string group;            // non-empty: negotiated and executed with its group
  int32_t group_size = 0;
  int64_t wait_ms = 0;          // how long it has waited on its rank when sent
  std::string refusal;          // non-empty: the rank refuses this op, for this reason

  // Same tensor, same parameters: the response cache's notion of a hit.
  bool SameParams(const Request& o) const;
};

// What every rank executes, identical on all ranks.
struct Response {
  int32_t op = HVDLITE_OP_ALLREDUCE;
  std::string name;
  std::string error;            // non-empty: fail the handles with this message
  int32_t error_code = HVDLITE_OK;
  int32_t dtype = HVDLITE_FLOAT32;
  bool on_device = false;       // GPU tensors (on every rank: negotiation checks it)
  std::vector<int64_t> shape;   // rank 0's shape (the full shape for allreduce/broadcast)
  int32_t reduce_op = HVDLITE_SUM;
  double prescale = 1.0;
  double postscale = 1.0;
  int32_t root_rank = 0;
  int32_t contributors = 0;     // ranks that hold data (size minus joined ranks)
  int32_t last_joined_rank = -1;
  bool cacheable = false;
  std::string group;
  std::vector<int64_t> first_dims;  // allgather: rows from each rank
  std::vector<int64_t> splits;      // alltoall: size x size matrix, row r = rank r's splits
  std::vector<uint8_t> joined;      // 1 for each rank that had joined
  std::vector<uint8_t> targets;     // an error for some ranks only: 1 for each; empty: all
};

void SerializeRequests(const std::vector<Request>& requests, std::vector<uint8_t>* out);
Status ParseRequests(const uint8_t* data, size_t len, std::vector<Request>* out);
void SerializeResponses(const std::vector<Response>& responses, std::vector<uint8_t>* out);
Status ParseResponses(const uint8_t* data, size_t len, std::vector<Response>* out);

constexpr uint8_t kWireVersion = 1;
// Longest tensor name enqueue accepts, in bytes: well under the wire format's string
// limit, so a name (also inside group names and error messages) always fits a message.
constexpr size_t kMaxNameBytes = 1 << 16;

}  // namespace hvdlite
