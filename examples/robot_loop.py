"""A robot's control loop against `dpa serve`: execute one action chunk while the next is
being computed, so the robot never stands still waiting for the server.

    dpa serve &                                   # the demo policy on 127.0.0.1:8700
    python examples/robot_loop.py --chunks 20

Diffusion Policy executes `n_action_steps` actions of each chunk at the control rate. Here,
when a chunk starts executing, the request for the next one is sent (in a background thread)
with the latest observation; it must arrive before the current chunk runs out. The loop
reports how often it did not (a stall: the robot held its last action), and after
LATE_CHUNKS_TO_WARN late chunks says once, on stderr, how long a chunk took against that
deadline and what to lower. The "robot" is a stand-in: it records the actions and makes up
observations; replace `Robot` with yours.
"""
import argparse
import concurrent.futures
import statistics
import sys
import time

import numpy as np

from diffusion_policy_accelerated.serving.client import PolicyClient

# Late chunks after which the loop says (once) what to change.
LATE_CHUNKS_TO_WARN = 3


class Robot:
    """Replace with your robot: `observe()` returns the policy's inputs, `apply(action)`
    commands one action."""

    def __init__(self, spec, seed=0):
        self.spec = spec
        self.rng = np.random.default_rng(seed)
        self.applied = 0

    def observe(self):
        return {name: self.rng.standard_normal(s.shape).astype(np.float32) for name, s in self.spec.inputs.items()}

    def apply(self, action):
        self.applied += 1


def timed_act(client, observation):
    """(the chunk, seconds from request to answer)."""
    start = time.perf_counter()
    chunk = client.act(observation)
    return chunk, time.perf_counter() - start


def too_slow_message(seconds, deadline, late, steps_per_chunk, hz):
    return (f"robot_loop: {late} chunks arrived late: a chunk took {1e3 * statistics.median(seconds):.0f} ms "
            f"(median) from request to answer, but it must come within {1e3 * deadline:.0f} ms, the time "
            f"{steps_per_chunk} actions take at {hz:g} Hz. Make the policy faster on the server, with fewer "
            f"denoising steps (dpa serve --steps 10) or DDIM (dpa serve --scheduler ddim --steps 16; the demo "
            f"serves DDPM-100), bfloat16 or a GPU; or give each chunk longer (--steps-per-chunk, a lower --hz).")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8700")
    parser.add_argument("--hz", type=float, default=10.0, help="control rate (actions per second)")
    parser.add_argument("--steps-per-chunk", type=int, default=8, help="actions executed from each chunk")
    parser.add_argument("--chunks", type=int, default=20, help="chunks to execute, then stop")
    args = parser.parse_args(argv)

    client = PolicyClient(args.url, timeout=5.0)
    client.wait_ready(timeout=600)
    robot = Robot(client.spec)
    period = 1.0 / args.hz
    deadline = args.steps_per_chunk * period  # a chunk is requested as the one before it starts
    stalls, round_trips, warned = 0, [], False
    with concurrent.futures.ThreadPoolExecutor(1) as requester:
        chunk = client.act(robot.observe())
        for i in range(args.chunks):
            following = requester.submit(timed_act, client, robot.observe()) if i + 1 < args.chunks else None
            for action in chunk[:args.steps_per_chunk]:
                tick = time.perf_counter()
                robot.apply(action)
                time.sleep(max(0.0, period - (time.perf_counter() - tick)))
            if following is not None:
                stalls += not following.done()
                chunk, seconds = following.result()
                round_trips.append(seconds)
                if stalls >= LATE_CHUNKS_TO_WARN and not warned:
                    warned = True
                    print(too_slow_message(round_trips, deadline, stalls, args.steps_per_chunk, args.hz),
                          file=sys.stderr, flush=True)
                print(f"chunk {i + 2} computed in {client.last_timings.get('server_ms', float('nan')):.1f} ms on the "
                      f"server (in a batch of {client.last_timings.get('batch_rows', 1):.0f})", flush=True)
    client.close()
    print(f"{robot.applied} actions in {args.chunks} chunks; {stalls} chunks arrived late")


if __name__ == "__main__":
    main()
