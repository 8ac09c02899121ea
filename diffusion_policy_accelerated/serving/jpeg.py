"""JPEG camera frames: the server's decoding (protocol.py says how a request carries them).

A camera input (uint8 [n_obs_steps, C, H, W] in the spec) may come as JPEG: the input's tensor
then holds the frames' JPEG files end to end (uint8, 1-D), and the request's metadata "jpeg"
gives each file's length, nested like the frames ([n_obs_steps], or [n, n_obs_steps]).
`decode_jpeg_inputs` turns those into the raw frames the policy takes, with torchvision's
`decode_jpeg` on the CPU (libjpeg-turbo), in a thread of the server's rather than its event
loop. Each file's header must declare the spec's [C, H, W] before anything is decoded (a
file of a few bytes can declare 65500 x 65500 pixels, gigabytes decoded), and the decoded frame
must have it too, else 400 naming the input. libjpeg decodes damaged image data as far as it
goes rather than failing: a file whose header is intact but whose data was damaged in transit
gives a wrong frame, not an error, so a link that can damage bytes without failing the
connection is one to send raw frames over.
`encode_jpeg_frames` is the client's side (torchvision's `encode_jpeg`).
"""
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .protocol import ActRequest, PolicySpec, RequestError


def _torchvision_io():
    try:
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg, encode_jpeg
    except ImportError as error:
        raise ImportError(f"JPEG camera frames need torch and torchvision ({error}): pip install torchvision") \
            from error
    return torch, decode_jpeg, encode_jpeg, ImageReadMode


# Start-of-frame markers (baseline, progressive, lossless, arithmetic): their segment holds the
# image's height, width and number of components. Markers without a length follow.
_START_OF_FRAME = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_NO_LENGTH = {0x01, 0xD8} | set(range(0xD0, 0xD8))
_START_OF_SCAN = 0xDA


def jpeg_header_shape(data: bytes) -> Optional[Tuple[int, int, int]]:
    """(components, height, width) from a JPEG file's first start-of-frame segment, or None
    where the bytes before the image data hold none (not a JPEG, or a truncated header)."""
    if data[:2] != b"\xff\xd8":
        return None
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # a fill byte
            i += 1
            continue
        if marker in _NO_LENGTH:
            i += 2
            continue
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if marker in _START_OF_FRAME:
            if length < 8 or i + 10 > len(data):
                return None
            height, width = int.from_bytes(data[i + 5:i + 7], "big"), int.from_bytes(data[i + 7:i + 9], "big")
            return data[i + 9], height, width
        if marker == _START_OF_SCAN or length < 2:
            return None
        i += 2 + length
    return None


def decode_jpeg_inputs(request: ActRequest, spec: PolicySpec) -> ActRequest:
    """`request` with its JPEG inputs (request.jpeg) decoded into uint8 [rows, n_obs_steps, C,
    H, W] frames in request.inputs; RequestError(400) naming the input and the frame where a
    file does not decode or decodes to another shape."""
    if not request.jpeg:
        return request
    torch, decode_jpeg, _, ImageReadMode = _torchvision_io()
    for name, (data, lengths) in request.jpeg.items():
        shape = spec.inputs[name].shape
        offsets = np.concatenate([[0], np.cumsum(lengths.reshape(-1))])
        files = [torch.from_numpy(data[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)]
        frames = np.empty((request.rows,) + shape, np.uint8)
        for i, file in enumerate(files):
            where = np.unravel_index(i, (request.rows, shape[0]))
            label = f"frame [{where[1]}]" if request.single else f"frame [{where[0]}, {where[1]}]"
            declared = jpeg_header_shape(file.numpy().tobytes())
            if declared is None:
                raise RequestError(400, f"input {name!r} {label} is not a JPEG file (no start-of-frame header)")
            if declared != shape[1:]:
                raise RequestError(400, f"input {name!r} {label}'s header declares [{', '.join(map(str, declared))}], "
                                        f"not the [{', '.join(map(str, shape[1:]))}] (C, H, W) GET /v1/spec gives "
                                        f"(resize on the robot before encoding); not decoded")
            try:
                frame = decode_jpeg(file, mode=ImageReadMode.UNCHANGED)
            # Untrusted bytes: whatever libjpeg refuses is the sender's error.
            except Exception as error:  # noqa: BLE001
                raise RequestError(400, f"input {name!r} {label} is not a decodable JPEG: "
                                        f"{str(error).strip()[:200]}") from error
            if tuple(frame.shape) != shape[1:]:
                raise RequestError(400, f"input {name!r} {label} decodes to [{', '.join(map(str, frame.shape))}], "
                                        f"not the [{', '.join(map(str, shape[1:]))}] (C, H, W) GET /v1/spec gives "
                                        f"(resize on the robot before encoding)")
            frames[where] = frame.numpy()
        request.inputs[name] = frames
    request.jpeg = {}
    return request


def encode_jpeg_frames(frames: np.ndarray, quality: int, name: str = "frames") -> List:
    """JPEG files (bytes) of uint8 frames [..., C, H, W] (C 1 or 3), nested like the leading
    dimensions, at `quality` (1-100)."""
    if isinstance(quality, bool) or not isinstance(quality, (int, np.integer)) or not 1 <= quality <= 100:
        raise ValueError(f"jpeg_quality for {name!r} must be an integer in [1, 100], got {quality!r}")
    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim < 3 or frames.shape[-3] not in (1, 3):
        raise ValueError(f"{name!r}: JPEG frames must be uint8 [..., C, H, W] with C 1 or 3, got {frames.dtype} "
                         f"{list(frames.shape)}")
    torch, _, encode_jpeg, _ = _torchvision_io()
    flat = torch.from_numpy(np.ascontiguousarray(frames)).reshape((-1,) + frames.shape[-3:])
    files = [bytes(f.numpy()) for f in encode_jpeg(list(flat), quality=int(quality))]
    return _nest(files, frames.shape[:-3])


def _nest(items: Sequence, shape) -> List:
    if len(shape) == 0:
        return items[0]
    step = int(np.prod(shape[1:], dtype=np.int64))
    return [_nest(items[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]
