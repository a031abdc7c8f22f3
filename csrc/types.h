// Types shared by the C++ (csrc/) and CUDA (cuda/) sides of pyfedkern._C. No pybind11 or CUDA headers here.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace pfk {

// Element types crossing the Python boundary; the Python layer passes the name, the kernels switch on it.
enum class DType : int { F32 = 0, F64 = 1, F16 = 2, BF16 = 3 };

DType dtype_from_name(const std::string& name);  // "float32" | "float64" | "float16" | "bfloat16"
const char* dtype_name(DType dt);

// One input vector of a weighted sum: element i lives at ptr + i * stride (stride in elements, may be
// negative).
struct WeightedRow {
  const void* ptr;
  int64_t stride;
  double weight;
};

// One row of a row set: element j lives at ptr + j * stride (stride in elements, may be negative or 0).
struct RowRef {
  const void* ptr;
  int64_t stride;
};

// The rows the Python layer hands over: a list (one pointer and stride per row, `ptrs`/`strides`) or, when `ptrs`
// is empty, `count` rows of a stack, row r at byte address base + r * step_bytes with element stride col_stride.
std::vector<RowRef> make_rows(const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& strides, uintptr_t base,
                              int64_t step_bytes, int64_t count, int64_t col_stride);

// Device scratch the Python layer allocated with the caller's library (null/0 when none was given). A CUDA op that
// needs more returns the byte count without launching anything, and the Python layer calls again with it.
struct Scratch {
  void* ptr = nullptr;
  size_t bytes = 0;
};

inline Scratch as_scratch(uintptr_t ptr, size_t bytes) {
  return {reinterpret_cast<void*>(ptr), bytes};
}

// Raised for arguments the Python layer should have rejected; surfaces as ValueError.
struct ArgumentError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

}  // namespace pfk
