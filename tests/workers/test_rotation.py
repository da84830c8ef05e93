"""The rotations of ``workers/rotation.py`` keep the model's own function: a model with them
folded in gives the logits of the model without them (from a KV cache whose values it wrote
rotated), on both the module path and the compiled layers, for every Llama-family variant;
its hidden states are the unrotated model's, rotated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.checkpoints import KINDS, make_checkpoint
from helpers.one_step import forward_both

from pagedserve.kernels.quant_linear import hadamard_block, hadamard_rows_ref
from pagedserve.parallel.state import ParallelState
from pagedserve.workers import loader
from pagedserve.workers.rotation import random_orthogonal, rotate_residual_stream


def test_the_rotation_is_orthogonal_and_seeded() -> None:
    q = random_orthogonal(48, seed=3)
    assert q.dtype == torch.float64
    assert torch.allclose(q @ q.t(), torch.eye(48, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, random_orthogonal(48, seed=3))
    assert not torch.allclose(q, random_orthogonal(48, seed=4))


def _load(ckpt: Path, rotate: bool, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """The float32 model, its norm weights drawn away from ones (so that their fold matters),
    rotated or not between loading and packing, where quantization would run."""

    def prepare(model: torch.nn.Module, mode: str, model_dir: object) -> None:
        g = torch.Generator().manual_seed(0)
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.data.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
        if rotate:
            rotate_residual_stream(model)

    monkeypatch.setattr(loader, "quantize_model", prepare)
    return loader.load_model(ckpt, "float32", torch.device("cpu"), ParallelState(0, 1),
                             quantization="none")


@pytest.mark.parametrize("kind", KINDS)
def test_a_rotated_model_computes_the_same_hidden_states(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = make_checkpoint(kind, tmp_path / kind)
    model, arch, _ = _load(ckpt, False, monkeypatch)
    rotated, _, _ = _load(ckpt, True, monkeypatch)
    for norm in (rotated.model.layers[0].input_layernorm, rotated.model.norm):
        assert (norm.weight == 1).all()  # its weight moved into the QKV projection, the head
    assert not rotated.lm_head.tied  # the head folds the final norm in, the embedding does not
    # the cached context as the rotated model writes it: each value head rotated
    d = arch.head_dim
    h = hadamard_rows_ref(torch.eye(d, dtype=torch.float64), hadamard_block(d, cap=d)).float()

    def rotated_values(cache: torch.Tensor) -> torch.Tensor:
        out = cache.clone()
        out[:, 1] = cache[:, 1] @ h
        return out

    want = forward_both(model, arch.vocab_size)
    got = forward_both(rotated, arch.vocab_size, rotated_values)
    q = random_orthogonal(arch.hidden_size).float()
    g_final = model.model.norm.weight
    for (w_mod, w_comp), (g_mod, g_comp) in zip(want, got, strict=True):
        for a, b in ((w_mod, g_mod), (w_comp, g_comp)):
            assert ((a / g_final @ q - b).abs().max() / b.abs().max()).item() <= 1e-4
            with torch.inference_mode():
                a, b = model.compute_logits(a), rotated.compute_logits(b)
            assert ((a - b).abs().max() / a.abs().max()).item() <= 1e-4
