"""Named attention shapes for the kernel A/B benchmark (pure Python, no torch).

A :class:`Case` is one attention call of a vLLM step: a batch of requests, each
with ``q_len`` new tokens and ``kv_len`` total KV tokens (``kv_len`` includes the
new tokens, as ``seq_lens`` in docs/contract.md).  Every backend runs the same
logical case; only the physical KV layout and page size differ per backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

DTYPE_BYTES = {"bf16": 2, "fp16": 2}

DEFAULT_HQ = 28
DEFAULT_HKV = 4
DEFAULT_D = 128
DEFAULT_FA_PAGE = 16
ION_PAGE = 64
SKEW_SEED = 1234
SKEW_RANGE = (512, 16384)
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
    ion_page: int = ION_PAGE
    tags: tuple[str, ...] = field(default_factory=tuple)
    #: "separate": q, key and value are dense tensors of their own; "fused": each is a
    #: strided view of a ``[T, (hq + 2 hkv) * d]`` qkv projection output, at the column
    #: offsets vLLM's attention layers hand the backend (q at 0, key at hq*d, value at
    #: (hq + hkv)*d), so row strides and base alignment are the engine's
    qkv_layout: str = "separate"

    def __post_init__(self):
        if self.qkv_layout not in QKV_LAYOUTS:
            raise ValueError(f"{self.name}: qkv_layout must be one of {QKV_LAYOUTS}, "
                             f"got {self.qkv_layout!r}")
        if len(self.q_lens) != len(self.kv_lens) or not self.q_lens:
            raise ValueError(f"{self.name}: q_lens/kv_lens must be non-empty, equal length")
        for q, k in zip(self.q_lens, self.kv_lens):
            if q < 1 or k < q:
                raise ValueError(f"{self.name}: need 1 <= q_len <= kv_len, got {q}, {k}")
        if self.hq % self.hkv:
            raise ValueError(f"{self.name}: hq {self.hq} not a multiple of hkv {self.hkv}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"{self.name}: unsupported dtype {self.dtype}")

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def total_q(self) -> int:
        return sum(self.q_lens)

    @property
    def total_kv(self) -> int:
        return sum(self.kv_lens)

    @property
    def max_q(self) -> int:
        return max(self.q_lens)

    @property
    def max_kv(self) -> int:
        return max(self.kv_lens)

    @property
    def elem_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def query_start_loc(self) -> list[int]:
        out = [0]
        for q in self.q_lens:
            out.append(out[-1] + q)
        return out

    def num_pages(self, page: int) -> int:
        """Pages needed to hold every request's KV at page size ``page``."""
        return sum(math.ceil(k / page) for k in self.kv_lens)

    def kv_bytes(self) -> int:
        """K and V bytes of all KV tokens of all requests (one copy of the data)."""
        return 2 * self.total_kv * self.hkv * self.d * self.elem_bytes

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "batch": self.batch,
            "total_q": self.total_q,
            "total_kv": self.total_kv,
            "max_q": self.max_q,
            "max_kv": self.max_kv,
            "hq": self.hq,
            "hkv": self.hkv,
            "d": self.d,
            "dtype": self.dtype,
            "fa_page": self.fa_page,
            "ion_page": self.ion_page,
            "qkv_layout": self.qkv_layout,
        }


def min_bytes(case: Case) -> int:
    """Minimum HBM traffic: K+V read once for every KV token of every request,
    q read once, out written once."""
    qo = 2 * case.total_q * case.hq * case.d * case.elem_bytes
    return case.kv_bytes() + qo


def attended_pairs(q_len: int, kv_len: int) -> int:
    """Number of (query, key) pairs of one request under the causal mask of
    docs/contract.md: new token i (0-based) sees kv_len - q_len + i + 1 keys."""
    ctx = kv_len - q_len
    return q_len * ctx + q_len * (q_len + 1) // 2


def flops(case: Case) -> int:
    """Causal-aware FLOPs: 2*d for q.k and 2*d for p.v per attended pair per q head."""
    pairs = sum(attended_pairs(q, k) for q, k in zip(case.q_lens, case.kv_lens))
    return 4 * case.d * case.hq * pairs


