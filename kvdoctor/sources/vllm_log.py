"""vLLM's log → :class:`kvdoctor.facts.VllmLog`: typed events with numbers in base units.

Every line is cleaned first: ANSI colour codes, container-runtime / Kubernetes timestamp prefixes
(``2025-07-01T09:12:43.123456789Z ``, ``2025-07-01T09:12:43.123Z stdout F ``), the process prefix
``(APIServer pid=1) `` / ``(EngineCore_DP0 pid=277) `` / ``(Worker_TP1 pid=380) `` →
``LogEvent.process``/``pid``, then ``LEVEL MM-DD HH:MM:SS [file.py:NNN] `` (or the old
``file.py:NNN] ``) → ``level``/``time`` (vllm-facts.md §3.1). Matching is on the message text
only, never on ``file:line`` (those change every release). Sizes are bytes (vLLM's "GiB", and the
V0 "GB", are 2**30), percentages are fractions 0..1, durations seconds. ``LogEvent.text`` is the
message with secrets (``--api-key``, ``api_key=…``, ``*_TOKEN``/``*_KEY`` values, Authorization
headers) and prompt text redacted.

Event kinds (``LogEvent.kind`` → ``values`` keys). "§" cites reference/vllm-facts.md:

- ``version`` {version}: "vLLM API server version X", "vLLM server version X, serving model M",
  the logo's "version X", "Initializing a V1 LLM engine (vX)", "Initializing an LLM engine (vX)"
  (§3.2). Sets ``VllmLog.vllm_version`` and ``engine_generation`` ("v1"/"v0").
- ``args`` {args, source}: ``non-default args: {…}`` (source "non_default"), ``args: Namespace(…)``
  ("namespace"), ``Initializing … with config: k=v, …`` ("engine_config"; max_seq_len →
  max_model_len, torch.bfloat16 → "bfloat16"). Merged into ``VllmLog.args`` (later lines win, a
  Namespace default never overrides a non-default arg); ``VllmLog.args["_explicit"]`` lists the keys
  that came from ``non-default args``.
- ``chunked_prefill`` {max_num_batched_tokens}; ``max_model_len_used`` {max_model_len} (§3.2).
- ``weights_loading_start`` {}: "Starting to load model", "Loading model weights…" (V0).
- ``model_loading`` {weights_bytes, seconds}: "Model loading took X GiB[ memory] and S seconds"
  (all §3.3 item 1 variants, also 0.8's "GB"), V0 "Loading model weights took X GB" (seconds None).
- ``memory_profile_v0`` {seconds, total_bytes, gmu, budget_bytes, weights_bytes, non_torch_bytes,
  activation_peak_bytes, kv_bytes}: the three-line message of §3.3 item 11 (kv may be negative);
  also 0.6.x "Memory profiling results: total_gpu_memory=… peak_torch_memory=… kv_cache_size=…"
  (adds initial_bytes, peak_torch_bytes, post_profile_bytes; activation_peak_bytes =
  peak_torch − weights when this process logged its weights, else None).
- ``memory_profile_v1`` {seconds, non_kv_bytes, torch_peak_increase_bytes, non_torch_increase_bytes,
  consumed_bytes, weights_bytes}: the DEBUG "Memory profiling takes … Total non KV cache memory: …"
  line (§3.3 item 3); absent pieces are None.
- ``memory_request`` {initial_free_bytes, gmu, requested_bytes}: DEBUG "Initial free memory: X GiB;
  Requested memory: U (util), R GiB" (§3.3 item 3).
- ``available_kv_memory`` {bytes}: "Available KV cache memory: X GiB", one per worker (§3.3 item 5).
- ``kv_cache_size`` {device, tokens} and ``max_concurrency`` {max_model_len, concurrency}: one-line
  (≥0.28) and two-line forms, commas removed, also V0's "Maximum concurrency for N tokens…" (§3.3 7).
- ``num_gpu_blocks_override`` {computed, override}: "Overriding num_gpu_blocks=N with …=M".
- ``v0_blocks`` {device, gpu_blocks, cpu_blocks}: "# GPU blocks: 229, # CPU blocks: 512",
  "# cuda blocks: 0, # CPU blocks: 4681" (§3.3 item 11).
- ``graph_capture_start`` {}: "Capturing cudagraphs…", "Capturing the model for CUDA graphs",
  "Capturing CUDA graph shapes", "Capturing CUDA graphs (…" (one per capture, not per progress bar).
- ``graph_capture_done`` {seconds, bytes}: "Graph capturing finished in 5 secs, took 0.55 GiB"
  (bytes None in versions that did not print it) (§3.3 item 8).
- ``cudagraph_estimate`` {bytes}: "Estimated CUDA graph memory: X GiB total" (§3.3 item 4).
- ``cudagraph_pool`` {actual_bytes, estimated_bytes}: "CUDA graph pool memory: …" (§3.3 item 9).
- ``cudagraph_profiling`` {enabled, gmu, equivalent_gmu, suggested_gmu}: the INFO "CUDA graph memory
  profiling is enabled …" and WARNING "… is disabled …" lines (§3.3 item 4).
- ``memory_summary`` {free_bytes, total_bytes, gmu, requested_bytes, consumed_bytes, weights_bytes,
  activation_peak_bytes, non_torch_bytes, cudagraph_bytes, kv_cache_memory_fit_bytes,
  kv_cache_memory_full_bytes, kv_in_use_bytes}: §3.3 item 10, both variants (≤0.26 prints weights
  and non-torch separately; consumed_bytes is then their sum; the new form leaves them None).
- ``kv_cache_memory_bytes_reserved`` {initial_free_bytes, kv_bytes} (§3.3 item 2).
- ``external_weights`` {bytes, device, error, …}: weights held by another process (a
  ``vllm preload`` daemon), "Externally held weights …" (§3.5; ``log_engines.external_weights_line``).
- ``free_memory_below_util`` {device, free_bytes, total_bytes, gmu, requested_bytes, variant}:
  §3.5 with and without device ("cuda:0" or None); variant "util" (the common one),
  "external_weights_exceed" or "below_budget_excluding_external" for the external-weights errors.
- ``profiling_assertion`` {initial_free_bytes, current_free_bytes} (§3.5).
- ``no_available_kv_memory`` {}: "No available memory for the cache blocks" (V0 and V1).
- ``max_seq_len_exceeds_kv`` {max_model_len, needed_bytes, available_bytes, estimated_max_len}
  (V1, all §3.5 variants; estimated_max_len None when not printed) and
  ``v0_max_seq_len_exceeds_kv`` {max_model_len, kv_tokens}.
- ``autofit`` {from, to} ("Auto-fit max_model_len: reduced from A to B …" / "full model context
  length N fits …"), ``autofit_failed`` {}, ``user_max_model_len_too_large`` {max_model_len,
  derived, derived_key}, ``prompt_too_long`` {length, max_model_len} (§3.5).
- ``cuda_oom`` {form, requested_bytes, gpu, total_bytes, free_bytes, this_process_bytes,
  other_processes [{pid, bytes}], allowed_bytes, allocated_by_pytorch_bytes, private_pools_bytes,
  reserved_unallocated_bytes, already_allocated_bytes, reserved_total_bytes, phase}: PyTorch's OOM
  (§3.6): form "modern" (torch ≥2.1, incl. the "capacty" typo) or "legacy" (torch ≤2.0, where
  reserved_unallocated = reserved_total − already_allocated). One event per distinct occurrence:
  the same message repeated in one traceback block, or re-raised by EngineCore / the API server,
  is kept once; different workers (ranks) stay separate. ``phase``: "weight_loading",
  "profile_run", "kv_cache_init", "cuda_graph_capture", "sampler_warmup", "kv_sizing_warmup"
  (0.34's warm-up frames ``run_kv_cache_sizing_warmup`` / ``warmup_kernels`` before serving),
  "runtime" or "startup",
  from the events before it in the same process (globally for unprefixed lines) and the traceback.
  ``hints``: what the traceback around it mentions, a sorted subset of "logprobs" (logprobs /
  prompt_logprobs / log_softmax code), "sampler", "prefill" and "multimodal" (multimodal encoder /
  embedding code), for telling a logprobs or multimodal OOM from a prefill burst.
- ``engine_pid`` {pid, source}: a line naming an engine's pid ("Started engine process with PID N",
  uvicorn's "Started server process [N]", application lines; ``kvdoctor.sources.log_engines``).
  ``cuda_oom`` also carries ``engine_pid``: the raising process among the pids it names, or None.
- ``request`` {prompt_tokens}: "Received request …, prompt_token_ids: [...]" (the list's length, or
  N of ``[<redacted N tokens>]``).
- ``cudagraph_memory_profiling`` {}: "Profiling CUDA graph memory: …" (≥ 0.18, inside
  determine_available_memory; an OOM after it is a graph-capture OOM).
- ``cuda_error_oom`` {}: "CUDA error: out of memory" (a CUDA runtime error, not the allocator's).
- ``load_model_oom`` {}: "Failed to load model - not enough GPU memory" (§3.5);
  ``sampler_warmup_oom`` {num_requests}; ``mm_profile`` {}: multimodal profiling warnings.
- ``invalid_kv_cache_dtype`` {value, valid}: pydantic "Invalid kv_cache_dtype: 'int8'. Valid values
  are: [...]" and argparse "argument --kv-cache-dtype: invalid choice: 'int8' (choose from …)" (§4.1).
- ``engine_failed`` {reason}: "EngineCore failed to start", "Engine core initialization failed",
  "EngineDeadError", "EngineCore encountered a fatal error" / "an issue" (§3.5), V0's "Engine
  process failed to start".
- ``exception`` {exception, serving}: a traceback's exception line ("RuntimeError: NCCL error …",
  the dotted class name in ``exception``; ``serving``: the server was up when it was raised); the
  event's text is the line, redacted, at most 300 characters.
- ``stats`` {engine, prompt_throughput, generation_throughput, running, waiting, swapped, pending,
  deferred, preemptions, kv_usage, cpu_kv_usage, prefix_cache_hit_rate, device, num_engines}: every
  periodic-line form of §3.4 (V0 with Swapped/Pending, 0.9–0.11, ≥0.12 with Preemptions, "N Engines
  Aggregated:" → engine "aggregated", "CPU KV cache usage" as the main pool on the CPU backend).
  Throughputs in tokens/s; usages and hit rate are fractions; absent fields None.
- ``preempted_v0`` {mode, total_cumulative} (V0 "Sequence group … is preempted by … mode").
- ``swap_space_too_large`` {swap_bytes, cpu_total_bytes, fatal} (≤0.17).
- ``hybrid_block_size`` {block_size}, ``mamba_padding`` {fraction}, ``padding_layers`` {layers,
  waste_fraction} (§3.3 item 6).
- Catalogue 2 (sleep mode, weight offload, the V2 runner, speculative decoding, FlashInfer and
  Triton workspaces): the kinds listed in :mod:`kvdoctor.sources.log_catalogue2`. Every error
  raised in a traceback (``cuda_oom`` too) also gets ``frames``: the catalogue-2 code its
  traceback names (rejection_sampler, triton_autotune, fla_ops, attention, wake_up).
"""

from __future__ import annotations

import ast
import functools
import itertools
import json
import os
import re
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvdoctor.dcmethods import shared_methods
from kvdoctor.facts import LogEvent, SourceError, VllmLog
from kvdoctor.lazyre import lazy_re
from kvdoctor.redact import MARK, is_secret_name, redact_text
from kvdoctor.sources import log_catalogue2, log_v034
from kvdoctor.sources.limits import (
    MAX_DIGITS,
    MAX_GZIP_RATIO,
    MAX_LINE_CHARS,
    MAX_LOG_BYTES,
    guarded,
    iter_gunzip,
    open_regular,
)
from kvdoctor.sources.log_engines import (
    PROMPT_IDS,
    engine_pid_line,
    external_weights_line,
    oom_engine_pid,
    request_prompt_tokens,
    split_engines,
)
from kvdoctor.sources.log_prefixes import strip_prefixes
from kvdoctor.units import GiB, parse_size
from kvdoctor.vllm_flags import version_tuple

__all__ = ["LogFollower", "parse_log", "parse_log_file", "parse_line", "redact"]

# --------------------------------------------------------------------------- line prefix

