"""The wire format of `dpa serve` (and of its Ray Serve deployment): HTTP with safetensors bodies.

Why HTTP and safetensors: a robot, a simulator or a shell can call it with any HTTP library
(or curl), Ray Serve's ingress is HTTP, so one client speaks to both servers, and a
safetensors body is typed binary tensors (a JSON header of dtype, shape and offsets, then
the raw bytes) that every language reads and that cannot carry code. Nothing a client sends
is ever unpickled.

    GET  /v1/spec   JSON: the inputs (name -> shape of ONE observation, dtype: float32, or
                    uint8 for camera frames [n_obs_steps, C, H, W]), the action's
                    shape, max_rows, max_request_bytes and the policy's settings.
    POST /v1/act    body: safetensors of exactly the spec's inputs, each either one
                    observation (the spec's shape) or n of them ([n, *shape], the same n for
                    every input: a simulator's environments in one request); optional
                    metadata {"seed": "<int>"} fixes the noise of those n rows. A camera
                    input may come as JPEG instead: its tensor then holds the frames' JPEG
                    files end to end (uint8, 1-D) and metadata {"jpeg": JSON {input: lengths}}
                    gives each file's byte length, nested like the frames ([n_obs_steps], or
                    [n, n_obs_steps]); the server decodes them (jpeg.py) and checks each
                    frame's [C, H, W] against the spec.
                    200: safetensors {"action": [Ta, Da] or [n, Ta, Da]}, metadata with the
                    server's timings (also in the Server-Timing header).
                    4xx/5xx: JSON {"error": "..."}; 503 (overloaded, warming up, shutting
                    down) carries Retry-After and is safe to retry. 422: NaN or Inf in an
                    input (named) or in the actions computed for the request, which are not
                    sent (the server's non-finite guard, on unless `dpa serve --no-check-finite`).
    GET  /health    200 {"status": "ok", ...} when serving, 503 while warming up or stopping.
    GET  /metrics   Prometheus text: requests by status, batches, rows, latencies.

The Ray Serve deployment answers /v1/act (without queue_ms in the timings), /v1/spec and
/health; Ray Serve has metrics and health checks of its own.

This module needs numpy and safetensors only, so a robot's client does not need torch.
"""
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

PROTOCOL = "dpa-act/1"
CONTENT_TYPE = "application/vnd.dpa.safetensors"
SEED_KEY = "seed"
JPEG_KEY = "jpeg"
# What a refusal of a camera input adds.
FRAMES_HINT = (" (a camera input: uint8 frames, 0-255, [n_obs_steps, C, H, W] as GET /v1/spec says; "
               "resize on the robot)")
# safetensors' header: an 8-byte little-endian length, then that much JSON.
_HEADER_LENGTH = struct.Struct("<Q")


class RequestError(Exception):
    """A request the server answers with `status` and `message` (JSON {"error": message})."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a request or response: the shape of ONE observation (or action chunk)."""
    shape: Tuple[int, ...]
    dtype: str = "float32"

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, value: Mapping) -> "TensorSpec":
        return cls(tuple(int(d) for d in value["shape"]), str(value["dtype"]))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class PolicySpec:
    """What a served policy takes and returns, as GET /v1/spec reports it."""
    inputs: Dict[str, TensorSpec]
    action: TensorSpec
    max_rows: int
    info: Dict[str, object] = field(default_factory=dict)

    @property
    def too_large_hint(self) -> str:
        """What a 413 adds where the policy takes camera frames (float frames are 4x larger)."""
        cameras = [name for name, spec in self.inputs.items() if spec.dtype == "uint8"]
        return (f" (camera inputs {cameras} are uint8 frames, 0-255, 1 byte per value: float frames are 4 times "
                f"larger)") if cameras else ""

    @property
    def max_request_bytes(self) -> int:
        """The largest body a valid request can have: max_rows observations, plus room for
        the safetensors header and metadata."""
        return self.max_rows * sum(spec.nbytes for spec in self.inputs.values()) + 4096

    def to_json(self) -> dict:
        return {"protocol": PROTOCOL, "inputs": {k: v.to_json() for k, v in self.inputs.items()},
                "action": self.action.to_json(), "max_rows": self.max_rows,
                "max_request_bytes": self.max_request_bytes, **self.info}

    @classmethod
    def from_json(cls, value: Mapping) -> "PolicySpec":
        if value.get("protocol") != PROTOCOL:
            raise ValueError(f"the server speaks {value.get('protocol')!r}, this client {PROTOCOL!r}")
        known = {"protocol", "inputs", "action", "max_rows", "max_request_bytes"}
        return cls({k: TensorSpec.from_json(v) for k, v in value["inputs"].items()},
                   TensorSpec.from_json(value["action"]), int(value["max_rows"]),
                   {k: v for k, v in value.items() if k not in known})


