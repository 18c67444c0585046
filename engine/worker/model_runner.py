"""Scheduler output -> flat tensors -> model -> logits of the rows that sample -> sampler.

Owns the model, the KV cache and the sampler of one (tensor-parallel rank of an)
engine. Knows nothing about requests, text or asyncio.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.executor.parallel_state import get_tp_size
from engine.worker.forward_context import AttentionMetadata, set_forward_context, to_device
from engine.loader.gguf_config import gguf_source
from engine.loader.kv_scales import layer_kv_scales, read_kv_scales
from engine.worker.host_kv_cache import HostKVCache, host_kv_blocks
from engine.worker.kv_cache import allocate_kv_tensor
from engine.layers.attention import Attention
from engine.layers.cpu_fused_layer import bind_fused_decoder_layers
from engine.layers.cpu_gemm import pack_module_weight
from engine.layers.embed_head import ParallelLMHead
from engine.layers.linear import LinearBase
from engine.layers.quantization import (UnquantizedLinearMethod, get_quantization_config, quantize_linear_layers,
                                        quantized_build)
from engine.loader.weights import load_weights
from engine.math_utils import cdiv
from engine.models import get_model_class
from engine.core.kv_cache_groups import group_num_blocks, kv_cache_groups, split_kv_budget
from engine.core.messages import ModelInput, ModelRunnerOutput, SampleLogprobs, SchedulerOutput
from engine.worker.rejection_sampler import RejectionSampler, VerifiedTokens
from engine.worker.sampler import SampledTokens, Sampler, compute_prompt_logprobs
from engine.core.sequence import Sequence

logger = logging.getLogger(__name__)

class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path,
                 eos_token_ids: list[int]):
        assert config.is_resolved, "ModelRunner reads a resolved config: EngineConfig.resolve(model_config)"
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        # "auto": the model's dtype; "fp8" / "fp8_e4m3": e4m3 with per-layer scales (kernels/fp8_kv.py).
        self.kv_cache_dtype = self.dtype if config.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        self.attention_backend = config.attention_backend
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        self.model = self._build_model(model_path)
        # Adapter slots before the KV cache is sized: they are part of what the device holds.
        self.lora_manager = self._make_lora_manager()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # The runner owns the backend choice, as it owns the KV cache: model constructors never see it.
        fp8_kv = self.kv_cache_dtype == torch.float8_e4m3fn
        for layer in self.attn_layers:
            layer.set_backend(self.attention_backend, fp8_kv)
        if fp8_kv:
            self._set_kv_scales(model_path)
        self.kv_groups = kv_cache_groups(model_config.layer_types, model_config.sliding_window,
                                         len(self.attn_layers))
        for g, group in enumerate(self.kv_groups):
            for i in group.layer_indices:
                assert self.attn_layers[i].sliding_window == group.sliding_window, (i, group)
                self.attn_layers[i].kv_group = g
        self.sampler = Sampler(eos_token_ids=eos_token_ids, seed=config.seed, device=self.device)
        self.rejection_sampler = RejectionSampler(self.sampler)  # steps with draft tokens (speculation)
        # Every TP rank must hold the same number of blocks: take the smallest any rank can afford.
        # num_kv_blocks is the first KV cache group's pool; the others follow from it (kv_cache_groups.py).
        self.num_kv_blocks = _min_over_ranks(self._determine_num_kv_blocks(), self.device)
        self._allocate_kv_cache(self._group_num_block_ids(self.num_kv_blocks))
        if self.device.type == "cpu" and self.lora_manager is None:
            bind_fused_decoder_layers(self.model, self.dtype)  # INT8 W8A8 layers: one C call each
        self.host_kv_cache = self._make_host_kv_cache()  # None with kv_offload_gb=0
        self.num_host_kv_blocks = 0 if self.host_kv_cache is None else self.host_kv_cache.num_host_blocks
        self.graph_runner = self._maybe_capture_cuda_graphs()
        # The last sampled step's tokens on the device, and each sampled sequence's row in them.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[int, int] = {}

    # -- setup ---------------------------------------------------------------
    def _build_model(self, model_path: Path) -> torch.nn.Module:
        cls = get_model_class(self.model_config.architecture)
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = self._construct(cls)
        finally:
            torch.set_default_dtype(prev_dtype)
        gguf_file = gguf_source(model_path)  # a GGUF's HF view links the weights' file
        if gguf_file is not None:
            from engine.loader.gguf_loader import load_gguf_weights  # the gguf package only when needed

            load_gguf_weights(model, gguf_file)
        else:
            load_weights(model, model_path)
        if self.device.type == "cpu":
            _pack_weights_for_cpu(model)
        return model.eval()

    def _make_lora_manager(self):
        if not self.config.enable_lora:
            return None
        from engine.lora.worker_manager import LoRAModelManager

        return LoRAModelManager(self.model, self.config, self.model_config)

    def _construct(self, cls) -> torch.nn.Module:
        if self.config.quantization is None:
            return cls(self.model_config)
        quant_config = get_quantization_config(self.config.quantization,
                                               self.model_config.hf_config.get("quantization_config"))
        with quantized_build():
            model = cls(self.model_config)
        quantize_linear_layers(model, quant_config)
        return model

    def _set_kv_scales(self, model_path: Path) -> None:
        """Each attention's k_scale / v_scale: the checkpoint's (engine/loader/kv_scales.py), else 1.0."""
        scales = {} if gguf_source(model_path) is not None else read_kv_scales(model_path)
        if not scales:
            logger.warning("kv_cache_dtype=%s: the checkpoint has no k_scale/v_scale, using 1.0 "
                           "(K/V values past 448 saturate)", self.config.kv_cache_dtype)
        for name, layer in self.model.named_modules():
            if isinstance(layer, Attention):
                # Our Attention sits one module below the checkpoint's self_attn ("...self_attn.attn").
                k, v = layer_kv_scales(scales, name.rsplit(".", 1)[0])
                layer.k_scale = torch.tensor([k], dtype=torch.float32, device=self.device)
                layer.v_scale = torch.tensor([v], dtype=torch.float32, device=self.device)

    def _kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        attn = self.attn_layers[0]
        return (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of every layer's K and V cache tensors, all groups together."""
        return sum(t.numel() * t.element_size() for a in self.attn_layers for t in (a.k_cache, a.v_cache))

    def _bytes_per_layer_block(self) -> int:
        return 2 * math.prod(self._kv_cache_shape(1)) * self.kv_cache_dtype.itemsize

    def _group_num_block_ids(self, num_kv_blocks: int) -> list[int]:
        """Rows of each group's cache tensors: its usable blocks, plus a sliding pool's null block."""
        c = self.config
        sizes = group_num_blocks(self.kv_groups, num_kv_blocks, c.max_num_seqs, c.max_num_batched_tokens,
                                 self.block_size)
        return [n + (g.sliding_window is not None) for g, n in zip(self.kv_groups, sizes)]

    def _determine_num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        # Enough for every sequence at full length; more would only feed the prefix cache.
        cap = self.config.max_num_seqs * cdiv(self.config.max_model_len, self.block_size)
        if self.device.type == "cpu":
            budget = int(self.config.cpu_kv_cache_gb * 2**30)
        else:
            budget = self._profile_free_gpu_memory()
        c = self.config
        num_blocks = min(cap, split_kv_budget(self.kv_groups, budget, self._bytes_per_layer_block(),
                                              c.max_num_seqs, c.max_num_batched_tokens, self.block_size))
        if num_blocks < 1:
            raise ValueError(f"no room for a single KV block (budget {budget} bytes, "
                             f"{self._bytes_per_layer_block() * len(self.attn_layers)} bytes per block "
                             f"of every layer); raise the memory budget")
        return num_blocks

    def _make_host_kv_cache(self) -> HostKVCache | None:
        if not self.config.kv_offload_gb:
            return None
        bytes_per_block = self._bytes_per_layer_block() * len(self.attn_layers)
        num_blocks = _min_over_ranks(host_kv_blocks(self.config.kv_offload_gb, get_tp_size(), bytes_per_block),
                                     self.device)
        if num_blocks < 1:
            raise ValueError(f"kv_offload_gb={self.config.kv_offload_gb} holds no KV block ({bytes_per_block} bytes "
                             f"per block of every layer, per TP rank); raise it, or set 0 to turn the host tier off")
        return HostKVCache(self.attn_layers, num_blocks, self.device)

    def _maybe_capture_cuda_graphs(self):
        # Graphs need shape-static, sync-free kernels: the Triton backend on CUDA.
        if self.device.type != "cuda" or self.config.enforce_eager or self.attention_backend != "triton":
            return None
        from engine.worker.cuda_graph import CUDAGraphRunner
        runner = CUDAGraphRunner(self.model, self.config.max_num_seqs, self.config.max_model_len,
                                 self.block_size, self.device, num_kv_groups=len(self.kv_groups),
                                 max_loras=0 if self.lora_manager is None else self.config.max_loras)
        runner.capture()
        return runner

    @torch.inference_mode()
    def _profile_free_gpu_memory(self) -> int:
        """Run the largest step once (no KV cache yet) and return what is left for the cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._allocate_kv_cache([1] * len(self.kv_groups))
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, dtype=torch.long, device=self.device)
        meta = self._dummy_prefill_metadata(n)
        with set_forward_context(meta):
            hidden = self.model(ids, pos)
            self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs):])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak - used_by_others
        logger.info("KV cache budget %.2f GiB (peak activation %.2f GiB)", budget / 2**30, peak / 2**30)
        return max(budget, 0)

    def _dummy_prefill_metadata(self, n: int) -> AttentionMetadata:
        # One sequence writing to slot -1 (skipped) and reading block 0 only for causal context.
        dev = self.device
        slots = torch.full((n,), -1, dtype=torch.long, device=dev)
        tables = torch.zeros((1, cdiv(n, self.block_size)), dtype=torch.int32, device=dev)
        num_extra = len(self.kv_groups) - 1
        return AttentionMetadata(
            slot_mapping=slots, block_tables=tables,
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
            max_seqlen_q=n, max_seqlen_k=n, seq_lens_cpu=[n], query_lens_cpu=[n],
            group_slot_mappings=[slots] * num_extra, group_block_tables=[tables] * num_extra)

    def _allocate_kv_cache(self, group_num_block_ids: list[int]) -> None:
        # Zero-filled: padded key positions are masked, but 0 * NaN garbage would still poison a row.
        # On CPU the zero pages are the kernel's, made resident only when written (engine/worker/kv_cache.py).
        for layer in self.attn_layers:
            shape = self._kv_cache_shape(group_num_block_ids[layer.kv_group])
            layer.k_cache = allocate_kv_tensor(shape, self.kv_cache_dtype, self.device)
            layer.v_cache = allocate_kv_tensor(shape, self.kv_cache_dtype, self.device)

    # -- one step ------------------------------------------------------------
    # A step is collect(sample(forward(...))), called apart so steps can overlap: step N+1's
    # forward is launched before step N's tokens are read back (collect).
    @torch.inference_mode()
    def forward(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Launch the forward; the handle holds its logits (on the device)."""
        return StepHandle(scheduler_output, self.run_model(self.prepare_inputs(scheduler_output)))

    @torch.inference_mode()
    def sample(self, handle: StepHandle, allowed_token_bitmask=None) -> StepHandle:
        """Launch sampling and the copy of its tokens to the host; the tokens also stay on the
        device, where the next step's forward takes the input ids of its decodes from."""
        so, logits = handle.scheduler_output, handle.logits
        seqs = so.sampled_seqs
        num_sample_rows = len(seqs) + so.num_spec_tokens
        if logits is not None and logits.shape[0] > num_sample_rows:  # the rows after the sampled ones
            handle.prompt_logprobs = self._prompt_logprobs(logits[num_sample_rows:], so)
            logits = logits[:num_sample_rows]
        handle.logits = None  # [rows, vocab]: not kept alive past sampling
        if logits is None or not seqs:
            return handle
        if allowed_token_bitmask is not None:
            allowed_token_bitmask = allowed_token_bitmask.to(self.device, non_blocking=True)
        if so.spec_token_ids:
            drafts = [so.spec_token_ids.get(seq.seq_id, []) for seq in seqs]
            handle.sampled = self.rejection_sampler(logits, seqs, drafts, allowed_token_bitmask,
                                                    so.spec_draft_probs)
        else:
            handle.sampled = self.sampler.sample(logits, seqs, allowed_token_bitmask)
        handle.sampled.start_copy()
        self._prev_sampled = handle.sampled.token_ids
        self._prev_rows = {seq.seq_id: i for i, seq in enumerate(seqs)}
        return handle

    @staticmethod
    def collect(handle: StepHandle) -> ModelRunnerOutput:
        """Wait for the step's tokens on the host."""
        if handle.sampled is None:
            return ModelRunnerOutput(sampled_token_ids=[], prompt_logprobs=handle.prompt_logprobs)
        return handle.sampled.to_runner_output(handle.prompt_logprobs)

    @torch.inference_mode()
    def run_model(self, mi: ModelInput) -> torch.Tensor | None:
        """Forward over the flat batch; logits [num_sample_rows, vocab] (every TP rank runs this)."""
        if mi.blocks_to_swap_out or mi.blocks_to_swap_in:  # the host KV tier's copies come first
            self.host_kv_cache.swap(mi.blocks_to_swap_out, mi.blocks_to_swap_in)
        input_ids = self._input_ids(mi)
        if self.graph_runner is not None and self.graph_runner.can_run(mi):
            hidden = self.graph_runner.run(mi, input_ids, self._lora_graph_rows(mi))
        else:
            hidden = self._eager_forward(mi, input_ids)
        if mi.prompt_logprob_rows:
            # [num_sample_rows + num_prompt_logprob_rows, vocab], in that order: only the rows that are
            # scored, never the whole chunk's (at most max_num_batched_tokens rows).
            rows = to_device(mi.sample_rows + mi.prompt_logprob_rows, torch.long, self.device)
            return self.model.compute_logits(hidden[rows]).float()
        if not mi.sample_rows:
            return None
        if len(mi.sample_rows) < hidden.shape[0]:
            hidden = hidden[to_device(mi.sample_rows, torch.long, self.device)]
        # else every row samples (rows are increasing, so they are 0 .. n-1): no gather copy
        return self.model.compute_logits(hidden).float()

    def _input_ids(self, mi: ModelInput) -> torch.Tensor:
        """[num_tokens] on the device; decodes of a token still on the device read it from there."""
        input_ids = to_device(mi.input_ids, torch.long, self.device)
        if mi.prev_token_rows:
            input_ids[to_device(mi.prev_token_rows, torch.long, self.device)] = \
                self._prev_sampled[to_device(mi.prev_token_src, torch.long, self.device)]
        return input_ids

    def _lora_graph_rows(self, mi: ModelInput) -> tuple[list[int], list[int]] | None:
        """With LoRA, a replay's adapters loaded into their slots and the kernels' rows for its buffers."""
        if self.lora_manager is None:
            return None
        self.lora_manager.apply_loads(mi)
        return self.lora_manager.kernel_rows(mi)

    def _eager_forward(self, mi: ModelInput, input_ids: torch.Tensor) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=to_device(mi.slot_mapping, torch.long, self.device),
            block_tables=to_device(mi.block_tables, torch.int32, self.device),
            seq_lens=to_device(mi.seq_lens, torch.int32, self.device),
            cu_seqlens_q=to_device(_cumsum0(mi.query_lens), torch.int32, self.device),
            max_seqlen_q=max(mi.query_lens), max_seqlen_k=max(mi.seq_lens),
            seq_lens_cpu=mi.seq_lens, query_lens_cpu=mi.query_lens,
            group_slot_mappings=[to_device(s, torch.long, self.device) for s in mi.group_slot_mappings],
            group_block_tables=[to_device(t, torch.int32, self.device) for t in mi.group_block_tables])
        lora_mapping = None if self.lora_manager is None else self.lora_manager.prepare(mi)
        with set_forward_context(meta, lora_mapping):
            return self.model(input_ids, to_device(mi.positions, torch.long, self.device))

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, so: SchedulerOutput) -> dict[int, list[SampleLogprobs]]:
        """logits: [num_prompt_logprob_rows, vocab], rows in prepare_inputs' order -> records per seq_id."""
        spans = [(seq, prompt_logprob_positions(seq, start, n))
                 for seq, start, n in zip(so.seqs, so.num_computed_tokens, so.num_scheduled_tokens)
                 if seq.sampling_params.prompt_logprobs is not None]
        spans = [(seq, positions) for seq, positions in spans if positions]
        # The row at position p scores prompt token p + 1.
        target_ids = [seq.token_ids[p + 1] for seq, positions in spans for p in positions]
        ks = [seq.sampling_params.prompt_logprobs for seq, positions in spans for _p in positions]
        records = compute_prompt_logprobs(logits, target_ids, ks)
        out, i = {}, 0
        for seq, positions in spans:
            out[seq.seq_id] = records[i:i + len(positions)]
            i += len(positions)
        return out

    def prepare_inputs(self, so: SchedulerOutput) -> ModelInput:
        bs = self.block_size
        mi = ModelInput([], [], [], [], [], list(so.num_scheduled_tokens), [],
                        blocks_to_swap_out=so.blocks_to_swap_out, blocks_to_swap_in=so.blocks_to_swap_in)
        num_rows = 0
        spec = so.spec_token_ids
        for seq, start, n, samples in zip(so.seqs, so.num_computed_tokens, so.num_scheduled_tokens,
                                          so.sample_flags):
            end = start + n
            mi.input_ids.extend(seq.token_ids[start:end])
            drafts = spec.get(seq.seq_id) if spec else None
            if drafts:  # [last token, d_1 .. d_k]: every row samples (engine/worker/rejection_sampler.py)
                assert end == seq.num_tokens + len(drafts), (seq, start, n, drafts)
                mi.input_ids.extend(drafts)
                mi.sample_rows.extend(range(num_rows, num_rows + n - 1))
            elif end > seq.num_tokens:  # a decode of the previous step's token, not back on the host yet
                assert end == seq.num_tokens + 1, (seq, start, n)
                mi.prev_token_rows.append(num_rows + n - 1)
                mi.prev_token_src.append(self._prev_rows[seq.seq_id])
                mi.input_ids.append(0)
            mi.positions.extend(range(start, end))
            bt = seq.block_table
            mi.slot_mapping.extend([bt[p // bs] * bs + p % bs for p in range(start, end)])
            mi.seq_lens.append(end)
            if seq.sampling_params.prompt_logprobs is not None:  # rare: the common loop stays as it was
                mi.prompt_logprob_rows.extend(num_rows + p - start for p in prompt_logprob_positions(seq, start, n))
            num_rows += n
            if samples:
                mi.sample_rows.append(num_rows - 1)  # the chunk's last row predicts the next token
        max_blocks = max(cdiv(s, bs) for s in mi.seq_lens)
        for seq in so.seqs:
            bt = seq.block_table[:max_blocks]
            mi.block_tables.append(bt + [0] * (max_blocks - len(bt)))
        for g in range(1, len(self.kv_groups)):
            mi.group_slot_mappings.append(_slot_mapping(so, g, bs))
            tables = [seq.block_tables[g][:max_blocks] for seq in so.seqs]
            mi.group_block_tables.append([bt + [0] * (max_blocks - len(bt)) for bt in tables])
        if self.lora_manager is not None:
            mi.lora_slots, mi.lora_loads = self.lora_manager.plan([seq.lora_request for seq in so.seqs])
        return mi

    def free_seq(self, seq_id: int) -> None:
        self.sampler.free(seq_id)


@dataclass
class StepHandle:
    """A launched step, between forward(), sample() and collect()."""

    scheduler_output: SchedulerOutput
    logits: torch.Tensor | None        # [num_sample_rows (+ prompt logprob rows), vocab] until sampled
    sampled: SampledTokens | VerifiedTokens | None = None
    prompt_logprobs: dict[int, list[SampleLogprobs]] | None = None


def prompt_logprob_positions(seq: Sequence, start: int, num_scheduled: int) -> range:
    """Positions of this chunk whose row gives a prompt logprob entry not yet made: those
    whose next token is a prompt token (entries made before a preemption are not redone).

        prompt t0 t1 t2 t3 t4; entries for t1, t2 made before a preemption; recompute chunk [0, 5):
        rows of positions 2, 3 -> entries for t3, t4 (position 4 scores the first output token)
    """
    if not seq.num_missing_prompt_logprobs:
        return range(0)
    return range(max(start, len(seq.prompt_logprobs)), min(start + num_scheduled, seq.num_prompt_tokens - 1))


def _pack_weights_for_cpu(model: torch.nn.Module) -> None:
    """CPU fp32, after loading: every linear weight packed once for oneDNN
    (engine.layers.cpu_gemm). A weight two modules share (a tied LM head is also the
    embedding table, read by rows) stays dense."""
    uses: dict[int, int] = {}
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor):
            uses[id(w)] = uses.get(id(w), 0) + 1
    for m in model.modules():
        dense = isinstance(m, ParallelLMHead) or (isinstance(m, LinearBase)
                                                  and isinstance(m.quant_method, UnquantizedLinearMethod))
        if dense and uses[id(m.weight)] == 1:
            pack_module_weight(m)


def _slot_mapping(so: SchedulerOutput, group: int, bs: int) -> list[int]:
    """Cache slots of a step's new tokens in KV cache group `group`'s blocks."""
    out: list[int] = []
    for seq, start, n in zip(so.seqs, so.num_computed_tokens, so.num_scheduled_tokens):
        bt = seq.block_tables[group]
        out.extend(bt[p // bs] * bs + p % bs for p in range(start, start + n))
    return out


def _cumsum0(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _min_over_ranks(value: int, device: torch.device) -> int:
    if get_tp_size() == 1:
        return value
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
