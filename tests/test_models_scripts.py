"""CPU tests of the model makers (scripts/make_demo_model.py, make_tiny_model.py) and of
scripts/e2e_agreement.py's metrics, verdict, fault injection and driver (the driver against a
fake ``vllm`` package; the real check needs a GPU)."""

import json
import os
import random
import subprocess
import sys
import types

import pytest

from script_loader import load_script

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
VOCAB = 152064
TINY_ARGS = ["--layers", "1", "--hidden", "64", "--heads", "1", "--kv-heads", "1",
             "--intermediate", "128", "--seed", "3"]

demo_mod = load_script("make_demo_model.py", "make_demo_model_under_test")
tiny_mod = load_script("make_tiny_model.py", "make_tiny_model_under_test")
agree = load_script("e2e_agreement.py", "e2e_agreement_under_test")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "qwen7b-demo"
    assert demo_mod.main([str(out)]) == 0
    return out


def make_tiny(demo_dir, out, *args):
    """``make_tiny_model.py OUT ARGS``, the tokenizer copied from the demo model (the same
    builder writes both; building it again would only cost time)."""
    import shutil

    def copy_tokenizer(out_dir, seed=0, model_max_length=32768):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo_dir / name, os.path.join(out_dir, name))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_mod, "write_tokenizer", copy_tokenizer)
        assert tiny_mod.main([str(out), *args]) == 0
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, demo_dir):
    return make_tiny(demo_dir, tmp_path_factory.mktemp("tiny") / "tiny", *TINY_ARGS)


def test_demo_files_config_and_tokenizer(demo_dir):
    from transformers import AutoConfig, AutoTokenizer
    assert sorted(os.listdir(demo_dir)) == ["config.json", "generation_config.json",
                                            "tokenizer.json", "tokenizer_config.json"]
    cfg = AutoConfig.from_pretrained(str(demo_dir))
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size, cfg.tie_word_embeddings) == \
        ("qwen2", 3584, 28, 28, 4, VOCAB, False)
    tok = AutoTokenizer.from_pretrained(str(demo_dir))
    assert len(tok) == VOCAB and tok.eos_token_id == 151643
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|file_sep|>"]) == [151644, 151664]
    lens = [len(t) for t in tok.get_vocab()]
    assert sum(lens) / len(lens) > 4.0  # realistic multi-character tokens
    ids = [random.Random(0).randrange(VOCAB) for _ in range(500)]
    assert len(tok.decode(ids, skip_special_tokens=True)) > 1000
    s = "Hello world, the quick brown fox. 中文 12345\n  indented"
    assert tok.decode(tok(s).input_ids) == s


def test_models_parse_in_vllm(demo_dir, tiny_dir, cpu_platform):
    from vllm.config import ModelConfig
    m = ModelConfig(model=str(demo_dir), tokenizer=str(demo_dir), dtype="bfloat16",
                    max_model_len=8192)
    assert m.architectures == ["Qwen2ForCausalLM"]
    assert (m.get_total_num_kv_heads(), m.get_head_size(), m.get_vocab_size()) == (4, 128, VOCAB)
    t = ModelConfig(model=str(tiny_dir), tokenizer=str(tiny_dir), dtype="bfloat16",
                    max_model_len=4096)
    assert (t.get_total_num_kv_heads(), t.get_head_size()) == (1, 64)


def test_tiny_weights_are_seeded_and_named_as_transformers_expects(tiny_dir):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    w = load_file(str(tiny_dir / "model.safetensors"))
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["head_dim"]) == (1, 64, 64)
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert 0.019 < w["model.layers.0.mlp.gate_proj.weight"].float().std() < 0.021
    assert torch.equal(w["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    again = tiny_mod.make_weights(cfg, 3)  # bit-identical for a seed
    assert all(torch.equal(again[k], w[k]) for k in w)
    with torch.device("meta"):  # every weight transformers' Qwen2 has, and no other
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tiny_dir)))
    assert {k: tuple(v.shape) for k, v in hf.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in w.items()}


