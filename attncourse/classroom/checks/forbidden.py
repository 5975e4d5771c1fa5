"""The guard: watch what a learner's answer runs, and refuse an answer that reaches what its exercise does not allow.

Self-contained on purpose (the standard library and torch, no relative imports): the check cell imports it as a
module, and the grader sends this very source into the student's kernel and runs it there, so the check cell and
the grader watch the same things in the same way (:func:`run` is what both call).

An exercise's policy (a plain dict, see :func:`policy`) says what the answer may run:

* ``library`` / ``allow``: the answer may not enter the course's own code (the package ``attncourse``: its
  lessons' functions, its modules' ``forward`` methods, the checks and their reference answers) except the
  functions, classes and modules ``allow`` lists (the helpers a learner is meant to use). A Python profile hook
  sees every Python function entered, so any route counts: an alias, a wrapper (``functools.partial``,
  ``@torch.no_grad()``, a lambda), a module's ``forward`` called through ``nn.Module.__call__``, the code object
  of a library function rebound in a new function. Library code that an allowed helper runs (its own helpers,
  its sub-modules' ``forward``) is the helper's, not the answer's.
* ``ops``: families of PyTorch operators the answer may not run (``attention``, ``softmax``, ``logsumexp``, or
  ``torch`` for an answer that must use NumPy alone): seen at two levels, so every spelling counts: a
  ``TorchFunctionMode`` sees the function called (``F.softmax``, ``x.softmax``, ``torch.ops.aten._safe_softmax``,
  ``torch.ops.aten._scaled_dot_product_attention_math``, which decomposes before dispatch) and a
  ``TorchDispatchMode`` sees the ATen operator that really runs (``aten::_softmax`` under whatever name reached it).
  Python code of PyTorch that does the same job (``F.multi_head_attention_forward``, FlexAttention) counts by
  its function's name, and libraries that would do the whole job (SciPy's softmax, JAX, flash-attn, ...) by
  their package.
* ``forbid``: dotted names, recognised by identity under every spelling and alias (see :func:`resolve`); kept
  for exercises that forbid one function by name.
* ``trace``: record what ran (each ATen operator, its tensors' shapes, which of them are views of the answer's
  inputs and where, whether a Triton kernel launch or an allowed helper ran it) for the exercise's property
  check, which reads the record outside the answer's reach.
* ``stream``: hand one argument to the answer as a one-shot stream of chunks, each chunk overwritten with NaN as
  soon as the next is asked for (:class:`Chunks`).

Switching the watch off from inside the answer (``sys.setprofile``, popping a mode, disabling the dispatcher's
Python key) is itself refused. The guard records; it does not raise, so the verdict does not depend on what the
answer does with an exception. Code that is the course's own, copied as text and run afresh (pasted into a cell,
``exec(inspect.getsource(...))``, a module's file executed), is recognised by its bytecode, whatever its names for
locals, docstring, comments or file: it counts as the course's code. Code typed afresh, with its own structure, is
the learner's.
"""

import importlib
import math
import importlib.util
import os
import re
import sys
import sysconfig
import types

if "copies" not in globals():  # the grader's kernel runs this source with .copies given in its namespace
    from . import copies

TORCH_SPELLINGS = ("torch.{}", "torch.Tensor.{}", "torch.nn.functional.{}", "torch.special.{}")
LIBRARY = "attncourse"

# Operator families, matched against a normalised name (no "aten::", no overload, no leading "_", no "special_").
FAMILIES = {
    "attention": re.compile(r"(scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|"
                            r"multi_head_attention|flex_attention|fused_sdp|transformer_encoder_layer|"
                            r"native_multi_head|triton_multi_head|sdpa)"),
    "softmax": re.compile(r"^((safe|masked|sparse|log|sparse_log)_)?softmax|^softmin|^gumbel_softmax"),
    "logsumexp": re.compile(r"^(logsumexp|logaddexp2?|logcumsumexp)"),
    "torch": re.compile(r"."),  # any operator: an answer that must use NumPy alone
    "numpy": re.compile(r"(?!)"),  # no PyTorch operator: NumPy itself, for an answer that is a rule in plain Python
    "complex": re.compile(r"^(view_as_complex|view_as_real|complex|polar)$"),  # and any operator on a complex tensor
}
WORDS = {"attention": "a fused attention kernel", "softmax": "a softmax", "logsumexp": "a log-sum-exp",
         "torch": "a PyTorch operation (this exercise's answer is NumPy alone, or plain Python)",
         "rule": "PyTorch or NumPy (this answer is a rule in plain Python)",
         "numpy": "NumPy (this answer is judged by what it runs in PyTorch, or is a rule in plain Python)",
         "complex": "complex numbers (this exercise asks for the arithmetic on real numbers)",
         "bits": "floating-point numbers reinterpreted as integers (the arithmetic must run in PyTorch, where the "
                 "check sees it)",
         "scalars": "more numbers read out of tensors into plain Python than this exercise allows (the arithmetic "
                    "must run in PyTorch, where the check sees it)"}
# Families whose whole job other libraries would do: their code is refused with the family.
PACKAGES = {
    "attention": ("flash_attn", "xformers", "transformers", "jax", "tensorflow", "keras", "einx"),
    "softmax": ("scipy", "sklearn", "jax", "tensorflow", "keras"),
    "logsumexp": ("scipy", "sklearn", "jax", "tensorflow", "keras"),
    "torch": ("scipy", "sklearn", "jax", "tensorflow", "keras", "torch"),
    "numpy": ("numpy", "scipy", "sklearn", "jax", "tensorflow", "keras", "pandas", "numba", "cupy"),
}
# PyTorch operators that only move or describe data: never an "operation" for a trace's arithmetic count.
DATA_OPS = re.compile(r"^(view|_unsafe_view|reshape|expand|permute|transpose|t|slice|select|unsqueeze|squeeze|"
                      r"alias|detach|lift_fresh|clone|contiguous|_to_copy|copy_|empty|empty_like|empty_strided|"
                      r"zeros|zeros_like|ones|ones_like|full|full_like|new_empty|new_zeros|new_full|new_ones|"
                      r"arange|_local_scalar_dense|as_strided|split|split_with_sizes|unbind|chunk|narrow|"
                      r"diagonal|unfold|is_nonzero|item|set_|resize_|scalar_tensor|fill_|zero_|_copy_from|"
                      r"_has_compatible_shallow_copy_type|sym_size|sym_stride|sym_numel|sym_storage_offset)$")
