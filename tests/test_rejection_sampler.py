"""The rejection sampler: greedy keeps the agreeing prefix, sampling keeps the target distribution."""
import math

import pytest
import torch

from engine.core.sequence import Sequence
from engine.sampling_params import SamplingParams
from engine.worker.rejection_sampler import RejectionSampler
from engine.worker.sampler import Sampler

VOCAB = 6


def verify(seqs, drafts, logits, seed=0, draft_probs=None):
    sampler = RejectionSampler(Sampler(seed=seed, device="cpu"))
    return sampler(logits, seqs, drafts, draft_probs=draft_probs).to_runner_output()


def one_hot_rows(argmaxes):
    """Logits [len, VOCAB] whose row i has its maximum at argmaxes[i] (a clear one, no near-ties)."""
    logits = torch.randn(len(argmaxes), VOCAB, generator=torch.Generator().manual_seed(1))
    logits[torch.arange(len(argmaxes)), argmaxes] = 10.0
    return logits


def greedy_seq(**kw):
    return Sequence("r", [0, 1], SamplingParams(temperature=0, **kw))


def test_greedy_accepts_the_agreeing_prefix_then_the_targets_token():
    seqs = [greedy_seq(), greedy_seq(), greedy_seq()]
    drafts = [[3, 5, 1], [], [1, 1]]
    logits = one_hot_rows([3, 5, 2, 0] + [4] + [1, 1, 5])  # rows: 4 + 1 + 3
    out = verify(seqs, drafts, logits)
    assert out.num_accepted_tokens == [2, 0, 2]
    assert out.sampled_token_ids == [2, 4, 5]  # first disagreeing row's argmax; the plain row; the bonus row
    assert out.logprobs is None


def test_logprobs_of_accepted_drafts_and_the_final_token_are_the_raw_rows():
    seq = greedy_seq(logprobs=2)
    logits = one_hot_rows([3, 4, 1])
    out = verify([seq], [[3, 2]], logits)
    assert (out.num_accepted_tokens, out.sampled_token_ids) == ([1], [4])
    raw = torch.log_softmax(logits, dim=-1)
    (accepted,), (final,) = out.accepted_logprobs, out.logprobs
    assert [r.token_id for r in accepted] == [3] and final.token_id == 4
    assert accepted[0].logprob == pytest.approx(raw[0, 3].item()) and final.logprob == pytest.approx(raw[1, 4].item())
    assert final.top_token_ids[0] == 4 and final.rank == 1


def test_penalties_count_the_drafts_before_each_row():
    """Row 1 comes after draft 3: with a presence penalty, 3 is no longer its best token, as it would
    not be when decoding one token at a time."""
    seq = greedy_seq(presence_penalty=2.0)
    logits = torch.zeros(2, VOCAB)
    logits[:, 3], logits[:, 5] = 5.0, 4.0
    out = verify([seq], [[3]], logits)
    assert (out.num_accepted_tokens, out.sampled_token_ids) == ([1], [5])


def chi2_threshold(dof, p_value=1e-4):
    """The chi-squared quantile for 1 - p_value (Wilson-Hilferty; z for 1e-4 is 3.719)."""
    z = 3.719
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts, probs):
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def test_sampled_tokens_keep_the_target_distribution():
    """Drafts [3, 4] against fixed target rows: the first emitted token is distributed as row 0's
    softmax, the second (when the first draft was accepted) as row 1's, whatever the drafts.
    Without the resampling step (a rejected draft redrawn from p itself) the first token would be
    the draft with probability p(d) + (1 - p(d)) p(d); the statistic below shows that apart too."""
    n = 4000
    rows = torch.tensor([[0.5, -1.0, 0.2, 1.0, 0.0, -0.5],
                         [0.1, 0.3, -0.2, 0.0, 0.8, -1.0],
                         [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]]) * 1.5
    p = torch.softmax(rows / 0.8, dim=-1)
    seqs = [Sequence("r", [0], SamplingParams(temperature=0.8)) for _ in range(n)]
    out = verify(seqs, [[3, 4]] * n, rows.repeat(n, 1), seed=123)
    first = [3 if a >= 1 else t for a, t in zip(out.num_accepted_tokens, out.sampled_token_ids)]
    second = [4 if a >= 2 else t for a, t in zip(out.num_accepted_tokens, out.sampled_token_ids) if a >= 1]
    first_counts = [first.count(v) for v in range(VOCAB)]
    second_counts = [second.count(v) for v in range(VOCAB)]
    limit = chi2_threshold(VOCAB - 1)
    assert chi2(first_counts, p[0].tolist()) < limit, first_counts
    assert chi2(second_counts, p[1].tolist()) < limit, second_counts
    d = 3
    no_resample = [p[0, v].item() * (1 - p[0, d].item()) + (p[0, d].item() if v == d else 0) for v in range(VOCAB)]
    assert chi2(first_counts, no_resample) > 10 * limit


def test_a_seeded_sequence_draws_the_same_alone_or_in_a_batch():
    rows = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    seeded = Sequence("s", [0], SamplingParams(temperature=1.0, seed=42))
    alone = verify([seeded], [[1, 2]], rows)
    seeded_again = Sequence("s", [0], SamplingParams(temperature=1.0, seed=42))
    others = [Sequence("o", [0], SamplingParams(temperature=1.0)) for _ in range(2)]
    batch = torch.cat([torch.randn(2, VOCAB), rows, torch.randn(1, VOCAB)])
    mixed = verify([others[0], seeded_again, others[1]], [[3], [1, 2], []], batch, seed=9)
    assert (mixed.num_accepted_tokens[1], mixed.sampled_token_ids[1]) == \
        (alone.num_accepted_tokens[0], alone.sampled_token_ids[0])


