"""Building a contaminated pool and auditing it by a Poisson design (the demo's ingest).

The pool is r = (1 - eps) q + eps z (docs/methods.md, ingest): each pooled item is a target item with
probability 1 - eps (membership M_j = 1) and a contaminant otherwise. Contaminants are real text
from other corpora, or degenerate text made from the target: web boilerplate, near-duplicates and
word-shuffled items. The audit draws I_j ~ Bernoulli(pi_j) independently (Poisson design) and a
simulated annotator reveals M_j, and the label where M_j = 1, from the held-back truth.

Everything here is pure: numpy generators in, arrays and frames out.
"""

from __future__ import annotations

import numpy as np

CONTAMINANT_KINDS = ("other_corpora", "boilerplate", "near_duplicate", "shuffled")

# Real-world web boilerplate, the kind a scrape leaves in a text pool.
BOILERPLATE = (
    "We use cookies to improve your experience on our site. By continuing to browse you agree to our use of cookies.",
    "Click here to subscribe to our newsletter and get the latest updates delivered to your inbox.",
    "All rights reserved. This material may not be published, broadcast, rewritten or redistributed.",
    "Share this article on Facebook Twitter LinkedIn Email Print",
    "Sign in to comment. Comments are moderated and may take some time to appear.",
    "Advertisement. Scroll to continue reading.",
    "JavaScript is disabled in your browser. Please enable JavaScript to view this page.",
    "Page not found. The page you are looking for might have been removed or is temporarily unavailable.",
    "Terms of Use | Privacy Policy | Contact Us | Site Map | Careers",
    "Follow us for more updates. Like and retweet if you agree!",
    "Loading... Please wait while we retrieve your content.",
    "Read more: related stories you might have missed this week.",
    "Your subscription has expired. Renew now to keep reading without limits.",
    "Download our app for the best experience on mobile devices.",
    "Posted by admin in Uncategorized | Leave a comment",
    "This video is not available in your country.",
)


def poisson_inclusion_probabilities(
    n: int, budget: float, uncertainty: np.ndarray | None = None, floor: float = 0.0
) -> np.ndarray:
    """Inclusion probabilities pi_j for a Poisson audit of expected size `budget`.

    Uniform when `uncertainty` is None (pi_j = budget / n); otherwise pi_j = clip(c * u_j, floor, 1)
    with c found by bisection so that sum_j pi_j = budget. Raises ValueError when no c can meet the
    budget (budget > n, or floor * n > budget).
    """
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if not 0 < budget <= n:
        raise ValueError(f"audit budget must be in (0, n={n}], got {budget}")
    if uncertainty is None:
        return np.full(n, budget / n)
    u = np.asarray(uncertainty, dtype=np.float64)
    if u.shape != (n,) or not np.all(np.isfinite(u)) or np.any(u < 0):
        raise ValueError("uncertainty must be a finite, non-negative vector of length n")
    if not 0 < floor <= 1:
        raise ValueError(f"pi floor must be in (0, 1], got {floor}")
    if floor * n > budget:
        raise ValueError(
            f"pi floor {floor} x n {n} = {floor * n:g} exceeds the audit budget {budget}; "
            f"lower the floor or raise the budget"
        )

    def total(c: float) -> float:
        return float(np.clip(c * u, floor, 1.0).sum())

    lo, hi = 0.0, 1.0
    while total(hi) < budget and hi < 1e300:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if total(mid) < budget else (lo, mid)
    return np.clip(hi * u, floor, 1.0)


