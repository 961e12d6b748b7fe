#!/usr/bin/env python
"""Instruction-order summary of an IonAttention kernel's SASS, compiled on the CPU.

Compiles one attention kernel variant for sm_90a (no GPU needed), disassembles its cubin
with ``nvdisasm`` and prints the order of the instructions that shape the main loop:
HGMMA (wgmma), WARPGROUP.ARRIVE / DEPBAR (wgmma fences and waits), MUFU.EX2 (softmax exp2),
FMNMX / SHFL (row max reductions), SYNCS (mbarrier ops), BAR and BRA, as runs
(``MUFU.EX2x25`` = 25 in a row, other instructions skipped). Comparing two variants shows
where a change moved the softmax relative to the MMAs, e.g. the lazy-rescaling kernels
(bench/notes.md, eighth session):

    python scripts/sass_profile.py --variant 7 --unpacked --consumers 2
    python scripts/sass_profile.py --variant 7 --unpacked --consumers 2 --lazy-rescale
    python scripts/sass_profile.py --variant 7 --unpacked --consumers 2 --pin-pv-wait on

Needs ``nvdisasm`` on PATH (the nvidia-cuda-nvdisasm wheel vLLM installs ships one under
``site-packages/nvidia/cu13/bin``; this script adds that directory when present).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TAGS = ("HGMMA", "MUFU.EX2", "WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "BRA", "SYNCS", "BAR.",
        "FMNMX", "SHFL")


def find_nvdisasm() -> str | None:
    exe = shutil.which("nvdisasm")
    if exe:
        return exe
    try:
        import nvidia
        for base in nvidia.__path__:
            cand = os.path.join(base, "cu13", "bin", "nvdisasm")
            if os.path.exists(cand):
                return cand
    except ImportError:
        pass
    return None


def runs(sass: str) -> tuple[str, dict[str, int]]:
    """Run-length string of the tagged instructions, and each tag's total count."""
    seq, totals = [], {t: 0 for t in TAGS}
    for line in sass.splitlines():
        if not re.search(r"/\*[0-9a-f]{4,6}\*/", line):
            continue
        for tag in TAGS:
            if tag in line:
                seq.append(tag)
                totals[tag] += 1
                break
    out, prev, n = [], None, 0
    for t in seq:
        if t == prev:
            n += 1
            continue
        if prev:
            out.append(f"{prev}x{n}")
        prev, n = t, 1
    if prev:
        out.append(f"{prev}x{n}")
    return " ".join(out), totals


def wgmma_waits(sass: str) -> tuple[int, int]:
    """(HGMMA instructions, those that carry ``gsb0``).  A wgmma group ends with one
    ``gsb0`` HGMMA that a ``WARPGROUP.DEPBAR`` waits on; when ptxas serializes wgmma (it
    does when their issue sites sit inside branches, as with ``skip_idle``: bench/notes.md,
    eighteenth session) every HGMMA carries ``gsb0`` and gets its own arrive and wait, so
    each MMA waits for the one before."""
    lines = [ln for ln in sass.splitlines()
             if re.search(r"/\*[0-9a-f]{4,6}\*/", ln) and "HGMMA" in ln]
    return len(lines), sum(1 for ln in lines if "gsb0" in ln)


def _instructions(sass: str) -> tuple[list[str], dict[str, int]]:
    """The instructions of an nvdisasm listing (text up to ';') and each label's index."""
    ins: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,6}\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1).strip())
    return ins, labels


#: an instruction's guard predicate (``@P0``, ``@!P1``, ``@UP0``, ``@!UP2``) and a branch's
#: label, as nvdisasm prints them
_GUARD = r"@!?U?P\w+\s+"
_BRA_TARGET = r"BRA\s+`?\(?(\.L_x_\d+)"


def _opcode(text: str) -> str:
    return re.sub("^" + _GUARD, "", text).split()[0]