@dataclass
class ActRequest:
    """A decoded, validated POST /v1/act: `inputs` are [rows, *shape] arrays; `single` says
    the client sent one observation without the leading dimension (and gets its action
    chunk without one). `jpeg`: the inputs still to be decoded from JPEG (jpeg.py), name ->
    (the files end to end, their lengths [rows, n_obs_steps]); they are not in `inputs` yet."""
    inputs: Dict[str, np.ndarray]
    rows: int
    single: bool
    seed: Optional[int] = None
    jpeg: Dict[str, Tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def encode_tensors(tensors: Mapping[str, np.ndarray], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    from safetensors.numpy import save

    return save({k: np.ascontiguousarray(v) for k, v in tensors.items()},
                metadata={k: str(v) for k, v in (metadata or {}).items()} or None)


def decode_tensors(body: bytes) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """The tensors and metadata of a safetensors body; RequestError(400) if it is not one.
    safetensors checks the header against the body's length before anything is read."""
    from safetensors.numpy import load

    try:
        tensors = load(body)
        (length,) = _HEADER_LENGTH.unpack_from(body)
        metadata = json.loads(body[8:8 + length]).get("__metadata__") or {}
    # The body is untrusted bytes: any failure to parse it is the sender's error, reported
    # with the parser's message rather than as a server fault.
    except Exception as error:  # noqa: BLE001
        raise RequestError(400, f"the body is not a safetensors file: {error}") from error
    return tensors, metadata


def non_finite_rows(array: np.ndarray, single: bool) -> str:
    """" (rows [i, ...] of n)" for the rows of `array` ([n, ...], or one row where `single`)
    that hold a NaN or an Inf; "" for a single row."""
    if single:
        return ""
    rows = np.flatnonzero(~np.isfinite(array.reshape(len(array), -1)).all(axis=1)).tolist()
    return f" (rows [{', '.join(map(str, rows[:5]))}{', ...' if len(rows) > 5 else ''}] of {len(array)})"


def parse_act_request(body: bytes, spec: PolicySpec, check_finite: bool = True) -> ActRequest:
    """Validate a POST /v1/act body against the policy's spec; RequestError names what is wrong.
    With `check_finite`, an input holding NaN or Inf is refused with 422."""
    if len(body) > spec.max_request_bytes:
        raise RequestError(413, f"the body has {len(body)} bytes, more than the {spec.max_request_bytes} "
                                f"that {spec.max_rows} observations take{spec.too_large_hint}")
    tensors, metadata = decode_tensors(body)
    missing, extra = sorted(set(spec.inputs) - set(tensors)), sorted(set(tensors) - set(spec.inputs))
    if missing or extra:
        raise RequestError(400, f"the inputs must be exactly {sorted(spec.inputs)}: "
                                + ", ".join(filter(None, [missing and f"missing {missing}",
                                                          extra and f"unexpected {extra}"])))
    jpeg = _jpeg_lengths(metadata, tensors, spec)
    rows, single = None, None
    for name, expected in spec.inputs.items():
        array = tensors[name]
        if name in jpeg:
            this_single = jpeg[name].ndim == 1
            this_rows = 1 if this_single else jpeg[name].shape[0]
        elif array.dtype != np.dtype(expected.dtype):
            raise RequestError(400, f"input {name!r} must be {expected.dtype}, got {array.dtype}"
                                    + (FRAMES_HINT if expected.dtype == "uint8" else ""))
        else:
            shape = tuple(array.shape)
            this_single = shape == expected.shape
            if not this_single and not (len(shape) == len(expected.shape) + 1 and shape[1:] == expected.shape):
                raise RequestError(400, f"input {name!r} must be {list(expected.shape)} (one observation) or "
                                        f"[n, {', '.join(map(str, expected.shape))}], got {list(shape)}"
                                        + (FRAMES_HINT if expected.dtype == "uint8" else ""))
            this_rows = 1 if this_single else shape[0]
        if rows is not None and (this_rows, this_single) != (rows, single):
            raise RequestError(400, f"input {name!r} holds {'one observation' if this_single else this_rows} "
                                    f"but an earlier input {'one observation' if single else rows}: every input "
                                    f"needs the same leading dimension")
        rows, single = this_rows, this_single
        if check_finite and array.dtype.kind == "f" and not np.isfinite(array).all():
            raise RequestError(422, f"input {name!r} has NaN or infinite values{non_finite_rows(array, single)}: "
                                    f"no actions computed (dpa serve --no-check-finite lets them through)")
    if not 1 <= rows <= spec.max_rows:
        raise RequestError(400, f"a request holds 1 to {spec.max_rows} observations, got {rows}")
    unknown = sorted(set(metadata) - {SEED_KEY, JPEG_KEY})
    if unknown:
        raise RequestError(400, f"unknown metadata {unknown}; the keys are {SEED_KEY!r} and {JPEG_KEY!r}")
    seed = None
    if SEED_KEY in metadata:
        try:
            seed = int(metadata[SEED_KEY])
        except ValueError:
            seed = -1
        if not 0 <= seed < 2 ** 63:
            raise RequestError(400, f"metadata {SEED_KEY!r} must be an integer in [0, 2**63), got "
                                    f"{metadata[SEED_KEY]!r}")
    inputs = {name: tensors[name].reshape((rows,) + spec.inputs[name].shape) for name in spec.inputs
              if name not in jpeg}
    return ActRequest(inputs, rows, single, seed,
                      {name: (tensors[name], lengths.reshape(rows, -1)) for name, lengths in jpeg.items()})


def _jpeg_lengths(metadata: Mapping[str, str], tensors: Mapping[str, np.ndarray],
                  spec: PolicySpec) -> Dict[str, np.ndarray]:
    """The JPEG inputs' file lengths ([n_obs_steps] or [n, n_obs_steps]), checked against their
    tensors and the spec; RequestError(400) naming the input."""
    if JPEG_KEY not in metadata:
        return {}
    try:
        declared = json.loads(metadata[JPEG_KEY])
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python parses
        declared = None
    if not isinstance(declared, dict):
        raise RequestError(400, f"metadata {JPEG_KEY!r} must be a JSON object {{input: lengths}}, got "
                                f"{metadata[JPEG_KEY][:100]!r}")
    out = {}
    for name, lengths in declared.items():
        expected = spec.inputs.get(name)
        if expected is None or expected.dtype != "uint8" or len(expected.shape) != 4:
            raise RequestError(400, f"input {name!r} is sent as JPEG, but only camera inputs (uint8 [n_obs_steps, "
                                    f"C, H, W]) can be: {[k for k, v in spec.inputs.items() if v.dtype == 'uint8']}")
        array = tensors[name]
        lengths = _file_lengths(lengths, array.size)
        steps = expected.shape[0]
        if not (lengths.shape == (steps,) or (lengths.ndim == 2 and lengths.shape[1] == steps)) or \
                lengths.size == 0:
            raise RequestError(400, f"input {name!r}: metadata {JPEG_KEY!r} must give a positive byte length per "
                                    f"JPEG frame, [{steps}] for one observation or [n, {steps}], got "
                                    f"{str(declared[name])[:100]}")
        if array.dtype != np.uint8 or array.ndim != 1 or array.size != sum(map(int, lengths.reshape(-1))):
            raise RequestError(400, f"input {name!r} is sent as JPEG: its tensor must be the {lengths.size} files "
                                    f"end to end, uint8 [{int(lengths.sum())}] (the lengths' sum), got "
                                    f"{array.dtype} {list(array.shape)}")
        out[name] = lengths
    return out


def _file_lengths(value, limit: int) -> np.ndarray:
    """`value` (JSON: a list of ints, or a list of such lists) as an int64 array, each length a
    plain int in [1, limit] (so that the lengths' sum cannot wrap); an empty array where it is
    anything else."""
    def lengths_of(row) -> Optional[List[int]]:
        if not isinstance(row, list) or not all(type(x) is int and 1 <= x <= limit for x in row):
            return None
        return row

    if isinstance(value, list) and value and all(isinstance(row, list) for row in value):
        rows = [lengths_of(row) for row in value]
        if any(row is None for row in rows) or len({len(row) for row in rows}) != 1:
            return np.zeros((0,), np.int64)
        return np.array(rows, dtype=np.int64)
    row = lengths_of(value)
    return np.zeros((0,), np.int64) if row is None else np.array(row, dtype=np.int64)


# JPEG files as a client gives them: bytes, in lists nested like the frames' leading dimensions.
JpegFiles = Union[bytes, Sequence[Any]]


def encode_request(inputs: Mapping[str, np.ndarray], seed: Optional[int] = None,
                   jpeg: Optional[Mapping[str, JpegFiles]] = None) -> bytes:
    """A POST /v1/act body. `jpeg`: camera inputs sent as JPEG instead, name -> the files (bytes)
    nested like the frames: [n_obs_steps] of them, or [n][n_obs_steps]."""
    metadata = {} if seed is None else {SEED_KEY: str(int(seed))}
    tensors = dict(inputs)
    if jpeg:
        lengths = {}
        for name, files in jpeg.items():
            flat: List[bytes] = []
            lengths[name] = _lengths(files, flat, name)
            tensors[name] = np.frombuffer(b"".join(flat), np.uint8)
        metadata[JPEG_KEY] = json.dumps(lengths, separators=(",", ":"))
    return encode_tensors(tensors, metadata or None)


def _lengths(files: JpegFiles, flat: List[bytes], name: str):
    if isinstance(files, (bytes, bytearray, memoryview)):
        flat.append(bytes(files))
        return len(flat[-1])
    if isinstance(files, (str, np.ndarray)) or not isinstance(files, Sequence):
        raise ValueError(f"jpeg[{name!r}] must be JPEG files (bytes) in lists nested like the frames, got "
                         f"{type(files).__name__}")
    return [_lengths(f, flat, name) for f in files]


def encode_action(action: np.ndarray, timings: Mapping[str, float]) -> bytes:
    return encode_tensors({"action": action}, {k: _format_number(v) for k, v in timings.items()})


def server_timing_header(timings: Mapping[str, float]) -> str:
    """The Server-Timing header of a response (durations in ms; browsers and proxies show it)."""
    return ", ".join(f"{k.removesuffix('_ms')};dur={v:.3f}" if k.endswith("_ms") else f"{k};desc={_format_number(v)}"
                     for k, v in timings.items())


def _format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4f}"


def decode_action(body: bytes) -> Tuple[np.ndarray, Dict[str, float]]:
    tensors, metadata = decode_tensors(body)
    if "action" not in tensors:
        raise ValueError(f"the response has no 'action' tensor (it has {sorted(tensors)})")
    timings = {}
    for key, value in metadata.items():
        try:
            timings[key] = float(value)
        except ValueError:
            continue
        if math.isnan(timings[key]):
            del timings[key]
    return tensors["action"], timings
