"""End-to-end A/B: vLLM's own ``bench throughput`` (and optionally ``serve`` +
``bench serve``) with ``--attention-backend ION`` vs ``--attention-backend FLASH_ATTN``.

Everything runs as subprocesses of ``python3 -m vllm.entrypoints.cli.main`` (no
``vllm`` script on PATH needed).  Both sides get exactly the same flags except
``--attention-backend``; repeats are interleaved A/B/A/B.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from . import report

VLLM_CLI = ("-m", "vllm.entrypoints.cli.main")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")
DEFAULT_MODEL_DIR = Path("bench") / "demo-model"
DEMO_MODEL_SCRIPT = Path("scripts") / "make_demo_model.py"


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    dataset: str = "random"              # "random" | "prefix_repetition"
    range_ratio: float | None = None     # random dataset only
    prefix_len: int = 0                  # prefix_repetition only
    num_prefixes: int = 0                # prefix_repetition only
    prefix_caching: bool | None = None   # None = vLLM default
    note: str = ""

    @property
    def max_prompt_len(self) -> int:
        if self.dataset == "prefix_repetition":
            return self.prefix_len + self.input_len
        r = self.range_ratio or 0.0
        return int(self.input_len * (1 + r))


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("seed", 7680, 512, 32, 64, note="the anchor: 7.5k prompt, 512 out, 32 in flight"),
    Workload("decode-heavy", 2048, 2048, 64, 64, note="decode-dominated"),
    Workload("long", 30720, 1024, 8, 16, note="30k context, 8 in flight"),
    Workload("skewed", 4096, 512, 64, 128, range_ratio=0.9,
             note="input/output lengths uniform in [0.1x, 1.9x]"),
    Workload("shared-prefix", 512, 512, 32, 64, dataset="prefix_repetition",
             prefix_len=6144, num_prefixes=4, prefix_caching=True,
             note="4 shared 6k prefixes + 512 unique tokens each, prefix caching on"),
)}

BACKENDS = ("ION", "FLASH_ATTN")

#: ION variants for the A/B: a label, run as ``--attention-backend ION`` with the backend's
#: opt-in switches set in the environment (ion_vllm/backend.py)
ION_VARIANTS: dict[str, dict[str, str]] = {
    # the backend's defaults since the ninth session (2026-12-01): unpacked prefill tiles,
    # 128-row tiles per step, the split-parallel combine, fused KV writeback
    "ION+packed": {"ION_UNPACKED_PREFILL": "0", "ION_PREFILL_TILE_M": "64"},  # before v4
    "ION+m64": {"ION_PREFILL_TILE_M": "64"},
    # the combines the split-parallel one replaced: rows (default of sessions 4-8), group
    "ION+rowcomb": {"ION_LANE_COMBINE": "0"},
    "ION+groupcomb": {"ION_LANE_COMBINE": "0", "ION_ROW_COMBINE": "0"},
    # 128-token KV pages (kernel API experimental_pages): the e2e side of ion-auto-p128
    "ION+p128": {"ION_EXPERIMENTAL_PAGE": "128"},
    # lazy-rescaling attention kernels: the e2e side of ion-auto-lr
    "ION+lazy": {"ION_LAZY_RESCALE": "1"},
    "ION+pin": {"ION_PIN_PV_WAIT": "1"},
    # plan every step (no plan reuse across steps): the A/B of ION_PLAN_REUSE
    "ION+noreuse": {"ION_PLAN_REUSE": "0"},
    # decode-only steps recut the last decode plan (ION_PLAN_REPAGE, opt-in)
    "ION+repage": {"ION_PLAN_REPAGE": "1"},
    # the fused kernels' straddle copy: 16-byte chunks always (the default since the
    # nineteenth session) / element-wise always / per step (ION_VEC_STRADDLE=auto, the
    # eighteenth session's default)
    "ION+vs": {"ION_VEC_STRADDLE": "1"},
    "ION+novs": {"ION_VEC_STRADDLE": "0"},
    "ION+vsauto": {"ION_VEC_STRADDLE": "auto"},
    # idle consumer warpgroups skip their wgmma (ION_SKIP_IDLE, an experiment), and both
    "ION+si": {"ION_SKIP_IDLE": "1"},
    "ION+vs+si": {"ION_VEC_STRADDLE": "1", "ION_SKIP_IDLE": "1"},
    # page pairs on the 128-row q tiles of prefill-dominated steps: the e2e side of
    # ion-auto-kp / ion-auto-fused-kp
    "ION+kp": {"ION_KV_PAIR": "1"},
    # split-KV combine by programmatic dependent launch: the e2e side of ion-auto-pdl
    "ION+pdl": {"ION_PDL_COMBINE": "1"},
    # kv_append + attention instead of fused writeback: the e2e side of ion-auto-append
    "ION+append": {"ION_FUSED_KV_WRITEBACK": "0"},
    # the defaults of sessions 4-8 (row combine, kv_append)
    "ION+append+rowcomb": {"ION_FUSED_KV_WRITEBACK": "0", "ION_LANE_COMBINE": "0"},
    "ION+unpacked": {"ION_UNPACKED_PREFILL": "1"},
    # now part of the defaults; the labels stay for the recorded results that use them
    "ION+lanes": {"ION_LANE_COMBINE": "1"},
    "ION+fused": {"ION_FUSED_KV_WRITEBACK": "1"},
    "ION+fused+unpacked": {"ION_FUSED_KV_WRITEBACK": "1", "ION_UNPACKED_PREFILL": "1"},
    "ION+lanes+fused": {"ION_LANE_COMBINE": "1", "ION_FUSED_KV_WRITEBACK": "1"},
}


def resolve_backend(label: str) -> tuple[str, dict[str, str]]:
    """(vLLM --attention-backend value, extra environment) of a backend label."""
    if label in ION_VARIANTS:
        return "ION", dict(ION_VARIANTS[label])
    return label, {}


def backend_env(label: str, opts: "E2EOptions") -> dict[str, str]:
    env = dict(opts.env)
    env.update(resolve_backend(label)[1])
    return env


@dataclass
class E2EOptions:
    model: str
    backends: tuple[str, ...] = BACKENDS
    repeats: int = 2
    seed: int = 0
    num_prompts: int | None = None
    disable_detokenize: bool = False
    load_format: str | None = None       # None: "dummy" iff the model dir has no weights
    num_warmups: int = 4
    max_model_len: int | None = None
    extra_args: tuple[str, ...] = ()
    python: str = sys.executable
    run_timeout: float = 1800.0
    server_timeout: float = 900.0
    env: dict = field(default_factory=dict)
    kv_cache_gib: float = 40.0           # --colocate: KV cache per server (GiB)
    time_budget: float = 0.0             # --colocate: no new bench run after this many s


# --------------------------------------------------------------------------- commands

def model_has_weights(model: str | os.PathLike) -> bool:
    p = Path(model)
    if not p.is_dir():
        return True  # not a local dir: let vLLM resolve it
    return any(f.name.endswith(WEIGHT_SUFFIXES) for f in p.iterdir())


def load_format_for(opts: E2EOptions) -> str | None:
    if opts.load_format:
        return opts.load_format
    return None if model_has_weights(opts.model) else "dummy"


def _dataset_args(w: Workload, num_prompts: int) -> list[str]:
    if w.dataset == "random":
        args = ["--dataset-name", "random", "--random-input-len", str(w.input_len),
                "--random-output-len", str(w.output_len)]
        if w.range_ratio is not None:
            args += ["--random-range-ratio", str(w.range_ratio)]
    elif w.dataset == "prefix_repetition":
        args = ["--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(w.prefix_len),
                "--prefix-repetition-suffix-len", str(w.input_len),
                "--prefix-repetition-num-prefixes", str(w.num_prefixes),
                "--prefix-repetition-output-len", str(w.output_len)]
    else:
        raise ValueError(f"unknown dataset {w.dataset}")
    return args + ["--num-prompts", str(num_prompts)]


def _engine_args(w: Workload, backend: str, opts: E2EOptions) -> list[str]:
    args = ["--attention-backend", resolve_backend(backend)[0],
            "--max-num-seqs", str(w.concurrency),
            "--seed", str(opts.seed)]
    lf = load_format_for(opts)
    if lf:
        args += ["--load-format", lf]
    if w.prefix_caching is True:
        args += ["--enable-prefix-caching"]
    elif w.prefix_caching is False:
        args += ["--no-enable-prefix-caching"]
    if opts.max_model_len:
        args += ["--max-model-len", str(opts.max_model_len)]
    return args


def _warmups(w: Workload, opts: E2EOptions) -> int:
    # prefix_repetition needs at least one prompt per prefix, warm-up included
    if w.dataset == "prefix_repetition":
        return max(opts.num_warmups, w.num_prefixes)
    return opts.num_warmups


def num_prompts_for(w: Workload, opts: E2EOptions) -> int:
    return opts.num_prompts if opts.num_prompts else w.num_prompts


def throughput_cmd(w: Workload, backend: str, opts: E2EOptions, output_json: str) -> list[str]:
    """``vllm bench throughput`` for one side of the A/B."""
    cmd = [opts.python, *VLLM_CLI, "bench", "throughput", "--backend", "vllm",
           "--model", str(opts.model)]
    cmd += _dataset_args(w, num_prompts_for(w, opts))
    cmd += _engine_args(w, backend, opts)
    if opts.num_warmups:
        cmd += ["--num-warmups", str(_warmups(w, opts))]
    if opts.disable_detokenize:
        cmd += ["--disable-detokenize"]
    cmd += ["--output-json", str(output_json)]
    cmd += list(opts.extra_args)
    return cmd


def serve_cmd(w: Workload, backend: str, opts: E2EOptions, port: int) -> list[str]:
    cmd = [opts.python, *VLLM_CLI, "serve", str(opts.model), "--host", "127.0.0.1",
           "--port", str(port)]
    cmd += _engine_args(w, backend, opts)
    cmd += list(opts.extra_args)
    return cmd


def bench_serve_cmd(w: Workload, opts: E2EOptions, port: int, result_dir: str,
                    result_file: str, seed: int | None = None) -> list[str]:
    """``vllm bench serve`` against the server on ``port``.  ``seed``: the repeat's
    dataset seed (``opts.seed + repeat``; default ``opts.seed``): the same seed on every
    repeat would replay the same prompts, which the server's prefix cache then serves."""
    seed = opts.seed if seed is None else seed
    cmd = [opts.python, *VLLM_CLI, "bench", "serve", "--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{port}", "--model", str(opts.model)]
    cmd += _dataset_args(w, num_prompts_for(w, opts))
    cmd += ["--max-concurrency", str(w.concurrency), "--request-rate", "inf", "--ignore-eos",
            "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result",
            "--result-dir", str(result_dir), "--result-filename", str(result_file)]
    if opts.num_warmups:
        cmd += ["--num-warmups", str(_warmups(w, opts))]
    return cmd


