"""What a bundle is built with, checked when it is built, and which version of the course it grades
with: the platforms' time limits and image name (autograder/handout/platforms/limits.py), and the bundle's
record and its check against the course (autograder/handout/platforms/version.py). Nothing is graded here."""
from __future__ import annotations

import copy
import json
import shutil
import zipfile

import nbformat
import pytest

from autograder.__main__ import main as cli
from autograder.handout.platforms import limits, version
from autograder_fixtures import LAB, SOLUTIONS


@pytest.fixture
def course(tmp_path, monkeypatch):
    """A copy of the fixture course's solutions, as MINIDIST_SOLUTIONS (a test may change it)."""
    sol = tmp_path / "course" / "solutions"
    shutil.copytree(SOLUTIONS, sol)
    monkeypatch.setenv("MINIDIST_SOLUTIONS", str(sol))
    return sol


# --- the limits ---------------------------------------------------------------------------------

@pytest.mark.parametrize("timeout, wall", [(600, 540), (300, 240), (120, 60)])
def test_prairielearn_timeout_and_its_wall_limit(timeout, wall):
    assert limits.prairielearn_wall(timeout) == wall


@pytest.mark.parametrize("timeout, says", [(900, "at most 600 s"), (601, "at most 600 s"), (30, "too short"),
                                           (119, "use 120 to 600"), (0, "too short"), (-5, "too short"),
                                           (12.5, "whole number"), (True, "whole number")])
def test_prairielearn_timeouts_refused(timeout, says):
    with pytest.raises(SystemExit, match=says):
        limits.prairielearn_wall(timeout)


@pytest.mark.parametrize("image", ["yourorg/minidist-grader-lab1", "minidist", "ghcr.io/course/grader:2026.1",
                                   "localhost:5000/a/b_c__d", "reg.example.edu/x/y@sha256:" + "a" * 64])
def test_image_names_accepted(image):
    assert limits.prairielearn_image(image) == image


@pytest.mark.parametrize("image, says", [(None, "--image is required"), ("", "--image is required"),
                                         ("YourOrg/Grader", "not a Docker image name"),
                                         ("my grader", "not a Docker image name"),
                                         ("org/grader:", "not a Docker image name")])
def test_image_names_refused(image, says):
    with pytest.raises(SystemExit, match=says):
        limits.prairielearn_image(image)


def test_gradescope_wall_limit_within_its_timeout():
    assert limits.gradescope_wall() == 540
    assert limits.gradescope_wall(None, 1200) == 1140
    assert limits.gradescope_wall(300) == 300
    for wall, timeout, says in [(600, 600, "at most Gradescope's timeout less 60"), (541, 600, "600 - 60 = 540"),
                                (30, 600, "at least 60 s"), (0, 600, "at least 60 s"), (-1, 600, "at least 60 s"),
                                (float("nan"), 600, "at least 60 s"), (None, 100, "at least 120 s")]:
        with pytest.raises(SystemExit, match=says):
            limits.gradescope_wall(wall, timeout)


