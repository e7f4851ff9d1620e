"""Notebooks are committed as sources: valid, without outputs or execution counts."""
import glob
import json
import os

import pytest

from conftest import ROOT

NOTEBOOKS = sorted(p for d in ("solutions", "labs", "slides")
                   for p in glob.glob(os.path.join(ROOT, d, "**", "*.ipynb"), recursive=True)
                   if ".ipynb_checkpoints" not in p)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: os.path.relpath(p, ROOT))
def test_notebook_has_no_outputs(path):
    with open(path) as f:
        nb = json.load(f)
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{os.path.relpath(path, ROOT)}: cells {dirty} carry outputs; strip them before committing"


def test_there_are_notebooks_to_check():
    assert any("/slides/" in p for p in NOTEBOOKS)
