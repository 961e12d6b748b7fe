"""Named attention shapes for the kernel A/B benchmark (pure Python, no torch).

A :class:`Case` is one attention call of a vLLM step: a batch of requests, each with
``q_len`` new tokens and ``kv_len`` total KV tokens (``kv_len`` includes the new tokens,
as ``seq_lens`` in docs/contract.md).  Every backend runs the same logical case; only the
physical KV layout and page size differ per backend (ION: 64-token pages, FA: ``fa_page``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

DTYPE_BYTES = {"bf16": 2, "fp16": 2}
DEFAULT_HQ, DEFAULT_HKV, DEFAULT_D = 28, 4, 128     # Qwen2.5-7B, the demo model
DEFAULT_FA_PAGE = 16                                # vLLM's FLASH_ATTN block size
PAGE = 64                                           # cute_kernels.PAGE_SIZE
SKEW_SEED = 1234
QKV_LAYOUTS = ("separate", "fused")


@dataclass(frozen=True)
class Case:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    hq: int = DEFAULT_HQ
    hkv: int = DEFAULT_HKV
    d: int = DEFAULT_D
    dtype: str = "bf16"
    fa_page: int = DEFAULT_FA_PAGE
    #: "separate": q, key and value are dense tensors of their own; "fused": each is a
    #: strided view of a ``[T, (hq + 2 hkv) * d]`` qkv projection output at the column
    #: offsets vLLM's attention layers hand the backend (the engine's row strides)
    qkv_layout: str = "separate"
    #: model features: a sliding window (tokens, 0: none), a logits soft cap (0: none),
    #: per-q-head attention sinks (fixed logits, ``sink_logits``)
    window: int = 0
    softcap: float = 0.0
    sinks: bool = False

    def sink_logits(self):
        """The sinks of a case with them: fixed per-head logits of gpt-oss's size, in bf16
        as gpt-oss stores them (FA3 takes ``s_aux`` in bf16 only)."""
        import torch

        return torch.linspace(-2.0, 2.0, self.hq, dtype=torch.float32).to(torch.bfloat16)

    def __post_init__(self):
        if self.qkv_layout not in QKV_LAYOUTS:
            raise ValueError(f"{self.name}: qkv_layout must be one of {QKV_LAYOUTS}")
        if len(self.q_lens) != len(self.kv_lens) or not self.q_lens:
            raise ValueError(f"{self.name}: q_lens/kv_lens must be non-empty, equal length")
        if any(q < 1 or k < q for q, k in zip(self.q_lens, self.kv_lens)):
            raise ValueError(f"{self.name}: need 1 <= q_len <= kv_len for every request")
        if self.hq % self.hkv:
            raise ValueError(f"{self.name}: hq {self.hq} not a multiple of hkv {self.hkv}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"{self.name}: unsupported dtype {self.dtype}")
        if self.window < 0 or self.softcap < 0:
            raise ValueError(f"{self.name}: window and softcap must be >= 0")

    batch = property(lambda self: len(self.q_lens))
    total_q = property(lambda self: sum(self.q_lens))
    total_kv = property(lambda self: sum(self.kv_lens))
    max_q = property(lambda self: max(self.q_lens))
    max_kv = property(lambda self: max(self.kv_lens))
    elem_bytes = property(lambda self: DTYPE_BYTES[self.dtype])

    def query_start_loc(self) -> list[int]:
        return [0, *np.cumsum(self.q_lens).tolist()]

    def num_pages(self, page: int) -> int:
        """Pages needed to hold every request's KV at page size ``page``."""
        return sum(math.ceil(k / page) for k in self.kv_lens)

    def kv_bytes(self) -> int:
        """K and V bytes of all KV tokens of all requests (one copy of the data)."""
        return 2 * self.total_kv * self.hkv * self.d * self.elem_bytes

    def to_dict(self) -> dict:
        return {"name": self.name, "batch": self.batch, "total_q": self.total_q,
                "total_kv": self.total_kv, "max_q": self.max_q, "max_kv": self.max_kv,
                "hq": self.hq, "hkv": self.hkv, "d": self.d, "dtype": self.dtype,
                "fa_page": self.fa_page, "qkv_layout": self.qkv_layout}


def min_bytes(case: Case) -> int:
    """Minimum HBM traffic: K+V of every KV token read once, q read once, out written once."""
    return case.kv_bytes() + 2 * case.total_q * case.hq * case.d * case.elem_bytes


def attended_pairs(q_len: int, kv_len: int) -> int:
    """(query, key) pairs of one request under the causal mask of docs/contract.md: new
    token i (0-based) sees kv_len - q_len + i + 1 keys."""
    return q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2


def flops(case: Case) -> int:
    """Causal-aware FLOPs: 2*d for q.k and 2*d for p.v per attended pair per q head."""
    return 4 * case.d * case.hq * sum(attended_pairs(q, k)
                                      for q, k in zip(case.q_lens, case.kv_lens))