ESCAPES = ("setprofile", "settrace", "_pop_mode", "_pop_torch_function_stack", "_set_torch_function_mode",
           "_set_dispatch_mode", "_unset_dispatch_mode", "_DisableTorchDispatch", "DisableTorchFunction",
           "DisableTorchFunctionSubclass", "_disabled_torch_function_impl", "_DisablePythonDispatcher",
           "_ExcludeDispatchKeyGuard", "_force_dispatch_key_set", "_set_dispatch_mode_stack",
           # reaching the guard or the check's frames (the verdict, the trace, the expected values) from the answer
           "getprofile", "gettrace", "_getframe", "_current_frames", "get_objects", "get_referrers",
           "get_referents")
# The same through the standard library's Python (inspect.stack(), traceback.walk_stack()), entered from the answer.
FRAME_FUNCS = ("currentframe", "stack", "getouterframes", "getinnerframes", "walk_stack", "extract_stack",
               "print_stack", "format_stack", "walk_tb", "trace", "getframeinfo")
# Work started outside the watch (the hook and the modes are per thread): refused from anywhere in the answer
# unless an allowed helper does it.
ELSEWHERE = ("start_new_thread", "start_new", "start_joinable_thread", "_start_joinable_thread", "fork", "forkpty",
             "posix_spawn", "posix_spawnp", "system", "fork_exec", "execv", "execve", "spawnv", "spawnve",
             "register_at_fork")
_FRAME_MODULES = ("inspect.py", "traceback.py")


def message(name):
    """What a learner is told (check cell and grader alike)."""
    return f"your code called {name}, which this exercise asks you not to use"


def policy(forbid=(), allow=(), ops=(), library=True, trace=False, stream=None, source=False):
    """An exercise's policy as a plain dict (what the grader sends to the kernel); `source`: record the answer's
    source in the trace (a find-the-bug exercise judges the edit, see :mod:`.edits`)."""
    return {"forbid": tuple(forbid), "allow": tuple(allow), "ops": tuple(ops), "library": bool(library),
            "trace": bool(trace), "stream": stream, "source": bool(source)}


def source_of(func):
    """`func`'s source as its cell holds it, kept only when compiling that text gives `func`'s own bytecode and
    names (a function whose code was swapped for another's has no source); else ``{"why": ...}``."""
    import inspect
    import textwrap

    code = getattr(func, "__code__", None)
    if code is None or not inspect.isfunction(func):
        return {"why": "it is not a function defined with def"}
    try:
        text = textwrap.dedent(inspect.getsource(func))
        compiled = compile(text, code.co_filename, "exec")
    except (OSError, TypeError, SyntaxError) as err:
        return {"why": f"{type(err).__name__}: {err}"[:200]}
    found = [c for c in compiled.co_consts if isinstance(c, types.CodeType) and c.co_name == code.co_name]
    try:  # and the whole cell: CPython compiles `math.sqrt(x)` otherwise when the same text imports `math`
        whole = compile("".join(__import__("linecache").getlines(code.co_filename)), code.co_filename, "exec")
        found.extend(_code_objects(whole, code.co_name, code.co_firstlineno))
    except (SyntaxError, ValueError, TypeError):
        pass
    if not any(c.co_code == code.co_code and c.co_names == code.co_names for c in found):
        return {"why": "its text does not compile to the code that runs"}
    return text


def _code_objects(code, name, line):
    """The code objects named `name` that start on `line`, anywhere inside `code`."""
    inner = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return [c for c in inner if (c.co_name, c.co_firstlineno) == (name, line)] + \
        [found for c in inner for found in _code_objects(c, name, line)]


def normalise(name):
    """An operator's name without namespace, overload and leading underscores (``aten::_softmax.int`` -> softmax)."""
    name = str(name).split("::")[-1].split(".")[0].lstrip("_")
    return name[len("special_"):] if name.startswith("special_") else name


_FAMILY_OF = {}


def family_of(name, families):
    """The first of `families` that operator or function `name` belongs to, or None (cached)."""
    key = (name, families)
    if key not in _FAMILY_OF:
        _FAMILY_OF[key] = _family_of(name, tuple(families))
    return _FAMILY_OF[key]


def _family_of(name, families):
    base = normalise(name)
    for fam in families:
        pattern = FAMILIES.get(fam)
        if pattern is not None and pattern.search(base):
            return fam
        if pattern is None and base == normalise(fam):  # an operator named by itself
            return fam
    return None


def lookup(dotted):
    """The object a dotted name points to now (None if there is none)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
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


# --- the course's code copied as text: recognised by what it compiles to (fingerprints in .copies)
_PRINTS = {}  # top -> ({exact fingerprint: dotted name}, names of the modules walked, copies.Cores)


def _library_prints(top):
    """({exact fingerprint: dotted name}, copies.Cores) of the function bodies of package `top`'s loaded modules
    (their functions, the methods of their classes, and what those define inside), extended as more modules load."""
    prints, walked, cores = _PRINTS.setdefault(top, ({}, set(), copies.Cores()))

    def walk(code, dotted):
        if copies.copyable(code) and len({line for _, _, line in code.co_lines() if line}) >= copies.MIN_LINES:
            key = copies.exact(code)
            if key is not None:
                prints.setdefault(key, dotted)
            if copies.has_checks(code):
                cores.add(code, dotted)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                walk(const, f"{dotted}.<locals>.{const.co_name}")

    def visit(obj, dotted, module, depth=0):
        obj = getattr(obj, "__func__", obj)
        obj = getattr(obj, "__wrapped__", obj)
        code = getattr(obj, "__code__", None)
        if isinstance(code, types.CodeType):
            if _in_package(code.co_filename, top):
                walk(code, dotted)
        elif isinstance(obj, property):
            for part in (obj.fget, obj.fset, obj.fdel):
                if part is not None:
                    visit(part, dotted, module, depth)
        elif isinstance(obj, type) and depth < 2 and getattr(obj, "__module__", None) == module:
            for name, value in list(vars(obj).items()):
                visit(value, f"{dotted}.{name}", module, depth + 1)

    for module in _package_modules(top):
        name = getattr(module, "__name__", None)
        if name in walked:
            continue
        walked.add(name)
        for attr, value in list(vars(module).items()):
            visit(value, f"{name}.{attr}", name)
    return prints, cores


_INSIDE = {}


def _in_package(filename, top):
    key = (filename, top)
    inside = _INSIDE.get(key)
    if inside is None:
        where = os.path.realpath(filename)
        inside = _INSIDE[key] = any(where.startswith(d + os.sep) for d in _package_dirs(top))
    return inside


def genuine(obj, top):
    """Whether `obj` is the library's own (package `top`), not something the notebook defined."""
    code = getattr(obj, "__code__", None)
    if code is not None:
        return _in_package(code.co_filename, top)
    if isinstance(obj, type):
        return (getattr(obj, "__module__", None) or "").split(".")[0] == top
    if not callable(obj):
        return False
    owner = getattr(obj, "__objclass__", None)
    module = getattr(obj, "__module__", None) or (getattr(owner, "__module__", None) if owner is not None else None)
    if module is None:
        module = getattr(getattr(obj, "__self__", None), "__name__", None)
    return isinstance(module, str) and module.split(".")[0] == top


