"""The grading kit: what every lab's checks share, written once (see ``minidist/checks/__init__.py``
for what each file holds, and docs/AUTHORING.md for how a lab uses it). Import from the files
themselves (``from minidist.checks.kit.check import Registry``): this package imports nothing, so the
grader's confirmation can import :mod:`minidist.protocol` and the kit's standard-library parts early.
"""
