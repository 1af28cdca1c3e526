#include "common/common.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace hvdlite {

bool ValidDtype(int32_t dtype) { return dtype >= HVDLITE_UINT8 && dtype <= HVDLITE_UINT16; }

int ElementSize(int32_t dtype) {
  switch (dtype) {
    case HVDLITE_UINT8: case HVDLITE_INT8: case HVDLITE_BOOL: return 1;
    case HVDLITE_FLOAT16: case HVDLITE_BFLOAT16: case HVDLITE_INT16: case HVDLITE_UINT16: return 2;
    case HVDLITE_INT32: case HVDLITE_FLOAT32: return 4;
    case HVDLITE_INT64: case HVDLITE_FLOAT64: return 8;
    default: return 0;
  }
}

const char* DtypeName(int32_t dtype) {
  static const char* kNames[] = {"uint8", "int8", "int32", "int64", "float16",
                                 "bfloat16", "float32", "float64", "bool", "int16", "uint16"};
  return ValidDtype(dtype) ? kNames[dtype] : "unknown dtype";
}

bool ValidOp(int32_t op) {
  return op >= HVDLITE_OP_ALLREDUCE && op <= HVDLITE_OP_REMOVE_PROCESS_SET;
}

const char* OpName(int32_t op) {
  static const char* kNames[] = {"allreduce", "allgather", "broadcast", "alltoall",
                                 "reducescatter", "barrier", "join", "add_process_set",
                                 "remove_process_set"};
  return ValidOp(op) ? kNames[op] : "unknown op";
}

bool ValidReduceOp(int32_t r) { return r >= HVDLITE_AVERAGE && r <= HVDLITE_PRODUCT; }

const char* ReduceOpName(int32_t r) {
  static const char* kNames[] = {"Average", "Sum", "Min", "Max", "Product"};
  return ValidReduceOp(r) ? kNames[r] : "unknown reduction";
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string RankList(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

std::string Disagreement(const std::vector<std::string>& values,
                         const std::vector<uint8_t>* counts, const std::vector<int>* names) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;  // value -> its ranks
  for (size_t r = 0; r < values.size(); ++r) {
    if (counts && !(*counts)[r]) continue;
    const int name = names ? (*names)[r] : static_cast<int>(r);
    auto g = std::find_if(groups.begin(), groups.end(),
                          [&](const auto& x) { return x.first == values[r]; });
    if (g == groups.end()) {
      groups.push_back({values[r], {name}});
    } else {
      g->second.push_back(name);
    }
  }
  std::string diff;
  if (groups.size() <= 1) return diff;
  for (size_t i = 0; i < groups.size(); ++i) {
    diff += (i ? "; " : "") + RankList(groups[i].second) + " had " + groups[i].first;
  }
  return diff;
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t RowElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

std::vector<int64_t> ScatterCounts(const std::vector<int64_t>& shape, int size) {
  const int64_t rows = shape.empty() ? 0 : shape[0], row = RowElements(shape);
  std::vector<int64_t> counts(size);
  for (int k = 0; k < size; ++k) counts[k] = (rows / size + (k < rows % size ? 1 : 0)) * row;
  return counts;
}

namespace {
std::atomic<int> g_log_rank{-1};

LogLevel ParseLevel() {
  const char* env = std::getenv("HVDLITE_LOG_LEVEL");
  if (!env) return LogLevel::WARNING;
  std::string v(env);
  for (auto& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (v == "trace") return LogLevel::TRACE;
  if (v == "debug") return LogLevel::DEBUG;
  if (v == "info") return LogLevel::INFO;
  if (v == "error") return LogLevel::ERROR;
  return LogLevel::WARNING;
}
}  // namespace

LogLevel MinLogLevel() {
  static const LogLevel level = ParseLevel();
  return level;
}

void SetLogRank(int rank) { g_log_rank = rank; }

LogMessage::~LogMessage() {
  static const char* kLevels[] = {"TRACE", "DEBUG", "INFO", "WARNING", "ERROR"};
  std::string line = "[hvdlite r" + std::to_string(g_log_rank.load()) + "] " +
                     kLevels[static_cast<int>(level_)] + ": " + stream_.str() + "\n";
  // One write per line, so lines from the two threads never interleave.
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace hvdlite
