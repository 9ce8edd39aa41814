// The suffix drafter's search (drafters/suffix.py, `longest_match`, which defines what it finds):
// the longest suffix of a query that occurs in a corpus followed by a token, and every place
// right after an occurrence of it. In numpy that search was ~15 calls a corpus, each several
// times its warm cost with the caches cold from the forward just before: on a 2-core Xeon about
// 0.3 ms of a 9.5 ms suffix step for the two corpora. Here: one pass over the last token's
// occurrences, each compared backwards with the query as far as it agrees.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int32_t kSeparator = -1;  // between outputs (drafters/suffix.py: SEPARATOR); never matched

// (length, places after each occurrence of the longest match, ascending); length 0: none. The
// last token's occurrences are the corpus's own where `by_token` is empty; else `places` (corpus
// positions sorted by token, stably, over the first `indexed` positions: `by_token` their tokens)
// gives those, and positions from `indexed` on are scanned. A place may since hold a separator
// (a forgotten output): it is checked, as every occurrence is.
std::tuple<int64_t, at::Tensor> suffix_match(const at::Tensor& corpus, const at::Tensor& query, int64_t max_match,
                                             const at::Tensor& places, const at::Tensor& by_token, int64_t indexed) {
  TORCH_CHECK(corpus.scalar_type() == at::kInt && corpus.dim() == 1 && corpus.is_contiguous(),
              "suffix_match: corpus must be contiguous int32 [n]");
  TORCH_CHECK(query.scalar_type() == at::kInt && query.dim() == 1 && query.is_contiguous(),
              "suffix_match: query must be contiguous int32 [q]");
  TORCH_CHECK(places.scalar_type() == at::kInt && by_token.scalar_type() == at::kInt && places.is_contiguous() &&
                  by_token.is_contiguous() && places.numel() == by_token.numel(),
              "suffix_match: places and by_token must be contiguous int32 of one length");
  const int32_t* c = corpus.data_ptr<int32_t>();
  const int32_t* q = query.data_ptr<int32_t>();
  const int64_t n = corpus.numel(), m = query.numel();
  std::vector<int64_t> after;
  if (m == 0 || n < 2) return {0, at::empty({0}, at::kLong)};
  const int32_t last = q[m - 1];
  const auto consider = [&](int64_t p) {  // p: a place holding the last token, if it still does
    if (p < n - 1 && c[p] == last && c[p + 1] != kSeparator) after.push_back(p + 1);
  };
  int64_t scan_from = 0;
  if (by_token.numel() > 0) {
    const int32_t* sorted = by_token.data_ptr<int32_t>();
    const int32_t* where = places.data_ptr<int32_t>();
    const auto [lo, hi] = std::equal_range(sorted, sorted + by_token.numel(), last);
    for (const int32_t* s = lo; s < hi; ++s) consider(where[s - sorted]);
    scan_from = indexed;
  }
  for (int64_t p = scan_from; p < n - 1; ++p)
    if (c[p] == last) consider(p);
  if (after.empty()) return {0, at::empty({0}, at::kLong)};
  // Each occurrence's agreement with the query before the last token, up to the longest match allowed.
  const int64_t limit = std::min(max_match, m) - 1;
  std::vector<int64_t> agree(after.size());
  int64_t best = 0;
  for (size_t i = 0; i < after.size(); ++i) {
    const int64_t end = after[i] - 1;  // the last token's place
    int64_t k = 0;
    while (k < limit && end - 1 - k >= 0 && c[end - 1 - k] == q[m - 2 - k]) ++k;
    agree[i] = k;
    best = std::max(best, k);
  }
  std::vector<int64_t> longest;
  for (size_t i = 0; i < after.size(); ++i)
    if (agree[i] == best) longest.push_back(after[i]);
  at::Tensor out = at::empty({static_cast<int64_t>(longest.size())}, at::kLong);
  std::copy(longest.begin(), longest.end(), out.data_ptr<int64_t>());
  return {best + 1, out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_cpu, m) {
  m.def("suffix_match(Tensor corpus, Tensor query, int max_match, Tensor places, Tensor by_token, int indexed) "
        "-> (int, Tensor)");
}

TORCH_LIBRARY_IMPL(specserve_cpu, CPU, m) { m.impl("suffix_match", &suffix_match); }
