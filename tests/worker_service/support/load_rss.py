"""Run as ``python -m tests.worker_service.support.load_rss quantized|float``:
loads the default model in this fresh process and prints, as JSON, how much
its resident anonymous memory grew (the model file's mapped pages are page
cache, counted apart) and the quantized matrices' bytes."""

from __future__ import annotations

import gc
import json
import sys

from tests.worker_service.support.quantized_models import default_source, load_default
from worker_service.models.quantized import quantized_bytes


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main() -> None:
    quantized = sys.argv[1] == "quantized"
    default_source()  # the metadata (~160 MiB, its token list) is no weight
    gc.collect()
    before = rss_anon()
    model = load_default(quantized=quantized)
    gc.collect()
    grown = rss_anon() - before
    print(json.dumps({"grown": grown, "blocks": quantized_bytes(model)}))


if __name__ == "__main__":
    main()
