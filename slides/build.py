"""Build the lecture decks: execute each ``slides/*.ipynb`` and render it to reveal.js.

    python slides/build.py [DECK ...] [--out build/slides]

Decks are committed without outputs; every figure in the HTML comes from running
minidist at build time, on whatever machine builds them (CPU gloo or GPUs).
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbconvert import SlidesExporter

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL = "minidist"


def ensure_kernel() -> str:
    """The decks run on this interpreter's kernel (it has minidist installed)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL)
        if os.path.realpath(spec.argv[0]) == os.path.realpath(sys.executable):
            return KERNEL
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install
    install(prefix=sys.prefix, kernel_name=KERNEL, display_name="Python (minidist)")
    return KERNEL


def build(deck: str, out_dir: str, timeout: int = 300) -> tuple[str, float]:
    nb = nbformat.read(deck, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, kernel_name=ensure_kernel(), timeout=timeout,
                   resources={"metadata": {"path": HERE}}).execute()
    elapsed = time.perf_counter() - start
    html, _ = SlidesExporter(reveal_scroll=True).from_notebook_node(nb)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, os.path.basename(deck).replace(".ipynb", ".slides.html"))
    with open(path, "w") as f:
        f.write(html)
    return path, elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("decks", nargs="*", help="deck notebooks (default: every slides/*.ipynb)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "build", "slides"))
    args = parser.parse_args(argv)
    decks = args.decks or sorted(glob.glob(os.path.join(HERE, "*.ipynb")))
    for deck in decks:
        path, elapsed = build(deck, args.out)
        print(f"{os.path.basename(deck)}: executed in {elapsed:.1f} s -> {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
