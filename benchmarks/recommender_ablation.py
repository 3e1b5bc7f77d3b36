"""What each choice buys the recommender on MovieLens: one full training run per variant, in fresh processes one
after another, each scored on the same split (each user's most recent 10 %) beside the baselines of its run.

Run: .venv/bin/python benchmarks/recommender_ablation.py [--variants default,mf,...|all] [--seed 0]

Variants (each the default run, `gpuwise train recommender`, with one change); without --variants, the first four:
  default      SASRec: self-attention over each user's latest 50 items, dropout 0.2, 30 epochs at lr 3e-3
  mf           --model mf: matrix factorization, softmax over all items (the default until 2026-12-02)
  no-dropout   dropout 0 (every process then draws the same numbers: 1 and N processes train alike)
  history-200  the latest 200 items (recommender.HISTORY = 200), SASRec's setting for MovieLens-1M
  20-epochs    --epochs 20
  40-epochs    --epochs 40
  lr-1e-3      --lr 1e-3 (Adam's default, SASRec's)

Per variant: recall@10 and NDCG@10 of the model, EASE^R's (the strongest baseline, closed form, the same in
every run) and the run's wall time. One run takes 0.5-3 minutes on 2 cores; a difference of a few thousandths
is within what another seed moves (run it with --seed 1 and 2 to see).
"""

from __future__ import annotations

from pathlib import Path

from ablation import main, train_child

# name: (module switches of gpuwise.workloads.recommender, SequentialRecommender keywords, train flags)
VARIANTS: dict[str, tuple[dict, dict, list[str]]] = {
    "default": ({}, {}, []),
    "mf": ({}, {}, ["--model", "mf"]),
    "no-dropout": ({}, {"dropout": 0.0}, []),
    "history-200": ({"HISTORY": 200}, {}, []),
    "20-epochs": ({}, {}, ["--epochs", "20"]),
    "40-epochs": ({}, {}, ["--epochs", "40"]),
    "lr-1e-3": ({}, {}, ["--lr", "1e-3"]),
}
FIRST = ["default", "mf", "no-dropout", "history-200"]

CHILD = """
import sys
import gpuwise.workloads.recommender as r
switches, model_kw = {switches!r}, {model_kw!r}
if model_kw:
    base = r.SequentialRecommender

    class Changed(base):
        def __init__(self, *args, **kw):
            super().__init__(*args, **(kw | model_kw))

    r.SequentialRecommender = Changed
for name, value in switches.items():
    setattr(r, name, value)
from gpuwise.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run(name: str, seed: int, out: Path) -> dict:
    switches, model_kw, flags = VARIANTS[name]
    argv = ["train", "recommender", *flags, "--seed", str(seed), "--run-dir", str(out / name), "--json"]
    s = train_child(CHILD.format(switches=switches, model_kw=model_kw), argv, out, name)
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
