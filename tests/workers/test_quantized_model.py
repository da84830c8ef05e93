"""Quantized serving end to end: ``quantization="int8"`` on a tiny random checkpoint, and a GGUF
file's Q8_0 / Q4_0 / Q4_1 blocks served as stored.

Lower precision changes logits, so the tests bound how much: the int8 model's log-probability
of each float32 greedy token (teacher-forced: the float32 tokens appended to the prompt and
scored as prompt logprobs by both engines) stays within ``LOGPROB_TOL`` of float32's; a GGUF
layer served from its blocks matches the float64 product with the float weight it replaces.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.checkpoints import make_checkpoint

from pagedserve import LLM, SamplingParams
from pagedserve.config import ConfigError, ModelConfig
from pagedserve.kernels.quant_linear import Int4Weight, Int8Weight
from pagedserve.parallel.state import ParallelState
from pagedserve.workers.errors import ModelLoadError
from pagedserve.workers.loader import load_model

# Measured on this AVX2 machine (init_std 0.2, so the logits are peaked), over 2 x 16 greedy
# tokens: int8 moves a token's log-probability by 0.13 at most (0.038 on average), the GGUF
# file's blocks by 0.066 (0.022); the bounds leave room for other CPUs' summation orders.
LOGPROB_TOL = 0.3
LOGPROB_MEAN_TOL = 0.08
PROMPTS = [[1, 5, 9, 200, 33, 17], [1, 7, 7, 7, 300, 12, 40, 41]]
STEPS = 16
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("q8") / "tiny-llama")


def _teacher_forced(path: Path, sequences: list[list[int]], prompt_lens: list[int],
                    **options: object) -> list[list[float]]:
    """Each sequence's log-probability of its own tokens after its prompt."""
    with LLM(str(path), backend="local", dtype="float32", num_gpu_blocks=64, **options) as llm:
        outs = llm.generate(sequences, SamplingParams(max_tokens=1, prompt_logprobs=0),
                            use_tqdm=False)
    return [
        [out.prompt_logprobs[p][seq[p]] for p in range(n, len(seq))]
        for out, seq, n in zip(outs, sequences, prompt_lens, strict=True)
    ]


def _greedy_sequences(path: Path) -> list[list[int]]:
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    with LLM(str(path), backend="local", dtype="float32", num_gpu_blocks=64,
             quantization="none") as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, outs, strict=True)]


def test_int8_logprobs_stay_near_float32(ckpt: Path) -> None:
    seqs = _greedy_sequences(ckpt)
    lens = [len(p) for p in PROMPTS]
    ref = _teacher_forced(ckpt, seqs, lens, quantization="none")
    got = _teacher_forced(ckpt, seqs, lens, quantization="int8")
    _check_close(ref, got)


def _check_close(ref: list[list[float]], got: list[list[float]]) -> None:
    d = [abs(a - b) for r, g in zip(ref, got, strict=True) for a, b in zip(r, g, strict=True)]
    assert len(d) == STEPS * len(PROMPTS)
    assert max(d) <= LOGPROB_TOL and sum(d) / len(d) <= LOGPROB_MEAN_TOL
    assert max(d) > 0.0  # the quantized path really ran: some logprob moved


def test_int8_replaces_the_linears_and_keeps_the_embedding(ckpt: Path) -> None:
    model, _, _ = load_model(ckpt, "float32", CPU, ParallelState(0, 1), quantization="int8")
    layer = model.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj):
        assert isinstance(lin.quant, Int8Weight) and lin.weight is None
        assert lin.quant.dynamic  # batched rows quantize their activations everywhere
        # the rotations that make that hold perplexity (workers/quantize.py): the stream's,
        # folded into the weights, and the down projection's own, online
        assert lin.quant.hadamard == (64 if lin is layer.mlp.down_proj else 0)
    assert (model.model.norm.weight == 1).all()  # the stream's rotation folded in, to the head
    head = model.lm_head.quant  # int8 too, its input rotated online; the embedding stays
    assert isinstance(head, Int8Weight) and head.dynamic and head.hadamard == 64
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_unknown_or_misplaced_quantization_is_refused(ckpt: Path) -> None:
    with pytest.raises(ConfigError, match="quantization") as info:
        ModelConfig(quantization="int3")
    assert info.value.field == "quantization"
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(ckpt, "float32", CPU, ParallelState(0, 1), quantization="gguf")


# -- GGUF ------------------------------------------------------------------------------------

TYPES = {  # one fused layer per encoding; ffn_down stays float32 in the file
    "attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_0",
    "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "token_embd": "Q8_0", "output": "Q8_0",
}
# int4 blocks as stored, bfloat16 activations and scales: a few 2**-8 of the output's scale;
# Q8_0 requantized per channel adds at most half a step (max|w| / 254) per weight.
GGUF_REL = 3e-2


