#include "conv1d/conv_route.h"

#include <algorithm>
#include <limits>

namespace dpa {

namespace {

int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t work(const ConvShape& s) { return s.in_channels * s.out_channels * s.kernel_size * gemm_positions(s); }

// The work threshold below gemm_min_positions that applies to s: its name and value.
std::pair<const char*, int64_t> min_work(const ConvShape& s, const KernelConfig& c) {
  if (s.transposed) return {"transposed_gemm_min_work", c.transposed_gemm_min_work};
  return {"gemm_min_work", c.gemm_min_work};
}

std::string str(int64_t v) { return std::to_string(v); }

ConvShape contiguous(ConvShape s) {
  s.taps_major = false;
  return s;
}

}  // namespace

int narrow_block_positions(int64_t positions) { return positions <= 16 ? 16 : kNarrowMaxPositions; }

int narrow_stages(int64_t positions, int64_t smem_optin) {
  // A stage holds a chunk of the columns (the block's positions, padded by 4), and of each
  // warp's weight rows. The most stages up to 4 (3 in flight while one is read); fewer than
  // 3 would leave no copy in flight behind the one awaited, and a block of 32 positions takes
  // 4 (the one width measured).
  const int width = narrow_block_positions(positions);
  const int64_t stage_bytes = int64_t{kNarrowChunk} * (width + 4 + kNarrowRows) * 4;
  const int most = static_cast<int>(std::min<int64_t>(smem_optin / stage_bytes, 4));
  return most >= (width == 16 ? 3 : 4) ? most : 0;
}

int64_t gemm_positions(const ConvShape& s) { return s.batch * (s.transposed ? s.in_length : s.out_length); }

bool portable_launches(const KernelConfig& c, const RouteDevice& d) {
  return !(c.clusters || c.pdl) || d.major < 9 || !d.hopper_code;
}

bool takes_gemm_route(const ConvShape& s, const KernelConfig& c, const RouteDevice& d, std::string* why) {
  const int64_t positions = gemm_positions(s);
  const auto [work_name, work_min] = min_work(s, c);
  const auto say = [&](std::string text) {
    if (why != nullptr) *why = std::move(text);
  };
  if (positions >= c.gemm_min_positions) {
    say("batch x length " + str(positions) + " >= gemm_min_positions " + str(c.gemm_min_positions));
    return true;
  }
  if (positions >= c.gemm_min_work_positions && work(s) >= work_min) {
    say("batch x length " + str(positions) + " >= gemm_min_work_positions " + str(c.gemm_min_work_positions) +
        " and multiply-adds " + str(work(s)) + " >= " + work_name + " " + str(work_min));
    return true;
  }
  if (s.half && positions >= c.portable_half_gemm_min_positions && portable_launches(c, d)) {
    say("half precision without Hopper's clusters and programmatic dependent launch, batch x length " +
        str(positions) + " >= portable_half_gemm_min_positions " + str(c.portable_half_gemm_min_positions));
    return true;
  }
  if (s.taps_major && !s.transposed && s.kernel_size > 1) {
    say("half precision, 8+ positions at batch 2+ (16+ at batch 1) and C_in x C_out x positions >= " +
        str(c.taps_major_min_work) + " (at batch 1 from 8 positions: >= " + str(c.taps_major_min_work_batch_1) +
        "): a taps-major weight");
    return true;
  }
  say("batch x length " + str(positions) + " < gemm_min_positions " + str(c.gemm_min_positions) + ", " +
      (positions >= c.gemm_min_work_positions
           ? "multiply-adds " + str(work(s)) + " < " + work_name + " " + str(work_min)
           : "< gemm_min_work_positions " + str(c.gemm_min_work_positions)));
  return false;
}

bool taps_major_pays(const ConvShape& s, const KernelConfig& c, const RouteDevice& d) {
  if (!s.half || s.transposed || s.kernel_size == 1 || s.in_channels < c.taps_major_min_in_channels) return false;
  const int64_t positions = s.batch * s.out_length, elements = s.in_channels * s.out_channels * positions;
  if (s.batch == 1 && positions >= 8 && elements >= c.taps_major_min_work_batch_1) return true;
  return takes_gemm_route(contiguous(s), c, d) ||
         (positions >= (s.batch >= 2 ? 8 : 16) && elements >= c.taps_major_min_work);
}

GemmForm gemm_form(const ConvShape& s) {
  if (s.transposed) return GemmForm::kTransposed;
  return s.taps_major && s.kernel_size > 1 ? GemmForm::kTapRows : GemmForm::kIm2col;
}

int cublas_splits(int64_t m, int64_t red, int64_t positions, const KernelConfig& c, const RouteDevice& d) {
  // cuBLAS's SIMT SGEMM tile at these shapes; the shortest slice worth a split; the fewest
  // splits worth one (2 slices took 1.5-3x as long as the whole GEMM).
  constexpr int64_t kTileRows = 128, kTileColumns = 32, kMinDepth = 128, kFewest = 8;
  const int64_t tiles = ceil_div64(m, kTileRows) * ceil_div64(positions, kTileColumns);
  int64_t most = 2 * d.sms / tiles;
  if (most < kFewest && kFewest * tiles <= 4 * d.sms) most = kFewest;
  most = std::min<int64_t>(most, c.fp32_gemm_max_splits);
  int splits = 1;
  while (2 * splits <= most && red % (2 * splits) == 0 && red / (2 * splits) >= kMinDepth) splits *= 2;
  return splits >= kFewest ? splits : 1;
}

int narrow_splits(int64_t m, int64_t red, int64_t positions, bool beside_cublas, const KernelConfig& c,
                  const RouteDevice& d) {
  if (!c.narrow_gemm || d.major < 8 || positions > kNarrowMaxPositions ||
      (positions > 16 && (beside_cublas || m * red > kNarrowWideMaxWeights))) {
    return 0;
  }
  if (red % 4 != 0 || positions % 4 != 0 || narrow_stages(positions, d.smem_optin) == 0) return 0;
  const int64_t row_tiles = ceil_div64(m, kNarrowRows), chunks = ceil_div64(red, kNarrowChunk);
  const int64_t wanted = std::clamp<int64_t>(d.sms / row_tiles, 1, chunks);
  return static_cast<int>(ceil_div64(chunks, ceil_div64(chunks, wanted)));  // none empty
}

bool shortcut_on_side_stream(bool half, int64_t positions, const KernelConfig& c) {
  return c.side_stream && (half || positions < c.side_stream_fp32_max_positions);
}

ConvShape BlockShape::first() const {
  return ConvShape{batch, in_channels, out_channels, length, length, kernel_size, false, half, false};
}
ConvShape BlockShape::second() const {
  return ConvShape{batch, out_channels, out_channels, length, length, kernel_size, false, half, false};
}
ConvShape BlockShape::shortcut() const {
  return ConvShape{batch, in_channels, out_channels, length, length, 1, false, half, false};
}

bool block_op_pays(const BlockShape& b, const KernelConfig& c, const RouteDevice& d) {
  const auto gemm = [&](const ConvShape& s) { return takes_gemm_route(s, c, d) || taps_major_pays(s, c, d); };
  return gemm(b.first()) && gemm(b.second());
}

bool block_fused(const ConvShape& first, const ConvShape& second, int64_t groups, const KernelConfig& c,
                 const RouteDevice& d) {
  return takes_gemm_route(first, c, d) && takes_gemm_route(second, c, d) &&
         (group_held(first.out_channels / groups, first.out_length) ||
          (gemm_form(second) == GemmForm::kTapRows && second.batch > 1));
}

namespace {

// The CPU's route of a conv: timed at its shape's first call (cpu/conv_route_cpu.cpp), or fixed.
RouteAnswer cpu_route(const ConvShape& s, bool group_norm, bool bf16, const KernelConfig& c) {
  const bool streams = !s.half || bf16;  // the streaming GEMM has fp32 and bf16
  const std::string conv = s.transposed ? "transposed conv" : "conv";
  std::string operands = ", in the input's dtype";
  if (c.cpu_conv == CpuConv::kAuto && s.half) operands += " or on fp32 copies of its operands";
  if (c.cpu_conv == CpuConv::kFloat) operands = s.half ? " on fp32 copies of its operands" : ", in fp32";
  std::string how;
  switch (c.cpu_conv) {
    case CpuConv::kFloat: how = "ATen's " + conv + " (cpu_conv 'fp32')"; break;
    case CpuConv::kAuto:
      how = (s.transposed ? "ATen's transposed conv or (up to " : "ATen's conv, one GEMM or (up to ") +
            str(kCpuStreamMaxPositions) + " positions) the weight-streaming GEMM, whichever was fastest at this " +
            "shape's first call (cpu_conv 'auto')";
      break;
    case CpuConv::kAten: how = "ATen's " + conv + " (cpu_conv 'aten')"; break;
    case CpuConv::kGemm: how = s.transposed ? "ATen's transposed conv (cpu_conv 'gemm')" : "im2col + one GEMM (cpu_conv 'gemm')"; break;
    case CpuConv::kStream:
      how = !streams ? "ATen's " + conv + " (cpu_conv 'stream' has no fp16)"
            : s.transposed ? "the weight-streaming GEMM (cpu_conv 'stream')"
                           : "im2col + the weight-streaming GEMM (cpu_conv 'stream')";
      break;
  }
  return RouteAnswer{"CPU", how + operands + (group_norm ? ", then the fused epilogue" : "")};
}

// The GEMM route's answer for s: `route` with the GEMM's kernel and slices where it is the
// narrow GEMM or cut (fp32, im2col form only).
RouteAnswer gemm_answer(std::string route, std::string why, const ConvShape& s, bool narrow, bool beside_cublas,
                        const KernelConfig& c, const RouteDevice& d) {
  RouteAnswer answer{std::move(route), std::move(why)};
  if (s.half || gemm_form(s) != GemmForm::kIm2col) return answer;
  const int64_t m = s.out_channels, red = s.in_channels * s.kernel_size, positions = gemm_positions(s);
  answer.narrow_splits = narrow ? narrow_splits(m, red, positions, beside_cublas, c, d) : 0;
  if (answer.narrow_splits > 0) {
    answer.route += ", narrow GEMM" + (answer.narrow_splits > 1 ? ", " + str(answer.narrow_splits) + " slices" : "");
    return answer;
  }
  answer.cublas_splits = cublas_splits(m, red, positions, c, d);
  if (answer.cublas_splits > 1) answer.route += ", " + str(answer.cublas_splits) + " slices";
  return answer;
}

}  // namespace

RouteAnswer describe_route(const ConvShape& shape, int64_t groups, BlockRole role, const BlockShape& block, bool cuda,
                           const KernelConfig& c, const RouteDevice& d, bool bf16) {
  const bool group_norm = groups > 0;
  if (!cuda) return cpu_route(shape, group_norm, bf16, c);
  ConvShape s = contiguous(shape);
  const int64_t positions = gemm_positions(s);
  const bool taps = group_norm && taps_major_pays(s, c, d);
  const bool has_shortcut = role != BlockRole::kNone && block.in_channels != block.out_channels;
  const bool paired = has_shortcut && (role == BlockRole::kFirst || role == BlockRole::kShortcut);
  const ConvShape first = block.first();
  const bool side = has_shortcut && shortcut_on_side_stream(s.half, positions, c);
  const bool first_narrow =
      !s.half && narrow_splits(first.out_channels, first.in_channels * first.kernel_size, positions, false, c, d) > 0;
  const bool beside_cublas = paired && role == BlockRole::kShortcut && side && !first_narrow;
  ConvShape sized = s;  // the conv whose size decides the route
  bool taps_here = taps;
  if (role != BlockRole::kNone) {
    if (block_op_pays(block, c, d)) {
      const int64_t group = block.out_channels / block.groups * block.length;
      ConvShape fused_first = first, fused_second = block.second();
      fused_first.taps_major = taps_major_pays(fused_first, c, d);
      fused_second.taps_major = taps_major_pays(fused_second, c, d);
      if (block_fused(fused_first, fused_second, block.groups, c, d)) {
        const std::string why = "its residual block runs as one op on the GEMM route";
        if (taps) return RouteAnswer{"GEMM, block op, taps-major", why};
        if (role == BlockRole::kShortcut) return RouteAnswer{"GEMM, block op", why};
        return gemm_answer("GEMM, block op", why, s, role != BlockRole::kSecond, role == BlockRole::kFirst && side,
                           c, d);
      }
      std::string why;
      if (role == BlockRole::kShortcut) {
        ConvShape f = first;
        f.taps_major = taps_major_pays(first, c, d);
        takes_gemm_route(f, c, d, &why);
        why = "as its block's first conv, " + why;
      } else {
        s.taps_major = taps;
        takes_gemm_route(s, c, d, &why);
      }
      why += "; its residual block's op runs per conv: a GroupNorm group of " + str(group) +
             " elements is more than the fused epilogue holds (" + str(kHeldPerThread * kThreads) +
             "), at batch 1 or with a second conv whose weight is not taps-major";
      if (taps) return RouteAnswer{"GEMM, taps-major", why};
      return gemm_answer("GEMM", why, s, true, beside_cublas, c, d);
    }
    taps_here = taps && !paired;
    if (paired) sized = first;
  }
  sized.taps_major = taps_here && !paired;
  std::string why;
  if (takes_gemm_route(sized, c, d, &why)) {
    if (paired) why += "; with the block's first conv, in one op";
    if (taps_here) return RouteAnswer{"GEMM, taps-major", why};
    return gemm_answer("GEMM", why, s, true, beside_cublas, c, d);
  }
  const std::string plan = c.clusters ? "Hopper: clusters where they fit, else split-K" : "split-K (clusters off)";
  return RouteAnswer{std::string("streaming") + (paired ? ", paired" : ""),
                     why + "; " + plan + (paired ? "; the block's first conv and shortcut in one launch" : "")};
}

}  // namespace dpa
