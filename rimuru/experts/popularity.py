"""Expert popularity: per MoE layer, how often the router picks each expert, and the ranking it implies.

Three sources, one type (`ExpertPopularity`):
  * a ranking file written by `rimuru profile` (JSON, format below), loaded with validation;
  * `uniform(...)`: every expert equally popular (the fallback when no file is given);
  * `zipf(...)`: a seeded skewed router for simulations and benchmarks (power law, see below).
`OnlinePopularity` keeps a decayed (EMA) count of routing decisions, smoothed by a prior that does not decay (a
file, or uniform shares), and says when the ranking of a layer has changed enough to re-rank (hysteresis).

Ranking file (`probabilities[l][e]` = share of layer l's routed (token, expert) assignments that went
to expert e; each layer sums to 1):

    {"model": "qwen1.5-moe-a2.7b", "num_layers": 24, "num_experts": 60, "num_prompts": 500,
     "date": "2026-11-30T12:00:00+00:00", "probabilities": [[0.021, 0.013, ...], ...]}
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

_SUM_TOLERANCE = 1e-3
FORMAT_KEYS = ("model", "num_layers", "num_experts", "num_prompts", "date", "probabilities")


class PopularityFileError(ValueError):
    """A ranking file that is missing, malformed or does not match the model."""


def _rank(probs: np.ndarray) -> np.ndarray:
    # Most popular first; ties broken by the lower expert id (stable sort), so rankings are deterministic.
    return np.argsort(-probs, axis=-1, kind="stable")


@dataclass(frozen=True, eq=False)
class ExpertPopularity:
    model: str
    probabilities: np.ndarray  # [L, E] float64, each row sums to 1
    num_prompts: int = 0
    date: str = ""
    rankings: np.ndarray = field(init=False, repr=False)  # [L, E] expert ids, most popular first

    def __post_init__(self) -> None:
        p = np.array(self.probabilities, dtype=np.float64)
        _validate_probabilities(p)
        p.setflags(write=False)
        object.__setattr__(self, "probabilities", p)
        r = _rank(p)
        r.setflags(write=False)
        object.__setattr__(self, "rankings", r)

    @property
    def num_layers(self) -> int:
        return self.probabilities.shape[0]

    @property
    def num_experts(self) -> int:
        return self.probabilities.shape[1]

    def ranking(self, layer: int) -> list[int]:
        return self.rankings[layer].tolist()

    # ------------------------------------------------------------------ sources

    @classmethod
    def from_counts(cls, model: str, counts: np.ndarray, num_prompts: int = 0) -> ExpertPopularity:
        """Each layer's shares of its routed (token, expert) assignments `counts` [L, E] (the ranking file's
        probabilities), dated now; ValueError naming a layer that routed none."""
        counts = np.asarray(counts, dtype=np.float64)
        totals = counts.sum(axis=1, keepdims=True)  # [L, 1]
        empty = np.flatnonzero(totals[:, 0] <= 0)
        if empty.size:
            raise ValueError(f"MoE layer {int(empty[0])} routed no tokens: nothing to estimate its popularity from")
        return cls(model, counts / totals, num_prompts=num_prompts, date=_now())

    @classmethod
    def uniform(cls, model: str, num_layers: int, num_experts: int) -> ExpertPopularity:
        return cls(model, np.full((num_layers, num_experts), 1.0 / num_experts), date=_now())

    @classmethod
    def zipf(cls, model: str, num_layers: int, num_experts: int, exponent: float, seed: int) -> ExpertPopularity:
        """Seeded skewed router: in each layer the expert of popularity rank r (1-based) gets a share
        proportional to r^-exponent, and which expert holds which rank is a random permutation per layer
        (numpy default_rng(seed)). exponent 0 is uniform; real MoE routers measured in the literature
        sit around 0.5-1.2."""
        if exponent < 0 or not math.isfinite(exponent):
            raise ValueError(f"zipf exponent must be a finite number >= 0, got {exponent}")
        weights = np.arange(1, num_experts + 1, dtype=np.float64) ** -exponent
        weights /= weights.sum()
        rng = np.random.default_rng(seed)
        probs = np.empty((num_layers, num_experts))
        for layer in range(num_layers):
            probs[layer, rng.permutation(num_experts)] = weights
        return cls(model, probs, date=_now())

    @classmethod
    def from_routing(cls, model: str, name: str, num_layers: int, num_experts: int, seed: int) -> ExpertPopularity:
        """`uniform` or `zipf:S` (the command-line form of the synthetic routers)."""
        if name == "uniform":
            return cls.uniform(model, num_layers, num_experts)
        kind, _, arg = name.partition(":")
        if kind == "zipf":
            try:
                s = float(arg or "1.0")
            except ValueError:
                raise ValueError(f"bad routing {name!r}: zipf exponent must be a number, as in zipf:1.0") from None
            return cls.zipf(model, num_layers, num_experts, s, seed)
        raise ValueError(f"unknown routing {name!r}; use 'uniform' or 'zipf:S' (e.g. zipf:1.0)")

    # ------------------------------------------------------------------ file

    def to_json(self) -> dict:
        return {"model": self.model, "num_layers": self.num_layers, "num_experts": self.num_experts,
                "num_prompts": self.num_prompts, "date": self.date,
                "probabilities": self.probabilities.tolist()}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()) + "\n")

    @classmethod
    def load(cls, path: str | Path, num_layers: int | None = None,
             num_experts: int | None = None) -> ExpertPopularity:
        """Reads a ranking file; raises PopularityFileError saying what is wrong (and where)."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise PopularityFileError(f"ranking file {p} does not exist") from None
        except json.JSONDecodeError as e:
            raise PopularityFileError(f"ranking file {p} is not valid JSON: {e}") from None
        try:
            return cls.from_json(data, num_layers, num_experts)
        except PopularityFileError as e:
            raise PopularityFileError(f"ranking file {p}: {e}") from None

    @classmethod
    def from_json(cls, data: object, num_layers: int | None = None,
                  num_experts: int | None = None) -> ExpertPopularity:
        if not isinstance(data, dict):
            raise PopularityFileError(f"expected a JSON object, got {type(data).__name__}")
        missing = [k for k in FORMAT_KEYS if k not in data]
        if missing:
            raise PopularityFileError(f"missing keys {missing}; a ranking file has {list(FORMAT_KEYS)}")
        rows = data["probabilities"]
        if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
            raise PopularityFileError("'probabilities' must be a non-empty list of per-layer lists")
        widths = {len(r) for r in rows}
        if len(widths) != 1:
            raise PopularityFileError(f"layers list different numbers of experts: {sorted(widths)}")
        try:
            probs = np.array(rows, dtype=np.float64)
        except (TypeError, ValueError):
            raise PopularityFileError("'probabilities' must hold numbers only") from None
        L, E = probs.shape
        if (data["num_layers"], data["num_experts"]) != (L, E):
            raise PopularityFileError(f"header says {data['num_layers']} layers x {data['num_experts']} experts, "
                                      f"'probabilities' is {L} x {E}")
        if num_layers is not None and L != num_layers or num_experts is not None and E != num_experts:
            raise PopularityFileError(f"it is for {L} MoE layers x {E} experts, the model has "
                                      f"{num_layers} x {num_experts} (ranking of another model?)")
        if not isinstance(data["num_prompts"], int) or data["num_prompts"] < 0:
            raise PopularityFileError(f"num_prompts must be a non-negative integer, got {data['num_prompts']!r}")
        try:
            return cls(str(data["model"]), probs, num_prompts=data["num_prompts"], date=str(data["date"]))
        except ValueError as e:
            raise PopularityFileError(str(e)) from None


