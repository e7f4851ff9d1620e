"""Bindings that graded code must leave as it found them: minidist's modules and classes, torch's
comparison and communication modules, and the code, defaults and closures of their functions.

A check compares the student's results with its references using these; graded code that rebinds one
(``minidist.checks.kit.compare.TOLERANCE[torch.float32] = 1.0``, ``torch.allclose = ...``) would
change the verdict. :class:`Snapshot` records them; :meth:`Snapshot.diff_and_restore` names what
changed since and puts it back. Two users:

* :class:`minidist.checks.kit.refusal.refusing`, around every graded region (a check's body on each
  rank, a pure check's call): a snapshot of the code (``code_only``: functions, classes, modules;
  data such as a counter torch or the runtime updates is not watched), checked each time a graded
  call returns, so a rebinding is undone before the check compares anything, and fails the test;
* the grader's confirmation (:mod:`autograder.confirm.runner`), of everything, once the lab's setup
  cells have imported minidist's checks and torch: put back before every test (a change made by
  the solution cells is reported and undone) and checked after (a change made while the test ran
  fails it).

Standard library only: the confirmation imports it before any student code runs.
"""
import operator
import warnings
import sys
import types


_TORCH_MODULES = ("torch", "torch.testing", "torch.distributed", "torch.distributed.distributed_c10d",
                  "torch.nn", "torch.nn.functional", "torch.autograd", "torch.optim", "builtins", "math",
                  "operator", "functools", "copy")


_TORCH_CLASSES = ("torch.Tensor", "torch.nn.Module", "torch.nn.Parameter", "torch.nn.Linear",
                  "torch.optim.Optimizer", "torch.autograd.Function")


_CONTAINERS = (dict, list, set)


