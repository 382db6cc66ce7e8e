"""The JSON document every diagnostics script writes: command, machine, torch, results."""

from __future__ import annotations

import json
from typing import Any

import torch

from torchcomms.bench import env


def write_doc(path: str, command: str, results: dict[str, Any], **extra: Any) -> None:
    doc = {
        "command": command,
        **extra,
        "machine": {
            "cpu": env.cpu_model(),
            "cores": env.usable_cores(),
            "load_average": env.load_average(),
        },
        "torch": torch.__version__,
        "results": results,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
