// Process-wide settings and build information of pyfedkern._C.
#include <thread>

#include "bindings.h"
#include "build_config.h"
#include "cuda_launchers.h"
#include "parallel.h"
#include "types.h"

namespace pfk {

DType dtype_from_name(const std::string& name) {
  if (name == "float32") return DType::F32;
  if (name == "float64") return DType::F64;
  if (name == "float16") return DType::F16;
  if (name == "bfloat16") return DType::BF16;
  throw ArgumentError("unsupported dtype '" + name + "' (expected float32, float64, float16 or bfloat16)");
}

std::vector<RowRef> make_rows(const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& strides, uintptr_t base,
                              int64_t step_bytes, int64_t count, int64_t col_stride) {
  std::vector<RowRef> rows;
  if (!ptrs.empty()) {
    if (ptrs.size() != strides.size()) throw ArgumentError("row pointers and strides must have the same length");
    rows.reserve(ptrs.size());
    for (size_t k = 0; k < ptrs.size(); ++k) {
      if (ptrs[k] == 0) throw ArgumentError("row pointer is null");
      rows.push_back({reinterpret_cast<const void*>(ptrs[k]), strides[k]});
    }
    return rows;
  }
  if (count < 0) throw ArgumentError("negative row count");
  if (count > 0 && base == 0) throw ArgumentError("row stack pointer is null");
  rows.reserve(static_cast<size_t>(count));
  for (int64_t r = 0; r < count; ++r)
    rows.push_back({reinterpret_cast<const void*>(base + r * step_bytes), col_stride});
  return rows;
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F32:
      return "float32";
    case DType::F64:
      return "float64";
    case DType::F16:
      return "float16";
    case DType::BF16:
      return "bfloat16";
  }
  return "unknown";
}

void bind_runtime(py::module_& m) {
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
  m.def("get_num_threads", &num_threads);
  m.def("cuda_device_count", &cuda::device_count,
        "Number of usable CUDA devices now (0 without a CUDA build, a driver or a GPU).");
  m.def("build_info", []() {
    py::dict info;
#ifdef PYFEDKERN_WITH_CUDA
    info["cuda"] = true;
    info["cuda_archs"] = std::string(PYFEDKERN_CUDA_ARCHS);
    info["cuda_compiler"] = std::string(PYFEDKERN_CUDA_COMPILER);
    info["cuda_runtime_version"] = cuda::runtime_version();
#else
    info["cuda"] = false;
    info["cuda_archs"] = std::string();
#endif
    info["max_threads"] = default_num_threads();
    info["hardware_concurrency"] = static_cast<int>(std::thread::hardware_concurrency());
    info["compiler"] = std::string(PYFEDKERN_CXX_COMPILER);
    info["pybind11"] = std::to_string(PYBIND11_VERSION_MAJOR) + "." + std::to_string(PYBIND11_VERSION_MINOR) + "." +
                       std::to_string(PYBIND11_VERSION_PATCH);
    return info;
  });
}

}  // namespace pfk
