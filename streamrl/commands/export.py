"""``streamrl export RUN_DIR [--version N] [--merge] OUT``: a published policy version as a
Hugging Face directory, for serving or sharing outside streamrl (``streamrl.weights.export_version``).

A full-weights version is copied as it is. A LoRA version (``learner.lora``) is written as
PEFT's adapter files whose ``adapter_config.json`` names the base the learner published
(``RUN/weights/base``): ``AutoModelForCausalLM.from_pretrained(OUT)`` loads the base and the
adapter (with ``peft`` installed); with ``--merge``, the base with the adapter merged in, a plain
model directory.

Only a whole version is exported (``streamrl.weights.incomplete``: its manifest, written last,
read first): without ``--version`` the newest whole one, saying which newer ones it passed over
(being written, or cut short); a version named that is not whole, or whose delta chain is
damaged (a flipped byte, a truncated delta, a missing base), is one line naming the version, the
file and what is wrong, and exit 2.
"""

from __future__ import annotations

import argparse
import sys

HELP = "write a published policy version as a Hugging Face directory (a LoRA adapter, or --merge: merged into its base)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's directory (RUN/weights/v<N>/), or a weights directory")
    parser.add_argument("out", metavar="OUT", help="the directory to write")
    parser.add_argument("--version", type=int, default=None, help="the version to export (default: the newest)")
    parser.add_argument("--merge", action="store_true", help="LoRA: merge the adapter into the base (full weights)")


def main(args: argparse.Namespace) -> int:
    from streamrl.errors import StreamrlError, need
    from streamrl.weights import ADAPTER_CONFIG, export_version, incomplete, newest_whole, version_dirs

    need("transformers", "cpu", "streamrl export")
    try:
        weights, versions = version_dirs(args.run_dir)
    except FileNotFoundError as exc:
        raise StreamrlError(str(exc)) from None
    if args.version is None:  # the newest whole version: one being written, or cut short, is passed over
        version, skipped = newest_whole(versions)
        for n, why in skipped.items():
            print(f"streamrl export: passing over version {n}: {why}", file=sys.stderr, flush=True)
        if version is None:
            raise StreamrlError(f"no whole version in {weights} (versions {', '.join(map(str, sorted(versions)))} "
                                f"are all incomplete)")
    else:
        version = args.version
        if version not in versions:
            raise StreamrlError(f"version {version} is not in {weights} (there: {', '.join(map(str, sorted(versions)))})")
        why = incomplete(versions[version])
        if why is not None:
            raise StreamrlError(f"version {version} is not whole: {why}")
    src = versions[version]
    if (src / ADAPTER_CONFIG).is_file():
        need("peft", "cpu", "streamrl export of a LoRA version")
    try:
        out = export_version(src, args.out, merge=args.merge, base=weights / "base")
    except FileNotFoundError as exc:
        raise StreamrlError(str(exc)) from None
    print(f"exported version {version} ({'merged' if args.merge else 'as published'}) to {out}", flush=True)
    return 0