def _of_numpy(obj):
    """Whether builtin `obj` is NumPy's: a function of a NumPy module, or a method of a NumPy object (an array, a
    scalar, a ufunc's ``reduce``, a random generator). A ufunc called directly (``np.exp(x)``) is not a builtin and
    raises no profile event: it is seen only when its result is used through a method or a NumPy function."""
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and module.split(".")[0] == "numpy":
        return True
    owner = getattr(obj, "__self__", None)
    if getattr(obj, "__name__", None) == "numpy" and type(owner).__module__.split(".")[0] == "torch":
        return True  # tensor.numpy(): the way out of PyTorch (np.asarray(tensor) ends there too)
    if owner is None:
        owner = getattr(obj, "__objclass__", None)
        return owner is not None and (getattr(owner, "__module__", None) or "").split(".")[0] == "numpy"
    if type(owner).__name__ == "module":
        return (getattr(owner, "__name__", None) or "").split(".")[0] == "numpy"
    return (getattr(type(owner), "__module__", None) or "").split(".")[0] == "numpy"


def _spell_numpy(obj):
    owner = getattr(obj, "__self__", None)
    name = getattr(obj, "__name__", "?")
    if owner is not None and type(owner).__name__ != "module":
        top = (type(owner).__module__ or "numpy").split(".")[0]
        return f"{top}.{'Tensor' if top == 'torch' else type(owner).__name__}.{name}"
    return f"numpy.{name}"


def spellings(dotted):
    """The names under which the same function is reachable (see the module docstring)."""
    top, last = dotted.split(".")[0], dotted.rsplit(".", 1)[-1]
    names = [dotted]
    if top == "torch" and not last.startswith("_"):
        import torch

        if callable(getattr(torch, last, None)):
            names += [s.format(last) for s in TORCH_SPELLINGS if s.format(last) != dotted]
    return names


_MODULES = {}


def _package_modules(top):
    """The loaded modules of package `top` (cached until more modules are loaded)."""
    known = _MODULES.get(top)
    if known is None or known[0] != len(sys.modules):
        known = (len(sys.modules), [m for name, m in list(sys.modules.items())
                                    if m is not None and (name == top or name.startswith(top + "."))])
        _MODULES[top] = known
    return known[1]


_RESOLVED = {}


def resolve(dotted, namespace=None):
    """The library's own callables that `dotted` forbids, every spelling and alias included."""
    top, last = dotted.split(".")[0], dotted.rsplit(".", 1)[-1]
    found, seen = [], set()

    def keep(obj):
        if obj is not None and id(obj) not in seen and genuine(obj, top):
            seen.add(id(obj))
            found.append(obj)

    key = (dotted, len(sys.modules))
    if key not in _RESOLVED:  # what the names point to now (cached while no module is loaded)
        candidates = [lookup(name) for name in spellings(dotted)]
        if top != "torch":  # re-exports: the same name in any loaded module of the package
            for module in _package_modules(top):
                candidates.append(getattr(module, last, None))
        _RESOLVED[key] = candidates
    for obj in _RESOLVED[key]:
        keep(obj)
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


def _codes_of(obj, top, depth=0):
    """Every code object of the library inside `obj` (a function, a class and its bases, a module)."""
    codes = []
    if depth > 3 or obj is None:
        return codes
    if isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            codes += _codes_of(f, top, depth + 1)
        return codes
    fn = getattr(obj, "__func__", obj)
    fn = getattr(fn, "__wrapped__", fn) if getattr(fn, "__code__", None) is None else fn
    code = getattr(fn, "__code__", None)
    if code is not None:
        if _in_package(code.co_filename, top):
            stack = [code]
            while stack:  # nested functions and lambdas defined inside it
                c = stack.pop()
                codes.append(c)
                stack += [k for k in c.co_consts if hasattr(k, "co_code")]
        return codes
    if isinstance(obj, type):
        for klass in obj.__mro__:
            if (getattr(klass, "__module__", "") or "").split(".")[0] != top:
                continue
            for value in vars(klass).values():
                codes += _codes_of(value, top, depth + 1)
        return codes
    if type(obj).__name__ == "module":
        for value in list(vars(obj).values()):
            if getattr(value, "__module__", None) == obj.__name__:
                codes += _codes_of(value, top, depth + 1)
    return codes


_SYSTEM = None
_HERE = os.path.realpath(globals().get("__file__") or "<attncourse call guard>")


def _system_dirs():
    global _SYSTEM
    if _SYSTEM is None:
        paths = set()
        for key in ("stdlib", "platstdlib", "purelib", "platlib"):
            try:
                paths.add(os.path.realpath(sysconfig.get_paths()[key]))
            except Exception:
                pass
        for p in sys.path:
            if p and ("site-packages" in p or "dist-packages" in p):
                paths.add(os.path.realpath(p))
        _SYSTEM = tuple(sorted(paths))
    return _SYSTEM


_PLACES, _MASKED = {}, os.sep + os.path.join("torch", "masked") + os.sep  # torch.masked's Python: softmax, ...
# PyTorch's Python entry points to operators (``torch.ops.aten.X``, ``F.X``): entered from the answer with the watch
# off, they are the answer's doing. (Elsewhere PyTorch calls its own Python back from C++ with the modes popped
# while it handles an operator; that is not the answer's doing, and a builtin the answer calls is checked anyway.)
_ENTRY = re.compile(r"torch[/\\](_ops|functional|nn[/\\]functional|_tensor)\.py$")
# The guard's own code that runs inside an answer: the stream's iterator and the two modes' handlers (entered
# from the answer's frame); anything else of the guard handed in or called by the answer is check code.
_GUARD_RUNS = ("with_gradients", "__iter__", "_gen", "__repr__", "<module>", "__exit__", "__enter__", "__torch_function__",
               "__torch_dispatch__")