_ANSI_RE = lazy_re(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# Docker json-file/journald style and CRI (containerd/Kubernetes) "stdout F " prefixes.
_TS_PREFIX_RE = lazy_re(
    r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})? (?:(?:stdout|stderr) [FP] )?"
)
_PROC_RE = lazy_re(r"^\(([A-Za-z][\w.\-\[\]]*) pid=(\d{1,10})\) ?")
_LEVEL_RE = lazy_re(
    r"^(DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL) (\d\d-\d\d \d\d:\d\d:\d\d)(?:[.,]\d+)? "
    r"(?:\[[^\]\s]+:\d+\]|[^\s\]]+:\d+\])(?: |$)"
)
_UVICORN_RE = lazy_re(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+")

# "Received request X: prompt: '…', params: …, prompt_token_ids: [...]" (V0 and V1 request log).
_PROMPT_END_RE = lazy_re(r", (?:params|sampling_params|prompt_token_ids|prompt_embeds|lora_request)\b")
_PROMPT_IDS_RE = lazy_re(r"(\bprompt_token_ids: )\[([^\]]*)\]?")


# "Generated response X: output: '…', output_token_ids: [...], finish_reason: stop"
# (--enable-log-outputs): the model's answer is user data as much as the prompt.
_OUTPUT_END_RE = lazy_re(r", (?:output_token_ids|finish_reason)\b")
_OUTPUT_IDS_RE = lazy_re(r"(\boutput_token_ids: )\[([^\]]*)\]?")


def _redact_prompt(text: str, field: str = "prompt: ", end_re: Any = _PROMPT_END_RE) -> str:
    i = text.find(field)
    if i < 0:
        return text
    start = i + len(field)
    q = text[start : start + 1]
    if q in ("'", '"'):
        # The prompt ends at its matching quote: an unescaped quote followed by the next field
        # (", params: …") or the end of the line — a prompt holding ", params: " (or an
        # apostrophe) cannot end it early. No such quote (a truncated line): everything goes.
        n = len(text)
        j = _closing_quote(text, start + 1, q, end_re)
        end = min(j + 1, n)
        body_len = max(0, min(j, n) - start - 1)
        return f"{text[:start]}'<redacted {body_len} chars>'{text[end:]}"
    m = end_re.search(text, start)
    end = m.start() if m else len(text)  # a truncated line: everything after "prompt: " goes
    body = text[start:end]
    if body in ("None", ""):
        return text
    return f"{text[:start]}'<redacted {len(body)} chars>'{text[end:]}"


def _closing_quote(text: str, j: int, q: str, end_re: Any) -> int:
    """The index of the quote ``q`` that closes a quoted field starting before ``j`` (one
    followed by the next field, by ``end_re``, or by the end of the line); ``len(text)`` when
    none does (the field goes on past the line)."""
    n = len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == q and (j + 1 >= n or end_re.match(text, j + 1) or not text[j + 1 :].strip()):
            return j
        j += 1
    return n


def _open_field(text: str) -> tuple[str, Any] | None:
    """(quote, end pattern) when a prompt or output field opens on this line and does not close
    (a prompt logged with raw newlines: its next lines are prompt text too)."""
    for name, end_re in (("prompt: ", _PROMPT_END_RE), ("output: ", _OUTPUT_END_RE)):
        i = text.find(name)
        if i < 0:
            continue
        start = i + len(name)
        q = text[start : start + 1]
        body = text.rstrip("\r\n")
        if q in ("'", '"') and _closing_quote(body, start + 1, q, end_re) >= len(body):
            return q, end_re
    return None


def redact_lines(lines: Iterable[str]) -> Iterator[str]:
    """:func:`redact` over a log's lines (line ends kept), and the continuation lines of a prompt
    or model output logged with raw newlines (a quoted field that does not close on its line)
    replaced by "<redacted N chars>" up to the quote that closes it or the next log record."""
    open_: tuple[str, Any] | None = None
    for line in lines:
        if open_ is not None:
            body = line.rstrip("\r\n")
            nl = line[len(body) :]
            if parse_line(body).level is not None:
                open_ = None  # a new log record: the field was cut short
            else:
                q, end_re = open_
                j = _closing_quote(body, 0, q, end_re)
                if j >= len(body):
                    yield f"<redacted {len(body)} chars>{nl}"
                    continue
                open_ = None
                rest = redact(body[j:])
                for ids in (_PROMPT_IDS_RE, _OUTPUT_IDS_RE):
                    rest = ids.sub(lambda m: f"{m.group(1)}[<redacted>]", rest)
                yield f"<redacted {j} chars>{rest}{nl}"
                continue
        body = line.rstrip("\r\n")
        yield redact(body) + line[len(body) :]
        if "prompt: " in line or "output: " in line:
            open_ = _open_field(body)


# Cheap gate before the full redaction: every shape kvdoctor.redact handles contains one of these
# (a secret-named key/flag/variable, an Authorization header, a URL password, a token shape).
# "tokens/s" of the stats line is not a secret name, "HF_TOKEN" and "--hf-token" are.
_SECRET_NEEDLES = (
    "key",
    "secret",
    "pass",
    "pwd",
    "credential",
    "auth",
    "cookie",
    ":/",
    "@",
    "hf_",
    "sk-",
    "xox",
    "akia",
    "github_pat",
    "ghp_",
    "gho_",
    "ghu_",
    "ghs_",
    "ghr_",
)
_TOKEN_NAME_RE = lazy_re(r"token(?!s)")


def _maybe_secret(text: str) -> bool:
    low = text.lower()
    for n in _SECRET_NEEDLES:  # a loop, not any(genexpr): this runs on every event's text
        if n in low:
            return True
    return "token" in low and _TOKEN_NAME_RE.search(low) is not None


def redact(text: str) -> str:
    """Return ``text`` with secrets and prompt text replaced.

    Secrets (``--api-key X``, ``api_key='X'``, ``'api_key': 'X'``, ``*_TOKEN``/``*_KEY`` values,
    Authorization headers, token shapes) go through :func:`kvdoctor.redact.redact_text` → "***";
    the prompt of vLLM's request log ("Received request …: prompt: '…'") and the model's answer
    ("Generated response …: output: '…'", --enable-log-outputs) become "<redacted N chars>" and
    their token ids "<redacted N tokens>". Never raises.
    """
    if "prompt" in text:
        text = _redact_prompt(text)
    if "output: " in text and "Generated response" in text:
        text = _redact_prompt(text, "output: ", _OUTPUT_END_RE)
        text = _OUTPUT_IDS_RE.sub(
            lambda m: (
                f"{m.group(1)}[<redacted {len([t for t in m.group(2).split(',') if t.strip()])} tokens>]"
            ),
            text,
        )
    if "prompt_token_ids" in text:  # the regex's own words: most lines never run it
        text = _PROMPT_IDS_RE.sub(
            lambda m: (
                f"{m.group(1)}[<redacted {len([t for t in m.group(2).split(',') if t.strip()])} tokens>]"
            ),
            text,
        )
    return redact_text(text) if _maybe_secret(text) else text


@shared_methods
@dataclass(repr=False, eq=False)
class ParsedLine:
    """One physical log line split into its parts (see :func:`parse_line`)."""

    message: str
    process: str | None = None
    pid: int | None = None
    level: str | None = None
    time: str | None = None
    #: True for lines written by vLLM's formatter (they carry level and time).
    formatted: bool = False
    #: the node a collector prefix named (journald hostname, Ray ``ip=``), else None.
    host: str | None = None


def parse_line(raw: str) -> ParsedLine:
    """Strip ANSI codes, runtime timestamps, the ``(NAME pid=N)`` prefix and the
    ``LEVEL MM-DD HH:MM:SS [file.py:NNN]`` header (vllm-facts.md §3.1) from one physical line.

    Tolerates any text (never raises); a line without a prefix keeps its whole text as message.
    """
    line = raw.rstrip("\r\n")
    if len(line) > MAX_LINE_CHARS:
        line = line[:MAX_LINE_CHARS]  # before any regex: no real vLLM line is this long
    if "\r" in line:  # tqdm progress bars redraw with CR: the last redraw is what stays visible
        line = line.rstrip("\r").rsplit("\r", 1)[-1]
    if "\x1b" in line:
        line = _ANSI_RE.sub("", line)
    line, host = strip_prefixes(line)  # compose / kubectl / journald / Ray (log_prefixes)
    if line[:2] == "20" and line[4:5] == "-":
        m = _TS_PREFIX_RE.match(line)
        if m:
            line = line[m.end() :]
    process = pid = None
    if line.startswith("("):
        m = _PROC_RE.match(line)
        if m:
            process, pid = m.group(1), int(m.group(2))
            line = line[m.end() :]
    level = time = None
    formatted = False
    c = line[:1]
    if c in ("D", "I", "W", "E", "C"):
        m = _LEVEL_RE.match(line)
        if m:
            level = "WARNING" if m.group(1) == "WARN" else m.group(1)
            time = m.group(2)
            formatted = True
            line = line[m.end() :]
        else:
            m = _UVICORN_RE.match(line)
            if m:
                level = m.group(1)
                line = line[m.end() :]
    return ParsedLine(line, process, pid, level, time, formatted, host)


# --------------------------------------------------------------------------- value helpers


def _gib(text: str) -> int:
    """A vLLM "X GiB" number (2**30) as int bytes."""
    return int(round(float(text) * GiB))


def _size(text: str) -> int | None:
    """PyTorch's format_size ("20.00 MiB", "0 bytes") → bytes, None if unreadable."""
    try:
        return parse_size(text)
    except ValueError:
        return None


def _frac(percent: str) -> float:
    """ "99.7" (a percentage) → 0.997, rounded to drop float noise."""
    return round(float(percent) / 100, 6)


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def _split_top(text: str) -> list[str]:
    """Split "a=1, b=[1, 2], c='x, y'" at top-level ", " (brackets and quotes respected)."""
    parts: list[str] = []
    depth = 0
    quote = ""
    start = 0
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 2
                continue
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            # an apostrophe inside a bare word (o'brien) is not a quote
            if i == 0 or not text[i - 1].isalnum():
                quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


_TORCH_DTYPE_RE = lazy_re(r"^torch\.(\w+)$")
_MAX_LITERAL_CHARS = 32 * 1024
# "1if", "0x" … : the shapes that make the compiler print "SyntaxWarning: invalid … literal"
_WARNS_RE = lazy_re(r"\d[A-Za-z_]")
_LONG_DIGITS_RE = lazy_re(r"\d{%d}" % (MAX_DIGITS + 1))  # noqa: UP031


def _literal(text: str) -> Any:
    """ast.literal_eval, bounded: a long or deeply nested text is refused (ValueError) before
    the compiler sees it, and its SyntaxWarnings ("invalid decimal literal") stay quiet."""
    if len(text) > _MAX_LITERAL_CHARS or text.count("[") + text.count("{") + text.count("(") > 2000:
        raise ValueError("literal too large")
    if _LONG_DIGITS_RE.search(text):
        raise ValueError("number with too many digits")
    if "\\" not in text and not _WARNS_RE.search(text):
        return ast.literal_eval(text)  # nothing the compiler would warn about (the common case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.literal_eval(text)


def _value(text: str) -> Any:
    """A Python-literal value if it is one, else the string (``<function …>``, enums, paths)."""
    t = text.strip()
    if not t:
        return ""
    m = _TORCH_DTYPE_RE.match(t)
    if m:
        return m.group(1)
    if t[0] in "'\"[{(-0123456789" or t in ("None", "True", "False"):
        try:
            return _literal(t)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
        if t[0] in "[{":  # compilation_config etc. are printed as JSON (true/false/null)
            try:
                return json.loads(t)
            except (ValueError, RecursionError):
                pass
    if t == "true":
        return True
    if t == "false":
        return False
    if t == "null":
        return None
    return t


def _parse_kv_list(text: str) -> dict[str, Any]:
    """ "k=v, k2=v2" (Namespace(…) body or VllmConfig.__str__) → dict; unparseable parts skipped."""
    out: dict[str, Any] = {}
    for part in _split_top(text):
        key, sep, val = part.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            continue
        out[key] = _value(val)
    return out


def _parse_dict_repr(text: str) -> dict[str, Any]:
    """A Python dict repr → dict; on failure, parse its top-level "'k': v" items one by one."""
    t = text.strip()
    try:
        val = _literal(t)
        if isinstance(val, dict):
            return {str(k): v for k, v in val.items()}
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    if t.startswith("{"):
        t = t[1:]
    if t.endswith("}"):
        t = t[:-1]
    out: dict[str, Any] = {}
    for part in _split_top(t):
        key, sep, val = part.partition(":")
        if not sep:
            continue
        k = key.strip().strip("'\"")
        if k:
            out[k] = _value(val)
    return out


def _strip_unbalanced_paren(text: str) -> str:
    """Drop a trailing ")" that closes nothing (old "… with config: …, seed=0)" lines)."""
    t = text.rstrip()
    if t.endswith(")") and t.count(")") > t.count("("):
        return t[:-1]
    return t


def _redact_args(args: dict[str, Any]) -> dict[str, Any]:
    """Secret-named args (api_key, hf_token, …; kvdoctor.redact.is_secret_name) → "***"."""
    for k in list(args):
        if is_secret_name(k) and args[k] not in (None, "", [], False):
            args[k] = MARK
    return args


#: args that name a server (the run identity kvdoctor compares across restarts): scalars only.
_IDENTITY_ARGS = ("model", "model_tag", "served_model_name", "port", "host")


def _scalar_identity(args: dict[str, Any]) -> dict[str, Any]:
    """``served_model_name: ['qwen3', 'q']`` (vLLM's nargs='+') → its first name, the one vLLM
    serves and labels metrics with; any other identity arg that is not a plain str/number (a
    list, a dict from a garbled line) is dropped, so one odd line never breaks the comparison
    of runs."""
    for k in _IDENTITY_ARGS:
        v = args.get(k)
        if k == "served_model_name" and isinstance(v, (list, tuple)):
            v = args[k] = v[0] if v else None
        if v is not None and not isinstance(v, (str, int, float)):
            del args[k]
    return args


# --------------------------------------------------------------------------- regexes


def _pattern(pattern: str, flags: int = 0) -> tuple[str, int]:
    """A regex of :data:`_RE`, compiled when first used."""
    return pattern, flags


class _LazyPatterns(dict):  # type: ignore[type-arg]
    """The matcher's regex table: name → compiled pattern, each compiled on first lookup (a
    log uses a few dozen of them; compiling all ~75 costs a cold start ~40 ms). Iterating it
    (``items``, ``values``, ``keys``, ``len``, ``in``) compiles it whole, so it reads as a
    plain table of compiled patterns (the regex-hygiene test walks it)."""

    def __init__(self, sources: dict[str, tuple[str, int]]) -> None:
        super().__init__()
        self._sources = sources

    def __missing__(self, key: str) -> re.Pattern[str]:
        pattern = self[key] = re.compile(*self._sources[key])
        return pattern

    def _all(self) -> None:
        for key in self._sources:
            if not dict.__contains__(self, key):
                self[key]  # noqa: B018 - compiles it

    def items(self):  # type: ignore[no-untyped-def, override]
        self._all()
        return super().items()

    def values(self):  # type: ignore[no-untyped-def, override]
        self._all()
        return super().values()

    def keys(self):  # type: ignore[no-untyped-def, override]
        return self._sources.keys()

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __contains__(self, key: object) -> bool:
        return key in self._sources


_RE: _LazyPatterns = _LazyPatterns(
    {
        "api_version": _pattern(r"vLLM API server version (\S+)"),
        "server_version": _pattern(r"vLLM server version (\S+?),? serving model (\S+)"),
        "logo_version": _pattern(r"^\s*[\u2580-\u259f].*\bversion\s+(\S+)\s*$"),
        "init_engine": _pattern(
            r"Initializing (a V1 LLM engine|an LLM engine)(?: \(v?([^)\s]+)\))? with config: (.*)$"
        ),
        "non_default": _pattern(r"non-default args: (\{.*\}?)\s*$"),
        "namespace": _pattern(r"\bargs: Namespace\((.*)\)?\s*$"),
        "chunked": _pattern(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)"),
        "max_len_used": _pattern(r"Using max model len (\d+)"),
        "model_loading": _pattern(
            r"Model loading took (-?\d+(?:\.\d+)?) ?(GiB|GB)(?: memory)? and (\d+(?:\.\d+)?) ?s(?:ec(?:ond)?s?)?"
        ),
        "v0_weights": _pattern(r"Loading model weights took (-?\d+(?:\.\d+)?) ?(GiB|GB)"),
        "v0_prof_1": _pattern(r"^Memory profiling takes (\d+(?:\.\d+)?) seconds\.?\s*$"),
        "v0_prof_2": _pattern(
            r"total_gpu_memory \((\d+(?:\.\d+)?) ?GiB\) x gpu_memory_utilization \((\d+(?:\.\d+)?)\) = (-?\d+(?:\.\d+)?) ?GiB"
        ),
        "v0_prof_3": _pattern(
            r"model weights take (-?\d+(?:\.\d+)?) ?GiB; non_torch_memory takes (-?\d+(?:\.\d+)?) ?GiB; "
            r"PyTorch activation peak memory takes (-?\d+(?:\.\d+)?) ?GiB; "
            r"the rest of the memory reserved for KV Cache is (-?\d+(?:\.\d+)?) ?GiB"
        ),
        "v06_prof": _pattern(r"(?i)memory profiling results:(.*)$"),
        "v06_field": _pattern(r"(?<!\w)(\w{1,64})=(-?\d{1,20}(?:\.\d{1,20})?) ?(GiB|GB)?", re.I),
        "v1_prof": _pattern(r"Memory profiling takes (\d+(?:\.\d+)?) seconds\. ?(.*)$"),
        "v1_prof_field": _pattern(r"([A-Za-z][\w \-()]{0,100}?): (-?\d{1,20}(?:\.\d{1,20})?) ?GiB"),
        "mem_request": _pattern(
            r"Initial free memory: (-?\d+(?:\.\d+)?) ?GiB; Requested memory: (\d+(?:\.\d+)?) \(util\), (-?\d+(?:\.\d+)?) ?GiB"
        ),
        "avail_kv": _pattern(r"Available KV cache memory: (-?\d+(?:\.\d+)?) ?GiB"),
        "kv_size": _pattern(r"(\w{1,16}) KV cache size: ([\d,]{1,40}) tokens"),
        "max_conc": _pattern(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.,]+)x"),
        "blocks_override": _pattern(r"Overriding num_gpu_blocks=(\d+) with num_gpu_blocks_override=(\d+)"),
        "v0_blocks": _pattern(r"# (\w+) blocks: (\d+), # CPU blocks: (\d+)"),
        "capture_done": _pattern(
            r"Graph capturing finished in (\d+(?:\.\d+)?) secs?(?:, took (-?\d+(?:\.\d+)?) ?GiB)?"
        ),
        "cg_estimate": _pattern(r"Estimated CUDA graph memory: (-?\d+(?:\.\d+)?) ?GiB"),
        "cg_pool": _pattern(
            r"CUDA graph pool memory: (-?\d+(?:\.\d+)?) ?GiB \(actual\), (-?\d+(?:\.\d+)?) ?GiB \(estimated\)"
        ),
        "cg_enabled": _pattern(
            r"--gpu-memory-utilization=(\d+(?:\.\d+)?) is equivalent to --gpu-memory-utilization=(\d+(?:\.\d+)?) "
            r"without CUDA graph memory profiling.*?increase --gpu-memory-utilization to (\d+(?:\.\d+)?)"
        ),
        "cg_disabled": _pattern(
            r"increasing --gpu-memory-utilization from (\d+(?:\.\d+)?) to (\d+(?:\.\d+)?)"
        ),
        "summary_head": _pattern(
            r"Free memory on device (?:\S+ )?\((-?\d+(?:\.\d+)?)/(\d+(?:\.\d+)?) GiB\) on startup\. "
            r"Desired GPU memory utilization is \((\d+(?:\.\d+)?), (-?\d+(?:\.\d+)?) GiB\)"
        ),
        "summary_consumed": _pattern(r"(?<![\d.])(-?\d{1,20}(?:\.\d{1,20})?) GiB for consumed memory"),
        "summary_weight": _pattern(r"(?<![\d.])(-?\d{1,20}(?:\.\d{1,20})?) GiB for weights?\b"),
        "summary_act": _pattern(r"(?<![\d.])(-?\d{1,20}(?:\.\d{1,20})?) GiB for peak activation"),
        "summary_nontorch": _pattern(r"(?<![\d.])(-?\d{1,20}(?:\.\d{1,20})?) GiB for non-torch memory"),
        "summary_cg": _pattern(r"(?<![\d.])(-?\d{1,20}(?:\.\d{1,20})?) GiB for CUDAGraph memory"),
        "summary_kvmem": _pattern(r"--kv-cache-memory=(-?\d+)"),
        "summary_inuse": _pattern(r"kv cache memory in use is (-?\d+(?:\.\d+)?) ?(GiB|bytes)?", re.I),
        "kv_reserved": _pattern(
            r"Initial free memory (-?\d+(?:\.\d+)?) ?GiB, reserved (-?\d+(?:\.\d+)?) ?GiB memory for KV Cache"
        ),
        "below_util": _pattern(
            r"Free memory on device (?:(\S+) )?\((-?\d+(?:\.\d+)?)/(\d+(?:\.\d+)?) GiB\) on startup is less than "
            r"desired GPU memory utilization \((\d+(?:\.\d+)?), (-?\d+(?:\.\d+)?) GiB\)"
        ),
        "ext_device": _pattern(r"on device (?:(\S+) )?\((-?\d+(?:\.\d+)?)/(\d+(?:\.\d+)?) GiB\)"),
        "ext_util": _pattern(r"\((\d+(?:\.\d+)?), (-?\d+(?:\.\d+)?) GiB\)"),
        "prof_assert": _pattern(
            r"Error in memory profiling\. Initial free memory (-?\d+(?:\.\d+)?) ?(GiB)?, current free memory (-?\d+(?:\.\d+)?) ?(GiB)?"
        ),
        "max_seq_v1": _pattern(
            r"To serve at least one request with the models?'s max seq len \((\d+)\), \((-?\d+(?:\.\d+)?) GiB KV cache "
            r"is needed, which is larger than the available KV cache memory \((-?\d+(?:\.\d+)?) GiB\)\.\s*"
            r"(?:Based on the available memory, the estimated maximum model length is (\d+)\.)?"
        ),
        "max_seq_v0": _pattern(
            r"The model's max seq len \((\d+)\) is larger than the maximum number of tokens that can be stored "
            r"in KV cache \((-?\d+)\)"
        ),
        "autofit_reduced": _pattern(r"Auto-fit max_model_len: reduced from (\d+) to (\d+)"),
        "autofit_full": _pattern(r"Auto-fit max_model_len: full model context length (\d+) fits"),
        "user_max_len": _pattern(
            r"User-specified max_model_len \((\d+)\) is greater than the derived max_model_len \((?:(\w+)=)?(\w+)"
        ),
        "prompt_len": _pattern(
            r"The (?:decoder|encoder) prompt \(length (\d+)\) (?:plus the number of requested output tokens "
            r"\(at least \d+\) )?is longer than the maximum model length of (\d+)"
        ),
        "ctx_len": _pattern(
            r"This model's maximum context length is (\d+) tokens\. However, (?:your prompt contains (?:at least )?"
            r"(\d+) input tokens|you requested (\d+) tokens)"
        ),
        "input_too_long": _pattern(r"Input prompt \((\d+) tokens\) is too long and exceeds limit of (\d+)"),
        "oom_modern": _pattern(
            r"Tried to allocate ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8})\. GPU (\d+) has a total capac(?:i)?ty of ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) "
            r"of which ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) is free\."
        ),
        "oom_legacy": _pattern(
            r"Tried to allocate ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) \(GPU (\d+); ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) total capacity; ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) already "
            r"allocated; ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) free; (?:((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) allowed; )?((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) reserved in total by PyTorch"
        ),
        "oom_proc": _pattern(
            r"Process (\d+) has ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) memory in use"
        ),
        "oom_self": _pattern(
            r"Including non-PyTorch memory, this process has ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) memory in use"
        ),
        "oom_allowed": _pattern(r"((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) allowed;"),
        "oom_alloc": _pattern(
            r"Of the allocated memory ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) is allocated by PyTorch, (?:with ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) allocated in "
            r"private pools \(e\.g\., CUDA Graphs\), )?and ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8}) is reserved by PyTorch but unallocated"
        ),
        "oom_requested": _pattern(r"Requested size: ((?<![\d.])\d{1,20}(?:\.\d{1,20})? ?[A-Za-z]{1,8})"),
        "sampler_oom": _pattern(
            r"CUDA out of memory occurred when warming up (?:sampler|pooler) with (\d+) dummy"
        ),
        "kv_dtype_pyd": _pattern(r"Invalid kv_cache_dtype: '([^']*)'\. Valid values are: (\[[^\]]*\])"),
        "kv_dtype_arg": _pattern(
            r"argument --kv-cache-dtype: invalid choice: '([^']*)' \(choose from (.*?)\)\s*$"
        ),
        "stats_engine": _pattern(r"^(?:Engine (\d+)|(\d+) Engines Aggregated):"),
        "st_prompt": _pattern(r"Avg prompt throughput: (\d+(?:\.\d+)?) tokens/s"),
        "st_gen": _pattern(r"Avg generation throughput: (\d+(?:\.\d+)?) tokens/s"),
        "st_running": _pattern(r"Running: (\d+) reqs"),
        "st_waiting": _pattern(r"Waiting: (\d+) reqs"),
        "st_swapped": _pattern(r"Swapped: (\d+) reqs"),
        "st_pending": _pattern(r"Pending: (\d+) reqs"),
        "st_deferred": _pattern(r"Deferred: (\d+) reqs"),
        "st_preempt": _pattern(r"Preemptions: (\d+)"),
        "st_kv": _pattern(r"([A-Z]{1,8}) KV cache usage: (\d{1,20}(?:\.\d{1,20})?)%"),
        "st_prefix": _pattern(
            r"(?<!External )(?<!external )Prefix cache hit rate: (?:GPU: )?(\d+(?:\.\d+)?)%"
        ),
        "preempted": _pattern(
            r"is preempted by (?:PreemptionMode\.)?(\w+) mode because there is not enough KV cache space.*?"
            r"total_num_cumulative_preemption=(\d+)"
        ),
        "swap": _pattern(
            r"(Possibly too|Too) large swap space\. (\d+(?:\.\d+)?) GiB out of the (\d+(?:\.\d+)?) GiB total CPU memory"
        ),
        "hybrid_bs": _pattern(r"Setting attention block size to (\d+) tokens"),
        # "RuntimeError: NCCL error …", "torch.distributed.DistBackendError: …": a dotted class
        # name ending in Error/Exception at the start of a traceback line (bounded: ≤ 8 dots)
        "exception_line": _pattern(
            r"((?:[A-Za-z_]\w{0,60}\.){0,8}[A-Za-z_]\w{0,80}(?:Error|Exception))(?::|$)"
        ),
        "mamba_pad": _pattern(r"Padding mamba page size by (\d+(?:\.\d+)?)%"),
        "pad_layers": _pattern(r"Add (\d+) padding layers, may waste at most (\d+(?:\.\d+)?)%"),
    }
)