#: --arch: (model_type, head size, window, layer kinds, soft cap, attention sinks)
ARCH_EXPECT = {
    "gpt-oss": ("gpt_oss", 64, 128, {"sliding_attention", "full_attention"}, None, True),
    "gemma2": ("gemma2", 256, 4096, {"sliding_attention", "full_attention"}, 50.0, False),
    "gemma3": ("gemma3_text", 256, 1024, {"sliding_attention", "full_attention"}, None, False),
    "mistral": ("mistral", 128, 4096, None, None, False),
}


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory, demo_dir):
    """Every --arch model at hidden size 64."""
    return {arch: make_tiny(demo_dir, tmp_path_factory.mktemp(arch) / arch, "--arch", arch,
                            "--hidden", "64", "--seed", "5")
            for arch in tiny_mod.ARCHS}


def test_arch_refuses_the_qwen2_shape_flags(tmp_path):
    with pytest.raises(SystemExit):
        tiny_mod.main([str(tmp_path / "m"), "--arch", "gemma2", "--heads", "8"])
    with pytest.raises(SystemExit):
        tiny_mod.main([str(tmp_path / "m"), "--sliding-window", "256"])
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("arch", sorted(ARCH_EXPECT))
def test_arch_models_carry_their_attention_features(arch, arch_dirs, cpu_platform):
    """Each --arch model is what vLLM will serve: its architecture, head size, window on
    the sliding layers (both kinds of layer where the family mixes them), soft cap and
    sinks, with seeded bf16 weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from vllm.config import ModelConfig
    d = arch_dirs[arch]
    model_type, head, window, kinds, cap, sinks = ARCH_EXPECT[arch]
    cfg = AutoConfig.from_pretrained(str(d))
    assert (cfg.model_type, cfg.head_dim, cfg.sliding_window, cfg.vocab_size) == \
        (model_type, head, window, VOCAB)
    assert (set(cfg.layer_types) if getattr(cfg, "layer_types", None) else None) == kinds
    assert getattr(cfg, "attn_logit_softcapping", None) == cap
    w = load_file(str(d / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert ("model.layers.0.self_attn.sinks" in w) == sinks
    m = ModelConfig(model=str(d), tokenizer=str(d), dtype="bfloat16", max_model_len=8192)
    assert m.get_head_size() == head and m.architectures == cfg.architectures
    # ION takes every layer of the family as vLLM builds it (no refusal reason)
    from ion_vllm import validation
    windows = ({window if k == "sliding_attention" else None for k in kinds} if kinds
               else {window})  # one kind of layer: the config's window on every layer
    for w_ in windows:
        assert validation.layer_config_reasons(
            cfg.num_attention_heads, cfg.num_key_value_heads, head, sliding_window=w_,
            logits_soft_cap=cap, has_sinks=sinks) == [], (arch, w_)
    torch.manual_seed(0)  # the weights depend on --seed only
    tiny_mod.write_arch_model(arch, str(d.parent / "again"), 5, hidden=64)
    w2 = load_file(str(d.parent / "again" / "model.safetensors"))
    assert all(torch.equal(w[k], w2[k]) for k in w)


def test_tiny_config_shapes():
    cfg = tiny_mod.tiny_config(4, 2048, 16, 2, 5632, 32768)
    assert cfg["head_dim"] == 128 and cfg["num_attention_heads"] // cfg["num_key_value_heads"] == 8
    n = sum(int(__import__("math").prod(s)) for _, s, _ in tiny_mod.weight_shapes(cfg))
    assert 700e6 < n < 900e6
    with pytest.raises(ValueError):
        tiny_mod.tiny_config(4, 2048, 16, 3, 5632, 32768)


# --------------------------------------------------------------------------- e2e_agreement

def test_agreement_prompts_cover_pages_and_shared_prefixes():
    a = agree.build_prompts(0)
    assert a == agree.build_prompts(0) and a != agree.build_prompts(1)
    lens = [len(p["ids"]) for p in a]
    assert min(lens) == 16 and 3500 <= max(lens) <= 4096
    assert {63, 64, 65, 2047, 2048, 2049} <= set(lens)
    share = [p["ids"] for p in a if p["name"].startswith("shareA")]
    assert len(share) >= 3 and all(s[:64] == share[0][:64] for s in share)


class _LP:
    def __init__(self, logprob, rank):
        self.logprob, self.rank = logprob, rank


def test_agreement_extracts_prompt_logprobs():
    plp = [None, {3: _LP(-0.5, 1), 4: _LP(-1.0, 2), 7: _LP(-3.0, 9)},
           {9: _LP(-0.1, 1), 2: _LP(-2.5, 2)}]
    assert agree.extract_prompt_logprobs([5, 7, 9], plp) == {"top1": [3, 9],
                                                             "teacher_logprob": [-3.0, -0.1]}
    with pytest.raises(ValueError):
        agree.extract_prompt_logprobs([5, 7, 9], plp[:2])
    with pytest.raises(KeyError):  # the teacher token must be present
        agree.extract_prompt_logprobs([5, 8, 9], plp)


def test_agreement_compare_and_verdict():
    rng = random.Random(0)
    n = 2000
    ref_t, ref_l = [rng.randrange(100) for _ in range(n)], [rng.uniform(-15, -1) for _ in range(n)]

    def run(sigma, flips, gen=(1, 2, 3, 4), bump=0.0):
        t = list(ref_t)
        for i in rng.sample(range(n), flips):
            t[i] = (t[i] + 1) % 100
        lp = [x + rng.gauss(0, sigma) + (bump if 100 <= i < 110 else 0.0)
              for i, x in enumerate(ref_l)]
        return {"teacher_forced": [{"top1": t, "teacher_logprob": lp}],
                "generated": [{"ids": list(gen)}]}

    ref = run(0.0, 0)
    triton = agree.compare(ref, run(0.01, 10), ["p0"])
    assert triton["positions"] == n and triton["top1_disagreements"] == 10
    assert 0.005 < triton["dlogprob_mean"] < 0.012 and triton["greedy_prefix_match"] == 1.0
    assert agree.verdict(agree.compare(ref, run(0.008, 8), ["p0"]), triton)["verdict"] == "PASS"
    worse = agree.compare(ref, run(0.008, 30), ["p0"])
    assert agree.verdict(worse, triton)["checks"]["top1"] is False
    assert agree.verdict(worse, triton, top1_slack=0.02)["verdict"] == "PASS"
    assert agree.verdict(agree.compare(ref, run(0.05, 5), ["p0"]), triton)["verdict"] == "FAIL"
    local = agree.verdict(agree.compare(ref, run(0.008, 5, bump=3.0), ["p0"]), triton)
    assert local["checks"]["dlogprob_max"] is False  # a few positions badly off
    div = agree.compare(ref, run(0.0, 0, gen=(1, 2, 9, 4)), ["p0"])
    assert div["greedy_prefix_match"] == 0.5 and div["greedy_identical_prompts"] == 0


def test_fault_injection_reads_a_wrong_page(monkeypatch):
    """--break patches every binding of cute_kernels.ion_attention loaded in the worker, so
    that the kernel reads another request's page 0 (a lone request: its pages swapped)."""
    import torch
    bt = torch.tensor([[4, 5, 6], [7, 8, 9]])
    assert agree.fault_block_table(bt).tolist() == [[7, 5, 6], [7, 8, 9]]
    assert agree.fault_block_table(bt[:1]).tolist() == [[5, 4, 6]]
    assert bt.tolist() == [[4, 5, 6], [7, 8, 9]]  # the engine's table is untouched
    pkg, sub = types.ModuleType("cute_kernels"), types.ModuleType("cute_kernels.attention")
    pkg.ion_attention = sub.ion_attention = lambda q, k, v, out, qsl, sl, table, *a, **kw: table
    monkeypatch.setitem(sys.modules, "cute_kernels", pkg)
    monkeypatch.setitem(sys.modules, "cute_kernels.attention", sub)
    assert agree.inject_fault() == 2
    for f in (pkg.ion_attention, sub.ion_attention):
        assert f(None, None, None, None, None, None, bt, 0.1).tolist() == [[7, 5, 6], [7, 8, 9]]