# Target rows and a draft distribution q for two drafts: q shares about 40% of its mass with p
# (sum(min(p, q))), so both the acceptance test and the residual shape the output.
TARGET_ROWS = torch.tensor([[0.5, -1.0, 0.2, 1.0, 0.0, -0.5],
                            [0.1, 0.3, -0.2, 0.0, 0.8, -1.0],
                            [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]]) * 1.5
Q = torch.softmax(torch.tensor([[1.0, 0.5, -0.5, 0.3, -1.0, 1.2],
                                [-0.5, 1.0, 0.8, 0.6, -1.0, 0.2]]) * 1.5, dim=-1)


def sampled_drafts(seqs, q=Q, seed=7):
    """A draft of len(q) tokens per sequence, token i drawn from q[i] (as the draft model draws
    them), and q for each (SchedulerOutput.spec_draft_probs)."""
    tokens = torch.multinomial(q, len(seqs), replacement=True, generator=torch.Generator().manual_seed(seed)).T
    return [row.tolist() for row in tokens], {seq.seq_id: q for seq in seqs}


def emitted(out, drafts, position):
    """The token each sequence emitted at `position` (0 or 1), over those that got that far."""
    return [d[position] if a > position else t
            for a, t, d in zip(out.num_accepted_tokens, out.sampled_token_ids, drafts) if a >= position]


def test_drafts_sampled_from_q_keep_the_target_distribution():
    """Drafts drawn from q and verified with q (accept min(1, p(d) / q(d)), then norm(max(0, p - q))):
    the first emitted token is distributed as p_0, the second (after an accepted first) as p_1.
    Accepting with p(d) instead of p(d) / q(d), or resampling from p (d taken out) instead of
    max(0, p - q), fails this test (tried: statistics of 360 to 680 against a limit of 26)."""
    n = 4000
    p = torch.softmax(TARGET_ROWS / 0.8, dim=-1)
    seqs = [Sequence("r", [0], SamplingParams(temperature=0.8)) for _ in range(n)]
    drafts, draft_probs = sampled_drafts(seqs)
    out = verify(seqs, drafts, TARGET_ROWS.repeat(n, 1), seed=123, draft_probs=draft_probs)
    limit = chi2_threshold(VOCAB - 1)
    for position in (0, 1):
        tokens = emitted(out, drafts, position)
        counts = [tokens.count(v) for v in range(VOCAB)]
        assert chi2(counts, p[position].tolist()) < limit, (position, counts)
    # The first draft is accepted with probability sum(min(p_0, q_0)) = 0.41 (6 standard deviations
    # allowed): accepted and rejected drafts both common, so both paths shape the counts above.
    first_accepted = sum(a >= 1 for a in out.num_accepted_tokens) / n
    assert first_accepted == pytest.approx(torch.minimum(p[0], Q[0]).sum().item(), abs=0.05)


def test_drafts_sampled_from_the_targets_own_distribution_are_all_accepted():
    """q = p: p(d) / q(d) = 1, every draft accepted (the one-hot test, with p(d), accepts under a fifth: tried)."""
    n = 500
    p = torch.softmax(TARGET_ROWS, dim=-1)
    seqs = [Sequence("r", [0], SamplingParams(temperature=1.0)) for _ in range(n)]
    drafts, draft_probs = sampled_drafts(seqs, q=p[:2])
    out = verify(seqs, drafts, TARGET_ROWS.repeat(n, 1), draft_probs=draft_probs)
    assert sum(out.num_accepted_tokens) >= 0.99 * 2 * n


def test_drafts_with_q_beside_one_hot_drafts():
    """Only the sequences in draft_probs are verified with q. Here q = p at their draft, so it is
    always accepted (p(d) / q(d) = 1), where a draft without q would be accepted as one-hot, with
    p(d) = 0.3. An n-gram draft and a greedy row in the same batch keep their own tests."""
    n = 200
    p = torch.tensor([0.1, 0.2, 0.1, 0.3, 0.2, 0.1])
    seqs = [Sequence("s", [0], SamplingParams(temperature=1.0)) for _ in range(n)]
    seqs += [Sequence("n", [0], SamplingParams(temperature=1.0)), greedy_seq()]
    rows = torch.cat([torch.stack([p.log(), torch.zeros(VOCAB)]).repeat(n, 1), one_hot_rows([2, 1, 4])])
    draft_probs = {seq.seq_id: p.unsqueeze(0) for seq in seqs[:n]}
    out = verify(seqs, [[3]] * n + [[2], []], rows, draft_probs=draft_probs)
    assert out.num_accepted_tokens == [1] * n + [1, 0]
    assert out.sampled_token_ids[-1] == 4


def test_draft_probs_of_the_wrong_shape_are_refused():
    seq = Sequence("r", [0], SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match=r"draft_probs must be \[num_draft_tokens=2, vocab=6\], got \(1, 6\)"):
        verify([seq], [[1, 2]], torch.zeros(3, VOCAB), draft_probs={seq.seq_id: torch.full((1, VOCAB), 1 / VOCAB)})
