"""The driver of the multi-node Ray tests, run inside the head's host of a namespace
cluster: ``python ray_cluster_driver.py HEAD_ADDRESS SCENARIO``. Prints one line
``RESULT <json>`` with what each rank saw (``elastic`` takes two more arguments: the
network namespace of the host to lose and the address of the node that becomes free).
"""
import json
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

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


def elastic(head, lose_netns, join_address):
    """An elastic torch job on h1..h3 (one 2-CPU worker per node): h3 is busy at first
    (a blocker actor holds its CPUs), so the job starts with 2 ranks; once they have
    committed 3 steps the blocker ends and the job grows to 3; 2 commits later every
    process of host ``lose_netns`` (h2: its raylet, its worker, its rank) is killed and
    the job goes on with 2 ranks to the end. The callbacks drive it: each rank reports
    each commit through ray_logger."""
    node = next(n["NodeID"] for n in ray.nodes()
                if n["Alive"] and n["NodeManagerAddress"] == join_address)
    blocker = ray.remote(ray_bodies.Blocker).options(
        num_cpus=2, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
    ).remote()
    ray.get(blocker.ready.remote(), timeout=60)
    reports, done = [], {}

    def on_report(info):
        reports.append(info)
        if info["size"] == 2 and info["step"] >= 3 and "freed" not in done:
            done["freed"] = info["step"]
            ray.kill(blocker)
            done["freed_at"] = time.time()
        if info["size"] == 3:
            done.setdefault("grown", info["step"])
            if info["step"] >= done["grown"] + 2 and "lost" not in done:
                done["lost"] = info["step"]
                done["lost_at"] = time.time()
                pids = subprocess.run(["ip", "netns", "pids", lose_netns], check=True,
                                      capture_output=True, text=True).stdout.split()
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass

    settings = RayExecutor.create_settings(timeout_s=60)
    done["start"] = time.time()
    executor = RayExecutor(settings, min_workers=2, max_workers=3, cpus_per_worker=2,
                           elastic_timeout=60)
    executor.start()
    results = executor.run(ray_bodies.elastic_train, args=[ray_bodies.ELASTIC_STEPS],
                           kwargs={"step_s": 0.2}, callbacks=[on_report])
    done["end"] = time.time()
    executor.shutdown()
    return {"results": results, "worlds": executor.last_worlds, "events": done,
            "reports": reports}


def main():
    head, scenario = sys.argv[1], sys.argv[2]
    # How each world went, timed, for the test's failure message.
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("hvdlite").setLevel(logging.DEBUG)
    ray.init(address=head, logging_level="warning")
    if scenario == "elastic":
        out = elastic(head, sys.argv[3], sys.argv[4])
        print("RESULT " + json.dumps(to_json(out)), flush=True)
        ray.shutdown()
        return
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