FAKE_LLM = '''
"""Fake vllm (tests only): a deterministic 'model' whose per-backend numerics differ; ION
runs are broken when cute_kernels.ion_attention was patched (the --break fault)."""
import os, random
from types import SimpleNamespace


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class LLM:
    def __init__(self, model, attention_backend, **kw):
        assert os.path.isdir(model) and kw["enable_prefix_caching"] is True
        mode = os.environ.get("EXPECT_ION_CUDAGRAPH_MODE")
        if mode and attention_backend == "ION":
            assert kw["compilation_config"] == {"cudagraph_mode": mode}, kw
        else:
            assert "compilation_config" not in kw, (attention_backend, kw)
        spec = os.environ.get("EXPECT_SPEC_TOKENS")
        if spec:
            assert kw["speculative_config"]["method"] == "ngram", kw
            assert kw["speculative_config"]["num_speculative_tokens"] == int(spec), kw
            assert kw["disable_log_stats"] is False
        else:
            assert "speculative_config" not in kw, kw
        self.spec = bool(spec)
        self.diverge = attention_backend == "ION" and bool(os.environ.get("FAKE_ION_DIVERGES"))
        self.backend = attention_backend
        import cute_kernels
        self.fault = cute_kernels.ion_attention.__name__ == "broken"
        assert not self.fault or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.noise = {"FLASH_ATTN": 0.0, "TRITON_ATTN": 2e-3, "ION": 2e-3}[attention_backend]

    def _dist(self, prefix, pos):
        h = hash((tuple(prefix[-3:]), len(prefix))) & 0xFFFFFFFF
        top = random.Random(h).randrange(1000)
        n = random.Random(h ^ (hash(self.backend) & 0xFFFF) ^ pos).gauss(0, self.noise)
        return top, n + (2.0 if self.fault and 300 <= pos < 340 else 0.0)

    def generate(self, prompts, sp, use_tqdm=True):
        outs = []
        for p in prompts:
            ids = p["prompt_token_ids"]
            if getattr(sp, "prompt_logprobs", None):
                plp = [None]
                for i in range(1, len(ids)):
                    top, n = self._dist(ids[:i], i)
                    d = {top: SimpleNamespace(logprob=-0.5 + n, rank=1)}
                    if ids[i] != top:
                        d[ids[i]] = SimpleNamespace(logprob=-7.0 - (ids[i] % 5) + n, rank=50)
                    plp.append(d)
                outs.append(SimpleNamespace(prompt_logprobs=plp, outputs=[
                    SimpleNamespace(token_ids=[1], logprobs=None)]))
                continue
            seq, gen, lps = list(ids), [], []
            for j in range(sp.max_tokens):
                top, n = self._dist(seq, len(seq))
                top += 1 if self.diverge and j == 2 else 0
                gen.append(top)
                lps.append({top: SimpleNamespace(logprob=-0.5 + n, rank=1)})
                seq.append(top)
            outs.append(SimpleNamespace(prompt_logprobs=None,
                                        outputs=[SimpleNamespace(token_ids=gen, logprobs=lps)]))
        return outs

    def get_metrics(self):
        return [SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=12.0),
                SimpleNamespace(name="vllm:num_preemptions", value=0.0)] if self.spec else []
'''


