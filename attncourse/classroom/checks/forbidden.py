"""Forbidden calls: refuse an answer that reaches a library function it was asked not to use, however it gets there.

Self-contained on purpose (the standard library and torch, no relative imports): the check cell imports it as a
module, and the grader sends this very source into the student's kernel and runs it there, so the check cell and
the grader refuse the same calls in the same way.

An exercise's ``forbid`` lists dotted names ("torch.nn.functional.scaled_dot_product_attention",
"attncourse.gqa.grouped_attention"). While the answer runs, :class:`CallGuard` records a call as forbidden when it
reaches the library's own function by any route:

* every spelling of it: the same function re-exported elsewhere in its package (``attncourse.X`` and
  ``attncourse.module.X``); for a PyTorch op ``X`` that exists as ``torch.X``, each of ``torch.X``,
  ``torch.Tensor.X`` (so ``x.softmax(-1)``), ``torch.nn.functional.X`` and ``torch.special.X``;
* any alias bound before the check ran (``from ... import f as g``, ``g = attncourse.f``, a default argument):
  Python functions are recognised by their code object, PyTorch's built-in ops by identity (Tensor methods by
  name and class), in a profile hook and in a ``TorchFunctionMode``; a function of the library held only by an
  alias in the notebook's namespace is found there by its name;
* a forbidden class (``torch.nn.MultiheadAttention``) forbids its own methods: building or calling one.

Only the library's own functions count: a function defined in the notebook and assigned to a forbidden name
(``attncourse.scaled_dot_product_attention = mine``) is the learner's own code. Library code that reaches the
same computation from C++ without passing through Python (``nn.MultiheadAttention``'s fast path calls the
fused kernel inside ATen) is not seen: forbid such an entry point by its own name. The guard records; it does
not raise, so the verdict does not depend on what the answer does with an exception. Switching the profile
hook off from inside the answer is recorded as a forbidden call of ``sys.setprofile``.
"""

import importlib
import importlib.util
import os
import sys

TORCH_SPELLINGS = ("torch.{}", "torch.Tensor.{}", "torch.nn.functional.{}", "torch.special.{}")


def message(name):
    """What a learner is told (check cell and grader alike)."""
    return f"your code called {name}, which this exercise asks you not to use"


def lookup(dotted):
    """The object a dotted name points to now (None if there is none)."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


_DIRS = {}


def _package_dirs(top):
    if top not in _DIRS:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        locations = list(getattr(spec, "submodule_search_locations", None) or []) if spec else []
        if spec is not None and not locations and spec.origin:
            locations = [os.path.dirname(spec.origin)]
        _DIRS[top] = tuple(os.path.realpath(d) for d in locations)
    return _DIRS[top]


def genuine(obj, top):
    """Whether `obj` is the library's own (package `top`), not something the notebook defined."""
    code = getattr(obj, "__code__", None)
    if code is not None:
        where = os.path.realpath(code.co_filename)
        return any(where.startswith(d + os.sep) for d in _package_dirs(top))
    if isinstance(obj, type):
        return (getattr(obj, "__module__", None) or "").split(".")[0] == top
    if not callable(obj):
        return False
    owner = getattr(obj, "__objclass__", None)
    module = getattr(obj, "__module__", None) or (getattr(owner, "__module__", None) if owner is not None else None)
    if module is None:
        module = getattr(getattr(obj, "__self__", None), "__name__", None)
    return isinstance(module, str) and module.split(".")[0] == top


def spellings(dotted):
    """The names under which the same function is reachable (see the module docstring)."""
    top, last = dotted.split(".")[0], dotted.rsplit(".", 1)[-1]
    names = [dotted]
    if top == "torch" and not last.startswith("_"):
        import torch

        if callable(getattr(torch, last, None)):
            names += [s.format(last) for s in TORCH_SPELLINGS if s.format(last) != dotted]
    return names