@pytest.fixture(scope="module")
def converted(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gguf")
    from helpers.gguf_files import write_gguf_from_hf

    from pagedserve.workers.gguf_checkpoint import cached_gguf_checkpoint

    file = write_gguf_from_hf(ckpt, tmp_path_factory.mktemp("gguf") / "tiny-q.gguf", types=TYPES)
    return cached_gguf_checkpoint(file, root=tmp_path_factory.mktemp("cache"))


def test_blocks_decode_to_the_dequantized_checkpoint(converted: Path) -> None:
    from safetensors.torch import load_file

    from pagedserve.workers.gguf_blocks import read_blocks

    blocks = read_blocks(converted)
    dequantized = load_file(converted / "model.safetensors")  # transformers' dequantization
    assert blocks is not None
    kinds = {name.split(".")[-2]: b.kind for name, b in blocks.items()}
    assert kinds == {"q_proj": "Q4_1", "k_proj": "Q4_1", "v_proj": "Q4_1", "o_proj": "Q4_0",
                     "gate_proj": "Q8_0", "up_proj": "Q8_0"}  # embeddings, head: not kept
    for name, b in blocks.items():
        want = dequantized[name].double()  # Q/K un-permuted by transformers: rows must agree
        assert (b.dequantize() - want).abs().max() <= 1e-6 * want.abs().max(), name


def test_gguf_layers_serve_their_blocks(converted: Path) -> None:
    state = ParallelState(0, 1)
    ref, _, _ = load_model(converted, "float32", CPU, state, quantization="none")
    got, _, _ = load_model(converted, "float32", CPU, state)  # auto: the blocks
    g = torch.Generator().manual_seed(0)
    for i, (lr, lg) in enumerate(zip(ref.model.layers, got.model.layers, strict=True)):
        pairs = {
            "qkv": (lr.self_attn.qkv_proj, lg.self_attn.qkv_proj, Int4Weight),
            "o": (lr.self_attn.o_proj, lg.self_attn.o_proj, Int4Weight),
            "gate_up": (lr.mlp.gate_up_proj, lg.mlp.gate_up_proj, Int8Weight),
            "down": (lr.mlp.down_proj, lg.mlp.down_proj, type(None)),
        }
        for name, (a, b, kind) in pairs.items():
            assert isinstance(b.quant, kind), (i, name)
            w = a.weight if a.packed is None else None
            assert w is not None, "the tiny layers stay unpacked"
            x = torch.randn(5, w.shape[1], generator=g)
            want = torch.nn.functional.linear(x.double(), w.double())
            err = (b(x).double() - want).abs().max() / want.abs().max()
            assert err <= (GGUF_REL if kind is not type(None) else 1e-6), (i, name)
    assert got.lm_head.quant is None
    assert torch.equal(got.model.embed_tokens.weight, ref.model.embed_tokens.weight)


@pytest.mark.parametrize("rank", [0, 1])
def test_gguf_blocks_slice_like_the_weights_under_tensor_parallelism(converted: Path,
                                                                     rank: int) -> None:
    # Loading needs no process group; the rank's matmul is checked without the all-reduce.
    from pagedserve.kernels.quant_linear import quantized_linear

    state = ParallelState(rank, 2)
    ref, _, _ = load_model(converted, "float32", CPU, state, quantization="none")
    got, _, _ = load_model(converted, "float32", CPU, state)
    g = torch.Generator().manual_seed(rank)
    lr, lg = ref.model.layers[1], got.model.layers[1]
    for a, b, kind in ((lr.self_attn.qkv_proj, lg.self_attn.qkv_proj, Int4Weight),
                       (lr.self_attn.o_proj, lg.self_attn.o_proj, Int4Weight),
                       (lr.mlp.gate_up_proj, lg.mlp.gate_up_proj, Int8Weight)):
        assert isinstance(b.quant, kind)
        x = torch.randn(3, a.weight.shape[1], generator=g)
        want = torch.nn.functional.linear(x.double(), a.weight.double())  # the rank's slice
        err = (quantized_linear(x, b.quant).double() - want).abs().max() / want.abs().max()
        assert err <= GGUF_REL


def test_gguf_serves_through_llm_and_none_keeps_the_float_path(converted: Path) -> None:
    seqs = _greedy_sequences(converted)
    lens = [len(p) for p in PROMPTS]
    ref = _teacher_forced(converted, seqs, lens, quantization="none")
    got = _teacher_forced(converted, seqs, lens)  # the default: the blocks
    _check_close(ref, got)


def test_serve_flag_reaches_the_config() -> None:
    import argparse

    from pagedserve.config import from_flat
    from pagedserve.serving.cli.engine_args import add_engine_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--quantization", "int8"])
    assert from_flat(model="x", **engine_options(args)).model.quantization == "int8"
    assert parser.parse_args([]).quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("source", ["int8", "gguf"])
def test_quantized_layers_take_the_compiled_call_bit_for_bit(source, dtype, ckpt: Path,
                                                              converted: Path) -> None:
    """The compiled whole-layer call runs the quantized kernels the modules run (int8 weight-only
    at a few rows and dynamic above; the GGUF file's Q4_0, Q4_1 and Q8_0 blocks beside a plain
    projection), with the same result."""
    from helpers.one_step import forward_both

    from pagedserve.kernels.cpu import cpu_ops

    if cpu_ops() is None:
        pytest.skip("no compiled CPU kernels")
    path, quantization = (ckpt, "int8") if source == "int8" else (converted, "auto")
    model, arch, _ = load_model(path, dtype, CPU, ParallelState(0, 1), quantization=quantization)
    assert all(w is not None for w in model.model.fused)
    for modules, compiled in forward_both(model, arch.vocab_size):
        assert torch.equal(modules, compiled)
