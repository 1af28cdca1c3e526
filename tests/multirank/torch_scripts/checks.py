"""Shared by the rank scripts that compare against a local reference: failures are
collected, not raised, so that every rank keeps making the same calls, and reported as
the last line, ``HVDLITE_RESULT {"failures": [...], "checks": n, "info": {...}}``."""
import json

import torch


class Checks:
    def __init__(self):
        self.failures = []
        self.count = 0
        self.info = {}

    def close(self, label, got, want, tol):
        """Records a failure unless ``got`` has ``want``'s shape and values within tol
        (absolute and relative)."""
        self.count += 1
        try:
            ok = (tuple(got.shape) == tuple(want.shape)
                  and torch.allclose(got.double(), want.double(), atol=tol, rtol=tol))
        except Exception as e:  # noqa: BLE001 - reported, not raised
            ok, got = False, f"{got!r} ({e})"
        if not ok:
            self.failures.append(f"{label}: got {got!r}, want {want!r}")

    def true(self, label, ok, detail=""):
        self.count += 1
        if not ok:
            self.failures.append(f"{label} {detail}".strip())

    def report(self):
        print("HVDLITE_RESULT", json.dumps({"failures": self.failures, "checks": self.count,
                                            "info": self.info}), flush=True)
