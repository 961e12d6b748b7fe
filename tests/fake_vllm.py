"""A stand-in ``vllm`` package for the CPU tests of ``ion-bench e2e`` / ``startup``.

:func:`install` writes ``vllm/entrypoints/cli/main.py`` under a directory that the test puts
on ``PYTHONPATH``, so that ``python -m vllm.entrypoints.cli.main ...`` (the command line
ion-bench runs) reaches it.  It answers ``bench throughput`` (JSON + summary line),
``serve`` (HTTP /health, /reset_prefix_cache under VLLM_SERVER_DEV_MODE=1, /fake_info; an
"engine core" child in its process group) and ``bench serve`` (vLLM's result JSON).  Every
call appends a JSON line to ``$FAKE_VLLM_LOG`` with the ``ion_vllm`` it would import, so a
test sees which checkout a ``NAME@DIR`` label reached.  Throughput: 1100 tok/s (+ call
number) for ION, 1050 for ION from a dir named ``tag``, 1000 otherwise.
Knobs: FAKE_FAIL / FAKE_SERVE_FAIL / FAKE_SERVE_HANG / FAKE_BENCH_FAIL = a backend label
("ION", "ION@tag", "FLASH_ATTN"); FAKE_HEALTH_DELAY = seconds before /health is 200.
"""

import os

MAIN = r'''
import importlib.util, json, os, subprocess, sys, time, urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
spec = importlib.util.find_spec("ion_vllm")
origin = spec.origin if spec else None


def flag(name):
    return args[args.index(name) + 1]


def note(**kw):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(kw) + "\n")


def label(backend):
    return backend + ("@tag" if origin and "/tag/" in origin else "")


def count(kind):
    with open(os.environ["FAKE_VLLM_LOG"]) as f:
        return sum(1 for line in f if json.loads(line)["kind"] == kind)


def tok_s(lab, n):
    return {"ION": 1100.0, "ION@tag": 1050.0}.get(lab, 1000.0) + n


if args[:2] == ["bench", "throughput"]:
    lab = label(flag("--attention-backend"))
    note(kind="throughput", label=lab, ion=origin)
    if lab == os.environ.get("FAKE_FAIL"):
        print("boom"); sys.exit(3)
    tok = tok_s(lab, count("throughput"))
    json.dump({"elapsed_time": 2.0, "num_requests": 4, "total_num_tokens": tok * 2,
               "requests_per_second": 2.0, "tokens_per_second": tok},
              open(flag("--output-json"), "w"))
    print(f"Throughput: 2.00 requests/s, {tok:.2f} total tokens/s, {tok / 10:.2f} output tokens/s")
elif args[:1] == ["serve"]:
    lab, port = label(flag("--attention-backend")), int(flag("--port"))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    note(kind="serve", label=lab, port=port, pid=os.getpid(), child=child.pid, ion=origin,
         argv=args, dev=os.environ.get("VLLM_SERVER_DEV_MODE"),
         env={k: os.environ.get(k) for k in ("VLLM_CACHE_ROOT", "CUTE_DSL_CACHE_DIR",
                                             "TRITON_CACHE_DIR", "PYTHONSAFEPATH")})
    if lab == os.environ.get("FAKE_SERVE_FAIL"):
        print("CUDA out of memory (fake)"); sys.exit(1)
    ready_at = time.monotonic() + float(os.environ.get("FAKE_HEALTH_DELAY", "0"))
    hang = lab == os.environ.get("FAKE_SERVE_HANG")

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(503 if hang or time.monotonic() < ready_at else 200, {})
            elif self.path == "/fake_info":
                self._send(200, {"label": lab, "port": port})
            else:
                self._send(404, {})

        def do_POST(self):
            ok = self.path == "/reset_prefix_cache" and os.environ.get("VLLM_SERVER_DEV_MODE") == "1"
            if ok:
                note(kind="reset", label=lab)
            self._send(200 if ok else 404, {"success": True} if ok else {})

    srv = ThreadingHTTPServer(("127.0.0.1", port), H)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)
elif args[:2] == ["bench", "serve"]:
    info = json.load(urllib.request.urlopen(flag("--base-url") + "/fake_info", timeout=10))
    seed = int(flag("--seed"))
    note(kind="bench", label=info["label"], seed=seed, port=info["port"])
    if info["label"] == os.environ.get("FAKE_BENCH_FAIL"):
        print("boom"); sys.exit(3)
    tok = tok_s(info["label"], count("bench"))
    res = {"duration": 2.0, "completed": 4, "failed": 0, "request_throughput": 2.0,
           "output_throughput": tok * 0.2, "total_token_throughput": tok}
    for i, m in enumerate(("ttft", "tpot", "itl")):
        res.update({f"p50_{m}_ms": 10.0 * (i + 1) + seed, f"p99_{m}_ms": 20.0 * (i + 1) + seed})
    os.makedirs(flag("--result-dir"), exist_ok=True)
    with open(os.path.join(flag("--result-dir"), flag("--result-filename")), "w") as f:
        json.dump(res, f)
else:
    print("unexpected", args); sys.exit(9)
'''


def install(root) -> str:
    """Write the fake package under ``root``; returns the dir to put on PYTHONPATH."""
    d = os.path.join(str(root), "fakevllm")
    cli = os.path.join(d, "vllm", "entrypoints", "cli")
    os.makedirs(cli, exist_ok=True)
    for sub in ("vllm", "vllm/entrypoints", "vllm/entrypoints/cli"):
        open(os.path.join(d, sub, "__init__.py"), "w").close()
    with open(os.path.join(cli, "main.py"), "w") as f:
        f.write(MAIN)
    return d


def calls(log_path, kind=None) -> list[dict]:
    import json
    if not os.path.exists(log_path):
        return []
    with open(log_path) as f:
        recs = [json.loads(line) for line in f]
    return [r for r in recs if kind is None or r["kind"] == kind]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError, IndexError):
        return False


def assert_all_stopped(log_path, n: int, timeout: float = 15.0) -> None:
    """Every fake server (and its engine-core child) started so far has exited."""
    import signal
    import time
    servers = calls(log_path, "serve")
    assert len(servers) == n, servers
    left = [p for s in servers for p in (s["pid"], s["child"])]
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        left = [p for p in left if alive(p)]
        time.sleep(0.05)
    for p in left:  # never leak them into other tests
        os.kill(p, signal.SIGKILL)
    assert not left, f"still running: {left}"
