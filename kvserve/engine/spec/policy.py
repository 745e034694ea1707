"""How many drafts to propose: per step from the batch, per request from its acceptance.

A decode step reads every weight to produce one token per request; a verify step with ``k``
drafts carries ``B * (k + 1)`` tokens for about the same cost while those tokens are few enough
that reading the weights still dominates. So:

- batch: ``k_batch = min(k_max, verify_token_budget // B - 1)``, and no drafts at all above
  ``max_batch`` decoding requests (``disable_by_batch_size``, by default
  ``verify_token_budget // 2``: the batch where even one draft each leaves the budget);
- request: the j-th draft is only used if the j - 1 before it are accepted, with probability
  ``a^j`` for a per-draft acceptance rate ``a`` (tracked as a moving average per request).
  Drafts stop where that falls below ``MIN_DRAFT_GAIN``; at least one is always proposed, so
  the rate keeps being measured and recovers when the text turns repetitive again;
- step: whether to draft at all, from the measured wall time per emitted token of drafted and
  plain steps at this batch size (``DraftOrPlain``), since a step costs more than its forward.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque

from kvserve.config import SpeculativeConfig
from kvserve.engine.request import Request

MIN_DRAFT_GAIN = 0.2  # expected tokens a draft must bring to be proposed
EMA_WEIGHT = 0.3  # weight of the latest step in a request's acceptance rate


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def k_for_batch(self, num_decoding: int) -> int:
        c = self.config
        if num_decoding == 0 or num_decoding > c.max_batch:
            return 0
        return max(1, min(c.num_speculative_tokens, c.verify_token_budget // num_decoding - 1))

    @staticmethod
    def k_for_request(req: Request, k_batch: int) -> int:
        a = req.spec_acceptance
        if a >= 1.0:
            return k_batch
        if a <= 0.0:
            return min(1, k_batch)
        return max(min(1, k_batch), min(k_batch, int(math.log(MIN_DRAFT_GAIN) / math.log(a))))

    @staticmethod
    def observe(req: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step kept ``num_accepted`` of ``num_drafts``: update the per-draft rate."""
        # The drafts checked are the accepted ones plus the first rejected one, if any.
        checked = num_accepted + (num_accepted < num_drafts)
        rate = num_accepted / checked
        req.spec_acceptance += EMA_WEIGHT * (rate - req.spec_acceptance)


MEASURED_FROM = 4  # decoding requests from which the times decide; below, the rule alone
WARMUP_STEPS = 8  # measured steps of each side per batch-size bucket before the times decide
WINDOW = 8  # a side's cost: the median of its latest steps (a one-off stall does not decide)
PROBE_FIRST = 16  # steps of a bucket from a new choice to the first look at the side not taken
PROBE_EVERY = 192  # the longest gap between two looks reached by doubling
PROBE_STEPS = 4
LOOK_SHARE = 0.01  # the most a bucket's looks may cost, as a share of the chosen side's time
PROBE_MAX = 4096  # the longest gap between two looks however much a look costs
CONTINUOUS_S = 0.05  # a step launched longer than this after the last one ended follows an idle gap


