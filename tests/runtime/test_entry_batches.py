"""entry_batches: as few batches as fit the token budget, cut as evenly as possible."""

import random

from hybridcache.services.runtime.runner import entry_batches


def _greedy(lengths, max_tokens):
    """The plain greedy cut (close a batch when one more segment would pass the budget), as lengths."""
    batches = []
    for n in sorted(lengths):
        if batches and (len(batches[-1]) + 1) * n <= max_tokens:
            batches[-1].append(n)
        else:
            batches.append([n])
    return batches


def test_equal_segments_split_evenly():
    assert [len(b) for b in entry_batches([1024] * 18, 16384)] == [9, 9]
    assert [len(b) for b in entry_batches([1024] * 32, 16384)] == [16, 16]
    assert [len(b) for b in entry_batches([1024] * 33, 16384)] == [11, 11, 11]
    assert [len(b) for b in entry_batches([1024] * 14, 16384)] == [14]


def test_invariants_on_random_lengths():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice((rng.randint(9, 300), rng.randint(9, 3000))) for _ in range(rng.randint(1, 40))]
        budget = rng.choice((512, 2048, 8192))
        batches = entry_batches(lengths, budget)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(lengths)))  # every segment once
        assert [lengths[i] for i in flat] == sorted(lengths)  # in increasing length
        greedy = _greedy(lengths, budget)
        assert len(batches) == len(greedy)  # no more batches than needed
        for b in batches:  # within budget, unless one segment alone is over it
            assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= budget
        # never a larger batch than the greedy cut's largest
        costs = [len(b) * max(lengths[i] for i in b) for b in batches]
        assert max(costs) <= max(len(b) * max(b) for b in greedy)


def test_one_over_budget_segment_goes_alone():
    assert entry_batches([5, 100, 7, 30000, 8], 16384) == [[0, 2, 4, 1], [3]]
    assert entry_batches([], 100) == []
