"""The course's nbgrader configuration (:file:`nbgrader_config.py`, next to this module), read once
per use and re-rooted at a private course directory; its cell timeout and due dates."""
from __future__ import annotations

from pathlib import Path

from traitlets.config import Config, PyFileConfigLoader

CONFIG_FILE = Path(__file__).resolve().with_name("nbgrader_config.py")


def load_config(root: Path | None = None, db: Path | None = None, **overrides) -> Config:
    """The course configuration (autograder/course/nbgrader_config.py), optionally re-rooted.

    ``root``: a private course directory (source/, release/, submitted/ ... below it).
    """
    loader = PyFileConfigLoader(CONFIG_FILE.name, path=str(CONFIG_FILE.parent))
    c = loader.load_config()
    if root is not None:
        c.CourseDirectory.root = str(root)
        c.CourseDirectory.source_directory = "source"
        c.CourseDirectory.release_directory = "release"
        c.CourseDirectory.db_url = "sqlite:///" + str(Path(db or Path(root) / "gradebook.db"))
    for dotted, value in overrides.items():
        section, name = dotted.split("__")
        setattr(getattr(c, section), name, value)
    return c


def cell_timeout() -> int:
    return int(load_config().Execute.timeout)


def due_dates() -> dict[str, str]:
    """{lab: due date} from the course configuration (``c.Minidist.due_dates``)."""
    c = load_config()
    dates = c.Minidist.due_dates if "Minidist" in c and "due_dates" in c.Minidist else {}
    return {str(k): str(v) for k, v in dict(dates).items() if v}
