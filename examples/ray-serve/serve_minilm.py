"""MiniLM behind Ray Serve, batched by the node's tpubox daemon across every replica.

    python serve_minilm.py --repository /srv/models [--replicas 3] [--port 8000]

/srv/models/minilm must be a model directory as examples/minilm-serve/config.toml describes it
(config.toml, model.wasm, `files` -> the directory `tpubox setup minilm` prints); README.md
shows how to make one. Starts a local Ray (loopback only), the node actor with the repository,
Serve's proxy on 127.0.0.1:PORT and the deployment, sends a few sentences through the proxy at
once, prints their embeddings' first values and the model's statistics, and stops everything.
Needs `pip install './python[ray-serve]'` and the tpubox binary (TPUBOX_BIN or PATH).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import threading

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1

import ray  # noqa: E402
from ray import serve  # noqa: E402

import tpubox.ray  # noqa: E402

SENTENCES = [
    "A man is eating food.",
    "A man is riding a horse.",
    "The new movie is awesome.",
    "The cat sits outside.",
    "A woman is playing the violin.",
    "Two men pushed carts through the woods.",
]


def post(port: int, path: str, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{path}: {resp.status} {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repository", required=True, help="model repository with minilm/")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--port", type=int, default=8000, help="Ray Serve's HTTP proxy port")
    ap.add_argument("--plugin", default="cpu", help="the daemon's --plugin (cpu, tpu, cuda)")
    args = ap.parse_args()

    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        # The node's daemon: the session API plus the repository's inference doors on
        # 127.0.0.1 (free ports); tenant `web` may call minilm only.
        node = tpubox.ray.node(
            tenants={"web": {"models": ["minilm"], "max_in_flight": 32}},
            model_repository=args.repository,
            plugin=args.plugin,
            ready_timeout=300,
        )
        print("daemon:", ray.get(node.inference_address.remote()))

        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        app = tpubox.ray.serve_model("minilm", tenant="web", num_replicas=args.replicas)
        serve.run(app, name="minilm", route_prefix="/minilm")

        results: dict[int, list[float]] = {}

        def ask(i: int) -> None:
            body = {
                "inputs": [
                    {"name": "text", "shape": [1], "datatype": "BYTES", "data": [SENTENCES[i]]}
                ]
            }
            (out,) = post(args.port, "/minilm", body)["outputs"]
            results[i] = out["data"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(SENTENCES))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, text in enumerate(SENTENCES):
            print(f"{text!r:40} -> [{', '.join(f'{x:+.4f}' for x in results[i][:4])}, ...]")

        # The daemon's own statistics: executions below inferences means it batched.
        token = ray.get(node.token.remote("web"))
        host, port = ray.get(node.inference_address.remote())["http"].rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/v2/models/minilm/stats", headers={"Authorization": f"Bearer {token}"})
        stats = json.loads(conn.getresponse().read())["model_stats"][0]
        print(f"inferences {stats['inference_count']}, executions {stats['execution_count']}")
    finally:
        serve.shutdown()
        tpubox.ray.shutdown_node()
        ray.shutdown()


if __name__ == "__main__":
    main()