#: the words each stats field's regex (``_RE["st_*"]``) starts with.
_STATS_WORDS = {
    "st_prompt": "Avg prompt throughput: ",
    "st_gen": "Avg generation throughput: ",
    "st_running": "Running: ",
    "st_waiting": "Waiting: ",
    "st_swapped": "Swapped: ",
    "st_pending": "Pending: ",
    "st_deferred": "Deferred: ",
    "st_preempt": "Preemptions: ",
    "st_prefix": "Prefix cache hit rate: ",
}

#: characters of a traceback's exception line kept in an ``exception`` event (redacted)
_EXCEPTION_CHARS = 300

_ERROR_KINDS = frozenset(
    {
        "cuda_oom",
        "cuda_error_oom",
        "sampler_warmup_oom",
        "load_model_oom",
        "free_memory_below_util",
        "profiling_assertion",
        "no_available_kv_memory",
        "max_seq_len_exceeds_kv",
        "v0_max_seq_len_exceeds_kv",
        "autofit_failed",
        "user_max_model_len_too_large",
        "invalid_kv_cache_dtype",
        "engine_failed",
    }
)
# catalogue-2 errors (sources/log_catalogue2.py) are kept once per failure too
_ERROR_KINDS |= log_catalogue2.ERROR_KINDS
# vLLM 0.34's errors (sources/log_v034.py) too
_ERROR_KINDS |= log_v034.ERROR_KINDS
# Kinds that move a process through startup (phase tracking for cuda_oom).
_PHASE_OF = {
    "weights_loading_start": "weight_loading",
    "model_loading": "profile_run",
    "memory_profile_v0": "kv_cache_init",
    "memory_profile_v1": "kv_cache_init",
    "available_kv_memory": "kv_cache_init",
    "kv_cache_size": "kv_cache_init",
    "max_concurrency": "kv_cache_init",
    "v0_blocks": "kv_cache_init",
    "kv_cache_memory_bytes_reserved": "kv_cache_init",
    "graph_capture_start": "cuda_graph_capture",
    "graph_capture_done": "kv_cache_init",
}
_SERVING_NEEDLES = (
    "Application startup complete",
    "Starting vLLM API server",
    "Starting vLLM server on",
    "Uvicorn running on",
    "Received request",
    *log_catalogue2.SERVING_NEEDLES,
    "Added request",
    '"POST /v1/',
)
#: Messages of vLLM's request log and uvicorn's access log — the bulk of a serving log. They
#: carry no event (a prompt's text must never become one), so only the serving marker is read.
_REQUEST_PREFIXES = ("Received request ", "Added request ", "Finished request ", "Aborted request ")
_ACCESS_RE = lazy_re(r'[\w.:\[\]-]{1,64}:\d{1,5} - "')
# A plain INFO/DEBUG/WARNING request-log or access-log line (vllm-facts §3.1 header, then one of
# the messages above), in pieces: the chunk scanner puts a file's own literal process prefixes
# and file tags in front of the general pieces (_scan_re).
_BULK_PROC = r"\([A-Za-z][\w.\-\[\]]* pid=\d{1,10}\) ?"
_BULK_TAG = r"\[[^\]\s]+:\d+\]|[^\s\]]+:\d+\]"
_BULK_MSG = (
    r'(?:Received request |Added request |Finished request |Aborted request |[\w.:\[\]-]{1,64}:\d{1,5} - "'
    r"|(?:Engine \d+: )?Avg prompt throughput: )"
)
_BULK_LEVEL_TIME = r"(?:DEBUG|INFO|WARNING|WARN) \d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)? "
_BULK_BODY = rf"(?:{_BULK_PROC})?(?:{_BULK_LEVEL_TIME}(?:{_BULK_TAG}) |(?:DEBUG|INFO|WARNING):\s+){_BULK_MSG}"
#: A line that is NOT a plain INFO/DEBUG/WARNING request-log or access-log line, found after
#: its newline: anything else goes through the full parser. One pass at C speed (the literal
#: "\n" first), so a 200 MB log of request lines is read at a few times line iteration.
_NOT_REQUEST_LINE_RE = lazy_re(rf"\n(?!{_BULK_BODY})")
#: The same line from its start, the process prefix and the file tag captured (what the chunk
#: scanner learns a file's literal prefixes from).
_BULK_LINE_RE = lazy_re(
    rf"(?P<proc>{_BULK_PROC})?(?:{_BULK_LEVEL_TIME}(?P<tag>{_BULK_TAG}) |(?:DEBUG|INFO|WARNING):\s+){_BULK_MSG}"
)
#: vLLM's line header in pieces, its parts captured as :func:`parse_line` takes them
#: (:data:`_PROC_RE`, :data:`_LEVEL_RE`): the optional "(NAME pid=N) " and "LEVEL MM-DD HH:MM:SS ".
_HEAD_PROC = r"(?:\((?P<proc>[A-Za-z][\w.\-\[\]]*) pid=(?P<pid>\d{1,10})\) ?)?"
_HEAD_LEVEL_TIME = r"(?P<level>DEBUG|INFO|WARNING|WARN) (?P<time>\d\d-\d\d \d\d:\d\d:\d\d)(?:[.,]\d+)? "
#: A plain request-log line that gives a ``request`` event ("Received request …" / "Added request
#: …" after the header), its header's parts captured: exactly what :func:`parse_line` takes from
#: such a line (:data:`_PROC_RE`, :data:`_LEVEL_RE`, :data:`_UVICORN_RE` on the bulk form).
_REQUEST_LINE_RE = lazy_re(
    rf"{_HEAD_PROC}(?:{_HEAD_LEVEL_TIME}(?:{_BULK_TAG}) |(?P<ulevel>DEBUG|INFO|WARNING):\s+)"
    r"(?:Received|Added) request "
)
# The literal fast path's own pieces: each a subset of the general piece it stands before.
_FAST_TIME = r"[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9](?:[.,][0-9]+)? "
_FAST_MSG = (
    r'(?:Received request |Added request |Finished request |Aborted request |[0-9.]{7,15}:[0-9]{1,5} - "'
    r"|Engine [0-9]+: Avg prompt throughput: |Avg prompt throughput: )"
)
_SCAN_MAX_PROCS = 8
_SCAN_MAX_TAGS = 16
_SCAN_SAMPLES = 16


@functools.lru_cache(maxsize=32)
def _scan_re(procs: tuple[str, ...], tags: tuple[str, ...]) -> re.Pattern[str]:
    """:data:`_NOT_REQUEST_LINE_RE` with a fast path in front: a file's own process prefixes
    (``procs``, "" for none) and file tags (``tags``) as literals, tried before the general
    pieces. The fast alternatives are subsets of the general body, so the set of lines found is
    exactly the general pattern's; only the time to reject a bulk line changes (literals and
    ``[0-9]`` instead of ``\\w``/``\\d`` classes: a few times faster in ``re``)."""
    if not procs:
        return _NOT_REQUEST_LINE_RE.compiled
    p = "|".join(re.escape(x) for x in procs)
    fast = [f"(?:{p})INFO: +{_FAST_MSG}"]
    if tags:
        t = "|".join(re.escape(x) for x in tags)
        fast.insert(0, f"(?:{p})(?:INFO|DEBUG|WARNING) {_FAST_TIME}(?:{t}) {_FAST_MSG}")
    return re.compile(rf"\n(?!{'|'.join(fast)}|{_BULK_BODY})")