def _validate_probabilities(p: np.ndarray) -> None:
    if p.ndim != 2 or p.shape[0] == 0 or p.shape[1] == 0:
        raise ValueError(f"probabilities must be a non-empty [layers, experts] array, got shape {p.shape}")
    if not np.isfinite(p).all() or (p < 0).any():
        layer = int(np.argwhere(~np.isfinite(p) | (p < 0))[0, 0])
        raise ValueError(f"layer {layer}: probabilities must be finite and >= 0")
    sums = p.sum(axis=1)
    bad = np.flatnonzero(np.abs(sums - 1.0) > _SUM_TOLERANCE)
    if bad.size:
        raise ValueError(f"layer {int(bad[0])}: probabilities sum to {sums[bad[0]]:.6f}, expected 1")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class OnlinePopularityConfig:
    decay: float = 0.99  # EMA factor per update (one update per engine step): half-life ~69 steps
    # The prior counts as this many routed assignments per layer, at every update: it is added to the decayed counts,
    # never decayed with them. An expert the last few hundred steps never routed is then estimated at a small share
    # of its prior, not at zero: a decayed prior left such experts at ~1e-20, free to evict by the cost model,
    # and under traffic whose routing moves with the requests (on the H100, Qwen1.5-MoE shapes, multi-turn chats)
    # the experts evicted so were read ~2x more than estimated a few seconds later, 140-190 of them out.
    prior_weight: float = 1000.0
    rerank_margin: float = 0.25  # re-rank only if an expert beats one ranked above it by > 25 %
    # `observe` looks for stale layers every this many updates: the counts move over tens of steps (the half-life
    # above), and the check is the costliest host work of an update (a gather and a running minimum over [L, E])
    rerank_interval: int = 8

    def __post_init__(self) -> None:
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.prior_weight < 0 or self.rerank_margin < 0:
            raise ValueError("prior_weight and rerank_margin must be >= 0")
        if self.rerank_interval < 1:
            raise ValueError(f"rerank_interval must be >= 1, got {self.rerank_interval}")


