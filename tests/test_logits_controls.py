"""logit_bias, allowed_token_ids and bad_words: in the sampler against hand computations, then
through the engine (n > 1, seeds, penalties, logprobs, preemption, overlapped scheduling)."""
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.core.sequence import Sequence
from engine.errors import InvalidRequestError
from engine.sampling_params import bad_words_token_ids
from engine.worker.logits_controls import RowGuard, TokenControls, apply_bad_words
from engine.worker.sampler import Sampler

VOCAB = 64
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]
PROMPT = {"prompt_token_ids": list(range(40, 72))}  # 32 tokens: a few requests overflow the tiny cache


def make_seq(output=(), bad_words=(), **params) -> Sequence:
    seq = Sequence("req", [1, 2, 3], SamplingParams(**params))
    for t in output:
        seq.append_token(t)
    seq.bad_words_token_ids = [list(w) for w in bad_words]
    return seq


def _finite(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


# -- the ops ------------------------------------------------------------------------
def test_bad_words_ban_the_last_token_after_the_others():
    seqs = [make_seq(output=[5, 6], bad_words=[[6, 7], [9, 8], [10], [4, 5, 6, 11]]),  # [4, 5, 6, 11]: 4 is prompt
            make_seq(output=[5, 6, 9], bad_words=[[6, 7], [9, 8]]),
            make_seq(output=[], bad_words=[[3, 12]]),  # the prompt's tail does not count
            make_seq()]
    logits = torch.zeros(len(seqs), VOCAB)
    apply_bad_words(logits, seqs)
    assert [set(range(VOCAB)) - _finite(row) for row in logits] == [{7, 10}, {8}, set(), set()]


def test_logit_bias_and_allowed_token_ids_touch_only_their_rows():
    controls = TokenControls()
    seqs = [make_seq(logit_bias={3: 2.5, 9: -100}), make_seq(), make_seq(allowed_token_ids=[4, 60]),
            make_seq(allowed_token_ids=[1], logit_bias={1: 1.0, 2: 5.0})]
    logits = torch.zeros(len(seqs), VOCAB)
    controls.apply_allowed_token_ids(logits, seqs)
    controls.apply_logit_bias(logits, seqs)
    expected = torch.zeros(len(seqs), VOCAB)
    expected[0, 3], expected[0, 9] = 2.5, -100.0
    expected[2] = float("-inf")
    expected[2, [4, 60]] = 0.0
    expected[3] = float("-inf")
    expected[3, 1] = 1.0  # the bias of a banned token leaves it banned (-inf + 5)
    assert torch.equal(logits, expected)
    controls.free(seqs[0].seq_id)
    assert seqs[0].seq_id not in controls._bias


def test_row_guard_restores_only_rows_left_empty():
    seqs = [make_seq(allowed_token_ids=[5]), make_seq(allowed_token_ids=[6]), make_seq()]
    logits = torch.randn(3, VOCAB)
    logits[0, 5] = float("-inf")  # a grammar bans the only allowed token of row 0
    before = logits.clone()
    guard = RowGuard(logits, seqs)
    TokenControls().apply_allowed_token_ids(logits, seqs)
    guard.restore_emptied(logits)
    assert torch.equal(logits[0], before[0])   # emptied: the grammar's logits again
    assert _finite(logits[1]) == {6}           # not emptied: restricted
    assert torch.equal(logits[2], before[2])   # no controls: untouched


# -- in the sampler -----------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_sampler_applies_them_and_reports_raw_logprobs(device):
    torch.manual_seed(0)
    row = torch.randn(VOCAB, device=device)
    top = int(row.argmax())
    n = 400
    seqs = ([make_seq(temperature=0.0, logit_bias={top: -100})]
            + [make_seq(temperature=1.0, logit_bias={7: 100}, logprobs=0, seed=s) for s in range(n)]
            + [make_seq(temperature=1.0, allowed_token_ids=[2, 3, 5], seed=s) for s in range(n)]
            + [make_seq(temperature=0.0)])
    ids, records = Sampler(seed=0, device=device)(row.expand(len(seqs), -1).contiguous(), seqs)
    assert ids[0] == int(row.topk(2).indices[1])  # the greedy pick is banned: the runner-up
    assert set(ids[1:1 + n]) == {7}                # +100 forces it at temperature 1
    assert set(ids[1 + n:1 + 2 * n]) == {2, 3, 5}  # and the allowed set is sampled from, all of it
    assert ids[-1] == top                          # a row without controls in the same batch
    # vLLM V1 (logprobs_mode="raw_logprobs"): the model's logprob of the token, before the bias.
    assert records[1].logprob == pytest.approx(torch.log_softmax(row, -1)[7].item(), abs=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_controls_yield_to_the_grammar_when_they_would_leave_nothing(device):
    logits = torch.zeros(2, VOCAB, device=device)
    bitmask = torch.zeros(2, VOCAB // 32, dtype=torch.int32)
    bitmask[:, 0] = 1 << 4  # the grammar allows token 4 only
    seqs = [make_seq(temperature=1.0, allowed_token_ids=[9]), make_seq(temperature=0.0, output=[3], bad_words=[[4]])]
    ids, _ = Sampler(seed=0, device=device)(logits, seqs, bitmask.to(device))
    assert ids == [4, 4]


# -- through the engine ---------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_llama) -> dict[bool, LLM]:
    """async_scheduling -> engine; 10 KV blocks (160 tokens) for batches that want 288: preemption."""
    return {overlap: LLM(tiny_llama, dtype="float32", device="cpu", num_kv_blocks=10, async_scheduling=overlap)
            for overlap in (False, True)}


@pytest.fixture(scope="module")
def greedy(engines) -> list[int]:
    return engines[False].generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                   use_tqdm=False)[0].outputs[0].token_ids


def test_logit_bias_bans_and_forces_in_the_engine(engines, greedy):
    llm = engines[False]
    banned = llm.generate([PROMPT], SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, logit_bias={str(t): -100 for t in set(greedy)}),
        use_tqdm=False)[0].outputs[0].token_ids
    assert not set(banned) & set(greedy)
    forced = llm.generate([PROMPT], SamplingParams(
        temperature=1.0, seed=3, n=2, max_tokens=6, ignore_eos=True, logit_bias={"77": 100}), use_tqdm=False)[0]
    assert [c.token_ids for c in forced.outputs] == [[77] * 6] * 2


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("penalties", [False, True], ids=["alone", "with_penalties"])
def test_every_control_holds_with_n_seeds_preemption_and_overlap(engines, greedy, penalties):
    """One batch, sync and overlapped: the same tokens, and each request's controls hold. The bad
    word is two tokens of the greedy continuation (the first pair whose text tokenizes back to
    them), so without the ban greedy would write it. Without penalties in the batch, only the
    bad word's history makes the overlapped engine wait for the last token."""
    tok = engines[False].get_tokenizer()
    pairs = [greedy[i:i + 2] for i in range(len(greedy) - 1)]
    pair = next(p for p in pairs if p in bad_words_token_ids(tok, [tok.decode(p)]))
    word = tok.decode(pair)
    words = bad_words_token_ids(tok, [word])
    allowed = sorted(set(greedy))[:4] + [11, 12]
    knobs = {"frequency_penalty": 0.5, "repetition_penalty": 1.3, "logprobs": 2} if penalties else {}
    base = {"max_tokens": 16, "ignore_eos": True, **knobs}
    params = [SamplingParams(temperature=0, bad_words=[word], **base),
              SamplingParams(temperature=1.0, seed=1, n=2, bad_words=[word], **base),
              SamplingParams(temperature=1.0, seed=2, n=2, allowed_token_ids=allowed,
                             logit_bias={allowed[0]: -100}, **base),
              SamplingParams(temperature=1.0, seed=4, logit_bias={99: 3.0}, **base)]
    results = {}
    for overlap, llm in engines.items():
        preempted, waits = llm.llm_engine.scheduler.num_preemptions, llm.llm_engine.num_host_waits
        outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
        results[overlap] = [c.token_ids for out in outs for c in out.outputs]
        assert llm.llm_engine.scheduler.num_preemptions > preempted
        llm.llm_engine.block_manager.check_no_leak()
        for tokens in results[overlap][:3]:
            assert not any(_contains(tokens, w) for w in words), tokens
        for tokens in results[overlap][3:5]:
            assert set(tokens) <= set(allowed[1:]), tokens
    assert results[True] == results[False]
    assert results[False][0] != greedy  # the ban changed the greedy continuation
    assert engines[True].llm_engine.num_host_waits > waits  # a two-token bad word reads the last token on the host


def test_allowed_token_ids_with_a_grammar(engines):
    """A choice grammar and allowed_token_ids that cover one choice: only that choice is written."""
    tok = engines[False].get_tokenizer()
    yes = tok.encode("yes", add_special_tokens=False) + engines[False].llm_engine.eos_token_ids
    out = engines[False].generate(["Answer:"], SamplingParams(
        temperature=1.0, seed=0, n=3, max_tokens=8, allowed_token_ids=yes,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), use_tqdm=False)[0]
    assert [c.text for c in out.outputs] == ["yes"] * 3


@pytest.mark.parametrize("params, param", [
    ({"logit_bias": {"1000000": 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [3, 1000000]}, "allowed_token_ids"),
])
def test_token_ids_out_of_vocabulary_are_refused_at_add_request(engines, params, param):
    llm = engines[False]
    with pytest.raises(InvalidRequestError, match="out of vocabulary") as info:
        llm.generate(["x"], SamplingParams(**params), use_tqdm=False)
    assert info.value.param == param and not llm.llm_engine.has_unfinished_requests()
