"""Device-discipline cases (see tests/device_discipline.py): filled in by the library's owners."""
from device_discipline import Case  # noqa: F401

CASES: dict = {}
EXEMPT: dict = {}
