"""Procedural mutations (SWE-smith style) of the functions a project's own tests run.

`mutations(path, source, covered)` lists every mutation of the functions of one file whose first line
(`co_firstlineno`: the first decorator's line for a decorated function) is in `covered`. A mutation
replaces the exact bytes of one AST node (or one operator token between two nodes) in the real source
text, so the patch that reverts it is a minimal line diff of that file; every mutant parses and differs
from the original's AST. Nested functions and classes count as their own functions.

The operators (`Mutation.operator`):
    comparison      < <=, > >=, == !=, in / not in, is / is not: each to its partner
    arithmetic      + -, * -> +, / -> *, // -> /, % -> //, ** -> *, & |, ^ -> |, << >> (also in `x += y`),
                    never on a string literal's `+` or `%`
    boolean         and <-> or
    off_by_one      an integer literal n -> n + 1 and n - 1 (ranges, slices, indices, constants)
    constant        True <-> False
    invert_if       `if c:` / `x if c else y` -> `not (c)`
    remove_if       an `if` without `else` (and not alone in its block) deleted, body and all
    drop_return     `return x` -> `x` (the function falls through), `return` -> `pass`
    drop_raise      `raise ...` -> `pass`
    swap_args       f(a, b, ...) -> f(b, a, ...) (two different positional arguments, no `*args`)
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

_COMPARE = {
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
    ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"),
}
_BINARY = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "+"),
    ast.Div: ("/", "*"),
    ast.FloorDiv: ("//", "/"),
    ast.Mod: ("%", "//"),
    ast.Pow: ("**", "*"),
    ast.BitAnd: ("&", "|"),
    ast.BitOr: ("|", "&"),
    ast.BitXor: ("^", "|"),
    ast.LShift: ("<<", ">>"),
    ast.RShift: (">>", "<<"),
}
_BOOLEAN = {ast.And: ("and", "or"), ast.Or: ("or", "and")}
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


@dataclass(frozen=True)
class Mutation:
    """Replace `source[start:end]` (bytes, `old`) with `new` in the file `path`. `line` is the first line
    changed, `function` the qualified name of the function it is in, `function_line` that function's
    first line (`first_line`)."""

    path: str
    function: str
    function_line: int
    operator: str
    line: int
    start: int
    end: int
    old: str
    new: str

    @property
    def key(self) -> str:
        """A short stable id of this mutation (the same on every run and machine)."""
        text = f"{self.path}\0{self.start}\0{self.end}\0{self.new}"
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def apply(self, source: bytes) -> bytes:
        return source[: self.start] + self.new.encode() + source[self.end :]


class _Text:
    """A file's bytes with AST positions (1-based line, UTF-8 byte column) turned into offsets."""

    def __init__(self, source: bytes) -> None:
        self.source = source
        self.starts = [0]
        for line in source.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def at(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.at(node.lineno, node.col_offset), self.at(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def text(self, start: int, end: int) -> str:
        return self.source[start:end].decode()

    def between(self, left: ast.AST, right: ast.AST, word: str) -> tuple[int, int] | None:
        """Where the operator `word` is between two nodes: only when nothing but it, brackets and
        whitespace is there (a comment or anything else: None)."""
        start = self.at(left.end_lineno, left.end_col_offset)  # type: ignore[attr-defined]
        end = self.at(right.lineno, right.col_offset)  # type: ignore[attr-defined]
        gap = self.text(start, end)
        pattern = r"[\s()\\]*(" + r"\s+".join(map(re.escape, word.split())) + r")[\s()\\]*"
        match = re.fullmatch(pattern, gap)
        if match is None:
            return None
        return start + len(gap[: match.start(1)].encode()), start + len(gap[: match.end(1)].encode())


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str | bytes))


