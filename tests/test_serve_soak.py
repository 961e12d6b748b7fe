"""scripts/serve_soak.py on the CPU: its plan, its judgements, and its server command as
vLLM 0.26's own parser reads it (the soak itself runs on a GPU)."""

from __future__ import annotations

import random

import pytest

from script_loader import load_script

soak = load_script("serve_soak.py", "serve_soak_script")


@pytest.mark.parametrize("n,frac", [(2000, 0.05), (400, 0.05), (7, 0.5)])
def test_the_plan_disconnects_exactly_the_share_asked(n, frac):
    reqs = soak.plan_phase(random.Random(n), n, 16, (16, 1024), (16, 256), frac)
    assert len(reqs) == n and [r.idx for r in reqs] == list(range(n))
    assert sum(1 for r in reqs if r.disconnect_after) == round(frac * n)
    assert all(2 <= r.disconnect_after <= 8 for r in reqs if r.disconnect_after)
    assert all(16 <= r.prompt_len <= 1024 and 16 <= r.max_tokens <= 256 for r in reqs)


def test_error_lines_catch_errors_and_tracebacks_only():
    log = "\n".join([
        "INFO 12-07 10:00:00 [api_server.py:1] Started server",
        "WARNING 12-07 10:00:01 [x.py:2] Ion KV tier: verify mode on",
        "ERROR 12-07 10:00:02 [core.py:3] EngineCore encountered an issue",
        "Traceback (most recent call last):",
        "INFO 12-07 10:00:03 [metrics.py:4] error_rate=0",  # a word, not a level
        # the tier's stats line names its failure counters: not an engine failure
        "(EngineCore pid=5) INFO 12-07 [worker.py:426] Ion KV tier worker: "
        "{'failed_copies': 0, 'failed_load_blocks': 0}",
        "(EngineCore pid=5) ERROR 12-07 [core.py:1] EngineCore failed to start",
    ])
    lines = log.splitlines()
    assert soak.error_lines(log) == lines[2:4] + lines[6:]


def test_metrics_are_summed_over_label_sets():
    text = "\n".join([
        "# TYPE vllm:num_preemptions_total counter",
        'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0',
        'vllm:num_preemptions_total{engine="1",model_name="m"} 4.0',
        'vllm:ion_kv_tier_loaded_blocks_total{engine="0"} 120.0',
        'vllm:num_preemptions_created{engine="0"} 1.7e9',
    ])
    m = soak.parse_metrics(text)
    assert m["vllm:num_preemptions_total"] == 7.0
    assert m["vllm:ion_kv_tier_loaded_blocks_total"] == 120.0
    assert m["vllm:request_success_total"] == 0.0


def test_flatness_compares_the_first_and_the_last_minute():
    s = [{"t": float(t), "rss": 1000.0 + (300.0 if t >= 240 else 0.0)}
         for t in range(0, 301, 5)]
    f = soak.flatness(s, "rss")
    assert f["first_min_mib"] == 1000.0 and f["span_s"] == 300.0
    assert f["growth_mib"] == 300.0 and f["last_min_mib"] == 1300.0


def test_gpu_memory_counts_only_the_server_processes(monkeypatch):
    table = "4242, 30000\n4243, 1200\n999, 50000\n"
    monkeypatch.setattr(soak, "_smi", lambda *q: table)
    assert soak.gpu_tree_mib([4242, 4243, 7]) == 31200.0
    assert soak.gpu_tree_mib([7]) != soak.gpu_tree_mib([7])  # none listed: NaN


def test_the_server_command_parses_as_vllm_serve(tmp_path, cpu_platform):
    import json

    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ns = type("A", (), dict(model=str(tmp_path), max_model_len=8192, max_num_seqs=512,
                            gpu_blocks=4096, gpu_memory_utilization=0.9, host_gib=32.0))
    cmd = soak.server_cmd(ns, 8125)
    sub = cmd[cmd.index("vllm.entrypoints.cli.main") + 1:]
    assert sub[0] == "serve"
    a = make_arg_parser(FlexibleArgumentParser()).parse_args(sub[1:])
    assert (a.attention_backend, a.port, a.num_gpu_blocks_override, a.kv_offloading_size,
            a.load_format, a.max_num_seqs) == ("ION", 8125, 4096, 32.0, "dummy", 512)
    tier = a.kv_transfer_config
    tier = json.loads(tier) if isinstance(tier, str) else tier
    get = tier.get if isinstance(tier, dict) else lambda k: getattr(tier, k)
    assert get("kv_load_failure_policy") == "recompute"
    assert get("kv_connector_extra_config") == {"spec_name": "IonKVTier"}


def test_clients_stream_hang_up_and_count_failures_against_a_fake_server():
    """run_phase against a local aiohttp server that streams one SSE chunk per token and
    fails every request whose prompt starts with token 0: completed, disconnected and
    failed requests are told apart."""
    import asyncio
    import json

    from aiohttp import web

    async def completions(request):
        body = await request.json()
        if body["prompt"][0] == 0:
            return web.Response(status=500, text="boom")
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await resp.write(f"data: {json.dumps({'choices': [{'text': str(i)}]})}\n\n"
                             .encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def scenario():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        reqs = soak.plan_phase(random.Random(5), 40, 2, (3, 9), (10, 20), 0.25)
        prefixes = [[7, 7], [0, 1]]  # prefix 1 fails
        try:
            return reqs, await soak.run_phase(f"http://127.0.0.1:{port}/v1/completions", "m",
                                              reqs, prefixes, concurrency=8, seed=1)
        finally:
            await runner.cleanup()

    reqs, res = asyncio.run(scenario())
    by = {r["idx"]: r for r in res}
    for q in reqs:
        r = by[q.idx]
        if q.prefix == 1:
            assert not r["ok"] and r["status"] == 500
        elif q.disconnect_after:
            assert r["ok"] and r["disconnected"] and r["chunks"] == q.disconnect_after
        else:
            assert r["ok"] and not r.get("disconnected") and r["chunks"] == q.max_tokens