def plan_throughput(workloads: list[Workload], opts: E2EOptions, out_dir: Path,
                    offsets: dict[str, int] | None = None):
    """[(workload, backend, repeat, cmd, json_path)] in execution order: per
    workload, repeat r runs every backend in the given order (A/B/A/B).
    Repeat numbers start at ``offsets[workload]`` (runs kept from earlier calls)."""
    plan = []
    for w in workloads:
        first = (offsets or {}).get(w.name, 0)
        for r in range(first, first + opts.repeats):
            for b in opts.backends:
                js = out_dir / "raw" / f"{w.name}-{b}-r{r}.json"
                plan.append((w, b, r, throughput_cmd(w, b, opts, str(js)), js))
    return plan


# --------------------------------------------------------------------------- colocated servers
#
# ``--serve --colocate``: one ``vllm serve`` per backend label, all started at once on
# one GPU, each sized explicitly (no KV-cache profiling race between the processes),
# each serving every selected workload; the bench runs then alternate between them.

#: the GPU-memory fraction shared out between the colocated servers
COLOCATE_GPU_FRACTION_PCT = 90
#: max-model-len granularity for colocated servers
COLOCATE_LEN_ROUND = 256
#: server environment: VLLM_SERVER_DEV_MODE=1 exposes POST /reset_prefix_cache, called
#: before every bench run so that a run never hits blocks cached by an earlier workload
#: or repeat on the same long-lived server
COLOCATE_SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def check_colocatable(workloads: list[Workload]) -> None:
    """Colocated servers keep vLLM's default prefix caching (on) for every workload;
    a workload that asks for it off cannot share them."""
    off = [w.name for w in workloads if w.prefix_caching is False]
    if off:
        raise ValueError(
            f"--colocate serves every workload from one server per backend with prefix "
            f"caching on (vLLM's default), but workload(s) {', '.join(off)} need it off; "
            f"run them without --colocate")


