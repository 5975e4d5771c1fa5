"""Fingerprints of code objects, to recognise the course's code copied as text (see :mod:`.forbidden`).

Two prints per function body:

* :func:`exact`: the global and attribute names it uses, in order, its constants (nested code by fingerprint, the
  docstring left out) and its signature. Not its file, lines, local names or the exact bytecode (Python compiles a
  method call differently when the module imports its object), so a copy pasted or exec'd elsewhere, locals
  renamed, has the same fingerprint.
* :func:`core`: what the body does once its input checks are taken out: the sequence of operations (names loaded,
  attributes, constants, operators, calls; locals as "a local"), without the statements that only guard the input
  (a ``raise``, an ``assert``, a call of a ``_validate``/``_check`` helper, and the ``if`` test whose body raises).
  A copy whose validation lines were deleted, or replaced by ``pass``, keeps the print of its original.
"""

import dis
import os
import re
import sys
import types

MIN_BYTES = 64  # smaller bodies (a one-line helper) are too generic to call a copy
MIN_ITEMS = 8  # names and constants together: below that, two functions may share them by chance
MIN_LINES = 6  # a library function of fewer lines (a three-line formula) is what a learner writes anyway
MIN_CORE = 40  # operations left once the input checks are out: below that, a body is too generic to call a copy

_GUARD_NAME = re.compile(r"^_?(validate|check)")
_SKIP = {"CACHE", "RESUME", "NOP", "PRECALL", "EXTENDED_ARG", "KW_NAMES", "PUSH_NULL", "COPY_FREE_VARS",
         "MAKE_CELL", "POP_TOP", "RETURN_VALUE", "SWAP", "COPY", "RETURN_CONST"}
_RAISE = dis.opmap["RAISE_VARARGS"]
_LOCAL = {"LOAD_FAST": "L", "LOAD_DEREF": "L", "LOAD_CLOSURE": "L", "LOAD_FAST_CHECK": "L",
          "STORE_FAST": "S", "STORE_DEREF": "S", "DELETE_FAST": "S"}


def exact(code):
    """The exact fingerprint (a hash), or None when a constant is unhashable."""
    consts = code.co_consts
    if code.co_name != "<module>" and consts and isinstance(consts[0], str):
        consts = consts[1:]  # the docstring (without one, Python puts None first)
    consts = tuple(c for c in consts if c is not None)
    norm = tuple(exact(c) if isinstance(c, types.CodeType) else
                 c.rsplit("<locals>.", 1)[-1] if isinstance(c, str) else  # a nested function's qualified name
                 c if isinstance(c, (int, float, complex, bytes, bool, type(None), tuple, frozenset)) else
                 type(c).__name__ for c in consts)
    try:
        return hash((code.co_names, norm, code.co_argcount, code.co_kwonlyargcount,
                     len(code.co_varnames), code.co_flags & 0x3FF))  # not the __future__ flags of its file
    except TypeError:
        return None


def copyable(code):
    return len(code.co_code) >= MIN_BYTES and len(code.co_names) + len(code.co_consts) >= MIN_ITEMS


def _token(ins):
    op, value = ins.opname, ins.argval
    if op in _LOCAL:
        return _LOCAL[op]
    if op in ("LOAD_GLOBAL", "LOAD_NAME"):
        return "g:" + str(value)
    if op in ("LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR"):
        return "a:" + str(value)
    if op == "LOAD_CONST":
        if isinstance(value, types.CodeType):
            return "code"
        if value is None or isinstance(value, (int, float, bool)):
            return "c:" + repr(value)
        return "s" if isinstance(value, str) else "c:" + type(value).__name__
    if op == "BINARY_OP":
        return "op:" + ins.argrepr.rstrip("=")
    if op in ("COMPARE_OP", "IS_OP", "CONTAINS_OP"):
        return op + ":" + ins.argrepr
    if op.startswith(("POP_JUMP", "JUMP")):
        return "jump"
    return op


def _span(ins):
    pos = ins.positions
    span = (pos.lineno, pos.end_lineno, pos.col_offset, pos.end_col_offset) if pos else None
    return span if span and None not in span else None


def _inside(pos, span):
    return span is not None and pos is not None and (span[0], span[2]) <= (pos[0], pos[2]) and \
        (pos[1], pos[3]) <= (span[1], span[3])


def _item_start(ins, m):
    """The index where the instructions that leave one value on the stack, ending at `m`, begin."""
    need = 1
    while m >= 0:
        i = ins[m]
        need -= dis.stack_effect(i.opcode, i.arg if i.opcode >= dis.HAVE_ARGUMENT else None, jump=False)
        if need <= 0:
            return m
        m -= 1
    return 0


