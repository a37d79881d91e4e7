"""Files we write get the mode a plain ``open()`` gives (``0o666 & ~umask``), not 0o600.

safetensors >= 0.8 (``save_file``) and ``tempfile.mkstemp`` create files of mode 0o600
([Note: file modes] in hf_cephalo/file_modes.py). Checked with ``os.stat`` on real saves under
umask 022 (every file 0o644) and, for the offline export and the profile cache, under 077 and
002 (0o600 / 0o664: the umask decides, the mode is not hard-coded): a 2-rank checkpoint with
optimizer state, the streamed ``save_pretrained``, a LoRA adapter, ``export_hf`` of the
checkpoint and a profile-cache entry.
"""

from __future__ import annotations

import contextlib
import os
import stat

import pytest
import torch

from hf_cephalo import file_modes
from tests.dist_utils import budget_s, run_ranks, test_timeout
from tests.models_fixtures import build

JOB_S = 45.0  # seconds of the 2-rank save job, measured (about 40 s under load 6 on 2 cores)
pytestmark = test_timeout(JOB_S)


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _modes(directory) -> dict[str, int]:
    """Permission bits of every file below ``directory`` (relative name -> mode)."""
    out = {}
    for dirpath, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, directory)] = stat.S_IMODE(os.stat(path).st_mode)
    return out


def test_default_file_mode_follows_the_umask(monkeypatch, tmp_path):
    for mask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664), (0o027, 0o640)):
        with umask(mask):
            assert file_modes.current_umask() == mask
            assert file_modes.default_file_mode() == mode
            path = tmp_path / f"f{mask:o}"
            path.write_bytes(b"")
            os.chmod(path, 0o600)
            file_modes.apply_default_mode(path)
            assert stat.S_IMODE(os.stat(path).st_mode) == mode
    # without /proc's Umask line: os.umask(0) and back, leaving the umask as it was
    monkeypatch.setattr(file_modes, "open", lambda *a, **k: (_ for _ in ()).throw(OSError),
                        raising=False)
    with umask(0o027):
        assert file_modes.current_umask() == 0o027
        assert os.umask(0o027) == 0o027  # restored by current_umask


def test_profile_cache_entry_mode(tmp_path):
    from hf_cephalo.profiles.cache import ProfileCache

    for mask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        with umask(mask):
            cache = ProfileCache(tmp_path / f"cache{mask:o}")
            cache._write("entry", {"x": 1})
        assert _modes(cache.root) == {"entry.json": mode}  # no temporary file left either


def _save_worker(rank, world_size, root):
    from peft import LoraConfig, get_peft_model

    from hf_cephalo.engine import CephaloEngine
    from hf_cephalo.engine import checkpoint as ckpt
    from hf_cephalo.engine.export import save_pretrained_streamed
    from hf_cephalo.engine.peft_save import save_peft_adapter
    from hf_cephalo.models import stage_model

    with umask(0o022):
        engine = CephaloEngine(stage_model(build("llama", seed=3)), [0.6, 0.4])
        opt = torch.optim.AdamW(engine.parameters())
        for p in engine.parameters():
            p.grad = torch.ones_like(p)
        opt.step()  # AdamW state in the checkpoint too
        ckpt.save_checkpoint(engine, os.path.join(root, "ckpt"), opt)
        save_pretrained_streamed(engine, os.path.join(root, "streamed"), max_shard_size="100KB")
        config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        peft = get_peft_model(build("llama", seed=3), config)
        lora = CephaloEngine(stage_model(peft), [0.5, 0.5])
        save_peft_adapter(lora, peft, os.path.join(root, "adapter"))


def test_saved_checkpoint_export_and_adapter_files_are_0644_under_umask_022(tmp_path):
    pytest.importorskip("peft")
    from hf_cephalo.engine.checkpoint import export_hf

    run_ranks(_save_worker, 2, str(tmp_path), timeout_s=budget_s(JOB_S))
    ckpt = _modes(tmp_path / "ckpt")
    assert {"cephalo_shard_rank0.safetensors", "cephalo_shard_rank1.safetensors",
            "cephalo_buffers.safetensors"} <= set(ckpt), ckpt
    streamed = _modes(tmp_path / "streamed")
    assert sum(n.endswith(".safetensors") for n in streamed) > 1, streamed  # sharded save
    adapter = _modes(tmp_path / "adapter")
    assert "adapter_model.safetensors" in adapter, adapter
    for modes in (ckpt, streamed, adapter):
        assert modes == {name: 0o644 for name in modes}
    for mask, mode in ((0o022, 0o644), (0o077, 0o600), (0o002, 0o664)):
        out = tmp_path / f"hf{mask:o}"
        with umask(mask):
            export_hf(str(tmp_path / "ckpt"), str(out))
        exported = _modes(out)
        assert "model.safetensors" in exported, exported
        assert exported == {name: mode for name in exported}
