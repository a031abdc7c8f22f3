// Similarity softmax shared by the CPU (csrc/similarity.cpp) and CUDA (cuda/similarity.cu) kernels: the metric
// codes, the layout of the per-segment statistics, and the double-precision step from statistics to weights.
#pragma once

#include <cmath>
#include <cstdint>

#include "half.h"  // PFK_HD

namespace pfk {

// Metric codes passed from Python: whole-vector L2 distance (the paper's eq. 5), the mean over segments of the
// distance between unit-normalised segments (the authors' code, the default), and the mean per-segment cosine.
enum SimilarityMetric : int { kMetricL2 = 0, kMetricLayerL2 = 1, kMetricLayerCos = 2 };

// Statistics of one segment: query_sq = Σ q², then for each of the K bank rows (dot = Σ q·b, bank_sq = Σ b²,
// diff_sq = Σ (q − b)²); the kernels fill diff_sq only for the l2 metric and dot, bank_sq only for the others.
// A segment's block has 1 + 3K doubles.
PFK_HD int64_t similarity_pitch(int64_t K) {
  return 1 + 3 * K;
}

// Score of bank row k from the statistics of the L included segments (block l at stats + l * pitch): the L2
// distance, the mean normalised-segment distance in [0, 2], or the mean cosine in [-1, 1]. A segment whose norm
// is <= eps counts as the zero vector: its normalised form is 0 (distance 1 to a unit segment, 0 to another zero
// segment; cosine 0).
PFK_HD double similarity_score(int metric, const double* stats, int64_t L, int64_t K, int64_t k, double eps) {
  const int64_t pitch = similarity_pitch(K);
  double total = 0.0;
  for (int64_t l = 0; l < L; ++l) {
    const double* s = stats + l * pitch;
    const double query_sq = s[0], dot = s[1 + 3 * k], bank_sq = s[2 + 3 * k], diff_sq = s[3 + 3 * k];
    if (metric == kMetricL2) {
      total += diff_sq;
      continue;
    }
    const double nq = sqrt(query_sq), nb = sqrt(bank_sq);
    const bool zero_q = !(nq > eps), zero_b = !(nb > eps);
    if (zero_q || zero_b) {  // a zero segment normalises to the zero vector
      total += metric == kMetricLayerL2 ? ((zero_q && zero_b) ? 0.0 : 1.0) : 0.0;
      continue;
    }
    const double cosine = fmin(fmax(dot / (nq * nb), -1.0), 1.0);
    // ‖q/|q| − b/|b|‖ = √(2 − 2·cos): the sums are in double, so nearly parallel segments keep ~8 digits
    total += metric == kMetricLayerL2 ? sqrt(fmax(2.0 - 2.0 * cosine, 0.0)) : cosine;
  }
  return metric == kMetricL2 ? sqrt(total) : total / static_cast<double>(L);
}

// alpha = softmax(scale · v) with v = −score for distances and +score for cosines, computed as
// exp(scale · (v_k − v_best)) so that no term overflows and a huge scale gives exact zeros, not inf − inf.
PFK_HD void similarity_softmax(int metric, const double* scores, int64_t K, double scale, double* alpha) {
  const double sign = metric == kMetricLayerCos ? 1.0 : -1.0;
  double best = sign * scores[0];
  for (int64_t k = 1; k < K; ++k) {
    const double v = sign * scores[k];
    best = scale >= 0.0 ? fmax(best, v) : fmin(best, v);
  }
  double sum = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    alpha[k] = exp(scale * (sign * scores[k] - best));
    sum += alpha[k];
  }
  for (int64_t k = 0; k < K; ++k) alpha[k] /= sum;
}

}  // namespace pfk