def loop_mix(sass: str) -> dict | None:
    """Opcode mix of the main loop: the shortest loop (a backward ``BRA``) that holds both
    HGMMA and MUFU.EX2, i.e. the steady state of the consumer's KV loop.  ``guarded``
    counts the instructions a forward conditional branch inside the loop can skip (the
    boundary-page mask), so ``len - guarded`` is what an unmasked iteration issues at
    least.  ``None`` without such a loop.  Works on any sm_90 listing, e.g. FA3's kernel
    from ``cuobjdump -xelf`` + ``nvdisasm`` of vLLM's ``_vllm_fa3_C.abi3.so``."""
    ins, labels = _instructions(sass)
    best = None
    for i, t in enumerate(ins):
        m = re.search(_BRA_TARGET, t)
        if not m or m.group(1) not in labels or labels[m.group(1)] > i:
            continue
        a = labels[m.group(1)]
        body = ins[a:i + 1]
        if any("HGMMA" in x for x in body) and any("MUFU.EX2" in x for x in body):
            if best is None or len(body) < best[1] - best[0] + 1:
                best = (a, i)
    if best is None:
        return None
    a, b = best
    guarded = 0
    for j in range(a, b):
        m = re.match(_GUARD + _BRA_TARGET, ins[j])
        if m and m.group(1) in labels and j < labels[m.group(1)] <= b:
            guarded += labels[m.group(1)] - j - 1
    counts: dict[str, int] = {}
    for t in ins[a:b + 1]:
        op = _opcode(t)
        counts[op] = counts.get(op, 0) + 1
    hgmma = {k: v for k, v in counts.items() if k.startswith("HGMMA")}
    return {"len": b - a + 1, "guarded": guarded, "hgmma": hgmma,
            "counts": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


def compile_cubin(variant_index: int, unpacked: bool, consumers: int, lazy: bool,
                  kv_pair: bool = False, fused: bool = False, pingpong=None,
                  kv_stages=None, pin_pv_wait=None, vec_straddle: bool = False,
                  skip_idle: bool = False) -> str:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass.cute as cute

    from cute_kernels import attention
    from cute_kernels.variants import ALL_VARIANTS

    v = ALL_VARIANTS[variant_index]
    d = tempfile.mkdtemp(prefix="ion_sass_")
    if fused:
        kernel = attention.make_fused_kernel(v, unpacked, consumers, lazy, kv_pair,
                                             kv_stages, pingpong, pin_pv_wait,
                                             vec_straddle=vec_straddle, skip_idle=skip_idle)
        args = attention.fused_fake_args(v, unpacked)
    else:
        kernel = attention.make_kernel(v, unpacked, consumers, lazy, kv_pair, kv_stages,
                                       pingpong, pin_pv_wait, skip_idle=skip_idle)
        args = attention.fake_args(v, unpacked)
    cute.compile(kernel, *args,
                 options=f"--enable-tvm-ffi --gpu-arch sm_90a --keep-cubin --dump-dir {d}")
    cubins = glob.glob(os.path.join(d, "**", "*.cubin"), recursive=True)
    if not cubins:
        raise RuntimeError(f"no cubin written under {d}")
    return cubins[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", type=int, default=7, help="index into variants.ALL_VARIANTS")
    ap.add_argument("--unpacked", action="store_true")
    ap.add_argument("--consumers", type=int, default=1, choices=(1, 2, 3))
    ap.add_argument("--lazy-rescale", action="store_true")
    ap.add_argument("--kv-pair", action="store_true", help="page pairs (needs --consumers 2)")
    ap.add_argument("--fused", action="store_true", help="the fused-writeback kernel")
    ap.add_argument("--pingpong", choices=("on", "off"), default=None,
                    help="warpgroup ping-pong (needs --consumers 2; default: the default)")
    ap.add_argument("--pin-pv-wait", choices=("on", "off"), default=None,
                    help="the steady state's PV wait pinned after the softmax (default: the "
                         "default)")
    ap.add_argument("--kv-stages", type=int, default=None,
                    help="K/V stages of a --consumers 2 kernel (default: the default)")
    ap.add_argument("--vec-straddle", action="store_true",
                    help="the fused kernel's 16-byte straddle copy (needs --fused)")
    ap.add_argument("--skip-idle", action="store_true",
                    help="idle consumer warpgroups issue no wgmma (needs --consumers >= 2)")
    ap.add_argument("--dump", default=None, help="also write the full SASS listing here")
    ap.add_argument("--loop-mix", action="store_true",
                    help="also print the opcode mix of the main loop (loop_mix)")
    ap.add_argument("--sass-file", default=None,
                    help="read this nvdisasm listing instead of compiling (e.g. FA3's)")
    args = ap.parse_args(argv)
    if args.sass_file:
        with open(args.sass_file) as f:
            sass = f.read()
        print_profile(sass, args.loop_mix)
        return 0
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        print("sass_profile: nvdisasm not found", file=sys.stderr)
        return 2
    cubin = compile_cubin(args.variant, args.unpacked, args.consumers, args.lazy_rescale,
                          args.kv_pair, args.fused,
                          None if args.pingpong is None else args.pingpong == "on",
                          args.kv_stages,
                          None if args.pin_pv_wait is None else args.pin_pv_wait == "on",
                          args.vec_straddle, args.skip_idle)
    sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True,
                          check=True).stdout
    if args.dump:
        with open(args.dump, "w") as f:
            f.write(sass)
    print_profile(sass, args.loop_mix)
    return 0


def print_profile(sass: str, mix: bool) -> None:
    order, totals = runs(sass)
    print("totals:", " ".join(f"{k}={v}" for k, v in totals.items()))
    print("order:", order)
    n, g = wgmma_waits(sass)
    wg = f"wgmma: {g} of {n} HGMMA carry gsb0" + (" (serialized)" if n and g == n else "")
    if mix:
        lm = loop_mix(sass)
        if lm is None:
            print("loop mix: no loop with HGMMA and MUFU.EX2")
        else:
            print(f"loop mix: {lm['len']} instructions ({lm['guarded']} behind forward "
                  f"branches), HGMMA {lm['hgmma']}")
            print("  " + ", ".join(f"{k}:{v}" for k, v in lm["counts"].items()))
    print(wg)


if __name__ == "__main__":
    sys.exit(main())
