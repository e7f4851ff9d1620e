"""Every deck executes and renders to reveal.js, with its figures drawn by the live run."""
import glob
import os

import pytest

from conftest import ROOT, load_slides_builder

DECKS = sorted(glob.glob(os.path.join(ROOT, "slides", "*.ipynb")))


@pytest.mark.parametrize("deck", DECKS, ids=os.path.basename)
def test_deck_builds_with_live_figures(deck, tmp_path):
    path, _ = load_slides_builder().build(deck, str(tmp_path))
    html = open(path).read()
    assert "reveal" in html.lower()
    assert "data:image/png" in html, "a deck's figures must come from running it"
    assert "Traceback (most recent call last)" not in html     # nbclient also fails on any cell error
