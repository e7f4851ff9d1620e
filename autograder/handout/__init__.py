"""Handing out: what students and grading machines get, made from the course."""