def resolve(dotted, namespace=None):
    """The library's own callables that `dotted` forbids, every spelling and alias included."""
    top, last = dotted.split(".")[0], dotted.rsplit(".", 1)[-1]
    candidates = [lookup(name) for name in spellings(dotted)]
    if top != "torch":  # re-exports: the same name in any loaded module of the package
        for name, module in list(sys.modules.items()):
            if module is not None and (name == top or name.startswith(top + ".")):
                candidates.append(getattr(module, last, None))
    found, seen = [], set()

    def keep(obj):
        if obj is not None and id(obj) not in seen and genuine(obj, top):
            seen.add(id(obj))
            found.append(obj)

    for obj in candidates:
        keep(obj)
    # An alias the notebook bound before the check, perhaps to a function whose every module-level name it then
    # re-bound: a library function of that name from the same module as a spelling or a function found above.
    homes = {name.rsplit(".", 1)[0] for name in spellings(dotted)} | {getattr(f, "__module__", None) for f in found}
    if namespace is None:
        namespace = getattr(sys.modules.get("__main__"), "__dict__", {})
    for value in list(namespace.values()):
        try:
            if getattr(value, "__name__", None) == last and getattr(value, "__module__", None) in homes:
                keep(value)
        except Exception:
            continue
    return found


class CallGuard:
    """Context manager recording, in ``used``, the forbidden names the code run inside it reached."""

    def __init__(self, names, namespace=None):
        self.codes, self.builtins, self.methods, self.used = {}, {}, {}, []
        for dotted in names:
            for obj in resolve(dotted, namespace):
                self._add(obj, dotted)
        self.mode = None
        self.previous = None
        self.installed = False

    def _add(self, obj, dotted):
        if isinstance(obj, type):
            for value in vars(obj).values():
                fn = getattr(value, "__func__", value)
                if getattr(fn, "__code__", None) is not None and genuine(fn, dotted.split(".")[0]):
                    self.codes.setdefault(fn.__code__, dotted)
            return
        code = getattr(obj, "__code__", None)
        if code is not None:
            self.codes.setdefault(code, dotted)
            return
        self.builtins.setdefault(obj, dotted)
        owner = getattr(obj, "__objclass__", None)
        name = getattr(obj, "__name__", None)
        if owner is not None and name:  # a method: x.softmax(-1) calls a bound method, never the descriptor
            self.methods.setdefault(name, []).append((owner, dotted))

    @property
    def active(self):
        return bool(self.codes or self.builtins)

    def _hit(self, dotted):
        if not self.used or self.used[-1] != dotted:
            self.used.append(dotted)

    def _profile(self, frame, event, arg):
        if event == "call":
            dotted = self.codes.get(frame.f_code)
            if dotted is not None:
                self._hit(dotted)
        elif event == "c_call":
            try:
                dotted = self.builtins.get(arg)
            except TypeError:
                dotted = None
            if dotted is None and self.methods:
                for owner, name in self.methods.get(getattr(arg, "__name__", None), ()):
                    if isinstance(getattr(arg, "__self__", None), owner):
                        dotted = name
                        break
            if dotted is not None:
                self._hit(dotted)
        if self.previous is not None:
            self.previous(frame, event, arg)

    def __enter__(self):
        if not self.active:
            return self
        if self.builtins:
            from torch.overrides import TorchFunctionMode

            guard = self

            class Watch(TorchFunctionMode):
                def __torch_function__(self, func, types, args=(), kwargs=None):
                    try:
                        dotted = guard.builtins.get(func)
                    except TypeError:
                        dotted = None
                    if dotted is not None:
                        guard._hit(dotted)
                    return func(*args, **(kwargs or {}))

            self.mode = Watch()
            self.mode.__enter__()
        previous = sys.getprofile()
        self.previous = previous if callable(previous) else None
        sys.setprofile(self._profile)
        self.installed = True
        return self

    def __exit__(self, *exc):
        if not self.installed:
            return False
        hook = sys.getprofile()
        sys.setprofile(self.previous)
        self.installed = False
        if self.mode is not None:
            try:
                self.mode.__exit__(None, None, None)
            except Exception:  # the answer emptied the mode stack itself
                self._hit("torch function modes")
            self.mode = None
        if getattr(hook, "__self__", None) is not self:
            self._hit("sys.setprofile")
        return False