def colocate_gpu_memory_utilization(n_servers: int) -> float:
    """floor(0.90 / n, 2 decimals), in integer arithmetic (0.90/2 = 0.45, /3 = 0.30, /4 = 0.22)."""
    if n_servers < 1:
        raise ValueError("need at least one server")
    return (COLOCATE_GPU_FRACTION_PCT // n_servers) / 100


#: GiB per colocated server that is neither weights nor KV cache (CUDA context, activations,
#: CUDA-graph pools, torch.compile workspaces), for ``check_colocated_memory``
COLOCATE_RESERVE_GIB = 3.0


def estimate_weight_bytes(model: str | os.PathLike, dtype_bytes: int = 2) -> int | None:
    """Weight bytes of a dense decoder from its ``config.json`` (embeddings, attention,
    gated MLP, untied LM head), or None if the config is missing or is not that shape (MoE,
    multimodal): Qwen2.5-7B gives 7.62e9 parameters, 15.2 GB in bf16."""
    try:
        c = json.loads((Path(model) / "config.json").read_text())
        h, n_layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
        inter, vocab = int(c["intermediate_size"]), int(c["vocab_size"])
        nh = int(c["num_attention_heads"])
        nkv = int(c.get("num_key_value_heads") or nh)
        d = int(c.get("head_dim") or h // nh)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if any(k in c for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    attn = 2 * h * nh * d + 2 * h * nkv * d
    params = n_layers * (attn + 3 * h * inter) + vocab * h * (
        1 if c.get("tie_word_embeddings") else 2)
    return params * dtype_bytes


def gpu_total_bytes() -> int | None:
    """This host's GPU memory (device 0) from ``nvidia-smi``, or None without one.  Not
    through torch: a CUDA context in the bench process would hold GPU memory for the
    whole run."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return int(out.split()[0]) << 20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def check_colocated_memory(n_servers: int, kv_cache_gib: float, weight_bytes: int | None,
                           total_bytes: int | None,
                           reserve_gib: float = COLOCATE_RESERVE_GIB) -> None:
    """Refuse a colocated run whose servers cannot all fit on the GPU: each needs its fixed
    KV cache (``--kv-cache-memory-bytes`` is not capped by ``--gpu-memory-utilization``),
    its weights and ``reserve_gib``.  Overcommitted, one server dies with an out-of-memory
    error mid-benchmark (seen on 2026-12-01: three 7B servers at 30 GiB each).  Unknown
    weights or GPU size: no check."""
    if weight_bytes is None or total_bytes is None:
        return
    gib = 1 << 30
    need = n_servers * (kv_cache_gib * gib + weight_bytes + reserve_gib * gib)
    if need > total_bytes:
        fit = total_bytes / n_servers / gib - weight_bytes / gib - reserve_gib
        raise ValueError(
            f"--colocate: {n_servers} servers x ({kv_cache_gib:g} GiB KV + "
            f"{weight_bytes / gib:.1f} GiB weights + {reserve_gib:g} GiB reserve) = "
            f"{need / gib:.1f} GiB > the GPU's {total_bytes / gib:.1f} GiB; use "
            f"--kv-cache-gib {math.floor(fit * 10) / 10:g} or fewer backends"
            if fit >= 0.1 else
            f"--colocate: {n_servers} servers' weights and reserve alone do not fit on the GPU")


def log_tail(path: str | os.PathLike, lines: int = 25) -> str:
    """The last ``lines`` lines of a (server) log, for an error report; '' if unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def colocate_kv_cache_bytes(opts: E2EOptions) -> int:
    if opts.kv_cache_gib <= 0:
        raise ValueError(f"--kv-cache-gib must be > 0 (got {opts.kv_cache_gib})")
    return round(opts.kv_cache_gib * (1 << 30))


def colocate_max_num_seqs(workloads: list[Workload]) -> int:
    return max(w.concurrency for w in workloads)


def colocate_max_model_len(workloads: list[Workload], opts: E2EOptions) -> int:
    """``opts.max_model_len`` if given, else the longest prompt + output any selected
    workload can draw, rounded up to a multiple of 256."""
    if opts.max_model_len:
        return opts.max_model_len
    need = max(w.max_prompt_len + math.ceil(w.output_len * (1 + (w.range_ratio or 0.0)))
               for w in workloads)
    return -(-need // COLOCATE_LEN_ROUND) * COLOCATE_LEN_ROUND


def colocate_serve_cmd(workloads: list[Workload], backend: str, opts: E2EOptions,
                       port: int) -> list[str]:
    """``vllm serve`` for one backend label, sized for all ``workloads`` and for a GPU
    shared with ``len(opts.backends)`` servers."""
    check_colocatable(workloads)
    cmd = [opts.python, *VLLM_CLI, "serve", str(opts.model), "--host", "127.0.0.1",
           "--port", str(port),
           "--attention-backend", resolve_backend(backend)[0],
           "--max-num-seqs", str(colocate_max_num_seqs(workloads)),
           "--max-model-len", str(colocate_max_model_len(workloads, opts)),
           "--gpu-memory-utilization", f"{colocate_gpu_memory_utilization(len(opts.backends)):.2f}",
           "--kv-cache-memory-bytes", str(colocate_kv_cache_bytes(opts)),
           "--seed", str(opts.seed)]
    lf = load_format_for(opts)
    if lf:
        cmd += ["--load-format", lf]
    if any(w.prefix_caching is True for w in workloads):
        cmd += ["--enable-prefix-caching"]  # the default, said explicitly
    cmd += list(opts.extra_args)
    return cmd


def colocate_server_env(backend: str, opts: E2EOptions) -> dict[str, str]:
    """Environment added to one colocated server's (on top of os.environ)."""
    env = dict(COLOCATE_SERVER_ENV)
    env.update(backend_env(backend, opts))
    return env


def distinct_free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


def plan_colocated(workloads: list[Workload], opts: E2EOptions, out_dir: Path,
                   ports: dict[str, int], offsets: dict[str, int] | None = None):
    """[(workload, backend, repeat, seed, cmd, result_path)] in execution order: per
    workload, per repeat r, every backend in the given order (A/B/A/B), all with
    ``--seed opts.seed + r``.  Repeats start at ``offsets[workload]``."""
    plan = []
    rdir = out_dir / "raw"
    for w in workloads:
        first = (offsets or {}).get(w.name, 0)
        for r in range(first, first + opts.repeats):
            seed = opts.seed + r
            for b in opts.backends:
                fname = f"{w.name}-serve-{b}-r{r}.json"
                cmd = bench_serve_cmd(w, opts, ports[b], str(rdir), fname, seed=seed)
                plan.append((w, b, r, seed, cmd, rdir / fname))
    return plan


# --------------------------------------------------------------------------- validation

_PARSE_CHECK = r"""
import json, sys
from vllm import platforms
from vllm.platforms.cpu import CpuPlatform
platforms.current_platform = CpuPlatform()
platforms._current_platform = platforms.current_platform
from vllm.utils.argparse_utils import FlexibleArgumentParser
cmds = json.load(sys.stdin)
res = []
for argv in cmds:
    try:
        i = argv.index("vllm.entrypoints.cli.main") + 1
        sub = argv[i:]
        if sub[:2] == ["bench", "throughput"]:
            from vllm.benchmarks import throughput as mod
            p = FlexibleArgumentParser(prog="vllm bench throughput")
            mod.add_cli_args(p)
            a = p.parse_args(sub[2:])
            mod.validate_args(a)
        elif sub[:2] == ["bench", "serve"]:
            from vllm.benchmarks import serve as mod
            p = FlexibleArgumentParser(prog="vllm bench serve")
            mod.add_cli_args(p)
            a = p.parse_args(sub[2:])
        elif sub[:1] == ["serve"]:
            from vllm.entrypoints.openai.cli_args import make_arg_parser
            p = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
            a = p.parse_args(sub[1:])
        else:
            raise ValueError(f"unknown vllm subcommand {sub[:2]}")
        res.append({"ok": True, "args": {k: v for k, v in vars(a).items()
                                          if isinstance(v, (str, int, float, bool, type(None)))}})
    except SystemExit as e:
        res.append({"ok": False, "error": f"argparse exit {e.code}"})
    except Exception as e:
        res.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
print("@@RESULT@@" + json.dumps(res))
"""


def check_with_vllm_parser(cmds: list[list[str]], python: str = sys.executable,
                           timeout: float = 600.0) -> list[dict]:
    """Parse each planned command with vLLM's own argument parser (and, for
    ``bench throughput``, its ``validate_args``) in a CPU-platform subprocess.
    Returns one ``{"ok", "args" | "error"}`` per command."""
    r = subprocess.run([python, "-c", _PARSE_CHECK], input=json.dumps(cmds), text=True,
                       capture_output=True, timeout=timeout)
    for line in r.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@"):])
    raise RuntimeError(f"vLLM parser check failed (rc={r.returncode}):\n{r.stderr[-3000:]}")


# --------------------------------------------------------------------------- parsing

_THROUGHPUT_RE = re.compile(
    r"Throughput:\s*([\d.]+)\s*requests/s,\s*([\d.]+)\s*total tokens/s,\s*([\d.]+)\s*output tokens/s")
_OUT_TOKENS_RE = re.compile(r"Total num output tokens:\s*(\d+)")


def parse_throughput(json_path: str | os.PathLike | None, stdout: str) -> dict:
    """One run's numbers from ``--output-json`` (elapsed, total tok/s) and the
    printed summary line (output tok/s, which the JSON does not carry)."""
    res: dict = {}
    if json_path and Path(json_path).exists():
        js = json.loads(Path(json_path).read_text())
        res["elapsed_s"] = js.get("elapsed_time")
        res["num_requests"] = js.get("num_requests")
        res["total_num_tokens"] = js.get("total_num_tokens")
        res["requests_s"] = js.get("requests_per_second")
        res["total_tok_s"] = js.get("tokens_per_second")
    m = None
    for m in _THROUGHPUT_RE.finditer(stdout):
        pass
    if m:
        res.setdefault("requests_s", float(m.group(1)))
        if res.get("total_tok_s") is None:
            res["total_tok_s"] = float(m.group(2))
        res["output_tok_s"] = float(m.group(3))
    else:
        mo = list(_OUT_TOKENS_RE.finditer(stdout))
        if mo and res.get("elapsed_s"):
            res["output_tok_s"] = int(mo[-1].group(1)) / res["elapsed_s"]
    return res


def parse_bench_serve(path: str | os.PathLike) -> dict:
    js = json.loads(Path(path).read_text())

    def g(*keys):
        for k in keys:
            if js.get(k) is not None:
                return js[k]
        return None

    return {
        "total_tok_s": g("total_token_throughput"),
        "output_tok_s": g("output_throughput"),
        "requests_s": g("request_throughput"),
        "elapsed_s": g("duration"),
        "completed": g("completed"),
        "failed": g("failed"),
        "ttft_p50_ms": g("p50_ttft_ms", "median_ttft_ms"),
        "ttft_p99_ms": g("p99_ttft_ms"),
        "tpot_p50_ms": g("p50_tpot_ms", "median_tpot_ms"),
        "tpot_p99_ms": g("p99_tpot_ms"),
        "itl_p50_ms": g("p50_itl_ms", "median_itl_ms"),
        "itl_p99_ms": g("p99_itl_ms"),
    }


def build_records(workload: Workload, runs: dict[str, list[dict]], opts: E2EOptions,
                  case: str | None = None, errors: dict[str, str] | None = None) -> list[dict]:
    """One e2e record per backend from its runs; the ION record also carries the
    ION/FLASH_ATTN ratios (mean ratio and the spread of per-repeat ratios)."""
    case = case or workload.name
    recs = {}
    for b in opts.backends:
        ok = [r for r in runs.get(b, []) if r.get("total_tok_s")]
        rec = {"suite": "e2e", "case": case, "backend": b,
               "workload": {"input_len": workload.input_len, "output_len": workload.output_len,
                            "concurrency": workload.concurrency,
                            "num_prompts": num_prompts_for(workload, opts),
                            "dataset": workload.dataset, "range_ratio": workload.range_ratio,
                            "prefix_len": workload.prefix_len,
                            "num_prefixes": workload.num_prefixes,
                            "prefix_caching": workload.prefix_caching,
                            "seed": opts.seed, "model": str(opts.model),
                            "load_format": load_format_for(opts)},
               "runs": ok}
        rec.update(report.e2e_aggregate(ok))
        lat_keys = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                    "itl_p50_ms", "itl_p99_ms")
        for k in lat_keys:
            vals = [r[k] for r in ok if r.get(k) is not None]
            if vals:
                rec[k] = sum(vals) / len(vals)
        if ok:
            rec["status"] = "ok"
        else:
            rec["status"] = "error"
            rec["error"] = (errors or {}).get(b, "no successful run")
        if errors and b in errors and ok:
            rec["warning"] = errors[b]
        recs[b] = rec
    base = recs.get(report.E2E_BASELINE)
    for label, ion in recs.items():  # ION and its variants, each against FLASH_ATTN
        if not (base and label.startswith(report.ION_E2E)):
            continue
        for key in ("total_tok_s", "output_tok_s"):
            r = report.e2e_ratio(ion, base, key)
            if r:
                ion[f"ratio_{key}_vs_{report.E2E_BASELINE}"] = r
    return list(recs.values())


# --------------------------------------------------------------------------- processes

def _run_logged(cmd: list[str], log_path: Path, timeout: float, env: dict | None = None,
                cwd: str | None = None) -> tuple[int, str]:
    """Run ``cmd`` in its own session, teeing output to ``log_path``; on timeout
    or interrupt the whole process group (vLLM's engine core included) is killed."""
    import threading
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env.update(env or {})
    out: list[str] = []
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(_q(c) for c in cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1, start_new_session=True,
                                env=full_env, cwd=cwd)

        def pump():
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                out.append(line)

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        try:
            rc = proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            _kill_group(proc)
            th.join(timeout=10)
            log.write(f"\n[ion-bench] killed: {e!r}\n")
            if isinstance(e, KeyboardInterrupt):
                raise
            return -9, "".join(out)
        th.join(timeout=30)
    return rc, "".join(out)


def _kill_group(proc: subprocess.Popen, grace: float = 20.0):
    """Stop the process group led by ``proc`` (started by us with its own session)."""
    if proc.poll() is not None:
        # Leader is gone; take down any helper it left behind in its group.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _q(s: str) -> str:
    import shlex
    return shlex.quote(str(s))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float) -> None:
    url = f"http://127.0.0.1:{port}/health"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {proc.returncode} before /health")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(2.0)
    raise TimeoutError(f"vllm serve not healthy after {timeout:.0f}s")


# --------------------------------------------------------------------------- drivers

def ensure_model(opts: E2EOptions, log=print) -> None:
    """The default demo model dir is created on first use with
    ``scripts/make_demo_model.py`` (offline; no weights)."""
    p = Path(opts.model)
    if p.exists():
        return
    if p == DEFAULT_MODEL_DIR and DEMO_MODEL_SCRIPT.exists():
        log(f"[e2e] creating demo model in {p} with {DEMO_MODEL_SCRIPT}")
        subprocess.run([opts.python, str(DEMO_MODEL_SCRIPT), str(p)], check=True)
        return
    raise FileNotFoundError(
        f"model dir {p} does not exist (create one with: python3 {DEMO_MODEL_SCRIPT} {p})")


def run_throughput(workloads: list[Workload], opts: E2EOptions, out_dir: Path, *,
                   log=print, on_records=None, prior: dict | None = None) -> list[dict]:
    """``prior[case][backend]``: runs from earlier invocations to keep (``--accumulate``)."""
    prior = prior or {}
    runs: dict[str, dict[str, list[dict]]] = {
        w.name: {b: list(prior.get(w.name, {}).get(b, [])) for b in opts.backends}
        for w in workloads}
    offsets = {}
    for w in workloads:  # keep prior runs pairwise aligned across backends
        n = min(len(v) for v in runs[w.name].values())
        runs[w.name] = {b: v[:n] for b, v in runs[w.name].items()}
        offsets[w.name] = n
    plan = plan_throughput(workloads, opts, out_dir, offsets)
    errors: dict[str, dict[str, str]] = {w.name: {} for w in workloads}
    all_recs: dict[str, list[dict]] = {}
    for i, (w, b, r, cmd, js) in enumerate(plan):
        log(f"[e2e] ({i + 1}/{len(plan)}) {w.name} {b} repeat {r + 1 - offsets[w.name]}/"
            f"{opts.repeats} ...")
        js.parent.mkdir(parents=True, exist_ok=True)
        if js.exists():
            js.unlink()
        t0 = time.monotonic()
        logp = out_dir / "logs" / f"{w.name}-{b}-r{r}.log"
        rc, out = _run_logged(cmd, logp, opts.run_timeout, env=backend_env(b, opts))
        wall = time.monotonic() - t0
        res = parse_throughput(js, out) if rc == 0 else {}
        if rc == 0 and res.get("total_tok_s"):
            res.update(repeat=r, wall_s=wall, log=str(logp))
            runs[w.name][b].append(res)
            log(f"[e2e] {w.name:<14} {b:<10} r{r}: {res['total_tok_s']:9.1f} total tok/s, "
                f"{res.get('output_tok_s') or float('nan'):9.1f} output tok/s "
                f"(elapsed {res.get('elapsed_s') or float('nan'):.1f}s, wall {wall:.0f}s)")
        else:
            tail = "".join(out.splitlines(keepends=True)[-5:]).strip()
            errors[w.name][b] = f"run {r} failed (rc={rc}); see {logp}: {tail[-300:]}"
            log(f"[e2e] {w.name:<14} {b:<10} r{r}: FAILED rc={rc} (log {logp})")
        all_recs[w.name] = build_records(w, runs[w.name], opts, errors=errors[w.name])
        if on_records:
            on_records([x for v in all_recs.values() for x in v])
    return [x for v in all_recs.values() for x in v]


def run_serve(workloads: list[Workload], opts: E2EOptions, out_dir: Path, *,
              log=print, on_records=None, prior: dict | None = None) -> list[dict]:
    """Per workload and backend: start ``vllm serve``, wait for /health, run
    ``vllm bench serve`` ``repeats`` times, stop the server."""
    all_recs: dict[str, list[dict]] = {}
    prior = prior or {}
    for w in workloads:
        runs = {b: list(prior.get(f"{w.name}-serve", {}).get(b, [])) for b in opts.backends}
        offset = min(len(v) for v in runs.values())
        runs = {b: v[:offset] for b, v in runs.items()}
        errors: dict[str, str] = {}
        for b in opts.backends:
            port = free_port()
            cmd = serve_cmd(w, b, opts, port)
            logp = out_dir / "logs" / f"{w.name}-serve-{b}.server.log"
            logp.parent.mkdir(parents=True, exist_ok=True)
            log(f"[e2e] starting vllm serve ({b}) on port {port} (log {logp})")
            env = dict(os.environ)
            env.update(backend_env(b, opts))
            with open(logp, "w") as lf:
                lf.write("$ " + " ".join(_q(c) for c in cmd) + "\n")
                lf.flush()
                proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT,
                                        start_new_session=True, env=env)
                try:
                    wait_healthy(port, proc, opts.server_timeout)
                    for r in range(offset, offset + opts.repeats):
                        fname = f"{w.name}-serve-{b}-r{r}.json"
                        rdir = out_dir / "raw"
                        res_path = rdir / fname
                        if res_path.exists():
                            res_path.unlink()
                        bcmd = bench_serve_cmd(w, opts, port, str(rdir), fname,
                                               seed=opts.seed + r)
                        blog = out_dir / "logs" / f"{w.name}-serve-{b}-r{r}.log"
                        rc, _ = _run_logged(bcmd, blog, opts.run_timeout, env=opts.env)
                        if rc == 0 and res_path.exists():
                            res = parse_bench_serve(res_path)
                            res.update(repeat=r, seed=opts.seed + r, log=str(blog))
                            runs[b].append(res)
                            log(f"[e2e] {w.name + '-serve':<20} {b:<10} r{r}: "
                                f"{res['total_tok_s'] or float('nan'):9.1f} total tok/s, TTFT p50 "
                                f"{res['ttft_p50_ms'] or float('nan'):.1f} ms p99 "
                                f"{res['ttft_p99_ms'] or float('nan'):.1f} ms, TPOT p50 "
                                f"{res['tpot_p50_ms'] or float('nan'):.2f} ms p99 "
                                f"{res['tpot_p99_ms'] or float('nan'):.2f} ms")
                        else:
                            errors[b] = f"bench serve run {r} failed (rc={rc}); see {blog}"
                            log(f"[e2e] {w.name}-serve {b} r{r}: FAILED rc={rc} (log {blog})")
                except Exception as e:  # noqa: BLE001 - report and go on with the next side
                    errors[b] = f"{type(e).__name__}: {e} (server log {logp})"
                    log(f"[e2e] {w.name}-serve {b}: {errors[b]}")
                finally:
                    _kill_group(proc)
            all_recs[w.name] = build_records(w, runs, opts, case=f"{w.name}-serve",
                                             errors=errors)
            if on_records:
                on_records([x for v in all_recs.values() for x in v])
    return [x for v in all_recs.values() for x in v]


