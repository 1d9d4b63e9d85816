"""What a job builds and runs eagerly round by round, as a user runs it (`mtplx-batch run`, one process).

    python -m benchmarks.adaptive_phases -- run jobs/eval-mtp.yaml --set input.limit=16 --restart --quiet
    python -m benchmarks.adaptive_phases --attr mtplx.depth.PRIOR=0 -- run jobs/eval-mtp.yaml ...

Watches, with the rounds landed so far: every new compiled program (the verify bank's and the MTP
head's; built by a real call or ahead by a warm-up), every eager forward of the MTP head outside a
program (the head's catch-up after rounds at depth 0, an eager proposal, an eager commit) with its
query length, every eager verify; the depths the rounds drafted; and the admissions (rows each prefill
took). Prints one line per event and a summary: what was built or run eagerly at a shape that no program or earlier eager call had met
("new shapes after round 1": on a GPU each is a trace, a graph and possibly kernel builds).
"""

from __future__ import annotations

from collections import Counter

from benchmarks.fresh_cli import set_attrs


class Watch:
    def __init__(self):
        self.rounds, self.events, self.depths = 0, [], Counter()
        self.eager_shapes = set()
        self.consumer = []  # seconds the caller took per result yielded
        self.admitted = []  # rows of each admission's prefill

    def event(self, kind: str, what) -> None:
        self.events.append((self.rounds, kind, what))
        print(f"round {self.rounds}: {kind} {what}", flush=True)

    def install(self):
        from mtplx import drafters, graphbank, mtp_draft, spec_rounds

        watch = self

        def wrap_get(cls, name, kind, key_of):
            inner = getattr(cls, name)

            def get(self, key, *a):
                if key not in self._programs:
                    watch.event(kind, key_of(key))
                return inner(self, key, *a)

            setattr(cls, name, get)

        wrap_get(graphbank.CompiledVerifyBank, "_program", "verify program", lambda k: k)
        wrap_get(mtp_draft.CompiledDraftBank, "_get", "head program", lambda k: k[:6])

        commit, eager_commit = drafters.MtpDrafter._commit, drafters.MtpDrafter._commit_eager

        def _commit(self, n, nxt, counts, most, verify_in, hidden, exact=False, following=None):
            if self.behind:
                watch.event("head catch-up", (self.cache.batch, len(self.behind), "rounds behind"))
            return commit(self, n, nxt, counts, most, verify_in, hidden, exact, following)

        def _commit_eager(self, verify_in, n, nxt, hidden, lookup):
            watch.eager_head((self.cache.batch, verify_in.shape[1]))
            return eager_commit(self, verify_in, n, nxt, hidden, lookup)

        drafters.MtpDrafter._commit, drafters.MtpDrafter._commit_eager = _commit, _commit_eager
        eager = drafters.MtpDrafter._propose_eager

        def _propose_eager(self, K, sampler, u):
            watch.event("eager proposal", (self.cache.batch, K))
            return eager(self, K, sampler, u)

        drafters.MtpDrafter._propose_eager = _propose_eager
        verify = graphbank.CompiledVerifyBank.eager

        def eager_verify(self, tokens, cache):
            watch.event("eager verify", tuple(tokens.shape))
            return verify(self, tokens, cache)

        graphbank.CompiledVerifyBank.eager = eager_verify
        land = spec_rounds.SpeculativeRounds._land

        def _land(self, slots, cache, flight, out, seconds):
            watch.rounds += 1
            watch.depths[flight.K] += 1
            return land(self, slots, cache, flight, out, seconds)

        spec_rounds.SpeculativeRounds._land = _land
        rounds_gen = spec_rounds.SpeculativeRounds._round

        def _round(self, *a, **k):  # the time the caller spends between results (the job's writes)
            import time

            for res in rounds_gen(self, *a, **k):
                t = time.perf_counter()
                yield res
                watch.consumer.append(time.perf_counter() - t)

        spec_rounds.SpeculativeRounds._round = _round
        from mtplx import prefill

        run = prefill.Prefiller.run

        def admission(self, rows, *a, **k):  # each admission's prefill (an eager launch and graph build on a GPU)
            watch.admitted.append(len(rows))
            return run(self, rows, *a, **k)

        prefill.Prefiller.run = admission

    def eager_head(self, shape) -> None:
        new = shape not in self.eager_shapes
        self.eager_shapes.add(shape)
        self.event("eager head commit" + (" NEW SHAPE" if new else ""), shape)

    def summary(self) -> str:
        kinds = Counter(k for _, k, _ in self.events)
        late = Counter(k for r, k, _ in self.events if r > 1)
        depths = " ".join(f"{d}:{n}" for d, n in sorted(self.depths.items()))
        return (f"rounds {self.rounds}; depths (K) {depths}\n"
                f"all events: {dict(kinds)}\n"
                f"after round 1: {dict(late)}\n"
                f"eager head commit shapes (W, L): {sorted(self.eager_shapes)}\n"
                f"caller's time per result yielded: {len(self.consumer)} results, "
                f"max {1000 * max(self.consumer, default=0):.1f} ms, sum {sum(self.consumer):.3f} s, "
                f"over 5 ms: {sum(c > 0.005 for c in self.consumer)}\n"
                f"admissions: {len(self.admitted)} (rows {self.admitted})")


def main(argv=None):
    rest = set_attrs(argv, __doc__)
    watch = Watch()
    watch.install()
    from pipelines.cli.commands import main as cli

    try:
        cli(args=rest, prog_name="mtplx-batch", standalone_mode=False)
    finally:
        print(watch.summary(), flush=True)


if __name__ == "__main__":
    main()