def rotations(case: Case, l2_bytes: int = 50 * 1024 * 1024, min_rot: int = 2) -> int:
    """Independent KV copies to cycle through so that the KV bytes touched between two
    uses of one copy exceed 2x L2 (no call finds its KV in L2)."""
    return max(min_rot, math.ceil(2 * l2_bytes / max(1, case.kv_bytes())))


# --------------------------------------------------------------------------- shapes

def _case(kind: str, q_lens, kv_lens, hq=DEFAULT_HQ, hkv=DEFAULT_HKV, d=DEFAULT_D,
          fa_page=DEFAULT_FA_PAGE) -> Case:
    name = f"{kind}-h{hq}/{hkv}-d{d}" + (f"-fap{fa_page}" if fa_page != DEFAULT_FA_PAGE else "")
    return Case(name, tuple(q_lens), tuple(kv_lens), hq, hkv, d, fa_page=fa_page)


def decode(batch: int, kv: int, **shape) -> Case:
    return _case(f"decode-{batch}x{kv}", (1,) * batch, (kv,) * batch, **shape)


def skewed_kv_lens(batch: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    """KV lengths uniform in [lo, hi] (inclusive), deterministic for a seed."""
    return tuple(int(x) for x in np.random.default_rng(seed).integers(lo, hi + 1, size=batch))


def decode_skewed(batch: int = 32, lo: int = 512, hi: int = 16384, seed: int = SKEW_SEED,
                  **shape) -> Case:
    return _case(f"decode-{batch}xU{lo}-{hi}s{seed}", (1,) * batch,
                 skewed_kv_lens(batch, lo, hi, seed), **shape)


def mixed(batch: int, kv: int, chunk: int, **shape) -> Case:
    """``batch`` decode rows at ``kv`` plus one fresh causal prefill chunk of ``chunk``."""
    return _case(f"mixed-{batch}x{kv}+p{chunk}", (1,) * batch + (chunk,),
                 (kv,) * batch + (chunk,), **shape)


def prefill(length: int, **shape) -> Case:
    return _case(f"prefill-1x{length}", (length,), (length,), **shape)


def prefill_chunk(length: int, ctx: int, **shape) -> Case:
    """A later chunk of a long prompt: ``length`` new tokens over ``ctx`` cached ones."""
    return _case(f"chunk-1x{length}c{ctx}", (length,), (ctx + length,), **shape)


def chunked_prefill_steps(n_prompts: int, prompt_len: int, budget: int,
                          max_seqs: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The steps vLLM's scheduler runs for ``n_prompts`` prompts of ``prompt_len`` tokens
    arriving together, under chunked prefill with a ``budget``-token step and at most
    ``max_seqs`` running requests, for as long as steps carry prefill (no preemption).
    Each step serves running requests first, in admission order (a finished prompt decodes
    one token, one in progress takes the rest of its prompt up to the budget left), then
    admits waiting prompts while budget and seats are left.  Rows come decodes first (vLLM's
    input-batch order), as ``(q_lens, kv_lens)`` with ``kv_len`` counting new tokens."""
    if min(n_prompts, prompt_len, budget, max_seqs) < 1:
        raise ValueError("n_prompts, prompt_len, budget and max_seqs must be >= 1")
    done: list[int] = []  # computed tokens of each admitted request, admission order
    steps, waiting = [], n_prompts
    while waiting or any(c < prompt_len for c in done):
        left, dec, pre = budget, [], []
        for i, c in enumerate(done):
            if left == 0:
                break
            n = 1 if c >= prompt_len else min(prompt_len - c, left)
            (dec if c >= prompt_len else pre).append((n, c + n))
            done[i] = c + n
            left -= n
        while waiting and left > 0 and len(done) < max_seqs:
            n = min(prompt_len, left)
            pre.append((n, n))
            done.append(n)
            waiting -= 1
            left -= n
        if not pre:  # every seat decodes: no more prefill
            break
        rows = dec + pre
        steps.append((tuple(q for q, _ in rows), tuple(k for _, k in rows)))
    return steps


#: the prefill-carrying steps of the offline seed run (32 prompts of 7680 tokens at once,
#: serve's 8192-token budget) that suites ``engine`` and ``engine-d64`` time
ENGINE_SEED_STEPS = (2, 9, 20, 29)
#: the attention shape of head-size-64 GQA models (e.g. Llama-3.2-1B: 32 q / 8 KV heads)
D64_SHAPE = {"hq": 32, "hkv": 8, "d": 64}


def _engine(prefix: str, qkv_twins: bool, **shape) -> list[Case]:
    """Each step of ``ENGINE_SEED_STEPS`` as the scheduler makes it (decodes at ~7.7k, a
    prompt continuing at a context that is rarely a multiple of 64, a fresh prompt), then
    its page-aligned twin (``-aligned``: every prefill's context rounded down to a page, so
    the fused writeback never straddles a page), then (``qkv_twins``) the step with the
    engine's strided q/key/value (``-qkv``)."""
    steps = chunked_prefill_steps(32, 7680, 8192, 32)
    cases = []
    for i in ENGINE_SEED_STEPS:
        q_lens, kv_lens = steps[i]
        ndec = sum(1 for q in q_lens if q == 1)
        name = f"{prefix}-s{i:02d}-{ndec}d+" + "+".join(
            f"{q}c{k - q}" if k > q else f"{q}" for q, k in zip(q_lens, kv_lens) if q > 1)
        cases.append(Case(name, q_lens, kv_lens, **shape))
        aligned = tuple(k if q == 1 else q + (k - q) // PAGE * PAGE
                        for q, k in zip(q_lens, kv_lens))
        if aligned != kv_lens:
            cases.append(Case(name + "-aligned", q_lens, aligned, **shape))
        if qkv_twins:
            cases.append(Case(name + "-qkv", q_lens, kv_lens, qkv_layout="fused", **shape))
    return cases


SUITES: dict[str, object] = {
    # a quick check that every backend runs
    "smoke": lambda: [decode(32, 8192), mixed(32, 8192, 2048)],
    # the reference shapes: decode (uniform, long, many short, skewed), mixed, prefill
    "anchors": lambda: [decode(32, 8192), decode(128, 2048), decode(8, 32768),
                        decode_skewed(32), mixed(32, 8192, 2048), prefill(8192)],
    # the engine's chunked-prefill steps of the seed workload, aligned and strided twins
    "engine": lambda: _engine("engine-seed", True),
    # the same steps at head size 64 (32 q / 8 KV heads)
    "engine-d64": lambda: _engine("engine-d64", False, **D64_SHAPE),
    # steady-state steps of e2e seed / skewed under serve's 8192-token budget
    "steps": lambda: [mixed(31, 8192, 8161), mixed(16, 8192, 8176), mixed(63, 4608, 8129)],
    # later chunks of long prompts (prefill over a cached context)
    "chunks": lambda: [prefill_chunk(2048, 6144), prefill_chunk(4096, 4096)],
    # head configurations: 32/8, 28/4, 64/8 heads at head dims 64 and 128
    "gqa": lambda: [c for hq, hkv in ((32, 8), (28, 4), (64, 8)) for d in (64, 128)
                    for c in (decode(32, 8192, hq=hq, hkv=hkv, d=d),
                              mixed(32, 8192, 2048, hq=hq, hkv=hkv, d=d))],
}
#: gpt-oss's attention shape: 64 q / 8 KV heads of 64
GPT_OSS = {"hq": 64, "hkv": 8, "d": 64}
#: Gemma 2 9B's: 16 q / 8 KV heads of 256
GEMMA2_9B = {"hq": 16, "hkv": 8, "d": 256}


def _feature(case: Case, suffix: str, **features) -> Case:
    return dataclasses.replace(case, name=f"{case.name}-{suffix}", **features)


# the model-coverage A/B against FA3 on the same feature (the window cases read only the
# pages inside the window: the planner never schedules the rest)
SUITES["features"] = lambda: [
    _feature(decode(32, 16384), "w4096", window=4096),
    _feature(prefill(8192), "w1024", window=1024),
    _feature(decode(32, 8192, **GPT_OSS), "gptoss-sinks-w128", window=128, sinks=True),
    _feature(mixed(32, 8192, 2048, **GPT_OSS), "gptoss-sinks-w128", window=128, sinks=True),
    _feature(decode(32, 8192, hq=32, hkv=2), "gqa16"),
    _feature(decode(32, 8192), "cap50", softcap=50.0),
    decode(32, 8192, **GEMMA2_9B),
    prefill(8192, **GEMMA2_9B),
    _feature(decode(32, 8192, **GEMMA2_9B), "gemma2-w4096-cap50", window=4096, softcap=50.0),
]
SUITES["full"] = lambda: [c for s in SUITES if s != "full" for c in SUITES[s]()]


def _dedupe(cases: list[Case]) -> list[Case]:
    seen: dict[str, Case] = {}
    for c in cases:
        if seen.setdefault(c.name, c) != c:
            raise ValueError(f"two different cases named {c.name}")
    return list(seen.values())


def suite(name: str) -> list[Case]:
    if name not in SUITES:
        raise KeyError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
    return _dedupe(SUITES[name]())


def select(suites: list[str] | None = None, names: list[str] | None = None) -> list[Case]:
    """Cases of the given suites plus the named cases (in order, deduplicated); with
    neither, the ``smoke`` suite."""
    picked = [c for s in suites or [] for c in suite(s)]
    table = {c.name: c for c in suite("full")}
    for n in names or []:
        if n not in table:
            close = [k for k in table if n in k][:5]
            raise KeyError(f"unknown case {n!r}" + (f" (did you mean: {', '.join(close)})"
                                                    if close else ""))
        picked.append(table[n])
    return _dedupe(picked) if picked else suite("smoke")
