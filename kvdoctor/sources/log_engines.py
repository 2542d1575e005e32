"""Engine identity in a vLLM log: which pids are the engine's, how many engines one log holds.

vLLM is not always a process called vllm: a plain Python application building ``LLM(...)``
engines, another inference server's backend, Ray actors, or a V0 engine process whose own lines
carry no ``(NAME pid=N)`` prefix. Every line that names an engine's pid is a source:

- "Started engine process with PID 4113" (V0 multiprocessing front end, vllm-facts §3.2);
- application / launcher lines naming an engine's or worker's pid ("vLLM engine … pid 4113",
  "worker pid=4113 started");
- uvicorn's "Started server process [1]" (the API server);
- the process prefixes themselves (``LogEvent.pid``, read by the parser).

The parser calls :func:`engine_pid_line` on every message (one substring test before any regex)
and emits an ``engine_pid`` event {pid, source} for a hit.
"""

from __future__ import annotations

import re

from kvdoctor.facts import LogEngine, VllmLog
from kvdoctor.lazyre import lazy_re

__all__ = [
    "engine_pid_line",
    "external_weights_line",
    "oom_engine_pid",
    "request_prompt_tokens",
    "split_engines",
]

PROMPT_IDS = "prompt_token_ids: ["
_REDACTED_IDS_RE = lazy_re(r"<redacted (\d{1,12}) tokens>\]")


def request_prompt_tokens(message: str) -> int | None:
    """A request-log line's prompt length in tokens: the length of its ``prompt_token_ids`` list,
    or N of the redacted form ``[<redacted N tokens>]`` (spec/bundle.md). None when the line
    names no token ids ("Received request …" / "Added request …", vllm-facts §3).

    The list is counted by its commas at C speed (``str.find``/``str.count``, no regex over
    the ids), up to its "]" or the end of the (already length-capped) line."""
    i = message.find(PROMPT_IDS)
    if i < 0:
        return None
    start = i + len(PROMPT_IDS)
    if message.startswith("<redacted ", start):
        m = _REDACTED_IDS_RE.match(message, start)
        if m:
            return int(m.group(1))
    end = message.find("]", start)
    body = (message[start:] if end < 0 else message[start:end]).strip().rstrip(",")
    if not body:
        return 0
    return body.count(",") + 1


_STARTED_RE = lazy_re(
    r"Started engine (?:core )?process with PID (\d+)|Started server process \[(\d+)\]", re.IGNORECASE
)
_APP_RE = lazy_re(
    r"\b(?:vllm|engine|enginecore|worker|llm)\b[^\n]{0,80}?\bpid\b[ =:#]*(\d{1,9})\b", re.IGNORECASE
)


def engine_pid_line(message: str) -> tuple[int, str] | None:
    """(pid, source) when a log message names an engine process's pid, else None.

    ``source`` is "started_engine_process", "server_process" (uvicorn's "Started server
    process [N]": the API server) or "application". Never raises."""
    if "pid" not in message and "PID" not in message and "Started server process" not in message:
        return None
    m = _STARTED_RE.search(message)
    if m:
        if m.group(2):
            return int(m.group(2)), "server_process"
        return int(m.group(1)), "started_engine_process"
    if "Process " in message and "memory in use" in message:
        return None  # a CUDA OOM lists every process on the GPU, foreign ones too
    m = _APP_RE.search(message)
    if m and int(m.group(1)) > 0:
        return int(m.group(1)), "application"
    return None


# vLLM ≥ 0.32 with weights held by another process (a ``vllm preload`` daemon), vllm-facts §2.1 /
# §3.5: "Externally held weights on device cuda:0 (14.96 GiB) exceed the desired GPU memory
# utilization (0.3, 23.85 GiB) …", "Free memory on device cuda:0 (40.1/79.2 GiB) on startup is
# less than the engine's budget after excluding external process's weights (52.3 GiB) …", and
# the informational "Externally held weights: 14.96 GiB …" form.
_EXTERNAL_RE = lazy_re(r"Externally held weights(?: on device (\S+))?:? \(?(\d+(?:\.\d+)?) ?GiB")
_EXTERNAL_BUDGET_RE = lazy_re(
    r"Free memory on device (?:(\S+) )?\((\d+(?:\.\d+)?)/(\d+(?:\.\d+)?) GiB\) on startup is less than "
    r"the engine's budget after excluding external process's weights(?: \((\d+(?:\.\d+)?) GiB\))?"
)


def external_weights_line(message: str) -> dict[str, object] | None:
    """{bytes, device, error} when a line names weights another process holds on the GPU
    (``bytes``: the externally held weights, GiB = 2^30, None when the line gives no figure;
    ``error``: vLLM refused to start on it), else None. One substring test first; never raises."""
    if "xternal" not in message:
        return None
    m = _EXTERNAL_RE.search(message)
    if m:
        return {
            "bytes": int(float(m.group(2)) * 2**30),
            "device": m.group(1),
            "error": "exceed" in message[m.end() : m.end() + 40],
        }
    m = _EXTERNAL_BUDGET_RE.search(message)
    if m:
        free, total = float(m.group(2)), float(m.group(3))
        return {
            "bytes": None,
            "device": m.group(1),
            "error": True,
            "free_bytes": int(free * 2**30),
            "total_bytes": int(total * 2**30),
            "budget_bytes": int(float(m.group(4)) * 2**30) if m.group(4) else None,
        }
    return None


