// Running the streaming kernels (conv_params.h): each call plans its launch for the current
// device (launch_plan.h), and launches on the current stream.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "conv1d/conv1d.h"
#include "conv1d/cuda/conv_params.h"

namespace dpa {

// Runs problem a (p's sizes) on a streaming kernel: a cluster kernel where its plan fits,
// else split-K with `counters` (the caller's zeros, or null for fresh ones) and a workspace.
void run_streaming(StreamArgs& a, const ConvProblem& p, const at::Tensor& x, const at::Tensor& weight,
                   int* counters);

// Two Conv1d problems on the same input and positions (a and b, weights wa and wb: a
// residual block's first conv and its 1x1 shortcut) in one launch where their plans allow.
// `counters`: a's then b's, or null for fresh zeros.
void run_streaming_pair(StreamArgs& a, StreamArgs& b, const ConvProblem& pa, const ConvProblem& pb,
                        const at::Tensor& x, const at::Tensor& wa, const at::Tensor& wb, int* counters);

// Traces the streaming launches made (or captured) on any thread from start to stop, for
// measurement (scripts/dev/trace_conv.py): each launch's blocks stamp the global timer at the
// points TraceEvent lists, into the next rows of `buffer` (a CUDA int64 tensor
// [rows, kTraceEvents], zeros where a block does not get there), one row per block, launch
// after launch. stop returns the number of blocks (rows) of each launch traced, in order.
void start_launch_trace(const at::Tensor& buffer);
std::vector<int64_t> stop_launch_trace();

}  // namespace dpa
