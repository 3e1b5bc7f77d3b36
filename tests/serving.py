"""A real uvicorn on loopback serving a finished run, and the small runs the serving tests train."""

import socket
import threading
import time
from pathlib import Path

import httpx

from gpuwise.cli import main

from train_data import image_folder, interactions_csv, reviews_jsonl


def trained(tmp: Path, workload: str) -> Path:
    run = tmp / workload
    data = {
        "defects": f"defects --data {image_folder(tmp / 'cells')} --image-size 32 --batch-size 8 --max-steps 2",
        "recommender": f"recommender --data {interactions_csv(tmp / 'i.csv')} --batch-size 8 --max-steps 3",
        "product-lm": f"product-lm --base scratch --data {reviews_jsonl(tmp / 'r.jsonl')} --block-size 32"
        " --batch-size 4 --max-steps 1",
    }[workload]
    assert main(f"train {data} --run-dir {run}".split()) == 0
    return run


class Server:
    """uvicorn in a thread, on a free loopback port, serving one run, or a model given directly."""

    def __init__(self, run: Path | str, **settings):
        import uvicorn

        from gpuwise.serve.app import Settings, create_app, server_config
        from gpuwise.serve.models import is_run, load_model, load_served
        from gpuwise.workloads.serving import Limits

        limits = Limits(**settings.pop("limits", {}))
        dtype = settings.pop("dtype", "auto")  # language models: as `gpuwise serve --dtype`
        if is_run(Path(run)):
            self.served, _ = load_served(Path(run), settings.get("runtime", "torch"), limits, dtype)
        else:
            self.served = load_model(str(run), limits, dtype=dtype)
        app = create_app(self.served, Settings(str(run), limits=limits, **settings), run_id=Path(run).name,
                         precision="fp32")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(server_config(app, "127.0.0.1", self.port, limits))  # as `gpuwise serve` runs
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return httpx.Client(base_url=self.url, timeout=30)

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
