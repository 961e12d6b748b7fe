"""CPU tests of scripts/make_demo_model.py and scripts/make_tiny_model.py."""

import hashlib
import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
VOCAB = 152064


def _run(script, *args):
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *args],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "qwen7b-demo"
    _run("make_demo_model.py", str(out))
    return out


TINY_ARGS = ["--layers", "2", "--hidden", "256", "--heads", "2", "--kv-heads", "1",
             "--intermediate", "512", "--seed", "3"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "tiny"
    _run("make_tiny_model.py", str(out), *TINY_ARGS)
    return out


def test_demo_files_and_config(demo_dir):
    names = sorted(os.listdir(demo_dir))
    assert names == ["config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json"]
    cfg = json.loads((demo_dir / "config.json").read_text())
    expect = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "intermediate_size": 18944, "vocab_size": VOCAB, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    for k, v in expect.items():
        assert cfg[k] == v, k
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 128
    gen = json.loads((demo_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 151643


def test_demo_config_via_transformers(demo_dir):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(str(demo_dir))
    assert cfg.model_type == "qwen2"
    assert cfg.num_key_value_heads == 4 and cfg.num_attention_heads == 28
    assert cfg.vocab_size == VOCAB and cfg.hidden_size == 3584
    assert cfg.tie_word_embeddings is False
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    assert rope["rope_theta"] == 1e6


VLLM_CHECK = """
import sys, random
import vllm.platforms as P
from vllm.platforms.cpu import CpuPlatform
P._current_platform = CpuPlatform()
from vllm.config import ModelConfig
from vllm.tokenizers import get_tokenizer
d = sys.argv[1]
m = ModelConfig(model=d, tokenizer=d, dtype="bfloat16", max_model_len=8192)
assert m.architectures == ["Qwen2ForCausalLM"], m.architectures
assert (m.get_total_num_kv_heads(), m.get_head_size(), m.get_vocab_size()) == (4, 128, 152064)
t = get_tokenizer(d)
assert len(t) == 152064 and t.eos_token_id == 151643
r = random.Random(1)
assert len(t.decode([r.randrange(152064) for _ in range(300)])) > 500
print("VLLM_OK")
"""


def test_demo_model_parsed_by_vllm(demo_dir):
    # subprocess: the CPU platform override must not leak into other tests
    r = subprocess.run([sys.executable, "-c", VLLM_CHECK, str(demo_dir)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "VLLM_OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_demo_tokenizer(demo_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(demo_dir))
    assert len(tok) == VOCAB
    vocab = tok.get_vocab()
    assert len(vocab) == VOCAB and sorted(vocab.values()) == list(range(VOCAB))
    assert tok.eos_token_id == 151643
    assert tok.convert_tokens_to_ids("<|im_start|>") == 151644
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    assert tok.convert_tokens_to_ids("<|file_sep|>") == 151664
    # realistic multi-character tokens
    lens = [len(t) for t in vocab]
    assert sum(lens) / len(lens) > 4.0
    assert sum(1 for n in lens if n == 1) < 1000
    # decoding random ids works and produces text
    rng = random.Random(0)
    ids = [rng.randrange(VOCAB) for _ in range(500)]
    text = tok.decode(ids, skip_special_tokens=True)
    assert isinstance(text, str) and len(text) > 1000
    # every single id decodes (spot check incl. the top of the range)
    for i in list(range(0, 300)) + list(range(VOCAB - 500, VOCAB)):
        assert isinstance(tok.decode([i]), str)
    # encode / decode round trip on ordinary text
    s = "Hello world, the quick brown fox. 中文 12345\n  indented"
    enc = tok(s).input_ids
    assert tok.decode(enc) == s
    assert len(enc) < len(s)


def test_demo_tokenizer_deterministic(tmp_path, demo_dir):
    out = tmp_path / "again"
    _run("make_demo_model.py", str(out))
    h1 = hashlib.sha256((demo_dir / "tokenizer.json").read_bytes()).hexdigest()
    h2 = hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert h1 == h2


def test_tiny_files_and_weights(tiny_dir):
    from safetensors.torch import load_file
    import torch
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(os.listdir(tiny_dir))
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 256
    assert cfg["num_attention_heads"] == 2 and cfg["num_key_value_heads"] == 1
    assert cfg["head_dim"] == 128 and cfg["vocab_size"] == VOCAB
    w = load_file(str(tiny_dir / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in w.values())
    assert w["model.embed_tokens.weight"].shape == (VOCAB, 256)
    assert w["lm_head.weight"].shape == (VOCAB, 256)
    assert w["model.layers.1.self_attn.k_proj.weight"].shape == (128, 256)
    assert w["model.layers.1.self_attn.q_proj.bias"].shape == (256,)
    assert w["model.layers.0.mlp.down_proj.weight"].shape == (256, 512)
    assert torch.equal(w["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))
    assert torch.equal(w["model.layers.0.input_layernorm.weight"],
                       torch.ones(256, dtype=torch.bfloat16))
    std = w["model.layers.0.mlp.gate_proj.weight"].float().std().item()
    assert 0.019 < std < 0.021
    assert not torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])
    assert len(w) == 2 + 1 + 2 * 12


def test_tiny_deterministic(tmp_path, tiny_dir):
    out = tmp_path / "again"
    _run("make_tiny_model.py", str(out), *TINY_ARGS)
    a = hashlib.sha256((tiny_dir / "model.safetensors").read_bytes()).hexdigest()
    b = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert a == b
    other = tmp_path / "seed4"
    _run("make_tiny_model.py", str(other), *TINY_ARGS[:-1], "4")
    c = hashlib.sha256((other / "model.safetensors").read_bytes()).hexdigest()
    assert c != a


def test_tiny_loads_in_transformers(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert len(tok) == VOCAB
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    model.eval()
    # all weights were loaded (none freshly initialised): compare against the file
    from safetensors.torch import load_file
    w = load_file(str(tiny_dir / "model.safetensors"))
    sd = model.state_dict()
    for name, t in w.items():
        assert torch.equal(sd[name].to(torch.bfloat16), t), name
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 8, VOCAB)
    assert torch.isfinite(logits).all()
    assert logits[0, -1].std() > 0.1  # random weights -> non-degenerate logits


def test_tiny_default_config_shape():
    sys.path.insert(0, SCRIPTS)
    try:
        import make_tiny_model as mt
    finally:
        sys.path.remove(SCRIPTS)
    cfg = mt.tiny_config(4, 2048, 16, 2, 5632, 32768)
    assert cfg["head_dim"] == 128
    assert cfg["num_attention_heads"] // cfg["num_key_value_heads"] == 8
    n = sum(int(__import__("math").prod(s)) for _, s, _ in mt.weight_shapes(cfg))
    assert 700e6 < n < 900e6
    with pytest.raises(ValueError):
        mt.tiny_config(4, 2048, 16, 3, 5632, 32768)


# ---- scripts/e2e_agreement.py pure helpers (the script itself needs vLLM + GPU) -------

def _load_e2e():
    from script_loader import load_script

    return load_script("e2e_agreement.py", "e2e_agreement_under_test")


def test_e2e_help_and_import():
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "e2e_agreement.py"), "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for flag in ("--break", "--enforce-eager", "--out", "--model", "--top1-slack"):
        assert flag in r.stdout
    e2e = _load_e2e()
    assert "PASS iff" in e2e.__doc__ and "1.5" in e2e.__doc__
    r = subprocess.run([sys.executable, os.path.join(SCRIPTS, "e2e_agreement.py"),
                        "--backends", "ION,TRITON_ATTN"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "FLASH_ATTN" in r.stderr


def test_e2e_prompts():
    e2e = _load_e2e()
    a = e2e.build_prompts(0)
    assert a == e2e.build_prompts(0) and a != e2e.build_prompts(1)
    lens = [len(p["ids"]) for p in a]
    assert min(lens) == 16 and max(lens) >= 3500 and max(lens) <= 4096
    assert len(a) >= 30 and len({p["name"] for p in a}) == len(a)
    for n in (63, 64, 65, 2047, 2048, 2049):
        assert n in lens
    assert all(0 <= t < 151643 for p in a for t in p["ids"])
    share = [p["ids"] for p in a if p["name"].startswith("shareA")]
    assert len(share) >= 3 and all(s[:64] == share[0][:64] for s in share)
    assert sum(1 for s in share if s[:2048] == share[0][:2048]) >= 3
    c = next(p for p in a if p["name"].startswith("shareC"))
    assert c["ids"][:513] == next(p for p in a if p["name"] == "len513")["ids"]


class _LP:
    def __init__(self, logprob, rank):
        self.logprob, self.rank = logprob, rank


def test_e2e_extract_prompt_logprobs():
    e2e = _load_e2e()
    ids = [5, 7, 9]
    plp = [None,
           {3: _LP(-0.5, 1), 4: _LP(-1.0, 2), 7: _LP(-3.0, 9)},
           {9: _LP(-0.1, 1), 2: _LP(-2.5, 2)}]
    out = e2e.extract_prompt_logprobs(ids, plp)
    assert out == {"top1": [3, 9], "teacher_logprob": [-3.0, -0.1]}
    with pytest.raises(ValueError):
        e2e.extract_prompt_logprobs(ids, plp[:2])
    with pytest.raises(KeyError):  # teacher token must be present
        e2e.extract_prompt_logprobs([5, 8, 9], plp)


def _result(top1s, lps, gen=None):
    return {"teacher_forced": [{"top1": t, "teacher_logprob": l} for t, l in zip(top1s, lps)],
            "generated": gen}


def test_e2e_compare_and_verdict():
    e2e = _load_e2e()
    import random as _r
    rng = _r.Random(0)
    n = 2000
    ref_t = [rng.randrange(100) for _ in range(n)]
    ref_l = [rng.uniform(-15, -1) for _ in range(n)]
    ref = _result([ref_t], [ref_l], [{"ids": [1, 2, 3, 4], "logprobs": [0] * 4}])

    def noisy(sigma, flips, gen_ids=(1, 2, 3, 4)):
        t = list(ref_t)
        for i in rng.sample(range(n), flips):
            t[i] = (t[i] + 1) % 100
        lp = [x + rng.gauss(0, sigma) for x in ref_l]
        return _result([t], [lp], [{"ids": list(gen_ids), "logprobs": [0] * 4}])

    triton = e2e.compare(ref, noisy(0.01, 10), ["p0"])
    assert triton["positions"] == n and triton["top1_disagreements"] == 10
    assert triton["top1_agreement"] == pytest.approx(1 - 10 / n)
    assert 0.005 < triton["dlogprob_mean"] < 0.012
    assert triton["dlogprob_p99"] < triton["dlogprob_max"]
    assert triton["greedy_prefix_match"] == 1.0 and triton["greedy_identical_prompts"] == 1

    good = e2e.compare(ref, noisy(0.008, 8), ["p0"])
    assert e2e.verdict(good, triton)["verdict"] == "PASS"
    worse_top1 = e2e.compare(ref, noisy(0.008, 30), ["p0"])
    v = e2e.verdict(worse_top1, triton)
    assert v["verdict"] == "FAIL" and v["checks"]["top1"] is False
    assert e2e.verdict(worse_top1, triton, top1_slack=0.02)["verdict"] == "PASS"
    noisier = e2e.compare(ref, noisy(0.05, 5), ["p0"])
    assert e2e.verdict(noisier, triton)["verdict"] == "FAIL"
    # a localized fault (a few positions badly off, like a swapped KV page) fails on max
    bad = noisy(0.008, 5)
    for i in range(100, 110):
        bad["teacher_forced"][0]["teacher_logprob"][i] += 3.0
    faulty = e2e.compare(ref, bad, ["p0"])
    v = e2e.verdict(faulty, triton)
    assert v["verdict"] == "FAIL" and v["checks"]["dlogprob_max"] is False
    # greedy divergence is measured
    div = e2e.compare(ref, noisy(0.0, 0, gen_ids=(1, 2, 9, 4)), ["p0"])
    assert div["greedy_prefix_match"] == 0.5 and div["greedy_identical_prompts"] == 0
    md = e2e.render_markdown({"date": "x", "model": "m", "num_prompts": 1, "positions": n,
                              "enforce_eager": False, "fault": None, "top1_slack": 0.0,
                              "vs_reference": {"TRITON_ATTN": triton, "ION": faulty},
                              "verdict": v})
    assert "| ION |" in md and "Verdict: FAIL" in md


FAKE_VLLM = '''
"""Fake vllm (tests only): a deterministic 'model' whose per-backend numerics differ."""
import math, os, random
from types import SimpleNamespace


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class LLM:
    def __init__(self, model, attention_backend, **kw):
        assert os.path.isdir(model), model
        assert kw["enable_prefix_caching"] is True
        assert kw["max_num_batched_tokens"] == 512
        mode = os.environ.get("EXPECT_ION_CUDAGRAPH_MODE")
        if mode and attention_backend == "ION":
            assert kw["compilation_config"] == {"cudagraph_mode": mode}, kw
        else:
            assert "compilation_config" not in kw, (attention_backend, kw)
        self.backend = attention_backend
        self.fault = os.environ.get("ION_FAULT_INJECT") if attention_backend == "ION" else None
        noise = {"FLASH_ATTN": 0.0, "TRITON_ATTN": 2e-3, "ION": 2e-3}[attention_backend]
        self.noise = noise

    def _dist(self, prefix, pos):
        # true "logprobs": top token and the logprob of any token, from the prefix
        h = hash((tuple(prefix[-3:]), len(prefix))) & 0xFFFFFFFF
        rng = random.Random(h)
        top = rng.randrange(1000)
        rng2 = random.Random(h ^ (self.backend.__hash__() & 0xFFFF) ^ pos)
        n = rng2.gauss(0, self.noise)
        if self.fault and 300 <= pos < 340:
            n += 2.0
        return top, n

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
            else:
                seq = list(ids)
                gen, lps = [], []
                for _ in range(sp.max_tokens):
                    top, n = self._dist(seq, len(seq))
                    gen.append(top)
                    lps.append({top: SimpleNamespace(logprob=-0.5 + n, rank=1)})
                    seq.append(top)
                outs.append(SimpleNamespace(prompt_logprobs=None, outputs=[
                    SimpleNamespace(token_ids=gen, logprobs=lps)]))
        return outs
'''


@pytest.mark.parametrize("break_", [False, True])
def test_e2e_pipeline_with_fake_vllm(tmp_path, break_):
    """The whole driver (subprocess per backend, teacher forcing, metrics, verdict,
    output files, --break env propagation) against a fake vllm package."""
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (fake / "vllm" / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n")
    model = tmp_path / "model"
    model.mkdir()
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(fake), PYTHONHASHSEED="0")
    env.pop("ION_FAULT_INJECT", None)
    cmd = [sys.executable, os.path.join(SCRIPTS, "e2e_agreement.py"), "--model", str(model),
           "--out", str(out), "--gen-tokens", "4"]
    if break_:
        cmd.append("--break")
    else:  # the ION run alone gets vLLM's FULL cudagraph mode (mixed batches in full graphs)
        cmd += ["--ion-cudagraph-mode", "FULL"]
        env["EXPECT_ION_CUDAGRAPH_MODE"] = "FULL"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == (1 if break_ else 0), r.stdout + r.stderr
    s = json.loads((out / "agreement.json").read_text())
    assert set(s["vs_reference"]) == {"TRITON_ATTN", "ION"}
    assert s["verdict"]["verdict"] == ("FAIL" if break_ else "PASS")
    assert s["fault"] == ("swap_kv_page" if break_ else None)
    ion = s["vs_reference"]["ION"]
    assert ion["positions"] == sum(n + 4 - 1 for n in s["prompt_lengths"])
    assert ion["top1_agreement"] == 1.0
    if break_:
        assert s["verdict"]["checks"]["dlogprob_max"] is False and ion["dlogprob_max"] > 1.0
        assert (out / "log-ION-fault.txt").exists()
    else:
        assert ion["dlogprob_max"] < 0.05
    assert "Verdict" in (out / "agreement.md").read_text()
    assert "verdict:" in r.stdout
