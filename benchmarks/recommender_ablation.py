"""What each choice buys the recommender on MovieLens: one full training run per variant, in fresh processes one
after another, each scored on the same split (each user's most recent 10 %) beside the baselines of its run.

Run: .venv/bin/python benchmarks/recommender_ablation.py [--variants default,mf,...|all] [--seed 0]

Variants (each the default run, `gpuwise train recommender`, with one change); without --variants, the first four:
  default      SASRec: self-attention over each user's latest 50 items, dropout 0.2, 30 epochs at lr 3e-3
  mf           --model mf: matrix factorization, softmax over all items
  no-dropout   dropout 0 (every process then draws the same numbers: 1 and N processes train alike)
  history-200  the latest 200 items, SASRec's setting for MovieLens-1M
  20-epochs    --epochs 20
  40-epochs    --epochs 40
  lr-1e-3      --lr 1e-3 (Adam's default, SASRec's)

A variant of the recipe is a `Recommender` subclass below with another `RecommenderRecipe`, trained by its
`module:Class` name (`gpuwise train recommender_ablation:NoDropout`, this directory on the Python path). Per
variant: recall@10 and NDCG@10 of the model, EASE^R's (the strongest baseline, closed form, the same in every
run) and the run's wall time. A difference of a few thousandths is within what another seed moves (run it with
--seed 1 and 2 to see); the figures are in docs/quality.md, recommender.
"""

from __future__ import annotations

from pathlib import Path

from ablation import main, train_child

from gpuwise.workloads.recommender import Recommender, RecommenderRecipe

HERE = Path(__file__).resolve().parent
MODULE = Path(__file__).stem  # how the child imports this file: it runs as __main__ here


class NoDropout(Recommender):
    recipe = RecommenderRecipe(dropout=0.0)


class History200(Recommender):
    recipe = RecommenderRecipe(history=200)


# name: (the workload trained, train flags)
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "default": ("recommender", []),
    "mf": ("recommender", ["--model", "mf"]),
    "no-dropout": (f"{MODULE}:{NoDropout.__name__}", []),
    "history-200": (f"{MODULE}:{History200.__name__}", []),
    "20-epochs": ("recommender", ["--epochs", "20"]),
    "40-epochs": ("recommender", ["--epochs", "40"]),
    "lr-1e-3": ("recommender", ["--lr", "1e-3"]),
}
FIRST = ["default", "mf", "no-dropout", "history-200"]

# The CLI as it is, with this directory on the path: the registry imports a variant's class from here.
CHILD = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from gpuwise.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run(name: str, seed: int, out: Path) -> dict:
    workload, flags = VARIANTS[name]
    argv = ["train", workload, *flags, "--seed", str(seed), "--run-dir", str(out / name), "--json"]
    s = train_child(CHILD, argv, out, name)
    ease = next(v for k, v in s["baseline"]["also"].items() if k.startswith("EASE"))
    return {
        "recall@10": s["eval"]["recall@10"],
        "ndcg@10": s["eval"]["ndcg@10"],
        "ease recall": ease["recall@10"],
        "ease ndcg": ease["ndcg@10"],
        "wall_s": s["wall_s"],
        "epochs": s["epochs"],
    }


if __name__ == "__main__":
    main(
        __doc__, VARIANTS, FIRST, "MovieLens recommender", run, ("recall@10", "ndcg@10", "ease recall", "ease ndcg"), 13
    )
