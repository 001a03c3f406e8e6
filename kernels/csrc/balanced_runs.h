// Work items shared out to threads as contiguous runs of about equal estimated cost (one run per
// thread): an even split by count leaves a thread waiting at the end of each call while the
// other finishes the costlier items. Which thread runs an item never changes its result.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace stoker {

// starts[t] .. starts[t + 1] are run t's items, for t < starts.size() - 1 (at most one run per
// thread, and at least one run). costs: one non-negative estimate per item.
inline std::vector<int64_t> balanced_runs(const std::vector<double>& costs) {
  const int64_t items = static_cast<int64_t>(costs.size());
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<int64_t> starts(nt + 1, items);
  starts[0] = 0;
  double total = 0.0, acc = 0.0;
  for (double c : costs) total += c;
  int64_t t = 1;
  for (int64_t i = 0; i < items && t < nt; ++i) {
    acc += costs[i];
    while (t < nt && acc >= total * t / nt) starts[t++] = i + 1;
  }
  return starts;
}

}  // namespace stoker