_FOREIGN = tuple(sorted({p for names in PACKAGES.values() for p in names if p != "torch"}))


def _place(code):
    """Where a code object lives: "self" (this guard), "library" (the course package), "launch" (Triton's kernel
    launcher), "package:NAME" (a library that would do a whole job), "torch", "learner" or "other" (the
    standard library, other installed packages, generated code). Cached: the answer's guard asks often."""
    key = (code, code.co_filename)  # code objects compare equal across files: the file is part of the key
    place = _PLACES.get(key)
    if place is None:
        filename = code.co_filename
        if filename == "<attncourse call guard>" or os.path.realpath(filename) == _HERE:
            place = "self"
        elif _in_package(filename, LIBRARY):
            place = "library"
        elif "triton" + os.sep in filename and code.co_name == "run" and \
                os.path.basename(filename) in ("jit.py", "interpreter.py"):
            place = "launch"
        else:
            foreign = next((p for p in _FOREIGN if _in_package(filename, p)), None)
            if foreign is not None:
                place = "package:" + foreign
            elif _in_package(filename, "torch"):
                place = "torch"
            elif filename.startswith(("<ipython-input", "<cell")):
                place = "learner"
            elif filename.startswith("<"):
                place = "other"
            elif any(os.path.realpath(filename).startswith(d + os.sep) for d in _system_dirs()):
                place = "other"
            else:
                place = "learner"
        _PLACES[key] = place
    return place


class Chunks:
    """A one-shot stream of chunks of a tensor along `dim`: iterate it once; each chunk handed out is a fresh
    tensor, overwritten with NaN as soon as the next one is asked for (so an answer cannot keep reading it)."""

    def __init__(self, tensor, dim, size, guard=None):
        self._tensor, self._dim, self._size, self._guard = tensor, dim, int(size), guard
        self._started = False
        self.handed = 0

    def __iter__(self):
        if self._started:
            raise RuntimeError("this stream of chunks can be read only once")
        self._started = True
        return self._gen()

    def _gen(self):
        n = self._tensor.shape[self._dim]
        previous = None
        for start in range(0, n, self._size):
            if previous is not None:
                previous.fill_(float("nan"))
            chunk = self._tensor.narrow(self._dim, start, min(self._size, n - start)).clone()
            self.handed += 1
            if self._guard is not None:
                self._guard.label(chunk, f"chunk {self.handed - 1}")
            previous = chunk
            yield chunk
        if previous is not None:
            previous.fill_(float("nan"))

    def __repr__(self):
        return f"<a one-shot stream of chunks of {self._size} along dim {self._dim}>"


class Refused(BaseException):
    """Raised into the answer at its first refused call when the guard stops there (:func:`run`): a
    BaseException, so an answer's ``except Exception`` does not swallow it (and the verdict is recorded first)."""


