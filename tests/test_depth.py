"""The adaptive depth controller picks what measured round times and acceptance say pays."""

from mtplx.depth import EXPLORE_EVERY, EXPLORE_MOST, DepthController


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


def test_acceptance_that_falls_with_depth_is_measured_per_position():
    """An MTP-like drafter: draft 1 passes 90% of the time, deeper drafts almost never (they build
    on the head's own guess). With a round costing 1 + 0.1 k, depth 1 pays most (1.9 / 1.1 tokens
    per unit against 1.95 / 1.2 at depth 2); a single per-token acceptance averages the positions
    and drafts deeper than pays."""
    import numpy as np

    from mtplx.depth import position_counts

    rng = np.random.default_rng(0)
    ctrl = DepthController(4)
    width = 8
    chosen = []
    for _ in range(400):
        k = ctrl.choose(width)
        chosen.append(k)
        depths = np.full(width, k)
        n = np.zeros(width, dtype=np.int64)
        for i in range(width):
            for j in range(1, k + 1):
                if rng.random() >= (0.9 if j == 1 else 0.05):
                    break
                n[i] = j
        reached, passed = position_counts(n, depths, k)
        ctrl.record(width, k, 1.0 + 0.1 * k, int(n.sum()), int(np.minimum(n + 1, depths).sum()), reached, passed)
    tail = chosen[-EXPLORE_EVERY * 4:]
    assert max(set(tail), key=tail.count) == 1
    assert abs(ctrl.position_acceptance(1) - 0.9) < 0.15 and ctrl.position_acceptance(2) < 0.3


def test_position_counts():
    import numpy as np

    from mtplx.depth import position_counts

    # rows drafted 3, 3, 1 tokens and kept 0, 2, 1 of them
    reached, passed = position_counts(np.array([0, 2, 1]), np.array([3, 3, 1]), 3)
    assert reached == [3, 1, 1] and passed == [2, 1, 0]


def test_a_draft_model_whose_steps_cost_a_target_step_falls_back_to_plain():
    """A draft model on a launch-bound GPU: each drafted token costs about a target step (the H200
    with Qwen2.5-Coder 1.5B / 0.5B), so even drafts that pass 80% of the time lose to plain decoding.
    The verify-shaped prior (0.15 per token) says otherwise until two depths are measured; then
    their own slope decides, and the controller falls back to depth 0 within a few explorations."""
    ctrl = DepthController(3)
    width, chosen = 1, []
    for _ in range(10 * EXPLORE_EVERY):
        k = ctrl.choose(width)
        chosen.append(k)
        # a round of depth k costs 1 + 0.9 k; each draft passes 80% of the time (a fraction per position)
        ctrl.record(width, k, 1.0 + 0.9 * k, int(0.8 * k), k, [1] * k, [0.8] * k)
    assert chosen[:4] == [0, 0, 3, 3]  # plain until timed, then the deepest depth until timed
    assert chosen.index(0) < EXPLORE_EVERY, chosen  # depth 0 is measured early (rounds 3-4)
    tail = chosen[-EXPLORE_EVERY * 4:]
    assert max(set(tail), key=tail.count) == 0, chosen


def test_one_controller_drafts_deep_at_one_stream_and_shallow_at_width_32():
    """An MTP head on a launch-bound GPU, one controller for both widths (rows leave and the batch
    narrows): at one stream a round of depth k costs 1 + 0.12 k (the head's steps; a verify of k + 1
    tokens costs what one of 1 does), at width 32 1 + 0.45 k (the verify's tokens cost there too).
    Drafts pass with conditional rates 0.55 / 0.75 / 0.8 by position. Tokens per unit of time: one
    stream 1.68 at depth 3 (best), width 32 1.07 at depth 1 (best; 0.97 at depth 3)."""
    rates = [0.55, 0.75, 0.8]
    ctrl = DepthController(3)
    chosen = {1: [], 32: []}
    for r in range(12 * EXPLORE_EVERY):
        width = 1 if r % 2 else 32
        k = ctrl.choose(width)
        chosen[width].append(k)
        reached, passed, run = [], [], 1.0
        for j in range(k):
            reached.append(run)
            run *= rates[j]
            passed.append(run)
        cost = 1.0 + (0.12 if width == 1 else 0.45) * k
        ctrl.record(width, k, cost, int(sum(passed)), k, reached, passed)
    for width, want in ((1, 3), (32, 1)):
        tail = chosen[width][-EXPLORE_EVERY * 2:]
        assert max(set(tail), key=tail.count) == want, (width, chosen[width])


