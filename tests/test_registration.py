"""CPU tests: `--attention-backend ION` through vLLM 0.26's own CLI parser and config, and
the ``vllm.general_plugins`` hook (``ion_vllm.register``) in a fresh process.

Everything here runs on a CPU-only machine: vLLM's platform is forced to CpuPlatform and
the model is a tiny Qwen2 config.json written into tmp_path (no hub access).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ion_vllm import BACKEND_NAME, BACKEND_QUALNAME  # noqa: E402

EXPECTED_QUALNAME = "ion_vllm.backend.IonAttentionBackend"

TINY_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def write_tiny_model(path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_QWEN2))
    return str(path)



@pytest.fixture
def tiny_model(tmp_path):
    return write_tiny_model(tmp_path / "tiny-qwen2")


def engine_config_from_cli(argv):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(argv)
    return EngineArgs.from_cli_args(args).create_engine_config()


def run_python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- register()
def test_exported_names():
    import ion_vllm
    from ion_vllm import registration, validation

    assert (BACKEND_NAME, BACKEND_QUALNAME) == ("ION", EXPECTED_QUALNAME)
    assert ion_vllm.__all__ == ["BACKEND_NAME", "BACKEND_QUALNAME", "register"]
    assert validation.BACKEND_NAME == registration.BACKEND_NAME == BACKEND_NAME


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert "ion" in eps, "pip install -e . did not register the vllm.general_plugins entry"
    assert eps["ion"].value == "ion_vllm:register"
    import ion_vllm

    assert eps["ion"].load() is ion_vllm.register


def test_plugins_register_ion_in_a_fresh_process(cpu_platform, tiny_model, tmp_path):
    """What a `vllm serve` engine or worker process does: the config arrives pickled and is
    unpickled *before* plugins load there (the backend must still be CUSTOM); then vLLM's
    plugin loader runs ``ion_vllm.register`` (ION resolves to the backend class).
    ``register`` is idempotent and cheap (no CUDA, no CuTe, no backend import) and keeps the
    enum's iteration."""
    cfg = engine_config_from_cli(["--model", tiny_model, "--attention-backend", "ION",
                                  "--skip-tokenizer-init", "--load-format", "dummy"])
    blob = tmp_path / "vllm_config.pkl"
    blob.write_bytes(pickle.dumps(cfg))
    res = run_python(f"""
        import pickle, sys
        import torch
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        members_before = list(AttentionBackendEnum)
        assert "ION" not in AttentionBackendEnum.__members__
        assert not AttentionBackendEnum.CUSTOM.is_overridden()
        cfg = pickle.loads(open({str(blob)!r}, "rb").read())
        backend = cfg.attention_config.backend
        assert backend is AttentionBackendEnum.CUSTOM, backend
        assert not backend.is_overridden()  # plugins not loaded yet in this process
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        assert AttentionBackendEnum["ION"] is backend is AttentionBackendEnum["CUSTOM"]
        import ion_vllm
        from ion_vllm.registration import is_registered
        ion_vllm.register()
        ion_vllm.register()
        assert is_registered()
        assert list(AttentionBackendEnum) == members_before, "iteration changed"
        assert "ION" in AttentionBackendEnum.__members__
        heavy = [m for m in ("cutlass", "cute_kernels", "ion_vllm.backend") if m in sys.modules]
        assert not heavy, heavy
        assert not torch.cuda.is_initialized()
        print(AttentionBackendEnum.CUSTOM.get_path())
    """)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.strip().splitlines()[-1] == EXPECTED_QUALNAME


# ----------------------------------------------------------------------------- CLI + config
@pytest.mark.parametrize("name", ["ION", "ion", "CUSTOM"])
def test_cli_attention_backend_resolves_to_ion(cpu_platform, tiny_model, name):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    cfg = engine_config_from_cli(["--model", tiny_model, "--attention-backend", name,
                                  "--skip-tokenizer-init", "--load-format", "dummy"])
    backend = cfg.attention_config.backend
    assert backend is AttentionBackendEnum.CUSTOM
    assert backend.get_path() == EXPECTED_QUALNAME
    from ion_vllm.backend import IonAttentionBackend

    assert backend.get_class() is IonAttentionBackend


def test_serve_parser_accepts_ion(cpu_platform, tiny_model):
    """The `vllm serve` argument parser (OpenAI server CLI) + AsyncEngineArgs."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["--model", tiny_model, "--attention-backend", "ION",
                              "--skip-tokenizer-init", "--load-format", "dummy"])
    cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert cfg.attention_config.backend is AttentionBackendEnum.CUSTOM
    assert cfg.attention_config.backend.get_path() == EXPECTED_QUALNAME


def test_unknown_backend_is_still_refused(cpu_platform, tiny_model):
    with pytest.raises(Exception) as err:
        engine_config_from_cli(["--model", tiny_model, "--attention-backend", "IONX",
                                "--skip-tokenizer-init", "--load-format", "dummy"])
    assert "Unknown attention backend" in str(err.value)
    assert "ION" in str(err.value)


def test_ion_logs_reach_vllms_handler(monkeypatch):
    """register() routes the ion_vllm loggers to vLLM's handler and level: the backend's
    INFO lines (its chosen path, every logged fallback) appear in vLLM's log, once each."""
    import logging

    from ion_vllm.registration import route_logs_to_vllm

    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    class Foreign(Keep):  # e.g. a test harness's capture handler found on the vllm logger
        def emit(self, record):
            got.append("foreign: " + record.getMessage())

    vllm_handler = Keep()
    vllm_handler.set_name("vllm")  # as vLLM's logging config names it
    vllm_logger, ion = logging.getLogger("vllm"), logging.getLogger("ion_vllm")
    monkeypatch.setattr(vllm_logger, "handlers", [vllm_handler, Foreign()])
    monkeypatch.setattr(vllm_logger, "level", logging.INFO)
    monkeypatch.setattr(ion, "handlers", [])
    monkeypatch.setattr(ion, "level", logging.NOTSET)
    logging.getLogger("ion_vllm.backend").info("before")
    assert got == []  # unrouted: vLLM's handler never sees it
    route_logs_to_vllm()
    route_logs_to_vllm()
    logging.getLogger("ion_vllm.backend").info("ION: fused KV writeback")
    logging.getLogger("ion_vllm.backend").debug("hidden at INFO")
    assert got == ["ION: fused KV writeback"]
