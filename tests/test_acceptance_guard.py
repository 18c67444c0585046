"""The acceptance guard: drafts pause for a sequence whose drafts keep failing, and come back."""
from engine.spec_decode.acceptance_guard import MAX_COOLDOWN_STEPS, MIN_COOLDOWN_STEPS, AcceptanceGuard


def steps_without_draft(guard, seq_id):
    n = 0
    while not guard.wants_draft(seq_id):
        n += 1
    return n


def test_rejections_pause_drafts_for_a_doubling_cooldown():
    guard = AcceptanceGuard()
    assert guard.wants_draft(1)
    for _ in range(2):
        guard.observe(1, 4, 0)
        assert guard.wants_draft(1)  # two failures are not enough
    guard.observe(1, 4, 0)
    assert steps_without_draft(guard, 1) == MIN_COOLDOWN_STEPS
    for _ in range(3):  # the probe fails too: twice as long
        guard.observe(1, 4, 0)
    assert steps_without_draft(guard, 1) == 2 * MIN_COOLDOWN_STEPS
    for _ in range(20):
        for _ in range(3):
            guard.observe(1, 4, 0)
        cooldown = steps_without_draft(guard, 1)
    assert cooldown == MAX_COOLDOWN_STEPS


def test_good_acceptance_keeps_drafts_and_resets_the_cooldown():
    guard = AcceptanceGuard()
    for _ in range(3):
        guard.observe(7, 4, 0)
    steps_without_draft(guard, 7)
    for _ in range(3):
        guard.observe(7, 4, 0)
    assert steps_without_draft(guard, 7) == 2 * MIN_COOLDOWN_STEPS
    for _ in range(10):
        guard.observe(7, 4, 3)
        assert guard.wants_draft(7)
    for _ in range(6):  # from a high average it takes more failures, and the pause is short again
        guard.observe(7, 4, 0)
        assert guard.wants_draft(7)
    guard.observe(7, 4, 0)
    assert steps_without_draft(guard, 7) == MIN_COOLDOWN_STEPS
    guard.retain(set())
    assert guard.wants_draft(7)
