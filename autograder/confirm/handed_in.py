"""Files handed in next to the notebook, as modules only the student's own code can import
(standard library and minidist.protocol only: the confirmation's runner imports it, and a
sandboxed kernel runs it as an IPython startup file before any cell).

A helper module handed in with the notebook is importable, but

* only by student code: an import made by torch, minidist or the standard library never finds it
  (torch tries ``import opt_einsum`` while it is imported; a file of that name next to the notebook
  would otherwise run inside the lab's setup cell, before any snapshot of the checks);
* never under the name of a standard or installed module (refused, and listed in ``refused``);
* from the end of the meta path: whatever is installed is found first.

The folder itself leaves ``sys.path`` (IPython puts the working folder first).
"""
import importlib.abc
import importlib.machinery
import os
import sys

from minidist.protocol import NOTEBOOK_CELL

_IMPORT_MACHINERY = ("<frozen", os.path.dirname(importlib.__file__) + os.sep)


class HandedIn(importlib.abc.MetaPathFinder):
    def __init__(self, folder: str, is_student):
        self.folder, self.is_student, self.refused = folder, is_student, []
        self.path = [p for p in sys.path if p not in ("", ".", folder) and os.path.abspath(p or ".") != folder]

    def find_spec(self, name, path=None, target=None):
        if path is not None:             # a submodule: its package's own __path__ finds it
            return None
        f = sys._getframe(1)
        while f is not None and f.f_code.co_filename.startswith(_IMPORT_MACHINERY):
            f = f.f_back
        if f is None or not self.is_student(f.f_code):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, [self.folder])
        if spec is None:
            return None
        if name in sys.stdlib_module_names or importlib.machinery.PathFinder.find_spec(name, self.path) is not None:
            if name not in self.refused:
                self.refused.append(name)
            return None
        return spec


def install(folder: str, is_student) -> HandedIn:
    folder = os.path.abspath(folder)
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != folder]
    finder = HandedIn(folder, is_student)
    sys.meta_path.append(finder)
    return finder


def _notebook_cell(code) -> bool:
    """In a kernel: code of a notebook cell (ipykernel's cell files) or of a file handed in."""
    name = code.co_filename
    return bool(NOTEBOOK_CELL.search(name)) or name.startswith(os.getcwd() + os.sep)


def shadows(name: str) -> bool:
    """A standard or installed module of that name exists (a handed-in file may not take its place)."""
    return name in sys.stdlib_module_names or importlib.machinery.PathFinder.find_spec(
        name, [p for p in sys.path if p not in ("", ".")]) is not None


if __name__ == "__main__" and "IPython" in sys.modules:          # an IPython startup file
    install(os.getcwd(), _notebook_cell)
    del install, HandedIn, _notebook_cell