class Guard:
    """Context manager recording, in ``used``, what the code run inside it reached that its policy forbids, and
    (with ``trace``) what it ran, in ``trace``."""

    def __init__(self, pol, namespace=None, stop=False):
        pol = dict(pol)
        self.pol = pol
        self.stop = stop
        self.pending = None
        self.codes, self.builtins, self.methods, self.used = {}, {}, {}, []
        for dotted in pol.get("forbid", ()):
            for obj in resolve(dotted, namespace):
                self._add(obj, dotted)
        if AUTOGRAD.intersection(pol.get("forbid", ())):  # the engine both reach, called directly
            import torch

            engine = getattr(torch._C, "_ImperativeEngine", None)
            for name in ("run_backward", "queue_callback"):
                if getattr(engine, name, None) is not None:
                    self._add(getattr(engine, name), f"torch.autograd's engine ({name})")
            for name in ("grad_fn", "_grad_fn"):  # the graph's nodes, called by hand, are the engine by another name
                self._add(getattr(torch.Tensor, name).__get__, f"torch.Tensor.{name} (autograd's graph nodes)")
        self.library = LIBRARY if pol.get("library") else None
        self.families = tuple(pol.get("ops", ()))
        self.allowed, self._keep = set(), []
        if self.library:
            for dotted in pol.get("allow", ()):
                for code in _codes_of(lookup(dotted), self.library):
                    self.allowed.add(id(code))  # by identity: equal bytecode elsewhere is not allowed
                    self._keep.append(code)
        self.packages = tuple(sorted({p for fam in self.families for p in PACKAGES.get(fam, ())}))
        self.tracing = bool(pol.get("trace"))
        self._sources = {0: None} if pol.get("source") else {}  # the kernels launched, when the source is judged
        self.scalars, self.scalar_budget = 0, None  # numbers read out of tensors (item, tolist): see run()
        self._complex = "complex" in self.families
        self.trace = {"ops": [], "counts": {}, "launches": 0, "dropped": 0, "read": 0}  # read: numbers of any dtype
        self.labels = {}
        self._kinds = {}
        self.copies = {}
        self._allowed_prints = {copies.exact(code) for code in self._keep}  # a copy of an allowed helper is allowed too
        self._allowed_frames = set()
        self._launch_frames = set()
        self.root = None
        self.modes = []
        self.previous = None
        self.installed = False
        self._in_audit, self._above = False, set()

    # --- what a code object is
    def _kind(self, code):
        key = (code, code.co_filename)
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._classify(code)
            self._kinds[key] = kind
        return kind

    def _classify(self, code):
        place = _place(code)
        if place in ("learner", "other") and self.library and copies.copyable(code):
            prints, cores = _library_prints(self.library)
            key = copies.exact(code)
            original = prints.get(key) if key not in self._allowed_prints else None
            found = cores.find(code) if original is None else None  # a copy with its input checks deleted
            if found is not None and found[1] not in self._keep:
                original = found[0]
            if original is not None:  # the course's code, copied as text
                self.copies[code] = original
                return "copy"
        if place == "library":
            if code.co_name == "<module>":
                return "self"
            if not self.library:
                return "other"
            return "allowed" if id(code) in self.allowed else "library"
        if place.startswith("package:"):
            return "package" if place[8:] in self.packages else "other"
        if place == "torch":
            name = ("masked_" if _MASKED in code.co_filename else "") + code.co_name  # torch.masked.softmax: masked_...
            if "torch" in self.packages or (self.families and family_of(name, self.families)):
                return "torchjob"
            return "torch"
        return place

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
        return bool(self.codes or self.builtins or self.library or self.families or self.tracing)

    def _hit(self, dotted, where=None, family=None):
        family = "rule" if family in ("torch", "numpy") and {"torch", "numpy"} <= set(self.families) else family
        text = dotted + (f" ({where})" if where else "") + (f", {WORDS.get(family, family)}" if family else "")
        if not any(u.split(" (")[0].split(",")[0] == dotted for u in self.used):
            self.used.append(text)
        if self.stop and self.installed:  # the verdict is recorded: stop the answer at its next operator
            self.pending = text

    def _stop_here(self):
        """Raise :class:`Refused` into the answer (from a mode's handler, never from the profile hook: raising there
        has crashed CPython 3.11) once a refusal is pending."""
        if self.pending is not None and self.installed:
            text, self.pending = self.pending, None
            raise Refused(text)

    def _where(self, frame):
        """The learner's line that led to `frame` (for the message), or None."""
        while frame is not None and frame is not self.root:
            if self._kind(frame.f_code) == "learner":
                name = frame.f_code.co_name
                return f"from {'your code' if name == '<module>' else name}, line {frame.f_lineno}"
            frame = frame.f_back
        return None

    def _inside_allowed(self, frame):
        """Whether an allowed library function is running between the nearest learner frame and `frame`."""
        while frame is not None and frame is not self.root:
            kind = self._kind(frame.f_code)
            if kind == "allowed":
                return True
            if kind == "learner":
                return False
            frame = frame.f_back
        return False

    def label(self, tensor, name):
        """Name `tensor`'s storage in the trace (an input, a chunk of a stream)."""
        try:
            self.labels[tensor.untyped_storage().data_ptr()] = (name, tensor.storage_offset(), tuple(tensor.stride()))
        except Exception:
            pass

    def label_inputs(self, args, kwargs):
        import torch

        def walk(x, name):
            if isinstance(x, torch.Tensor):
                self.label(x, name)
            elif isinstance(x, (tuple, list)):
                for i, v in enumerate(x):
                    walk(v, f"{name}[{i}]")
            elif isinstance(x, dict):
                for k, v in x.items():
                    walk(v, f"{name}[{k!r}]")
            elif isinstance(x, torch.nn.Module):
                for pname, p in x.named_parameters():
                    walk(p, f"{name}.{pname}")

        for i, a in enumerate(args):
            walk(a, f"arg{i}")
        for k, a in kwargs.items():
            walk(a, k)

    # --- the hooks
    def _intact(self):
        """Whether the answer left the watch on: both modes still stacked and the dispatcher's Python key on."""
        import torch

        C = torch._C
        for mode in self.modes:
            if type(mode).__name__ == "Watch":
                if not C._is_torch_function_mode_enabled() or not any(
                        C._get_function_stack_at(i) is mode for i in range(C._len_torch_function_stack())):
                    return False
            else:
                if C._dispatch_tls_is_dispatch_key_excluded(C.DispatchKey.Python) or not any(
                        C._get_dispatch_stack_at(i) is mode for i in range(C._len_torch_dispatch_stack())):
                    return False
        return True

    def _check_intact(self, frame):
        if self.modes and not self._intact():
            self._hit("a switch that turns PyTorch's operator watch off", self._where(frame))

    def _profile(self, frame, event, arg):
        if event == "call":
            if frame.f_back is not None and self._kind(frame.f_back.f_code) == "learner" and \
                    _ENTRY.search(frame.f_code.co_filename):
                self._check_intact(frame.f_back)
            code = frame.f_code
            dotted = self.codes.get(code)
            if dotted is not None:
                self._hit(dotted, self._where(frame.f_back))
            kind = self._kind(code)
            if code.co_name in FRAME_FUNCS and code.co_filename.endswith(_FRAME_MODULES) and frame.f_back is not None \
                    and self._kind(frame.f_back.f_code) == "learner":  # inspect.stack(), traceback.walk_stack()
                self._hit(f"{os.path.basename(code.co_filename)[:-3]}.{code.co_name}", self._where(frame.f_back))
            if kind == "self" and code.co_name not in _GUARD_RUNS and \
                    (frame.f_back is self.root or (frame.f_back is not None and
                                                   self._kind(frame.f_back.f_code) == "learner")):
                self._hit(f"the guard's own {code.co_name}", self._where(frame.f_back))  # check code, handed in
            elif kind == "allowed":
                self._allowed_frames.add(id(frame))
            elif kind == "copy":
                if not self._inside_allowed(frame.f_back):
                    self._hit(f"a copy of {self.copies[code]} (the course's code as text)", self._where(frame.f_back))
            elif kind == "library":  # a class body that a course module's import runs is not a call:
                if not self._inside_allowed(frame.f_back) and _place(up := getattr(frame.f_back, "f_code", code)) + \
                        up.co_name != "library<module>":
                    qual, module = getattr(code, "co_qualname", code.co_name), frame.f_globals.get("__name__", "?")
                    self._hit(f"{module}.{qual}", self._where(frame.f_back))
            elif kind == "package":
                pkg = _place(code)[len("package:"):]
                launched = pkg == "numpy" and self._launch_frames  # Triton's interpreter steps a kernel with NumPy
                if not launched and not self._inside_allowed(frame.f_back):
                    fam = next((f for f in self.families if pkg in PACKAGES.get(f, ())), None)
                    self._hit(f"{frame.f_globals.get('__name__', '?')}.{code.co_name}", self._where(frame.f_back), fam)
            elif kind == "torch" and self.scalar_budget is not None and code.co_name in ("format", "save") and \
                    code.co_filename.endswith(("_tensor_str.py", "serialization.py")):  # numbers as text or bytes
                self._read_out(*_as_text_or_bytes(code, frame), frame.f_back)
            elif kind == "torch" and (self.scalar_budget is not None or self.tracing) and \
                    code.co_name in ("tolist", "__getitem__") and code.co_filename.endswith("storage.py"):  # bytes read
                owner = frame.f_locals.get("self")
                n = len(owner) if code.co_name == "tolist" else 1
                self._note_read(n)
                self._read_out(n, f"{type(owner).__name__}.{code.co_name}", frame.f_back)
            elif kind == "torch" and frame.f_back is not None and self._kind(frame.f_back.f_code) == "learner" \
                    and any(e in code.co_name for e in ESCAPES):
                self._hit(f"{frame.f_globals.get('__name__', '?')}.{code.co_name}", self._where(frame.f_back))
            elif kind == "torchjob":
                if not self._inside_allowed(frame.f_back):
                    self._hit(f"{frame.f_globals.get('__name__', '?')}.{code.co_name}", self._where(frame.f_back))
            elif kind == "launch":
                self._launch_frames.add(id(frame))
                self.trace["launches"] += 1
                kernel = getattr(frame.f_locals.get("self"), "fn", None)  # the @triton.jit function launched
                if self._sources and kernel is not None and id(kernel) not in self._sources:
                    self._sources[id(kernel)] = source_of(kernel)
                    self.trace.setdefault("kernels", []).append(self._sources[id(kernel)])
        elif event == "return":
            if self._allowed_frames:
                self._allowed_frames.discard(id(frame))
            if self._launch_frames:
                self._launch_frames.discard(id(frame))
        elif event == "c_call":
            if self._launch_frames:  # inside a Triton launch (the interpreter calls NumPy at every step):
                try:  # only a forbidden builtin by identity; operators are seen by the dispatch mode
                    dotted = self.builtins.get(arg)
                except TypeError:
                    dotted = None
                if dotted is not None:
                    self._hit(dotted, self._where(frame))
                name = getattr(arg, "__name__", "") or ""
                if name == "_getframe" and self._kind(frame.f_code) != "learner":
                    pass  # typing and namedtuple ask for their caller's module while a first launch imports;
                    # the audit hook refuses any frame of the answer or the check reached that way
                elif (name in ESCAPES or name in ELSEWHERE) and self._kind(frame.f_code) != "self":  # a kernel's
                    # body is the learner's code too (the guard's own handlers ask for the hook they suspend)
                    self._hit(f"{getattr(arg, '__module__', None) or 'sys'}.{name}", self._where(frame))
                if self.previous is not None:
                    self.previous(frame, event, arg)
                return
            if self._kind(frame.f_code) == "learner":
                self._check_intact(frame)
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
                self._hit(dotted, self._where(frame))
            name = getattr(arg, "__name__", "") or ""
            if name in ESCAPES and self._kind(frame.f_code) == "learner":
                self._hit(f"{getattr(arg, '__module__', None) or 'sys'}.{name}", self._where(frame))
            elif name in ELSEWHERE and not self._allowed_frames and self._kind(frame.f_code) != "self":
                self._hit(f"{getattr(arg, '__module__', None) or 'os'}.{name} (work outside the watch: a thread or "
                          "a process)", self._where(frame))
            elif self.families and not self._allowed_frames and self._kind(frame.f_code) != "self":
                fam = family_of(name, self.families) if name else None
                if fam is not None and (fam != "torch" or genuine(arg, "torch")):
                    self._hit(_spell(arg), self._where(frame), fam)
                elif "numpy" in self.families and _of_numpy(arg):  # np.array, np.zeros, an array's methods
                    self._hit(_spell_numpy(arg), self._where(frame), "numpy")
        if self.previous is not None:
            self.previous(frame, event, arg)

    def _note_read(self, n):
        """Numbers of any dtype read out into plain Python, for a property that counts them (``trace["read"]``)."""
        if self.tracing and not self._allowed_frames and not self._launch_frames:
            self.trace["read"] += n

    def _read_out(self, n, name, frame):
        """`n` floating-point numbers left PyTorch for plain Python (``item``, ``float(t)``, ``tolist``): refused
        past the budget. Integers and booleans (indices, counts, flags) are control flow and never counted."""
        if self.scalar_budget is None or self._allowed_frames or self._launch_frames:
            return
        self.scalars += n
        if self.scalars > self.scalar_budget:
            self._hit(name, self._where(frame), "scalars")

    def _on_function(self, func, args=()):
        if (self.scalar_budget is not None or self.tracing) and getattr(func, "__name__", None) == "tolist" and args:
            import torch

            t = args[0]
            if isinstance(t, torch.Tensor):
                self._note_read(t.numel())  # booleans and integers too: a property may count them
                if self.scalar_budget is not None and (t.is_floating_point() or t.is_complex()):  # a subclass too
                    self._read_out(t.numel(), "Tensor.tolist", sys._getframe(2))
        try:
            dotted = self.builtins.get(func)
        except TypeError:
            dotted = None
        if dotted is not None:
            self._hit(dotted, self._where(sys._getframe(1)))
        if self.families and not self._allowed_frames:
            name = getattr(func, "__name__", None) or str(func)
            fam = family_of(name, self.families)
            if fam is not None:
                self._hit(_spell(func), self._where(sys._getframe(1)), fam)

    def _on_dispatch(self, func, args, kwargs):
        name = func.name() if hasattr(func, "name") else str(func)
        inlib = bool(self._allowed_frames)
        if self.families and not inlib:
            fam = family_of(name, self.families)
            if fam is None and self._complex and _any_complex(args, kwargs):
                fam = "complex"
            if fam is not None:
                self._hit(name, self._where(sys._getframe(1)), fam)
        if self.scalar_budget is not None and name == "aten::view.dtype" and not inlib and len(args) > 1 and \
                args[0].is_floating_point() and not args[1].is_floating_point:  # floats' bits read as integers
            self._hit("Tensor.view(dtype)", self._where(sys._getframe(1)), "bits")
        if self.scalar_budget is not None and name == "aten::_local_scalar_dense" and args and \
                (args[0].is_floating_point() or args[0].is_complex()):  # indices and flags are control flow
            self._read_out(1, "Tensor.item (or float(t))", sys._getframe(1))
        if self.tracing:
            counts = self.trace["counts"]
            counts[name] = counts.get(name, 0) + 1
            ops = self.trace["ops"]
            if len(ops) >= 20000:
                self.trace["dropped"] += 1
                return
            import torch

            tensors = []
            for a in list(args) + list((kwargs or {}).values()):
                if isinstance(a, (list, tuple)):
                    items = a
                else:
                    items = (a,)
                for t in items:
                    if isinstance(t, torch.Tensor):
                        try:
                            ptr = t.untyped_storage().data_ptr()
                        except Exception:
                            ptr = None
                        lab = self.labels.get(ptr)
                        tensors.append((lab[0] if lab else None, int(t.storage_offset()) - (lab[1] if lab else 0),
                                        tuple(t.shape), tuple(t.stride())))
            ops.append((name, bool(self._launch_frames), inlib, tensors))

    def __enter__(self):
        if not self.active:
            return self
        self.root = sys._getframe(1)
        _warm_up()

        if self.builtins or self.families:
            mode = _mode_classes()[0](self)
            mode.__enter__()
            self.modes.append(mode)
        if self.families or self.tracing:
            mode = _mode_classes()[1](self)
            mode.__enter__()
            self.modes.append(mode)
        previous = sys.getprofile()
        self.previous = previous if callable(previous) else None
        frame, self._above = self.root, set()
        while frame is not None:  # the check's frames, which the answer must not reach
            self._above.add(id(frame))
            frame = frame.f_back
        _start_auditing()
        _WATCHING.append(self)
        sys.setprofile(self._profile)
        self.installed = True
        return self

    def __exit__(self, *exc):
        if not self.installed:
            return False
        hook = sys.getprofile()
        sys.setprofile(self.previous)
        self.installed = False
        if self in _WATCHING:
            _WATCHING.remove(self)
        for mode in reversed(self.modes):
            try:
                mode.__exit__(None, None, None)
            except Exception:  # the answer emptied a mode stack itself
                self._hit("torch modes")
        self.modes = []
        if getattr(hook, "__self__", None) is not self:
            self._hit("sys.setprofile")
        return False


