#include "conv1d/cpu/lanes.h"

#include <cstdlib>

namespace dpa {
namespace cpu {

int widest_lanes() {
  static const int lanes = [] {
    const char* asked = std::getenv("DPA_CPU_VECTOR_LANES");
    const int most = asked ? std::atoi(asked) : 16;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (most >= 16 && __builtin_cpu_supports("avx512f")) return 16;
    if (most >= 8 && __builtin_cpu_supports("avx2")) return 8;
#else
    (void)most;  // 4 lanes (NEON) is the widest elsewhere
#endif
    return 4;
  }();
  return lanes;
}

bool bf16_dot_product() {
  static const bool has = [] {
    const char* asked = std::getenv("DPA_CPU_VECTOR_LANES");
#if defined(__x86_64__)
    __builtin_cpu_init();
    return (!asked || std::atoi(asked) > 16) && widest_lanes() >= 16 && __builtin_cpu_supports("avx512bf16");
#else
    (void)asked;
    return false;
#endif
  }();
  return has;
}

}  // namespace cpu
}  // namespace dpa