def _fake_vllm(tmp_path):
    fake = tmp_path / "fake"
    for pkg, body in (("vllm", FAKE_LLM), ("cute_kernels", "def ion_attention(*a, **k):\n    pass\n")):
        (fake / pkg).mkdir(parents=True)
        (fake / pkg / "__init__.py").write_text(body)
    (fake / "vllm" / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    (tmp_path / "model").mkdir()
    return fake


def test_spec_prompts_repeat_a_segment():
    ps = agree.spec_prompts(0)
    assert ps == agree.spec_prompts(0) and ps != agree.spec_prompts(1)
    for p in ps:
        seg, reps = (int(x) for x in p["name"][3:].split("x"))
        assert len(p["ids"]) == seg * reps and p["ids"] == p["ids"][:seg] * reps
    assert {64, 65} <= {int(p["name"][3:].split("x")[0]) for p in ps}


@pytest.mark.parametrize("diverge", [False, True])
def test_agreement_driver_with_speculation(tmp_path, diverge):
    """--spec-ngram: every backend gets the n-gram proposer; ION passes only when its greedy
    output equals FLASH_ATTN's on every prompt (one token off fails it) and drafts ran."""
    fake = _fake_vllm(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(fake), PYTHONHASHSEED="0", EXPECT_SPEC_TOKENS="3")
    if diverge:
        env["FAKE_ION_DIVERGES"] = "1"
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "e2e_agreement.py"), "--model",
                        str(tmp_path / "model"), "--out", str(tmp_path / "out"),
                        "--gen-tokens", "4", "--num-prompts", "6", "--spec-ngram", "3"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == (1 if diverge else 0), r.stdout + r.stderr
    s = json.loads((tmp_path / "out" / "agreement.json").read_text())
    assert s["spec_ngram"] == 3 and s["prompt_lengths"][0] == 20  # rep5x4
    assert s["spec_decode"]["ION"] == {"vllm:spec_decode_num_draft_tokens": 12.0}
    checks = s["verdict"]["checks"]
    assert checks["drafts_verified"] is True and checks["greedy_identical"] is (not diverge)
    assert s["verdict"]["verdict"] == ("FAIL" if diverge else "PASS")


