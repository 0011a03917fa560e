"""Strings spelled in pieces, read back: the capability gate's constant folder (`swe_grpo.grading.capability`).

`fold(node)` is the string an expression of constants evaluates to, for the forms a name is hidden in
(concatenation, f-strings of constants, `join`, slicing, case changes, `chr`, `bytes([...]).decode()`, rot13,
base64, hex), without running anything: None for every other expression. A codec is applied only from a fixed
list of pure text transforms, never looked up by a name the patch chose.
"""

from __future__ import annotations

import ast
import base64
import binascii
import codecs
from collections.abc import Callable

_FOLD_DEPTH = 20


def fold(node: ast.AST, depth: int = 0) -> str | None:
    """The string an expression of constants evaluates to, for the forms a name is spelled in pieces with;
    None for anything else."""
    if depth > _FOLD_DEPTH:
        return None
    value = _value(node, depth)
    if isinstance(value, bytes):
        return value.decode("latin-1")
    return value if isinstance(value, str) else None


def _value(node: ast.AST, depth: int) -> str | bytes | int | list | None:
    d = depth + 1
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str | bytes | int)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        operand = _value(node.operand, d)
        return -operand if isinstance(operand, int) else None
    if isinstance(node, ast.JoinedStr):
        pieces = [_value(v.value if isinstance(v, ast.FormattedValue) else v, d) for v in node.values]
        return "".join(str(p) for p in pieces) if all(isinstance(p, str | int) for p in pieces) else None
    if isinstance(node, ast.BinOp):
        left, right = _value(node.left, d), _value(node.right, d)
        if isinstance(node.op, ast.Add) and type(left) is type(right) and isinstance(left, str | bytes | list):
            return left + right  # type: ignore[operator]
        if isinstance(node.op, ast.Mult) and isinstance(left, str | bytes) and isinstance(right, int):
            return left * min(right, 4)
        return None
    if isinstance(node, ast.List | ast.Tuple):
        items = [_value(e, d) for e in node.elts]
        return items if all(i is not None for i in items) else None
    if isinstance(node, ast.Subscript):
        value = _value(node.value, d)
        if isinstance(value, str | bytes) and isinstance(node.slice, ast.Slice):
            bounds = [_value(b, d) if b is not None else None for b in (node.slice.lower, node.slice.upper)]
            step = _value(node.slice.step, d) if node.slice.step is not None else None
            if all(b is None or isinstance(b, int) for b in (*bounds, step)) and step != 0:
                return value[bounds[0] : bounds[1] : step]  # type: ignore[misc]
        return None
    return _call(node, d) if isinstance(node, ast.Call) else None


def _call(node: ast.Call, d: int) -> str | bytes | None:
    func, args = node.func, [_value(a, d) for a in node.args]
    one = args[0] if len(args) == 1 else None
    if isinstance(func, ast.Name):
        if func.id == "chr" and isinstance(one, int) and 0 <= one < 0x110000:
            return chr(one)
        if func.id in ("bytes", "bytearray") and isinstance(one, list) and all(_is_byte(i) for i in one):
            return bytes(one)
        return one if func.id == "str" and isinstance(one, str) else None
    if not isinstance(func, ast.Attribute):
        return None
    method = func.attr
    if method in _DECODERS:
        try:
            return _DECODERS[method](one) if isinstance(one, str | bytes) else None
        except (ValueError, binascii.Error):
            return None
    if method in ("decode", "encode") and len(args) == 2:  # codecs.decode(text, "rot13")
        return _decode_with(args[0], args[1])
    receiver = _value(func.value, d)
    if not isinstance(receiver, str | bytes):
        return None
    if method == "join" and isinstance(one, list) and all(type(i) is type(receiver) for i in one):
        return receiver.join(one)  # type: ignore[arg-type]
    if method == "decode":
        return _decode_with(receiver, args[0] if args else "utf-8")
    if method == "encode":
        return receiver.encode("utf-8", "replace") if isinstance(receiver, str) else None
    if method in ("lower", "upper", "strip", "lstrip", "rstrip", "title", "swapcase", "casefold") and not args:
        return getattr(receiver, method)()
    if method == "replace" and len(args) == 2 and all(type(a) is type(receiver) for a in args):
        return receiver.replace(args[0], args[1])  # type: ignore[arg-type]
    return None


def _is_byte(item: object) -> bool:
    return isinstance(item, int) and 0 <= item < 256


def _unhex(data: str | bytes) -> bytes:
    return binascii.unhexlify(data.strip() if isinstance(data, bytes) else data.strip().encode())


_DECODERS: dict[str, Callable[[str | bytes], bytes]] = {
    "b64decode": base64.b64decode,
    "b32decode": base64.b32decode,
    "b16decode": base64.b16decode,
    "a85decode": base64.a85decode,
    "unhexlify": _unhex,
    "fromhex": _unhex,
}
# Codecs the folder may apply: pure text transforms, never a codec looked up by a name the patch chose.
_SAFE_CODECS = {"rot13", "rot_13", "rot-13", "utf-8", "utf8", "ascii", "latin-1", "latin1", "hex", "base64"}


def _decode_with(data: object, codec: object) -> str | bytes | None:
    if not isinstance(codec, str) or codec.lower() not in _SAFE_CODECS or not isinstance(data, str | bytes):
        return None
    try:
        if codec.lower() in ("hex", "base64"):
            return codecs.decode(data.encode() if isinstance(data, str) else data, codec)
        if isinstance(data, bytes):
            return data.decode(codec, "replace")
        return codecs.decode(data, codec) if "rot" in codec.lower() else data
    except (ValueError, LookupError, binascii.Error):
        return None
