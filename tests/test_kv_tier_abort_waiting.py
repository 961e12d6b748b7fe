"""A request aborted while it waits after a lookup: vLLM 0.26's OffloadingConnector
(scheduler side) fails ``assert len(offload_keys) == len(offload_block_ids)`` in
``_build_store_jobs`` and EngineCore dies (a benchmark's time limit that shuts an engine down with
preempted requests waiting gets there).  Two ways in:
a new request that waits for room after its lookup (any store policy), and a preempted one
whose final sampled token completes a block (policies that store past the prompt).  The
Ion spec installs a guard (``ion_vllm/kv_tier/vllm_guards.py``); these tests drive vLLM's
real Scheduler on the CPU with and without it."""

from types import SimpleNamespace

import pytest

from test_kv_tier_scheduler import BS, Engine, _prompt, vllm_cpu  # noqa: F401  (fixture)


def _preempt_at_block_boundary(vllm_cpu, extra=None):  # noqa: F811
    """An engine whose request r2 was preempted while its token count was a multiple of
    the block size (its last sampled token completes a block), and still waits after a
    readmission attempt (a lookup, which clears the connector's block ids of r2) found no
    room."""
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
        n = len(eng.matched)
        eng.step()
        if any(m[0] == "r2" for m in eng.matched[n:]) and r2 in eng.sched.waiting:
            return eng, r1, r2
    pytest.fail("no prompt length preempts r2 at a block boundary")


def _waiting_after_lookup(vllm_cpu, extra=None):  # noqa: F811
    """An engine whose new request r2 (6 full prompt blocks) was looked up and waits for
    room behind r1, nothing of it computed."""
    eng = Engine(vllm_cpu, gpu_blocks=10, host_blocks=64, store_lag=1, max_num_seqs=2,
                 extra=extra)
    r1 = eng.add("r1", _prompt(3, 96), max_tokens=30)
    eng.step()
    r2 = eng.add("r2", _prompt(4, 100), max_tokens=10)
    eng.step()
    eng.step()
    assert r2 in eng.sched.waiting and r2.num_computed_tokens == 0
    assert [m for m in eng.matched if m[0] == "r2"]
    return eng, r1, r2


def _abort(eng, rid):
    from vllm.v1.request import RequestStatus

    eng.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)


@pytest.fixture
def no_guard(monkeypatch):
    """vLLM's request_finished as shipped (the guard taken off for one test)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler as cls)

    from ion_vllm.kv_tier.vllm_guards import install_abort_guard

    install_abort_guard()
    monkeypatch.setattr(cls, "request_finished", cls.request_finished.__wrapped__)
    # and the spec does not put it back when the engine builds its manager
    monkeypatch.setattr("ion_vllm.kv_tier.spec.install_abort_guard", lambda: False)


def _assert_vllm_store_assertion(eng, r1):
    with pytest.raises(AssertionError) as e:
        eng.run_to_completion(r1)
    last = e.traceback[-1]
    assert last.name == "_build_store_jobs" and "offloading" in str(last.path)
    assert "len(offload_keys) == len(offload_block_ids)" in str(last.statement)


def _assert_goes_on(eng, r1, n_out, max_tokens):
    eng.run_to_completion(r1)
    assert r1.num_output_tokens == max_tokens
    assert not [1 for _, _, meta in eng.outputs[n_out:]
                for job in meta.store_jobs.values() if job.req_id == "r2"]
    assert "r2" not in eng.cs._req_status


def test_without_the_guard_vllm_asserts(vllm_cpu, no_guard):  # noqa: F811
    eng, r1, r2 = _preempt_at_block_boundary(vllm_cpu)
    _abort(eng, "r2")
    _assert_vllm_store_assertion(eng, r1)


@pytest.mark.parametrize("extra", [None, {"offload_prompt_only": True}],
                         ids=["all-blocks", "prompt-only"])
def test_new_request_aborted_while_waiting(vllm_cpu, extra, no_guard):  # noqa: F811
    """Without the guard, any store policy: vLLM's own default crashes here too."""
    eng, r1, r2 = _waiting_after_lookup(vllm_cpu, extra)
    _abort(eng, "r2")
    _assert_vllm_store_assertion(eng, r1)


@pytest.mark.parametrize("extra", [None, {"offload_prompt_only": True}],
                         ids=["all-blocks", "prompt-only"])
def test_new_request_aborted_while_waiting_with_the_guard(vllm_cpu, extra):  # noqa: F811
    eng, r1, r2 = _waiting_after_lookup(vllm_cpu, extra)
    n_out = len(eng.outputs)
    _abort(eng, "r2")
    _assert_goes_on(eng, r1, n_out, 30)


def test_prompt_only_policy_does_not_reach_it_even_without_the_guard(
        vllm_cpu, no_guard):  # noqa: F811
    """The preempted-at-a-boundary way in needs a policy that stores past the prompt."""
    eng, r1, r2 = _preempt_at_block_boundary(vllm_cpu, {"offload_prompt_only": True})
    _abort(eng, "r2")
    eng.run_to_completion(r1)
    assert r1.num_output_tokens == 60


def test_with_the_guard_the_engine_goes_on_and_the_tier_keeps_r2s_blocks(
        vllm_cpu):  # noqa: F811
    eng, r1, r2 = _preempt_at_block_boundary(vllm_cpu)
    stored = eng.host_ids_of("r2")  # stored before / flushed at the preemption
    assert stored
    n_out = len(eng.outputs)
    _abort(eng, "r2")
    # nothing stored for r2 after the abort, and its state is gone from the connector
    _assert_goes_on(eng, r1, n_out, 60)
    # what was stored for r2 still serves a request with r2's tokens
    r3 = eng.add("r3", list(r2.all_token_ids[:len(stored) * BS + 3]), max_tokens=2)
    eng.run_to_completion(r3)
    ext = [m for m in eng.matched if m[0] == "r3"][0][2]
    assert ext == len(stored) * BS


def _state(keys, ids, next_idx):
    return SimpleNamespace(offload_keys=list(range(keys)), block_ids=list(range(ids)),
                           next_stored_chunk_idx=next_idx)


def test_skip_chunks_without_gpu_blocks():
    from ion_vllm.kv_tier.vllm_guards import skip_chunks_without_gpu_blocks as skip

    # block ids cover the keys (a request that finished while running): untouched
    st = SimpleNamespace(group_states=(_state(5, 5, 4),))
    assert skip(st, 1) == 0 and st.group_states[0].next_stored_chunk_idx == 4
    # cleared by a readmission lookup: the unstored chunks are skipped
    st = SimpleNamespace(group_states=(_state(5, 0, 4), _state(3, 3, 1)))
    assert skip(st, 1) == 1
    assert [g.next_stored_chunk_idx for g in st.group_states] == [5, 1]
    # everything already stored: nothing to skip
    st = SimpleNamespace(group_states=(_state(5, 0, 5),))
    assert skip(st, 1) == 0
    # two blocks a chunk: 3 keys need 6 ids
    st = SimpleNamespace(group_states=(_state(3, 5, 1),))
    assert skip(st, 2) == 2 and st.group_states[0].next_stored_chunk_idx == 3
    st = SimpleNamespace(group_states=(_state(3, 6, 1),))
    assert skip(st, 2) == 0


def test_install_is_idempotent():
    from ion_vllm.kv_tier.vllm_guards import install_abort_guard

    install_abort_guard()
    assert install_abort_guard() is False
