"""Build the lecture decks: execute each ``slides/*.ipynb`` and render it to reveal.js.

    python slides/build.py [DECK ...] [--out build/slides] [--check]

Decks are committed without outputs; every figure in the HTML comes from running
minidist at build time, on whatever machine builds them (CPU gloo or GPUs). Each deck is
one self-contained HTML file (``slides/offline.py``: reveal.js and MathJax inlined), so
it presents without network. On slides, code inputs are hidden; a code cell tagged
``show-code`` shows its code, for the cells where the code is the point. Speaker notes
are markdown cells of slide type "notes" (press ``s`` in the deck). ``--check`` opens
every built deck in headless Chromium (``slides/browser.py``).
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time

import nbformat
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbconvert import SlidesExporter

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:           # slides/ is not a package; its helpers sit beside this file
    sys.path.insert(0, HERE)
import offline  # noqa: E402

KERNEL = "minidist"
SHOW_CODE_TAG = "show-code"


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


class SocketKernelManager(AsyncKernelManager):
    """The deck's kernel over Unix sockets in a folder of its own: a TCP port chosen free here and bound
    later by the kernel could be taken by another kernel started at the same moment (decks build in
    parallel under ``pytest -n``)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.socket_dir = tempfile.mkdtemp(prefix="minidist-deck-")
        self.transport, self.ip = "ipc", os.path.join(self.socket_dir, "k")

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    cleanup_resources = _async_cleanup_resources


def hide_code(nb) -> None:
    """Hide every code cell's input unless it is tagged ``show-code`` (outputs stay)."""
    for cell in nb.cells:
        if cell.cell_type == "code" and SHOW_CODE_TAG not in cell.metadata.get("tags", []):
            cell.metadata["transient"] = {"remove_source": True}


def render(nb, path: str) -> str:
    """Write an executed notebook as a self-contained reveal.js deck at ``path``."""
    nb = nbformat.from_dict(nb)     # a copy: hiding inputs must not touch the caller's notebook
    hide_code(nb)
    exporter = SlidesExporter(template_name="minidist",
                              extra_template_basedirs=[os.path.join(HERE, "template")],
                              exclude_input_prompt=True, exclude_output_prompt=True)
    html, _ = exporter.from_notebook_node(nb, resources={"offline": offline.assets()})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(html)
    return path


def html_path(deck: str, out_dir: str) -> str:
    """Where ``build`` writes ``deck``'s HTML: ``out_dir/<name>.slides.html``."""
    return os.path.join(out_dir, os.path.basename(deck).replace(".ipynb", ".slides.html"))


def build(deck: str, out_dir: str, timeout: int = 300) -> tuple[str, float]:
    """Execute ``deck`` live and render it into ``out_dir``; returns (html path, seconds executing)."""
    nb = nbformat.read(deck, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, kernel_name=ensure_kernel(), timeout=timeout, kernel_manager_class=SocketKernelManager,
                   resources={"metadata": {"path": HERE}}).execute()
    elapsed = time.perf_counter() - start
    return render(nb, html_path(deck, out_dir)), elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("decks", nargs="*", help="deck notebooks (default: every slides/*.ipynb)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "build", "slides"))
    parser.add_argument("--check", action="store_true",
                        help="open each built deck in headless Chromium: slides, notes, maths, no network")
    args = parser.parse_args(argv)
    decks = args.decks or sorted(glob.glob(os.path.join(HERE, "[0-9]*.ipynb")))
    failed = 0
    for deck in decks:
        path, elapsed = build(deck, args.out)
        print(f"{os.path.basename(deck)}: executed in {elapsed:.1f} s -> {os.path.relpath(path)}")
        if args.check:
            import browser
            report = browser.check_deck(path)
            print("   ", report.summary())
            failed += not report.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
