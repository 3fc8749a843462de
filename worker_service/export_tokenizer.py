"""Write a model's tokenizer files (tokenizer.json, tokenizer_config.json with
the chat template, ...) to a directory: ``python -m worker_service.export_tokenizer
--model default DIR`` (``radixserve export-tokenizer DIR``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from worker_service.weights import open_model


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir")
    p.add_argument("--model", default="default")
    args = p.parse_args(argv)
    source = open_model(None if args.model == "default" else args.model)
    target = Path(args.dir)
    target.mkdir(parents=True, exist_ok=True)
    for name, data in source.tokenizer_files().items():
        (target / name).write_bytes(data)
    print(f"wrote the tokenizer of {source.path.name} to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
