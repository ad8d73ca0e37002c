"""The vectorised `pick_evictions` / `pick_grows` against the heap merges they replaced, on random states.

The reference below is the heap implementation as it was (its two loops merged into one): each layer nominates
its next item, the least key (probability, -residents now, layer, expert) for evictions / (-probability, residents now,
layer, expert) for grows leaves first. Random states draw arbitrary resident sets (not only ranking prefixes),
probabilities from a few values (many ties) that need not follow the committed rankings, and per-layer limits.
"""

from __future__ import annotations

import heapq
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rimuru.experts.adjuster import AdjusterState, Expert, pick_evictions, pick_grows


def _reference_merge(state: AdjusterState, n: int, evict: bool) -> list[Expert]:
    """The heap merge as it was: each layer nominates its next item; evictions take residents from the least
    popular up while the layer is under its limit, grows non-residents in ranking order."""
    E = state.rankings.shape[1]
    resident = [set(r) for r in state.resident]
    ranks = [state.rankings[layer][::-1] if evict else state.rankings[layer] for layer in range(len(resident))]
    order = [[int(e) for e in ranks[layer] if (e in resident[layer]) == evict] for layer in range(len(resident))]
    heap: list[tuple[float, int, int, int]] = []

    def nominate(layer: int) -> None:
        if order[layer] and (not evict or E - len(resident[layer]) < state.limit(layer)):
            e = order[layer][0]
            p = float(state.probabilities[layer, e])
            k = len(resident[layer])
            heapq.heappush(heap, (p, -k, layer, e) if evict else (-p, k, layer, e))

    for layer in range(len(resident)):
        nominate(layer)
    out: list[Expert] = []
    while heap and len(out) < n:
        _, _, layer, e = heapq.heappop(heap)
        out.append((layer, e))
        order[layer].pop(0)
        if evict:
            resident[layer].discard(e)
        else:
            resident[layer].add(e)
        nominate(layer)
    return out


def _reference_pick_evictions(state: AdjusterState, n: int) -> list[Expert]:
    return _reference_merge(state, n, evict=True)


def _reference_pick_grows(state: AdjusterState, n: int) -> list[Expert]:
    return _reference_merge(state, n, evict=False)


@st.composite
def states(draw: st.DrawFn) -> AdjusterState:
    L = draw(st.integers(1, 6))
    E = draw(st.integers(2, 16))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # a few distinct values (ties within and across layers), sometimes float32, sometimes a zero among them
    values = rng.choice([0.0, 0.01, 0.05, 0.1, 0.125, 0.2, 0.5], size=draw(st.integers(1, 4)), replace=False)
    probs = rng.choice(values, size=(L, E)).astype(draw(st.sampled_from([np.float64, np.float32])))
    how = draw(st.sampled_from(["random", "by_probs", "noisy"]))
    if how == "random":  # committed order unrelated to the estimate
        rankings = np.stack([rng.permutation(E) for _ in range(L)])
    elif how == "by_probs":  # committed order = the estimate's (monotone sequences)
        rankings = np.argsort(-probs, axis=1, kind="stable")
    else:  # the estimate's order with a few swaps
        rankings = np.argsort(-probs, axis=1, kind="stable")
        for layer in range(L):
            for _ in range(int(rng.integers(0, 3))):
                i, j = rng.integers(0, E, size=2)
                rankings[layer, [i, j]] = rankings[layer, [j, i]]
    shape = draw(st.sampled_from(["random", "prefix", "all", "none"]))
    resident: list[frozenset[int] | set[int]] = []
    for layer in range(L):
        if shape == "random":
            r = {int(e) for e in np.flatnonzero(rng.random(E) < rng.random())}
        elif shape == "prefix":
            r = set(rankings[layer, :int(rng.integers(0, E + 1))].tolist())
        elif shape == "all":
            r = set(range(E))
        else:
            r = set()
        resident.append(frozenset(r) if layer % 2 else r)
    if draw(st.booleans()):
        limit: int | list[int] = draw(st.integers(0, E))
    else:
        limit = [int(x) for x in rng.integers(0, E + 1, size=L)]
    return AdjusterState(shortfall_mid_pages=0, free_mid_pages=0, resident=resident, probabilities=probs,
                         rankings=rankings, offload_limit=limit)


