"""The driver of the multi-node Ray tests, run inside the head's host of a namespace
cluster: ``python ray_cluster_driver.py HEAD_ADDRESS SCENARIO``. Prints one line
``RESULT <json>`` with what each rank saw."""
import json
import sys

import numpy as np
import ray

import ray_bodies
from hvdlite.ray import RayExecutor


def to_json(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def main():
    head, scenario = sys.argv[1], sys.argv[2]
    ray.init(address=head, logging_level="warning")
    settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)
    if scenario == "hosts":
        executor = RayExecutor(settings, num_hosts=2, num_workers_per_host=2)
    else:  # "spread": 2 CPUs per worker, 2 per node: PACK puts one worker on each node
        executor = RayExecutor(settings, num_workers=3, cpus_per_worker=2)
    executor.start()
    try:
        out = {"identity": executor.run(ray_bodies.identity),
               "collectives": executor.run(ray_bodies.collectives)}
    finally:
        executor.shutdown()
    print("RESULT " + json.dumps(to_json(out)), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
