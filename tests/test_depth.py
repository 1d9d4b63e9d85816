"""The adaptive depth controller picks what measured round times and acceptance say pays."""

from mtplx.depth import EXPLORE_EVERY, DepthController


def drive(ctrl, width, cost, acceptance, rounds=200):
    """Feed the controller rounds whose time is cost(k) and whose drafts pass with `acceptance`."""
    chosen = []
    for _ in range(rounds):
        k = ctrl.choose(width)
        chosen.append(k)
        accepted = 0
        for _ in range(k):  # expected prefix of accepted drafts, made deterministic
            if accepted < round(acceptance * k):
                accepted += 1
        ctrl.record(width, k, cost(k), accepted, min(accepted + 1, k) if k else 0)
    tail = chosen[-EXPLORE_EVERY * 4:]
    return max(set(tail), key=tail.count)


def test_free_verify_and_good_acceptance_drafts_deep():
    # a GPU-like device: verifying more tokens costs almost nothing extra
    assert drive(DepthController(4), 1, lambda k: 1.0 + 0.02 * k, 0.9) == 4


def test_costly_verify_and_poor_acceptance_stops_drafting():
    # a CPU-like device: each drafted token costs most of a forward; drafts rarely pass
    assert drive(DepthController(4), 1, lambda k: 1.0 + 0.9 * k, 0.1) == 0


def test_fixed_depth_when_not_adaptive():
    ctrl = DepthController(3, adaptive=False)
    assert {ctrl.choose(w) for w in (1, 8, 32)} == {3}


def test_no_drafter_never_drafts():
    ctrl = DepthController(0)
    assert {ctrl.choose(1) for _ in range(40)} == {0}
