"""The recommender's recipe: every choice a variant of the workload may change, in one frozen object.

A `Recommender` (or a subclass naming another recipe) hands its recipe to `build`, `bench_step` and the
baselines; nothing reads a module-level switch. The defaults are the best the ablation found
(`benchmarks/recommender_ablation.py`; the figures are in docs/quality.md, recommender). What a finished run
needs to load again (the history length, the embedding width) is saved in its ids.json and read from there,
so a run keeps loading whatever the recipe of the code that loads it.
"""

from __future__ import annotations

from dataclasses import dataclass

MODELS = ("sasrec", "mf")  # --model: the first is the default


@dataclass(frozen=True)
class RecommenderRecipe:
    """How the recommender trains and what it is scored beside."""

    # SASRec (Kang & McAuley 2018, arXiv 1808.09781, section IV-B) reads the latest 50 items on its sparser
    # data sets and 200 on MovieLens-1M; 50 is the better of the two on this MovieLens (shorter histories).
    history: int = 50
    # SASRec's dropout on MovieLens-1M; without it the model memorizes the training sequences.
    dropout: float = 0.2
    # Past this many items the [samples, items] softmax logits and their step grow too large, and the loss
    # is BPR (the next item against one sampled item), whose step does not grow with the catalogue.
    full_softmax_items: int = 50_000
    # EASE^R's ridge strength (Steck 2019, arXiv 1905.03375, tuned it per data set: 200-1000 on ML-20M).
    ease_lambda: float = 100.0
    # ItemKNN and EASE^R build dense matrices: users x items, and items x items or the smaller Gram matrix
    # (cubic to invert). Past these bounds they are skipped, and the summary says so.
    dense_cells: int = 50_000_000  # users x items: 200 MB in fp32, 400 MB in fp64
    square_side: int = 10_000  # a square of this side: 400 MB in fp32, 800 MB in fp64
