// Types shared by the C++ (csrc/) and CUDA (cuda/) sides of pyfedkern._C. No pybind11 or CUDA headers here.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

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

// Raised for arguments the Python layer should have rejected; surfaces as ValueError.
struct ArgumentError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

}  // namespace pfk
