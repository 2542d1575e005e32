"""Built-in catalogues: GPUs (memory as nvidia-smi reports it, fp8 support) and popular models.

GPU memory is ``memory.total`` as nvidia-smi / NVML ``nvmlDeviceGetMemoryInfo`` report it (what
vLLM's ``torch.cuda.mem_get_info`` total sees), in bytes: e.g. A100 80GB = 81920 MiB, H100 80GB
HBM3 = 81559 MiB, H200 = 143771 MiB. ``fp8`` means vLLM can store an fp8 KV cache with native
kernels (compute capability ≥ 8.9: Ada, Hopper, Blackwell; MI300 on ROCm).

The model catalogue (``kvdoctor/data/models.json``) holds facts only: the attention and size
fields of each model's public ``config.json``, so ``kvdoctor plan meta-llama/Llama-3.1-70B``
works offline.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from kvdoctor.dcmethods import shared_methods
from kvdoctor.lazyre import lazy_re
from kvdoctor.units import MiB, parse_size


@shared_methods
@dataclass(frozen=True, repr=False, eq=False)
class GpuSpec:
    """One GPU model: ``memory_bytes`` (nvidia-smi ``memory.total``, bytes), ``fp8`` (KV cache
    fp8 supported natively), ``sm`` compute capability as "9.0" ("gfx942" for MI300X)."""

    name: str
    memory_bytes: int
    fp8: bool
    sm: str

    @property
    def sm_major(self) -> int:
        """Major compute capability (9 for Hopper), 0 when not a CUDA SM string."""
        m = re.match(r"(\d{1,4})\.", self.sm)
        return int(m.group(1)) if m else 0


def _g(name: str, mib: int, sm: str, fp8: bool | None = None) -> GpuSpec:
    if fp8 is None:
        major, minor = (int(x) for x in sm.split("."))
        fp8 = (major, minor) >= (8, 9)
    return GpuSpec(name, mib * MiB, fp8, sm)


# canonical key -> spec. Keys are matched after normalising (lower case, no "nvidia"/"tesla"/
# "geforce", separators removed).
_GPUS: dict[str, GpuSpec] = {
    "A100-80GB": _g("A100-80GB", 81920, "8.0"),
    "A100-40GB": _g("A100-40GB", 40960, "8.0"),
    "A800-80GB": _g("A800-80GB", 81920, "8.0"),
    "H100-80GB": _g("H100-80GB", 81559, "9.0"),
    "H100-NVL": _g("H100-NVL", 95830, "9.0"),
    "H800": _g("H800", 81559, "9.0"),
    "H200": _g("H200", 143771, "9.0"),
    "H20": _g("H20", 97871, "9.0"),
    "GH200": _g("GH200", 97871, "9.0"),
    "B200": _g("B200", 183359, "10.0"),
    # 2025-26 cards. Memory: the nvidia-smi memory.total people paste (MiB), else the datasheet
    # capacity; compute capability from NVIDIA's CUDA GPUs table (developer.nvidia.com/cuda-gpus).
    "GB200": _g("GB200", 189471, "10.0"),
    "B300": _g("B300", 275040, "10.3"),
    "GB300": _g("GB300", 284208, "10.3"),
    "H200-NVL": _g("H200-NVL", 143771, "9.0"),
    "RTX PRO 6000 Blackwell": _g("RTX PRO 6000 Blackwell", 97887, "12.0"),
    "RTX 5090": _g("RTX 5090", 32607, "12.0"),
    "RTX 5080": _g("RTX 5080", 16303, "12.0"),
    "RTX 5070 Ti": _g("RTX 5070 Ti", 16303, "12.0"),
    "RTX 5070": _g("RTX 5070", 12227, "12.0"),
    "RTX 5060 Ti": _g("RTX 5060 Ti", 16311, "12.0"),
    "RTX 4080": _g("RTX 4080", 16376, "8.9"),
    "L20": _g("L20", 46068, "8.9"),
    "A30": _g("A30", 24576, "8.0"),
    "L40S": _g("L40S", 46068, "8.9"),
    "L40": _g("L40", 46068, "8.9"),
    "L4": _g("L4", 23034, "8.9"),
    "A10G": _g("A10G", 23028, "8.6"),
    "A10": _g("A10", 23028, "8.6"),
    "A40": _g("A40", 46068, "8.6"),
    "RTX A6000": _g("RTX A6000", 49140, "8.6"),
    "RTX 6000 Ada": _g("RTX 6000 Ada", 49140, "8.9"),
    "RTX 4090": _g("RTX 4090", 24564, "8.9"),
    "RTX 3090": _g("RTX 3090", 24576, "8.6"),
    "RTX 4060": _g("RTX 4060", 8188, "8.9"),
    "V100-16GB": _g("V100-16GB", 16160, "7.0"),
    "V100-32GB": _g("V100-32GB", 32768, "7.0"),
    "T4": _g("T4", 15360, "7.5"),
    # Workstation and older data-centre boards people still serve on (datasheet capacity in
    # MiB; compute capability from developer.nvidia.com/cuda-gpus).
    "V100S-32GB": _g("V100S-32GB", 32768, "7.0"),
    "RTX 3090 Ti": _g("RTX 3090 Ti", 24564, "8.6"),
    "RTX 3080": _g("RTX 3080", 10240, "8.6"),
    "RTX A5000": _g("RTX A5000", 24564, "8.6"),
    "RTX A4000": _g("RTX A4000", 16376, "8.6"),
    "RTX 5000 Ada": _g("RTX 5000 Ada", 32760, "8.9"),
    "RTX 4000 Ada": _g("RTX 4000 Ada", 20475, "8.9"),
    "Quadro RTX 8000": _g("Quadro RTX 8000", 49152, "7.5"),
    # DGX Station A100's display card ("NVIDIA DGX Display", 4 GB Turing): never an engine GPU.
    "DGX Display": _g("DGX Display", 4096, "7.5"),
    # ROCm reports 192 GiB HBM3 as 196288 MiB usable.
    "MI300X": GpuSpec("MI300X", 196288 * MiB, True, "gfx942"),
}

# Aliases (normalised) -> canonical key; nvidia-smi names included.
_ALIASES: dict[str, str] = {
    "a100": "A100-80GB",
    "a10080gb": "A100-80GB",
    "a100sxm480gb": "A100-80GB",
    "a10080gbpcie": "A100-80GB",
    "a100pcie80gb": "A100-80GB",
    "a100sxm80gb": "A100-80GB",
    "a10040gb": "A100-40GB",
    "a100sxm440gb": "A100-40GB",
    "a100pcie40gb": "A100-40GB",
    "a800": "A800-80GB",
    "a80080gb": "A800-80GB",
    "a800sxm480gb": "A800-80GB",
    "h100": "H100-80GB",
    "h10080gb": "H100-80GB",
    "h10080gbhbm3": "H100-80GB",
    "h100sxm580gb": "H100-80GB",
    "h100pcie": "H100-80GB",
    "h100nvl": "H100-NVL",
    "h800": "H800",
    "h200": "H200",
    "h200141gb": "H200",
    "h20": "H20",
    "gh200": "GH200",
    "gh200480gb": "GH200",
    "b200": "B200",
    "b200sxm": "B200",
    "gb200": "GB200",
    "b300": "B300",
    "b300sxm6ac": "B300",
    "gb300": "GB300",
    # DGX Station (2025) carries a GB300 superchip.
    "dgxstation": "GB300",
    "dgxstationgb300": "GB300",
    "h200nvl": "H200-NVL",
    "rtxpro6000": "RTX PRO 6000 Blackwell",
    "rtxpro6000blackwell": "RTX PRO 6000 Blackwell",
    "rtxpro6000blackwellworkstationedition": "RTX PRO 6000 Blackwell",
    "rtxpro6000blackwellserveredition": "RTX PRO 6000 Blackwell",
    "rtxpro6000blackwellmaxqworkstationedition": "RTX PRO 6000 Blackwell",
    "rtx5090": "RTX 5090",
    "5090": "RTX 5090",
    "rtx5080": "RTX 5080",
    "rtx5070ti": "RTX 5070 Ti",
    "rtx5070": "RTX 5070",
    "rtx5060ti": "RTX 5060 Ti",
    "rtx4080": "RTX 4080",
    "l20": "L20",
    "a30": "A30",
    "l40s": "L40S",
    "l40": "L40",
    "l4": "L4",
    "a10g": "A10G",
    "a10": "A10",
    "a40": "A40",
    "rtxa6000": "RTX A6000",
    "a6000": "RTX A6000",
    "rtx6000ada": "RTX 6000 Ada",
    "rtx6000adageneration": "RTX 6000 Ada",
    "rtx4090": "RTX 4090",
    "4090": "RTX 4090",
    "rtx3090": "RTX 3090",
    "rtx4060": "RTX 4060",
    "v100": "V100-16GB",
    "v10016gb": "V100-16GB",
    "v100sxm216gb": "V100-16GB",
    "v100pcie16gb": "V100-16GB",
    "v10032gb": "V100-32GB",
    "v100sxm232gb": "V100-32GB",
    "v100pcie32gb": "V100-32GB",
    "t4": "T4",
    "v100s": "V100S-32GB",
    "v100spcie32gb": "V100S-32GB",
    "rtx3090ti": "RTX 3090 Ti",
    "rtx3080": "RTX 3080",
    "rtxa5000": "RTX A5000",
    "rtxa4000": "RTX A4000",
    "rtx5000ada": "RTX 5000 Ada",
    "rtx5000adageneration": "RTX 5000 Ada",
    "rtx4000ada": "RTX 4000 Ada",
    "rtx4000adageneration": "RTX 4000 Ada",
    "quadrortx8000": "Quadro RTX 8000",
    "dgxdisplay": "DGX Display",
    # China-market "D" boards: same memory and capability as the base card.
    "rtx4090d": "RTX 4090",
    "rtx5090d": "RTX 5090",
    "a800pcie80gb": "A800-80GB",
    "a80080gbpcie": "A800-80GB",
    "h800pcie": "H800",
    "mi300x": "MI300X",
    "amdinstinctmi300x": "MI300X",
}


def _norm(name: str) -> str:
    s = name.lower()
    s = re.sub(r"\b(nvidia|tesla|geforce|amd|instinct)\b", " ", s)
    s = s.replace("…", "").replace("...", "")
    return re.sub(r"[^a-z0-9]", "", s)


#: words of a board variant or form factor that do not change the GPU family's compute
#: capability: "H100 PCIe", "A100-SXM4-80GB", "H200 NVL", "RTX PRO 6000 Blackwell Max-Q
#: Workstation Edition", "RTX 4060 Laptop GPU", OEM suffixes ("HBM3", "AC"). Stripped from the end
#: of a name word by word until the catalogue knows the rest.
_VARIANT_WORDS = frozenset(
    "pcie sxm sxm2 sxm3 sxm4 sxm5 sxm6 nvl hbm hbm2 hbm2e hbm3 hbm3e ac oem gpu laptop mobile maxq max q "
    "workstation server edition generation graphics device module".split()
)
_MEM_WORD = lazy_re(r"^(\d{1,4})g(?:b)?$")


def _by_family(name: str, memory_bytes: int | None) -> str | None:
    """The catalogue key of a name with board-variant words (:data:`_VARIANT_WORDS`), a MIG
    profile ("… MIG 1g.10gb") or a memory size ("94GB") after the family, word by word from the
    end; None when no prefix of the name is catalogued. A memory word must agree with the card
    (within 8 %, decimal GB as boards are named) unless ``memory_bytes`` is given: "GH200 144G"
    is not the 96 GB GH200."""
    low = re.sub(r"\b(nvidia|tesla|geforce|amd|instinct)\b", " ", name.lower())
    low = low.split(" mig ", 1)[0]
    words = re.findall(r"[a-z0-9]+", low)
    mem_gb = None
    while words:
        key = _ALIASES.get("".join(words))
        if key is None:
            key = next((c for c in _GPUS if _norm(c) == "".join(words)), None)
        if key is not None:
            if mem_gb is not None and memory_bytes is None:
                have = _GPUS[key].memory_bytes / 1e9
                if abs(have - mem_gb) > 0.08 * have:
                    return None
            return key
        last = words.pop()
        m = _MEM_WORD.match(last)
        if m:
            mem_gb = float(m.group(1))
        elif last not in _VARIANT_WORDS:
            return None
    return None


def gpu_names() -> list[str]:
    """The canonical GPU names of the catalogue."""
    return list(_GPUS)


def gpu(name: str, memory_bytes: int | None = None) -> GpuSpec:
    """Look up a GPU by a short name ("A100-80GB", "H100", "RTX 4090") or an nvidia-smi name
    ("NVIDIA A100-SXM4-80GB", "NVIDIA H800", "NVIDIA RTX 6000 Ada Generation", even the table's
    truncated "NVIDIA A100-SXM..."). ``memory_bytes`` (nvidia-smi total) disambiguates truncated
    or memory-less names and, when given, is what the returned spec carries.

    Raises KeyError with the known names when the GPU is not in the catalogue.
    """
    n = _norm(name)
    key = _ALIASES.get(n)
    if key is None:
        for canon in _GPUS:
            if _norm(canon) == n:
                key = canon
                break
    if key is None and n:
        # Truncated nvidia-smi names ("A100-SXM...") and suffixed ones ("H100 80GB HBM3 PCIe"):
        # the longest alias that is a prefix, preferring one whose memory matches.
        # A prefix must end at a word boundary: "h100" does not match "h1000".
        cands = [
            a
            for a in _ALIASES
            if (n.startswith(a) and not n[len(a) : len(a) + 1].isalnum()) or (len(n) >= 3 and a.startswith(n))
        ]
        if memory_bytes is not None and cands:
            close = [a for a in cands if abs(_GPUS[_ALIASES[a]].memory_bytes - memory_bytes) <= 2048 * MiB]
            cands = close or cands
        if cands:
            key = _ALIASES[max(cands, key=len)]
    if key is None:
        key = _by_family(name, memory_bytes)
    if key is None:
        raise KeyError(f"unknown GPU {name!r}; known: {', '.join(_GPUS)} (or give --gpu-memory)")
    spec = _GPUS[key]
    if memory_bytes is not None and memory_bytes != spec.memory_bytes:
        spec = GpuSpec(spec.name, memory_bytes, spec.fp8, spec.sm)
    return spec


def parse_gpu_memory(text: str) -> int:
    """``--gpu-memory 80GiB`` / ``81920MiB`` / ``80G`` → bytes (binary units; "GB" = 2**30, as
    in :func:`kvdoctor.units.parse_size`; a bare number means GiB). Raises ValueError."""
    n = parse_size(text, default_unit="gib")
    if n <= 0:
        raise ValueError(f"GPU memory must be positive: {text!r}")
    return n


# --------------------------------------------------------------------------- models


@lru_cache(maxsize=1)
def _catalogue() -> dict[str, Any]:
    # the package's own directory, where importlib.resources.files("kvdoctor") points for a
    # package on disk (importing importlib.resources costs a cold start ~10 ms)
    text = (Path(__file__).resolve().parent / "data" / "models.json").read_text(encoding="utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def _models() -> dict[str, dict[str, Any]]:
    models: dict[str, dict[str, Any]] = _catalogue()["models"]
    return models


def _aliases() -> dict[str, str]:
    aliases: dict[str, str] = _catalogue().get("aliases", {})
    return aliases


def model_names() -> list[str]:
    """The Hugging Face ids in the built-in model catalogue."""
    return list(_models())


def model_config(name: str) -> dict[str, Any] | None:
    """The catalogue's config.json facts for a model id ("meta-llama/Llama-3.1-70B"), matched
    case-insensitively, with or without the organisation prefix; None when unknown."""
    models = _models()
    if name in models:
        return dict(models[name])
    low = name.lower().strip().rstrip("/")
    for old, new in _aliases().items():
        # Older repo ids (Meta-Llama-3.1-8B-Instruct) name today's entries.
        if old.lower() == low or old.lower().split("/", 1)[-1] == low.split("/", 1)[-1]:
            return dict(models[new])
    for key, cfg in models.items():
        if key.lower() == low or key.lower().split("/", 1)[-1] == low.split("/", 1)[-1]:
            return dict(cfg)
    return None


@lru_cache(maxsize=256)
def _model_arch_cached(name: str) -> Any:
    from kvdoctor.facts import SourceError
    from kvdoctor.sources.model_config import parse_model_config

    raw = model_config(name)
    if raw is None:
        return None
    try:
        return parse_model_config(raw, origin=f"catalogue:{name}")
    except SourceError:
        return None


def model_arch(name: str) -> Any:
    """The catalogue's :class:`~kvdoctor.facts.ModelArch` for a model id (``model_config`` read
    the way a config.json is, once per name and cached), so a bundle without config.json still
    gets weights and KV sizes; None when not catalogued. The object is shared between callers:
    like every fact, it is never modified."""
    return _model_arch_cached(name)