class _BulkScan:
    """The process prefixes and file tags of one file's bulk lines, learnt from a few sampled
    lines per chunk (bounded: :data:`_SCAN_MAX_PROCS`, :data:`_SCAN_MAX_TAGS`), and the scan
    regex built from them (:func:`_scan_re`)."""

    __slots__ = ("procs", "tags")

    def __init__(self) -> None:
        self.procs: tuple[str, ...] = ()
        self.tags: tuple[str, ...] = ()

    def pattern(self, text: str, pos: int) -> re.Pattern[str]:
        """The scan regex for ``text[pos:]`` after sampling :data:`_SCAN_SAMPLES` of its lines."""
        end = len(text)
        step = max(1, (end - pos) // _SCAN_SAMPLES)
        match = _BULK_LINE_RE.match
        for k in range(_SCAN_SAMPLES):
            at = pos + k * step
            if at > end:
                break
            start = max(pos, text.rfind("\n", 0, at) + 1)
            m = match(text, start)
            if m is None:
                continue
            proc = m.group("proc") or ""
            if proc not in self.procs and len(self.procs) < _SCAN_MAX_PROCS:
                self.procs += (proc,)
            tag = m.group("tag")
            if tag is not None and tag not in self.tags and len(self.tags) < _SCAN_MAX_TAGS:
                self.tags += (tag,)
        return _scan_re(self.procs, self.tags)


# traceback frames of CUDA graph capture (V0 capture_model/graph_runner.capture, V1 _capture_cudagraphs)
_CAPTURE_HINTS = (
    "profile_cudagraph_memory",  # ≥ 0.18: graph memory profiled in determine_available_memory
    "capture_model",
    "graph_runner.capture",
    "_capture_cudagraphs",
    "capture_graphs",
    "cudagraph capture",
)
_WEIGHT_HINTS = ("load_model", "load_weights", "get_model(", "init_model", "Failed to load model")
_PROFILE_HINTS = ("profile_run", "determine_num_available_blocks", "determine_available_memory")
#: traceback text → the ``hints`` of a cuda_oom event (what code ran out of memory).
_OOM_HINTS: dict[str, tuple[str, ...]] = {
    "logprobs": ("logprobs", "log_softmax", "_get_logprobs", "_get_prompt_logprob"),
    "sampler": ("sampler.py", "_sample(", "self.sampler(", "Sampler.forward"),
    "prefill": ("prefill", "_prepare_prompt", "context_attention_fwd"),
    "multimodal": (
        "get_multimodal_embeddings",
        "embed_multimodal",
        "_execute_mm_encoder",
        "mm_encoder",
        "multi_modal",
        "multimodal",
        "vision_tower",
        "get_image_features",
        "pixel_values",
        "image_encoder",
        "visual(",
    ),
}
#: lines that quote a request's parameters or configuration, not code that ran out of memory.
_PARAMS_RE = lazy_re(
    r"SamplingParams\(|Received request|Added request|\blogprobs=|prompt_logprobs=|chunked prefill|enable_chunked_prefill"
)
#: traceback frames of an offline engine's run-time step (LLM.generate → engine step → model).
_OFFLINE_FRAMES = (", in generate", ", in _run_engine", ", in chat", ", in encode", ", in embed")
_STEP_FRAMES = (", in step", ", in execute_model")
#: 0.34's warm-up before the extensible KV cache is sized (v1/worker/gpu/warmup.py, gpu_worker.py)
_KV_SIZING_WARMUP_FRAMES = (", in run_kv_cache_sizing_warmup", ", in warmup_kernels")
_CROSS_PROCESS_WINDOW = 2000  # lines within which a re-print by another process is the same failure


def _version_tuple(version: str) -> tuple[int, ...]:
    return version_tuple(version) or ()


def _is_worker(process: str | None) -> bool:
    return process is not None and ("Worker" in process or process.startswith("RayWorker"))


def _hints(block: _Block) -> list[str]:
    # Only the failing process's traceback and error text: a request's params repr
    # ("logprobs=None, prompt_logprobs=None") or a chunked-prefill note is no hint.
    low = "\n".join(t for t in block.text if not _PARAMS_RE.search(t)).lower()
    return sorted(tag for tag, needles in _OOM_HINTS.items() if any(n.lower() in low for n in needles))


@shared_methods
@dataclass(repr=False, eq=False)
class _Block:
    """A run of one process's error/traceback lines (ended by that process's next normal line)."""

    id: int
    text: list[str] = field(default_factory=list)
    #: cuda_oom events raised in this block with the process state and serving flag at the time.
    ooms: list[tuple[LogEvent, str, bool]] = field(default_factory=list)


class _History:
    """The events of one kind in the current run, bounded: the first ``head`` and the last
    ``tail`` (a deque), so a days-long run of periodic lines keeps its start and its end, and
    those ``pinned`` before an error (:meth:`pin`), so what led up to it stays whatever follows.
    Stats dropped hand their preemption count to the oldest kept tail event (``carry``, added
    when the history is read), so the run's preemption total stays exact."""

    __slots__ = ("head", "tail", "pinned", "head_max", "carry", "fresh")

    def __init__(self, head_max: int, tail_max: int) -> None:
        # (emission number, event): merging kinds back keeps the order events were made in
        self.head: list[tuple[int, LogEvent | _Request | _Stats]] = []
        self.tail: deque[tuple[int, LogEvent | _Request | _Stats]] = deque(maxlen=tail_max)
        self.pinned: deque[tuple[int, LogEvent | _Request | _Stats]] = deque()
        self.head_max = head_max
        self.carry = 0  # preemptions of the stats dropped so far
        self.fresh = 0  # tail events added since the last pin

    def _drop(self, old: LogEvent | _Request | _Stats) -> None:
        if isinstance(old, _Stats):
            self.carry += old.own_preemptions()  # nothing is handed to a kept one yet
        elif isinstance(old, LogEvent) and old.kind == "stats":
            self.carry += old.values.get("preemptions") or 0

    def add(self, seq: int, ev: LogEvent | _Request | _Stats) -> None:
        if len(self.head) < self.head_max:
            self.head.append((seq, ev))
            return
        tail = self.tail
        if len(tail) == tail.maxlen:  # the append drops the oldest
            self._drop(tail[0][1])
        tail.append((seq, ev))
        self.fresh += 1

    def pin(self, n: int) -> None:
        """Keep the last ``n`` events of the tail for good (an error follows them), those added
        since the last pin only; at most :data:`_MAX_PINNED`, the oldest pins going first.
        They are made now, so a pin holds no line text (a request line may be 64 KiB)."""
        moved = [self.tail.pop() for _ in range(min(n, len(self.tail), self.fresh))]
        self.fresh = 0
        self.pinned.extend(
            (seq, ev if isinstance(ev, LogEvent) else ev.event()) for seq, ev in reversed(moved)
        )
        while len(self.pinned) > _MAX_PINNED:
            self._drop(self.pinned.popleft()[1])

    def items(self) -> list[tuple[int, LogEvent | _Request | _Stats]]:
        """Head, pins and tail in order, the dropped stats' preemptions handed to the oldest
        tail event (once: the carry is spent)."""
        if self.carry and (self.tail or self.pinned):
            first = self.tail[0][1] if self.tail else self.pinned[-1][1]
            if isinstance(first, _Stats):
                first.extra += self.carry
            elif isinstance(first, LogEvent):
                first.values["preemptions"] = (first.values.get("preemptions") or 0) + self.carry
            self.carry = 0
        return self.head + list(self.pinned) + list(self.tail)


#: events of these kinds kept from just before each error (request: derive's in-flight and
#: 5-second burst look-back; stats: the engines' last lines before it), and pins kept per kind.
_PINNED_BEFORE_ERROR = {"request": 256, "stats": 64}
_MAX_PINNED = 4096


class _Request(NamedTuple):
    """A ``request`` event not made yet: a serving log has millions of request lines and the
    run's history keeps a thousand (:class:`_History`), so the prompt is counted and the
    LogEvent made for those kept only (:meth:`_Parser._flush_history`). ``match`` is
    :data:`_REQUEST_LINE_RE` on the line, whose header it read."""

    line: int
    match: re.Match[str]

    def event(self) -> LogEvent:
        """The ``request`` event: its prompt's length in tokens (the token-id list counted)."""
        m = self.match
        raw = m.string
        n = request_prompt_tokens(raw if len(raw) <= MAX_LINE_CHARS else raw[:MAX_LINE_CHARS])
        proc, pid, level, time_, ulevel = m.group("proc", "pid", "level", "time", "ulevel")
        if level is None:
            level = ulevel
        elif level == "WARN":
            level = "WARNING"
        return LogEvent(
            kind="request",
            line=self.line,
            values={"prompt_tokens": n},
            text=f"request with a {n}-token prompt",
            process=proc,
            pid=int(pid) if pid is not None else None,
            level=level,
            time=time_,
        )


#: per run and kind, events kept in a bounded parse (head + tail); stats lines come every 10 s.
_HISTORY_LIMITS: dict[str, tuple[int, int]] = {"stats": (1000, 9000)}
_HISTORY_DEFAULT = (200, 800)
#: events kept over all runs of one file; the oldest runs' events go first.
_MAX_LOG_EVENTS = 60_000
#: open traceback blocks (one per process) and per-process state entries kept.
_MAX_BLOCKS = 64
_MAX_PROCESS_KEYS = 4096


_NO_PAREN_RE = lazy_re(r"\n[^(]")


def _next_closer(text: str, pos: int, stop: int, key: Any) -> int:
    """The first line start in ``text[pos:stop]`` whose process key may be ``key`` (``(NAME,
    pid)`` → the line starts with "(NAME pid="; None → it starts with no "("), else ``stop``."""
    if key is None:
        if pos < len(text) and text[pos] != "(":
            return pos
        m = _NO_PAREN_RE.search(text, pos, stop)
        return m.start() + 1 if m else stop
    needle = f"({key[0]} pid="
    if text.startswith(needle, pos):
        return pos
    i = text.find("\n" + needle, pos, stop)
    return i + 1 if i >= 0 else stop


class _Parser:
    """Stateful line-by-line parser shared by :func:`parse_log` and :class:`LogFollower`.

    ``bounded`` (a whole file): the state stays bounded whatever the input size — the current
    run's events of each kind as a head and a tail (:class:`_History`), at most
    :data:`_MAX_LOG_EVENTS` events over all runs, a bounded set of open traceback blocks.
    """

    def __init__(self, origin: str = "", *, bounded: bool = False) -> None:
        self.bounded = bounded
        self._history: dict[str, _History] = {}
        self._seq = 0
        #: events emitted so far (a follower takes the new ones from the end of ``log.events``)
        self.emitted = 0
        self.log = VllmLog(origin=origin)
        self.lineno = 0
        self._gen_strong = False
        self._explicit: list[str] = []
        self._pending_v0: dict[Any, dict[str, Any]] = {}
        self._state: dict[Any, str] = {}
        self._global_state = "startup"
        self._serving = False
        self._capturing: set[Any] = set()
        self._weights: dict[Any, int] = {}
        self._blocks: dict[Any, _Block] = {}
        self._block_seq = 0
        self._seen_errors: dict[tuple[Any, ...], list[tuple[Any, str | None, int, int]]] = {}
        self._new: list[LogEvent] = []
        self._scan = _BulkScan()
        #: lines whose text made a matcher fail (skipped, no event)
        self.bad_lines = 0

    # ------------------------------------------------------------------ feeding

    def feed(self, raw: str) -> list[LogEvent]:
        """Parse the next physical line; return the events it completed (file order)."""
        self.lineno += 1
        self.log.line_count = self.lineno
        if len(self._state) > _MAX_PROCESS_KEYS or len(self._weights) > _MAX_PROCESS_KEYS:
            self._state.clear()  # a flood of distinct (NAME pid=N) prefixes: state stays bounded
            self._weights.clear()
            self._pending_v0.clear()
            self._capturing.clear()
        self._new = []
        try:
            pl = parse_line(raw)
        except Exception:
            self.bad_lines += 1  # a line its header parse failed on costs that line
            return self._new
        key = (pl.process, pl.pid) if pl.process else None
        # Tracebacks are ERROR lines or unprefixed raw lines; a normal line ends the block.
        normal = pl.level in ("DEBUG", "INFO", "WARNING")
        block = self._blocks.get(key)
        if normal:
            if block is not None:
                self._close_block(key)
                block = None
        else:
            if block is None:
                if len(self._blocks) >= _MAX_BLOCKS:
                    self._close_block(next(iter(self._blocks)))  # the oldest open block
                self._block_seq += 1
                block = self._blocks[key] = _Block(self._block_seq)
            block.text.append(pl.message[:2000])  # hints and phases look for short frame names
            if len(block.text) > 400:
                del block.text[:100]
        if pl.process and pl.process.startswith("EngineCore") and not self._gen_strong:
            self.log.engine_generation = "v1"
        try:
            self._match(pl, key, block)
            if block is not None:
                self._match_exception(pl, key)
        except Exception:
            # A half-written or mangled line costs that line, never the file: it gives no event.
            self.bad_lines += 1
        return self._new

    def _match_exception(self, pl: ParsedLine, key: Any) -> None:
        """The exception line of a traceback ("RuntimeError: NCCL error …"), after the line's
        other events (an OOM is also a cuda_oom): engine-crashed quotes the last one."""
        msg = pl.message
        if len(msg) < 8 or msg[0] == " " or not ("Error" in msg[:120] or "Exception" in msg[:120]):
            return
        m = _RE["exception_line"].match(msg)
        if m:
            self._emit(
                "exception",
                pl,
                key,
                {"exception": m.group(1)[-120:], "serving": self._serving},
                text=redact(msg[:_EXCEPTION_CHARS]),
            )

    def feed_chunk(self, text: str) -> None:
        """Parse a chunk of whole lines ("\\n"-joined), the same as :meth:`feed` on each line,
        at C speed for the lines that cannot matter.

        Only a plain INFO/DEBUG/WARNING request-log or access-log line (:data:`_BULK_LINE_RE`)
        can be skipped, and only while the server serves, no traceback block is open, and the
        line holds none of "\\r", "\\x1b", "prompt_token_ids: [" (a prompt length is an event)
        or, before the engine generation is known, "EngineCore": :meth:`feed` on such a line
        changes nothing but the line count. Everything else goes through :meth:`feed`. Skipped
        lines are found by ``str.find`` and one regex pass over the chunk with the file's own
        prefixes as literals (:class:`_BulkScan`), so a 200 MB log of request lines is read at
        a few times the speed Python iterates its lines.
        """
        end = len(text)
        pos = 0  # start of the next line not yet fed or counted
        feed = self.feed

        def line_at(start: int) -> tuple[str, int]:
            stop = text.find("\n", start)
            if stop < 0:
                stop = end
            return text[start:stop], stop + 1

        while pos <= end and not self._serving:  # startup: every line counts (a few hundred)
            line, pos = line_at(pos)
            feed(line)
        if pos > end:
            return
        starts: set[int] = set()
        find, rfind = text.find, text.rfind

        def lines_with(word: str, into: set[int]) -> None:
            i = find(word, pos)
            while i >= 0:
                into.add(rfind("\n", 0, i) + 1)
                nl = find("\n", i)
                i = find(word, nl) if nl >= 0 else -1

        for word in ("\r", "\x1b") if self._gen_strong else ("\r", "\x1b", "EngineCore"):
            lines_with(word, starts)  # parse_line would see another message
        # "prompt_token_ids: [": a request line's prompt length is an event (its count, no
        # text); "prompt_token_ids: None" gives none, like every other request line.
        requests: set[int] = set()
        lines_with("prompt_token_ids: [", requests)
        # the periodic stats line: each one is looked at, its usual form read by one match
        stats: set[int] = set()
        lines_with("Avg prompt throughput: ", stats)
        scan = self._scan.pattern(text, pos)
        if pos:  # text[pos - 1] is the newline before the line at pos
            starts.update(m.start() + 1 for m in scan.finditer(text, pos - 1))
        else:
            starts.update(m.start() for m in scan.finditer("\n" + text))
        plain_requests = requests - starts  # plain request-log lines holding a token-id list
        for start in sorted(starts | requests | stats):
            if start < pos:
                continue  # already fed while a block was open
            if pos < start:
                if self._serving and not self._blocks:  # _skip's answer, without the call
                    self.lineno += text.count("\n", pos, start)
                else:
                    self._skip(text, pos, start)
            stop = find("\n", start)
            if stop < 0:
                stop = end
            line, pos = text[start:stop], stop + 1
            if self._serving and not self._blocks:
                if start in plain_requests and self._feed_request(line):
                    continue
                if start in stats and self.bounded and self._feed_stats(line):
                    continue
            feed(line)
        if pos <= end:
            self._skip(text, pos, end + 1)
        self.log.line_count = self.lineno

    def _feed_request(self, raw: str) -> bool:
        """:meth:`feed` for a plain INFO/DEBUG/WARNING request-log line (:data:`_BULK_LINE_RE`)
        with a ``prompt_token_ids`` list, while serving with no block open: all that line can
        do is give its ``request`` event (the list's length), so only that is done — whether it
        gives one told by one match (:data:`_REQUEST_LINE_RE`), and in a bounded parse the
        event made only if the run's history keeps it (:class:`_Request`). False (nothing
        done) for a line that match does not read: :meth:`feed` reads it."""
        m = _REQUEST_LINE_RE.match(raw)
        if m is None:
            return False  # "Finished request …", a mangled line: the general path reads it
        self.lineno += 1
        if len(raw) > MAX_LINE_CHARS and PROMPT_IDS not in raw[:MAX_LINE_CHARS]:
            return True  # the list starts past the cut every line gets (parse_line): no event
        req = _Request(self.lineno, m)
        if not self.bounded:
            self._new = []
            ev = req.event()
            self.log.events.append(ev)
            self._new.append(ev)
            self.emitted += 1
            return True
        hist = self._history.get("request")
        if hist is None:
            hist = self._history["request"] = _History(*_HISTORY_DEFAULT)
        self._seq += 1
        self.emitted += 1
        hist.add(self._seq, req)
        return True

    def _feed_stats(self, raw: str) -> bool:
        """:meth:`feed` for a periodic stats line in its usual form (:data:`_STATS_LINE_RE`,
        whole) while serving with no block open, in a bounded parse: all such a line does is
        give its ``stats`` event, made only if the run's history keeps it (:class:`_Stats`).
        False (nothing done) for any other line."""
        if len(raw) > _STATS_LINE_MAX:
            return False
        m = _STATS_LINE_RE.fullmatch(raw)
        if m is None:
            return False
        self.lineno += 1
        if not self._gen_strong:  # as feed() and _match_stats_fast set it
            if m.group(_STATS_LINE_BODY + 5) is not None:  # Swapped: a V0 line
                self.log.engine_generation = "v0"
            elif m.group(_STATS_LINE_BODY + 1) is not None or (m.group("proc") or "").startswith(
                "EngineCore"
            ):
                self.log.engine_generation = "v1"
        hist = self._history.get("stats")
        if hist is None:
            hist = self._history["stats"] = _History(*_HISTORY_LIMITS["stats"])
        self._seq += 1
        self.emitted += 1
        hist.add(self._seq, _Stats(self.lineno, m))
        return True

    def _skip(self, text: str, pos: int, stop: int) -> None:
        """Count the lines of ``text`` from ``pos`` to ``stop`` (a line start, or ``len(text) +
        1`` for the rest), all plain request/access lines, feeding the few that can still change
        state: every line while the server does not serve (after a restart), and a line that
        may close an open traceback block (its process prefix, or none for a block of
        unprefixed lines). Such lines open no block, so the open set only shrinks here."""
        end = len(text)
        nxt_of: dict[Any, int] = {}  # block key -> next line start that may close it
        while pos < stop:
            if not self._serving:
                stop_at = text.find("\n", pos)
                if stop_at < 0:
                    stop_at = end
                self.feed(text[pos:stop_at])
                pos = stop_at + 1
                continue
            nxt = stop
            for key in self._blocks:
                at = nxt_of.get(key, -1)
                if at < pos:
                    at = nxt_of[key] = _next_closer(text, pos, stop, key)
                nxt = min(nxt, at)
            if nxt > pos:
                if nxt > end:
                    self.lineno += text.count("\n", pos, end) + 1
                else:
                    self.lineno += text.count("\n", pos, nxt)
                pos = nxt
                continue
            stop_at = text.find("\n", pos)
            if stop_at < 0:
                stop_at = end
            self.feed(text[pos:stop_at])
            pos = stop_at + 1

    def finish(self) -> None:
        """Close open traceback blocks (final phase of pending cuda_oom events)."""
        for key in list(self._blocks):
            self._close_block(key)
        self._flush_history()
        self.log.engines = split_engines(self.log, _PHASE_OF)  # several engines in one log

    # ------------------------------------------------------------------ helpers

    def _emit(
        self,
        kind: str,
        pl: ParsedLine,
        key: Any,
        values: dict[str, Any],
        line: int | None = None,
        text: str | None = None,
    ) -> LogEvent | None:
        ev = LogEvent(
            kind=kind,
            line=line if line is not None else self.lineno,
            values=values,
            # ``text``: the event's own wording, for lines whose text must not be kept at all
            text=text if text is not None else redact(pl.message)[:4000],
            process=pl.process,
            pid=pl.pid,
            level=pl.level,
            time=pl.time,
            host=pl.host,
        )
        if kind in _ERROR_KINDS and self._is_duplicate(ev, key):
            return None
        if self.bounded:
            hist = self._history.get(kind)
            if hist is None:
                hist = self._history[kind] = _History(*_HISTORY_LIMITS.get(kind, _HISTORY_DEFAULT))
            self._seq += 1
            hist.add(self._seq, ev)
            if kind in _ERROR_KINDS:  # what led up to an error stays, however long the run goes on
                for pinned_kind, n in _PINNED_BEFORE_ERROR.items():
                    led = self._history.get(pinned_kind)
                    if led is not None:
                        led.pin(n)
        else:
            self.log.events.append(ev)
        self._new.append(ev)
        self.emitted += 1
        self._track(ev, key)
        return ev

    def _is_duplicate(self, ev: LogEvent, key: Any) -> bool:
        sig = (ev.kind, repr(sorted((k, v) for k, v in ev.values.items() if k != "phase")))
        block = self._blocks.get(key)
        block_id = block.id if block is not None else -1
        prior = self._seen_errors.setdefault(sig, [])
        for pkey, pproc, pblock, pline in prior:
            if pkey == key:
                if pblock == block_id and block_id != -1:
                    return True
            elif (
                not (_is_worker(pproc) and _is_worker(ev.process))
                and self.lineno - pline <= _CROSS_PROCESS_WINDOW
            ):
                return True
        prior.append((key, ev.process, block_id, self.lineno))
        return False

    def _track(self, ev: LogEvent, key: Any) -> None:
        kind = ev.kind
        phase = _PHASE_OF.get(kind)
        if phase:
            self._state[key] = phase
            self._global_state = phase
            if kind == "graph_capture_start":
                self._capturing.add(key)
            elif kind == "graph_capture_done":
                self._capturing.discard(key)
        if kind == "model_loading" and ev.values.get("weights_bytes") is not None:
            self._weights[key] = ev.values["weights_bytes"]
        if kind in ("stats", "preempted_v0", "prompt_too_long"):
            self._serving = True

    def _flush_history(self) -> None:
        """Move the current run's kept events into ``log.events`` (bounded mode); drop the oldest
        runs' events when the file has had more than :data:`_MAX_LOG_EVENTS`."""
        if not self._history:
            return
        events = self.log.events
        kept = [item for hist in self._history.values() for item in hist.items()]
        kept.sort(key=lambda item: item[0])
        events.extend(ev if isinstance(ev, LogEvent) else ev.event() for _, ev in kept)  # made now
        self._history = {}
        if len(events) > _MAX_LOG_EVENTS:
            events.sort(key=lambda e: e.line)
            del events[: len(events) - _MAX_LOG_EVENTS * 3 // 4]

    def _new_startup(self) -> None:
        if self.bounded:
            self._flush_history()
        if self._serving or self._global_state != "startup":
            self._state.clear()
            self._capturing.clear()
            self._global_state = "startup"
            self._serving = False
            self._seen_errors.clear()

    def _close_block(self, key: Any) -> None:
        block = self._blocks.pop(key, None)
        if block is None:
            return
        for ev, state, serving in block.ooms:
            ev.values["phase"] = self._phase(state, block, serving)
            ev.values["hints"] = _hints(block)
            ev.values["frames"] = log_catalogue2.frame_hints(block.text)

    def _phase(self, state: str, block: _Block, serving: bool) -> str:
        text = "\n".join(block.text)
        low = text.lower()
        if not serving and ("_dummy_sampler_run" in text or "warming up sampler" in text):
            return "sampler_warmup"
        if not serving and any(f in text for f in _KV_SIZING_WARMUP_FRAMES):
            # 0.34's KV-sizing warm-up runs steps (execute_model) before the engine serves
            return "kv_sizing_warmup"
        if serving:
            return "runtime"
        if state == "cuda_graph_capture" or any(h in low for h in _CAPTURE_HINTS):
            return "cuda_graph_capture"
        if state == "weight_loading" or (state == "startup" and any(h in text for h in _WEIGHT_HINTS)):
            return "weight_loading"
        if state == "profile_run" or (state == "startup" and any(h in text for h in _PROFILE_HINTS)):
            return "profile_run"
        if not any(h in text for h in _PROFILE_HINTS) and (
            any(f in text for f in _OFFLINE_FRAMES)
            or (state == "kv_cache_init" and any(f in text for f in _STEP_FRAMES))
        ):
            # An offline engine (LLM(...) driven by a script) prints no serving marker: a step
            # of generate after the startup steps is run time.
            return "runtime"
        return state

    # ------------------------------------------------------------------ matching

    def _match(self, pl: ParsedLine, key: Any, block: _Block | None) -> None:  # noqa: C901
        msg = pl.message
        if not msg or len(msg) < 8 or msg.startswith("    ") or msg.startswith("  File "):
            return  # traceback source lines quote the messages they raise: never an event
        R = _RE
        log = self.log

        # --- serving markers (global): the engine answered requests or opened its port
        if not self._serving:
            for needle in _SERVING_NEEDLES:
                if needle in msg:
                    self._serving = True
                    break
        if pl.formatted or pl.level in ("DEBUG", "INFO", "WARNING"):
            if msg.startswith(_REQUEST_PREFIXES) or _ACCESS_RE.match(msg):
                # The request and access logs: a prompt's text never becomes an event; a
                # request's prompt length does (its token count only, the text left out).
                if "prompt_token_ids" in msg and msg.startswith(("Received request ", "Added request ")):
                    n = request_prompt_tokens(msg)
                    if n is not None:
                        self._emit(
                            "request", pl, key, {"prompt_tokens": n}, text=f"request with a {n}-token prompt"
                        )
                return

        # --- catalogue 2 lines (sources/log_catalogue2.py): extra events; the line goes on below
        for kind, values in log_catalogue2.match(msg):
            self._emit_catalogue2(kind, values, pl, key, block)
        # --- vLLM 0.34 lines (sources/log_v034.py): extra events; the line goes on below
        for kind, values in log_v034.match(msg):
            self._emit_catalogue2(kind, values, pl, key, block, log_v034.BLOCK_KINDS)

        # --- engine pids named by a line (log_engines): "Started engine process with PID N", …
        if "pid" in msg or "PID" in msg or "Started server process" in msg:
            hit = engine_pid_line(msg)
            if hit is not None:
                self._emit("engine_pid", pl, key, {"pid": hit[0], "source": hit[1]})

        # --- weights held by another process (log_engines): a `vllm preload` daemon's
        if "xternal" in msg:
            ext = external_weights_line(msg)
            if ext is not None:
                self._emit("external_weights", pl, key, ext)

        # --- request log lines in other formats (no level prefix): the prompt's length only
        if "prompt_token_ids" in msg and ("Received request" in msg or "Added request" in msg):
            n = request_prompt_tokens(msg)
            if n is not None:
                self._emit("request", pl, key, {"prompt_tokens": n}, text=f"request with a {n}-token prompt")
                return

        # --- the periodic stats line in its usual form, before the chain below: its fixed
        # words hold none of the chain's needles, so it would reach the stats branch anyway
        if msg[:1] in ("E", "A") and self._match_stats_fast(pl, key, msg):
            return

        # --- version / generation
        if "version" in msg:
            m = R["api_version"].search(msg) or R["server_version"].search(msg)
            if m is None and ("\u2580" <= msg.lstrip()[:1] <= "\u259f"):
                m = R["logo_version"].match(msg)  # anchored: one start, not one per block char
            if m:
                self._set_version(m.group(1), None, pl, key)
        if "with config:" in msg and "Initializing" in msg:
            m = R["init_engine"].search(msg)
            if m:
                gen = "v1" if "V1" in m.group(1) else "v0"
                if m.group(2):
                    self._set_version(m.group(2), gen, pl, key)
                else:
                    log.engine_generation = gen
                    self._gen_strong = True
                cfg = _parse_kv_list(_strip_unbalanced_paren(m.group(3)))
                if "max_seq_len" in cfg:
                    cfg["max_model_len"] = cfg.pop("max_seq_len")
                self._add_args(cfg, "engine_config", pl, key)
            return
        if "non-default args:" in msg:
            m = R["non_default"].search(msg)
            if m:
                self._add_args(_parse_dict_repr(m.group(1)), "non_default", pl, key)
            return
        if "args: Namespace(" in msg:
            m = R["namespace"].search(msg)
            if m:
                self._add_args(_parse_kv_list(_strip_unbalanced_paren(m.group(1))), "namespace", pl, key)
            return

        if "Chunked prefill is enabled" in msg:
            m = R["chunked"].search(msg)
            if m:
                self._emit("chunked_prefill", pl, key, {"max_num_batched_tokens": int(m.group(1))})
            return
        if "Using max model len" in msg:
            m = R["max_len_used"].search(msg)
            if m:
                self._emit("max_model_len_used", pl, key, {"max_model_len": int(m.group(1))})
            return

        # --- weights
        if "Starting to load model" in msg:
            self._emit("weights_loading_start", pl, key, {})
            return
        if "Loading model weights" in msg:
            m = R["v0_weights"].search(msg)
            if m:
                self._emit("model_loading", pl, key, {"weights_bytes": _gib(m.group(1)), "seconds": None})
            elif "took" not in msg:
                self._emit("weights_loading_start", pl, key, {})
            return
        if "Model loading took" in msg:
            m = R["model_loading"].search(msg)
            if m:
                self._emit(
                    "model_loading",
                    pl,
                    key,
                    {"weights_bytes": _gib(m.group(1)), "seconds": float(m.group(3))},
                )
            return

        # --- memory profiling
        if "emory profiling" in msg:
            if self._match_profile(pl, key, msg):
                return
        if "the current vLLM instance can use total_gpu_memory" in msg:
            m = R["v0_prof_2"].search(msg)
            if m:
                p = self._pending_v0.setdefault(key, {"_line": self.lineno, "seconds": None})
                p.update(
                    total_bytes=_gib(m.group(1)),
                    gmu=float(m.group(2)),
                    budget_bytes=_gib(m.group(3)),
                )
            return
        if "the rest of the memory reserved for KV Cache" in msg:
            m = R["v0_prof_3"].search(msg)
            if m:
                p = self._pending_v0.pop(key, {}) or {"_line": self.lineno, "seconds": None}
                line = p.pop("_line")
                values = {
                    "seconds": p.get("seconds"),
                    "total_bytes": p.get("total_bytes"),
                    "gmu": p.get("gmu"),
                    "budget_bytes": p.get("budget_bytes"),
                    "weights_bytes": _gib(m.group(1)),
                    "non_torch_bytes": _gib(m.group(2)),
                    "activation_peak_bytes": _gib(m.group(3)),
                    "kv_bytes": _gib(m.group(4)),
                }
                self._emit("memory_profile_v0", pl, key, values, line=line)
            return
        if "Initial free memory:" in msg and "Requested memory" in msg:
            m = R["mem_request"].search(msg)
            if m:
                self._emit(
                    "memory_request",
                    pl,
                    key,
                    {
                        "initial_free_bytes": _gib(m.group(1)),
                        "gmu": float(m.group(2)),
                        "requested_bytes": _gib(m.group(3)),
                    },
                )
            return
        if "Available KV cache memory" in msg:
            m = R["avail_kv"].search(msg)
            if m:
                self._emit("available_kv_memory", pl, key, {"bytes": _gib(m.group(1))})
            return

        # --- KV capacity
        if "KV cache size:" in msg or "Maximum concurrency for" in msg:
            m = R["kv_size"].search(msg)
            if m:
                self._emit("kv_cache_size", pl, key, {"device": m.group(1), "tokens": _int(m.group(2))})
            m = R["max_conc"].search(msg)
            if m:
                self._emit(
                    "max_concurrency",
                    pl,
                    key,
                    {"max_model_len": _int(m.group(1)), "concurrency": float(m.group(2).replace(",", ""))},
                )
            return
        if "Overriding num_gpu_blocks" in msg:
            m = R["blocks_override"].search(msg)
            if m:
                self._emit(
                    "num_gpu_blocks_override",
                    pl,
                    key,
                    {"computed": int(m.group(1)), "override": int(m.group(2))},
                )
            return
        if "# CPU blocks:" in msg:
            m = R["v0_blocks"].search(msg)
            if m:
                self._emit(
                    "v0_blocks",
                    pl,
                    key,
                    {"device": m.group(1), "gpu_blocks": int(m.group(2)), "cpu_blocks": int(m.group(3))},
                )
                if not self._gen_strong:
                    log.engine_generation = "v0"
            return

        # --- CUDA graphs
        if "Profiling CUDA graph memory" in msg:
            # ≥ 0.18 profiles graph memory inside determine_available_memory: an OOM now is a
            # graph-capture OOM (vllm-facts §3.3 item 4).
            self._emit("cudagraph_memory_profiling", pl, key, {})
            self._state[key] = self._global_state = "cuda_graph_capture"
            return
        if "Capturing" in msg and (
            "Capturing cudagraphs" in msg
            or "Capturing the model for CUDA graphs" in msg
            or "Capturing CUDA graph" in msg
        ):
            if key not in self._capturing:
                self._emit("graph_capture_start", pl, key, {})
            return
        if "Graph capturing finished" in msg:
            m = R["capture_done"].search(msg)
            if m:
                self._emit(
                    "graph_capture_done",
                    pl,
                    key,
                    {"seconds": float(m.group(1)), "bytes": _gib(m.group(2)) if m.group(2) else None},
                )
            return
        if "Estimated CUDA graph memory" in msg:
            m = R["cg_estimate"].search(msg)
            if m:
                self._emit("cudagraph_estimate", pl, key, {"bytes": _gib(m.group(1))})
            return
        if "CUDA graph pool memory" in msg:
            m = R["cg_pool"].search(msg)
            if m:
                self._emit(
                    "cudagraph_pool",
                    pl,
                    key,
                    {"actual_bytes": _gib(m.group(1)), "estimated_bytes": _gib(m.group(2))},
                )
            return
        if "CUDA graph memory profiling is" in msg:
            if "is enabled" in msg:
                m = R["cg_enabled"].search(msg)
                if m:
                    self._emit(
                        "cudagraph_profiling",
                        pl,
                        key,
                        {
                            "enabled": True,
                            "gmu": float(m.group(1)),
                            "equivalent_gmu": float(m.group(2)),
                            "suggested_gmu": float(m.group(3)),
                        },
                    )
            else:
                m = R["cg_disabled"].search(msg)
                if m:
                    self._emit(
                        "cudagraph_profiling",
                        pl,
                        key,
                        {
                            "enabled": False,
                            "gmu": float(m.group(1)),
                            "equivalent_gmu": None,
                            "suggested_gmu": float(m.group(2)),
                        },
                    )
            return

        # --- free memory at startup
        if "Free memory on device" in msg:
            if "Desired GPU memory utilization is" in msg:
                self._match_summary(pl, key, msg)
                return
            m = R["below_util"].search(msg)
            if m:
                self._emit(
                    "free_memory_below_util",
                    pl,
                    key,
                    {
                        "device": m.group(1),
                        "free_bytes": _gib(m.group(2)),
                        "total_bytes": _gib(m.group(3)),
                        "gmu": float(m.group(4)),
                        "requested_bytes": _gib(m.group(5)),
                        "variant": "util",
                    },
                )
                return
            if "excluding external" in msg:
                self._match_external(pl, key, msg, "below_budget_excluding_external")
                return
        if "Externally held weights" in msg:
            self._match_external(pl, key, msg, "external_weights_exceed")
            return
        if "reserved" in msg and "as specified by kv_cache_memory_bytes" in msg:
            m = R["kv_reserved"].search(msg)
            if m:
                self._emit(
                    "kv_cache_memory_bytes_reserved",
                    pl,
                    key,
                    {"initial_free_bytes": _gib(m.group(1)), "kv_bytes": _gib(m.group(2))},
                )
            return
        if "Error in memory profiling" in msg:
            m = R["prof_assert"].search(msg)
            if m:
                a = _gib(m.group(1)) if m.group(2) else int(float(m.group(1)))
                b = _gib(m.group(3)) if m.group(4) else int(float(m.group(3)))
                self._emit("profiling_assertion", pl, key, {"initial_free_bytes": a, "current_free_bytes": b})
            return

        # --- KV does not fit
        if "No available memory for the cache blocks" in msg:
            self._emit("no_available_kv_memory", pl, key, {})
            return
        if "To serve at least one request with the model" in msg:
            m = R["max_seq_v1"].search(msg)
            if m:
                self._emit(
                    "max_seq_len_exceeds_kv",
                    pl,
                    key,
                    {
                        "max_model_len": int(m.group(1)),
                        "needed_bytes": _gib(m.group(2)),
                        "available_bytes": _gib(m.group(3)),
                        "estimated_max_len": int(m.group(4)) if m.group(4) else None,
                    },
                )
            return
        if "is larger than the maximum number of tokens that can be stored in KV cache" in msg:
            m = R["max_seq_v0"].search(msg)
            if m:
                self._emit(
                    "v0_max_seq_len_exceeds_kv",
                    pl,
                    key,
                    {"max_model_len": int(m.group(1)), "kv_tokens": int(m.group(2))},
                )
            return
        if "auto-fit max_model_len" in msg or "Auto-fit max_model_len" in msg:
            if "Cannot auto-fit" in msg:
                self._emit("autofit_failed", pl, key, {})
                return
            m = R["autofit_reduced"].search(msg)
            if m:
                self._emit("autofit", pl, key, {"from": int(m.group(1)), "to": int(m.group(2))})
                return
            m = R["autofit_full"].search(msg)
            if m:
                self._emit("autofit", pl, key, {"from": int(m.group(1)), "to": int(m.group(1))})
            return
        if "User-specified max_model_len" in msg:
            m = R["user_max_len"].search(msg)
            if m:
                derived: Any = m.group(3)
                try:
                    derived = int(derived)
                except ValueError:
                    derived = None
                self._emit(
                    "user_max_model_len_too_large",
                    pl,
                    key,
                    {"max_model_len": int(m.group(1)), "derived": derived, "derived_key": m.group(2)},
                )
            return
        if (
            "maximum model length of" in msg
            or "maximum context length is" in msg
            or "is too long and exceeds" in msg
        ):
            m = R["prompt_len"].search(msg)
            if m:
                self._emit(
                    "prompt_too_long", pl, key, {"length": int(m.group(1)), "max_model_len": int(m.group(2))}
                )
                return
            m = R["ctx_len"].search(msg)
            if m:
                length = int(m.group(2) or m.group(3))
                self._emit("prompt_too_long", pl, key, {"length": length, "max_model_len": int(m.group(1))})
                return
            m = R["input_too_long"].search(msg)
            if m:
                self._emit(
                    "prompt_too_long", pl, key, {"length": int(m.group(1)), "max_model_len": int(m.group(2))}
                )
            return

        # --- OOM
        if "out of memory" in msg:
            self._match_oom(pl, key, msg, block)
            return

        if "kv_cache_dtype" in msg or "--kv-cache-dtype" in msg:
            m = R["kv_dtype_pyd"].search(msg)
            valid: list[str] = []
            if m:
                try:
                    parsed = _literal(m.group(2))
                    valid = [str(v) for v in parsed] if isinstance(parsed, (list, tuple)) else []
                except (ValueError, SyntaxError):
                    valid = [v.strip(" '\"") for v in m.group(2).strip("[]").split(",") if v.strip(" '\"")]
                self._emit("invalid_kv_cache_dtype", pl, key, {"value": m.group(1), "valid": valid})
                return
            m = R["kv_dtype_arg"].search(msg)
            if m:
                valid = [v.strip(" '\"") for v in m.group(2).split(",") if v.strip(" '\"")]
                self._emit("invalid_kv_cache_dtype", pl, key, {"value": m.group(1), "valid": valid})
                return

        # --- engine death
        for needle, reason in (
            ("EngineCore failed to start", "EngineCore failed to start"),
            ("Engine core initialization failed", "Engine core initialization failed"),
            ("EngineCore encountered a fatal error", "EngineCore encountered a fatal error"),
            ("EngineDeadError", "EngineDeadError"),
            ("EngineCore encountered an issue", "EngineDeadError"),
            ("Engine process failed to start", "Engine process failed to start"),
        ):
            if needle in msg:
                self._emit("engine_failed", pl, key, {"reason": reason})
                return

        # --- periodic stats
        if "Avg prompt throughput" in msg:
            self._match_stats(pl, key, msg)
            return
        if "is preempted by" in msg:
            m = R["preempted"].search(msg)
            if m:
                self._emit(
                    "preempted_v0", pl, key, {"mode": m.group(1).lower(), "total_cumulative": int(m.group(2))}
                )
            return
        if "large swap space" in msg:
            m = R["swap"].search(msg)
            if m:
                self._emit(
                    "swap_space_too_large",
                    pl,
                    key,
                    {
                        "swap_bytes": _gib(m.group(2)),
                        "cpu_total_bytes": _gib(m.group(3)),
                        "fatal": m.group(1) == "Too",
                    },
                )
            return

        # --- hybrid / mamba
        if "Setting attention block size to" in msg:
            m = R["hybrid_bs"].search(msg)
            if m:
                self._emit("hybrid_block_size", pl, key, {"block_size": int(m.group(1))})
            return
        if "Padding mamba page size" in msg:
            m = R["mamba_pad"].search(msg)
            self._emit("mamba_padding", pl, key, {"fraction": _frac(m.group(1)) if m else None})
            return
        if "padding layers" in msg:
            m = R["pad_layers"].search(msg)
            if m:
                self._emit(
                    "padding_layers",
                    pl,
                    key,
                    {"layers": int(m.group(1)), "waste_fraction": _frac(m.group(2))},
                )
            return

        # --- multimodal profiling
        if (
            "multi-modal embeddings in the worst case" in msg
            or "Encoder cache will be initialized with a budget" in msg
            or ("profil" in msg and ("multimodal" in msg or "multi-modal" in msg) and pl.level == "WARNING")
        ):
            self._emit("mm_profile", pl, key, {})
            return

    # ------------------------------------------------------------------ sub-matchers

    def _emit_catalogue2(
        self,
        kind: str,
        values: dict[str, Any],
        pl: ParsedLine,
        key: Any,
        block: _Block | None,
        block_kinds: frozenset[str] = log_catalogue2.BLOCK_KINDS,
    ) -> None:
        """One event of :mod:`log_catalogue2` (or :mod:`log_v034`, with its ``block_kinds``);
        errors raised in a traceback get ``phase`` and ``hints`` as a ``cuda_oom`` does (refined
        when the block closes)."""
        ev = self._emit(kind, pl, key, values)
        if ev is None or kind not in block_kinds:
            return
        state = self._state.get(key, self._global_state)
        if key in self._capturing:
            state = "cuda_graph_capture"
        if block is None:
            block = _Block(-1, [pl.message])
        else:
            block.ooms.append((ev, state, self._serving))
        ev.values["phase"] = self._phase(state, block, self._serving)
        ev.values["hints"] = _hints(block)
        ev.values["frames"] = log_catalogue2.frame_hints(block.text)

    def _set_version(self, version: str, gen: str | None, pl: ParsedLine, key: Any) -> None:
        version = version.lstrip("v").rstrip(",.")
        if not version or not version[0].isdigit() or version_tuple(version) is None:
            return  # not a version kvdoctor can compare (e.g. a part of thousands of digits)
        self.log.vllm_version = version
        if not gen and not self._gen_strong and _version_tuple(version) >= (0, 11):
            self.log.engine_generation = "v1"  # the V0 engine was removed in 0.11
        if gen:
            self.log.engine_generation = gen
            self._gen_strong = True
        else:
            self._new_startup()  # the API server's banner starts a new run (restarts in one file)
        self._emit("version", pl, key, {"version": version})

    def _add_args(self, args: dict[str, Any], source: str, pl: ParsedLine, key: Any) -> None:
        args = _scalar_identity(_redact_args(args))
        if source != "engine_config":
            self._new_startup()
        self._emit("args", pl, key, {"args": args, "source": source})
        merged = self.log.args
        if source == "non_default":
            for k in args:
                if k not in self._explicit:
                    self._explicit.append(k)
        for k, v in args.items():
            if source == "namespace" and k in self._explicit and k in merged:
                continue
            if source != "non_default" and v is None and merged.get(k) is not None:
                continue  # a default None never hides a known value
            merged[k] = v
        merged["_explicit"] = list(self._explicit)

    def _match_profile(self, pl: ParsedLine, key: Any, msg: str) -> bool:
        R = _RE
        m = R["v0_prof_1"].match(msg)
        if m:
            self._pending_v0[key] = {"_line": self.lineno, "seconds": float(m.group(1))}
            return True
        m = R["v1_prof"].search(msg)
        if m and "GiB" in m.group(2):
            fields = {name.strip().lower(): _gib(val) for name, val in R["v1_prof_field"].findall(m.group(2))}

            def pick(*needles: str) -> int | None:
                for name, val in fields.items():
                    if all(n in name for n in needles):
                        return val
                return None

            self._emit(
                "memory_profile_v1",
                pl,
                key,
                {
                    "seconds": float(m.group(1)),
                    "non_kv_bytes": pick("non kv cache"),
                    "torch_peak_increase_bytes": pick("torch peak"),
                    "non_torch_increase_bytes": pick("non-torch"),
                    "consumed_bytes": pick("total consumed"),
                    "weights_bytes": pick("weights"),
                },
            )
            return True
        m = R["v06_prof"].search(msg)
        if m:
            f: dict[str, float] = {}
            units: dict[str, bool] = {}
            for name, val, unit in R["v06_field"].findall(m.group(1)):
                f[name.lower()] = float(val)
                units[name.lower()] = bool(unit)
            total = _gib(str(f["total_gpu_memory"])) if "total_gpu_memory" in f else None
            gmu = f.get("gpu_memory_utilization")
            peak = _gib(str(f["peak_torch_memory"])) if "peak_torch_memory" in f else None
            weights = self._weights.get(key)
            values = {
                "seconds": f.get("duration"),
                "total_bytes": total,
                "gmu": gmu,
                "budget_bytes": int(total * gmu) if total is not None and gmu is not None else None,
                "weights_bytes": weights,
                "non_torch_bytes": _gib(str(f["non_torch_memory"])) if "non_torch_memory" in f else None,
                "activation_peak_bytes": peak - weights if peak is not None and weights is not None else None,
                "kv_bytes": _gib(str(f["kv_cache_size"])) if "kv_cache_size" in f else None,
                "initial_bytes": _gib(str(f["initial_memory_usage"]))
                if "initial_memory_usage" in f
                else None,
                "peak_torch_bytes": peak,
                "post_profile_bytes": _gib(str(f["memory_usage_post_profile"]))
                if "memory_usage_post_profile" in f
                else None,
            }
            self._emit("memory_profile_v0", pl, key, values)
            return True
        return False

    def _match_summary(self, pl: ParsedLine, key: Any, msg: str) -> None:
        R = _RE
        m = R["summary_head"].search(msg)
        if not m:
            return

        def g(name: str) -> int | None:
            mm = R[name].search(msg)
            return _gib(mm.group(1)) if mm else None

        weights, non_torch, consumed = g("summary_weight"), g("summary_nontorch"), g("summary_consumed")
        if consumed is None and weights is not None and non_torch is not None:
            consumed = weights + non_torch
        kvmem = [int(x) for x in R["summary_kvmem"].findall(msg)]
        inuse = None
        mi = R["summary_inuse"].search(msg)
        if mi:
            inuse = int(float(mi.group(1))) if (mi.group(2) or "").lower() == "bytes" else _gib(mi.group(1))
        self._emit(
            "memory_summary",
            pl,
            key,
            {
                "free_bytes": _gib(m.group(1)),
                "total_bytes": _gib(m.group(2)),
                "gmu": float(m.group(3)),
                "requested_bytes": _gib(m.group(4)),
                "consumed_bytes": consumed,
                "weights_bytes": weights,
                "activation_peak_bytes": g("summary_act"),
                "non_torch_bytes": non_torch,
                "cudagraph_bytes": g("summary_cg"),
                "kv_cache_memory_fit_bytes": kvmem[0] if kvmem else None,
                "kv_cache_memory_full_bytes": kvmem[1] if len(kvmem) > 1 else None,
                "kv_in_use_bytes": inuse,
            },
        )

    def _match_external(self, pl: ParsedLine, key: Any, msg: str, variant: str) -> None:
        R = _RE
        d = R["ext_device"].search(msg)
        u = None
        for mm in R["ext_util"].finditer(msg):
            if d is None or mm.start() != d.start(2) - 1:
                u = mm
                break
        self._emit(
            "free_memory_below_util",
            pl,
            key,
            {
                "device": d.group(1) if d else None,
                "free_bytes": _gib(d.group(2)) if d else None,
                "total_bytes": _gib(d.group(3)) if d else None,
                "gmu": float(u.group(1)) if u else None,
                "requested_bytes": _gib(u.group(2)) if u else None,
                "variant": variant,
            },
        )

    def _match_oom(self, pl: ParsedLine, key: Any, msg: str, block: _Block | None) -> None:
        R = _RE
        if "Failed to load model - not enough GPU memory" in msg:
            self._emit("load_model_oom", pl, key, {})
        m = R["sampler_oom"].search(msg)
        if m:
            self._emit("sampler_warmup_oom", pl, key, {"num_requests": int(m.group(1))})
            return
        if "CUDA error: out of memory" in msg:
            self._emit("cuda_error_oom", pl, key, {})
            return
        if "CUDA out of memory" not in msg:
            return
        values: dict[str, Any] = {
            "form": "modern",
            "requested_bytes": None,
            "gpu": None,
            "total_bytes": None,
            "free_bytes": None,
            "this_process_bytes": None,
            "other_processes": [],
            "allowed_bytes": None,
            "allocated_by_pytorch_bytes": None,
            "private_pools_bytes": None,
            "reserved_unallocated_bytes": None,
            "already_allocated_bytes": None,
            "reserved_total_bytes": None,
        }
        m = R["oom_legacy"].search(msg)
        if m:
            values.update(
                form="legacy",
                requested_bytes=_size(m.group(1)),
                gpu=int(m.group(2)),
                total_bytes=_size(m.group(3)),
                already_allocated_bytes=_size(m.group(4)),
                free_bytes=_size(m.group(5)),
                allowed_bytes=_size(m.group(6)) if m.group(6) else None,
                reserved_total_bytes=_size(m.group(7)),
            )
            if values["reserved_total_bytes"] is not None and values["already_allocated_bytes"] is not None:
                values["reserved_unallocated_bytes"] = (
                    values["reserved_total_bytes"] - values["already_allocated_bytes"]
                )
        else:
            m = R["oom_modern"].search(msg)
            if m:
                values.update(
                    requested_bytes=_size(m.group(1)),
                    gpu=int(m.group(2)),
                    total_bytes=_size(m.group(3)),
                    free_bytes=_size(m.group(4)),
                )
            else:
                mr = R["oom_requested"].search(msg)
                if mr:
                    values["requested_bytes"] = _size(mr.group(1))
            values["other_processes"] = [
                {"pid": int(pid), "bytes": _size(sz)} for pid, sz in R["oom_proc"].findall(msg)
            ]
            ms = R["oom_self"].search(msg)
            if ms:
                values["this_process_bytes"] = _size(ms.group(1))
            values["engine_pid"] = oom_engine_pid(values)  # the raising process (log_engines)
            ma = R["oom_allowed"].search(msg)
            if ma:
                values["allowed_bytes"] = _size(ma.group(1))
            mp = R["oom_alloc"].search(msg)
            if mp:
                values["allocated_by_pytorch_bytes"] = _size(mp.group(1))
                values["private_pools_bytes"] = _size(mp.group(2)) if mp.group(2) else None
                values["reserved_unallocated_bytes"] = _size(mp.group(3))
        ev = self._emit("cuda_oom", pl, key, values)
        if ev is None:
            return
        # this process's own progress, else the latest of any process (EngineCore re-raising)
        state = self._state.get(key, self._global_state)
        if key in self._capturing:
            state = "cuda_graph_capture"
        if "Failed to load model" in msg:
            state = "weight_loading"
        if block is None:
            block = _Block(-1, [msg])
        else:
            block.ooms.append((ev, state, self._serving))
        # final for a closed block; provisional (refined when the block closes) for a follower
        ev.values["phase"] = self._phase(state, block, self._serving)
        ev.values["hints"] = _hints(block)
        ev.values["frames"] = log_catalogue2.frame_hints(block.text)

    def _match_stats(self, pl: ParsedLine, key: Any, msg: str) -> None:
        if self._match_stats_fast(pl, key, msg):
            return
        R = _RE

        def num(name: str, conv: Callable[[str], Any] = int) -> Any:
            # the field's own words first: an absent field costs a substring test, not a search
            at = msg.find(_STATS_WORDS[name])
            if at < 0:
                return None
            # from its words on (9 characters before for st_prefix's "External " lookbehind):
            # no match starts earlier
            mm = R[name].search(msg, max(0, at - 9))
            return conv(mm.group(1)) if mm else None

        engine: str | None = None
        num_engines: int | None = None
        me = R["stats_engine"].search(msg)
        if me:
            if me.group(1) is not None:
                engine = str(int(me.group(1)))
            else:
                engine = "aggregated"
                num_engines = int(me.group(2))
        # "[A-Z]{1,8} KV cache usage" has no literal start: search from 8 characters before
        # its first " KV cache usage: " (no match can start earlier), none when it is absent
        at = msg.find(" KV cache usage: ")
        kv = R["st_kv"].findall(msg, max(0, at - 8)) if at >= 0 else []
        device = kv[0][0] if kv else None
        kv_usage = _frac(kv[0][1]) if kv else None
        cpu_kv = None
        for dev, val in kv[1:]:
            if dev == "CPU":
                cpu_kv = _frac(val)
        swapped = num("st_swapped")
        if swapped is not None and not self._gen_strong:
            self.log.engine_generation = "v0"
        elif me and not self._gen_strong:
            self.log.engine_generation = "v1"
        self._emit(
            "stats",
            pl,
            key,
            {
                "engine": engine,
                "prompt_throughput": num("st_prompt", float),
                "generation_throughput": num("st_gen", float),
                "running": num("st_running"),
                "waiting": num("st_waiting"),
                "swapped": swapped,
                "pending": num("st_pending"),
                "deferred": num("st_deferred"),
                "preemptions": num("st_preempt"),
                "kv_usage": kv_usage,
                "cpu_kv_usage": cpu_kv,
                "prefix_cache_hit_rate": num("st_prefix", _frac),
                "device": device,
                "num_engines": num_engines,
            },
        )

    def _set_generation(self, gen: str) -> None:
        self.log.engine_generation = gen

    def _match_stats_fast(self, pl: ParsedLine, key: Any, msg: str) -> bool:
        """The periodic line in one of its usual forms (:data:`_STATS_FAST_RE`, every field
        once, in order; vllm-facts §3.4): the same event as the field-by-field path, from one
        match. Its text needs no redaction (fixed words and numbers)."""
        m = _STATS_FAST_RE.fullmatch(msg)
        if m is None:
            return False
        values = _stats_values(m.groups(), None if self._gen_strong else self._set_generation)
        self._emit("stats", pl, key, values, text=msg[:4000])
        return True


#: The periodic line, whole, in the forms vLLM has printed: V1 (≥ 0.12: "Engine N: … Running,
#: Waiting, GPU KV cache usage, Prefix cache hit rate[, Preemptions]"), V1 of 0.8-0.11
#: ("… Waiting: N reqs, Preemptions: N, GPU KV cache usage …") and V0 ("… Running, Swapped,
#: Pending, GPU KV cache usage, CPU KV cache usage."). Each group is the pattern of its field
#: regex (``_RE["st_*"]``); the device only GPU or CPU (so the text holds nothing to redact).
#: Groups: engine, prompt, generation, running, swapped, pending, waiting, preemptions (after
#: waiting), device, kv, cpu kv, prefix hit rate, preemptions (at the end).
_STATS_FAST_BODY = (
    r"(?:Engine (\d+): )?Avg prompt throughput: (\d+(?:\.\d+)?) tokens/s, "
    r"Avg generation throughput: (\d+(?:\.\d+)?) tokens/s, Running: (\d+) reqs, "
    r"(?:Swapped: (\d+) reqs, Pending: (\d+) reqs, |Waiting: (\d+) reqs, (?:Preemptions: (\d+), )?)"
    r"(GPU|CPU) KV cache usage: (\d{1,20}(?:\.\d{1,20})?)%(?:, CPU KV cache usage: (\d{1,20}(?:\.\d{1,20})?)%)?"
    r"(?:, Prefix cache hit rate: (\d+(?:\.\d+)?)%)?(?:, Preemptions: (\d+))?\.?"
)
_STATS_FAST_RE = lazy_re(_STATS_FAST_BODY)
#: the preemption groups of :data:`_STATS_FAST_BODY` (1-based), either of which a line has
_STATS_PRE_GROUPS = (8, 13)
#: A whole line holding that stats message after vLLM's usual header, the header's parts
#: captured: exactly what :func:`parse_line` takes from it (:data:`_PROC_RE`, :data:`_LEVEL_RE`).
#: The body's groups follow the header's, in :data:`_STATS_FAST_RE`'s order.
_STATS_LINE_RE = lazy_re(rf"{_HEAD_PROC}{_HEAD_LEVEL_TIME}(?:{_BULK_TAG}) (?P<msg>{_STATS_FAST_BODY})")


def _stats_values(
    g: tuple[str | Any, ...], set_generation: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The ``stats`` event's values from :data:`_STATS_FAST_BODY`'s groups ``g``, converted in
    the field-by-field path's order; ``set_generation`` told "v0"/"v1" where that path sets the
    engine generation (so an error in a conversion leaves the same state)."""
    eng, prompt, gen, running, swapped, pending, waiting, pre_mid, device, kv, cpu_kv, prefix, pre_end = g
    engine = str(int(eng)) if eng is not None else None
    kv_usage = _frac(kv)
    cpu_kv_usage = _frac(cpu_kv) if cpu_kv is not None else None
    n_swapped = int(swapped) if swapped is not None else None
    if set_generation is not None:
        if n_swapped is not None:
            set_generation("v0")
        elif eng is not None:
            set_generation("v1")
    pre = pre_mid if pre_mid is not None else pre_end
    return {
        "engine": engine,
        "prompt_throughput": float(prompt),
        "generation_throughput": float(gen),
        "running": int(running),
        "waiting": int(waiting) if waiting is not None else None,
        "swapped": n_swapped,
        "pending": int(pending) if pending is not None else None,
        "deferred": None,
        "preemptions": int(pre) if pre is not None else None,
        "kv_usage": kv_usage,
        "cpu_kv_usage": cpu_kv_usage,
        "prefix_cache_hit_rate": _frac(prefix) if prefix is not None else None,
        "device": device,
        "num_engines": None,
    }


#: groups of :data:`_STATS_LINE_RE` before its body's
_STATS_LINE_BODY = 5
#: its preemption groups (:data:`_STATS_PRE_GROUPS`)
_STATS_LINE_PRE_MID, _STATS_LINE_PRE_END = (_STATS_LINE_BODY + g for g in _STATS_PRE_GROUPS)
#: a usual stats line is ~250 characters; longer ones take the general path.
_STATS_LINE_MAX = 600


class _Stats:
    """A ``stats`` event not made yet (:class:`_Request`'s reason: a long run has hundreds of
    thousands of stats lines and its history keeps ten thousand). ``match`` is
    :data:`_STATS_LINE_RE` on the line; ``extra`` the preemptions handed on by dropped
    stats (:class:`_History`)."""

    __slots__ = ("line", "match", "extra")

    def __init__(self, line: int, match: re.Match[str]) -> None:
        self.line = line
        self.match = match
        self.extra = 0

    def own_preemptions(self) -> int:
        """The line's own preemption count (0 when it has none)."""
        m = self.match
        pre = m.group(_STATS_LINE_PRE_MID) or m.group(_STATS_LINE_PRE_END)
        return int(pre) if pre and pre != "0" else 0

    def event(self) -> LogEvent:
        """The event :meth:`_Parser._match_stats_fast` makes of this line."""
        m = self.match
        proc, pid, level, time_, msg = m.group("proc", "pid", "level", "time", "msg")
        values = _stats_values(m.groups()[_STATS_LINE_BODY:])
        if self.extra:
            values["preemptions"] = (values["preemptions"] or 0) + self.extra
        return LogEvent(
            kind="stats",
            line=self.line,
            values=values,
            text=msg[:4000],
            process=proc,
            pid=int(pid) if pid is not None else None,
            level="WARNING" if level == "WARN" else level,
            time=time_,
        )


# --------------------------------------------------------------------------- public API


@guarded("origin", 1)
def parse_log(text: str, origin: str = "") -> VllmLog:
    """Parse a whole vLLM log (any mix of APIServer / EngineCore / Worker lines, V0 or V1).

    ``text`` is the decoded log; ``origin`` names it in events and errors. Returns a
    :class:`VllmLog` with every event in file order (1-based line numbers), ``vllm_version``,
    ``engine_generation``, merged ``args`` and ``line_count``. Never raises on odd text: lines it
    does not recognise give no event.
    """
    parser = _Parser(origin, bounded=True)
    if text.endswith("\n"):
        text = text[:-1]
    if text:
        parser.feed_chunk(text)
    parser.finish()
    parser.log.events.sort(key=lambda e: e.line)
    return parser.log


@guarded("path", 0)
def check_log_file(path: str | os.PathLike[str]) -> None:
    """Raise SourceError when ``path`` cannot be read, is not a regular file or is not a text log
    (binary content), by the same test :func:`parse_log_file` applies; used before following a
    file live."""
    origin = os.fspath(path)
    with open_regular(origin, what="log") as fh:
        head = fh.read(_HEAD_BYTES)
    if head[:2] == b"\x1f\x8b":
        head = b"".join(_take(iter_gunzip([head], MAX_LOG_BYTES, origin, truncated_ok=True), _HEAD_BYTES))
    _check_head(head, origin)


_HEAD_BYTES = 65536
_CHUNK_BYTES = 1 << 20


def _take(chunks: Iterator[bytes], n: int) -> Iterator[bytes]:
    got = 0
    for c in chunks:
        yield c
        got += len(c)
        if got >= n:
            return


def _check_head(head: bytes, origin: str) -> None:
    """SourceError when the first 64 KiB of a log are not text (NULs, mostly non-text bytes)."""
    head = head[:_HEAD_BYTES]
    if head and (head.count(b"\x00") > len(head) // 100 or _binary_ratio(head) > 0.30):
        raise SourceError("not a text log (binary content)", origin=origin)


def _binary_ratio(head: bytes) -> float:
    text = head.decode("utf-8", errors="replace")
    bad = sum(1 for ch in text if ch == "\ufffd" or (ord(ch) < 32 and ch not in "\n\r\t\x1b\x0c"))
    return bad / max(1, len(text))


def iter_log_chunks(
    path: str | os.PathLike[str], *, on_bytes: Callable[[int], None] | None = None
) -> Iterator[str]:
    """A log file (plain or gzip) as decoded text chunks of whole lines, streamed: read in
    1 MiB pieces, never whole. Each chunk holds complete lines joined by "\\n" (no trailing
    newline); iterate :func:`iter_log_lines` for single lines.

    Bytes are decoded as utf-8 with errors replaced; a line longer than :data:`MAX_LINE_CHARS`
    keeps its first part (the rest is skipped up to the next newline, never buffered). A gzip
    log may decompress to at most :data:`MAX_LOG_BYTES`, and past 8 MiB to at most
    :data:`MAX_GZIP_RATIO` times its own size (a bomb). ``on_bytes(n)`` is told the file
    bytes consumed so far after each chunk (progress). Raises SourceError when the file cannot
    be read, is not a regular file, is binary, or its gzip data is corrupt or too large.
    """
    origin = os.fspath(path)
    limit = MAX_LINE_CHARS
    with open_regular(origin, what="log") as fh:
        consumed = 0

        def raw_chunks() -> Iterator[bytes]:
            nonlocal consumed
            while True:
                try:
                    chunk = fh.read(_CHUNK_BYTES)
                except OSError as exc:
                    raise SourceError(
                        f"cannot read log ({exc.strerror or 'I/O error'})", origin=origin
                    ) from None
                if not chunk:
                    return
                consumed += len(chunk)
                yield chunk

        source = raw_chunks()
        first = next(source, b"")
        if not first:
            return
        chunks: Iterator[bytes] = itertools.chain([first], source)
        if first[:2] == b"\x1f\x8b":
            chunks = iter_gunzip(chunks, MAX_LOG_BYTES, origin, max_ratio=MAX_GZIP_RATIO)
        buf = b""
        overlong = False
        checked = False
        for chunk in chunks:
            if not checked:
                _check_head(buf + chunk, origin)
                checked = len(buf) + len(chunk) >= _HEAD_BYTES
            if overlong:
                i = chunk.find(b"\n")
                if i < 0:
                    continue  # still inside an overlong line: nothing kept
                chunk = chunk[i:]
                overlong = False
            data = buf + chunk if buf else chunk
            cut = data.rfind(b"\n")
            if cut < 0:
                buf = data
            else:
                text = data[:cut].decode("utf-8", errors="replace")
                buf = data[cut + 1 :]
                yield text  # lines inside are cut at MAX_LINE_CHARS by parse_line
            if len(buf) > limit:
                buf = buf[:limit]
                overlong = True
            if on_bytes is not None:
                on_bytes(consumed)
        if not checked:
            _check_head(buf, origin)
        if buf:
            yield buf.decode("utf-8", errors="replace")[:limit]


def iter_log_lines(
    path: str | os.PathLike[str], *, on_bytes: Callable[[int], None] | None = None
) -> Iterator[str]:
    """The lines of a log file, streamed (see :func:`iter_log_chunks` for limits and errors)."""
    limit = MAX_LINE_CHARS
    for text in iter_log_chunks(path, on_bytes=on_bytes):
        for line in text.split("\n"):
            yield line if len(line) <= limit else line[:limit]


#: Past a time budget, the rest of a log is streamed and counted, and only these are parsed: the
#: start of the last run found (its startup, up to this many characters from its banner) and the
#: file's last characters. The state that matters is the current run's (issue 27 item 9).
_CUT_HEAD_CHARS = 4 << 20
_CUT_TAIL_CHARS = 32 << 20
#: the lines that start a run of the server (a restart in one file): its banner, its arguments.
_RUN_START_WORDS = ("vLLM API server version ", "non-default args: ", "args: Namespace(")


@guarded("path", 0)
def parse_log_file(
    path: str | os.PathLike[str], *, progress: bool | None = None, deadline: float | None = None
) -> VllmLog:
    """Read and parse a vLLM log file (plain or gzip), streamed line by line: memory stays flat
    whatever the file size (see :func:`iter_log_lines`).

    An empty file gives a VllmLog with no events. Raises SourceError when the file cannot be
    read or is binary (mostly NUL or non-text bytes). ``progress`` (default: stderr is a
    terminal) shows how far reading got once it has taken more than two seconds.

    ``deadline`` (a :func:`time.monotonic` time): once passed, the rest of the file is read and
    its lines counted but only the latest run is parsed — from the last startup banner in the
    rest (its first 4 MiB) and the file's last 32 MiB; the lines between are not parsed and
    ``VllmLog.cut`` says which (line numbers stay exact).
    """
    origin = os.fspath(path)
    parser = _Parser(origin, bounded=True)
    meter = _Progress(origin) if (progress if progress is not None else _stderr_is_tty()) else None
    try:
        chunks = iter_log_chunks(origin, on_bytes=meter.update if meter else None)
        for text in chunks:
            parser.feed_chunk(text)
            if deadline is not None and time.monotonic() > deadline:
                _parse_latest_run(parser, chunks)
                break
    finally:
        if meter is not None:
            meter.done()
    parser.finish()
    parser.log.events.sort(key=lambda e: e.line)
    return parser.log


def _lines_in(chunks: Iterable[str]) -> int:
    """Lines in chunks of :func:`iter_log_chunks` (whole lines, no trailing newline)."""
    return sum(text.count("\n") + 1 for text in chunks)


def _run_start(text: str) -> int:
    """The start of the last line of ``text`` that starts a run (:data:`_RUN_START_WORDS`), or -1."""
    at = max(text.rfind(word) for word in _RUN_START_WORDS)
    return -1 if at < 0 else text.rfind("\n", 0, at) + 1


def _parse_latest_run(parser: _Parser, chunks: Iterator[str]) -> None:
    """Stream the rest of ``chunks`` keeping the start of the last run that begins in them
    (:data:`_CUT_HEAD_CHARS`) and, within :data:`_CUT_TAIL_CHARS`, the file's end and the lines
    just before that run; parse what was kept in file order and count the lines of the rest;
    say which lines were not parsed in ``parser.log.cut``."""
    first = parser.lineno + 1  # the first line not yet parsed
    earlier: deque[str] = deque()  # the lines just before the head (earlier runs' ends)
    head: list[str] = []  # the last run's start
    tail: deque[str] = deque()  # the last lines read
    kept = head_chars = 0  # characters in earlier + tail; in head
    before = 0  # lines dropped before earlier + head (or before the tail when no run starts)
    middle = 0  # lines dropped between the head and the tail

    def trim() -> None:
        nonlocal kept, before, middle
        while kept > _CUT_TAIL_CHARS:
            if earlier:  # earlier runs go first
                old = earlier.popleft()
                before += old.count("\n") + 1
            elif len(tail) > 1:
                old = tail.popleft()
                if head:
                    middle += old.count("\n") + 1
                else:
                    before += old.count("\n") + 1
            else:
                return
            kept -= len(old)

    for text in chunks:
        at = _run_start(text)
        if at >= 0:  # a run starts here: what came before it is an earlier run
            if middle:  # the old head and tail are not contiguous: drop both
                before += _lines_in(earlier) + _lines_in(head) + middle + _lines_in(tail)
                earlier.clear()
            else:
                earlier.extend(head)
                earlier.extend(tail)
            if at:
                earlier.append(text[: at - 1])
            head, head_chars = [text[at:]], len(text) - at
            tail.clear()
            middle = 0
            kept = sum(len(t) for t in earlier)
        elif head and head_chars < _CUT_HEAD_CHARS and not tail:
            head.append(text)
            head_chars += len(text)
            continue
        else:
            tail.append(text)
            kept += len(text)
        trim()
    parser.lineno += before
    for text in (*earlier, *head):
        parser.feed_chunk(text)
    cut_middle = parser.lineno + 1
    parser.lineno += middle
    for text in tail:
        parser.feed_chunk(text)
    parser.log.line_count = parser.lineno
    parts = []
    if before:
        what = "earlier runs" if head else "the middle of the run"
        parts.append(f"lines {first:,}-{first + before - 1:,} ({what})")
    if middle:
        parts.append(f"lines {cut_middle:,}-{cut_middle + middle - 1:,} (the middle of the last run)")
    if parts:
        parser.log.cut = (
            "time budget ran out: "
            + " and ".join(parts)
            + " counted, not parsed; the last run's start and the file's last "
            + f"{_CUT_TAIL_CHARS >> 20} MiB parsed in full"
        )


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class _Progress:
    """ "reading vllm.log: 41% (82 of 200 MiB)" on stderr, redrawn in place, once reading has
    taken more than two seconds; erased when done."""

    def __init__(self, origin: str) -> None:
        self.name = os.path.basename(origin)
        try:
            self.total = os.stat(origin).st_size
        except OSError:
            self.total = 0
        self.start = time.monotonic()
        self.last = 0.0
        self.shown = False

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.start < 2.0 or now - self.last < 0.2:
            return
        self.last = now
        mib = done / (1 << 20)
        pct = f"{100 * done / self.total:.0f}% " if self.total else ""
        tot = f" of {self.total / (1 << 20):.0f}" if self.total else ""
        sys.stderr.write(f"\rreading {self.name}: {pct}({mib:.0f}{tot} MiB)")
        sys.stderr.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


class LogFollower:
    """Tail a growing vLLM log: each :meth:`poll` parses only the complete lines appended since
    the previous poll (same line parser and state as :func:`parse_log`).

    Truncation (size below the read offset) or rotation (a new inode at ``path``) restarts from
    the beginning of the new file with fresh state and line numbers. ``log`` accumulates the
    events, version and args seen since the last restart. A missing file gives no events.
    """

    #: at most this many bytes are read per poll, so a huge backlog is consumed in steps.
    max_read_bytes = 16 * 1024 * 1024
    #: ``log.events`` keeps at most this many (the oldest are dropped) for days-long tails.
    max_events = 50_000

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._offset = 0
        self._inode: tuple[int, int] | None = None
        self._buf = b""
        self._parser = _Parser(self.path)

    @property
    def log(self) -> VllmLog:
        """Everything parsed since the start (or the last restart)."""
        return self._parser.log

    def _restart(self, inode: tuple[int, int] | None) -> None:
        self._offset = 0
        self._buf = b""
        self._inode = inode
        self._parser = _Parser(self.path)

    def poll(self) -> list[LogEvent]:
        """Parse newly appended complete lines; return their events in file order.

        Raises SourceError only when the file exists but cannot be read.
        """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise SourceError(f"cannot stat log: {exc.strerror or exc}", origin=self.path) from None
        inode = (st.st_dev, st.st_ino)
        if self._inode is None:
            self._inode = inode
        elif inode != self._inode or st.st_size < self._offset:
            self._restart(inode)
        if st.st_size == self._offset:
            return []
        parser = self._parser
        kept = parser.log.events
        new: list[LogEvent] = []
        try:
            with open_regular(self.path, what="log") as fh:
                fh.seek(self._offset)
                while True:  # the whole backlog, in steps: --log FILE reads the file in full
                    try:
                        chunk = fh.read(self.max_read_bytes)
                    except OSError as exc:
                        raise SourceError(
                            f"cannot read log: {exc.strerror or exc}", origin=self.path
                        ) from None
                    if not chunk:
                        break
                    self._offset += len(chunk)
                    data = self._buf + chunk
                    complete, sep, rest = data.rpartition(b"\n")
                    if not sep:
                        complete, rest = b"", data
                    # a line with no end in sight keeps its first MAX_LINE_CHARS bytes only
                    self._buf = rest if len(rest) <= MAX_LINE_CHARS else rest[:MAX_LINE_CHARS]
                    if complete:
                        before = len(kept)
                        parser.feed_chunk(complete.decode("utf-8", errors="replace"))
                        new.extend(kept[before:])
                        if len(kept) > self.max_events:
                            del kept[: len(kept) - self.max_events]
                    if len(chunk) < self.max_read_bytes:
                        break
        except SourceError:
            raise
        if not new:
            return []
        tail = kept[-len(new) - 1 :]
        if any(a.line > b.line for a, b in zip(tail, tail[1:], strict=False)):
            kept.sort(key=lambda e: e.line)  # a multi-line message finished: keep file order
        return sorted(new, key=lambda e: e.line)