def _check(got: list[Expert], want: list[Expert]) -> None:
    assert got == want
    assert all(type(layer) is int and type(e) is int for layer, e in got)


@settings(max_examples=400, deadline=None)
@given(state=states(), extra=st.integers(0, 5), frac=st.floats(0.0, 1.0))
def test_pick_evictions_matches_heap_merge(state: AdjusterState, extra: int, frac: float) -> None:
    total = sum(len(r) for r in state.resident)
    for n in (0, 1, int(frac * total), total, total + extra):
        _check(pick_evictions(state, n), _reference_pick_evictions(state, n))


@settings(max_examples=400, deadline=None)
@given(state=states(), extra=st.integers(0, 5), frac=st.floats(0.0, 1.0))
def test_pick_grows_matches_heap_merge(state: AdjusterState, extra: int, frac: float) -> None:
    E = state.rankings.shape[1]
    total = sum(E - len(r) for r in state.resident)
    for n in (0, 1, int(frac * total), total, total + extra):
        _check(pick_grows(state, n), _reference_pick_grows(state, n))


def test_negative_n_picks_nothing() -> None:
    probs = np.full((2, 4), 0.25)
    rankings = np.tile(np.arange(4), (2, 1))
    st_ = AdjusterState(0, 0, [{0, 1}, {2}], probs, rankings, offload_limit=4)
    assert pick_evictions(st_, -1) == [] and pick_grows(st_, -3) == []


def test_uniform_evictions_spread_evenly_over_layers() -> None:
    L, E = 6, 16
    probs = np.full((L, E), 1.0 / E)
    rankings = np.stack([np.random.default_rng(layer).permutation(E) for layer in range(L)])
    state = AdjusterState(0, 0, [set(range(E)) for _ in range(L)], probs, rankings, offload_limit=10)
    evict = pick_evictions(state, 5 * L + 3)
    assert evict == _reference_pick_evictions(state, 5 * L + 3)
    per_layer = Counter(layer for layer, _ in evict)
    assert max(per_layer.values()) - min(per_layer.values()) <= 1
    assert evict[:L] == [(layer, int(rankings[layer, -1])) for layer in range(L)]  # one round over the layers first
    # each layer gives its least popular (last ranked) experts first
    for layer in range(L):
        assert [e for lay, e in evict if lay == layer] == rankings[layer, ::-1][:per_layer[layer]].tolist()
    # grows back, uniform: the layer with the fewest residents first, round robin
    after = [set(range(E)) - {e for lay, e in evict if lay == layer} for layer in range(L)]
    back = AdjusterState(0, 0, after, probs, rankings, offload_limit=10)
    grows = pick_grows(back, len(evict))
    assert grows == _reference_pick_grows(back, len(evict))
    assert Counter(layer for layer, _ in grows) == per_layer


def test_many_experts_match_heap_merge() -> None:
    # more than 256 experts a layer: resident ids do not fit a byte (the other path that reads the sets)
    L, E = 3, 300
    rng = np.random.default_rng(7)
    probs = rng.choice([0.001, 0.002, 0.004], size=(L, E))
    rankings = np.stack([rng.permutation(E) for _ in range(L)])
    resident = [{int(e) for e in np.flatnonzero(rng.random(E) < 0.6)} for _ in range(L)]
    state = AdjusterState(0, 0, resident, probs, rankings, offload_limit=[200, 150, 290])
    for n in (1, 50, 1000):
        _check(pick_evictions(state, n), _reference_pick_evictions(state, n))
        _check(pick_grows(state, n), _reference_pick_grows(state, n))