class Snapshot:
    """Attribute bindings of modules and classes, the insides of their functions, and the contents
    of minidist's public tables (``code_only``: bindings to functions, classes and modules, and
    minidist's public constants; only tables that are dicts: the lists are the tracer's stacks,
    which the checks push onto)."""

    def __init__(self, code_only: bool = False):
        self.code_only = code_only
        self.spaces = {}          # key -> (owner, {name: value})
        self.inner = {}           # id(fn) -> (fn, code, defaults, kwdefaults, closure contents)
        self.contents = {}        # id(container) -> (container, copy)
        with warnings.catch_warnings():     # reading torch's deprecated aliases warns; stderr fails a cell
            warnings.simplefilter("ignore")
            self._record()
            self._index()

    def _record(self):
        self.modules = len(sys.modules)
        for name, mod in list(sys.modules.items()):
            if f"module {name}" in self.spaces:
                continue
            if mod is not None and (name == "minidist" or name.startswith("minidist.") or name in _TORCH_MODULES):
                self._space(f"module {name}", mod)
                if name.startswith("minidist"):
                    for attr, value in list(vars(mod).items()):
                        if isinstance(value, type) and getattr(value, "__module__", "").startswith("minidist"):
                            self._space(f"class {value.__module__}.{value.__qualname__}", value)
                        elif isinstance(value, _CONTAINERS) and not attr.startswith("_") and \
                                not (self.code_only and not isinstance(value, dict)):     # tables, not caches
                            self.contents[id(value)] = (value, self._copy(value))
        for dotted in _TORCH_CLASSES:
            mod, _, attr = dotted.rpartition(".")
            cls = getattr(sys.modules.get(mod), attr, None)
            if isinstance(cls, type):
                self._space(f"class {dotted}", cls)

    @staticmethod
    def _copy(c):
        return dict(c) if isinstance(c, dict) else list(c) if isinstance(c, list) else set(c)

    def _space(self, key, owner):
        try:
            items = dict(vars(owner))
        except TypeError:
            return
        if self.code_only:
            items = {k: v for k, v in items.items() if self._watched(key, k, v)}
        self.spaces[key] = (owner, items)
        for value in items.values():
            self._inner(value, again=False)

    @staticmethod
    def _watched(key: str, name: str, value) -> bool:
        """In ``code_only`` mode: code anywhere, and minidist's public constants (a check's tolerance,
        ``TOL``, is a float); not the private state the runtime keeps (``_rank_device``) nor torch's data."""
        return _is_code(value) or (key.startswith(("module minidist", "class minidist")) and not name.startswith("_"))

    def _inner(self, value, again: bool = True):
        fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if isinstance(fn, types.FunctionType) and (again or id(fn) not in self.inner):
            cells = tuple(c.cell_contents if _filled(c) else EMPTY for c in (fn.__closure__ or ()))
            # code_only is the confirmation's watch: there, reading a function's code or defaults is an
            # audited event (a call of the audit hook each, thousands per check), and the audit hook
            # refuses assigning them for minidist's and torch's functions itself
            inside = (None, None, None) if self.code_only else (fn.__code__, fn.__defaults__, fn.__kwdefaults__)
            self.inner[id(fn)] = (fn, *inside, cells)

    def diff_and_restore(self) -> list[str]:
        """What changed since the snapshot (each put back)."""
        return self._diff(restore=True)

    def accept(self) -> list[str]:
        """What changed since the snapshot, kept: the snapshot is now of the present bindings (a
        check's own patch around a graded call, made before it, is not the graded call's doing)."""
        return self._diff(restore=False)

    def _index(self):
        """The snapshot as flat tuples that :meth:`_unchanged` compares in C loops: every return of a
        graded call pays for a check (1.5 ms walked in Python, 0.1 ms so)."""
        spaces = []
        for owner, items in self.spaces.values():
            d = vars(owner)
            keys = tuple(items)
            spaces.append((d, len(d), _getter(keys), tuple(items.values())))
        fns = () if self.code_only else tuple(fn for fn, *_ in self.inner.values())
        cells = [(c, v) for fn, _, _, _, saved in self.inner.values() for c, v in zip(fn.__closure__ or (), saved)
                 if v is not EMPTY]
        inner = (fns, tuple(i[1] for i in self.inner.values()), tuple(i[2] for i in self.inner.values()),
                 tuple(i[3] for i in self.inner.values()), tuple(c for c, _ in cells), tuple(v for _, v in cells))
        tables = [(c, len(saved), _getter(tuple(saved)), tuple(saved.values())) if isinstance(c, dict) else (c, saved)
                  for c, saved in self.contents.values()]
        self._fast = (spaces, inner, tables)

    def _unchanged(self) -> bool:
        spaces, (fns, codes, defaults, kwdefaults, cells, contents), tables = self._fast
        try:
            for d, n, get, values in spaces:
                if len(d) != n or not all(map(operator.is_, get(d), values)):
                    return False
            if not (all(map(operator.is_, map(_CODE, fns), codes)) and all(map(operator.is_, map(_DEFAULTS, fns), defaults))
                    and all(map(operator.is_, map(_KWDEFAULTS, fns), kwdefaults))
                    and all(map(operator.is_, map(_CONTENTS, cells), contents))):
                return False
            for table in tables:
                if len(table) == 2:
                    if table[0] != table[1]:
                        return False
                elif len(table[0]) != table[1] or not all(map(operator.is_, table[2](table[0]), table[3])):
                    return False
        except (KeyError, ValueError):
            return False
        return True

    def _diff(self, restore: bool) -> list[str]:
        if len(sys.modules) != self.modules:        # a module imported since: watched from now on
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._record()
                self._index()
        if self._unchanged():
            return []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            changed = self._slow_diff(restore)
            self._index()
            return changed

    def _slow_diff(self, restore: bool) -> list[str]:
        changed = []
        for key, (owner, items) in self.spaces.items():
            self._diff_space(key, owner, items, restore, changed)
        for fn, code, defaults, kwdefaults, cells in list(self.inner.values()):
            before = len(changed)
            if self.code_only:
                pass
            elif fn.__code__ is not code:
                changed.append(f"{fn.__module__}.{fn.__qualname__}.__code__")
                if restore:
                    fn.__code__ = code
            if not self.code_only and (fn.__defaults__ is not defaults or fn.__kwdefaults__ is not kwdefaults):
                changed.append(f"{fn.__module__}.{fn.__qualname__} defaults")
                if restore:
                    fn.__defaults__, fn.__kwdefaults__ = defaults, kwdefaults
            for c, v in zip(fn.__closure__ or (), cells):
                if v is not EMPTY and (not _filled(c) or c.cell_contents is not v):
                    changed.append(f"{fn.__module__}.{fn.__qualname__} closure")
                    if restore:
                        c.cell_contents = v
            if not restore and len(changed) > before:
                self._inner(fn)
        for key, (container, saved) in list(self.contents.items()):
            if (isinstance(container, dict) and (container.keys() != saved.keys() or
                                                 any(container[k] is not v for k, v in saved.items()))) or \
                    (not isinstance(container, dict) and container != saved):
                changed.append(f"contents of a minidist table ({type(container).__name__} of {len(saved)})")
                if not restore:
                    self.contents[key] = (container, self._copy(container))
                    continue
                container.clear()
                container.update(saved) if not isinstance(container, list) else container.extend(saved)
        return changed

    def _diff_space(self, key, owner, items, restore, changed):
        now = vars(owner)
        for name, value in list(items.items()):
            if name in now and now[name] is not value and _torch_wrapper(now[name], value):
                items[name] = now[name]        # torch wrapped its own function (a lazy import): kept
            elif name not in now or now[name] is not value:
                changed.append(f"{key}.{name}" if name in now else f"{key}.{name} deleted")
                if restore:
                    _set(owner, name, value)
                elif name in now and (not self.code_only or self._watched(key, name, now[name])):
                    items[name] = now[name]
                    self._inner(now[name])
                else:
                    del items[name]
        for name in [n for n in list(now) if n not in items]:
            value = now[name]
            if self.code_only and not self._watched(key, name, value):
                continue
            if isinstance(value, types.ModuleType) and key.startswith("module ") and \
                    value.__name__ == f"{key[7:]}.{name}":
                continue          # a submodule imported since: not a change
            if key.startswith("module ") and name in ("__warningregistry__", "__loader__"):
                continue
            if key.startswith("class ") and name == "__slotnames__" and value == _slotnames(owner):
                items[name] = value      # copyreg's cache, made by the first copy of an instance: watched from now
                continue
            changed.append(f"{key}.{name} added")
            if restore:
                _del(owner, name)
            else:
                items[name] = value
                self._inner(value)


