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
