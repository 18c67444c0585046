"""Our model code against HF transformers on tiny random checkpoints: logits of a mixed
flat batch (prefill, decode, chunked prefill) must equal HF's, for both attention backends."""
import os

import torch

# The Triton kernels run under the interpreter on CPU; set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.worker.forward_context import AttentionMetadata, set_forward_context  # noqa: E402
from engine.layers.attention import Attention  # noqa: E402
from engine.loader.weights import load_weights  # noqa: E402
from engine.models import MODEL_REGISTRY, get_model_class  # noqa: E402

BLOCK_SIZE = 16
BLOCKS_PER_SEQ = 8  # room for 128 tokens per sequence
# Our attention sums in another order than HF's SDPA: on CPU the C kernel (online softmax, a
# polynomial exp) now takes whole prefill chunks too, and gave 1.43e-4 on one of 9250 qwen2
# logits (MQA, large init, logits ~2); an H100's cuBLAS and native kernels gave 1.2e-4 there.
ATOL = 2e-4
ATOL_CUDA = 5e-4

_COMMON = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
               initializer_range=0.5)  # large init: logits far from uniform
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64)
# Half of each head rotates; every sequence HF recomputes whole here fits the original 24 positions
# (the long factors past them: tests/test_phi3.py, against HF's own decode loop).
PHI3_ROPE = dict(partial_rotary_factor=0.5, original_max_position_embeddings=24, rope_parameters=dict(
    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.1, 1.2, 1.3], long_factor=[1.0, 2.0, 4.0, 8.0]))
# transformers is imported lazily: the TP test's worker processes import this module and never need it.
HF_CONFIGS = {  # (config class, per-arch settings: each exercises that family's distinctive path)
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=1, tie_word_embeddings=True)),  # MQA, q/k/v bias, tied
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32)),               # q/k norm, head_dim != 64/4
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, pad_token_id=None, **PHI3_ROPE)),  # fused tensors, LongRoPE
}


def build_hf_checkpoint(arch: str, out_dir, seed: int = 0, max_shard_size=None, **overrides):
    """A random-weight HF model saved as safetensors in `out_dir`; returns the (float32, eval) HF model."""
    torch.manual_seed(seed)
    import transformers

    config_cls, arch_kw = HF_CONFIGS[arch]
    config = getattr(transformers, config_cls)(**{**_COMMON, **arch_kw, **overrides})
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomise them so their loading is tested
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    kw = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
    hf.save_pretrained(out_dir, **kw)
    return hf.eval()


def _device(backend: str) -> str:
    """Triton runs natively on a GPU when there is one, interpreted on CPU otherwise."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _atol(backend: str) -> float:
    return ATOL_CUDA if _device(backend) == "cuda" else ATOL


def load_our_model(path, backend: str = "torch", dtype=torch.float32):
    config = ModelConfig.from_pretrained(path)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = get_model_class(config.architecture)(config)
    finally:
        torch.set_default_dtype(prev)
    for m in model.modules():  # as the model runner does
        if isinstance(m, Attention):
            m.set_backend(backend)
    load_weights(model, path)
    return model.to(_device(backend)).eval()


def attach_kv_cache(model, num_seqs: int, dtype=torch.float32) -> None:
    """Sequence s owns blocks [s * BLOCKS_PER_SEQ, (s + 1) * BLOCKS_PER_SEQ)."""
    for m in model.modules():
        if isinstance(m, Attention):
            shape = (num_seqs * BLOCKS_PER_SEQ, BLOCK_SIZE, m.num_kv_heads, m.head_dim)
            device = next(model.parameters()).device
            m.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            m.v_cache = torch.zeros(shape, dtype=dtype, device=device)


def make_step(chunks: list[tuple[int, list[int], int]], device="cpu"):
    """chunks: (seq index, new token ids, number already cached) -> (input_ids, positions, metadata)."""
    ids, positions, slots, seq_lens, query_lens, tables = [], [], [], [], [], []
    for seq, tokens, num_cached in chunks:
        table = list(range(seq * BLOCKS_PER_SEQ, (seq + 1) * BLOCKS_PER_SEQ))
        pos = range(num_cached, num_cached + len(tokens))
        ids += tokens
        positions += pos
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
        seq_lens.append(num_cached + len(tokens))
        query_lens.append(len(tokens))
        tables.append(table)
    cu = torch.tensor([0] + query_lens, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, **i64), block_tables=torch.tensor(tables, **i32),
        seq_lens=torch.tensor(seq_lens, **i32), cu_seqlens_q=cu, max_seqlen_q=max(query_lens),
        max_seqlen_k=max(seq_lens), seq_lens_cpu=seq_lens, query_lens_cpu=query_lens)
    return torch.tensor(ids, **i64), torch.tensor(positions, **i64), md


@torch.inference_mode()
def run_step(model, chunks) -> torch.Tensor:
    """Logits [num_tokens, vocab] of every row of one flat step, on the CPU (where HF's are)."""
    input_ids, positions, md = make_step(chunks, next(model.parameters()).device)
    with set_forward_context(md):
        hidden = model(input_ids, positions)
    return model.compute_logits(hidden).cpu()


@torch.inference_mode()
def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([token_ids])).logits[0].float()  # [len, vocab]