def _annotations(ins):
    """Offsets of the instructions that build a nested function's annotations: one constant tuple under ``from
    __future__ import annotations``, built at run time without it (a copy exec'd without the import differs there)."""
    gone = set()
    for n, i in enumerate(ins):
        if i.opname == "MAKE_FUNCTION" and (i.arg or 0) & 0x04 and n >= 1 and ins[n - 1].opname == "LOAD_CONST":
            m = n - 2
            if i.arg & 0x08:  # the closure's tuple sits above the annotations
                m = _item_start(ins, m) - 1
            gone.update(ins[k].offset for k in range(_item_start(ins, m), m + 1))
    return gone


def core_tokens(code):
    """The operations of `code`'s body without its input checks (see the module's docstring)."""
    every = list(dis.get_instructions(code))
    notes = _annotations(every)
    ins = [i for i in every if i.opname not in _SKIP and i.offset not in notes]
    spans = [_span(i) for i in ins]
    line = [s[0] if s else None for s in spans]
    gone = set()  # source lines of the input checks
    for n, i in enumerate(ins):
        if i.opname == "RAISE_VARARGS" and spans[n]:  # the whole raise statement, f-string and all
            gone.update(range(spans[n][0], spans[n][1] + 1))
        elif i.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD") and \
                _GUARD_NAME.match(str(i.argval)):  # a call of a validation helper: its whole call
            call = next((spans[m] for m in range(n + 1, len(ins)) if ins[m].opname.startswith("CALL") and
                         _inside(spans[n], spans[m])), spans[n])
            if call:
                gone.update(range(call[0], call[1] + 1))
    drop = {n for n in range(len(ins)) if line[n] in gone}
    offsets = {i.offset: n for n, i in enumerate(ins)}
    for n, i in enumerate(ins):  # a `for` loop whose body was all dropped: the loop goes too
        end = offsets.get(i.argval) if i.opname == "FOR_ITER" else None
        if end is not None and all(m in drop for m in range(n + 1, end)
                                   if line[m] != line[n] and ins[m].opname != "JUMP_BACKWARD"):
            drop.update(m for m in range(len(ins)) if n <= m < end or line[m] == line[n])
    for n, i in enumerate(ins):  # an `if` test whose body was dropped: its line goes too
        if "JUMP" in i.opname and n + 1 < len(ins) and n + 1 in drop and n not in drop and line[n] is not None:
            drop.update(m for m in range(len(ins)) if line[m] == line[n])
    return [_token(i) for n, i in enumerate(ins) if n not in drop]


def has_checks(code):
    """Whether `code` raises or calls a validation helper (else its core print adds nothing to its exact one)."""
    return any(_GUARD_NAME.match(name) for name in code.co_names) or _RAISE in code.co_code[::2]


def core(code):
    """The core fingerprint (a hash), or None when the body left is too small to call a copy."""
    tokens = core_tokens(code)
    if len(tokens) < MIN_CORE:
        return None
    return hash(("core", tuple(tokens)))


MIN_NAMES = 5  # a body using fewer globals and attributes is too generic (many functions use a superset)
_INSTALLED = tuple({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})


def _written_here(filename):
    """Code of the learner's (a cell, exec'd text, a file of theirs), not of Python or an installed package."""
    if filename.startswith("<"):
        return not filename.startswith("<frozen")  # a cell, exec'd text; not Python's own frozen modules
    return not os.path.realpath(filename).startswith(_INSTALLED)


class Cores:
    """The package's functions that check their input, to be found again by their core print in a copy whose
    checks were deleted (its global and attribute names are then among the original's)."""

    def __init__(self):
        self.entries = []  # (names, code, dotted name)
        self._prints = {}  # code -> core print, computed when first needed

    def add(self, code, dotted):
        self.entries.append((frozenset(code.co_names), code, dotted))

    def find(self, code):
        """``(dotted name, code)`` of the package function whose core print `code` has, or None."""
        names = set(code.co_names)
        if len(names) < MIN_NAMES or not _written_here(code.co_filename):
            return None
        candidates = [(original, dotted) for have, original, dotted in self.entries if names <= have]
        key = core(code) if candidates else None
        if key is None:
            return None
        for original, dotted in candidates:
            if original not in self._prints:
                self._prints[original] = core(original)
            if self._prints[original] == key:
                return dotted, original
        return None