# Frame objects reached without a call the profile hook sees: `err.__traceback__.tb_frame`, a generator's
# `gi_frame`, a coroutine's `cr_frame`, or `sys._getframe` run by library code on the answer's behalf
# (`logging.currentframe()`). From a frame, `f_back` leads to the check's frames (the guard, the expected values).
# CPython raises an audit event for each; one hook per process, acting only while a guard watches.
FRAME_ATTRS = ("tb_frame", "gi_frame", "cr_frame", "ag_frame")
_WATCHING = []  # the guards watching now (innermost last)


def _audit(event, args):
    if not _WATCHING:
        return
    guard = _WATCHING[-1]
    if guard._in_audit:
        return
    if event == "object.__getattr__":
        if len(args) < 2 or args[1] not in FRAME_ATTRS:
            return
        guard._in_audit = True
        try:
            frame = sys._getframe(1)
        finally:
            guard._in_audit = False
        if guard._kind(frame.f_code) == "learner" and not guard._inside_allowed(frame):
            guard._hit(f"the attribute {args[1]} (a frame: the check's own frames are behind it)", guard._where(frame))
            raise Refused(guard.used[-1])  # an audit hook may refuse the access itself: the frame never arrives
    elif event.startswith("ctypes."):  # raw memory (from_address, string_at, a foreign call): numbers no trace sees
        guard._in_audit = True
        try:
            frame = sys._getframe(1)
            home = os.path.dirname(getattr(sys.modules.get("ctypes"), "__file__", None) or "/nowhere/") + os.sep
            while frame is not None and frame.f_code.co_filename.startswith(home):  # ctypes' wrappers: who called
                frame = frame.f_back
        finally:
            guard._in_audit = False
        if frame is not None and guard._kind(frame.f_code) == "learner" and not guard._inside_allowed(frame):
            guard._hit(f"{event} (memory read through ctypes, where no trace sees the arithmetic)", guard._where(frame))
            raise Refused(guard.used[-1])
    elif event in ("sys._getframe", "sys._current_frames"):
        got = args[0] if args else None
        if event == "sys._current_frames" or (got is not None and (
                id(got) in guard._above or guard._kind(got.f_code) in ("learner", "self"))):
            guard._in_audit = True
            try:
                caller = sys._getframe(1)
            finally:
                guard._in_audit = False
            if guard._kind(caller.f_code) == "self" or guard._inside_allowed(caller):
                return
            guard._hit(f"{event} (the frame of your code or of the check)", guard._where(got or caller))
            raise Refused(guard.used[-1])


