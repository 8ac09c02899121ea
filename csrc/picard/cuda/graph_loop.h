// A loop inside a CUDA graph: a conditional WHILE node (CUDA 12.4+) whose body graph is
// captured from PyTorch code like any other graph, so that a loop whose trip count the GPU
// decides (Picard iterations until every window converged) runs in one replay, without a host
// round trip per iteration. torch.cuda.graph has no such node; these open one in the capture
// under way on the current stream.
#pragma once

#include <cstdint>
#include <tuple>

namespace dpa {

// Whether this build and the driver can capture graph loops (else callers unroll a budget).
bool graph_loops_supported();

// Opens a WHILE node at the current point of the capture under way on the current stream:
// from here until end_graph_loop, work on the current stream (which becomes a stream of the
// loop's own) is captured into the loop's body, allocating from the memory pool `pool`
// (torch.cuda.graph_pool_handle(): a pool of the body's own, since the capture's pool takes
// only the capture's stream; it must outlive the graph, then release_graph_pool). The body
// runs once, then again while its last condition setter (picard_update's
// `conditional_handle`) set nonzero. Returns the node's condition handle. Loops do not nest.
int64_t begin_graph_loop(std::tuple<int64_t, int64_t> pool);

// Ends the body's capture; the outer capture goes on, after the loop, on the stream it had.
void end_graph_loop();

// Gives a loop body's pool back to the allocator once its graph is gone.
void release_graph_pool(int64_t device, std::tuple<int64_t, int64_t> pool);

}  // namespace dpa
