"""Small string helpers."""

import re
import unicodedata

__all__ = ["slugify", "truncate"]


def slugify(text: str, sep: str = "-") -> str:
    """The lower-case ASCII words of `text` joined by `sep`: "Hello, World!" -> "hello-world"."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return sep.join(re.findall(r"[a-z0-9]+", ascii_text.lower()))


def truncate(text: str, width: int, placeholder: str = "...") -> str:
    """`text` shortened to at most `width` characters, placeholder included; a cut ends with
    `placeholder`. Text that fits is returned unchanged."""
    if width < len(placeholder):
        raise ValueError(f"width {width} is smaller than the placeholder {placeholder!r}")
    if len(text) <= width:
        return text
    return text[: width - len(placeholder)] + placeholder