@dataclass
class ColocatedServer:
    backend: str
    port: int
    argv: list[str]
    env: dict[str, str]           # added to os.environ
    log_path: Path
    proc: subprocess.Popen | None = None
    started: float | None = None  # time.monotonic() at launch
    startup_s: float | None = None
    error: str | None = None

    def info(self) -> dict:
        d = {"colocated": True, "startup_s": self.startup_s, "port": self.port,
             "argv": list(self.argv)}
        if self.error:
            d["error"] = self.error
        return d


def _launch(s: ColocatedServer) -> None:
    s.log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(s.env)
    with open(s.log_path, "w") as lf:
        extra = " ".join(f"{k}={_q(v)}" for k, v in sorted(s.env.items()))
        lf.write(f"$ {extra} " + " ".join(_q(c) for c in s.argv) + "\n")
        lf.flush()
        s.proc = subprocess.Popen(s.argv, stdout=lf, stderr=subprocess.STDOUT,
                                  start_new_session=True, env=env)
    s.started = time.monotonic()


def _wait_all_healthy(servers: list[ColocatedServer], timeout: float, log) -> None:
    """Wait for every server's /health at once; a server that dies or times out gets
    ``error`` set, the others ``startup_s``."""
    import threading

    def one(s: ColocatedServer):
        try:
            wait_healthy(s.port, s.proc, timeout)
            s.startup_s = time.monotonic() - s.started
            log(f"[e2e] colocated server {s.backend} healthy on port {s.port} after "
                f"{s.startup_s:.0f}s")
        except Exception as e:  # noqa: BLE001 - recorded, the others go on
            s.error = f"{type(e).__name__}: {e} (server log {s.log_path})"
            log(f"[e2e] colocated server {s.backend} FAILED: {s.error}")

    threads = [threading.Thread(target=one, args=(s,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)


def _stop_all(servers: list[ColocatedServer], log) -> None:
    """Stop every server's process group, all at once (each gets _kill_group's grace)."""
    import threading
    procs = [s.proc for s in servers if s.proc is not None]
    if not procs:
        return
    log(f"[e2e] stopping {len(procs)} colocated server(s)")
    threads = [threading.Thread(target=_kill_group, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for p in procs:  # a leader that outlived the threads' wait: no grace left
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def reset_prefix_cache(port: int, tries: int = 3) -> bool | None:
    """POST /reset_prefix_cache (served with VLLM_SERVER_DEV_MODE=1).  True/False: the
    server's answer (it refuses while blocks are held; retried); None: no such route."""
    url = f"http://127.0.0.1:{port}/reset_prefix_cache"
    ok = False
    for i in range(tries):
        try:
            req = urllib.request.Request(url, data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                body = r.read().decode(errors="replace")
            try:
                ok = bool(json.loads(body).get("success", True))
            except (ValueError, AttributeError):
                ok = True  # 200 without a JSON verdict
        except urllib.error.HTTPError as e:
            if e.code in (404, 405):
                return None
            ok = False
        except (urllib.error.URLError, ConnectionError, OSError):
            ok = False
        if ok:
            return True
        if i + 1 < tries:
            time.sleep(1.0)
    return False


def run_serve_colocated(workloads: list[Workload], opts: E2EOptions, out_dir: Path, *,
                        log=print, on_records=None, prior: dict | None = None,
                        t_start: float | None = None, clock=time.monotonic) -> list[dict]:
    """``--serve --colocate``: start one ``vllm serve`` per backend label at the same
    time on one GPU (explicit memory split, fixed KV cache size), wait for all of them,
    then per workload and repeat run ``vllm bench serve`` against each backend in turn.

    ``opts.time_budget`` (s since ``t_start``, default now; measured with ``clock``):
    no bench run starts after it; records are built from the runs that finished (a
    repeat that the budget cut in the middle is kept apart as ``unpaired_runs``, so
    that the means compare the same prompts).  The servers are always stopped."""
    check_colocatable(workloads)
    prior = prior or {}
    t_start = clock() if t_start is None else t_start
    budget = opts.time_budget or 0.0

    def over_budget() -> bool:
        return budget > 0 and clock() - t_start >= budget

    runs: dict[str, dict[str, list[dict]]] = {}
    offsets: dict[str, int] = {}
    for w in workloads:  # prior runs (--accumulate), kept pairwise aligned
        rs = {b: list(prior.get(f"{w.name}-serve", {}).get(b, [])) for b in opts.backends}
        n = min(len(v) for v in rs.values())
        runs[w.name] = {b: v[:n] for b, v in rs.items()}
        offsets[w.name] = n
    hard: dict[str, dict[str, list[str]]] = {w.name: {b: [] for b in opts.backends}
                                             for w in workloads}
    budget_skips: dict[str, dict[str, list[int]]] = {w.name: {b: [] for b in opts.backends}
                                                     for w in workloads}
    unpaired: dict[str, dict[str, list[dict]]] = {w.name: {b: [] for b in opts.backends}
                                                  for w in workloads}
    ports = dict(zip(opts.backends, distinct_free_ports(len(opts.backends))))
    servers = {b: ColocatedServer(b, ports[b], colocate_serve_cmd(workloads, b, opts, ports[b]),
                                  colocate_server_env(b, opts),
                                  out_dir / "logs" / f"colocated-{b}.server.log")
               for b in opts.backends}
    all_recs: dict[str, list[dict]] = {}
    new_runs: dict[tuple[str, int], dict[str, dict]] = {}  # (workload, repeat) -> this call's

    def records_for(w: Workload) -> list[dict]:
        errs = {}
        for b in opts.backends:
            msgs = list(hard[w.name][b])
            if budget_skips[w.name][b]:
                msgs.append(f"time budget {budget:.0f}s spent: repeat(s) "
                            f"{budget_skips[w.name][b]} not run")
            if unpaired[w.name][b]:
                msgs.append(f"repeat(s) {[x['repeat'] for x in unpaired[w.name][b]]} kept "
                            f"out of the means: the time budget cut their pair")
            if msgs:
                errs[b] = "; ".join(msgs)
        recs = build_records(w, runs[w.name], opts, case=f"{w.name}-serve", errors=errs)
        for rec in recs:
            b = rec["backend"]
            rec["server"] = servers[b].info()
            rec["workload"]["prefix_caching"] = True  # the colocated servers' setting
            if unpaired[w.name][b]:
                rec["unpaired_runs"] = unpaired[w.name][b]
            if (rec["status"] == "error" and not hard[w.name][b]
                    and (budget_skips[w.name][b] or unpaired[w.name][b])):
                rec["status"] = "skipped"
        return recs

    def flush(w: Workload):
        all_recs[w.name] = records_for(w)
        if on_records:
            on_records([x for v in all_recs.values() for x in v])

    try:
        if over_budget():
            log(f"[e2e] time budget {budget:.0f}s already spent: no server started")
        else:
            for b, s in servers.items():
                log(f"[e2e] starting colocated vllm serve ({b}) on port {s.port} "
                    f"(log {s.log_path})")
                try:
                    _launch(s)
                except OSError as e:
                    s.error = f"could not start vllm serve: {type(e).__name__}: {e}"
                    log(f"[e2e] colocated server {b} FAILED: {s.error}")
            wait_s = opts.server_timeout
            if budget > 0:
                wait_s = min(wait_s, max(0.0, budget - (clock() - t_start)))
            _wait_all_healthy([s for s in servers.values() if s.proc is not None], wait_s, log)
            for b, s in servers.items():
                if s.error:
                    if budget > 0 and wait_s < opts.server_timeout and over_budget():
                        s.error += f" (wait capped by the {budget:.0f}s time budget)"
                    for w in workloads:
                        hard[w.name][b].append(f"server failed: {s.error}")
            if all(s.error for s in servers.values()):
                log("[e2e] no colocated server came up; nothing to run")
        plan = plan_colocated(workloads, opts, out_dir, ports, offsets)
        skipped: list[str] = []
        for i, (w, b, r, seed, bcmd, res_path) in enumerate(plan):
            s = servers[b]
            if s.error:
                continue
            if over_budget():
                budget_skips[w.name][b].append(r)
                skipped.append(f"{w.name}/{b}/r{r}")
                continue
            if s.proc.poll() is not None:
                s.error = (f"server exited with code {s.proc.returncode} during the "
                           f"benchmark (server log {s.log_path})")
                log(f"[e2e] colocated server {b}: {s.error}; its log ends:\n"
                    f"{log_tail(s.log_path)}")
                for ww in workloads:
                    hard[ww.name][b].append(f"server failed: {s.error}")
                continue
            log(f"[e2e] ({i + 1}/{len(plan)}) {w.name}-serve {b} repeat "
                f"{r + 1 - offsets[w.name]}/{opts.repeats} (seed {seed}, port {s.port}) ...")
            reset = reset_prefix_cache(s.port)
            if reset is not True:
                log(f"[e2e] {b}: prefix cache NOT reset before {w.name} r{r} "
                    f"({'no /reset_prefix_cache route' if reset is None else 'refused'})")
            res_path.parent.mkdir(parents=True, exist_ok=True)
            if res_path.exists():
                res_path.unlink()
            blog = out_dir / "logs" / f"{w.name}-serve-{b}-r{r}.log"
            t0 = time.monotonic()
            rc, _ = _run_logged(bcmd, blog, opts.run_timeout, env=opts.env)
            wall = time.monotonic() - t0
            if rc == 0 and res_path.exists():
                res = parse_bench_serve(res_path)
                res.update(repeat=r, seed=seed, wall_s=wall, log=str(blog),
                           prefix_cache_reset=reset)
                runs[w.name][b].append(res)
                new_runs.setdefault((w.name, r), {})[b] = res
                log(f"[e2e] {w.name + '-serve':<20} {b:<10} r{r}: "
                    f"{res['total_tok_s'] or float('nan'):9.1f} total tok/s, TTFT p50 "
                    f"{res['ttft_p50_ms'] or float('nan'):.1f} ms p99 "
                    f"{res['ttft_p99_ms'] or float('nan'):.1f} ms, TPOT p50 "
                    f"{res['tpot_p50_ms'] or float('nan'):.2f} ms p99 "
                    f"{res['tpot_p99_ms'] or float('nan'):.2f} ms (wall {wall:.0f}s)")
            else:
                hard[w.name][b].append(f"bench serve run {r} failed (rc={rc}); see {blog}")
                log(f"[e2e] {w.name}-serve {b} r{r}: FAILED rc={rc} (log {blog})")
            flush(w)
        # a repeat the budget cut in the middle: its finished runs have no partner
        for w in workloads:
            for r in sorted({r for v in budget_skips[w.name].values() for r in v}):
                for b, res in new_runs.get((w.name, r), {}).items():
                    runs[w.name][b] = [x for x in runs[w.name][b] if x is not res]
                    unpaired[w.name][b].append(res)
                    log(f"[e2e] {w.name}-serve {b} r{r}: kept out of the means "
                        f"(its pair was cut by the time budget)")
        if skipped:
            log(f"[e2e] time budget {budget:.0f}s spent after {clock() - t_start:.0f}s: "
                f"skipped {len(skipped)} bench run(s): {', '.join(skipped)}")
        for w in workloads:
            flush(w)
    finally:
        _stop_all(list(servers.values()), log)
    return [x for v in all_recs.values() for x in v]


def select_workloads(names: list[str] | None) -> list[Workload]:
    if not names:
        return [WORKLOADS["seed"]]
    out = []
    for n in names:
        for part in n.split(","):
            part = part.strip()
            if not part:
                continue
            if part == "all":
                out.extend(WORKLOADS.values())
                continue
            if part not in WORKLOADS:
                raise KeyError(f"unknown workload {part!r}; choose from "
                               f"{', '.join(WORKLOADS)} or all")
            out.append(WORKLOADS[part])
    return list({w.name: w for w in out}.values())