class DraftOrPlain:
    """Whether a step drafts, from what each kind of step measurably costs per emitted token.

    The rule in ``SpecPolicy`` sizes the drafts from the verify cost a forward pass has; a step
    costs more than its forward. A drafted step waits for its accepted tokens before the next
    can be scheduled, while a plain step lets the next be launched ahead (async scheduling), and
    proposing and verifying take host time. Where that outweighs what the accepted drafts save
    (large batches, or text the drafts rarely match), decoding without drafts is faster. So per
    batch-size bucket (powers of two) the wall time per emitted token of pure decode steps is
    kept for both kinds (the median of the latest ``WINDOW``), each is tried ``WARMUP_STEPS`` times
    (drafted first in the engine's first bucket), then the cheaper one runs, with the other tried
    again for ``PROBE_STEPS`` steps at a time: first ``PROBE_FIRST`` steps after the choice, then at
    gaps that double while the looks keep the choice, up to ``PROBE_EVERY`` steps. A changed choice
    is looked at again soon. The warm-up steps are a request's first, where an n-gram lookup has the
    least text to match: a choice they got wrong is undone within a few dozen steps, not after
    hundreds.

    A look costs what its steps took beyond what the chosen side would have taken for the same
    tokens, and that can be far more than its median step says: a draft model's first drafted step
    after plain ones catches up on every token decoded since, and on the prompts of the requests
    that came meanwhile (at batch 32 on an H100, a 1B draft's catch-up took 20-90 ms, up to
    thirteen plain steps of an 8B target). So the gap after a look is also long enough for the look to cost at most
    ``LOOK_SHARE`` of the chosen side's time over it (up to ``PROBE_MAX`` steps). Only steps this
    class scheduled as a look are charged to it: a seeded request's drafted steps, which the rule
    decides, and a drafted step in which no request found a draft are not looks. A bucket met for
    the first time (the batch grows or drains) warms up with the side its nearest decided bucket
    chose first (the larger of two as near), so a drain past buckets where drafting loses does not
    open each with drafted steps.

    Below ``MEASURED_FROM`` decoding requests the rule alone decides: a verify step of up to
    nine rows per request costs about one plain step there (1.09-1.13 on an H200 at batch 1), so
    drafting pays whenever drafts are kept at all, and a request whose drafts are rejected
    already gets fewer. (On the H200, timing the two sides at batch 1 also misjudged drafted
    n-gram steps as dearer than plain ones; the rule's drafting ran 2.00x there.)

    A seeded request sampling at temperature > 0 draws different numbers from a verify step than
    from a plain one, so while one decodes, the choice is the rule's alone and its seed
    reproduces its output. Greedy output does not depend on the choice."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.recent: dict[tuple[int, bool], deque[float]] = {}
        self.measured: dict[tuple[int, bool], int] = {}
        self.decided: dict[int, int] = {}
        # per bucket: [the next look's first step, the gap before it, the side chosen]
        self.looks: dict[int, list] = {}
        self.emitted: dict[tuple[int, bool], deque[int]] = {}  # tokens of a side's latest steps
        self.look_spent: dict[int, list] = {}  # per bucket: [seconds, tokens] of the current look
        # Per bucket: look steps scheduled and not yet recorded. The next step is scheduled
        # before the last one is recorded (async scheduling), so a look's last step is charged
        # to the next look; every look is charged four steps all the same.
        self.look_owed: dict[int, int] = {}
        self.last_end: float | None = None

    def drafts(self, num_decoding: int) -> bool:
        """Decide for the next step of ``num_decoding`` decoding requests."""
        if num_decoding < MEASURED_FROM:
            return True
        b = num_decoding.bit_length()
        n = self.decided.get(b, 0)
        self.decided[b] = n + 1
        first = self._first_side(b)
        for side in (first, not first):
            if self.measured.get((b, side), 0) < WARMUP_STEPS:
                return side
        drafted, plain = self.cost((b, True)), self.cost((b, False))
        better = drafted <= plain
        look = self.looks.get(b)
        if look is None or look[2] != better:  # a first or a changed choice: look again soon
            look = self.looks[b] = [n + PROBE_FIRST, PROBE_FIRST, better]
            self.look_spent.pop(b, None)
            self.look_owed[b] = 0
        elif n >= look[0] + PROBE_STEPS:  # a look that kept the choice: the next one later
            seconds, tokens = self.look_spent.pop(b, (0.0, 0))
            self.look_owed[b] = min(self.look_owed.get(b, 0), 1)  # the look's last step, in flight
            # Tokens the chosen side would have emitted beyond the look's in the look's time, over
            # the tokens a step of it emits: the steps that make up for the look.
            lost = seconds / max(drafted if better else plain, 1e-9) - tokens
            per_step = max(statistics.mean(self.emitted[b, better]), 1)
            paid_for = math.ceil(lost / (LOOK_SHARE * per_step)) if lost > 0 else 0
            look[1] = max(min(2 * look[1], PROBE_EVERY), min(paid_for, PROBE_MAX))
            look[0] = n + look[1]
        if look[0] <= n < look[0] + PROBE_STEPS:
            self.look_owed[b] = self.look_owed.get(b, 0) + 1
            return not better
        return better

    def _first_side(self, b: int) -> bool:
        """The side a bucket warms up with: its nearest decided bucket's choice; drafted first
        in an engine's first bucket."""
        if not self.looks:
            return True
        return self.looks[min(self.looks, key=lambda d: (abs(d - b), -d))][2]

    def record(self, num_decoding: int, drafted: bool, tokens: int, launched: float, pure: bool) -> None:
        """A step launched at ``launched`` ends now; a pure decode step emitted ``tokens``."""
        now = self.clock()
        last, self.last_end = self.last_end, now
        if not pure or last is None or tokens <= 0 or launched - last > CONTINUOUS_S:
            return
        # From the previous step's end: a step launched ahead overlaps it, and a step launched
        # after it also pays the host time between the two.
        key = (num_decoding.bit_length(), drafted)
        self.recent.setdefault(key, deque(maxlen=WINDOW)).append((now - last) / tokens)
        self.emitted.setdefault(key, deque(maxlen=WINDOW)).append(tokens)
        self.measured[key] = self.measured.get(key, 0) + 1
        look = self.looks.get(key[0])
        if look is not None and drafted != look[2] and self.look_owed.get(key[0], 0) > 0:  # a look's step
            self.look_owed[key[0]] -= 1
            spent = self.look_spent.setdefault(key[0], [0.0, 0])
            spent[0] += now - last
            spent[1] += tokens

    def cost(self, key: tuple[int, bool]) -> float:
        """Seconds per emitted token of a (bucket, drafted) side."""
        return statistics.median(self.recent[key])

    def costs(self) -> dict[tuple[int, bool], float]:
        return {key: self.cost(key) for key in sorted(self.recent)}