def _suffix(hq: int, hkv: int, d: int, fa_page: int) -> str:
    s = f"-h{hq}/{hkv}-d{d}"
    if fa_page != DEFAULT_FA_PAGE:
        s += f"-fap{fa_page}"
    return s


def decode(batch: int, kv: int, hq=DEFAULT_HQ, hkv=DEFAULT_HKV, d=DEFAULT_D,
           fa_page=DEFAULT_FA_PAGE, tags=()) -> Case:
    return Case(f"decode-{batch}x{kv}" + _suffix(hq, hkv, d, fa_page),
                (1,) * batch, (kv,) * batch, hq, hkv, d, fa_page=fa_page, tags=tuple(tags))


def skewed_kv_lens(batch: int, lo: int, hi: int, seed: int) -> tuple[int, ...]:
    """KV lengths uniform in [lo, hi] (inclusive), deterministic for a seed."""
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in rng.integers(lo, hi + 1, size=batch))


def decode_skewed(batch: int = 32, lo: int = SKEW_RANGE[0], hi: int = SKEW_RANGE[1],
                  seed: int = SKEW_SEED, hq=DEFAULT_HQ, hkv=DEFAULT_HKV, d=DEFAULT_D,
                  fa_page=DEFAULT_FA_PAGE, tags=()) -> Case:
    kv = skewed_kv_lens(batch, lo, hi, seed)
    return Case(f"decode-{batch}xU{lo}-{hi}s{seed}" + _suffix(hq, hkv, d, fa_page),
                (1,) * batch, kv, hq, hkv, d, fa_page=fa_page, tags=tuple(tags))


def mixed(batch: int, kv: int, chunk: int, hq=DEFAULT_HQ, hkv=DEFAULT_HKV, d=DEFAULT_D,
          fa_page=DEFAULT_FA_PAGE, tags=()) -> Case:
    """``batch`` decode rows at ``kv`` plus one fresh prefill chunk of ``chunk``
    tokens whose KV length is ``chunk`` (causal)."""
    return Case(f"mixed-{batch}x{kv}+p{chunk}" + _suffix(hq, hkv, d, fa_page),
                (1,) * batch + (chunk,), (kv,) * batch + (chunk,), hq, hkv, d,
                fa_page=fa_page, tags=tuple(tags))


def prefill(length: int, hq=DEFAULT_HQ, hkv=DEFAULT_HKV, d=DEFAULT_D,
            fa_page=DEFAULT_FA_PAGE, tags=()) -> Case:
    return Case(f"prefill-1x{length}" + _suffix(hq, hkv, d, fa_page),
                (length,), (length,), hq, hkv, d, fa_page=fa_page, tags=tuple(tags))


def prefill_chunk(length: int, ctx: int, hq=DEFAULT_HQ, hkv=DEFAULT_HKV, d=DEFAULT_D,
                  fa_page=DEFAULT_FA_PAGE, tags=()) -> Case:
    """One chunked-prefill row: ``length`` new tokens over ``ctx`` cached ones (causal), the
    later chunks of a prompt longer than the step's token budget."""
    return Case(f"chunk-1x{length}c{ctx}" + _suffix(hq, hkv, d, fa_page),
                (length,), (ctx + length,), hq, hkv, d, fa_page=fa_page, tags=tuple(tags))


def prefills(q_lens: tuple[int, ...], ctx: tuple[int, ...] | None = None, hq=DEFAULT_HQ,
             hkv=DEFAULT_HKV, d=DEFAULT_D, fa_page=DEFAULT_FA_PAGE, tags=()) -> Case:
    """Several prefill rows in one step: row i has ``q_lens[i]`` new tokens over
    ``ctx[i]`` cached ones (default 0: fresh prompts), causal."""
    ctx = ctx or (0,) * len(q_lens)
    if len(ctx) != len(q_lens):
        raise ValueError("one context length per prefill row")
    name = "+".join(f"{q}c{c}" if c else f"{q}" for q, c in zip(q_lens, ctx))
    return Case(f"prefills-{name}" + _suffix(hq, hkv, d, fa_page), tuple(q_lens),
                tuple(q + c for q, c in zip(q_lens, ctx)), hq, hkv, d, fa_page=fa_page,
                tags=tuple(tags))