def test_the_cli_refuses_before_building(tmp_path, course):
    """Bad options fail at once, with the reason, and nothing is written."""
    for argv, says in [(["prairielearn", LAB, "--timeout", "900", "--image", "org/g"], "at most 600 s"),
                       (["prairielearn", LAB, "--timeout", "30", "--image", "org/g"], "too short"),
                       (["prairielearn", LAB], "--image is required"),
                       (["gradescope", LAB, "--wall-timeout", "600"], "at most Gradescope's timeout less 60"),
                       (["gradescope", LAB, "--timeout", "1200", "--wall-timeout", "0"], "at least 60 s")]:
        with pytest.raises(SystemExit, match=says):
            cli(["--solutions", str(course), *argv, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# --- the bundle's record ------------------------------------------------------------------------

def test_record_parts_and_fingerprint(course, tmp_path):
    rec = json.loads(version.write_record(LAB, tmp_path).read_text())
    assert rec["lab"] == LAB and rec["built"].endswith("Z") and len(rec["fingerprint"]) == 64
    assert set(rec["parts"]) == set(version.PARTS)
    files = {k: set(v["files"]) for k, v in rec["parts"].items()}
    assert files["notebook"] == {f"solutions/{LAB}/{LAB}.ipynb"}
    assert (course / LAB / "bugbank.py").is_file()          # beside the notebook, and in no part: no bundle holds it
    assert files["checks"] == {f"minidist/checks/{LAB}/{f}.py" for f in
                               ("__init__", "add", "allsum", "hidden")}    # the toy lab: an exercise module each
    assert "minidist/checks/kit/__init__.py" in files["kit"] and "minidist/checks/__init__.py" in files["kit"]
    assert not any("/checks/" in f for f in files["library"]) and "minidist/collectives/__init__.py" in files["library"]
    assert "autograder/handout/platforms/version.py" in files["grader"]
    assert not any("bugbank" in f or f.endswith(".md") for f in files["grader"])
    assert version.fingerprint(version.parts(LAB)) == rec["fingerprint"]          # the same course, the same
    assert version.describe(rec).startswith(f"bundle: {LAB}, fingerprint {rec['fingerprint'][:12]}, built ")


def test_check_up_to_date_then_the_notebook_changes(course, tmp_path):
    version.write_record(LAB, tmp_path)
    ok, text = version.check(LAB, tmp_path)
    assert ok and "up to date" in text
    nb_path = course / LAB / f"{LAB}.ipynb"
    nb = nbformat.read(str(nb_path), as_version=4)
    ran = copy.deepcopy(nb)                     # outputs and execution counts are not the lab's version
    for c in ran.cells:
        if c.cell_type == "code":
            c.execution_count = 7
            c.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    nbformat.write(ran, str(nb_path))
    assert version.check(LAB, tmp_path)[0]
    test = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "test_add")
    test.source += "\nassert add(2, 2) == 4"
    nbformat.write(nb, str(nb_path))
    ok, text = version.check(LAB, tmp_path)
    assert not ok and "OUT OF DATE" in text
    assert f"the lab's notebook folder changed: solutions/{LAB}/{LAB}.ipynb (changed)" in text
    assert "checks" not in text.split("OUT OF DATE")[1] and "grader" not in text.split("OUT OF DATE")[1]


def test_check_names_the_checks_the_library_and_the_grader(course, tmp_path):
    """A bundle built before files changed: its record holds their old digests (or lacks new files)."""
    rec = version.record(LAB)
    old = copy.deepcopy(rec)
    old["parts"]["checks"]["files"][f"minidist/checks/{LAB}/hidden.py"] = "0" * 64
    del old["parts"]["library"]["files"]["minidist/collectives/__init__.py"]
    old["parts"]["grader"]["files"]["autograder/gone.py"] = "1" * 64
    for key in ("checks", "library", "grader"):
        old["parts"][key]["sha256"] = "old"
    old["fingerprint"] = "old"
    (tmp_path / "bundle.json").write_text(json.dumps(old))
    ok, text = version.check(LAB, tmp_path / "bundle.json")
    assert not ok
    assert f"the lab's checks changed: minidist/checks/{LAB}/hidden.py (changed)" in text
    assert "the library (minidist) changed: minidist/collectives/__init__.py (new)" in text
    assert "the grader (autograder) changed: autograder/gone.py (removed)" in text
    assert "notebook" not in text and "packages" not in text


def test_check_reads_a_zip_and_prairielearns_folder_and_refuses_others(course, tmp_path):
    image = tmp_path / "pl" / "grader-image"
    image.mkdir(parents=True)
    version.write_record(LAB, image)
    with zipfile.ZipFile(tmp_path / "a.zip", "w") as z:
        z.write(tmp_path / "pl" / "grader-image" / "bundle.json", "bundle.json")
    with zipfile.ZipFile(tmp_path / "old.zip", "w") as z:
        z.writestr("setup.sh", "#!/bin/sh\n")
    assert version.check(LAB, tmp_path / "a.zip")[0] and version.check(LAB, tmp_path / "pl")[0]
    with pytest.raises(SystemExit, match="no bundle.json in it"):
        version.check(LAB, tmp_path / "old.zip")
    with pytest.raises(SystemExit, match="no bundle there"):
        version.check(LAB, tmp_path / "nothing")
    other = json.loads((tmp_path / "pl" / "grader-image" / "bundle.json").read_text())
    (tmp_path / "other.json").write_text(json.dumps(dict(other, lab="lab1_collectives")))
    with pytest.raises(SystemExit, match="a bundle of 'lab1_collectives'"):
        version.check(LAB, tmp_path / "other.json")


def test_check_from_the_cli(course, tmp_path, capsys):
    version.write_record(LAB, tmp_path)
    assert cli(["--solutions", str(course), "gradescope", LAB, "--check", str(tmp_path)]) == 0
    assert "up to date" in capsys.readouterr().out
    (course / LAB / "extra.py").write_text("x = 1\n")          # a file next to the notebook: the lab's too
    assert cli(["--solutions", str(course), "prairielearn", LAB, "--check", str(tmp_path)]) == 1
    assert f"the lab's notebook folder changed: solutions/{LAB}/extra.py (new)" in capsys.readouterr().out
