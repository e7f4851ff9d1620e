"""Every deck executes and renders to reveal.js, with its figures drawn by the live run."""
import glob
import importlib.util
import os

import pytest

from conftest import ROOT

DECKS = sorted(glob.glob(os.path.join(ROOT, "slides", "*.ipynb")))


def _builder():
    spec = importlib.util.spec_from_file_location("slides_build", os.path.join(ROOT, "slides", "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("deck", DECKS, ids=os.path.basename)
def test_deck_builds_with_live_figures(deck, tmp_path):
    path, _ = _builder().build(deck, str(tmp_path))
    html = open(path).read()
    assert "reveal" in html.lower()
    assert "data:image/png" in html, "a deck's figures must come from running it"
    assert "Traceback (most recent call last)" not in html     # nbclient also fails on any cell error