def oom_engine_pid(values: dict[str, object]) -> int | None:
    """The pid of the process that raised a CUDA OOM, from the pids the message names
    ("Process 3371 has 15.25 GiB memory in use"): the only one listed, or the one whose bytes
    equal "this process has X memory in use". None when it cannot be told apart.

    ``values``: a ``cuda_oom`` event's values (``other_processes`` [{pid, bytes}],
    ``this_process_bytes``)."""
    procs = values.get("other_processes")
    if not isinstance(procs, list) or not procs:
        return None
    own = values.get("this_process_bytes")
    if isinstance(own, int) and own > 0:
        same = [p for p in procs if isinstance(p, dict) and abs(int(p.get("bytes") or 0) - own) <= own // 100]
        return int(same[0]["pid"]) if len(same) == 1 else None
    if len(procs) == 1 and isinstance(procs[0], dict) and procs[0].get("pid") is not None:
        return int(procs[0]["pid"])
    return None


# --------------------------------------------------------------------------- one log, several engines

#: event kind → the engine's phase after it (LogEngine.phase).
_ENGINE_PHASE = {
    "weights_loading_start": "weight_loading",
    "model_loading": "profiling",
    "memory_profile_v0": "profiling",
    "memory_profile_v1": "profiling",
    "available_kv_memory": "profiling",
    "kv_cache_size": "profiling",
    "v0_blocks": "profiling",
    "cudagraph_memory_profiling": "graph_capture",
    "graph_capture_start": "graph_capture",
    "graph_capture_done": "ready",
    "stats": "serving",
}
_FAIL_KINDS = frozenset(
    {
        "engine_failed",
        "free_memory_below_util",
        "no_available_kv_memory",
        "max_seq_len_exceeds_kv",
        "v0_max_seq_len_exceeds_kv",
        "load_model_oom",
        "profiling_assertion",
        "invalid_kv_cache_dtype",
    }
)
_TIME_RE = lazy_re(r"^(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)$")


def _seconds(time: str | None) -> float | None:
    """vLLM's "MM-DD HH:MM:SS" → seconds since an arbitrary origin (for gaps only)."""
    m = _TIME_RE.match(time or "")
    if not m:
        return None
    mo, d, h, mi, s = (int(x) for x in m.groups())
    return float((((mo * 31 + d) * 24 + h) * 60 + mi) * 60 + s)


def split_engines(log: VllmLog, phase_of: dict[str, str]) -> list[LogEngine]:
    """The engines of a log holding two or more engine-initialisation lines ("Initializing a V1
    LLM engine … with config", V0's "Initializing an LLM engine"), else [].

    Each event goes to the engine of its pid (an EngineCore's init line claims its pid; the
    k-th API server pid is the k-th engine's), a new pid or an unprefixed line to the engine
    initialised last before it (an unprefixed "non-default args" line: the next one). Per engine:
    pids, its own args (engine config overlaid with its non-default args), last phase, whether
    its startup failed, and the time of its first line (``LogEngine.start_s``).

    Also corrects, in place, a ``cuda_oom`` that the parser put in "cuda_graph_capture" because
    another engine was capturing: its phase becomes its own engine's (``phase_of``: event kind
    → the parser's phase names). Called by the parser on the log it is building."""
    inits = [e for e in log.events if e.kind == "args" and e.values.get("source") == "engine_config"]
    if len(inits) < 2:
        return []
    engines = [
        LogEngine(index=i, init_line=e.line, args=dict(e.values.get("args") or {}), start_s=_seconds(e.time))
        for i, e in enumerate(inits)
    ]
    pid_engine: dict[int, int] = {e.pid: i for i, e in enumerate(inits) if e.pid is not None}
    api_pids: list[int] = []
    own_state: list[str] = ["startup"] * len(engines)
    current = -1
    nxt = 0
    for e in log.events:
        while nxt < len(inits) and inits[nxt].line <= e.line:
            current = nxt
            nxt += 1
        idx: int | None
        if e.pid is not None and e.pid in pid_engine:
            idx = pid_engine[e.pid]
        elif e.pid is not None and (e.process or "").startswith("APIServer"):
            if e.pid not in api_pids:
                api_pids.append(e.pid)
            k = api_pids.index(e.pid)
            idx = k if k < len(engines) else None
        elif e.kind == "args" and e.values.get("source") != "engine_config" and nxt < len(inits):
            # an unprefixed "non-default args" line precedes its own engine's init line
            idx = nxt
        else:
            idx = current if current >= 0 else None
            if idx is not None and e.pid is not None:
                pid_engine[e.pid] = idx
        if idx is None:
            continue
        eng = engines[idx]
        if e.kind == "args" and e.values.get("source") != "engine_config":
            given = {k: v for k, v in (e.values.get("args") or {}).items() if not str(k).startswith("_")}
            eng.args.update(given)
            eng.args["_explicit"] = sorted(set(eng.args.get("_explicit") or []) | set(given))
        if e.pid is not None and e.pid not in eng.pids:
            eng.pids.append(e.pid)
        if eng.start_s is None and e.time:
            eng.start_s = _seconds(e.time)
        if e.kind == "cuda_oom" and e.values.get("phase") == "cuda_graph_capture":
            if own_state[idx] != "cuda_graph_capture":
                e.values["phase"] = own_state[idx]
        if e.kind in phase_of:
            own_state[idx] = phase_of[e.kind]
        if e.kind == "cudagraph_memory_profiling":
            own_state[idx] = "cuda_graph_capture"
        if e.kind in _ENGINE_PHASE:
            eng.phase = _ENGINE_PHASE[e.kind]
            if eng.phase in ("ready", "serving") and eng.failed is None:
                eng.failed = False
        if e.kind in _FAIL_KINDS or (e.kind == "cuda_oom" and eng.phase not in ("ready", "serving")):
            eng.failed = True
    return engines
