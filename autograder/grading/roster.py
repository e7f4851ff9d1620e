"""A class roster: who each student folder is, for the files an LMS imports (``grade --roster``,
``export --roster``).

A CSV file, UTF-8 (a spreadsheet's byte-order mark is fine), whose first row names its columns:

* ``login`` (required): the student's folder name under SUBMISSIONS, unique;
* ``name``: the name the LMS shows (Canvas's ``Student``, Moodle's ``Full name``);
* ``email``: the e-mail address (Moodle can match students on it);
* ``lms_id``: the LMS's own id of the student (Canvas's ``ID``, the number in the user's page address;
  Moodle's ``ID number``);
* ``section``: Canvas's ``Section``.

Header names are matched ignoring case, spaces, hyphens and underscores (``E-mail``, ``LMS id``); the
columns come in any order, and every one but ``login`` may be left out or empty. A malformed roster is
refused with every problem and its line, before anything is graded; ``grade`` stores the roster it read
as ``OUT/roster.csv``, which ``export`` reads.
"""
from __future__ import annotations

import csv
import re
from dataclasses import astuple, dataclass
from pathlib import Path

FIELDS = ("login", "name", "email", "lms_id", "section")
#: where ``grade`` stores the roster, in its OUT
ROSTER_FILE = "roster.csv"
#: problems listed at most, in the error
MAX_PROBLEMS = 10


@dataclass(frozen=True)
class Student:
    login: str
    name: str = ""
    email: str = ""
    lms_id: str = ""
    section: str = ""


def _key(header: str) -> str:
    return re.sub(r"[\s_\-]+", "", header.strip().lower())


_COLUMNS = {_key(f): f for f in FIELDS}


def read_roster(path) -> dict[str, Student]:
    """{login: Student} from the roster at ``path``; SystemExit naming every problem (at most
    MAX_PROBLEMS) with its line."""
    path = Path(path)
    where = f"roster {path}"
    if not path.is_file():
        raise SystemExit(f"{where}: no such file")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise SystemExit(f"{where}: not UTF-8 text ({e.reason} at byte {e.start}); save it as CSV UTF-8") from None
    try:
        rows = [(n, row) for n, row in enumerate(csv.reader(text.splitlines()), 1) if any(c.strip() for c in row)]
    except csv.Error as e:
        raise SystemExit(f"{where}: not a CSV file ({e})") from None
    expected = f"a header row naming its columns: {', '.join(FIELDS)} (login required)"
    if not rows:
        raise SystemExit(f"{where}: empty; it needs {expected}, then one row per student")
    line, header = rows[0]
    columns = [_COLUMNS.get(_key(h)) for h in header]
    problems = []
    unknown = [h for h, c in zip(header, columns) if c is None]
    if unknown:
        problems.append(f"line {line}: unknown column(s) {', '.join(repr(h) for h in unknown)}; {expected}")
    twice = sorted({c for c in columns if c and columns.count(c) > 1})
    if twice:
        problems.append(f"line {line}: column(s) {', '.join(twice)} named twice")
    if "login" not in columns:
        problems.append(f"line {line}: no login column; {expected}")
    if problems:
        raise SystemExit(f"{where}: " + "; ".join(problems))
    if len(rows) == 1:
        raise SystemExit(f"{where}: no students after the header")
    out: dict[str, Student] = {}
    seen: dict[tuple[str, str], int] = {}
    for line, row in rows[1:]:
        if len(row) != len(header):
            problems.append(f"line {line}: {len(row)} fields, the header has {len(header)}")
            continue
        s = Student(**{c: v.strip() for c, v in zip(columns, row)})
        if not s.login:
            problems.append(f"line {line}: no login")
            continue
        if "/" in s.login or "\\" in s.login or s.login.startswith((".", "_")):
            problems.append(f"line {line}: login {s.login!r} cannot be a student folder under SUBMISSIONS")
        if s.email and not re.fullmatch(r"[^@\s]+@[^@\s]+", s.email):
            problems.append(f"line {line}: {s.email!r} is no e-mail address")
        for field in ("login", "email", "lms_id"):
            value = getattr(s, field)
            if value and (field, value) in seen:
                problems.append(f"line {line}: {field} {value!r} already on line {seen[(field, value)]}")
            seen.setdefault((field, value), line)
        out[s.login] = s
    if problems:
        more = f" (and {len(problems) - MAX_PROBLEMS} more)" if len(problems) > MAX_PROBLEMS else ""
        raise SystemExit(f"{where}: " + "; ".join(problems[:MAX_PROBLEMS]) + more)
    return out


def write_roster(roster: dict[str, Student], path) -> Path:
    """The roster as read, with the canonical header, sorted by login."""
    path = Path(path)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(FIELDS)
        w.writerows(astuple(roster[login]) for login in sorted(roster))
    return path


def batch_roster(out, override=None) -> dict[str, Student] | None:
    """The roster for batch OUT: ``override`` if given, else the one ``grade --roster`` stored there."""
    if override:
        return read_roster(override)
    stored = Path(out) / ROSTER_FILE
    return read_roster(stored) if stored.is_file() else None


def not_on_roster(roster: dict[str, Student], students) -> list[str]:
    return sorted(set(students) - set(roster))


def warning(roster_name: str, missing: list[str]) -> str:
    return (f"warning: {len(missing)} student(s) graded but not on the roster {roster_name} (their LMS rows carry "
            f"no name, e-mail, id or section): {', '.join(missing)}")