def draw_poisson_sample(pi: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """I_j ~ Bernoulli(pi_j), independently. Returns a boolean mask."""
    return rng.random(len(pi)) < pi


def shuffle_words(text: str, rng: np.random.Generator) -> str:
    """The same words in a random order: fluent-looking vocabulary, no syntax."""
    words = text.split()
    if len(words) < 2:
        return text[::-1]
    order = rng.permutation(len(words))
    if np.all(order == np.arange(len(words))):
        order = np.roll(order, 1)
    return " ".join(words[i] for i in order)


def near_duplicate(text: str, rng: np.random.Generator, drop: float = 0.1) -> str:
    """A scraped near-copy: a few words dropped, one pair swapped, case and punctuation noise."""
    words = text.split()
    if len(words) < 4:
        return text.upper() + " !!"
    keep = rng.random(len(words)) >= drop
    keep[0] = True
    words = [w for w, k in zip(words, keep) if k]
    if len(words) >= 2:
        i = int(rng.integers(0, len(words) - 1))
        words[i], words[i + 1] = words[i + 1], words[i]
    out = " ".join(words)
    return out.lower() if rng.random() < 0.5 else out + " ..."


def boilerplate(rng: np.random.Generator) -> str:
    """One or two boilerplate lines."""
    k = int(rng.integers(1, 3))
    picks = rng.choice(len(BOILERPLATE), size=k, replace=False)
    return " ".join(BOILERPLATE[i] for i in picks)


def contaminant_kinds(n: int, mix: dict[str, float], rng: np.random.Generator) -> np.ndarray:
    """Draw the kind of each of n contaminants from the mixture weights `mix` (normalised here)."""
    weights = np.array([float(mix.get(k, 0.0)) for k in CONTAMINANT_KINDS])
    if np.any(weights < 0) or weights.sum() <= 0:
        raise ValueError(f"contaminant weights must be >= 0 with a positive sum, got {mix}")
    return rng.choice(np.array(CONTAMINANT_KINDS), size=n, p=weights / weights.sum())


def build_pool(
    target, others, *, n_pool: int, eps: float, mix: dict[str, float], rng: np.random.Generator, id_prefix: str
):
    """A contaminated pool of n_pool items and its held-back truth.

    target: frame (text, label) of held-out target items, at least as many as the pool needs;
    others: frame (text, corpus) of other corpora's items. Each slot is a target item with
    probability 1 - eps (M_j = 1), else a contaminant of a kind drawn from `mix`. Ids are assigned
    after a random permutation, so an id says nothing about membership.

    Returns (pool: id, text; truth: id, member, label, origin). Raises ValueError if `target` is
    too small for the drawn number of target slots.
    """
    import pandas as pd

    if not 0 <= eps < 1:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    member = rng.random(n_pool) >= eps
    n_target = int(member.sum())
    if n_target > len(target):
        raise ValueError(
            f"the pool needs {n_target} target items but only {len(target)} are left after the "
            f"reference and test splits; lower n_pool (or n_reference / n_test)"
        )
    tgt = target.iloc[rng.permutation(len(target))[:n_target]]
    texts = np.empty(n_pool, dtype=object)
    labels = np.full(n_pool, None, dtype=object)
    origin = np.empty(n_pool, dtype=object)
    texts[member] = tgt["text"].to_numpy()
    labels[member] = tgt["label"].to_numpy()
    origin[member] = "target"
    slots = np.flatnonzero(~member)
    kinds = contaminant_kinds(len(slots), mix, rng) if len(slots) else np.array([], dtype=str)
    if np.any(kinds == "other_corpora") and len(others) == 0:
        raise ValueError("contaminant kind 'other_corpora' needs other corpora, but none were given")
    by_corpus = [np.flatnonzero(others["corpus"].to_numpy() == c) for c in sorted(set(others["corpus"]))]
    source_texts = tgt["text"].to_numpy()
    if len(source_texts) == 0:
        source_texts = target["text"].to_numpy()
    for j, kind in zip(slots, kinds):
        if kind == "other_corpora":
            # a corpus first, uniformly, so a large corpus does not crowd out the small ones
            rows = by_corpus[int(rng.integers(len(by_corpus)))]
            k = int(rows[rng.integers(len(rows))])
            texts[j], origin[j] = others["text"].iat[k], f"other:{others['corpus'].iat[k]}"
        elif kind == "boilerplate":
            texts[j], origin[j] = boilerplate(rng), "boilerplate"
        elif kind == "near_duplicate":
            texts[j], origin[j] = near_duplicate(source_texts[rng.integers(len(source_texts))], rng), "near_duplicate"
        else:
            texts[j], origin[j] = shuffle_words(source_texts[rng.integers(len(source_texts))], rng), "shuffled"
    order = rng.permutation(n_pool)
    ids = np.array([f"{id_prefix}{i:06d}" for i in range(n_pool)], dtype=object)
    pool = pd.DataFrame({"id": ids, "text": texts[order]})
    truth = pd.DataFrame(
        {
            "id": ids,
            "member": member[order].astype(np.int8),
            "label": pd.array(labels[order], dtype="string"),
            "origin": origin[order],
        }
    )
    return pool, truth
