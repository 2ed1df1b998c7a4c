// The n-gram matchers of infer/spec/ngram.py as scalar C++ (`native_matchers`), compiled into
// quantspec's CPU extension.

#include "cpu.h"

#include <algorithm>
#include <tuple>

// ---- n-gram drafting (spec/ngram.py's matchers, scalar) ---------------------------------------
//
// `propose_ngram_match` and `realigned_match` of infer/spec/ngram.py (their docstrings define
// them; the numpy versions are the reference and the fallback), as one scalar pass each. In the
// engine the drafter runs right after a forward that streamed the weights through every cache,
// where one call here touches only the token array and a few lines of code.

namespace {

// how many j = 0, 1, ... (< cap) have t[at - j] == t[src - j] consecutively (src < at; 0 if src < 0)
inline int64_t agreeing_run(const int64_t* t, int64_t at, int64_t src, int64_t cap) {
  int64_t j = 0;
  while (j < cap && src - j >= 0 && t[at - j] == t[src - j]) ++j;
  return j;
}

// ngram.py's `_continuation`: the up to cap tokens after position end, cycled through the last p
// tokens where the sequence already repeats them
std::vector<int64_t> continuation(const int64_t* t, int64_t L, int64_t end, int64_t cap) {
  const int64_t p = L - 1 - end, q = std::max<int64_t>(p, 2);
  const int64_t n = std::min(cap, p);
  std::vector<int64_t> out(t + end + 1, t + end + 1 + n);
  if (n < cap && p > 0 && p + q <= L && std::equal(t + L - q, t + L, t + L - q - p))
    for (int64_t i = n; i < cap; ++i) out.push_back(t[end + 1 + i % p]);
  return out;
}

// the sequence: the first L elements of `tokens` (a buffer the proposer grows)
const int64_t* token_ptr(const at::Tensor& tokens, int64_t L, const char* op) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.is_contiguous() &&
              tokens.device().is_cpu(), op, ": tokens must be a contiguous 1-D int64 CPU tensor");
  TORCH_CHECK(L >= 0 && L <= tokens.size(0), op, ": length must be in [0, tokens.numel()]");
  return tokens.data_ptr<int64_t>();
}

}  // namespace

// → (draft, agreement) for the sequence tokens[:L]; the caller checks the sizes (ngram.py's _check_sizes).
// An occurrence followed by one of `stop` (end-of-sequence ids) is no candidate.
std::tuple<std::vector<int64_t>, int64_t> ngram_match(const at::Tensor& tokens, int64_t L, int64_t max_ngram,
                                                      int64_t cap, int64_t min_ngram, int64_t tie_context,
                                                      int64_t agreement_cap, const std::vector<int64_t>& stop) {
  const int64_t* t = token_ptr(tokens, L, "ngram_match");
  const int64_t max_n = std::min(max_ngram, L - 1);
  if (cap == 0 || max_n < min_ngram) return {std::vector<int64_t>(), 0};
  // each occurrence e of the last token: its agreement m(e) with the suffix, counted up to jmax
  // (the tie-break's reach); the chosen one has the largest m, ties → the latest e. That is the
  // longest-first search (the latest of the longest matches up to max_n tokens) and, where
  // several reach max_n, its tie-break over the context before them, in one pass
  const int64_t jmax = std::min(max_n + tie_context, L - 1);
  int64_t best_m = 0, best_end = -1;
  for (int64_t e = 0; e < L - 1; ++e) {
    if (t[e] != t[L - 1] || std::find(stop.begin(), stop.end(), t[e + 1]) != stop.end()) continue;
    const int64_t m = agreeing_run(t, L - 1, e, jmax);
    if (m >= best_m) best_m = m, best_end = e;
  }
  const int64_t best_n = std::min(best_m, max_n);
  if (best_n < min_ngram || best_end < 0) return {std::vector<int64_t>(), 0};
  int64_t agreement = best_n;
  while (agreement < agreement_cap && agreement <= best_end && t[best_end - agreement] == t[L - 1 - agreement])
    ++agreement;
  return {continuation(t, L, best_end, cap), agreement};
}

// → (draft, matched): `realigned_match` of tokens[:L], with its constants
std::tuple<std::vector<int64_t>, int64_t> realigned_match(const at::Tensor& tokens, int64_t L, int64_t cap,
                                                          int64_t max_gap, int64_t context, double gap_penalty,
                                                          int64_t candidates) {
  const int64_t* t = token_ptr(tokens, L, "realigned_match");
  if (cap == 0 || L < 2) return {std::vector<int64_t>(), 0};
  std::vector<int64_t> ends;  // the latest `candidates` occurrences of the last token, ascending
  for (int64_t e = L - 2; e >= 0 && static_cast<int64_t>(ends.size()) < candidates; --e)
    if (t[e] == t[L - 1]) ends.push_back(e);
  if (ends.empty()) return {std::vector<int64_t>(), 0};
  std::reverse(ends.begin(), ends.end());
  double best_score = -1.0;
  int64_t best_e = -1, best_matched = 0;
  for (const int64_t e : ends) {
    const int64_t a = agreeing_run(t, L - 1, e, context);
    double gain = 0.0;
    int64_t b_used = 0;
    for (int64_t go = 0; go <= max_gap; ++go)
      for (int64_t gs = 0; gs <= max_gap; ++gs) {
        if (go == 0 && gs == 0) continue;
        const int64_t at = L - 1 - a - go, src = e - a - gs;
        const int64_t b = src < at ? agreeing_run(t, at, src, context) : 0;
        const double g = static_cast<double>(b) - gap_penalty * static_cast<double>(go + gs);
        if (g > gain) gain = g, b_used = b;  // the first gap of the largest gain
      }
    const double score = static_cast<double>(a) + gain;
    if (score >= best_score) best_score = score, best_e = e, best_matched = a + b_used;  // ties → the latest
  }
  return {continuation(t, L, best_e, cap), best_matched};
}

static qs_bind::Register bind_ngram([](pybind11::module_& m) {
  m.def("ngram_match", &ngram_match, py::arg("tokens"), py::arg("L"), py::arg("max_ngram"), py::arg("cap"),
        py::arg("min_ngram"), py::arg("tie_context"), py::arg("agreement_cap"),
        py::arg("stop") = std::vector<int64_t>(), py::call_guard<py::gil_scoped_release>());
  m.def("realigned_match", &realigned_match, py::call_guard<py::gil_scoped_release>());
});
