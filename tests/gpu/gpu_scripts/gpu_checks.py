"""Shared by the GPU rank scripts: the device this rank uses, and checks that collect
failures instead of raising (every rank keeps making the same calls), reported as the
last line, ``HVDLITE_RESULT {"failures": [...], "checks": n, "info": {...}}``.

``--device cuda`` (the default) pins the GPU as Horovod scripts do:
``torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())``, so ranks that
outnumber the GPUs share them. ``--device cpu`` runs the same script on CPU tensors,
which checks the script itself on a machine without a GPU.
"""
import argparse
import json

import torch

import hvdlite.torch as hvd


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    return parser.parse_args(argv)


def pick_device(kind):
    """Returns the torch.device this rank computes on (hvd.init() must have run)."""
    if kind == "cpu":
        return torch.device("cpu")
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def core_stats():
    """The core's counters (hvdlite.core.stats()), as a dict."""
    from hvdlite import core

    stats = core.stats()
    return dict(stats) if isinstance(stats, dict) else dict(vars(stats))


class Checks:
    def __init__(self, device):
        self.device = device
        self.failures = []
        self.count = 0
        self.info = {}

    def close(self, label, got, want, tol=0.0, dtype=True):
        """Records a failure unless ``got`` is a tensor on this rank's device with
        ``want``'s shape (and dtype, unless ``dtype=False``) and values within ``tol``
        (absolute and relative). ``want`` may be on any device."""
        self.count += 1
        try:
            problems = []
            if got.device != self.device:
                problems.append(f"on {got.device}, not {self.device}")
            if tuple(got.shape) != tuple(want.shape):
                problems.append(f"shape {tuple(got.shape)}, not {tuple(want.shape)}")
            elif dtype and got.dtype != want.dtype:
                problems.append(f"dtype {got.dtype}, not {want.dtype}")
            elif not torch.allclose(got.detach().cpu().double(), want.detach().cpu().double(),
                                    atol=tol, rtol=tol):
                diff = (got.detach().cpu().double() - want.detach().cpu().double()).abs().max()
                problems.append(f"values differ by up to {float(diff):.3g} (tol {tol}): got "
                                f"{got.detach().cpu().flatten()[:8].tolist()}, want "
                                f"{want.detach().cpu().flatten()[:8].tolist()}")
        except Exception as e:  # noqa: BLE001 - reported, not raised
            problems = [f"{type(e).__name__}: {e}"]
        if problems:
            self.failures.append(f"{label}: " + "; ".join(problems))

    def true(self, label, ok, detail=""):
        self.count += 1
        if not ok:
            self.failures.append(f"{label} {detail}".strip())

    def attempt(self, label, fn):
        """Runs ``fn()``; an exception is a failure (the script goes on). Returns its
        result, or None when it raised."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - reported, not raised
            self.count += 1
            self.failures.append(f"{label}: raised {type(e).__name__}: {e}")
            return None

    def report(self):
        print("HVDLITE_RESULT", json.dumps({"failures": self.failures, "checks": self.count,
                                            "info": self.info}), flush=True)
