#include "common/kernel_config.h"

#include <c10/util/Exception.h>

#include <mutex>
#include <optional>

namespace dpa {

namespace {

std::mutex default_mutex;
std::optional<KernelConfig> process_default;
thread_local std::optional<KernelConfig> thread_override;
// A copy per thread of the default it last read, so that a launch reads no shared state
// while another thread sets the default.
thread_local KernelConfig default_seen;

}  // namespace

const std::vector<std::string>& cpu_conv_names() {
  static const std::vector<std::string> names{"auto", "aten", "gemm", "stream", "fp32"};
  return names;
}

const std::vector<KernelConfigField>& kernel_config_fields() {
  using K = KernelConfig;
  static const std::vector<KernelConfigField> fields{
      {"gemm_min_positions", &K::gemm_min_positions, nullptr},
      {"gemm_min_work", &K::gemm_min_work, nullptr},
      {"gemm_min_work_positions", &K::gemm_min_work_positions, nullptr},
      {"portable_half_gemm_min_positions", &K::portable_half_gemm_min_positions, nullptr},
      {"transposed_gemm_min_work", &K::transposed_gemm_min_work, nullptr},
      {"side_stream", nullptr, &K::side_stream},
      {"side_stream_fp32_max_positions", &K::side_stream_fp32_max_positions, nullptr},
      {"fp32_gemm_max_splits", &K::fp32_gemm_max_splits, nullptr},
      {"narrow_gemm", nullptr, &K::narrow_gemm},
      {"clusters", nullptr, &K::clusters},
      {"pdl", nullptr, &K::pdl},
      {"cooperative_group_norm", nullptr, &K::cooperative_group_norm},
      {"weights_evict_first", nullptr, &K::weights_evict_first},
      {"taps_major_min_in_channels", &K::taps_major_min_in_channels, nullptr},
      {"taps_major_min_work", &K::taps_major_min_work, nullptr},
      {"taps_major_min_work_batch_1", &K::taps_major_min_work_batch_1, nullptr},
      {"sm_count", &K::sm_count, nullptr},
  };
  return fields;
}

const KernelConfig& kernel_config() {
  if (thread_override.has_value()) return *thread_override;
  const std::lock_guard<std::mutex> lock(default_mutex);
  TORCH_CHECK(process_default.has_value(),
              "diffusion_policy_accelerated: the kernel configuration is not set; load the ops "
              "through `import diffusion_policy_accelerated.ops`, not the _C module alone");
  default_seen = *process_default;
  return default_seen;
}

void set_default_kernel_config(const KernelConfig& config) {
  const std::lock_guard<std::mutex> lock(default_mutex);
  process_default = config;
}

void set_thread_kernel_config(const KernelConfig* config) {
  if (config == nullptr) {
    thread_override.reset();
  } else {
    thread_override = *config;
  }
}

}  // namespace dpa