def pipelined(ctrl, cost, rates, rounds, width=1, noisy=None):
    """Feed `ctrl` as the engine does (rounds.py): a round's depth is chosen two rounds before
    the round is read, and its time, cost[k] (or noisy(k, i) for the i-th timed round at depth k,
    where given), comes only when the round queued after it drafts as deep (None otherwise).
    Drafts pass with conditional rates by position. Returns the depths of the rounds."""
    queued, chosen, timed = [ctrl.choose(width), ctrl.choose(width)], [], {}
    for _ in range(rounds):
        queued.append(ctrl.choose(width))
        k = queued.pop(0)
        chosen.append(k)
        reached, passed, run = [], [], 1.0
        for j in range(k):
            reached.append(run)
            run *= rates[j]
            passed.append(run)
        seconds = None
        if queued[0] == k:
            i = timed[k] = timed.get(k, -1) + 1
            seconds = noisy(k, i) if noisy else cost[k]
        ctrl.record(width, k, seconds, round(sum(passed)), k, reached, passed)
    return chosen


H200_DRAFT = {0: 0.004, 1: 0.009, 2: 0.014}  # Qwen2.5-Coder 1.5B, its 0.5B draft: s a round by depth
H200_RATES = [0.89, 0.9]  # 2.7 tokens a depth-2 round


def test_h200_draft_model_rounds_timed_as_the_engine_times_them_settle_at_plain():
    """The H200 with Qwen2.5-Coder 1.5B and its 0.5B draft: a plain round 4 ms, depth 1 9 ms,
    depth 2 14 ms for 2.7 tokens: plain decoding pays most. Fed as the engine feeds it, the
    controller settles at depth 0 and still tries drafting now and then."""
    ctrl = DepthController(2)
    chosen = pipelined(ctrl, H200_DRAFT, H200_RATES, 20 * EXPLORE_EVERY)
    tail = chosen[-EXPLORE_EVERY * 8:]
    assert tail.count(0) > 0.8 * len(tail), chosen
    assert any(tail), chosen
    assert abs(ctrl.seconds[(1, 0)] - 0.004) < 1e-9 and abs(ctrl.seconds[(1, 2)] - 0.014) < 1e-9
    # tries that keep confirming plain decoding come less often: one in EXPLORE_MOST rounds, not EXPLORE_EVERY
    last = chosen[-4 * EXPLORE_MOST:]
    starts = sum(1 for a, b in zip(last, last[1:]) if a == 0 and b)
    assert 3 <= starts <= 4, chosen


def test_a_plain_round_timed_high_once_is_measured_again():
    """The H200's compiled draft chain (a fixed ~8 ms a round: depth 1 14.2 ms, depth 2 16.8 ms, plain
    4 ms), with the first timed plain round at 1.7x its time (the device busy elsewhere): depth 2
    then looks best, depth 1 worse, and a neighbour-only exploration would try depth 1 and never
    plain decoding again. Tries from the deepest depth alternate depth-1 and plain ones, so the
    controller still settles at depth 0."""
    cost = {0: 0.004, 1: 0.0142, 2: 0.0168}
    noisy = lambda k, i: cost[k] * (1.7 if (k, i) == (0, 1) else 1.0)  # i = 0: untimed (compiles)
    chosen = pipelined(DepthController(2), cost, H200_RATES, 20 * EXPLORE_EVERY, noisy=noisy)
    tail = chosen[-EXPLORE_EVERY * 8:]
    assert tail.count(0) > 0.8 * len(tail), chosen


def test_a_new_width_starts_from_the_nearest_measured_widths_costs():
    """Width 32 measured: drafting costs 3x a plain round there, and loses. A batch's last rows pass
    through narrower widths a few rounds each: width 16 starts from width 32's costs (plain),
    not from the assumed slope (which drafts deep at 50% acceptance)."""
    ctrl = DepthController(3, acceptance=0.5)
    drive(ctrl, 32, lambda k: 1.0 + 0.7 * k, 0.5)
    ctrl.explore = False
    assert ctrl.choose(32) == 0
    ctrl.explore = True
    assert ctrl.choose(16) == 0
    fresh = DepthController(3, acceptance=0.5)
    fresh.explore = False  # (no first plain rounds)
    assert fresh.choose(16) > 0  # nothing measured anywhere: the assumed slope


def test_no_tries_when_not_exploring():
    """A batch's last rows (`explore` off) keep the best depth: no first tries of plain decoding at
    a new width, no neighbour tries, and the width's own count of rounds does not move."""
    ctrl = DepthController(3)
    drive(ctrl, 8, lambda k: 1.0 + 0.02 * k, 0.9)
    tries = dict(vars(ctrl.widths[8]))
    ctrl.explore = False
    assert {ctrl.choose(8) for _ in range(4 * EXPLORE_MOST)} == {3}
    assert {ctrl.choose(2) for _ in range(4 * EXPLORE_MOST)} == {3}
    assert vars(ctrl.widths[8]) == tries and 2 not in ctrl.widths


