// Types shared by every part of the core: Status, element types, names, logging.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "hvdlite/c_api.h"

namespace hvdlite {

// The outcome of an operation: a code from c_api.h and, when not OK, why.
class Status {
 public:
  Status() = default;
  Status(hvdlite_status_t code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status OK() { return Status(); }
  bool ok() const { return code_ == HVDLITE_OK; }
  hvdlite_status_t code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  hvdlite_status_t code_ = HVDLITE_OK;
  std::string message_;
};

inline Status InvalidArgument(std::string m) { return Status(HVDLITE_ERR_INVALID_ARGUMENT, std::move(m)); }

bool ValidDtype(int32_t dtype);
int ElementSize(int32_t dtype);
const char* DtypeName(int32_t dtype);
bool ValidOp(int32_t op);
const char* OpName(int32_t op);
bool ValidReduceOp(int32_t reduce_op);
const char* ReduceOpName(int32_t reduce_op);
std::string ShapeString(const std::vector<int64_t>& shape);
// "rank 3" or "ranks 0, 2".
std::string RankList(const std::vector<int>& ranks);
// Ranks grouped by the value each had: "" when all agree, else e.g. "ranks 0, 2 had
// 1024; rank 1 had 200000". values[r] is rank r's value; ranks with counts[r] == 0 are
// left out (counts null: every rank counts). names[r], when given, is how rank r is
// called (its global rank, for the ranks of a process set).
std::string Disagreement(const std::vector<std::string>& values,
                         const std::vector<uint8_t>* counts = nullptr,
                         const std::vector<int>* names = nullptr);
int64_t NumElements(const std::vector<int64_t>& shape);
// Elements of one row: every dimension but the first.
int64_t RowElements(const std::vector<int64_t>& shape);
// Reducescatter's split of a tensor's rows over `size` ranks: each rank's element count
// (the first rows % size ranks get one row more).
std::vector<int64_t> ScatterCounts(const std::vector<int64_t>& shape, int size);

// Logging: HVDLITE_LOG(WARNING) << "..."; level from HVDLITE_LOG_LEVEL.
enum class LogLevel { TRACE = 0, DEBUG = 1, INFO = 2, WARNING = 3, ERROR = 4 };
LogLevel MinLogLevel();
void SetLogRank(int rank);

class LogMessage {
 public:
  explicit LogMessage(LogLevel level) : level_(level) {}
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  std::ostringstream stream_;
};

#define HVDLITE_LOG(level)                                                 \
  if (::hvdlite::LogLevel::level < ::hvdlite::MinLogLevel()) {             \
  } else                                                                   \
    ::hvdlite::LogMessage(::hvdlite::LogLevel::level).stream()

// The loops that stream tensors through memory (reductions, scaling) are compiled twice,
// for AVX2 and for any x86-64, and the loader picks the one this CPU runs (an ifunc):
// their fixed 64-byte blocks then take two vector instructions instead of four. A
// 23 MB allreduce through shared memory ran ~6% faster here (median of interleaved
// pairs). (Not under ASan, whose start-up the ifunc resolver would run before.)
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__SANITIZE_ADDRESS__)
#define HVDLITE_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define HVDLITE_VECTOR_CLONES
#endif

}  // namespace hvdlite
