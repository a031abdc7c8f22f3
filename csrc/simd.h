// Run-time choice of the widest vector ISA this CPU supports. A kernel body is written once as a template
// with PFK_ALWAYS_INLINE and instantiated under each target by PFK_ISA_DISPATCH; the build uses
// -ffp-contract=off, so every path rounds identically and results do not depend on the CPU.
#pragma once

#define PFK_ALWAYS_INLINE inline __attribute__((always_inline))
#define PFK_COMMA ,  // a comma inside a macro argument (template parameter lists)

namespace pfk {

enum class Isa { Baseline, Avx2, Avx512 };

inline Isa cpu_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const Isa isa = __builtin_cpu_supports("avx512f") ? Isa::Avx512
                         : __builtin_cpu_supports("avx2")  ? Isa::Avx2
                                                           : Isa::Baseline;
  return isa;
#else
  return Isa::Baseline;
#endif
}

}  // namespace pfk

// Defines the function template `name<targs>(params)` that calls `body<targs>(args)` compiled for the best
// ISA. Usage: PFK_ISA_DISPATCH(template <typename T>, <T>, void, tile, (int n, T* p), (n, p), tile_body)
#if defined(__x86_64__) && defined(__GNUC__)
#define PFK_ISA_DISPATCH(tmpl, targs, ret, name, params, args, body)                        \
  tmpl __attribute__((target("avx512f,avx512bw,avx512vl,avx2"))) ret name##_avx512 params { \
    return body targs args;                                                                 \
  }                                                                                         \
  tmpl __attribute__((target("avx2"))) ret name##_avx2 params {                             \
    return body targs args;                                                                 \
  }                                                                                         \
  tmpl ret name##_baseline params {                                                         \
    return body targs args;                                                                 \
  }                                                                                         \
  tmpl ret name params {                                                                    \
    switch (::pfk::cpu_isa()) {                                                             \
      case ::pfk::Isa::Avx512:                                                              \
        return name##_avx512 targs args;                                                    \
      case ::pfk::Isa::Avx2:                                                                \
        return name##_avx2 targs args;                                                      \
      default:                                                                              \
        return name##_baseline targs args;                                                  \
    }                                                                                       \
  }
#else
#define PFK_ISA_DISPATCH(tmpl, targs, ret, name, params, args, body) \
  tmpl ret name params {                                             \
    return body targs args;                                          \
  }
#endif