def test_one_stream_where_mtp_loses_settles_on_plain():
    """The H200's width-1 GSM8K rounds: a plain round 2.6 ms (with the head
    left behind at depth 0, what plain decoding costs), depth 3 5.4 ms at ~1.55 tokens a verify
    (depth 1 4.0 ms, depth 2 4.7 ms): 0.38 tokens a ms plain against at most 0.36 drafting. The
    controller, fed as the engine feeds it, settles on plain decoding and still tries drafting."""
    import numpy as np

    from mtplx.depth import position_counts

    rng = np.random.default_rng(1)
    ctrl = DepthController(3)
    cost = {0: 2.6e-3, 1: 4.0e-3, 2: 4.7e-3, 3: 5.4e-3}
    chosen = []
    for _ in range(600):
        k = ctrl.choose(1)
        chosen.append(k)
        n = 0
        for j in range(1, k + 1):
            if rng.random() >= (0.45 if j == 1 else 0.2):
                break
            n = j
        reached, passed = position_counts(np.array([n]), np.array([k]), k)
        ctrl.record(1, k, cost[k], n, min(n + 1, k), reached, passed)
    tail = chosen[-200:]
    assert tail.count(0) > 0.9 * len(tail), chosen
    assert any(tail), chosen


def _mtp_rounds(ctrl, cost, rounds, slow=None, a=0.68, width=8):
    """Rounds as an MTP head gives them (8 rows, each draft passing with chance `a` once the one
    before it has), timed cost[k]; `slow` = {round index: seconds}: rounds timed that instead."""
    import numpy as np

    from mtplx.depth import position_counts

    rng, chosen = np.random.default_rng(0), []
    for i in range(rounds):
        k = ctrl.choose(width)
        chosen.append(k)
        n = np.minimum(np.argmin(np.append(rng.random((width, k)) < a, np.zeros((width, 1), bool), axis=1), axis=1), k)
        depths = np.full(width, k)
        reached, passed = position_counts(n, depths, k)
        ctrl.record(width, k, (slow or {}).get(i, cost[k]), int(n.sum()), int(np.minimum(n + 1, k).sum()), reached, passed)
    return chosen


# an MTP round on a host-bound GPU: the head's commit a fixed cost over plain, then the verify's slope
MTP_COST = {0: 3.0e-3, 1: 4.8e-3, 2: 5.1e-3, 3: 5.4e-3}


def test_one_slow_round_does_not_move_the_depth_that_pays():
    """Depth 3 pays (2.44 tokens for 5.4 ms against depth 2's 2.14 for 5.1). One round of it timed
    40 ms (a host hiccup): the depth's cost is the median of its last rounds, so the controller stays
    (an average taking 0.3 of each round would put depth 3 at 15.8 ms, and run depth 2 until tries of
    depth 3 brought the average back)."""
    prior = [0.68] * 4
    ctrl = DepthController(3, prior=prior)
    chosen = _mtp_rounds(ctrl, MTP_COST, 200, slow={60: 0.040}, a=0.68)
    after = chosen[61:200]
    assert after.count(3) > 0.9 * len(after), chosen


def test_from_plain_decoding_the_deepest_depth_is_tried_again():
    """Depth 3 timed high once while it was the only drafting depth measured (the device busy
    elsewhere), so plain decoding looks best. Depth 1 loses to plain (the head's commit is a fixed
    cost), and tries from plain decoding alternate depth 1 and the deepest depth: depth 3 is
    measured again and the controller goes back to it (with tries of depth 1 only, plain for good)."""
    from mtplx import depth

    ctrl = DepthController(3, prior=[0.68] * 4)
    ctrl.record(8, 3, None, 0, 0)  # (a shape's first round: untimed)
    ctrl.record(8, 3, 0.030, 2, 3, [1, 1, 1], [1, 1, 0])  # one high time: plain looks best
    ctrl.record(8, 0, None, 0, 0)
    ctrl.record(8, 0, MTP_COST[0], 0, 0)
    ctrl.widths[8] = depth._Tries(rounds=10)  # (past the first tries of plain decoding)
    assert ctrl.choose(8) == 0
    chosen = _mtp_rounds(ctrl, MTP_COST, 300)
    tail = chosen[-100:]
    assert tail.count(3) > 0.8 * len(tail), chosen
