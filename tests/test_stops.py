"""Stop strings that end inside a token, or that a multi-token round ran past."""

from mtplx import stops

PIECES = ["Hel", "lo", " wor", "ld", "\n\n", "Q:", " more"]


def decode(ids):
    return "".join(PIECES[i] for i in ids)


def test_cut_keeps_the_token_that_completes_the_stop_and_the_text_before_it():
    tokens = [0, 1, 2, 3, 4, 5, 6]  # "Hello world\n\nQ: more": a round emitted past the stop
    assert stops.cut(decode, tokens, ["\nQ:"]) == (6, "Hello world\n")


def test_cut_takes_the_first_stop_in_the_text_whichever_is_listed_first():
    assert stops.cut(decode, [0, 1, 2, 3, 4, 5], ["Q:", "wor"]) == (3, "Hello ")


def test_a_stop_inside_one_token_and_no_stop_at_all():
    assert stops.cut(decode, [0, 1, 2], ["el"]) == (1, "H")
    assert stops.cut(decode, [0, 1, 2], ["ell"]) == (2, "H")  # across two tokens: both kept
    assert stops.cut(decode, [0, 1, 2], ["xyz", ""]) is None
    assert stops.in_tail(decode, [0, 1, 2, 3], ["o w"]) and not stops.in_tail(decode, [0, 1], ["o w"])