def prompts(vocab: int, lengths=(4, 14, 19), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, build_hf_checkpoint(request.param, path)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_then_decode_matches_hf(checkpoint, backend):
    path, hf = checkpoint
    model = load_our_model(path, backend)
    seqs = prompts(hf.config.vocab_size)
    attach_kv_cache(model, len(seqs))
    # One flat prefill step of all three prompts.
    logits = run_step(model, [(s, toks, 0) for s, toks in enumerate(seqs)])
    torch.testing.assert_close(logits, torch.cat([hf_logits(hf, t) for t in seqs]), atol=_atol(backend), rtol=0)
    last = logits[torch.tensor([len(t) for t in seqs]).cumsum(0) - 1]  # [num_seqs, vocab]
    for _ in range(3):  # decode steps, feeding the greedy tokens; seq 1 crosses into its second block
        for s, tok in enumerate(last.argmax(-1).tolist()):
            seqs[s].append(tok)
        last = run_step(model, [(s, toks[-1:], len(toks) - 1) for s, toks in enumerate(seqs)])
        expected = torch.stack([hf_logits(hf, t)[-1] for t in seqs])
        torch.testing.assert_close(last, expected, atol=_atol(backend), rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_prefill_equals_single_prefill(checkpoint, backend):
    path, hf = checkpoint
    model = load_our_model(path, backend)
    long, short = prompts(hf.config.vocab_size, lengths=(26, 6), seed=2)
    attach_kv_cache(model, 2)
    single = run_step(model, [(0, long, 0)])
    attach_kv_cache(model, 2)
    # Step 1: first chunk of seq 0 beside the whole prompt of seq 1; step 2: the rest of
    # seq 0 beside a decode of seq 1 (prefill and decode mixed in one step).
    # The second chunk starts mid-block and crosses into the next block.
    first = run_step(model, [(0, long[:13], 0), (1, short, 0)])
    second = run_step(model, [(0, long[13:], 13), (1, [7], len(short))])
    torch.testing.assert_close(torch.cat([first[:13], second[:-1]]), single, atol=_atol(backend), rtol=0)
    torch.testing.assert_close(second[-1], hf_logits(hf, short + [7])[-1], atol=_atol(backend), rtol=0)


def test_forward_without_kv_cache_is_a_clear_error(checkpoint):
    path, hf = checkpoint
    model = load_our_model(path)
    with pytest.raises(RuntimeError, match="no KV cache"):
        run_step(model, [(0, [1, 2, 3], 0)])


def test_forward_without_attention_backend_is_a_clear_error(tmp_path):
    build_hf_checkpoint("llama", tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    model = get_model_class(config.architecture)(config)  # as built, before the runner sets a backend
    attach_kv_cache(model, 1)
    with pytest.raises(RuntimeError, match="no backend"):
        run_step(model, [(0, [1, 2, 3], 0)])


def test_every_registered_architecture_builds_its_model_class():
    """The registry is the one table of supported architectures; its "module:Class" strings
    are imported on first use, so a typo would otherwise surface only when that model loads."""
    for arch in MODEL_REGISTRY:
        assert issubclass(get_model_class(arch), torch.nn.Module), arch
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_bfloat16_model_runs_and_returns_float32_logits(tmp_path):
    hf = build_hf_checkpoint("qwen3", tmp_path)
    model = load_our_model(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    attach_kv_cache(model, 1, dtype=torch.bfloat16)
    seq = prompts(hf.config.vocab_size, lengths=(12,))[0]
    logits = run_step(model, [(0, seq, 0)])
    assert logits.dtype == torch.float32 and logits.shape == (12, hf.config.vocab_size)
    # bf16 keeps ~3 significant digits: close to the float32 reference, not equal.
    torch.testing.assert_close(logits, hf_logits(hf, seq), atol=0.5, rtol=0.05)


def test_cache_is_not_part_of_state_dict(tmp_path):
    build_hf_checkpoint("llama", tmp_path)
    model = load_our_model(tmp_path)
    attach_kv_cache(model, 1)
    assert not any("cache" in k for k in model.state_dict())
    assert [type(m).__name__ for m in model.modules()].count("Attention") == 2