_AUDITING = []


def _start_auditing():
    if not _AUDITING:
        sys.addaudithook(_audit)  # cannot be removed: it does nothing while no guard watches
        _AUDITING.append(True)


_MODES = []


def _mode_classes():
    """The guard's two mode classes, made once: PyTorch keeps per-class state for a mode's type, and a class made
    per check, freed and its address reused, has crashed the interpreter."""
    if not _MODES:
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        class Watch(TorchFunctionMode):
            def __init__(self, guard):
                super().__init__()
                self.guard = guard

            def __torch_function__(self, func, types, args=(), kwargs=None):
                hook = sys.getprofile()
                if _plain_function(func) and _plain_args(args):  # the guard's bookkeeping runs unprofiled (about
                    sys.setprofile(None)  # 2x faster) where no learner code can run in it: C or plain functions
                try:
                    self.guard._on_function(func, args)  # no stop here: this level also sees state switches such as
                finally:  # no_grad's __exit__, which must run
                    sys.setprofile(hook)
                return func(*args, **(kwargs or {}))

        class Record(TorchDispatchMode):
            def __init__(self, guard):
                super().__init__()
                self.guard = guard

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                hook = sys.getprofile()
                if _plain_args(args) and (not kwargs or _plain_args(tuple(kwargs.values()))):
                    sys.setprofile(None)  # plain tensors only: a subclass's methods may be the learner's code
                try:
                    self.guard._on_dispatch(func, args, kwargs)
                    self.guard._stop_here()
                finally:
                    sys.setprofile(hook)
                return func(*args, **(kwargs or {}))

        _MODES.extend([Watch, Record])
    return _MODES


def _plain_function(func):
    """Whether `func` is a C function, a method descriptor or a plain Python function: reading its name and
    hashing it run no Python code (identity tests only, so no class of the learner's can answer them)."""
    tp = type(func)
    return tp is types.BuiltinFunctionType or tp is types.FunctionType or tp is types.MethodDescriptorType or \
        tp is types.WrapperDescriptorType or tp is types.MethodWrapperType or tp is types.GetSetDescriptorType or \
        tp is types.ClassMethodDescriptorType


def _any_complex(args, kwargs):
    """Whether an operator gets a complex tensor, a complex number or a complex dtype."""
    import torch

    def walk(items):
        for a in items:
            tp = type(a)
            if tp is list or tp is tuple:
                if walk(a):
                    return True
            elif tp is complex or (tp is torch.dtype and a.is_complex):
                return True
            elif issubclass(tp, torch.Tensor) and a.is_complex():
                return True
        return False

    return walk(args) or walk(tuple((kwargs or {}).values()))


def _plain_args(items):
    """Whether every tensor among `items` (lists and tuples opened) is a plain tensor or parameter: reading its
    storage, shape and strides then runs no Python code of a subclass."""
    import torch

    for a in items:
        tp = type(a)
        if tp is list or tp is tuple:
            if not _plain_args(a):
                return False
        elif tp is not torch.Tensor and tp is not torch.nn.Parameter and issubclass(tp, torch.Tensor):
            return False
    return True


