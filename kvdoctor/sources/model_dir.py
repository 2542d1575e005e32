"""A local model directory or Hugging Face cache entry: where its config is, how big its weights are.

Weights are sized from metadata only, never by loading tensors: ``model.safetensors.index.json``
``metadata.total_size`` when present, else the sum of each ``*.safetensors`` file's tensor byte
ranges read from its header (8-byte little-endian header length, then a JSON header whose
``data_offsets`` give each tensor's bytes).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from kvdoctor.facts import SourceError

#: A safetensors header larger than this is not a real header (the format caps it at 100 MB).
_MAX_HEADER = 100 * 1024 * 1024


def hf_cache_dir(model_id: str, cache_root: str | os.PathLike[str] | None = None) -> Path | None:
    """The newest snapshot directory of ``model_id`` ("org/name") in the Hugging Face hub cache
    (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``), or None when absent."""
    if cache_root is None:
        env = os.environ.get("HF_HUB_CACHE")
        if env:
            cache_root = env
        else:
            home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
            cache_root = os.path.join(home, "hub")
    snaps = Path(cache_root) / ("models--" + model_id.replace("/", "--")) / "snapshots"
    if not snaps.is_dir():
        return None
    cands = [p for p in snaps.iterdir() if (p / "config.json").is_file()]
    if not cands:
        return None
    return max(cands, key=lambda p: p.stat().st_mtime)


def safetensors_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of tensor data in one ``.safetensors`` file, from its header alone.

    Raises :class:`SourceError` for a truncated or non-safetensors file.
    """
    p = Path(path)
    try:
        with p.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SourceError("safetensors file is truncated (no header length)", origin=str(p))
            (n,) = struct.unpack("<Q", head)
            if n <= 0 or n > _MAX_HEADER:
                raise SourceError(f"not a safetensors file (header length {n})", origin=str(p))
            raw = f.read(n)
    except OSError as e:
        raise SourceError(f"cannot read: {e.strerror or e}", origin=str(p)) from None
    if len(raw) < n:
        raise SourceError("safetensors header is truncated", origin=str(p))
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SourceError("safetensors header is not JSON", origin=str(p)) from None
    if not isinstance(header, dict):
        raise SourceError("safetensors header is not a JSON object", origin=str(p))
    total = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offs = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(x, int) for x in offs)):
            raise SourceError("a tensor has no data_offsets", origin=str(p))
        total += offs[1] - offs[0]
    return total


def weights_bytes_from_dir(model_dir: str | os.PathLike[str]) -> int | None:
    """Total weight bytes of a local checkpoint directory: ``model.safetensors.index.json``
    ``metadata.total_size`` when present, else Σ :func:`safetensors_bytes` over ``*.safetensors``;
    None when the directory has neither. Raises :class:`SourceError` on a corrupt index or header.
    """
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            meta = json.loads(index.read_text(encoding="utf-8")).get("metadata") or {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            raise SourceError("safetensors index is not valid JSON", origin=str(index)) from None
        size = meta.get("total_size") if isinstance(meta, dict) else None
        if isinstance(size, (int, float)) and size > 0:
            return int(size)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        return None
    return sum(safetensors_bytes(f) for f in files)
