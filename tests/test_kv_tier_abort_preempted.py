"""A request aborted while it waits after a preemption, in vLLM 0.26's OffloadingConnector
(scheduler side, unchanged vLLM code): seen on the H100 on 2026-12-06 when the benchmark's
time limit shut an engine down with preempted requests waiting (EngineCore fatal error,
``assert len(offload_keys) == len(offload_block_ids)`` in ``_build_store_jobs``).

Why: preemption clears the request's GPU block ids in the connector's scheduler state;
``request_finished`` then extends its offload keys to every block full by token count,
and when the last sampled token (never computed) completes a block, the next
``_build_store_jobs`` asks for one block more than the cleared id list holds.  Only
policies that store past the prompt reach it this way (Ion's default, vLLM's
``offload_prompt_only: false``); vLLM's prompt-only default caps the keys at the prompt.

These tests pin the behaviour down through vLLM's real Scheduler on the CPU, so that the
day vLLM (or a guard on Ion's side) changes it, they say so."""

import pytest

from test_kv_tier_scheduler import BS, Engine, _prompt, vllm_cpu  # noqa: F401  (fixture)


def _preempt_at_block_boundary(vllm_cpu, extra):  # noqa: F811
    """An engine whose request r2 was preempted while its token count was a multiple of
    the block size (its last sampled token completes a block), and still waits after a
    readmission attempt (a lookup) found no room."""
    for p2 in range(33, 64):
        eng = Engine(vllm_cpu, gpu_blocks=10, host_blocks=64, store_lag=1, max_num_seqs=2,
                     extra=extra)
        r1 = eng.add("r1", _prompt(3, 48), max_tokens=60)
        r2 = eng.add("r2", _prompt(4, p2), max_tokens=60)
        try:
            eng.run(lambda: r2.num_preemptions > 0, max_steps=400)
        except AssertionError:
            continue
        if r2.num_tokens % BS or r2.is_finished():
            continue
        # the scheduler tries to readmit r2: its lookup clears the connector's block ids
        # of r2; the pool still has no room, so r2 keeps waiting
        n = len(eng.matched)
        eng.step()
        if any(m[0] == "r2" for m in eng.matched[n:]) and not eng.sched.requests[
                "r2"].num_computed_tokens and r2 in eng.sched.waiting:
            return eng, r1, r2
    pytest.fail("no prompt length preempts r2 at a block boundary")


def _abort(eng, rid):
    from vllm.v1.request import RequestStatus

    eng.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)


def test_abort_of_a_preempted_request_trips_vllms_store_assertion(vllm_cpu):  # noqa: F811
    eng, r1, r2 = _preempt_at_block_boundary(vllm_cpu, None)
    _abort(eng, "r2")
    with pytest.raises(AssertionError) as e:
        eng.run_to_completion(r1)
    last = e.traceback[-1]
    assert last.name == "_build_store_jobs" and "offloading" in str(last.path)
    assert "len(offload_keys) == len(offload_block_ids)" in str(last.statement)


def test_prompt_only_policy_does_not_reach_it(vllm_cpu):  # noqa: F811
    eng, r1, r2 = _preempt_at_block_boundary(vllm_cpu, {"offload_prompt_only": True})
    _abort(eng, "r2")
    eng.run_to_completion(r1)
    assert r1.num_output_tokens == 60