_WARM = []


def _warm_up():
    """Import what PyTorch imports lazily the first time a mode handles an operator (``torch._dynamo``, several
    seconds), before the watch is on: under the profile hook the first check of a session would take 10x longer."""
    if not _WARM:
        _WARM.append(True)
        try:
            import torch._dynamo  # noqa: F401
            import torch
            from torch.utils._python_dispatch import TorchDispatchMode

            class Nothing(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    return func(*args, **(kwargs or {}))

            with Nothing():
                torch.ones(2).add(1).isfinite()
        except Exception:
            pass


def _spell(func):
    """A readable name for a function a TorchFunctionMode saw."""
    name = getattr(func, "__name__", None) or str(func)
    kind = type(func).__name__
    if kind in ("OpOverloadPacket", "OpOverload"):
        return f"torch.ops.aten.{name}"
    owner = getattr(func, "__objclass__", None)
    if owner is not None:
        return f"{getattr(owner, '__name__', 'Tensor')}.{name}"
    module = getattr(func, "__module__", None) or "torch"
    if module.startswith("torch._ops"):
        return f"torch.ops.{module[len('torch._ops.'):] or 'aten'}.{name}"
    if module.startswith("torch._C"):
        module = "torch"
    return f"{module}.{name}"


class CallGuard(Guard):
    """The guard for dotted names only (no library rule, no operator families): ``CallGuard(names)``."""

    def __init__(self, names, namespace=None):
        super().__init__(policy(forbid=names, library=False), namespace)


AUTOGRAD = {"torch.autograd.grad", "torch.autograd.backward", "torch.Tensor.backward"}
SCALAR_FLOOR = 256  # numbers an answer may always read out of its tensors (loop bounds, indices, a few flags)


def _as_text_or_bytes(code, frame):
    """(numbers, name) for a tensor's numbers leaving PyTorch as text or bytes: one per number a printed tensor shows
    to more than 6 significant digits or 4 decimals (a repr parsed back, or a tensor scaled by 1e6 and printed, is a
    read-out; a default print while debugging is not), every entry of what ``torch.save`` writes (pickle too)."""
    import torch

    if code.co_name == "format":  # torch._tensor_str._Formatter.format: one number of a printed tensor
        opts, me, value = torch._tensor_str.PRINT_OPTS, frame.f_locals.get("self"), frame.f_locals.get("value")
        whole = len(f"{abs(value):.0f}") if isinstance(value, float) and math.isfinite(value) else 0
        shown = opts.precision + 1 if getattr(me, "sci_mode", True) else \
            whole + (0 if getattr(me, "int_mode", False) else opts.precision)  # a tensor scaled by 1e6: 11 digits
        return int(getattr(me, "floating_dtype", False) and (opts.precision > 4 or bool(opts.sci_mode) or shown > 6)), \
            "Tensor.__repr__ (a tensor printed to more than 6 digits)"
    obj = frame.f_locals.get("obj")
    if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)):
        return getattr(obj, "_untyped_storage", obj).nbytes() // 4, "torch.save (or pickle: a tensor's bytes)"
    return _entries([obj]), "torch.save (or pickle: a tensor's bytes)"


def _entries(items):
    """The number of tensor entries among `items` (lists, tuples and dicts opened)."""
    import torch

    total = 0
    for a in items:
        if isinstance(a, torch.Tensor):
            total += a.numel()
        elif isinstance(a, (list, tuple)):
            total += _entries(a)
        elif isinstance(a, dict):
            total += _entries(list(a.values()))
    return total


BACKWARD = "__attncourse_backward__"  # a case's keyword: the answer's result and the gradients of its inputs


def with_gradients(out, leaves):
    """``(out, *grads)``: the gradients of `leaves` for the upstream gradient N(0, 1) drawn from seed 0 (zeros for
    an input the output does not depend on). Raise ``ValueError`` when `out` carries no autograd graph."""
    import torch

    out = out[0] if isinstance(out, tuple) and out else out  # a tuple's first item: the result (see .gradients)
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        raise ValueError("the output carries no gradient: compute it from the inputs with PyTorch operations "
                         "(no .detach(), no torch.no_grad(), no detour outside PyTorch)")
    with torch.enable_grad():
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        grads = torch.autograd.grad(out, leaves, upstream.to(out.dtype), allow_unused=True)
    return (out.detach(), *(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)))


def run(answer, args, kwargs, pol, namespace=None):
    """Call ``answer(*args, **kwargs)`` under the guard of policy `pol`: a dict with ``result``, ``error`` (the
    exception it raised, or None), ``used`` (what it reached that is forbidden, with where) and ``trace``."""
    pol = dict(pol or {})
    args, kwargs = list(args), dict(kwargs or {})
    backward = bool(kwargs.pop(BACKWARD, False))
    guard = Guard(pol, namespace, stop=True)
    if "numpy" in guard.families:  # an answer judged by what it runs in PyTorch: its numbers stay there, bar a few
        entries = _entries(args) + _entries(list(kwargs.values()))  # (indices, counts, a value per block); an
        guard.scalar_budget = max(SCALAR_FLOOR, entries // 4)  # answer that builds its own tensors: the floor
    stream = pol.get("stream")
    chunks = None
    if stream:
        index, dim, size = stream
        if isinstance(size, str):  # "argN": the chunk size is argument N
            size = args[int(size[3:])]
        chunks = Chunks(args[index], dim, size, guard)
        args[index] = chunks
    if guard.tracing:
        guard.label_inputs(args, kwargs)
    error, result = None, None
    import torch

    grad = torch.is_grad_enabled()  # an answer stopped inside a `no_grad` block must not leave it on
    leaves = []
    if backward:  # the case asks for the gradients too: of the floating inputs, for one fixed upstream gradient
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                args[i] = a.detach().requires_grad_()
                leaves.append(args[i])
    with guard:
        try:
            result = answer(*args, **kwargs)
            if backward:  # still watched: a custom backward is the learner's code too
                result = with_gradients(result, leaves)
        except Refused:
            pass
        except Exception as err:  # a forbidden call decides the verdict, whatever the answer did next
            error = err
    torch.set_grad_enabled(grad)
    trace = guard.trace if guard.tracing else None
    if chunks is not None:
        trace = dict(trace or {}, chunks=chunks.handed)
    if pol.get("source"):
        trace = dict(trace or {}, source=source_of(answer))
    return {"result": result, "error": error, "used": list(guard.used), "trace": trace}
