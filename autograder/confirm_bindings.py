"""Pristine bindings for the confirmation run (:mod:`autograder.confirm_runner`; standard
library only, it runs next to the runner in the sandbox).

Once the lab's setup cells have imported minidist's checks and torch, :class:`Snapshot` records
the attributes of every loaded minidist module, of torch's comparison and communication modules
and of their classes, and the code, defaults and closures of their functions.
:meth:`Snapshot.diff_and_restore` names what changed since and puts it back: the runner calls
it before every test (a change made by the solution cells is reported and undone) and after
(a change made while the test ran fails it).
"""
import sys
import types


_TORCH_MODULES = ("torch", "torch.testing", "torch.distributed", "torch.distributed.distributed_c10d",
                  "torch.nn", "torch.nn.functional", "torch.autograd", "torch.optim", "builtins", "math",
                  "operator", "functools", "copy")


_TORCH_CLASSES = ("torch.Tensor", "torch.nn.Module", "torch.nn.Parameter", "torch.nn.Linear",
                  "torch.optim.Optimizer", "torch.autograd.Function")


_CONTAINERS = (dict, list, set)


class Snapshot:
    """Attribute bindings of modules and classes, and the insides of their functions."""

    def __init__(self):
        self.spaces = {}          # key -> (owner, {name: value})
        self.inner = {}           # id(fn) -> (fn, code, defaults, kwdefaults, closure contents)
        self.contents = {}        # id(container) -> (container, copy)
        for name, mod in list(sys.modules.items()):
            if mod is not None and (name == "minidist" or name.startswith("minidist.") or name in _TORCH_MODULES):
                self._space(f"module {name}", mod)
                if name.startswith("minidist"):
                    for attr, value in list(vars(mod).items()):
                        if isinstance(value, type) and getattr(value, "__module__", "").startswith("minidist"):
                            self._space(f"class {value.__module__}.{value.__qualname__}", value)
                        elif isinstance(value, _CONTAINERS) and not attr.startswith("_"):   # tables, not caches
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
        self.spaces[key] = (owner, items)
        for value in items.values():
            fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if isinstance(fn, types.FunctionType) and id(fn) not in self.inner:
                cells = tuple(c.cell_contents if _filled(c) else EMPTY for c in (fn.__closure__ or ()))
                self.inner[id(fn)] = (fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__, cells)

    def diff_and_restore(self) -> list[str]:
        """What changed since the snapshot (each put back)."""
        changed = []
        for key, (owner, items) in self.spaces.items():
            now = vars(owner)
            for name, value in list(items.items()):
                if name in now and now[name] is not value and _torch_wrapper(now[name], value):
                    items[name] = now[name]        # torch wrapped its own function (a lazy import): kept
                elif name not in now or now[name] is not value:
                    changed.append(f"{key}.{name}" if name in now else f"{key}.{name} deleted")
                    _set(owner, name, value)
            for name in [n for n in list(now) if n not in items]:
                value = now[name]
                if isinstance(value, types.ModuleType) and key.startswith("module ") and \
                        value.__name__ == f"{key[7:]}.{name}":
                    continue          # a submodule imported since: not a change
                if key.startswith("module ") and name in ("__warningregistry__", "__loader__"):
                    continue
                changed.append(f"{key}.{name} added")
                _del(owner, name)
        for fn, code, defaults, kwdefaults, cells in self.inner.values():
            if fn.__code__ is not code:
                changed.append(f"{fn.__module__}.{fn.__qualname__}.__code__")
                fn.__code__ = code
            if fn.__defaults__ is not defaults or fn.__kwdefaults__ is not kwdefaults:
                changed.append(f"{fn.__module__}.{fn.__qualname__} defaults")
                fn.__defaults__, fn.__kwdefaults__ = defaults, kwdefaults
            for c, v in zip(fn.__closure__ or (), cells):
                if v is not EMPTY and (not _filled(c) or c.cell_contents is not v):
                    changed.append(f"{fn.__module__}.{fn.__qualname__} closure")
                    c.cell_contents = v
        for container, saved in self.contents.values():
            if (isinstance(container, dict) and (container.keys() != saved.keys() or
                                                 any(container[k] is not v for k, v in saved.items()))) or \
                    (not isinstance(container, dict) and container != saved):
                changed.append(f"contents of a minidist table ({type(container).__name__} of {len(saved)})")
                container.clear()
                container.update(saved) if not isinstance(container, list) else container.extend(saved)
        return changed


EMPTY = object()


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
