// The CPU aggregation kernel, shared with other op families (similarity_combine's blend pass).
#pragma once

#include <cstdint>
#include <vector>

#include "types.h"

namespace pfk {

// out = (accumulate ? out : 0) + sum_k rows[k].weight * rows[k] over d elements of `dtype` (strides in elements);
// every row is read, so drop zero-weight rows first. Fixed summation order (row 0, 1, ...) for every element.
void weighted_sum_cpu(DType dtype, int64_t d, void* out, int64_t out_stride, const std::vector<WeightedRow>& rows,
                      bool accumulate);

}  // namespace pfk
