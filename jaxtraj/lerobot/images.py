"""Image features: a PNG per frame, stored in the data file as LeRobot's image struct.

LeRobot's loader declares an ``"image"`` feature as ``datasets.Image()``, whose column is the
struct ``{"bytes": binary, "path": string}`` (``format.IMAGE_TYPE``); the writer fills ``bytes``
with the PNG and leaves ``path`` null. PNGs are written with zlib level 1, as LeRobot's image
writer does.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from jaxtraj.lerobot.format import IMAGE_TYPE


def encode_png(frame: np.ndarray) -> bytes:
    """One ``[H, W, 3]`` uint8 frame as PNG bytes."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="PNG", compress_level=1)
    return out.getvalue()


def decode_png(data: bytes) -> np.ndarray:
    """PNG bytes to ``[H, W, 3]`` uint8."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def encode_episodes(episodes: Sequence[np.ndarray]) -> list[bytes]:
    """Every frame of every episode ``[L, H, W, 3]``, in order, as PNG bytes."""
    return [encode_png(frame) for frames in episodes for frame in frames]


def to_arrow(pngs: Sequence[bytes]) -> pa.Array:
    """PNG bytes to the image struct column (``path`` null)."""
    return pa.StructArray.from_arrays(
        [pa.array(pngs, type=pa.binary()), pa.nulls(len(pngs), type=pa.string())],
        fields=list(IMAGE_TYPE),
    )