def _own_nodes(function: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function's body, not those of the functions and classes nested in it."""
    stack = list(reversed(function.body))  # type: ignore[attr-defined]
    while stack:
        node = stack.pop()
        if isinstance(node, _SCOPES):
            continue
        yield node
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield f"{prefix}{node.name}", node
            yield from _functions(node, f"{prefix}{node.name}.<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def first_line(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The line a function's code object starts at (`co_firstlineno`): its first decorator's, if any."""
    return min([function.lineno, *(d.lineno for d in function.decorator_list)])


def _sites(text: _Text, function: ast.AST) -> Iterator[tuple[str, int, int, str]]:
    """(operator, start, end, new text) for each mutation of one function's own nodes."""
    for node in _own_nodes(function):
        if isinstance(node, ast.Compare):
            lefts = [node.left, *node.comparators[:-1]]
            for left, op, right in zip(lefts, node.ops, node.comparators, strict=True):
                old, new = _COMPARE[type(op)]
                if (where := text.between(left, right, old)) is not None:
                    yield "comparison", *where, new
        elif isinstance(node, ast.BinOp | ast.AugAssign) and type(node.op) in _BINARY:
            left, right = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.target, node.value)
            if _is_text(left) or _is_text(right):
                continue
            old, new = _BINARY[type(node.op)]
            suffix = "=" if isinstance(node, ast.AugAssign) else ""
            if (where := text.between(left, right, old + suffix)) is not None:
                yield "arithmetic", *where, new + suffix
        elif isinstance(node, ast.BoolOp):
            old, new = _BOOLEAN[type(node.op)]
            for left, right in zip(node.values, node.values[1:], strict=False):
                if (where := text.between(left, right, old)) is not None:
                    yield "boolean", *where, new
        elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
            yield "constant", *text.span(node), str(not node.value)
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            start, end = text.span(node)
            yield "off_by_one", start, end, str(node.value + 1)
            if node.value > 0:
                yield "off_by_one", start, end, str(node.value - 1)
        elif isinstance(node, ast.If | ast.IfExp):
            start, end = text.span(node.test)
            yield "invert_if", start, end, f"not ({text.text(start, end)})"
            if isinstance(node, ast.If) and not node.orelse:
                yield from _removal(text, node, function)
        elif isinstance(node, ast.Return):
            start, end = text.span(node)
            yield "drop_return", start, end, "pass" if node.value is None else text.text(*text.span(node.value))
        elif isinstance(node, ast.Raise):
            yield "drop_raise", *text.span(node), "pass"
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            first, second = node.args[:2]
            if any(isinstance(arg, ast.Starred) for arg in node.args):
                continue
            (a_start, a_end), (b_start, b_end) = text.span(first), text.span(second)
            a, b = text.text(a_start, a_end), text.text(b_start, b_end)
            if a != b:
                yield "swap_args", a_start, b_end, b + text.text(a_end, b_start) + a


def _removal(text: _Text, node: ast.If, function: ast.AST) -> Iterator[tuple[str, int, int, str]]:
    """Delete an `if` statement's whole lines, when it has them to itself and is not alone in its block."""
    for parent in _own_nodes_and_self(function):
        for name in ("body", "orelse", "finalbody"):
            block = getattr(parent, name, None)
            if isinstance(block, list) and node in block and len(block) > 1:
                start, end = text.span(node)
                line_start, line_end = text.starts[node.lineno - 1], text.starts[node.end_lineno]  # type: ignore[index]
                if text.text(line_start, start).strip() or text.text(end, line_end).strip():
                    return
                yield "remove_if", line_start, line_end, ""
                return


def _own_nodes_and_self(function: ast.AST) -> Iterator[ast.AST]:
    yield function
    yield from _own_nodes(function)


class _Block:
    """A function's own lines, parsed as a module of their own (an indented one under `if 1:`): a mutant
    is checked there, not by parsing the whole file again."""

    def __init__(self, function: ast.AST, source: bytes, text: _Text) -> None:
        lines = [function.lineno, *(d.lineno for d in function.decorator_list)]  # type: ignore[attr-defined]
        self.start, end = text.starts[min(lines) - 1], text.starts[function.end_lineno]  # type: ignore[attr-defined]
        self.block = source[self.start : end]
        self.pad = b"if 1:\n" if self.block[:1] in (b" ", b"\t") else b""
        self.dump = self._dump(self.block)

    def _dump(self, block: bytes) -> str | None:
        try:
            return ast.dump(ast.parse(self.pad + block))
        except (SyntaxError, ValueError):
            return None

    def accepts(self, mutation: Mutation) -> bool:
        """Whether the mutant parses and differs from the original."""
        start, end = mutation.start - self.start, mutation.end - self.start
        mutant = self._dump(self.block[:start] + mutation.new.encode() + self.block[end:])
        return self.dump is not None and mutant is not None and mutant != self.dump


def mutations(path: str, source: bytes, covered: set[int] | None = None) -> list[Mutation]:
    """Every mutation of the functions of `source` (the file `path`) whose first line is in `covered`
    (all functions when None), in file order; each mutant parses and has a different AST. A file that
    does not parse has none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    text = _Text(source)
    found: dict[tuple[int, int, str], Mutation] = {}
    for name, function in _functions(tree):
        if covered is not None and first_line(function) not in covered:
            continue
        block = _Block(function, source, text)
        for operator, start, end, new in _sites(text, function):
            if (start, end, new) in found:
                continue
            mutation = Mutation(
                path=path,
                function=name,
                function_line=first_line(function),
                operator=operator,
                line=source.count(b"\n", 0, start) + 1,
                start=start,
                end=end,
                old=text.text(start, end),
                new=new,
            )
            if block.accepts(mutation):
                found[start, end, new] = mutation
    return sorted(found.values(), key=lambda m: (m.start, m.end, m.new))
