"""Flags for the instructor, read from a submission's source (no score change).

Every code cell of the submitted notebook is parsed (IPython syntax turned into Python first)
and searched for what honest lab code has no reason to do: assign attributes of imported
modules (``torch.allclose = ...``, ``checks.check_add = ...``), ``setattr`` on a module,
touch ``sys.modules``, ``gc``, ``ctypes``, ``__code__``, ``builtins``, frames, or name a file
outside the working folder. The source is the one thing a kernel cannot rewrite after the
fact, so these flags hold even where the kernel could hide what it did at run time; code that
builds its names at run time (``getattr(__import__("c" + "types"), ...)``) escapes them, which
is why ``exec``/``eval``/``__import__`` are flagged too. The confirmation run adds what its
audit hook saw (:mod:`autograder.confirm.audit`).
"""
from __future__ import annotations

import ast

SUSPICIOUS_NAMES = {
    "gc": "uses gc", "ctypes": "uses ctypes", "builtins": "touches builtins", "__builtins__": "touches builtins",
    "__import__": "calls __import__", "exec": "calls exec", "eval": "calls eval",
}
SUSPICIOUS_ATTRS = {
    "__code__": "touches __code__", "modules": None, "_getframe": "reads frames", "f_back": "reads frames",
    "f_locals": "reads frames", "f_globals": "reads frames", "tb_frame": "reads frames",
    "settrace": "calls settrace", "setprofile": "calls setprofile", "addaudithook": "adds an audit hook",
    "__globals__": "touches __globals__", "__closure__": "touches __closure__", "__wrapped__": "uses __wrapped__",
}
FILE_CALLS = {"open", "Path", "listdir", "scandir", "walk", "glob", "iglob", "rmtree", "remove", "unlink",
              "rename", "copy", "copyfile", "copytree", "chdir", "system", "popen", "Popen", "run", "check_output"}


def _transform(source: str) -> str:
    if not any(line.lstrip().startswith(("%", "!")) for line in source.splitlines()):
        return source
    try:
        from IPython.core.inputtransformer2 import TransformerManager
        return TransformerManager().transform_cell(source)
    except Exception:
        return "\n".join("" if l.lstrip().startswith(("%", "!")) else l for l in source.splitlines())


def _outside(path: str) -> bool:
    return path.startswith(("/", "~")) or ".." in path.replace("\\", "/").split("/")


def cell_flags(source: str) -> list[str]:
    """What one cell does that a lab never asks for, one short phrase each."""
    try:
        tree = ast.parse(_transform(source))
    except SyntaxError:
        return []
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules.add((a.asname or a.name).split(".")[0])
                if a.name.split(".")[0] in ("gc", "ctypes", "builtins"):
                    modules.add(a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in ("gc", "ctypes", "builtins"):
                modules.add(node.module.split(".")[0])
            if node.module.split(".")[0] in ("minidist", "torch"):
                for a in node.names:          # from minidist.checks import lab1 as checks: a module too
                    modules.add(a.asname or a.name)
    out = [SUSPICIOUS_NAMES[m] for m in ("gc", "ctypes", "builtins") if m in modules]

    def root(expr):
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and root(t) in modules | {"torch", "dist", "minidist", "checks",
                                                                         "sys", "os", "F", "nn"}:
                    out.append(f"assigns {ast.unparse(t)} (an attribute of an imported module)")
                if isinstance(t, ast.Subscript) and "modules" in ast.unparse(t.value):
                    out.append("changes sys.modules")
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else None
            if name in ("setattr", "delattr") and node.args:
                target = node.args[0]
                if root(target) in modules or isinstance(target, ast.Call):
                    out.append(f"{name}() on {ast.unparse(target)[:60]} (a module)")
            if name in FILE_CALLS:
                for arg in node.args[:1]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _outside(arg.value):
                        out.append(f"file access outside the working folder: {name}({arg.value!r})"[:160])
            if name in SUSPICIOUS_NAMES and isinstance(fn, ast.Name) and name in ("exec", "eval", "__import__"):
                out.append(SUSPICIOUS_NAMES[name])
        elif isinstance(node, ast.Attribute):
            if node.attr == "modules" and root(node) == "sys":
                out.append("touches sys.modules")
            elif SUSPICIOUS_ATTRS.get(node.attr):
                out.append(SUSPICIOUS_ATTRS[node.attr])
        elif isinstance(node, ast.Name) and node.id in ("gc", "ctypes", "builtins", "__builtins__") and \
                node.id in modules | {"__builtins__"}:
            out.append(SUSPICIOUS_NAMES[node.id])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 300 and \
                node.value.startswith(("/work", "/home", "/root", "/etc", "/proc", "/tmp/", "../")) and "\n" not in node.value:
            out.append(f"names a path outside the working folder: {node.value!r}"[:160])
    seen, uniq = set(), []
    for f in out:
        if f not in seen:
            seen.add(f)
            uniq.append(f)
    return uniq


def notebook_flags(nb) -> list[str]:
    """``cell <id or #n>: <flag>`` for every code cell of a submitted notebook."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.get("cell_type") != "code":
            continue
        gid = (cell.get("metadata", {}).get("nbgrader", {}) or {}).get("grade_id")
        for f in cell_flags(cell.get("source", "")):
            out.append(f"cell {gid or '#' + str(i + 1)}: {f}")
    return out
