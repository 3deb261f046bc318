"""Per-row sampling parameters and the logits -> probabilities transform.

Every row of a batch carries its own temperature, top-k, top-p and min-p, so one batch can
mix greedy and sampled requests. `probs` is the single definition of "the distribution q the
output must follow": verification, drafting and plain sampling all go through it.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SamplingParams:
    """Per-row sampling parameters; every field is a [B] array.

    temperature: 0 means greedy (q is the one-hot argmax of the logits).
    top_k:       keep the k most likely tokens; 0 disables.
    top_p:       keep the smallest prefix of the sorted distribution with mass >= top_p; 1 disables.
    min_p:       keep tokens with prob >= min_p * max prob; 0 disables.
    """

    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32

    @classmethod
    def make(
        cls,
        batch_size: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
    ) -> SamplingParams:
        """The same parameters for every row, validated."""
        full = lambda value, dtype: jnp.full((batch_size,), value, dtype)
        params = cls(
            temperature=full(temperature, jnp.float32),
            top_k=full(top_k, jnp.int32),
            top_p=full(top_p, jnp.float32),
            min_p=full(min_p, jnp.float32),
        )
        params.check()
        return params

    def check(self) -> None:
        """ValueError naming the first row and field out of range (NaN included)."""
        rules = {
            "temperature": (lambda x: (x >= 0) & (x < np.inf), "a finite number >= 0 (0 = greedy)"),
            "top_k": (lambda x: x >= 0, ">= 0 (0 disables)"),
            "top_p": (lambda x: (x > 0) & (x <= 1), "in (0, 1]"),
            "min_p": (lambda x: (x >= 0) & (x < 1), "in [0, 1)"),
        }
        for name, (valid, expected) in rules.items():
            values = np.asarray(getattr(self, name))
            bad = np.flatnonzero(~valid(values))
            if bad.size:
                raise ValueError(f"{name} must be {expected}; row {bad[0]} has {values[bad[0]]}")

    @classmethod
    def stack(cls, rows: list[SamplingParams]) -> SamplingParams:
        """Concatenate per-row parameter sets along the batch axis."""
        return jax.tree.map(lambda *xs: jnp.concatenate(xs), *rows)

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def greedy(self) -> jax.Array:  # [B] bool
        return self.temperature <= 0.0


def _expand(per_row: jax.Array, like: jax.Array) -> jax.Array:
    """[B] -> [B, 1, ..., 1] broadcastable against `like` ([B, ..., V])."""
    return per_row.reshape(per_row.shape + (1,) * (like.ndim - 1))


def _filter_sorted(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Apply top-k and top-p (which need the sorted distribution); masked logits are -inf."""
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # [B, ..., V] descending
    vocab = logits.shape[-1]
    # top-k: threshold at the k-th largest logit (ties at the threshold are kept).
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, _expand(k - 1, logits), axis=-1)  # [B, ..., 1]
    keep = logits >= kth
    # top-p on the top-k-filtered distribution: keep sorted tokens whose preceding mass < top_p.
    sorted_kept = jnp.where(sorted_logits >= kth, sorted_logits, -jnp.inf)
    sorted_probs = jax.nn.softmax(sorted_kept, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    top_p = _expand(params.top_p, logits)
    inside = ((mass_before < top_p) | (top_p >= 1.0)) & (sorted_logits >= kth)
    # The smallest logit still inside the nucleus is the threshold.
    nucleus_min = jnp.min(jnp.where(inside, sorted_kept, jnp.inf), axis=-1, keepdims=True)
    keep &= logits >= nucleus_min
    return jnp.where(keep, logits, -jnp.inf)


def argmax(logits: jax.Array) -> jax.Array:
    """`jnp.argmax(logits, axis=-1)` as int32 (the first of equal maxima; the first NaN if any), in
    two plain reductions: XLA:CPU runs argmax's (value, index) reduction one element at a time,
    but vectorizes a max and a min. Over SmolLM2's 49,152 logits of a 4-token block, 0.22 ms
    instead of 0.56 (docs/architecture.md, "Exactness rules")."""
    top = jnp.max(logits, axis=-1, keepdims=True)  # NaN where the row holds one
    hit = (logits == top) | jnp.isnan(logits)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Processed probabilities q from raw logits.

    logits: [B, ..., V]. Returns float32 [B, ..., V] summing to 1 over V.
    Greedy rows (temperature 0) get the one-hot of the argmax (lowest index on ties).
    Order: temperature, top-k, top-p, min-p, as in vLLM and Hugging Face.
    """
    logits = logits.astype(jnp.float32)
    greedy = _expand(params.greedy, logits)
    scaled = logits / jnp.where(greedy, 1.0, _expand(params.temperature, logits))
    needs_sort = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
    scaled = jax.lax.cond(needs_sort, lambda x: _filter_sorted(x, params), lambda x: x, scaled)
    sampled = jax.nn.softmax(scaled, axis=-1)
    min_keep = sampled >= _expand(params.min_p, logits) * jnp.max(sampled, axis=-1, keepdims=True)
    sampled = jnp.where(min_keep, sampled, 0.0)
    sampled = sampled / jnp.sum(sampled, axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy, one_hot, sampled)


def sample(key: jax.Array, probabilities: jax.Array) -> jax.Array:
    """Draw one token per distribution: [..., V] -> [...] int32. Zero-probability tokens never appear.

    key: one key, or [B] per-row keys for probabilities [B, ..., V]."""
    if key.ndim:
        return jax.vmap(sample)(key, probabilities)
    return jax.random.categorical(key, jnp.log(probabilities), axis=-1).astype(jnp.int32)


def unless_greedy(params: SamplingParams, draft_probs: Callable[[], jax.Array]) -> jax.Array:
    """`draft_probs()`, or zeros of its shape when every row is greedy: no rule reads a greedy
    row's draft distribution (`verify.greedy`), so an all-greedy batch computes none."""
    shape = jax.eval_shape(draft_probs)
    return jax.lax.cond(jnp.all(params.greedy), lambda: jnp.zeros(shape.shape, shape.dtype), draft_probs)


def pick(key: jax.Array, logits: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """A drafter's choice: a token per distribution, `sample`d from `probs(logits, params)` [B, ..., V],
    and that distribution. An all-greedy batch takes the argmax and returns zeros for the
    distribution, computing none: no rule reads a greedy row's draft distribution (`verify.greedy`)."""
    def sampled():
        q = probs(logits, params)
        return sample(key, q), q

    greedy = lambda: (argmax(logits), jnp.zeros(logits.shape, jnp.float32))
    return jax.lax.cond(jnp.all(params.greedy), greedy, sampled)
