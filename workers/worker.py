"""The worker: one rank's device, model shard, KV pool and step loop.

A plain class, testable in-process; a Ray actor wraps it. Lifecycle::

    w = Worker(config, rank)           # tp > 1: also distributed_init_method=, or the two calls
                                       # port = w0.open_store(); wi.init_distributed(host, port)
    report = w.load_model()            # -> WorkerReport (KV needs per layer, KV byte budget)
    w.init_kv_cache(layout)            # the controller's KVCacheLayout; allocates the KV pool
    out = w.execute(scheduler_output)  # every step
    w.shutdown()

Every public method is also an operation the engine can call on all ranks at once, by name
(``Executor.collective_rpc``): a new worker operation is a method here and nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from pagedserve.config import ConfigError, EngineConfig
from pagedserve.kernels import CPLayout
from pagedserve.messages import (
    KVCacheLayout,
    LayerKVSpec,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerReport,
)
from pagedserve.parallel.netif import bind_collectives
from pagedserve.parallel.state import (
    ParallelState,
    destroy_parallel_state,
    init_dcp_state,
    join_process_group,
    open_store,
)
from pagedserve.workers.block_table import BlockTable, MultiGroupBlockTable
from pagedserve.workers.context import AttentionMetadata, ForwardContext, forward_context
from pagedserve.workers.draft_model import DraftModel
from pagedserve.workers.errors import ModelLoadError
from pagedserve.workers.input_batch import InputBatch
from pagedserve.workers.kv_dtype import log_kv_cache_dtype, resolve_kv_cache_dtype
from pagedserve.workers.kv_pool import KVPool
from pagedserve.workers.layers.attention import PagedAttention
from pagedserve.workers.loader import (
    load_model,
    read_eos_token_ids,
    read_hf_config,
    read_model_arch,
)
from pagedserve.workers.model_runner import ModelRunner
from pagedserve.workers.models.arch import ModelArch
from pagedserve.workers.sampler import Sampler
from pagedserve.workers.warmup import warm_up

CPU_DEFAULT_KV_BYTES = 1 << 30


def pick_device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


class Worker:
    def __init__(
        self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None
    ) -> None:
        self.config = config
        self.rank = rank
        self.device = pick_device(rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.parallel = ParallelState(rank, config.parallel.tensor_parallel_size)
        self.dcp = ParallelState()
        self._store: Any = None
        self._joined = self.parallel.size == 1
        if distributed_init_method is not None or self._joined:
            self.init_distributed(init_method=distributed_init_method)
        self.model: nn.Module | None = None
        self.draft_model: nn.Module | None = None  # speculative_config method draft_model
        self.arch: ModelArch | None = None
        self.dtype = torch.float32
        self.kv_dtype = torch.float32  # the KV cache's own (cache.kv_cache_dtype)
        self.max_model_len = 0
        self.eos_token_ids: tuple[int, ...] = ()
        self.runner: ModelRunner | None = None

    # -- process group (tensor parallelism > 1 only) ------------------------------------------

    def open_store(self, host: str = "0.0.0.0") -> int:
        """Rank 0: open the rendezvous store on a free port and return the port."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 opens the rendezvous store")
        self._store = open_store(self.parallel.size, host)
        return int(self._store.port)

    def init_distributed(
        self,
        master_addr: str | None = None,
        master_port: int | None = None,
        init_method: str | None = None,
        *,
        bind_address: str | None = None,
        node: str = "?",
    ) -> None:
        """Join the TP process group (all ranks at once) and form the DCP subgroups.

        Rank 0 uses the store from ``open_store``; the others pass its address and port.
        Alternatively every rank passes the same ``init_method`` (``tcp://host:port``).
        ``bind_address`` (this rank's node IP, or 127.0.0.1 for a one-host group) picks the
        interface gloo and NCCL bind to, unless the user set ``GLOO_SOCKET_IFNAME`` /
        ``NCCL_SOCKET_IFNAME``; ``node`` names this node in the error when none carries it.
        """
        par = self.config.parallel
        if bind_address is not None and par.tensor_parallel_size > 1:
            bind_collectives(bind_address, node=node)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        master = None if master_addr is None or master_port is None else (master_addr, master_port)
        self.parallel = join_process_group(
            self.rank,
            par.tensor_parallel_size,
            backend,
            init_method=init_method,
            store=self._store,
            master=master,
        )
        # DCP groups are consecutive TP ranks; a rank's position in its group is its CP rank.
        self.dcp = init_dcp_state(self.parallel, par.decode_context_parallel_size)
        self._joined = True

    # -- model ---------------------------------------------------------------------------------

    def load_model(self) -> WorkerReport:
        if not self._joined:
            raise RuntimeError("tensor_parallel_size > 1: call init_distributed() first")
        mc = self.config.model
        model_dir = mc.model
        if not model_dir:
            from pagedserve.workers.demo import demo_checkpoint_dir

            model_dir = str(demo_checkpoint_dir())
        torch.manual_seed(mc.seed)
        self.model, self.arch, self.dtype = load_model(
            model_dir, mc.dtype, self.device, self.parallel, mc.max_model_len, self.dcp,
            mc.quantization,
        )
        self._check_dcp(self.arch)
        self.eos_token_ids = read_eos_token_ids(model_dir, read_hf_config(model_dir))
        self.max_model_len = mc.max_model_len or self.arch.max_position_embeddings
        self.kv_dtype = resolve_kv_cache_dtype(self.config.cache.kv_cache_dtype, self.dtype)
        if self.rank == 0:
            log_kv_cache_dtype(self.kv_dtype, self.dtype, self.device)
        if self.config.speculative.method == "draft_model":
            self.draft_model = self._load_draft_model()
        # The block count follows the KV dtype: the controller divides the byte budget by it.
        dtype_bytes = torch.empty((), dtype=self.kv_dtype).element_size()

        def specs(layers: list[PagedAttention]) -> list[LayerKVSpec]:
            return [LayerKVSpec(layer.num_kv_heads, layer.head_dim, dtype_bytes,
                                layer.sliding_window) for layer in layers]

        return WorkerReport(
            layer_specs=specs(self._attention_layers()),
            available_kv_bytes=self._kv_budget(),
            vocab_size=self.arch.vocab_size,
            max_model_len=self.max_model_len,
            device=str(self.device),
            draft_layer_specs=specs(self._draft_layers()),
        )

    def _load_draft_model(self) -> nn.Module:
        """The draft model of speculative decoding: loaded like the target (its dtype, this
        rank's shard of it), after checking that it shares the target's vocabulary and covers
        every position the target may serve."""
        assert self.arch is not None
        path = self.config.speculative.model or ""
        field = "speculative_config.model"
        try:
            arch = read_model_arch(read_hf_config(path))
        except ModelLoadError as exc:
            raise ConfigError(field, f"cannot load the draft model: {exc}") from exc
        if arch.vocab_size != self.arch.vocab_size:
            raise ConfigError(field, f"the draft model {path} has a vocabulary of "
                              f"{arch.vocab_size} tokens, the target {self.arch.vocab_size}: "
                              "a draft must share the target's tokenizer")
        if arch.max_position_embeddings < self.max_model_len:
            raise ConfigError(field, f"the draft model {path} covers "
                              f"{arch.max_position_embeddings} positions, fewer than "
                              f"max_model_len={self.max_model_len}; lower max_model_len")
        dtype = str(self.dtype).removeprefix("torch.")
        try:
            model, _, _ = load_model(path, dtype, self.device, self.parallel)
        except (ModelLoadError, ValueError) as exc:  # a broken file, heads tp cannot split
            raise ConfigError(field, f"cannot load the draft model: {exc}") from exc
        return model

    def _draft_layers(self) -> list[PagedAttention]:
        if self.draft_model is None:
            return []
        return self.draft_model.attention_layers()  # type: ignore[operator,no-any-return]

    def _check_dcp(self, arch: ModelArch) -> None:
        """DCP shards tokens over ranks that would otherwise hold the same replicated KV heads."""
        tp, dcp = self.parallel.size, self.dcp.size
        if dcp > 1 and (tp <= arch.num_kv_heads or (tp // arch.num_kv_heads) % dcp):
            raise ValueError(
                f"decode_context_parallel_size={dcp} needs replicated KV heads shared by the "
                f"whole DCP group: tensor_parallel_size ({tp}) / num_kv_heads "
                f"({arch.num_kv_heads}) must be a multiple of {dcp}"
            )

    def _attention_layers(self) -> list[PagedAttention]:
        assert self.model is not None, "load_model() first"
        return self.model.attention_layers()  # type: ignore[operator,no-any-return]

    def _kv_budget(self) -> int:
        """Bytes this rank may spend on KV: the configured budget, else measured, else 1 GiB."""
        cc = self.config.cache
        if cc.kv_cache_memory_bytes is not None:
            return cc.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_BYTES
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # Allowed = utilisation share of the device, minus what is used now (weights, other
        # processes, the CUDA context), minus the activation peak of a full-budget step.
        budget = int(total * cc.gpu_memory_utilization) - (total - free) - activation_peak
        return max(budget, 0)

    def _profile_run(self) -> None:
        """One forward pass over ``max_num_batched_tokens`` tokens with a throwaway KV pool."""
        bs = self.config.cache.block_size
        tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        nblocks = math.ceil(tokens / bs) + 1
        layers, draft = self._attention_layers(), self._draft_layers()
        pool = KVPool(
            KVCacheLayout(nblocks, bs, [list(range(len(layers)))], draft_groups=[0] * len(draft)),
            layers, self.kv_dtype, self.device, draft,
        )
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.arange(bs, bs + tokens, device=dev),
            block_table=torch.arange(1, nblocks, dtype=torch.int32, device=dev)[None],
            seq_lens=torch.tensor([tokens], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=dev),
        )
        assert self.model is not None
        with torch.inference_mode(), forward_context(ForwardContext([md])):
            hidden = self.model(
                torch.zeros(tokens, dtype=torch.long, device=dev), torch.arange(tokens, device=dev)
            )
            self.model.compute_logits(hidden[-self.config.scheduler.max_num_seqs :])
            if self.draft_model is not None:  # it runs after the target, over the same tokens
                del hidden
                hidden = self.draft_model(
                    torch.zeros(tokens, dtype=torch.long, device=dev),
                    torch.arange(tokens, device=dev),
                )
                self.draft_model.compute_logits(hidden[-self.config.scheduler.max_num_seqs :])
        for layer in (*layers, *draft):
            layer.kv_cache = None
        del pool, hidden

    # -- KV cache --------------------------------------------------------------------------------

    def init_kv_cache(self, layout: KVCacheLayout) -> None:
        """Allocate the KV pool for ``layout`` and build the batch state around it.

        ``layout.block_size`` is the per-rank block size B (the KV tensors' block dim). Under
        decode context parallelism (W ranks) the controller's virtual block size B*W is also
        accepted when it equals ``cache.block_size * W``.
        """
        assert self.model is not None and self.arch is not None, "load_model() first"
        cp = CPLayout(self.dcp.rank, self.dcp.size, self.config.parallel.dcp_interleave)
        if cp.size > 1 and layout.block_size == self.config.cache.block_size * cp.size:
            layout = dataclasses.replace(layout, block_size=self.config.cache.block_size)
        layers = self._attention_layers()
        pool = KVPool(layout, layers, self.kv_dtype, self.device, self._draft_layers())
        width = math.ceil(self.max_model_len / (layout.block_size * cp.size))
        max_reqs = self.config.scheduler.max_num_seqs
        tables = MultiGroupBlockTable(
            [
                BlockTable(max_reqs, width, layout.block_size, self.device, cp=cp)
                for _ in layout.groups
            ]
        )
        batch = InputBatch(max_reqs, self.max_model_len, self.arch.vocab_size, tables, self.device)
        sampler = Sampler(self.device, self.config.model.seed)
        draft = None
        if self.draft_model is not None:
            draft = DraftModel(self.draft_model, tables, layout.draft_groups[0],
                               self.config.speculative.num_speculative_tokens, self.device, cp)
        self.runner = ModelRunner(
            self.model,
            batch,
            pool,
            sampler,
            self.device,
            cp,
            self.eos_token_ids,
            draft,
        )
        warm_up(self.runner, len(layout.groups), layout.block_size * cp.size, self.max_model_len)
        # After the warm-up, whose dummy tokens must not set the scales: the first real
        # prefill does.
        if self.config.cache.calculate_kv_scales:
            pool.calibrate_kv_scales()

    def kv_scales(self) -> list[tuple[float, float]]:
        """Per attention layer ``(k_scale, v_scale)`` of the KV pool (1.0 unless fp8 scales
        were calibrated)."""
        if self.runner is None:
            raise RuntimeError("init_kv_cache() must run before kv_scales()")
        return self.runner.kv_pool.kv_scales()

    # -- steps -----------------------------------------------------------------------------------

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.runner is None:
            raise RuntimeError("init_kv_cache() must run before execute()")
        return self.runner.execute(scheduler_output)

    def rank_info(self) -> dict[str, Any]:
        """Where this rank stands: its tensor- and context-parallel ranks, device, KV pool."""
        pool = self.runner.kv_pool.layout if self.runner is not None else None
        return {
            "rank": self.rank,
            "tp": [self.parallel.rank, self.parallel.size],
            "dcp": [self.dcp.rank, self.dcp.size],
            "device": str(self.device),
            "num_kv_blocks": pool.num_blocks if pool is not None else 0,
        }

    def shutdown(self) -> None:
        if self.runner is not None:
            for layer in (*self._attention_layers(), *self._draft_layers()):
                layer.kv_cache = None
        self.runner = None
        self.model = self.draft_model = None
        destroy_parallel_state(self.parallel)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
