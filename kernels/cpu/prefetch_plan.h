// Memory a step reads soon, prefetched by the next weight-streaming matmul between its own loads
// (`pending_prefetch`): the decoder stack names the next layer's cached K/V rows before the MLP's
// gate/up matmul, so attention finds them in cache instead of waiting on DRAM. After a step's
// weights have streamed through every cache, a decode's K/V arrive cold: on AMD EPYC Zen 4 the
// attention of a 1000-token SmolLM2 decode waited longer on them than the matmuls took.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace specserve {

struct PrefetchPlan {
  std::vector<const char*> starts;  // each range's first byte
  std::vector<int64_t> until;       // lines of ranges [0, r] together

  int64_t lines() const { return until.empty() ? 0 : until.back(); }
  int64_t bytes() const { return lines() * 64; }
  void clear() { starts.clear(), until.clear(); }
  void add(const void* begin, int64_t bytes) {
    if (bytes <= 0) return;
    starts.push_back(static_cast<const char*>(begin));
    until.push_back(lines() + (bytes + 63) / 64);
  }

  // Prefetch lines [first, last) of the plan, in its order. Into L2, not L1 (T2): prefetches
  // into L1 held the matmul's own loads back for as long as they saved (in-process A/B: 0.98-1.01x).
  void issue(int64_t first, int64_t last) const {
    int64_t r = std::upper_bound(until.begin(), until.end(), first) - until.begin();
    for (int64_t line = first; line < last && r < static_cast<int64_t>(starts.size()); ++r) {
      const int64_t begin = r == 0 ? 0 : until[r - 1];
      for (; line < std::min(last, until[r]); ++line) {
#if defined(__SSE__)
        _mm_prefetch(starts[r] + (line - begin) * 64, _MM_HINT_T2);
#else
        __builtin_prefetch(starts[r] + (line - begin) * 64, 0, 1);
#endif
      }
    }
  }
};

// The plan the next tiled matmul called on this thread takes (leaving it empty): set right
// before the call it is meant for, and cleared after it (a kernel without plans leaves it).
inline PrefetchPlan& pending_prefetch() {
  static thread_local PrefetchPlan plan;
  return plan;
}

}  // namespace specserve
