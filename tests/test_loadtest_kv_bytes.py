"""loadtest/kv_bytes.py: the KV bytes a Gemma 3 27B conversation holds before and after the
sliding layers free the blocks behind their window, and its count of held blocks against a
real sliding BlockManager's."""
import pytest

from engine.core.block_manager import NULL_BLOCK_ID, BlockManager
from engine.core.sequence import Sequence
from engine.sampling_params import SamplingParams
from loadtest.kv_bytes import GEMMA3_27B, kv_bytes, main, sliding_blocks_held


def test_gemma3_27b_at_32k_tokens():
    r = kv_bytes(GEMMA3_27B, 32768)
    # 62 layers x K and V x 16 heads x 128 x 2 bytes = 507,904 bytes a token before;
    # after: 10 global layers for every token, 52 local ones for 64 blocks of 16 (the last
    # token, at 32767, sees 31744..32767: blocks 1984..2047).
    assert r.before_per_token == 62 * 2 * 16 * 128 * 2 == 507_904
    assert r.after == (10 * 32768 + 52 * 64 * 16) * 2 * 16 * 128 * 2
    assert r.after_per_token == 95_232 and r.before / r.after == pytest.approx(5.33, abs=0.01)


def test_short_conversation_and_full_only_model_change_nothing():
    assert kv_bytes(GEMMA3_27B, 500).before == kv_bytes(GEMMA3_27B, 500).after  # inside one window
    llama = dict(GEMMA3_27B, architectures=["LlamaForCausalLM"], hidden_act="silu")
    for key in ("sliding_window", "sliding_window_pattern", "rope_local_base_freq", "hidden_activation"):
        llama.pop(key)
    r = kv_bytes(llama, 32768)
    assert r.before == r.after


@pytest.mark.parametrize("window", [7, 16, 40])
def test_held_blocks_match_the_block_manager(window):
    bm = BlockManager(num_blocks=64, block_size=4, sliding_window=window)
    seq = Sequence("r", [1] * 5, SamplingParams(max_tokens=400))
    assert bm.allocate_slots(seq, 5)
    seq.num_computed_tokens = 5
    for _ in range(300):  # decoding at position num_tokens
        seq.append_token(1)
        assert bm.allocate_slots(seq, 1)
        held = sum(b != NULL_BLOCK_ID for b in seq.block_table)
        assert held == min(len(seq.block_table), sliding_blocks_held(seq.num_computed_tokens, window, 4))
        seq.num_computed_tokens += 1


def test_main_prints_both(capsys):
    main(["--tokens", "32768"])
    out = capsys.readouterr().out
    assert "496.0 KiB per token" in out and "93.0 KiB per token" in out