class OnlinePopularity:
    """Decayed routing counts smoothed by an offline ranking (the prior), and the re-rank decision.

    counts    <- decay * counts + routed        (per layer, per expert; 0 at the start)
    smoothed   = counts + prior_weight * prior   (the prior never decays: additive smoothing)
    p          = smoothed / row sum of smoothed
    A layer's committed ranking r is *stale* when some expert r[j] has an estimated probability above
    (1 + rerank_margin) times that of an expert r[i] ranked above it (i < j). Only stale layers are
    re-ranked; smaller reorderings (noise) keep the committed order, so the resident prefix does not
    churn on every wobble of the counts.
    """

    def __init__(self, prior: ExpertPopularity, config: OnlinePopularityConfig | None = None) -> None:
        self.config = config or OnlinePopularityConfig()
        self.model = prior.model
        self.counts = np.zeros_like(prior.probabilities)  # [L, E] decayed routed counts; written by update() alone
        self.routed = np.zeros_like(prior.probabilities)  # [L, E] every routed assignment so far, undecayed
        self._prior = prior.probabilities * self.config.prior_weight  # [L, E] pseudo-counts, constant
        self.rankings = np.array(prior.rankings)  # committed order, [L, E]
        self.num_reranks = 0
        self.num_updates = 0
        self._prior_totals = self._prior.sum(axis=1, keepdims=True)  # [L, 1]
        self._count_totals = np.zeros_like(self._prior_totals)  # [L, 1] per-layer sums of counts, kept with them
        self._probabilities: tuple[int, np.ndarray] | None = None  # probabilities() as of update num_updates

    def update(self, routed: np.ndarray) -> None:
        """`routed[l, e]`: (token, expert) assignments of layer l to expert e in one step."""
        routed = np.asarray(routed, dtype=np.float64)
        if routed.shape != self.counts.shape:
            raise ValueError(f"routed counts have shape {routed.shape}, expected {self.counts.shape}")
        self.counts *= self.config.decay
        self.counts += routed
        self.routed += routed
        self._count_totals *= self.config.decay
        self._count_totals += routed.sum(axis=1, keepdims=True)
        self.num_updates += 1

    def observe(self, routed: np.ndarray) -> list[int]:
        """One step's routing (`update`), and every `rerank_interval` updates the stale layers re-ranked (returned;
        [] in between)."""
        self.update(routed)
        if self.num_updates % self.config.rerank_interval:
            return []
        return self.maybe_rerank()

    def probabilities(self) -> np.ndarray:
        """[L, E] the estimated routing probabilities (each row sums to 1). Read-only, and the same array until
        the next update (asked several times per step)."""
        cached = self._probabilities
        if cached is not None and cached[0] == self.num_updates:
            return cached[1]
        totals = self._count_totals + self._prior_totals
        smoothed = self.smoothed_counts()
        if (totals > 0).all():
            probs = smoothed / totals
        else:  # no prior weight and nothing routed yet in some layer
            E = self.counts.shape[1]
            probs = np.where(totals > 0, smoothed / np.where(totals > 0, totals, 1.0), 1.0 / E)
        probs.setflags(write=False)
        self._probabilities = (self.num_updates, probs)
        return probs

    def smoothed_counts(self) -> np.ndarray:
        """[L, E] the decayed counts plus the prior's pseudo-counts (what probabilities and re-ranks read)."""
        return self.counts + self._prior

    def estimate(self) -> ExpertPopularity:
        return ExpertPopularity(self.model, self.probabilities(), date=_now())

    def stale_layers(self) -> list[int]:
        c = np.take_along_axis(self.smoothed_counts(), self.rankings, axis=1)  # counts in committed order
        floor = np.minimum.accumulate(c, axis=1)  # weakest expert ranked at or above each position
        # counts share a per-layer denominator, so comparing counts compares probabilities
        stale = (c[:, 1:] > (1.0 + self.config.rerank_margin) * floor[:, :-1]).any(axis=1)
        return np.flatnonzero(stale).tolist()

    def maybe_rerank(self) -> list[int]:
        """Re-ranks the stale layers (new order = estimated probabilities) and returns them."""
        layers = self.stale_layers()
        if layers:
            self.rankings[layers] = _rank(self.smoothed_counts()[layers])
            self.num_reranks += len(layers)
        return layers