@pytest.mark.parametrize("break_", [False, True])
def test_agreement_driver_with_fake_vllm(tmp_path, break_):
    """The whole driver (a subprocess per backend, teacher forcing, metrics, verdict, output
    files; --break's fault reaching the ION worker only) against a fake vllm package."""
    fake = _fake_vllm(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(fake), PYTHONHASHSEED="0")
    cmd = [sys.executable, os.path.join(SCRIPTS, "e2e_agreement.py"), "--model",
           str(tmp_path / "model"), "--out", str(tmp_path / "out"), "--gen-tokens", "4",
           "--num-prompts", "16"]  # up to 500 tokens: the fault hits positions 300-340
    if break_:
        cmd.append("--break")
    else:  # the ION run alone gets vLLM's FULL cudagraph mode
        cmd += ["--ion-cudagraph-mode", "FULL"]
        env["EXPECT_ION_CUDAGRAPH_MODE"] = "FULL"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == (1 if break_ else 0), r.stdout + r.stderr
    s = json.loads((tmp_path / "out" / "agreement.json").read_text())
    assert set(s["vs_reference"]) == {"TRITON_ATTN", "ION"}
    assert s["verdict"]["verdict"] == ("FAIL" if break_ else "PASS")
    assert s["fault"] == ("swap_kv_page" if break_ else None)
    ion = s["vs_reference"]["ION"]
    assert len(s["prompt_lengths"]) == 16
    assert ion["positions"] == sum(n + 4 - 1 for n in s["prompt_lengths"])
    assert (ion["dlogprob_max"] > 1.0) if break_ else (ion["dlogprob_max"] < 0.05)
    assert s["vs_reference"]["TRITON_ATTN"]["dlogprob_max"] < 0.05  # only ION is broken
    assert "Verdict" in (tmp_path / "out" / "agreement.md").read_text()