def _multi() -> list[Case]:
    """Steps of several prompts under the offline ``LLM``'s 16384-token budget: the seed
    profile (``scripts/attention_share.py``, sixteenth session) found ION's attention in
    such steps ~15% slower than FA3's, where one 8192-token prompt is 5% faster."""
    return [prefills((7680, 7680, 1024)), prefills((6656, 7680, 2048), (1024, 0, 0)),
            prefills((4096, 4096))]


def chunked_prefill_steps(n_prompts: int, prompt_len: int, budget: int,
                          max_seqs: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The steps vLLM's scheduler runs for ``n_prompts`` prompts of ``prompt_len`` tokens
    that arrive together, under chunked prefill with a ``budget``-token step and at most
    ``max_seqs`` running requests, for as long as steps carry prefill (pure; requests
    generate past the last such step and are never preempted: the KV pool is assumed
    large enough).  Each step serves the running
    requests first, in admission order (a finished prompt decodes one token, a prompt in
    progress takes the rest of its prompt up to the budget left), then admits waiting
    prompts while budget and seats are left, each taking up to the budget left.  Rows are
    returned decodes first (the order vLLM's input batch puts them in), as
    ``(q_lens, kv_lens)`` with ``kv_len`` counting the step's new tokens."""
    if min(n_prompts, prompt_len, budget, max_seqs) < 1:
        raise ValueError("n_prompts, prompt_len, budget and max_seqs must be >= 1")
    done = []      # computed tokens of each admitted request, admission order
    steps = []
    waiting = n_prompts
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
        if not pre:  # every seat decodes and no request finishes here: no more prefill
            break
        rows = dec + pre
        steps.append((tuple(q for q, _ in rows), tuple(k for _, k in rows)))
    return steps


#: the steps of the profiled offline seed run (32 prompts of 7680 tokens at once, serve's
#: 8192-token budget) that suite ``engine`` times
ENGINE_SEED_STEPS = (2, 9, 20, 29)


def _engine_steps(prefix: str, **shape) -> list[tuple[str, Case, Case | None]]:
    """Each step of ``ENGINE_SEED_STEPS`` as the scheduler makes it
    (``chunked_prefill_steps``: decodes at ~7.7k, a prompt continuing at a context that is
    rarely a multiple of 64, a fresh prompt start), named ``<prefix>-sNN-...``, with the
    attention ``shape`` (``Case`` fields), and its page-aligned twin (``-aligned``: every
    prefill's context rounded down to a page, new tokens unchanged, so the attended pairs
    move by < 64 a query and the fused writeback never straddles a page; None when the
    step is already aligned)."""
    steps = chunked_prefill_steps(32, 7680, 8192, 32)
    out = []
    for i in ENGINE_SEED_STEPS:
        q_lens, kv_lens = steps[i]
        ndec = sum(1 for q in q_lens if q == 1)
        name = f"{prefix}-s{i:02d}-{ndec}d+" + "+".join(
            f"{q}c{k - q}" if k > q else f"{q}" for q, k in zip(q_lens, kv_lens) if q > 1)
        aligned_kv = tuple(k if q == 1 else q + (k - q) // ION_PAGE * ION_PAGE
                           for q, k in zip(q_lens, kv_lens))
        aligned = (Case(name + "-aligned", q_lens, aligned_kv, **shape)
                   if aligned_kv != kv_lens else None)
        out.append((name, Case(name, q_lens, kv_lens, **shape), aligned))
    return out


def _engine() -> list[Case]:
    """The prefill-carrying steps of the seventeenth session's profile, where ION's
    192-row kernel averaged 1,099 us a call in the engine against FA3's 963, while the
    kernel bench had it at FA3's speed on fresh-chunk steps.  Each step
    (``_engine_steps``), then its page-aligned twin, then the step with the engine's
    strided q/key/value (``-qkv``): which of the two is the engine's extra cost."""
    cases = []
    for name, case, aligned in _engine_steps("engine-seed"):
        cases += [case] + ([aligned] if aligned else [])
        cases.append(Case(name + "-qkv", case.q_lens, case.kv_lens, qkv_layout="fused"))
    return cases


#: the attention shape of head-size-64 models with GQA (e.g. Llama-3.2-1B: 32 q / 8 KV heads)
D64_HQ, D64_HKV = 32, 8


def _engine_d64() -> list[Case]:
    """Suite ``engine``'s steps (and page-aligned twins) at head size 64: where the D = 64
    fused kernels copy the straddled rows of a continued prompt element-wise, against the
    16-byte copy of ``ion-auto-fused-vs64`` (twentieth session) and FA3."""
    cases = []
    for _, case, aligned in _engine_steps("engine-d64", hq=D64_HQ, hkv=D64_HKV, d=64):
        cases += [case] + ([aligned] if aligned else [])
    return cases


def _chunks() -> list[Case]:
    return [prefill_chunk(2048, 6144), prefill_chunk(4096, 4096)]


def _steps() -> list[Case]:
    """Steady-state steps of the e2e workloads under ``vllm serve``'s 8192-token budget:
    seed (7680 in / 512 out, 32 in flight) runs 31 decodes at ~8k beside a fresh prefill
    chunk of the rest of the budget, and 16 decodes while the batch refills; skewed (4096
    in, 64 in flight) 63 decodes at ~4.6k beside 8129 prefill tokens."""
    return [mixed(31, 8192, 8161), mixed(16, 8192, 8176), mixed(63, 4608, 8129)]


def _anchors() -> list[Case]:
    return [
        decode(32, 8192),
        decode(128, 2048),
        decode(8, 32768),
        decode_skewed(32),
        mixed(32, 8192, 2048),
        prefill(8192),
    ]


def _gqa() -> list[Case]:
    cases = []
    for hq, hkv in ((32, 8), (28, 4), (64, 8)):
        for d in (64, 128):
            cases.append(decode(32, 8192, hq, hkv, d))
            cases.append(mixed(32, 8192, 2048, hq, hkv, d))
    return cases


def _pages() -> list[Case]:
    return [
        decode(32, 8192, fa_page=64),
        decode_skewed(32, fa_page=64),
        mixed(32, 8192, 2048, fa_page=64),
        prefill(8192, fa_page=64),
    ]


def _smoke() -> list[Case]:
    return [decode(32, 8192), mixed(32, 8192, 2048)]


def _dedupe(cases: list[Case]) -> list[Case]:
    seen: dict[str, Case] = {}
    for c in cases:
        if c.name in seen:
            if seen[c.name] != c:
                raise ValueError(f"two different cases named {c.name}")
            continue
        seen[c.name] = c
    return list(seen.values())


SUITES = ("smoke", "anchors", "gqa", "pages", "chunks", "steps", "multi", "engine",
          "engine-d64", "full")


def suite(name: str) -> list[Case]:
    if name == "smoke":
        return _smoke()
    if name == "anchors":
        return _anchors()
    if name == "gqa":
        return _dedupe(_gqa())
    if name == "pages":
        return _pages()
    if name == "chunks":
        return _chunks()
    if name == "steps":
        return _steps()
    if name == "multi":
        return _multi()
    if name == "engine":
        return _engine()
    if name == "engine-d64":
        return _engine_d64()
    if name == "full":
        return _dedupe(_anchors() + _gqa() + _pages() + _chunks() + _steps() + _multi()
                       + _engine() + _engine_d64())
    raise KeyError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")


def all_cases() -> dict[str, Case]:
    return {c.name: c for c in suite("full")}


def select(suites: list[str] | None = None, names: list[str] | None = None) -> list[Case]:
    """Cases of the given suites plus the named cases (in order, deduplicated).
    With neither, the ``smoke`` suite."""
    picked: list[Case] = []
    for s in suites or []:
        picked.extend(suite(s))
    if names:
        table = all_cases()
        for n in names:
            if n not in table:
                close = [k for k in table if n in k]
                hint = f" (did you mean: {', '.join(close[:5])})" if close else ""
                raise KeyError(f"unknown case {n!r}{hint}")
            picked.append(table[n])
    if not suites and not names:
        picked = suite("smoke")
    return _dedupe(picked)


def rotations(case: Case, l2_bytes: int = 50 * 1024 * 1024, min_rot: int = 2) -> int:
    """Number of independent KV copies to cycle through so that the KV bytes
    touched between two uses of the same copy exceed 2x L2."""
    return max(min_rot, math.ceil(2 * l2_bytes / max(1, case.kv_bytes())))