def _slotnames(cls) -> list:
    """What ``copyreg`` caches as ``cls.__slotnames__`` when an instance is first copied or pickled (its
    ``_slotnames``, computed without caching): a class gaining exactly that is no one's doing."""
    names = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                stripped = c.__name__.lstrip("_")
                name = f"_{stripped}{name}" if stripped else name
            names.append(name)
    return names


EMPTY = object()
_CODE, _DEFAULTS, _KWDEFAULTS = (operator.attrgetter(a) for a in ("__code__", "__defaults__", "__kwdefaults__"))
_CONTENTS = operator.attrgetter("cell_contents")


def _getter(keys: tuple):
    """d -> the tuple of d's values at ``keys`` (itemgetter gives a bare value for one key)."""
    if len(keys) == 1:
        return lambda d, k=keys[0]: (d[k],)
    return operator.itemgetter(*keys) if keys else (lambda d: ())


def _is_code(value) -> bool:
    """What a check's computation can run: a function, a class, a module, a method descriptor."""
    return isinstance(value, (type, types.ModuleType, staticmethod, classmethod, property)) or callable(value)


def _torch_wrapper(new, old) -> bool:
    """``new`` is torch's own wrapper of ``old`` (importing ``torch._dynamo``, which a test may
    trigger, rebinds e.g. ``torch.manual_seed`` to a wrapper that calls the original): its code
    lives in torch's package and it wraps exactly the old function."""
    torch = sys.modules.get("torch")
    code = getattr(new, "__code__", None)
    if torch is None or code is None or getattr(new, "__wrapped__", None) is not old:
        return False
    root = torch.__file__.rsplit("/", 1)[0] + "/"
    return code.co_filename.startswith(root)


def _filled(cell):
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def _set(owner, name, value):
    if isinstance(owner, types.ModuleType):
        vars(owner)[name] = value
    else:
        type.__setattr__(owner, name, value)


def _del(owner, name):
    if isinstance(owner, types.ModuleType):
        vars(owner).pop(name, None)
    else:
        try:
            type.__delattr__(owner, name)
        except (AttributeError, TypeError):
            pass
