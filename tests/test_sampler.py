"""Sampler: each knob against a hand computation or the support it must respect."""
import math

import pytest
import torch

from engine.worker.sampler import Sampler, apply_penalties, apply_top_k_top_p
from engine.sampling_params import SamplingParams
from engine.core.sequence import Sequence

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]
KNOWN_PROBS = [0.5, 0.3, 0.15, 0.05]


def make_seq(prompt=(1, 2, 3), output=(), index=0, **params) -> Sequence:
    seq = Sequence("req", list(prompt), SamplingParams(**params), index=index)
    for t in output:
        seq.append_token(t)
    return seq


def sample_support(logits_row: torch.Tensor, n: int = 2000, **params) -> set[int]:
    """Tokens seen in n independent draws (one batch of n identical rows)."""
    sampler = Sampler(seed=0)
    ids, _ = sampler(logits_row.expand(n, -1), [make_seq(**params) for _ in range(n)])
    return set(ids)


def known_logits() -> torch.Tensor:
    return torch.tensor(KNOWN_PROBS).log()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_in_a_mixed_batch(device):
    torch.manual_seed(0)
    logits = torch.randn(6, 100, device=device)
    before = logits.clone()
    seqs = [make_seq(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    ids, logprobs = Sampler(seed=0)(logits, seqs)
    assert logprobs is None
    assert [ids[i] for i in (0, 2, 4)] == logits.argmax(-1)[::2].tolist()
    assert torch.equal(logits, before)  # the caller's logits are not touched


def test_all_greedy_batch_still_applies_penalties():
    # An all-greedy batch takes the argmax of the raw logits only when no row has a
    # stage that changes them: a repetition penalty on one row must still move its pick.
    logits = torch.tensor([[0.0, 2.0, 1.5], [0.0, 2.0, 1.5]])
    seqs = [make_seq(prompt=[1], temperature=0.0),
            make_seq(prompt=[1], temperature=0.0, repetition_penalty=2.0)]
    ids, _ = Sampler(seed=0)(logits, seqs)
    assert ids == [1, 2]  # row 1: 2.0 / 2 = 1.0 < 1.5


def test_top_k_restricts_support():
    torch.manual_seed(1)
    row = torch.randn(64)
    seen = sample_support(row, top_k=5)
    assert seen <= set(row.topk(5).indices.tolist())
    assert len(seen) > 1


@pytest.mark.parametrize("top_p, allowed", [(0.4, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_keeps_smallest_nucleus(top_p, allowed):
    assert sample_support(known_logits(), top_p=top_p) == allowed


@pytest.mark.parametrize("min_p, allowed", [(0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})])
def test_min_p_drops_tokens_below_fraction_of_max(min_p, allowed):
    assert sample_support(known_logits(), min_p=min_p) == allowed


def test_top_k_and_top_p_per_row_in_one_batch():
    logits = known_logits().expand(3, -1)
    top_k = torch.tensor([4, 3, 2])
    top_p = torch.tensor([0.75, 1.0, 1.0])
    out = apply_top_k_top_p(logits, top_k, top_p)
    kept = [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in out]
    assert kept == [{0, 1}, {0, 1, 2}, {0, 1}]
    assert torch.equal(out[0, :2], logits[0, :2])  # kept logits are unchanged


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_frequencies(temperature):
    n = 4000
    ids, _ = Sampler(seed=3)(known_logits().expand(n, -1), [make_seq(temperature=temperature) for _ in range(n)])
    expected = torch.softmax(known_logits() / temperature, -1)
    freq = torch.bincount(torch.tensor(ids), minlength=4).float() / n
    assert torch.allclose(freq, expected, atol=0.03)


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_hand_computation(device):
    raw = [1.5, -2.0, 0.5, -0.5, 3.0, 0.0, 2.0, -1.0]
    logits = torch.tensor([raw, raw, raw], device=device)
    seqs = [make_seq(),  # no penalties: row untouched
            make_seq(prompt=[0, 1, 1, 100], output=[2, 3, 3, 0],  # 100 is out of vocab: ignored
                     repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            make_seq(prompt=[4], output=[6], presence_penalty=1.0)]
    apply_penalties(logits, seqs)
    # token 0: 1.5/2 - 0.5*1 - 0.25 | 1: -2*2 | 2: 0.5/2 - 0.5 - 0.25 | 3: -0.5*2 - 0.5*2 - 0.25
    expected = [0.0, -4.0, -0.5, -2.25, 3.0, 0.0, 2.0, -1.0]
    assert logits[0].tolist() == raw
    assert logits[1].tolist() == pytest.approx(expected)
    assert logits[2].tolist() == pytest.approx([1.5, -2.0, 0.5, -0.5, 3.0, 0.0, 1.0, -1.0])


def test_min_tokens_blocks_eos_and_stop_token_ids():
    logits = torch.zeros(10, 1).t()  # [1, 10], not contiguous: the sampler copies it
    logits[0, 9], logits[0, 7], logits[0, 3] = 3.0, 2.0, 1.0  # eos 9 > stop id 7 > token 3
    sampler = Sampler(eos_token_ids=[9], seed=0)

    def greedy(output, **params):
        return sampler(logits, [make_seq(output=output, temperature=0.0, stop_token_ids=[7], **params)])[0][0]

    assert greedy([], min_tokens=2) == 3
    assert greedy([5], min_tokens=2) == 3
    assert greedy([5, 5], min_tokens=2) == 9
    assert greedy([], min_tokens=2, ignore_eos=True) == 9  # eos is not a stop: not blocked


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_reproducible_whatever_the_batch(device):
    torch.manual_seed(0)
    steps = [torch.randn(1000, device=device) * 0.1 for _ in range(5)]  # near-uniform: seeds matter

    def run(batch_seed, order):
        sampler = Sampler(seed=batch_seed)
        target = make_seq(seed=7)
        others = [make_seq(), make_seq(seed=99), make_seq(temperature=0.0), make_seq(top_k=50)]
        batch = [target, *others][:order] if order > 0 else [*others[::-1], target]
        out = []
        for row in steps:
            logits = torch.randn(len(batch), 1000, device=device)
            logits[batch.index(target)] = row
            ids, _ = sampler(logits, batch)
            out.append(ids[batch.index(target)])
        return out

    reference = run(batch_seed=1, order=1)  # alone
    assert run(batch_seed=2, order=3) == reference
    assert run(batch_seed=3, order=0) == reference  # last in a reversed batch


def test_different_seeds_and_indices_differ_and_free_restarts():
    torch.manual_seed(0)
    logits = torch.randn(1, 1000) * 0.1
    sampler = Sampler(seed=0)

    def five(seq):
        return [sampler(logits, [seq])[0][0] for _ in range(5)]

    a = make_seq(seed=7)
    first = five(a)
    assert five(make_seq(seed=8)) != first
    assert five(make_seq(seed=7, index=1)) != first  # n > 1 completions of one seeded request
    assert five(make_seq(seed=7)) == first
    sampler.free(a.seq_id)
    assert five(a) == first  # a fresh generator replays the stream


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_come_from_raw_logits(device):
    torch.manual_seed(0)
    logits = torch.randn(3, 50, device=device)
    seqs = [make_seq(output=[4, 4], logprobs=5, temperature=0.7, repetition_penalty=1.3, frequency_penalty=1.0),
            make_seq(),
            make_seq(logprobs=0, temperature=0.0)]
    ids, records = Sampler(seed=0)(logits, seqs)
    raw = torch.log_softmax(logits, -1).cpu()
    assert records[1] is None
    for row, rec in ((0, records[0]), (2, records[2])):
        assert rec.token_id == ids[row]
        assert rec.logprob == pytest.approx(raw[row, ids[row]].item(), abs=1e-6)
        assert rec.rank == 1 + int((raw[row] > raw[row, ids[row]]).sum())
    top = raw[0].topk(5)
    assert records[0].top_token_ids == top.indices.tolist()
    assert records[0].top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert records[0].top_logprobs == sorted(records[0].top_logprobs, reverse=True)
    assert records[2].rank == 1 and records[2].top_token_ids == [] and records[2].top_logprobs == []


def _bitmask(allowed_rows: list[set[int] | None], vocab: int) -> torch.Tensor:
    """xgrammar layout: int32 words, bit j of word w = token 32*w + j; None = all allowed."""
    num_words = math.ceil(vocab / 32)
    rows = []
    for allowed in allowed_rows:
        words = [-1] * num_words if allowed is None else [0] * num_words
        for t in allowed or ():
            words[t // 32] |= 1 << (t % 32)
        rows.append([w - (1 << 32) if w >= 1 << 31 else w for w in words])  # to signed int32
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_bitmask_blocks_disallowed_tokens(device):
    vocab, allowed = 70, {3, 31, 33, 69}  # 31: the sign bit; 69: in the last, partial word
    n = 500
    logits = torch.randn(n, vocab, device=device)
    bitmask = _bitmask([allowed] * n, vocab).to(device)
    ids, _ = Sampler(seed=0)(logits, [make_seq() for _ in range(n)], bitmask)
    assert set(ids) == allowed

    logits = torch.zeros(2, vocab, device=device)
    logits[:, 5], logits[:, 33] = 5.0, 1.0  # 5 is the argmax but row 0 disallows it
    ids, records = Sampler()(logits, [make_seq(temperature=0.0, logprobs=1)] * 2,
                             _bitmask([allowed, None], vocab).to(device))
    assert ids == [33, 5]
    # logprobs see the grammar mask: only the 4 allowed tokens share the mass
    assert records[0].logprob == pytest.approx(1.0 - math.log(3 + math.e), abs=1e-5)


def test_bitmask_shape_is_checked():
    with pytest.raises(ValueError, match="allowed_token_bitmask"):
        Sampler()(torch.zeros(1, 70), [make_seq()], torch.zeros(1, 2, dtype=torch.int32))
